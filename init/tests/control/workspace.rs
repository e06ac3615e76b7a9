//! The control API with the real FUSE workspace (root and /dev/fuse; panics when they are
//! missing while CI is set, skips with a printed line otherwise): /health turns 200 once the
//! workspace is mounted, /status reports the mount, POST /checkpoint flushes it, `keel status`
//! finds the socket in the state dir, and a socket left by a killed keel does not stop the
//! next one.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;
use support::control::*;
use support::pid1::*;

fn ws_config(state: &Path) -> String {
    format!(
        "[workspace]\nmount_point = \"$D/ws\"\nstate_dir = \"{}\"\n\
         [control]\nlisten = \"127.0.0.1:0\"\n[shutdown]\ngrace = \"2s\"\n",
        state.display()
    )
}

fn control_addr(k: &Keel) -> SocketAddr {
    k.wait_log("control API on http://");
    let log = k.log_text();
    let rest = &log[log.find("control API on http://").unwrap() + 22..];
    rest.split(char::is_whitespace)
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn is_mount_point(p: &Path) -> bool {
    read(Path::new("/proc/self/mountinfo"))
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(p.to_str().unwrap()))
}

#[test]
fn health_status_checkpoint_and_keel_status_with_the_fuse_workspace() {
    if !require_root_and_fuse("control workspace test") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let mut k = start(
        &ws_config(state.path()),
        &[
            "sh",
            "-c",
            "echo hello > $D/ws/f; mkdir $D/ws/d; touch $D/ws/d/x; rmdir $D/ws/d; \
             touch $D/wrote; exec sleep 30",
        ],
    );
    let addr = control_addr(&k);
    let r = poll("GET /health 200", || {
        let r = get(addr, "/health", None);
        (r.code == 200).then_some(r)
    });
    assert_eq!(r.body, "ok\n");
    // 200 means the mount is really there.
    assert!(is_mount_point(&k.path("ws")), "{}", k.log_text());
    k.wait_file("wrote");

    let v = get(addr, "/status", None).json();
    assert_eq!(v["mount"]["state"], "mounted");
    assert_eq!(v["mount"]["mounted"], true);
    assert_eq!(v["mount"]["mount_point"], k.path("ws").to_str().unwrap());
    assert_eq!(v["mount"]["cache"], "auto");
    assert!(v["mount"]["passthrough"].is_boolean(), "{v}");
    // The count of FUSE requests served: at least the ones that wrote the file above.
    let served = v["mount"]["fuse_requests"].as_u64().unwrap_or_default();
    assert!(served > 0, "{v}");
    // Of those, the ones no caller waited for (FORGET, RELEASE, RELEASEDIR): a part of them.
    let unwaited = v["mount"]["fuse_requests_unwaited"].as_u64();
    assert!(unwaited.is_some_and(|u| u < served), "{v}");
    // Checkpoints are on ([persist] defaults to a file:// remote in the state dir).
    assert!(v["persist"]["dirty_bytes"].is_u64(), "{v}");

    // Something new for this checkpoint. The checkpoint keel takes at start may still be
    // running and pick up a write made now (metadata commits are grouped), so write again
    // once a POST has answered "nothing changed": by then that one is over.
    let mut c = serde_json::Value::Null;
    for attempt in 0..2 {
        let name = format!("for-the-checkpoint-{attempt}");
        std::fs::write(k.path("ws").join(name), b"new bytes").unwrap();
        let r = post(addr, "/checkpoint", None);
        assert_eq!(r.code, 200, "{r:?}");
        c = r.json();
        if c["done"].as_str().unwrap_or("").contains("snapshot") {
            break;
        }
    }
    assert_eq!(c["ok"], true);
    assert_eq!(c["remote"], true, "{c}");
    assert!(c["bytes_uploaded"].is_u64(), "{c}");
    assert!(c["done"].as_str().unwrap().contains("snapshot"), "{c}");

    // /metrics counts what the workload and the checkpoint did, by operation.
    let m = get(addr, "/metrics", None).body;
    let at_least = |sample: &str, min: f64| {
        let v = metric(&m, sample);
        assert!(v.is_some_and(|v| v >= min), "{sample} = {v:?} in\n{m}");
    };
    at_least("keel_fuse_requests_total{op=\"create\"}", 3.0);
    at_least("keel_fuse_requests_total{op=\"mkdir\"}", 1.0);
    // The three files' bytes went through keel or, with passthrough, past it.
    let passthrough = v["mount"]["passthrough"] == true;
    if passthrough {
        at_least("keel_fuse_passthrough_opens_total", 3.0);
    } else {
        at_least("keel_fuse_write_bytes_total", 6.0 + 9.0);
    }
    // One request in 8 per thread is timed, a thread's first one included.
    let timed: f64 = m
        .lines()
        .filter(|l| l.starts_with("keel_fuse_request_duration_seconds_count{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    assert!(timed >= 1.0, "no FUSE request timed:\n{m}");
    // The shell's `rmdir` of a non-empty directory: an error keel answered, by errno.
    at_least(
        "keel_fuse_errors_total{op=\"rmdir\",errno=\"ENOTEMPTY\"}",
        1.0,
    );
    at_least("keel_checkpoints_total{result=\"ok\"}", 1.0);
    at_least("keel_checkpoint_duration_seconds_count", 1.0);
    // At least what the POST above reported (small files travel inside the snapshot).
    let sent = c["bytes_uploaded"].as_f64().unwrap();
    at_least("keel_checkpoint_uploaded_bytes_total", sent);

    // keel status finds <state_dir>/control.sock from the config alone.
    let sock = state.path().join(keel::state::CONTROL_SOCK);
    assert!(sock.exists());
    let out = Command::new(KEEL)
        .args(["status", "--config"])
        .arg(k.path("config.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mount"]["mounted"], true);

    k.signal(Signal::SIGTERM);
    assert_eq!(k.wait().0, 143, "{}", k.log_text());
    assert!(!sock.exists(), "control socket left in the state dir");
    assert!(!is_mount_point(&k.path("ws")));
}

#[test]
fn a_stale_socket_in_a_fresh_state_dir_does_not_block_the_next_keel() {
    if !require_root_and_fuse("control workspace test") {
        return;
    }
    // A keel that died before it initialised the state dir left only its socket behind.
    let state = tempfile::tempdir().unwrap();
    support::sys::dead_socket(&state.path().join(keel::state::CONTROL_SOCK)).unwrap();
    let mut k = start(
        &ws_config(state.path()),
        &["sh", "-c", "echo hi > $D/ws/f && cat $D/ws/f"],
    );
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert_eq!(k.stdout(), "hi\n");
    assert!(!state.path().join(keel::state::CONTROL_SOCK).exists());
}

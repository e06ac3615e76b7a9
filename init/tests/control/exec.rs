//! Processes started through the control API (`POST /exec`, `/processes`) of a real `keel
//! run` (workspace disabled; as root): output byte for byte, stdin given and streamed, a
//! client that drops mid-run resuming with `from=`, a retried `request_id`, a terminal and
//! its resize, kills (DELETE and timeout) that leave nothing of the tree (a double-forked
//! `setsid` grandchild that ignores TERM included; keel as PID 1 of a PID namespace, so
//! nothing can leak), and who may call them (403 for a tokenless TCP listener and for a
//! `[control] group` member). Waits poll for outcomes with a hang guard; no outcome depends
//! on timing.

use crate::support;

use std::path::{Path, PathBuf};

use base64::Engine;
use serde_json::{json, Value};
use support::control::*;
use support::pid1::*;

fn config(extra: &str) -> String {
    format!(
        "[init]\nworkspace = false\n[workspace]\nstate_dir = \"$D/state\"\n\
         [control]\nsocket = \"$D/sock/c.sock\"\n{extra}\n[shutdown]\ngrace = \"1s\"\n"
    )
}

/// `keel run` with `extra` lines in `[control]`, the main command sleeping; waits until it
/// supervises (processes may start).
fn keel(extra: &str, pid1: bool) -> Keel {
    let k = start_with(
        &config(extra),
        &["sleep", "100000"],
        Opts {
            pid1,
            env: &[("AWS_SECRET_ACCESS_KEY", "exec-test-secret")],
            ..Default::default()
        },
    );
    k.wait_log("ready after");
    k
}

/// SIGTERM to keel (under `unshare` as PID 1: its child on the host side) and its exit code.
fn stop(k: &mut Keel) -> i32 {
    let top = k.pid();
    let keel = processes()
        .into_iter()
        .find(|p| p.1 == top && p.2 != 'Z')
        .map(|p| p.0)
        .unwrap_or(top);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(keel),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    k.wait().0
}

fn sock(k: &Keel) -> PathBuf {
    k.path("sock/c.sock")
}

fn exec(k: &Keel, req: Value) -> Resp {
    unix_send(&sock(k), "POST", "/exec", req.to_string().as_bytes())
}

/// The decoded bytes of one stream's events, and the exit event.
fn collect(evs: &[Value], stream: &str) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = Vec::new();
    for e in evs.iter().filter(|e| e["type"] == stream) {
        assert_eq!(e["offset"].as_u64(), Some(out.len() as u64), "{e}");
        out.extend(b64.decode(e["data"].as_str().unwrap()).unwrap());
    }
    out
}

fn exit_of(evs: &[Value]) -> Value {
    let last = evs.last().expect("no events").clone();
    assert_eq!(
        last["type"], "exit",
        "the stream did not end with the exit: {evs:?}"
    );
    last
}

fn run(k: &Keel, req: Value) -> (Vec<u8>, Vec<u8>, Value) {
    let r = exec(k, req);
    assert_eq!(r.code, 200, "{r:?}");
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/x-ndjson")
    );
    let evs = events(&r.body);
    assert_eq!(evs[0]["type"], "start", "{evs:?}");
    (
        collect(&evs, "stdout"),
        collect(&evs, "stderr"),
        exit_of(&evs),
    )
}

fn id_of(v: &Value) -> u64 {
    v["id"].as_u64().unwrap_or_else(|| panic!("no id in {v}"))
}

/// Follows a process's stdout from `from` to its end: the bytes and the exit event.
fn follow(k: &Keel, id: u64, from: u64) -> (Vec<u8>, Value) {
    let r = unix_send(
        &sock(k),
        "GET",
        &format!("/processes/{id}/output?stream=stdout&from={from}&follow=1"),
        b"",
    );
    assert_eq!(r.code, 200, "{r:?}");
    let evs = events(&r.body);
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = Vec::new();
    for e in evs.iter().filter(|e| e["type"] == "stdout") {
        assert_eq!(e["offset"].as_u64(), Some(from + out.len() as u64), "{e}");
        out.extend(b64.decode(e["data"].as_str().unwrap()).unwrap());
    }
    (out, exit_of(&evs))
}

#[test]
fn output_is_byte_exact_and_exits_are_reported_as_keel_run_does() {
    if !require_root("exec test") {
        return;
    }
    let mut k = keel("", false);
    // Every byte value, 300 kB through stdin and back out of `cat`, plus stderr.
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 256) as u8).collect();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
    let (out, err, x) = run(
        &k,
        json!({"argv": ["sh", "-c", "cat; echo oops >&2; exit 3"], "stdin": {"base64": b64}}),
    );
    assert!(out == data, "stdout differs ({} bytes back)", out.len());
    assert_eq!(err, b"oops\n");
    assert_eq!(
        (x["code"].clone(), x["status"].clone()),
        (json!(3), json!(3)),
        "{x}"
    );
    assert_eq!(x["timed_out"], false);
    assert!(
        x["duration_ms"].is_u64() && x["cpu_ms"].is_u64() && x["peak_rss_kib"].as_u64() > Some(0),
        "{x}"
    );
    // A shell line, the user asked for, the environment added and keel's secrets scrubbed.
    let (out, _, x) = run(
        &k,
        json!({"shell": "id -u; echo \"$FOO\"; env | grep -c AWS_ || true", "user": "nobody",
               "env": {"FOO": "bar"}}),
    );
    assert_eq!(String::from_utf8_lossy(&out), "65534\nbar\n0\n", "{x}");
    // Missing and not executable: 127 and 126, with the reason.
    let (_, _, x) = run(&k, json!({"argv": ["/nonexistent/keel-cmd"]}));
    assert_eq!(x["status"], 127, "{x}");
    assert!(x["error"].as_str().unwrap().contains("No such file"), "{x}");
    let (_, _, x) = run(&k, json!({"argv": ["/etc/passwd"]}));
    assert_eq!(x["status"], 126, "{x}");
    // A signal.
    let (_, _, x) = run(&k, json!({"shell": "kill -9 $$"}));
    assert_eq!(
        (x["signal"].clone(), x["status"].clone()),
        (json!("SIGKILL"), json!(137))
    );
    // Bad requests are one line naming the field.
    let r = exec(
        &k,
        json!({"argv": ["true"], "cwd": "/nonexistent/keel-dir"}),
    );
    assert_eq!(r.code, 400);
    assert!(
        r.json()["error"]
            .as_str()
            .unwrap()
            .contains("`cwd` /nonexistent/keel-dir"),
        "{r:?}"
    );
    let r = exec(&k, json!({"argv": ["true"], "user": "no-such-user-keel"}));
    assert_eq!(r.code, 400, "{r:?}");
    // The list and the record keep what happened.
    let l = unix_get(&sock(&k), "/processes").json();
    assert!(l["processes"].as_array().unwrap().len() >= 5, "{l}");
    let one = unix_get(&sock(&k), "/processes/1").json();
    assert_eq!(one["state"], "done");
    assert_eq!(one["exit"]["code"], 3);
    assert_eq!(unix_get(&sock(&k), "/processes/999").code, 404);
    // keel's own command line works the same way.
    let out = std::process::Command::new(KEEL)
        .args(["exec", "--socket"])
        .arg(sock(&k))
        .args(["--", "sh", "-c", "printf 'a\\0b'; exit 4"])
        .output()
        .unwrap();
    assert_eq!(
        (out.status.code(), out.stdout.as_slice()),
        (Some(4), &b"a\0b"[..])
    );
    stop(&mut k);
}

/// The working directory is entered as the process's user, after the switch: a directory
/// that user may not search is refused (one line naming the step and the directory), even
/// though keel, root, could enter it; one the user may enter is its cwd.
#[test]
fn the_working_directory_is_entered_as_the_processs_user() {
    if !require_root("exec cwd test") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mut k = keel("", false);
    let private = k.path("root-only");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let dir = private.to_str().unwrap();
    let (out, _, x) = run(&k, json!({"argv": ["pwd"], "user": "nobody", "cwd": dir}));
    assert!(
        out.is_empty(),
        "nobody ran in {dir}: {}",
        String::from_utf8_lossy(&out)
    );
    let e = x["error"].as_str().unwrap_or_default();
    assert!(
        e.contains("enter its working directory as its user") && e.contains(dir),
        "{x}"
    );
    assert_ne!(x["status"], 0, "{x}");
    // root may; and nobody may enter a directory open to it.
    let (out, _, x) = run(&k, json!({"argv": ["pwd"], "cwd": dir}));
    assert_eq!(String::from_utf8_lossy(&out), format!("{dir}\n"), "{x}");
    let (out, _, x) = run(
        &k,
        json!({"argv": ["sh", "-c", "pwd; id -u"], "user": "nobody", "cwd": "/tmp"}),
    );
    assert_eq!(String::from_utf8_lossy(&out), "/tmp\n65534\n", "{x}");
    stop(&mut k);
}

#[test]
fn stdin_is_streamed_and_closed() {
    if !require_root("exec test") {
        return;
    }
    let mut k = keel("", false);
    let r = exec(
        &k,
        json!({"shell": "cat; echo END", "stdin": "stream", "detach": true}),
    );
    assert_eq!(r.code, 200, "{r:?}");
    let id = id_of(&r.json());
    let s = sock(&k);
    let r = unix_send(&s, "POST", &format!("/processes/{id}/stdin"), b"abc\x00");
    assert_eq!(
        (r.code, r.json()["bytes"].clone()),
        (200, json!(4)),
        "{r:?}"
    );
    let r = unix_send(
        &s,
        "POST",
        &format!("/processes/{id}/stdin?close=1"),
        b"def",
    );
    assert_eq!(r.json()["closed"], true, "{r:?}");
    let (out, x) = follow(&k, id, 0);
    assert_eq!(out, b"abc\x00defEND\n");
    assert_eq!(x["code"], 0);
    // Closed: no more input.
    let r = unix_send(&s, "POST", &format!("/processes/{id}/stdin"), b"x");
    assert_eq!(r.code, 409, "{r:?}");
    stop(&mut k);
}

/// Reads a streamed answer until `until` holds for the bytes so far, then drops the
/// connection (a client that goes away mid-run).
fn read_then_drop(socket: &Path, body: &Value, until: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let b = body.to_string();
    write!(
        s,
        "POST /exec HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !until(&got) {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    got
}

#[test]
fn a_client_that_drops_loses_neither_output_nor_exit_and_a_retry_starts_nothing_new() {
    if !require_root("exec test") {
        return;
    }
    let mut k = keel("", false);
    let d = k.scratch().to_path_buf();
    let script = format!(
        "echo run >> {d}/count; echo first; while [ ! -e {d}/go ]; do sleep 0.05; done; echo second",
        d = d.display()
    );
    let req = json!({"shell": script, "request_id": "job-1"});
    // The first event with "first" in it (base64 of "first\n" is "Zmlyc3QK").
    let got = read_then_drop(&sock(&k), &req, |b| {
        String::from_utf8_lossy(b).contains("Zmlyc3QK")
    });
    let text = String::from_utf8_lossy(&got);
    let id: u64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("Keel-Process-Id: ")
                .or(l.strip_prefix("keel-process-id: "))
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no process id header in {text}"));
    // The client is gone; the process goes on. A retry with the same request id attaches.
    let r = exec(
        &k,
        json!({"shell": "echo never", "request_id": "job-1", "detach": true}),
    );
    let v = r.json();
    assert_eq!((id_of(&v), v["attached"].clone()), (id, json!(true)), "{v}");
    std::fs::write(d.join("go"), "").unwrap();
    // Resumed where the client stopped: after "first\n" (6 bytes).
    let (rest, x) = follow(&k, id, 6);
    assert_eq!(rest, b"second\n");
    assert_eq!(x["code"], 0, "{x}");
    // After the exit a retry still attaches, and replays everything.
    let (out, _, x2) = run(&k, json!({"shell": "echo never", "request_id": "job-1"}));
    assert_eq!(out, b"first\nsecond\n");
    assert_eq!(x2["id"], id);
    assert_eq!(
        std::fs::read_to_string(d.join("count")).unwrap(),
        "run\n",
        "ran twice"
    );
    stop(&mut k);
}

#[test]
fn a_terminal_is_a_terminal_and_sees_its_resize() {
    if !require_root("exec test") {
        return;
    }
    let mut k = keel("", false);
    let script = "test -t 0 && test -t 1 && echo tty; stty size; \
                  trap 'stty size; exit 0' WINCH; echo ready; while :; do sleep 0.05; done";
    let r = exec(
        &k,
        json!({"shell": script, "pty": {"rows": 33, "cols": 101}, "detach": true}),
    );
    let id = id_of(&r.json());
    let s = sock(&k);
    poll("the terminal's first lines", || {
        let r = unix_send(
            &s,
            "GET",
            &format!("/processes/{id}/output?format=raw"),
            b"",
        );
        r.body.contains("ready").then_some(())
    });
    let r = unix_send(
        &s,
        "POST",
        &format!("/processes/{id}/resize?rows=40&cols=120"),
        b"",
    );
    assert_eq!(r.code, 200, "{r:?}");
    let (out, x) = follow(&k, id, 0);
    let out = String::from_utf8_lossy(&out).replace('\r', "");
    assert!(out.starts_with("tty\n33 101\nready\n40 120\n"), "{out:?}");
    assert_eq!(x["code"], 0);
    // Resizing a process without a terminal is refused.
    let (_, _, x) = run(&k, json!({"argv": ["true"]}));
    let r = unix_send(
        &s,
        "POST",
        &format!("/processes/{}/resize?rows=1&cols=1", id_of(&x)),
        b"",
    );
    assert_eq!(r.code, 409);
    stop(&mut k);
}

/// Live processes (not zombies) whose command line is `sleep MARKER`, from the host's /proc.
fn marked(marker: &str) -> Vec<i32> {
    let want = format!("sleep\0{marker}\0");
    processes()
        .into_iter()
        .filter(|(_, _, state)| *state != 'Z')
        .filter(|(pid, _, _)| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want.as_bytes())
        })
        .map(|(pid, _, _)| pid)
        .collect()
}

/// A tree whose leader and grandchild ignore TERM; the grandchild left the session and its
/// parent exited (re-parented to keel), so only the cgroup still holds it.
fn tree_script(d: &Path, marker: &str) -> String {
    let d = d.display();
    format!(
        "sh -c 'setsid sh -c \"trap \\\"\\\" TERM; touch {d}/{marker}.up; exec sleep {marker}\" &'; \
         trap '' TERM; while [ ! -e {d}/{marker}.up ]; do sleep 0.05; done; echo started; \
         while :; do sleep 1; done"
    )
}

fn require_cgroups(k: &Keel) -> bool {
    if !k.log_text().contains("no cgroup for processes") {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "cgroup v2 cannot be written here and CI is set: a double-forked process would escape"
    );
    eprintln!("skipping: no writable cgroup v2 (a double-forked process would escape)");
    false
}

#[test]
fn delete_and_timeout_leave_no_descendant_not_even_a_double_forked_one() {
    if !require_root("exec kill test") {
        return;
    }
    let mut k = keel("", true);
    if !require_cgroups(&k) {
        return;
    }
    let d = k.scratch().to_path_buf();
    // DELETE.
    let r = exec(
        &k,
        json!({"shell": tree_script(&d, "987601"), "detach": true}),
    );
    let id = id_of(&r.json());
    poll("the grandchild", || {
        d.join("987601.up").exists().then_some(())
    });
    assert_eq!(marked("987601").len(), 1, "the grandchild is not running");
    let r = unix_send(&sock(&k), "DELETE", &format!("/processes/{id}"), b"");
    assert_eq!(r.code, 200, "{r:?}");
    let v = r.json();
    assert_eq!(
        (v["state"].clone(), v["exit"]["killed"].clone()),
        (json!("done"), json!(true)),
        "{v}"
    );
    // Ignoring TERM, it took the KILL after the grace.
    assert_eq!(v["exit"]["signal"], "SIGKILL", "{v}");
    assert_eq!(
        marked("987601"),
        Vec::<i32>::new(),
        "a descendant survived DELETE"
    );
    // A second DELETE forgets the record.
    assert_eq!(
        unix_send(&sock(&k), "DELETE", &format!("/processes/{id}"), b"").code,
        200
    );
    assert_eq!(unix_get(&sock(&k), &format!("/processes/{id}")).code, 404);
    // The timeout, kept by keel: the stream ends with the exit, timed out.
    let (_, _, x) = run(
        &k,
        json!({"shell": tree_script(&d, "987602"), "timeout": "1s"}),
    );
    assert_eq!(
        (x["timed_out"].clone(), x["signal"].clone()),
        (json!(true), json!("SIGKILL")),
        "{x}"
    );
    assert_eq!(
        marked("987602"),
        Vec::<i32>::new(),
        "a descendant survived the timeout"
    );
    stop(&mut k);
}

/// keel's stop ends processes started through the API like the main command: the stream
/// gets their exit before keel exits.
#[test]
fn keels_stop_stops_them_too() {
    if !require_root("exec stop test") {
        return;
    }
    let mut k = keel("", true);
    let s = sock(&k);
    let r = exec(&k, json!({"argv": ["sleep", "987603"], "detach": true}));
    let id = id_of(&r.json());
    let follower = std::thread::spawn(move || {
        let r = unix_send(&s, "GET", &format!("/processes/{id}/output?follow=1"), b"");
        exit_of(&events(&r.body))
    });
    poll("the process", || {
        (!marked("987603").is_empty()).then_some(())
    });
    let code = stop(&mut k);
    assert_eq!(code, 143, "{}", k.log_text());
    let x = follower.join().unwrap();
    assert_eq!(
        (x["killed"].clone(), x["signal"].clone()),
        (json!(true), json!("SIGTERM")),
        "{x}"
    );
}

#[test]
fn only_the_token_root_and_keels_user_may_start_processes() {
    if !require_root("exec rights test") {
        return;
    }
    // A TCP listener without a token observes only; a member of [control] group too.
    let mut k = keel("listen = \"127.0.0.1:0\"\ngroup = \"nogroup\"", false);
    k.wait_log("control API on http://");
    let log = k.log_text();
    let rest = &log[log.find("control API on http://").unwrap() + 22..];
    let addr: std::net::SocketAddr = rest
        .split(char::is_whitespace)
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let body = json!({"argv": ["touch", k.path("pwned").to_str().unwrap()]}).to_string();
    let r = raw(
        addr,
        format!(
            "POST /exec HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    assert_eq!(r.code, 403, "{r:?}");
    for path in ["/processes", "/processes/1", "/processes/1/output"] {
        assert_eq!(get(addr, path, None).code, 403, "{path}");
    }
    assert_eq!(get(addr, "/status", None).code, 200);
    // The group member (nobody, primary group nogroup) on the socket.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(k.scratch(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = |args: &[&str]| support::control::status_as_nobody(&sock(&k), args);
    assert_eq!(
        as_nobody(&["http://k/status"]),
        "200",
        "the group member cannot observe"
    );
    assert_eq!(
        as_nobody(&["-X", "POST", "-d", &body, "http://k/exec"]),
        "403"
    );
    assert_eq!(as_nobody(&["http://k/processes"]), "403");
    // keel exec as the group member says so.
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            KEEL,
            "exec",
            "--socket",
        ])
        .arg(sock(&k))
        .args(["--", "touch", k.path("pwned").to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("403"),
        "{out:?}"
    );
    assert!(
        !k.path("pwned").exists(),
        "a refused caller started a process"
    );
    stop(&mut k);
}

/// `keel exec` from outside the sandbox: over TCP with `--url` and the token; without the
/// token it gets 401 and runs nothing.
#[test]
fn keel_exec_from_outside_with_a_url_and_the_token() {
    if !require_root("exec client test") {
        return;
    }
    let mut k = keel(
        "listen = \"127.0.0.1:0\"\ntoken = \"exec-test-token-1234\"",
        false,
    );
    k.wait_log("control API on http://");
    let log = k.log_text();
    let rest = &log[log.find("control API on http://").unwrap() + 22..];
    let url = format!("http://{}", rest.split(char::is_whitespace).next().unwrap());
    let marker = k.path("ran");
    let cmd = |token: &str| {
        std::process::Command::new(KEEL)
            .args(["exec", "--url", &url, "--timeout", "30s", "--"])
            .args([
                "sh",
                "-c",
                &format!("echo out; echo err >&2; touch {}; exit 9", marker.display()),
            ])
            .env("KEEL_CONTROL_TOKEN", token)
            .output()
            .unwrap()
    };
    let out = cmd("wrong-token");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("401"),
        "{out:?}"
    );
    assert!(!marker.exists(), "a wrong token ran the command");
    let out = cmd("exec-test-token-1234");
    assert_eq!(
        (
            out.status.code(),
            out.stdout.as_slice(),
            out.stderr.as_slice()
        ),
        (Some(9), &b"out\n"[..], &b"err\n"[..])
    );
    assert!(marker.exists());
    stop(&mut k);
}

#[test]
fn a_caller_that_waited_for_ready_is_never_told_keel_is_starting() {
    if !require_root("exec readiness test") {
        return;
    }
    // `keel` waits for "ready after" in keel's log; a process starts at once.
    let mut k = keel("", false);
    let r = exec(&k, json!({"argv": ["true"]}));
    assert_eq!(r.code, 200, "right after ready: {r:?}");
    assert_eq!(exit_of(&events(&r.body))["code"], 0);
    // The order that makes it so: the table opens before keel says it is ready.
    let log = k.log_text();
    let line = |f: &dyn Fn(&str) -> bool| log.lines().position(f);
    let open = line(&|l| l.contains("processes may start through the API"))
        .unwrap_or_else(|| panic!("the exec table never opened:\n{log}"));
    let ready = line(&|l| {
        l.contains("ready after") && (l.contains("(subreaper)") || l.contains("(PID 1)"))
    })
    .unwrap_or_else(|| panic!("keel never said it was ready:\n{log}"));
    assert!(
        open < ready,
        "keel said ready before processes could start:\n{log}"
    );
    stop(&mut k);
}

#[test]
fn max_processes_counts_the_running_ones_and_done_records_go_after_the_retention() {
    if !require_root("exec limits test") {
        return;
    }
    let mut k = keel("[exec]\nmax_processes = 2\nretention = \"1s\"", false);
    let detach = |argv: &[&str]| exec(&k, json!({"argv": argv, "detach": true}));
    let a = detach(&["sleep", "100000"]);
    let b = detach(&["sleep", "100000"]);
    assert_eq!((a.code, b.code), (200, 200), "{a:?} {b:?}");
    let c = detach(&["true"]);
    assert_eq!(c.code, 429, "a third process while two run: {c:?}");
    assert!(c.body.contains("max_processes"), "{c:?}");
    // A kill frees a place by the time it answers; a process that ended holds none by the
    // time its exit event is out (one runs right after the other, each in the one free place).
    let (a, b) = (id_of(&a.json()), id_of(&b.json()));
    let r = unix_request(&sock(&k), "DELETE", &format!("/processes/{a}"));
    assert_eq!(r.code, 200, "{r:?}");
    for _ in 0..30 {
        let (_, _, x) = run(&k, json!({"argv": ["true"]}));
        assert_eq!(x["code"], 0, "{x}");
    }
    // Full again: one more runs, the next is refused.
    let d = detach(&["sleep", "100000"]);
    assert_eq!(d.code, 200, "{d:?}");
    assert_eq!(detach(&["true"]).code, 429);
    let d = id_of(&d.json());
    let r = unix_request(&sock(&k), "DELETE", &format!("/processes/{d}"));
    assert_eq!(r.code, 200, "{r:?}");
    // Done records go once the retention has passed (every later call prunes); the running
    // one stays.
    poll("the done records to be forgotten", || {
        let l = unix_get(&sock(&k), "/processes").json();
        let ids: Vec<u64> = l["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(id_of)
            .collect();
        (ids == vec![b]).then_some(())
    });
    assert_eq!(
        unix_get(&sock(&k), &format!("/processes/{a}")).code,
        404,
        "the killed record after its retention"
    );
    stop(&mut k);
}

/// Detaches the tmpfs put over keel's output files when the test ends, however it ends.
struct Detach(PathBuf);
impl Drop for Detach {
    fn drop(&mut self) {
        let _ = support::sys::umount_detach(&self.0);
    }
}

#[test]
fn output_that_cannot_be_kept_is_an_output_error_and_the_process_still_ends() {
    if !require_root("exec output error test") {
        return;
    }
    let mut k = keel("", false);
    // keel's output files go to a 64 KiB filesystem: the first MiB of a 4 MiB output fills
    // it (ENOSPC).
    let dir = k.path("state/exec");
    std::fs::create_dir_all(&dir).unwrap();
    support::sys::mount_tmpfs(&dir, "size=64k,mode=700").expect("mount a 64 KiB tmpfs");
    let _detach = Detach(dir);
    let (out, err, exit) = run(
        &k,
        json!({"shell": "head -c 4194304 /dev/zero; echo done >&2"}),
    );
    // The process was never blocked on its pipe (the rest was drained) and exited 0; the
    // exit event says the output was not all kept, and why.
    assert_eq!(exit["code"], 0, "{exit}");
    let why = exit["output_error"]
        .as_str()
        .unwrap_or_else(|| panic!("no output_error: {exit}"));
    assert!(
        why.starts_with("stdout: ") && why.contains("No space left"),
        "{why}"
    );
    assert!(out.len() < 4 << 20, "{} bytes kept", out.len());
    assert_eq!(
        exit["stdout_bytes"].as_u64(),
        Some(out.len() as u64),
        "{exit}"
    );
    assert!(err.is_empty(), "{err:?}");
    let id = exit["id"].as_u64().unwrap();
    let rec = unix_get(&sock(&k), &format!("/processes/{id}")).json();
    assert_eq!(rec["output_error"], exit["output_error"], "{rec}");
    assert_eq!(rec["exit"]["output_error"], exit["output_error"], "{rec}");
    // One warning per stream (stderr's file could not be made either), not one per chunk.
    let log = k.log_text();
    assert_eq!(
        log.matches("stdout: keeping its output failed").count(),
        1,
        "{log}"
    );
    assert_eq!(
        log.matches("stderr: keeping its output failed").count(),
        1,
        "{log}"
    );
    stop(&mut k);
}

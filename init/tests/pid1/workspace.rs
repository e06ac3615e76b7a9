//! keel run with the real FUSE workspace (root and /dev/fuse; CI fails loudly without them):
//! what the main command writes survives keel's exit and a fresh mount, the stop flushes and
//! unmounts, and sandboxed processes cannot unmount the workspace.

use crate::support;

use nix::sys::signal::Signal;
use std::path::Path;
use support::pid1::*;

/// A config mounting the workspace at $D/ws with state in `state` (kept across runs).
fn ws_config(state: &Path) -> String {
    format!(
        "[workspace]\nmount_point = \"$D/ws\"\nstate_dir = \"{}\"\n[shutdown]\ngrace = \"2s\"\n",
        state.display()
    )
}

fn mounted(mp: &Path) -> bool {
    read(Path::new("/proc/self/mountinfo"))
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(mp.to_str().unwrap()))
}

#[test]
fn written_data_survives_exit_and_remount_and_nothing_stays_mounted() {
    if !require_root_and_fuse("workspace test") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let script = "echo hello > $D/ws/file && mkdir $D/ws/dir && echo ok; \
                  umount $D/ws 2>/dev/null && echo UNMOUNTED; true";
    let mut k = start(&ws_config(state.path()), &["sh", "-c", script]);
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    // Root in the sandbox lacks CAP_SYS_ADMIN: the unmount attempt failed.
    assert_eq!(k.stdout(), "ok\n", "{}", k.log_text());
    assert!(!mounted(&k.path("ws")), "keel left the workspace mounted");
    assert!(
        k.log_text().contains("workspace flush + unmount took"),
        "{}",
        k.log_text()
    );

    let mut k = start(
        &ws_config(state.path()),
        &["sh", "-c", "cat $D/ws/file; test -d $D/ws/dir"],
    );
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert_eq!(k.stdout(), "hello\n");
}

#[test]
fn sigterm_flushes_a_file_still_open_for_writing() {
    if !require_root_and_fuse("workspace test") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let script = "exec 3> $D/ws/open; echo part1 >&3; touch $D/ready; exec sleep 30";
    let mut k = start(&ws_config(state.path()), &["sh", "-c", script]);
    k.wait_file("ready");
    k.signal(Signal::SIGTERM);
    assert_eq!(k.wait().0, 143, "{}", k.log_text());
    assert!(!mounted(&k.path("ws")));

    let mut k = start(&ws_config(state.path()), &["cat", "$D/ws/open"]);
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert_eq!(k.stdout(), "part1\n");
}

#[test]
fn a_second_keel_on_the_same_state_dir_is_refused_before_starting_anything() {
    if !require_root_and_fuse("workspace test") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let mut first = start(
        &ws_config(state.path()),
        &["sh", "-c", "touch $D/ready; exec sleep 30"],
    );
    first.wait_file("ready");
    let mut second = start(&ws_config(state.path()), &["touch", "$D/started"]);
    assert_eq!(second.wait().0, 1, "{}", second.log_text());
    assert!(
        second.log_text().contains("already in use"),
        "{}",
        second.log_text()
    );
    assert!(!second.path("started").exists());
    first.signal(Signal::SIGTERM);
    assert_eq!(first.wait().0, 143);
}

//! keel as a real PID 1, inside `unshare --pid --fork --mount-proc --uts` (root only): orphans
//! of the whole namespace are reaped, leftovers are killed with kill(-1) at the grace
//! deadline, and the hostname is set in keel's own UTS namespace.

use crate::support;

use nix::sys::signal::Signal;
use std::time::{Duration, Instant};
use support::pid1::*;

fn pid1(init: &str, rest: &str, argv: &[&str]) -> Option<Keel> {
    if !require_root("PID-1 namespace test") {
        return None;
    }
    Some(start_with(
        &config(init, rest),
        argv,
        Opts {
            pid1: true,
            ..Default::default()
        },
    ))
}

#[test]
fn reaps_a_hundred_orphans_as_pid_1() {
    // Inside the namespace the main shell checks /proc itself: no zombie and no orphan left.
    let script = r#"
        echo $PPID > $D/ppid
        for i in $(seq 100); do (sleep 0.3 &); done
        n=0
        while :; do
            z=0; s=0
            for f in /proc/[0-9]*/stat; do
                read -r l < $f 2>/dev/null || continue
                case "$l" in *") Z "*) z=$((z+1));; esac
                case "$l" in *"(sleep)"*) s=$((s+1));; esac
            done
            [ $z -eq 0 ] && [ $s -eq 0 ] && exit 42
            n=$((n+1)); [ $n -gt 6000 ] && { echo "zombies $z sleeps $s"; exit 99; }  # a hang guard
            sleep 0.02
        done"#;
    let Some(mut k) = pid1("hostname = \"keel-pid1-test\"", "", &["sh", "-c", script]) else {
        return;
    };
    let (code, _) = k.wait();
    assert_eq!(code, 42, "stdout: {} log:\n{}", k.stdout(), k.log_text());
    assert_eq!(
        read(&k.path("ppid")).trim(),
        "1",
        "keel is PID 1 in the namespace"
    );
    assert!(k.log_text().contains("(PID 1)"), "{}", k.log_text());
}

#[test]
fn hostname_is_set_as_pid_1() {
    let Some(mut k) = pid1(
        "hostname = \"keel-pid1-test\"",
        "",
        &["cat", "/proc/sys/kernel/hostname"],
    ) else {
        return;
    };
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert_eq!(k.stdout().trim(), "keel-pid1-test");
}

#[test]
fn stop_as_pid_1_kills_leftovers_in_other_sessions_at_the_grace_deadline() {
    let script =
        "setsid sh -c 'trap \"\" TERM; touch $D/ready; while :; do sleep 0.05; done' & wait";
    let Some(mut k) = pid1("", "[shutdown]\ngrace = \"1s\"", &["sh", "-c", script]) else {
        return;
    };
    k.wait_file("ready");
    // keel is the child of `unshare` on the host side.
    let unshare = k.pid();
    let keel = poll("keel under unshare", || {
        processes()
            .into_iter()
            .find(|p| p.1 == unshare)
            .map(|p| p.0)
    });
    let t = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(keel), Signal::SIGTERM).unwrap();
    let (code, _) = k.wait();
    let took = t.elapsed();
    assert_eq!(code, 143, "{}", k.log_text());
    // Not before the grace (how much later is the machine's business, not keel's: the log
    // says keel itself sent the SIGKILL when the grace ended).
    assert!(took >= Duration::from_millis(950), "{took:?}");
    assert!(k.log_text().contains("SIGKILL"), "{}", k.log_text());
}

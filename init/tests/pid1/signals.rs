//! Signal forwarding and reaping with keel as a subreaper: every catchable signal reaches the
//! main service, group vs process forwarding of a pipeline, orphans reaped with no zombie
//! left, and leftover processes stopped before keel exits.

use crate::support;

use nix::sys::signal::Signal;
use std::time::Duration;
use support::pid1::*;

#[test]
fn every_catchable_signal_reaches_the_child() {
    // 1..=31 minus KILL and STOP (uncatchable) and CHLD (keel's own). SIGINT is forwarded like
    // the rest because only SIGTERM is a stop signal here; SIGTERM goes last.
    let sigs: Vec<i32> = (1..=31)
        .filter(|s| ![9, 19, 17, 15].contains(s))
        .chain([15])
        .collect();
    let traps: String = sigs
        .iter()
        .map(|s| format!("trap 'echo {s} >> $D/got' {s}; "))
        .collect();
    let script = format!("{traps} touch $D/ready; while :; do sleep 0.01; done");
    let cfg = config(
        "forward_to = \"process\"",
        "[shutdown]\non = [\"SIGTERM\"]\ngrace = \"300ms\"",
    );
    let mut k = start(&cfg, &["bash", "-c", &script]);
    k.wait_file("ready");
    for (n, &s) in sigs.iter().enumerate() {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(k.pid()),
            Signal::try_from(s).unwrap(),
        )
        .unwrap();
        let got = k.path("got");
        poll(
            &format!("signal {s} at the child; log:\n{}", k.log_text()),
            || (read(&got).lines().count() > n).then_some(()),
        );
        assert_eq!(read(&got).lines().nth(n), Some(s.to_string().as_str()));
    }
    // The child traps SIGTERM too, so the stop ends with SIGKILL at the grace deadline.
    let (code, _) = k.wait();
    assert_eq!(code, 137, "{}", k.log_text());
}

fn pipeline(forward_to: &str) -> (i32, String) {
    // Two pipeline members trap USR1 and record it; sh itself dies of it. The members ignore
    // SIGTERM so keel's stop (which starts when sh dies) cannot cut a trap short; they end by
    // their trap or by SIGKILL at the grace deadline.
    let member = |n: &str| {
        format!("(trap '' TERM; trap 'echo {n} >> $D/got; exit 0' USR1; touch $D/r{n}; sleep 30 & wait)")
    };
    let script = format!("{} | {}", member("a"), member("b"));
    let cfg = config(
        &format!("forward_to = \"{forward_to}\""),
        "[shutdown]\ngrace = \"1s\"",
    );
    let mut k = start(&cfg, &["sh", "-c", &script]);
    k.wait_file("ra");
    k.wait_file("rb");
    k.signal(Signal::SIGUSR1);
    let (code, _) = k.wait();
    let mut got: Vec<String> = read(&k.path("got")).lines().map(String::from).collect();
    got.sort();
    (code, got.join(","))
}

#[test]
fn group_forwarding_reaches_every_pipeline_member() {
    let (code, got) = pipeline("group");
    assert_eq!(code, 128 + 10);
    assert_eq!(got, "a,b");
}

#[test]
fn process_forwarding_reaches_only_the_main_process() {
    let (code, got) = pipeline("process");
    assert_eq!(code, 128 + 10);
    // The members never saw USR1 (they were killed at the grace deadline).
    assert_eq!(got, "");
}

#[test]
fn hundred_orphans_are_reaped_as_subreaper() {
    // Each `( sleep & )` leaves an orphan that keel inherits as subreaper.
    let script = "for i in $(seq 100); do (sleep 0.3 &); done; touch $D/spawned; \
                  while [ ! -e $D/done ]; do sleep 0.02; done";
    let mut k = start(&config("", ""), &["sh", "-c", script]);
    k.wait_file("spawned");
    let keel = k.pid();
    // Everything below keel except the main shell and its sleep ends; keel must reap it all.
    poll("orphans to be reaped", || {
        let kids: Vec<_> = processes().into_iter().filter(|p| p.1 == keel).collect();
        (kids.len() == 1).then_some(())
    });
    let zombies = processes()
        .into_iter()
        .filter(|p| p.1 == keel && p.2 == 'Z')
        .count();
    assert_eq!(zombies, 0);
    std::fs::write(k.path("done"), "").unwrap();
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert!(
        k.log_text().contains("reaped pid"),
        "orphans were reaped by keel: {}",
        k.log_text()
    );
}

#[test]
fn keel_never_exits_while_descendants_run() {
    // An orphan in its own session (outside every service group) that ignores SIGTERM, and one
    // in the main group: keel must stop both before it exits with main's status.
    let script = "setsid sh -c 'trap \"\" TERM; echo $$ > $D/a; while :; do sleep 0.05; done' & \
                  (sleep 30 & echo $! > $D/b); \
                  while [ ! -s $D/a ] || [ ! -s $D/b ]; do sleep 0.01; done; exit 7";
    let mut k = start(
        &config("", "[shutdown]\ngrace = \"700ms\""),
        &["sh", "-c", script],
    );
    let (code, took) = k.wait();
    assert_eq!(code, 7, "{}", k.log_text());
    for f in ["a", "b"] {
        let pid: i32 = read(&k.path(f)).trim().parse().unwrap();
        assert!(!alive(pid), "{f} ({pid}) outlived keel");
    }
    assert!(
        took >= Duration::from_millis(650),
        "the TERM-ignoring orphan needs the grace: {took:?}"
    );
    let log = k.log_text();
    assert!(log.contains("leftover") && log.contains("SIGKILL"), "{log}");
}

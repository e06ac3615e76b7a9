//! The ordered stop and services: waiting exactly as long as a service needs, SIGKILL at the
//! grace deadline, a second stop signal escalating, reverse dependency order, readiness
//! probes gating dependents, and restart policies with backoff.
//!
//! No outcome here depends on how fast the machine is: times are checked from below (keel
//! did not act before it should), and "keel did not wait longer" is shown by a grace of an
//! hour that the test would hang on (the harness gives up long before), by the order of
//! keel's log lines, or by the delays keel announces.

use crate::support;

use nix::sys::signal::Signal;
use std::time::{Duration, Instant};
use support::pid1::*;

/// Sends SIGTERM once the main command runs; returns (exit code, time from the signal).
fn term_and_wait(k: &mut Keel) -> (i32, Duration) {
    k.wait_file("ready");
    let t = Instant::now();
    k.signal(Signal::SIGTERM);
    let (code, _) = k.wait();
    (code, t.elapsed())
}

#[test]
fn stop_waits_only_as_long_as_the_service_needs() {
    let script = "trap 'sleep 1; exit 0' TERM; touch $D/ready; while :; do sleep 0.05; done";
    // Waiting for the grace would outlast the harness's patience.
    let mut k = start(
        &config("", "[shutdown]\ngrace = \"1h\""),
        &["sh", "-c", script],
    );
    let (code, took) = term_and_wait(&mut k);
    assert_eq!(code, 0, "{}", k.log_text());
    assert!(took >= Duration::from_millis(950), "{took:?}");
    assert!(!k.log_text().contains("SIGKILL"), "{}", k.log_text());
}

#[test]
fn service_ignoring_sigterm_is_killed_at_the_grace_deadline() {
    let script = "trap '' TERM; touch $D/ready; while :; do sleep 0.05; done";
    let mut k = start(
        &config("", "[shutdown]\ngrace = \"1s\""),
        &["sh", "-c", script],
    );
    let (code, took) = term_and_wait(&mut k);
    assert_eq!(code, 137, "{}", k.log_text());
    assert!(took >= Duration::from_millis(950), "{took:?}");
    assert!(
        k.log_text().contains("grace 1.000s expired"),
        "{}",
        k.log_text()
    );
}

#[test]
fn second_stop_signal_escalates_at_once() {
    let script = "trap '' TERM INT; touch $D/ready; while :; do sleep 0.05; done";
    let mut k = start(
        &config("", "[shutdown]\ngrace = \"1h\""),
        &["sh", "-c", script],
    );
    k.wait_file("ready");
    k.signal(Signal::SIGTERM);
    k.wait_log("stop: forwarded SIGTERM");
    k.signal(Signal::SIGINT);
    let (code, _) = k.wait();
    assert_eq!(code, 137, "{}", k.log_text());
    assert!(
        k.log_text().contains("second stop signal"),
        "{}",
        k.log_text()
    );
}

/// A service that records its start and, on SIGTERM, its stop in $D/log.
fn service(name: &str, extra: &str) -> String {
    format!(
        "[[service]]\nname = \"{name}\"\n\
         command = \"trap 'echo stop {name} >> $D/log; exit 0' TERM; echo start {name} >> $D/log; touch $D/up-{name}; while :; do sleep 0.02; done\"\n{extra}\n"
    )
}

#[test]
fn services_start_in_dependency_order_after_readiness_and_stop_in_reverse() {
    let rest = format!(
        "[shutdown]\ngrace = \"5s\"\n{}{}{}",
        // web depends on db; db is ready only when its file exists (after a delay).
        service(
            "web",
            "depends_on = [\"db\"]\nready = { command = [\"test\", \"-e\", \"$D/up-web\"] }"
        ),
        service("db", "ready = { file = \"$D/up-db\" }"),
        service("cache", "")
    );
    let main =
        "test -e $D/up-web && test -e $D/up-db && test -e $D/up-cache && echo start main >> $D/log";
    let mut k = start(&config("", &rest), &["sh", "-c", main]);
    let (code, _) = k.wait();
    assert_eq!(
        code,
        0,
        "main ran before its services were ready: {}",
        k.log_text()
    );
    let log = read(&k.path("log"));
    let lines: Vec<&str> = log.lines().collect();
    let pos = |l: &str| {
        lines
            .iter()
            .position(|x| *x == l)
            .unwrap_or_else(|| panic!("no `{l}` in {log}"))
    };
    assert!(pos("start db") < pos("start web"), "{log}");
    assert!(pos("start web") < pos("start main"), "{log}");
    // Stop: web before db (reverse dependencies); cache has no dependents.
    assert!(pos("stop web") < pos("stop db"), "{log}");
    assert!(log.contains("stop cache"), "{log}");
}

#[test]
fn a_straggler_in_mains_group_does_not_delay_stopping_services() {
    let rest = format!("[shutdown]\ngrace = \"1500ms\"\n{}", service("db", ""));
    // main leaves a TERM-ignoring process in its own group behind.
    let main = "sh -c 'trap \"\" TERM; touch $D/ready; while :; do sleep 0.05; done' & wait";
    let mut k = start(&config("", &rest), &["sh", "-c", main]);
    k.wait_file("up-db");
    let (code, took) = term_and_wait(&mut k);
    assert_eq!(code, 143, "{}", k.log_text());
    assert!(
        took >= Duration::from_millis(1400),
        "the straggler needs SIGKILL: {took:?}"
    );
    // db was stopped as soon as main's own process ended, not when the straggler's grace
    // ran out: its SIGTERM comes before the grace expired.
    let log = k.log_text();
    let at = |what: &str| {
        log.lines()
            .position(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no `{what}` in {log}"))
    };
    assert!(
        at("stop: sent SIGTERM to service db") < at("stop: grace 1.500s expired"),
        "db was stopped only with the straggler: {log}"
    );
    assert!(read(&k.path("log")).contains("stop db"));
}

#[test]
fn readiness_http_probe_gates_the_main_command() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("answered-200");
    let flag2 = flag.clone();
    // Answers 503 twice, then 200 (creating the flag file first).
    std::thread::spawn(move || {
        for (n, s) in listener.incoming().enumerate() {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf);
            let status = if n < 2 { "503 Busy" } else { "200 OK" };
            if n >= 2 {
                std::fs::write(&flag2, "").unwrap();
            }
            let _ =
                s.write_all(format!("HTTP/1.0 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes());
        }
    });
    let rest = format!(
        "[[service]]\nname = \"web\"\ncommand = \"exec sleep 30\"\nready = {{ http = \"http://127.0.0.1:{port}/health\", interval = \"50ms\" }}\n"
    );
    let mut k = start(&config("", &rest), &["test", "-e", flag.to_str().unwrap()]);
    assert_eq!(
        k.wait().0,
        0,
        "main started before the probe answered 200: {}",
        k.log_text()
    );
    assert!(
        k.log_text().contains("service web ready"),
        "{}",
        k.log_text()
    );
}

#[test]
fn readiness_timeout_stops_everything() {
    let rest = "[[service]]\nname = \"slow\"\ncommand = \"exec sleep 30\"\nready = { file = \"/nonexistent/x\", timeout = \"300ms\" }\n";
    let mut k = start(&config("", rest), &["touch", "$D/started"]);
    let (code, _) = k.wait();
    assert_eq!(code, 1, "{}", k.log_text());
    assert!(
        k.log_text().contains("service slow not ready after 0.300s"),
        "{}",
        k.log_text()
    );
    assert!(!k.path("started").exists());
}

#[test]
fn readiness_timeout_applies_to_a_service_that_keeps_crashing() {
    let rest = "[[service]]\nname = \"crashy\"\ncommand = \"exit 1\"\nrestart = \"always\"\n\
                ready = { file = \"/nonexistent/x\", timeout = \"400ms\" }\n";
    let mut k = start(&config("", rest), &["touch", "$D/started"]);
    let (code, _) = k.wait();
    assert_eq!(code, 1, "{}", k.log_text());
    assert!(
        k.log_text().contains("service crashy not ready"),
        "{}",
        k.log_text()
    );
    assert!(!k.path("started").exists());
}

#[test]
fn stop_signal_before_main_starts_reports_128_plus_n() {
    let rest = "[[service]]\nname = \"never-ready\"\ncommand = \"touch $D/ready; exec sleep 30\"\n\
                ready = { file = \"/nonexistent/x\" }\n";
    let mut k = start(&config("", rest), &["touch", "$D/started"]);
    let (code, _) = term_and_wait(&mut k);
    assert_eq!(code, 128 + 15, "{}", k.log_text());
    assert!(!k.path("started").exists());
}

/// Runs one restarting service until keel has logged the end of its `lines`-th run, and
/// returns the start times and what keel said at each end (the last one is its decision
/// not to restart any more: no settle time in which a wrong restart might or might not show).
fn restarts(policy: &str, exit: i32, max: u32, lines: usize) -> (Vec<f64>, Vec<String>) {
    let rest = format!(
        "[[service]]\nname = \"flaky\"\ncommand = \"date +%s.%N >> $D/starts; exit {exit}\"\n\
         restart = \"{policy}\"\nrestart_delay = \"100ms\"\nrestart_max_delay = \"300ms\"\nmax_restarts = {max}\n"
    );
    let main = format!(
        "while [ $(grep -c 'service flaky (pid [0-9]*) ended' $D/keel.stderr) -lt {lines} ]; do sleep 0.02; done"
    );
    let mut k = start(&config("", &rest), &["sh", "-c", &main]);
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    let ends = k
        .log_text()
        .lines()
        .filter(|l| l.contains("service flaky (pid") && l.contains(") ended: "))
        .map(|l| l.split(") ended: ").nth(1).unwrap_or(l).to_string())
        .collect();
    let starts = read(&k.path("starts"))
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    (starts, ends)
}

#[test]
fn on_failure_restarts_with_doubling_backoff_up_to_the_limit() {
    let (t, ends) = restarts("on-failure", 3, 4, 5);
    assert_eq!(t.len(), 5, "1 start + 4 restarts, then it gives up: {t:?}");
    // 100ms, 200ms, then capped at 300ms: announced by keel, and no run came sooner.
    for (i, want) in ["0.100s", "0.200s", "0.300s", "0.300s"].iter().enumerate() {
        let said = format!("restart {} of 4 in {want}", i + 1);
        assert!(
            ends[i].ends_with(&said),
            "run {i}: {:?}, want `{said}`",
            ends[i]
        );
    }
    assert!(ends[4].ends_with("gave up after 4 restarts"), "{ends:?}");
    let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
    for (g, want) in gaps.iter().zip([0.1, 0.2, 0.3, 0.3]) {
        assert!(*g >= want - 0.01, "gaps {gaps:?}");
    }
}

#[test]
fn on_failure_does_not_restart_a_clean_exit_but_always_does() {
    for (policy, exit, max, runs) in [
        ("on-failure", 0, 3, 1),
        ("never", 1, 3, 1),
        ("always", 0, 2, 3),
    ] {
        let (t, ends) = restarts(policy, exit, max, runs);
        assert_eq!(t.len(), runs, "{policy}: {t:?}");
        let last = ends.last().unwrap();
        assert!(
            !last.contains("restart ") || last.contains("gave up"),
            "{policy}: keel meant to start it again: {ends:?}"
        );
    }
}

//! The control API of the built `keel run` binary (`[init] workspace = false`, so no FUSE):
//! /health follows service readiness and flips to 503 on SIGTERM, /status and /metrics show
//! real supervised processes, `keel status` prints the same JSON over the Unix socket and
//! fails cleanly once keel is gone, the token from the environment never reaches services, and
//! control errors stop keel before it starts anything.

use crate::support;

use std::net::SocketAddr;
use std::process::Command;

use nix::sys::signal::Signal;
use support::control::*;
use support::pid1::*;

const TOKEN: &str = "e2e-token-0123456789";

/// The address keel logged as "control API on http://ADDR ...".
fn control_addr(k: &Keel) -> SocketAddr {
    k.wait_log("control API on http://");
    let log = k.log_text();
    let rest = &log[log.find("control API on http://").unwrap() + 22..];
    let addr = rest.split(|c: char| c.is_whitespace()).next().unwrap();
    addr.parse()
        .unwrap_or_else(|e| panic!("{addr:?}: {e}; log:\n{log}"))
}

/// Runs `keel status ARGS...`; returns (exit code, stdout, stderr).
fn keel_status(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(KEEL)
        .arg("status")
        .args(args)
        .env_remove("KEEL_CONFIG")
        .envs(env.iter().copied())
        .output()
        .expect("run keel status");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Polls `GET path` (with the token) until `want` holds for the response.
fn wait_for(addr: SocketAddr, path: &str, want: impl Fn(&Resp) -> bool) -> Resp {
    poll(&format!("{path} to change"), || {
        let r = get(addr, path, Some(TOKEN));
        want(&r).then_some(r)
    })
}

fn service<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no service {name} in {v}"))
}

/// JSON without the fields that move on their own.
fn still(mut v: serde_json::Value) -> serde_json::Value {
    v["uptime_seconds"] = serde_json::Value::Null;
    // keel's memory moves between two reads; its budget does not.
    let budget = v["memory"]["budget_bytes"].clone();
    assert!(budget.as_u64().is_some_and(|b| b >= 16 << 20), "{v}");
    v["memory"] = serde_json::json!({ "budget_bytes": budget });
    v
}

const SERVICES: &str = r#"
[control]
listen = "127.0.0.1:0"
socket = "$D/control.sock"
token = "e2e-token-0123456789"

[shutdown]
grace = "5s"

[[service]]
name = "db"
command = ["sh", "-c", "while [ ! -e $D/go ]; do sleep 0.02; done; touch $D/db.ready; exec sleep 60"]
ready = { file = "$D/db.ready", interval = "20ms", timeout = "18s" }

[[service]]
name = "flaky"
command = "exit 3"
restart = "on-failure"
restart_delay = "20ms"
max_restarts = 2
"#;

#[test]
fn health_status_metrics_and_keel_status_follow_the_real_processes() {
    // The main command takes half a second to stop, so keel is seen stopping.
    let main = "trap 'sleep 0.5; exit 0' TERM; touch $D/main.started; \
                while :; do sleep 0.02; done";
    let mut k = start(&config("", SERVICES), &["sh", "-c", main]);
    let addr = control_addr(&k);
    let sock = k.path("control.sock");

    // db waits for $D/go: /health says which service it waits for.
    let r = wait_for(addr, "/health", |r| {
        r.body == "not ready: service db starting\n"
    });
    assert_eq!(r.code, 503);
    // (Published before the first start too: wait until db runs.)
    let v = wait_for(addr, "/status", |r| {
        !service(&r.json(), "db")["pid"].is_null()
    })
    .json();
    assert_eq!(v["phase"], "running");
    assert_eq!(v["mount"]["state"], "disabled");
    let db = service(&v, "db");
    assert_eq!(db["state"], "starting");
    assert!(alive(db["pid"].as_i64().unwrap() as i32));
    assert_eq!(db["ready_probe"], true);
    // The main command waits for every service.
    assert_eq!(service(&v, "main")["main"], true);
    assert!(service(&v, "main")["pid"].is_null());
    if curl_available() {
        assert!(!curl_health(addr), "curl -f passed on a 503");
    }

    std::fs::write(k.path("go"), "").unwrap();
    let r = wait_for(addr, "/health", |r| r.code == 200);
    assert_eq!(r.body, "ok\n");
    if curl_available() {
        assert!(
            curl_health(addr),
            "the image's HEALTHCHECK command failed on a 200"
        );
    }
    k.wait_file("main.started");
    // flaky gives up after its two restarts.
    let v = wait_for(addr, "/status", |r| {
        let v = r.json();
        service(&v, "flaky")["state"] == "exited" && service(&v, "main")["state"] == "running"
    })
    .json();
    let flaky = service(&v, "flaky");
    assert_eq!(flaky["restarts"], 2);
    assert_eq!(flaky["last_exit"]["code"], 3);
    assert_eq!(flaky["last_exit"]["text"], "exit code 3");
    assert!(flaky["pid"].is_null());
    let db = service(&v, "db");
    assert_eq!(db["state"], "ready");
    assert!(alive(db["pid"].as_i64().unwrap() as i32));
    let main_pid = service(&v, "main")["pid"].as_i64().unwrap() as i32;
    assert!(alive(main_pid));
    assert_eq!(v["healthy"], true);

    let m = get(addr, "/metrics", Some(TOKEN)).body;
    assert_eq!(
        metric(&m, "keel_service_restarts_total{service=\"flaky\"}"),
        Some(2.0)
    );
    assert_eq!(metric(&m, "keel_services{state=\"ready\"}"), Some(1.0));
    assert_eq!(metric(&m, "keel_services{state=\"running\"}"), Some(1.0));
    assert_eq!(metric(&m, "keel_services{state=\"exited\"}"), Some(1.0));
    assert_eq!(metric(&m, "keel_workspace_mounted"), Some(0.0));

    // No workspace: nothing to checkpoint. Wrong tokens learn nothing.
    let r = post(addr, "/checkpoint", Some(TOKEN));
    assert_eq!(r.code, 503, "{r:?}");
    let r = get(addr, "/status", Some("wrong"));
    assert_eq!((r.code, r.body.as_str()), (401, "unauthorized\n"));

    // keel status over the socket: the same JSON as GET /status.
    let (code, out, err) = keel_status(&["--socket", sock.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let tcp = get(addr, "/status", Some(TOKEN)).json();
    let via_socket: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(still(via_socket), still(tcp));
    // ... and the socket path comes from the config too.
    let cfg = k.path("config.toml");
    let (code, out2, err) = keel_status(&["--config", cfg.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out2.contains("\"flaky\""));
    let (code, _, err) = keel_status(&[], &[("KEEL_CONFIG", cfg.to_str().unwrap())]);
    assert_eq!(code, 0, "{err}");

    // SIGTERM: /health is 503 "stopping" while the main command takes its time.
    k.signal(Signal::SIGTERM);
    let r = poll("503 stopping", || {
        let r = get(addr, "/health", None);
        (r.code == 503).then_some(r)
    });
    assert_eq!(r.body, "not ready: stopping\n");
    let v = get(addr, "/status", Some(TOKEN)).json();
    assert_eq!(v["phase"], "stopping");
    assert_eq!(v["stopping"], "received SIGTERM");
    assert_eq!(k.wait().0, 0, "{}", k.log_text());

    // Gone: the socket file is removed, keel status says so in one line, the port is closed.
    assert!(!sock.exists(), "control socket left behind");
    let (code, out, err) = keel_status(&["--socket", sock.to_str().unwrap()], &[]);
    assert_eq!(code, 1);
    assert_eq!(out, "");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("keel status: nothing is listening on"),
        "{err}"
    );
    // (The port went with keel's process; whether another process has taken it since is
    // not keel's to say.)
    let _ = addr;
    // keel's own log never carries the token.
    assert!(!k.log_text().contains(TOKEN));
}

#[test]
fn env_token_overrides_the_file_and_never_reaches_services() {
    let rest = "[control]\nlisten = \"127.0.0.1:0\"\ntoken = \"from-the-file\"\n";
    let mut k = start_with(
        &config("", rest),
        &["sh", "-c", "env > $D/env; touch $D/up; exec sleep 30"],
        Opts {
            env: &[("KEEL_CONTROL_TOKEN", "from-the-env-42")],
            ..Default::default()
        },
    );
    let addr = control_addr(&k);
    k.wait_file("up");
    let env = read(&k.path("env"));
    assert!(env.contains("D="), "{env}");
    assert!(!env.contains("KEEL_CONTROL_TOKEN"), "{env}");
    assert!(!env.contains("from-the-env-42"), "{env}");
    assert_eq!(get(addr, "/status", Some("from-the-env-42")).code, 200);
    assert_eq!(get(addr, "/status", Some("from-the-file")).code, 401);
    let body = get(addr, "/status", Some("from-the-env-42")).body;
    assert!(!body.contains("from-the"), "{body}");
    k.signal(Signal::SIGTERM);
    assert_eq!(k.wait().0, 143);
    assert!(!k.log_text().contains("from-the"), "{}", k.log_text());
}

#[test]
fn control_errors_stop_keel_before_anything_starts() {
    // The port is taken.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let rest = format!("[control]\nlisten = \"127.0.0.1:{port}\"\n");
    let mut k = start(&config("", &rest), &["touch", "$D/ran"]);
    assert_eq!(k.wait().0, 1, "{}", k.log_text());
    assert!(
        k.log_text()
            .contains(&format!("control.listen: listen on 127.0.0.1:{port}")),
        "{}",
        k.log_text()
    );
    assert!(!k.path("ran").exists(), "the command ran anyway");

    // A bad value in the file: exit 2 naming the key.
    let mut k = start(
        &config("", "[control]\nlisten = \"everywhere\"\n"),
        &["touch", "$D/ran"],
    );
    assert_eq!(k.wait().0, 2);
    assert!(k.log_text().contains("control.listen"), "{}", k.log_text());
    assert!(!k.path("ran").exists());

    // A bad token in the environment: exit 2 naming the variable, not echoing it.
    let mut k = start_with(
        &config("", "[control]\nlisten = \"127.0.0.1:0\"\n"),
        &["touch", "$D/ran"],
        Opts {
            env: &[("KEEL_CONTROL_TOKEN", "has spaces in it")],
            ..Default::default()
        },
    );
    assert_eq!(k.wait().0, 2);
    assert!(
        k.log_text().contains("KEEL_CONTROL_TOKEN"),
        "{}",
        k.log_text()
    );
    assert!(!k.log_text().contains("has spaces"), "{}", k.log_text());
    assert!(!k.path("ran").exists());
}

#[test]
fn no_control_table_means_no_listener_and_no_socket() {
    let mut k = start(&config("", ""), &["sh", "-c", "ls -A $D > $D/ls"]);
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert!(!k.log_text().contains("control API"), "{}", k.log_text());
    assert!(!read(&k.path("ls")).contains(".sock"));
}

fn curl_available() -> bool {
    let ok = Command::new("curl")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("curl not installed: skipping the HEALTHCHECK command checks");
    }
    ok
}

/// The image's HEALTHCHECK command.
fn curl_health(addr: SocketAddr) -> bool {
    Command::new("curl")
        .args(["-fsS", "--max-time", "5", &format!("http://{addr}/health")])
        .output()
        .unwrap()
        .status
        .success()
}

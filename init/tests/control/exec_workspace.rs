//! Processes started through the control API with the real FUSE workspace (root and
//! /dev/fuse; panics when they are missing while CI is set): they get exactly what the main
//! command gets (mount namespace with keel's state hidden, capabilities and bounding set,
//! user, umask, limits, environment); `rollback_on=failure` leaves the workspace as it was
//! when the command fails and keeps a success's changes; `diff=true` equals `keel diff` of
//! the snapshots around the exec; `snapshot=NAME` and `checkpoint=wait` name snapshots that
//! exist; the temporary name pinning the snapshot before goes whatever happens (a spawn that
//! fails, which rolls nothing back, or keel's stop while the command runs).

use crate::support;

use std::path::PathBuf;
use std::process::Command;

use serde_json::{json, Value};
use support::control::*;
use support::pid1::*;

fn keel(main: &str) -> Keel {
    let cfg = format!(
        "{}[control]\nsocket = \"$D/c.sock\"\n[shutdown]\ngrace = \"1s\"\n\
         [init]\numask = \"0027\"\n[init.rlimits]\nnofile = 4242\n",
        support::keel::workspace_config("")
    );
    let k = start(&cfg, &["sh", "-c", main]);
    k.wait_log("ready after");
    k
}

fn sock(k: &Keel) -> PathBuf {
    k.path("c.sock")
}

fn run(k: &Keel, req: Value) -> (String, Value) {
    let r = unix_send(&sock(k), "POST", "/exec", req.to_string().as_bytes());
    assert_eq!(r.code, 200, "{r:?}");
    let evs = events(&r.body);
    let b64 = base64::engine::general_purpose::STANDARD;
    use base64::Engine;
    let out: Vec<u8> = evs
        .iter()
        .filter(|e| e["type"] == "stdout")
        .flat_map(|e| b64.decode(e["data"].as_str().unwrap()).unwrap())
        .collect();
    let x = evs.last().unwrap().clone();
    assert_eq!(x["type"], "exit", "{evs:?}");
    (String::from_utf8_lossy(&out).into_owned(), x)
}

fn stop(k: &mut Keel) {
    k.signal(nix::sys::signal::Signal::SIGTERM);
    k.wait();
}

/// What a process sees of itself: namespace, credentials and capabilities, umask, open
/// files limit, environment (without what differs by nature: PWD, SHLVL, _).
const SELF: &str = "readlink /proc/self/ns/mnt; \
    grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' /proc/self/status; \
    umask; ulimit -n; ls -A STATE | wc -l; env | grep -vE '^(PWD|OLDPWD|SHLVL|_)=' | sort";

#[test]
fn a_process_gets_exactly_what_the_main_command_gets() {
    if !require_root_and_fuse("exec workspace test") {
        return;
    }
    // Written whole, then renamed: `wait_file` must not see it half-written.
    let main = format!(
        "({}) > $D/main.self.tmp && mv $D/main.self.tmp $D/main.self; exec sleep 100000",
        SELF.replace("STATE", "$D/state")
    );
    let mut k = keel(&main);
    k.wait_file("main.self");
    let state = k.path("state");
    let (got, x) = run(
        &k,
        json!({"shell": SELF.replace("STATE", state.to_str().unwrap()), "env": {}}),
    );
    assert_eq!(x["code"], 0, "{x}");
    let want = std::fs::read_to_string(k.path("main.self")).unwrap();
    assert_eq!(got, want, "an exec'd process differs from the main command");
    // The state dir is hidden (empty) in both; SYS_ADMIN is out of the bounding set.
    assert!(got.contains("\n0\n"), "{got}");
    let bnd = got
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(
        bnd & (1 << 21),
        0,
        "CAP_SYS_ADMIN in the bounding set: {got}"
    );
    assert!(got.contains("0027\n4242\n"), "{got}");
    // Its default directory is the workspace.
    let (pwd, _) = run(&k, json!({"argv": ["pwd"]}));
    assert_eq!(pwd.trim(), k.path("ws").to_str().unwrap());
    stop(&mut k);
}

#[test]
fn a_failing_transactional_exec_leaves_the_workspace_as_before_and_a_success_keeps_its_changes() {
    if !require_root_and_fuse("exec workspace test") {
        return;
    }
    let mut k =
        keel("echo kept > $D/ws/keep; mkdir $D/ws/d; echo x > $D/ws/d/f; exec sleep 100000");
    let ws = k.path("ws");
    poll("the main command's files", || {
        ws.join("d/f").exists().then_some(())
    });
    let (_, x) = run(
        &k,
        json!({"shell": "echo junk > junk; rm keep; echo changed > d/f; exit 1",
               "rollback_on": "failure"}),
    );
    assert_eq!(x["code"], 1, "{x}");
    assert_eq!(x["rollback"]["rolled_back"], true, "{x}");
    assert!(x["errors"].is_null(), "{x}");
    assert!(
        !ws.join("junk").exists(),
        "the failed command's file stayed"
    );
    assert_eq!(std::fs::read_to_string(ws.join("keep")).unwrap(), "kept\n");
    assert_eq!(std::fs::read_to_string(ws.join("d/f")).unwrap(), "x\n");
    // A success keeps what it did.
    let (_, x) = run(
        &k,
        json!({"shell": "echo new > new; rm keep", "rollback_on": "failure"}),
    );
    assert_eq!(
        (x["code"].clone(), x["rollback"]["rolled_back"].clone()),
        (json!(0), json!(false)),
        "{x}"
    );
    assert_eq!(std::fs::read_to_string(ws.join("new")).unwrap(), "new\n");
    assert!(!ws.join("keep").exists());
    // rollback_on=timeout rolls back a timeout, not a failure.
    let (_, x) = run(
        &k,
        json!({"shell": "echo t > t; exit 2", "rollback_on": "timeout"}),
    );
    assert_eq!(x["rollback"]["rolled_back"], false, "{x}");
    assert!(ws.join("t").exists());
    let (_, x) = run(
        &k,
        json!({"shell": "echo u > u; sleep 1000", "rollback_on": "timeout", "timeout": "1s"}),
    );
    assert_eq!(
        (x["timed_out"].clone(), x["rollback"]["rolled_back"].clone()),
        (json!(true), json!(true)),
        "{x}"
    );
    assert!(!ws.join("u").exists());
    // The names that pinned the snapshots before are gone.
    let l = unix_get(&sock(&k), "/snapshots").json();
    let named: Vec<&Value> = l["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["names"].as_array().unwrap())
        .filter(|n| n.as_str().unwrap().starts_with("exec-"))
        .collect();
    assert!(named.is_empty(), "{named:?}");
    stop(&mut k);
}

#[test]
fn diff_true_equals_keel_diff_of_the_snapshots_around_the_exec_and_options_name_snapshots() {
    if !require_root_and_fuse("exec workspace test") {
        return;
    }
    let mut k = keel(
        "mkdir -p $D/ws/src; for i in 1 2 3; do echo $i > $D/ws/src/f$i; done; exec sleep 100000",
    );
    let ws = k.path("ws");
    poll("the main command's files", || {
        ws.join("src/f3").exists().then_some(())
    });
    let (_, x) = run(
        &k,
        json!({"shell": "echo more >> src/f1; rm src/f2; mv src/f3 src/g3; head -c 100000 /dev/zero > big",
               "diff": true, "snapshot": "before-edit", "checkpoint": "wait"}),
    );
    assert_eq!(x["code"], 0, "{x}");
    let d = &x["diff"];
    assert_eq!(
        d["trees"], "tracked",
        "diff=true comes from the change tracker: {d}"
    );
    let (from, to) = (d["from"].as_u64().unwrap(), d["to"].as_u64().unwrap());
    assert_eq!(x["snapshot_before"], from, "{x}");
    assert_eq!(
        x["checkpoint"], to,
        "checkpoint=wait names the snapshot with the writes: {x}"
    );
    let out = Command::new(KEEL)
        .args(["diff", "--json", "--config"])
        .arg(k.path("config.toml"))
        .args([&from.to_string(), &to.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cli: Value = serde_json::from_slice(&out.stdout).unwrap();
    let cli = if cli["changes"].is_array() {
        cli
    } else {
        cli["diff"].clone()
    };
    assert_eq!(
        d["changes"], cli["changes"],
        "exec diff {d}\nkeel diff {cli}"
    );
    let paths: Vec<(&str, &str)> = d["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["change"].as_str().unwrap(), c["path"].as_str().unwrap()))
        .collect();
    for want in [
        ("modified", "/src/f1"),
        ("removed", "/src/f2"),
        ("renamed", "/src/g3"),
        ("added", "/big"),
    ] {
        assert!(paths.contains(&want), "{want:?} not in {paths:?}");
    }
    // snapshot=NAME is kept, named, at the snapshot before.
    let l = unix_get(&sock(&k), "/snapshots").json();
    let named = l["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| {
            s["names"]
                .as_array()
                .unwrap()
                .iter()
                .any(|n| n == "before-edit")
        })
        .unwrap_or_else(|| panic!("no snapshot named before-edit: {l}"));
    assert_eq!(named["id"], from);
    stop(&mut k);
}

/// `keel diff --json FROM TO`'s changes.
fn keel_diff(k: &Keel, from: u64, to: u64) -> Value {
    let out = Command::new(KEEL)
        .args(["diff", "--json", "--config"])
        .arg(k.path("config.toml"))
        .args([&from.to_string(), &to.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cli: Value = serde_json::from_slice(&out.stdout).unwrap();
    if cli["changes"].is_array() {
        cli["changes"].clone()
    } else {
        cli["diff"]["changes"].clone()
    }
}

fn snapshot(k: &Keel, name: &str) -> u64 {
    let r = unix_request(&sock(k), "POST", &format!("/snapshots?name={name}"));
    assert!(r.code == 200 || r.code == 201, "{r:?}");
    r.json()["id"].as_u64().unwrap_or_else(|| panic!("{r:?}"))
}

#[test]
fn diff_true_alone_takes_no_snapshot_and_equals_keel_diff_of_snapshots_taken_around() {
    if !require_root_and_fuse("exec workspace test") {
        return;
    }
    // Files of every kind, one with a hard link, one big enough for a body of several
    // windows, checkpointed (clean) before the command.
    let mut k = keel(
        "cd $D/ws && mkdir -p a/b keep && echo one > a/b/f && echo same > same && \
         ln a/b/f hard && ln -s a/b/f link && head -c 1200000 /dev/urandom > big && \
         echo x > gone && mkdir dir && echo y > dir/in && touch mode && \
         touch $D/ready; exec sleep 100000",
    );
    k.wait_file("ready");
    let before = snapshot(&k, "around-before");
    let (_, x) = run(
        &k,
        json!({"shell": "echo more >> a/b/f && echo same > same && chmod 600 mode && \
                         rm gone && mv dir moved && echo z > moved/new && \
                         printf 'X' | dd of=big bs=1 seek=700000 conv=notrunc 2>/dev/null && \
                         echo tmp > tmp && rm tmp && mkdir t && mv t t2 && rmdir t2 && \
                         ln -sf moved link2 && setfattr -n user.k -v v keep 2>/dev/null; \
                         echo done",
               "diff": true}),
    );
    assert_eq!(x["code"], 0, "{x}");
    assert!(x["errors"].is_null(), "{x}");
    assert!(
        x["snapshot_before"].is_null(),
        "diff=true alone took a snapshot: {x}"
    );
    let d = &x["diff"];
    assert_eq!(d["trees"], "tracked", "{d}");
    let after = snapshot(&k, "around-after");
    let cli = keel_diff(&k, before, after);
    assert_eq!(d["changes"], cli, "exec diff {d}\nkeel diff {cli}");
    let paths: Vec<(&str, &str)> = cli
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["change"].as_str().unwrap(), c["path"].as_str().unwrap()))
        .collect();
    for want in [
        ("modified", "/a/b/f"),
        ("modified", "/hard"),
        ("modified", "/mode"),
        ("modified", "/big"),
        ("removed", "/gone"),
        ("renamed", "/moved"),
        ("added", "/moved/new"),
        ("added", "/link2"),
    ] {
        assert!(paths.contains(&want), "{want:?} not in {paths:?}");
    }
    // Rewritten with the same bytes, or made and removed within the command: no change.
    for p in ["/same", "/tmp", "/t", "/t2"] {
        assert!(!paths.iter().any(|(_, q)| *q == p), "{p} in {paths:?}");
    }
    stop(&mut k);
}

/// The names of snapshots that start with `exec-` (the temporary pins of `rollback_on` and
/// of `diff` without a change tracker).
fn exec_pins(k: &Keel) -> Vec<String> {
    let l = unix_get(&sock(k), "/snapshots").json();
    l["snapshots"]
        .as_array()
        .unwrap_or_else(|| panic!("{l}"))
        .iter()
        .flat_map(|s| s["names"].as_array().unwrap().clone())
        .map(|n| n.as_str().unwrap().to_string())
        .filter(|n| n.starts_with("exec-"))
        .collect()
}

#[test]
fn an_exec_whose_spawn_fails_rolls_nothing_back_and_leaves_no_pinned_snapshot() {
    if !require_root_and_fuse("exec workspace test") {
        return;
    }
    let mut k = keel(
        "echo data > $D/ws/plain && touch $D/ready; \
         exec sleep 100000",
    );
    k.wait_file("ready");
    let cases = [
        (
            "missing binary",
            json!({"argv": ["/no/such/binary"], "rollback_on": "failure"}),
            127,
        ),
        (
            "not executable",
            json!({"argv": [k.path("ws/plain")], "rollback_on": "timeout", "diff": true}),
            126,
        ),
    ];
    for (what, req, code) in cases {
        let (_, x) = run(&k, req);
        assert_eq!(x["code"], code, "{what}: {x}");
        assert!(x["error"].is_string(), "{what}: {x}");
        // A command that never started changed nothing: no rollback (it would only undo
        // what others wrote meanwhile).
        assert_eq!(x["rollback"]["rolled_back"], false, "{what}: {x}");
        assert_eq!(exec_pins(&k), Vec::<String>::new(), "{what}: {x}");
    }
    // A user that does not exist is refused before any snapshot.
    let r = unix_send(
        &sock(&k),
        "POST",
        "/exec",
        json!({"argv": ["true"], "user": "no-such-user-keel", "rollback_on": "failure"})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.code, 400, "{r:?}");
    stop(&mut k);
}

#[test]
fn a_transactional_exec_cut_short_by_keels_stop_leaves_no_pinned_snapshot() {
    if !require_root_and_fuse("exec workspace test") {
        return;
    }
    let mut k = keel("exec sleep 100000");
    let r = unix_send(
        &sock(&k),
        "POST",
        "/exec",
        json!({"argv": ["sleep", "100000"], "rollback_on": "failure", "detach": true})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.code, 200, "{r:?}");
    let pins = exec_pins(&k);
    assert_eq!(pins.len(), 1, "the running exec's pin: {pins:?}");
    stop(&mut k);
    // The store after the stop: the snapshot before is there, its temporary name is not.
    let out = Command::new(KEEL)
        .args(["snapshot", "list", "--json", "--config"])
        .arg(k.path("config.toml"))
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{listed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !listed.contains(&pins[0]),
        "{} is still pinned after the stop: {listed}",
        pins[0]
    );
}

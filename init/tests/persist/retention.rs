//! Retention through `keel gc` on a state dir with a `file://` remote: `[persist] keep_size`
//! and `keep_age` drop unnamed history oldest first (never the head, a named snapshot, or a
//! chain a kept delta needs), `keel gc` prints the snapshots, chunks and bytes it freed, and
//! bad values are refused in one line naming the key. Also `/status`'s
//! `persist.remote_disk_bytes`: published by the running checkpoint service after each
//! checkpoint and gc (here `keel gc` reaches it over its socket).
//! No root or /dev/fuse needed: the workspace is driven through `WorkspaceFs` directly.

use crate::support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use keel::config::{PersistConfig, WorkspaceConfig};
use keel::persist::{open_remote, snapshots, CheckpointOptions, Persister, Repo, Service};
use support::persist::*;

/// Each round rewrites `big` whole: 16 chunks of its own.
const BIG: usize = 16 * CHUNK as usize;

fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env("RUST_LOG", "warn")
        .env_remove("KEEL_CONFIG")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn repo(url: &str) -> Repo {
    open_remote(url, &PersistConfig::default()).unwrap()
}

/// Opens the state dir, writes version `v` of `big`, checkpoints (full or delta), closes it;
/// the snapshot's id.
fn round(state: &Path, url: &str, v: u64, full: bool) -> u64 {
    let fs = open_fs(state);
    write_file(&fs, "big", &noise(v, BIG));
    let mut p = Persister::open(state, repo(url), params()).unwrap();
    let r = p
        .checkpoint(&CheckpointOptions {
            full,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(r.full, full, "{r}");
    r.seq.unwrap()
}

fn snaps(url: &str) -> Vec<u64> {
    repo(url)
        .list_snapshots()
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

/// `keel gc` with `[persist]` lines added to a config naming the remote; its stdout.
fn gc(root: &Path, state: &Path, url: &str, keys: &str) -> Result<String, String> {
    let cfg = root.join("config.toml");
    std::fs::write(
        &cfg,
        format!("[persist]\nremote = \"{url}\"\ngc_grace = \"0s\"\n{keys}\n"),
    )
    .unwrap();
    let o = keel(&[
        "gc",
        "--config",
        cfg.to_str().unwrap(),
        "--state",
        state.to_str().unwrap(),
    ]);
    if o.status.success() {
        Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
    } else {
        Err(text(&o))
    }
}

/// The number after `word` in `s` (`"freed 2 snapshots"`: `number(s, "freed")` is 2).
fn number(s: &str, word: &str) -> u64 {
    let at = s.find(word).unwrap_or_else(|| panic!("no `{word}` in {s}")) + word.len();
    s[at..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after `{word}` in {s}"))
}

#[test]
fn keel_gc_applies_size_and_age_limits_and_says_what_it_freed() {
    let root = tempfile::tempdir().unwrap();
    let state = root.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let url = format!("file://{}/remote", root.path().display());

    // 1 full, 2 delta (named), 3 full, 4 delta, 5 full, 6 delta (head).
    let ids: Vec<u64> = [true, false, true, false, true, false]
        .iter()
        .enumerate()
        .map(|(v, full)| round(&state, &url, v as u64 + 1, *full))
        .collect();
    assert_eq!(ids, vec![1, 2, 3, 4, 5, 6]);
    snapshots::record(&repo(&url), 2, Some("keep-me"), "", 0).unwrap();

    // Limits that nothing is past: nothing goes, and the output says so.
    let out = gc(
        root.path(),
        &state,
        &url,
        "keep = 100\nkeep_age = \"1h\"\nkeep_size = \"1GiB\"",
    )
    .unwrap();
    println!("no limit hit: {out}");
    assert!(
        out.starts_with("freed 0 snapshots, 0 chunks, 0 bytes;"),
        "{out}"
    );
    assert_eq!(snaps(&url), ids);

    // Room for the named chain (1, 2) and the head's (5, 6) and a little: 4 would bring 3
    // with it (its parent), 32 more chunks, so 4 and everything older unnamed goes.
    let out = gc(
        root.path(),
        &state,
        &url,
        "keep = 100\nkeep_size = \"5MiB\"",
    )
    .unwrap();
    println!("keep_size = 5MiB: {out}");
    assert_eq!(number(&out, "freed"), 2, "{out}");
    assert_eq!(
        number(&out, "snapshots,"),
        32,
        "chunks of versions 3 and 4: {out}"
    );
    assert!(
        number(&out, "chunks,") >= 2 * BIG as u64,
        "bytes freed: {out}"
    );
    assert!(
        out.contains("history ended by keep_size at snapshot 4"),
        "{out}"
    );
    assert_eq!(snaps(&url), vec![1, 2, 5, 6]);
    // What it says it kept fits the limit.
    assert!(number(&out, "snapshots (") <= 5 << 20, "{out}");

    // Age: 7 (full) is taken, then the clock passes keep_age, then 8 (delta of 7, head).
    round(&state, &url, 7, true);
    std::thread::sleep(Duration::from_millis(2100));
    round(&state, &url, 8, false);
    let out = gc(root.path(), &state, &url, "keep = 100\nkeep_age = \"2s\"").unwrap();
    println!("keep_age = 2s: {out}");
    // 7 is past the limit but 8 needs it; 6 and 5 go; the named 2 (and 1) stay.
    assert_eq!(number(&out, "freed"), 2, "{out}");
    assert_eq!(number(&out, "snapshots,"), 32, "{out}");
    assert!(
        out.contains("history ended by keep_age at snapshot 7"),
        "{out}"
    );
    assert_eq!(snaps(&url), vec![1, 2, 7, 8]);

    // Once the name is deleted, retention applies to it again.
    snapshots::delete(&repo(&url), "keep-me").unwrap();
    let out = gc(root.path(), &state, &url, "keep = 2").unwrap();
    println!("keep = 2 without the name: {out}");
    assert_eq!(number(&out, "freed"), 2, "{out}");
    assert_eq!(snaps(&url), vec![7, 8]);
    // What is left restores to the live workspace.
    let dir = tempfile::tempdir().unwrap();
    keel::persist::restore::restore(&mut repo(&url), None, dir.path()).unwrap();
    assert_eq!(dump(&open_fs(dir.path())), dump(&open_fs(&state)));

    // Bad values: one line naming the key, nothing done.
    for bad in [
        "keep_size = \"lots\"",
        "keep_size = 0",
        "keep_age = \"0s\"",
        "keep_age = \"a week\"",
    ] {
        let e = gc(root.path(), &state, &url, bad).unwrap_err();
        let key = bad.split(' ').next().unwrap();
        let stderr = e.split("stderr: ").nth(1).unwrap().trim();
        assert!(stderr.contains(&format!("persist.{key}")), "{bad}: {e}");
        assert_eq!(stderr.lines().count(), 1, "{bad}: {e}");
        assert!(
            e.starts_with("status Some(2)") || e.starts_with("status Some(1)"),
            "{e}"
        );
    }
    assert_eq!(snaps(&url), vec![7, 8]);
}

/// The running service publishes the `file://` remote's disk use after each checkpoint and
/// gc, without a walk per request; `keel gc` reaches the running keel over its socket.
#[test]
fn status_shows_the_file_remote_disk_use_after_checkpoints_and_gc() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let fs = open_fs(state);
    write_file(&fs, "big", &noise(1, BIG));
    let ws = WorkspaceConfig {
        state_dir: state.to_path_buf(),
        mount_point: state.join("mnt"),
        chunk_size: CHUNK,
        ..Default::default()
    };
    // The default remote: file://<state>/remote.
    let cfg = PersistConfig {
        interval: Duration::ZERO,
        keep: 1,
        // Every snapshot full: keeping the newest needs nothing older.
        compact_every: 1,
        gc_grace: Duration::ZERO,
        gc_every: 0,
        ..Default::default()
    };
    let svc = Service::start(&ws, &cfg, Box::new(|| Ok(())), None, None)
        .unwrap()
        .unwrap();
    let wait_for = |what: &str, ok: &dyn Fn(u64) -> bool| -> u64 {
        let t0 = Instant::now();
        loop {
            if let Some(n) = svc.published_state().remote_disk_bytes.filter(|n| ok(*n)) {
                return n;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "remote_disk_bytes never {what}: {:?}",
                svc.published_state()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let empty = wait_for("published", &|_| true);
    svc.checkpoint_now().unwrap();
    let one = wait_for("grew by a version of big", &|n| n >= empty + BIG as u64);
    write_file(&fs, "big", &noise(2, BIG));
    svc.checkpoint_now().unwrap();
    let two = wait_for("grew by a second version", &|n| n >= one + BIG as u64);
    // `keel gc` through the running keel's control socket (served here as `keel mount`
    // serves it): keep = 1 frees the first version.
    let full = keel::config::Config {
        workspace: ws.clone(),
        ..Default::default()
    };
    let status = keel::control::StatusHandle::new(&full);
    keel::control::publish_checkpoints(&status, &svc);
    let control = keel::control::start_socket(&full, &status).unwrap();
    let o = keel(&["gc", "--state", state.to_str().unwrap()]);
    control.stop();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    println!("gc through the running keel: {out}");
    assert_eq!(number(&out, "snapshots,"), 16, "{out}");
    let after = wait_for("shrank after gc", &|n| n + BIG as u64 <= two);
    println!(
        "remote_disk_bytes: empty {empty}, after 1 checkpoint {one}, after 2 {two}, after gc {after}"
    );
    // What /status would show is what a walk finds now.
    assert_eq!(after, snapshots::disk_use(&state.join("remote")));
    drop(svc);
    drop(fs);
}

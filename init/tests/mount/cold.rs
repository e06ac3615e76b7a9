//! Cold starts of a real `keel mount` on an empty state dir restored lazily from a remote:
//! a reader already waiting when the mount appears is served the file's bytes, never an
//! error, because the remote is the source of windows not fetched yet before the mount is
//! made. Over a real S3 endpoint (moto; see `support::s3` for the skip rule).

use crate::support;

use std::io::Read;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use keel::persist::{open_remote, Persister};
use support::mount::Keel;
use support::persist::*;
use support::s3::{s3_config, start_moto};

/// Checkpoints a tree holding `cold/f` (`bytes`, several windows) to moto at `port`;
/// returns the config that mounts a state dir restored from it. Over S3 the wiring of the
/// remote takes a round trip or two: wide enough for a waiting reader to fall into.
fn remote_with_file(tmp: &Path, port: u16, bytes: &[u8]) -> std::path::PathBuf {
    let src = tmp.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let fs = open_fs(&src);
    mkdir(&fs, "cold");
    write_file(&fs, "cold/f", bytes);
    fs.shutdown().unwrap();
    drop(fs);
    let repo = open_remote("s3://keel/cold", &s3_config(port)).unwrap();
    let mut p = Persister::open(&src, repo, params()).unwrap();
    checkpoint(&mut p);
    let cfg = tmp.join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nchunk_size = \"64KiB\"\n[persist]\nremote = \"s3://keel/cold\"\n\
             endpoint = \"http://127.0.0.1:{port}\"\nregion = \"us-east-1\"\nallow_http = true\n\
             interval = \"0s\"\n"
        ),
    )
    .unwrap();
    cfg
}

/// Detaches the tmpfs when the test ends, however it ends.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = support::sys::umount_detach(&self.0);
    }
}

/// How one read of the file that was waiting for the mount ended.
enum Outcome {
    Same,
    Differs(usize),
    Error(std::io::Error),
    /// The mount came up without the file.
    Never,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Same => write!(f, "the file's bytes"),
            Outcome::Differs(n) => write!(f, "{n} bytes that differ from the file's"),
            Outcome::Error(e) => write!(f, "error: {e}"),
            Outcome::Never => write!(f, "no file on the mount"),
        }
    }
}

/// Opens `path` as soon as it exists (ENOENT until the mount appears) and reads it whole;
/// gives up once `mounted` was set before an open that found nothing.
fn wait_and_read(path: &Path, want: &[u8], mounted: &AtomicBool) -> Outcome {
    loop {
        let after_mount = mounted.load(Ordering::SeqCst);
        match std::fs::File::open(path) {
            Ok(mut f) => {
                let mut got = Vec::new();
                return match f.read_to_end(&mut got) {
                    Ok(_) if got == want => Outcome::Same,
                    Ok(n) => Outcome::Differs(n),
                    Err(e) => Outcome::Error(e),
                };
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if after_mount {
                    return Outcome::Never;
                }
                std::thread::yield_now();
            }
            Err(e) => return Outcome::Error(e),
        }
    }
}

/// 200 cold starts, each with a reader spinning on the file before keel starts: every read
/// returns the file's bytes (before the fix, a read between the mount and the wiring of the
/// remote failed with EIO).
#[test]
fn a_read_waiting_for_a_cold_mount_gets_the_bytes() {
    if !support::mount::fuse_available() {
        return;
    }
    let starts: usize = std::env::var("KEEL_COLD_STARTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    let top = tempfile::Builder::new()
        .prefix("keel-cold-gap.")
        .tempdir()
        .unwrap();
    // State dirs on a tmpfs: a start costs what keel does, not the host disk's syncs.
    support::sys::mount_tmpfs(top.path(), "mode=0700").unwrap();
    let _unmount = Unmount(top.path().to_path_buf());
    let want = noise(41, 3 * CHUNK as usize + 99);
    let cfg = remote_with_file(top.path(), port, &want);
    let mut bad = Vec::new();
    for i in 0..starts {
        let tmp = tempfile::Builder::new()
            .prefix("keel-cold-start.")
            .tempdir_in(top.path())
            .unwrap();
        let state = tmp.path().join("state");
        let path = tmp.path().join("mnt/cold/f");
        let mounted = Arc::new(AtomicBool::new(false));
        let reader = {
            let (path, want, mounted) = (path.clone(), want.clone(), mounted.clone());
            std::thread::spawn(move || wait_and_read(&path, &want, &mounted))
        };
        let mut k = Keel::start_in(tmp, state, &["--config", cfg.to_str().unwrap()]);
        // The mount is up: the reader finds the file (or has read it already).
        mounted.store(true, Ordering::SeqCst);
        let outcome = reader.join().unwrap();
        if !matches!(outcome, Outcome::Same) {
            bad.push(format!("start {i}: {outcome}\n{}", k.log_text()));
        }
        k.stop();
    }
    assert!(
        bad.is_empty(),
        "{} of {starts} cold starts failed the waiting read; first:\n{}",
        bad.len(),
        bad[0]
    );
}

/// A tree of two directories of multi-window files, checkpointed to a `file://` remote;
/// returns (remote dir, path → bytes).
fn two_dirs(tmp: &Path) -> (std::path::PathBuf, Vec<(String, Vec<u8>)>) {
    let src = tmp.join("src");
    let remote_dir = tmp.join("remote");
    std::fs::create_dir_all(&src).unwrap();
    let fs = open_fs(&src);
    let mut files = Vec::new();
    for d in ["a", "b"] {
        mkdir(&fs, d);
        for i in 0..6u64 {
            let p = format!("{d}/f{i}");
            let bytes = noise(
                i + if d == "a" { 100 } else { 200 },
                (2 * CHUNK + 1000 * i) as usize,
            );
            write_file(&fs, &p, &bytes);
            files.push((p, bytes));
        }
    }
    fs.shutdown().unwrap();
    drop(fs);
    let remote: Arc<dyn keel::persist::Remote> =
        Arc::new(keel::persist::FsRemote::open(&remote_dir).unwrap());
    let mut p = Persister::open(&src, keel::persist::Repo::new(remote, ""), params()).unwrap();
    checkpoint(&mut p);
    (remote_dir, files)
}

fn file_config(tmp: &Path, remote_dir: &Path, name: &str, extra: &str) -> std::path::PathBuf {
    let cfg = tmp.join(name);
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nchunk_size = \"64KiB\"\n[persist]\nremote = \"file://{}\"\ninterval = \"0s\"\n{extra}\n",
            remote_dir.display()
        ),
    )
    .unwrap();
    cfg
}

/// What a session reads is recorded by its last checkpoint, and the next cold start with
/// `replay = "before"` has fetched exactly that before its mount appears: with the remote's
/// chunks taken away once it is mounted, the files the last session read still read whole,
/// and one it did not read fails.
#[test]
fn the_last_sessions_reads_are_fetched_before_the_next_mount() {
    if !support::mount::fuse_available() {
        return;
    }
    let top = tempfile::Builder::new()
        .prefix("keel-cold-replay.")
        .tempdir()
        .unwrap();
    let (remote_dir, files) = two_dirs(top.path());
    let cfg = file_config(
        top.path(),
        &remote_dir,
        "config.toml",
        "replay = \"before\"",
    );
    // Session 1: reads the files of a/ (in reverse), then stops cleanly.
    let tmp = tempfile::Builder::new()
        .prefix("s1.")
        .tempdir_in(top.path())
        .unwrap();
    let state = tmp.path().join("state");
    let mut k = Keel::start_in(tmp, state, &["--config", cfg.to_str().unwrap()]);
    for (p, want) in files.iter().filter(|(p, _)| p.starts_with("a/")).rev() {
        assert!(std::fs::read(k.p(p)).unwrap() == *want, "{p}");
    }
    k.stop();
    assert!(remote_dir.join("readset").exists(), "no read set recorded");

    // Session 2: a cold start; once it is mounted, no chunk can be fetched any more.
    let tmp = tempfile::Builder::new()
        .prefix("s2.")
        .tempdir_in(top.path())
        .unwrap();
    let state = tmp.path().join("state");
    let mut k = Keel::start_in(tmp, state, &["--config", cfg.to_str().unwrap()]);
    let chunks = remote_dir.join("chunks");
    let away = remote_dir.join("chunks.away");
    std::fs::rename(&chunks, &away).unwrap();
    let a: Vec<_> = files.iter().filter(|(p, _)| p.starts_with("a/")).collect();
    let results: Vec<_> = a.iter().map(|(p, _)| std::fs::read(k.p(p))).collect();
    let b0 = std::fs::read(k.p("b/f0"));
    std::fs::rename(&away, &chunks).unwrap();
    for ((p, want), got) in a.iter().zip(results) {
        let got = got.unwrap_or_else(|e| panic!("{p} was not replayed: {e}\n{}", k.log_text()));
        assert!(got == *want, "{p} differs");
    }
    assert!(b0.is_err(), "b/f0 was never read, yet it was fetched");
    let log = k.log_text();
    assert!(
        log.contains("replayed the last session's read set before the mount"),
        "{log}"
    );
    k.stop();
}

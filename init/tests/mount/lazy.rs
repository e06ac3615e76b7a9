//! Real mounts of a lazily restored state dir: `keel mount` (passthrough `auto`, the
//! default) serves every file through the kernel with the original bytes, fetching windows
//! from the remote on first read; with `[persist] prefetch = true` everything arrives in
//! the background, after which the files read without the remote at all.

use crate::support;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::meta::{Nanos, Store};
use keel::persist::restore::{restore_with, RestoreMode};
use keel::persist::{FsRemote, Persister, Remote, Repo};
use support::mount::Keel;
use support::persist::*;

/// Path → bytes of every regular file of the source tree.
fn source(remote_dir: &Path, src: &Path) -> BTreeMap<&'static str, Vec<u8>> {
    std::fs::create_dir_all(src).unwrap();
    let fs = open_fs(src);
    mkdir(&fs, "lz");
    let mut files = BTreeMap::new();
    files.insert("lz/a", noise(21, 3 * 1024 * 1024 + 17));
    files.insert("lz/b", noise(22, 40 * CHUNK as usize));
    files.insert("lz/small", b"inline bytes".to_vec());
    for (p, d) in &files {
        write_file(&fs, p, d);
    }
    let c = write_file(&fs, "lz/sparse", b"");
    write_at(&fs, c, 20 * CHUNK + 3, b"far");
    let mut sparse = vec![0u8; 20 * CHUNK as usize + 6];
    sparse[20 * CHUNK as usize + 3..].copy_from_slice(b"far");
    files.insert("lz/sparse", sparse);
    fs.shutdown().unwrap();
    drop(fs);
    let remote: Arc<dyn Remote> = Arc::new(FsRemote::open(remote_dir).unwrap());
    let mut p = Persister::open(src, Repo::new(remote, ""), params()).unwrap();
    checkpoint(&mut p);
    files
}

/// Unfetched windows as committed to the state dir. The mounted keel groups its metadata
/// commits (at most 20 ms apart): callers wait for the count they expect (`until`).
fn missing_windows(state: &Path) -> u64 {
    let s = Store::open(&state.join(keel::state::META_DB), Nanos(0)).unwrap();
    let n = s.read().missing_window_count().unwrap();
    n
}

/// Waits (a hang guard only) until the committed count of unfetched windows satisfies
/// `ok`; returns it.
fn until(state: &Path, what: &str, ok: impl Fn(u64) -> bool) -> u64 {
    let t0 = Instant::now();
    loop {
        let n = missing_windows(state);
        if ok(n) {
            return n;
        }
        assert!(
            t0.elapsed() < support::mount::READY_TIMEOUT,
            "{what}: {n} windows still missing"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A lazily restored state dir under `tmp`, and the config that mounts it.
fn lazy_state(
    tmp: &Path,
    prefetch: bool,
) -> (
    std::path::PathBuf,
    std::path::PathBuf,
    BTreeMap<&'static str, Vec<u8>>,
) {
    let remote_dir = tmp.join("remote");
    let files = source(&remote_dir, &tmp.join("src"));
    let state = tmp.join("state");
    let remote: Arc<dyn Remote> = Arc::new(FsRemote::open(&remote_dir).unwrap());
    let r = restore_with(&mut Repo::new(remote, ""), None, &state, RestoreMode::Lazy).unwrap();
    assert_eq!(r.chunks_fetched, 0);
    assert!(missing_windows(&state) > 80);
    let cfg = tmp.join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nchunk_size = \"64KiB\"\n[persist]\nremote = \"file://{}\"\ninterval = \"0s\"\nprefetch = {prefetch}\n",
            remote_dir.display()
        ),
    )
    .unwrap();
    (state, cfg, files)
}

#[test]
fn lazily_restored_state_reads_through_the_kernel() {
    if !support::mount::fuse_available() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("keel-lazy-mount.")
        .tempdir()
        .unwrap();
    let (state, cfg, files) = lazy_state(tmp.path(), false);
    let before = missing_windows(&state);
    let mut k = Keel::start_in(tmp, state.clone(), &["--config", cfg.to_str().unwrap()]);

    // A read in the middle of a file first: only what it needs arrives.
    let f = std::fs::File::open(k.p("lz/b")).unwrap();
    let mut buf = vec![0u8; 1000];
    f.read_exact_at(&mut buf, 17 * CHUNK + 5).unwrap();
    let b = &files["lz/b"];
    assert_eq!(buf, &b[17 * CHUNK as usize + 5..17 * CHUNK as usize + 1005]);
    drop(f);
    let after_one = until(&state, "nothing was fetched", |n| n < before);
    assert!(
        before - after_one <= 1 + 2 * 4,
        "one small read fetched {} windows",
        before - after_one
    );

    // Every file, whole, twice (the second open of a complete file may use passthrough).
    for round in 0..2 {
        for (p, want) in &files {
            let got = std::fs::read(k.p(p)).unwrap();
            assert!(got == *want, "{p} differs in round {round}");
        }
    }
    until(&state, "windows left after reading everything", |n| n == 0);
    let log = k.log_text();
    assert!(!log.contains("cannot fetch"), "{log}");
    // The case under test: the kernel took passthrough, yet files with windows left were
    // served through keel (reads of the sparse body would have returned zeros).
    assert!(log.contains("passthrough=true"), "{log}");
    k.stop();
}

#[test]
fn prefetch_fetches_everything_in_the_background() {
    if !support::mount::fuse_available() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("keel-lazy-prefetch.")
        .tempdir()
        .unwrap();
    let remote_dir = tmp.path().join("remote");
    let (state, cfg, files) = lazy_state(tmp.path(), true);
    let mut k = Keel::start_in(tmp, state.clone(), &["--config", cfg.to_str().unwrap()]);
    until(&state, "prefetch did not finish", |n| n == 0);
    // The remote's chunks are gone: everything must already be local.
    let chunks = remote_dir.join("chunks");
    std::fs::rename(&chunks, remote_dir.join("chunks.away")).unwrap();
    for (p, want) in &files {
        let got = std::fs::read(k.p(p)).unwrap();
        assert!(got == *want, "{p} differs after prefetch");
    }
    std::fs::rename(remote_dir.join("chunks.away"), &chunks).unwrap();
    k.stop();
}

/// Readers of eight files not fetched yet, on a mount with two FUSE threads, all wait for
/// the remote at once: each chunk object is a FIFO here, so a fetch blocks in its open
/// until the test writes the chunk, and the test counts the FIFOs a reader has open before
/// it writes any. Before fetches moved off the FUSE threads, two at most waited (one per
/// thread) and the other readers queued behind them.
#[test]
fn readers_of_unfetched_files_are_not_limited_to_the_fuse_threads() {
    use std::os::unix::fs::OpenOptionsExt;
    if !support::mount::fuse_available() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("keel-lazy-parallel.")
        .tempdir()
        .unwrap();
    let remote_dir = tmp.path().join("remote");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let fs = open_fs(&src);
    mkdir(&fs, "par");
    let n = 8;
    // One window each, none of them in a pack (full-size windows are stored alone).
    let files: Vec<Vec<u8>> = (0..n)
        .map(|i| noise(60 + i as u64, CHUNK as usize))
        .collect();
    for (i, d) in files.iter().enumerate() {
        write_file(&fs, &format!("par/f{i}"), d);
    }
    fs.shutdown().unwrap();
    drop(fs);
    let remote: Arc<dyn Remote> = Arc::new(FsRemote::open(&remote_dir).unwrap());
    let mut p = Persister::open(&src, Repo::new(remote.clone(), ""), params()).unwrap();
    checkpoint(&mut p);
    drop(p);
    let state = tmp.path().join("state");
    restore_with(&mut Repo::new(remote, ""), None, &state, RestoreMode::Lazy).unwrap();
    // Each file's chunk object becomes a FIFO.
    let fifos: Vec<std::path::PathBuf> = files
        .iter()
        .map(|d| {
            let h = keel::chunk::ChunkId::of(d).to_hex();
            remote_dir.join("chunks").join(&h[..2]).join(&h)
        })
        .collect();
    for f in &fifos {
        std::fs::remove_file(f).unwrap();
        support::sys::mknod(f, libc::S_IFIFO | 0o600, 0).unwrap();
    }
    let cfg = tmp.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nchunk_size = \"64KiB\"\nthreads = 2\n[persist]\nremote = \"file://{}\"\ninterval = \"0s\"\n",
            remote_dir.display()
        ),
    )
    .unwrap();
    let mut k = Keel::start_in(tmp, state, &["--config", cfg.to_str().unwrap()]);
    let readers: Vec<_> = (0..n)
        .map(|i| {
            let p = k.p(&format!("par/f{i}"));
            std::thread::spawn(move || std::fs::read(p))
        })
        .collect();
    // A FIFO opens for writing without blocking only while a reader has it open; the
    // writing end is kept (closing it would end the reader's read), and fed later.
    let mut held: Vec<Option<std::fs::File>> = (0..n).map(|_| None).collect();
    // The deadline only bounds a keel that never lets more than two wait.
    let t0 = Instant::now();
    while held.iter().any(Option::is_none) && t0.elapsed() < Duration::from_secs(60) {
        for (h, f) in held.iter_mut().zip(&fifos) {
            if h.is_none() {
                *h = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(f)
                    .ok();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let most = held.iter().filter(|h| h.is_some()).count();
    // Feed every FIFO (one not held yet: a writer that blocks until its reader comes).
    let feeders: Vec<_> = held
        .into_iter()
        .zip(&fifos)
        .zip(&files)
        .map(|((h, f), d)| {
            let (f, d) = (f.clone(), d.clone());
            std::thread::spawn(move || -> std::io::Result<()> {
                use std::io::Write;
                // A blocking writer (at once when `h` holds the FIFO open for its reader),
                // then the non-blocking one goes.
                let mut w = std::fs::OpenOptions::new().write(true).open(&f)?;
                drop(h);
                w.write_all(&d)
            })
        })
        .collect();
    for (r, want) in readers.into_iter().zip(&files) {
        assert!(
            r.join().unwrap().unwrap() == *want,
            "a reader got other bytes"
        );
    }
    for f in feeders {
        f.join().unwrap().unwrap();
    }
    for (f, d) in fifos.iter().zip(&files) {
        std::fs::remove_file(f).unwrap();
        std::fs::write(f, d).unwrap();
    }
    assert_eq!(
        most,
        n,
        "readers waiting for the remote at once, with 2 FUSE threads; log:\n{}",
        k.log_text()
    );
    k.stop();
}

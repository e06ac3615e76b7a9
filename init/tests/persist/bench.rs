//! Benchmarks for BENCHMARKS.md (ignored by default; numbers, not assertions):
//! `cargo test --release --test persist bench:: -- --ignored --nocapture --test-threads 1`.
//! Checkpoint throughput cold and incremental (file:// remote on the same disk, and an
//! in-memory remote to isolate hashing + metadata), restore throughput, and fsck time for a
//! 100k-file tree.

use crate::support;

use std::sync::Arc;
use std::time::Instant;

use keel::chunk::ChunkId;
use keel::config::CacheMode;
use keel::persist::fsck::{fsck, FsckOptions};
use keel::persist::pack::{encode_index, Entry, PackIndex, PackMap};
use keel::persist::{
    restore, CheckpointOptions, FsRemote, MemRemote, PersistParams, Persister, Remote, Repo,
};
use keel::workspace::fs::{FsOptions, WorkspaceFs};
use support::persist::*;

const CS: u64 = 512 * 1024;

fn fs_512k(dir: &std::path::Path) -> WorkspaceFs {
    WorkspaceFs::new(
        dir,
        FsOptions {
            cache: CacheMode::Auto,
            inline_max: 4096,
            chunk_size: CS,
            passthrough: Default::default(),
            posix_acl: Default::default(),
        },
    )
    .unwrap()
}

fn persister_512k(dir: &std::path::Path, remote: Arc<dyn Remote>) -> Persister {
    Persister::open(
        dir,
        Repo::new(remote, ""),
        PersistParams {
            chunk_size: CS,
            compact_every: 32,
            pack_below: 64 << 10,
            pack_size: 4 << 20,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
        },
    )
    .unwrap()
}

fn mbps(bytes: u64, s: f64) -> f64 {
    bytes as f64 / s / 1e6
}

#[test]
#[ignore]
fn bench_checkpoint_throughput() {
    for (name, file_remote) in [("file://", true), ("memory", false)] {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let rdir = tempfile::tempdir_in("/var/tmp").unwrap();
        let fs = fs_512k(dir.path());
        let n = 256;
        let size = 4 << 20;
        for i in 0..n {
            write_file(&fs, &format!("f{i}"), &noise(i, size));
        }
        fs.sync_all().unwrap();
        let remote: Arc<dyn Remote> = if file_remote {
            Arc::new(FsRemote::open(rdir.path()).unwrap())
        } else {
            Arc::new(MemRemote::new())
        };
        let mut p = persister_512k(dir.path(), remote.clone());
        let t = Instant::now();
        let r = p.checkpoint(&CheckpointOptions::default()).unwrap();
        let cold = t.elapsed().as_secs_f64();
        println!(
            "BENCH checkpoint cold [{name}]: {} MiB in {n} files: {cold:.2}s = {:.0} MB/s hashed+stored ({} chunks)",
            r.bytes_hashed >> 20,
            mbps(r.bytes_hashed, cold),
            r.chunks_uploaded
        );
        // Incremental: rewrite 16 files (64 MiB).
        for i in 0..16u64 {
            write_file(&fs, &format!("f{i}"), &noise(1000 + i, size));
        }
        let t = Instant::now();
        let r = p.checkpoint(&CheckpointOptions::default()).unwrap();
        let inc = t.elapsed().as_secs_f64();
        println!(
            "BENCH checkpoint incremental [{name}]: 64 MiB changed of 1 GiB: {inc:.3}s = {:.0} MB/s, {} windows hashed, {} bytes uploaded, snapshot {} bytes",
            mbps(r.bytes_hashed, inc),
            r.windows_hashed,
            r.chunk_bytes_uploaded,
            r.snapshot_bytes
        );
        write_at(&fs, resolve(&fs, "f100"), 12345, b"one small change");
        let t = Instant::now();
        let r = p.checkpoint(&CheckpointOptions::default()).unwrap();
        println!(
            "BENCH checkpoint one small change [{name}]: {:.1} ms, {} bytes uploaded",
            t.elapsed().as_secs_f64() * 1e3,
            r.chunk_bytes_uploaded + r.snapshot_bytes
        );
        if file_remote {
            let target = tempfile::tempdir_in("/var/tmp").unwrap();
            let t = Instant::now();
            let rr = restore::restore(&mut Repo::new(remote, ""), None, target.path()).unwrap();
            let s = t.elapsed().as_secs_f64();
            println!(
                "BENCH restore [{name}]: {} MiB: {s:.2}s = {:.0} MB/s",
                rr.file_bytes >> 20,
                mbps(rr.file_bytes, s)
            );
        }
    }
}

#[test]
#[ignore]
fn bench_fsck_100k_files() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let rdir = tempfile::tempdir_in("/var/tmp").unwrap();
    let fs = fs_512k(dir.path());
    let t = Instant::now();
    for d in 0..1000 {
        mkdir(&fs, &format!("d{d}"));
        for f in 0..100 {
            write_file(&fs, &format!("d{d}/f{f}"), &noise(d * 100 + f, 200));
        }
    }
    for b in 0..100u64 {
        write_file(&fs, &format!("d{b}/big"), &noise(b, 1 << 20));
    }
    fs.shutdown().unwrap();
    drop(fs);
    println!(
        "BENCH build 100k-file tree: {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let remote: Arc<dyn Remote> = Arc::new(FsRemote::open(rdir.path()).unwrap());
    let mut p = persister_512k(dir.path(), remote.clone());
    let t = Instant::now();
    let r = p.checkpoint(&CheckpointOptions::default()).unwrap();
    println!(
        "BENCH checkpoint 100k-file tree cold: {:.2}s, snapshot {} bytes",
        t.elapsed().as_secs_f64(),
        r.snapshot_bytes
    );
    drop(p);
    for (label, quick, with_remote) in [
        ("full (local + remote)", false, true),
        ("local only", false, false),
        ("--quick", true, false),
    ] {
        let opts = FsckOptions {
            repair: false,
            quick,
            chunk_size: CS,
            remote: with_remote.then(|| Repo::new(remote.clone(), "")),
            missing_remote: None,
        };
        let t = Instant::now();
        let rep = fsck(dir.path(), &opts).unwrap();
        println!(
            "BENCH fsck 100k files {label}: {:.2}s ({} inodes, {} windows hashed, {} remote chunks, {} findings)",
            t.elapsed().as_secs_f64(),
            rep.inodes,
            rep.windows_hashed,
            rep.chunks_checked,
            rep.findings.len()
        );
        assert!(rep.is_clean());
    }
    let target = tempfile::tempdir_in("/var/tmp").unwrap();
    let t = Instant::now();
    restore::restore(&mut Repo::new(remote, ""), None, target.path()).unwrap();
    println!(
        "BENCH restore 100k-file tree: {:.2}s",
        t.elapsed().as_secs_f64()
    );
}

/// A fresh host's restore of N files (`KEEL_BENCH_FILES`, default 100,000) of
/// `KEEL_BENCH_SIZE` bytes (default 100) in directories of 1,000, lazy and eager, with the
/// time of each phase. The workspace is built without a kernel and checkpointed to a
/// file:// remote once; `KEEL_BENCH_REMOTE=DIR` keeps that remote between runs.
#[test]
#[ignore]
fn bench_fresh_restore_phases() {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (n, size) = (
        env("KEEL_BENCH_FILES", 100_000),
        env("KEEL_BENCH_SIZE", 100),
    );
    let kept = std::env::var("KEEL_BENCH_REMOTE").ok();
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let rpath = kept
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tmp.path().join("remote"));
    std::fs::create_dir_all(&rpath).unwrap();
    let remote: Arc<dyn Remote> = Arc::new(FsRemote::open(&rpath).unwrap());
    if Repo::new(remote.clone(), "").read_head().unwrap().is_none() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let fs = open_fs(dir.path());
        let t = Instant::now();
        let data = vec![b'x'; size as usize];
        let root = keel::meta::InodeNo::ROOT;
        let mut parent = root;
        for i in 0..n {
            if i % 1000 == 0 {
                parent = fs
                    .mkdir(ROOT, root, format!("d{}", i / 1000).as_bytes(), 0o755)
                    .unwrap()
                    .inode
                    .ino;
            }
            let (a, fh, _) = fs
                .create(
                    ROOT,
                    parent,
                    format!("f{i}").as_bytes(),
                    0o644,
                    libc::O_RDWR,
                )
                .unwrap();
            fs.write(a.inode.ino, 0, &data).unwrap();
            fs.release(fh).unwrap();
        }
        fs.shutdown().unwrap();
        drop(fs);
        println!(
            "BENCH build {n} files of {size} B: {:.1}s",
            t.elapsed().as_secs_f64()
        );
        let mut p = Persister::open(dir.path(), Repo::new(remote.clone(), ""), params()).unwrap();
        let t = Instant::now();
        let r = p.checkpoint(&CheckpointOptions::default()).unwrap();
        println!(
            "BENCH checkpoint cold: {:.2}s, snapshot {} bytes",
            t.elapsed().as_secs_f64(),
            r.snapshot_bytes
        );
    }
    for mode in [restore::RestoreMode::Lazy, restore::RestoreMode::Eager] {
        let target = tempfile::tempdir_in("/var/tmp").unwrap();
        let r = restore::restore_with(
            &mut Repo::new(remote.clone(), ""),
            None,
            target.path(),
            mode,
        )
        .unwrap();
        let phases: Vec<String> = r
            .phases
            .iter()
            .map(|(p, s)| format!("{p} {s:.3}s"))
            .collect();
        println!(
            "BENCH fresh restore {mode:?} of {n} files of {size} B: {:.3}s ({}), peak RSS {} MiB",
            r.elapsed_s,
            phases.join(", "),
            peak_rss_mib()
        );
    }
}

/// This process's peak RSS so far (VmHWM).
fn peak_rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |k| k >> 10)
}

/// A chunk id that looks like blake3 output (spread over the whole key space).
fn pack_fake_id(n: u64) -> ChunkId {
    ChunkId::of(&n.to_le_bytes())
}

/// Not a test: the pack map's memory and lookup cost at `KEEL_PACKMAP_CHUNKS` chunks
/// (default 2M) in packs of 2,000, printed (`cargo test --release --test
/// persist bench::pack_map_cost -- --ignored --nocapture`). With `KEEL_PACKGEN=DIR` it also writes
/// those packs' index objects under DIR (a `file://` chunk store's `packs/`), for
/// measuring a keel that loads them.
#[test]
#[ignore]
fn pack_map_cost() {
    let n: u64 = std::env::var("KEEL_PACKMAP_CHUNKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000);
    let per = 2000;
    let rss = || {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap()
    };
    let gen = std::env::var_os("KEEL_PACKGEN").map(std::path::PathBuf::from);
    let mut packs = Vec::new();
    for k in 0..n.div_ceil(per) {
        let entries: Vec<Entry> = (0..per.min(n - k * per))
            .map(|j| Entry {
                id: pack_fake_id(k * per + j),
                off: j * 4000,
                len: 3000,
            })
            .collect();
        let p = PackIndex {
            name: pack_fake_id(u64::MAX - k),
            len: per * 4000,
            entries,
        };
        if let Some(dir) = &gen {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(
                dir.join(format!("{}.idx", p.name.to_hex())),
                encode_index(&p),
            )
            .unwrap();
        }
        packs.push(p);
    }
    packs.sort_by_key(|p| p.name);
    let before = rss();
    let t = std::time::Instant::now();
    let m = PackMap::new("s", packs, Vec::new());
    let built = t.elapsed();
    let after = rss();
    let t = std::time::Instant::now();
    let mut found = 0;
    let lookups = 1_000_000u64;
    for j in 0..lookups {
        found += m.find(&pack_fake_id(j * 7919 % n)).len();
    }
    let per_lookup = t.elapsed().as_nanos() as f64 / lookups as f64;
    assert_eq!(found as u64, lookups);
    println!(
        "pack map: {n} chunks, built in {:.3} s, RSS +{} MiB over the decoded indexes ({:.1} B a chunk), find {per_lookup:.0} ns",
        built.as_secs_f64(),
        after.saturating_sub(before) >> 10,
        after.saturating_sub(before) as f64 * 1024.0 / n as f64,
    );
}

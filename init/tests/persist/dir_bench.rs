//! Benchmark for BENCHMARKS.md (ignored by default; numbers, not assertions):
//! `DIR_BENCH_FILES=100000 cargo test --release --test dir_bench -- --ignored --nocapture`.
//! The `dir` provider at scale, on the host disk (ext4 here): the first walk + checkpoint of
//! N files (1,000 per directory, 1–8 KiB each, every 100th 64 KiB), then, five times, one
//! file changed and the walk alone, the checkpoint after it, and a bare `lstat` walk of the
//! same tree (the floor: what any walk costs); then a fresh state dir restored from the
//! remote (eager) and the tree built from it (`DIR_BENCH_NO_RESTORE=1`: not). Between the
//! two, with change notification (inotify) on, five rounds of one file changed and the
//! periodic (narrowed) walk and the checkpoint after it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::persist::restore::{self, RestoreMode};
use keel::persist::{CheckpointOptions, FsRemote, PersistParams, Persister, Remote, Repo};
use keel::workspace::dir::DirTree;

const CS: u64 = 512 * 1024;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The same syscalls as the walk (getdents, then `fstatat` of each name relative to its
/// directory's fd, directories opened the same way), without the store: the least a walk
/// of the tree costs.
fn bare_walk(root: &std::path::Path) -> u64 {
    use keel::sys::tree as t;
    use std::os::fd::AsFd;
    let mut n = 0;
    let fd: std::os::fd::OwnedFd = std::fs::File::open(root).unwrap().into();
    let mut stack = vec![fd];
    while let Some(d) = stack.pop() {
        for name in t::read_names(d.as_fd()).unwrap() {
            let st = t::lstat_at(d.as_fd(), &name).unwrap();
            n += 1;
            if st.kind() == libc::S_IFDIR {
                stack.push(
                    t::open_at(d.as_fd(), &name, libc::O_RDONLY | libc::O_DIRECTORY, 0).unwrap(),
                );
            }
        }
    }
    n
}

#[test]
#[ignore]
fn dir_checkpoint_after_one_change() {
    let files: usize = std::env::var("DIR_BENCH_FILES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let base = std::env::var("DIR_BENCH_DIR").unwrap_or_else(|_| "/tmp".into());
    let tmp = tempfile::Builder::new()
        .prefix("keel-dir-bench.")
        .tempdir_in(base)
        .unwrap();
    let state = tmp.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let remote_dir = tmp.path().join("remote");
    std::fs::create_dir(&remote_dir).unwrap();
    let remote: Arc<dyn Remote> = Arc::new(FsRemote::open(&remote_dir).unwrap());
    let params = PersistParams {
        chunk_size: CS,
        compact_every: 32,
        pack_below: 64 << 10,
        pack_size: 4 << 20,
        threads: 2,
    };
    let tree = DirTree::open(&state, 4096, CS).unwrap();
    let t0 = Instant::now();
    let per_dir = 1000;
    for d in 0..files.div_ceil(per_dir) {
        let dir = tree.root().join(format!("d{d:04}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..per_dir.min(files - d * per_dir) {
            let i = d * per_dir + f;
            let len = if i % 100 == 0 {
                65536
            } else {
                1024 + (i % 8) * 1024
            };
            let mut body = format!("file {i}\n").into_bytes();
            body.resize(len, b'x');
            std::fs::write(dir.join(format!("f{f:04}")), body).unwrap();
        }
    }
    let made = t0.elapsed();
    let mut p = Persister::open(&state, Repo::new(remote.clone(), "ws"), params.clone()).unwrap();
    p.set_body_opener(Some(tree.opener()));
    let t1 = Instant::now();
    let first_walk = tree.scan().unwrap();
    let w1 = t1.elapsed();
    let r1 = p.checkpoint(&CheckpointOptions::default()).unwrap();
    let c1 = t1.elapsed() - w1;
    println!(
        "dir bench: {files} files made in {:.1}s; first walk {:.0} ms ({first_walk}), first checkpoint {:.0} ms ({r1})",
        made.as_secs_f64(),
        ms(w1),
        ms(c1)
    );
    // Files written just now are looked at once more by the next walk (same clock tick):
    // settle them before measuring.
    tree.scan().unwrap();
    p.checkpoint(&CheckpointOptions::default()).unwrap();
    let (mut walks, mut cps, mut bares) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..5 {
        let target = tree.root().join(format!(
            "d{:04}/f{:04}",
            (round * 7) % files.div_ceil(per_dir),
            3
        ));
        std::fs::write(&target, format!("changed in round {round}\n").repeat(300)).unwrap();
        let t = Instant::now();
        let w = tree.scan().unwrap();
        let walk = t.elapsed();
        let r = p.checkpoint(&CheckpointOptions::default()).unwrap();
        let cp = t.elapsed() - walk;
        assert!(w.changed >= 1 && w.rewritten == 1, "{w}");
        assert!(r.seq.is_some(), "{r}");
        let t = Instant::now();
        let n = bare_walk(tree.root());
        bares.push(ms(t.elapsed()));
        assert!(n as usize >= files);
        walks.push(ms(walk));
        cps.push(ms(cp));
        // The changed file is within the clock tick of this walk: settled by the next.
        tree.scan().unwrap();
        p.checkpoint(&CheckpointOptions::default()).unwrap();
    }
    let (walk, cp, bare) = (median(walks), median(cps), median(bares));
    println!("| files | walk (ms) | checkpoint after it (ms) | walk + checkpoint (ms) | bare lstat walk (ms) | walk / bare |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {files} | {walk:.0} | {cp:.0} | {:.0} | {bare:.0} | {:.2}x |",
        walk + cp,
        walk / bare
    );
    // With change notification: the periodic walk lists the changed directory only.
    tree.watch().unwrap();
    tree.scan().unwrap(); // full: watches every directory
    let (mut nwalks, mut ncps) = (Vec::new(), Vec::new());
    for round in 0..5 {
        let target = tree.root().join(format!(
            "d{:04}/f{:04}",
            (round * 11 + 3) % files.div_ceil(per_dir),
            5
        ));
        std::fs::write(&target, format!("notified in round {round}\n").repeat(300)).unwrap();
        let t = Instant::now();
        let w = tree.scan_changed().unwrap();
        let walk = t.elapsed();
        let r = p.checkpoint(&CheckpointOptions::default()).unwrap();
        let cp = t.elapsed() - walk;
        assert!(w.narrowed && w.rewritten == 1, "{w}");
        assert!(r.seq.is_some(), "{r}");
        nwalks.push(ms(walk));
        ncps.push(ms(cp));
    }
    let (nwalk, ncp) = (median(nwalks), median(ncps));
    println!("| files | walk with inotify (ms) | checkpoint after it (ms) | walk + checkpoint (ms) | dirs watched |");
    println!("|---|---|---|---|---|");
    println!(
        "| {files} | {nwalk:.1} | {ncp:.1} | {:.1} | {} |",
        nwalk + ncp,
        tree.watched().unwrap_or(0)
    );
    if std::env::var_os("DIR_BENCH_NO_RESTORE").is_some() {
        return;
    }
    // A fresh host: restore (eager) and build the tree.
    let fresh = tmp.path().join("fresh");
    std::fs::create_dir(&fresh).unwrap();
    let t = Instant::now();
    let mut repo = Repo::new(remote, "ws");
    restore::restore_for_mount(&mut repo, &fresh, RestoreMode::Eager, CS).unwrap();
    let restored = t.elapsed();
    let _t2 = DirTree::open(&fresh, 4096, CS).unwrap();
    let built = t.elapsed() - restored;
    println!(
        "fresh state dir, {files} files: restore (eager, file:// remote) {:.1}s + tree built {:.1}s = {:.1}s",
        restored.as_secs_f64(),
        built.as_secs_f64(),
        (restored + built).as_secs_f64()
    );
}

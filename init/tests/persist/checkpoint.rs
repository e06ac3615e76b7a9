//! Checkpoint behaviour measured through the remote trait: incrementality (one changed file
//! of 10,000 costs O(that file) bytes), dedup (two identical 64 MiB files cost one set of
//! chunks), corruption (a flipped byte in a stored chunk fails restore naming the chunk, fsck
//! reports it and `--repair` re-uploads it from local bytes), gc with retention and grace, and
//! a remote that fails at every possible step of a checkpoint (backlog reported, nothing lost
//! once it is back).

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use keel::persist::fsck::{fsck, FsckOptions, Level};
use keel::persist::{gc, restore, FsRemote, MemRemote, Remote, Repo};
use support::persist::*;

fn restore_dump(remote: Arc<dyn Remote>) -> std::collections::BTreeMap<String, String> {
    let dir = tempfile::tempdir().unwrap();
    let mut repo = Repo::new(remote, "ws");
    restore::restore(&mut repo, None, dir.path()).expect("restore");
    dump(&open_fs(dir.path()))
}

#[test]
fn one_changed_file_of_10000_uploads_o1_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    for d in 0..100 {
        mkdir(&fs, &format!("d{d}"));
        for f in 0..99 {
            write_file(
                &fs,
                &format!("d{d}/f{f}"),
                &noise(d * 1000 + f, 100 + (f as usize * 37) % 2000),
            );
        }
    }
    for b in 0..100 {
        write_file(&fs, &format!("d{b}/body"), &noise(b, 200_000));
    }
    let remote = counted(Arc::new(MemRemote::new()));
    let mut p = persister(dir.path(), remote.clone());
    let c0 = remote.counts();
    let r = checkpoint(&mut p);
    let cold = remote.counts().since(&c0);
    assert!(r.full, "{r}");
    assert_eq!(r.inodes, 10_101, "{r}");
    assert!(
        cold.bytes_put > 20_000_000,
        "cold checkpoint uploaded only {} bytes",
        cold.bytes_put
    );

    // One small file changes: the upload is a delta of that one inode.
    write_file(&fs, "d42/f7", b"changed");
    let c1 = remote.counts();
    let r = checkpoint(&mut p);
    let inc = remote.counts().since(&c1);
    assert!(!r.full, "{r}");
    assert_eq!(r.inodes, 1, "{r}");
    assert!(
        inc.bytes_put < 2_000,
        "one small file cost {} bytes: {r}",
        inc.bytes_put
    );
    assert_eq!(inc.puts, 2, "snapshot + head: {inc:?}");

    // 4 KiB inside one 200 KB body: one chunk window plus a small delta.
    let ino = resolve(&fs, "d7/body");
    write_at(&fs, ino, 70_000, &[7u8; 4096]);
    let c2 = remote.counts();
    let r = checkpoint(&mut p);
    let inc = remote.counts().since(&c2);
    assert_eq!((r.windows_hashed, r.chunks_uploaded), (1, 1), "{r}");
    assert!(
        inc.bytes_put < CHUNK + 2_000,
        "one window cost {} bytes: {r}",
        inc.bytes_put
    );

    // The same 4 KiB back to what they were (a branch switched back): the window's chunk is
    // on the remote already; a store no other workspace shares needs no upload at all.
    write_at(&fs, ino, 70_000, &noise(7, 200_000)[70_000..74_096]);
    let c3 = remote.counts();
    let r = checkpoint(&mut p);
    let inc = remote.counts().since(&c3);
    assert_eq!(r.windows_hashed, 1, "{r}");
    assert_eq!((r.chunks_uploaded, r.chunks_refreshed), (0, 0), "{r}");
    assert!(inc.bytes_put < 2_000, "a reverted window cost {inc:?}: {r}");
    assert_eq!(restore_dump(remote.clone()), dump(&fs));
}

#[test]
fn identical_64mib_files_cost_one_set_of_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let data = noise(64, 64 << 20);
    write_file(&fs, "a", &data);
    mkdir(&fs, "sub");
    write_file(&fs, "sub/b", &data);
    let remote = counted(Arc::new(MemRemote::new()));
    let mut p = persister(dir.path(), remote.clone());
    let r = checkpoint(&mut p);
    let n = (64 << 20) / CHUNK;
    assert_eq!(r.windows_hashed, 2 * n, "{r}");
    assert_eq!(r.chunks_uploaded, n, "{r}");
    assert_eq!(r.chunk_bytes_uploaded, 64 << 20, "{r}");
    let chunk_objects = Repo::new(remote.clone(), "ws").list_chunks().unwrap().len() as u64;
    assert_eq!(chunk_objects, n);
    assert!(remote.counts().bytes_put < (64 << 20) + 200_000);
}

#[test]
fn corrupt_chunk_fails_restore_and_fsck_then_repair_reuploads() {
    let dir = tempfile::tempdir().unwrap();
    let rdir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    write_file(&fs, "f", &noise(9, 5 * CHUNK as usize));
    let fsr = Arc::new(FsRemote::open(rdir.path()).unwrap());
    let remote: Arc<dyn Remote> = fsr.clone();
    let mut p = persister(dir.path(), remote.clone());
    checkpoint(&mut p);
    drop(fs);
    let repo = Repo::new(remote.clone(), "ws");
    let (id, info) = repo.list_chunks().unwrap().into_iter().nth(2).unwrap();
    let path = rdir.path().join(&info.key);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[1234] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();

    let target = tempfile::tempdir().unwrap();
    let err = restore::restore(&mut repo.clone(), None, target.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&id.to_hex()) && err.contains("corrupt"),
        "{err}"
    );

    let opts = |repair| FsckOptions {
        repair,
        quick: false,
        chunk_size: CHUNK,
        remote: Some(repo.clone()),
        missing_remote: None,
    };
    let rep = fsck(dir.path(), &opts(false)).unwrap();
    assert!(!rep.is_clean());
    let errs: Vec<_> = rep
        .findings
        .iter()
        .filter(|f| f.level == Level::Error)
        .collect();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].what.contains(&id.to_hex()), "{errs:?}");
    // --repair: the local body still has the right bytes, so the chunk is uploaded again.
    let rep = fsck(dir.path(), &opts(true)).unwrap();
    assert!(rep.is_clean(), "{:?}", rep.findings);
    assert!(fsck(dir.path(), &opts(false)).unwrap().findings.is_empty());
    restore::restore(&mut repo.clone(), None, target.path()).expect("restore after repair");
}

/// `keel fsck`'s line says what it checked of the remote: the chunks of a `file://` remote
/// it verified; "not checked" with `--no-remote`; and a configured `file://` remote that is
/// not there (not mounted in this container, moved) is an error once something was
/// checkpointed to it, not a clean "0 remote chunks verified".
#[test]
fn fsck_says_what_it_checked_of_a_file_remote() {
    let dir = tempfile::tempdir().unwrap();
    let (state, remote) = (dir.path().join("state"), dir.path().join("remote"));
    keel::state::private::create_dir_all(&state).unwrap();
    let fs = open_fs(&state);
    write_file(&fs, "big", &noise(11, 3 * CHUNK as usize));
    let url = format!("file://{}", remote.display());
    let repo = keel::persist::open_remote(&url, &Default::default()).unwrap();
    let mut p = keel::persist::Persister::open(&state, repo, params()).unwrap();
    checkpoint(&mut p);
    drop(p);
    drop(fs);
    let config = dir.path().join("config.toml");
    std::fs::write(&config, format!("[persist]\nremote = \"{url}\"\n")).unwrap();
    let fsck = |extra: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["fsck", "--config"])
            .arg(&config)
            .arg("--state")
            .arg(&state)
            .args(extra)
            .output()
            .unwrap();
        let text =
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
        (o.status.code(), text)
    };
    let (code, out) = fsck(&[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(", 3 remote chunks verified; 0 errors"),
        "{out}"
    );
    let (code, out) = fsck(&["--no-remote"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("the remote not checked; 0 errors"), "{out}");
    // The remote elsewhere: an error naming it, nothing created at its path.
    std::fs::rename(&remote, dir.path().join("moved")).unwrap();
    let (code, out) = fsck(&[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!(
            "error: remote {url} is not there, but snapshot 1 was checkpointed to it"
        )),
        "{out}"
    );
    assert!(out.contains("the remote not checked; 1 errors"), "{out}");
    assert!(!remote.exists(), "fsck created the missing remote");
}

#[test]
fn gc_keeps_retained_snapshots_and_their_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let mem = Arc::new(MemRemote::new());
    let remote: Arc<dyn Remote> = mem.clone();
    let mut p = persister(dir.path(), remote.clone());
    write_file(&fs, "old", &noise(1, 3 * CHUNK as usize));
    checkpoint(&mut p);
    let old = resolve(&fs, "old");
    fs.unlink(keel::meta::InodeNo::ROOT, b"old").unwrap();
    // The kernel forgets the inode: now it is gone.
    fs.forget(old, u64::MAX);
    for i in 0..4u64 {
        write_file(&fs, &format!("new{i}"), &noise(100 + i, 2 * CHUNK as usize));
        checkpoint(&mut p);
    }
    // A compaction, then one more delta: the two kept snapshots need nothing older.
    write_file(&fs, "last", b"x");
    let full = p
        .checkpoint(&keel::persist::CheckpointOptions {
            full: true,
            ..Default::default()
        })
        .unwrap();
    write_file(&fs, "last", b"y");
    let delta = checkpoint(&mut p);
    let mut repo = Repo::new(remote.clone(), "ws");
    assert_eq!(repo.list_chunks().unwrap().len(), 3 + 8);
    // Everything is young: nothing goes. The 5 dropped snapshots are left for later, and
    // the 3 chunks only they name are kept with them (a young dropped snapshot can still
    // be read, or forked, whole until it goes).
    let r = gc::gc(&mut repo, Some(p.store()), 2, Duration::from_secs(600)).unwrap();
    assert_eq!((r.chunks_deleted, r.snapshots_deleted), (0, 0), "{r}");
    assert_eq!(r.young_skipped, 5, "{r}");
    mem.age_all(Duration::from_secs(3600));
    let r = gc::gc(&mut repo, Some(p.store()), 2, Duration::from_secs(600)).unwrap();
    assert_eq!(
        (r.chunks_deleted, r.snapshots_deleted, r.chunks_kept),
        (3, 5, 8),
        "{r}"
    );
    let left: Vec<u64> = repo
        .list_snapshots()
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(left, vec![full.seq.unwrap(), delta.seq.unwrap()]);
    // A retained delta whose chain reaches further back keeps that chain.
    write_file(&fs, "more", &noise(7, CHUNK as usize));
    checkpoint(&mut p);
    mem.age_all(Duration::from_secs(3600));
    let r = gc::gc(&mut repo, Some(p.store()), 1, Duration::from_secs(600)).unwrap();
    assert_eq!(r.snapshots_kept, 3, "{r}");
    for (s, _) in repo.list_snapshots().unwrap() {
        repo.load_tree(s)
            .unwrap_or_else(|e| panic!("snapshot {s} unreadable after gc: {e}"));
    }
    assert_eq!(restore_dump(remote.clone()), dump(&fs));
}

#[test]
fn remote_failing_at_every_step_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let mem = Arc::new(MemRemote::new());
    let remote: Arc<dyn Remote> = mem.clone();
    let mut p = persister(dir.path(), remote.clone());
    build_rich_tree(&fs);
    checkpoint(&mut p);
    for k in 0..12u64 {
        write_file(&fs, &format!("f{k}"), &noise(k, (k as usize + 1) * 20_000));
        write_at(&fs, resolve(&fs, "d/e/big"), k * 10_000, b"again");
        mem.fail_after(Some(k));
        let res = p.checkpoint(&Default::default());
        mem.fail_after(None);
        if res.is_err() {
            let b = p.backlog().unwrap();
            assert!(
                b.files >= 2 && b.bytes > 0,
                "after failing at step {k}: {b}"
            );
        }
        // The next checkpoint carries everything the failed one claimed.
        checkpoint(&mut p);
        assert_eq!(p.backlog().unwrap().inodes, 0);
        assert_eq!(
            restore_dump(remote.clone()),
            dump(&fs),
            "after failing at step {k}"
        );
    }
    let rep = fsck(
        dir.path(),
        &FsckOptions {
            repair: false,
            quick: false,
            chunk_size: CHUNK,
            remote: Some(Repo::new(remote, "ws")),
            missing_remote: None,
        },
    )
    .unwrap();
    assert!(
        rep.findings.iter().all(|f| f.level != Level::Error),
        "{:?}",
        rep.findings
    );
}

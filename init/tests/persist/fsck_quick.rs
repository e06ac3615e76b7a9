//! `keel fsck --quick` checks a sample whose size does not grow with the workspace; each
//! thing it claims to check is broken here once and must be reported: the running totals
//! against the last snapshot's header, an entry naming a missing inode in a directory
//! changed since the checkpoint, the root's link count, a missing and a damaged body, a
//! missing remote chunk, a snapshot missing from the head's chain.

use crate::support;

use std::path::Path;
use std::sync::Arc;

use keel::chunk::BodyStore;
use keel::persist::fsck::{fsck, FsckOptions, FsckReport, Level};
use keel::persist::{FsRemote, Remote, Repo};
use support::persist::*;

fn quick(state: &Path, repo: &Repo) -> FsckReport {
    let rep = fsck(
        state,
        &FsckOptions {
            repair: false,
            quick: true,
            chunk_size: CHUNK,
            remote: Some(repo.clone()),
            missing_remote: None,
        },
    )
    .unwrap();
    assert!(rep.sample.is_some(), "--quick reports what it sampled");
    rep
}

fn has(rep: &FsckReport, level: Level, text: &str) -> bool {
    rep.findings
        .iter()
        .any(|f| f.level == level && f.what.contains(text))
}

fn sql(state: &Path, stmt: &str) {
    let c = rusqlite::Connection::open(state.join(keel::state::META_DB)).unwrap();
    c.execute_batch(stmt).unwrap();
}

#[test]
fn quick_fsck_reports_what_it_claims_to_check() {
    let dir = tempfile::tempdir().unwrap();
    let rdir = tempfile::tempdir().unwrap();
    let state = dir.path();
    for d in [state, rdir.path()] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let fs = open_fs(state);
    for d in 0..10 {
        mkdir(&fs, &format!("d{d}"));
        for f in 0..20 {
            write_file(&fs, &format!("d{d}/f{f}"), &noise(d * 100 + f, 100));
        }
    }
    let big = write_file(&fs, "big", &noise(7, 3 * CHUNK as usize));
    let remote: Arc<dyn Remote> = Arc::new(FsRemote::open(rdir.path()).unwrap());
    let repo = Repo::new(remote.clone(), "ws");
    let mut p = persister(state, remote.clone());
    checkpoint(&mut p);

    let rep = quick(state, &repo);
    assert!(rep.findings.is_empty(), "{:?}", rep.findings);
    assert_eq!(
        rep.windows_hashed, 3,
        "the root's body file is always in the sample"
    );
    assert_eq!(rep.chunks_checked, 3);
    assert_eq!(rep.sample.as_ref().unwrap().snapshots, 1);

    // The running totals no longer match the snapshot of a checkpoint with nothing since.
    sql(state, "UPDATE inode_totals SET live = live + 1");
    let rep = quick(state, &repo);
    assert!(
        has(&rep, Level::Warning, "the last checkpoint's snapshot"),
        "{:?}",
        rep.findings
    );
    sql(state, "UPDATE inode_totals SET live = live - 1");

    // A body window damaged behind keel's back, then the body gone.
    let bodies = BodyStore::open(&state.join(keel::state::BODIES)).unwrap();
    let path = bodies.path(big.0);
    let good = std::fs::read(&path).unwrap();
    let mut bad = good.clone();
    bad[CHUNK as usize + 5] ^= 1;
    std::fs::write(&path, &bad).unwrap();
    let rep = quick(state, &repo);
    assert!(
        has(&rep, Level::Error, "window 1 no longer matches"),
        "{:?}",
        rep.findings
    );
    std::fs::write(&path, &good).unwrap();
    let moved = state.join("aside");
    std::fs::rename(&path, &moved).unwrap();
    let rep = quick(state, &repo);
    assert!(
        has(&rep, Level::Error, "body file is missing"),
        "{:?}",
        rep.findings
    );
    std::fs::rename(&moved, &path).unwrap();

    // A chunk of a sampled file missing on the remote.
    let (id, info) = repo.list_chunks().unwrap().into_iter().next().unwrap();
    let chunk = rdir.path().join(&info.key);
    let aside = rdir.path().join("aside");
    std::fs::rename(&chunk, &aside).unwrap();
    let rep = quick(state, &repo);
    assert!(
        has(
            &rep,
            Level::Error,
            &format!("chunk {id} is referenced but missing")
        ),
        "{:?}",
        rep.findings
    );
    std::fs::rename(&aside, &chunk).unwrap();

    // A second checkpoint (a delta on the first): losing the full snapshot breaks the chain.
    write_file(&fs, "d2/new", b"x");
    checkpoint(&mut p);
    let full = rdir.path().join(repo.snapshot_key(1));
    std::fs::rename(&full, &aside).unwrap();
    let rep = quick(state, &repo);
    assert!(
        has(&rep, Level::Error, "snapshot 1 (in the chain of 2)"),
        "{:?}",
        rep.findings
    );
    std::fs::rename(&aside, &full).unwrap();
    let rep = quick(state, &repo);
    assert!(rep.findings.is_empty(), "{:?}", rep.findings);

    // An entry naming a missing inode, in a directory changed since the checkpoint (so in
    // the sample whatever the random draw), and the root's link count off by one.
    write_file(&fs, "d5/changed", b"y");
    let victim = resolve(&fs, "d5/f3");
    drop(p);
    drop(fs);
    sql(
        state,
        &format!("DELETE FROM inode WHERE ino = {}", victim.0),
    );
    sql(state, "UPDATE inode SET nlink = nlink + 1 WHERE ino = 1");
    let rep = quick(state, &repo);
    assert!(
        has(
            &rep,
            Level::Error,
            &format!(
                "entry `f3` in directory {} names missing inode {}",
                resolve_dir(state, "d5"),
                victim.0
            )
        ),
        "{:?}",
        rep.findings
    );
    assert!(
        has(&rep, Level::Error, "directory 1 has nlink 13 but 12 links"),
        "{:?}",
        rep.findings
    );
    assert!(!rep.is_clean());
}

/// The inode of a top-level directory, read from the database (the workspace is closed).
fn resolve_dir(state: &Path, name: &str) -> u64 {
    let c = rusqlite::Connection::open(state.join(keel::state::META_DB)).unwrap();
    c.query_row(
        "SELECT ino FROM dirent WHERE parent = 1 AND name = ?1",
        [name.as_bytes()],
        |r| r.get::<_, i64>(0),
    )
    .unwrap() as u64
}

//! A fresh host's restore, without a kernel: the bulk-written database keeps the running
//! totals right (fsck clean, totals equal to a count of the rows) and its triggers and
//! indexes working afterwards; and a restore that dies before its database is in place
//! leaves a state dir that is never taken for a workspace, that fsck calls clean (saying
//! what it is) and that the next restore recognises and starts over.

use crate::support;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use keel::meta::{Nanos, Store};
use keel::persist::fsck::{fsck, FsckOptions};
use keel::persist::restore::{self, RestoreMode};
use keel::persist::{MemRemote, Remote, Repo};
use keel::state::RESTORE_UNFINISHED as UNFINISHED;
use support::persist::*;

/// A remote holding the rich tree plus a directory of 300 small files, and its dump.
fn source() -> (
    tempfile::TempDir,
    Arc<dyn Remote>,
    std::collections::BTreeMap<String, String>,
) {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let fs = open_fs(dir.path());
    build_rich_tree(&fs);
    mkdir(&fs, "many");
    for i in 0..300 {
        write_file(&fs, &format!("many/f{i}"), format!("file {i}").as_bytes());
    }
    let mut p = persister(dir.path(), remote.clone());
    checkpoint(&mut p);
    // A delta on top, so the restore replays a chain.
    write_file(&fs, "after", &noise(9, 3 * CHUNK as usize));
    checkpoint(&mut p);
    let d = dump(&fs);
    (dir, remote, d)
}

fn fsck_clean(state: &Path, remote: &Arc<dyn Remote>) {
    let rep = fsck(
        state,
        &FsckOptions {
            repair: false,
            quick: false,
            chunk_size: CHUNK,
            remote: Some(Repo::new(remote.clone(), "ws")),
            missing_remote: None,
        },
    )
    .unwrap();
    assert!(rep.is_clean(), "fsck after restore: {:?}", rep.findings);
}

#[test]
fn bulk_restore_keeps_totals_right_and_triggers_working() {
    let (_src, remote, want) = source();
    for mode in [RestoreMode::Lazy, RestoreMode::Eager] {
        let dir = tempfile::tempdir().unwrap();
        let r = restore::restore_with(&mut Repo::new(remote.clone(), "ws"), None, dir.path(), mode)
            .unwrap();
        assert!(r.inodes > 300, "{r:?}");
        assert_eq!(
            r.windows_missing > 0,
            mode == RestoreMode::Lazy,
            "{mode:?}: {r:?}"
        );
        assert!(!dir.path().join(UNFINISHED).exists());
        assert!(!dir.path().join(keel::state::META_DB_RESTORING).exists());
        {
            let store = Store::open(&dir.path().join(keel::state::META_DB), Nanos(0)).unwrap();
            let (counted, kept) = store.read().inode_totals_both().unwrap();
            assert_eq!(counted, kept, "{mode:?}: totals (rows, live, bytes)");
            assert_eq!(counted[0], r.inodes, "{mode:?}");
            // Nothing is recorded as changed: the tree is the remote's.
            let tx = store.read();
            assert!(tx.unclaimed_changes().unwrap().is_empty(), "{mode:?}");
            // The triggers came back: an entry added now is recorded, and deleting an
            // inode drops its chunk map and missing windows and updates the totals.
            let ino = keel::meta::InodeNo(r.inodes + 1000);
            drop(tx);
            let tx = store.write().unwrap();
            let big = tx
                .lookup(keel::meta::InodeNo::ROOT, b"after")
                .unwrap()
                .unwrap()
                .ino;
            tx.link(
                keel::meta::InodeNo::ROOT,
                b"new",
                ino,
                keel::meta::Kind::File,
            )
            .unwrap();
            let before = tx.live_totals().unwrap();
            let size = tx.get(big).unwrap().unwrap().size;
            tx.delete(big).unwrap();
            assert_eq!(tx.live_totals().unwrap(), (before.0 - 1, before.1 - size));
            assert!(tx.file_chunks(big).unwrap().is_empty(), "{mode:?}");
            assert!(tx.missing_windows(big).unwrap().is_empty(), "{mode:?}");
            assert_eq!(tx.unclaimed_changes().unwrap().dirents, 1, "{mode:?}");
            // (rolled back on drop)
        }
        fsck_clean(dir.path(), &remote);
        if mode == RestoreMode::Eager {
            // (Lazy: reading needs the fetcher a mount wires up; persist_lazy covers it.)
            assert_eq!(dump(&open_fs(dir.path())), want);
        }
    }
}

#[test]
fn a_restore_that_dies_midway_is_never_a_workspace_and_is_redone() {
    let (_src, remote, want) = source();
    let dir = tempfile::tempdir().unwrap();
    // Dies (a panic: nothing cleans up, as after SIGKILL) while fetching chunks.
    let dying = Tap::new(remote.clone(), |op, key| {
        // The chain's snapshot objects come by get_many too: only a chunk's fetch dies.
        if op == "get_many" && key.contains("/chunks/") {
            panic!("killed while fetching");
        }
    });
    let died = catch_unwind(AssertUnwindSafe(|| {
        restore::restore_with(
            &mut Repo::new(dying, "ws"),
            None,
            dir.path(),
            RestoreMode::Eager,
        )
    }));
    assert!(died.is_err(), "the tap did not fire");
    assert!(dir.path().join(UNFINISHED).exists());
    assert!(dir.path().join(keel::state::BODIES).exists());
    assert!(
        !dir.path().join(keel::state::META_DB).exists(),
        "a half-restored state dir must not look like a workspace"
    );
    // As if it had also died while writing the database.
    std::fs::write(
        dir.path().join(keel::state::META_DB_RESTORING),
        b"SQLite format 3\0half",
    )
    .unwrap();
    std::fs::write(dir.path().join("meta.db.restoring-journal"), b"x").unwrap();
    // fsck of the state dir as the kill left it: nothing is damaged, it says what it is.
    let rep = fsck(
        dir.path(),
        &FsckOptions {
            repair: false,
            quick: false,
            chunk_size: CHUNK,
            remote: Some(Repo::new(remote.clone(), "ws")),
            missing_remote: None,
        },
    )
    .expect("fsck of a state dir whose restore was killed");
    assert!(rep.is_clean(), "{:?}", rep.findings);
    assert!(
        rep.findings.iter().any(|f| f
            .what
            .contains("restore into this state dir did not finish")),
        "{:?}",
        rep.findings
    );

    let r = restore::restore_with(
        &mut Repo::new(remote.clone(), "ws"),
        None,
        dir.path(),
        RestoreMode::Eager,
    )
    .expect("the next restore starts over");
    assert!(r.chunks_fetched > 0, "{r:?}");
    for gone in [UNFINISHED, "meta.db.restoring", "meta.db.restoring-journal"] {
        assert!(!dir.path().join(gone).exists(), "{gone} left behind");
    }
    fsck_clean(dir.path(), &remote);
    assert_eq!(dump(&open_fs(dir.path())), want);
}

#[test]
fn a_failed_restore_empties_the_state_dir_and_a_foreign_one_is_left_alone() {
    let (_src, remote, _) = source();
    // A failure (not a crash): what it wrote is removed, marker included.
    let dir = tempfile::tempdir().unwrap();
    let broken: Arc<dyn Remote> = Arc::new(MemRemote::new());
    for k in remote.list("").unwrap() {
        if !k.key.contains("chunk") {
            broken
                .put(
                    &k.key,
                    remote.get(&k.key).unwrap(),
                    keel::persist::remote::PutMode::Overwrite,
                )
                .unwrap();
        }
    }
    let e = restore::restore_with(
        &mut Repo::new(broken, "ws"),
        None,
        dir.path(),
        RestoreMode::Eager,
    )
    .expect_err("chunks are missing");
    assert!(e.to_string().contains("fetch chunk"), "{e}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    // Leftovers without the marker are not a restore's: refused, untouched.
    std::fs::create_dir(dir.path().join(keel::state::BODIES)).unwrap();
    std::fs::write(dir.path().join("bodies/keep"), b"mine").unwrap();
    let e = restore::restore_with(
        &mut Repo::new(remote, "ws"),
        None,
        dir.path(),
        RestoreMode::Lazy,
    )
    .expect_err("not empty");
    assert!(e.to_string().contains("not empty"), "{e}");
    assert_eq!(
        std::fs::read(dir.path().join("bodies/keep")).unwrap(),
        b"mine"
    );
    assert!(!dir.path().join(UNFINISHED).exists());
}

//! The `dir` provider's change notification (inotify): a periodic walk narrowed to the
//! directories something happened in still brings every change into the snapshot — a file
//! under a new directory, a rename across directories, an unlink, a chmod and an xattr
//! change, a write through a shared mapping kept open across the checkpoint — and what it
//! cannot follow (an overflowed event queue, a directory moved) falls back to the full
//! walk. Each case restores the snapshot into a fresh (FUSE provider's) store and compares
//! it with the tree by a manifest of contents, modes, owners, links, xattrs and mtimes.

use crate::support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use keel::persist::{MemRemote, Persister, Remote};
use keel::workspace::dir::DirTree;
use support::persist::*;

use super::dir_provider::{
    dir_persister, fs_manifest, host_manifest, restore_eager, set_mtime, xattr_set,
};

struct Fixture {
    _state: tempfile::TempDir,
    tree: DirTree,
    remote: Arc<dyn Remote>,
    p: Persister,
}

/// A small tree, watched, walked in full and checkpointed; every mtime set well in the
/// past so that no file is within a walk's clock tick.
fn fixture() -> Fixture {
    fixture_with(|_| {})
}

/// [`fixture`], with `before_watch` called on the tree's root once it is written and
/// backdated, before change notification starts.
fn fixture_with(before_watch: impl FnOnce(&Path)) -> Fixture {
    let state = tempfile::tempdir().unwrap();
    let tree = DirTree::open(state.path(), 4096, CHUNK).unwrap();
    let root = tree.root().to_path_buf();
    for d in ["a", "b", "c/deep"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for (i, f) in ["a/x", "a/y", "b/z", "c/deep/w", "top"].iter().enumerate() {
        std::fs::write(root.join(f), format!("file {i}\n").repeat(200 * (i + 1))).unwrap();
    }
    std::fs::write(root.join("a/big"), vec![7u8; 100_000]).unwrap();
    super::dir_provider::backdate(&root);
    before_watch(&root);
    tree.watch().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let mut p = dir_persister(state.path(), remote.clone(), &tree);
    let r = tree.scan().unwrap();
    assert!(!r.narrowed, "{r}");
    assert!(checkpoint(&mut p).seq.is_some());
    assert_eq!(tree.watched(), Some(5), "root, a, b, c, c/deep");
    Fixture {
        _state: state,
        tree,
        remote,
        p,
    }
}

impl Fixture {
    fn root(&self) -> &Path {
        self.tree.root()
    }

    /// The periodic walk and a checkpoint; the walk's report.
    fn periodic(&mut self) -> keel::workspace::dir::ScanReport {
        let r = self.tree.scan_changed().unwrap();
        let c = checkpoint(&mut self.p);
        assert!(c.seq.is_some(), "{r}; {c}");
        r
    }

    /// The last snapshot, restored into a fresh store, is the tree as it is.
    fn assert_snapshot_is_the_tree(&self) {
        let fresh = tempfile::tempdir().unwrap();
        restore_eager(self.remote.clone(), fresh.path());
        let fs = open_fs(fresh.path());
        assert_eq!(fs_manifest(&fs), host_manifest(self.root()));
    }
}

#[test]
fn a_file_under_a_new_directory_reaches_the_snapshot() {
    let mut f = fixture();
    std::fs::create_dir_all(f.root().join("b/new/sub")).unwrap();
    std::fs::write(f.root().join("b/new/sub/n"), b"new file").unwrap();
    std::fs::write(f.root().join("b/new/big"), vec![3u8; 70_000]).unwrap();
    let r = f.periodic();
    assert!(r.narrowed && r.created == 4, "{r}");
    f.assert_snapshot_is_the_tree();
    // The new directories are watched: a change in one is seen by a narrowed walk too.
    std::fs::write(f.root().join("b/new/sub/n"), b"changed").unwrap();
    let r = f.periodic();
    // At least `n`: where some process's open files cannot be read in /proc (a machine
    // whose PID 1 is not dumpable), the new directories are listed whole until the next
    // full walk, and `b/new/big` may count too.
    assert!(r.narrowed && r.rewritten >= 1, "{r}");
    f.assert_snapshot_is_the_tree();
}

#[test]
fn a_rename_across_directories_reaches_the_snapshot() {
    let mut f = fixture();
    std::fs::rename(f.root().join("a/big"), f.root().join("c/deep/moved")).unwrap();
    std::fs::rename(f.root().join("a/x"), f.root().join("b/x2")).unwrap();
    let r = f.periodic();
    assert!(r.narrowed && r.created == 0 && r.removed == 0, "{r}");
    f.assert_snapshot_is_the_tree();
}

#[test]
fn an_unlink_reaches_the_snapshot() {
    let mut f = fixture();
    std::fs::remove_file(f.root().join("c/deep/w")).unwrap();
    std::fs::remove_file(f.root().join("a/big")).unwrap();
    let r = f.periodic();
    assert!(r.narrowed && r.removed == 2, "{r}");
    f.assert_snapshot_is_the_tree();
}

#[test]
fn a_chmod_and_an_xattr_change_reach_the_snapshot() {
    let mut f = fixture();
    std::fs::set_permissions(f.root().join("b/z"), std::fs::Permissions::from_mode(0o600)).unwrap();
    xattr_set(&f.root().join("c/deep/w"), b"user.tag", b"v1");
    std::fs::set_permissions(f.root().join("c"), std::fs::Permissions::from_mode(0o700)).unwrap();
    let r = f.periodic();
    assert!(r.narrowed && r.changed == 3 && r.rewritten == 0, "{r}");
    f.assert_snapshot_is_the_tree();
}

#[test]
fn a_write_through_a_shared_mapping_kept_open_reaches_the_snapshot() {
    let mut f = fixture();
    let len = 100_000;
    // The mapping keeps the file open (no IN_CLOSE_* until it goes).
    let addr = map_shared(&f.root().join("a/big"), len);
    // A walk while it is mapped and not written yet: its directory is listed (a file is
    // open there), nothing changed.
    let r = f.tree.scan_changed().unwrap();
    assert!(r.narrowed && r.dirs == 1 && r.changed == 0, "{r}");
    // Written through the mapping only: no inotify event, the mtime moves at the fault.
    // SAFETY: within the mapping made above, which nothing else uses.
    unsafe { std::ptr::write_bytes(addr.add(70_000), b'M', 1000) };
    let r = f.periodic();
    assert!(r.narrowed && r.rewritten == 1, "{r}");
    f.assert_snapshot_is_the_tree();
    // SAFETY: the mapping made above, not used after this.
    assert_eq!(unsafe { libc::munmap(addr as *mut libc::c_void, len) }, 0);
}

/// A file mapped before keel watched the tree makes no `IN_OPEN` event: its directory is
/// found holding an open file in /proc when the first walk has watched it, and narrowed
/// walks list it while the mapping lasts.
#[test]
fn a_write_through_a_mapping_made_before_the_watch_reaches_a_periodic_snapshot() {
    let len = 100_000;
    let mut addr = std::ptr::null_mut();
    let mut f = fixture_with(|root| addr = map_shared(&root.join("a/big"), len));
    // Written through the mapping only: no inotify event, the mtime moves at the fault.
    // SAFETY: within the mapping made above, which nothing else uses.
    unsafe { std::ptr::write_bytes(addr.add(40_000), b'P', 1000) };
    let r = f.periodic();
    assert!(r.narrowed && r.rewritten == 1, "{r}");
    f.assert_snapshot_is_the_tree();
    // SAFETY: the mapping made above, not used after this.
    assert_eq!(unsafe { libc::munmap(addr.cast(), len) }, 0);
}

/// The same for a directory made, and a file in it mapped, between two walks: the walk
/// that finds the directory watches it only then, after the open.
#[test]
fn a_write_through_a_mapping_made_in_a_new_directory_reaches_a_periodic_snapshot() {
    let mut f = fixture();
    let (dir, len) = (f.root().join("b/new"), 100_000);
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("m"), vec![5u8; len]).unwrap();
    // Out of the walk's clock tick (a file changed within it is looked at again by a walk
    // that lists it, which this one would not without the fix), without waiting.
    set_mtime(&dir.join("m"), 1_600_000_000_000_000_000);
    let addr = map_shared(&dir.join("m"), len);
    let r = f.periodic();
    assert!(r.narrowed && r.created == 2, "{r}");
    // SAFETY: within the mapping made above, which nothing else uses.
    unsafe { std::ptr::write_bytes(addr.add(10), b'N', 1000) };
    let r = f.periodic();
    assert!(r.narrowed && r.rewritten == 1, "{r}");
    f.assert_snapshot_is_the_tree();
    // SAFETY: the mapping made above, not used after this.
    assert_eq!(unsafe { libc::munmap(addr.cast(), len) }, 0);
}

#[test]
fn an_overflowed_event_queue_falls_back_to_the_full_walk() {
    let mut f = fixture();
    let max: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    f.tree.hold_events(true);
    // Each file made is at least 3 events (create, open, close-write): more than the
    // queue holds, so the kernel drops what follows and says it overflowed.
    for i in 0..max / 3 + 100 {
        std::fs::write(f.root().join(format!("a/fill{i}")), b"x").unwrap();
    }
    // A change whose event is lost in the overflow.
    std::fs::set_permissions(f.root().join("b/z"), std::fs::Permissions::from_mode(0o604)).unwrap();
    f.tree.hold_events(false);
    let r = f.periodic();
    assert!(!r.narrowed, "{r}");
    f.assert_snapshot_is_the_tree();
    // Back to narrowed walks afterwards.
    std::fs::write(f.root().join("top"), b"after").unwrap();
    let r = f.periodic();
    assert!(r.narrowed && r.rewritten == 1, "{r}");
    f.assert_snapshot_is_the_tree();
}

#[test]
fn a_moved_directory_falls_back_to_the_full_walk() {
    let mut f = fixture();
    std::fs::rename(f.root().join("c/deep"), f.root().join("b/deep")).unwrap();
    let r = f.periodic();
    assert!(!r.narrowed, "{r}");
    f.assert_snapshot_is_the_tree();
    // The moved directory is watched at its new path.
    std::fs::write(f.root().join("b/deep/w"), b"rewritten").unwrap();
    set_mtime(&f.root().join("b/deep/w"), 1_600_000_000_000_000_000);
    let r = f.periodic();
    assert!(r.narrowed && r.rewritten == 1, "{r}");
    f.assert_snapshot_is_the_tree();
}

/// Maps `len` bytes of the file at `path` shared and writable (the file's descriptor is
/// closed at once: the mapping keeps the file open).
fn map_shared(path: &Path, len: usize) -> *mut u8 {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    support::sys::map_shared(&file, len).unwrap()
}

/// A page written through a mapping, walked, then written again while still dirty (no
/// sync wrote it back in between): the second write makes no fault, so neither time moves,
/// and a walk comparing times would take the file as unchanged for good. Its close (the
/// mapping going, as at a stop) makes the next walk read it again: `narrowed` for a
/// periodic walk, else the full (final) one. The file is inline (its bytes are read by the
/// walk itself); a body file's bytes are read later by the checkpoint, which narrows the
/// window to between that read and the checkpoint's sync.
fn a_dirty_mapped_page_written_again_reaches_the_snapshot(narrowed: bool) {
    // Another test's checkpoint syncs the same filesystem and may write the page back
    // between the two writes (the second then faults and moves the mtime, and there is
    // nothing to show): try again, a few times.
    for _ in 0..5 {
        let mut f = fixture();
        let path = f.root().join("a/x");
        let len = std::fs::metadata(&path).unwrap().len() as usize;
        let addr = map_shared(&path, len);
        // SAFETY: within the mapping made above, which nothing else uses.
        unsafe { std::ptr::write_bytes(addr, b'1', 100) };
        // Out of the walk's clock tick (a file changed within it is looked at again anyway,
        // which would hide what this test is about), without waiting.
        set_mtime(&path, 1_600_000_000_000_000_000);
        // A walk alone (a checkpoint's sync would write the page back).
        let r = f.tree.scan_changed().unwrap();
        assert!(r.narrowed && r.rewritten == 1, "{r}");
        let before = std::fs::metadata(&path).unwrap();
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(addr, b'2', 100) };
        // SAFETY: the mapping made above, not used after this.
        assert_eq!(unsafe { libc::munmap(addr as *mut libc::c_void, len) }, 0);
        let after = std::fs::metadata(&path).unwrap();
        use std::os::unix::fs::MetadataExt;
        if (before.mtime(), before.mtime_nsec()) != (after.mtime(), after.mtime_nsec()) {
            continue;
        }
        let r = if narrowed {
            f.periodic()
        } else {
            let r = f.tree.scan().unwrap();
            assert!(checkpoint(&mut f.p).seq.is_some());
            r
        };
        assert_eq!((r.narrowed, r.rewritten), (narrowed, 1), "{r}");
        f.assert_snapshot_is_the_tree();
        return;
    }
    panic!("the page was written back between the two writes in every try");
}

#[test]
fn a_dirty_mapped_page_written_again_reaches_a_periodic_snapshot() {
    a_dirty_mapped_page_written_again_reaches_the_snapshot(true);
}

#[test]
fn a_dirty_mapped_page_written_again_reaches_the_final_snapshot() {
    a_dirty_mapped_page_written_again_reaches_the_snapshot(false);
}

//! Metadata images (`persist::image`): a fresh host's lazy restore from the full snapshot's
//! image plus the deltas after it writes the same database as decoding the whole chain;
//! a corrupt or missing image falls back to that decode; a snapshot from before images
//! restores; gc removes the images of dropped snapshots; fsck (full and quick) reports a
//! missing or corrupt image.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use keel::meta::{InodeNo, Nanos, Store};
use keel::persist::checkpoint::CheckpointOptions;
use keel::persist::format;
use keel::persist::fsck::{fsck, FsckOptions};
use keel::persist::remote::PutMode;
use keel::persist::restore::{self, RestoreMode, RestoreReport};
use keel::persist::{MemRemote, Remote, Repo};
use keel::state::RESTORE_UNFINISHED as UNFINISHED;
use keel::workspace::fs::{SetAttr, SetTime};
use rusqlite::types::ValueRef;
use support::persist::*;

fn repo(remote: &Arc<dyn Remote>) -> Repo {
    Repo::new(remote.clone(), "ws")
}

/// The image objects on the remote.
fn images(remote: &Arc<dyn Remote>) -> Vec<String> {
    remote
        .list("ws/images/")
        .unwrap()
        .into_iter()
        .map(|i| i.key)
        .collect()
}

/// A remote whose head is a full snapshot (with its image) and 4 deltas that delete,
/// rename, patch windows of, truncate, re-xattr, relink and re-create files.
fn source() -> (tempfile::TempDir, Arc<dyn Remote>) {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let fs = open_fs(dir.path());
    build_rich_tree(&fs);
    mkdir(&fs, "many");
    for i in 0..200 {
        write_file(&fs, &format!("many/f{i}"), format!("file {i}").as_bytes());
    }
    let multi = write_file(&fs, "multi", &noise(3, 4 * CHUNK as usize));
    let mut p = persister(dir.path(), remote.clone());
    let r = checkpoint(&mut p);
    assert!(r.full, "{r}");
    // Delta 1: one window of a multi-window file, a deletion, a rename.
    write_at(&fs, multi, CHUNK + 5, b"patched");
    fs.unlink(InodeNo::ROOT, b"empty").unwrap();
    let many = resolve(&fs, "many");
    fs.rename(many, b"f1", InodeNo::ROOT, b"moved", 0).unwrap();
    assert!(!checkpoint(&mut p).full);
    // Delta 2: truncate (fewer windows), an xattr, a hard link, a new big file.
    let big = resolve(&fs, "d/e/big");
    fs.setattr(
        big,
        &keel::workspace::fs::SetAttr {
            size: Some(CHUNK + 1),
            ..Default::default()
        },
    )
    .unwrap();
    fs.setxattr(ROOT, multi, b"user.new", b"x", 0).unwrap();
    fs.link(multi, many, b"multi-link").unwrap();
    write_file(&fs, "late", &noise(7, 2 * CHUNK as usize + 3));
    assert!(!checkpoint(&mut p).full);
    // Delta 3: a name reused for another inode, a directory removed, inline to body.
    fs.unlink(InodeNo::ROOT, b"moved").unwrap();
    write_file(&fs, "moved", b"again");
    for i in 2..10 {
        fs.unlink(many, format!("f{i}").as_bytes()).unwrap();
    }
    let small = resolve(&fs, "d/small");
    write_at(&fs, small, 0, &noise(9, CHUNK as usize + 9));
    assert!(!checkpoint(&mut p).full);
    // Delta 4: an all-zero file (no stored window: its body is created at restore).
    let z = write_file(&fs, "zeros", b"");
    fs.setattr(
        z,
        &keel::workspace::fs::SetAttr {
            size: Some(3 * CHUNK),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(!checkpoint(&mut p).full);
    assert_eq!(images(&remote).len(), 1);
    (dir, remote)
}

/// Every row of the restored database that describes the workspace, as text (the
/// bookkeeping's `clean_before` is a clock reading).
fn db_dump(state: &Path) -> Vec<String> {
    let c = rusqlite::Connection::open(state.join(keel::state::META_DB)).unwrap();
    let mut out = Vec::new();
    for (t, order) in [
        ("inode", "ino"),
        ("dirent", "parent, name"),
        ("xattr", "ino, name"),
        ("inline_data", "ino"),
        ("symlink", "ino"),
        ("file_chunk", "ino, idx"),
        ("missing_window", "ino, idx"),
        ("inode_totals", "id"),
        ("changed", "ino"),
        ("changed_dirent", "parent, name"),
        ("persist_state", "key"),
        // Not the root page: where a table's pages lie is no part of what it holds.
        (
            "(SELECT type, name, tbl_name, sql FROM sqlite_master
              WHERE type IN ('index', 'trigger'))",
            "name",
        ),
    ] {
        let mut st = c
            .prepare(&format!("SELECT * FROM {t} ORDER BY {order}"))
            .unwrap();
        let n = st.column_count();
        let rows = st
            .query_map([], |r| {
                let mut v = Vec::new();
                for i in 0..n {
                    v.push(match r.get_ref(i)? {
                        ValueRef::Text(t) => String::from_utf8_lossy(t).into_owned(),
                        ValueRef::Blob(b) => b.iter().map(|x| format!("{x:02x}")).collect(),
                        other => format!("{other:?}"),
                    });
                }
                Ok(v.join("|"))
            })
            .unwrap();
        for r in rows {
            let r = r.unwrap();
            if !r.contains("clean_before") {
                out.push(format!("{t}: {r}"));
            }
        }
    }
    out
}

/// Equal dumps, or a failure that shows only the rows in one and not the other.
fn same(a: &[String], b: &[String], what: &str) {
    let only = |x: &[String], y: &[String]| -> Vec<String> {
        x.iter().filter(|r| !y.contains(r)).cloned().collect()
    };
    assert!(
        a == b,
        "{what}: only in the first: {:#?}\nonly in the second: {:#?}",
        only(a, b),
        only(b, a)
    );
}

fn lazy(remote: &Arc<dyn Remote>, state: &Path) -> RestoreReport {
    let r = restore::restore_with(&mut repo(remote), None, state, RestoreMode::Lazy).unwrap();
    assert!(!state.join(UNFINISHED).exists());
    assert!(!state.join(keel::state::META_DB_RESTORING).exists());
    r
}

fn used_image(r: &RestoreReport) -> bool {
    r.phases.iter().any(|(p, _)| *p == "image")
}

fn fell_back(r: &RestoreReport) -> bool {
    r.phases.iter().any(|(p, _)| *p == "image (not used)")
}

fn fsck_of(state: &Path, remote: &Arc<dyn Remote>, quick: bool) -> keel::persist::fsck::FsckReport {
    fsck(
        state,
        &FsckOptions {
            repair: false,
            quick,
            chunk_size: CHUNK,
            remote: Some(repo(remote)),
            missing_remote: None,
        },
    )
    .unwrap()
}

/// The bodies a restore created (name, size), sorted.
fn bodies(state: &Path) -> Vec<(String, u64)> {
    let mut v = Vec::new();
    let Ok(shards) = std::fs::read_dir(state.join(keel::state::BODIES)) else {
        return v;
    };
    for shard in shards {
        let shard = shard.unwrap();
        if shard.file_name() == "pool" {
            continue;
        }
        for f in std::fs::read_dir(shard.path()).unwrap() {
            let f = f.unwrap();
            v.push((
                f.file_name().to_string_lossy().into_owned(),
                f.metadata().unwrap().len(),
            ));
        }
    }
    v.sort();
    v
}

/// A copy of `remote` (a MemRemote) without what `drop_key` names.
fn copy_without(remote: &Arc<dyn Remote>, drop_key: impl Fn(&str) -> bool) -> Arc<dyn Remote> {
    let out: Arc<dyn Remote> = Arc::new(MemRemote::new());
    for i in remote.list("").unwrap() {
        if !drop_key(&i.key) {
            out.put(&i.key, remote.get(&i.key).unwrap(), PutMode::Overwrite)
                .unwrap();
        }
    }
    out
}

#[test]
fn restore_from_the_image_writes_what_decoding_the_chain_writes() {
    let (_src, remote) = source();
    let a = tempfile::tempdir().unwrap();
    let ra = lazy(&remote, a.path());
    assert!(used_image(&ra) && !fell_back(&ra), "{ra:?}");
    let chain_only = copy_without(&remote, |k| k.starts_with("ws/images/"));
    let b = tempfile::tempdir().unwrap();
    let rb = lazy(&chain_only, b.path());
    assert!(!used_image(&rb), "{rb:?}");
    let (da, db) = (db_dump(a.path()), db_dump(b.path()));
    assert!(da.len() > 400, "{}", da.len());
    same(&da, &db, "image restore vs chain restore");
    // A lazy restore writes no body (the all-zero file's included: no pass over every
    // inode to find such files); reads see zeros without one (the first write makes it),
    // and fsck accepts its absence.
    assert_eq!(bodies(a.path()), Vec::new());
    assert_eq!(bodies(b.path()), Vec::new());
    for k in ["inodes", "files", "file_bytes", "windows_missing", "seq"] {
        let f = |r: &RestoreReport| match k {
            "inodes" => r.inodes,
            "files" => r.files,
            "file_bytes" => r.file_bytes,
            "windows_missing" => r.windows_missing,
            _ => r.seq,
        };
        assert_eq!(f(&ra), f(&rb), "{k}: {ra:?} vs {rb:?}");
    }
    let rep = fsck_of(a.path(), &remote, false);
    assert!(rep.findings.is_empty(), "{:?}", rep.findings);
    let rep = fsck_of(a.path(), &remote, true);
    assert!(rep.findings.is_empty(), "quick: {:?}", rep.findings);
    {
        let fs = open_fs(a.path());
        let z = resolve(&fs, "zeros");
        assert_eq!(read_all(&fs, z).unwrap(), vec![0; 3 * CHUNK as usize]);
    }
    assert_eq!(
        bodies(a.path()),
        Vec::new(),
        "the all-zero file's read made a body"
    );
    let rep = fsck_of(a.path(), &remote, false);
    assert!(
        rep.findings.is_empty(),
        "after the open: {:?}",
        rep.findings
    );
    // The copy without images: clean, with a warning that says what is missing.
    let rep = fsck_of(b.path(), &chain_only, false);
    assert!(rep.is_clean(), "{:?}", rep.findings);
    assert_eq!(rep.findings.len(), 1, "{:?}", rep.findings);
    assert!(
        rep.findings[0].what.contains("is missing"),
        "{:?}",
        rep.findings
    );
    // An eager restore (which decodes the chain) has the same inodes.
    let e = tempfile::tempdir().unwrap();
    let re = restore::restore_with(&mut repo(&remote), None, e.path(), RestoreMode::Eager).unwrap();
    assert_eq!(re.inodes, ra.inodes);
    // Eager counts every file with a body; lazy, those with a window to fetch (not the
    // all-zero one).
    assert_eq!(
        (re.files, re.file_bytes),
        (ra.files + 1, ra.file_bytes + 3 * CHUNK),
        "{re:?} vs {ra:?}"
    );
    let store = Store::open(&a.path().join(keel::state::META_DB), Nanos(0)).unwrap();
    let (counted, kept) = store.read().inode_totals_both().unwrap();
    assert_eq!(counted, kept);
    assert_eq!(counted[0], ra.inodes);
}

#[test]
fn a_corrupt_or_missing_image_falls_back_to_the_chain() {
    let (_src, remote) = source();
    let want = {
        let d = tempfile::tempdir().unwrap();
        lazy(
            &copy_without(&remote, |k| k.starts_with("ws/images/")),
            d.path(),
        );
        db_dump(d.path())
    };
    let key = images(&remote).pop().unwrap();
    let mut bytes = remote.get(&key).unwrap().to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    remote
        .put(&key, Bytes::from(bytes), PutMode::Overwrite)
        .unwrap();
    let d = tempfile::tempdir().unwrap();
    let r = lazy(&remote, d.path());
    assert!(fell_back(&r), "{r:?}");
    same(&db_dump(d.path()), &want, "fallback vs chain restore");
    for quick in [false, true] {
        let rep = fsck_of(d.path(), &remote, quick);
        let said = rep
            .findings
            .iter()
            .any(|f| f.what.contains("metadata image"));
        // The quick check compares sizes only (the flip kept it): it sees a missing one.
        assert_eq!(said, !quick, "quick={quick}: {:?}", rep.findings);
        assert!(
            rep.is_clean(),
            "a bad image is a warning: {:?}",
            rep.findings
        );
    }
    remote.delete(&key).unwrap();
    let d = tempfile::tempdir().unwrap();
    let r = lazy(&remote, d.path());
    assert!(fell_back(&r), "{r:?}");
    same(&db_dump(d.path()), &want, "fallback vs chain restore");
    for quick in [false, true] {
        let rep = fsck_of(d.path(), &remote, quick);
        assert!(
            rep.findings
                .iter()
                .any(|f| f.what.contains("metadata image") && f.what.contains("missing")),
            "quick={quick}: {:?}",
            rep.findings
        );
    }
}

#[test]
fn a_snapshot_from_before_images_restores() {
    let (_src, remote) = source();
    // Rewrite the full snapshot as a keel without images wrote it: no image in the header.
    let snaps = repo(&remote).list_snapshots().unwrap();
    let (seq, info) = &snaps[0];
    let (mut h, b) = format::decode(&info.key, &remote.get(&info.key).unwrap()).unwrap();
    assert!(h.is_full() && h.image.is_some(), "{h:?}");
    h.image = None;
    let old = format::encode(&h, &b).unwrap();
    remote
        .put(&info.key, Bytes::from(old), PutMode::Overwrite)
        .unwrap();
    assert!(repo(&remote).read_header(*seq).unwrap().image.is_none());
    let d = tempfile::tempdir().unwrap();
    let r = lazy(&remote, d.path());
    assert!(!used_image(&r) && !fell_back(&r), "{r:?}");
    assert!(r.windows_missing > 0);
    let rep = fsck_of(d.path(), &remote, false);
    assert!(rep.findings.is_empty(), "{:?}", rep.findings);
}

#[test]
fn gc_removes_the_images_of_dropped_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let fs = open_fs(dir.path());
    let mut p = persister(dir.path(), remote.clone());
    let mut fulls = Vec::new();
    for i in 0..3 {
        write_file(&fs, &format!("f{i}"), format!("v{i}").as_bytes());
        let r = p
            .checkpoint(&CheckpointOptions {
                full: true,
                ..Default::default()
            })
            .unwrap();
        assert!(r.full);
        fulls.push(r.seq.unwrap());
    }
    assert_eq!(images(&remote).len(), 3);
    let head = *fulls.last().unwrap();
    let want = keel::persist::image::key(
        &repo(&remote),
        &repo(&remote).read_header(head).unwrap().image.unwrap().hash,
    );
    // Young images are left for the next run (they may be a checkpoint's in progress).
    let r = keel::persist::gc::gc(
        &mut repo(&remote),
        Some(p.store()),
        1,
        Duration::from_secs(3600),
    )
    .unwrap();
    assert_eq!(r.images_deleted, 0);
    let r = keel::persist::gc::gc(&mut repo(&remote), Some(p.store()), 1, Duration::ZERO).unwrap();
    assert_eq!(r.snapshots_deleted, 2, "{r:?}");
    assert_eq!(r.images_deleted, 2, "{r:?}");
    assert_eq!(images(&remote), vec![want]);
    // The kept snapshot still restores from its image.
    let d = tempfile::tempdir().unwrap();
    assert!(used_image(&lazy(&remote, d.path())));
}

/// A lazy restore fetches each object of the chain once: with the image, the deltas whole
/// and the full snapshot's header only; without one (a snapshot from before images), the
/// full snapshot whole too, never the chain's headers a second time (it read every header
/// with one request, then every object again).
#[test]
fn a_lazy_restore_fetches_each_snapshot_object_once() {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    let (_src, remote) = source();
    let chain_len = repo(&remote).list_snapshots().unwrap().len() as u64;
    assert_eq!(chain_len, 5);
    for with_image in [true, false] {
        let inner = if with_image {
            remote.clone()
        } else {
            copy_without(&remote, |k| k.starts_with("ws/images/"))
        };
        let seen: Arc<Mutex<BTreeMap<(String, String), u64>>> = Default::default();
        let s = seen.clone();
        let tap = Tap::new(inner, move |op, key| {
            if key.contains("/snapshots/") {
                *s.lock()
                    .unwrap()
                    .entry((op.into(), key.into()))
                    .or_default() += 1;
            }
        });
        let d = tempfile::tempdir().unwrap();
        let tapped: Arc<dyn Remote> = tap;
        let r = lazy(&tapped, d.path());
        assert_eq!(used_image(&r), with_image, "{r:?}");
        let seen = seen.lock().unwrap();
        let whole: Vec<_> = seen
            .iter()
            .filter(|((op, _), _)| op != "get_range")
            .collect();
        assert!(
            whole.iter().all(|(_, n)| **n == 1),
            "an object fetched twice: {seen:?}"
        );
        // The deltas, and the full snapshot only without an image.
        let want_whole = chain_len - u64::from(with_image);
        assert_eq!(whole.len() as u64, want_whole, "{seen:?}");
        // Headers: the head's and the full snapshot's.
        let ranged: u64 = seen
            .iter()
            .filter(|((op, _), _)| op == "get_range")
            .map(|(_, n)| n)
            .sum();
        assert!(ranged <= 2, "{ranged} header reads: {seen:?}");
    }
}

/// The image of a full snapshot whose build failed (a transient error: here its scratch
/// file cannot be made) is not given up: the next checkpoint with changes writes a full
/// snapshot again, with its image, so fresh restores stop decoding the chain.
#[test]
fn a_failed_image_build_is_retried_by_the_next_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let fs = open_fs(dir.path());
    build_rich_tree(&fs);
    let mut p = persister(dir.path(), remote.clone());
    // The image is built beside the state database: a directory in its place fails it.
    let scratch = dir.path().join("meta.db.image");
    std::fs::create_dir_all(scratch.join("in-the-way")).unwrap();
    let r = checkpoint(&mut p);
    assert!(r.full, "{r}");
    let base = |remote: &Arc<dyn Remote>| {
        let repo = repo(remote);
        let head = repo.read_head().unwrap().unwrap().0.seq;
        let b = repo.read_header(head).unwrap().base;
        repo.read_header(b).unwrap()
    };
    assert!(base(&remote).image.is_none(), "the build was to fail");
    assert!(images(&remote).is_empty());
    std::fs::remove_dir_all(&scratch).unwrap();
    // Nothing changed: nothing written (no full snapshot just for the image).
    assert_eq!(checkpoint(&mut p).seq, None);
    write_file(&fs, "more", b"a change");
    let r = checkpoint(&mut p);
    assert!(r.full, "the image is retried with a full snapshot: {r}");
    assert!(base(&remote).image.is_some());
    assert_eq!(images(&remote).len(), 1);
    let d = tempfile::tempdir().unwrap();
    assert!(used_image(&lazy(&remote, d.path())));
}

/// A head of one full snapshot and six deltas holding every kind of change (creates above
/// the image's highest inode and re-stated old inodes, renames of files and directories,
/// a rename over a name, unlinks, a name reused, hard links added and dropped, xattrs set,
/// replaced and removed, truncates shorter and longer, window patches laid over patches,
/// inline files growing into bodies and bodies cut back to inline, a directory removed,
/// chmod/chown, symlinks made and removed): the lazy restore from the image, which applies
/// each delta in bulk, is the live tree, read back through the remote, and writes the same
/// database as decoding the whole chain.
#[test]
fn a_head_of_many_deltas_restores_from_the_image_as_the_live_tree() {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let fs = open_fs(dir.path());
    build_rich_tree(&fs);
    mkdir(&fs, "old");
    for i in 0..300 {
        write_file(&fs, &format!("old/f{i}"), format!("old {i}").as_bytes());
    }
    let multi = write_file(&fs, "multi", &noise(3, 5 * CHUNK as usize));
    let body = write_file(&fs, "body", &noise(4, 2 * CHUNK as usize + 10));
    let mut p = persister(dir.path(), remote.clone());
    assert!(checkpoint(&mut p).full);
    let old = resolve(&fs, "old");
    let set = |ino, attr: SetAttr| {
        fs.setattr(ino, &attr).unwrap();
    };
    // 1: new files and a new directory tree, a file and a directory renamed, unlinks, a
    // window patched.
    mkdir(&fs, "new");
    mkdir(&fs, "new/sub");
    for i in 0..150 {
        write_file(&fs, &format!("new/sub/n{i}"), format!("new {i}").as_bytes());
    }
    fs.rename(old, b"f0", InodeNo::ROOT, b"f0-moved", 0)
        .unwrap();
    fs.rename(InodeNo::ROOT, b"d", old, b"d-moved", 0).unwrap();
    for i in 1..20 {
        fs.unlink(old, format!("f{i}").as_bytes()).unwrap();
    }
    write_at(&fs, multi, CHUNK + 5, b"patch one");
    assert!(!checkpoint(&mut p).full);
    // 2: hard links, xattrs set and replaced, a truncate shorter and one longer, a patch
    // laid over the last one, an inline file grown into a body.
    let f20 = resolve(&fs, "old/f20");
    fs.link(f20, InodeNo::ROOT, b"f20-link").unwrap();
    fs.link(multi, resolve(&fs, "new/sub"), b"multi-link")
        .unwrap();
    fs.setxattr(ROOT, f20, b"user.a", b"1", 0).unwrap();
    fs.setxattr(ROOT, multi, b"user.b", b"2", 0).unwrap();
    let small = resolve(&fs, "old/d-moved/small");
    fs.setxattr(ROOT, small, b"user.k", b"replaced", 0).unwrap();
    set(
        body,
        SetAttr {
            size: Some(CHUNK + 3),
            ..Default::default()
        },
    );
    let sparse = resolve(&fs, "sparse");
    set(
        sparse,
        SetAttr {
            size: Some(8 * CHUNK),
            ..Default::default()
        },
    );
    write_at(&fs, multi, CHUNK + 7, b"patch two");
    write_at(&fs, multi, 4 * CHUNK, b"window four");
    let f21 = resolve(&fs, "old/f21");
    write_at(&fs, f21, 0, &noise(5, 3 * CHUNK as usize));
    assert!(!checkpoint(&mut p).full);
    // 3: one link of each hard link dropped, an xattr removed, a name reused by a new
    // inode, a directory removed, a body cut back to inline, chmod and chown.
    fs.unlink(old, b"f20").unwrap();
    fs.unlink(InodeNo::ROOT, b"hardlink").unwrap();
    fs.removexattr(multi, b"user.b").unwrap();
    fs.unlink(old, b"f22").unwrap();
    write_file(&fs, "old/f22", b"a new inode under an old name");
    let sub = resolve(&fs, "new/sub");
    for i in 0..150 {
        fs.unlink(sub, format!("n{i}").as_bytes()).unwrap();
    }
    fs.unlink(sub, b"multi-link").unwrap();
    fs.rmdir(resolve(&fs, "new"), b"sub").unwrap();
    set(
        f21,
        SetAttr {
            size: Some(0),
            ..Default::default()
        },
    );
    write_at(&fs, f21, 0, b"inline again");
    set(
        resolve(&fs, "old/f23"),
        SetAttr {
            mode: Some(0o600),
            uid: Some(1234),
            gid: Some(5678),
            ..Default::default()
        },
    );
    assert!(!checkpoint(&mut p).full);
    // 4: a rename over an existing name, symlinks made and one removed, more new files.
    fs.rename(old, b"f24", old, b"f25", 0).unwrap();
    fs.symlink(ROOT, InodeNo::ROOT, b"sym2", b"old/f25")
        .unwrap();
    fs.symlink(ROOT, old, b"sym3", b"../multi").unwrap();
    fs.unlink(InodeNo::ROOT, b"sym").unwrap();
    for i in 0..50 {
        write_file(
            &fs,
            &format!("new/m{i}"),
            &noise(10 + i, 100 + 50 * i as usize),
        );
    }
    assert!(!checkpoint(&mut p).full);
    // 5: a patch over the earlier patches, the file that grew into a body truncated into
    // the middle of a window, the symlink's directory entry renamed.
    write_at(&fs, multi, CHUNK + 9, b"patch three");
    set(
        multi,
        SetAttr {
            size: Some(3 * CHUNK + 100),
            ..Default::default()
        },
    );
    fs.rename(old, b"sym3", InodeNo::ROOT, b"sym3", 0).unwrap();
    assert!(!checkpoint(&mut p).full);
    // 6: a file deleted in full (last link), a new file at a freed name, times set.
    fs.unlink(InodeNo::ROOT, b"f20-link").unwrap();
    write_file(&fs, "f20-link", &noise(11, CHUNK as usize + 1));
    set(
        resolve(&fs, "old/f26"),
        SetAttr {
            atime: Some(SetTime::At(Nanos(42))),
            mtime: Some(SetTime::At(Nanos(-42))),
            ..Default::default()
        },
    );
    assert!(!checkpoint(&mut p).full);
    let want = dump(&fs);
    fs.shutdown().unwrap();
    drop(fs);
    drop(p);

    let a = tempfile::tempdir().unwrap();
    let ra = lazy(&remote, a.path());
    assert!(used_image(&ra) && !fell_back(&ra), "{ra:?}");
    let chain_only = copy_without(&remote, |k| k.starts_with("ws/images/"));
    let b = tempfile::tempdir().unwrap();
    let rb = lazy(&chain_only, b.path());
    assert!(!used_image(&rb), "{rb:?}");
    same(
        &db_dump(a.path()),
        &db_dump(b.path()),
        "image + bulk deltas vs chain",
    );
    assert_eq!(bodies(a.path()), bodies(b.path()));
    let fs = open_fs(a.path());
    let mut r = repo(&remote);
    r.manifest().unwrap();
    fs.set_chunk_source(Arc::new(keel::persist::hydrate::RemoteChunks::new(r)));
    let got = dump(&fs);
    assert_eq!(got.len(), want.len());
    for (path, w) in &want {
        assert_eq!(got.get(path), Some(w), "{path}");
    }
    let store = Store::open(&a.path().join(keel::state::META_DB), Nanos(0)).unwrap();
    let (counted, kept) = store.read().inode_totals_both().unwrap();
    assert_eq!(counted, kept, "the running totals after the bulk deltas");
}

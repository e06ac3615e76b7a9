//! Real-mount tests: data survives. Every file whose close or fsync returned is there after a
//! clean unmount + mount, and after `kill -9` of keel + mount, with identical bytes and metadata:
//! type, mode, uid, gid, nlink, size, rdev, inode number, mtime and ctime in ns, xattrs, symlink
//! targets, hard-link groups. (atime is checked separately: reads may legitimately update it.)

use crate::support;

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use support::mount::{assert_same_tree, pattern, snapshot, Keel};
use support::sys::{self, Ts};

/// A tree using every kind of metadata keel must keep. Returns after every file is closed.
fn build_rich_tree(root: &Path) {
    let p = |rel: &str| root.join(rel);
    fs::create_dir_all(p("a/b/c/d/e/f")).unwrap();
    fs::write(p("a/b/c/d/e/f/deep.txt"), b"deep").unwrap();
    fs::create_dir(p("private")).unwrap();
    fs::set_permissions(p("private"), fs::Permissions::from_mode(0o750)).unwrap();
    std::os::unix::fs::chown(p("private"), Some(1234), Some(5678)).unwrap();
    fs::create_dir(p("sticky")).unwrap();
    fs::set_permissions(p("sticky"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::create_dir(p("setgid")).unwrap();
    fs::set_permissions(p("setgid"), fs::Permissions::from_mode(0o2775)).unwrap();
    fs::create_dir(p("emptydir")).unwrap();

    fs::write(p("empty"), b"").unwrap();
    fs::set_permissions(p("empty"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(p("small.txt"), b"small inline file\n").unwrap();
    fs::write(p("private/big.bin"), pattern(3 * 1024 * 1024 + 123, 1)).unwrap();
    fs::write(p("exact-chunk.bin"), pattern(512 * 1024, 2)).unwrap();
    // Sparse: data at both ends of 10 MiB.
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(p("sparse.bin"))
        .unwrap();
    f.write_all_at(&pattern(4096, 3), 0).unwrap();
    f.write_all_at(&pattern(4096, 4), 9 * 1024 * 1024).unwrap();
    f.set_len(10 * 1024 * 1024).unwrap();
    drop(f);
    // Rewritten in place, appended, truncated.
    fs::write(p("edited.txt"), pattern(100_000, 5)).unwrap();
    let f = OpenOptions::new()
        .write(true)
        .open(p("edited.txt"))
        .unwrap();
    f.write_all_at(b"EDIT", 50_000).unwrap();
    f.set_len(70_000).unwrap();
    drop(f);
    let mut f = OpenOptions::new()
        .append(true)
        .open(p("edited.txt"))
        .unwrap();
    f.write_all(b"appended").unwrap();
    drop(f);

    fs::write(p("suid"), b"#!/bin/sh\n").unwrap();
    fs::set_permissions(p("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::write(p("owned"), b"owned").unwrap();
    std::os::unix::fs::chown(p("owned"), Some(1000), Some(1000)).unwrap();
    fs::set_permissions(p("owned"), fs::Permissions::from_mode(0o640)).unwrap();
    fs::write(p("noperm"), b"root can still read").unwrap();
    fs::set_permissions(p("noperm"), fs::Permissions::from_mode(0o000)).unwrap();

    symlink("small.txt", p("link")).unwrap();
    sys::lchown(&p("link"), 1234, 1234).unwrap();
    symlink("nowhere/at/all", p("dangling")).unwrap();
    symlink("../small.txt", p("a/up")).unwrap();
    fs::hard_link(p("small.txt"), p("a/small.hard")).unwrap();
    fs::hard_link(p("small.txt"), p("private/small.hard2")).unwrap();

    sys::mknod(&p("fifo"), libc::S_IFIFO | 0o640, 0).unwrap();
    sys::mknod(&p("null"), libc::S_IFCHR | 0o666, sys::makedev(1, 3)).unwrap();
    sys::mknod(&p("blk"), libc::S_IFBLK | 0o600, sys::makedev(8, 1)).unwrap();
    sys::mknod(&p("sock"), libc::S_IFSOCK | 0o600, 0).unwrap();

    sys::set_xattr(&p("small.txt"), "user.a", b"1", 0).unwrap();
    sys::set_xattr(&p("small.txt"), "user.big", &pattern(4000, 6), 0).unwrap();
    sys::set_xattr(&p("small.txt"), "user.empty", b"", 0).unwrap();
    sys::set_xattr(&p("small.txt"), "trusted.t", b"trusted value", 0).unwrap();
    sys::set_xattr(&p("private"), "user.dir", b"dir xattr", 0).unwrap();
    sys::set_xattr(&p("private/big.bin"), "user.x", b"x", 0).unwrap();

    // Renamed things keep everything.
    fs::write(p("before-rename"), b"renamed").unwrap();
    fs::rename(p("before-rename"), p("a/b/after-rename")).unwrap();
    // Deleted things stay deleted.
    fs::write(p("deleted"), b"gone").unwrap();
    fs::remove_file(p("deleted")).unwrap();
    fs::create_dir(p("deleted-dir")).unwrap();
    fs::remove_dir(p("deleted-dir")).unwrap();

    // Explicit times last (creating children changes a directory's mtime), children first.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let mut paths = support::mount::walk(root);
    paths.reverse();
    for (i, rel) in paths.iter().enumerate() {
        let i = i as i64;
        sys::utimens(
            &root.join(rel),
            Ts::At(now - 3600, 100_000_000 + i),
            Ts::At(now - 7200 - i, 123_456_789 - i),
            true,
        )
        .unwrap();
    }
}

fn atimes(root: &Path) -> Vec<(std::path::PathBuf, i64, i64)> {
    let mut v: Vec<_> = support::mount::walk(root)
        .into_iter()
        .map(|rel| {
            let m = fs::symlink_metadata(root.join(&rel)).unwrap();
            (rel, m.atime(), m.atime_nsec())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn tree_survives_clean_remount() {
    let mut k = keel_or_skip!();
    build_rich_tree(&k.mnt);
    let before = snapshot(&k.mnt, false);
    // Taken after the reads of `snapshot` (relatime may have updated some atimes; the explicit
    // ones are older than ctime), and compared before any read after the remount.
    let atimes_before = atimes(&k.mnt);
    k.remount();
    assert_eq!(
        atimes(&k.mnt),
        atimes_before,
        "atimes (ns) survive a remount"
    );
    let after = snapshot(&k.mnt, false);
    assert_same_tree(&before, &after, "unmount + mount");
    // And a second cycle (state written by a remounted keel reads back too).
    fs::write(k.p("second-gen"), b"2").unwrap();
    let before = snapshot(&k.mnt, false);
    k.remount();
    assert_same_tree(&before, &snapshot(&k.mnt, false), "second unmount + mount");
}

#[test]
fn tree_survives_sigint() {
    let mut k = keel_or_skip!();
    build_rich_tree(&k.mnt);
    let before = snapshot(&k.mnt, false);
    k.stop_with(libc::SIGINT);
    k.start_again();
    assert_same_tree(&before, &snapshot(&k.mnt, false), "SIGINT + mount");
}

#[test]
fn closed_files_survive_kill9() {
    let mut k = keel_or_skip!();
    build_rich_tree(&k.mnt);
    // Closing is not a durability point (metadata is group-committed); an fsync is, and
    // keel's makes every operation before it durable.
    fs::File::open(&k.mnt).unwrap().sync_all().unwrap();
    let before = snapshot(&k.mnt, false);
    k.crash_remount();
    assert_same_tree(
        &before,
        &snapshot(&k.mnt, false),
        "kill -9 + mount (files closed, then a directory fsync'd)",
    );
}

#[test]
fn fsynced_open_files_survive_kill9() {
    let mut k = keel_or_skip!();
    // Files still open (never closed) when keel dies: fsync/fdatasync is the durability point.
    let data = pattern(2 * 1024 * 1024 + 99, 21);
    let f1 = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(k.p("open-fsync.bin"))
        .unwrap();
    f1.write_all_at(&data, 0).unwrap();
    f1.sync_all().unwrap();
    let f2 = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(k.p("open-fdatasync.txt"))
        .unwrap();
    f2.write_all_at(b"fdatasync'd", 0).unwrap();
    f2.sync_data().unwrap();
    fs::create_dir(k.p("dir")).unwrap();
    let f3 = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(k.p("dir/in-dir"))
        .unwrap();
    f3.write_all_at(b"in a new dir", 0).unwrap();
    f3.set_permissions(fs::Permissions::from_mode(0o604))
        .unwrap();
    f3.sync_all().unwrap();
    fs::File::open(k.p("dir")).unwrap().sync_all().unwrap();
    let expect_mode = fs::metadata(k.p("dir/in-dir")).unwrap().mode();
    k.crash_remount();
    drop((f1, f2, f3)); // stale fds of the dead mount
    assert!(
        fs::read(k.p("open-fsync.bin")).unwrap() == data,
        "fsync'd bytes lost"
    );
    assert_eq!(fs::read(k.p("open-fdatasync.txt")).unwrap(), b"fdatasync'd");
    assert_eq!(fs::read(k.p("dir/in-dir")).unwrap(), b"in a new dir");
    assert_eq!(fs::metadata(k.p("dir/in-dir")).unwrap().mode(), expect_mode);
}

#[test]
fn repeated_crashes_keep_a_consistent_store() {
    let mut k = keel_or_skip!();
    for round in 0..5u64 {
        for i in 0..20u64 {
            fs::write(
                k.p(&format!("r{round}-f{i}")),
                pattern(1000 * i as usize, round * 100 + i),
            )
            .unwrap();
        }
        fs::File::open(&k.mnt).unwrap().sync_all().unwrap();
        let synced = snapshot(&k.mnt, false);
        // Not fsync'd: the crash may lose the unlink, but only whole (name, inode and the
        // directory's times together), never half of it.
        fs::remove_file(k.p(&format!("r{round}-f0"))).unwrap();
        let before = snapshot(&k.mnt, false);
        k.crash_remount();
        let after = snapshot(&k.mnt, false);
        if after != synced {
            assert_same_tree(&before, &after, &format!("crash {round}"));
        }
    }
    let lost_unlinks = (0..5).filter(|r| k.p(&format!("r{r}-f0")).exists()).count();
    k.remount();
    assert_eq!(fs::read_dir(&k.mnt).unwrap().count(), 5 * 19 + lost_unlinks);
}

#[test]
fn unlinked_open_file_is_gone_after_remount() {
    let mut k = keel_or_skip!();
    fs::write(k.p("keep"), b"keep").unwrap();
    fs::write(k.p("orphan"), pattern(1 << 20, 8)).unwrap();
    let f = fs::File::open(k.p("orphan")).unwrap();
    fs::remove_file(k.p("orphan")).unwrap();
    drop(f);
    k.remount();
    let names: Vec<_> = fs::read_dir(&k.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("keep")]);

    // Still open while keel is killed: the orphan must not come back either.
    fs::write(k.p("orphan2"), b"o").unwrap();
    let f = fs::File::open(k.p("orphan2")).unwrap();
    fs::remove_file(k.p("orphan2")).unwrap();
    k.crash_remount();
    drop(f);
    let names: Vec<_> = fs::read_dir(&k.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("keep")]);
}

#[test]
fn every_cache_mode_and_thread_count_persists() {
    for args in [
        &["--cache", "auto"][..],
        &["--cache", "kernel"][..],
        &["--cache", "none"][..],
        &["--threads", "1"][..],
        &["--threads", "4", "--cache", "none"][..],
        &["--passthrough", "on"][..],
        &["--passthrough", "on", "--cache", "kernel"][..],
    ] {
        let Some(mut k) = Keel::start(args) else {
            return;
        };
        let data = pattern(1024 * 1024 + 5, 30);
        fs::write(k.p("f"), &data).unwrap();
        fs::write(k.p("f"), &data[..1000]).unwrap(); // shrink: no stale cached tail
        assert_eq!(fs::read(k.p("f")).unwrap(), &data[..1000], "{args:?}");
        // mmap-style consistency: a write through one fd is seen by a read through another.
        let a = OpenOptions::new()
            .read(true)
            .write(true)
            .open(k.p("f"))
            .unwrap();
        let b = fs::File::open(k.p("f")).unwrap();
        a.write_all_at(b"XYZ", 10).unwrap();
        let mut buf = [0u8; 3];
        b.read_exact_at(&mut buf, 10).unwrap();
        assert_eq!(&buf, b"XYZ", "{args:?}");
        drop((a, b));
        let before = snapshot(&k.mnt, false);
        k.remount();
        assert_same_tree(
            &before,
            &snapshot(&k.mnt, false),
            &format!("remount with {args:?}"),
        );
    }
}

/// `[persist] remote = "none"` on a fresh state dir: nothing to restore from, so `keel mount`
/// mounts (before the start sequence moved into `boot/`, it failed with "restore from the
/// remote: no remote configured") and what is written survives a remount.
#[test]
fn a_fresh_state_dir_without_a_remote_mounts() {
    let cfg = tempfile::tempdir().unwrap();
    let file = cfg.path().join("keel.toml");
    fs::write(&file, "[persist]\nremote = \"none\"\n").unwrap();
    let mut k = keel_or_skip!("--config", file.to_str().unwrap());
    fs::write(k.p("f"), b"kept").unwrap();
    k.remount();
    assert_eq!(fs::read(k.p("f")).unwrap(), b"kept");
    assert!(
        !k.state.join("remote").exists(),
        "remote = \"none\" made no default remote"
    );
}

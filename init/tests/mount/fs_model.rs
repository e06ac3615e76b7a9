//! `WorkspaceFs` without a kernel: direct tests of POSIX semantics, and a proptest reference
//! model (create / write at offset / copy_file_range / truncate / rename / link / unlink / mkdir / rmdir /
//! chmod / xattr / fsync / remount) compared against an in-memory model after every step.

use crate::support;

use support::persist::{read_all, write_at};

use std::collections::BTreeMap;
use std::path::Path;

use keel::chunk::body::POOL_FILL;
use keel::config::CacheMode;
use keel::meta::{InodeNo, Kind, Nanos, Storage, Store};
use keel::workspace::fs::{Caller, FsError, FsOptions, SetAttr, SetTime, WorkspaceFs};
use proptest::prelude::*;
use std::os::unix::fs::FileExt;

const ROOT: Caller = Caller {
    uid: 0,
    gid: 0,
    pid: 0,
    umask: 0,
};

fn opts() -> FsOptions {
    FsOptions {
        cache: CacheMode::Auto,
        inline_max: 64,
        chunk_size: 64 * 1024,
        passthrough: Default::default(),
        posix_acl: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
    }
}

fn open_fs(dir: &Path) -> WorkspaceFs {
    WorkspaceFs::new(dir, opts()).expect("open workspace")
}

/// Resolves a slash-separated path relative to the root.
fn resolve(fs: &WorkspaceFs, path: &str) -> Result<InodeNo, FsError> {
    let mut ino = InodeNo::ROOT;
    for part in path.split('/').filter(|p| !p.is_empty()) {
        ino = fs.lookup(ino, part.as_bytes())?.inode.ino;
    }
    Ok(ino)
}

fn split(path: &str) -> (&str, &str) {
    match path.rsplit_once('/') {
        Some((p, n)) => (p, n),
        None => ("", path),
    }
}

#[test]
fn create_write_read_across_inline_and_body() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let (a, fh, _) = fs
        .create(ROOT, InodeNo::ROOT, b"f", 0o644, libc::O_RDWR)
        .unwrap();
    let ino = a.inode.ino;
    fs.write(ino, 0, b"hello").unwrap();
    // Crosses inline_max (64): moves to a body file.
    fs.write(ino, 100, &[7u8; 200]).unwrap();
    fs.release(fh).unwrap();
    let data = read_all(&fs, ino).unwrap();
    assert_eq!(data.len(), 300);
    assert_eq!(&data[..5], b"hello");
    assert!(data[5..100].iter().all(|b| *b == 0));
    assert!(data[100..].iter().all(|b| *b == 7));
    assert_eq!(fs.getattr(ino).unwrap().inode.size, 300);
}

/// With passthrough, a new write-only file (what `cp` and `echo >` create) takes a body from
/// the pool and is passed through at once: the kernel writes the body. At its last close it
/// goes back inline if it stayed small, and its body returns to the pool once that is
/// committed; a large one keeps its body. A new read-write file starts inline, through keel.
#[test]
fn new_files_with_passthrough_open_modes() {
    let dir = tempfile::tempdir().unwrap();
    let inline_max = opts().inline_max as usize;
    let open = || {
        let o = opts();
        o.passthrough
            .store(true, std::sync::atomic::Ordering::Relaxed);
        WorkspaceFs::new(dir.path(), o).expect("open workspace")
    };
    let pooled = || {
        std::fs::read_dir(dir.path().join("bodies/pool"))
            .unwrap()
            .count()
    };
    fn created(fs: &WorkspaceFs, name: &[u8], bytes: &[u8]) -> InodeNo {
        let (a, fh, info) = fs
            .create(ROOT, InodeNo::ROOT, name, 0o644, libc::O_WRONLY)
            .unwrap();
        let body = info.backing.expect("a write-only create is passed through");
        assert!(!info.direct_io && !info.keep_cache);
        // What the kernel does with a passthrough handle: write the body itself.
        body.write_all_at(bytes, 0).unwrap();
        fs.flush(a.inode.ino).unwrap();
        fs.release(fh).unwrap();
        a.inode.ino
    }

    // The pool fills itself at mount, off the request path; wait until the filler is done
    // (it counts a file as free only after making it, and stops at `want` free), so the
    // counts below are exact.
    let filled = |fs: &WorkspaceFs, want: usize| {
        support::mount::poll_for(support::mount::READY_TIMEOUT, || {
            (fs.pooled_bodies() == want).then_some(())
        });
        assert_eq!(fs.pooled_bodies(), want, "the pool holds {want} free files");
        assert_eq!(pooled(), want, "the pool directory holds {want} files");
    };

    let fs = open();
    filled(&fs, POOL_FILL);
    let small = created(&fs, b"small", &[1u8; 30]);
    let a = fs.getattr(small).unwrap().inode;
    assert_eq!(
        (a.storage, a.size),
        (Storage::Inline, 30),
        "small: back inline"
    );
    assert_eq!(read_all(&fs, small).unwrap(), vec![1u8; 30]);
    fs.shutdown().unwrap();
    drop(fs);
    assert_eq!(pooled(), POOL_FILL, "its body went back to the pool");

    // Well above the low mark: the filler stays asleep.
    let fs = open();
    let big = created(&fs, b"big", &vec![2u8; inline_max + 1]);
    assert_eq!(pooled(), POOL_FILL - 1, "a pooled file became this body");
    let a = fs.getattr(big).unwrap().inode;
    assert_eq!(
        (a.storage, a.size as usize),
        (Storage::Body, inline_max + 1)
    );
    let (fh, info) = fs.open(big, libc::O_RDONLY).unwrap();
    assert!(
        info.backing.is_some(),
        "a later open of a body is passed through"
    );
    fs.release(fh).unwrap();

    // An inline file opened for writing takes a body to be passed through, and goes back
    // inline when it stays small.
    let again = created(&fs, b"again", &[3u8; 10]);
    let (fh, info) = fs.open(again, libc::O_WRONLY | libc::O_TRUNC).unwrap();
    assert!(info.backing.is_some());
    info.backing.unwrap().write_all_at(b"xyz", 0).unwrap();
    fs.release(fh).unwrap();
    assert_eq!(fs.getattr(again).unwrap().inode.storage, Storage::Inline);
    fs.shutdown().unwrap();
    drop(fs);
    let fs = WorkspaceFs::new(dir.path(), opts()).expect("reopen workspace");
    assert_eq!(read_all(&fs, small).unwrap(), vec![1u8; 30]);
    assert_eq!(read_all(&fs, big).unwrap(), vec![2u8; inline_max + 1]);
    assert_eq!(read_all(&fs, again).unwrap(), b"xyz");

    let (_, fh, info) = fs
        .create(ROOT, InodeNo::ROOT, b"rw", 0o644, libc::O_RDWR)
        .unwrap();
    assert!(
        info.backing.is_none() && !info.direct_io,
        "read-write create"
    );
    fs.release(fh).unwrap();
}

/// A file created write-only and unlinked while open is deleted with its body at its last
/// close, not moved inline.
#[test]
fn new_write_only_file_unlinked_while_open() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts();
    o.passthrough
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let fs = WorkspaceFs::new(dir.path(), o).expect("open workspace");
    let (a, fh, info) = fs
        .create(ROOT, InodeNo::ROOT, b"gone", 0o644, libc::O_WRONLY)
        .unwrap();
    info.backing.unwrap().write_all_at(b"bytes", 0).unwrap();
    fs.unlink(InodeNo::ROOT, b"gone").unwrap();
    fs.release(fh).unwrap();
    fs.forget(a.inode.ino, 1);
    assert!(matches!(fs.getattr(a.inode.ino), Err(FsError::NotFound)));
    // Bodies of deleted files are removed off the request path; shutdown (what an unmount
    // runs) waits for that.
    fs.shutdown().unwrap();
    drop(fs);
    let bodies: Vec<_> = (0..=255u32)
        .flat_map(|s| std::fs::read_dir(dir.path().join(format!("bodies/{s:02x}"))).unwrap())
        .collect();
    assert!(bodies.is_empty(), "no body left behind: {bodies:?}");
}

/// Descriptors this process holds on body files under `dir`.
fn body_fds(dir: &Path) -> usize {
    let bodies = dir.join(keel::state::BODIES);
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.starts_with(&bodies) && !t.starts_with(bodies.join("pool")))
        .count()
}

#[test]
fn closed_files_stay_loaded_within_a_bound_and_never_past_their_unlink() {
    use keel::workspace::fs::LINGER_MAX;
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let n = LINGER_MAX + 20;
    let mut inos = Vec::new();
    for i in 0..n {
        let name = format!("f{i}");
        let (a, fh, _) = fs
            .create(ROOT, InodeNo::ROOT, name.as_bytes(), 0o644, libc::O_RDWR)
            .unwrap();
        fs.write(a.inode.ino, 0, &[i as u8; 1000]).unwrap();
        fs.release(fh).unwrap();
        inos.push(a.inode.ino);
    }
    // The kernel still holds each file's lookup: the last closed stay loaded, a bounded few.
    let held = body_fds(dir.path());
    assert!(
        (1..=LINGER_MAX).contains(&held),
        "{held} bodies held open after {n} closes"
    );
    // A loaded file reopens with its bytes, the earliest (dropped) one too.
    for &i in [0, n - 1].iter() {
        assert_eq!(read_all(&fs, inos[i]).unwrap(), vec![i as u8; 1000]);
    }
    // Unlinked, a closed file lets go of its body at once; the body file itself goes to
    // the pool once the deletion is committed, on the discard thread (which holds it open
    // while it empties it), so that part is waited for.
    let last = *inos.last().unwrap();
    fs.unlink(InodeNo::ROOT, format!("f{}", n - 1).as_bytes())
        .unwrap();
    assert!(matches!(fs.getattr(last), Err(FsError::NotFound)));
    fs.sync_all().unwrap();
    let at_name = dir
        .path()
        .join(format!("bodies/{:02x}/{:x}", last.0 & 0xff, last.0));
    let settled = support::mount::poll_for(support::mount::READY_TIMEOUT, || {
        (!at_name.exists() && body_fds(dir.path()) == held - 1).then_some(())
    });
    assert!(
        settled.is_some(),
        "the unlinked body is closed and gone from its name: {} bodies open, at its name: {}",
        body_fds(dir.path()),
        at_name.exists()
    );
    // Forgotten, the others are dropped too.
    for &ino in &inos[..n - 1] {
        fs.forget(ino, 1);
    }
    assert_eq!(body_fds(dir.path()), 0);
}

#[test]
fn unlinked_open_file_stays_readable_until_release() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let (a, fh, _) = fs
        .create(ROOT, InodeNo::ROOT, b"f", 0o644, libc::O_RDWR)
        .unwrap();
    let ino = a.inode.ino;
    fs.write(ino, 0, &[1u8; 1000]).unwrap();
    fs.unlink(InodeNo::ROOT, b"f").unwrap();
    assert!(matches!(
        fs.lookup(InodeNo::ROOT, b"f"),
        Err(FsError::NotFound)
    ));
    let mut buf = Vec::new();
    fs.read(ino, 0, 1000, &mut buf).unwrap();
    assert_eq!(buf, vec![1u8; 1000]);
    assert_eq!(fs.getattr(ino).unwrap().inode.nlink, 0);
    fs.release(fh).unwrap();
    // The kernel still holds one lookup from create; forgetting it frees the inode.
    fs.forget(ino, 1);
    assert!(matches!(fs.getattr(ino), Err(FsError::NotFound)));
}

#[test]
fn rename_rules() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let d = fs
        .mkdir(ROOT, InodeNo::ROOT, b"d", 0o755)
        .unwrap()
        .inode
        .ino;
    let sub = fs.mkdir(ROOT, d, b"sub", 0o755).unwrap().inode.ino;
    // Directory into its own subtree.
    assert!(matches!(
        fs.rename(InodeNo::ROOT, b"d", sub, b"x", 0),
        Err(FsError::Invalid)
    ));
    fs.mknod(ROOT, InodeNo::ROOT, b"f", libc::S_IFREG | 0o644, 0)
        .unwrap();
    fs.mknod(ROOT, InodeNo::ROOT, b"g", libc::S_IFREG | 0o644, 0)
        .unwrap();
    // RENAME_NOREPLACE onto an existing name.
    assert!(matches!(
        fs.rename(InodeNo::ROOT, b"f", InodeNo::ROOT, b"g", 1),
        Err(FsError::Exists)
    ));
    // A file over a directory, a directory over a file.
    assert!(matches!(
        fs.rename(InodeNo::ROOT, b"f", InodeNo::ROOT, b"d", 0),
        Err(FsError::IsDir)
    ));
    assert!(matches!(
        fs.rename(InodeNo::ROOT, b"d", InodeNo::ROOT, b"f", 0),
        Err(FsError::NotDir)
    ));
    // Moving a directory to another parent moves one link between the parents.
    let other = fs
        .mkdir(ROOT, InodeNo::ROOT, b"o", 0o755)
        .unwrap()
        .inode
        .ino;
    assert_eq!(fs.getattr(d).unwrap().inode.nlink, 3);
    fs.rename(d, b"sub", other, b"sub", 0).unwrap();
    assert_eq!(fs.getattr(d).unwrap().inode.nlink, 2);
    assert_eq!(fs.getattr(other).unwrap().inode.nlink, 3);
    assert_eq!(fs.lookup(sub, b"..").unwrap().inode.ino, other);
    // RENAME_EXCHANGE of a file and a directory in different parents.
    fs.rename(InodeNo::ROOT, b"f", other, b"sub", 2).unwrap();
    assert_eq!(fs.lookup(InodeNo::ROOT, b"f").unwrap().inode.ino, sub);
    assert_eq!(fs.getattr(other).unwrap().inode.nlink, 2);
    assert_eq!(fs.getattr(InodeNo::ROOT).unwrap().inode.nlink, 5);
}

#[test]
fn bad_names_and_xattr_flags() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let long = vec![b'x'; 256];
    assert!(matches!(
        fs.mkdir(ROOT, InodeNo::ROOT, &long, 0o755),
        Err(FsError::NameTooLong)
    ));
    assert_eq!(FsError::NameTooLong.errno(), libc::ENAMETOOLONG);
    let f = fs
        .mknod(ROOT, InodeNo::ROOT, b"f", libc::S_IFREG | 0o644, 0)
        .unwrap()
        .inode
        .ino;
    assert!(matches!(
        fs.setxattr(ROOT, f, b"user.a", b"1", 2),
        Err(FsError::NoAttr)
    ));
    fs.setxattr(ROOT, f, b"user.a", b"1", 1).unwrap();
    assert!(matches!(
        fs.setxattr(ROOT, f, b"user.a", b"2", 1),
        Err(FsError::Exists)
    ));
    fs.setxattr(ROOT, f, b"user.a", b"2", 2).unwrap();
    assert_eq!(fs.getxattr(f, b"user.a").unwrap(), b"2");
    assert!(matches!(
        fs.setxattr(ROOT, f, b"user.big", &vec![0u8; 65537], 0),
        Err(FsError::TooBig)
    ));
    assert_eq!(fs.listxattr(f).unwrap(), b"user.a\0");
    fs.removexattr(f, b"user.a").unwrap();
    assert!(matches!(fs.getxattr(f, b"user.a"), Err(FsError::NoAttr)));
}

/// The xattr value of `text` (`u::rwx,u:65534:r--,g::r-x,m::r-x,o::---`).
fn acl(text: &str) -> Vec<u8> {
    use keel::workspace::fs::acl::{Acl, Entry, Tag};
    let entries = text
        .split(',')
        .map(|part| {
            let f: Vec<&str> = part.split(':').collect();
            let tag = match (f[0], f[1].is_empty()) {
                ("u", true) => Tag::UserObj,
                ("u", false) => Tag::User,
                ("g", true) => Tag::GroupObj,
                ("g", false) => Tag::Group,
                ("m", _) => Tag::Mask,
                _ => Tag::Other,
            };
            let perm = f[2]
                .chars()
                .zip([4, 2, 1])
                .filter(|(c, _)| *c != '-')
                .map(|(_, b)| b)
                .sum();
            Entry {
                tag,
                id: f[1].parse().unwrap_or(0),
                perm,
            }
        })
        .collect();
    Acl::new(entries).unwrap().encode()
}

const ACCESS: &[u8] = b"system.posix_acl_access";
const DEFAULT: &[u8] = b"system.posix_acl_default";

#[test]
fn acls_set_the_mode_follow_chmod_and_are_inherited() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let perm = |ino| fs.getattr(ino).unwrap().inode.perm;
    let f = fs
        .mknod(ROOT, InodeNo::ROOT, b"f", libc::S_IFREG | 0o2755, 0)
        .unwrap()
        .inode
        .ino;
    // A minimal ACL only sets the mode (set-group-ID stays for root, CAP_FSETID).
    fs.setxattr(ROOT, f, ACCESS, &acl("u::r--,g::rwx,o::rw-"), 0)
        .unwrap();
    assert_eq!(perm(f), 0o2476);
    assert!(matches!(fs.getxattr(f, ACCESS), Err(FsError::NoAttr)));
    // A named entry is kept; the group bits are the mask.
    let full = acl("u::rwx,u:65534:rwx,g::r--,m::r-x,o::---");
    fs.setxattr(ROOT, f, ACCESS, &full, 0).unwrap();
    assert_eq!(perm(f), 0o2750);
    assert_eq!(fs.getxattr(f, ACCESS).unwrap(), full);
    assert_eq!(fs.listxattr(f).unwrap(), b"system.posix_acl_access\0");
    // chmod rewrites owner, mask and other.
    let set = SetAttr {
        mode: Some(0o640),
        ..SetAttr::default()
    };
    fs.setattr(f, &set).unwrap();
    assert_eq!(
        fs.getxattr(f, ACCESS).unwrap(),
        acl("u::rw-,u:65534:rwx,g::r--,m::r--,o::---")
    );
    // Not valid, or a default ACL on a file: refused, nothing changes.
    assert!(matches!(
        fs.setxattr(ROOT, f, ACCESS, b"\x02\0\0\0\x01\0", 0),
        Err(FsError::Invalid)
    ));
    assert!(matches!(
        fs.setxattr(ROOT, f, DEFAULT, &full, 0),
        Err(FsError::Access)
    ));
    assert_eq!(perm(f), 0o640);
    // Removing an ACL the inode lacks succeeds, as on ext4; a plain xattr does not.
    fs.removexattr(f, ACCESS).unwrap();
    fs.removexattr(f, ACCESS).unwrap();
    assert!(matches!(fs.removexattr(f, b"user.x"), Err(FsError::NoAttr)));
    assert_eq!(perm(f), 0o640);

    // Inheritance: the umask applies only without a default ACL.
    let umask = Caller {
        umask: 0o077,
        ..ROOT
    };
    let d = fs
        .mkdir(umask, InodeNo::ROOT, b"d", 0o777)
        .unwrap()
        .inode
        .ino;
    assert_eq!(perm(d), 0o700);
    let default = acl("u::rwx,u:65534:rwx,g::r-x,m::rwx,o::r-x");
    fs.setxattr(ROOT, d, DEFAULT, &default, 0).unwrap();
    let (n, fh, _) = fs.create(umask, d, b"n", 0o666, libc::O_RDWR).unwrap();
    fs.release(fh).unwrap();
    assert_eq!(n.inode.perm, 0o664);
    assert_eq!(
        fs.getxattr(n.inode.ino, ACCESS).unwrap(),
        acl("u::rw-,u:65534:rwx,g::r-x,m::rw-,o::r--")
    );
    assert!(matches!(
        fs.getxattr(n.inode.ino, DEFAULT),
        Err(FsError::NoAttr)
    ));
    let sub = fs.mkdir(umask, d, b"sub", 0o750).unwrap().inode;
    assert_eq!(sub.perm, 0o750);
    assert_eq!(fs.getxattr(sub.ino, DEFAULT).unwrap(), default);
    let fifo = fs
        .mknod(umask, sub.ino, b"p", libc::S_IFIFO | 0o600, 0)
        .unwrap()
        .inode;
    assert_eq!(fifo.perm, 0o600);
    assert_eq!(
        fs.getxattr(fifo.ino, ACCESS).unwrap(),
        acl("u::rw-,u:65534:rwx,g::r-x,m::---,o::---")
    );
    let link = fs.symlink(umask, d, b"l", b"n").unwrap().inode;
    assert_eq!(link.perm, 0o777);
    assert_eq!(fs.listxattr(link.ino).unwrap(), b"");
}

#[test]
fn acls_are_refused_where_the_kernel_would_not_enforce_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts();
    o.posix_acl = Default::default();
    let fs = WorkspaceFs::new(dir.path(), o).unwrap();
    let f = fs
        .mknod(ROOT, InodeNo::ROOT, b"f", libc::S_IFREG | 0o644, 0)
        .unwrap()
        .inode
        .ino;
    let a = acl("u::rw-,u:65534:---,g::r--,m::r--,o::r--");
    assert!(matches!(
        fs.setxattr(ROOT, f, ACCESS, &a, 0),
        Err(FsError::NotSupported)
    ));
    assert!(matches!(fs.getxattr(f, ACCESS), Err(FsError::NotSupported)));
    assert!(matches!(
        fs.removexattr(f, ACCESS),
        Err(FsError::NotSupported)
    ));
    assert_eq!(FsError::NotSupported.errno(), libc::EOPNOTSUPP);
    assert_eq!(fs.getattr(f).unwrap().inode.perm, 0o644);
    drop(fs);
    // One stored while enforced (a snapshot from elsewhere) is neither shown nor inherited.
    let fs = open_fs(dir.path());
    let d = fs
        .mkdir(ROOT, InodeNo::ROOT, b"d", 0o755)
        .unwrap()
        .inode
        .ino;
    fs.setxattr(ROOT, d, DEFAULT, &a, 0).unwrap();
    fs.shutdown().unwrap();
    drop(fs);
    let mut o = opts();
    o.posix_acl = Default::default();
    let fs = WorkspaceFs::new(dir.path(), o).unwrap();
    assert_eq!(fs.listxattr(d).unwrap(), b"");
    let umask = Caller {
        umask: 0o022,
        ..ROOT
    };
    let n = fs.mkdir(umask, d, b"n", 0o777).unwrap().inode;
    assert_eq!(n.perm, 0o755);
    assert_eq!(fs.listxattr(n.ino).unwrap(), b"");
}

#[test]
fn sparse_large_file_and_seek() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let (a, fh, _) = fs
        .create(ROOT, InodeNo::ROOT, b"big", 0o644, libc::O_RDWR)
        .unwrap();
    let ino = a.inode.ino;
    let off = 5u64 << 30;
    fs.write(ino, off, b"tail").unwrap();
    assert_eq!(fs.getattr(ino).unwrap().inode.size, off + 4);
    assert!(fs.getattr(ino).unwrap().blocks < 1024);
    assert_eq!(fs.seek(ino, 0, true).unwrap() / 4096, off / 4096);
    assert_eq!(fs.seek(ino, 0, false).unwrap(), 0);
    let mut buf = Vec::new();
    fs.read(ino, off - 2, 10, &mut buf).unwrap();
    assert_eq!(buf, b"\0\0tail");
    // Punch a hole over the data.
    fs.fallocate(
        ino,
        off,
        4,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
    )
    .unwrap();
    fs.read(ino, off, 4, &mut buf).unwrap();
    assert_eq!(buf, b"\0\0\0\0");
    fs.release(fh).unwrap();
}

/// With passthrough, a body handed to the kernel read-write may be mapped shared, and the
/// mapping outlives the close: its writes change the body with no request to keel. keel
/// keeps watching such a body after the last close: `getattr` shows the new mtime and ctime
/// (and says the kernel must not cache them), and every window is recorded for the next
/// checkpoint.
#[test]
fn a_body_written_after_its_last_close_moves_times_and_reaches_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts();
    o.passthrough
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let fs = WorkspaceFs::new(dir.path(), o).expect("open workspace");
    let (a, fh, _) = fs
        .create(ROOT, InodeNo::ROOT, b"f", 0o644, libc::O_RDWR)
        .unwrap();
    let ino = a.inode.ino;
    fs.write(ino, 0, &[1u8; 200]).unwrap();
    fs.release(fh).unwrap();
    assert!(
        !fs.getattr(ino).unwrap().volatile,
        "a closed file's attributes are cached"
    );

    let (fh, info) = fs.open(ino, libc::O_RDWR).unwrap();
    let body = info
        .backing
        .expect("a read-write open of a body is passed through");
    assert!(
        fs.getattr(ino).unwrap().volatile,
        "while a read-write passthrough handle is open, the kernel must ask every time"
    );
    fs.release(fh).unwrap();
    let sentinel = Nanos(1_000_000_000_000_000_000);
    let set = SetAttr {
        mtime: Some(SetTime::At(sentinel)),
        ..SetAttr::default()
    };
    let before = fs.setattr(ino, &set).unwrap().inode;
    fs.sync_all().unwrap();
    // What a checkpoint would do: forget the changes recorded so far.
    let store = Store::open(&dir.path().join(keel::state::META_DB), Nanos(0)).unwrap();
    let tx = store.write().unwrap();
    tx.clear_all_changes().unwrap();
    tx.commit().unwrap();

    // The mapping writes the body after the close.
    body.write_all_at(&[2u8; 10], 150).unwrap();
    let after = fs.getattr(ino).unwrap();
    assert!(after.volatile, "a body a mapping may write stays uncached");
    assert_ne!(after.inode.mtime, sentinel, "mtime after the write");
    assert!(after.inode.ctime > before.ctime, "ctime after the write");
    fs.sync_all().unwrap();
    assert!(
        store.read().backlog_windows().unwrap().contains(&(ino, 0)),
        "the written window is recorded for the next checkpoint"
    );
    let mut want = vec![1u8; 200];
    want[150..160].fill(2);
    assert_eq!(read_all(&fs, ino).unwrap(), want);
}

/// A crash loses the open group commit and the inode numbers it gave, which SQLite then
/// gives again: a file handle of a lost file must not open the new one. The new file has
/// the number and another generation; files that survived keep theirs, across a clean
/// remount too.
#[test]
fn a_number_a_crash_gives_again_comes_with_another_generation() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let create = |fs: &WorkspaceFs, name: &[u8]| {
        let (a, fh, _) = fs
            .create(ROOT, InodeNo::ROOT, name, 0o644, libc::O_RDWR)
            .unwrap();
        fs.release(fh).unwrap();
        (a.inode.ino, a.generation)
    };
    let (kept, kept_gen) = create(&fs, b"kept");
    let (lost, lost_gen) = create(&fs, b"lost");
    assert_eq!(
        fs.lookup(InodeNo::ROOT, b"lost").unwrap().generation,
        lost_gen
    );
    assert_eq!(
        fs.getattr(InodeNo::ROOT).unwrap().generation,
        0,
        "the root's is 0"
    );
    fs.sync_all().unwrap();
    drop(fs);
    // What a crash before the group commit leaves: no row, no entry, the sequence back.
    let db = rusqlite::Connection::open(dir.path().join(keel::state::META_DB)).unwrap();
    db.execute_batch(&format!(
        "DELETE FROM inode WHERE ino = {lost};
         DELETE FROM dirent WHERE ino = {lost};
         UPDATE sqlite_sequence SET seq = {kept} WHERE name = 'inode';",
        lost = lost.0,
        kept = kept.0
    ))
    .unwrap();
    drop(db);

    let fs = open_fs(dir.path());
    assert_eq!(
        fs.lookup(InodeNo::ROOT, b"kept").unwrap().generation,
        kept_gen
    );
    let (again, again_gen) = create(&fs, b"new");
    assert_eq!(again, lost, "the number is given again");
    assert_ne!(again_gen, lost_gen, "with another generation");
    fs.shutdown().unwrap();
    drop(fs);
    let fs = open_fs(dir.path());
    assert_eq!(
        fs.lookup(InodeNo::ROOT, b"new").unwrap().generation,
        again_gen
    );
    assert_eq!(
        fs.lookup(InodeNo::ROOT, b"kept").unwrap().generation,
        kept_gen
    );
}

/// The kernel's export operations look up "." and ".." by inode number, for an inode of
/// any kind: "." is the inode while it has a name, ".." a directory's parent.
#[test]
fn dot_and_dotdot_by_inode_number() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let d = fs
        .mkdir(ROOT, InodeNo::ROOT, b"d", 0o755)
        .unwrap()
        .inode
        .ino;
    let (a, fh, _) = fs.create(ROOT, d, b"f", 0o644, libc::O_RDWR).unwrap();
    let f = a.inode.ino;
    fs.release(fh).unwrap();
    assert_eq!(
        fs.lookup(f, b".").unwrap().inode.ino,
        f,
        "a file's own \".\""
    );
    assert_eq!(fs.lookup(d, b".").unwrap().inode.ino, d);
    assert_eq!(fs.lookup(d, b"..").unwrap().inode.ino, InodeNo::ROOT);
    assert!(matches!(fs.lookup(f, b".."), Err(FsError::NotDir)));
    fs.unlink(d, b"f").unwrap();
    assert!(matches!(fs.lookup(f, b"."), Err(FsError::NotFound)));
    assert!(matches!(
        fs.lookup(InodeNo(1 << 40), b"."),
        Err(FsError::NotFound)
    ));
}

// ---------------------------------------------------------------------------------------
// The reference model.

#[derive(Debug, Clone, PartialEq)]
enum MNode {
    File { id: usize },
    Dir,
}

/// A file's bytes, mode and xattrs.
type MFile = (Vec<u8>, u32, BTreeMap<String, Vec<u8>>);

#[derive(Debug, Clone, Default)]
struct Model {
    /// path → node; directories have no data.
    paths: BTreeMap<String, MNode>,
    /// file id → (bytes, mode, xattrs)
    files: Vec<MFile>,
    dir_modes: BTreeMap<String, u32>,
    dir_xattrs: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
}

impl Model {
    fn parent_ok(&self, path: &str) -> bool {
        let (p, _) = split(path);
        p.is_empty() || matches!(self.paths.get(p), Some(MNode::Dir))
    }
    fn children(&self, dir: &str) -> Vec<String> {
        let prefix = if dir.is_empty() {
            String::new()
        } else {
            format!("{dir}/")
        };
        self.paths
            .keys()
            .filter(|k| {
                k.starts_with(&prefix) && !k[prefix.len()..].contains('/') && k.len() > prefix.len()
            })
            .cloned()
            .collect()
    }
    fn nlink(&self, id: usize) -> usize {
        self.paths
            .values()
            .filter(|n| **n == MNode::File { id })
            .count()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Create(String),
    Write(String, u64, Vec<u8>),
    /// copy_file_range(src, off_in, dst, off_out, len)
    Copy(String, u64, String, u64, u64),
    Truncate(String, u64),
    Mkdir(String),
    Rmdir(String),
    Unlink(String),
    Rename(String, String),
    Link(String, String),
    Chmod(String, u32),
    SetXattr(String, String, Vec<u8>),
    RemoveXattr(String, String),
    Fsync(String),
    Remount {
        clean: bool,
    },
}

fn path_strategy() -> impl Strategy<Value = String> {
    let name = prop::sample::select(vec!["a", "b", "c"]);
    prop::collection::vec(name, 1..=3).prop_map(|v| v.join("/"))
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let data = prop::collection::vec(any::<u8>(), 0..300);
    prop_oneof![
        3 => path_strategy().prop_map(Op::Create),
        4 => (path_strategy(), 0u64..400, data).prop_map(|(p, o, d)| Op::Write(p, o, d)),
        2 => (path_strategy(), 0u64..400, path_strategy(), 0u64..400, 0u64..300)
            .prop_map(|(a, ia, b, ib, n)| Op::Copy(a, ia, b, ib, n)),
        2 => (path_strategy(), 0u64..500).prop_map(|(p, s)| Op::Truncate(p, s)),
        3 => path_strategy().prop_map(Op::Mkdir),
        1 => path_strategy().prop_map(Op::Rmdir),
        2 => path_strategy().prop_map(Op::Unlink),
        3 => (path_strategy(), path_strategy()).prop_map(|(a, b)| Op::Rename(a, b)),
        2 => (path_strategy(), path_strategy()).prop_map(|(a, b)| Op::Link(a, b)),
        1 => (path_strategy(), 0u32..0o1000).prop_map(|(p, m)| Op::Chmod(p, m)),
        1 => (path_strategy(), prop::sample::select(vec!["user.x", "user.y"]), prop::collection::vec(any::<u8>(), 0..20))
            .prop_map(|(p, n, v)| Op::SetXattr(p, n.to_string(), v)),
        1 => (path_strategy(), prop::sample::select(vec!["user.x", "user.y"]))
            .prop_map(|(p, n)| Op::RemoveXattr(p, n.to_string())),
        1 => path_strategy().prop_map(Op::Fsync),
        1 => any::<bool>().prop_map(|clean| Op::Remount { clean }),
    ]
}

/// Applies `op` to the model; returns whether the real filesystem should succeed.
fn apply_model(m: &mut Model, op: &Op) -> bool {
    match op {
        Op::Create(p) => {
            if !m.parent_ok(p) || m.paths.contains_key(p) {
                return false;
            }
            m.files.push((Vec::new(), 0o644, BTreeMap::new()));
            m.paths.insert(
                p.clone(),
                MNode::File {
                    id: m.files.len() - 1,
                },
            );
            true
        }
        Op::Write(p, off, d) => match m.paths.get(p) {
            Some(MNode::File { id }) => {
                let f = &mut m.files[*id].0;
                let end = *off as usize + d.len();
                if !d.is_empty() {
                    if f.len() < end {
                        f.resize(end, 0);
                    }
                    f[*off as usize..end].copy_from_slice(d);
                }
                true
            }
            _ => false,
        },
        Op::Copy(a, ia, b, ib, n) => match (m.paths.get(a), m.paths.get(b)) {
            (Some(MNode::File { id: src }), Some(MNode::File { id: dst })) => {
                let (src, dst, ia, ib) = (*src, *dst, *ia as usize, *ib as usize);
                let from = m.files[src].0.get(ia..).unwrap_or_default();
                let bytes = from[..from.len().min(*n as usize)].to_vec();
                // The kernel refuses overlapping ranges within one file (EINVAL).
                if src == dst && ia < ib + *n as usize && ib < ia + *n as usize {
                    return false;
                }
                let f = &mut m.files[dst].0;
                if !bytes.is_empty() {
                    if f.len() < ib + bytes.len() {
                        f.resize(ib + bytes.len(), 0);
                    }
                    f[ib..ib + bytes.len()].copy_from_slice(&bytes);
                }
                true
            }
            _ => false,
        },
        Op::Truncate(p, s) => match m.paths.get(p) {
            Some(MNode::File { id }) => {
                m.files[*id].0.resize(*s as usize, 0);
                true
            }
            _ => false,
        },
        Op::Mkdir(p) => {
            if !m.parent_ok(p) || m.paths.contains_key(p) {
                return false;
            }
            m.paths.insert(p.clone(), MNode::Dir);
            m.dir_modes.insert(p.clone(), 0o755);
            true
        }
        Op::Rmdir(p) => {
            if !matches!(m.paths.get(p), Some(MNode::Dir)) || !m.children(p).is_empty() {
                return false;
            }
            m.paths.remove(p);
            m.dir_modes.remove(p);
            m.dir_xattrs.remove(p);
            true
        }
        Op::Unlink(p) => {
            if !matches!(m.paths.get(p), Some(MNode::File { .. })) {
                return false;
            }
            m.paths.remove(p);
            true
        }
        Op::Rename(a, b) => {
            let Some(src) = m.paths.get(a).cloned() else {
                return false;
            };
            if !m.parent_ok(b) {
                return false;
            }
            if a == b {
                return true;
            }
            if src == MNode::Dir && b.starts_with(&format!("{a}/")) {
                return false;
            }
            match (m.paths.get(b), &src) {
                (Some(MNode::Dir), MNode::File { .. }) => return false,
                (Some(MNode::File { .. }), MNode::Dir) => return false,
                (Some(MNode::Dir), MNode::Dir) if !m.children(b).is_empty() => return false,
                (Some(MNode::File { id: x }), MNode::File { id: y }) if x == y => return true,
                _ => {}
            }
            // Move the subtree.
            let moved: Vec<(String, MNode)> = m
                .paths
                .iter()
                .filter(|(k, _)| *k == a || k.starts_with(&format!("{a}/")))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if matches!(m.paths.get(b), Some(MNode::Dir)) {
                m.dir_modes.remove(b);
                m.dir_xattrs.remove(b);
            }
            m.paths.remove(b);
            for (k, v) in moved {
                m.paths.remove(&k);
                let nk = format!("{b}{}", &k[a.len()..]);
                if let Some(mode) = m.dir_modes.remove(&k) {
                    m.dir_modes.insert(nk.clone(), mode);
                }
                if let Some(x) = m.dir_xattrs.remove(&k) {
                    m.dir_xattrs.insert(nk.clone(), x);
                }
                m.paths.insert(nk, v);
            }
            true
        }
        Op::Link(a, b) => {
            let Some(MNode::File { id }) = m.paths.get(a).cloned() else {
                return false;
            };
            if !m.parent_ok(b) || m.paths.contains_key(b) {
                return false;
            }
            m.paths.insert(b.clone(), MNode::File { id });
            true
        }
        Op::Chmod(p, mode) => match m.paths.get(p) {
            Some(MNode::File { id }) => {
                m.files[*id].1 = *mode;
                true
            }
            Some(MNode::Dir) => {
                m.dir_modes.insert(p.clone(), *mode);
                true
            }
            None => false,
        },
        Op::SetXattr(p, n, v) => match m.paths.get(p) {
            Some(MNode::File { id }) => {
                m.files[*id].2.insert(n.clone(), v.clone());
                true
            }
            Some(MNode::Dir) => {
                m.dir_xattrs
                    .entry(p.clone())
                    .or_default()
                    .insert(n.clone(), v.clone());
                true
            }
            None => false,
        },
        Op::RemoveXattr(p, n) => match m.paths.get(p) {
            Some(MNode::File { id }) => m.files[*id].2.remove(n).is_some(),
            Some(MNode::Dir) => m
                .dir_xattrs
                .get_mut(p)
                .map(|x| x.remove(n).is_some())
                .unwrap_or(false),
            None => false,
        },
        Op::Fsync(p) => matches!(m.paths.get(p), Some(MNode::File { .. })),
        Op::Remount { .. } => true,
    }
}

fn apply_real(fs: &WorkspaceFs, op: &Op) -> Result<(), FsError> {
    let parent_of = |p: &str| -> Result<(InodeNo, String), FsError> {
        let (dir, name) = split(p);
        Ok((resolve(fs, dir)?, name.to_string()))
    };
    match op {
        Op::Create(p) => {
            let (d, n) = parent_of(p)?;
            let (_, fh, _) =
                fs.create(ROOT, d, n.as_bytes(), 0o644, libc::O_RDWR | libc::O_EXCL)?;
            fs.release(fh).map(|_| ())
        }
        Op::Write(p, off, data) => {
            let ino = resolve(fs, p)?;
            if fs.getattr(ino)?.inode.kind != Kind::File {
                return Err(FsError::IsDir);
            }
            write_at(fs, ino, *off, data);
            Ok(())
        }
        Op::Copy(a, ia, b, ib, n) => {
            let (src, dst) = (resolve(fs, a)?, resolve(fs, b)?);
            for ino in [src, dst] {
                if fs.getattr(ino)?.inode.kind != Kind::File {
                    return Err(FsError::IsDir);
                }
            }
            // What the kernel checks before asking the filesystem.
            if src == dst && ia < &(ib + n) && ib < &(ia + n) {
                return Err(FsError::Invalid);
            }
            let (fi, _) = fs.open(src, libc::O_RDONLY)?;
            let (fo, _) = fs.open(dst, libc::O_WRONLY)?;
            let size = fs.getattr(src)?.inode.size;
            let want = size.saturating_sub(*ia).min(*n);
            let got = fs.copy_file_range(src, *ia, dst, *ib, *n);
            fs.release(fi)?;
            fs.release(fo)?;
            assert_eq!(got?, want, "copy_file_range copied a short count");
            Ok(())
        }
        Op::Truncate(p, s) => {
            let ino = resolve(fs, p)?;
            fs.setattr(
                ino,
                &SetAttr {
                    size: Some(*s),
                    ..Default::default()
                },
            )?;
            Ok(())
        }
        Op::Mkdir(p) => {
            let (d, n) = parent_of(p)?;
            fs.mkdir(ROOT, d, n.as_bytes(), 0o755).map(|_| ())
        }
        Op::Rmdir(p) => {
            let (d, n) = parent_of(p)?;
            fs.rmdir(d, n.as_bytes())
        }
        Op::Unlink(p) => {
            let (d, n) = parent_of(p)?;
            fs.unlink(d, n.as_bytes())
        }
        Op::Rename(a, b) => {
            let (da, na) = parent_of(a)?;
            let (db, nb) = parent_of(b)?;
            fs.rename(da, na.as_bytes(), db, nb.as_bytes(), 0)
        }
        Op::Link(a, b) => {
            let ino = resolve(fs, a)?;
            let (db, nb) = parent_of(b)?;
            fs.link(ino, db, nb.as_bytes()).map(|_| ())
        }
        Op::Chmod(p, mode) => {
            let ino = resolve(fs, p)?;
            fs.setattr(
                ino,
                &SetAttr {
                    mode: Some(*mode),
                    ..Default::default()
                },
            )
            .map(|_| ())
        }
        Op::SetXattr(p, n, v) => {
            let ino = resolve(fs, p)?;
            fs.setxattr(ROOT, ino, n.as_bytes(), v, 0)
        }
        Op::RemoveXattr(p, n) => {
            let ino = resolve(fs, p)?;
            fs.removexattr(ino, n.as_bytes())
        }
        Op::Fsync(p) => {
            let ino = resolve(fs, p)?;
            let (fh, _) = fs.open(ino, libc::O_RDONLY)?;
            fs.fsync(ino, false)?;
            fs.release(fh).map(|_| ())
        }
        Op::Remount { .. } => Ok(()),
    }
}

/// `assert_eq!` that returns the difference as an error instead of panicking.
macro_rules! check_eq {
    ($a:expr, $b:expr $(,)?) => {
        check_eq!($a, $b, "values differ")
    };
    ($a:expr, $b:expr, $($msg:tt)+) => {{
        let (a, b) = (&$a, &$b);
        if a != b {
            return Err(format!("{}: left {:?}, right {:?}", format!($($msg)+), a, b));
        }
    }};
}

/// Compares the whole tree with the model.
fn tree_matches(fs: &WorkspaceFs, m: &Model) -> Result<(), String> {
    tree_matches_torn(fs, m, &[])
}

/// Whether byte `i` of file `id` is one the file held at `i` in one of `states` (a hole
/// past a state's end reads as zero).
fn byte_from_history(states: &[Model], id: usize, i: usize, b: u8) -> bool {
    states
        .iter()
        .filter_map(|s| s.files.get(id))
        .any(|(data, _, _)| data.get(i).copied().unwrap_or(0) == b)
}

/// `tree_matches`, except that after a crash (`torn` = the states since the last durable
/// point) a file kept in a body may hold any mix of the bytes it had in those states: bodies
/// are written in place, and like a local disk, keel promises unsynced bytes nothing more.
/// Sizes, names, modes and inline files (bytes in the store) must still match `m` exactly.
fn tree_matches_torn(fs: &WorkspaceFs, m: &Model, torn: &[Model]) -> Result<(), String> {
    let mut seen_ids: BTreeMap<usize, InodeNo> = BTreeMap::new();
    let mut stack = vec![(String::new(), InodeNo::ROOT)];
    let mut real_paths = Vec::new();
    while let Some((path, ino)) = stack.pop() {
        let fh = fs.opendir(ino).unwrap();
        let mut entries = Vec::new();
        fs.readdir(fh, 0, |e, _| {
            entries.push(e.clone());
            false
        })
        .unwrap();
        fs.releasedir(fh);
        let mut subdirs = 0;
        for e in entries {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let name = String::from_utf8(e.name.clone()).unwrap();
            let p = if path.is_empty() {
                name
            } else {
                format!("{path}/{name}")
            };
            real_paths.push(p.clone());
            let attr = fs.getattr(e.ino).unwrap().inode;
            match m.paths.get(&p) {
                Some(MNode::Dir) => {
                    check_eq!(attr.kind, Kind::Dir, "{p}");
                    check_eq!(attr.perm, m.dir_modes[&p], "mode of {p}");
                    let want: Vec<u8> = m
                        .dir_xattrs
                        .get(&p)
                        .map(|x| x.keys().flat_map(|k| k.bytes().chain([0])).collect())
                        .unwrap_or_default();
                    check_eq!(fs.listxattr(e.ino).unwrap(), want, "xattrs of {p}");
                    subdirs += 1;
                    stack.push((p, e.ino));
                }
                Some(MNode::File { id }) => {
                    check_eq!(attr.kind, Kind::File, "{p}");
                    if let Some(prev) = seen_ids.insert(*id, e.ino) {
                        check_eq!(prev, e.ino, "hard links of {p} must share an inode");
                    }
                    let (data, mode, xattrs) = &m.files[*id];
                    check_eq!(attr.size as usize, data.len(), "size of {p}");
                    let got = read_all(fs, e.ino).unwrap();
                    if torn.is_empty() || attr.storage != Storage::Body {
                        check_eq!(&got, data, "bytes of {p}");
                    } else if let Some(i) =
                        (0..got.len()).find(|&i| !byte_from_history(torn, *id, i, got[i]))
                    {
                        return Err(format!(
                            "byte {i} of {p} is {}, which the file never held since the last \
                             durable point",
                            got[i]
                        ));
                    }
                    check_eq!(attr.perm, *mode, "mode of {p}");
                    check_eq!(attr.nlink as usize, m.nlink(*id), "nlink of {p}");
                    let want: Vec<u8> = xattrs.keys().flat_map(|k| k.bytes().chain([0])).collect();
                    check_eq!(fs.listxattr(e.ino).unwrap(), want, "xattrs of {p}");
                    for (k, v) in xattrs {
                        check_eq!(&fs.getxattr(e.ino, k.as_bytes()).unwrap(), v);
                    }
                }
                None => return Err(format!("{p} exists but the model has no such path")),
            }
        }
        check_eq!(
            fs.getattr(ino).unwrap().inode.nlink,
            2 + subdirs,
            "nlink of directory `{path}`"
        );
    }
    real_paths.sort();
    let want: Vec<String> = m.paths.keys().cloned().collect();
    check_eq!(real_paths, want);
    Ok(())
}

/// Compares the whole tree with the model; panics at the first difference.
fn compare(fs: &WorkspaceFs, m: &Model) {
    if let Err(e) = tree_matches(fs, m) {
        panic!("{e}");
    }
}

fn run_model(ops: &[Op]) {
    let dir = tempfile::tempdir().unwrap();
    let mut fs = open_fs(dir.path());
    let mut m = Model::default();
    // Model states since the last point where everything was durable (an fsync, a clean
    // remount): a crash may lose the newest operations since then, whole and in order, so
    // after an unclean remount the tree must equal one of them.
    let mut since_durable = vec![m.clone()];
    for (i, op) in ops.iter().enumerate() {
        let mut next = m.clone();
        let want_ok = apply_model(&mut next, op);
        let got = apply_real(&fs, op);
        assert_eq!(
            got.is_ok(),
            want_ok,
            "step {i}: {op:?}: filesystem said {got:?}, model said ok={want_ok}"
        );
        if want_ok {
            m = next;
        }
        since_durable.push(m.clone());
        if matches!(op, Op::Fsync(_)) && want_ok {
            since_durable = vec![m.clone()];
        }
        if let Op::Remount { clean } = op {
            if *clean {
                fs.shutdown().unwrap();
            }
            drop(fs);
            fs = open_fs(dir.path());
            if !*clean {
                let survived = since_durable
                    .iter()
                    .rev()
                    .find(|c| tree_matches_torn(&fs, c, &since_durable).is_ok())
                    .cloned();
                match survived {
                    Some(c) => {
                        m = c;
                        // From here on the model holds the bytes that survived.
                        for (path, node) in m.paths.clone() {
                            if let MNode::File { id } = node {
                                m.files[id].0 =
                                    read_all(&fs, resolve(&fs, &path).unwrap()).unwrap();
                            }
                        }
                    }
                    None => panic!(
                        "step {i}: after a crash the tree is no state since the last durable \
                         point; against the newest: {}",
                        tree_matches(&fs, &m).unwrap_err()
                    ),
                }
            }
            since_durable = vec![m.clone()];
        }
        compare(&fs, &m);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn matches_reference_model(ops in prop::collection::vec(op_strategy(), 1..60)) {
        run_model(&ops);
    }
}

/// Renaming a directory over an empty directory in the same parent drops one parent link.
#[test]
fn regression_rename_dir_over_empty_dir() {
    run_model(&[
        Op::Mkdir("a".into()),
        Op::Mkdir("b".into()),
        Op::Rename("a".into(), "b".into()),
        Op::Remount { clean: false },
    ]);
}

/// A hard link survives the unlink of the original name, across a remount.
#[test]
fn regression_link_then_unlink_then_remount() {
    run_model(&[
        Op::Create("a".into()),
        Op::Write("a".into(), 10, vec![1, 2, 3]),
        Op::Link("a".into(), "b".into()),
        Op::Unlink("a".into()),
        Op::Remount { clean: true },
        Op::Truncate("b".into(), 200),
    ]);
}

#[test]
fn copy_file_range_between_inline_and_body_files() {
    let bytes = |n: usize, seed: u8| -> Vec<u8> { (0..n).map(|i| seed ^ i as u8).collect() };
    run_model(&[
        Op::Create("a".into()),
        Op::Write("a".into(), 0, bytes(200, 1)),
        Op::Create("b".into()),
        Op::Write("b".into(), 0, bytes(10, 2)),
        Op::Create("c".into()),
        Op::Write("c".into(), 0, bytes(20, 3)),
        // body -> inline file that outgrows inline_max: copied between bodies
        Op::Copy("a".into(), 5, "b".into(), 3, 150),
        // body -> body, extending the target
        Op::Copy("b".into(), 0, "a".into(), 300, 40),
        // inline -> inline, and inline -> body: through a buffer
        Op::Copy("c".into(), 0, "c".into(), 25, 10),
        Op::Copy("c".into(), 2, "b".into(), 1, 10),
        // within one body; overlapping ranges are refused
        Op::Copy("a".into(), 0, "a".into(), 250, 50),
        Op::Copy("a".into(), 10, "a".into(), 20, 50),
        // past the source's end: nothing
        Op::Copy("c".into(), 500, "a".into(), 0, 10),
        Op::Remount { clean: false },
    ]);
}

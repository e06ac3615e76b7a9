//! Real-mount tests: POSIX behaviour of a `keel mount` seen through the kernel.
//! Each test mounts its own workspace on temp dirs (see common/mod.rs for the gate and cleanup).

use crate::support;

use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{symlink, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use support::mount::{assert_errno, pattern};
use support::sys::{self, Ts};

/// An old, exact timestamp: set on an inode before an operation, any change is detectable
/// without depending on the clock.
const SENTINEL: Ts = Ts::At(1_000_000_000, 0);
const SENTINEL_NS: i128 = 1_000_000_000 * 1_000_000_000;

fn mtime_ns(p: &Path) -> i128 {
    let m = fs::symlink_metadata(p).unwrap();
    support::mount::ns(m.mtime(), m.mtime_nsec())
}

fn ctime_ns(p: &Path) -> i128 {
    let m = fs::symlink_metadata(p).unwrap();
    support::mount::ns(m.ctime(), m.ctime_nsec())
}

fn reset_times(p: &Path) {
    sys::utimens(p, SENTINEL, SENTINEL, true).unwrap();
}

fn nlink(p: &Path) -> u64 {
    fs::symlink_metadata(p).unwrap().nlink()
}

fn ino(p: &Path) -> u64 {
    fs::symlink_metadata(p).unwrap().ino()
}

#[test]
fn mount_is_fuse_and_empty() {
    let k = keel_or_skip!();
    assert!(support::mount::is_fuse_mount(&k.mnt));
    let md = fs::metadata(&k.mnt).unwrap();
    assert!(md.is_dir());
    assert_eq!(
        fs::read_dir(&k.mnt).unwrap().count(),
        0,
        "fresh workspace is empty"
    );
    assert!(k.state.is_dir(), "keel creates a missing state dir");
}

#[test]
fn terminal_ioctls_answer_enotty_like_a_disk_file() {
    let k = keel_or_skip!();
    let f = fs::File::create(k.mnt.join("notatty")).unwrap();
    let e = sys::isatty(&f).expect_err("a workspace file is not a terminal");
    assert_eq!(e.raw_os_error(), Some(libc::ENOTTY), "{e}");
}

/// A file rewritten through a passthrough handle and read right after its close: the
/// RELEASE of the old handle (sent after close returns) races the next OPEN, which may give
/// the file a new body; the kernel must then be handed the new body, not the old one's
/// still-registered backing id (writes went to the old body and were lost, ~1 in 150
/// rounds here, before `workspace/backing.rs`).
#[test]
fn rewrites_reach_the_next_reader_while_the_last_release_is_in_flight() {
    let k = keel_or_skip!();
    let mut lost = Vec::new();
    for i in 0..1500 {
        let (t, h, p) = (k.p("target"), k.p("hard"), k.p("hello"));
        let _ = fs::remove_file(&h);
        fs::write(&t, vec![b'x'; i % 7]).unwrap();
        fs::hard_link(&t, &h).unwrap();
        fs::write(&h, b"changed").unwrap();
        let got = fs::read(&t).unwrap();
        if got != b"changed" {
            lost.push(format!(
                "round {i}: rewrite through the other name read {got:?}"
            ));
        }
        fs::remove_file(&t).unwrap();

        fs::write(&p, b"hello world").unwrap();
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"!").unwrap();
        drop(f);
        let got = fs::read(&p).unwrap();
        if got != b"hello world!" {
            lost.push(format!("round {i}: append read {got:?}"));
        }
        let f = OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(b"W", 6).unwrap();
        drop(f);
        let got = fs::read(&p).unwrap();
        if got != b"hello World!" {
            lost.push(format!("round {i}: overwrite read {got:?}"));
        }
    }
    assert!(lost.is_empty(), "{} lost writes: {:?}", lost.len(), lost);
}

#[test]
fn file_read_write_append_truncate() {
    let k = keel_or_skip!();
    let p = k.p("hello.txt");
    fs::write(&p, b"hello world").unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"hello world");
    assert_eq!(fs::metadata(&p).unwrap().len(), 11);

    // O_APPEND always writes at the end, whatever the offset.
    let mut f = OpenOptions::new().append(true).open(&p).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.write_all(b"!").unwrap();
    drop(f);
    assert_eq!(fs::read(&p).unwrap(), b"hello world!");

    // Overwrite in the middle; write past EOF leaves a zero-filled gap.
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(b"W", 6).unwrap();
    f.write_all_at(b"end", 20).unwrap();
    drop(f);
    let mut want = b"hello World!".to_vec();
    want.resize(20, 0);
    want.extend_from_slice(b"end");
    assert_eq!(fs::read(&p).unwrap(), want);

    // O_EXCL on an existing file.
    assert_errno(
        OpenOptions::new().write(true).create_new(true).open(&p),
        libc::EEXIST,
        "O_CREAT|O_EXCL on existing",
    );
    // O_TRUNC empties it.
    drop(
        OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&p)
            .unwrap(),
    );
    assert_eq!(fs::metadata(&p).unwrap().len(), 0);

    // ftruncate grows with zeros and shrinks.
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    f.set_len(10_000).unwrap();
    assert_eq!(fs::read(&p).unwrap(), vec![0u8; 10_000]);
    f.write_all_at(b"abc", 5000).unwrap();
    f.set_len(5001).unwrap();
    drop(f);
    let data = fs::read(&p).unwrap();
    assert_eq!(data.len(), 5001);
    assert_eq!(&data[4999..], b"\0a");

    // A multi-chunk file (3 MiB + odd tail) reads back byte for byte, also at random offsets.
    let big = pattern(3 * 1024 * 1024 + 12345, 7);
    let bp = k.p("big.bin");
    fs::write(&bp, &big).unwrap();
    assert_eq!(fs::read(&bp).unwrap(), big);
    let f = fs::File::open(&bp).unwrap();
    for &(off, len) in &[
        (0usize, 1usize),
        (524_287, 2),
        (1_000_000, 70_000),
        (3_145_000, 12_345 + 728),
    ] {
        let mut buf = vec![0u8; len];
        let n = f.read_at(&mut buf, off as u64).unwrap();
        let end = (off + len).min(big.len());
        assert_eq!(&buf[..n], &big[off..end], "read_at({off}, {len})");
    }
    // Reading at EOF returns 0 bytes.
    let mut buf = [0u8; 10];
    assert_eq!(f.read_at(&mut buf, big.len() as u64).unwrap(), 0);

    fs::remove_file(&p).unwrap();
    assert_errno(fs::metadata(&p), libc::ENOENT, "stat after unlink");
    assert_errno(fs::remove_file(&p), libc::ENOENT, "unlink twice");
}

#[test]
fn o_direct_and_o_sync_work() {
    let k = keel_or_skip!();
    let p = k.p("direct.bin");
    let data = pattern(1 << 20, 3);
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(libc::O_SYNC)
        .open(&p)
        .unwrap();
    f.write_all(&data).unwrap();
    drop(f);
    // O_DIRECT may be refused by filesystems without it (EINVAL); keel must accept it.
    // Aligned buffers and offsets, as block filesystems require.
    #[repr(C, align(4096))]
    struct Aligned([u8; 65536]);
    let mut buf = Box::new(Aligned([0; 65536]));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p)
        .unwrap();
    let mut back = Vec::new();
    loop {
        let n = f.read_at(&mut buf.0, back.len() as u64).unwrap();
        if n == 0 {
            break;
        }
        back.extend_from_slice(&buf.0[..n]);
    }
    assert!(back == data, "O_DIRECT read differs");
    buf.0.fill(0xAB);
    f.write_all_at(&buf.0, 65536).unwrap();
    drop(f);
    let all = fs::read(&p).unwrap();
    assert!(
        all[65536..131072].iter().all(|&b| b == 0xAB),
        "O_DIRECT write not visible"
    );
}

#[test]
fn directories_and_readdir() {
    let k = keel_or_skip!();
    let d = k.p("dir");
    fs::create_dir(&d).unwrap();
    assert_errno(fs::create_dir(&d), libc::EEXIST, "mkdir existing");
    fs::write(d.join("f"), b"x").unwrap();
    assert_errno(fs::remove_dir(&d), libc::ENOTEMPTY, "rmdir non-empty");
    assert_errno(fs::remove_dir(d.join("f")), libc::ENOTDIR, "rmdir a file");
    assert_errno(fs::remove_file(&d), libc::EISDIR, "unlink a directory");
    assert_errno(
        fs::create_dir(d.join("f/x")),
        libc::ENOTDIR,
        "mkdir under a file",
    );
    assert_errno(
        fs::write(d.join("missing/x"), b""),
        libc::ENOENT,
        "create in missing dir",
    );
    assert_errno(fs::read_dir(d.join("f")), libc::ENOTDIR, "opendir a file");

    // Many entries: readdir must return every name exactly once across several batches.
    let n = 1500;
    for i in 0..n {
        fs::write(d.join(format!("entry-{i:05}-{}", "x".repeat(i % 50))), b"").unwrap();
    }
    let mut names: Vec<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want: Vec<String> = (0..n)
        .map(|i| format!("entry-{i:05}-{}", "x".repeat(i % 50)))
        .collect();
    want.push("f".into());
    want.sort();
    assert_eq!(names, want);
    // File types from readdir(plus) agree with lstat.
    for e in fs::read_dir(&d).unwrap() {
        let e = e.unwrap();
        assert!(e.file_type().unwrap().is_file());
    }
    for name in &want {
        fs::remove_file(d.join(name)).unwrap();
    }
    assert_eq!(fs::read_dir(&d).unwrap().count(), 0);
    fs::remove_dir(&d).unwrap();
    assert_errno(fs::metadata(&d), libc::ENOENT, "stat removed dir");
}

#[test]
fn symlinks_hardlinks_and_special_files() {
    let k = keel_or_skip!();
    fs::write(k.p("target"), b"content").unwrap();
    symlink("target", k.p("link")).unwrap();
    assert_eq!(fs::read_link(k.p("link")).unwrap(), Path::new("target"));
    assert_eq!(fs::read(k.p("link")).unwrap(), b"content");
    assert!(fs::symlink_metadata(k.p("link"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        fs::symlink_metadata(k.p("link")).unwrap().len(),
        6,
        "symlink size = target length"
    );
    symlink("does/not/exist", k.p("dangling")).unwrap();
    assert_errno(
        fs::metadata(k.p("dangling")),
        libc::ENOENT,
        "stat dangling symlink",
    );
    assert_errno(
        symlink("x", k.p("link")),
        libc::EEXIST,
        "symlink over existing",
    );
    let long_target = "t".repeat(4000);
    symlink(&long_target, k.p("longlink")).unwrap();
    assert_eq!(
        fs::read_link(k.p("longlink")).unwrap(),
        Path::new(&long_target)
    );

    fs::hard_link(k.p("target"), k.p("hard")).unwrap();
    assert_eq!(nlink(&k.p("target")), 2);
    assert_eq!(ino(&k.p("target")), ino(&k.p("hard")));
    fs::write(k.p("hard"), b"changed").unwrap();
    assert_eq!(fs::read(k.p("target")).unwrap(), b"changed");
    fs::remove_file(k.p("target")).unwrap();
    assert_eq!(nlink(&k.p("hard")), 1);
    assert_eq!(fs::read(k.p("hard")).unwrap(), b"changed");
    fs::create_dir(k.p("d")).unwrap();
    assert_errno(
        fs::hard_link(k.p("d"), k.p("dlink")),
        libc::EPERM,
        "hard link to a directory",
    );
    assert_errno(
        fs::hard_link(k.p("hard"), k.p("d")),
        libc::EEXIST,
        "link over existing",
    );

    sys::mknod(&k.p("fifo"), libc::S_IFIFO | 0o640, 0).unwrap();
    let m = fs::symlink_metadata(k.p("fifo")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&m.file_type()));
    assert_eq!(m.mode() & 0o7777, 0o640);

    sys::mknod(&k.p("null"), libc::S_IFCHR | 0o666, sys::makedev(1, 3)).unwrap();
    let m = fs::symlink_metadata(k.p("null")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &m.file_type()
    ));
    assert_eq!(m.rdev(), sys::makedev(1, 3));
    sys::mknod(&k.p("blk"), libc::S_IFBLK | 0o600, sys::makedev(7, 99)).unwrap();
    assert_eq!(
        fs::symlink_metadata(k.p("blk")).unwrap().rdev(),
        sys::makedev(7, 99)
    );
    sys::mknod(&k.p("sock"), libc::S_IFSOCK | 0o600, 0).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_socket(
        &fs::symlink_metadata(k.p("sock")).unwrap().file_type()
    ));
}

#[test]
fn chmod_chown_utimens() {
    let k = keel_or_skip!();
    let p = k.p("f");
    fs::write(&p, b"data").unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o4755)).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, 0o4755);
    std::os::unix::fs::chown(&p, Some(1234), Some(5678)).unwrap();
    let m = fs::metadata(&p).unwrap();
    assert_eq!((m.uid(), m.gid()), (1234, 5678));
    assert_eq!(
        m.mode() & 0o7777,
        0o755,
        "chown clears the setuid bit of a regular file"
    );

    // lchown changes the link, not the target.
    symlink("f", k.p("l")).unwrap();
    sys::lchown(&k.p("l"), 42, 43).unwrap();
    let lm = fs::symlink_metadata(k.p("l")).unwrap();
    assert_eq!((lm.uid(), lm.gid()), (42, 43));
    assert_eq!(fs::metadata(&p).unwrap().uid(), 1234);

    // Exact nanosecond timestamps, UTIME_OMIT and UTIME_NOW.
    sys::utimens(
        &p,
        Ts::At(1_600_000_000, 111_111_111),
        Ts::At(1_500_000_000, 123_456_789),
        false,
    )
    .unwrap();
    let m = fs::metadata(&p).unwrap();
    assert_eq!((m.atime(), m.atime_nsec()), (1_600_000_000, 111_111_111));
    assert_eq!((m.mtime(), m.mtime_nsec()), (1_500_000_000, 123_456_789));
    sys::utimens(&p, Ts::At(1_700_000_000, 5), Ts::Omit, false).unwrap();
    let m = fs::metadata(&p).unwrap();
    assert_eq!((m.atime(), m.atime_nsec()), (1_700_000_000, 5));
    assert_eq!(
        (m.mtime(), m.mtime_nsec()),
        (1_500_000_000, 123_456_789),
        "UTIME_OMIT"
    );
    sys::utimens(&p, Ts::Omit, Ts::Now, false).unwrap();
    let m = fs::metadata(&p).unwrap();
    assert_eq!(
        (m.atime(), m.atime_nsec()),
        (1_700_000_000, 5),
        "UTIME_OMIT"
    );
    assert!(m.mtime() > 1_700_000_000, "UTIME_NOW sets the current time");
    // Symlink timestamps (AT_SYMLINK_NOFOLLOW) are the link's own.
    sys::utimens(
        &k.p("l"),
        Ts::At(1_400_000_000, 7),
        Ts::At(1_400_000_000, 8),
        true,
    )
    .unwrap();
    let lm = fs::symlink_metadata(k.p("l")).unwrap();
    assert_eq!((lm.mtime(), lm.mtime_nsec()), (1_400_000_000, 8));
    assert_ne!(fs::metadata(&p).unwrap().mtime(), 1_400_000_000);

    // chmod changes ctime, not mtime.
    sys::utimens(&p, SENTINEL, SENTINEL, false).unwrap();
    let c0 = ctime_ns(&p);
    fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(mtime_ns(&p), SENTINEL_NS, "chmod leaves mtime alone");
    assert!(ctime_ns(&p) >= c0);

    // Writing updates mtime (and ctime); reading does not touch mtime.
    let _ = fs::read(&p).unwrap();
    assert_eq!(mtime_ns(&p), SENTINEL_NS, "read leaves mtime alone");
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .write_all_at(b"x", 1)
        .unwrap();
    assert_ne!(mtime_ns(&p), SENTINEL_NS, "write updates mtime");
    reset_times(&p);
    fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(100)
        .unwrap();
    assert_ne!(
        mtime_ns(&p),
        SENTINEL_NS,
        "ftruncate to a new size updates mtime"
    );
    reset_times(&p);
    drop(
        fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&p)
            .unwrap(),
    );
    assert_ne!(mtime_ns(&p), SENTINEL_NS, "O_TRUNC updates mtime");
}

/// Write, truncate, O_TRUNC and chown drop setuid (and setgid when the group may execute)
/// exactly as the host filesystem does: keel does it itself (FUSE_HANDLE_KILLPRIV_V2), so
/// the same steps run as an unprivileged user on keel and on the host, and must agree.
#[test]
fn writes_by_other_users_drop_setuid_like_the_host() {
    let k = keel_or_skip!();
    let host = k.scratch().join("host");
    fs::create_dir(&host).unwrap();
    // The user must reach both directories.
    for d in [k.scratch(), host.as_path(), k.mnt.as_path()] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    // (file mode, command run as uid/gid 1000, or as root when `root`)
    let cases: [(u32, &str, bool); 8] = [
        (0o6775, "printf x >> f", false),
        (0o2765, "printf x >> f", false),
        (0o6775, "printf x >> f", true),
        (0o6775, "truncate -s 1 f", false),
        (0o4755, ": > f", false),
        (
            0o6775,
            "dd if=/dev/zero of=f bs=4k count=1 conv=notrunc status=none",
            false,
        ),
        (0o4775, "cat f > /dev/null", false),
        (
            0o6775,
            "python3 -c 'import os; os.copy_file_range(os.open(\"f\", os.O_RDONLY), os.open(\"f\", os.O_WRONLY), 4, 0, 10)'",
            false,
        ),
    ];
    let outcome = |dir: &Path, mode: u32, cmd: &str, root: bool| -> u32 {
        let f = dir.join("f");
        let _ = fs::remove_file(&f);
        fs::write(&f, b"0123456789").unwrap();
        std::os::unix::fs::chown(&f, Some(1000), Some(1000)).unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(mode)).unwrap();
        let mut c = std::process::Command::new("sh");
        c.arg("-c").arg(cmd).current_dir(dir);
        if !root {
            use std::os::unix::process::CommandExt;
            c.uid(1000).gid(1000);
        }
        let st = c.status().unwrap();
        assert!(st.success(), "`{cmd}` failed in {}", dir.display());
        fs::metadata(&f).unwrap().mode() & 0o7777
    };
    for (mode, cmd, root) in cases {
        let want = outcome(&host, mode, cmd, root);
        let got = outcome(&k.mnt, mode, cmd, root);
        assert_eq!(
            format!("{got:o}"),
            format!("{want:o}"),
            "mode {mode:o} after `{cmd}` (root: {root}): keel vs host"
        );
    }
    // chown by root drops setuid too (and the setgid of a group-executable file).
    let f = k.p("g");
    fs::write(&f, b"x").unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o6755)).unwrap();
    std::os::unix::fs::chown(&f, Some(7), None).unwrap();
    assert_eq!(fs::metadata(&f).unwrap().mode() & 0o7777, 0o755);
}

#[test]
fn open_unlinked_file_stays_usable_until_close() {
    let k = keel_or_skip!();
    let p = k.p("doomed");
    let data = pattern(2 * 1024 * 1024 + 17, 11);
    fs::write(&p, &data).unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    fs::remove_file(&p).unwrap();
    assert_errno(fs::metadata(&p), libc::ENOENT, "stat unlinked");
    assert_eq!(
        fs::read_dir(&k.mnt).unwrap().count(),
        0,
        "no hidden leftovers in the directory"
    );
    assert_eq!(f.metadata().unwrap().nlink(), 0);
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(back, data, "unlinked file readable through the open fd");
    f.write_all_at(b"still writable", 100).unwrap();
    let mut b = [0u8; 14];
    f.read_exact_at(&mut b, 100).unwrap();
    assert_eq!(&b, b"still writable");
    // A new file with the same name is a different inode.
    fs::write(&p, b"new").unwrap();
    assert_ne!(ino(&p), f.metadata().unwrap().ino());
    assert_eq!(fs::read(&p).unwrap(), b"new");
    f.read_exact_at(&mut b, 100).unwrap();
    assert_eq!(&b, b"still writable");
    drop(f);
    assert_eq!(fs::read(&p).unwrap(), b"new");

    // Renaming over an open file: the old fd keeps the old bytes.
    fs::write(k.p("old"), b"old bytes").unwrap();
    fs::write(k.p("replacement"), b"new bytes").unwrap();
    let f = fs::File::open(k.p("old")).unwrap();
    fs::rename(k.p("replacement"), k.p("old")).unwrap();
    let mut s = String::new();
    (&f).read_to_string(&mut s).unwrap();
    assert_eq!(s, "old bytes");
    assert_eq!(fs::read(k.p("old")).unwrap(), b"new bytes");
}

#[test]
fn rename_flavours() {
    let k = keel_or_skip!();
    fs::create_dir_all(k.p("p1")).unwrap();
    fs::create_dir_all(k.p("p2")).unwrap();

    // Plain rename keeps the inode.
    fs::write(k.p("p1/a"), b"A").unwrap();
    let ia = ino(&k.p("p1/a"));
    fs::rename(k.p("p1/a"), k.p("p2/b")).unwrap();
    assert_errno(fs::metadata(k.p("p1/a")), libc::ENOENT, "old name");
    assert_eq!(fs::read(k.p("p2/b")).unwrap(), b"A");
    assert_eq!(ino(&k.p("p2/b")), ia, "rename keeps the inode number");

    // Over an existing file: replaced atomically.
    fs::write(k.p("p1/c"), b"C").unwrap();
    fs::rename(k.p("p1/c"), k.p("p2/b")).unwrap();
    assert_eq!(fs::read(k.p("p2/b")).unwrap(), b"C");
    assert_eq!(fs::read_dir(k.p("p1")).unwrap().count(), 0);

    // Directory over an empty directory: ok; over a non-empty one: ENOTEMPTY (or EEXIST).
    fs::create_dir(k.p("p1/d")).unwrap();
    fs::write(k.p("p1/d/inner"), b"i").unwrap();
    fs::create_dir(k.p("p2/empty")).unwrap();
    fs::rename(k.p("p1/d"), k.p("p2/empty")).unwrap();
    assert_eq!(fs::read(k.p("p2/empty/inner")).unwrap(), b"i");
    fs::create_dir(k.p("p1/d2")).unwrap();
    let e = fs::rename(k.p("p1/d2"), k.p("p2/empty")).unwrap_err();
    assert!(
        matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)),
        "dir over non-empty dir: {e}"
    );
    // Type mismatches.
    assert_errno(
        fs::rename(k.p("p2/b"), k.p("p1/d2")),
        libc::EISDIR,
        "file over dir",
    );
    assert_errno(
        fs::rename(k.p("p1/d2"), k.p("p2/b")),
        libc::ENOTDIR,
        "dir over file",
    );
    // Into its own subtree.
    fs::create_dir_all(k.p("p1/d2/sub/subsub")).unwrap();
    assert_errno(
        fs::rename(k.p("p1/d2"), k.p("p1/d2/sub/x")),
        libc::EINVAL,
        "dir into itself",
    );
    // Missing source.
    assert_errno(
        fs::rename(k.p("p1/none"), k.p("p1/x")),
        libc::ENOENT,
        "missing source",
    );
    // Hard links to the same inode: rename is a successful no-op.
    fs::hard_link(k.p("p2/b"), k.p("p2/b2")).unwrap();
    fs::rename(k.p("p2/b"), k.p("p2/b2")).unwrap();
    assert!(k.p("p2/b").exists() && k.p("p2/b2").exists());

    // RENAME_NOREPLACE
    fs::write(k.p("n1"), b"1").unwrap();
    fs::write(k.p("n2"), b"2").unwrap();
    assert_errno(
        sys::renameat2(&k.p("n1"), &k.p("n2"), libc::RENAME_NOREPLACE),
        libc::EEXIST,
        "RENAME_NOREPLACE onto existing",
    );
    assert_eq!(fs::read(k.p("n1")).unwrap(), b"1");
    assert_eq!(fs::read(k.p("n2")).unwrap(), b"2");
    sys::renameat2(&k.p("n1"), &k.p("n3"), libc::RENAME_NOREPLACE).unwrap();
    assert_eq!(fs::read(k.p("n3")).unwrap(), b"1");

    // RENAME_EXCHANGE: a file and a directory in different parents swap places.
    fs::create_dir(k.p("x1")).unwrap();
    fs::create_dir(k.p("x2")).unwrap();
    fs::write(k.p("x1/file"), b"F").unwrap();
    fs::create_dir(k.p("x2/dir")).unwrap();
    fs::write(k.p("x2/dir/inside"), b"I").unwrap();
    let (ifile, idir) = (ino(&k.p("x1/file")), ino(&k.p("x2/dir")));
    let (n1, n2) = (nlink(&k.p("x1")), nlink(&k.p("x2")));
    sys::renameat2(&k.p("x1/file"), &k.p("x2/dir"), libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs::read(k.p("x2/dir")).unwrap(), b"F");
    assert_eq!(fs::read(k.p("x1/file/inside")).unwrap(), b"I");
    assert_eq!(ino(&k.p("x2/dir")), ifile);
    assert_eq!(ino(&k.p("x1/file")), idir);
    assert_eq!(nlink(&k.p("x1")), n1 + 1, "x1 gained a subdirectory");
    assert_eq!(nlink(&k.p("x2")), n2 - 1, "x2 lost a subdirectory");
    assert_eq!(
        ino(&k.p("x1/file/..")),
        ino(&k.p("x1")),
        "'..' follows the exchanged directory"
    );
    assert_errno(
        sys::renameat2(&k.p("x1/file"), &k.p("x1/missing"), libc::RENAME_EXCHANGE),
        libc::ENOENT,
        "RENAME_EXCHANGE with a missing target",
    );
    assert_errno(
        sys::renameat2(
            &k.p("n2"),
            &k.p("n3"),
            libc::RENAME_EXCHANGE | libc::RENAME_NOREPLACE,
        ),
        libc::EINVAL,
        "EXCHANGE|NOREPLACE",
    );
}

#[test]
fn directory_nlink_and_mtime_updates() {
    let k = keel_or_skip!();
    let root_links = nlink(&k.mnt);
    fs::create_dir(k.p("a")).unwrap();
    assert_eq!(nlink(&k.p("a")), 2);
    assert_eq!(
        nlink(&k.mnt),
        root_links + 1,
        "mkdir adds a link to the parent"
    );

    let a = k.p("a");
    let check = |what: &str, dir: &Path, op: &dyn Fn()| {
        reset_times(dir);
        let c0 = ctime_ns(dir);
        op();
        assert_ne!(
            mtime_ns(dir),
            SENTINEL_NS,
            "{what}: parent mtime must change"
        );
        assert!(ctime_ns(dir) >= c0, "{what}: parent ctime must not go back");
    };
    check("create", &a, &|| fs::write(a.join("f"), b"1").unwrap());
    check("mkdir", &a, &|| fs::create_dir(a.join("sub")).unwrap());
    assert_eq!(nlink(&a), 3);
    check("symlink", &a, &|| symlink("f", a.join("l")).unwrap());
    check("link", &a, &|| {
        fs::hard_link(a.join("f"), a.join("f2")).unwrap()
    });
    check("rename within", &a, &|| {
        fs::rename(a.join("f2"), a.join("f3")).unwrap()
    });
    check("unlink", &a, &|| fs::remove_file(a.join("f3")).unwrap());
    check("mknod", &a, &|| {
        sys::mknod(&a.join("p"), libc::S_IFIFO | 0o600, 0).unwrap()
    });
    check("rmdir", &a, &|| fs::remove_dir(a.join("sub")).unwrap());
    assert_eq!(nlink(&a), 2);

    // Moving a directory between parents updates both parents' nlink and mtime.
    fs::create_dir(k.p("b")).unwrap();
    fs::create_dir(a.join("moving")).unwrap();
    let b = k.p("b");
    let (na, nb) = (nlink(&a), nlink(&b));
    reset_times(&a);
    reset_times(&b);
    fs::rename(a.join("moving"), b.join("moved")).unwrap();
    assert_eq!(
        nlink(&a),
        na - 1,
        "old parent loses the subdirectory's '..' link"
    );
    assert_eq!(nlink(&b), nb + 1, "new parent gains it");
    assert_ne!(mtime_ns(&a), SENTINEL_NS, "old parent mtime");
    assert_ne!(mtime_ns(&b), SENTINEL_NS, "new parent mtime");
    assert_eq!(ino(&b.join("moved/..")), ino(&b));

    // Operations that are not directory changes leave the parent's mtime alone.
    reset_times(&a);
    fs::OpenOptions::new()
        .write(true)
        .open(a.join("f"))
        .unwrap()
        .write_all(b"more")
        .unwrap();
    let _ = fs::read(a.join("f")).unwrap();
    fs::set_permissions(a.join("f"), fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        mtime_ns(&a),
        SENTINEL_NS,
        "writing a child does not change the directory"
    );
    // The link count of a file changes its ctime.
    let c0 = ctime_ns(&a.join("f"));
    fs::hard_link(a.join("f"), b.join("f-link")).unwrap();
    assert!(ctime_ns(&a.join("f")) >= c0);
    assert_eq!(nlink(&a.join("f")), 2);
}

#[test]
fn name_and_path_limits() {
    let k = keel_or_skip!();
    let ok = "n".repeat(255);
    let long = "n".repeat(256);
    fs::write(k.p(&ok), b"ok").unwrap();
    assert_eq!(fs::read(k.p(&ok)).unwrap(), b"ok");
    fs::create_dir(k.p(&format!("d{}", &ok[1..]))).unwrap();
    assert_errno(
        fs::write(k.p(&long), b""),
        libc::ENAMETOOLONG,
        "create 256-byte name",
    );
    assert_errno(
        fs::create_dir(k.p(&long)),
        libc::ENAMETOOLONG,
        "mkdir 256-byte name",
    );
    assert_errno(
        fs::metadata(k.p(&long)),
        libc::ENAMETOOLONG,
        "lookup 256-byte name",
    );
    assert_errno(
        symlink("x", k.p(&long)),
        libc::ENAMETOOLONG,
        "symlink 256-byte name",
    );
    assert_errno(
        fs::hard_link(k.p(&ok), k.p(&long)),
        libc::ENAMETOOLONG,
        "link 256-byte name",
    );
    assert_errno(
        fs::rename(k.p(&ok), k.p(&long)),
        libc::ENAMETOOLONG,
        "rename to 256-byte name",
    );
    assert_errno(
        sys::mknod(&k.p(&long), libc::S_IFIFO | 0o600, 0),
        libc::ENAMETOOLONG,
        "mknod 256-byte name",
    );
    assert_errno(
        sys::set_xattr(&k.p(&ok), &format!("user.{}", "x".repeat(300)), b"v", 0),
        libc::ERANGE,
        "xattr name over 255 bytes",
    );
    // A path over PATH_MAX (4096).
    let deep = format!("{}/{}", k.mnt.display(), "abcdefg/".repeat(600));
    assert_errno(
        fs::metadata(&deep),
        libc::ENAMETOOLONG,
        "path over PATH_MAX",
    );
    assert_errno(
        symlink("t".repeat(4096), k.p("s")),
        libc::ENAMETOOLONG,
        "symlink target >= PATH_MAX",
    );
    let m = sys::statvfs(&k.mnt).unwrap();
    assert_eq!(m.f_namemax, 255);
}

#[test]
fn symlink_loops_give_eloop() {
    let k = keel_or_skip!();
    symlink("b", k.p("a")).unwrap();
    symlink("a", k.p("b")).unwrap();
    symlink("self", k.p("self")).unwrap();
    assert_errno(fs::read(k.p("a")), libc::ELOOP, "open a<->b loop");
    assert_errno(fs::metadata(k.p("self")), libc::ELOOP, "stat self loop");
    assert_errno(
        fs::read_dir(k.p("a/x")),
        libc::ELOOP,
        "loop in a path component",
    );
    // A chain longer than the kernel's 40 follows.
    fs::write(k.p("end"), b"end").unwrap();
    symlink("end", k.p("c0")).unwrap();
    for i in 1..=41 {
        symlink(format!("c{}", i - 1), k.p(&format!("c{i}"))).unwrap();
    }
    assert_eq!(fs::read(k.p("c39")).unwrap(), b"end");
    assert_errno(fs::read(k.p("c41")), libc::ELOOP, "41 nested symlinks");
    // O_NOFOLLOW on a symlink.
    assert_errno(
        sys::open_raw(&k.p("c0"), libc::O_RDONLY | libc::O_NOFOLLOW, 0),
        libc::ELOOP,
        "O_NOFOLLOW on a symlink",
    );
}

#[test]
fn xattr_semantics() {
    let k = keel_or_skip!();
    let p = k.p("f");
    fs::write(&p, b"x").unwrap();
    fs::create_dir(k.p("d")).unwrap();
    for target in [p.clone(), k.p("d")] {
        let t = target.as_path();
        assert_errno(sys::get_xattr(t, "user.a"), libc::ENODATA, "get missing");
        assert_errno(
            sys::set_xattr(t, "user.a", b"1", libc::XATTR_REPLACE),
            libc::ENODATA,
            "REPLACE missing",
        );
        sys::set_xattr(t, "user.a", b"1", libc::XATTR_CREATE).unwrap();
        assert_errno(
            sys::set_xattr(t, "user.a", b"2", libc::XATTR_CREATE),
            libc::EEXIST,
            "CREATE existing",
        );
        assert_eq!(sys::get_xattr(t, "user.a").unwrap(), b"1");
        sys::set_xattr(t, "user.a", b"22", libc::XATTR_REPLACE).unwrap();
        assert_eq!(sys::get_xattr(t, "user.a").unwrap(), b"22");
        sys::set_xattr(t, "user.a", b"333", 0).unwrap();
        sys::set_xattr(t, "user.empty", b"", 0).unwrap();
        assert_eq!(sys::get_xattr(t, "user.empty").unwrap(), b"");
        let big = pattern(4000, 5);
        sys::set_xattr(t, "user.big", &big, 0).unwrap();
        assert_eq!(
            sys::get_xattr(t, "user.big").unwrap(),
            big,
            "4000-byte value"
        );
        // Up to XATTR_SIZE_MAX (64 KiB) a filesystem may store the value or say E2BIG/ENOSPC.
        let huge = pattern(65536, 6);
        match sys::set_xattr(t, "user.huge", &huge, 0) {
            Ok(()) => {
                assert_eq!(
                    sys::get_xattr(t, "user.huge").unwrap(),
                    huge,
                    "64 KiB value"
                );
                sys::remove_xattr(t, "user.huge").unwrap();
            }
            Err(e) => assert!(
                matches!(e.raw_os_error(), Some(libc::E2BIG) | Some(libc::ENOSPC)),
                "64 KiB xattr value: {e}"
            ),
        }
        assert_errno(
            sys::set_xattr(t, "user.toobig", &vec![0u8; 65537], 0),
            libc::E2BIG,
            "value > 64 KiB",
        );
        // Size query and a too-small buffer.
        assert_eq!(sys::get_xattr_raw(t, "user.a", &mut []).unwrap(), 3);
        assert_errno(
            sys::get_xattr_raw(t, "user.a", &mut [0u8; 2]),
            libc::ERANGE,
            "small buffer",
        );
        assert_eq!(
            sys::list_xattrs(t).unwrap(),
            vec!["user.a", "user.big", "user.empty"]
        );
        sys::remove_xattr(t, "user.big").unwrap();
        assert_errno(
            sys::remove_xattr(t, "user.big"),
            libc::ENODATA,
            "remove missing",
        );
        assert_eq!(sys::list_xattrs(t).unwrap(), vec!["user.a", "user.empty"]);
        // A file's xattrs are capped (keel: 256 KiB of names and values), so a flood cannot
        // grow every metadata image: the fifth 64 KiB value gets ENOSPC, replacing one of
        // the four still works, and removing one makes room again.
        let full = vec![7u8; 65536 - 64];
        for i in 0..4 {
            sys::set_xattr(t, &format!("user.flood{i}"), &full, 0).unwrap();
        }
        assert_errno(
            sys::set_xattr(t, "user.flood4", &full, 0),
            libc::ENOSPC,
            "xattrs past the per-file cap",
        );
        sys::set_xattr(t, "user.flood3", &full[..100], libc::XATTR_REPLACE).unwrap();
        sys::set_xattr(t, "user.flood4", &full, 0).unwrap();
        for i in 0..5 {
            sys::remove_xattr(t, &format!("user.flood{i}")).unwrap();
        }
        // Root may use the trusted namespace.
        sys::set_xattr(t, "trusted.t", b"root only", 0).unwrap();
        assert_eq!(sys::get_xattr(t, "trusted.t").unwrap(), b"root only");
    }
    // Setting an xattr changes ctime, not mtime.
    sys::utimens(&p, SENTINEL, SENTINEL, false).unwrap();
    sys::set_xattr(&p, "user.c", b"c", 0).unwrap();
    assert_eq!(mtime_ns(&p), SENTINEL_NS);
    // Hard links share xattrs; unlinking one name keeps them.
    fs::hard_link(&p, k.p("f2")).unwrap();
    assert_eq!(sys::get_xattr(&k.p("f2"), "user.c").unwrap(), b"c");
    fs::remove_file(&p).unwrap();
    assert_eq!(sys::get_xattr(&k.p("f2"), "user.a").unwrap(), b"333");
}

#[test]
fn statfs_reports_the_state_volume() {
    let k = keel_or_skip!();
    let m = sys::statvfs(&k.mnt).unwrap();
    let s = sys::statvfs(&k.state).unwrap();
    assert!(
        m.f_bsize > 0 && m.f_frsize > 0 && m.f_blocks > 0,
        "statfs: {m:?}"
    );
    assert!(m.f_bfree <= m.f_blocks && m.f_bavail <= m.f_blocks);
    let total = |v: &libc::statvfs| v.f_blocks as f64 * v.f_frsize as f64;
    let ratio = total(&m) / total(&s);
    assert!(
        (0.9..=1.1).contains(&ratio),
        "workspace size {} vs state volume {} bytes",
        total(&m),
        total(&s)
    );
}

#[test]
fn many_threads_in_parallel() {
    // Concurrent creates/writes/reads from several threads (keel serves with n_threads).
    let k = keel_or_skip!();
    let base = k.mnt.clone();
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let base = base.clone();
            std::thread::spawn(move || {
                let d = base.join(format!("t{t}"));
                fs::create_dir(&d).unwrap();
                for i in 0..100 {
                    let data = pattern(1000 + i * 37, (t * 1000 + i) as u64);
                    fs::write(d.join(format!("f{i}")), &data).unwrap();
                    assert_eq!(fs::read(d.join(format!("f{i}"))).unwrap(), data);
                }
                for i in (0..100).step_by(2) {
                    fs::remove_file(d.join(format!("f{i}"))).unwrap();
                }
                assert_eq!(fs::read_dir(&d).unwrap().count(), 50);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// Found by the differential test (seed 1): a write through an open fd followed by a readdir
/// of the parent (READDIRPLUS carries attributes) must not make the file look shorter, whether
/// the fd came from O_CREAT or from opening an existing file.
#[test]
fn readdir_after_write_through_open_fd_keeps_size_and_mtime() {
    let k = keel_or_skip!();
    for existing in [false, true] {
        let p = k.p(if existing { "existing" } else { "created" });
        if existing {
            fs::write(&p, b"").unwrap();
        }
        let f = OpenOptions::new()
            .create(!existing)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let what = if existing { "existing file" } else { "O_CREAT" };
        f.write_all_at(b"payload", 5000).unwrap();
        let _ = fs::read_dir(&k.mnt).unwrap().count();
        assert_eq!(
            fs::metadata(&p).unwrap().len(),
            5007,
            "{what}: stat after readdir"
        );
        assert_eq!(
            f.metadata().unwrap().len(),
            5007,
            "{what}: fstat after readdir"
        );
        reset_times(&p);
        f.write_all_at(b"more", 6000).unwrap();
        let _ = fs::read_dir(&k.mnt).unwrap().count();
        assert_eq!(fs::metadata(&p).unwrap().len(), 6004, "{what}");
        assert_ne!(
            mtime_ns(&p),
            SENTINEL_NS,
            "{what}: mtime after write + readdir"
        );
        drop(f);
        let data = fs::read(&p).unwrap();
        assert_eq!(data.len(), 6004, "{what}: size after close");
        assert_eq!(&data[5000..5007], b"payload");
        assert_eq!(&data[6000..], b"more");
    }
}

/// Found by the differential test (seeds 2, 3): fallocate changes mtime and ctime, in every
/// mode, as on ext4 and tmpfs (the kernel's file_modified()).
#[test]
fn fallocate_updates_mtime() {
    let k = keel_or_skip!();
    let p = k.p("f");
    fs::write(&p, pattern(300_000, 1)).unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    for (mode, off, len, what) in [
        (0, 0, 400_000, "mode 0 extending"),
        (libc::FALLOC_FL_KEEP_SIZE, 0, 4096, "KEEP_SIZE inside"),
        (
            libc::FALLOC_FL_KEEP_SIZE,
            1_000_000,
            4096,
            "KEEP_SIZE beyond EOF",
        ),
        (
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            4096,
            8192,
            "PUNCH_HOLE",
        ),
    ] {
        reset_times(&p);
        sys::fallocate(&f, mode, off, len).unwrap();
        assert_ne!(
            mtime_ns(&p),
            SENTINEL_NS,
            "fallocate {what} must update mtime"
        );
    }
}

/// Files created write-only (`fs::write`, `cp`, `echo >`) are passed through to a body from
/// the start; the small ones go back inline at close and their bodies to the pool, so only
/// the large files keep a body. Contents are right before and after a remount.
#[test]
fn files_created_write_only_keep_a_body_only_when_large() {
    let mut k = keel_or_skip!("--passthrough", "on");
    let small: Vec<Vec<u8>> = (0..40).map(|i| pattern(100 + i * 50, i as u64)).collect();
    for (i, d) in small.iter().enumerate() {
        fs::write(k.p(&format!("s{i}")), d).unwrap();
    }
    let big = pattern((1 << 20) + 3, 99);
    fs::write(k.p("big"), &big).unwrap();
    fs::copy(k.p("big"), k.p("big2")).unwrap();
    let mut f = OpenOptions::new().append(true).open(k.p("s0")).unwrap();
    f.write_all(b"appended").unwrap();
    drop(f);
    let mut s0 = small[0].clone();
    s0.extend_from_slice(b"appended");
    let check = |k: &support::mount::Keel| {
        assert_eq!(fs::read(k.p("s0")).unwrap(), s0);
        for (i, d) in small.iter().enumerate().skip(1) {
            assert_eq!(&fs::read(k.p(&format!("s{i}"))).unwrap(), d, "s{i}");
        }
        assert_eq!(fs::read(k.p("big")).unwrap(), big);
        assert_eq!(fs::read(k.p("big2")).unwrap(), big);
    };
    check(&k);
    k.stop();
    let bodies: Vec<String> = (0..=255u32)
        .flat_map(|s| fs::read_dir(k.state.join(format!("bodies/{s:02x}"))).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(bodies.len(), 2, "only big and big2 keep a body: {bodies:?}");
    let pooled = fs::read_dir(k.state.join("bodies/pool")).unwrap().count();
    assert!(pooled >= 1, "the small files' bodies wait in the pool");
    k.start_again();
    check(&k);
}

/// Body files named in `state/bodies/*/` (not the pool).
fn named_bodies(state: &Path) -> usize {
    (0..=255u32)
        .filter_map(|s| fs::read_dir(state.join(format!("bodies/{s:02x}"))).ok())
        .map(|d| d.count())
        .sum()
}

/// Deleting files frees their bodies while the workspace stays mounted, once the kernel
/// forgets the inodes (FORGETs of many unlinks arrive together, see serve::FORGET_BATCH),
/// and a file still open keeps its body until it is closed.
#[test]
fn deleted_files_free_their_bodies_while_mounted() {
    let k = keel_or_skip!();
    let data = pattern(64 << 10, 5);
    for i in 0..30 {
        let mut f = fs::File::create(k.p(&format!("f{i}"))).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
    }
    assert_eq!(named_bodies(&k.state), 30);
    let held = fs::File::open(k.p("f0")).unwrap();
    for i in 0..30 {
        fs::remove_file(k.p(&format!("f{i}"))).unwrap();
    }
    let wait_for = |n: usize| {
        support::mount::poll_for(support::mount::READY_TIMEOUT, || {
            (named_bodies(&k.state) == n).then_some(n)
        })
        .unwrap_or_else(|| named_bodies(&k.state))
    };
    assert_eq!(wait_for(1), 1, "29 bodies freed, the open file's kept");
    let mut back = Vec::new();
    (&held).read_to_end(&mut back).unwrap();
    assert_eq!(back, data, "an unlinked file still reads while open");
    drop(held);
    assert_eq!(wait_for(0), 0, "the last body goes once the file is closed");
}

/// Used inodes of the mount (statfs: files - free files; keel counts its inode rows).
fn inodes_used(mnt: &Path) -> u64 {
    let s = sys::statvfs(mnt).unwrap();
    s.f_files - s.f_ffree
}

/// A directory removed or renamed over while a process holds it open (or as its working
/// directory) still answers `fstat`/`stat(".")`, with nlink 0, as on ext4 (xfstests
/// generic/035); once nothing holds it, it is gone from the store.
#[test]
fn open_directory_removed_or_renamed_over_still_answers_fstat() {
    let k = keel_or_skip!();
    let base = inodes_used(&k.mnt);
    let d = k.mnt.join("d");
    fs::create_dir(&d).unwrap();
    let held = fs::File::open(&d).unwrap();
    fs::remove_dir(&d).unwrap();
    let m = held
        .metadata()
        .expect("fstat of an open directory after rmdir");
    assert!(m.is_dir());
    assert_eq!(m.nlink(), 0, "a removed directory has no links");

    let (a, b) = (k.mnt.join("a"), k.mnt.join("b"));
    fs::create_dir(&a).unwrap();
    fs::create_dir(&b).unwrap();
    let old_b = fs::File::open(&b).unwrap();
    let old_ino = old_b.metadata().unwrap().ino();
    fs::rename(&a, &b).unwrap();
    let m = old_b
        .metadata()
        .expect("fstat of an open directory renamed over");
    assert_eq!((m.ino(), m.nlink()), (old_ino, 0));
    assert_ne!(ino(&b), old_ino);

    // A working directory removed under a process.
    let c = k.mnt.join("c");
    fs::create_dir(&c).unwrap();
    let out = std::process::Command::new("sh")
        .current_dir(&c)
        .args(["-c", "rmdir \"$PWD\" && stat -c %h:%F ."])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0:directory");

    // Nothing holds them any more: they leave the store (once the kernel's FORGETs, which
    // it batches, arrive: the wait is only a hang guard).
    drop(held);
    drop(old_b);
    fs::remove_dir(&b).unwrap();
    let gone = support::mount::poll_for(std::time::Duration::from_secs(60), || {
        (inodes_used(&k.mnt) == base).then_some(())
    });
    assert!(
        gone.is_some(),
        "removed directories stay in the store: {} inodes used, {base} before",
        inodes_used(&k.mnt)
    );
}

/// `rewinddir` shows the entries made and removed since `opendir` (xfstests generic/471).
#[test]
fn rewinddir_shows_entries_changed_since_opendir() {
    let k = keel_or_skip!();
    let d = k.mnt.join("d");
    fs::create_dir(&d).unwrap();
    fs::write(d.join("old"), b"x").unwrap();
    let mut stream = sys::DirStream::open(&d).unwrap();
    let mut first = stream.names();
    first.sort();
    assert_eq!(first, [".", "..", "old"]);
    for i in 0..3 {
        fs::write(d.join(format!("new{i}")), b"y").unwrap();
    }
    fs::remove_file(d.join("old")).unwrap();
    stream.rewind();
    let mut again = stream.names();
    again.sort();
    assert_eq!(again, [".", "..", "new0", "new1", "new2"]);
}

//! Set-user-ID and set-group-ID bits as ext4 keeps them: the same operations, by root and by
//! an unprivileged user (`nobody`, in a forked child that dropped to uid/gid 65534), on a
//! keel mount and on an ext4 directory of this machine, and the resulting modes compared row
//! by row (the table is printed). Every kind of file: regular files, directories, FIFOs,
//! sockets and character and block devices, each chowned and chgrped in both call forms. Also: names the kernel already caches beneath a directory
//! that denies `nobody` search permission stay out of its reach (keel relies on the kernel's
//! `default_permissions`, which checks every path walk, cached or not). Needs root, /dev/fuse
//! and an ext4 temp dir: without them it fails when CI is set and skips otherwise.

use crate::support;

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

const NOBODY: u32 = 65534;
const NOGROUP: u32 = 65534;

#[derive(Debug, Clone, Copy)]
enum Op {
    /// chown(path, -1, -1)
    ChownNoop,
    /// chown(path, -1, gid)
    Chgrp(u32),
    /// chown(path, uid, -1)
    Chown(u32),
    /// chown(path, uid, gid)
    ChownBoth(u32, u32),
    /// open O_WRONLY, write one byte, close
    Write,
    /// open O_RDWR|O_DIRECT, write 4 KiB at 0, close (xfstests generic/355, as `xfs_io -d`)
    DirectWrite,
    /// truncate(path, 0)
    Truncate,
    /// open O_WRONLY|O_TRUNC, close
    OpenTrunc,
    /// stat(path)
    Stat,
    /// open O_RDONLY, read one byte, close
    Read,
}

/// What a row's node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    File,
    Dir,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

impl Node {
    fn name(self) -> &'static str {
        match self {
            Node::File => "file",
            Node::Dir => "dir",
            Node::Fifo => "fifo",
            Node::Socket => "socket",
            Node::CharDev => "char dev",
            Node::BlockDev => "block dev",
        }
    }
}

struct Row {
    what: String,
    node: Node,
    mode: u32,
    uid: u32,
    gid: u32,
    /// Who does `op`: 0 (root) or NOBODY.
    actor: u32,
    op: Op,
}

fn rows() -> Vec<Row> {
    let f = |what: &str, mode, uid, gid, actor, op| Row {
        what: what.to_string(),
        node: Node::File,
        mode,
        uid,
        gid,
        actor,
        op,
    };
    let mut rows = vec![
        f(
            "owner chown(-1,-1) of 06555",
            0o6555,
            NOBODY,
            NOGROUP,
            NOBODY,
            Op::ChownNoop,
        ),
        f(
            "root chown(-1,-1) of 06755",
            0o6755,
            NOBODY,
            NOGROUP,
            0,
            Op::ChownNoop,
        ),
        f(
            "root chown(-1,-1) of 06745",
            0o6745,
            NOBODY,
            NOGROUP,
            0,
            Op::ChownNoop,
        ),
        f(
            "owner chgrp to own group, 06745",
            0o6745,
            NOBODY,
            NOGROUP,
            NOBODY,
            Op::Chgrp(NOGROUP),
        ),
        f(
            "owner chgrp to own group, 06755",
            0o6755,
            NOBODY,
            NOGROUP,
            NOBODY,
            Op::Chgrp(NOGROUP),
        ),
        f(
            "root chown to nobody, 06745",
            0o6745,
            0,
            0,
            0,
            Op::Chown(NOBODY),
        ),
        f(
            "root chown to nobody, 06755",
            0o6755,
            0,
            0,
            0,
            Op::Chown(NOBODY),
        ),
        f("user write, 06777", 0o6777, 0, 0, NOBODY, Op::Write),
        f(
            "user write, 06767 not in group",
            0o6767,
            0,
            0,
            NOBODY,
            Op::Write,
        ),
        f(
            "user write, 06767 in group",
            0o6767,
            0,
            NOGROUP,
            NOBODY,
            Op::Write,
        ),
        f("root write, 06777", 0o6777, 0, 0, 0, Op::Write),
        f(
            "owner O_DIRECT write, 06644",
            0o6644,
            NOBODY,
            NOGROUP,
            NOBODY,
            Op::DirectWrite,
        ),
        f(
            "owner O_DIRECT write, 06744",
            0o6744,
            NOBODY,
            NOGROUP,
            NOBODY,
            Op::DirectWrite,
        ),
        f(
            "owner O_DIRECT write, 06654",
            0o6654,
            NOBODY,
            NOGROUP,
            NOBODY,
            Op::DirectWrite,
        ),
        f(
            "owner O_DIRECT write, 06754",
            0o6754,
            NOBODY,
            NOGROUP,
            NOBODY,
            Op::DirectWrite,
        ),
        f(
            "user O_DIRECT write, 06777",
            0o6777,
            0,
            0,
            NOBODY,
            Op::DirectWrite,
        ),
        f(
            "root O_DIRECT write, 06777",
            0o6777,
            0,
            0,
            0,
            Op::DirectWrite,
        ),
        f("user truncate, 06777", 0o6777, 0, 0, NOBODY, Op::Truncate),
        f(
            "user truncate, 02767 in group",
            0o2767,
            0,
            NOGROUP,
            NOBODY,
            Op::Truncate,
        ),
        f("root truncate, 06777", 0o6777, 0, 0, 0, Op::Truncate),
        f(
            "user open O_TRUNC, 06777",
            0o6777,
            0,
            0,
            NOBODY,
            Op::OpenTrunc,
        ),
        f("root open O_TRUNC, 06777", 0o6777, 0, 0, 0, Op::OpenTrunc),
        Row {
            what: "owner chown(-1,-1) of dir 06755".to_string(),
            node: Node::Dir,
            mode: 0o6755,
            uid: NOBODY,
            gid: NOGROUP,
            actor: NOBODY,
            op: Op::ChownNoop,
        },
        Row {
            what: "root chown to nobody, dir 06775".to_string(),
            node: Node::Dir,
            mode: 0o6775,
            uid: 0,
            gid: 0,
            actor: 0,
            op: Op::Chown(NOBODY),
        },
    ];
    // Every kind of node (regular files too, as the reference), owned by nobody in root's
    // group: the owner moves it to its own group in both forms of the call, root chowns
    // and chgrps it, and the owner chowns it to itself without changing anything.
    for node in [
        Node::File,
        Node::Dir,
        Node::Fifo,
        Node::Socket,
        Node::CharDev,
        Node::BlockDev,
    ] {
        let name = node.name();
        let row = |what: String, mode, actor, op| Row {
            what,
            node,
            mode,
            uid: NOBODY,
            gid: 0,
            actor,
            op,
        };
        rows.extend([
            row(
                format!("owner chown(uid,gid) {name} 06555"),
                0o6555,
                NOBODY,
                Op::ChownBoth(NOBODY, NOGROUP),
            ),
            row(
                format!("owner chown(-1,gid) {name} 06555"),
                0o6555,
                NOBODY,
                Op::Chgrp(NOGROUP),
            ),
            row(
                format!("owner chown(-1,gid) {name} 06545"),
                0o6545,
                NOBODY,
                Op::Chgrp(NOGROUP),
            ),
            row(
                format!("owner chown(uid,-1) {name} 06555"),
                0o6555,
                NOBODY,
                Op::Chown(NOBODY),
            ),
            row(
                format!("root chown(uid,gid) {name} 06545"),
                0o6545,
                0,
                Op::ChownBoth(0, NOGROUP),
            ),
            row(
                format!("root chown(-1,gid) {name} 06755"),
                0o6755,
                0,
                Op::Chgrp(NOGROUP),
            ),
        ]);
    }
    rows
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// Runs `op` on `path` in a forked child as `actor` (root stays root; otherwise the child
/// drops to NOBODY/NOGROUP with no supplementary groups, which also empties its effective
/// capabilities). Returns 0 or the errno of the first failed step.
fn run_as(actor: u32, op: Op, path: &Path) -> i32 {
    let c = cpath(path);
    let byte = [b'x'];
    // 4 KiB at a 4 KiB-aligned address, as O_DIRECT wants.
    let mut block = vec![b'd'; 8192];
    let skew = block.as_ptr().align_offset(4096);
    let aligned = block[skew..skew + 4096].as_mut_ptr();
    // SAFETY: the child calls only async-signal-safe syscalls on memory prepared before the
    // fork (`c`, `byte`, `block`), then _exit; the parent waits for it.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let err = || *libc::__errno_location();
            if actor != 0
                && (libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setresgid(NOGROUP, NOGROUP, NOGROUP) != 0
                    || libc::setresuid(actor, actor, actor) != 0)
            {
                libc::_exit(200);
            }
            let none = u32::MAX;
            let r = match op {
                Op::ChownNoop => libc::chown(c.as_ptr(), none, none),
                Op::Chgrp(g) => libc::chown(c.as_ptr(), none, g),
                Op::Chown(u) => libc::chown(c.as_ptr(), u, none),
                Op::ChownBoth(u, g) => libc::chown(c.as_ptr(), u, g),
                Op::Truncate => libc::truncate(c.as_ptr(), 0),
                Op::Stat => {
                    let mut st: libc::stat = std::mem::zeroed();
                    libc::stat(c.as_ptr(), &mut st)
                }
                Op::Read => {
                    let fd = libc::open(c.as_ptr(), libc::O_RDONLY);
                    if fd < 0 {
                        libc::_exit(err());
                    }
                    let mut b = [0u8; 1];
                    if libc::read(fd, b.as_mut_ptr().cast(), 1) != 1 {
                        libc::_exit(err());
                    }
                    libc::close(fd)
                }
                Op::Write | Op::OpenTrunc | Op::DirectWrite => {
                    let flags = match op {
                        Op::Write => libc::O_WRONLY,
                        Op::DirectWrite => libc::O_RDWR | libc::O_DIRECT,
                        _ => libc::O_WRONLY | libc::O_TRUNC,
                    };
                    let fd = libc::open(c.as_ptr(), flags);
                    if fd < 0 {
                        libc::_exit(err());
                    }
                    if matches!(op, Op::Write) && libc::write(fd, byte.as_ptr().cast(), 1) != 1 {
                        libc::_exit(err());
                    }
                    if matches!(op, Op::DirectWrite)
                        && libc::write(fd, aligned.cast_const().cast(), 4096) != 4096
                    {
                        libc::_exit(err());
                    }
                    libc::close(fd)
                }
            };
            libc::_exit(if r == 0 { 0 } else { err() });
        }
        let mut status = 0;
        assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        assert!(libc::WIFEXITED(status), "child died: {status}");
        libc::WEXITSTATUS(status)
    }
}

/// Makes a node of kind `node` at `p` (as root, mode 0600).
fn make_node(node: Node, p: &Path) {
    let dev = |kind: libc::mode_t, major, minor| {
        let c = cpath(p);
        // SAFETY: mknod reads the NUL-terminated path `c`, which outlives the call.
        let r = unsafe { libc::mknod(c.as_ptr(), kind | 0o600, libc::makedev(major, minor)) };
        assert_eq!(r, 0, "mknod {p:?}: {}", std::io::Error::last_os_error());
    };
    match node {
        Node::File => fs::write(p, b"data").unwrap(),
        Node::Dir => fs::create_dir(p).unwrap(),
        Node::Fifo => dev(libc::S_IFIFO, 0, 0),
        Node::Socket => dev(libc::S_IFSOCK, 0, 0),
        Node::CharDev => dev(libc::S_IFCHR, 1, 3),
        Node::BlockDev => dev(libc::S_IFBLK, 7, 0),
    }
}

/// Makes the row's node at `p` (owner, group, then mode: chown would clear the bits), runs
/// the operation, and returns (errno, resulting mode & 07777).
fn apply(row: &Row, p: &Path) -> (i32, u32) {
    make_node(row.node, p);
    std::os::unix::fs::chown(p, Some(row.uid), Some(row.gid)).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(row.mode)).unwrap();
    assert_eq!(
        fs::metadata(p).unwrap().mode() & 0o7777,
        row.mode,
        "setup of {p:?}"
    );
    let e = run_as(row.actor, row.op, p);
    (e, mode_only(p))
}

/// The mode as `stat -c %A` reads it: statx asking for the mode alone, which the kernel may
/// answer from what it caches of the inode while its other attributes are stale (after a
/// write it drops only the size and times; `fs::metadata` asks for everything).
fn mode_only(p: &Path) -> u32 {
    let c = cpath(p);
    // SAFETY: statx reads the NUL-terminated path `c` and writes only into `st`, a zeroed
    // statx struct owned here; both outlive the call.
    unsafe {
        let mut st: libc::statx = std::mem::zeroed();
        let r = libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_MODE,
            &mut st,
        );
        assert_eq!(r, 0, "statx {p:?}: {}", std::io::Error::last_os_error());
        u32::from(st.stx_mode) & 0o7777
    }
}

fn on_ext4(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::EXT4_SUPER_MAGIC)
}

#[test]
fn setid_bits_after_chown_write_truncate_match_ext4() {
    compare_with_ext4(&[]);
}

/// The same with every write through keel (and the writeback cache): passthrough off.
#[test]
fn setid_bits_match_ext4_without_passthrough() {
    compare_with_ext4(&["--passthrough", "off"]);
}

/// Runs every row on a keel mount started with `args` and on an ext4 dir; asserts the
/// results agree.
fn compare_with_ext4(args: &[&str]) {
    let Some(k) = support::mount::Keel::start(args) else {
        return;
    };
    let ext4 = k.scratch().join("ext4");
    fs::create_dir(&ext4).unwrap();
    if !on_ext4(&ext4) {
        let why = format!("{} is not on ext4", ext4.display());
        if std::env::var_os("CI").is_some() {
            panic!("CI is set but {why}: refusing to skip the comparison with ext4");
        }
        eprintln!("skipping: {why}");
        return;
    }
    // `nobody` must reach both directories.
    for d in [k.scratch(), ext4.as_path(), k.mnt.as_path()] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut table = vec![format!(
        "{:<40} {:>6} {:>10} {:>10}",
        "operation", "actor", "ext4", "keel"
    )];
    let mut differ = Vec::new();
    for (i, row) in rows().iter().enumerate() {
        let name = format!("r{i}");
        let (e_err, e_mode) = apply(row, &ext4.join(&name));
        let (k_err, k_mode) = apply(row, &k.mnt.join(&name));
        let show = |err: i32, mode: u32| {
            if err == 0 {
                format!("{mode:05o}")
            } else {
                format!("err {err}")
            }
        };
        let actor = if row.actor == 0 { "root" } else { "nobody" };
        table.push(format!(
            "{:<40} {:>6} {:>10} {:>10}{}",
            row.what,
            actor,
            show(e_err, e_mode),
            show(k_err, k_mode),
            if (e_err, e_mode) == (k_err, k_mode) {
                ""
            } else {
                "   <- differs"
            }
        ));
        if (e_err, e_mode) != (k_err, k_mode) {
            differ.push(row.what.clone());
        }
    }
    let table = table.join("\n");
    println!("{table}");
    assert!(
        differ.is_empty(),
        "keel ({args:?}) differs from ext4 in {differ:?}:\n{table}"
    );
}

/// Without `default_permissions` the kernel would check nothing on a walk through a
/// directory and reach a cached name without asking keel (BENCHMARKS.md, "What
/// `default_permissions` costs"); this pins that the mount keeps the kernel's checks.
#[test]
fn cached_names_beneath_a_private_directory_stay_private() {
    let k = keel_or_skip!();
    for d in [k.scratch(), k.mnt.as_path()] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let secret = k.mnt.join("secret");
    fs::create_dir(&secret).unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(secret.join("f"), b"topsecret").unwrap();
    fs::write(secret.join("g"), b"other").unwrap();
    // Root walks to both names: the kernel now caches their dentries and attributes.
    assert_eq!(fs::read(secret.join("f")).unwrap(), b"topsecret");
    assert!(fs::metadata(secret.join("g")).is_ok());
    assert_eq!(run_as(0, Op::Read, &secret.join("f")), 0, "root reads f");
    for (op, name) in [(Op::Stat, "g"), (Op::Read, "f"), (Op::Stat, "f")] {
        let e = run_as(NOBODY, op, &secret.join(name));
        assert_eq!(
            e,
            libc::EACCES,
            "nobody's {op:?} of secret/{name} through a 0700 directory: errno {e}"
        );
    }
    // And once the directory lets others search, the same names are reachable.
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o711)).unwrap();
    assert_eq!(run_as(NOBODY, Op::Stat, &secret.join("g")), 0);
    assert_eq!(run_as(NOBODY, Op::Read, &secret.join("f")), 0);
}

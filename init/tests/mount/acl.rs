//! POSIX ACLs as ext4 keeps and enforces them: the same setups and operations on a keel mount
//! and on an ext4 directory of this machine, the outcomes compared row by row (the table is
//! printed; each row also names the errno both must give where the point is a refusal or a
//! grant). Covered: enforcement for the owner, a named user, the owning and a named group (as
//! the fs gid and as a supplementary group), the mask and other, as `nobody` and as root
//! without CAP_DAC_OVERRIDE; setfacl setting the mode (and clearing set-group-ID for a caller
//! outside the group); chmod rewriting the ACL; default ACLs inherited by new files,
//! directories, FIFOs and devices, with and without a umask. Then: ACLs survive a rollback in
//! both directions with the kernel's cached ACL forgotten at once, and a checkpoint restored
//! into a fresh state dir. Needs root, /dev/fuse, `setfacl`/`getfacl` (the `acl` package) and
//! an ext4 temp dir with ACLs: without them it fails when CI is set and skips otherwise.

use crate::support;

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use support::mount::{keel_bin, Keel};

const NOBODY: u32 = 65534;
const NOGROUP: u32 = 65534;
/// A group nobody is in unless a row gives it as a supplementary group.
const EXTRA: u32 = 4242;

/// Who performs a row's operation (in a forked child).
#[derive(Debug, Clone, Copy)]
struct Who {
    name: &'static str,
    uid: u32,
    gid: u32,
    groups: &'static [u32],
    /// Keeps CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER (root only).
    dac: bool,
}

const ROOT: Who = Who {
    name: "root",
    uid: 0,
    gid: 0,
    groups: &[0],
    dac: true,
};
/// root without the capabilities that override permission checks.
const ROOT_NODAC: Who = Who {
    name: "root-nodac",
    uid: 0,
    gid: 0,
    groups: &[0],
    dac: false,
};
const NOBODY_U: Who = Who {
    name: "nobody",
    uid: NOBODY,
    gid: NOGROUP,
    groups: &[],
    dac: false,
};
const NOBODY_EXTRA: Who = Who {
    name: "nobody+4242",
    uid: NOBODY,
    gid: NOGROUP,
    groups: &[EXTRA],
    dac: false,
};
/// nobody with gid 0 (for "caller outside the file's group" it is not; see rows).
const NOBODY_ROOTGRP: Who = Who {
    name: "nobody/gid0",
    uid: NOBODY,
    gid: 0,
    groups: &[],
    dac: false,
};

#[derive(Debug, Clone, Copy)]
enum New {
    File,
    Dir,
    Fifo,
    CharDev,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// open O_RDONLY and read a byte.
    Read,
    /// open O_RDONLY, close (no read: the inode's atime stays valid in the kernel).
    Open,
    /// open O_WRONLY.
    Write,
    /// execve (the file is a copy of /bin/true).
    Exec,
    /// opendir + readdir.
    List,
    /// stat (of a name inside a directory: needs search permission).
    Stat,
    /// Creates the row's path with this mode under this umask.
    Create(New, u32, u32),
    /// `setfacl ARGS PATH`: the outcome is setfacl's exit status, not an errno.
    SetFacl(&'static [&'static str]),
    Chmod(u32),
}

struct Row {
    what: &'static str,
    /// Builds the row's files in its own directory (as root, in this process).
    setup: fn(&Path),
    who: Who,
    op: Op,
    /// The path the operation works on, relative to the row's directory.
    at: &'static str,
    /// The errno (or setfacl status) both filesystems must give, when the row is about it.
    want: Option<i32>,
}

fn setfacl(p: &Path, args: &[&str]) {
    let out = Command::new("setfacl")
        .args(args)
        .arg(p)
        .output()
        .expect("run setfacl (the acl package)");
    assert!(
        out.status.success(),
        "setfacl {args:?} {}: {}",
        p.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `getfacl`'s entries (no header, numeric ids) on one line, or what went wrong.
fn getfacl(p: &Path) -> String {
    let out = Command::new("getfacl")
        .args(["-c", "-n", "-p"])
        .arg(p)
        .output()
        .expect("run getfacl (the acl package)");
    if !out.status.success() {
        return format!(
            "getfacl failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(",")
}

/// A file (a copy of /bin/true, so it can be executed) owned by uid:gid with `mode`, then
/// `setfacl -m acl` unless `acl` is empty.
fn file(p: &Path, uid: u32, gid: u32, mode: u32, acl: &str) {
    fs::write(p, fs::read("/bin/true").unwrap()).unwrap();
    std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    if !acl.is_empty() {
        setfacl(p, &["-m", acl]);
    }
}

/// A directory owned by uid:gid with `mode`, an access ACL and a default ACL (`--set`, so
/// the default is exactly this) unless empty.
fn dir(p: &Path, uid: u32, gid: u32, mode: u32, acl: &str, default: &str) {
    fs::create_dir(p).unwrap();
    std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    if !acl.is_empty() {
        setfacl(p, &["-m", acl]);
    }
    if !default.is_empty() {
        setfacl(p, &["-d", "--set", default]);
    }
}

const FULL_DEFAULT: &str = "u::rwx,u:65534:rwx,g::r-x,g:4242:-wx,m::rwx,o::---";
const MINIMAL_DEFAULT: &str = "u::rwx,g::r-x,o::---";

fn rows() -> Vec<Row> {
    let r = |what, setup, who, op, at, want| Row {
        what,
        setup,
        who,
        op,
        at,
        want,
    };
    let eacces = Some(libc::EACCES);
    let ok = Some(0);
    vec![
        // ----- enforcement -----
        r(
            "owner denied by u::--- (setfacl sets mode 0055)",
            |d| file(&d.join("f"), NOBODY, NOGROUP, 0o755, "u::---"),
            NOBODY_U,
            Op::Read,
            "f",
            eacces,
        ),
        r(
            "owner may not execute after u::rw-",
            |d| file(&d.join("f"), NOBODY, NOGROUP, 0o755, "u::rw-"),
            NOBODY_U,
            Op::Exec,
            "f",
            eacces,
        ),
        r(
            "owner may execute with u::r-x",
            |d| file(&d.join("f"), NOBODY, NOGROUP, 0o600, "u::r-x"),
            NOBODY_U,
            Op::Exec,
            "f",
            ok,
        ),
        r(
            "root-nodac owner denied by u::---",
            |d| file(&d.join("f"), 0, 0, 0o644, "u::---"),
            ROOT_NODAC,
            Op::Read,
            "f",
            eacces,
        ),
        r(
            "root with DAC_OVERRIDE reads despite u::---",
            |d| file(&d.join("f"), 0, 0, 0o644, "u::---"),
            ROOT,
            Op::Read,
            "f",
            ok,
        ),
        r(
            "named user u:nobody:--- denies a 0644 file",
            |d| file(&d.join("f"), 0, 0, 0o644, "u:65534:---"),
            NOBODY_U,
            Op::Read,
            "f",
            eacces,
        ),
        r(
            "named user u:nobody:r-- grants a 0600 file",
            |d| file(&d.join("f"), 0, 0, 0o600, "u:65534:r--"),
            NOBODY_U,
            Op::Read,
            "f",
            ok,
        ),
        r(
            "named user rw- but mask r--: no write",
            |d| file(&d.join("f"), 0, 0, 0o600, "u:65534:rw-,m::r--"),
            NOBODY_U,
            Op::Write,
            "f",
            eacces,
        ),
        r(
            "root-nodac as named user u:0:r-- reads nobody's 0600 file",
            |d| file(&d.join("f"), NOBODY, NOGROUP, 0o600, "u:0:r--"),
            ROOT_NODAC,
            Op::Read,
            "f",
            ok,
        ),
        r(
            "root-nodac as named user u:0:--- denied a 0644 file",
            |d| file(&d.join("f"), NOBODY, NOGROUP, 0o644, "u:0:---"),
            ROOT_NODAC,
            Op::Read,
            "f",
            eacces,
        ),
        r(
            "owning group g::--- denies a member",
            |d| file(&d.join("f"), 0, NOGROUP, 0o644, "g::---"),
            NOBODY_U,
            Op::Read,
            "f",
            eacces,
        ),
        r(
            "named group g:nogroup:r-- grants (fs gid)",
            |d| file(&d.join("f"), 0, 0, 0o600, "g:65534:r--"),
            NOBODY_U,
            Op::Read,
            "f",
            ok,
        ),
        r(
            "named group g:4242:r-- grants (supplementary)",
            |d| file(&d.join("f"), 0, 0, 0o600, "g:4242:r--"),
            NOBODY_EXTRA,
            Op::Read,
            "f",
            ok,
        ),
        r(
            "named group g:4242:r-- not for a non-member",
            |d| file(&d.join("f"), 0, 0, 0o604, "g:4242:r--"),
            NOBODY_U,
            Op::Read,
            "f",
            ok,
        ),
        r(
            "named group denied by m::---",
            |d| file(&d.join("f"), 0, 0, 0o600, "g:65534:r--,m::---"),
            NOBODY_U,
            Op::Read,
            "f",
            eacces,
        ),
        r(
            "a named user entry wins over other",
            |d| file(&d.join("f"), 0, 0, 0o646, "u:65534:---"),
            NOBODY_U,
            Op::Write,
            "f",
            eacces,
        ),
        r(
            "other o::--- denies",
            |d| file(&d.join("f"), 0, 0, 0o644, "o::---"),
            NOBODY_U,
            Op::Read,
            "f",
            eacces,
        ),
        r(
            "directory u:nobody:--- denies search",
            |d| {
                dir(&d.join("d"), 0, 0, 0o755, "u:65534:---", "");
                file(&d.join("d/x"), 0, 0, 0o644, "");
            },
            NOBODY_U,
            Op::Stat,
            "d/x",
            eacces,
        ),
        r(
            "directory u:nobody:--- denies listing",
            |d| dir(&d.join("d"), 0, 0, 0o755, "u:65534:---", ""),
            NOBODY_U,
            Op::List,
            "d",
            eacces,
        ),
        r(
            "directory u:nobody:rwx lets nobody create in a 0700 dir",
            |d| dir(&d.join("d"), 0, 0, 0o700, "u:65534:rwx", ""),
            NOBODY_U,
            Op::Create(New::File, 0o644, 0o022),
            "d/new",
            ok,
        ),
        // ----- setfacl sets the mode -----
        r(
            "setfacl -m u::r--,g::rwx,o::rw- on 0754",
            |d| file(&d.join("f"), 0, 0, 0o754, ""),
            ROOT,
            Op::SetFacl(&["-m", "u::r--,g::rwx,o::rw-"]),
            "f",
            ok,
        ),
        r(
            "setfacl -m u:nobody:rwx: group bits are the mask",
            |d| file(&d.join("f"), 0, 0, 0o640, ""),
            ROOT,
            Op::SetFacl(&["-m", "u:65534:rwx"]),
            "f",
            ok,
        ),
        r(
            "setfacl -m m::r-- narrows the group bits",
            |d| file(&d.join("f"), 0, 0, 0o775, "u:65534:rwx"),
            ROOT,
            Op::SetFacl(&["-m", "m::r--"]),
            "f",
            ok,
        ),
        r(
            "setfacl -b leaves the mode",
            |d| file(&d.join("f"), 0, 0, 0o640, "u:65534:rwx"),
            ROOT,
            Op::SetFacl(&["-b"]),
            "f",
            ok,
        ),
        r(
            "setfacl -x u:nobody recomputes the mask",
            |d| file(&d.join("f"), 0, 0, 0o640, "u:65534:rwx,g:4242:r--"),
            ROOT,
            Op::SetFacl(&["-x", "u:65534"]),
            "f",
            ok,
        ),
        r(
            "setfacl by the owner in the group keeps set-group-ID",
            |d| file(&d.join("f"), NOBODY, NOGROUP, 0o2755, ""),
            NOBODY_U,
            Op::SetFacl(&["-m", "u::rwx,g::rwx,o::rwx"]),
            "f",
            ok,
        ),
        r(
            "setfacl by the owner outside the group clears set-group-ID",
            |d| file(&d.join("f"), NOBODY, 0, 0o2755, ""),
            NOBODY_U,
            Op::SetFacl(&["-m", "u::rwx,g::rwx,o::rwx"]),
            "f",
            ok,
        ),
        r(
            "setfacl by the owner in the group (gid 0) keeps it on a dir",
            |d| dir(&d.join("d"), NOBODY, 0, 0o2755, "", ""),
            NOBODY_ROOTGRP,
            Op::SetFacl(&["-m", "u::rwx,g::rwx,o::rwx"]),
            "d",
            ok,
        ),
        r(
            "setfacl by the owner outside the group clears it on a dir",
            |d| dir(&d.join("d"), NOBODY, 0, 0o2755, "", ""),
            NOBODY_U,
            Op::SetFacl(&["-m", "u::rwx,g::rwx,o::rwx"]),
            "d",
            ok,
        ),
        r(
            "setfacl by root keeps set-group-ID (CAP_FSETID)",
            |d| file(&d.join("f"), NOBODY, NOGROUP, 0o2755, ""),
            ROOT,
            Op::SetFacl(&["-m", "u:4242:r-x"]),
            "f",
            ok,
        ),
        r(
            "setfacl by someone not the owner fails",
            |d| file(&d.join("f"), 0, 0, 0o666, ""),
            NOBODY_U,
            Op::SetFacl(&["-m", "u:65534:rwx"]),
            "f",
            Some(1),
        ),
        r(
            "setfacl -d on a file fails",
            |d| file(&d.join("f"), 0, 0, 0o644, ""),
            ROOT,
            Op::SetFacl(&["-d", "-m", "u:65534:rwx"]),
            "f",
            Some(1),
        ),
        r(
            "setfacl -k removes a default ACL (and none at all is fine)",
            |d| dir(&d.join("d"), 0, 0, 0o755, "", FULL_DEFAULT),
            ROOT,
            Op::SetFacl(&["-k"]),
            "d",
            ok,
        ),
        r(
            "setfacl -k without a default ACL",
            |d| dir(&d.join("d"), 0, 0, 0o755, "", ""),
            ROOT,
            Op::SetFacl(&["-k"]),
            "d",
            ok,
        ),
        // ----- chmod rewrites the ACL -----
        r(
            "chmod 0640 of a file with u:nobody:rwx",
            |d| file(&d.join("f"), 0, 0, 0o660, "u:65534:rwx"),
            ROOT,
            Op::Chmod(0o640),
            "f",
            ok,
        ),
        r(
            "chmod 0700: the mask takes nobody's entry away",
            |d| file(&d.join("f"), 0, 0, 0o660, "u:65534:rwx"),
            ROOT,
            Op::Chmod(0o700),
            "f",
            ok,
        ),
        r(
            "chmod 0755 of an ACL without a mask",
            |d| file(&d.join("f"), 0, 0, 0o600, "u::rw-,g::---,o::---"),
            ROOT,
            Op::Chmod(0o755),
            "f",
            ok,
        ),
        r(
            "chmod by the owner of a dir leaves its default ACL",
            |d| {
                dir(
                    &d.join("d"),
                    NOBODY,
                    NOGROUP,
                    0o770,
                    "g:4242:rwx",
                    FULL_DEFAULT,
                )
            },
            NOBODY_U,
            Op::Chmod(0o2751),
            "d",
            ok,
        ),
        r(
            "chmod then nobody's read is denied by the new mask",
            |d| {
                file(&d.join("f"), 0, 0, 0o660, "u:65534:rw-");
                fs::set_permissions(d.join("f"), fs::Permissions::from_mode(0o600)).unwrap();
            },
            NOBODY_U,
            Op::Read,
            "f",
            eacces,
        ),
        // ----- default ACLs and the umask -----
        r(
            "file in a dir without default ACL, umask 027",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", ""),
            NOBODY_U,
            Op::Create(New::File, 0o666, 0o027),
            "d/n",
            ok,
        ),
        r(
            "dir in a dir without default ACL, umask 027",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", ""),
            NOBODY_U,
            Op::Create(New::Dir, 0o777, 0o027),
            "d/n",
            ok,
        ),
        r(
            "fifo in a dir without default ACL, umask 077",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", ""),
            NOBODY_U,
            Op::Create(New::Fifo, 0o666, 0o077),
            "d/n",
            ok,
        ),
        r(
            "file inherits a full default ACL, umask 022",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", FULL_DEFAULT),
            NOBODY_U,
            Op::Create(New::File, 0o666, 0o022),
            "d/n",
            ok,
        ),
        r(
            "file inherits a full default ACL, umask 077 ignored",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", FULL_DEFAULT),
            NOBODY_U,
            Op::Create(New::File, 0o640, 0o077),
            "d/n",
            ok,
        ),
        r(
            "dir inherits access and default ACL, umask 077 ignored",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", FULL_DEFAULT),
            NOBODY_U,
            Op::Create(New::Dir, 0o755, 0o077),
            "d/n",
            ok,
        ),
        r(
            "fifo inherits a full default ACL",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", FULL_DEFAULT),
            NOBODY_U,
            Op::Create(New::Fifo, 0o666, 0o022),
            "d/n",
            ok,
        ),
        r(
            "char device (root) inherits a full default ACL",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", FULL_DEFAULT),
            ROOT,
            Op::Create(New::CharDev, 0o666, 0o022),
            "d/n",
            ok,
        ),
        r(
            "file under a minimal default ACL: mode only",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", MINIMAL_DEFAULT),
            NOBODY_U,
            Op::Create(New::File, 0o666, 0o000),
            "d/n",
            ok,
        ),
        r(
            "dir under a minimal default ACL keeps it as default",
            |d| dir(&d.join("d"), 0, 0, 0o777, "", MINIMAL_DEFAULT),
            NOBODY_U,
            Op::Create(New::Dir, 0o777, 0o022),
            "d/n",
            ok,
        ),
        r(
            "two levels: a new dir passes the default on",
            |d| {
                dir(&d.join("d"), 0, 0, 0o777, "", FULL_DEFAULT);
                fs::create_dir(d.join("d/sub")).unwrap();
                fs::set_permissions(d.join("d/sub"), fs::Permissions::from_mode(0o777)).unwrap();
            },
            NOBODY_U,
            Op::Create(New::File, 0o666, 0o022),
            "d/sub/n",
            ok,
        ),
        r(
            "the inherited ACL is enforced: nobody writes through its entry",
            |d| {
                dir(&d.join("d"), 0, 0, 0o777, "", FULL_DEFAULT);
                let f = d.join("d/g");
                fs::write(&f, b"x").unwrap();
            },
            NOBODY_U,
            Op::Write,
            "d/g",
            ok,
        ),
        r(
            "setgid dir with a default ACL, mkdir by a non-member",
            |d| {
                dir(&d.join("d"), 100, 100, 0o777, "", "u:101:rwx");
                fs::set_permissions(d.join("d"), fs::Permissions::from_mode(0o2777)).unwrap();
            },
            NOBODY_U,
            Op::Create(New::Dir, 0o777, 0o022),
            "d/n",
            ok,
        ),
        r(
            "setgid dir, default mask rw-: no group execute, no set-group-ID",
            |d| {
                dir(&d.join("d"), 0, 0, 0o777, "", "u::rwx,g::rw-,m::rw-,o::rwx");
                fs::set_permissions(d.join("d"), fs::Permissions::from_mode(0o2777)).unwrap();
            },
            NOBODY_U,
            Op::Create(New::File, 0o2010, 0o010),
            "d/n",
            ok,
        ),
    ]
}

/// The capability sets of the calling thread as capget/capset take them (version 3).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_V3: u32 = 0x2008_0522;
/// CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER.
const DAC_CAPS: u32 = (1 << 1) | (1 << 2) | (1 << 3);

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// Runs `op` on `path` in a forked child as `who`. Returns 0 or the errno of the failed
/// step (for `SetFacl`, setfacl's exit status).
fn run_as(who: Who, op: Op, path: &Path) -> i32 {
    let c = cpath(path);
    // Everything the child needs is built before the fork: it only makes system calls.
    let argv_store: Vec<CString> = match op {
        Op::SetFacl(args) => std::iter::once("setfacl")
            .chain(args.iter().copied())
            .map(|a| CString::new(a).unwrap())
            .chain(std::iter::once(c.clone()))
            .collect(),
        _ => vec![c.clone()],
    };
    let mut argv: Vec<*const libc::c_char> = argv_store.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let envp: [*const libc::c_char; 2] = [c"PATH=/usr/bin:/bin".as_ptr(), std::ptr::null()];
    let setfacl_bin = c"/usr/bin/setfacl";
    let groups: Vec<libc::gid_t> = who.groups.to_vec();
    // SAFETY: the child calls only async-signal-safe system calls on memory prepared before
    // the fork, then execs or _exits; the parent waits for it.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let err = || *libc::__errno_location();
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setresgid(who.gid, who.gid, who.gid) != 0
                || libc::setresuid(who.uid, who.uid, who.uid) != 0
            {
                libc::_exit(200);
            }
            if who.uid == 0 && !who.dac {
                let mut h = CapHeader {
                    version: CAP_V3,
                    pid: 0,
                };
                let mut d = [CapData {
                    effective: 0,
                    permitted: 0,
                    inheritable: 0,
                }; 2];
                if libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) != 0 {
                    libc::_exit(201);
                }
                for x in d.iter_mut().take(1) {
                    x.effective &= !DAC_CAPS;
                    x.permitted &= !DAC_CAPS;
                }
                if libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) != 0 {
                    libc::_exit(202);
                }
            }
            let r = match op {
                Op::Read => {
                    let fd = libc::open(c.as_ptr(), libc::O_RDONLY);
                    if fd < 0 {
                        libc::_exit(err());
                    }
                    let mut b = [0u8; 1];
                    if libc::read(fd, b.as_mut_ptr().cast(), 1) < 0 {
                        libc::_exit(err());
                    }
                    libc::close(fd)
                }
                Op::Open => {
                    let fd = libc::open(c.as_ptr(), libc::O_RDONLY);
                    if fd < 0 {
                        libc::_exit(err());
                    }
                    libc::close(fd)
                }
                Op::Write => {
                    let fd = libc::open(c.as_ptr(), libc::O_WRONLY);
                    if fd < 0 {
                        libc::_exit(err());
                    }
                    libc::close(fd)
                }
                Op::Exec => {
                    libc::execve(c.as_ptr(), argv.as_ptr(), envp.as_ptr());
                    libc::_exit(err());
                }
                Op::List => {
                    let d = libc::opendir(c.as_ptr());
                    if d.is_null() {
                        libc::_exit(err());
                    }
                    libc::closedir(d)
                }
                Op::Stat => {
                    let mut st: libc::stat = std::mem::zeroed();
                    libc::stat(c.as_ptr(), &mut st)
                }
                Op::Create(kind, mode, umask) => {
                    libc::umask(umask);
                    match kind {
                        New::File => {
                            let fd = libc::open(
                                c.as_ptr(),
                                libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY,
                                mode,
                            );
                            if fd < 0 {
                                libc::_exit(err());
                            }
                            libc::close(fd)
                        }
                        New::Dir => libc::mkdir(c.as_ptr(), mode),
                        New::Fifo => libc::mknod(c.as_ptr(), libc::S_IFIFO | mode, 0),
                        New::CharDev => {
                            libc::mknod(c.as_ptr(), libc::S_IFCHR | mode, libc::makedev(1, 3))
                        }
                    }
                }
                Op::SetFacl(_) => {
                    libc::execve(setfacl_bin.as_ptr(), argv.as_ptr(), envp.as_ptr());
                    libc::_exit(203);
                }
                Op::Chmod(mode) => libc::chmod(c.as_ptr(), mode),
            };
            libc::_exit(if r == 0 { 0 } else { err() });
        }
        let mut status = 0;
        assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        assert!(libc::WIFEXITED(status), "child died: {status}");
        libc::WEXITSTATUS(status)
    }
}

/// Sets the row up in `base` (its own directory), runs it, and describes the outcome:
/// the result, then the mode and ACL of the row's path.
fn apply(row: &Row, base: &Path) -> (i32, String) {
    fs::create_dir(base).unwrap();
    fs::set_permissions(base, fs::Permissions::from_mode(0o755)).unwrap();
    (row.setup)(base);
    let p = base.join(row.at);
    let res = run_as(row.who, row.op, &p);
    let state = match fs::symlink_metadata(&p) {
        Ok(m) => format!("{:05o} {}", m.mode() & 0o7777, getfacl(&p)),
        Err(_) => "absent".to_string(),
    };
    (res, format!("{res} {state}"))
}

fn on_ext4(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::EXT4_SUPER_MAGIC)
}

/// Fails under CI, else skips (returns false), naming what is missing.
fn require(ok: bool, why: &str) -> bool {
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("CI is set but {why}: refusing to skip");
        }
        eprintln!("skipping: {why}");
    }
    ok
}

fn acl_tools() -> bool {
    Command::new("getfacl")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn acls_match_ext4() {
    let k = keel_or_skip!();
    if !require(acl_tools(), "setfacl/getfacl are missing (the acl package)") {
        return;
    }
    let ext4 = k.scratch().join("ext4");
    fs::create_dir(&ext4).unwrap();
    if !require(
        on_ext4(&ext4),
        &format!("{} is not on ext4", ext4.display()),
    ) {
        return;
    }
    let probe = ext4.join("probe");
    fs::write(&probe, b"").unwrap();
    let acls = Command::new("setfacl")
        .args(["-m", "u:65534:r--"])
        .arg(&probe)
        .status()
        .is_ok_and(|s| s.success());
    if !require(
        acls,
        &format!("{} has no ACLs (mounted noacl?)", ext4.display()),
    ) {
        return;
    }
    // `nobody` must reach both directories.
    for d in [k.scratch(), ext4.as_path(), k.mnt.as_path()] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut table = vec![format!("{:<64} {:<12} result", "row", "who")];
    let mut wrong = Vec::new();
    for (i, row) in rows().iter().enumerate() {
        let name = format!("r{i}");
        let (e_res, e_out) = apply(row, &ext4.join(&name));
        let (k_res, k_out) = apply(row, &k.mnt.join(&name));
        let same = e_out == k_out;
        let wanted = row.want.is_none_or(|w| w == e_res && w == k_res);
        table.push(format!(
            "{:<64} {:<12} ext4 {e_out}",
            row.what, row.who.name
        ));
        if same {
            table.push(format!("{:<64} {:<12} keel same", "", ""));
        } else {
            table.push(format!("{:<64} {:<12} keel {k_out}   <- differs", "", ""));
        }
        if !wanted {
            table.push(format!("{:<64} {:<12} wanted {:?}", "", "", row.want));
        }
        if !same || !wanted {
            wrong.push(row.what);
        }
    }
    let table = table.join("\n");
    println!("{table}");
    assert!(
        wrong.is_empty(),
        "keel differs from ext4 (or both from the wanted result) in {wrong:?}:\n{table}"
    );
}

fn keel(args: &[&str]) -> String {
    let out = Command::new(keel_bin())
        .args(args)
        .output()
        .expect("run keel");
    assert!(
        out.status.success(),
        "keel {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A rollback changes ACLs behind the kernel's back: the kernel must forget the ACL it cached
/// (here, right after nobody's open used it), or its old answer would stand until the
/// attributes are next refreshed (the attribute timeout is 60 s): an ACL the rollback brings
/// back must deny at once (this fails without the rollback's inode invalidation). The other
/// way, an ACL that goes grants at once too (the kernel retries a refusal with fresh
/// attributes, which drops its cached ACL). Then the ACLs reach a fresh state dir through the
/// remote and are enforced and inherited there.
#[test]
fn acls_follow_rollbacks_at_once_and_reach_a_fresh_restore() {
    if !support::mount::fuse_available() {
        return;
    }
    if !require(acl_tools(), "setfacl/getfacl are missing (the acl package)") {
        return;
    }
    let shared = tempfile::tempdir().unwrap();
    let cfg = shared.path().join("config.toml");
    fs::write(
        &cfg,
        format!(
            "[persist]\nremote = \"file://{}\"\ninterval = \"0s\"\n",
            shared.path().join("remote").display()
        ),
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap().to_string();
    let mut k = Keel::start(&["--config", &cfg]).expect("gate passed above");
    let state = k.state.to_str().unwrap().to_string();
    for d in [k.scratch(), k.mnt.as_path()] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let f = k.p("f");
    fs::write(&f, b"guarded").unwrap();
    fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
    setfacl(&f, &["-m", "u:65534:---"]);
    let d = k.p("d");
    fs::create_dir(&d).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o777)).unwrap();
    setfacl(&d, &["-d", "--set", FULL_DEFAULT]);
    let (f_acl, d_acl) = (getfacl(&f), getfacl(&d));
    assert!(f_acl.contains("user:65534:---"), "{f_acl}");
    assert_eq!(run_as(NOBODY_U, Op::Read, &f), libc::EACCES);
    keel(&["snapshot", "create", "--state", &state, "--name", "deny"]);

    setfacl(&f, &["-b"]);
    assert_eq!(run_as(NOBODY_U, Op::Read, &f), 0);
    keel(&["snapshot", "create", "--state", &state, "--name", "open"]);
    // The kernel caches "no ACL" for f, with valid attributes: a stat (which may refresh
    // them, dropping cached ACLs), then an open without a read (which checks the permission,
    // caching the ACL, and leaves the atime alone).
    fs::metadata(&f).unwrap();
    assert_eq!(run_as(NOBODY_U, Op::Open, &f), 0);

    // Nothing between the rollback and nobody's open refreshes f's attributes: only the
    // rollback's own invalidation can make the kernel fetch the ACL again.
    keel(&["rollback", "--state", &state, "deny"]);
    assert_eq!(
        run_as(NOBODY_U, Op::Open, &f),
        libc::EACCES,
        "the ACL the rollback brought back is enforced at once"
    );
    assert_eq!(getfacl(&f), f_acl, "f's ACL after the rollback to deny");
    // And the other way, with the ACL cached by nobody's refused open.
    assert_eq!(run_as(NOBODY_U, Op::Open, &f), libc::EACCES);
    keel(&["rollback", "--state", &state, "open"]);
    assert_eq!(
        run_as(NOBODY_U, Op::Open, &f),
        0,
        "the ACL the rollback took away no longer denies"
    );
    assert!(!getfacl(&f).contains("65534"), "{}", getfacl(&f));
    keel(&["rollback", "--state", &state, "deny"]);
    assert_eq!(run_as(NOBODY_U, Op::Read, &f), libc::EACCES);
    let mode = fs::metadata(&f).unwrap().mode() & 0o7777;
    k.stop();

    // A fresh state dir restores the last checkpoint from the remote.
    let fresh = tempfile::tempdir().unwrap();
    let fresh_state = fresh.path().join("state");
    let k2 = Keel::start_in(fresh, fresh_state, &["--config", &cfg]);
    for d in [k2.scratch(), k2.mnt.as_path()] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    assert!(
        k2.log_text().contains("restored snapshot"),
        "{}",
        k2.log_text()
    );
    let (f2, d2) = (k2.p("f"), k2.p("d"));
    assert_eq!(getfacl(&f2), f_acl);
    assert_eq!(getfacl(&d2), d_acl);
    assert_eq!(fs::metadata(&f2).unwrap().mode() & 0o7777, mode);
    assert_eq!(run_as(NOBODY_U, Op::Read, &f2), libc::EACCES);
    // The restored default ACL is inherited.
    assert_eq!(
        run_as(NOBODY_U, Op::Create(New::File, 0o666, 0o077), &d2.join("n")),
        0
    );
    let got = getfacl(&d2.join("n"));
    assert!(got.contains("user:65534:rwx"), "{got}");
}

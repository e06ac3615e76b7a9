//! Path resolution confined to a directory, for the files API's helper (`files::helper`):
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` refuses a `..` that climbs out, an
//! absolute path or symlink, and `/proc` magic links (EXDEV / ELOOP), so a path given to
//! the API can only name something inside the workspace. The other calls work on a name
//! in a directory opened that way (`*at` with `AT_SYMLINK_NOFOLLOW` / `O_NOFOLLOW`), so
//! the last component is never followed out either. Thin safe wrappers over `nix`.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

fn io_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Opens `path` (relative) below `root`, never leaving it. `flags` are `O_*` bits
/// (`O_CLOEXEC` is added); `mode` is used with `O_CREAT`.
pub fn open_beneath(
    root: BorrowedFd<'_>,
    path: &Path,
    flags: i32,
    mode: u32,
) -> io::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(OFlag::from_bits_retain(flags) | OFlag::O_CLOEXEC)
        .mode(Mode::from_bits_retain(mode))
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    loop {
        match nix::fcntl::openat2(root, path, how) {
            Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINTR) => continue,
            r => return r.map_err(io_err),
        }
    }
}

/// Opens the entry `name` of `dir` without following a symlink there.
pub fn open_at(dir: BorrowedFd<'_>, name: &Path, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    nix::fcntl::openat(
        dir,
        name,
        OFlag::from_bits_retain(flags) | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_retain(mode),
    )
    .map_err(io_err)
}

/// What `lstat` says of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime_ns: i128,
    pub ctime_ns: i128,
    pub dev: u64,
    pub ino: u64,
}

impl Stat {
    fn of(s: &nix::sys::stat::FileStat) -> Stat {
        Stat {
            mode: s.st_mode,
            uid: s.st_uid,
            gid: s.st_gid,
            size: s.st_size as u64,
            mtime_ns: s.st_mtime as i128 * 1_000_000_000 + s.st_mtime_nsec as i128,
            ctime_ns: s.st_ctime as i128 * 1_000_000_000 + s.st_ctime_nsec as i128,
            dev: s.st_dev,
            ino: s.st_ino,
        }
    }

    /// The same file with the same bytes as far as `stat` tells (inode, size, mtime):
    /// what survives a rename, which changes the ctime.
    pub fn same_file_and_bytes(&self, o: &Stat) -> bool {
        (self.dev, self.ino, self.size, self.mtime_ns, self.kind())
            == (o.dev, o.ino, o.size, o.mtime_ns, o.kind())
    }
    pub fn kind(&self) -> u32 {
        self.mode & libc::S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.kind() == libc::S_IFDIR
    }
    pub fn is_file(&self) -> bool {
        self.kind() == libc::S_IFREG
    }
    pub fn is_symlink(&self) -> bool {
        self.kind() == libc::S_IFLNK
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
pub fn stat_at(dir: BorrowedFd<'_>, name: &Path) -> io::Result<Stat> {
    nix::sys::stat::fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        .map(|s| Stat::of(&s))
        .map_err(io_err)
}

/// `fstat`.
pub fn stat_fd(fd: BorrowedFd<'_>) -> io::Result<Stat> {
    nix::sys::stat::fstat(fd)
        .map(|s| Stat::of(&s))
        .map_err(io_err)
}

/// The target of the symlink `name` in `dir`.
pub fn read_link_at(dir: BorrowedFd<'_>, name: &Path) -> io::Result<OsString> {
    nix::fcntl::readlinkat(dir, name).map_err(io_err)
}

/// `symlinkat(target, dir, name)`.
pub fn symlink_at(target: &Path, dir: BorrowedFd<'_>, name: &Path) -> io::Result<()> {
    nix::unistd::symlinkat(target, dir, name).map_err(io_err)
}

pub fn mkdir_at(dir: BorrowedFd<'_>, name: &Path, mode: u32) -> io::Result<()> {
    nix::sys::stat::mkdirat(dir, name, Mode::from_bits_retain(mode)).map_err(io_err)
}

/// `unlinkat`, with `AT_REMOVEDIR` for a directory.
pub fn unlink_at(dir: BorrowedFd<'_>, name: &Path, directory: bool) -> io::Result<()> {
    let how = if directory {
        nix::unistd::UnlinkatFlags::RemoveDir
    } else {
        nix::unistd::UnlinkatFlags::NoRemoveDir
    };
    nix::unistd::unlinkat(dir, name, how).map_err(io_err)
}

/// `renameat2`; `replace = false` fails with EEXIST when `to` exists.
pub fn rename_at(
    from_dir: BorrowedFd<'_>,
    from: &Path,
    to_dir: BorrowedFd<'_>,
    to: &Path,
    replace: bool,
) -> io::Result<()> {
    let flags = if replace {
        nix::fcntl::RenameFlags::empty()
    } else {
        nix::fcntl::RenameFlags::RENAME_NOREPLACE
    };
    nix::fcntl::renameat2(from_dir, from, to_dir, to, flags).map_err(io_err)
}

/// `renameat2(RENAME_EXCHANGE)`: swaps two names atomically (both must exist).
pub fn exchange_at(dir: BorrowedFd<'_>, a: &Path, b: &Path) -> io::Result<()> {
    nix::fcntl::renameat2(dir, a, dir, b, nix::fcntl::RenameFlags::RENAME_EXCHANGE).map_err(io_err)
}

pub fn chmod_fd(fd: BorrowedFd<'_>, mode: u32) -> io::Result<()> {
    nix::sys::stat::fchmod(fd, Mode::from_bits_retain(mode)).map_err(io_err)
}

pub fn chown_fd(fd: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    nix::unistd::fchown(
        fd,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
    .map_err(io_err)
}

/// The effective uid of this process.
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The names in the directory `fd` (without `.` and `..`), in the order the filesystem
/// gives them.
pub fn read_dir(fd: &OwnedFd) -> io::Result<Vec<OsString>> {
    let dup = fd.as_fd().try_clone_to_owned()?;
    let mut d = nix::dir::Dir::from_fd(dup).map_err(io_err)?;
    let mut out = Vec::new();
    for e in d.iter() {
        let e = e.map_err(io_err)?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push(std::ffi::OsStr::from_bytes(n).to_os_string());
        }
    }
    Ok(out)
}

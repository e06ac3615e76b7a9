//! The syscalls of the `dir` workspace provider (`workspace::dir`), which walks and writes a
//! plain directory tree relative to directory fds, never following a symlink it did not
//! ask for: a full `lstat` (inode, link count, every time in ns), xattrs on an open fd,
//! `mknodat`, `linkat`, `fchownat`/`utimensat` without following, `renameat2` with
//! RENAME_EXCHANGE, reading a directory's names. Thin safe wrappers over `nix` and `libc`.

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::fcntl::AtFlags;
use nix::sys::stat::{Mode, SFlag};

fn io_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// What `lstat` says of an entry, all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullStat {
    pub dev: u64,
    pub ino: u64,
    /// With the `S_IFMT` bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u64,
    pub size: u64,
    pub rdev: u64,
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl FullStat {
    fn of(s: &nix::sys::stat::FileStat) -> FullStat {
        let ns = |sec: i64, nsec: i64| sec.saturating_mul(1_000_000_000).saturating_add(nsec);
        FullStat {
            dev: s.st_dev,
            ino: s.st_ino,
            mode: s.st_mode,
            uid: s.st_uid,
            gid: s.st_gid,
            nlink: s.st_nlink,
            size: s.st_size as u64,
            rdev: s.st_rdev,
            atime_ns: ns(s.st_atime, s.st_atime_nsec),
            mtime_ns: ns(s.st_mtime, s.st_mtime_nsec),
            ctime_ns: ns(s.st_ctime, s.st_ctime_nsec),
        }
    }

    pub fn kind(&self) -> u32 {
        self.mode & libc::S_IFMT
    }
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
pub fn lstat_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<FullStat> {
    nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map(|s| FullStat::of(&s))
        .map_err(io_err)
}

/// `fstat`.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<FullStat> {
    nix::sys::stat::fstat(fd)
        .map(|s| FullStat::of(&s))
        .map_err(io_err)
}

/// Opens the entry `name` of `dir` without following a symlink there (`O_NOFOLLOW`,
/// `O_CLOEXEC` added); `O_NOATIME` is dropped when the kernel refuses it (not the owner).
pub fn open_at(dir: BorrowedFd<'_>, name: &OsStr, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    let open = |f: i32| {
        nix::fcntl::openat(
            dir,
            name,
            nix::fcntl::OFlag::from_bits_retain(f)
                | nix::fcntl::OFlag::O_NOFOLLOW
                | nix::fcntl::OFlag::O_CLOEXEC,
            Mode::from_bits_retain(mode),
        )
    };
    match open(flags) {
        Err(nix::errno::Errno::EPERM) if flags & libc::O_NOATIME != 0 => {
            open(flags & !libc::O_NOATIME).map_err(io_err)
        }
        r => r.map_err(io_err),
    }
}

/// The names in the directory `fd` (without `.` and `..`); the fd's offset is used up.
pub fn read_names(fd: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    let dup = fd.try_clone_to_owned()?;
    let mut d = nix::dir::Dir::from_fd(dup).map_err(io_err)?;
    let mut out = Vec::new();
    for e in d.iter() {
        let e = e.map_err(io_err)?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push(OsStr::from_bytes(n).to_os_string());
        }
    }
    Ok(out)
}

/// The target of the symlink `name` in `dir`.
pub fn read_link_at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<OsString> {
    nix::fcntl::readlinkat(dir, name).map_err(io_err)
}

pub fn symlink_at(target: &OsStr, dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    nix::unistd::symlinkat(target, dir, name).map_err(io_err)
}

pub fn mkdir_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<()> {
    nix::sys::stat::mkdirat(dir, name, Mode::from_bits_retain(mode)).map_err(io_err)
}

/// `mknodat` of a FIFO, socket or device node (`mode` with its `S_IFMT` bits).
pub fn mknod_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32, rdev: u64) -> io::Result<()> {
    let kind = SFlag::from_bits_truncate(mode & libc::S_IFMT);
    let perm = Mode::from_bits_truncate(mode & 0o7777);
    nix::sys::stat::mknodat(dir, name, kind, perm, rdev).map_err(io_err)
}

/// `linkat(from_dir, from, to_dir, to, 0)`: a hard link, never following a symlink.
pub fn link_at(
    from_dir: BorrowedFd<'_>,
    from: &OsStr,
    to_dir: BorrowedFd<'_>,
    to: &OsStr,
) -> io::Result<()> {
    nix::unistd::linkat(from_dir, from, to_dir, to, AtFlags::empty()).map_err(io_err)
}

/// `unlinkat`, with `AT_REMOVEDIR` for a directory.
pub fn unlink_at(dir: BorrowedFd<'_>, name: &OsStr, directory: bool) -> io::Result<()> {
    let how = if directory {
        nix::unistd::UnlinkatFlags::RemoveDir
    } else {
        nix::unistd::UnlinkatFlags::NoRemoveDir
    };
    nix::unistd::unlinkat(dir, name, how).map_err(io_err)
}

/// `renameat2`: `exchange` swaps the two entries atomically (both must exist), else `to`
/// is replaced.
pub fn rename_at(
    from_dir: BorrowedFd<'_>,
    from: &OsStr,
    to_dir: BorrowedFd<'_>,
    to: &OsStr,
    exchange: bool,
) -> io::Result<()> {
    let flags = if exchange {
        nix::fcntl::RenameFlags::RENAME_EXCHANGE
    } else {
        nix::fcntl::RenameFlags::empty()
    };
    nix::fcntl::renameat2(from_dir, from, to_dir, to, flags).map_err(io_err)
}

/// `fchownat(dir, name, uid, gid, AT_SYMLINK_NOFOLLOW)`.
pub fn lchown_at(dir: BorrowedFd<'_>, name: &OsStr, uid: u32, gid: u32) -> io::Result<()> {
    nix::unistd::fchownat(
        dir,
        name,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(io_err)
}

/// `fchmodat(dir, name, mode)` (never a symlink: Linux cannot change a symlink's mode).
pub fn chmod_at(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> io::Result<()> {
    nix::sys::stat::fchmodat(
        dir,
        name,
        Mode::from_bits_retain(mode & 0o7777),
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )
    .map_err(io_err)
}

/// `utimensat(dir, name, [atime, mtime], AT_SYMLINK_NOFOLLOW)`, times in ns.
pub fn lutimes_at(dir: BorrowedFd<'_>, name: &OsStr, atime: i64, mtime: i64) -> io::Result<()> {
    let ts = |ns: i64| {
        nix::sys::time::TimeSpec::new(ns.div_euclid(1_000_000_000), ns.rem_euclid(1_000_000_000))
    };
    nix::sys::stat::utimensat(
        dir,
        name,
        &ts(atime),
        &ts(mtime),
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(io_err)
}

fn cstr(name: &[u8]) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// The names of the xattrs of the open file `fd`.
pub fn list_xattrs(fd: BorrowedFd<'_>) -> io::Result<Vec<Vec<u8>>> {
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes for the call.
        let n = unsafe {
            libc::flistxattr(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast::<libc::c_char>(),
                buf.len(),
            )
        };
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf
                .split(|b| *b == 0)
                .filter(|n| !n.is_empty())
                .map(<[u8]>::to_vec)
                .collect());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) => buf.resize(buf.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            _ => return Err(e),
        }
    }
}

/// The value of xattr `name` of the open file `fd` (`None`: it has none by that name).
pub fn get_xattr(fd: BorrowedFd<'_>, name: &[u8]) -> io::Result<Option<Vec<u8>>> {
    let c = cstr(name)?;
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: `c` is NUL-terminated and `buf` is a live buffer of `buf.len()` bytes.
        let n = unsafe {
            libc::fgetxattr(
                fd.as_raw_fd(),
                c.as_ptr(),
                buf.as_mut_ptr().cast::<libc::c_void>(),
                buf.len(),
            )
        };
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(Some(buf));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) => buf.resize(buf.len() * 8, 0),
            Some(libc::ENODATA) => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Sets xattr `name` of the open file `fd` to `value`.
pub fn set_xattr(fd: BorrowedFd<'_>, name: &[u8], value: &[u8]) -> io::Result<()> {
    let c = cstr(name)?;
    // SAFETY: `c` is NUL-terminated and `value` is a live buffer of `value.len()` bytes.
    let r = unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            c.as_ptr(),
            value.as_ptr().cast::<libc::c_void>(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Removes xattr `name` of the open file `fd`; one that is not there is no error.
pub fn remove_xattr(fd: BorrowedFd<'_>, name: &[u8]) -> io::Result<()> {
    let c = cstr(name)?;
    // SAFETY: `c` is NUL-terminated.
    let r = unsafe { libc::fremovexattr(fd.as_raw_fd(), c.as_ptr()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENODATA) {
            return Err(e);
        }
    }
    Ok(())
}

/// A hard link `name` in `dir` to the open file `fd` (`linkat` with `AT_EMPTY_PATH`, which
/// needs CAP_DAC_READ_SEARCH): the file the fd is, wherever its names are now.
pub fn link_fd(fd: BorrowedFd<'_>, dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    nix::unistd::linkat(fd, "", dir, name, AtFlags::AT_EMPTY_PATH).map_err(io_err)
}

/// A hard link `name` in `dir` to the file at the absolute path `from` (not followed if a
/// symlink).
pub fn link_path(from: &std::path::Path, dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    nix::unistd::linkat(nix::fcntl::AT_FDCWD, from, dir, name, AtFlags::empty()).map_err(io_err)
}

//! Thin libc wrappers for the syscalls the mount tests exercise and std does not expose.
//! Every function returns `io::Result` carrying the raw errno, so tests can assert exact errors.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

fn cstr(s: &str) -> CString {
    CString::new(s).expect("string without NUL")
}

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn check_size(ret: libc::ssize_t) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// A shared read-write mapping of the first `len` bytes of `f`, at an address the kernel
/// picks. It keeps the file open after `f` is closed; the caller writes only inside it and
/// unmaps it (`libc::munmap(addr.cast(), len)`).
pub fn map_shared(f: &impl AsRawFd, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a new mapping that overlaps nothing of this process's (the kernel picks the
    // address); no memory is read or written by the call.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(addr.cast())
}

pub fn kill(pid: u32, sig: libc::c_int) {
    // SAFETY: kill has no memory-safety preconditions; a stale pid at worst returns ESRCH.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// umount2(MNT_DETACH): works on a mount whose FUSE daemon is gone.
pub fn umount_detach(p: &Path) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: c is a valid NUL-terminated string for the duration of the call.
    check(unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) })
}

pub fn mount_tmpfs(p: &Path, options: &str) -> io::Result<()> {
    let (src, dst, ty, opts) = (cstr("keel-test"), cpath(p), cstr("tmpfs"), cstr(options));
    // SAFETY: all four pointers are valid NUL-terminated strings that outlive the call.
    check(unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            ty.as_ptr(),
            0,
            opts.as_ptr().cast(),
        )
    })
}

/// An ext4 filesystem of `size` bytes in the sparse file `image`, mounted on `p` through a
/// loop device (`mount -o loop`: the device goes with the unmount).
pub fn mount_ext4_image(image: &Path, size: u64, p: &Path) -> io::Result<()> {
    std::fs::File::create(image)?.set_len(size)?;
    let run = |cmd: &mut std::process::Command| -> io::Result<()> {
        let out = cmd.output()?;
        if out.status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "{cmd:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    };
    run(std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(image))?;
    run(std::process::Command::new("mount")
        .args(["-o", "loop"])
        .arg(image)
        .arg(p))
}

pub fn set_xattr(p: &Path, name: &str, value: &[u8], flags: libc::c_int) -> io::Result<()> {
    let (c, n) = (cpath(p), cstr(name));
    // SAFETY: c and n are valid C strings; value points to value.len() readable bytes.
    check(unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            flags,
        )
    })
}

/// getxattr with an explicit buffer size (0 = ask for the size).
pub fn get_xattr_raw(p: &Path, name: &str, buf: &mut [u8]) -> io::Result<usize> {
    let (c, n) = (cpath(p), cstr(name));
    // SAFETY: c and n are valid C strings; buf is writable for buf.len() bytes.
    check_size(unsafe {
        libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
    })
}

pub fn get_xattr(p: &Path, name: &str) -> io::Result<Vec<u8>> {
    loop {
        let size = get_xattr_raw(p, name, &mut [])?;
        let mut buf = vec![0u8; size];
        match get_xattr_raw(p, name, &mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) => continue, // grew meanwhile
            Err(e) => return Err(e),
        }
    }
}

pub fn list_xattrs(p: &Path) -> io::Result<Vec<String>> {
    let c = cpath(p);
    loop {
        // SAFETY: c is a valid C string; a NULL buffer with size 0 asks for the needed size.
        let size = check_size(unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) })?;
        let mut buf = vec![0u8; size];
        // SAFETY: buf is writable for buf.len() bytes.
        match check_size(unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), size) }) {
            Ok(n) => {
                buf.truncate(n);
                let mut names: Vec<String> = buf
                    .split(|b| *b == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect();
                names.sort();
                return Ok(names);
            }
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) => continue,
            Err(e) => return Err(e),
        }
    }
}

pub fn remove_xattr(p: &Path, name: &str) -> io::Result<()> {
    let (c, n) = (cpath(p), cstr(name));
    // SAFETY: c and n are valid C strings.
    check(unsafe { libc::lremovexattr(c.as_ptr(), n.as_ptr()) })
}

pub fn renameat2(from: &Path, to: &Path, flags: libc::c_uint) -> io::Result<()> {
    let (a, b) = (cpath(from), cpath(to));
    // SAFETY: a and b are valid C strings; AT_FDCWD resolves them relative to the cwd.
    check(unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    })
}

pub fn fallocate(f: &impl AsRawFd, mode: libc::c_int, off: i64, len: i64) -> io::Result<()> {
    // SAFETY: fallocate only reads its integer arguments; the fd is owned by `f`.
    check(unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) })
}

pub fn lseek(f: &impl AsRawFd, off: i64, whence: libc::c_int) -> io::Result<i64> {
    // SAFETY: lseek has no memory-safety preconditions.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub fn copy_file_range(
    src: &impl AsRawFd,
    off_in: i64,
    dst: &impl AsRawFd,
    off_out: i64,
    len: usize,
) -> io::Result<usize> {
    let (mut i, mut o) = (off_in, off_out);
    // SAFETY: i and o are valid, exclusively borrowed i64s for the duration of the call.
    check_size(unsafe {
        libc::copy_file_range(src.as_raw_fd(), &mut i, dst.as_raw_fd(), &mut o, len, 0)
    })
}

/// A timestamp argument of utimensat.
#[derive(Debug, Clone, Copy)]
pub enum Ts {
    Now,
    Omit,
    At(i64, i64),
}

impl Ts {
    fn spec(self) -> libc::timespec {
        match self {
            Ts::Now => libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_NOW,
            },
            Ts::Omit => libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_OMIT,
            },
            Ts::At(s, n) => libc::timespec {
                tv_sec: s,
                tv_nsec: n,
            },
        }
    }
}

/// utimensat(AT_FDCWD, p, [atime, mtime], AT_SYMLINK_NOFOLLOW if nofollow).
pub fn utimens(p: &Path, atime: Ts, mtime: Ts, nofollow: bool) -> io::Result<()> {
    let c = cpath(p);
    let times = [atime.spec(), mtime.spec()];
    let flags = if nofollow {
        libc::AT_SYMLINK_NOFOLLOW
    } else {
        0
    };
    // SAFETY: c is a valid C string and times points to two timespecs.
    check(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), flags) })
}

pub fn mknod(p: &Path, mode: libc::mode_t, dev: libc::dev_t) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: c is a valid C string.
    check(unsafe { libc::mknod(c.as_ptr(), mode, dev) })
}

/// A socket file that nothing ever listened on, what a keel that died leaves behind. Binding
/// a listener and dropping it is not the same in a test binary whose other tests fork: the
/// forked child holds a copy of the listening fd until it execs, and a connect in that window
/// succeeds (then is reset).
pub fn dead_socket(p: &Path) -> io::Result<()> {
    mknod(p, libc::S_IFSOCK | 0o600, 0)
}

/// A 127.0.0.1 TCP port that refuses every connection and that nobody else can take while
/// the returned fd lives: bound, never listened on. (A port learnt from a listener that was
/// then dropped is free again, and another process may take it meanwhile.)
pub fn refusing_port() -> io::Result<(std::os::fd::OwnedFd, u16)> {
    use std::os::fd::FromRawFd;
    // SAFETY: creates a new socket; the fd is owned by the OwnedFd below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let mut addr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes([127, 0, 0, 1]),
        },
        sin_zero: [0; 8],
    };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_in of `len` bytes, only read.
    check(unsafe { libc::bind(fd, (&raw const addr).cast(), len) })?;
    // SAFETY: `addr` has room for `len` bytes, which getsockname writes.
    check(unsafe { libc::getsockname(fd, (&raw mut addr).cast(), &mut len) })?;
    Ok((owned, u16::from_be(addr.sin_port)))
}

pub fn makedev(major: u32, minor: u32) -> libc::dev_t {
    libc::makedev(major, minor)
}

pub fn lchown(p: &Path, uid: u32, gid: u32) -> io::Result<()> {
    let c = cpath(p);
    // SAFETY: c is a valid C string.
    check(unsafe { libc::lchown(c.as_ptr(), uid, gid) })
}

pub fn statvfs(p: &Path) -> io::Result<libc::statvfs> {
    let c = cpath(p);
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string and st is a writable statvfs.
    check(unsafe { libc::statvfs(c.as_ptr(), &mut st) })?;
    Ok(st)
}

/// open(2) with raw flags, for O_NOFOLLOW/O_EXCL/... error checks.
pub fn open_raw(p: &Path, flags: libc::c_int, mode: libc::mode_t) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let c = cpath(p);
    // SAFETY: c is a valid C string.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, mode as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by open and is owned by nobody else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// `isatty(fd)`: `Ok(false)` carries the errno the filesystem answered (ENOTTY expected).
pub fn isatty(f: &impl AsRawFd) -> io::Result<bool> {
    // SAFETY: isatty only reads the descriptor number, which `f` keeps open.
    let r = unsafe { libc::isatty(f.as_raw_fd()) };
    if r == 1 {
        Ok(true)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Pins the calling thread to one CPU (to make a request from a chosen CPU's queue).
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; zeroed is an empty set, CPU_SET writes inside it, and
    // sched_setaffinity only reads the set for the calling thread (pid 0).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        check(libc::sched_setaffinity(
            0,
            std::mem::size_of::<libc::cpu_set_t>(),
            &set,
        ))
    }
}

/// A duplicate of file descriptor `fd` of process `pid` (pidfd_getfd; needs ptrace rights
/// over it, which root has).
pub fn steal_fd(pid: i32, fd: i32) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags; no pointers.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pidfd_getfd takes a pidfd, a target fd number and flags; no pointers.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd as libc::c_int, fd, 0) };
    let err = io::Error::last_os_error();
    // SAFETY: pidfd is an fd we own and close once.
    unsafe { libc::close(pidfd as libc::c_int) };
    if got < 0 {
        return Err(err);
    }
    // SAFETY: `got` is a new fd returned to us and owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(got as libc::c_int) })
}

/// A directory stream of opendir(3): readdir(3) and rewinddir(3) as a program calls them
/// (the kernel sees getdents64 and an lseek to 0).
pub struct DirStream(*mut libc::DIR);

impl DirStream {
    pub fn open(p: &Path) -> io::Result<DirStream> {
        let c = cpath(p);
        // SAFETY: c is a valid C string; a NULL result is checked.
        let d = unsafe { libc::opendir(c.as_ptr()) };
        if d.is_null() {
            return Err(io::Error::last_os_error());
        }
        Ok(DirStream(d))
    }

    /// Every name from the stream's position to its end.
    pub fn names(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        loop {
            // SAFETY: self.0 is an open DIR*; the entry readdir returns is valid until the
            // next call on the stream, and its name is copied out before that.
            unsafe {
                let e = libc::readdir(self.0);
                if e.is_null() {
                    break;
                }
                let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr());
                out.push(name.to_string_lossy().into_owned());
            }
        }
        out
    }

    pub fn rewind(&mut self) {
        // SAFETY: self.0 is an open DIR*.
        unsafe { libc::rewinddir(self.0) }
    }
}

impl Drop for DirStream {
    fn drop(&mut self) {
        // SAFETY: self.0 is an open DIR*, closed exactly once here.
        unsafe { libc::closedir(self.0) };
    }
}

/// A file handle of name_to_handle_at(2): its type and opaque bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHandle {
    pub kind: i32,
    pub bytes: Vec<u8>,
}

/// MAX_HANDLE_SZ of the kernel.
const MAX_HANDLE_SZ: usize = 128;

/// A `struct file_handle` with room for `MAX_HANDLE_SZ` bytes, 8-byte aligned.
fn handle_buf() -> Vec<u64> {
    vec![0u64; (std::mem::size_of::<libc::file_handle>() + MAX_HANDLE_SZ).div_ceil(8)]
}

/// name_to_handle_at(AT_FDCWD, p, ..., 0): the handle of what `p` names.
pub fn name_to_handle(p: &Path) -> io::Result<FileHandle> {
    let c = cpath(p);
    let mut buf = handle_buf();
    let fh = buf.as_mut_ptr().cast::<libc::file_handle>();
    let mut mount_id: libc::c_int = 0;
    // SAFETY: `fh` points to a zeroed buffer with room for the header and MAX_HANDLE_SZ bytes,
    // which handle_bytes says; c is a valid C string; mount_id is a writable int.
    unsafe {
        (*fh).handle_bytes = MAX_HANDLE_SZ as libc::c_uint;
        check(libc::name_to_handle_at(
            libc::AT_FDCWD,
            c.as_ptr(),
            fh,
            &mut mount_id,
            0,
        ))?;
        let n = (*fh).handle_bytes as usize;
        let data = std::slice::from_raw_parts(
            buf.as_ptr()
                .cast::<u8>()
                .add(std::mem::size_of::<libc::file_handle>()),
            n,
        );
        Ok(FileHandle {
            kind: (*fh).handle_type,
            bytes: data.to_vec(),
        })
    }
}

/// open_by_handle_at(fd of `mount`, h, flags): needs CAP_DAC_READ_SEARCH.
pub fn open_by_handle(
    mount: &Path,
    h: &FileHandle,
    flags: libc::c_int,
) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let m = std::fs::File::open(mount)?;
    let mut buf = handle_buf();
    assert!(h.bytes.len() <= MAX_HANDLE_SZ);
    let fh = buf.as_mut_ptr().cast::<libc::file_handle>();
    // SAFETY: the buffer has room for the header and MAX_HANDLE_SZ bytes; the copy stays
    // inside it; `m` keeps its fd open for the call.
    let fd = unsafe {
        (*fh).handle_bytes = h.bytes.len() as libc::c_uint;
        (*fh).handle_type = h.kind;
        std::ptr::copy_nonoverlapping(
            h.bytes.as_ptr(),
            buf.as_mut_ptr()
                .cast::<u8>()
                .add(std::mem::size_of::<libc::file_handle>()),
            h.bytes.len(),
        );
        libc::open_by_handle_at(m.as_raw_fd(), fh, flags | libc::O_CLOEXEC)
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned to us and is owned by nothing else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// A TCP connection to `to` from the local IPv4 address `from` (any of 127.0.0.0/8 is
/// loopback): a client the server sees at another address.
#[allow(dead_code)]
pub fn connect_from(
    from: std::net::Ipv4Addr,
    to: std::net::SocketAddrV4,
) -> io::Result<std::net::TcpStream> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let sin = |a: std::net::SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let (src, dst) = (sin(std::net::SocketAddrV4::new(from, 0)), sin(to));
    // SAFETY: `src` and `dst` are valid sockaddr_in of `len` bytes for the calls' duration.
    check(unsafe { libc::bind(fd.as_raw_fd(), std::ptr::from_ref(&src).cast(), len) })?;
    // SAFETY: as above.
    check(unsafe { libc::connect(fd.as_raw_fd(), std::ptr::from_ref(&dst).cast(), len) })?;
    Ok(std::net::TcpStream::from(fd))
}

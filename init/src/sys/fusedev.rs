//! The FUSE device: opening `/dev/fuse`, mounting a connection with mount(2), reading
//! requests and writing replies, cloning the fd for more workers, registering passthrough
//! backing files, and pinning a thread to a CPU (FUSE over io_uring serves each CPU's queue
//! on that CPU). Safe wrappers; the ioctls are the only `unsafe`.

use std::fs::File;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::Arc;

fn io_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// `_IOC(dir, 229, nr, size)` from `include/uapi/linux/fuse.h`.
const fn fuse_ioc(dir: u64, nr: u64, size: u64) -> u64 {
    (dir << 30) | (size << 16) | (229 << 8) | nr
}
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;
/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: u64 = fuse_ioc(IOC_READ, 0, 4);
/// `FUSE_DEV_IOC_BACKING_OPEN`: `_IOW(229, 1, struct fuse_backing_map)`.
const FUSE_DEV_IOC_BACKING_OPEN: u64 = fuse_ioc(IOC_WRITE, 1, 16);
/// `FUSE_DEV_IOC_BACKING_CLOSE`: `_IOW(229, 2, uint32_t)`.
const FUSE_DEV_IOC_BACKING_CLOSE: u64 = fuse_ioc(IOC_WRITE, 2, 4);

/// An open `/dev/fuse` (the connection's first fd, or a clone of it).
#[derive(Debug)]
pub struct FuseDev {
    fd: OwnedFd,
}

impl AsFd for FuseDev {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl FuseDev {
    pub fn open() -> io::Result<FuseDev> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")?;
        Ok(FuseDev { fd: f.into() })
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// A new fd on the same connection (`FUSE_DEV_IOC_CLONE`): each worker reads its own.
    pub fn clone_dev(&self) -> io::Result<FuseDev> {
        let new = FuseDev::open()?;
        let mut src = self.raw_fd() as u32;
        // SAFETY: FUSE_DEV_IOC_CLONE reads one u32 (the source fd) through the pointer, which
        // points at a live local for the duration of the call.
        let r = unsafe { libc::ioctl(new.raw_fd(), FUSE_DEV_IOC_CLONE as _, &mut src) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(new)
    }

    /// Blocks for the next request. ENOENT (an interrupted request vanished), EINTR and EAGAIN
    /// are retried; ENODEV means the filesystem was unmounted.
    pub fn read_request(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match nix::unistd::read(&self.fd, buf) {
                Ok(n) => return Ok(n),
                Err(nix::errno::Errno::ENOENT | nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::EAGAIN) => continue,
                Err(e) => return Err(io_err(e)),
            }
        }
    }

    /// Writes one reply (header and body) in a single `writev`, as the kernel requires.
    pub fn write_reply(&self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        nix::sys::uio::writev(&self.fd, bufs)
            .map(|_| ())
            .map_err(io_err)
    }

    /// Registers `file` as a passthrough backing file; the id goes into the open reply.
    pub fn backing_open(self: &Arc<Self>, file: &File) -> io::Result<BackingId> {
        // struct fuse_backing_map { int32_t fd; uint32_t flags; uint64_t padding; }
        let mut map = [0u8; 16];
        map[0..4].copy_from_slice(&file.as_raw_fd().to_ne_bytes());
        // SAFETY: the ioctl reads 16 bytes from `map`, a live local buffer of that size.
        let id = unsafe {
            libc::ioctl(
                self.raw_fd(),
                FUSE_DEV_IOC_BACKING_OPEN as _,
                map.as_mut_ptr(),
            )
        };
        if id < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(BackingId {
            dev: self.clone(),
            id,
        })
    }
}

/// A registered passthrough backing file; closed (`FUSE_DEV_IOC_BACKING_CLOSE`) on drop. The
/// kernel keeps its own reference for every open that was answered with it.
#[derive(Debug)]
pub struct BackingId {
    dev: Arc<FuseDev>,
    id: i32,
}

impl BackingId {
    pub fn id(&self) -> i32 {
        self.id
    }
}

impl Drop for BackingId {
    fn drop(&mut self) {
        let mut id = self.id as u32;
        // SAFETY: the ioctl reads one u32 from the pointer, a live local.
        let r = unsafe { libc::ioctl(self.dev.raw_fd(), FUSE_DEV_IOC_BACKING_CLOSE as _, &mut id) };
        if r < 0 {
            tracing::debug!(id = self.id, error = %io::Error::last_os_error(), "closing a passthrough backing id failed");
        }
    }
}

/// Mounts the FUSE connection of `dev` on `target` (mount(2); needs CAP_SYS_ADMIN): type
/// `fuse`, with suid and device files allowed, `allow_other` and `default_permissions`.
pub fn mount_fuse(dev: &FuseDev, target: &Path, source: &str) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let rootmode = std::fs::metadata(target)?.permissions().mode() & libc::S_IFMT;
    let data = format!(
        "fd={},rootmode={:o},user_id={},group_id={},default_permissions,allow_other",
        dev.raw_fd(),
        rootmode,
        nix::unistd::getuid(),
        nix::unistd::getgid()
    );
    nix::mount::mount(
        Some(source),
        target,
        Some("fuse"),
        nix::mount::MsFlags::empty(),
        Some(data.as_str()),
    )
    .map_err(io_err)
}

/// `umount2(target, 0)`: fails with EBUSY while something still uses the mount.
pub fn unmount(target: &Path) -> io::Result<()> {
    nix::mount::umount2(target, nix::mount::MntFlags::empty()).map_err(io_err)
}

/// Number of CPUs the kernel may ever bring online (`/sys/devices/system/cpu/possible`):
/// FUSE over io_uring has one queue for each.
pub fn possible_cpus() -> io::Result<usize> {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    parse_cpu_list(s.trim())
        .map(|max| max + 1)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("cpu list `{s}`")))
}

/// The highest CPU number in a list like `0-3,8,10-11`.
fn parse_cpu_list(s: &str) -> Option<usize> {
    s.split(',')
        .map(|part| part.rsplit('-').next().and_then(|n| n.trim().parse().ok()))
        .try_fold(0usize, |m, n: Option<usize>| n.map(|n| m.max(n)))
}

/// Pins the calling thread to `cpu`.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).map_err(io_err)?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(io_err)
}

/// An eventfd: a counter one thread bumps to wake another out of a blocking wait.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes two integers and returns a new fd or -1; no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn signal(&self) -> io::Result<()> {
        nix::unistd::write(&self.fd, &1u64.to_ne_bytes())
            .map(|_| ())
            .map_err(io_err)
    }

    /// Waits up to `timeout` (at most 65 s) for a signal; true once signalled. The counter
    /// is left as it is, so every waiter sees the signal.
    pub fn wait_timeout(&self, timeout: std::time::Duration) -> io::Result<bool> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(n) => Ok(n > 0),
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(e) => Err(io_err(e)),
        }
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_header() {
        assert_eq!(FUSE_DEV_IOC_CLONE, 0x8004_e500);
        assert_eq!(FUSE_DEV_IOC_BACKING_OPEN, 0x4010_e501);
        assert_eq!(FUSE_DEV_IOC_BACKING_CLOSE, 0x4004_e502);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0"), Some(0));
        assert_eq!(parse_cpu_list("0-1"), Some(1));
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(11));
        assert_eq!(parse_cpu_list("x"), None);
        assert!(possible_cpus().unwrap() >= 1);
    }
}

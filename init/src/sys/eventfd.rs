//! An eventfd: a counter one thread bumps to wake another out of a blocking wait (the FUSE
//! session says with one that the kernel ended the connection).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

fn io_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// An eventfd: a counter one thread bumps to wake another out of a blocking wait.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes two integers and returns a new fd or -1; no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
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

    /// Resets the counter (after a wake-up was seen), without blocking.
    pub fn clear(&self) {
        let mut b = [0u8; 8];
        let _ = nix::unistd::read(&self.fd, &mut b);
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

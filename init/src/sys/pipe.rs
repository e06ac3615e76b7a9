//! Pipes and terminals keel reads and writes for processes started through the API: making
//! an fd non-blocking, growing a pipe's buffer, and waiting until any of several fds can be
//! read (or has hung up) within a deadline.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

fn io_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Sets O_NONBLOCK on `fd`.
pub fn set_nonblocking(fd: impl AsFd) -> io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(fd.as_fd(), FcntlArg::F_GETFL).map_err(io_err)?;
    let flags = OFlag::from_bits_retain(flags) | OFlag::O_NONBLOCK;
    fcntl(fd.as_fd(), FcntlArg::F_SETFL(flags)).map_err(io_err)?;
    Ok(())
}

/// Asks for a pipe buffer of `bytes` (F_SETPIPE_SZ); the kernel may give less. Returns the
/// size in effect.
pub fn set_pipe_size(fd: impl AsFd, bytes: usize) -> io::Result<usize> {
    use nix::fcntl::{fcntl, FcntlArg};
    fcntl(fd.as_fd(), FcntlArg::F_SETPIPE_SZ(bytes as i32))
        .map(|n| n as usize)
        .map_err(io_err)
}

/// Waits until one of `fds` is readable or hung up, or `timeout` (None: forever) passes.
/// Returns, per fd, whether it is ready.
pub fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<Vec<bool>> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let t = match timeout {
        None => PollTimeout::NONE,
        Some(d) => {
            let ms = d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
        }
    };
    let mut pfds: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
        .collect();
    match poll(&mut pfds, t) {
        Ok(_) => {}
        Err(nix::errno::Errno::EINTR) => return Ok(vec![false; fds.len()]),
        Err(e) => return Err(io_err(e)),
    }
    Ok(pfds
        .iter()
        .map(|p| p.revents().is_some_and(|r| !r.is_empty()))
        .collect())
}

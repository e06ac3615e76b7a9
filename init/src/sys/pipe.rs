//! Pipes and terminals keel reads and writes for processes started through the API: making
//! an fd non-blocking, growing a pipe's buffer, waiting until any of several fds can be read
//! (or has hung up) within a deadline, how many bytes a pipe holds, and moving them into a
//! file without a copy through keel (splice).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::Duration;

fn io_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// How many bytes the pipe `fd` holds now (FIONREAD).
pub fn available(fd: impl AsFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD stores one c_int through the pointer, which points at `n`, alive for
    // the whole call; `fd` is a live descriptor borrowed for it.
    let r = unsafe { libc::ioctl(fd.as_fd().as_raw_fd(), libc::FIONREAD, &mut n) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Moves up to `len` bytes from the pipe `from` into the file `to` at offset `at` without
/// copying them through keel's memory (splice(2), never blocking). EINVAL: one of them
/// cannot be spliced (a terminal, a file system without splice).
pub fn splice_to_file(from: impl AsFd, to: impl AsFd, at: u64, len: usize) -> io::Result<usize> {
    use nix::fcntl::SpliceFFlags;
    let mut off =
        libc::loff_t::try_from(at).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    nix::fcntl::splice(
        from.as_fd(),
        None,
        to.as_fd(),
        Some(&mut off),
        len,
        SpliceFFlags::SPLICE_F_NONBLOCK | SpliceFFlags::SPLICE_F_MOVE,
    )
    .map_err(io_err)
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

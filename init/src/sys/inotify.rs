//! inotify, for the `dir` provider's change notification: one watch per directory of the
//! tree, events read without blocking (a thread waits for them with a timeout, so it can be
//! stopped).

use std::ffi::OsString;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

pub use nix::sys::inotify::{AddWatchFlags as Mask, WatchDescriptor as Wd};
use nix::sys::inotify::{InitFlags, Inotify as NixInotify};

fn io_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// One event: the watch it came from, what happened, the name below the watched directory.
#[derive(Debug)]
pub struct Event {
    pub wd: Wd,
    pub mask: Mask,
    pub name: Option<OsString>,
}

/// An inotify instance (close-on-exec, non-blocking).
#[derive(Debug)]
pub struct Inotify {
    fd: NixInotify,
}

impl Inotify {
    pub fn new() -> io::Result<Inotify> {
        let fd =
            NixInotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK).map_err(io_err)?;
        Ok(Inotify { fd })
    }

    /// Watches the directory `path` (never following a symlink): the watch it already has
    /// when it has one. ENOSPC: `fs.inotify.max_user_watches` reached.
    pub fn add_dir(&self, path: &Path, mask: Mask) -> io::Result<Wd> {
        self.fd
            .add_watch(path, mask | Mask::IN_ONLYDIR | Mask::IN_DONT_FOLLOW)
            .map_err(io_err)
    }

    /// Waits up to `timeout` for events to read; whether there are some.
    pub fn ready(&self, timeout: Duration) -> io::Result<bool> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => Ok(false),
            Ok(_) => Ok(true),
            Err(e) => Err(io_err(e)),
        }
    }

    /// The events queued now, without waiting.
    pub fn read(&self) -> io::Result<Vec<Event>> {
        match self.fd.read_events() {
            Ok(v) => Ok(v
                .into_iter()
                .map(|e| Event {
                    wd: e.wd,
                    mask: e.mask,
                    name: e.name,
                })
                .collect()),
            Err(nix::errno::Errno::EAGAIN) => Ok(Vec::new()),
            Err(e) => Err(io_err(e)),
        }
    }
}

/// `fs.inotify.max_user_watches` (read, never changed): how many watches the host allows
/// one user, across every process of that user.
pub fn max_user_watches() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/fs/inotify/max_user_watches")
        .ok()?
        .trim()
        .parse()
        .ok()
}

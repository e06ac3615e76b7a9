//! Stop signals for foreground commands (`keel mount`): block SIGTERM/SIGINT/SIGHUP (and
//! SIGUSR1, which asks for counters, not a stop) before any thread starts so every thread
//! inherits the mask, then wait for one synchronously, or for an eventfd that says the work
//! ended on its own (the mount was unmounted from outside).

use std::os::fd::AsFd;

use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::eventfd::EventFd;

/// Why `StopSignals::wait_or` returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// One of the stop signals, by name.
    Signal(&'static str),
    /// The eventfd fired.
    Ended,
}

#[derive(Debug)]
pub struct StopSignals(SigSet);

impl StopSignals {
    /// Blocks the stop signals in the calling thread (call before spawning threads).
    pub fn block() -> std::io::Result<StopSignals> {
        let mut set = SigSet::empty();
        set.add(Signal::SIGTERM);
        set.add(Signal::SIGINT);
        set.add(Signal::SIGHUP);
        set.add(Signal::SIGUSR1);
        nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), None)
            .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
        Ok(StopSignals(set))
    }

    /// Waits until one of the stop signals arrives and returns its name.
    pub fn wait(&self) -> std::io::Result<&'static str> {
        let sig = self
            .0
            .wait()
            .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
        Ok(sig.as_str())
    }

    /// Waits until one of the stop signals arrives or `ended` is signalled.
    pub fn wait_or(&self, ended: &EventFd) -> std::io::Result<Stop> {
        let io = |e: nix::Error| std::io::Error::from_raw_os_error(e as i32);
        // The signals stay blocked, so they queue for the signalfd (pending ones included).
        let sfd = SignalFd::with_flags(&self.0, SfdFlags::SFD_CLOEXEC).map_err(io)?;
        loop {
            let mut fds = [
                PollFd::new(sfd.as_fd(), PollFlags::POLLIN),
                PollFd::new(ended.as_fd(), PollFlags::POLLIN),
            ];
            match nix::poll::poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(io(e)),
            }
            let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
            if ready(&fds[0]) {
                if let Some(info) = sfd.read_signal().map_err(io)? {
                    let sig = Signal::try_from(info.ssi_signo as i32).map_err(io)?;
                    return Ok(Stop::Signal(sig.as_str()));
                }
            }
            if ready(&fds[1]) {
                return Ok(Stop::Ended);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_or_returns_when_the_eventfd_fires() {
        // The stop signals are blocked in this test thread alone.
        let stop = StopSignals::block().unwrap();
        let ended = std::sync::Arc::new(EventFd::new().unwrap());
        let e = ended.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            e.signal().unwrap();
        });
        assert_eq!(stop.wait_or(&ended).unwrap(), Stop::Ended);
        t.join().unwrap();
    }
}

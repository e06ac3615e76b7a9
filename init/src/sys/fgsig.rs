//! Stop signals for foreground commands (`keel mount`): block SIGTERM/SIGINT/SIGHUP before any
//! thread starts so every thread inherits the mask, then wait for one synchronously.

use nix::sys::signal::{SigSet, SigmaskHow, Signal};

#[derive(Debug)]
pub struct StopSignals(SigSet);

impl StopSignals {
    /// Blocks the stop signals in the calling thread (call before spawning threads).
    pub fn block() -> std::io::Result<StopSignals> {
        let mut set = SigSet::empty();
        set.add(Signal::SIGTERM);
        set.add(Signal::SIGINT);
        set.add(Signal::SIGHUP);
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
}

//! The ordered, deadline-driven stop: why keel is stopping, the grace deadline after which
//! everything left is SIGKILLed, and the final workspace flush + unmount inside
//! `flush_timeout`. The supervisor drives the process side; this module owns the clock.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use crate::boot::workspace::Workspace;
use crate::sys::process::Exit;

#[derive(Debug, thiserror::Error)]
pub enum ShutdownError {
    #[error("workspace flush: {0}")]
    Flush(crate::workspace::SessionError),
    #[error("workspace unmount: {0}")]
    Unmount(crate::workspace::SessionError),
    #[error("workspace flush + unmount did not finish within {0:?}; detached the mount")]
    FlushTimeout(Duration),
}

/// Why the stop began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// keel received this stop signal.
    Signal(i32),
    /// The main command ended.
    MainExited(Exit),
    /// No main command and every service has ended for good.
    ServicesEnded,
    /// Startup failed; the message says how.
    StartFailed(String),
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Signal(s) => write!(f, "received {}", crate::sys::signal::name(*s)),
            Reason::MainExited(e) => write!(f, "main command ended ({e})"),
            Reason::ServicesEnded => write!(f, "every service has ended"),
            Reason::StartFailed(m) => write!(f, "startup failed: {m}"),
        }
    }
}

/// A stop in progress.
#[derive(Debug)]
pub struct Stop {
    pub reason: Reason,
    pub started: Instant,
    pub grace_deadline: Instant,
    /// SIGKILL has been sent to everything (grace expired or escalated).
    pub killed: bool,
    /// Processes outside every service group have been sent the stop signal.
    pub leftovers_signalled: bool,
}

impl Stop {
    pub fn begin(reason: Reason, grace: Duration) -> Self {
        let started = Instant::now();
        info!("stopping: {reason}; grace {}", secs(grace));
        Stop {
            reason,
            started,
            grace_deadline: started + grace,
            killed: false,
            leftovers_signalled: false,
        }
    }

    /// "1.234s" since the stop began, for log lines.
    pub fn elapsed(&self) -> String {
        secs(self.started.elapsed())
    }

    pub fn grace_expired(&self, now: Instant) -> bool {
        now >= self.grace_deadline
    }
}

pub fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

/// Flushes and unmounts the workspace within `budget`. The work runs on its own thread so a
/// hung flush cannot keep keel (PID 1) from exiting; on timeout the mount is detached.
pub fn finish_workspace(
    ws: Workspace,
    budget: Duration,
    since: Instant,
) -> Result<(), ShutdownError> {
    let mount_point = ws.mount_point().to_path_buf();
    let fuse = ws.mounted().is_some();
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name("keel-flush".into())
        .spawn(move || {
            let r = ws.flush().map_err(ShutdownError::Flush).and_then(|()| {
                info!("workspace flushed");
                ws.unmount().map_err(ShutdownError::Unmount)
            });
            let _ = tx.send(r);
        });
    if let Err(e) = worker {
        error!("cannot start flush thread: {e}");
        return Err(ShutdownError::FlushTimeout(budget));
    }
    match rx.recv_timeout(budget) {
        Ok(Ok(())) => {
            info!("workspace flush + unmount took {}", secs(since.elapsed()));
            Ok(())
        }
        Ok(Err(e)) => {
            error!("{e}");
            if fuse {
                let _ = crate::sys::mount::unmount_lazy(&mount_point);
            }
            Err(e)
        }
        Err(_) => {
            let e = ShutdownError::FlushTimeout(budget);
            warn!("{e}");
            if fuse {
                let _ = crate::sys::mount::unmount_lazy(&mount_point);
            }
            Err(e)
        }
    }
}

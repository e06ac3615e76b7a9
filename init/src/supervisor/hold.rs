//! Stopping the main command and starting it again at another thread's request (`keel
//! rollback --restart`): the thread asks through `MainHold` and wakes the supervisor's loop
//! with a SIGCHLD to keel itself (the loop ignores the signal but runs once more); the loop
//! sends the stop signal to the main command's process group, SIGKILL after the grace, and
//! answers once nothing of the group is left. While held, the main command's exit neither
//! stops keel nor sets its exit code; `start` runs it again with the same command line.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::persist::agent::{HoldFailure, MainCommand, MainCommandError};
use crate::sys::signal;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HoldState {
    Idle,
    StopAsked,
    /// The stop signal went out; SIGKILL at `kill_at`.
    Stopping {
        kill_at: Instant,
        killed: bool,
    },
    Stopped,
    StartAsked,
    /// The supervisor stops: nothing is held or started any more.
    Closed,
}

/// Shared between the supervisor and the thread that asks (see the module doc).
#[derive(Debug)]
pub struct MainHold {
    pub(super) state: Mutex<HoldState>,
    pub(super) cv: Condvar,
    pub(super) grace: Duration,
}

impl MainHold {
    pub(super) fn new(grace: Duration) -> Arc<Self> {
        Arc::new(MainHold {
            state: Mutex::new(HoldState::Idle),
            cv: Condvar::new(),
            grace,
        })
    }

    pub(super) fn get(&self) -> HoldState {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn set(&self, s: HoldState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = s;
        self.cv.notify_all();
    }

    /// Whether the main command's exit belongs to a hold (not keel's end).
    pub(super) fn holding(&self) -> bool {
        matches!(
            self.get(),
            HoldState::StopAsked | HoldState::Stopping { .. } | HoldState::Stopped
        )
    }

    /// Asks for `to` and waits until the state is one of `until` (or `Closed`), at most
    /// `wait`.
    fn ask(&self, to: HoldState, until: &[HoldState], wait: Duration) -> Result<(), HoldFailure> {
        {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if *s == HoldState::Closed {
                return Err(HoldFailure::Stopping);
            }
            *s = to;
        }
        // Wakes the supervisor's loop (it ignores SIGCHLD but runs once more).
        let _ = signal::send(std::process::id() as i32, libc::SIGCHLD);
        let deadline = Instant::now() + wait;
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while !until.contains(&s) && *s != HoldState::Closed {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(HoldFailure::NoAnswer(wait));
            }
            s = self
                .cv
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        match *s {
            HoldState::Closed => Err(HoldFailure::Stopping),
            _ => Ok(()),
        }
    }
}

impl MainCommand for MainHold {
    fn stop(&self) -> Result<(), MainCommandError> {
        // The grace, the SIGKILL after it, and time to reap.
        let wait = self.grace + Duration::from_secs(10);
        self.ask(HoldState::StopAsked, &[HoldState::Stopped], wait)
            .map_err(MainCommandError::Stop)
    }

    fn start(&self) -> Result<(), MainCommandError> {
        self.ask(
            HoldState::StartAsked,
            &[HoldState::Idle],
            Duration::from_secs(30),
        )
        .map_err(MainCommandError::Start)
    }
}

impl super::Supervisor {
    /// One step of a hold (called from the loop while keel is not stopping).
    pub(super) fn advance_hold(&mut self) {
        let Some(m) = self.main else {
            return;
        };
        match self.hold.get() {
            HoldState::StopAsked => {
                let u = &self.units[m];
                match u.pgid.or(u.pid) {
                    Some(g) => {
                        tracing::info!(
                            "rollback --restart: sending {} to the main command's group {g}",
                            signal::name(self.main_stop_signal)
                        );
                        let _ = signal::send_group(g, self.main_stop_signal);
                        self.hold.set(HoldState::Stopping {
                            kill_at: Instant::now() + self.hold.grace,
                            killed: false,
                        });
                    }
                    None => self.hold.set(HoldState::Stopped),
                }
            }
            HoldState::Stopping { kill_at, killed } => {
                if !self.active(m) {
                    tracing::info!("rollback --restart: the main command has stopped");
                    self.hold.set(HoldState::Stopped);
                } else if !killed && Instant::now() >= kill_at {
                    if let Some(g) = self.units[m].pgid {
                        tracing::info!("rollback --restart: SIGKILL to group {g} after the grace");
                        let _ = signal::send_group(g, libc::SIGKILL);
                    }
                    self.hold.set(HoldState::Stopping {
                        kill_at,
                        killed: true,
                    });
                }
            }
            HoldState::StartAsked => {
                tracing::info!("rollback --restart: starting the main command again");
                if let Err((code, msg)) = self.start(m) {
                    tracing::error!("{msg}");
                    self.code = Some(code);
                    self.hold.set(HoldState::Closed);
                    self.begin_stop(crate::shutdown::Reason::StartFailed(msg));
                    return;
                }
                self.hold.set(HoldState::Idle);
            }
            HoldState::Idle | HoldState::Stopped | HoldState::Closed => {}
        }
    }

    /// When the loop must look at a hold again (the group is polled while it stops).
    pub(super) fn hold_deadline(&self) -> Option<Instant> {
        match self.hold.get() {
            HoldState::Stopping { kill_at, killed } => {
                let poll = Instant::now() + Duration::from_millis(50);
                Some(if killed { poll } else { poll.min(kill_at) })
            }
            HoldState::StopAsked | HoldState::StartAsked => Some(Instant::now()),
            _ => None,
        }
    }

    /// What `keel rollback --restart` uses to stop and start the main command.
    pub fn main_hold(&self) -> Option<Arc<MainHold>> {
        self.main.map(|_| self.hold.clone())
    }
}

//! Stopping the main command and starting it again at another thread's request (`keel
//! rollback --restart`): the thread asks through `MainHold` and wakes the supervisor's loop
//! with a SIGCHLD to keel itself (the loop ignores the signal but runs once more); the loop
//! sends the stop signal to the main command's process group, SIGKILL after the grace, and
//! answers once nothing of the group is left. While held, the main command's exit neither
//! stops keel nor sets its exit code; `start` runs it again with the same command line.
//!
//! A group can outlive its SIGKILL (a process in uninterruptible sleep, e.g. on a FUSE
//! request its server does not answer): when the stop is not done in time, `stop` fails
//! (the caller rolls nothing back) and the hold is left to start the command again by itself
//! as soon as the group is gone, so the sandbox is not left without its main command.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::persist::agent::{HoldFailure, MainCommand, MainCommandError};
use crate::sys::signal;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HoldState {
    Idle,
    /// `then_start`: the asker gave up waiting; start the command again once it stopped.
    StopAsked {
        then_start: bool,
    },
    /// The stop signal went out; SIGKILL at `kill_at`.
    Stopping {
        kill_at: Instant,
        killed: bool,
        then_start: bool,
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

    /// Sets `to` if the state is still `from` (the asker may have changed it since the
    /// supervisor looked); whether it did.
    pub(super) fn swap(&self, from: HoldState, to: HoldState) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if *s != from {
            return false;
        }
        *s = to;
        self.cv.notify_all();
        true
    }

    /// Whether the main command's exit belongs to a hold (not keel's end).
    pub(super) fn holding(&self) -> bool {
        matches!(
            self.get(),
            HoldState::StopAsked { .. } | HoldState::Stopping { .. } | HoldState::Stopped
        )
    }

    /// After a stop that was not done in time: start the command again once its group is
    /// gone (`Ok(true)`), or `Ok(false)` when it stopped after all.
    fn start_when_stopped(&self) -> Result<bool, HoldFailure> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match *s {
            HoldState::Stopped => return Ok(false),
            HoldState::Closed => return Err(HoldFailure::Stopping),
            HoldState::StopAsked { .. } => *s = HoldState::StopAsked { then_start: true },
            HoldState::Stopping {
                kill_at, killed, ..
            } => {
                *s = HoldState::Stopping {
                    kill_at,
                    killed,
                    then_start: true,
                }
            }
            // Only `stop` moves a hold out of Idle; nothing else to do.
            HoldState::Idle | HoldState::StartAsked => {}
        }
        drop(s);
        let _ = signal::send(std::process::id() as i32, libc::SIGCHLD);
        Ok(true)
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
        match self.ask(
            HoldState::StopAsked { then_start: false },
            &[HoldState::Stopped],
            wait,
        ) {
            Err(HoldFailure::NoAnswer(w)) => match self.start_when_stopped() {
                Ok(false) => Ok(()),
                Ok(true) => Err(MainCommandError::Stop(HoldFailure::NotStopped(w))),
                Err(e) => Err(MainCommandError::Stop(e)),
            },
            r => r.map_err(MainCommandError::Stop),
        }
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
        // Every change is a swap from the state looked at: the asker may have set
        // `then_start` meanwhile, and then the next round sees it.
        let now = self.hold.get();
        match now {
            HoldState::StopAsked { then_start } => {
                let u = &self.units[m];
                match u.pgid.or(u.pid) {
                    Some(g) => {
                        tracing::info!(
                            "rollback --restart: sending {} to the main command's group {g}",
                            signal::name(self.main_stop_signal)
                        );
                        let _ = signal::send_group(g, self.main_stop_signal);
                        self.hold.swap(
                            now,
                            HoldState::Stopping {
                                kill_at: Instant::now() + self.hold.grace,
                                killed: false,
                                then_start,
                            },
                        );
                    }
                    None => {
                        self.stopped(now, then_start);
                    }
                }
            }
            HoldState::Stopping {
                kill_at,
                killed,
                then_start,
            } => {
                if !self.active(m) {
                    tracing::info!("rollback --restart: the main command has stopped");
                    self.stopped(now, then_start);
                } else if !killed && Instant::now() >= kill_at {
                    if let Some(g) = self.units[m].pgid {
                        tracing::info!("rollback --restart: SIGKILL to group {g} after the grace");
                        let _ = signal::send_group(g, libc::SIGKILL);
                    }
                    self.hold.swap(
                        now,
                        HoldState::Stopping {
                            kill_at,
                            killed: true,
                            then_start,
                        },
                    );
                }
            }
            HoldState::StartAsked => self.start_again(),
            HoldState::Idle | HoldState::Stopped | HoldState::Closed => {}
        }
    }

    /// The main command's group is gone: the asker is told, or, when it gave up waiting,
    /// the command starts again at once.
    fn stopped(&mut self, now: HoldState, then_start: bool) {
        if !then_start {
            self.hold.swap(now, HoldState::Stopped);
        } else if self.hold.swap(now, HoldState::StartAsked) {
            tracing::warn!(
                "rollback --restart: the main command's group is gone only now, after the rollback was refused"
            );
            self.start_again();
        }
    }

    fn start_again(&mut self) {
        let Some(m) = self.main else {
            return;
        };
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

    /// When the loop must look at a hold again (the group is polled while it stops).
    pub(super) fn hold_deadline(&self) -> Option<Instant> {
        match self.hold.get() {
            HoldState::Stopping {
                kill_at, killed, ..
            } => {
                let poll = Instant::now() + Duration::from_millis(50);
                Some(if killed { poll } else { poll.min(kill_at) })
            }
            HoldState::StopAsked { .. } | HoldState::StartAsked => Some(Instant::now()),
            _ => None,
        }
    }

    /// What `keel rollback --restart` uses to stop and start the main command.
    pub fn main_hold(&self) -> Option<Arc<MainHold>> {
        self.main.map(|_| self.hold.clone())
    }
}

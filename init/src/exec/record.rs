//! One process started through the API: what was asked, its output streams, its state
//! (starting, running, finishing the workspace options, done) and how it ended. Readers wait
//! on its condition variable for new output or a new state; every change bumps `version`.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use super::output::Output;
use super::request::Around;
use crate::sys::cgroup::Cgroup;
use crate::sys::eventfd::EventFd;
use crate::sys::process::{Exit, Usage};

/// A process's id in the API (`/processes/{id}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProcessId(pub u64);

impl std::fmt::Display for ProcessId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where a process is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Accepted: the options before the spawn run (a snapshot).
    Starting,
    Running,
    /// It ended and its output is drained; the options after it run (diff, rollback,
    /// checkpoint).
    Finishing,
    Done,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Running => "running",
            Phase::Finishing => "finishing",
            Phase::Done => "done",
        }
    }
}

/// The mutable part of a record.
#[derive(Debug)]
pub struct State {
    pub phase: Phase,
    pub pid: Option<i32>,
    /// The exit as the reaper saw it.
    pub exit: Option<(Exit, Usage)>,
    pub ended: Option<Instant>,
    pub done: Option<Instant>,
    /// It could not start: why (the exit is 127/126/1 then).
    pub error: Option<String>,
    /// Its output could not be kept (an output file not created or written: no space, no
    /// descriptor): the first such failure; the bytes after it were read and dropped.
    pub output_error: Option<String>,
    pub timed_out: bool,
    /// Killed on request (DELETE) or by keel's stop.
    pub killed: bool,
    /// A kill was asked for and not started yet (the pump thread starts it).
    pub kill_asked: bool,
    /// What the workspace options found (diff, snapshots, rollback, checkpoint).
    pub workspace: serde_json::Map<String, Value>,
    /// CPU time and peak memory of the whole tree, when a cgroup counted them.
    pub tree_cpu: Option<Duration>,
    pub tree_peak_kib: Option<u64>,
    /// Bumped at every change (output or state), under the lock.
    pub version: u64,
}

/// Keel's ends of the process's input.
#[derive(Debug, Default)]
pub struct Input {
    /// The pipe to its stdin (`stdin: "stream"`), or the terminal's master side.
    pub writer: Option<std::fs::File>,
    /// Closing stdin on a terminal sends end-of-file (^D) instead of closing the master.
    pub terminal: bool,
}

#[derive(Debug)]
pub struct Record {
    pub id: ProcessId,
    pub request_id: Option<String>,
    pub argv: Vec<String>,
    pub user: String,
    pub cwd: PathBuf,
    pub pty: bool,
    pub timeout: Option<Duration>,
    pub around: Around,
    pub started_wall: SystemTime,
    pub started: Instant,
    pub stdout: Output,
    pub stderr: Output,
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    /// Wakes the pump thread (exit seen, kill asked); gone once the record is done, so a
    /// kept record holds no descriptor of its own (every fork copies keel's fd table).
    pub(super) wake: Mutex<Option<Arc<EventFd>>>,
    pub(super) input: Mutex<Input>,
    /// The terminal's master side, for resizing.
    pub(super) master: OnceLock<std::os::fd::OwnedFd>,
    pub(super) cgroup: OnceLock<Cgroup>,
}

fn ms(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

impl Record {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the pump thread, while there is one.
    pub(super) fn wake(&self) {
        if let Some(w) = &*self.wake.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = w.signal();
        }
    }

    /// The pump thread's end of `wake` (None once the record is done).
    pub(super) fn wake_fd(&self) -> Option<Arc<EventFd>> {
        self.wake.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The record is done: nothing will wait on `wake` any more.
    pub(super) fn drop_wake(&self) {
        self.wake.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Changes the state under the lock, bumps the version and wakes every reader.
    pub(super) fn update(&self, f: impl FnOnce(&mut State)) {
        let mut s = self.lock();
        f(&mut s);
        s.version += 1;
        drop(s);
        self.cv.notify_all();
    }

    /// Waits (at most `limit`) until the version moves past `seen`; returns the new one.
    pub fn wait_change(&self, seen: u64, limit: Duration) -> u64 {
        let s = self.lock();
        let (s, _) = self
            .cv
            .wait_timeout_while(s, limit, |s| s.version == seen)
            .unwrap_or_else(|p| p.into_inner());
        s.version
    }

    pub fn version(&self) -> u64 {
        self.lock().version
    }

    pub fn phase(&self) -> Phase {
        self.lock().phase
    }

    pub fn pid(&self) -> Option<i32> {
        self.lock().pid
    }

    /// Waits until the record is done, at most `limit`; true when it is.
    pub fn wait_done(&self, limit: Duration) -> bool {
        let s = self.lock();
        let (s, _) = self
            .cv
            .wait_timeout_while(s, limit, |s| s.phase != Phase::Done)
            .unwrap_or_else(|p| p.into_inner());
        s.phase == Phase::Done
    }

    /// The record as `GET /processes/{id}` shows it.
    pub fn to_json(&self) -> Value {
        let s = self.lock();
        let mut v = json!({
            "id": self.id.0,
            "request_id": self.request_id,
            "argv": self.argv,
            "user": self.user,
            "cwd": self.cwd.display().to_string(),
            "pty": self.pty,
            "state": s.phase.as_str(),
            "pid": s.pid,
            "started": crate::time::rfc3339(self.started_wall),
            "timeout_ms": self.timeout.map(ms),
            "stdout_bytes": self.stdout.len(),
            "stderr_bytes": self.stderr.len(),
        });
        if let Some(e) = &s.output_error {
            v["output_error"] = e.clone().into();
        }
        if s.exit.is_some() || s.error.is_some() {
            v["exit"] = exit_json(&s, self);
        }
        v
    }

    /// The last event of a stream: how it ended, what it cost, what the options found.
    pub fn exit_json(&self) -> Value {
        let s = self.lock();
        let mut v = exit_json(&s, self);
        v["type"] = "exit".into();
        v["id"] = self.id.0.into();
        v
    }
}

fn exit_json(s: &State, r: &Record) -> Value {
    let (exit, usage) = match s.exit {
        Some((e, u)) => (Some(e), u),
        None => (None, Usage::default()),
    };
    let duration = s
        .ended
        .map(|e| e.saturating_duration_since(r.started))
        .unwrap_or_default();
    let mut v = json!({
        "code": match exit { Some(Exit::Code(c)) => Some(c), _ => None },
        "signal": match exit { Some(Exit::Signal(n)) => Some(crate::sys::signal::name(n)), _ => None },
        "status": exit.map(|e| e.code()),
        "timed_out": s.timed_out,
        "killed": s.killed,
        "duration_ms": ms(duration),
        "cpu_ms": ms(s.tree_cpu.unwrap_or(usage.cpu)),
        "peak_rss_kib": s.tree_peak_kib.unwrap_or(usage.max_rss_kib),
        "stdout_bytes": r.stdout.len(),
        "stderr_bytes": r.stderr.len(),
        "stdout_dropped": r.stdout.dropped(),
        "stderr_dropped": r.stderr.dropped(),
    });
    if let Some(e) = &s.error {
        v["error"] = e.clone().into();
    }
    if let Some(e) = &s.output_error {
        v["output_error"] = e.clone().into();
    }
    for (k, x) in &s.workspace {
        v[k] = x.clone();
    }
    v
}

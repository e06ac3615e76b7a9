//! The threads that requests waiting for the remote run on (lazy restore): a READ of bytes
//! not fetched yet is queued here by `WorkspaceFs::defer_fetch` and answered from here, so
//! a FUSE worker never waits a round trip and parallel readers are not capped at the FUSE
//! threads. Threads start as requests need them (at most `max`) and end when idle.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// A request that must first fetch from the remote, run by a fetch thread; it answers the
/// kernel itself.
pub type Deferred = Box<dyn FnOnce() + Send>;

/// Fetch threads by default (see `WorkspaceFs::set_fetch_threads`).
pub const FETCH_THREADS: usize = 16;
/// A fetch thread with nothing to do for this long ends.
const FETCH_IDLE: Duration = Duration::from_secs(10);

/// The threads requests waiting for the remote run on, so that a FUSE worker never waits a
/// round trip: started as requests need them (at most `max`), ended when idle.
#[derive(Default)]
pub(super) struct Fetchers {
    q: Mutex<FetchQueue>,
    ready: Condvar,
    pub(super) max: AtomicUsize,
}

#[derive(Default)]
struct FetchQueue {
    jobs: VecDeque<Deferred>,
    threads: usize,
    idle: usize,
    closed: bool,
}

impl Fetchers {
    fn lock(&self) -> MutexGuard<'_, FetchQueue> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job`, starting a thread when none is idle and fewer than `max` run; `Err`
    /// hands it back when no thread can run it (closed, or none could be started).
    pub(super) fn submit(self: &Arc<Self>, job: Deferred) -> Result<(), Deferred> {
        let mut q = self.lock();
        if q.closed {
            return Err(job);
        }
        if q.idle == 0 && q.threads < self.max.load(Ordering::Relaxed).max(1) {
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("keel-fetch".into())
                .spawn(move || me.work());
            match spawned {
                Ok(_) => q.threads += 1,
                Err(e) if q.threads == 0 => {
                    tracing::warn!(error = %e, "cannot start a fetch thread; the request waits on its FUSE worker");
                    return Err(job);
                }
                Err(_) => {}
            }
        }
        q.jobs.push_back(job);
        drop(q);
        self.ready.notify_one();
        Ok(())
    }

    /// Runs jobs until the queue is closed and empty, or nothing came for `FETCH_IDLE`;
    /// `idle` runs each time the queue is found empty (settling what was fetched).
    fn work(&self) {
        let mut q = self.lock();
        loop {
            if let Some(job) = q.jobs.pop_front() {
                drop(q);
                job();
                q = self.lock();
                continue;
            }
            if q.closed {
                break;
            }
            q.idle += 1;
            let (g, t) = self
                .ready
                .wait_timeout(q, FETCH_IDLE)
                .unwrap_or_else(|p| p.into_inner());
            q = g;
            q.idle -= 1;
            if t.timed_out() && q.jobs.is_empty() {
                break;
            }
        }
        q.threads -= 1;
    }

    /// No new job is taken; the threads end once the queue is empty.
    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }
}

//! The checkpoint service of a mounted workspace: one worker thread that owns the
//! `Persister` and takes a checkpoint every `[persist] interval` when something changed,
//! on request (the control API through `CheckpointHandle`, `fsync = "remote"`), and a final one at shutdown within a
//! deadline; automatic gc every `gc_every` checkpoints. If the final checkpoint cannot
//! finish, `finish` reports exactly what did not reach the remote; it stays in the local
//! state (pending) and the next start uploads it first. A failed periodic checkpoint is
//! retried sooner than the interval (1 s, doubling, capped at the interval). With a lease,
//! the service owns it: renewed in the background, released when the service closes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::checkpoint::{backlog, Backlog, CheckpointOptions, CheckpointReport, Persister};
use super::gc::{gc_with, GcReport, Retention};
use super::lease::{Lease, LeaseInfo, LeaseState};
use crate::config::{PersistConfig, WorkspaceConfig};
use crate::time::now_ns;

/// How often a long restore or final checkpoint logs how far it has got.
pub const LOG_EVERY: Duration = Duration::from_secs(5);
use crate::meta::Nanos;

/// Makes every write the filesystem acknowledged visible in the state database (the
/// mounted filesystem's `flush`).
pub type FlushFn = Box<dyn Fn() -> Result<(), BoxError> + Send>;

/// The mounted filesystem's read set and its generation (see `persist::readset`).
pub type ReadSetFn = Box<dyn Fn() -> (u64, Vec<(u64, u64)>) + Send>;

/// The error of what the filesystem's side hands across layers (its flush, its rollback).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why the service did not start, or why a request to it (a checkpoint, a gc, a named
/// snapshot or a rollback) failed. The messages are the one-liners `/status`,
/// `keel checkpoint` and the control socket show.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("open remote {url}: {source}")]
    OpenRemote {
        url: String,
        source: super::RemoteError,
    },
    #[error("start checkpoints: {0}")]
    Start(#[from] super::CheckpointError),
    #[error("spawn worker: {0}")]
    Spawn(std::io::Error),
    #[error("checkpoint service stopped")]
    Stopped,
    #[error("refused: another rollback is running")]
    RollbackRunning,
    #[error("refused: a checkpoint is running; try again when it is done")]
    CheckpointRunning,
    /// The filesystem could not make its acknowledged writes visible (`FlushFn`).
    #[error("{0}")]
    Flush(#[source] BoxError),
    #[error("{0}")]
    Checkpoint(#[source] super::CheckpointError),
    #[error("{0}")]
    Gc(#[source] super::gc::GcError),
    #[error("free space of {}: {source}", path.display())]
    FreeSpace {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint skipped: the remote is on the state volume, which has {} free; this checkpoint needs up to {} and {} must stay free for the workspace (the workspace is safe on the volume; checkpoints resume once there is room, or lower [persist] keep / use another remote)", mib(*avail), mib(*need), mib(*floor))]
    NoRoom { avail: u64, need: u64, floor: u64 },
    #[error("did not finish within {:.1}s", .0.as_secs_f64())]
    FinalTimeout(Duration),
    #[error(transparent)]
    Agent(#[from] super::agent::AgentError),
}

/// The final checkpoint did not complete.
#[derive(Debug, thiserror::Error)]
#[error("final checkpoint failed ({reason}): {backlog}; they are safe in the state dir and are uploaded first at the next start on it (lost if the state dir is discarded)")]
pub struct FinalError {
    pub reason: Box<ServiceError>,
    pub backlog: Backlog,
}

pub(crate) enum Cmd {
    Checkpoint {
        full: bool,
        reply: Sender<Result<CheckpointReport, ServiceError>>,
    },
    Gc {
        reply: Sender<Result<GcReport, ServiceError>>,
    },
    State {
        reply: Sender<PersistState>,
    },
    /// Stop periodic work (the filesystem is about to go away).
    Pause {
        reply: Sender<()>,
    },
    /// The last checkpoint: pauses periodic work, no flush (the caller just flushed).
    Final {
        /// `None`: none (`Service::set_final_unbounded`).
        deadline: Option<Instant>,
        reply: Sender<Result<CheckpointReport, ServiceError>>,
    },
    /// Exit; `clean`: every write of the filesystem is recorded in the store.
    Close {
        clean: bool,
    },
    /// A named snapshot or a rollback (`agent`).
    Agent {
        op: super::agent::Op,
        reply: Sender<Result<serde_json::Value, ServiceError>>,
    },
    /// A diff written to `out` as it is produced (`agent::diff_to`).
    DiffTo {
        req: super::agent::Diff,
        format: super::diff::Format,
        limit: u64,
        out: Box<dyn std::io::Write + Send>,
        reply: Sender<Result<(), ServiceError>>,
    },
    /// The remote, for listings and diffs.
    Repo {
        reply: Sender<super::Repo>,
    },
    /// What periodic checkpoints flush with instead of the service's `FlushFn` (the `dir`
    /// provider's walk of what changed; every other checkpoint walks everything).
    SetPeriodicFlush {
        f: FlushFn,
    },
    /// Where the read set comes from, and the set found on the remote at the start (when
    /// the start fetched it).
    SetReadSet {
        f: ReadSetFn,
        found: Option<Vec<(u64, u64)>>,
    },
}

/// What the worker is doing, for refusing a rollback at once (`CheckpointHandle::agent`).
const IDLE: u8 = 0;
const CHECKPOINTING: u8 = 1;
const ROLLING_BACK: u8 = 2;

/// A cloneable handle to the running service, for other threads (the HTTP control API's
/// `POST /checkpoint`, `/status`, `fsync = "remote"`).
#[derive(Clone)]
pub struct CheckpointHandle {
    tx: Sender<Cmd>,
    busy: Arc<AtomicU8>,
    /// `keel run` handed over its main command (`Service::start`): the worker's `main`.
    has_main: bool,
}

/// What the service reports for `/status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PersistState {
    pub backlog: Backlog,
    pub last_seq: Option<u64>,
    /// Wall-clock time of the last checkpoint, in ns since the epoch.
    pub last_checkpoint_ns: Option<i64>,
    pub remote: String,
    /// Checkpoints that failed in a row since the last one that worked.
    pub consecutive_failures: u32,
    /// Why the last checkpoint failed (no credentials), until one works again.
    pub last_error: Option<String>,
    /// The single-writer lease; `None` when there is none (disabled).
    pub lease: Option<LeaseInfo>,
    /// Bytes a `file://` remote takes on disk as of the last checkpoint or gc (see
    /// `DiskUse`); `None` for other remotes and until the first walk is done.
    pub remote_disk_bytes: Option<u64>,
}

/// Told the new state after every checkpoint attempt and every lease renewal.
pub type StateObserver = Arc<dyn Fn(&PersistState) + Send + Sync>;

/// The last published state and who wants to hear about changes.
#[derive(Default)]
struct Published {
    state: Mutex<PersistState>,
    observer: Mutex<Option<StateObserver>>,
}

impl Published {
    fn update(&self, f: impl FnOnce(&mut PersistState)) {
        let snapshot = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut s);
            s.clone()
        };
        let obs = self
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(o) = obs {
            o(&snapshot);
        }
    }
}

/// The disk use of a `file://` remote, walked on its own thread when nudged (at start, after
/// each checkpoint that wrote a snapshot, after each gc), so neither `/status` nor a
/// checkpoint waits for a walk of the remote. Nudges during a walk make one more walk.
struct DiskUse {
    nudge: mpsc::SyncSender<()>,
    bytes: Arc<Mutex<Option<u64>>>,
}

impl DiskUse {
    fn start(root: PathBuf, published: Arc<Published>) -> Result<DiskUse, std::io::Error> {
        let (nudge, rx) = mpsc::sync_channel::<()>(1);
        let bytes = Arc::new(Mutex::new(None));
        let b = bytes.clone();
        std::thread::Builder::new()
            .name("keel-remote-du".into())
            .spawn(move || {
                // Ends when the worker (the only sender) is gone.
                while rx.recv().is_ok() {
                    let n = super::snapshots::disk_use(&root);
                    *b.lock().unwrap_or_else(|p| p.into_inner()) = Some(n);
                    published.update(|s| s.remote_disk_bytes = Some(n));
                }
            })?;
        let d = DiskUse { nudge, bytes };
        d.refresh();
        Ok(d)
    }

    fn refresh(&self) {
        // Full: a walk is pending already and will see this change too.
        let _ = self.nudge.try_send(());
    }

    fn get(&self) -> Option<u64> {
        *self.bytes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The delay before retrying after `failures` failed periodic checkpoints in a row: 1 s,
/// doubling, never more than `interval`.
pub fn retry_delay(failures: u32, interval: Duration) -> Duration {
    let d = Duration::from_secs(1).saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    d.min(interval)
}

/// Sends the worker the command `cmd` makes around a reply channel and waits for the answer;
/// `Stopped` when the worker is gone before answering.
fn ask<T>(tx: &Sender<Cmd>, cmd: impl FnOnce(Sender<T>) -> Cmd) -> Result<T, ServiceError> {
    let (reply, rx) = mpsc::channel();
    tx.send(cmd(reply)).map_err(|_| ServiceError::Stopped)?;
    rx.recv().map_err(|_| ServiceError::Stopped)
}

impl CheckpointHandle {
    /// Flushes the filesystem, takes a checkpoint and waits for it.
    pub fn checkpoint_now(&self) -> Result<CheckpointReport, ServiceError> {
        ask(&self.tx, |reply| Cmd::Checkpoint { full: false, reply })?
    }

    /// Flushes the filesystem, takes a checkpoint that writes a full snapshot (not a delta)
    /// and waits for it (`keel checkpoint --full`).
    pub fn checkpoint_full(&self) -> Result<CheckpointReport, ServiceError> {
        ask(&self.tx, |reply| Cmd::Checkpoint { full: true, reply })?
    }

    /// A gc of the remote by the worker, under the configured retention (`keel gc`).
    pub fn gc(&self) -> Result<GcReport, ServiceError> {
        ask(&self.tx, |reply| Cmd::Gc { reply })?
    }

    /// Runs a named snapshot or a rollback on the worker and waits for it. A rollback is
    /// refused at once while a checkpoint or another rollback runs.
    pub fn agent(&self, op: super::agent::Op) -> Result<serde_json::Value, ServiceError> {
        let rollback = matches!(op, super::agent::Op::Rollback(_));
        // A request that can never work says so, whatever else is running.
        if matches!(&op, super::agent::Op::Rollback(r) if r.restart == Some(true)) && !self.has_main
        {
            return Err(super::agent::AgentError::NoMain.into());
        }
        if rollback {
            if let Err(now) =
                self.busy
                    .compare_exchange(IDLE, ROLLING_BACK, Ordering::SeqCst, Ordering::SeqCst)
            {
                return Err(if now == ROLLING_BACK {
                    ServiceError::RollbackRunning
                } else {
                    ServiceError::CheckpointRunning
                });
            }
        }
        let (reply, rx) = mpsc::channel();
        let r = match self.tx.send(Cmd::Agent { op, reply }) {
            Ok(()) => rx.recv().map_err(|_| ServiceError::Stopped).and_then(|r| r),
            Err(_) => Err(ServiceError::Stopped),
        };
        if rollback {
            self.busy.store(IDLE, Ordering::SeqCst);
        }
        r
    }

    /// `keel diff` / `GET /diff` on the worker, written to `out` as the changes are found
    /// (`agent::diff_to`): nothing is written when it fails before the first change.
    pub fn diff_to(
        &self,
        req: super::agent::Diff,
        format: super::diff::Format,
        limit: u64,
        out: Box<dyn std::io::Write + Send>,
    ) -> Result<(), ServiceError> {
        let (reply, rx) = mpsc::channel();
        let cmd = Cmd::DiffTo {
            req,
            format,
            limit,
            out,
            reply,
        };
        match self.tx.send(cmd) {
            Ok(()) => rx.recv().map_err(|_| ServiceError::Stopped).and_then(|r| r),
            Err(_) => Err(ServiceError::Stopped),
        }
    }

    /// The workspace's remote (for listings and diffs, which only read it).
    pub fn repo(&self) -> Result<super::Repo, ServiceError> {
        ask(&self.tx, |reply| Cmd::Repo { reply })
    }

    /// Backlog and last checkpoint (waits for a checkpoint in progress).
    pub fn state(&self) -> Result<PersistState, ServiceError> {
        ask(&self.tx, |reply| Cmd::State { reply })
    }
}

pub struct Service {
    tx: Sender<Cmd>,
    worker: Option<JoinHandle<()>>,
    state_dir: PathBuf,
    chunk_size: u64,
    /// The final checkpoint's budget; `None`: none (`set_final_unbounded`).
    flush_timeout: Option<Duration>,
    lease: Option<Lease>,
    published: Arc<Published>,
    busy: Arc<AtomicU8>,
    has_main: bool,
}

pub(super) struct Worker {
    pub(super) p: Persister,
    cfg: PersistConfig,
    flush: FlushFn,
    /// See `Cmd::SetPeriodicFlush`.
    periodic_flush: Option<FlushFn>,
    since_gc: u32,
    pub(super) paused: bool,
    /// What a rollback changes (`agent::LiveTree`); `None` when the start gave none (no
    /// rollback then).
    pub(super) live: Option<Box<dyn super::agent::LiveTree>>,
    /// A rollback stops the main command unless asked not to (the `dir` provider).
    pub(super) rollback_restarts: bool,
    /// Recent snapshots' trees for diffs and rollbacks (`history`); loaded on the first.
    pub(super) history: Option<super::history::History>,
    /// See `agent::MainCommand`; `None` under `keel mount`.
    pub(super) main: Option<std::sync::Arc<dyn super::agent::MainCommand>>,
    busy: Arc<AtomicU8>,
    /// Where the workspace is mounted (`agent::sync_kernel`).
    pub(super) mount_point: PathBuf,
    failures: u32,
    last_error: Option<String>,
    published: Arc<Published>,
    /// The remote's directory when it is a `file://` remote on the state volume (see
    /// `make_room`).
    same_volume: Option<PathBuf>,
    /// The disk use of a `file://` remote.
    disk_use: Option<DiskUse>,
    /// The mounted filesystem's read set, uploaded after each checkpoint when it changed.
    read_set: Option<ReadSets>,
}

/// The read set's upload state (see `Worker::upload_read_set`).
struct ReadSets {
    get: ReadSetFn,
    /// The remote's set as found before this session's first upload (fetched then when
    /// the start did not).
    found: Option<Vec<(u64, u64)>>,
    /// Generation of the set last uploaded.
    uploaded: Option<u64>,
}

/// What a checkpoint to a remote on the state volume leaves free at least: a tenth of the
/// volume, at most 2 GiB. That remote holds history only (the workspace itself is on the
/// volume), and its checkpoints must not take the space the workspace needs.
fn space_floor(volume_bytes: u64) -> u64 {
    (volume_bytes / 10).min(2 << 30)
}

/// Chunk bytes a checkpoint may always upload to a remote on the state volume while four
/// times as much is free: the history of a workspace that fills its volume by itself keeps
/// its metadata changes.
const SMALL_CHECKPOINT: u64 = 1 << 20;

/// Whether a checkpoint of at most `need` bytes fits on a volume with `avail` bytes free,
/// leaving `floor` free; if not, why.
fn space_verdict(avail: u64, floor: u64, need: u64) -> Result<(), ServiceError> {
    if avail.checked_sub(need).is_some_and(|left| left >= floor)
        || (need <= SMALL_CHECKPOINT && avail >= 4 * SMALL_CHECKPOINT)
    {
        return Ok(());
    }
    Err(ServiceError::NoRoom { avail, need, floor })
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// The remote's directory when `url` is a `file://` remote on the same filesystem as the
/// state dir.
fn on_state_volume(url: &str, state: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let root = PathBuf::from(url.strip_prefix("file://")?);
    let dev = |p: &Path| std::fs::metadata(p).ok().map(|m| m.dev());
    (dev(&root)? == dev(state)?).then_some(root)
}

impl Worker {
    pub(super) fn checkpoint(
        &mut self,
        opts: CheckpointOptions,
        flush: bool,
    ) -> Result<CheckpointReport, ServiceError> {
        // Marked busy unless a rollback (which checkpoints too) already is.
        let mine = self
            .busy
            .compare_exchange(IDLE, CHECKPOINTING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        let r = self.checkpoint_once(opts, flush);
        if let (Ok(Some(seq)), Some(h)) = (r.as_ref().map(|r| r.seq), self.history.as_mut()) {
            if !matches!(h.advance(self.p.repo(), seq), Ok(true)) {
                self.history = None;
            }
        }
        if mine {
            self.busy.store(IDLE, Ordering::SeqCst);
        }
        match &r {
            Ok(_) => {
                self.failures = 0;
                self.last_error = None;
            }
            Err(e) => {
                self.failures += 1;
                self.last_error = Some(e.to_string());
            }
        }
        // A checkpoint's batches and snapshot trees are large and short-lived; without this
        // glibc keeps that memory in its arenas and keel's RSS stays at the peak.
        crate::sys::mem::release_free_heap();
        self.publish();
        r
    }

    fn publish(&self) {
        let s = self.state();
        // The disk use is the `DiskUse` thread's to publish: a value read here may already
        // be older than the one it published meanwhile.
        self.published.update(|p| {
            let disk = p.remote_disk_bytes.or(s.remote_disk_bytes);
            *p = s;
            p.remote_disk_bytes = disk;
        });
    }

    fn lease_lost(&self) -> bool {
        self.p
            .lease()
            .is_some_and(|l| l.info().state != LeaseState::Held)
    }

    fn checkpoint_once(
        &mut self,
        opts: CheckpointOptions,
        flush: bool,
    ) -> Result<CheckpointReport, ServiceError> {
        let synced_at = Nanos(now_ns());
        if flush {
            (self.flush)().map_err(ServiceError::Flush)?;
        }
        if let Some(root) = self.same_volume.clone() {
            self.make_room(&root)?;
        }
        let r = self
            .p
            .checkpoint(&CheckpointOptions {
                synced_at: Some(synced_at),
                ..opts
            })
            .map_err(ServiceError::Checkpoint)?;
        {
            let _deadline = super::retry::deadline_scope(opts.deadline);
            self.upload_read_set();
        }
        if r.seq.is_some() {
            if let Some(d) = &self.disk_use {
                d.refresh();
            }
            self.since_gc += 1;
            if self.cfg.gc_every > 0 && self.since_gc >= self.cfg.gc_every {
                self.since_gc = 0;
                if let Err(e) = self.gc() {
                    tracing::warn!(error = %e, "automatic gc failed");
                }
            }
        }
        Ok(r)
    }

    /// Uploads the read set when it changed since the last upload: this session's windows,
    /// then those of the set the remote had that this session did not read. Best effort:
    /// a failure is logged and tried again after the next checkpoint.
    fn upload_read_set(&mut self) {
        let Some(rs) = self.read_set.as_mut() else {
            return;
        };
        let (generation, mine) = (rs.get)();
        if rs.uploaded == Some(generation) || (mine.is_empty() && rs.uploaded.is_none()) {
            return;
        }
        let cs = self.p.params.chunk_size;
        let repo = self.p.repo();
        let found = rs
            .found
            .get_or_insert_with(|| super::readset::download(repo, cs));
        let set = super::readset::merge(&mine, found);
        match super::readset::upload(repo, &set, cs) {
            Ok(()) => {
                rs.uploaded = Some(generation);
                tracing::debug!(windows = set.len(), "read set uploaded");
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot upload the read set; trying again after the next checkpoint")
            }
        }
    }

    fn gc(&mut self) -> Result<GcReport, ServiceError> {
        self.gc_keeping(Retention::of(&self.cfg))
    }

    fn gc_keeping(&mut self, rules: Retention) -> Result<GcReport, ServiceError> {
        let mut repo = self.p.repo().clone();
        let r = gc_with(&mut repo, Some(self.p.store()), &rules, self.cfg.gc_grace)
            .map_err(ServiceError::Gc);
        if let Some(d) = &self.disk_use {
            d.refresh();
        }
        r
    }

    /// Before a checkpoint to a remote on the state volume: when it might not leave
    /// `space_floor` free, older history goes first (gc keeping one snapshot, still within
    /// the grace window), and if that is not enough the checkpoint is skipped with an error.
    /// Once paused (the workspace is being stopped and takes no more writes) the floor is
    /// not kept: the checkpoint is skipped only when it cannot fit at all, rather than
    /// leaving half its chunks on a full volume.
    fn make_room(&mut self, root: &Path) -> Result<(), ServiceError> {
        let need = self.p.backlog().map_err(ServiceError::Checkpoint)?.bytes;
        let stopping = self.paused;
        let verdict = || -> Result<(), ServiceError> {
            let s = crate::sys::file::statvfs(root).map_err(|source| ServiceError::FreeSpace {
                path: root.to_path_buf(),
                source,
            })?;
            let unit = s.fragment_size.max(1);
            let floor = if stopping {
                0
            } else {
                space_floor(s.blocks.saturating_mul(unit))
            };
            space_verdict(s.blocks_avail.saturating_mul(unit), floor, need)
        };
        if verdict().is_ok() {
            return Ok(());
        }
        match self.gc_keeping(Retention::count(1)) {
            Ok(r) => {
                tracing::warn!(report = %r, "state volume low on space: gc kept only the newest snapshot")
            }
            Err(e) => tracing::warn!(error = %e, "state volume low on space: gc failed"),
        }
        verdict()
    }

    fn state(&self) -> PersistState {
        let r = self.p.store().read();
        let get = |k: &str| r.persist_get(k).ok().flatten();
        PersistState {
            backlog: self.p.backlog().unwrap_or_default(),
            last_seq: get("last_seq").and_then(|v| v.parse().ok()),
            last_checkpoint_ns: get("last_checkpoint_ns").and_then(|v| v.parse().ok()),
            remote: self.p.repo().describe(),
            consecutive_failures: self.failures,
            last_error: self.last_error.clone(),
            lease: self.p.lease().map(|l| l.info()),
            remote_disk_bytes: self.disk_use.as_ref().and_then(DiskUse::get),
        }
    }

    fn run(mut self, rx: Receiver<Cmd>, interval: Duration) {
        // Changes left from the last run (a failed final checkpoint) go first.
        let mut next = if self.p.has_changes().unwrap_or(false) && !interval.is_zero() {
            Instant::now()
        } else {
            Instant::now() + interval
        };
        loop {
            let wait = if self.paused || interval.is_zero() {
                Duration::from_secs(3600)
            } else {
                next.saturating_duration_since(Instant::now())
            };
            match rx.recv_timeout(wait) {
                Err(RecvTimeoutError::Timeout) => {
                    if self.paused || interval.is_zero() {
                        continue;
                    }
                    next = Instant::now() + interval;
                    // Without the lease there is nothing to try: lost for good (until keel
                    // restarts), or lapsed until the renewal thread takes it back.
                    if self.lease_lost() {
                        continue;
                    }
                    let flushed = match &self.periodic_flush {
                        Some(f) => f(),
                        None => (self.flush)(),
                    };
                    if let Err(e) = &flushed {
                        tracing::warn!(error = %e, "periodic checkpoint skipped: the workspace's changes could not be collected");
                    }
                    let changed = flushed.is_ok() && self.p.has_changes().unwrap_or(true);
                    if changed {
                        if let Err(e) = self.checkpoint(CheckpointOptions::default(), false) {
                            if !self.lease_lost() {
                                let d = retry_delay(self.failures, interval);
                                next = Instant::now() + d;
                                tracing::warn!(
                                    error = %e,
                                    failures = self.failures,
                                    "periodic checkpoint failed; retrying in {:.0}s",
                                    d.as_secs_f64()
                                );
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => break,
                Ok(Cmd::Close { clean }) => {
                    if clean {
                        if let Err(e) = self.p.mark_running(false) {
                            tracing::warn!(error = %e, "could not record the clean stop");
                        }
                    }
                    break;
                }
                Ok(Cmd::Checkpoint { full, reply }) => {
                    let r = self.checkpoint(
                        CheckpointOptions {
                            full,
                            ..Default::default()
                        },
                        !self.paused,
                    );
                    let _ = reply.send(r);
                }
                Ok(Cmd::Gc { reply }) => {
                    let _ = reply.send(self.gc());
                }
                Ok(Cmd::State { reply }) => {
                    let _ = reply.send(self.state());
                }
                Ok(Cmd::Agent { op, reply }) => {
                    let _ =
                        reply.send(super::agent::run(&mut self, op).map_err(ServiceError::from));
                }
                Ok(Cmd::DiffTo {
                    req,
                    format,
                    limit,
                    mut out,
                    reply,
                }) => {
                    let _peak = crate::budget::track("diff");
                    let r = super::agent::diff_to(&mut self, &req, format, limit, &mut out);
                    // The writer ends the answer when it goes (before the reply).
                    drop(out);
                    let _ = reply.send(r.map_err(ServiceError::from));
                }
                Ok(Cmd::Repo { reply }) => {
                    let _ = reply.send(self.p.repo().clone());
                }
                Ok(Cmd::SetPeriodicFlush { f }) => self.periodic_flush = Some(f),
                Ok(Cmd::SetReadSet { f, found }) => {
                    self.read_set = Some(ReadSets {
                        get: f,
                        found,
                        uploaded: None,
                    })
                }
                Ok(Cmd::Pause { reply }) => {
                    self.paused = true;
                    let _ = reply.send(());
                }
                Ok(Cmd::Final { deadline, reply }) => {
                    self.paused = true;
                    // A long final checkpoint says in the log how far it has got.
                    let log = crate::progress::Logged::new("final checkpoint", LOG_EVERY);
                    let r = crate::progress::scope(log, || {
                        self.checkpoint(
                            CheckpointOptions {
                                deadline,
                                ..Default::default()
                            },
                            false,
                        )
                    });
                    let _ = reply.send(r);
                }
            }
        }
    }
}

impl Service {
    /// A handle other threads use to ask for checkpoints and read the backlog.
    pub fn handle(&self) -> CheckpointHandle {
        CheckpointHandle {
            tx: self.tx.clone(),
            busy: self.busy.clone(),
            has_main: self.has_main,
        }
    }

    /// How long the final checkpoint at unmount may take (so the init's own deadline can
    /// still report what did not reach the remote).
    pub fn set_final_budget(&mut self, budget: Duration) {
        self.flush_timeout = Some(budget);
    }

    /// The final checkpoint runs to its end, however long it takes (a dead remote still
    /// ends it: its retries give up): nobody waits to kill keel, as after an unmount from
    /// outside, so what it saves does not depend on how loaded the machine is.
    pub fn set_final_unbounded(&mut self) {
        self.flush_timeout = None;
    }

    /// Calls `f` with the new state after every checkpoint attempt and lease renewal (for
    /// `/status`), once right away.
    pub fn set_observer(&self, f: StateObserver) {
        *self
            .published
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(f);
        self.published.update(|_| {});
    }

    /// The state as of the last checkpoint attempt or lease renewal (does not wait for a
    /// checkpoint in progress).
    pub fn published_state(&self) -> PersistState {
        self.published
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Starts checkpoints for a mounted workspace; `None` when `[persist] remote = "none"`.
    /// `lease`, when given, fences every checkpoint; the service renews it and releases it
    /// when it closes. `main`: `keel run`'s main command, which `rollback --restart` stops
    /// and starts again (`None` under `keel mount`, which refuses it).
    pub fn start(
        ws: &WorkspaceConfig,
        cfg: &PersistConfig,
        flush: FlushFn,
        lease: Option<Lease>,
        main: Option<std::sync::Arc<dyn super::agent::MainCommand>>,
    ) -> Result<Option<Service>, ServiceError> {
        Self::start_with(ws, cfg, flush, lease, main, None, None)
    }

    /// [`Service::start`] with what rollbacks change (`live`; none: rollbacks are refused)
    /// and, for a workspace whose file bytes are not in the state dir's bodies, `opener`,
    /// which opens a file by inode number for the checkpoint (the `dir` provider's tree).
    pub fn start_with(
        ws: &WorkspaceConfig,
        cfg: &PersistConfig,
        flush: FlushFn,
        mut lease: Option<Lease>,
        main: Option<std::sync::Arc<dyn super::agent::MainCommand>>,
        opener: Option<super::checkpoint::BodyOpener>,
        live: Option<Box<dyn super::agent::LiveTree>>,
    ) -> Result<Option<Service>, ServiceError> {
        let state = &ws.state_dir;
        let Some(url) = cfg.remote_url(state) else {
            return Ok(None);
        };
        // A `file://` remote an older keel left readable is made private before it is used.
        if let Err(e) = super::secure_remote(&url) {
            tracing::warn!(remote = %url, error = %e, "cannot make the file:// remote private");
        }
        let repo = super::open_remote(&url, cfg).map_err(|source| ServiceError::OpenRemote {
            url: url.clone(),
            source,
        })?;
        let mut p = Persister::open(state, repo, super::params(ws, cfg))?;
        // A workspace read through an opener is the `dir` provider's: its rollbacks stop
        // the main command unless asked not to.
        let rollback_restarts = opener.is_some();
        p.set_body_opener(opener);
        p.mark_running(true)?;
        let same_volume = on_state_volume(&url, state);
        let published = Arc::new(Published::default());
        if let Some(l) = lease.as_mut() {
            p.set_lease(Some(l.handle()));
            let pb = published.clone();
            l.set_observer(Box::new(move |info| pb.update(|s| s.lease = Some(info))));
            l.start_renewal().map_err(ServiceError::Spawn)?;
        }
        let disk_use = match p.repo().remote.local_root() {
            Some(root) => Some(
                DiskUse::start(root.to_path_buf(), published.clone())
                    .map_err(ServiceError::Spawn)?,
            ),
            None => None,
        };
        let (tx, rx) = mpsc::channel();
        let busy = Arc::new(AtomicU8::new(IDLE));
        let has_main = main.is_some();
        let worker = Worker {
            rollback_restarts,
            p,
            cfg: cfg.clone(),
            flush,
            since_gc: 0,
            paused: false,
            live,
            periodic_flush: None,
            history: None,
            main,
            busy: busy.clone(),
            mount_point: ws.mount_point.clone(),
            failures: 0,
            last_error: None,
            published: published.clone(),
            same_volume,
            disk_use,
            read_set: None,
        };
        worker.publish();
        let interval = cfg.interval;
        let handle = std::thread::Builder::new()
            .name("keel-checkpoint".into())
            .spawn(move || worker.run(rx, interval))
            .map_err(ServiceError::Spawn)?;
        tracing::info!(remote = %url, interval_s = interval.as_secs_f64(), "checkpoints enabled");
        Ok(Some(Service {
            tx,
            worker: Some(handle),
            state_dir: state.clone(),
            chunk_size: ws.chunk_size,
            flush_timeout: Some(cfg.flush_timeout),
            lease,
            published,
            busy,
            has_main,
        }))
    }

    /// Uploads the mounted filesystem's read set after each checkpoint when it changed;
    /// `found`: the remote's set, when the start fetched it already.
    pub fn set_read_set(&self, f: ReadSetFn, found: Option<Vec<(u64, u64)>>) {
        let _ = self.tx.send(Cmd::SetReadSet { f, found });
    }

    /// Periodic checkpoints flush with `f` (see `Cmd::SetPeriodicFlush`).
    pub fn set_periodic_flush(&self, f: FlushFn) {
        let _ = self.tx.send(Cmd::SetPeriodicFlush { f });
    }

    /// Takes a checkpoint now and waits for it (`fsync = "remote"`, `keel checkpoint`).
    pub fn checkpoint_now(&self) -> Result<CheckpointReport, ServiceError> {
        ask(&self.tx, |reply| Cmd::Checkpoint { full: false, reply })?
    }

    /// Stops periodic checkpoints (before the filesystem is unmounted).
    pub fn pause(&self) {
        let (reply, rx) = mpsc::channel();
        if self.tx.send(Cmd::Pause { reply }).is_ok() {
            let _ = rx.recv();
        }
    }

    /// The final checkpoint, right after the caller flushed the filesystem, within
    /// `[persist] flush_timeout` (unless `set_final_unbounded`). Periodic checkpoints stop.
    pub fn finish(&mut self) -> Result<CheckpointReport, FinalError> {
        let deadline = self.flush_timeout.map(|t| Instant::now() + t);
        let (reply, rx) = mpsc::channel();
        let sent = self.tx.send(Cmd::Final { deadline, reply }).is_ok();
        // The worker checks the deadline between steps; allow one remote round trip more.
        let got = match (sent, self.flush_timeout) {
            (false, _) => None,
            (true, Some(t)) => rx.recv_timeout(t + Duration::from_secs(2)).ok(),
            (true, None) => rx.recv().ok(),
        };
        match got {
            Some(Ok(r)) => Ok(r),
            other => {
                let reason = match other {
                    Some(Err(e)) => e,
                    _ => match self.flush_timeout {
                        Some(t) => ServiceError::FinalTimeout(t),
                        None => ServiceError::Stopped,
                    },
                };
                let backlog = read_backlog(&self.state_dir, self.chunk_size).unwrap_or_default();
                Err(FinalError {
                    reason: Box::new(reason),
                    backlog,
                })
            }
        }
    }

    /// Stops the service and releases the lease. `clean`: the filesystem has stopped and
    /// recorded every write, so the next start need not look for unrecorded ones.
    pub fn close(mut self, clean: bool) {
        self.stop(clean);
        if let Some(l) = self.lease.take() {
            if let Err(e) = l.release() {
                tracing::warn!(error = %e, "could not release the workspace lease; the next writer waits for it to expire");
            }
        }
    }

    fn stop(&mut self, clean: bool) {
        let _ = self.tx.send(Cmd::Close { clean });
        if let Some(w) = self.worker.take() {
            // A worker stuck past the final deadline is left behind; the process exits.
            if clean || w.is_finished() {
                let _ = w.join();
            }
        }
    }
}

fn read_backlog(state: &Path, chunk_size: u64) -> Option<Backlog> {
    let store = crate::state::open_store(state, Nanos(now_ns())).ok()?;
    backlog(&store, chunk_size).ok()
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_checkpoints_retry_sooner_than_the_interval_then_back_off() {
        let i = Duration::from_secs(30);
        let d: Vec<u64> = (1..=7).map(|n| retry_delay(n, i).as_secs()).collect();
        assert_eq!(d, [1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(retry_delay(1000, i), i);
        assert_eq!(
            retry_delay(3, Duration::from_millis(500)),
            Duration::from_millis(500)
        );
    }

    #[test]
    fn a_checkpoint_to_the_state_volume_leaves_a_tenth_of_it_free_at_most_2_gib() {
        const M: u64 = 1 << 20;
        assert_eq!(space_floor(100 * M), 10 * M);
        assert_eq!(space_floor(1 << 40), 2 << 30);
        let floor = space_floor(100 * M);
        assert!(space_verdict(50 * M, floor, 40 * M).is_ok());
        assert!(space_verdict(50 * M, floor, 41 * M).is_err());
        let e = space_verdict(20 * M, floor, 36 * M)
            .unwrap_err()
            .to_string();
        assert!(e.contains("20.0 MiB free") && e.contains("36.0 MiB"), "{e}");
        // Small ones go through on a volume the workspace itself fills, down to 4 MiB free.
        assert!(space_verdict(5 * M, floor, M).is_ok());
        assert!(space_verdict(5 * M, floor, 2 * M).is_err());
        assert!(space_verdict(3 * M, floor, 0).is_err());
        // At stop (no floor) only what cannot fit at all is skipped.
        assert!(space_verdict(M, 0, M / 2).is_ok());
        assert!(space_verdict(M, 0, 2 * M).is_err());
    }

    #[test]
    fn only_a_file_remote_on_the_state_volume_is_guarded() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        let remote = state.join(crate::state::REMOTE);
        std::fs::create_dir_all(&remote).unwrap();
        let url = format!("file://{}", remote.display());
        assert_eq!(on_state_volume(&url, &state), Some(remote));
        assert_eq!(on_state_volume("s3://bucket/prefix", &state), None);
        // /proc is another filesystem.
        assert_eq!(on_state_volume("file:///proc", &state), None);
    }
}

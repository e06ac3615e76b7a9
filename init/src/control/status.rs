//! The shared status model behind `/health`, `/status`, `/metrics` and `keel status`: one
//! `StatusHandle` (cheap to clone) that `run`, the supervisor and persistence publish into,
//! and that the control servers read. Publishing only swaps small values under a mutex, so it
//! never blocks the supervisor loop on a slow client. Secrets are never stored here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::workspace::MountedHandle;

/// What `POST /checkpoint` runs. Returns once the checkpoint is durable, or why it failed.
pub type CheckpointFn = Box<
    dyn Fn() -> Result<CheckpointReport, Box<dyn std::error::Error + Send + Sync>> + Send + Sync,
>;

/// What a checkpoint did; serialized as the body of `POST /checkpoint`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CheckpointReport {
    /// One line saying what was done, e.g. "flushed the workspace to the local store".
    pub done: String,
    /// The checkpoint reached the remote (false: local store only).
    pub remote: bool,
    /// Files (inodes) that were part of the checkpoint.
    pub files: Option<u64>,
    /// Chunks and bytes sent to the remote.
    pub chunks_uploaded: Option<u64>,
    pub bytes_uploaded: Option<u64>,
    /// Identifier of the committed checkpoint (e.g. its metadata snapshot).
    pub checkpoint: Option<String>,
}

/// Persistence numbers, published by the persistence side; all `None` (JSON `null`) until it
/// does. Replace them whole with [`StatusHandle::set_persist`] or edit them in place with
/// [`StatusHandle::update_persist`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PersistStatus {
    /// Bytes and files changed since the last checkpoint.
    pub dirty_bytes: Option<u64>,
    pub dirty_files: Option<u64>,
    /// When the last checkpoint committed.
    pub last_checkpoint: Option<SystemTime>,
    /// Bytes and chunks committed locally but not yet on the remote.
    pub remote_backlog_bytes: Option<u64>,
    pub remote_backlog_chunks: Option<u64>,
    /// Changed inodes not on the remote yet.
    pub backlog_inodes: Option<u64>,
    /// Checkpoints that failed in a row, and why the last one did (no credentials).
    pub consecutive_failures: Option<u32>,
    pub last_error: Option<String>,
    /// The single-writer lease on the remote.
    pub lease: Option<LeaseStatus>,
    /// Bytes a `file://` remote takes on disk (allocated blocks), as of the last checkpoint
    /// or gc; `None` for other remotes.
    pub remote_disk_bytes: Option<u64>,
}

/// The single-writer lease as persistence sees it. Holds no credentials.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseStatus {
    /// This keel holds the lease.
    pub held: bool,
    /// `held`, `lost`, `released` or `disabled`.
    pub state: String,
    /// Who holds it (an instance id, host and pid, not a secret).
    pub holder: Option<String>,
    /// Grows by one at every change of holder.
    pub epoch: Option<u64>,
    /// When it runs out unless renewed.
    pub expires: Option<SystemTime>,
    /// Why it was lost.
    pub error: Option<String>,
}

/// Where the workspace is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MountState {
    /// keel has not got to the mount yet.
    Pending,
    Mounting,
    Mounted,
    /// `[init] workspace = false`.
    Disabled,
    /// The `dir` provider: a plain directory on the state volume, checkpointed by walks.
    Dir,
    /// The final flush and unmount are running.
    Unmounting,
    Unmounted,
}

impl MountState {
    /// True while the FUSE workspace is mounted (also during the final flush).
    pub fn is_mounted(self) -> bool {
        matches!(self, MountState::Mounted | MountState::Unmounting)
    }
    /// True when the workspace needs nothing more before keel is healthy.
    fn settled(self) -> bool {
        matches!(
            self,
            MountState::Mounted | MountState::Disabled | MountState::Dir
        )
    }
}

/// A service's state as `/status` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServiceState {
    /// Waiting for its dependencies, or started and its readiness probe has not passed yet.
    Starting,
    /// Running and its readiness probe passed.
    Ready,
    /// Running; it has no readiness probe.
    Running,
    /// Ended and will not be started again.
    Exited,
    /// Ended; a restart is scheduled.
    Restarting,
    /// keel is stopping and sent it its stop signal; it still runs.
    Stopping,
    /// keel is stopping and it has ended.
    Stopped,
}

impl ServiceState {
    pub const ALL: [ServiceState; 7] = [
        ServiceState::Starting,
        ServiceState::Ready,
        ServiceState::Running,
        ServiceState::Exited,
        ServiceState::Restarting,
        ServiceState::Stopping,
        ServiceState::Stopped,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceState::Starting => "starting",
            ServiceState::Ready => "ready",
            ServiceState::Running => "running",
            ServiceState::Exited => "exited",
            ServiceState::Restarting => "restarting",
            ServiceState::Stopping => "stopping",
            ServiceState::Stopped => "stopped",
        }
    }
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitInfo {
    Code(i32),
    Signal(i32),
}

/// One supervised process as the supervisor publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceStatus {
    pub name: String,
    /// The image's command (`keel run -- CMD`), not a `[[service]]`.
    pub main: bool,
    pub pid: Option<i32>,
    pub state: ServiceState,
    /// It has a readiness probe (so `/health` waits for it).
    pub probed: bool,
    /// Restarts since keel started (never reset; a Prometheus counter).
    pub restarts: u64,
    pub last_exit: Option<ExitInfo>,
}

/// Whether keel is starting, supervising or stopping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Booting, mounting, or the supervisor has not published yet.
    Starting,
    Running,
    /// keel is stopping; the reason in words.
    Stopping(String),
}

#[derive(Debug)]
struct State {
    phase: Phase,
    mount: MountState,
    services: Vec<ServiceStatus>,
    persist: PersistStatus,
}

struct Shared {
    started: Instant,
    started_wall: SystemTime,
    mount_point: String,
    /// The state dir with every symlink resolved: a client checks it is this keel's.
    state_dir: String,
    cache: &'static str,
    /// `[control] diff_max_entries`.
    diff_max_entries: u64,
    state: Mutex<State>,
    workspace: Mutex<Option<MountedHandle>>,
    checkpoint: Mutex<Option<Arc<CheckpointFn>>>,
    /// Held while a checkpoint runs: they never overlap.
    checkpoint_running: Mutex<()>,
    supervised: AtomicBool,
    /// The checkpoint service, for named snapshots, diffs and rollbacks (`snapshots`).
    agent: Mutex<Option<crate::persist::CheckpointHandle>>,
    /// Processes started through the API (`keel run` only).
    exec: Mutex<Option<Arc<crate::exec::Processes>>>,
    /// The `/metrics` registry, built once with the model.
    registry: prometheus_client::registry::Registry,
}

/// The handle everything publishes status through. Clone it freely.
#[derive(Clone)]
pub struct StatusHandle(Arc<Shared>);

impl std::fmt::Debug for StatusHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusHandle").finish_non_exhaustive()
    }
}

/// A status model that may be gone (what the metrics registry inside it holds).
#[derive(Debug)]
pub(crate) struct WeakStatus(Weak<Shared>);

impl WeakStatus {
    pub(crate) fn upgrade(&self) -> Option<StatusHandle> {
        self.0.upgrade().map(StatusHandle)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take the control API down with it: the data is plain values.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why `/health` is not 200, in a few words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotReady(pub String);

/// What a checkpoint request came to.
#[derive(Debug)]
pub enum CheckpointOutcome {
    Done(CheckpointReport, Duration),
    /// Nothing to checkpoint into (no workspace mounted, or keel is stopping).
    Unavailable(String),
    Failed(String),
}

impl StatusHandle {
    /// A fresh model: phase starting, mount pending, no services.
    pub fn new(cfg: &crate::config::Config) -> Self {
        StatusHandle(Arc::new_cyclic(|me| Shared {
            started: Instant::now(),
            started_wall: SystemTime::now(),
            mount_point: cfg.workspace.mount_point.display().to_string(),
            state_dir: canonical_state_dir(&cfg.workspace.state_dir),
            cache: cfg.workspace.cache.as_str(),
            diff_max_entries: cfg.control.diff_max_entries,
            state: Mutex::new(State {
                phase: Phase::Starting,
                mount: MountState::Pending,
                services: Vec::new(),
                persist: PersistStatus::default(),
            }),
            workspace: Mutex::new(None),
            checkpoint: Mutex::new(None),
            checkpoint_running: Mutex::new(()),
            supervised: AtomicBool::new(false),
            agent: Mutex::new(None),
            exec: Mutex::new(None),
            registry: super::metrics::registry(WeakStatus(me.clone())),
        }))
    }

    /// The `/metrics` registry of this model.
    pub fn registry(&self) -> &prometheus_client::registry::Registry {
        &self.0.registry
    }

    pub fn uptime(&self) -> Duration {
        self.0.started.elapsed()
    }

    // ----- publishing -----

    pub fn set_mount(&self, state: MountState) {
        lock(&self.0.state).mount = state;
    }

    /// `run` is about to mount the workspace (or not, by config).
    pub fn mounting(&self, cfg: &crate::config::Config) {
        self.set_mount(if cfg.init.workspace {
            MountState::Mounting
        } else {
            MountState::Disabled
        });
    }

    /// `run` has mounted the workspace, or found it disabled or fell back to a plain dir.
    pub fn mounted(&self, cfg: &crate::config::Config, m: Option<&crate::workspace::Mounted>) {
        self.set_workspace(m.map(|m| m.handle()));
        self.set_mount(match (m, cfg.init.workspace) {
            (Some(_), _) => MountState::Mounted,
            (None, false) => MountState::Disabled,
            (None, true) => MountState::Dir,
        });
    }

    /// The final flush and unmount begin: no more checkpoints, snapshots or rollbacks
    /// through the control API (the checkpoint service is busy with the final checkpoint).
    pub fn unmounting(&self) {
        self.set_stopping("stopping");
        self.set_workspace(None);
        *lock(&self.0.agent) = None;
        self.set_mount(MountState::Unmounting);
    }

    /// The mounted workspace, for the default checkpoint (a flush) and the passthrough flag;
    /// `None` once it is being unmounted.
    pub fn set_workspace(&self, handle: Option<MountedHandle>) {
        *lock(&self.0.workspace) = handle;
    }

    /// The mounted workspace (`None` before the mount, once it unmounts, and with no FUSE
    /// workspace).
    pub fn workspace(&self) -> Option<MountedHandle> {
        lock(&self.0.workspace).clone()
    }

    /// The supervisor's view of every unit, and whether it is stopping (and why).
    pub fn set_services(&self, services: Vec<ServiceStatus>, stopping: Option<String>) {
        self.0.supervised.store(true, Ordering::Release);
        let mut s = lock(&self.0.state);
        s.services = services;
        s.phase = match stopping {
            Some(why) => Phase::Stopping(why),
            None if matches!(s.phase, Phase::Stopping(_)) => s.phase.clone(),
            None => Phase::Running,
        };
    }

    /// Marks keel as stopping (for `/health`) without touching the services.
    pub fn set_stopping(&self, why: impl Into<String>) {
        let mut s = lock(&self.0.state);
        if !matches!(s.phase, Phase::Stopping(_)) {
            s.phase = Phase::Stopping(why.into());
        }
    }

    /// Replaces every persistence field at once.
    pub fn set_persist(&self, p: PersistStatus) {
        lock(&self.0.state).persist = p;
    }

    /// Edits persistence fields in place, e.g. `h.update_persist(|p| p.dirty_bytes = Some(n))`.
    pub fn update_persist(&self, f: impl FnOnce(&mut PersistStatus)) {
        f(&mut lock(&self.0.state).persist);
    }

    /// Registers what `POST /checkpoint` runs instead of the default flush. Replaces any
    /// earlier callback. It runs on the HTTP connection's thread, never two at once through
    /// this API, and the reply waits for it; a panic in it answers 500. keel's final flush
    /// at shutdown does not wait for a checkpoint in flight: serialize the two in the callee.
    pub fn set_checkpoint(&self, f: CheckpointFn) {
        *lock(&self.0.checkpoint) = Some(Arc::new(f));
    }

    /// Registers the checkpoint service behind `/snapshots`, `/diff` and `/rollback`.
    pub fn set_agent(&self, h: crate::persist::CheckpointHandle) {
        *lock(&self.0.agent) = Some(h);
    }

    /// The checkpoint service, once registered.
    pub fn agent(&self) -> Option<crate::persist::CheckpointHandle> {
        lock(&self.0.agent).clone()
    }

    /// Changed entries one diff answer may list (`[control] diff_max_entries`; 0: any).
    pub fn diff_max_entries(&self) -> u64 {
        self.0.diff_max_entries
    }

    /// Processes started through the API from now on (`/exec`, `/processes`).
    pub fn set_exec(&self, p: Arc<crate::exec::Processes>) {
        *lock(&self.0.exec) = Some(p);
    }

    /// The processes' table, under `keel run`.
    pub fn exec(&self) -> Option<Arc<crate::exec::Processes>> {
        lock(&self.0.exec).clone()
    }

    // ----- reading -----

    /// `Ok` when keel is supervising, not stopping, the workspace is mounted (or disabled or
    /// a plain dir by config) and every service with a readiness probe is ready and running.
    pub fn health(&self) -> Result<(), NotReady> {
        let s = lock(&self.0.state);
        let nr = |m: String| Err(NotReady(m));
        match &s.phase {
            Phase::Stopping(_) => return nr("stopping".into()),
            Phase::Starting if !self.0.supervised.load(Ordering::Acquire) => {
                return nr(match s.mount {
                    MountState::Pending | MountState::Mounting => "workspace not mounted yet",
                    _ => "starting",
                }
                .into())
            }
            _ => {}
        }
        if !s.mount.settled() {
            return nr(format!("workspace {}", mount_word(s.mount)));
        }
        if let Some(u) = s
            .services
            .iter()
            .find(|u| u.probed && u.state != ServiceState::Ready)
        {
            return nr(format!("service {} {}", u.name, u.state.as_str()));
        }
        Ok(())
    }

    /// The body of `GET /status` (and `keel status`): pretty JSON, newline-terminated.
    pub fn status_json(&self) -> String {
        let mut out = serde_json::to_string_pretty(&self.report()).unwrap_or_else(|e| {
            format!(
                "{{\"error\": {}}}",
                serde_json::Value::String(e.to_string())
            )
        });
        out.push('\n');
        out
    }

    /// A consistent copy of everything, for `/status` and `/metrics`.
    pub fn report(&self) -> Report {
        let health = self.health();
        let (passthrough, fuse_requests, fuse_requests_unwaited) =
            match lock(&self.0.workspace).as_ref() {
                Some(w) => (
                    Some(w.passthrough()),
                    Some(w.fuse_requests()),
                    Some(w.fuse_requests_unwaited()),
                ),
                None => (None, None, None),
            };
        let s = lock(&self.0.state);
        let uptime = self.0.started.elapsed();
        Report {
            version: env!("CARGO_PKG_VERSION"),
            state_dir: self.0.state_dir.clone(),
            started_at: crate::time::rfc3339(self.0.started_wall),
            uptime_seconds: round3(uptime.as_secs_f64()),
            phase: match &s.phase {
                Phase::Starting => "starting",
                Phase::Running => "running",
                Phase::Stopping(_) => "stopping",
            },
            stopping: match &s.phase {
                Phase::Stopping(why) => Some(why.clone()),
                _ => None,
            },
            healthy: health.is_ok(),
            health: match health {
                Ok(()) => "ok".into(),
                Err(NotReady(why)) => why,
            },
            mount: MountReport {
                state: s.mount,
                mounted: s.mount.is_mounted(),
                mount_point: self.0.mount_point.clone(),
                cache: self.0.cache,
                passthrough: passthrough.filter(|_| s.mount.is_mounted()),
                fuse_requests: fuse_requests.filter(|_| s.mount.is_mounted()),
                fuse_requests_unwaited: fuse_requests_unwaited.filter(|_| s.mount.is_mounted()),
            },
            services: s
                .services
                .iter()
                .map(|u| ServiceReport {
                    name: u.name.clone(),
                    main: u.main,
                    pid: u.pid,
                    state: u.state,
                    ready_probe: u.probed,
                    restarts: u.restarts,
                    last_exit: u.last_exit.map(|e| match e {
                        ExitInfo::Code(c) => ExitReport {
                            code: Some(c),
                            signal: None,
                            text: crate::sys::process::Exit::Code(c).to_string(),
                        },
                        ExitInfo::Signal(n) => ExitReport {
                            code: None,
                            signal: Some(crate::sys::signal::name(n).to_string()),
                            text: crate::sys::process::Exit::Signal(n).to_string(),
                        },
                    }),
                })
                .collect(),
            persist: PersistReport {
                dirty_bytes: s.persist.dirty_bytes,
                dirty_files: s.persist.dirty_files,
                last_checkpoint: s.persist.last_checkpoint.map(crate::time::rfc3339),
                last_checkpoint_unix: s.persist.last_checkpoint.map(unix_secs),
                remote_backlog_bytes: s.persist.remote_backlog_bytes,
                remote_backlog_chunks: s.persist.remote_backlog_chunks,
                last_checkpoint_age_seconds: s.persist.last_checkpoint.map(|t| {
                    round3(
                        SystemTime::now()
                            .duration_since(t)
                            .unwrap_or(Duration::ZERO)
                            .as_secs_f64(),
                    )
                }),
                backlog_inodes: s.persist.backlog_inodes,
                consecutive_failures: s.persist.consecutive_failures,
                last_error: s.persist.last_error.clone(),
                remote_disk_bytes: s.persist.remote_disk_bytes,
                lease: s.persist.lease.as_ref().map(|l| LeaseReport {
                    held: l.held,
                    state: l.state.clone(),
                    holder: l.holder.clone(),
                    epoch: l.epoch,
                    expires: l.expires.map(crate::time::rfc3339),
                    error: l.error.clone(),
                }),
            },
            memory: MemoryReport::now(),
        }
    }

    // ----- checkpoint -----

    /// Runs one checkpoint (never two at once): the registered callback, else a flush of the
    /// mounted workspace. Returns once it is done.
    pub fn checkpoint(&self) -> CheckpointOutcome {
        let _one = lock(&self.0.checkpoint_running);
        let t0 = Instant::now();
        if let Some(stopping) = self.stopping_outcome() {
            return stopping;
        }
        let callback = lock(&self.0.checkpoint).clone();
        if let Some(f) = callback {
            return match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f())) {
                Ok(Ok(r)) => CheckpointOutcome::Done(r, t0.elapsed()),
                Ok(Err(e)) => CheckpointOutcome::Failed(e.to_string()),
                Err(_) => CheckpointOutcome::Failed("the checkpoint panicked".into()),
            };
        }
        let ws = lock(&self.0.workspace).clone();
        let Some(ws) = ws else {
            let mount = lock(&self.0.state).mount;
            return CheckpointOutcome::Unavailable(format!("workspace {}", mount_word(mount)));
        };
        match ws.flush() {
            Ok(()) => CheckpointOutcome::Done(
                CheckpointReport {
                    done: format!(
                        "flushed {} to the local store (no remote configured)",
                        ws.mount_point().display()
                    ),
                    remote: false,
                    ..Default::default()
                },
                t0.elapsed(),
            ),
            Err(e) => CheckpointOutcome::Failed(e.to_string()),
        }
    }

    /// A checkpoint that writes a full snapshot, not a delta (`keel checkpoint --full`), by
    /// the checkpoint service (never beside another checkpoint of this API). Without a
    /// service there is no snapshot to write.
    pub fn checkpoint_full(&self) -> CheckpointOutcome {
        let _one = lock(&self.0.checkpoint_running);
        let t0 = Instant::now();
        if let Some(stopping) = self.stopping_outcome() {
            return stopping;
        }
        let Some(agent) = self.agent() else {
            return CheckpointOutcome::Unavailable(NO_SERVICE.into());
        };
        match agent.checkpoint_full() {
            Ok(r) => CheckpointOutcome::Done(CheckpointReport::of(&r), t0.elapsed()),
            Err(e) => CheckpointOutcome::Failed(e.to_string()),
        }
    }

    /// The answer to a checkpoint asked for once keel is stopping.
    fn stopping_outcome(&self) -> Option<CheckpointOutcome> {
        matches!(lock(&self.0.state).phase, Phase::Stopping(_)).then(|| {
            CheckpointOutcome::Unavailable("keel is stopping; the final flush is under way".into())
        })
    }
}

/// Why a route that needs the checkpoint service is not served.
pub const NO_SERVICE: &str =
    "no checkpoint service (no workspace mounted, keel is stopping, or [persist] remote = \"none\")";

impl CheckpointReport {
    /// The report of a checkpoint by the checkpoint service.
    pub fn of(r: &crate::persist::checkpoint::CheckpointReport) -> Self {
        CheckpointReport {
            done: r.to_string(),
            remote: true,
            files: Some(r.inodes),
            chunks_uploaded: Some(r.chunks_uploaded),
            bytes_uploaded: Some(r.chunk_bytes_uploaded),
            checkpoint: r.seq.map(|s| s.to_string()),
        }
    }
}

fn mount_word(m: MountState) -> &'static str {
    match m {
        MountState::Pending | MountState::Mounting => "not mounted yet",
        MountState::Mounted => "mounted",
        MountState::Disabled => "disabled by config",
        MountState::Dir => "is a directory on the state volume (provider dir)",
        MountState::Unmounting => "is being unmounted",
        MountState::Unmounted => "unmounted",
    }
}

/// `dir` with every symlink resolved, or as it is when that fails (it does not exist, or is
/// hidden): what `GET /status` reports as `state_dir`, and what a client compares it with to
/// know the keel that answered serves its state dir.
pub fn canonical_state_dir(dir: &std::path::Path) -> String {
    std::fs::canonicalize(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .display()
        .to_string()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Seconds since the Unix epoch, with milliseconds.
pub fn unix_secs(t: SystemTime) -> f64 {
    round3(
        t.duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs_f64(),
    )
}

/// `GET /status`, field by field.
#[derive(Debug, Serialize)]
pub struct Report {
    pub version: &'static str,
    /// The state dir this keel serves, symlinks resolved (`canonical_state_dir`).
    pub state_dir: String,
    pub started_at: String,
    pub uptime_seconds: f64,
    pub phase: &'static str,
    pub stopping: Option<String>,
    pub healthy: bool,
    pub health: String,
    pub mount: MountReport,
    pub services: Vec<ServiceReport>,
    pub persist: PersistReport,
    pub memory: MemoryReport,
}

/// keel's own memory against its budget (see `crate::budget`), bytes.
#[derive(Debug, Serialize)]
pub struct MemoryReport {
    /// keel's resident memory now (`VmRSS`); null where /proc does not say.
    pub rss_bytes: Option<u64>,
    /// Its peak since keel started.
    pub peak_bytes: u64,
    pub budget_bytes: u64,
    /// Where the budget came from, in words.
    pub budget: String,
    /// The peak of the last checkpoint (null before the first).
    pub last_checkpoint_peak_bytes: Option<u64>,
    /// The last tracked operation (checkpoint, snapshot_create, diff, rollback, gc, fsck,
    /// restore, fork) and its peak.
    pub last_operation: Option<String>,
    pub last_operation_peak_bytes: Option<u64>,
}

impl MemoryReport {
    pub fn now() -> MemoryReport {
        let b = crate::budget::get();
        let p = crate::budget::peaks();
        MemoryReport {
            rss_bytes: crate::budget::rss().map(|(now, _)| now),
            peak_bytes: p.since_start,
            budget_bytes: b.bytes,
            budget: b.to_string(),
            last_checkpoint_peak_bytes: p.last_checkpoint,
            last_operation: p.last_op.map(|(op, _)| op.to_string()),
            last_operation_peak_bytes: p.last_op.map(|(_, n)| n),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct MountReport {
    pub state: MountState,
    pub mounted: bool,
    pub mount_point: String,
    pub cache: &'static str,
    /// FUSE passthrough negotiated with the kernel; null when not mounted.
    pub passthrough: Option<bool>,
    /// FUSE requests served since the mount; null when not mounted.
    pub fuse_requests: Option<u64>,
    /// Of `fuse_requests`, those no caller waited for (FORGET per inode, RELEASE,
    /// RELEASEDIR); null when not mounted.
    pub fuse_requests_unwaited: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct ServiceReport {
    pub name: String,
    pub main: bool,
    pub pid: Option<i32>,
    pub state: ServiceState,
    pub ready_probe: bool,
    pub restarts: u64,
    pub last_exit: Option<ExitReport>,
}

#[derive(Debug, Serialize)]
pub struct ExitReport {
    pub code: Option<i32>,
    pub signal: Option<String>,
    pub text: String,
}

#[derive(Debug, Serialize)]
pub struct PersistReport {
    pub dirty_bytes: Option<u64>,
    pub dirty_files: Option<u64>,
    pub last_checkpoint: Option<String>,
    pub last_checkpoint_unix: Option<f64>,
    pub remote_backlog_bytes: Option<u64>,
    pub remote_backlog_chunks: Option<u64>,
    /// Seconds since the last checkpoint committed.
    pub last_checkpoint_age_seconds: Option<f64>,
    pub backlog_inodes: Option<u64>,
    pub consecutive_failures: Option<u32>,
    pub last_error: Option<String>,
    pub lease: Option<LeaseReport>,
    /// Bytes the `file://` remote takes on disk, as of the last checkpoint or gc.
    pub remote_disk_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct LeaseReport {
    pub held: bool,
    pub state: String,
    pub holder: Option<String>,
    pub epoch: Option<u64>,
    pub expires: Option<String>,
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn svc(name: &str, state: ServiceState, probed: bool) -> ServiceStatus {
        ServiceStatus {
            name: name.into(),
            main: false,
            pid: Some(42),
            state,
            probed,
            restarts: 0,
            last_exit: None,
        }
    }

    #[test]
    fn health_waits_for_mount_supervisor_and_probed_services() {
        let h = StatusHandle::new(&Config::default());
        assert_eq!(
            h.health(),
            Err(NotReady("workspace not mounted yet".into()))
        );
        h.set_mount(MountState::Mounted);
        assert_eq!(h.health(), Err(NotReady("starting".into())));
        h.set_services(
            vec![
                svc("db", ServiceState::Starting, true),
                svc("log", ServiceState::Starting, false),
            ],
            None,
        );
        assert_eq!(h.health(), Err(NotReady("service db starting".into())));
        h.set_services(
            vec![
                svc("db", ServiceState::Ready, true),
                svc("log", ServiceState::Starting, false),
            ],
            None,
        );
        assert_eq!(h.health(), Ok(()));
        h.set_services(vec![svc("db", ServiceState::Restarting, true)], None);
        assert!(h.health().is_err());
        h.set_services(vec![], Some("received SIGTERM".into()));
        assert_eq!(h.health(), Err(NotReady("stopping".into())));
        // Stopping is sticky.
        h.set_services(vec![], None);
        assert_eq!(h.health(), Err(NotReady("stopping".into())));
    }

    #[test]
    fn disabled_or_plain_dir_workspace_counts_as_settled() {
        for m in [MountState::Disabled, MountState::Dir] {
            let h = StatusHandle::new(&Config::default());
            h.set_mount(m);
            h.set_services(vec![], None);
            assert_eq!(h.health(), Ok(()));
        }
        let h = StatusHandle::new(&Config::default());
        h.set_mount(MountState::Mounting);
        h.set_services(vec![], None);
        assert!(h.health().is_err());
    }

    #[test]
    fn persist_fields_are_null_until_published() {
        let h = StatusHandle::new(&Config::default());
        let v: serde_json::Value = serde_json::from_str(&h.status_json()).unwrap();
        for k in [
            "dirty_bytes",
            "dirty_files",
            "last_checkpoint",
            "remote_backlog_bytes",
            "lease",
            "remote_disk_bytes",
        ] {
            assert!(v["persist"][k].is_null(), "{k}: {v}");
        }
        let t = UNIX_EPOCH + Duration::from_millis(1_700_000_000_250);
        h.update_persist(|p| {
            p.dirty_bytes = Some(4096);
            p.remote_disk_bytes = Some(8192);
            p.last_checkpoint = Some(t);
            p.lease = Some(LeaseStatus {
                held: true,
                state: "held".into(),
                holder: Some("host-1".into()),
                epoch: Some(3),
                expires: None,
                error: None,
            });
        });
        let v: serde_json::Value = serde_json::from_str(&h.status_json()).unwrap();
        assert_eq!(v["persist"]["dirty_bytes"], 4096);
        assert_eq!(v["persist"]["remote_disk_bytes"], 8192);
        assert_eq!(v["persist"]["last_checkpoint"], "2023-11-14T22:13:20.250Z");
        assert_eq!(v["persist"]["last_checkpoint_unix"], 1_700_000_000.25);
        assert_eq!(v["persist"]["lease"]["holder"], "host-1");
        assert_eq!(v["persist"]["lease"]["state"], "held");
        assert_eq!(v["persist"]["lease"]["epoch"], 3);
        assert!(
            v["persist"]["last_checkpoint_age_seconds"]
                .as_f64()
                .unwrap()
                > 0.0
        );
        assert!(v["persist"]["dirty_files"].is_null());
    }

    #[test]
    fn checkpoint_uses_callback_and_never_overlaps() {
        let h = StatusHandle::new(&Config::default());
        match h.checkpoint() {
            CheckpointOutcome::Unavailable(why) => assert!(why.contains("not mounted"), "{why}"),
            o => panic!("{o:?}"),
        }
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = running.clone();
        h.set_checkpoint(Box::new(move || {
            assert_eq!(
                r.fetch_add(1, Ordering::SeqCst),
                0,
                "checkpoints overlapped"
            );
            std::thread::sleep(Duration::from_millis(30));
            r.fetch_sub(1, Ordering::SeqCst);
            Ok(CheckpointReport {
                done: "uploaded".into(),
                remote: true,
                ..Default::default()
            })
        }));
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let h = h.clone();
                std::thread::spawn(move || h.checkpoint())
            })
            .collect();
        for t in threads {
            match t.join().unwrap() {
                CheckpointOutcome::Done(r, _) => assert!(r.remote),
                o => panic!("{o:?}"),
            }
        }
        h.set_checkpoint(Box::new(|| panic!("boom")));
        assert!(matches!(h.checkpoint(), CheckpointOutcome::Failed(m) if m.contains("panicked")));
        // The lock a panicking callback poisoned does not wedge the next checkpoint.
        h.set_checkpoint(Box::new(|| Ok(CheckpointReport::default())));
        assert!(matches!(h.checkpoint(), CheckpointOutcome::Done(..)));
        h.set_stopping("received SIGTERM");
        assert!(matches!(h.checkpoint(), CheckpointOutcome::Unavailable(_)));
    }
}

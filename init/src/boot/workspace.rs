//! The workspace's start sequence, in the order it runs, and its stop: make the state dir
//! private → take its lock (`workspace::lock_state`) → take the remote's single-writer
//! lease → give an empty state dir the remote's latest snapshot → open the store
//! (`workspace::open_locked`) → wire a lazily restored state dir to the remote → mount
//! (`Opened::mount`) → start the prefetch → start the checkpoint service, handing it the
//! live workspace rollbacks change (`live::FuseLive`, `live::DirLive`). The lock comes before the lease: a keel restarted on the same state
//! dir takes its own lease back at once, trusting the lock. The stop keeps the reverse:
//! prefetch stopped → flush → final checkpoint → unmount → filesystem shut down → service
//! closed (the lease released) → lock released. `workspace` and `persist` know nothing of
//! each other; this module joins them for `keel run` and `keel mount`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::config::persist::{FsyncMode, ReplayMode};
use crate::config::Config;
use crate::persist::agent::{LiveTree, MainCommand};
use crate::persist::lease::{LeaseError, ReleaseOnDrop};
use crate::persist::restore::{self, RestoreError, RestoreMode};
use crate::persist::service::{FlushFn, ServiceError};
use crate::persist::{RemoteError, Service};
use crate::workspace::dir::DirTree;
use crate::workspace::fs::{ReplayReport, WorkspaceFs};
use crate::workspace::{Finisher, Mounted, SessionError, StateLock};

/// The step of the start sequence that failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Lock(SessionError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("restore from the remote: open {url}: {source}")]
    RestoreOpen { url: String, source: RemoteError },
    #[error("restore from the remote: {0}")]
    Restore(#[source] RestoreError),
    #[error(transparent)]
    Mount(SessionError),
    #[error("lazy restore: open the remote {url}: {source}")]
    LazyOpen { url: String, source: RemoteError },
    #[error("lazy restore: read the remote's manifest: {0}")]
    LazyManifest(#[source] crate::persist::repo::RepoError),
    #[error("start prefetch: {0}")]
    Prefetch(#[source] std::io::Error),
    #[error("checkpoints: {0}")]
    Checkpoints(#[source] ServiceError),
    #[error("dir workspace: {0}")]
    Dir(#[source] crate::workspace::dir::DirError),
    #[error("state dir {0}: a restore into it did not finish, and no remote is configured to finish it (start with the remote it came from, or empty the state dir)")]
    UnfinishedRestore(std::path::PathBuf),
}

impl StartError {
    /// The mount(2) itself failed (not the checks before it).
    pub fn mount_source(&self) -> Option<&std::io::Error> {
        match self {
            StartError::Mount(SessionError::Mount { source, .. }) => Some(source),
            _ => None,
        }
    }
}

/// The first half of the start sequence, done before `keel run` starts its control API and
/// supervisor: the state dir locked, the lease held (released on drop), an empty state dir
/// restored. [`Prepared::mount`] is the second half.
pub struct Prepared {
    lock: StateLock,
    lease: ReleaseOnDrop,
    /// The remote an empty state dir was just restored from (its manifest read): the
    /// lazy source reuses it, and its connections.
    restored_from: Option<crate::persist::Repo>,
}

/// Makes the state dir private, locks it, takes the lease and restores an empty state dir
/// from the remote (lazily by default), so a fresh state dir never starts empty and
/// checkpoints an empty tree over the workspace.
pub fn prepare(cfg: &Config) -> Result<Prepared, StartError> {
    prepare_for(cfg, false)
}

/// [`prepare`] for the provider chosen: the `dir` provider restores eagerly (its tree is
/// written whole before anything starts).
pub fn prepare_for(cfg: &Config, dir: bool) -> Result<Prepared, StartError> {
    // Private before anything is written there; a dir that cannot be made is reported by
    // the lock that needs it.
    if let Err(e) = crate::persist::secure_at_start(&cfg.workspace.state_dir, Some(&cfg.persist)) {
        tracing::warn!(state = %cfg.workspace.state_dir.display(), error = %e, "cannot make the state dir private");
    }
    crate::logging::step("start", "lock");
    let lock = crate::workspace::lock_state(&cfg.workspace).map_err(StartError::Lock)?;
    crate::state::remove_scratch(&cfg.workspace.state_dir);
    // The lease before anything reads or writes the remote; the lock is ours, so a lease
    // this state dir recorded is taken back at once.
    crate::logging::step("start", "lease");
    // A new host has nothing to serve without the remote: it waits for one that does not
    // answer, up to `[persist] start_wait`.
    let wait = StartWait::new(restore_wanted(cfg).then_some(cfg.persist.start_wait));
    let lease = ReleaseOnDrop::new(wait.retry("take the lease", |deadline| {
        let _d = crate::persist::retry::deadline_scope(deadline);
        crate::persist::acquire_lease_at_start(&cfg.workspace.state_dir, &cfg.persist)
            .map_err(StartError::from)
    })?);
    crate::logging::step("start", "restore");
    let mut restored_from = None;
    let restored = wait.retry("restore", |_| {
        let log = crate::progress::Logged::new("restore", crate::persist::service::LOG_EVERY);
        crate::progress::scope(log, || restore_on_start(cfg, dir))
    })?;
    if let Some((what, repo)) = restored {
        tracing::info!("{what}");
        restored_from = Some(repo);
    }
    // The lock accepts a state dir an unfinished restore left; one that no restore took
    // over now must not become an empty workspace.
    unfinished_restore_left(&cfg.workspace.state_dir)?;
    Ok(Prepared {
        lock,
        lease,
        restored_from,
    })
}

impl StartError {
    /// The remote could not be reached or did not answer in time (a later try may work).
    fn is_temporary(&self) -> bool {
        match self {
            StartError::Lease(e) => e.is_temporary(),
            StartError::RestoreOpen { source, .. } => source.is_temporary(),
            StartError::Restore(e) => e.is_temporary(),
            _ => false,
        }
    }
}

/// How long a new host's start keeps trying a remote that does not answer.
struct StartWait {
    /// `None`: a failure is final (a state dir that holds a workspace, or `start_wait = 0s`).
    deadline: Option<std::time::Instant>,
    total: std::time::Duration,
}

/// The pause between two tries of a start step while the remote does not answer.
const START_WAIT_PAUSE: std::time::Duration = std::time::Duration::from_secs(3);

impl StartWait {
    fn new(wait: Option<std::time::Duration>) -> Self {
        let total = wait.unwrap_or_default();
        StartWait {
            deadline: (!total.is_zero()).then(|| std::time::Instant::now() + total),
            total,
        }
    }

    /// Runs `step` (given the deadline its remote requests must keep), again after a pause
    /// while it fails because the remote does not answer, until the deadline or a stop
    /// signal; says each time what it waits for.
    fn retry<T>(
        &self,
        what: &str,
        mut step: impl FnMut(Option<std::time::Instant>) -> Result<T, StartError>,
    ) -> Result<T, StartError> {
        loop {
            let e = match step(self.deadline) {
                Err(e) if e.is_temporary() => e,
                r => return r,
            };
            let Some(deadline) = self.deadline else {
                return Err(e);
            };
            let now = std::time::Instant::now();
            if now >= deadline || crate::sys::signal::stop_pending() {
                return Err(e);
            }
            let left = deadline - now;
            tracing::warn!(
                "{what}: the remote does not answer ({e}); a new host has no workspace without it: trying again in {}s ({}s left of [persist] start_wait = {}s)",
                START_WAIT_PAUSE.min(left).as_secs(),
                left.as_secs(),
                self.total.as_secs()
            );
            let until = now + START_WAIT_PAUSE.min(left);
            while std::time::Instant::now() < until {
                if crate::sys::signal::stop_pending() {
                    return Err(e);
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// A restore's marker without a database after the start's restore step: no remote
/// finished it (none is configured), so starting would make an empty workspace over it.
fn unfinished_restore_left(state: &std::path::Path) -> Result<(), StartError> {
    if crate::state::restore_unfinished(state) {
        return Err(StartError::UnfinishedRestore(state.to_path_buf()));
    }
    Ok(())
}

/// A remote is configured and the state dir has no workspace yet: `restore_on_start` asks
/// the remote for a snapshot.
pub fn restore_wanted(cfg: &Config) -> bool {
    !cfg.persist.remote.is_empty()
        && cfg.persist.remote_url(&cfg.workspace.state_dir).is_some()
        && !crate::state::has_workspace(&cfg.workspace.state_dir)
}

/// With an empty (locked) state dir and a configured remote that holds a snapshot,
/// restores the remote's head: a fresh container with no state volume gets its workspace
/// back. `Ok(None)`: nothing to do (state present, default remote, or an empty remote);
/// else what was restored, and the remote it came from.
fn restore_on_start(
    cfg: &Config,
    dir: bool,
) -> Result<Option<(String, crate::persist::Repo)>, StartError> {
    let state = &cfg.workspace.state_dir;
    if !restore_wanted(cfg) {
        return Ok(None);
    }
    let Some(url) = cfg.persist.remote_url(state) else {
        return Ok(None);
    };
    let mut repo = crate::persist::open_remote(&url, &cfg.persist)
        .map_err(|source| StartError::RestoreOpen { url, source })?;
    let mode = match cfg.persist.restore {
        _ if dir => RestoreMode::Eager,
        crate::config::persist::RestoreMode::Eager => RestoreMode::Eager,
        crate::config::persist::RestoreMode::Lazy => RestoreMode::Lazy,
    };
    match restore::restore_for_mount(&mut repo, state, mode, cfg.workspace.chunk_size) {
        Ok(r) => Ok(Some((format!(
            "restored snapshot {} from {} ({}): {} files, {} bytes, {} chunks fetched, {} windows left to fetch on first use, in {:.2}s ({})",
            r.seq,
            repo.describe(),
            if r.lazy { "lazy" } else { "eager" },
            r.files,
            r.file_bytes,
            r.chunks_fetched,
            r.windows_missing,
            r.elapsed_s,
            r.phases
                .iter()
                .map(|(p, s)| format!("{p} {s:.2}s"))
                .collect::<Vec<_>>()
                .join(", ")
        ), repo))),
        Err(RestoreError::NoSnapshot(_)) => Ok(None),
        Err(e) => Err(StartError::Restore(e)),
    }
}

/// The prefetch thread and its stop flag.
type Prefetch = (Arc<AtomicBool>, std::thread::JoinHandle<()>);

fn stop_prefetch(p: Option<Prefetch>) {
    if let Some((stop, t)) = p {
        stop.store(true, Ordering::Relaxed);
        let _ = t.join();
    }
}

/// A mounted workspace with what `persist` adds to it. Dropping it unmounts too, but only
/// [`Workspace::unmount`] takes the final checkpoint and reports errors.
pub struct Workspace {
    /// `None` only once unmounted or dropped, or with the `dir` provider.
    mounted: Option<Mounted>,
    /// The `dir` provider's tree (and the state dir's lock, held until the stop).
    dir: Option<(Arc<DirTree>, Option<StateLock>)>,
    mount_point: std::path::PathBuf,
    /// The checkpoint service, when checkpoints are on.
    persist: Option<Service>,
    /// Background fetch of lazily restored windows.
    prefetch: Option<Prefetch>,
}

impl Prepared {
    /// Opens the locked state dir, wires the remote in as the source of windows not fetched
    /// yet, mounts it, then starts the prefetch and the checkpoint service (with the lease,
    /// `main`, `keel run`'s main command for `rollback --restart`, and the mounted
    /// filesystem for rollbacks).
    pub fn mount(
        mut self,
        cfg: &Config,
        main: Option<Arc<dyn MainCommand>>,
    ) -> Result<Workspace, StartError> {
        crate::logging::step("start", "mount");
        tracing::info!("memory budget: {}", crate::budget::get());
        let opened =
            crate::workspace::open_locked(&cfg.workspace, self.lock).map_err(StartError::Mount)?;
        // The remote is the source of windows not fetched yet before the first request can
        // arrive: a read in between would find no source and fail (EIO, or SIGBUS through
        // a mapping).
        let lazy = wire_lazy(cfg, opened.fs(), self.restored_from.take())?;
        let fs = opened.fs().clone();
        fs.set_read_set_max(cfg.persist.read_set);
        // The windows the last session read, fetched first: before the mount, or beside
        // whatever runs once it is up.
        let found = match &lazy {
            Some(repo) if cfg.persist.replay != ReplayMode::Off => {
                let set = crate::persist::readset::download(repo, cfg.workspace.chunk_size);
                tracing::info!(windows = set.len(), "read set of the last session");
                Some(set)
            }
            _ => None,
        };
        if let (Some(set), ReplayMode::Before) = (&found, cfg.persist.replay) {
            let r = fs.replay(set, cfg.persist.concurrency, &AtomicBool::new(false));
            log_replay(&r, "before the mount");
        }
        let mounted = opened.mount(&cfg.workspace).map_err(StartError::Mount)?;
        let mut ws = Workspace {
            mount_point: mounted.mount_point().to_path_buf(),
            mounted: Some(mounted),
            dir: None,
            persist: None,
            prefetch: None,
        };
        crate::logging::step("start", "lazy_source");
        let inval = ws.mounted().and_then(|m| m.invalidator());
        if lazy.is_some() {
            let beside = found
                .clone()
                .filter(|_| cfg.persist.replay == ReplayMode::Beside);
            ws.prefetch = start_background(cfg, &fs, beside)?;
        }
        crate::logging::step("start", "checkpoints");
        // Rollbacks change the filesystem and tell the kernel what it must forget: without
        // the kernel's notifier there is no safe rollback, and none is offered.
        let live = inval.map(|inval| {
            Box::new(super::live::FuseLive {
                fs: fs.clone(),
                inval,
            }) as Box<dyn LiveTree>
        });
        ws.persist = start_persist(cfg, &fs, self.lease.take(), main, live)?;
        if let Some(svc) = &ws.persist {
            let fs2 = fs.clone();
            svc.set_read_set(Box::new(move || fs2.read_set()), found);
        }
        crate::logging::step("start", "ready");
        Ok(ws)
    }
}

impl Prepared {
    /// The `dir` provider's start: the tree (built from the store when a restore or a FUSE
    /// provider wrote it), the mount point a symlink to it, the checkpoint service walking
    /// it before each checkpoint, rollbacks building the target tree beside it. `why`: the
    /// reason the provider was chosen, said in one line with what is and is not protected.
    pub fn open_dir(
        mut self,
        cfg: &Config,
        main: Option<Arc<dyn MainCommand>>,
        why: &str,
    ) -> Result<Workspace, StartError> {
        crate::logging::step("start", "tree");
        let ws = &cfg.workspace;
        crate::meta::set_cache_ceiling(ws.meta_cache.unwrap_or(crate::budget::shares().fs_cache));
        let tree = Arc::new(
            DirTree::open(&ws.state_dir, ws.inline_max, ws.chunk_size).map_err(StartError::Dir)?,
        );
        // The sandbox's user reaches the tree through the state dir: search only (0711),
        // nothing listed, everything else in it 0700/0600.
        if let Err(e) = crate::state::secure(&ws.state_dir).and_then(|()| {
            use std::os::unix::fs::PermissionsExt;
            if !crate::state::private::may_chmod(&std::fs::metadata(&ws.state_dir)?) {
                return Ok(()); // not keel's user's to change (see `may_chmod`)
            }
            std::fs::set_permissions(&ws.state_dir, std::fs::Permissions::from_mode(0o711))
        }) {
            tracing::warn!(state = %ws.state_dir.display(), error = %e, "cannot make the state dir private (0711)");
        }
        crate::workspace::dir::link_mount_point(&ws.mount_point, tree.root())
            .map_err(StartError::Dir)?;
        tracing::info!(
            "workspace: provider dir ({why}): {} -> {}; {}",
            ws.mount_point.display(),
            tree.root().display(),
            dir_protection(cfg)
        );
        crate::logging::step("start", "checkpoints");
        let t2 = tree.clone();
        let flush: FlushFn = Box::new(move || {
            let r = t2.scan()?;
            tracing::debug!(%r, "walk before the checkpoint");
            Ok(())
        });
        let persist = Service::start_with(
            ws,
            &cfg.persist,
            flush,
            self.lease.take(),
            main,
            Some(tree.opener()),
            Some(Box::new(super::live::DirLive(tree.clone()))),
        )
        .map_err(StartError::Checkpoints)?;
        if let Some(svc) = &persist {
            // Periodic checkpoints walk what change notification names (when it covers the
            // tree); every other checkpoint walks the whole tree (the flush above).
            match tree.watch() {
                Ok(()) => {
                    let t3 = tree.clone();
                    svc.set_periodic_flush(Box::new(move || {
                        let r = t3.scan_changed()?;
                        tracing::debug!(%r, "walk before the periodic checkpoint");
                        Ok(())
                    }));
                }
                Err(e) => {
                    tracing::info!(error = %e, "no change notification: every checkpoint walks the whole tree")
                }
            }
        }
        crate::logging::step("start", "ready");
        Ok(Workspace {
            mounted: None,
            dir: Some((tree, Some(self.lock))),
            mount_point: ws.mount_point.clone(),
            persist,
            prefetch: None,
        })
    }
}

/// The line a `dir` start says about what is and is not protected.
fn dir_protection(cfg: &Config) -> String {
    let user = cfg.init.user.as_deref();
    let root_sandbox = user.is_none_or(|u| u == "root" || u == "0");
    let keel_root = crate::sys::beneath::euid() == 0;
    let state = cfg.workspace.state_dir.display();
    if !keel_root {
        format!("NOT PROTECTED: keel runs as uid {} and everything it starts shares that user, so the sandbox can read and change {state} (the store, the lock) and a local remote", crate::sys::beneath::euid())
    } else if root_sandbox {
        format!("NOT PROTECTED: the main command runs as root, which can read and change {state} (the store) and a local remote without CAP_SYS_ADMIN to hide them; set [init] user to a non-root user so that modes 0700/0600 keep them from it")
    } else {
        format!("protected from user {}: {state} (0711: searchable, not listable; the store and everything else 0700/0600), a local remote and the credentials file by their modes, and capabilities are dropped; NOT protected: nothing hides them from root in the container (no CAP_SYS_ADMIN for a mount namespace)", user.unwrap_or("?"))
    }
}

fn log_replay(r: &ReplayReport, when: &str) {
    tracing::info!(
        windows = r.windows,
        skipped = r.skipped,
        failed = r.failed,
        seconds = r.elapsed.as_secs_f64(),
        "replayed the last session's read set {when}"
    );
}

/// A lazily restored state dir: wires the remote in as the source of windows not fetched
/// yet (before the mount): `restored_from` when the restore just read it, else the
/// configured remote. The remote, when it did.
fn wire_lazy(
    cfg: &Config,
    fs: &Arc<WorkspaceFs>,
    restored_from: Option<crate::persist::Repo>,
) -> Result<Option<crate::persist::Repo>, StartError> {
    if !fs.lazy_active() {
        return Ok(None);
    }
    let p = &cfg.persist;
    let Some(url) = p.remote_url(&cfg.workspace.state_dir) else {
        tracing::warn!("this state dir was restored lazily but [persist] remote = \"none\": reads of data not fetched yet fail with EIO");
        return Ok(None);
    };
    let repo = match restored_from {
        Some(repo) => repo,
        None => {
            let mut repo = crate::persist::open_remote(&url, p)
                .map_err(|source| StartError::LazyOpen { url, source })?;
            // Where the chunks live (a fork's manifest may point elsewhere).
            repo.manifest().map_err(StartError::LazyManifest)?;
            repo
        }
    };
    fs.set_chunk_source(Arc::new(crate::persist::hydrate::RemoteChunks::new(
        repo.clone(),
    )));
    // The pack indexes load beside the rest of the start, not in front of the first read.
    drop(repo.load_packs_ahead());
    // As many requests wait for the remote at once as it serves in parallel.
    fs.set_fetch_threads(p.concurrency);
    Ok(Some(repo))
}

/// In the background: the replay of `read_set` (when it runs beside), then, with
/// `[persist] prefetch`, every window not fetched yet.
fn start_background(
    cfg: &Config,
    fs: &Arc<WorkspaceFs>,
    read_set: Option<Vec<(u64, u64)>>,
) -> Result<Option<Prefetch>, StartError> {
    let p = &cfg.persist;
    if !p.prefetch && read_set.as_ref().is_none_or(|s| s.is_empty()) {
        return Ok(None);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (fs2, stop2, parallel, prefetch) = (fs.clone(), stop.clone(), p.concurrency, p.prefetch);
    let t = std::thread::Builder::new()
        .name("keel-prefetch".into())
        .spawn(move || {
            if let Some(set) = read_set.filter(|s| !s.is_empty()) {
                let r = fs2.replay(&set, parallel, &stop2);
                log_replay(&r, "beside the workload");
            }
            if prefetch && !stop2.load(Ordering::Relaxed) {
                fs2.prefetch_all(&stop2, parallel);
            }
        })
        .map_err(StartError::Prefetch)?;
    Ok(Some((stop, t)))
}

/// Starts the checkpoint service; its flush makes every acknowledged write visible in the
/// store before a checkpoint claims the changes.
fn start_persist(
    cfg: &Config,
    fs: &Arc<WorkspaceFs>,
    lease: Option<crate::persist::lease::Lease>,
    main: Option<Arc<dyn MainCommand>>,
    live: Option<Box<dyn LiveTree>>,
) -> Result<Option<Service>, StartError> {
    let fs2 = fs.clone();
    // Never touch the mount point from inside the daemon here (no syncfs of the mount): a
    // thread blocked on its own mount keeps a killed keel from ever exiting. Pages still in
    // the kernel's writeback cache reach the store at their writeback, `keel checkpoint`
    // syncs the mount from its own process first, and the final checkpoint follows
    // `Mounted::flush`.
    let flush: FlushFn = Box::new(move || fs2.sync_all().map_err(Into::into));
    let service = Service::start_with(&cfg.workspace, &cfg.persist, flush, lease, main, None, live)
        .map_err(StartError::Checkpoints)?;
    if let Some(svc) = &service {
        if cfg.persist.fsync == FsyncMode::Remote {
            let h = svc.handle();
            fs.set_fsync_hook(Box::new(move || {
                h.checkpoint_now().map(|_| ()).map_err(Into::into)
            }));
        }
    }
    Ok(service)
}

/// The whole start sequence at once (`keel mount`, which has no main command).
pub fn start(cfg: &Config) -> Result<Workspace, StartError> {
    prepare(cfg)?.mount(cfg, None)
}

impl Workspace {
    /// The mounted FUSE filesystem (`None` with the `dir` provider).
    pub fn mounted(&self) -> Option<&Mounted> {
        self.mounted.as_ref()
    }

    /// Where the workspace is (a FUSE mount, or the symlink to the `dir` tree).
    pub fn mount_point(&self) -> &std::path::Path {
        &self.mount_point
    }

    /// The `dir` provider's tree.
    pub fn dir_tree(&self) -> Option<&Arc<DirTree>> {
        self.dir.as_ref().map(|(t, _)| t)
    }

    /// Makes everything written so far visible to the final checkpoint: the FUSE mount's
    /// flush, or a walk of the `dir` tree.
    pub fn flush(&self) -> Result<(), SessionError> {
        match (&self.mounted, &self.dir) {
            (Some(m), _) => m.flush(),
            (None, Some((t, _))) => {
                let r = t
                    .scan()
                    .map(|r| tracing::info!(%r, "final walk"))
                    .map_err(|e| SessionError::Flush(e.into()));
                t.make_room_if_full();
                r
            }
            (None, None) => Ok(()),
        }
    }

    /// The checkpoint service, when checkpoints are on.
    pub fn persist(&self) -> Option<&Service> {
        self.persist.as_ref()
    }

    /// The checkpoint service, e.g. to set the final checkpoint's budget.
    pub fn persist_mut(&mut self) -> Option<&mut Service> {
        self.persist.as_mut()
    }

    /// Stops the prefetch, flushes, takes the final checkpoint (within `[persist]
    /// flush_timeout`), unmounts, shuts the filesystem down and closes the service (see
    /// `Mounted::unmount`).
    pub fn unmount(mut self) -> Result<(), SessionError> {
        stop_prefetch(self.prefetch.take());
        let fin = self
            .persist
            .take()
            .map(|s| Box::new(s) as Box<dyn Finisher>);
        if let Some((_, lock)) = self.dir.as_mut() {
            // The tree stays; the final checkpoint follows the caller's walk (`flush`).
            let lock = lock.take();
            let r = match fin {
                Some(mut f) => {
                    let r = f.finish();
                    f.close(r.is_ok());
                    r
                }
                None => Ok(()),
            };
            drop(lock);
            // As under FUSE: the remote is behind, the state dir holds everything.
            return r.map_err(SessionError::Finish);
        }
        let m = self.mounted.take().expect("mounted until unmount");
        m.unmount(fin)
    }
}

impl Drop for Workspace {
    /// Like the unmount without a final checkpoint; the service stops before the state
    /// dir's lock is released.
    fn drop(&mut self) {
        stop_prefetch(self.prefetch.take());
        if let Some((_, lock)) = self.dir.as_mut() {
            let lock = lock.take();
            drop(self.persist.take());
            drop(lock);
            return;
        }
        if let Some(m) = self.mounted.take() {
            let lock = m.release_lock();
            drop(self.persist.take());
            drop(lock);
        }
    }
}

/// The checkpoint service stops with the mount: its final checkpoint on the flushed
/// filesystem, then (after the unmount) the worker, the control socket and the lease.
impl Finisher for Service {
    fn finish(&mut self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let r = Service::finish(self)?;
        tracing::info!(report = %r, "final checkpoint");
        Ok(())
    }

    fn close(self: Box<Self>, clean: bool) {
        Service::close(*self, clean)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unfinished_restore_nobody_took_over_stops_the_start() {
        let d = tempfile::tempdir().unwrap();
        unfinished_restore_left(d.path()).unwrap();
        std::fs::write(d.path().join(crate::state::RESTORE_UNFINISHED), b"").unwrap();
        let e = unfinished_restore_left(d.path()).unwrap_err().to_string();
        assert!(e.contains("did not finish"), "{e}");
        std::fs::write(d.path().join(crate::state::META_DB), b"").unwrap();
        unfinished_restore_left(d.path()).unwrap();
    }
}

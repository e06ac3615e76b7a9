//! Mounting and unmounting the workspace: locks the state dir, opens the store, mounts a
//! `/dev/fuse` connection with mount(2), serves it through fuser (`Session::from_fd`, its
//! worker threads each on a cloned fd), and on shutdown syncs and unmounts.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::config::{CacheMode, Passthrough, PersistConfig, WorkspaceConfig};
use crate::persist::lease::ReleaseOnDrop;
use crate::sys;
use crate::sys::eventfd::EventFd;

use super::fs::{FsOptions, WorkspaceFs};
use super::fuse::{FuseAdapter, KernelFeatures, RequestCounters, Timeouts};

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("state dir {path}: already in use by another keel (lock {lock} is held)")]
    StateLocked { path: PathBuf, lock: PathBuf },
    #[error("state dir {path}: {reason}")]
    OpenState { path: PathBuf, reason: String },
    #[error("mount point {path}: {reason}")]
    MountPoint { path: PathBuf, reason: String },
    #[error("mount {path}: {source}")]
    Mount { path: PathBuf, source: io::Error },
    #[error("flush: {0}")]
    Flush(String),
    #[error("unmount {path}: {source}")]
    Unmount { path: PathBuf, source: io::Error },
    #[error("checkpoints: {0}")]
    Persist(String),
    #[error("{0}")]
    Lease(crate::persist::lease::LeaseError),
}

/// A mounted workspace. Dropping it unmounts too, but only `unmount` reports errors.
pub struct Mounted {
    mount_point: PathBuf,
    fs: Arc<WorkspaceFs>,
    session: Option<FuseSession>,
    passthrough: Arc<AtomicBool>,
    requests: Arc<RequestCounters>,
    persist: Option<crate::persist::Service>,
    /// Background fetch of lazily restored windows.
    prefetch: Option<Prefetch>,
    _lock: sys::file::LockFile,
}

/// A cloneable handle on a mounted workspace for other threads (the control API's
/// `POST /checkpoint`, `/status`): it can flush and read the passthrough flag, never unmount.
/// After the unmount a flush through it only syncs the (still open) store.
#[derive(Clone)]
pub struct MountedHandle {
    mount_point: PathBuf,
    fs: Arc<WorkspaceFs>,
    passthrough: Arc<AtomicBool>,
    requests: Arc<RequestCounters>,
}

impl MountedHandle {
    pub fn mount_point(&self) -> &Path {
        &self.mount_point
    }

    /// Same as [`Mounted::flush`].
    pub fn flush(&self) -> Result<(), SessionError> {
        flush(&self.mount_point, &self.fs)
    }

    /// FUSE passthrough was negotiated with the kernel.
    pub fn passthrough(&self) -> bool {
        self.passthrough.load(Ordering::Relaxed)
    }

    /// FUSE requests served so far on this mount.
    pub fn fuse_requests(&self) -> u64 {
        self.requests.all()
    }

    /// Of those, the ones no caller waited for (FORGET per inode, RELEASE, RELEASEDIR; see
    /// `RequestCounters`).
    pub fn fuse_requests_unwaited(&self) -> u64 {
        self.requests.unwaited()
    }
}

fn flush(mount_point: &Path, fs: &WorkspaceFs) -> Result<(), SessionError> {
    if let Err(e) = sys::file::syncfs(mount_point) {
        tracing::warn!(error = %e, "syncfs of the mount failed; syncing the store anyway");
    }
    fs.sync_all()
        .map_err(|e| SessionError::Flush(e.to_string()))
}

/// Names that may sit in a state dir that keel has not initialised yet.
const HARMLESS: &[&str] = &[
    "lost+found",
    "lock",
    ".keep",
    "reserve",
    "reserve.boot",
    "control.sock",
    crate::persist::LEASE_HOLDER_FILE,
];

fn check_state_dir(dir: &Path) -> Result<(), SessionError> {
    let bad = |reason: String| SessionError::OpenState {
        path: dir.to_path_buf(),
        reason,
    };
    crate::persist::secure_state_dir(dir).map_err(|e| bad(format!("cannot create: {e}")))?;
    if !dir.join("meta.db").exists() {
        let entries = std::fs::read_dir(dir).map_err(|e| bad(format!("cannot read: {e}")))?;
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if !HARMLESS.contains(&name.as_ref()) && name != "bodies" {
                return Err(bad(format!(
                    "not a keel state dir (it holds `{name}` but no meta.db); refusing to touch it"
                )));
            }
        }
    }
    Ok(())
}

/// At most this many dead keel mounts stacked on one mount point are cleared.
const MAX_DEAD_MOUNTS: usize = 8;

fn prepare_mount_point(p: &Path) -> Result<(), SessionError> {
    let bad = |reason: String| SessionError::MountPoint {
        path: p.to_path_buf(),
        reason,
    };
    // keel holds the state dir's lock, so a keel FUSE mount at its mount point is a dead
    // keel's. Its connection may still be alive with nobody reading it: then any stat of the
    // path waits forever. So, before anything touches the path: abort the connection
    // (found in /proc/self/mountinfo, not by a stat) and detach the mount.
    for _ in 0..MAX_DEAD_MOUNTS {
        let Some(dead) = sys::mount::fuse_connection_at(p).filter(|m| m.source == "keel") else {
            break;
        };
        if let Err(e) = sys::mount::abort_fuse_connection(dead.minor) {
            tracing::warn!(connection = dead.minor, error = %e, "cannot abort the dead keel's FUSE connection; detaching it anyway");
        }
        sys::file::detach_mount(p).map_err(|e| bad(format!("stale mount: {e}")))?;
        tracing::warn!(path = %p.display(), connection = dead.minor, "aborted and detached the FUSE mount a dead keel left behind");
    }
    // stat may be answered from the kernel's attribute cache even when the daemon behind a
    // FUSE mount is dead; statfs always asks the daemon.
    if let Err(e) = sys::file::statvfs(p) {
        if e.raw_os_error() == Some(libc::ENOTCONN) {
            sys::file::detach_mount(p).map_err(|e| bad(format!("stale mount: {e}")))?;
            tracing::warn!(path = %p.display(), "cleared the dead mount a killed keel left behind");
        }
    }
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(bad("exists and is not a directory".into())),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            // A FUSE daemon died here earlier; clear its dead mount.
            sys::file::detach_mount(p).map_err(|e| bad(format!("stale mount: {e}")))?;
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(p).map_err(|e| bad(format!("cannot create: {e}")))
        }
        Err(e) => Err(bad(e.to_string())),
    }
}

/// Mounts the workspace described by `cfg` and returns once the kernel has accepted it.
/// No checkpoints (see `mount_persistent`).
pub fn mount(cfg: &WorkspaceConfig) -> Result<Mounted, SessionError> {
    mount_with(cfg, None)
}

/// Mounts the workspace and starts checkpoints to the `[persist]` remote: periodic, on
/// request over `<state>/control.sock`, and a final one in `unmount`. Takes the remote's
/// single-writer lease first (when on): a refused lease fails here with nothing mounted.
pub fn mount_persistent(
    cfg: &WorkspaceConfig,
    persist: &PersistConfig,
) -> Result<Mounted, SessionError> {
    mount_with(cfg, Some((persist, None)))
}

/// `mount_persistent` with a lease the caller already took (`keel run` takes it before
/// restoring from the remote); `None` when the lease is off.
pub fn mount_persistent_leased(
    cfg: &WorkspaceConfig,
    persist: &PersistConfig,
    lease: Option<crate::persist::lease::Lease>,
) -> Result<Mounted, SessionError> {
    mount_with(cfg, Some((persist, Some(lease))))
}

type PersistPlan<'a> = (
    &'a PersistConfig,
    Option<Option<crate::persist::lease::Lease>>,
);

fn mount_with(
    cfg: &WorkspaceConfig,
    persist: Option<PersistPlan<'_>>,
) -> Result<Mounted, SessionError> {
    let state = &cfg.state_dir;
    check_state_dir(state)?;
    let lock_path = state.join("lock");
    let lock = sys::file::try_lock(&lock_path)
        .map_err(|e| SessionError::OpenState {
            path: state.clone(),
            reason: format!("lock {}: {e}", lock_path.display()),
        })?
        .ok_or_else(|| SessionError::StateLocked {
            path: state.clone(),
            lock: lock_path.clone(),
        })?;
    // The lease before anything is mounted: a second writer stops here.
    let persist = match persist {
        Some((p, Some(lease))) => Some((p, ReleaseOnDrop::new(lease))),
        Some((p, None)) => Some((
            p,
            ReleaseOnDrop::new(
                crate::persist::acquire_lease(state, p, true).map_err(SessionError::Lease)?,
            ),
        )),
        None => None,
    };
    let passthrough_on = Arc::new(AtomicBool::new(false));
    crate::meta::set_cache_ceiling(cfg.meta_cache);
    let fs = WorkspaceFs::new(
        state,
        FsOptions {
            cache: cfg.cache,
            inline_max: cfg.inline_max,
            chunk_size: cfg.chunk_size,
            passthrough: passthrough_on.clone(),
        },
    )
    .map_err(|e| SessionError::OpenState {
        path: state.clone(),
        reason: e.to_string(),
    })?;
    let fs = Arc::new(fs);
    prepare_mount_point(&cfg.mount_point)?;

    let mount_err = |source: io::Error| SessionError::Mount {
        path: cfg.mount_point.clone(),
        source,
    };
    let adapter = FuseAdapter::new(
        fs.clone(),
        Timeouts {
            attr: cfg.attr_timeout,
            entry: cfg.entry_timeout,
            negative: cfg.negative_timeout,
        },
        KernelFeatures {
            writeback_cache: cfg.writeback_cache && cfg.cache != CacheMode::None,
            passthrough: match cfg.passthrough {
                Passthrough::Off => None,
                Passthrough::Auto => Some(false),
                Passthrough::On => Some(true),
            },
            passthrough_on: passthrough_on.clone(),
        },
    );
    let requests = adapter.requests();
    let session = FuseSession::start(adapter, &cfg.mount_point, cfg.effective_threads())
        .map_err(mount_err)?;
    let notifier = session.notifier.clone();
    tracing::info!(
        mount_point = %cfg.mount_point.display(),
        state = %state.display(),
        cache = cfg.cache.as_str(),
        threads = cfg.effective_threads(),
        passthrough = passthrough_on.load(Ordering::Relaxed),
        "workspace mounted"
    );
    let mut mounted = Mounted {
        mount_point: cfg.mount_point.clone(),
        fs,
        session: Some(session),
        passthrough: passthrough_on,
        requests,
        persist: None,
        prefetch: None,
        _lock: lock,
    };
    if let Some((p, mut lease)) = persist {
        mounted.prefetch = start_lazy(cfg, p, &mounted.fs)?;
        mounted.persist = start_persist(cfg, p, &mounted, lease.take())?;
        if let (Some(svc), Some(n)) = (&mounted.persist, notifier) {
            svc.set_rollback(super::live::rollback_fn(
                mounted.fs.clone(),
                invalidate_through(n),
            ));
        }
    } else if mounted.fs.lazy_active() {
        tracing::warn!("this state dir was restored lazily but no remote is configured: reads of data not fetched yet fail with EIO");
    }
    Ok(mounted)
}

/// A lazily restored state dir: wires the remote in as the source of windows not fetched
/// yet, and with `[persist] prefetch` starts fetching all of them in the background.
fn start_lazy(
    cfg: &WorkspaceConfig,
    p: &PersistConfig,
    fs: &Arc<WorkspaceFs>,
) -> Result<Option<Prefetch>, SessionError> {
    if !fs.lazy_active() {
        return Ok(None);
    }
    let Some(url) = p.remote_url(&cfg.state_dir) else {
        tracing::warn!("this state dir was restored lazily but [persist] remote = \"none\": reads of data not fetched yet fail with EIO");
        return Ok(None);
    };
    let mut repo = crate::persist::open_remote(&url, p)
        .map_err(|e| SessionError::Persist(format!("open remote for lazy restore: {e}")))?;
    // Where the chunks live (a fork's manifest may point elsewhere).
    repo.manifest()
        .map_err(|e| SessionError::Persist(format!("read remote manifest: {e}")))?;
    fs.set_chunk_source(Arc::new(crate::persist::hydrate::RemoteChunks::new(repo)));
    if !p.prefetch {
        return Ok(None);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (fs2, stop2, batch) = (fs.clone(), stop.clone(), p.concurrency);
    let t = std::thread::Builder::new()
        .name("keel-prefetch".into())
        .spawn(move || {
            fs2.prefetch_all(&stop2, batch);
        })
        .map_err(|e| SessionError::Persist(format!("start prefetch: {e}")))?;
    Ok(Some((stop, t)))
}

/// Invalidations for a rollback, through the session's notifier (the kernel answers
/// ENOENT for an inode or name it does not cache: not an error here).
fn invalidate_through(n: fuser::Notifier) -> super::live::Invalidate {
    use std::os::unix::ffi::OsStrExt;
    Arc::new(move |i: &super::fs::Inval| {
        let r = match i {
            super::fs::Inval::Inode(ino) => n.inval_inode(fuser::INodeNo(ino.0), 0, 0),
            super::fs::Inval::Entry(parent, name) => {
                n.inval_entry(fuser::INodeNo(parent.0), std::ffi::OsStr::from_bytes(name))
            }
        };
        match r {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    })
}

/// The prefetch thread and its stop flag.
type Prefetch = (Arc<AtomicBool>, std::thread::JoinHandle<()>);

fn stop_prefetch(p: Option<Prefetch>) {
    if let Some((stop, t)) = p {
        stop.store(true, Ordering::Relaxed);
        let _ = t.join();
    }
}

/// Starts the checkpoint service; its flush makes every acknowledged write visible in the
/// store before a checkpoint claims the changes.
fn start_persist(
    cfg: &WorkspaceConfig,
    p: &PersistConfig,
    m: &Mounted,
    lease: Option<crate::persist::lease::Lease>,
) -> Result<Option<crate::persist::Service>, SessionError> {
    let fs = m.fs.clone();
    // Never touch the mount point from inside the daemon here (no syncfs of the mount): a
    // thread blocked on its own mount keeps a killed keel from ever exiting. Pages still in
    // the kernel's writeback cache reach the store at their writeback, `keel checkpoint`
    // syncs the mount from its own process first, and the final checkpoint follows
    // `Mounted::flush`.
    let flush: crate::persist::service::FlushFn =
        Box::new(move || fs.sync_all().map_err(|e| e.to_string()));
    let service = crate::persist::Service::start(cfg, p, flush, lease)
        .map_err(|e| SessionError::Persist(e.to_string()))?;
    if let Some(svc) = &service {
        if p.fsync == crate::config::persist::FsyncMode::Remote {
            let h = svc.handle();
            m.fs.set_fsync_hook(Box::new(move || h.checkpoint_now().map(|_| ())));
        }
    }
    Ok(service)
}

impl Mounted {
    pub fn mount_point(&self) -> &Path {
        &self.mount_point
    }

    /// Makes every file whose close returned durable in the local store: asks the kernel to
    /// write back its dirty pages, then syncs bodies and metadata.
    pub fn flush(&self) -> Result<(), SessionError> {
        flush(&self.mount_point, &self.fs)
    }

    /// Set when the kernel ended the connection: unmounted from outside, or aborted.
    pub fn ended(&self) -> Arc<Ended> {
        self.session
            .as_ref()
            .expect("session present until unmount")
            .ended
            .clone()
    }

    /// A handle other threads can flush through.
    pub fn handle(&self) -> MountedHandle {
        MountedHandle {
            mount_point: self.mount_point.clone(),
            fs: self.fs.clone(),
            passthrough: self.passthrough.clone(),
            requests: self.requests.clone(),
        }
    }

    /// The checkpoint service, when checkpoints are on.
    pub fn persist(&self) -> Option<&crate::persist::Service> {
        self.persist.as_ref()
    }

    /// The checkpoint service, e.g. to set the final checkpoint's budget.
    pub fn persist_mut(&mut self) -> Option<&mut crate::persist::Service> {
        self.persist.as_mut()
    }

    /// Flushes (every open handle's dirty data into the store), takes the final checkpoint
    /// (within `[persist] flush_timeout`), then unmounts and waits for the FUSE workers.
    /// A checkpoint that could not finish is reported (what did not reach the remote) after
    /// the unmount; its changes stay pending in the local state.
    pub fn unmount(mut self) -> Result<(), SessionError> {
        stop_prefetch(self.prefetch.take());
        let flushed = if self.ended().is_set() {
            // The kernel wrote its dirty pages back before it ended the connection; the
            // mount point is no longer this mount.
            self.fs
                .sync_all()
                .map_err(|e| SessionError::Flush(e.to_string()))
        } else {
            self.flush()
        };
        let final_cp = match (&flushed, self.persist.as_mut()) {
            (Ok(()), Some(p)) => Some(p.finish()),
            _ => None,
        };
        let session = self.session.take().expect("session present until unmount");
        let unmounted = match session.unmount() {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                // Something still has files open or its cwd inside. Everything acknowledged
                // is synced; detach so the mount point is not left dead behind us.
                tracing::warn!(
                    mount_point = %self.mount_point.display(),
                    "mount point busy: detaching it; processes still inside lose access"
                );
                sys::file::detach_mount(&self.mount_point)
                    .map(|_| ())
                    .map_err(|source| SessionError::Unmount {
                        path: self.mount_point.clone(),
                        source,
                    })
            }
            Err(source) => Err(SessionError::Unmount {
                path: self.mount_point.clone(),
                source,
            }),
        };
        let shut = flushed.and_then(|()| {
            self.fs
                .shutdown()
                .map_err(|e| SessionError::Flush(e.to_string()))
        });
        if let Some(p) = self.persist.take() {
            p.close(shut.is_ok() && unmounted.is_ok());
        }
        match final_cp {
            Some(Ok(r)) => tracing::info!(report = %r, "final checkpoint"),
            Some(Err(e)) => return Err(SessionError::Persist(e.to_string())),
            None => {}
        }
        unmounted?;
        shut?;
        tracing::info!(
            mount_point = %self.mount_point.display(),
            fuse_requests = self.requests.all(),
            fuse_requests_unwaited = self.requests.unwaited(),
            "workspace unmounted"
        );
        Ok(())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        stop_prefetch(self.prefetch.take());
        if let Some(s) = self.session.take() {
            let _ = self.fs.sync_all();
            if s.unmount().is_ok() {
                let _ = self.fs.shutdown();
            }
        }
    }
}

/// Set by the session when the kernel ends the connection (every worker read ENODEV): an
/// unmount, keel's own or from outside (`umount`, `fusermount -u`), or an abort through
/// `/sys/fs/fuse/connections`.
#[derive(Debug)]
pub struct Ended {
    gone: AtomicBool,
    fd: EventFd,
}

impl Ended {
    fn new() -> io::Result<Ended> {
        Ok(Ended {
            gone: AtomicBool::new(false),
            fd: EventFd::new()?,
        })
    }

    fn set(&self) {
        if !self.gone.swap(true, Ordering::SeqCst) {
            let _ = self.fd.signal();
        }
    }

    /// The connection is gone.
    pub fn is_set(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// Readable once the connection is gone.
    pub fn fd(&self) -> &EventFd {
        &self.fd
    }
}

/// A mounted FUSE connection served by fuser's worker threads.
struct FuseSession {
    mount_point: PathBuf,
    /// Runs fuser's `Session::run`, which starts the workers and returns when all have seen
    /// the end of the connection.
    runner: Option<JoinHandle<()>>,
    ended: Arc<Ended>,
    /// Tells the kernel to drop cached inodes and names (rollback).
    notifier: Option<fuser::Notifier>,
    /// The connection's number (its device minor), to recognise the mount at the unmount.
    connection: Option<u32>,
    unmounted: bool,
}

impl FuseSession {
    /// Mounts a new `/dev/fuse` connection on `mount_point`, answers INIT through `adapter`
    /// and starts `threads` workers, each reading its own clone of the fd. On any failure
    /// nothing stays mounted.
    fn start(adapter: FuseAdapter, mount_point: &Path, threads: usize) -> io::Result<Self> {
        let dev: OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")?
            .into();
        sys::mount::mount_fuse(dev.as_fd(), mount_point, "keel")?;
        let mut s = FuseSession {
            mount_point: mount_point.to_path_buf(),
            runner: None,
            ended: Arc::new(Ended::new()?),
            notifier: None,
            connection: None,
            unmounted: false,
        };
        // From here on, dropping `s` unmounts.
        s.connection = sys::mount::fuse_connection_at(mount_point).map(|m| m.minor);
        let mut config = fuser::Config::default();
        config.n_threads = Some(threads.max(1));
        config.clone_fd = true;
        // Reads INIT and answers it (`FuseAdapter::init`). Every user may use the mount
        // (`allow_other`); the kernel checks permissions (`default_permissions`).
        let session = fuser::Session::from_fd(adapter, dev, fuser::SessionACL::All, config)?;
        s.notifier = Some(session.notifier());
        let ended = s.ended.clone();
        let runner = std::thread::Builder::new()
            .name("keel-fuse".into())
            .spawn(move || {
                if let Err(e) = session.run() {
                    tracing::error!(error = %e, "FUSE session ended with an error");
                }
                ended.set();
            })?;
        s.runner = Some(runner);
        Ok(s)
    }

    /// Unmounts and waits for the workers. Fails (EBUSY) while the mount is in use; the
    /// workers then keep serving. Syncing the store is the caller's (`Mounted::unmount`).
    /// A mount already unmounted from outside only has its workers joined.
    fn unmount(mut self) -> io::Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> io::Result<()> {
        if !self.unmounted_from_outside() {
            sys::mount::unmount(&self.mount_point)?;
        }
        self.unmounted = true;
        if let Some(t) = self.runner.take() {
            let _ = t.join();
        }
        Ok(())
    }

    /// The kernel ended the connection and the mount point no longer shows this connection
    /// (an aborted connection still mounted is unmounted as usual; whatever was mounted
    /// there since is left alone).
    fn unmounted_from_outside(&self) -> bool {
        self.ended.is_set()
            && sys::mount::fuse_connection_at(&self.mount_point).map(|m| m.minor) != self.connection
    }
}

impl Drop for FuseSession {
    fn drop(&mut self) {
        if !self.unmounted {
            let _ = self.unmount_inner();
        }
    }
}

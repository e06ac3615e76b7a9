//! Mounting and unmounting the workspace, in phases: `lock_state` checks and locks the
//! state dir; `open_locked` opens the store; `Opened::mount` mounts a `/dev/fuse`
//! connection with mount(2) and serves it through fuser (`Session::from_fd`, its worker
//! threads each on a cloned fd). Between the first two the caller does what needs the lock
//! but no open store (`boot`: the lease, a restore); between the last two what must be in
//! place before the first request (`boot`: the source of lazily restored windows).
//! `mount_locked` is the last two at once. On shutdown it syncs, lets a `Finisher` (the checkpoint service) do
//! its last work, and unmounts.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::config::{CacheMode, Passthrough, WorkspaceConfig};
use crate::sys;
use crate::sys::eventfd::EventFd;

use super::fs::{FsError, FsOptions, Inval, WorkspaceFs};
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
    Flush(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("unmount {path}: {source}")]
    Unmount { path: PathBuf, source: io::Error },
    /// The finisher's last work (the final checkpoint) failed.
    #[error("{0}")]
    Finish(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A mounted workspace. Dropping it unmounts too, but only `unmount` reports errors.
pub struct Mounted {
    mount_point: PathBuf,
    fs: Arc<WorkspaceFs>,
    session: Option<FuseSession>,
    passthrough: Arc<AtomicBool>,
    requests: Arc<RequestCounters>,
    /// Held until the filesystem has shut down (see `release_lock`).
    lock: Option<StateLock>,
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

impl std::fmt::Debug for MountedHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountedHandle")
            .field("mount_point", &self.mount_point)
            .finish_non_exhaustive()
    }
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

    /// The change feed, recording from now on, and the cursor after its newest event.
    pub fn watch(
        &self,
    ) -> Result<
        (
            Arc<crate::workspace::feed::Feed>,
            crate::workspace::feed::Cursor,
        ),
        FsError,
    > {
        let c = self.fs.watch()?;
        Ok((self.fs.feed().clone(), c))
    }

    /// Starts recording what changes with its state before (`fs::track`).
    pub fn track_start(&self) -> Result<super::fs::TrackId, FsError> {
        self.fs.track_start()
    }

    /// What changed since `track_start`, before and now.
    pub fn track_finish(
        &self,
        t: super::fs::TrackId,
    ) -> Result<super::fs::Tracked, super::fs::TrackError> {
        self.fs.track_finish(t)
    }

    /// The chunk window of the workspace's change tracking.
    pub fn chunk_size(&self) -> u64 {
        self.fs.chunk_size()
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
    fs.sync_all().map_err(|e| SessionError::Flush(e.into()))
}

/// Creates the state dir (0700) when absent and refuses one that is not keel's (see
/// `state::check_keels`; `boot` tightens an existing one first). A restore killed before its
/// database was in place left its marker and part of its output: the start's restore
/// removes that and starts over (and refuses anything it did not write itself).
fn check_state_dir(dir: &Path) -> Result<(), SessionError> {
    crate::state::create_checked(dir).map_err(|e| SessionError::OpenState {
        path: dir.to_path_buf(),
        reason: e.to_string(),
    })
}

/// At most this many dead keel mounts stacked on one mount point are cleared.
const MAX_DEAD_MOUNTS: usize = 8;

/// A FUSE mount with this source is keel's: the source older keels used (`keel`), the
/// default one (`keel:<state dir>`), or the name this keel mounts with (`fsname`).
fn is_keel_source(source: &str, fsname: &str) -> bool {
    source == "keel"
        || source.starts_with(crate::config::workspace::FSNAME_PREFIX)
        || source == fsname
}

fn prepare_mount_point(p: &Path, fsname: &str) -> Result<(), SessionError> {
    let bad = |reason: String| SessionError::MountPoint {
        path: p.to_path_buf(),
        reason,
    };
    // keel holds the state dir's lock, so a keel FUSE mount at its mount point is a dead
    // keel's. Its connection may still be alive with nobody reading it: then any stat of the
    // path waits forever. So, before anything touches the path: abort the connection
    // (found in /proc/self/mountinfo, not by a stat) and detach the mount.
    for _ in 0..MAX_DEAD_MOUNTS {
        let Some(dead) =
            sys::mount::fuse_connection_at(p).filter(|m| is_keel_source(&m.source, fsname))
        else {
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

/// The state dir, checked and locked for this process: the first phase of a mount. What
/// must happen before the filesystem opens (the lease, a restore into an empty state dir)
/// runs while this is held; [`mount_locked`] is the second phase.
pub struct StateLock {
    state_dir: PathBuf,
    _lock: sys::file::LockFile,
}

impl StateLock {
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }
}

/// Checks that `cfg`'s state dir is keel's (or empty) and takes its lock; a second keel on
/// the same state dir stops here.
pub fn lock_state(cfg: &WorkspaceConfig) -> Result<StateLock, SessionError> {
    let state = &cfg.state_dir;
    check_state_dir(state)?;
    let lock_path = state.join(crate::state::LOCK);
    let lock = crate::state::try_lock(state)
        .map_err(|e| SessionError::OpenState {
            path: state.clone(),
            reason: format!("lock {}: {e}", lock_path.display()),
        })?
        .ok_or_else(|| SessionError::StateLocked {
            path: state.clone(),
            lock: lock_path.clone(),
        })?;
    Ok(StateLock {
        state_dir: state.clone(),
        _lock: lock,
    })
}

/// The store of a locked state dir, open but not mounted yet: what must be in place before
/// the first request can arrive (the source of lazily restored windows) is wired into
/// [`Opened::fs`] here, then [`Opened::mount`] makes the mount.
pub struct Opened {
    fs: Arc<WorkspaceFs>,
    passthrough: Arc<AtomicBool>,
    posix_acl: Arc<AtomicBool>,
    lock: StateLock,
}

/// Opens the store of the locked state dir (the second phase of a mount begins): nothing is
/// mounted yet, so no request can reach the filesystem before [`Opened::mount`].
pub fn open_locked(cfg: &WorkspaceConfig, lock: StateLock) -> Result<Opened, SessionError> {
    let state = &cfg.state_dir;
    let passthrough = Arc::new(AtomicBool::new(false));
    let posix_acl = Arc::new(AtomicBool::new(false));
    crate::meta::set_cache_ceiling(cfg.meta_cache.unwrap_or(crate::budget::shares().fs_cache));
    let fs = WorkspaceFs::new(
        state,
        FsOptions {
            cache: cfg.cache,
            inline_max: cfg.inline_max,
            chunk_size: cfg.chunk_size,
            passthrough: passthrough.clone(),
            posix_acl: posix_acl.clone(),
        },
    )
    .map_err(|e| SessionError::OpenState {
        path: state.clone(),
        reason: e.to_string(),
    })?;
    fs.feed().set_window(cfg.watch_window);
    Ok(Opened {
        fs: Arc::new(fs),
        passthrough,
        posix_acl,
        lock,
    })
}

/// Opens the store of the locked state dir and mounts it on `cfg`'s mount point; returns
/// once the kernel has accepted the mount. The lock is held until the `Mounted` is gone.
pub fn mount_locked(cfg: &WorkspaceConfig, lock: StateLock) -> Result<Mounted, SessionError> {
    open_locked(cfg, lock)?.mount(cfg)
}

impl Opened {
    /// The filesystem, for what must be wired in before it serves its first request.
    pub fn fs(&self) -> &Arc<WorkspaceFs> {
        &self.fs
    }

    /// Mounts the open store on `cfg`'s mount point; returns once the kernel has accepted
    /// the mount. The lock is held until the `Mounted` is gone.
    pub fn mount(self, cfg: &WorkspaceConfig) -> Result<Mounted, SessionError> {
        let Opened {
            fs,
            passthrough: passthrough_on,
            posix_acl: posix_acl_on,
            lock,
        } = self;
        let state = &cfg.state_dir;
        let fsname = cfg.fsname();
        prepare_mount_point(&cfg.mount_point, &fsname)?;

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
                posix_acl_on: posix_acl_on.clone(),
            },
        );
        let requests = adapter.requests();
        let session =
            FuseSession::start(adapter, &cfg.mount_point, &fsname, cfg.effective_threads())
                .map_err(mount_err)?;
        tracing::info!(
            mount_point = %cfg.mount_point.display(),
            state = %state.display(),
            fsname = %fsname,
            cache = cfg.cache.as_str(),
            threads = cfg.effective_threads(),
            passthrough = passthrough_on.load(Ordering::Relaxed),
            posix_acl = posix_acl_on.load(Ordering::Relaxed),
            "workspace mounted"
        );
        Ok(Mounted {
            mount_point: cfg.mount_point.clone(),
            fs,
            session: Some(session),
            passthrough: passthrough_on,
            requests,
            lock: Some(lock),
        })
    }
}

/// Sends one invalidation to the kernel; an error (the kernel no longer knows the inode or
/// name) is not one.
pub type Invalidate = Arc<dyn Fn(&Inval) -> std::io::Result<()> + Send + Sync>;

/// Invalidations for a rollback, through the session's notifier (the kernel answers
/// ENOENT for an inode or name it does not cache: not an error here).
fn invalidate_through(n: fuser::Notifier) -> Invalidate {
    use std::os::unix::ffi::OsStrExt;
    Arc::new(move |i: &Inval| {
        let r = match i {
            Inval::Inode(ino) => n.inval_inode(fuser::INodeNo(ino.0), 0, 0),
            Inval::Entry(parent, name) => {
                n.inval_entry(fuser::INodeNo(parent.0), std::ffi::OsStr::from_bytes(name))
            }
        };
        match r {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    })
}

/// What stops with the mount and is not the filesystem's (the checkpoint service, wired
/// in by `boot`): `finish` runs right after the flush, before the unmount (the final
/// checkpoint); `close` after the filesystem has shut down.
pub trait Finisher: Send {
    /// The last work on the flushed filesystem; an error is reported after the unmount.
    fn finish(&mut self) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
    /// Stops for good. `clean`: the filesystem shut down and recorded every write.
    fn close(self: Box<Self>, clean: bool);
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

    /// The filesystem, for what `boot` wires into it (the remote as the source of windows
    /// not fetched yet, the fsync hook, rollback).
    pub fn fs(&self) -> &Arc<WorkspaceFs> {
        &self.fs
    }

    /// Tells the kernel to drop what it caches of an inode or name (after a rollback).
    pub fn invalidator(&self) -> Option<Invalidate> {
        let s = self.session.as_ref()?;
        s.notifier.clone().map(invalidate_through)
    }

    /// Drops the mount like `Drop` does (sync, unmount, shut the filesystem down) and hands
    /// back the state dir's lock, so what used the state dir can stop before it is released.
    pub fn release_lock(mut self) -> Option<StateLock> {
        let lock = self.lock.take();
        drop(self);
        lock
    }

    /// Flushes (every open handle's dirty data into the store), lets `finisher` do its last
    /// work (the final checkpoint), then unmounts and waits for the FUSE workers, shuts the
    /// filesystem down and closes `finisher`. A `finish` that failed is reported after the
    /// unmount (its changes stay pending in the local state).
    pub fn unmount(mut self, mut finisher: Option<Box<dyn Finisher>>) -> Result<(), SessionError> {
        let started = std::time::Instant::now();
        // Watchers get what is left of the feed, then its end.
        self.fs.feed().close();
        let flushed = if self.ended().is_set() {
            // The kernel wrote its dirty pages back before it ended the connection; the
            // mount point is no longer this mount.
            self.fs
                .sync_all()
                .map_err(|e| SessionError::Flush(e.into()))
        } else {
            self.flush()
        };
        let finished = match (&flushed, finisher.as_mut()) {
            (Ok(()), Some(f)) => Some(f.finish()),
            _ => None,
        };
        // Everything acknowledged is in the store (and past the final checkpoint) from here;
        // what follows is the kernel's: `umount2` tears down every inode and name it cached,
        // which takes seconds at a million (tmpfs takes as long, see BENCHMARKS.md).
        let durable_ms = started.elapsed().as_millis() as u64;
        let session = self.session.take().expect("session present until unmount");
        let unmounting = std::time::Instant::now();
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
        let kernel_unmount_ms = unmounting.elapsed().as_millis() as u64;
        let shut = flushed.and_then(|()| {
            self.fs
                .shutdown_unfolded()
                .map_err(|e| SessionError::Flush(e.into()))
        });
        if let Some(f) = finisher {
            f.close(shut.is_ok() && unmounted.is_ok());
        }
        // Last: the WAL folded with everything in it, the finisher's own record included.
        let shut = shut.and_then(|()| self.fs.fold().map_err(|e| SessionError::Flush(e.into())));
        // A local failure first: `Finish` alone means everything is safe in the state dir
        // and only the remote is behind.
        unmounted?;
        shut?;
        if let Some(Err(e)) = finished {
            return Err(SessionError::Finish(e));
        }
        tracing::info!(
            mount_point = %self.mount_point.display(),
            fuse_requests = self.requests.all(),
            fuse_requests_unwaited = self.requests.unwaited(),
            durable_ms,
            kernel_unmount_ms,
            "workspace unmounted"
        );
        Ok(())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
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
    /// nothing stays mounted. `fsname` is the mount's source.
    fn start(
        adapter: FuseAdapter,
        mount_point: &Path,
        fsname: &str,
        threads: usize,
    ) -> io::Result<Self> {
        let dev: OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")?
            .into();
        sys::mount::mount_fuse(dev.as_fd(), mount_point, fsname)?;
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
        let slot = adapter.notifier_slot();
        let session = fuser::Session::from_fd(adapter, dev, fuser::SessionACL::All, config)?;
        s.notifier = Some(session.notifier());
        // Before `run`: no request but INIT is served until then.
        let _ = slot.set(session.notifier());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keel_mounts_are_known_by_their_source() {
        for (source, fsname, keel) in [
            ("keel", "keel:/s", true),
            ("keel:/other/state", "keel:/s", true),
            ("keel:", "keel:/s", true),
            ("scratch", "scratch", true),
            ("scratch", "keel:/s", false),
            ("keeler", "keel:/s", false),
            ("sshfs#host:", "keel:/s", false),
            ("", "keel:/s", false),
        ] {
            assert_eq!(is_keel_source(source, fsname), keel, "{source} / {fsname}");
        }
    }
}

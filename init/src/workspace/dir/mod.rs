//! The `dir` workspace provider: where FUSE cannot be mounted (no CAP_SYS_ADMIN: plain
//! `docker run --device /dev/fuse`, restricted pods, Fargate, `wrangler dev`), the workspace
//! is a plain directory on the state volume, `<state_dir>/workspace`, and the mount point
//! (`/workspace`) a symlink to it. Files are read and written by the kernel at the disk's
//! speed; keel is not on the I/O path.
//!
//! The store (`meta.db`) stays the record of the last checkpoint, exactly as under FUSE, so
//! the checkpoint, snapshot format, remote layout, lease, forks, retention, gc and fsck are
//! the FUSE provider's: before each checkpoint the walk (`scan`) compares every entry of the
//! tree with what the last walk recorded (`meta::HostRow`: host inode, size, mtime, ctime)
//! and writes what changed into the store the way the FUSE write path would (inodes,
//! entries, xattrs, inline bytes, dirty windows); the checkpoint then reads the changed
//! files' bytes from the tree itself through [`DirTree::opener`] (beneath the tree, the
//! host inode checked). A restore into `dir`, a rollback and a switch from FUSE build a
//! whole tree beside the live one (`build`) and swap the two with one `renameat2`
//! (RENAME_EXCHANGE), so the tree is always the old one or the new one.
//!
//! What it cannot do that FUSE can: hide the state dir from root in the sandbox (no mount
//! namespace without CAP_SYS_ADMIN: only modes protect it, and root has
//! CAP_DAC_OVERRIDE), see a change as it happens (a checkpoint walks the tree; periodic
//! ones only the directories inotify named, see `watch`, when it watches them all), take
//! a point-in-time copy of files still being written (a periodic checkpoint of a file
//! rewritten meanwhile is taken again at the next one; the final checkpoint runs after
//! every process stopped), or restore lazily (the tree is written whole before the main
//! command starts).

mod build;
mod scan;
pub mod watch;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use build::{BuildReport, Source, SourceData, SourceInode};
pub use scan::ScanReport;

use crate::chunk::reserve::Reserve;
use crate::meta::{InodeNo, Kind, MetaError, Nanos, Store};

/// The tree's name in the state dir.
pub const TREE: &str = crate::state::TREE;
/// Where a new tree is built before it is swapped in.
pub const TREE_NEW: &str = crate::state::TREE_NEW;
pub use crate::meta::{PROVIDER_KEY, TREE_KEY};

#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error("state database: {0}")]
    Meta(#[from] MetaError),
    #[error("walk {path}: {source}")]
    Walk { path: PathBuf, source: io::Error },
    #[error("build the tree at {path}: {source}")]
    Build { path: PathBuf, source: io::Error },
    #[error("inode {0} is a regular file whose bytes are nowhere (no body, not in the tree)")]
    NoBytes(u64),
    #[error("{0} windows of lazily restored files are not fetched yet: start once with the FUSE provider and read them (or set [persist] prefetch = true), or restore into an empty state dir")]
    LazyWindows(u64),
    #[error("swap the new tree into {path}: {source}")]
    Swap { path: PathBuf, source: io::Error },
    #[error("mount point {path}: {why}")]
    MountPoint { path: PathBuf, why: String },
    #[error("open {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("watch {path} for changes (inotify): {source}")]
    Watch { path: PathBuf, source: io::Error },
}

/// Where the walk last found each regular file kept in a body (not inline): the path below
/// the tree and the host inode, for the checkpoint's reads.
type Paths = HashMap<InodeNo, (PathBuf, u64)>;

/// A plain-directory workspace on a locked state dir.
pub struct DirTree {
    state_dir: PathBuf,
    root: PathBuf,
    store: Mutex<Store>,
    inline_max: u64,
    chunk_size: u64,
    paths: Arc<Mutex<Paths>>,
    /// Change notification, once [`DirTree::watch`] started it (dropped when the host's
    /// watch limit is reached).
    watch: Mutex<Option<watch::Watch>>,
    /// The FUSE provider's two space reserves (the same files): given back when a walk's
    /// commit, or the start's, finds the state volume full (the sandbox filled it through
    /// the tree), retaken once there is room.
    reserve: Reserve,
    boot_reserve: Reserve,
}

/// Opens a file of the tree by inode number for the checkpoint (see [`DirTree::opener`]).
pub type Opener = Arc<dyn Fn(u64) -> io::Result<File> + Send + Sync>;

impl DirTree {
    /// Opens the store of `state_dir` (creating it when absent) for the walk. When the
    /// store says the tree does not hold it yet (after a restore, or on a state dir the FUSE
    /// provider wrote), the tree is built from the store and its bodies first, and the
    /// bodies are removed once it is in place.
    ///
    /// On a state volume the sandbox filled, a store that cannot be opened or a tree that
    /// cannot be recorded gets the space the reserves the last run left hold (as under
    /// FUSE), and the start says how full the volume is.
    pub fn open(state_dir: &Path, inline_max: u64, chunk_size: u64) -> Result<DirTree, DirError> {
        use crate::workspace::fs::{give_back_reserves, VolumeUsage, MIB, RESERVE_BYTES};
        let reserves = [
            state_dir.join(crate::state::RESERVE),
            state_dir.join(crate::state::RESERVE_BOOT),
        ];
        let volume = VolumeUsage::of(state_dir);
        let open = || -> Result<DirTree, DirError> {
            let store = crate::state::open_store(state_dir, Nanos::now())?;
            store.ensure_host_map()?;
            let t = DirTree {
                state_dir: state_dir.to_path_buf(),
                root: state_dir.join(TREE),
                store: Mutex::new(store),
                inline_max,
                chunk_size,
                paths: Arc::default(),
                watch: Mutex::new(None),
                // Taken below, once the store is open.
                reserve: Reserve::unheld(&reserves[0], RESERVE_BYTES),
                boot_reserve: Reserve::unheld(&reserves[1], RESERVE_BYTES),
            };
            t.settle()?;
            Ok(t)
        };
        let mut t = match open() {
            Ok(t) => t,
            // A foreign or corrupt store is refused as it is.
            Err(e @ DirError::Meta(MetaError::Foreign { .. })) => return Err(e),
            Err(first) => match give_back_reserves(&reserves) {
                0 => return Err(first),
                freed => {
                    tracing::warn!(
                        error = %first,
                        "cannot open the store on a full state volume; retrying with the {:.1} MiB space reserve",
                        freed as f64 / MIB
                    );
                    open()?
                }
            },
        };
        if let Some(v) = volume {
            if v.full() {
                tracing::warn!("{v}: deleting files in the workspace makes room");
            } else {
                tracing::info!("{v}");
            }
        }
        t.boot_reserve = Reserve::open(&reserves[1], RESERVE_BYTES);
        t.reserve = Reserve::open(&reserves[0], RESERVE_BYTES);
        Ok(t)
    }

    /// Runs `f` (a walk: one transaction), once more with the running reserve's space when
    /// the state volume is full; retaken after it when there is room. The boot reserve is
    /// the next start's (a workload that fills the volume through the tree takes whatever
    /// keel gives back, so it is not spent on walks).
    fn with_room<T>(&self, f: impl Fn() -> Result<T, DirError>) -> Result<T, DirError> {
        loop {
            match f() {
                Err(DirError::Meta(e)) if e.is_full() && self.reserve.release() => {
                    tracing::warn!(error = %e, "state volume is full: using the space reserve to record the workspace's changes");
                }
                r => {
                    if r.is_ok() {
                        self.reserve.refill_if_room();
                    }
                    return r;
                }
            }
        }
    }

    /// Before the final checkpoint: on a full state volume, the checkpoint's records get
    /// the space the running reserve holds (if the walk left it). The boot reserve stays
    /// held: the next start opens the store with it when something else filled the volume
    /// meanwhile.
    pub fn make_room_if_full(&self) {
        if crate::workspace::fs::VolumeUsage::of(&self.state_dir).is_some_and(|v| v.full()) {
            self.reserve.release();
        }
    }

    /// The tree's root, `<state_dir>/workspace`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the tree hold what the store says, building it when the store says it does not.
    fn settle(&self) -> Result<(), DirError> {
        let (built, fresh) = {
            let s = self.store();
            let r = s.read();
            let built = r.persist_get(TREE_KEY)?.is_some();
            // A store nothing was ever written to (one root, no entries) has no tree to build.
            let fresh = r.list(InodeNo::ROOT)?.is_empty();
            (built, fresh)
        };
        let bodies = crate::state::open_bodies(&self.state_dir).map_err(|e| DirError::Open {
            path: self.state_dir.join(crate::state::BODIES),
            source: io::Error::other(e.to_string()),
        })?;
        if built {
            // Bodies a build linked into the tree and a crash left behind.
            for id in bodies.ids().unwrap_or_default() {
                let _ = bodies.remove(id);
            }
            if !self.root.is_dir() {
                return Err(DirError::Open {
                    path: self.root.clone(),
                    source: io::Error::new(
                        io::ErrorKind::NotFound,
                        "the store records a tree here but it is gone (restore from the remote into an empty state dir)",
                    ),
                });
            }
            return Ok(());
        }
        if fresh {
            if !self.root.exists() {
                std::fs::create_dir(&self.root).map_err(|source| DirError::Build {
                    path: self.root.clone(),
                    source,
                })?;
            }
            let report = self.scan()?;
            tracing::debug!(%report, "adopted the tree");
        } else {
            let missing = self.store().read().missing_window_count()?;
            if missing > 0 {
                return Err(DirError::LazyWindows(missing));
            }
            let src = build::StoreSource::new(&self.store, &bodies);
            let r = self.build_swap(&src)?;
            self.mark_built()?;
            // The bodies are in the tree now (hard links): their names go before the walk
            // records the files (removing a link moves a file's ctime).
            for id in bodies.ids().unwrap_or_default() {
                let _ = bodies.remove(id);
            }
            self.scan()?;
            tracing::info!(
                "workspace tree {} built from the store: {} files, {} dirs, {} bytes in {:.2}s{}",
                self.root.display(),
                r.files,
                r.dirs,
                r.bytes,
                r.elapsed.as_secs_f64(),
                r.skipped_note()
            );
        }
        self.mark_built()
    }

    /// Records that the tree holds what the store says.
    fn mark_built(&self) -> Result<(), DirError> {
        let s = self.store();
        let tx = s.write()?;
        tx.persist_set(TREE_KEY, "1")?;
        tx.persist_set(PROVIDER_KEY, "dir")?;
        tx.commit()?;
        s.sync()?;
        Ok(())
    }

    /// Builds the tree `src` describes beside the live one, swaps it in, removes the old
    /// one and records the new tree's host inodes (a walk that takes every entry whose
    /// name and attributes match the store as it is).
    pub fn build_and_swap(&self, src: &dyn Source) -> Result<BuildReport, DirError> {
        let r = self.build_swap(src)?;
        // Files linked from the live tree keep their host inode, so their records stay
        // theirs; every file written anew is a new host inode, read again by this walk.
        self.scan()?;
        Ok(r)
    }

    /// [`DirTree::build_and_swap`] without the walk.
    fn build_swap(&self, src: &dyn Source) -> Result<BuildReport, DirError> {
        let state = self.state_dir.clone();
        let new = state.join(TREE_NEW);
        if new.exists() {
            remove_tree(&new);
        }
        let reuse = self.reuse_fd()?;
        let paths = self.paths.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let report = build::build(src, &new, reuse.as_ref().map(|fd| (fd, &paths)))?;
        drop(reuse);
        let dir = open_dir(&state)?;
        let exchange = self.root.exists();
        crate::sys::tree::rename_at(
            dir.as_fd(),
            TREE_NEW.as_ref(),
            dir.as_fd(),
            TREE.as_ref(),
            exchange,
        )
        .map_err(|source| DirError::Swap {
            path: self.root.clone(),
            source,
        })?;
        if exchange {
            remove_tree(&new);
        }
        Ok(report)
    }

    /// The live tree's root, for hard links to files a build keeps as they are.
    fn reuse_fd(&self) -> Result<Option<OwnedFd>, DirError> {
        if !self.root.is_dir() {
            return Ok(None);
        }
        open_dir(&self.root).map(Some)
    }

    /// Walks the whole tree and brings the store up to date (see `scan`); with change
    /// notification on, every directory is watched before it is listed.
    pub fn scan(&self) -> Result<ScanReport, DirError> {
        self.with_room(|| self.scan_once())
    }

    fn scan_once(&self) -> Result<ScanReport, DirError> {
        self.scan_full(None)
    }

    /// A full walk; `prior`: the files a narrowed walk that gave way to it was to read
    /// again (`watch::Rewritten`).
    fn scan_full(&self, prior: Option<watch::Rewritten>) -> Result<ScanReport, DirError> {
        let s = self.store();
        let w = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        let mut rewritten = prior.unwrap_or_default();
        if let Some(w) = w.as_ref() {
            w.give_back_rewritten(rewritten);
            rewritten = w.begin_full();
        }
        let add = |rel: &Path| {
            if let Some(w) = w.as_ref() {
                w.add(rel)
            }
        };
        let r = scan::scan(&s, &self.root, &self.opts(&rewritten, &add));
        if let (Err(e), Some(w)) = (&r, w.as_ref()) {
            w.force_full(format!("the last walk failed: {e}"));
            w.give_back_rewritten(rewritten);
        }
        let (report, paths) = r?;
        *self.paths.lock().unwrap_or_else(|p| p.into_inner()) = paths;
        if let Some(w) = w.as_ref() {
            w.walked(true);
        }
        Ok(report)
    }

    /// How this tree's walks go (see `scan::Opts`).
    fn opts<'a>(
        &self,
        rewritten: &'a watch::Rewritten,
        on_dir: &'a dyn Fn(&Path),
    ) -> scan::Opts<'a> {
        scan::Opts {
            inline_max: self.inline_max,
            chunk_size: self.chunk_size,
            rewritten,
            on_dir,
        }
    }

    /// Starts change notification (see `watch`): the next walk is full and watches every
    /// directory; periodic walks ([`DirTree::scan_changed`]) list only the directories
    /// something happened in from then on.
    pub fn watch(&self) -> Result<(), DirError> {
        {
            let s = self.store();
            let tx = s.write()?;
            // A narrowed walk counts a file's names in the store.
            tx.index_names()?;
            tx.commit()?;
        }
        let w = watch::Watch::start(&self.root).map_err(|source| DirError::Watch {
            path: self.root.clone(),
            source,
        })?;
        *self.watch.lock().unwrap_or_else(|p| p.into_inner()) = Some(w);
        Ok(())
    }

    /// Tests: the watcher's reader thread leaves events queued in the kernel while `on`
    /// (see `watch::Watch::hold`).
    #[doc(hidden)]
    pub fn hold_events(&self, on: bool) {
        if let Some(w) = self
            .watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            w.hold(on);
        }
    }

    /// How many directories change notification watches (`None`: it is off).
    pub fn watched(&self) -> Option<usize> {
        self.watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|w| w.watched())
    }

    /// The walk before a periodic checkpoint: only the directories change notification
    /// named since the last walk when it covers the whole tree, else the whole tree (see
    /// `watch` for when, and why that is safe).
    pub fn scan_changed(&self) -> Result<ScanReport, DirError> {
        self.with_room(|| self.scan_changed_once())
    }

    fn scan_changed_once(&self) -> Result<ScanReport, DirError> {
        let plan = {
            let mut g = self.watch.lock().unwrap_or_else(|p| p.into_inner());
            match g.as_ref().map(|w| (w.dead(), w)) {
                None => None,
                Some((Some(why), w)) => {
                    tracing::warn!(
                        "change notification is off: {why}; every checkpoint walks the whole tree, and a second write to a still-dirty page of a shared mapping can no longer be seen"
                    );
                    // What it reported until now still goes to the next walk.
                    let pending = w.begin_full();
                    *g = None;
                    Some((watch::Plan::Full(why), pending))
                }
                Some((None, w)) => Some((w.plan(), watch::Rewritten::default())),
            }
        };
        let (dirs, rewritten) = match plan {
            Some((watch::Plan::Dirs(d, r), _)) => (d, r),
            Some((watch::Plan::Full(why), pending)) => {
                tracing::debug!("full walk: {why}");
                return self.scan_full(Some(pending));
            }
            None => return self.scan_once(),
        };
        let s = self.store();
        let w = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        let add = |rel: &Path| {
            if let Some(w) = w.as_ref() {
                w.add(rel)
            }
        };
        let mut paths = std::mem::take(&mut *self.paths.lock().unwrap_or_else(|p| p.into_inner()));
        let r = scan::scan_dirs(
            &s,
            &self.root,
            &dirs,
            &mut paths,
            &self.opts(&rewritten, &add),
        );
        *self.paths.lock().unwrap_or_else(|p| p.into_inner()) = paths;
        match r {
            Ok(scan::Narrowed::Done(report)) => {
                if let Some(w) = w.as_ref() {
                    w.walked(false);
                }
                Ok(report)
            }
            Ok(scan::Narrowed::NeedFull(why)) => {
                tracing::debug!("narrowed walk gave way to a full one: {why}");
                drop((s, w));
                self.scan_full(Some(rewritten))
            }
            Err(e) => {
                if let Some(w) = w.as_ref() {
                    w.force_full(format!("the last walk failed: {e}"));
                    w.give_back_rewritten(rewritten);
                }
                Err(e)
            }
        }
    }

    /// Opens the file the last walk found for inode `ino`, beneath the tree and only if it
    /// is still the same host inode: what the checkpoint reads a changed file's bytes
    /// through. A file replaced since the walk fails the checkpoint, and the next one walks
    /// again.
    pub fn opener(&self) -> Opener {
        let paths = self.paths.clone();
        let root = self.root.clone();
        Arc::new(move |ino: u64| {
            let (rel, host) = paths
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&InodeNo(ino))
                .cloned()
                .ok_or_else(|| {
                    io::Error::new(io::ErrorKind::NotFound, "not found by the last walk")
                })?;
            let dir = open_dir(&root).map_err(|e| io::Error::other(e.to_string()))?;
            let fd = crate::sys::beneath::open_beneath(
                dir.as_fd(),
                &rel,
                libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
                0,
            )?;
            let st = crate::sys::tree::fstat(fd.as_fd())?;
            if st.ino != host || st.kind() != libc::S_IFREG {
                return Err(io::Error::other(format!(
                    "{} changed since the walk (the next checkpoint takes it)",
                    rel.display()
                )));
            }
            Ok(File::from(fd))
        })
    }
}

/// Opens a directory to work relative to.
fn open_dir(p: &Path) -> Result<OwnedFd, DirError> {
    nix::fcntl::open(
        p,
        nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| DirError::Open {
        path: p.to_path_buf(),
        source: io::Error::from_raw_os_error(e as i32),
    })
}

/// Removes a tree keel built or swapped out; what cannot be removed is logged and left.
fn remove_tree(p: &Path) {
    if let Err(e) = std::fs::remove_dir_all(p) {
        tracing::warn!(path = %p.display(), error = %e, "cannot remove an old workspace tree");
    }
}

/// Whether the state dir's store says the `dir` provider wrote it last.
pub fn state_is_dir(state_dir: &Path) -> bool {
    if !crate::state::has_workspace(state_dir) {
        return false;
    }
    crate::state::open_store(state_dir, Nanos::now())
        .and_then(|s| s.read().persist_get(PROVIDER_KEY))
        .ok()
        .flatten()
        .as_deref()
        == Some("dir")
}

/// Points `mount_point` at the tree `root`: a symlink (replacing an empty directory or an
/// old symlink). A non-empty directory or a mount there is refused with the reason.
pub fn link_mount_point(mount_point: &Path, root: &Path) -> Result<(), DirError> {
    let bad = |why: String| DirError::MountPoint {
        path: mount_point.to_path_buf(),
        why,
    };
    match std::fs::symlink_metadata(mount_point) {
        Ok(m) if m.file_type().is_symlink() => {
            if std::fs::read_link(mount_point).ok().as_deref() == Some(root) {
                return Ok(());
            }
            std::fs::remove_file(mount_point).map_err(|e| bad(format!("remove old link: {e}")))?;
        }
        Ok(m) if m.is_dir() => {
            if crate::sys::mount::mount_points()
                .iter()
                .any(|p| p == mount_point)
            {
                return Err(bad(format!(
                    "is a mount point: the dir provider makes it a symlink to {} (mount the volume at the state dir instead)",
                    root.display()
                )));
            }
            std::fs::remove_dir(mount_point).map_err(|e| {
                bad(format!(
                    "must be empty or absent (it becomes a symlink to {}): {e}{}",
                    root.display(),
                    not_permitted_hint(&e)
                ))
            })?;
        }
        Ok(_) => return Err(bad("exists and is not a directory".into())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(p) = mount_point.parent() {
                std::fs::create_dir_all(p).map_err(|e| bad(e.to_string()))?;
            }
        }
        Err(e) => return Err(bad(e.to_string())),
    }
    std::os::unix::fs::symlink(root, mount_point)
        .map_err(|e| bad(format!("symlink: {e}{}", not_permitted_hint(&e))))
}

/// What to do when keel may not replace the mount point: a non-root keel (a restricted pod,
/// `--user`) cannot change a directory like `/`.
fn not_permitted_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::PermissionDenied => {
            " (its parent directory is not keel's to change: as a non-root user, set [workspace] mount_point to a path keel's user may create, e.g. under its home)"
        }
        _ => "",
    }
}

/// Kind of a host file type (`None`: not one keel stores).
fn kind_of(mode: u32) -> Option<Kind> {
    Kind::from_mode(mode)
}

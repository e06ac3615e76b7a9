//! POSIX semantics of the workspace, with no FUSE types: names, links, renames, attributes,
//! xattrs, file data (inline in SQLite or in a body file written in place), open-unlinked
//! files and durability points. `fuse.rs` translates kernel requests into these calls; tests
//! call them directly.
//!
//! Concurrency: one mutex guards the metadata store and the table of in-use inodes; reads and
//! writes of body files run outside it on a shared file handle.
//!
//! Group commit: metadata operations join one open SQLite transaction (each its own
//! savepoint, so each is wholly in or out) that is committed when it is 20 ms old or holds
//! 256 operations (checked as each operation lets go of the lock, and by a timer thread when
//! the filesystem goes idle), when the checkpoint service needs the write lock, and before
//! every fsync, sync and shutdown. A crash loses at most the operations of the open group,
//! newest first, never part of one; body files of deleted inodes are removed only once the
//! deletion is committed.
//!
//! Where things are: `error` (FsError and its errno), `group` (group commit, `Batch`),
//! `node` (the in-memory inode and its life cycle), `namespace` (names, attributes,
//! directories), `data` (file bytes), `xattr` (xattrs, ACLs kept in step with the mode,
//! set-ID dropping, access), `acl` (the POSIX ACL format and rules, pure), `lazy`
//! (fetching lazily restored windows), `rollback` (rolling the live tree back), `watch`
//! (what the mutating operations append to the change feed), `track` (the state before of
//! what changed while a tracker runs: `diff=true`). This file
//! keeps the public types, `WorkspaceFs` with its lock, and the whole-filesystem calls.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::chunk::reserve::Reserve;
use crate::chunk::{BodyPool, BodyStore};
use crate::config::CacheMode;
use crate::meta::{DirCache, Inode, InodeNo, Kind, MetaError, Nanos, Store};
use crate::sys;

pub mod acl;
mod data;
mod error;
mod fetchers;
mod group;
mod lazy;
mod mapped;
mod namespace;
mod node;
mod nodes;
mod reads;
mod replay;
mod rollback;
mod track;
mod watch;
mod xattr;

pub use error::{FsError, FsResult};
pub use fetchers::{Deferred, FETCH_THREADS};
pub use node::LINGER_MAX;
pub use reads::READ_SET_MAX;
pub use replay::ReplayReport;
pub use rollback::{Inval, RollbackPlan, RollbackReport, RollbackTarget, Target, TargetData};
pub use track::{Content, Seen, Side, TrackError, TrackId, Tracked};
pub use xattr::{setid_lost, XattrReply};

use group::{committer, discard_body, Batch};
use node::{Data, Node, NO_STAMP};
use nodes::NodeMap;

/// Longest name of a directory entry, in bytes.
pub const NAME_MAX: usize = 255;
/// Longest symlink target, in bytes.
pub const PATH_MAX: usize = 4096;
/// Longest xattr name and value.
pub const XATTR_NAME_MAX: usize = 255;
pub const XATTR_SIZE_MAX: usize = 65536;
/// Most hard links one inode may have.
pub const LINK_MAX: u32 = 65000;

const XATTR_CREATE: i32 = 1;
const XATTR_REPLACE: i32 = 2;
const RENAME_NOREPLACE: u32 = 1;
const RENAME_EXCHANGE: u32 = 2;

/// Who is asking (from the kernel request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// 0 when the kernel sends the request on its own (e.g. a writeback).
    pub pid: u32,
    /// The caller's umask, in the requests that create (mknod, mkdir, create); 0 in the
    /// others. keel applies it (the kernel leaves it to keel, FUSE_DONT_MASK) unless the
    /// directory's default ACL takes its place.
    pub umask: u32,
}

/// What a request did that may cost a regular file its set-user-ID and set-group-ID bits
/// and its `security.capability`, decided from the caller as the kernel decides it for a
/// local filesystem such as ext4 (see [`setid_lost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetIdLoss {
    /// chown or chgrp, `chown(-1, -1)` included.
    Chown(Caller),
    /// A write, truncate, `O_TRUNC` open or copy into the file.
    Modify(Caller),
}

/// An inode's attributes as `stat` shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    pub inode: Inode,
    /// Allocated 512-byte blocks.
    pub blocks: u64,
    /// The kernel must not cache these attributes: they can change with no request to keel
    /// (a shared writable mapping of a passthrough body, see `mapped`).
    pub volatile: bool,
    /// The inode's generation: a file handle names the number and this, so a handle of an
    /// inode whose number a crash gave to another one is stale (`meta::Generations`).
    pub generation: u32,
}

/// A time to set with `setattr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetTime {
    Now,
    At(Nanos),
}

/// The fields `setattr` changes; `None` leaves a field alone.
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SetTime>,
    pub mtime: Option<SetTime>,
    pub ctime: Option<Nanos>,
    /// Drop setuid/setgid and `security.capability` first, as this caller's request would
    /// on ext4 (see [`WorkspaceFs::drop_setid`]).
    pub drop_setid: Option<SetIdLoss>,
}

/// How the kernel should cache an opened file.
#[derive(Debug, Clone, Default)]
pub struct OpenInfo {
    pub keep_cache: bool,
    pub direct_io: bool,
    /// Hand reads and writes of this handle to the kernel on this body file (passthrough).
    pub backing: Option<Arc<File>>,
}

/// One directory entry as `readdir` returns it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub name: Vec<u8>,
    pub ino: InodeNo,
    pub kind: Kind,
}

/// Numbers for `statfs`.
#[derive(Debug, Clone, Copy)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// Tunables of the filesystem itself.
#[derive(Debug, Clone)]
pub struct FsOptions {
    pub cache: CacheMode,
    pub inline_max: u64,
    /// Chunk window size for change tracking (a power of two).
    pub chunk_size: u64,
    /// Set by the FUSE layer once the kernel agreed to pass file I/O through to body files.
    pub passthrough: Arc<AtomicBool>,
    /// Set by the FUSE layer once the kernel agreed to enforce POSIX ACLs (FUSE_POSIX_ACL).
    /// Until then, and on a kernel without it, the ACL xattrs are refused (EOPNOTSUPP: an
    /// ACL stored but not enforced is a permission its owner believes removed) and no
    /// default ACL is inherited.
    pub posix_acl: Arc<AtomicBool>,
}

enum Handle {
    File {
        ino: InodeNo,
        passthrough: bool,
        /// A passthrough handle open for writing (`OpenFile::pt_writers`).
        writer: bool,
    },
    Dir {
        ino: InodeNo,
        /// The listing READDIR serves, read at every request from offset 0: the first
        /// after `opendir`, and each after a `rewinddir`, which must show the entries made
        /// or removed since.
        entries: Vec<DirEntry>,
    },
}

struct Inner {
    store: Store,
    nodes: NodeMap<Node>,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
    /// Bodies of deleted inodes, handed to a background thread (`None` after shutdown).
    discard: Option<Sender<u64>>,
    /// Bodies of inodes deleted in the open group: removed once it commits.
    discard_after_commit: Vec<u64>,
    pool: Arc<BodyPool>,
    /// Inodes known to have no xattrs at all: the kernel asks for `security.capability`
    /// before every write(2), and the answer is then free.
    no_xattrs: HashSet<InodeNo>,
    /// Closed files kept loaded, longest-closed first (see `WorkspaceFs::linger`).
    lingering: VecDeque<InodeNo>,
    /// Bodies a shared writable mapping may still write after the last close (`mapped`).
    mapped: mapped::Mapped,
    /// When the free space of the state volume was last looked at (group commit pauses
    /// while it is low).
    space_checked: Option<std::time::Instant>,
    /// The change feed (also `WorkspaceFs::feed`), for what only `Inner` sees (a lost group).
    feed: Arc<crate::workspace::feed::Feed>,
    /// Directory inode → `/`-rooted path, for the change feed's events (see `watch`).
    dir_paths: HashMap<InodeNo, Arc<str>>,
    /// Spans whose changes are being recorded with their state before (see `track`).
    trackers: track::Trackers,
}

/// The lock on `Inner`; letting go of it commits the open group when that is due.
struct Guard<'a> {
    fs: &'a WorkspaceFs,
    g: MutexGuard<'a, Inner>,
}

impl std::ops::Deref for Guard<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.g
    }
}

impl std::ops::DerefMut for Guard<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.g
    }
}

/// The workspace filesystem over one state directory.
pub struct WorkspaceFs {
    inner: Arc<Mutex<Inner>>,
    /// The store's directory inodes, read without `inner` (see `meta::DirCache`).
    dirs: Arc<DirCache>,
    bodies: BodyStore,
    pool: Arc<BodyPool>,
    state_dir: PathBuf,
    opts: FsOptions,
    reserve: Reserve,
    /// Space for the next start's opening writes; also given back by a shutdown that
    /// cannot fold the WAL on a full volume.
    boot_reserve: Reserve,
    /// Runs after every successful fsync, with no lock held (`[persist] fsync = "remote"`).
    fsync_hook: std::sync::OnceLock<FsyncHook>,
    discarder: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Keeps the body pool stocked with empty files (`BodyPool::run_filler`).
    filler: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Windows of lazily restored bodies not fetched yet.
    lazy: lazy::Lazy,
    /// The windows read since the mount (see `reads`).
    reads: reads::ReadLog,
    /// The group commit timer thread, and what tells it to end.
    committer: std::thread::Thread,
    committer_stop: Arc<AtomicBool>,
    /// Inode generations, fixed at the start (`meta::Generations`).
    generations: crate::meta::Generations,
    /// The change feed (`watch`).
    feed: Arc<crate::workspace::feed::Feed>,
}

impl Drop for WorkspaceFs {
    /// Without `shutdown` this is a crash: the open group is not committed.
    fn drop(&mut self) {
        self.committer_stop.store(true, Ordering::SeqCst);
        self.committer.unpark();
        self.pool.stop_filler();
    }
}

/// What `fsync` must also do once the local store is durable, e.g. a checkpoint to the
/// remote. An error fails the fsync (EIO): the data did not get where it was promised.
pub type FsyncHook =
    Box<dyn Fn() -> Result<(), Box<dyn std::error::Error + Send + Sync>> + Send + Sync>;

/// Space kept free for metadata commits on a full volume.
pub(crate) const RESERVE_BYTES: u64 = 1 << 20;

/// Opens the store and the bodies of a state dir for a start: removes inodes unlinked while
/// open when keel last stopped, finishes an interrupted rollback and begins the start's
/// generation (each a write: on a full volume these are what fail). Safe to run again after
/// a failure: each step is a transaction or idempotent.
fn open_store(
    state_dir: &Path,
    opts: &FsOptions,
) -> FsResult<(Store, BodyStore, crate::meta::Generations)> {
    let store = crate::state::open_store(state_dir, Nanos::now())?;
    let bodies = crate::state::open_bodies(state_dir)
        .map_err(|e| FsError::Io(io::Error::other(e.to_string())))?;
    let orphans = store.read().orphans()?;
    if !orphans.is_empty() {
        let tx = store.write()?;
        for o in &orphans {
            tx.delete(o.ino)?;
        }
        tx.commit()?;
        for o in &orphans {
            bodies.remove(o.ino.0)?;
        }
        tracing::info!(
            count = orphans.len(),
            "removed files that were unlinked while open"
        );
    }
    let finished = rollback::finish_rollback_renames(state_dir, &store, &bodies, opts.chunk_size)?;
    if finished > 0 {
        tracing::warn!(
            bodies = finished,
            "finished a rollback that stopped after its metadata was recorded: its new file bodies are in place"
        );
    }
    // Before any number is handed out: numbers a crash took back get a new generation.
    let generations = store.begin_generation()?;
    Ok((store, bodies, generations))
}

/// Empties the reserve files at `paths` (held by nobody: the filesystem is not open yet);
/// returns the bytes given back.
pub(crate) fn give_back_reserves(paths: &[PathBuf]) -> u64 {
    let mut freed = 0;
    for p in paths {
        let Ok(f) = File::options().write(true).open(p) else {
            continue;
        };
        let held = f.metadata().map(|m| m.len()).unwrap_or(0);
        if held > 0 && f.set_len(0).is_ok() {
            freed += held;
        }
    }
    freed
}

pub(crate) const MIB: f64 = (1u64 << 20) as f64;

/// How full the state volume is, said once at every start.
#[derive(Debug, Clone, Copy)]
pub struct VolumeUsage {
    pub total: u64,
    pub used: u64,
    /// What an unprivileged writer could still use.
    pub avail: u64,
}

impl VolumeUsage {
    pub fn of(dir: &Path) -> Option<VolumeUsage> {
        let s = sys::file::statvfs(dir).ok()?;
        let total = s.blocks.saturating_mul(s.fragment_size);
        let free = s.blocks_free.saturating_mul(s.fragment_size);
        Some(VolumeUsage {
            total,
            used: total.saturating_sub(free),
            avail: s.blocks_avail.saturating_mul(s.fragment_size),
        })
    }

    /// Less room left than the metadata reserve holds.
    pub fn full(&self) -> bool {
        self.avail < RESERVE_BYTES
    }
}

impl std::fmt::Display for VolumeUsage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = if self.total == 0 {
            0.0
        } else {
            100.0 * self.used as f64 / self.total as f64
        };
        write!(
            f,
            "state volume: {:.1} MiB used, {:.1} MiB free of {:.1} MiB ({pct:.0}% full)",
            self.used as f64 / MIB,
            self.avail as f64 / MIB,
            self.total as f64 / MIB
        )
    }
}

/// Waits for a background thread that was told to end (once: the handle is taken).
fn join_thread(slot: &Mutex<Option<std::thread::JoinHandle<()>>>) {
    if let Some(t) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
        let _ = t.join();
    }
}

impl WorkspaceFs {
    /// Opens the state directory (which must already be locked by the caller), removing
    /// inodes that were unlinked while open when keel last stopped.
    pub fn new(state_dir: &Path, opts: FsOptions) -> Result<WorkspaceFs, FsError> {
        // The reserves (see `Reserve`) the last run left hold space for exactly this: a
        // start on a volume the sandbox filled must still open the store, recover its WAL
        // and write the start's own rows. Given back only if opening fails, retaken once
        // open when there is room.
        let reserves = [
            state_dir.join(crate::state::RESERVE),
            state_dir.join(crate::state::RESERVE_BOOT),
        ];
        let volume = VolumeUsage::of(state_dir);
        let (store, bodies, generations) = match open_store(state_dir, &opts) {
            Ok(opened) => opened,
            // A foreign or corrupt store is refused as it is: nothing in the dir is touched.
            Err(e @ FsError::Meta(MetaError::Foreign { .. })) => return Err(e),
            Err(first) => match give_back_reserves(&reserves) {
                0 => return Err(first),
                freed => {
                    tracing::warn!(
                        error = %first,
                        "cannot open the store on a full state volume; retrying with the {:.1} MiB space reserve",
                        freed as f64 / MIB
                    );
                    open_store(state_dir, &opts)?
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
        let boot_reserve = Reserve::open(&reserves[1], RESERVE_BYTES);
        let pool = Arc::new(
            BodyPool::open(&bodies)
                .map_err(|e| FsError::Io(io::Error::other(e.to_string())))?
                .never_reuse_while(opts.passthrough.clone()),
        );
        let lazy = lazy::Lazy::new(store.any_missing_windows()?);
        if lazy_active_check(&store, opts.chunk_size)? {
            tracing::info!(
                "lazily restored state dir: file data is fetched from the remote on first use"
            );
        }
        let dirs = store.dir_cache().clone();
        let (discard_tx, discard_rx) = std::sync::mpsc::channel::<u64>();
        let reaper = pool.clone();
        let discarder = std::thread::Builder::new()
            .name("keel-discard".into())
            .spawn(move || {
                for id in discard_rx {
                    discard_body(&reaper, id);
                }
            })?;
        let filling = pool.clone();
        let filler = std::thread::Builder::new()
            .name("keel-pool-fill".into())
            .spawn(move || {
                // New body files are for later: only spare CPU time goes to them.
                if let Err(e) = sys::sched::set_nice(0, 19) {
                    tracing::debug!(error = %e, "cannot lower the pool filler's priority");
                }
                filling.run_filler();
            })?;
        pool.request_fill();
        let feed = Arc::new(crate::workspace::feed::Feed::default());
        let inner = Arc::new(Mutex::new(Inner {
            store,
            nodes: NodeMap::new(),
            handles: HashMap::new(),
            next_fh: 1,
            discard: Some(discard_tx),
            discard_after_commit: Vec::new(),
            pool: pool.clone(),
            no_xattrs: HashSet::new(),
            lingering: VecDeque::new(),
            mapped: mapped::Mapped::default(),
            space_checked: None,
            feed: feed.clone(),
            dir_paths: HashMap::new(),
            trackers: track::Trackers::default(),
        }));
        let committer_stop = Arc::new(AtomicBool::new(false));
        let (weak, stop, chunk) = (
            Arc::downgrade(&inner),
            committer_stop.clone(),
            opts.chunk_size,
        );
        let committer = std::thread::Builder::new()
            .name("keel-commit".into())
            .spawn(move || committer(weak, stop, chunk))?
            .thread()
            .clone();
        let waker = committer.clone();
        inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .store
            .enable_group_commit(Box::new(move || waker.unpark()));
        Ok(WorkspaceFs {
            inner,
            dirs,
            bodies,
            pool,
            fsync_hook: std::sync::OnceLock::new(),
            discarder: Mutex::new(Some(discarder)),
            filler: Mutex::new(Some(filler)),
            committer,
            committer_stop,
            lazy,
            reads: reads::ReadLog::default(),
            reserve: Reserve::open(&reserves[0], RESERVE_BYTES),
            boot_reserve,
            state_dir: state_dir.to_path_buf(),
            opts,
            generations,
            feed,
        })
    }

    /// The chunk window of change tracking.
    pub fn chunk_size(&self) -> u64 {
        self.opts.chunk_size
    }

    /// The generation of inode `ino` (see `Attr::generation`).
    pub fn generation(&self, ino: InodeNo) -> u32 {
        self.generations.of(ino.0)
    }

    /// Runs an operation that frees space (or must not fail on a full disk); when it fails
    /// with ENOSPC, gives up the metadata reserve and tries once more. Operations leave no
    /// trace when they fail, so the retry is safe.
    fn freeing<T>(&self, mut op: impl FnMut() -> FsResult<T>) -> FsResult<T> {
        let r = match op() {
            Err(e) if e.errno() == libc::ENOSPC && self.reserve.release() => {
                tracing::warn!("state volume is full: using the metadata reserve");
                op()
            }
            r => r,
        };
        if r.is_ok() {
            self.reserve.refill_if_room();
        }
        r
    }

    fn lock(&self) -> Guard<'_> {
        Guard {
            fs: self,
            g: self.inner.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }

    pub fn statfs(&self) -> FsResult<StatFs> {
        let s = sys::file::statvfs(&self.state_dir)?;
        let used = self.lock().store.read().inode_count()?;
        Ok(StatFs {
            blocks: s.blocks,
            bfree: s.blocks_free,
            bavail: s.blocks_avail,
            files: used + s.files_free,
            ffree: s.files_free,
            bsize: s.block_size as u32,
            namelen: NAME_MAX as u32,
            frsize: s.fragment_size as u32,
        })
    }

    // ----- whole-filesystem -----

    /// Commits every open file's pending attributes, writes all bodies to disk and makes
    /// the store durable (shutdown, `sync`).
    pub fn sync_all(&self) -> FsResult<()> {
        // Fetched windows first: a checkpoint after this flush may trust every row left.
        self.settle_windows(None)?;
        self.freeing(|| self.sync_all_once())
    }

    fn sync_all_once(&self) -> FsResult<()> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let pt: Vec<InodeNo> = inner
            .nodes
            .iter()
            .filter(|(_, n)| n.pt_opens > 0)
            .map(|(i, _)| *i)
            .collect();
        for ino in pt {
            self.sync_written(inner, ino)?;
        }
        // What mappings wrote after the last close, before a checkpoint claims the changes.
        for ino in inner.mapped.inodes() {
            self.sync_mapped(inner, ino)?;
        }
        let dirty: Vec<Inode> = inner
            .nodes
            .values()
            .filter_map(|n| n.open.as_ref())
            .filter(|of| of.dirty)
            .map(|of| of.inode.clone())
            .collect();
        if !dirty.is_empty() {
            let mut tx = Batch::new(&inner.store)?;
            for inode in &dirty {
                tx.save(&inner.nodes, inode)?;
            }
            tx.commit(&mut inner.nodes)?;
        }
        sys::file::syncfs(&self.state_dir)?;
        inner.sync(self.opts.chunk_size)?;
        Ok(())
    }

    /// Empty body files the pool holds ready for new files (the filler keeps at least
    /// `POOL_LOW` of them; files it is still making are not counted).
    pub fn pooled_bodies(&self) -> usize {
        self.pool.len()
    }

    /// Final step before unmount: sync everything and fold the WAL into the database.
    pub fn shutdown(&self) -> FsResult<()> {
        self.shutdown_unfolded()?;
        self.fold()
    }

    /// `shutdown` but the fold: sync and commit everything and record the clean stop, for a
    /// caller with writes of its own to make before [`WorkspaceFs::fold`].
    pub fn shutdown_unfolded(&self) -> FsResult<()> {
        self.close_fetchers();
        // On a volume the sandbox filled these commits may need the reserves (the running
        // one may be gone already; the boot one is retaken at the next start).
        let reserve = || self.reserve.release() || self.boot_reserve.release();
        self.settle_windows(None)?;
        loop {
            match self.sync_all_once() {
                Err(e) if e.errno() == libc::ENOSPC && reserve() => {
                    tracing::warn!(error = %e, "state volume is full: using the space reserve to save open files");
                }
                r => break r?,
            }
        }
        // No new pool files from here on.
        self.pool.stop_filler();
        join_thread(&self.filler);
        // Finish removing discarded bodies before the state dir is handed on.
        self.lock().discard.take();
        join_thread(&self.discarder);
        let mut guard = self.lock();
        let chunk = self.opts.chunk_size;
        loop {
            match guard.commit_group(chunk) {
                Err(e) if e.is_full() && reserve() => {
                    tracing::warn!(error = %e, "state volume is full: using the space reserve to commit the last changes");
                }
                r => break r?,
            }
        }
        // Every number handed out is in the store: the next start continues the range.
        loop {
            match guard.store.mark_clean() {
                Err(e) if e.is_full() && reserve() => {}
                r => break r?,
            }
        }
        drop(guard);
        // Bodies of files that went back inline, too.
        self.pool.recycle_released();
        // What is written after this (the checkpointer's record of the clean stop) gets
        // the space a reserve holds when the volume has less.
        if VolumeUsage::of(&self.state_dir).is_some_and(|v| v.full()) {
            let _ = self.reserve.release() || self.boot_reserve.release();
        }
        Ok(())
    }

    /// After `shutdown` and the last writes of others (the checkpointer's): folds the WAL
    /// into the database file and truncates it.
    pub fn fold(&self) -> FsResult<()> {
        let guard = self.lock();
        let reserve = || self.reserve.release() || self.boot_reserve.release();
        // Folding the WAL into the database grows the database file. When a full volume
        // has no room for that even with the reserves given back, the WAL stays where it is:
        // synced, consistent, and folded by a later start or shutdown with room.
        loop {
            match guard.store.checkpoint() {
                Err(e) if e.is_full() && reserve() => {}
                Err(e) if e.is_full() => {
                    sys::file::syncfs(&self.state_dir)?;
                    tracing::warn!(
                        error = %e,
                        "state volume is full: the metadata log stays unfolded until there is room (nothing is lost)"
                    );
                    break;
                }
                r => break r?,
            }
        }
        Ok(())
    }
}

/// A state dir with windows left to fetch must keep the window size they were restored
/// with. Returns whether there are any.
fn lazy_active_check(store: &Store, chunk_size: u64) -> FsResult<bool> {
    if !store.any_missing_windows()? {
        return Ok(false);
    }
    let restored: Option<u64> = store
        .read()
        .persist_get("chunk_size")?
        .and_then(|v| v.parse().ok());
    match restored {
        Some(cs) if cs != chunk_size => Err(FsError::Io(io::Error::other(format!(
            "this state dir was restored lazily with {cs}-byte chunks and still has data to fetch; \
             [workspace] chunk_size is {chunk_size}: set it back to {cs} until every file was read"
        )))),
        _ => Ok(true),
    }
}

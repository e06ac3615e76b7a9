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

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::chunk::reserve::Reserve;
use crate::chunk::{BodyPool, BodyStore, Fresh};
use crate::config::CacheMode;
use crate::meta::{
    DirCache, Dirent, GroupLimits, Inode, InodeNo, Kind, MetaError, Nanos, Storage, Store, Tx,
};
use crate::sys;

mod lazy;
mod nodes;
mod rollback;

use nodes::NodeMap;

pub use rollback::{Inval, RollbackPlan, RollbackReport, RollbackTarget, Target, TargetData};

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

/// Everything that can go wrong in a filesystem operation. `errno` maps each to the one
/// errno the caller sees.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("name too long")]
    NameTooLong,
    #[error("invalid argument")]
    Invalid,
    #[error("no such attribute")]
    NoAttr,
    #[error("buffer too small")]
    Range,
    #[error("attribute value too large")]
    TooBig,
    #[error("operation not permitted")]
    NotPermitted,
    #[error("permission denied")]
    Access,
    #[error("bad file handle")]
    BadHandle,
    #[error("operation not supported")]
    NotSupported,
    #[error("no data at or after offset")]
    NoData,
    #[error("too many links")]
    TooManyLinks,
    #[error("io: {0}")]
    Io(#[from] io::Error),
    #[error("metadata: {0}")]
    Meta(#[from] MetaError),
    #[error("lazy restore: {0}")]
    Fetch(String),
}

impl FsError {
    /// The errno for this error. One exhaustive match: adding a variant forces a choice here.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::Invalid => libc::EINVAL,
            FsError::NoAttr => libc::ENODATA,
            FsError::Range => libc::ERANGE,
            FsError::TooBig => libc::E2BIG,
            FsError::NotPermitted => libc::EPERM,
            FsError::Access => libc::EACCES,
            FsError::BadHandle => libc::EBADF,
            FsError::NotSupported => libc::EOPNOTSUPP,
            FsError::NoData => libc::ENXIO,
            FsError::TooManyLinks => libc::EMLINK,
            FsError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            FsError::Meta(e) if e.is_full() => libc::ENOSPC,
            FsError::Meta(_) => libc::EIO,
            FsError::Fetch(_) => libc::EIO,
        }
    }
}

pub type FsResult<T> = Result<T, FsError>;

/// Who is asking (from the kernel request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// 0 when the kernel sends the request on its own (e.g. a writeback).
    pub pid: u32,
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
}

/// What to create in `make`.
struct New<'a> {
    kind: Kind,
    perm: u32,
    rdev: u32,
    target: Option<&'a [u8]>,
}

/// The bytes of an open regular file.
enum Data {
    Inline(Vec<u8>),
    Body(Arc<File>),
}

/// State of a regular file while it is open (or being changed by a data operation).
struct OpenFile {
    /// Authoritative attributes while open; the store may lag behind until `dirty` is cleared.
    inode: Inode,
    data: Data,
    dirty: bool,
    /// Chunk windows written since the store last recorded them.
    windows: BTreeSet<u64>,
    /// The body is a pooled file still under its pool slot's name: the store does not know
    /// it yet. It moves to the file's name when the store is first told the file has a body
    /// (`Batch::save`, and first thing in `fsync`), or goes back to the pool unrenamed if the
    /// file goes back inline first (`back_inline`) or is deleted (`purge`). A small file
    /// created write-only (`echo >`, `cp` of a small file) so costs no rename at all.
    provisional: std::cell::Cell<Option<Provisional>>,
    /// (size, mtime, ctime) of the body when we last looked, while passthrough handles are
    /// open: a change means the kernel wrote through one.
    pt_base: Option<BodyStamp>,
    /// The file took a body only to be passed through (it was inline when opened for
    /// writing, see `open_as`): at its last close it goes back inline if it stayed small.
    pt_body: bool,
}

/// A taken pool slot (see `OpenFile::provisional`).
struct Provisional {
    slot: u64,
    pool: Arc<BodyPool>,
}

impl OpenFile {
    /// Moves a provisional body to the file's name (see `provisional`).
    fn name_body(&self) -> io::Result<()> {
        if let Some(p) = self.provisional.take() {
            if let Err(e) = p.pool.name_slot(p.slot, self.inode.ino.0) {
                self.provisional.set(Some(p));
                return Err(e);
            }
        }
        Ok(())
    }

    /// Whether the file may stay loaded after its last close (see `WorkspaceFs::linger`):
    /// it still has a name, and its body is under that name, not a pool slot.
    fn may_linger(&self) -> bool {
        let p = self.provisional.take();
        let named = p.is_none();
        self.provisional.set(p);
        named && self.inode.nlink > 0 && !self.dirty
    }

    /// Gives a provisional body back to the pool; true when there was one.
    fn drop_provisional(&self) -> bool {
        match self.provisional.take() {
            Some(p) => {
                p.pool.give_back(p.slot);
                true
            }
            None => false,
        }
    }

    /// Notes that bytes `[from, to)` changed, for checkpoints.
    fn touch(&mut self, from: u64, to: u64, chunk_size: u64) {
        let first = from / chunk_size;
        let last = to.max(from + 1).div_ceil(chunk_size);
        self.windows.extend(first..last);
        self.dirty = true;
    }
}

/// An inode the kernel knows about (looked up) or that has open handles. One per inode the
/// kernel holds, so kept small (40 bytes): what only an open or loaded file needs is in the
/// boxed `OpenFile`.
struct Node {
    lookups: u64,
    opens: u32,
    /// Open handles whose I/O the kernel passes straight to the body file.
    pt_opens: u32,
    /// (mtime, size) when the last handle was closed: the page cache is still valid if the
    /// file looks the same at the next open (cache mode `auto`). `NO_STAMP`: none.
    cache_stamp: (Nanos, u64),
    open: Option<Box<OpenFile>>,
}

/// No cache stamp: no file has this size (sizes stop at `i64::MAX`).
const NO_STAMP: (Nanos, u64) = (Nanos(i64::MIN), u64::MAX);

impl Default for Node {
    fn default() -> Self {
        Node {
            lookups: 0,
            opens: 0,
            pt_opens: 0,
            cache_stamp: NO_STAMP,
            open: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BodyStamp {
    size: u64,
    mtime: Nanos,
    ctime: Nanos,
}

/// The end of a write of `len` bytes at `offset`, or EFBIG past the largest file size.
fn write_end(offset: u64, len: u64) -> FsResult<u64> {
    offset
        .checked_add(len)
        .filter(|e| *e <= i64::MAX as u64)
        .ok_or(FsError::Io(io::Error::from_raw_os_error(libc::EFBIG)))
}

/// Copies bytes `[off_in, off_in + len)` of body `src` to `off_out` in body `dst`, inside
/// the kernel where it can (`copy_file_range(2)`), else through a buffer. Past the end of
/// `src` (a body shorter than its file) the bytes are zeros, as `read` serves them.
fn copy_body_range(src: &File, off_in: u64, dst: &File, off_out: u64, len: u64) -> io::Result<()> {
    const PIECE: u64 = 1 << 20;
    let mut done = 0u64;
    let mut in_kernel = true;
    let mut buf = Vec::new();
    while done < len {
        let (at_in, at_out) = (off_in + done, off_out + done);
        let n = if in_kernel {
            let want = (len - done).min(1 << 30) as usize;
            match sys::file::copy_range(src, at_in, dst, at_out, want) {
                Ok(n) => n as u64,
                Err(e) if copy_unsupported(&e) => {
                    in_kernel = false;
                    continue;
                }
                Err(e) => return Err(e),
            }
        } else {
            buf.resize((len - done).min(PIECE) as usize, 0);
            let n = src.read_at(&mut buf, at_in)?;
            dst.write_all_at(&buf[..n], at_out)?;
            n as u64
        };
        if n == 0 {
            break;
        }
        done += n;
    }
    let zeros = vec![0u8; (len - done).min(PIECE) as usize];
    while done < len {
        let n = (len - done).min(PIECE) as usize;
        dst.write_all_at(&zeros[..n], off_out + done)?;
        done += n as u64;
    }
    Ok(())
}

/// `copy_file_range(2)` cannot copy between these two files (another filesystem, or one
/// that does not support it): copy through a buffer instead.
fn copy_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS)
    )
}

/// Fills `buf` (zeroed by the caller) from body `f` at `offset`. A body shorter than its
/// file reads as zeros (sparse tail): those bytes of `buf` stay as they are.
fn read_body(f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64)? {
            0 => break,
            n => done += n,
        }
    }
    Ok(())
}

fn body_stamp(f: &File) -> io::Result<BodyStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata()?;
    Ok(BodyStamp {
        size: m.len(),
        mtime: Nanos(m.mtime() * 1_000_000_000 + m.mtime_nsec()),
        ctime: Nanos(m.ctime() * 1_000_000_000 + m.ctime_nsec()),
    })
}

enum Handle {
    File { ino: InodeNo, passthrough: bool },
    Dir { entries: Vec<DirEntry> },
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
    /// When the free space of the state volume was last looked at (group commit pauses
    /// while it is low).
    space_checked: Option<std::time::Instant>,
}

/// The body of a deleted inode goes to the pool (or away when the pool is full).
fn discard_body(pool: &BodyPool, id: u64) {
    if let Err(e) = pool.recycle(id) {
        tracing::warn!(ino = id, error = %e, "cannot remove a body file");
    }
}

/// Below this much free space on the state volume every operation commits on its own, so
/// that a full disk fails the one operation (which may then use the reserve), never a
/// group of acknowledged ones.
const LOW_SPACE: u64 = 256 << 20;

/// Closed files kept loaded at most (see `WorkspaceFs::linger`): each may hold a body open.
pub const LINGER_MAX: usize = 64;

/// When the open metadata group is committed.
const GROUP: GroupLimits = GroupLimits {
    max_age: Duration::from_millis(20),
    max_ops: 256,
};

impl Inner {
    /// Commits the open group; then its deleted inodes' bodies can go.
    fn commit_group(&mut self, chunk_size: u64) -> Result<(), MetaError> {
        let r = self.store.commit_group();
        self.recover_if_lost(chunk_size);
        self.discard_committed();
        r
    }

    /// Commits the open group, then makes everything committed durable.
    fn sync(&mut self, chunk_size: u64) -> Result<(), MetaError> {
        self.commit_group(chunk_size)?;
        self.store.sync()
    }

    /// Once no group holds their changes any more: sends the bodies of deleted inodes to
    /// the discard thread, and lets the bodies of files that went back inline go to the
    /// pool (the committer thread moves them, `BodyPool::recycle_released`).
    fn discard_committed(&mut self) {
        if !self.store.group_open() {
            for id in std::mem::take(&mut self.discard_after_commit) {
                self.discard_now(id);
            }
            self.pool.release_held();
        }
    }

    fn discard_now(&self, id: u64) {
        let sent = self
            .discard
            .as_ref()
            .map(|s| s.send(id).is_ok())
            .unwrap_or(false);
        if !sent {
            discard_body(&self.pool, id);
        }
    }

    /// After SQLite rolled back an open group (a full disk at commit): what memory took as
    /// committed is not. Open files are written again in full at their next flush; deleted
    /// inodes keep their bodies.
    fn recover_if_lost(&mut self, chunk_size: u64) {
        if !self.store.take_group_lost() {
            return;
        }
        tracing::error!("a metadata commit failed: operations since the last commit are lost");
        self.discard_after_commit.clear();
        self.pool.keep_held();
        self.no_xattrs.clear();
        for of in self.nodes.values_mut().filter_map(|n| n.open.as_mut()) {
            let size = of.inode.size;
            of.touch(0, size, chunk_size);
        }
    }
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

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        let chunk = self.fs.opts.chunk_size;
        let inner: &mut Inner = &mut self.g;
        if inner.store.group_due(GROUP) {
            if let Err(e) = inner.commit_group(chunk) {
                if inner.store.group_open() && self.fs.reserve.release() {
                    tracing::warn!(error = %e, "state volume is full: using the metadata reserve");
                    if let Err(e) = inner.commit_group(chunk) {
                        tracing::error!(error = %e, "cannot commit metadata");
                    }
                } else {
                    tracing::error!(error = %e, "cannot commit metadata");
                }
            }
        }
        inner.recover_if_lost(chunk);
        inner.discard_committed();
        if !inner.store.group_open()
            && inner
                .space_checked
                .is_none_or(|t| t.elapsed() >= GROUP.max_age)
        {
            inner.space_checked = Some(std::time::Instant::now());
            let low = sys::file::statvfs(&self.fs.state_dir)
                .map(|s| s.blocks_avail.saturating_mul(s.fragment_size) < LOW_SPACE)
                .unwrap_or(true);
            inner.store.pause_group_commit(low);
        }
    }
}

/// Commits the open group once it is due when no operation comes along to do it. Parked
/// while no group is open; woken by the store when one begins.
fn committer(inner: Weak<Mutex<Inner>>, stop: Arc<AtomicBool>, chunk_size: u64) {
    loop {
        std::thread::park();
        loop {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let (wait, pool) = {
                let mut g = inner.lock().unwrap_or_else(|p| p.into_inner());
                let wait = match g.store.group_due_in(GROUP.max_age) {
                    None => None,
                    Some(d) if !d.is_zero() => Some(d),
                    Some(_) => {
                        if let Err(e) = g.commit_group(chunk_size) {
                            tracing::warn!(error = %e, "cannot commit metadata; retrying");
                        }
                        Some(GROUP.max_age)
                    }
                };
                (wait, g.pool.clone())
            };
            drop(inner);
            // Off the request path, with no lock held: this thread is awake anyway.
            pool.recycle_released();
            let Some(wait) = wait else {
                break;
            };
            std::thread::park_timeout(wait);
        }
    }
}

/// One metadata transaction. In-memory copies of open files are only updated once it
/// commits, so a failed commit (a full disk) leaves memory and store agreeing.
struct Batch<'a> {
    tx: Tx<'a>,
    saved: Vec<Inode>,
}

impl<'a> Batch<'a> {
    fn new(store: &'a Store) -> FsResult<Batch<'a>> {
        Ok(Batch {
            tx: store.write()?,
            saved: Vec::new(),
        })
    }

    /// Writes an inode (and, for an open file, its inline bytes and dirty windows).
    fn save(&mut self, nodes: &NodeMap<Node>, inode: &Inode) -> FsResult<()> {
        if let Some(of) = nodes.get(&inode.ino).and_then(|n| n.open.as_ref()) {
            if inode.storage == Storage::Body {
                of.name_body()?;
            }
        }
        self.tx.update(inode)?;
        if let Some(of) = nodes.get(&inode.ino).and_then(|n| n.open.as_ref()) {
            if let Data::Inline(bytes) = &of.data {
                self.tx.set_inline_data(inode.ino, bytes)?;
            }
            if !of.windows.is_empty() {
                self.tx
                    .mark_dirty_windows(inode.ino, of.windows.iter().copied())?;
            }
        }
        self.saved.push(inode.clone());
        Ok(())
    }

    fn commit(self, nodes: &mut NodeMap<Node>) -> FsResult<()> {
        self.tx.commit()?;
        for inode in self.saved {
            if let Some(of) = nodes.get_mut(&inode.ino).and_then(|n| n.open.as_mut()) {
                of.inode = inode;
                of.dirty = false;
                of.windows.clear();
            }
        }
        Ok(())
    }
}

impl<'a> std::ops::Deref for Batch<'a> {
    type Target = Tx<'a>;
    fn deref(&self) -> &Tx<'a> {
        &self.tx
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
    _boot_reserve: Reserve,
    /// Runs after every successful fsync, with no lock held (`[persist] fsync = "remote"`).
    fsync_hook: std::sync::OnceLock<FsyncHook>,
    discarder: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Keeps the body pool stocked with empty files (`BodyPool::run_filler`).
    filler: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Windows of lazily restored bodies not fetched yet.
    lazy: lazy::Lazy,
    /// The group commit timer thread, and what tells it to end.
    committer: std::thread::Thread,
    committer_stop: Arc<AtomicBool>,
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
pub type FsyncHook = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Most inodes remembered as having no xattrs (the set starts over when full, emptied of
/// its memory too: at 1 << 20 it held 18 MiB at a million files; a miss costs one row read).
const NO_XATTRS_MAX: usize = 1 << 16;
/// The xattr the kernel probes before writes and that `drop_setid` drops.
const CAPABILITY_XATTR: &[u8] = b"security.capability";

/// Space kept free for metadata commits on a full volume.
const RESERVE_BYTES: u64 = 1 << 20;

/// Waits for a background thread that was told to end (once: the handle is taken).
fn join_thread(slot: &Mutex<Option<std::thread::JoinHandle<()>>>) {
    if let Some(t) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
        let _ = t.join();
    }
}

/// Current time in nanoseconds since the epoch.
/// The set-ID bits of a regular file (mode `perm`, group `gid`) that `loss` by a caller with
/// `creds` clears, as Linux does for ext4 (`chown_common`, `setattr_should_drop_suidgid`):
/// chown always clears set-user-ID; set-group-ID goes when the group may execute or the
/// caller is neither in the file's group nor holds CAP_FSETID. A write or truncate clears the
/// same bits, but only for a caller without CAP_FSETID.
pub fn setid_lost(perm: u32, gid: u32, loss: SetIdLoss, creds: &sys::creds::Creds) -> u32 {
    if matches!(loss, SetIdLoss::Modify(_)) && creds.fsetid {
        return 0;
    }
    let mut lost = perm & libc::S_ISUID;
    if perm & libc::S_ISGID != 0
        && (perm & libc::S_IXGRP != 0 || !(creds.fsetid || creds.groups.contains(&gid)))
    {
        lost |= libc::S_ISGID;
    }
    lost
}

pub fn now() -> Nanos {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Nanos(d.as_nanos() as i64)
}

fn check_name(name: &[u8]) -> FsResult<()> {
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    if name.is_empty() || name.contains(&b'/') || name == b"." || name == b".." {
        return Err(FsError::Invalid);
    }
    Ok(())
}

impl WorkspaceFs {
    /// Opens the state directory (which must already be locked by the caller), removing
    /// inodes that were unlinked while open when keel last stopped.
    pub fn new(state_dir: &Path, opts: FsOptions) -> Result<WorkspaceFs, FsError> {
        // Space held back for opening the store (WAL recovery) even on a volume that filled
        // up while keel last ran: given back only if opening fails, retaken once open.
        let boot_reserve = state_dir.join("reserve.boot");
        let db = state_dir.join("meta.db");
        let store = match Store::open(&db, now()) {
            Ok(s) => s,
            // A foreign or corrupt store is refused as it is: nothing in the dir is touched.
            Err(e @ MetaError::Foreign { .. }) => return Err(e.into()),
            Err(first) if boot_reserve.exists() => {
                tracing::warn!(error = %first, "cannot open the store; retrying with the space reserve");
                File::options()
                    .write(true)
                    .open(&boot_reserve)?
                    .set_len(0)?;
                Store::open(&db, now())?
            }
            Err(e) => return Err(e.into()),
        };
        let boot_reserve = Reserve::open(&boot_reserve, RESERVE_BYTES);
        let bodies = BodyStore::open(&state_dir.join("bodies"))
            .map_err(|e| FsError::Io(io::Error::other(e.to_string())))?;
        let pool = Arc::new(
            BodyPool::open(&bodies).map_err(|e| FsError::Io(io::Error::other(e.to_string())))?,
        );
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
            space_checked: None,
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
            reserve: Reserve::open(&state_dir.join("reserve"), RESERVE_BYTES),
            _boot_reserve: boot_reserve,
            state_dir: state_dir.to_path_buf(),
            opts,
        })
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

    // ----- inode helpers (called with the lock held) -----

    fn load(inner: &Inner, ino: InodeNo) -> FsResult<Inode> {
        if let Some(of) = inner.nodes.get(&ino).and_then(|n| n.open.as_ref()) {
            return Ok(of.inode.clone());
        }
        inner.store.read().get(ino)?.ok_or(FsError::NotFound)
    }

    /// A directory's inode: from the directory cache (kept current by every commit of the
    /// store), else from the store, and then cached. Every lookup, create and unlink starts
    /// with its parent; reading that row from SQLite each time was most of a lookup's cost.
    fn load_dir(inner: &Inner, ino: InodeNo) -> FsResult<Inode> {
        let dirs = inner.store.dir_cache();
        if let Some(i) = dirs.get(ino) {
            return Ok(i);
        }
        let i = Self::load(inner, ino)?;
        if i.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        dirs.put(&i);
        Ok(i)
    }

    fn attr(&self, inode: Inode, body: Option<&File>) -> FsResult<Attr> {
        let blocks = match (inode.kind, inode.storage) {
            (Kind::File, Storage::Body) => {
                use std::os::unix::fs::MetadataExt;
                match body {
                    Some(f) => f.metadata()?.blocks(),
                    None => self.bodies.stat(inode.ino.0)?.map(|(_, b)| b).unwrap_or(0),
                }
            }
            _ => inode.size.div_ceil(512),
        };
        Ok(Attr { inode, blocks })
    }

    /// Picks up what the kernel wrote through passthrough handles: size and times from the
    /// body, and every window marked dirty (the written ranges are unknown).
    fn sync_from_body(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let chunk = self.opts.chunk_size;
        let Some(node) = inner.nodes.get_mut(&ino) else {
            return Ok(());
        };
        let Some(of) = node.open.as_mut() else {
            return Ok(());
        };
        let Some(base) = of.pt_base else {
            return Ok(());
        };
        let Data::Body(f) = &of.data else {
            return Ok(());
        };
        let now_stamp = body_stamp(f)?;
        if now_stamp != base {
            of.inode.size = now_stamp.size;
            if now_stamp.mtime != base.mtime {
                of.inode.mtime = now_stamp.mtime;
            }
            of.inode.ctime = of.inode.ctime.max(now_stamp.ctime);
            of.touch(0, now_stamp.size, chunk);
            of.pt_base = Some(now_stamp);
        }
        Ok(())
    }

    /// Re-reads the body stamp after keel itself changed a passthrough file, so its own
    /// change is not mistaken for a kernel write.
    fn rebase(inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        if let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) {
            if of.pt_base.is_some() {
                if let Data::Body(f) = &of.data {
                    of.pt_base = Some(body_stamp(f)?);
                }
            }
        }
        Ok(())
    }

    /// Attributes as the kernel must see them: first picks up passthrough writes, so that no
    /// reply (lookup, readdirplus, ...) hands the kernel a stale size.
    fn fresh_attr(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<Attr> {
        self.sync_from_body(inner, ino)?;
        self.attr_locked(inner, ino)
    }

    fn attr_locked(&self, inner: &Inner, ino: InodeNo) -> FsResult<Attr> {
        let inode = Self::load(inner, ino)?;
        let body = inner
            .nodes
            .get(&ino)
            .and_then(|n| n.open.as_ref())
            .and_then(|of| match &of.data {
                Data::Body(f) => Some(f.clone()),
                Data::Inline(_) => None,
            });
        self.attr(inode, body.as_deref())
    }

    fn remember(inner: &mut Inner, ino: InodeNo) {
        inner.nodes.entry(ino).or_default().lookups += 1;
    }

    /// Deletes an inode that has no links and nobody using it.
    fn purge(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        // A body still under its pool name goes back there; nothing is at the file's name.
        let provisional = inner
            .nodes
            .get(&ino)
            .and_then(|n| n.open.as_ref())
            .is_some_and(|of| of.drop_provisional());
        let had_body = !provisional
            && Self::load(inner, ino)
                .map(|i| i.storage == Storage::Body)
                .unwrap_or(true);
        let tx = Batch::new(&inner.store)?;
        tx.delete(ino)?;
        tx.commit(&mut inner.nodes)?;
        inner.nodes.remove(&ino);
        if had_body {
            Self::discard_body(inner, ino);
        }
        Ok(())
    }

    /// Removes a body file off the request path once its inode's deletion is committed
    /// (inode numbers are never reused, so no new body can take its name meanwhile).
    fn discard_body(inner: &mut Inner, ino: InodeNo) {
        if inner.store.group_open() {
            inner.discard_after_commit.push(ino.0);
        } else {
            inner.discard_now(ino.0);
        }
    }

    /// Whether any handle has the inode open (open-unlinked files must stay).
    fn is_open(inner: &Inner, ino: InodeNo) -> bool {
        inner.nodes.get(&ino).is_some_and(|n| n.opens > 0)
    }

    fn new_inode(caller: Caller, parent: &Inode, kind: Kind, perm: u32, rdev: u32) -> Inode {
        let t = now();
        let (gid, perm) = if parent.perm & libc::S_ISGID != 0 {
            let perm = if kind == Kind::Dir {
                perm | libc::S_ISGID
            } else {
                perm
            };
            (parent.gid, perm)
        } else {
            (caller.gid, perm)
        };
        Inode {
            ino: InodeNo(0),
            kind,
            perm: perm & 0o7777,
            uid: caller.uid,
            gid,
            nlink: if kind == Kind::Dir { 2 } else { 1 },
            size: 0,
            atime: t,
            mtime: t,
            ctime: t,
            rdev,
            parent: parent.ino,
            storage: Storage::Inline,
        }
    }

    /// Loads the bytes of a regular file into its node so data operations can work on it.
    fn ensure_open(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        if inner.nodes.get(&ino).is_some_and(|n| n.open.is_some()) {
            return Ok(());
        }
        let inode = inner.store.read().get(ino)?.ok_or(FsError::NotFound)?;
        match inode.kind {
            Kind::File => {}
            Kind::Dir => return Err(FsError::IsDir),
            _ => return Err(FsError::Invalid),
        }
        let data = match inode.storage {
            Storage::Inline => Data::Inline(inner.store.read().inline_data(ino)?),
            Storage::Body => {
                let f = self.bodies.open_rw(ino.0)?;
                // The body may disagree with the committed size after a crash: the store
                // is the truth (bytes past it were never acknowledged).
                if f.metadata()?.len() != inode.size {
                    f.set_len(inode.size)?;
                }
                Data::Body(Arc::new(f))
            }
        };
        let mut data = data;
        if let Data::Inline(v) = &mut data {
            v.resize(inode.size as usize, 0);
        }
        inner.nodes.entry(ino).or_default().open = Some(Box::new(OpenFile {
            inode,
            data,
            dirty: false,
            windows: BTreeSet::new(),
            provisional: std::cell::Cell::new(None),
            pt_base: None,
            pt_body: false,
        }));
        Ok(())
    }

    /// Writes back and drops the loaded bytes of a file nobody has open.
    fn settle(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let Some(node) = inner.nodes.get_mut(&ino) else {
            return Ok(());
        };
        if node.opens > 0 {
            return Ok(());
        }
        let inlined = self.back_inline(node)?;
        Self::write_back(inner, ino)?;
        // Only once the store says inline may the body go (after its group commits).
        if inlined {
            self.pool.hold(ino.0);
        }
        let node = inner.nodes.get_mut(&ino).expect("node present");
        if let Some(of) = &node.open {
            node.cache_stamp = (of.inode.mtime, of.inode.size);
        }
        if node.lookups > 0 && node.open.as_ref().is_some_and(|of| of.may_linger()) {
            self.linger(inner, ino);
        } else {
            node.open = None;
        }
        let node = inner.nodes.get_mut(&ino).expect("node present");
        if node.lookups == 0 {
            let inode = inner.store.read().get(ino)?;
            // The table gives its memory back by itself (see `nodes`).
            inner.nodes.remove(&ino);
            // Already deleted (unlinked while nobody had it open) or still linked: done.
            if inode.is_some_and(|i| i.nlink == 0) {
                self.purge(inner, ino)?;
            }
        }
        Ok(())
    }

    /// Keeps a closed file loaded (its row, its open body) for the next open, getattr or
    /// lookup: `cat >> log`, a compiler or `git add` open the same files again and again,
    /// and loading one costs a row read, an `openat` and a `statx`. At most `LINGER_MAX`
    /// files linger; the longest-closed one is written back (if anything is pending) and
    /// dropped to make room. Unlink and forget drop a lingering file like a closed one.
    fn linger(&self, inner: &mut Inner, ino: InodeNo) {
        if let Some(i) = inner.lingering.iter().position(|&x| x == ino) {
            inner.lingering.remove(i);
        }
        inner.lingering.push_back(ino);
        while inner.lingering.len() > LINGER_MAX {
            let Some(old) = inner.lingering.pop_front() else {
                break;
            };
            if let Err(e) = self.unload(inner, old) {
                tracing::warn!(ino = old.0, error = %e, "cannot write back a closed file");
            }
        }
    }

    /// Drops the loaded bytes of a closed file, first saving what is pending (only after
    /// a lost group commit, see `recover_if_lost`, does a closed file have any).
    fn unload(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let Some(node) = inner.nodes.get_mut(&ino) else {
            return Ok(());
        };
        if node.opens > 0 {
            return Ok(());
        }
        Self::write_back(inner, ino)?;
        if let Some(node) = inner.nodes.get_mut(&ino) {
            node.open = None;
        }
        Ok(())
    }

    /// Saves and commits a loaded file's pending attributes, bytes (inline) and dirty
    /// windows; nothing when it has none or is not loaded.
    fn write_back(inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let inode = match inner.nodes.get(&ino).and_then(|n| n.open.as_ref()) {
            Some(of) if of.dirty => of.inode.clone(),
            _ => return Ok(()),
        };
        let mut tx = Batch::new(&inner.store)?;
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)
    }

    /// A file that took a body only to be passed through (see `open_as`) and stayed small
    /// goes back inline once nobody has it open: small files live in the store. Returns
    /// whether it did; its body may go back to the pool once that is saved and committed.
    fn back_inline(&self, node: &mut Node) -> FsResult<bool> {
        let Some(of) = node.open.as_mut() else {
            return Ok(false);
        };
        if !std::mem::take(&mut of.pt_body) {
            return Ok(false);
        }
        let Data::Body(f) = &of.data else {
            return Ok(false);
        };
        // An unlinked file is about to be deleted with its body.
        if of.inode.size > self.opts.inline_max || of.inode.nlink == 0 {
            return Ok(false);
        }
        let mut bytes = vec![0u8; of.inode.size as usize];
        read_body(f, &mut bytes, 0)?;
        of.data = Data::Inline(bytes);
        of.inode.storage = Storage::Inline;
        of.dirty = true;
        // No page of it is in the kernel's cache: the passthrough open dropped them (it
        // keeps no cache), and no cached open could join a passthrough one since.
        // A body that never got the file's name goes straight back to the pool.
        Ok(!of.drop_provisional())
    }

    /// Moves an inline file's bytes into a fresh body file.
    fn to_body(&self, of: &mut OpenFile) -> FsResult<()> {
        if let Data::Inline(bytes) = &of.data {
            let f = match self.pool.take(of.inode.ino.0)? {
                Fresh::Named(f) => f,
                Fresh::Slot(slot, f) => {
                    of.provisional.set(Some(Provisional {
                        slot,
                        pool: self.pool.clone(),
                    }));
                    f
                }
            };
            f.write_all_at(bytes, 0)?;
            // Only to grow it: ext4 flushes a file at close once it was truncated to zero.
            if of.inode.size > bytes.len() as u64 {
                f.set_len(of.inode.size)?;
            }
            of.data = Data::Body(Arc::new(f));
            of.inode.storage = Storage::Body;
            of.dirty = true;
        }
        Ok(())
    }

    /// Sets the size of an open file's bytes.
    fn resize(&self, of: &mut OpenFile, size: u64) -> FsResult<()> {
        if size > self.opts.inline_max {
            self.to_body(of)?;
        }
        match &mut of.data {
            Data::Inline(v) => v.resize(size as usize, 0),
            Data::Body(f) => f.set_len(size)?,
        }
        let (lo, hi) = (of.inode.size.min(size), of.inode.size.max(size));
        of.touch(lo, hi, self.opts.chunk_size);
        of.inode.size = size;
        Ok(())
    }

    // ----- namespace -----

    pub fn lookup(&self, parent: InodeNo, name: &[u8]) -> FsResult<Attr> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let p = Self::load_dir(inner, parent)?;
        let ino = match name {
            b"." => parent,
            b".." => p.parent,
            _ => {
                inner
                    .store
                    .read()
                    .lookup(parent, name)?
                    .ok_or(FsError::NotFound)?
                    .ino
            }
        };
        let attr = self.fresh_attr(inner, ino)?;
        Self::remember(inner, ino);
        Ok(attr)
    }

    pub fn forget(&self, ino: InodeNo, n: u64) {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let Some(node) = inner.nodes.get_mut(&ino) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if node.lookups == 0 && node.opens == 0 {
            if let Err(e) = self.settle(inner, ino) {
                tracing::warn!(ino = ino.0, error = %e, "forget: could not settle inode");
            }
        }
    }

    pub fn getattr(&self, ino: InodeNo) -> FsResult<Attr> {
        // A directory's attributes are a function of its row alone: no lock needed.
        if let Some(inode) = self.dirs.get(ino) {
            return self.attr(inode, None);
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let a = self.fresh_attr(inner, ino)?;
        self.dirs.put(&a.inode);
        Ok(a)
    }

    pub fn setattr(&self, ino: InodeNo, set: &SetAttr) -> FsResult<Attr> {
        self.freeing(|| self.setattr_once(ino, set))
    }

    fn setattr_once(&self, ino: InodeNo, set: &SetAttr) -> FsResult<Attr> {
        if let Some(size) = set.size {
            self.lazy_prepare_truncate(ino, size)?;
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        self.sync_from_body(inner, ino)?;
        if let Some(loss) = set.drop_setid {
            Self::kill_privs_locked(inner, ino, loss)?;
        }
        let t = now();
        if let Some(size) = set.size {
            // Loads the bytes; refuses directories (EISDIR) and special files (EINVAL).
            self.ensure_open(inner, ino)?;
            self.lazy_drop_from(inner, ino, size)?;
            let of = inner
                .nodes
                .get_mut(&ino)
                .and_then(|n| n.open.as_mut())
                .expect("loaded");
            if size != of.inode.size {
                self.resize(of, size)?;
            }
            // truncate(2) updates mtime and ctime even when the size does not change.
            of.inode.mtime = t;
            of.inode.ctime = t;
        }
        let mut inode = Self::load(inner, ino)?;
        if let Some(mode) = set.mode {
            inode.perm = mode & 0o7777;
        }
        if let Some(uid) = set.uid {
            inode.uid = uid;
        }
        if let Some(gid) = set.gid {
            inode.gid = gid;
        }
        match set.atime {
            Some(SetTime::Now) => inode.atime = t,
            Some(SetTime::At(x)) => inode.atime = x,
            None => {}
        }
        match set.mtime {
            Some(SetTime::Now) => inode.mtime = t,
            Some(SetTime::At(x)) => inode.mtime = x,
            None => {}
        }
        inode.ctime = set.ctime.unwrap_or(t);
        let mut tx = Batch::new(&inner.store)?;
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        if set.size.is_some() {
            Self::rebase(inner, ino)?;
            self.settle(inner, ino)?;
        }
        self.fresh_attr(inner, ino)
    }

    pub fn readlink(&self, ino: InodeNo) -> FsResult<Vec<u8>> {
        let guard = self.lock();
        let inner: &Inner = &guard;
        let i = Self::load(inner, ino)?;
        if i.kind != Kind::Symlink {
            return Err(FsError::Invalid);
        }
        let target = inner.store.read().symlink_target(ino)?;
        target.ok_or(FsError::NotFound)
    }

    /// Creates a new inode named `name` in `parent` and returns its attributes.
    fn make(&self, caller: Caller, parent: InodeNo, name: &[u8], new: New<'_>) -> FsResult<Attr> {
        let New {
            kind,
            perm,
            rdev,
            target,
        } = new;
        check_name(name)?;
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let mut p = Self::load_dir(inner, parent)?;
        if p.nlink == 0 {
            return Err(FsError::NotFound);
        }
        if inner.store.read().lookup(parent, name)?.is_some() {
            return Err(FsError::Exists);
        }
        let mut inode = Self::new_inode(caller, &p, kind, perm, rdev);
        if let Some(t) = target {
            inode.size = t.len() as u64;
        }
        let t = inode.ctime;
        let mut tx = Batch::new(&inner.store)?;
        inode.ino = tx.insert(&inode)?;
        tx.link(parent, name, inode.ino, kind)?;
        if let Some(target) = target {
            tx.set_symlink_target(inode.ino, target)?;
        }
        if kind == Kind::Dir {
            p.nlink += 1;
        }
        p.mtime = t;
        p.ctime = t;
        tx.save(&inner.nodes, &p)?;
        tx.commit(&mut inner.nodes)?;
        Self::remember(inner, inode.ino);
        self.attr(inode, None)
    }

    pub fn mknod(
        &self,
        caller: Caller,
        parent: InodeNo,
        name: &[u8],
        mode: u32,
        rdev: u32,
    ) -> FsResult<Attr> {
        let kind = Kind::from_mode(mode).unwrap_or(Kind::File);
        if kind == Kind::Dir || kind == Kind::Symlink {
            return Err(FsError::Invalid);
        }
        let rdev = if matches!(kind, Kind::CharDev | Kind::BlockDev) {
            rdev
        } else {
            0
        };
        self.make(
            caller,
            parent,
            name,
            New {
                kind,
                perm: mode & 0o7777,
                rdev,
                target: None,
            },
        )
    }

    pub fn mkdir(&self, caller: Caller, parent: InodeNo, name: &[u8], mode: u32) -> FsResult<Attr> {
        self.make(
            caller,
            parent,
            name,
            New {
                kind: Kind::Dir,
                perm: mode & 0o7777,
                rdev: 0,
                target: None,
            },
        )
    }

    pub fn symlink(
        &self,
        caller: Caller,
        parent: InodeNo,
        name: &[u8],
        target: &[u8],
    ) -> FsResult<Attr> {
        if target.len() >= PATH_MAX {
            return Err(FsError::NameTooLong);
        }
        if target.is_empty() {
            return Err(FsError::NotFound);
        }
        self.make(
            caller,
            parent,
            name,
            New {
                kind: Kind::Symlink,
                perm: 0o777,
                rdev: 0,
                target: Some(target),
            },
        )
    }

    pub fn unlink(&self, parent: InodeNo, name: &[u8]) -> FsResult<()> {
        self.freeing(|| self.remove(parent, name, false))
    }

    pub fn rmdir(&self, parent: InodeNo, name: &[u8]) -> FsResult<()> {
        match name {
            b"." => return Err(FsError::Invalid),
            b".." => return Err(FsError::NotEmpty),
            _ => {}
        }
        self.freeing(|| self.remove(parent, name, true))
    }

    fn remove(&self, parent: InodeNo, name: &[u8], dir: bool) -> FsResult<()> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let mut p = Self::load_dir(inner, parent)?;
        let d = inner
            .store
            .read()
            .lookup(parent, name)?
            .ok_or(FsError::NotFound)?;
        let mut child = Self::load(inner, d.ino)?;
        let t = now();
        if dir {
            if child.kind != Kind::Dir {
                return Err(FsError::NotDir);
            }
            if !inner.store.read().dir_is_empty(d.ino)? {
                return Err(FsError::NotEmpty);
            }
            child.nlink = 0;
            p.nlink -= 1;
        } else {
            if child.kind == Kind::Dir {
                return Err(FsError::IsDir);
            }
            child.nlink -= 1;
        }
        child.ctime = t;
        p.mtime = t;
        p.ctime = t;
        // Nobody has it open: the inode goes in the same transaction as its last name. (The
        // kernel may still hold a lookup reference; `forget` then finds nothing to do.)
        let delete_now = child.nlink == 0 && !Self::is_open(inner, child.ino);
        let mut tx = Batch::new(&inner.store)?;
        tx.unlink(parent, name)?;
        if delete_now {
            tx.delete(child.ino)?;
        } else {
            tx.save(&inner.nodes, &child)?;
        }
        tx.save(&inner.nodes, &p)?;
        tx.commit(&mut inner.nodes)?;
        if delete_now {
            if let Some(n) = inner.nodes.get_mut(&child.ino) {
                n.open = None;
            }
            if child.storage == Storage::Body {
                Self::discard_body(inner, child.ino);
            }
        }
        Ok(())
    }

    pub fn link(&self, ino: InodeNo, newparent: InodeNo, newname: &[u8]) -> FsResult<Attr> {
        check_name(newname)?;
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let mut inode = Self::load(inner, ino)?;
        if inode.kind == Kind::Dir {
            return Err(FsError::NotPermitted);
        }
        if inode.nlink == 0 {
            return Err(FsError::NotFound);
        }
        if inode.nlink >= LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        let mut p = Self::load_dir(inner, newparent)?;
        if inner.store.read().lookup(newparent, newname)?.is_some() {
            return Err(FsError::Exists);
        }
        let t = now();
        inode.nlink += 1;
        inode.ctime = t;
        p.mtime = t;
        p.ctime = t;
        let mut tx = Batch::new(&inner.store)?;
        tx.link(newparent, newname, ino, inode.kind)?;
        tx.save(&inner.nodes, &inode)?;
        tx.save(&inner.nodes, &p)?;
        tx.commit(&mut inner.nodes)?;
        Self::remember(inner, ino);
        self.fresh_attr(inner, ino)
    }

    /// Is `dir` equal to `ancestor` or below it?
    fn is_within(inner: &Inner, mut dir: InodeNo, ancestor: InodeNo) -> FsResult<bool> {
        loop {
            if dir == ancestor {
                return Ok(true);
            }
            if dir == InodeNo::ROOT {
                return Ok(false);
            }
            dir = Self::load(inner, dir)?.parent;
        }
    }

    pub fn rename(
        &self,
        parent: InodeNo,
        name: &[u8],
        newparent: InodeNo,
        newname: &[u8],
        flags: u32,
    ) -> FsResult<()> {
        self.freeing(|| self.rename_once(parent, name, newparent, newname, flags))
    }

    fn rename_once(
        &self,
        parent: InodeNo,
        name: &[u8],
        newparent: InodeNo,
        newname: &[u8],
        flags: u32,
    ) -> FsResult<()> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        check_name(newname)?;
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0
            || flags == RENAME_NOREPLACE | RENAME_EXCHANGE
        {
            return Err(FsError::Invalid);
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        Self::load_dir(inner, parent)?;
        Self::load_dir(inner, newparent)?;
        let src = inner
            .store
            .read()
            .lookup(parent, name)?
            .ok_or(FsError::NotFound)?;
        let dst = inner.store.read().lookup(newparent, newname)?;
        let t = now();

        if flags & RENAME_EXCHANGE != 0 {
            let dst = dst.ok_or(FsError::NotFound)?;
            return self.exchange(inner, parent, &src, newparent, &dst, t);
        }
        if let Some(d) = &dst {
            if flags & RENAME_NOREPLACE != 0 {
                return Err(FsError::Exists);
            }
            if d.ino == src.ino {
                // Two links to the same inode: POSIX says do nothing.
                return Ok(());
            }
        }
        let mut s = Self::load(inner, src.ino)?;
        if s.kind == Kind::Dir && newparent != parent && Self::is_within(inner, newparent, src.ino)?
        {
            return Err(FsError::Invalid);
        }
        let mut victim = None;
        if let Some(d) = &dst {
            let mut v = Self::load(inner, d.ino)?;
            match (s.kind == Kind::Dir, v.kind == Kind::Dir) {
                (true, false) => return Err(FsError::NotDir),
                (false, true) => return Err(FsError::IsDir),
                (true, true) => {
                    if !inner.store.read().dir_is_empty(d.ino)? {
                        return Err(FsError::NotEmpty);
                    }
                    v.nlink = 0;
                }
                (false, false) => v.nlink -= 1,
            }
            v.ctime = t;
            victim = Some(v);
        }

        let mut tx = Batch::new(&inner.store)?;
        tx.unlink(parent, name)?;
        if dst.is_some() {
            tx.relink(newparent, newname, src.ino, s.kind)?;
        } else {
            tx.link(newparent, newname, src.ino, s.kind)?;
        }
        s.ctime = t;
        if s.kind == Kind::Dir {
            s.parent = newparent;
        }
        tx.save(&inner.nodes, &s)?;
        if let Some(v) = &victim {
            tx.save(&inner.nodes, v)?;
        }
        // Parents last, so their nlink reflects every change above.
        let mut p = Self::load(inner, parent)?;
        let victim_dir = victim.as_ref().is_some_and(|v| v.kind == Kind::Dir);
        if parent == newparent {
            if victim_dir {
                p.nlink -= 1;
            }
            p.mtime = t;
            p.ctime = t;
            tx.save(&inner.nodes, &p)?;
        } else {
            let mut np = Self::load(inner, newparent)?;
            if s.kind == Kind::Dir {
                p.nlink -= 1;
                np.nlink += 1;
            }
            if victim_dir {
                np.nlink -= 1;
            }
            p.mtime = t;
            p.ctime = t;
            np.mtime = t;
            np.ctime = t;
            tx.save(&inner.nodes, &p)?;
            tx.save(&inner.nodes, &np)?;
        }
        tx.commit(&mut inner.nodes)?;
        if let Some(v) = victim {
            if v.nlink == 0 && !Self::is_open(inner, v.ino) {
                self.purge(inner, v.ino)?;
            }
        }
        Ok(())
    }

    fn exchange(
        &self,
        inner: &mut Inner,
        parent: InodeNo,
        a: &Dirent,
        newparent: InodeNo,
        b: &Dirent,
        t: Nanos,
    ) -> FsResult<()> {
        if a.ino == b.ino {
            return Ok(());
        }
        let mut ia = Self::load(inner, a.ino)?;
        let mut ib = Self::load(inner, b.ino)?;
        if parent != newparent {
            if ia.kind == Kind::Dir && Self::is_within(inner, newparent, a.ino)? {
                return Err(FsError::Invalid);
            }
            if ib.kind == Kind::Dir && Self::is_within(inner, parent, b.ino)? {
                return Err(FsError::Invalid);
            }
        }
        let mut tx = Batch::new(&inner.store)?;
        tx.relink(parent, &a.name, b.ino, ib.kind)?;
        tx.relink(newparent, &b.name, a.ino, ia.kind)?;
        ia.ctime = t;
        ib.ctime = t;
        if ia.kind == Kind::Dir {
            ia.parent = newparent;
        }
        if ib.kind == Kind::Dir {
            ib.parent = parent;
        }
        tx.save(&inner.nodes, &ia)?;
        tx.save(&inner.nodes, &ib)?;
        let mut p = Self::load(inner, parent)?;
        p.mtime = t;
        p.ctime = t;
        if parent == newparent {
            tx.save(&inner.nodes, &p)?;
        } else {
            let mut np = Self::load(inner, newparent)?;
            let a_dir = i64::from(ia.kind == Kind::Dir);
            let b_dir = i64::from(ib.kind == Kind::Dir);
            p.nlink = (i64::from(p.nlink) - a_dir + b_dir) as u32;
            np.nlink = (i64::from(np.nlink) + a_dir - b_dir) as u32;
            np.mtime = t;
            np.ctime = t;
            tx.save(&inner.nodes, &p)?;
            tx.save(&inner.nodes, &np)?;
        }
        tx.commit(&mut inner.nodes)?;
        Ok(())
    }

    // ----- files -----

    fn open_info(&self, node: &Node, inode: &Inode, flags: i32) -> OpenInfo {
        let direct = flags & libc::O_DIRECT != 0;
        match self.opts.cache {
            CacheMode::None => OpenInfo {
                keep_cache: false,
                direct_io: true,
                backing: None,
            },
            CacheMode::Kernel => OpenInfo {
                keep_cache: true,
                direct_io: direct,
                backing: None,
            },
            CacheMode::Auto => OpenInfo {
                keep_cache: node.cache_stamp == (inode.mtime, inode.size) || node.opens > 1,
                direct_io: direct,
                backing: None,
            },
        }
    }

    fn new_handle(inner: &mut Inner, h: Handle) -> u64 {
        let fh = inner.next_fh;
        inner.next_fh += 1;
        inner.handles.insert(fh, h);
        fh
    }

    pub fn open(&self, ino: InodeNo, flags: i32) -> FsResult<(u64, OpenInfo)> {
        self.open_as(ino, flags, false)
    }

    /// `fresh`: the file was just created. Opened read-write, it starts inline with a handle
    /// through keel (databases read back what they write, through the page cache), so small
    /// files never cost a body file; it moves to a body once it outgrows `inline_max`, and
    /// later opens hand its I/O to the kernel. Opened write-only (what `cp`, `echo >` and
    /// package managers do), it takes a body from the pool and passthrough at once, so its
    /// bytes go straight to the body. Any inline file that takes a body to be passed through
    /// goes back inline at its last close if it stayed small (`back_inline`).
    fn open_as(&self, ino: InodeNo, flags: i32, fresh: bool) -> FsResult<(u64, OpenInfo)> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        self.ensure_open(inner, ino)?;
        if flags & libc::O_TRUNC != 0 && flags & libc::O_ACCMODE != libc::O_RDONLY {
            self.sync_from_body(inner, ino)?;
            self.lazy_drop_from(inner, ino, 0)?;
            let t = now();
            let of = self.file_of(inner, ino)?;
            if of.inode.size != 0 {
                self.resize(of, 0)?;
            }
            of.inode.mtime = t;
            of.inode.ctime = t;
            of.dirty = true;
            Self::rebase(inner, ino)?;
        }
        // The kernel would read the sparse body directly: a file with windows still to
        // fetch is served through keel until it is complete.
        let inode = Self::load(inner, ino)?;
        // A kernel write through a passthrough handle never reaches keel, so nothing would
        // drop setuid/setgid: writers of such files go through keel (unless passthrough
        // handles are open already: the kernel refuses to mix the two).
        let privileged = inode.perm & (libc::S_ISUID | libc::S_ISGID) != 0
            && flags & libc::O_ACCMODE != libc::O_RDONLY;
        let passthrough = self.opts.passthrough.load(Ordering::Relaxed)
            && !self.lazy_incomplete(inner, ino, inode.size)?;
        let node = inner.nodes.get_mut(&ino).expect("loaded");
        let mut backing = None;
        let write_only = flags & libc::O_ACCMODE == libc::O_WRONLY;
        // The kernel refuses to mix cached and passthrough handles on one inode.
        if passthrough
            && (!fresh || write_only)
            && node.opens == node.pt_opens
            && !(privileged && node.opens == 0)
        {
            let of = node.open.as_mut().expect("loaded");
            if flags & libc::O_ACCMODE != libc::O_RDONLY && matches!(of.data, Data::Inline(_)) {
                self.to_body(of)?;
                of.pt_body = true;
            }
            if let Data::Body(f) = &of.data {
                if of.pt_base.is_none() {
                    of.pt_base = Some(body_stamp(f)?);
                }
                backing = Some(f.clone());
                node.pt_opens += 1;
            }
        }
        let pt = backing.is_some();
        node.opens += 1;
        let inode = node.open.as_ref().expect("loaded").inode.clone();
        let mut info = self.open_info(node, &inode, flags);
        if pt {
            info.keep_cache = false;
            info.direct_io = false;
        } else if fresh && self.opts.passthrough.load(Ordering::Relaxed) && write_only {
            // A new write-only file kept from passthrough (setuid): the kernel hands keel the
            // caller's pages instead of copying them into its page cache, which nobody reads
            // from a write-only handle.
            info.direct_io = true;
        }
        info.backing = backing;
        let fh = Self::new_handle(
            inner,
            Handle::File {
                ino,
                passthrough: pt,
            },
        );
        Ok((fh, info))
    }

    pub fn create(
        &self,
        caller: Caller,
        parent: InodeNo,
        name: &[u8],
        mode: u32,
        flags: i32,
    ) -> FsResult<(Attr, u64, OpenInfo)> {
        let attr = self.make(
            caller,
            parent,
            name,
            New {
                kind: Kind::File,
                perm: mode & 0o7777,
                rdev: 0,
                target: None,
            },
        )?;
        let (fh, info) = self.open_as(attr.inode.ino, flags, true)?;
        Ok((attr, fh, info))
    }

    /// Clones what a data operation needs without holding the lock during I/O.
    fn file_of<'a>(&self, inner: &'a mut Inner, ino: InodeNo) -> FsResult<&'a mut OpenFile> {
        self.ensure_open(inner, ino)?;
        self.sync_from_body(inner, ino)?;
        Ok(inner
            .nodes
            .get_mut(&ino)
            .and_then(|n| n.open.as_mut())
            .expect("loaded"))
    }

    pub fn read(&self, ino: InodeNo, offset: u64, size: u32, buf: &mut Vec<u8>) -> FsResult<()> {
        buf.clear();
        self.lazy_fetch(
            ino,
            offset,
            offset.saturating_add(u64::from(size)),
            lazy::READAHEAD_WINDOWS,
        )?;
        let body = {
            let mut guard = self.lock();
            let inner: &mut Inner = &mut guard;
            let of = self.file_of(inner, ino)?;
            if offset >= of.inode.size {
                return Ok(());
            }
            let n = (of.inode.size - offset).min(u64::from(size)) as usize;
            match &of.data {
                Data::Inline(v) => {
                    let o = offset as usize;
                    buf.extend_from_slice(&v[o..o + n]);
                    return Ok(());
                }
                Data::Body(f) => (f.clone(), n),
            }
        };
        let (f, n) = body;
        buf.resize(n, 0);
        read_body(&f, buf, offset)?;
        Ok(())
    }

    pub fn write(&self, ino: InodeNo, offset: u64, data: &[u8]) -> FsResult<u32> {
        if data.is_empty() {
            return Ok(0);
        }
        let end = write_end(offset, data.len() as u64)?;
        let claim = self.lazy_prepare_write(ino, offset, end)?;
        if let Some(f) = self.write_target(ino, offset, end, Some(data))? {
            f.write_all_at(data, offset)?;
            self.finish_write(ino, claim, &f, offset, end)?;
        }
        Ok(data.len() as u32)
    }

    /// Under the lock, before bytes `[offset, end)` are written: moves a file that outgrows
    /// `inline_max` to a body and returns the body, to be written without the lock. An
    /// inline file gets `data` right here and `None` comes back (also without `data`, when
    /// the caller must then write through `write`).
    fn write_target(
        &self,
        ino: InodeNo,
        offset: u64,
        end: u64,
        data: Option<&[u8]>,
    ) -> FsResult<Option<Arc<File>>> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let inline_max = self.opts.inline_max;
        let of = self.file_of(inner, ino)?;
        if end > inline_max {
            self.to_body(of)?;
        }
        match &mut of.data {
            Data::Body(f) => Ok(Some(f.clone())),
            Data::Inline(v) => {
                if let Some(data) = data {
                    if (v.len() as u64) < end {
                        v.resize(end as usize, 0);
                    }
                    v[offset as usize..end as usize].copy_from_slice(data);
                    let t = now();
                    of.inode.size = of.inode.size.max(end);
                    of.inode.mtime = t;
                    of.inode.ctime = t;
                    of.touch(offset, end, self.opts.chunk_size);
                }
                Ok(None)
            }
        }
    }

    /// After bytes `[offset, end)` went into body `f` without the lock: records them.
    fn finish_write(
        &self,
        ino: InodeNo,
        claim: Option<lazy::Claim<'_>>,
        f: &File,
        offset: u64,
        end: u64,
    ) -> FsResult<()> {
        self.lazy_finish_write(claim, f)?;
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        if let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) {
            let t = now();
            of.inode.size = of.inode.size.max(end);
            of.inode.mtime = t;
            of.inode.ctime = t;
            of.touch(offset, end, self.opts.chunk_size);
        }
        Self::rebase(inner, ino)
    }

    /// Commits a file's pending attributes (on close of a descriptor).
    pub fn flush(&self, ino: InodeNo) -> FsResult<()> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        self.sync_from_body(inner, ino)?;
        Self::write_back(inner, ino)
    }

    /// Closes a file handle; returns whether it was a passthrough handle.
    pub fn release(&self, fh: u64) -> FsResult<bool> {
        let (ino, passthrough) = {
            let mut guard = self.lock();
            let inner: &mut Inner = &mut guard;
            let Some(Handle::File { ino, passthrough }) = inner.handles.remove(&fh) else {
                return Err(FsError::BadHandle);
            };
            if let Err(e) = self.sync_from_body(inner, ino) {
                tracing::warn!(ino = ino.0, error = %e, "release: cannot stat the body");
            }
            if let Some(node) = inner.nodes.get_mut(&ino) {
                node.opens = node.opens.saturating_sub(1);
                if passthrough {
                    node.pt_opens = node.pt_opens.saturating_sub(1);
                    if node.pt_opens == 0 {
                        if let Some(of) = node.open.as_mut() {
                            of.pt_base = None;
                        }
                    }
                }
            }
            (ino, passthrough)
        };
        {
            let mut guard = self.lock();
            self.settle(&mut guard, ino)?;
        }
        Ok(passthrough)
    }

    /// Makes a file's bytes and metadata durable.
    pub fn fsync(&self, ino: InodeNo, datasync: bool) -> FsResult<()> {
        let body = {
            let guard = self.lock();
            let inner: &Inner = &guard;
            match inner.nodes.get(&ino).and_then(|n| n.open.as_deref()) {
                Some(
                    of @ OpenFile {
                        data: Data::Body(f),
                        ..
                    },
                ) => {
                    // The body must be at its name before that name is made durable.
                    of.name_body()?;
                    Some(f.clone())
                }
                _ => None,
            }
        };
        if let Some(f) = body {
            if datasync {
                f.sync_data()?;
            } else {
                f.sync_all()?;
            }
            self.bodies.sync_entry(ino.0)?;
        }
        self.flush(ino)?;
        let mut guard = self.lock();
        guard.sync(self.opts.chunk_size)?;
        drop(guard);
        if let Some(hook) = self.fsync_hook.get() {
            hook().map_err(|e| {
                tracing::error!(ino = ino.0, error = %e, "fsync: the checkpoint to the remote failed");
                FsError::Io(io::Error::other(e))
            })?;
        }
        Ok(())
    }

    /// Installs what every fsync must also do (once; later calls are ignored).
    pub fn set_fsync_hook(&self, hook: FsyncHook) {
        let _ = self.fsync_hook.set(hook);
    }

    pub fn fallocate(&self, ino: InodeNo, offset: u64, len: u64, mode: i32) -> FsResult<()> {
        const KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
        const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE;
        if mode & !(KEEP_SIZE | PUNCH | ZERO) != 0 {
            return Err(FsError::NotSupported);
        }
        if mode & PUNCH != 0 && (mode & KEEP_SIZE == 0 || mode & ZERO != 0) {
            return Err(FsError::Invalid);
        }
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= i64::MAX as u64)
            .ok_or(FsError::Io(io::Error::from_raw_os_error(libc::EFBIG)))?;
        if mode & (PUNCH | ZERO) != 0 {
            self.lazy_fetch(ino, offset, end, 0)?;
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let of = self.file_of(inner, ino)?;
        let grows = mode & KEEP_SIZE == 0 && end > of.inode.size;
        if grows {
            self.resize(of, end)?;
        }
        let zero_end = end.min(of.inode.size);
        if mode & (PUNCH | ZERO) != 0 && offset < zero_end {
            match &mut of.data {
                Data::Inline(v) => v[offset as usize..zero_end as usize].fill(0),
                Data::Body(f) => {
                    let m = if mode & PUNCH != 0 {
                        PUNCH | KEEP_SIZE
                    } else {
                        ZERO | KEEP_SIZE
                    };
                    if sys::file::fallocate(f, m, offset, zero_end - offset).is_err() {
                        zero_fill(f, offset, zero_end)?;
                    }
                }
            }
        } else if mode & (PUNCH | ZERO) == 0 {
            if let Data::Body(f) = &of.data {
                // Reserve the space so later writes cannot fail with ENOSPC.
                match sys::file::fallocate(f, KEEP_SIZE, offset, len) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        if mode & (PUNCH | ZERO) != 0 && offset < zero_end {
            of.touch(offset, zero_end, self.opts.chunk_size);
        }
        // Like ext4 and tmpfs: every successful fallocate is a modification.
        let t = now();
        of.inode.mtime = t;
        of.inode.ctime = t;
        of.dirty = true;
        let inode = of.inode.clone();
        let mut tx = Batch::new(&inner.store)?;
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        Self::rebase(inner, ino)?;
        self.settle(inner, ino)
    }

    /// SEEK_DATA (`data = true`) or SEEK_HOLE from `offset`.
    pub fn seek(&self, ino: InodeNo, offset: u64, data: bool) -> FsResult<u64> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let size = self.file_of(inner, ino)?.inode.size;
        if offset >= size {
            return Err(FsError::NoData);
        }
        // Windows still to fetch are holes in the body but data in the file: report no
        // holes until the file is complete (allowed: holes are optional).
        if self.lazy_incomplete(inner, ino, size)? {
            return Ok(if data { offset } else { size });
        }
        let of = self.file_of(inner, ino)?;
        match &of.data {
            Data::Inline(_) => Ok(if data { offset } else { size }),
            Data::Body(f) => match sys::file::seek_data_hole(f, offset, data) {
                Ok(o) => Ok(o.min(size)),
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                    if data {
                        Err(FsError::NoData)
                    } else {
                        Ok(size)
                    }
                }
                Err(e) => Err(e.into()),
            },
        }
    }

    pub fn copy_file_range(
        &self,
        ino_in: InodeNo,
        off_in: u64,
        ino_out: InodeNo,
        off_out: u64,
        len: u64,
    ) -> FsResult<u64> {
        let src_size = {
            let mut guard = self.lock();
            let inner: &mut Inner = &mut guard;
            self.file_of(inner, ino_in)?.inode.size
        };
        if off_in >= src_size || len == 0 {
            return Ok(0);
        }
        let len = len.min(src_size - off_in);
        if let Some(n) = self.copy_bodies(ino_in, off_in, ino_out, off_out, len)? {
            return Ok(n);
        }
        let mut buf = Vec::new();
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(1 << 20) as u32;
            self.read(ino_in, off_in + done, n, &mut buf)?;
            if buf.is_empty() {
                break;
            }
            self.write(ino_out, off_out + done, &buf)?;
            done += buf.len() as u64;
        }
        Ok(done)
    }

    /// Copies `len` bytes between two files that have bodies without the bytes leaving the
    /// kernel (`copy_file_range(2)` between the body files). `None` when either file is
    /// inline: the caller copies through a buffer.
    fn copy_bodies(
        &self,
        ino_in: InodeNo,
        off_in: u64,
        ino_out: InodeNo,
        off_out: u64,
        len: u64,
    ) -> FsResult<Option<u64>> {
        let end = write_end(off_out, len)?;
        if end <= self.opts.inline_max {
            return Ok(None);
        }
        self.lazy_fetch(ino_in, off_in, off_in.saturating_add(len), 0)?;
        let src = {
            let mut guard = self.lock();
            let inner: &mut Inner = &mut guard;
            match &self.file_of(inner, ino_in)?.data {
                Data::Body(f) => f.clone(),
                Data::Inline(_) => return Ok(None),
            }
        };
        let claim = self.lazy_prepare_write(ino_out, off_out, end)?;
        let Some(dst) = self.write_target(ino_out, off_out, end, None)? else {
            return Ok(None);
        };
        copy_body_range(&src, off_in, &dst, off_out, len)?;
        self.finish_write(ino_out, claim, &dst, off_out, end)?;
        Ok(Some(len))
    }

    // ----- directories -----

    pub fn opendir(&self, ino: InodeNo) -> FsResult<u64> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let d = Self::load_dir(inner, ino)?;
        let mut entries = vec![
            DirEntry {
                name: b".".to_vec(),
                ino,
                kind: Kind::Dir,
            },
            DirEntry {
                name: b"..".to_vec(),
                ino: d.parent,
                kind: Kind::Dir,
            },
        ];
        for e in inner.store.read().list(ino)? {
            entries.push(DirEntry {
                name: e.name,
                ino: e.ino,
                kind: e.kind,
            });
        }
        Ok(Self::new_handle(inner, Handle::Dir { entries }))
    }

    /// Entries of an open directory from `offset` on; each comes with the offset of the next.
    /// `add` returns true when the reply buffer is full.
    pub fn readdir(
        &self,
        fh: u64,
        offset: u64,
        mut add: impl FnMut(&DirEntry, u64) -> bool,
    ) -> FsResult<()> {
        let guard = self.lock();
        let inner: &Inner = &guard;
        let Some(Handle::Dir { entries }) = inner.handles.get(&fh) else {
            return Err(FsError::BadHandle);
        };
        for (i, e) in entries.iter().enumerate().skip(offset as usize) {
            if add(e, i as u64 + 1) {
                break;
            }
        }
        Ok(())
    }

    /// Like `readdir`, with attributes; every entry accepted by `add` (other than `.` and
    /// `..`) counts as a lookup.
    pub fn readdirplus(
        &self,
        fh: u64,
        offset: u64,
        mut add: impl FnMut(&DirEntry, &Attr, u64) -> bool,
    ) -> FsResult<()> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let Some(Handle::Dir { entries }) = inner.handles.get(&fh) else {
            return Err(FsError::BadHandle);
        };
        let entries: Vec<DirEntry> = entries.iter().skip(offset as usize).cloned().collect();
        for (i, e) in entries.iter().enumerate() {
            let attr = match self.fresh_attr(inner, e.ino) {
                Ok(a) => a,
                // Removed since opendir: skip it.
                Err(FsError::NotFound) => continue,
                Err(err) => return Err(err),
            };
            if add(e, &attr, offset + i as u64 + 1) {
                break;
            }
            if e.name != b"." && e.name != b".." {
                Self::remember(inner, e.ino);
            }
        }
        Ok(())
    }

    pub fn releasedir(&self, fh: u64) {
        self.lock().handles.remove(&fh);
    }

    pub fn fsyncdir(&self) -> FsResult<()> {
        self.lock().sync(self.opts.chunk_size)?;
        Ok(())
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

    // ----- xattrs -----

    pub fn setxattr(&self, ino: InodeNo, name: &[u8], value: &[u8], flags: i32) -> FsResult<()> {
        if name.is_empty() || name.len() > XATTR_NAME_MAX {
            return Err(FsError::Range);
        }
        if value.len() > XATTR_SIZE_MAX {
            return Err(FsError::TooBig);
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let mut inode = Self::load(inner, ino)?;
        let exists = inner.store.read().xattr(ino, name)?.is_some();
        if flags & XATTR_CREATE != 0 && exists {
            return Err(FsError::Exists);
        }
        if flags & XATTR_REPLACE != 0 && !exists {
            return Err(FsError::NoAttr);
        }
        inode.ctime = now();
        let mut tx = Batch::new(&inner.store)?;
        tx.set_xattr(ino, name, value)?;
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        inner.no_xattrs.remove(&ino);
        Ok(())
    }

    pub fn getxattr(&self, ino: InodeNo, name: &[u8]) -> FsResult<Vec<u8>> {
        if name.len() > XATTR_NAME_MAX {
            return Err(FsError::Range);
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        Self::load(inner, ino)?;
        Self::xattr_cached(inner, ino, name)?.ok_or(FsError::NoAttr)
    }

    /// One xattr's value; remembers inodes that have none at all, so the kernel's
    /// `security.capability` probes cost no SQLite query.
    fn xattr_cached(inner: &mut Inner, ino: InodeNo, name: &[u8]) -> FsResult<Option<Vec<u8>>> {
        if inner.no_xattrs.contains(&ino) {
            return Ok(None);
        }
        let v = inner.store.read().xattr(ino, name)?;
        if v.is_none() && inner.store.read().xattr_names(ino)?.is_empty() {
            if inner.no_xattrs.len() >= NO_XATTRS_MAX {
                inner.no_xattrs.clear();
            }
            inner.no_xattrs.insert(ino);
        }
        Ok(v)
    }

    /// Drops from a regular file what `loss` costs it on ext4: the set-ID bits the kernel
    /// would clear for this caller (see [`setid_lost`]) and `security.capability`. With
    /// FUSE_HANDLE_KILLPRIV_V2 the kernel leaves this to the filesystem and, in return, stops
    /// asking for `security.capability` before every write. Directories keep everything.
    pub fn drop_setid(&self, ino: InodeNo, loss: SetIdLoss) -> FsResult<()> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        self.sync_from_body(inner, ino)?;
        Self::kill_privs_locked(inner, ino, loss)
    }

    fn kill_privs_locked(inner: &mut Inner, ino: InodeNo, loss: SetIdLoss) -> FsResult<()> {
        let mut inode = Self::load(inner, ino)?;
        if inode.kind != Kind::File {
            return Ok(());
        }
        let perm = if inode.perm & (libc::S_ISUID | libc::S_ISGID) == 0 {
            inode.perm
        } else {
            let caller = match loss {
                SetIdLoss::Chown(c) | SetIdLoss::Modify(c) => c,
            };
            // The caller's capabilities and groups (only read when a set-ID bit is at
            // stake); a caller that is gone counts as root if its uid is 0.
            let creds = sys::creds::of_pid(caller.pid).unwrap_or_else(|_| sys::creds::Creds {
                fsetid: caller.uid == 0,
                groups: vec![caller.gid],
            });
            inode.perm & !setid_lost(inode.perm, inode.gid, loss, &creds)
        };
        let cap = Self::xattr_cached(inner, ino, CAPABILITY_XATTR)?.is_some();
        if perm == inode.perm && !cap {
            return Ok(());
        }
        inode.perm = perm;
        inode.ctime = now();
        let mut tx = Batch::new(&inner.store)?;
        if cap {
            tx.remove_xattr(ino, CAPABILITY_XATTR)?;
        }
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        Ok(())
    }

    /// All xattr names, each followed by a NUL byte.
    pub fn listxattr(&self, ino: InodeNo) -> FsResult<Vec<u8>> {
        let guard = self.lock();
        let inner: &Inner = &guard;
        Self::load(inner, ino)?;
        let mut out = Vec::new();
        for n in inner.store.read().xattr_names(ino)? {
            out.extend_from_slice(&n);
            out.push(0);
        }
        Ok(out)
    }

    pub fn removexattr(&self, ino: InodeNo, name: &[u8]) -> FsResult<()> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let mut inode = Self::load(inner, ino)?;
        inode.ctime = now();
        let mut tx = Batch::new(&inner.store)?;
        if !tx.remove_xattr(ino, name)? {
            return Err(FsError::NoAttr);
        }
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        Ok(())
    }

    /// `access(2)` check by mode bits (only used without `default_permissions`).
    pub fn access(&self, ino: InodeNo, caller: Caller, mask: i32) -> FsResult<()> {
        let guard = self.lock();
        let inner: &Inner = &guard;
        let i = Self::load(inner, ino)?;
        if mask == libc::F_OK {
            return Ok(());
        }
        let bits = if caller.uid == 0 {
            // root may read/write anything, and execute when any x bit is set.
            if mask & libc::X_OK != 0 && i.kind != Kind::Dir && i.perm & 0o111 == 0 {
                return Err(FsError::Access);
            }
            return Ok(());
        } else if caller.uid == i.uid {
            (i.perm >> 6) & 7
        } else if caller.gid == i.gid {
            (i.perm >> 3) & 7
        } else {
            i.perm & 7
        };
        if (mask as u32) & !bits & 7 != 0 {
            return Err(FsError::Access);
        }
        Ok(())
    }

    // ----- whole-filesystem -----

    /// Commits every open file's pending attributes, writes all bodies to disk and makes
    /// the store durable (shutdown, `sync`).
    pub fn sync_all(&self) -> FsResult<()> {
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
            self.sync_from_body(inner, ino)?;
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
        self.sync_all()?;
        // No new pool files from here on.
        self.pool.stop_filler();
        join_thread(&self.filler);
        // Finish removing discarded bodies before the state dir is handed on.
        self.lock().discard.take();
        join_thread(&self.discarder);
        let mut guard = self.lock();
        guard.commit_group(self.opts.chunk_size)?;
        guard.store.checkpoint()?;
        drop(guard);
        // Bodies of files that went back inline, too.
        self.pool.recycle_released();
        Ok(())
    }
}

fn zero_fill(f: &File, from: u64, to: u64) -> io::Result<()> {
    let zeros = vec![0u8; (to - from).min(1 << 20) as usize];
    let mut off = from;
    while off < to {
        let n = ((to - off) as usize).min(zeros.len());
        f.write_all_at(&zeros[..n], off)?;
        off += n as u64;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_the_kernel_holds_stays_small() {
        // One per inode the kernel has looked up: at a million files this is most of
        // keel's memory (issue 25). What an open file needs is boxed.
        assert!(
            std::mem::size_of::<Node>() <= 40,
            "{}",
            std::mem::size_of::<Node>()
        );
        assert_eq!(Node::default().cache_stamp, NO_STAMP);
    }

    #[test]
    fn setid_bits_lost_as_on_ext4() {
        let c = Caller {
            uid: 1000,
            gid: 100,
            pid: 0,
        };
        let user = sys::creds::Creds {
            fsetid: false,
            groups: vec![100],
        };
        let root = sys::creds::Creds {
            fsetid: true,
            groups: vec![0],
        };
        let (chown, modify) = (SetIdLoss::Chown(c), SetIdLoss::Modify(c));
        let both = libc::S_ISUID | libc::S_ISGID;
        // group may execute: both bits go, for anyone on chown, for the unprivileged on write.
        assert_eq!(setid_lost(0o6755, 100, chown, &user), both);
        assert_eq!(setid_lost(0o6755, 100, chown, &root), both);
        assert_eq!(setid_lost(0o6755, 100, modify, &user), both);
        assert_eq!(setid_lost(0o6755, 100, modify, &root), 0);
        // no group exec: set-group-ID stays for a member of the group or CAP_FSETID.
        assert_eq!(setid_lost(0o6745, 100, chown, &user), libc::S_ISUID);
        assert_eq!(setid_lost(0o6745, 7, chown, &user), both);
        assert_eq!(setid_lost(0o6745, 7, chown, &root), libc::S_ISUID);
        assert_eq!(setid_lost(0o2745, 7, modify, &user), libc::S_ISGID);
        assert_eq!(setid_lost(0o0755, 7, chown, &user), 0);
    }

    fn file_with(dir: &Path, name: &str, bytes: &[u8]) -> File {
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join(name))
            .unwrap();
        f.write_all_at(bytes, 0).unwrap();
        f
    }

    fn contents(f: &File) -> Vec<u8> {
        let mut v = vec![0u8; f.metadata().unwrap().len() as usize];
        f.read_exact_at(&mut v, 0).unwrap();
        v
    }

    #[test]
    fn body_copy_lands_at_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let src = file_with(dir.path(), "src", &data);
        let dst = file_with(dir.path(), "dst", b"0123456789");
        copy_body_range(&src, 5, &dst, 4, data.len() as u64 - 5).unwrap();
        let mut want = b"0123".to_vec();
        want.extend_from_slice(&data[5..]);
        assert!(contents(&dst) == want, "copied bytes differ");
    }

    #[test]
    fn body_copy_past_a_short_source_writes_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let src = file_with(dir.path(), "src", b"abc");
        let dst = file_with(dir.path(), "dst", &[7u8; 10]);
        copy_body_range(&src, 1, &dst, 2, 6).unwrap();
        assert_eq!(contents(&dst), b"\x07\x07bc\0\0\0\0\x07\x07");
    }
}

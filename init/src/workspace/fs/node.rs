//! The in-memory side of an inode: `Node` (one per inode the kernel holds), the loaded
//! bytes of a regular file (`OpenFile`), and the helpers that load, save and drop them.
//!
//! # Inode life cycle
//!
//! The states an inode goes through in `Inner::nodes`, and what moves it (every one of
//! these runs with the lock held):
//!
//! 1. **Stored**: no `Node`; only the store has the inode.
//! 2. **Known**: a `Node` with `lookups > 0`, `opens == 0` and no `OpenFile`: the kernel
//!    holds a reference. Stored → Known, or one lookup more: `remember` (lookup, create,
//!    mknod, mkdir, symlink, link, readdirplus). Known → Stored: `forget` down to no
//!    lookups, then `settle`.
//! 3. **Loaded**: `open: Some(OpenFile)`, the file's authoritative attributes and bytes in
//!    memory. Stored/Known → Loaded: `ensure_open` (open, truncate, every data operation;
//!    nothing when already loaded). A data operation without a handle (truncate,
//!    fallocate) ends with `settle` in the same call.
//! 4. **Open**: Loaded with `opens > 0`: `open_as` counts a handle in, `release` counts it
//!    out and calls `settle` at the last one. While loaded, the bytes move between
//!    **Inline** and **Body**: `to_body` (Inline → Body: `resize` past `inline_max`, or a
//!    writable passthrough open, which sets `pt_body`) and `back_inline` (Body → Inline,
//!    from `settle`: a passthrough-only body that stayed small); and between **dirty** and
//!    **clean**: writes mark `dirty` (`OpenFile::touch`), `write_back` (or any `Batch` that
//!    saves the inode, as flush, fsync and setattr do) makes it clean.
//! 5. **Lingering**: closed but kept loaded, listed in `Inner::lingering`. Loaded → Lingering:
//!    `settle` hands a linked, clean, looked-up file whose body has its name to `linger`.
//!    Lingering → Open: the next `open_as` (`ensure_open` finds it loaded). Lingering →
//!    Known: `unload`, when `linger` evicts the longest-closed file past `LINGER_MAX`.
//!    Lingering → Stored: `forget`, then `settle`.
//! 6. **Open-unlinked**: `nlink == 0` with handles open, or a directory the kernel still
//!    holds (`in_use`): `remove` or `rename` keep the row (a store orphan, which
//!    `WorkspaceFs::new` deletes after a crash). The last `release` (`releasedir`) settles
//!    it; once the kernel also forgets it, `settle` calls `purge`.
//! 7. **Deleted**: row and `Node` gone; the body goes back to the pool (or away) once the
//!    deletion commits (`discard_body`). Any state → Deleted: `purge` (from `settle`, or
//!    `rename` over an unopened victim), or `remove` directly when it takes the last name
//!    of an inode nobody has open.
//!
//! `settle` is the one exit from Loaded: it runs `back_inline` and `write_back`, then
//! lingers the file or drops its `OpenFile` (Known), and drops the `Node` once the kernel
//! holds no lookup (Stored), purging it when it has no links (Deleted). A rollback
//! (`rollback.rs`) may also retire an open file's inode or replace a loaded one.

use std::collections::BTreeSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::data::read_body;
use super::group::Batch;
use super::{Attr, Caller, FsError, FsResult, Inner, WorkspaceFs};
use crate::chunk::{BodyPool, Fresh};
use crate::meta::{Inode, InodeNo, Kind, Nanos, Storage};

/// The bytes of an open regular file.
pub(super) enum Data {
    Inline(Vec<u8>),
    Body(Arc<File>),
    /// A body the store names but that does not exist: every byte up to the size is zero.
    /// A lazy restore leaves an all-zero file so, and reading or opening it must not need
    /// room on the state volume (which may be full, or read-only). `materialize` creates
    /// the body when something is about to change the file.
    Holes,
}

/// State of a regular file while it is open (or being changed by a data operation).
pub(super) struct OpenFile {
    /// Authoritative attributes while open; the store may lag behind until `dirty` is cleared.
    pub(super) inode: Inode,
    pub(super) data: Data,
    pub(super) dirty: bool,
    /// Chunk windows written since the store last recorded them.
    pub(super) windows: BTreeSet<u64>,
    /// The body is a pooled file still under its pool slot's name: the store does not know
    /// it yet. It moves to the file's name when the store is first told the file has a body
    /// (`Batch::save`, and first thing in `fsync`), or goes back to the pool unrenamed if the
    /// file goes back inline first (`back_inline`) or is deleted (`purge`). A small file
    /// created write-only (`echo >`, `cp` of a small file) so costs no rename at all.
    pub(super) provisional: std::cell::Cell<Option<Provisional>>,
    /// (size, mtime, ctime) of the body when we last looked, while passthrough handles are
    /// open: a change means the kernel wrote through one.
    pub(super) pt_base: Option<BodyStamp>,
    /// The file took a body only to be passed through (it was inline when opened for
    /// writing, see `open_as`): at its last close it goes back inline if it stayed small.
    pub(super) pt_body: bool,
    /// A read-write passthrough handle was opened since the last close of every
    /// passthrough handle: a process may map the body shared and writable, and write it
    /// with no request to keel (see `mapped`).
    pub(super) pt_mappable: bool,
    /// Writable passthrough handles open now.
    pub(super) pt_writers: u32,
    /// A writable passthrough handle was open since `sync_written` last marked every
    /// window: the kernel may have written the body without moving its stamp (a write of the
    /// same size within one tick of the state volume's clock, or into a page a shared
    /// mapping had dirtied already, which takes no fault), so an unchanged stamp proves
    /// nothing about the bytes of such a file.
    pub(super) pt_unseen: bool,
    /// Where the file is in reporting its changes to the change feed (`watch`).
    pub(super) fed: Fed,
}

/// A file's data changes as the change feed has reported them (see `watch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fed {
    /// Nothing to report.
    Quiet,
    /// Changed, not reported yet.
    Due,
    /// Reported, unchanged since.
    Reported,
    /// Reported, then changed again: reported once more at close.
    Again,
}

/// A taken pool slot (see `OpenFile::provisional`).
pub(super) struct Provisional {
    pub(super) slot: u64,
    pub(super) pool: Arc<BodyPool>,
}

impl OpenFile {
    /// Moves a provisional body to the file's name (see `provisional`).
    pub(super) fn name_body(&self) -> io::Result<()> {
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
    pub(super) fn may_linger(&self) -> bool {
        let p = self.provisional.take();
        let named = p.is_none();
        self.provisional.set(p);
        named && self.inode.nlink > 0 && !self.dirty
    }

    /// Gives a provisional body back to the pool; true when there was one.
    pub(super) fn drop_provisional(&self) -> bool {
        match self.provisional.take() {
            Some(p) => {
                p.pool.give_back(p.slot, self.inode.ino.0);
                true
            }
            None => false,
        }
    }

    /// Notes that bytes `[from, to)` changed, for checkpoints.
    pub(super) fn touch(&mut self, from: u64, to: u64, chunk_size: u64) {
        let first = from / chunk_size;
        let last = to.max(from + 1).div_ceil(chunk_size);
        self.windows.extend(first..last);
        self.dirty = true;
        self.changed();
    }

    /// Notes a change of the bytes or size for the change feed (see `Fed`).
    pub(super) fn changed(&mut self) {
        self.fed = match self.fed {
            Fed::Quiet | Fed::Due => Fed::Due,
            Fed::Reported | Fed::Again => Fed::Again,
        };
    }
}

/// An inode the kernel knows about (looked up) or that has open handles. One per inode the
/// kernel holds, so kept small (40 bytes): what only an open or loaded file needs is in the
/// boxed `OpenFile`.
pub(super) struct Node {
    pub(super) lookups: u64,
    pub(super) opens: u32,
    /// Open handles whose I/O the kernel passes straight to the body file.
    pub(super) pt_opens: u32,
    /// (mtime, size) when the last handle was closed: the page cache is still valid if the
    /// file looks the same at the next open (cache mode `auto`). `NO_STAMP`: none.
    pub(super) cache_stamp: (Nanos, u64),
    pub(super) open: Option<Box<OpenFile>>,
}

/// No cache stamp: no file has this size (sizes stop at `i64::MAX`).
pub(super) const NO_STAMP: (Nanos, u64) = (Nanos(i64::MIN), u64::MAX);

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
pub(super) struct BodyStamp {
    pub(super) size: u64,
    pub(super) mtime: Nanos,
    pub(super) ctime: Nanos,
}

pub(super) fn body_stamp(f: &File) -> io::Result<BodyStamp> {
    Ok(stamp_of(&f.metadata()?))
}

/// When the kernel wrote a body keel did not see written (through passthrough or a
/// mapping), as the file's new mtime and ctime: the body's mtime, the kernel's clock at the
/// write, as ext4 sets both; but always after the file's last recorded change, which keel's
/// finer clock may have put up to a tick ahead of the kernel's coarse one.
pub(super) fn kernel_change_time(body: &BodyStamp, ctime: Nanos) -> Nanos {
    body.mtime.max(Nanos(ctime.0.saturating_add(1)))
}

pub(super) fn stamp_of(m: &std::fs::Metadata) -> BodyStamp {
    use std::os::unix::fs::MetadataExt;
    BodyStamp {
        size: m.len(),
        mtime: Nanos(m.mtime() * 1_000_000_000 + m.mtime_nsec()),
        ctime: Nanos(m.ctime() * 1_000_000_000 + m.ctime_nsec()),
    }
}

/// Closed files kept loaded at most (see `WorkspaceFs::linger`): each may hold a body open.
pub const LINGER_MAX: usize = 64;

impl WorkspaceFs {
    // ----- inode helpers (called with the lock held) -----

    pub(super) fn load(inner: &Inner, ino: InodeNo) -> FsResult<Inode> {
        if let Some(of) = inner.nodes.get(&ino).and_then(|n| n.open.as_ref()) {
            return Ok(of.inode.clone());
        }
        inner.store.read().get(ino)?.ok_or(FsError::NotFound)
    }

    /// A directory's inode: from the directory cache (kept current by every commit of the
    /// store), else from the store, and then cached. Every lookup, create and unlink starts
    /// with its parent; reading that row from SQLite each time was most of a lookup's cost.
    pub(super) fn load_dir(inner: &Inner, ino: InodeNo) -> FsResult<Inode> {
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

    pub(super) fn attr(&self, inode: Inode, body: Option<&File>) -> FsResult<Attr> {
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
        Ok(Attr {
            generation: self.generation(inode.ino),
            inode,
            blocks,
            volatile: false,
        })
    }

    /// Picks up what the kernel wrote through passthrough handles: size and times from the
    /// body, and every window marked dirty (the written ranges are unknown).
    /// With no passthrough handle open, what a mapping wrote after the last close
    /// (`sync_mapped`).
    pub(super) fn sync_from_body(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let chunk = self.opts.chunk_size;
        if Self::pt_base(inner, ino).is_none() {
            return self.sync_mapped(inner, ino);
        }
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
                let t = kernel_change_time(&now_stamp, of.inode.ctime);
                of.inode.mtime = t;
                of.inode.ctime = t;
            }
            of.inode.ctime = of.inode.ctime.max(now_stamp.ctime);
            of.touch(0, now_stamp.size, chunk);
            of.pt_base = Some(now_stamp);
            self.fed_touched(inner, ino);
        }
        Ok(())
    }

    /// `sync_from_body`, then, where no change may be missed (fsync, the release of a
    /// writable passthrough handle, `sync_all` before a checkpoint, a rollback), every window
    /// of a file a writable passthrough handle had open since the last time, whatever the
    /// body's stamp says (`OpenFile::pt_unseen`): what such a handle wrote is in the next
    /// checkpoint however coarse the state volume's timestamps are. The times stay as the
    /// stamp says: the kernel did not move them either.
    pub(super) fn sync_written(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        self.sync_from_body(inner, ino)?;
        if let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) {
            if of.pt_unseen {
                let size = of.inode.size;
                of.touch(0, size, self.opts.chunk_size);
                of.pt_unseen = of.pt_writers > 0;
            }
        }
        Ok(())
    }

    /// The body stamp of a file with passthrough handles open.
    pub(super) fn pt_base(inner: &Inner, ino: InodeNo) -> Option<BodyStamp> {
        inner
            .nodes
            .get(&ino)
            .and_then(|n| n.open.as_ref())
            .and_then(|of| of.pt_base)
    }

    /// Re-reads the body stamp after keel itself changed a passthrough (or mapped, see
    /// `mapped`) file, so its own change is not mistaken for a kernel write.
    pub(super) fn rebase(inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let watched = inner.mapped.contains(ino);
        if let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) {
            if of.pt_base.is_some() || watched {
                if let Data::Body(f) = &of.data {
                    let stamp = body_stamp(f)?;
                    if of.pt_base.is_some() {
                        of.pt_base = Some(stamp);
                    }
                    inner.mapped.restamp(ino, stamp);
                }
            }
        }
        Ok(())
    }

    /// Whether the kernel must ask for `ino`'s attributes every time (`Attr::volatile`): a
    /// read-write passthrough handle is open, or a mapping may outlive the last one.
    pub(super) fn volatile(inner: &Inner, ino: InodeNo) -> bool {
        inner.mapped.contains(ino)
            || inner
                .nodes
                .get(&ino)
                .and_then(|n| n.open.as_ref())
                .is_some_and(|of| of.pt_mappable && of.pt_base.is_some())
    }

    /// Attributes as the kernel must see them: first picks up passthrough writes, so that no
    /// reply (lookup, readdirplus, ...) hands the kernel a stale size.
    pub(super) fn fresh_attr(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<Attr> {
        self.sync_from_body(inner, ino)?;
        self.attr_locked(inner, ino)
    }

    pub(super) fn attr_locked(&self, inner: &Inner, ino: InodeNo) -> FsResult<Attr> {
        let inode = Self::load(inner, ino)?;
        let body = inner
            .nodes
            .get(&ino)
            .and_then(|n| n.open.as_ref())
            .and_then(|of| match &of.data {
                Data::Body(f) => Some(f.clone()),
                Data::Inline(_) | Data::Holes => None,
            });
        let mut a = self.attr(inode, body.as_deref())?;
        a.volatile = Self::volatile(inner, ino);
        Ok(a)
    }

    /// Stored → Known, or one lookup more (see the life cycle above).
    pub(super) fn remember(inner: &mut Inner, ino: InodeNo) {
        inner.nodes.entry(ino).or_default().lookups += 1;
    }

    /// Any state → Deleted: deletes an inode that has no links and nobody using it.
    pub(super) fn purge(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
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

    /// The last step into Deleted: removes a body file off the request path once its
    /// inode's deletion is committed
    /// (inode numbers are never reused, so no new body can take its name meanwhile).
    pub(super) fn discard_body(inner: &mut Inner, ino: InodeNo) {
        if inner.store.group_open() {
            inner.discard_after_commit.push(ino.0);
        } else {
            inner.discard_now(ino.0);
        }
    }

    /// Whether any handle has the inode open (open-unlinked files must stay).
    pub(super) fn is_open(inner: &Inner, ino: InodeNo) -> bool {
        inner.nodes.get(&ino).is_some_and(|n| n.opens > 0)
    }

    /// Whether an inode that lost its last link must stay for now (Open-unlinked): a handle
    /// has it open, or it is a directory the kernel still holds (an open handle, a process's
    /// working directory). Such a directory answers `fstat` and `stat(".")` with nlink 0, as
    /// on ext4, until the last release and forget (`settle` then purges it). A file the
    /// kernel only holds a lookup on goes at once: nothing can reach it by then.
    pub(super) fn in_use(inner: &Inner, ino: InodeNo, kind: Kind) -> bool {
        inner
            .nodes
            .get(&ino)
            .is_some_and(|n| n.opens > 0 || (kind == Kind::Dir && n.lookups > 0))
    }

    pub(super) fn new_inode(
        caller: Caller,
        parent: &Inode,
        kind: Kind,
        perm: u32,
        rdev: u32,
    ) -> Inode {
        let t = Nanos::now();
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

    /// Stored/Known → Loaded: loads the bytes of a regular file into its node so data
    /// operations can work on it (nothing when it is loaded already).
    pub(super) fn ensure_open(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
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
            Storage::Body => match self.bodies.open_existing(ino.0)? {
                Some(f) => {
                    // The body may disagree with the committed size after a crash: the
                    // store is the truth (bytes past it were never acknowledged).
                    if f.metadata()?.len() != inode.size {
                        f.set_len(inode.size)?;
                    }
                    Data::Body(Arc::new(f))
                }
                // Windows still to fetch land in a body: it is made now, as the fetches
                // that follow expect.
                None if self.lazy_incomplete(inner, ino, inode.size)? => {
                    Data::Body(Arc::new(self.sparse_body(ino, inode.size)?))
                }
                None => Data::Holes,
            },
        };
        let mut data = data;
        if let Data::Inline(v) = &mut data {
            v.resize(inode.size as usize, 0);
        }
        Self::load_as(inner, inode, data);
        Ok(())
    }

    /// Stored/Known → Loaded with what the store holds for `inode` (clean).
    fn load_as(inner: &mut Inner, inode: Inode, data: Data) {
        let ino = inode.ino;
        inner.nodes.entry(ino).or_default().open = Some(Box::new(OpenFile {
            inode,
            data,
            dirty: false,
            windows: BTreeSet::new(),
            provisional: std::cell::Cell::new(None),
            pt_base: None,
            pt_body: false,
            pt_mappable: false,
            pt_writers: 0,
            pt_unseen: false,
            fed: Fed::Quiet,
        }));
    }

    /// Known → Loaded for a regular file `make_locked` just inserted (empty, inline, no
    /// inline-data row), with the lock held since: what `ensure_open` would read back from
    /// the store (a row and its inline bytes) without reading it.
    pub(super) fn load_created(inner: &mut Inner, inode: Inode) {
        debug_assert!(inode.kind == Kind::File && inode.size == 0);
        debug_assert!(inode.storage == Storage::Inline);
        Self::load_as(inner, inode, Data::Inline(Vec::new()));
    }

    /// Loaded, with no handle open → Lingering, Known, Stored or Deleted: writes back and
    /// drops the loaded bytes of a file nobody has open (see the life cycle above).
    pub(super) fn settle(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let Some(node) = inner.nodes.get_mut(&ino) else {
            return Ok(());
        };
        if node.opens > 0 {
            return Ok(());
        }
        self.fed_closed(inner, ino);
        let node = inner.nodes.get_mut(&ino).expect("node present");
        // A loaded file's link count is authoritative (`load` prefers it to the row).
        let loaded_nlink = node.open.as_ref().map(|of| of.inode.nlink);
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
            let nlink = match loaded_nlink {
                Some(n) => Some(n),
                None => inner.store.read().get(ino)?.map(|i| i.nlink),
            };
            // The table gives its memory back by itself (see `nodes`).
            inner.nodes.remove(&ino);
            // Already deleted (a node is not kept past that, see `remove`) or still linked:
            // done.
            if nlink == Some(0) {
                self.purge(inner, ino)?;
            }
        }
        Ok(())
    }

    /// Loaded → Lingering: keeps a closed file loaded (its row, its open body) for the next open, getattr or
    /// lookup: `cat >> log`, a compiler or `git add` open the same files again and again,
    /// and loading one costs a row read, an `openat` and a `statx`. At most `LINGER_MAX`
    /// files linger; the longest-closed one is written back (if anything is pending) and
    /// dropped to make room. Unlink and forget drop a lingering file like a closed one.
    pub(super) fn linger(&self, inner: &mut Inner, ino: InodeNo) {
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

    /// Lingering → Known: drops the loaded bytes of a closed file, first saving what is pending (only after
    /// a lost group commit, see `recover_if_lost`, does a closed file have any).
    pub(super) fn unload(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
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

    /// Dirty → clean, in any loaded state: saves and commits a loaded file's pending attributes, bytes (inline) and dirty
    /// windows; nothing when it has none or is not loaded.
    pub(super) fn write_back(inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let inode = match inner.nodes.get(&ino).and_then(|n| n.open.as_ref()) {
            Some(of) if of.dirty => of.inode.clone(),
            _ => return Ok(()),
        };
        let mut tx = Batch::new(&inner.store)?;
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)
    }

    /// Body → Inline, from `settle`: a file that took a body only to be passed through (see `open_as`) and stayed small
    /// goes back inline once nobody has it open: small files live in the store. Returns
    /// whether it did; its body may go back to the pool once that is saved and committed.
    pub(super) fn back_inline(&self, node: &mut Node) -> FsResult<bool> {
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

    /// Inline → Body: moves an inline file's bytes into a fresh body file. Returns the
    /// body's stamp when it is known without asking (an empty file moved to a pool slot
    /// the pool found empty: nothing was written to it since the pool looked).
    pub(super) fn to_body(&self, of: &mut OpenFile) -> FsResult<Option<BodyStamp>> {
        let mut stamp = None;
        if let Data::Inline(bytes) = &of.data {
            let (fresh, seen) = self.pool.take_stat(of.inode.ino.0)?;
            if bytes.is_empty() && of.inode.size == 0 {
                stamp = seen.as_ref().map(stamp_of);
            }
            let f = match fresh {
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
        Ok(stamp)
    }

    /// Holes → Body: creates the body of a file that has none (`Data::Holes`), sparse at its
    /// size, before a change to the file that needs it: a write, a truncate, a preallocation
    /// or a writable passthrough open. Nothing for a file that has its bytes.
    pub(super) fn materialize(&self, of: &mut OpenFile) -> FsResult<()> {
        if let Data::Holes = of.data {
            of.data = Data::Body(Arc::new(self.sparse_body(of.inode.ino, of.inode.size)?));
        }
        Ok(())
    }

    /// The body of `ino`, created empty if absent, at `size` (a hole where it grew).
    pub(super) fn sparse_body(&self, ino: InodeNo, size: u64) -> FsResult<File> {
        let f = self.bodies.open_rw(ino.0)?;
        if f.metadata()?.len() < size {
            f.set_len(size)?;
        }
        Ok(f)
    }

    /// Sets the size of an open file's bytes (Inline → Body past `inline_max`, `to_body`).
    pub(super) fn resize(&self, of: &mut OpenFile, size: u64) -> FsResult<()> {
        if size > self.opts.inline_max {
            self.to_body(of)?;
        }
        self.materialize(of)?;
        match &mut of.data {
            Data::Inline(v) => v.resize(size as usize, 0),
            Data::Body(f) => f.set_len(size)?,
            Data::Holes => unreachable!("materialized above"),
        }
        let (lo, hi) = (of.inode.size.min(size), of.inode.size.max(size));
        of.touch(lo, hi, self.opts.chunk_size);
        of.inode.size = size;
        Ok(())
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
}

//! What a span of time did to the workspace, in time proportional to the change (`POST
//! /exec` with `diff=true`): between `track_start` and `track_finish`, every mutating
//! operation first records the state before it of each inode and entry it is about to
//! change, the first time it changes them (a pre-image: record, xattrs, content identity);
//! the finish reads the same inodes and entries as they are now, with the directory entries
//! that name them on both sides. What it returns is two partial trees, before and after,
//! that a diff (`persist::diff::diff_trees`, above this module) compares like two
//! snapshots.
//!
//! Content identity is what a snapshot holds: inline bytes, a symlink's target, or a body's
//! chunk ids (a window's id from the last checkpoint's map while the window is clean, else
//! the blake3 of its bytes, `None` for zeros), so a file rewritten with the same bytes is
//! not a change. Costs: nothing while no tracker runs (one `is_empty` per operation); with
//! one, a pre-image per inode and entry first touched (hashing only windows written since
//! the last checkpoint), and at the finish the same per tracked inode.
//!
//! What the kernel writes through passthrough handles is seen at close: files with such
//! handles (or a writable shared mapping) open when tracking starts are imaged then. A
//! rollback or a lost commit group during the span changes more than can be listed: the
//! finish says so (`TrackError::Overflow`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;

use super::node::Data;
use super::{FsError, FsResult, Inner, WorkspaceFs};
use crate::chunk::chunker::{is_zero, window_count, window_range};
use crate::chunk::ChunkId;
use crate::meta::{Inode, InodeNo, Kind, Storage};

/// Pre-images kept per tracker at most; past it the tracker gives up (`Overflow`).
const TRACKED_MAX: usize = 1 << 20;

/// A running tracker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TrackId(u64);

/// A file's content as a snapshot would hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    None,
    Inline(Vec<u8>),
    Symlink(Vec<u8>),
    Chunks(Vec<Option<ChunkId>>),
}

/// An inode as a snapshot would hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub inode: Inode,
    /// Sorted by name.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub content: Content,
}

/// One side of a tracked span: the inodes it touched (absent: not there, or unlinked),
/// the entries it touched, and the entries naming the directories above them.
#[derive(Debug, Clone, Default)]
pub struct Side {
    pub inodes: BTreeMap<InodeNo, Seen>,
    /// (parent, name) → (inode, kind)
    pub dirents: BTreeMap<(InodeNo, Vec<u8>), (InodeNo, Kind)>,
}

/// What a tracked span changed.
#[derive(Debug, Clone, Default)]
pub struct Tracked {
    pub before: Side,
    pub after: Side,
}

#[derive(Debug, thiserror::Error)]
pub enum TrackError {
    #[error("no such tracker (it finished already)")]
    Unknown,
    #[error("{0}: the changes cannot be listed one by one")]
    Overflow(&'static str),
    #[error("read the workspace: {0}")]
    Read(#[from] FsError),
}

impl From<crate::meta::MetaError> for TrackError {
    fn from(e: crate::meta::MetaError) -> Self {
        TrackError::Read(e.into())
    }
}

/// An entry: (parent, name).
type Entry = (InodeNo, Vec<u8>);
/// What an entry names, if it exists: (inode, kind).
type Names = Option<(InodeNo, Kind)>;

/// One tracker's pre-images (`None`: did not exist).
#[derive(Default)]
pub(super) struct Tracker {
    inodes: HashMap<InodeNo, Option<Seen>>,
    entries: HashMap<Entry, Names>,
    overflow: Option<&'static str>,
}

impl Tracker {
    fn full(&self) -> bool {
        self.inodes.len() + self.entries.len() >= TRACKED_MAX
    }
}

/// The trackers of a filesystem (in `Inner`).
#[derive(Default)]
pub(super) struct Trackers {
    next: u64,
    running: BTreeMap<TrackId, Tracker>,
}

impl Trackers {
    pub(super) fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// Every tracker gives up (a rollback, a lost group).
    pub(super) fn overflow(&mut self, why: &'static str) {
        for t in self.running.values_mut() {
            t.overflow.get_or_insert(why);
        }
    }
}

/// The chunk ids of body `f` (none: every byte is zero) of a file of `size` bytes: the
/// checkpoint's map for windows not written since (`clean`), the hash of the bytes for the
/// others.
fn body_ids(
    f: Option<&File>,
    size: u64,
    chunk: u64,
    clean: &HashMap<u64, Option<ChunkId>>,
    dirty: &BTreeSet<u64>,
) -> FsResult<Vec<Option<ChunkId>>> {
    let n = window_count(size, chunk);
    let mut out = Vec::with_capacity(n as usize);
    let mut buf = Vec::new();
    for idx in 0..n {
        if !dirty.contains(&idx) {
            if let Some(id) = clean.get(&idx) {
                out.push(*id);
                continue;
            }
        }
        let r = window_range(idx, size, chunk);
        buf.clear();
        buf.resize((r.end - r.start) as usize, 0);
        let mut got = 0;
        // No body at all: every window reads as zeros (`Data::Holes`).
        while let Some(f) = f.filter(|_| got < buf.len()) {
            match f.read_at(&mut buf[got..], r.start + got as u64) {
                // A shorter body: the rest reads as zeros (a sparse tail).
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        out.push((!is_zero(&buf)).then(|| ChunkId::of(&buf)));
    }
    Ok(out)
}

impl WorkspaceFs {
    /// Starts tracking changes (see the module doc).
    pub fn track_start(&self) -> FsResult<TrackId> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        // The finish names what changed by inode (once per state dir: see `index_names`).
        inner.store.read().index_names()?;
        let id = TrackId(inner.trackers.next);
        inner.trackers.next += 1;
        inner.trackers.running.insert(id, Tracker::default());
        // Files the kernel may be writing without telling keel (passthrough handles, shared
        // writable mappings): their state now, before any such write.
        let unseen: Vec<InodeNo> = inner
            .nodes
            .iter()
            .filter(|(_, n)| n.open.as_ref().is_some_and(|of| of.pt_base.is_some()))
            .map(|(ino, _)| *ino)
            .chain(inner.mapped.inodes())
            .collect();
        for ino in unseen {
            self.sync_from_body(inner, ino)?;
            self.track_inode(inner, ino);
        }
        Ok(id)
    }

    /// Ends tracker `id`: the inodes and entries it saw change, before and now.
    pub fn track_finish(&self, id: TrackId) -> Result<Tracked, TrackError> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let t = inner
            .trackers
            .running
            .remove(&id)
            .ok_or(TrackError::Unknown)?;
        if let Some(why) = t.overflow {
            return Err(TrackError::Overflow(why));
        }
        let mut out = Tracked::default();
        for (ino, before) in &t.inodes {
            // What passthrough handles wrote shows in the body only.
            self.sync_from_body(inner, *ino)?;
            if let Some(s) = before.as_ref().filter(|s| s.inode.nlink > 0) {
                out.before.inodes.insert(*ino, s.clone());
            }
            if let Some(s) = self.seen(inner, *ino)? {
                out.after.inodes.insert(*ino, s);
            }
        }
        // The touched entries, then those naming every directory above either side's.
        let mut above: BTreeSet<InodeNo> = BTreeSet::new();
        for ((parent, name), before) in &t.entries {
            let now = inner
                .store
                .read()
                .lookup(*parent, name)?
                .map(|d| (d.ino, d.kind));
            let key = (*parent, name.clone());
            if let Some(b) = before {
                out.before.dirents.insert(key.clone(), *b);
            }
            if let Some(n) = now {
                out.after.dirents.insert(key, n);
            }
            above.insert(*parent);
        }
        // Every other name of a tracked inode (a file's bytes changed under each of its
        // names, a hard link's too): unchanged, so the same on both sides.
        for ino in t.inodes.keys() {
            let kind = match (out.after.inodes.get(ino), out.before.inodes.get(ino)) {
                (Some(s), _) | (None, Some(s)) => s.inode.kind,
                (None, None) => continue,
            };
            for (p, name) in inner.store.read().names_of(*ino)? {
                let key = (p, name);
                if !t.entries.contains_key(&key) {
                    out.before.dirents.insert(key.clone(), (*ino, kind));
                    out.after.dirents.insert(key, (*ino, kind));
                    above.insert(p);
                }
            }
        }
        // A directory's entry before: the tracked one if it changed, else today's.
        let moved: HashMap<InodeNo, (InodeNo, Vec<u8>)> = t
            .entries
            .iter()
            .filter_map(|(k, v)| v.map(|(ino, _)| (ino, k.clone())))
            .collect();
        let mut done: BTreeSet<InodeNo> = BTreeSet::new();
        let mut todo: Vec<InodeNo> = above.into_iter().collect();
        while let Some(dir) = todo.pop() {
            if dir == InodeNo::ROOT || !done.insert(dir) {
                continue;
            }
            let now = inner.store.read().names_of(dir)?.into_iter().next();
            if let Some((p, name)) = &now {
                let key = (*p, name.clone());
                if !t.entries.contains_key(&key) {
                    // Untouched: the same on both sides.
                    out.before.dirents.insert(key.clone(), (dir, Kind::Dir));
                    out.after.dirents.insert(key, (dir, Kind::Dir));
                }
                todo.push(*p);
            }
            if let Some((p, _)) = moved.get(&dir) {
                todo.push(*p);
            }
        }
        Ok(out)
    }

    /// Inode `ino` as a snapshot would hold it now (`None`: gone or unlinked).
    fn seen(&self, inner: &Inner, ino: InodeNo) -> FsResult<Option<Seen>> {
        let inode = match Self::load(inner, ino) {
            Ok(i) if i.nlink > 0 => i,
            Ok(_) | Err(FsError::NotFound) => return Ok(None),
            Err(e) => return Err(e),
        };
        let xattrs = if inner.no_xattrs.contains(&ino) {
            Vec::new()
        } else {
            inner.store.read().xattrs_of(ino)?
        };
        let chunk = self.opts.chunk_size;
        let content = match inode.kind {
            Kind::Symlink => {
                Content::Symlink(inner.store.read().symlink_target(ino)?.unwrap_or_default())
            }
            Kind::File => {
                let of = inner.nodes.get(&ino).and_then(|n| n.open.as_ref());
                match (of.map(|of| &of.data), inode.storage) {
                    (Some(Data::Inline(v)), _) => {
                        Content::Inline(v[..(inode.size as usize).min(v.len())].to_vec())
                    }
                    (None, Storage::Inline) => {
                        Content::Inline(inner.store.read().inline_data(ino)?)
                    }
                    (Some(Data::Body(f)), _) => {
                        let dirty = self.dirty_windows(inner, ino)?;
                        let clean = self.clean_windows(inner, ino)?;
                        Content::Chunks(body_ids(Some(f), inode.size, chunk, &clean, &dirty)?)
                    }
                    (None, Storage::Body) if inode.size == 0 => Content::Chunks(Vec::new()),
                    (Some(Data::Holes), _) | (None, Storage::Body) => {
                        let dirty = self.dirty_windows(inner, ino)?;
                        let clean = self.clean_windows(inner, ino)?;
                        let f = self.bodies.open_existing(ino.0)?;
                        Content::Chunks(body_ids(f.as_ref(), inode.size, chunk, &clean, &dirty)?)
                    }
                }
            }
            _ => Content::None,
        };
        Ok(Some(Seen {
            inode,
            xattrs,
            content,
        }))
    }

    /// Windows written since the last checkpoint (recorded, claimed by one in flight, or
    /// still in memory).
    fn dirty_windows(&self, inner: &Inner, ino: InodeNo) -> FsResult<BTreeSet<u64>> {
        let mut w: BTreeSet<u64> = inner
            .store
            .read()
            .unsettled_windows(ino)?
            .into_iter()
            .collect();
        if let Some(of) = inner.nodes.get(&ino).and_then(|n| n.open.as_ref()) {
            w.extend(of.windows.iter().copied());
        }
        Ok(w)
    }

    fn clean_windows(
        &self,
        inner: &Inner,
        ino: InodeNo,
    ) -> FsResult<HashMap<u64, Option<ChunkId>>> {
        Ok(inner
            .store
            .read()
            .file_chunks(ino)?
            .into_iter()
            .map(|(idx, id)| (idx, id.map(ChunkId)))
            .collect())
    }

    /// Before a change to inode `ino`: its pre-image, in every tracker that has none.
    pub(super) fn track_inode(&self, inner: &mut Inner, ino: InodeNo) {
        if inner.trackers.is_empty() {
            return;
        }
        if inner
            .trackers
            .running
            .values()
            .all(|t| t.inodes.contains_key(&ino) || t.overflow.is_some())
        {
            return;
        }
        let seen = match self.seen(inner, ino) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(ino = ino.0, error = %e, "diff tracking: cannot read a changed file");
                inner.trackers.overflow("a changed file could not be read");
                return;
            }
        };
        for t in inner.trackers.running.values_mut() {
            if t.overflow.is_none() && !t.inodes.contains_key(&ino) {
                if t.full() {
                    t.overflow = Some("too many changes");
                } else {
                    t.inodes.insert(ino, seen.clone());
                }
            }
        }
    }

    /// After inode `ino` was made: it did not exist before.
    pub(super) fn track_new(&self, inner: &mut Inner, ino: InodeNo) {
        for t in inner.trackers.running.values_mut() {
            if t.overflow.is_none() && !t.inodes.contains_key(&ino) {
                if t.full() {
                    t.overflow = Some("too many changes");
                } else {
                    t.inodes.insert(ino, None);
                }
            }
        }
    }

    /// Before entry `name` of `parent` changes: what it named (`None`: absent).
    pub(super) fn track_entry(
        &self,
        inner: &mut Inner,
        parent: InodeNo,
        name: &[u8],
        was: Option<(InodeNo, Kind)>,
    ) {
        if inner.trackers.is_empty() {
            return;
        }
        let key = (parent, name.to_vec());
        for t in inner.trackers.running.values_mut() {
            if t.overflow.is_none() && !t.entries.contains_key(&key) {
                if t.full() {
                    t.overflow = Some("too many changes");
                } else {
                    t.entries.insert(key.clone(), was);
                }
            }
        }
    }
}

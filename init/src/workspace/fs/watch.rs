//! The filesystem's side of the change feed (`workspace::feed`): each mutating operation,
//! once it has committed and still under the lock, appends what it did with the paths it
//! did it to, so the feed's order is the order the operations took effect and every writer
//! (any process, the files API, a passthrough write seen at close) is in it.
//!
//! Paths: an entry's path is its directory's path and its name. A directory's path comes
//! from `Inner::dir_paths` (directory inode → `/`-rooted path), filled on first use from
//! the store's entries by inode (`Tx::names_of`, indexed from the first watch on): one
//! hash lookup per event in the usual case. A directory renamed or exchanged empties the
//! cache (the paths of everything below it changed); one removed leaves it. A file's
//! bytes changing is reported under every name it has (hard links): `names_of` again.
//!
//! Modify events: `OpenFile::touch` (every data change) moves the file's `Fed` state; the
//! first change after a quiet state is reported at once (`fed_touched`, called where
//! writes, truncates and fallocate finish), later ones once more when the file is closed or
//! settled (`fed_closed`), so a reader that acts on the last event of a write sees its
//! last byte. A passthrough write is only seen at close (the kernel never tells keel).
//!
//! Nothing here runs until the first watch: every hook starts with one relaxed load.

use std::sync::Arc;

use super::node::Fed;
use super::{FsResult, Inner, WorkspaceFs};
use crate::meta::{InodeNo, Kind};
use crate::workspace::feed::{Cursor, Feed, NewEvent, Op};

/// Directory paths cached at most; past it the cache starts over.
const DIR_PATHS_MAX: usize = 1 << 16;
/// Deepest directory chain walked to name a path.
const DEPTH_MAX: usize = 4096;

fn lossy(name: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(name)
}

impl WorkspaceFs {
    /// The change feed of this filesystem.
    pub fn feed(&self) -> &Arc<Feed> {
        &self.feed
    }

    /// Starts recording changes (the first time: indexes entries by inode, a moment on a
    /// large workspace) and returns the cursor after the newest event.
    pub fn watch(&self) -> FsResult<Cursor> {
        let guard = self.lock();
        if !self.feed.active() {
            guard.store.read().index_names()?;
            self.feed.activate();
            tracing::info!("change feed: recording from now on");
        }
        Ok(self.feed.now())
    }

    /// The path of directory `dir` (`""` for the root).
    fn dir_path(inner: &mut Inner, dir: InodeNo) -> FsResult<Arc<str>> {
        let mut chain: Vec<(InodeNo, Vec<u8>)> = Vec::new();
        let mut cur = dir;
        let base: Arc<str> = loop {
            if cur == InodeNo::ROOT {
                break Arc::from("");
            }
            if let Some(p) = inner.dir_paths.get(&cur) {
                break p.clone();
            }
            if chain.len() >= DEPTH_MAX {
                return Ok(Arc::from(format!("/?{}", dir.0)));
            }
            let Some((parent, name)) = inner.store.read().names_of(cur)?.into_iter().next() else {
                // Removed while in use: no path any more.
                break Arc::from(format!("/?{}", cur.0));
            };
            chain.push((cur, name));
            cur = parent;
        };
        if inner.dir_paths.len() + chain.len() > DIR_PATHS_MAX {
            inner.dir_paths.clear();
        }
        let mut path = base;
        for (ino, name) in chain.into_iter().rev() {
            path = Arc::from(format!("{path}/{}", lossy(&name)));
            inner.dir_paths.insert(ino, path.clone());
        }
        Ok(path)
    }

    fn entry_path(inner: &mut Inner, parent: InodeNo, name: &[u8]) -> FsResult<String> {
        let dir = Self::dir_path(inner, parent)?;
        Ok(format!("{dir}/{}", lossy(name)))
    }

    /// Records that entry `name` of `parent` (inode `ino`) was created or deleted.
    pub(super) fn fed_entry(
        &self,
        inner: &mut Inner,
        op: Op,
        (parent, name): (InodeNo, &[u8]),
        kind: Kind,
        ino: InodeNo,
        size: Option<u64>,
    ) {
        if !self.feed.active() {
            return;
        }
        if op == Op::Delete && kind == Kind::Dir {
            inner.dir_paths.remove(&ino);
        }
        match Self::entry_path(inner, parent, name) {
            Ok(path) => {
                let mut e = NewEvent::new(op, kind, ino, path);
                e.size = size.filter(|_| kind == Kind::File);
                self.feed.push([e]);
            }
            Err(e) => self.fed_failed(inner, e),
        }
    }

    /// Records a rename (`replaced`: over another name, or an exchange).
    pub(super) fn fed_rename(
        &self,
        inner: &mut Inner,
        (parent, name): (InodeNo, &[u8]),
        (newparent, newname): (InodeNo, &[u8]),
        kind: Kind,
        ino: InodeNo,
        replaced: bool,
    ) {
        if !self.feed.active() {
            return;
        }
        let paths = Self::entry_path(inner, parent, name)
            .and_then(|f| Ok((f, Self::entry_path(inner, newparent, newname)?)));
        // The moved directory's cached path, and those below it, are wrong now.
        if kind == Kind::Dir {
            inner.dir_paths.clear();
        }
        match paths {
            Ok((from, to)) => {
                let mut e = NewEvent::new(Op::Rename, kind, ino, to);
                e.from = Some(from);
                e.replaced = replaced;
                self.feed.push([e]);
            }
            Err(e) => self.fed_failed(inner, e),
        }
    }

    /// Records a change to inode `ino` under each of its names.
    pub(super) fn fed_inode(
        &self,
        inner: &mut Inner,
        op: Op,
        ino: InodeNo,
        kind: Kind,
        size: Option<u64>,
    ) {
        if !self.feed.active() {
            return;
        }
        let evs = (|| -> FsResult<Vec<NewEvent>> {
            let names = inner.store.read().names_of(ino)?;
            let mut evs = Vec::with_capacity(names.len());
            for (parent, name) in names {
                let mut e = NewEvent::new(op, kind, ino, Self::entry_path(inner, parent, &name)?);
                e.size = size.filter(|_| kind == Kind::File);
                evs.push(e);
            }
            Ok(evs)
        })();
        match evs {
            Ok(evs) => self.feed.push(evs),
            Err(e) => self.fed_failed(inner, e),
        }
    }

    /// After a data change: reports the first one since the file was quiet.
    pub(super) fn fed_touched(&self, inner: &mut Inner, ino: InodeNo) {
        if !self.feed.active() {
            return;
        }
        let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) else {
            return;
        };
        if of.fed != Fed::Due {
            return;
        }
        of.fed = Fed::Reported;
        let size = of.inode.size;
        self.fed_inode(inner, Op::Modify, ino, Kind::File, Some(size));
    }

    /// A file is closed (FLUSH) or settled: reports what changed since its last report,
    /// and it is quiet again.
    pub(super) fn fed_closed(&self, inner: &mut Inner, ino: InodeNo) {
        if !self.feed.active() {
            return;
        }
        let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) else {
            return;
        };
        let due = matches!(of.fed, Fed::Due | Fed::Again);
        of.fed = Fed::Quiet;
        if due {
            let size = of.inode.size;
            self.fed_inode(inner, Op::Modify, ino, Kind::File, Some(size));
        }
    }

    /// Records that more changed than can be listed (a rollback, a lost commit group).
    pub(super) fn fed_rescan(&self, inner: &mut Inner, reason: &'static str) {
        inner.dir_paths.clear();
        inner.trackers.overflow(reason);
        if !self.feed.active() {
            return;
        }
        let mut e = NewEvent::new(Op::Rescan, Kind::Dir, InodeNo::ROOT, "/".into());
        e.reason = Some(reason);
        self.feed.push([e]);
    }

    /// A path could not be read from the store: the feed says to rescan rather than skip.
    fn fed_failed(&self, inner: &mut Inner, e: super::FsError) {
        tracing::warn!(error = %e, "change feed: cannot name a changed path");
        self.fed_rescan(inner, "a changed path could not be named");
    }
}

//! Group commit: metadata operations join one open SQLite transaction that is committed
//! when it is due (age or size, `GROUP`), by whichever operation lets go of the lock then
//! (`Guard`'s drop) or by the committer thread once the filesystem goes idle; `Batch` is one
//! operation's part of it. Bodies of inodes deleted in the open group are removed only once
//! it commits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::node::{Data, Node};
use super::nodes::NodeMap;
use super::{FsResult, Guard, Inner};
use crate::chunk::BodyPool;
use crate::meta::{GroupLimits, Inode, MetaError, Storage, Store, Tx};
use crate::sys;

/// The body of a deleted inode goes to the pool (or away when the pool is full).
pub(super) fn discard_body(pool: &BodyPool, id: u64) {
    if let Err(e) = pool.recycle(id) {
        tracing::warn!(ino = id, error = %e, "cannot remove a body file");
    }
}

/// Below this much free space on the state volume every operation commits on its own, so
/// that a full disk fails the one operation (which may then use the reserve), never a
/// group of acknowledged ones.
pub(super) const LOW_SPACE: u64 = 256 << 20;

/// When the open metadata group is committed.
pub(super) const GROUP: GroupLimits = GroupLimits {
    max_age: Duration::from_millis(20),
    max_ops: 256,
};

impl Inner {
    /// Commits the open group; then its deleted inodes' bodies can go.
    pub(super) fn commit_group(&mut self, chunk_size: u64) -> Result<(), MetaError> {
        let r = self.store.commit_group();
        self.recover_if_lost(chunk_size);
        self.discard_committed();
        r
    }

    /// Commits the open group, then makes everything committed durable.
    pub(super) fn sync(&mut self, chunk_size: u64) -> Result<(), MetaError> {
        self.commit_group(chunk_size)?;
        self.store.sync()
    }

    /// Once no group holds their changes any more: sends the bodies of deleted inodes to
    /// the discard thread, and lets the bodies of files that went back inline go to the
    /// pool (the committer thread moves them, `BodyPool::recycle_released`).
    pub(super) fn discard_committed(&mut self) {
        if !self.store.group_open() {
            for id in std::mem::take(&mut self.discard_after_commit) {
                self.discard_now(id);
            }
            self.pool.release_held();
        }
    }

    pub(super) fn discard_now(&self, id: u64) {
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
    pub(super) fn recover_if_lost(&mut self, chunk_size: u64) {
        if !self.store.take_group_lost() {
            return;
        }
        tracing::error!("a metadata commit failed: operations since the last commit are lost");
        self.dir_paths.clear();
        self.trackers.overflow("a metadata commit failed");
        if self.feed.active() {
            let mut e = crate::workspace::feed::NewEvent::new(
                crate::workspace::feed::Op::Rescan,
                crate::meta::Kind::Dir,
                crate::meta::InodeNo::ROOT,
                "/".into(),
            );
            e.reason = Some("a metadata commit failed: changes since the last commit are lost");
            self.feed.push([e]);
        }
        self.discard_after_commit.clear();
        self.pool.keep_held();
        self.no_xattrs.clear();
        for of in self.nodes.values_mut().filter_map(|n| n.open.as_mut()) {
            let size = of.inode.size;
            of.touch(0, size, chunk_size);
        }
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
pub(super) fn committer(inner: Weak<Mutex<Inner>>, stop: Arc<AtomicBool>, chunk_size: u64) {
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
pub(super) struct Batch<'a> {
    pub(super) tx: Tx<'a>,
    pub(super) saved: Vec<Inode>,
}

impl<'a> Batch<'a> {
    pub(super) fn new(store: &'a Store) -> FsResult<Batch<'a>> {
        Ok(Batch {
            tx: store.write()?,
            saved: Vec::new(),
        })
    }

    /// Writes an inode (and, for an open file, its inline bytes and dirty windows).
    pub(super) fn save(&mut self, nodes: &NodeMap<Node>, inode: &Inode) -> FsResult<()> {
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

    pub(super) fn commit(self, nodes: &mut NodeMap<Node>) -> FsResult<()> {
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

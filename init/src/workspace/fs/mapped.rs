//! Bodies a shared writable mapping may still write: a file opened read-write with
//! passthrough can be mapped `MAP_SHARED`, and the kernel then maps keel's body file itself.
//! Its writes never reach keel as requests, not even at `munmap` or `msync` (both act on the
//! body), and the mapping outlives the close of every handle. The kernel only updates the
//! body's own times (at each write fault, as on any disk filesystem), so the body's stamp is
//! the one source of truth: while a file has a read-write passthrough handle open, keel
//! compares it at every `getattr`, flush, fsync and close (`OpenFile::pt_base`); after the
//! last close the stamp moves here, and keel keeps comparing at every `getattr`, lookup, open
//! and sync (`WorkspaceFs::sync_mapped`): a change moves the file's mtime and ctime as ext4
//! would and marks every window for the next checkpoint. The kernel must ask for such a
//! file's attributes each time (`Attr::volatile`). An unchanged stamp proves nothing while a
//! writable handle is open (see `OpenFile::pt_unseen`): `sync_written` marks such a file's
//! windows at fsync, release and checkpoint whatever it says. Nothing says when the last mapping is
//! gone, so at most `MAPPED_MAX` files are watched, the longest-closed one compared a last
//! time and dropped first. A small file that goes back inline at its last close keeps no
//! body a mapping could write: what its mapping writes after the close is lost (the file's
//! bytes are in the store by then; the mapping holds the old body, which is never reused).

use std::collections::{HashMap, VecDeque};

use super::group::Batch;
use super::node::{kernel_change_time, stamp_of, BodyStamp};
use super::{FsError, FsResult, Inner, WorkspaceFs};
use crate::chunk::chunker::window_count;
use crate::meta::{InodeNo, Kind, Storage};

/// Files watched at most (see the module doc).
pub const MAPPED_MAX: usize = 1024;

/// The watched files and the body stamp each was last seen with.
#[derive(Default)]
pub(super) struct Mapped {
    stamps: HashMap<InodeNo, BodyStamp>,
    /// Watch order, oldest first; may hold inodes no longer watched (skipped).
    order: VecDeque<InodeNo>,
}

impl Mapped {
    pub(super) fn get(&self, ino: InodeNo) -> Option<BodyStamp> {
        self.stamps.get(&ino).copied()
    }

    pub(super) fn contains(&self, ino: InodeNo) -> bool {
        self.stamps.contains_key(&ino)
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Starts (or renews) watching `ino`, last seen as `stamp`.
    pub(super) fn watch(&mut self, ino: InodeNo, stamp: BodyStamp) {
        if self.stamps.insert(ino, stamp).is_none() {
            self.order.push_back(ino);
        }
    }

    /// A new stamp for a file already watched (keel changed the body itself).
    pub(super) fn restamp(&mut self, ino: InodeNo, stamp: BodyStamp) {
        if let Some(s) = self.stamps.get_mut(&ino) {
            *s = stamp;
        }
    }

    pub(super) fn forget(&mut self, ino: InodeNo) {
        self.stamps.remove(&ino);
        if self.order.len() > 2 * self.stamps.len() + 16 {
            let stamps = &self.stamps;
            self.order.retain(|i| stamps.contains_key(i));
        }
    }

    /// The longest-watched file, while more than `max` are watched.
    pub(super) fn over(&mut self, max: usize) -> Option<InodeNo> {
        if self.stamps.len() <= max {
            return None;
        }
        while let Some(ino) = self.order.pop_front() {
            if self.stamps.contains_key(&ino) {
                self.order.push_front(ino);
                return Some(ino);
            }
        }
        None
    }

    /// Every watched file.
    pub(super) fn inodes(&self) -> Vec<InodeNo> {
        self.stamps.keys().copied().collect()
    }
}

impl WorkspaceFs {
    /// After the last passthrough handle of a file that had a read-write one closed: watches
    /// its body, last seen as `stamp`, while it is still the file's (a file back inline or
    /// deleted keeps nothing a mapping could write), dropping the longest-watched past
    /// `MAPPED_MAX` after a last look.
    pub(super) fn watch_mapped(&self, inner: &mut Inner, ino: InodeNo, stamp: BodyStamp) {
        match Self::load(inner, ino) {
            Ok(i) if i.kind == Kind::File && i.storage == Storage::Body && i.nlink > 0 => {
                inner.mapped.watch(ino, stamp);
            }
            _ => inner.mapped.forget(ino),
        }
        while let Some(old) = inner.mapped.over(MAPPED_MAX) {
            if let Err(e) = self.sync_mapped(inner, old) {
                tracing::warn!(ino = old.0, error = %e, "cannot look at a mapped body a last time");
            }
            inner.mapped.forget(old);
        }
    }

    /// Picks up what a mapping wrote to a watched body since keel last looked: the body's
    /// mtime becomes the file's (ctime moves with it) and every window is marked for the next
    /// checkpoint (the written ranges are unknown). Nothing for a file not watched, or one
    /// with passthrough handles open (`sync_from_body` compares those).
    pub(super) fn sync_mapped(&self, inner: &mut Inner, ino: InodeNo) -> FsResult<()> {
        let Some(seen) = inner.mapped.get(ino) else {
            return Ok(());
        };
        if Self::pt_base(inner, ino).is_some() {
            return Ok(());
        }
        let now = match self.bodies.metadata(ino.0)? {
            Some(m) => stamp_of(&m),
            None => {
                inner.mapped.forget(ino);
                return Ok(());
            }
        };
        if now == seen {
            return Ok(());
        }
        let mut inode = match Self::load(inner, ino) {
            Ok(i) if i.kind == Kind::File && i.storage == Storage::Body && i.nlink > 0 => i,
            Ok(_) | Err(FsError::NotFound) => {
                inner.mapped.forget(ino);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if now.mtime != seen.mtime {
            let t = kernel_change_time(&now, inode.ctime);
            inode.mtime = t;
            inode.ctime = t;
        }
        inode.ctime = inode.ctime.max(now.ctime);
        let chunk = self.opts.chunk_size;
        // A mapping cannot change the size: the file's, which keel keeps, stays.
        if let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) {
            of.inode.mtime = inode.mtime;
            of.inode.ctime = inode.ctime;
            let size = of.inode.size;
            of.touch(0, size, chunk);
            Self::write_back(inner, ino)?;
            self.fed_touched(inner, ino);
        } else {
            let mut tx = Batch::new(&inner.store)?;
            tx.save(&inner.nodes, &inode)?;
            tx.mark_whole_file_dirty(ino, window_count(inode.size, chunk))?;
            tx.commit(&mut inner.nodes)?;
            let size = Some(inode.size);
            self.fed_inode(
                inner,
                crate::workspace::feed::Op::Modify,
                ino,
                Kind::File,
                size,
            );
        }
        inner.mapped.restamp(ino, now);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::Nanos;

    fn stamp(n: i64) -> BodyStamp {
        BodyStamp {
            size: 1,
            mtime: Nanos(n),
            ctime: Nanos(n),
        }
    }

    #[test]
    fn watches_in_order_and_drops_the_oldest_first() {
        let mut m = Mapped::default();
        for i in 1..=4 {
            m.watch(InodeNo(i), stamp(i as i64));
        }
        m.watch(InodeNo(2), stamp(20));
        assert_eq!(m.get(InodeNo(2)), Some(stamp(20)));
        assert_eq!(m.over(4), None);
        assert_eq!(m.over(3), Some(InodeNo(1)));
        m.forget(InodeNo(1));
        assert_eq!(m.over(3), None);
        m.forget(InodeNo(2));
        assert_eq!(m.over(1), Some(InodeNo(3)));
        m.restamp(InodeNo(9), stamp(9));
        assert!(!m.contains(InodeNo(9)));
        assert_eq!(m.len(), 2);
        let mut all = m.inodes();
        all.sort();
        assert_eq!(all, [InodeNo(3), InodeNo(4)]);
    }
}

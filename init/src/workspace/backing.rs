//! The passthrough backing files the adapter registered with the kernel: which id each
//! passthrough handle was answered with, and which id an inode's next passthrough open
//! reuses.
//!
//! The kernel wants one backing file per inode for all its open passthrough handles, so an
//! open reuses the inode's registered id, but only while that id is still held by a handle
//! *and* was registered for the very body `fs` hands out now. Counting handles per inode is
//! not enough: a RELEASE that closed the last passthrough handle and an OPEN on another
//! FUSE thread may meet between `fs`'s lock and this map's, and the OPEN may get a new body
//! (the file went back inline at that release and took a fresh body again). Reusing the old
//! id then sent the kernel's writes to the old body while keel read the new one: writes were
//! lost (`mount_basic`'s rare stale reads). So ids are owned per handle and matched to their
//! body by identity.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::{Arc, Weak};

/// Registered ids of type `T` (fuser's `BackingId`; anything in the tests). Dropping the last
/// `Arc` of an id unregisters it.
#[derive(Debug)]
pub(super) struct Backings<T> {
    /// Per inode: the body its newest id was registered for, and that id. Both weak: the
    /// handles own the id, the fs owns the body.
    by_ino: HashMap<u64, (Weak<File>, Weak<T>)>,
    /// Per passthrough handle: the id its open was answered with.
    by_fh: HashMap<u64, Arc<T>>,
}

impl<T> Default for Backings<T> {
    fn default() -> Self {
        Backings {
            by_ino: HashMap::new(),
            by_fh: HashMap::new(),
        }
    }
}

impl<T> Backings<T> {
    /// The id for passthrough handle `fh` of inode `ino` over `body`: the inode's live id if
    /// it was registered for this same body, else a new one from `register`.
    pub(super) fn acquire(
        &mut self,
        ino: u64,
        fh: u64,
        body: &Arc<File>,
        register: impl FnOnce(&File) -> io::Result<T>,
    ) -> io::Result<Arc<T>> {
        let live = self.by_ino.get(&ino).and_then(|(file, id)| {
            if std::ptr::eq(file.as_ptr(), Arc::as_ptr(body)) {
                id.upgrade()
            } else {
                None
            }
        });
        let id = match live {
            Some(id) => id,
            None => {
                let id = Arc::new(register(body)?);
                self.by_ino
                    .insert(ino, (Arc::downgrade(body), Arc::downgrade(&id)));
                id
            }
        };
        self.by_fh.insert(fh, id.clone());
        Ok(id)
    }

    /// Handle `fh` of inode `ino` is released: its id goes (unregistered when no other handle
    /// holds it). Nothing for a handle that was not passed through.
    pub(super) fn release(&mut self, ino: u64, fh: u64) {
        drop(self.by_fh.remove(&fh));
        if self
            .by_ino
            .get(&ino)
            .is_some_and(|(_, id)| id.strong_count() == 0)
        {
            self.by_ino.remove(&ino);
        }
    }

    /// Ids registered and held by a handle.
    #[cfg(test)]
    fn live(&self) -> usize {
        self.by_ino
            .values()
            .filter(|(_, id)| id.strong_count() > 0)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn body() -> Arc<File> {
        Arc::new(tempfile::tempfile().unwrap())
    }

    /// A stand-in for the kernel's registration: ids 1, 2, 3... in the order asked.
    fn ids(next: &Cell<u32>) -> impl Fn(&File) -> io::Result<u32> + Copy + '_ {
        move |_| {
            next.set(next.get() + 1);
            Ok(next.get())
        }
    }

    #[test]
    fn handles_on_one_body_share_its_id_until_the_last_release() {
        let next = Cell::new(0u32);
        let reg = ids(&next);
        let mut b = Backings::default();
        let f = body();
        let a = b.acquire(7, 1, &f, reg).unwrap();
        let c = b.acquire(7, 2, &f, reg).unwrap();
        assert_eq!((*a, *c), (1, 1), "one registration for one body");
        drop((a, c));
        b.release(7, 1);
        assert_eq!(b.live(), 1, "handle 2 still holds it");
        b.release(7, 2);
        assert_eq!(b.live(), 0);
        assert!(b.by_ino.is_empty() && b.by_fh.is_empty());
        assert_eq!(*b.acquire(7, 3, &f, reg).unwrap(), 2, "registered anew");
    }

    #[test]
    fn a_new_body_gets_a_new_id_even_before_the_old_handle_is_released() {
        // The race this module exists for: fs released the last handle on the old body and
        // handed a new body to an open before the adapter saw the release.
        let next = Cell::new(0u32);
        let reg = ids(&next);
        let mut b = Backings::default();
        let (old, new) = (body(), body());
        let a = b.acquire(7, 1, &old, reg).unwrap();
        let n = b.acquire(7, 2, &new, reg).unwrap();
        assert_eq!((*a, *n), (1, 2), "the old body's id must not be reused");
        drop(a);
        b.release(7, 1);
        assert_eq!(b.live(), 1, "the new body's id stays registered");
        assert_eq!(
            *b.acquire(7, 3, &new, reg).unwrap(),
            2,
            "and is reused for it"
        );
        drop(n);
        b.release(7, 2);
        b.release(7, 3);
        assert!(b.by_ino.is_empty() && b.by_fh.is_empty());
    }

    #[test]
    fn a_refused_registration_leaves_nothing_behind() {
        let mut b: Backings<u32> = Backings::default();
        let f = body();
        let e = b
            .acquire(7, 1, &f, |_| Err(io::Error::from_raw_os_error(libc::EPERM)))
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        assert!(b.by_ino.is_empty() && b.by_fh.is_empty());
        b.release(7, 1);
    }
}

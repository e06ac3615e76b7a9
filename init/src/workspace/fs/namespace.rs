//! Names and attributes: lookup and forget, getattr/setattr, creating, linking, removing
//! and renaming entries, and reading directories.

use super::group::Batch;
use super::{
    Attr, Caller, DirEntry, FsError, FsResult, Handle, Inner, SetAttr, SetTime, WorkspaceFs,
};
use super::{LINK_MAX, NAME_MAX, PATH_MAX, RENAME_EXCHANGE, RENAME_NOREPLACE};
use crate::meta::{Dirent, InodeNo, Kind, Nanos, Storage};
use crate::workspace::feed::Op;

/// What to create in `make`.
pub(super) struct New<'a> {
    pub(super) kind: Kind,
    pub(super) perm: u32,
    pub(super) rdev: u32,
    pub(super) target: Option<&'a [u8]>,
}

pub(super) fn check_name(name: &[u8]) -> FsResult<()> {
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    if name.is_empty() || name.contains(&b'/') || name == b"." || name == b".." {
        return Err(FsError::Invalid);
    }
    Ok(())
}

impl WorkspaceFs {
    // ----- namespace -----

    pub fn lookup(&self, parent: InodeNo, name: &[u8]) -> FsResult<Attr> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let ino = match name {
            // Only the kernel's export operations ask for these, by inode number, to open a
            // file handle whose inode it no longer caches (`open_by_handle_at`): "." is the
            // inode itself, of any kind, ".." a directory's parent; an inode with no name
            // left (unlinked, open or not) is gone for a handle, as on ext4.
            b"." => {
                if Self::load(inner, parent)?.nlink == 0 {
                    return Err(FsError::NotFound);
                }
                parent
            }
            b".." => {
                let p = Self::load_dir(inner, parent)?;
                if p.nlink == 0 {
                    return Err(FsError::NotFound);
                }
                p.parent
            }
            _ => {
                Self::load_dir(inner, parent)?;
                // The entry and its inode's row in one statement; a loaded file's
                // attributes in memory are newer than its row, so they win.
                let row = inner
                    .store
                    .read()
                    .lookup_inode(parent, name)?
                    .ok_or(FsError::NotFound)?;
                let ino = row.ino;
                if inner.nodes.get(&ino).is_none_or(|n| n.open.is_none())
                    && !inner.mapped.contains(ino)
                {
                    let attr = self.attr(row, None)?;
                    Self::remember(inner, ino);
                    return Ok(attr);
                }
                ino
            }
        };
        let attr = self.fresh_attr(inner, ino)?;
        Self::remember(inner, ino);
        Ok(attr)
    }

    /// Drops `n` of the kernel's lookups; at none left, `settle` (Known/Lingering → Stored,
    /// or Deleted for an unlinked inode).
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
        // Only a truncate that shrinks the file makes room, so only it may take the metadata
        // reserve (`freeing`). A chmod, utimens or truncate up on a full volume gets ENOSPC
        // and leaves the reserve to the deletes that free the volume: spent on anything
        // else, its room goes to the next data write and the delete has none.
        let shrinks = match set.size {
            Some(size) => self.getattr(ino)?.inode.size > size,
            None => false,
        };
        if shrinks {
            self.freeing(|| self.setattr_once(ino, set))
        } else {
            self.setattr_once(ino, set)
        }
    }

    pub(super) fn setattr_once(&self, ino: InodeNo, set: &SetAttr) -> FsResult<Attr> {
        if let Some(size) = set.size {
            self.lazy_prepare_truncate(ino, size)?;
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        self.sync_from_body(inner, ino)?;
        self.track_inode(inner, ino);
        if let Some(loss) = set.drop_setid {
            Self::kill_privs_locked(inner, ino, loss)?;
        }
        let t = Nanos::now();
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
        let mut chmod_acl = None;
        if let Some(mode) = set.mode {
            inode.perm = mode & 0o7777;
            chmod_acl = self.acl_after_chmod(inner, ino, inode.perm)?;
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
        Self::save_chmod_acl(&tx, ino, chmod_acl.as_ref())?;
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        if set.size.is_some() {
            self.fed_touched(inner, ino);
        }
        if set.mode.is_some()
            || set.uid.is_some()
            || set.gid.is_some()
            || set.atime.is_some()
            || set.mtime.is_some()
        {
            let size = Some(inode.size);
            self.fed_inode(inner, Op::Attrib, ino, inode.kind, size);
        }
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
    pub(super) fn make(
        &self,
        caller: Caller,
        parent: InodeNo,
        name: &[u8],
        new: New<'_>,
    ) -> FsResult<Attr> {
        let mut guard = self.lock();
        self.make_locked(&mut guard, caller, parent, name, new)
    }

    /// `make` with the lock held (`create` goes on to open the new file under it).
    pub(super) fn make_locked(
        &self,
        inner: &mut Inner,
        caller: Caller,
        parent: InodeNo,
        name: &[u8],
        new: New<'_>,
    ) -> FsResult<Attr> {
        let New {
            kind,
            perm,
            rdev,
            target,
        } = new;
        check_name(name)?;
        let mut p = Self::load_dir(inner, parent)?;
        if p.nlink == 0 {
            return Err(FsError::NotFound);
        }
        let mut inode = Self::new_inode(caller, &p, kind, perm, rdev);
        let acls = self.inherit_acl(inner, parent, &mut inode, caller.umask)?;
        if let Some(t) = target {
            inode.size = t.len() as u64;
        }
        let t = inode.ctime;
        let mut tx = Batch::new(&inner.store)?;
        inode.ino = tx.insert(&inode)?;
        // The name's existence is checked by the entry's insert (its primary key), in the
        // same transaction: dropping `tx` on EEXIST takes the inserted row back with it.
        if !tx.link_new(parent, name, inode.ino, kind)? {
            return Err(FsError::Exists);
        }
        if let Some(target) = target {
            tx.set_symlink_target(inode.ino, target)?;
        }
        for (n, v) in &acls {
            tx.set_xattr(inode.ino, n, v)?;
        }
        if kind == Kind::Dir {
            p.nlink += 1;
        }
        p.mtime = t;
        p.ctime = t;
        tx.save(&inner.nodes, &p)?;
        tx.commit(&mut inner.nodes)?;
        self.track_entry(inner, parent, name, None);
        self.track_new(inner, inode.ino);
        self.fed_entry(
            inner,
            Op::Create,
            (parent, name),
            kind,
            inode.ino,
            Some(inode.size),
        );
        Self::remember(inner, inode.ino);
        // Created with no xattr unless it inherited ACLs: a lost group forgets this too.
        if acls.is_empty() {
            Self::has_no_xattrs(inner, inode.ino);
        }
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

    pub(super) fn remove(&self, parent: InodeNo, name: &[u8], dir: bool) -> FsResult<()> {
        if name.len() > NAME_MAX {
            return Err(FsError::NameTooLong);
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let mut p = Self::load_dir(inner, parent)?;
        // The entry and its inode's row in one statement (a loaded file's attributes in
        // memory are newer than its row: they win).
        let row = inner
            .store
            .read()
            .lookup_inode(parent, name)?
            .ok_or(FsError::NotFound)?;
        let mut child = match inner.nodes.get(&row.ino).and_then(|n| n.open.as_ref()) {
            Some(of) => of.inode.clone(),
            None => row,
        };
        self.track_entry(inner, parent, name, Some((child.ino, child.kind)));
        self.track_inode(inner, child.ino);
        let t = Nanos::now();
        if dir {
            if child.kind != Kind::Dir {
                return Err(FsError::NotDir);
            }
            if !inner.store.read().dir_is_empty(child.ino)? {
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
        // Nobody uses it: the inode goes in the same transaction as its last name, and its
        // `Node` with it (Deleted: row and node gone). The kernel may still hold a lookup
        // reference on a file; its `forget` then finds no node and has nothing to do (no
        // `SELECT` of the row this deleted).
        let delete_now = child.nlink == 0 && !Self::in_use(inner, child.ino, child.kind);
        let mut tx = Batch::new(&inner.store)?;
        tx.unlink(parent, name)?;
        if delete_now {
            let xattrs = !inner.no_xattrs.contains(&child.ino);
            tx.delete_known(child.ino, Some(child.kind), xattrs)?;
        } else {
            tx.save(&inner.nodes, &child)?;
        }
        tx.save(&inner.nodes, &p)?;
        tx.commit(&mut inner.nodes)?;
        self.fed_entry(
            inner,
            Op::Delete,
            (parent, name),
            child.kind,
            child.ino,
            None,
        );
        if delete_now {
            inner.nodes.remove(&child.ino);
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
        self.track_entry(inner, newparent, newname, None);
        self.track_inode(inner, ino);
        let t = Nanos::now();
        inode.nlink += 1;
        inode.ctime = t;
        p.mtime = t;
        p.ctime = t;
        let mut tx = Batch::new(&inner.store)?;
        tx.link(newparent, newname, ino, inode.kind)?;
        tx.save(&inner.nodes, &inode)?;
        tx.save(&inner.nodes, &p)?;
        tx.commit(&mut inner.nodes)?;
        let size = Some(inode.size);
        self.fed_entry(
            inner,
            Op::Create,
            (newparent, newname),
            inode.kind,
            ino,
            size,
        );
        Self::remember(inner, ino);
        self.fresh_attr(inner, ino)
    }

    /// Is `dir` equal to `ancestor` or below it?
    pub(super) fn is_within(inner: &Inner, mut dir: InodeNo, ancestor: InodeNo) -> FsResult<bool> {
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
        // A rename over another file deletes it and may take the metadata reserve; any other
        // rename leaves it to the deletes (see `setattr`).
        let replaces = flags & RENAME_EXCHANGE == 0
            && matches!(
                self.lock().store.read().lookup(newparent, newname),
                Ok(Some(_))
            );
        if replaces {
            self.freeing(|| self.rename_once(parent, name, newparent, newname, flags))
        } else {
            self.rename_once(parent, name, newparent, newname, flags)
        }
    }

    pub(super) fn rename_once(
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
        let t = Nanos::now();

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

        if !inner.trackers.is_empty() {
            self.track_entry(inner, parent, name, Some((src.ino, src.kind)));
            let was = dst.as_ref().map(|d| (d.ino, d.kind));
            self.track_entry(inner, newparent, newname, was);
            self.track_inode(inner, src.ino);
            if let Some(v) = &victim {
                self.track_inode(inner, v.ino);
            }
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
        self.fed_rename(
            inner,
            (parent, name),
            (newparent, newname),
            s.kind,
            src.ino,
            dst.is_some(),
        );
        if let Some(v) = victim {
            if v.nlink == 0 && !Self::in_use(inner, v.ino, v.kind) {
                self.purge(inner, v.ino)?;
            }
        }
        Ok(())
    }

    pub(super) fn exchange(
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
        if !inner.trackers.is_empty() {
            self.track_entry(inner, parent, &a.name, Some((a.ino, a.kind)));
            self.track_entry(inner, newparent, &b.name, Some((b.ino, b.kind)));
            self.track_inode(inner, a.ino);
            self.track_inode(inner, b.ino);
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
        // Each moved to where the other was.
        let (pa, pb) = ((parent, &a.name[..]), (newparent, &b.name[..]));
        self.fed_rename(inner, pa, pb, ia.kind, a.ino, true);
        self.fed_rename(inner, pb, pa, ib.kind, b.ino, true);
        Ok(())
    }

    // ----- directories -----

    /// Opens a directory. An open directory is in use like an open file: removed or renamed
    /// over, it stays (nlink 0) until its last handle is released and the kernel forgets it,
    /// so `fstat` of the handle still answers, as on ext4.
    pub fn opendir(&self, ino: InodeNo) -> FsResult<u64> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        Self::load_dir(inner, ino)?;
        inner.nodes.entry(ino).or_default().opens += 1;
        Ok(Self::new_handle(
            inner,
            Handle::Dir {
                ino,
                entries: Vec::new(),
            },
        ))
    }

    /// What READDIR lists for directory `ino` now: `.`, `..` and its entries.
    fn listing(inner: &Inner, ino: InodeNo) -> FsResult<Vec<DirEntry>> {
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
        Ok(entries)
    }

    /// The entries of handle `fh` from `offset` on; from offset 0 the listing is read again
    /// (see `Handle::Dir`).
    fn dir_entries(inner: &mut Inner, fh: u64, offset: u64) -> FsResult<Vec<DirEntry>> {
        let Some(Handle::Dir { ino, .. }) = inner.handles.get(&fh) else {
            return Err(FsError::BadHandle);
        };
        let ino = *ino;
        if offset == 0 {
            let fresh = Self::listing(inner, ino)?;
            if let Some(Handle::Dir { entries, .. }) = inner.handles.get_mut(&fh) {
                *entries = fresh;
            }
        }
        let Some(Handle::Dir { entries, .. }) = inner.handles.get(&fh) else {
            return Err(FsError::BadHandle);
        };
        Ok(entries.iter().skip(offset as usize).cloned().collect())
    }

    /// Entries of an open directory from `offset` on; each comes with the offset of the next.
    /// `add` returns true when the reply buffer is full.
    pub fn readdir(
        &self,
        fh: u64,
        offset: u64,
        mut add: impl FnMut(&DirEntry, u64) -> bool,
    ) -> FsResult<()> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let entries = Self::dir_entries(inner, fh, offset)?;
        for (i, e) in entries.iter().enumerate() {
            if add(e, offset + i as u64 + 1) {
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
        let entries = Self::dir_entries(inner, fh, offset)?;
        for (i, e) in entries.iter().enumerate() {
            let attr = match self.fresh_attr(inner, e.ino) {
                Ok(a) => a,
                // Removed since the listing was read: skip it.
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

    /// Closes a directory handle; a directory removed while open goes once the kernel also
    /// forgets it (`settle`).
    pub fn releasedir(&self, fh: u64) {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let Some(Handle::Dir { ino, .. }) = inner.handles.remove(&fh) else {
            return;
        };
        if let Some(node) = inner.nodes.get_mut(&ino) {
            node.opens = node.opens.saturating_sub(1);
        }
        if let Err(e) = self.settle(inner, ino) {
            tracing::warn!(ino = ino.0, error = %e, "releasedir: could not settle the directory");
        }
    }

    pub fn fsyncdir(&self) -> FsResult<()> {
        self.lock().sync(self.opts.chunk_size)?;
        Ok(())
    }
}

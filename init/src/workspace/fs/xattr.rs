//! Extended attributes, POSIX ACLs kept in step with the mode (setfacl changes the mode,
//! chmod the access ACL, new inodes inherit their directory's default ACL; the kernel enforces
//! them, see `acl`), the privileges a file loses on chown or write (set-ID bits,
//! `security.capability`), and `access(2)`.

use crate::meta::Nanos;
use std::sync::atomic::Ordering;

use super::acl::{self, Acl};
use super::group::Batch;
use super::{Caller, FsError, FsResult, Inner, SetAttr, SetIdLoss, WorkspaceFs};
use super::{XATTR_CREATE, XATTR_NAME_MAX, XATTR_REPLACE, XATTR_SIZE_MAX};
use crate::meta::{Inode, InodeNo, Kind};
use crate::sys;
use crate::workspace::feed::Op;

/// Most inodes remembered as having no xattrs (the set starts over when full, emptied of
/// its memory too: at 1 << 20 it held 18 MiB at a million files; a miss costs one row read).
pub(super) const NO_XATTRS_MAX: usize = 1 << 16;
/// The xattr the kernel probes before writes and that `drop_setid` drops.
pub(super) const CAPABILITY_XATTR: &[u8] = b"security.capability";
/// The most bytes (names and values) of xattrs one file may hold. ext4 keeps a file's xattrs
/// in its inode and one 4 KiB block; keel allows four of the largest values Linux passes
/// (`XATTR_SIZE_MAX`), so a file cannot grow every metadata image by hundreds of MiB. A
/// setxattr past it gets ENOSPC, as on a full ext4 xattr block.
pub const XATTRS_PER_FILE_MAX: u64 = 256 * 1024;

/// The set-ID bits of a file (mode `perm`, group `gid`) that `loss` by a caller with
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

/// Whether the caller is in group `gid` or holds CAP_FSETID (the kernel's
/// `in_group_or_capable`): if not, setting an access ACL clears set-group-ID. A caller that
/// is gone counts as root if its uid is 0.
fn in_group_or_fsetid(caller: Caller, gid: u32) -> bool {
    let creds = sys::creds::of_pid(caller.pid).unwrap_or_else(|_| sys::creds::Creds {
        fsetid: caller.uid == 0,
        groups: vec![caller.gid],
    });
    creds.fsetid || creds.groups.contains(&gid)
}

/// What a SETATTR costs a file's set-ID bits when the kernel leaves dropping them to the
/// filesystem (FUSE_HANDLE_KILLPRIV_V2), decided from the request's shape as the kernel
/// would (it does not say, through fuser, whether it set FATTR_KILL_SUIDGID): a chown or
/// chgrp (uid or gid set, or nothing set at all but perhaps ctime, which is what
/// `chown(f, -1, -1)` sends) is a chown; a truncate is a modification (which keeps the bits
/// for a caller with CAP_FSETID, the case the kernel leaves FATTR_KILL_SUIDGID out for).
impl SetAttr {
    pub fn setid_loss(&self, caller: Caller) -> Option<SetIdLoss> {
        let times = self.atime.is_some() || self.mtime.is_some();
        if self.uid.is_some()
            || self.gid.is_some()
            || (self.mode.is_none() && self.size.is_none() && !times)
        {
            Some(SetIdLoss::Chown(caller))
        } else if self.size.is_some() {
            Some(SetIdLoss::Modify(caller))
        } else {
            None
        }
    }
}

/// What getxattr/listxattr return for a caller's buffer of `size` bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum XattrReply {
    /// `size` was 0: the caller asks how large a buffer it needs.
    Size(u32),
    /// The value (or name list), which fits the buffer.
    Value(Vec<u8>),
}

impl XattrReply {
    /// The answer to a caller with a `size`-byte buffer: ERANGE when `v` does not fit.
    pub fn fit(v: Vec<u8>, size: u32) -> FsResult<XattrReply> {
        if size == 0 {
            Ok(XattrReply::Size(v.len() as u32))
        } else if v.len() > size as usize {
            Err(FsError::Range)
        } else {
            Ok(XattrReply::Value(v))
        }
    }
}

impl WorkspaceFs {
    // ----- xattrs -----

    /// Sets an xattr. The ACL xattrs are checked and applied as setfacl on ext4 applies
    /// them (see `set_acl`); `caller` matters only there.
    pub fn setxattr(
        &self,
        caller: Caller,
        ino: InodeNo,
        name: &[u8],
        value: &[u8],
        flags: i32,
    ) -> FsResult<()> {
        if name.is_empty() || name.len() > XATTR_NAME_MAX {
            return Err(FsError::Range);
        }
        if value.len() > XATTR_SIZE_MAX {
            return Err(FsError::TooBig);
        }
        if acl::is_acl_name(name) {
            return self.set_acl(caller, ino, name, value);
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
        let others = inner.store.read().xattr_bytes_except(ino, name)?;
        if others + (name.len() + value.len()) as u64 > XATTRS_PER_FILE_MAX {
            return Err(FsError::XattrsFull);
        }
        inode.ctime = Nanos::now();
        self.track_inode(inner, ino);
        let mut tx = Batch::new(&inner.store)?;
        tx.set_xattr(ino, name, value)?;
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        inner.no_xattrs.remove(&ino);
        self.fed_inode(inner, Op::Attrib, ino, inode.kind, Some(inode.size));
        Ok(())
    }

    /// Whether the kernel enforces POSIX ACLs on this mount (see `FsOptions::posix_acl`).
    pub fn posix_acls(&self) -> bool {
        self.opts.posix_acl.load(Ordering::Relaxed)
    }

    /// EOPNOTSUPP for an ACL xattr while the kernel does not enforce ACLs.
    fn acls_enforced(&self) -> FsResult<()> {
        if self.posix_acls() {
            Ok(())
        } else {
            Err(FsError::NotSupported)
        }
    }

    /// setfacl, as ext4 does it (the kernel's `fuse_set_acl` leaves all of it to keel): a
    /// default ACL only on a directory; an access ACL sets the mode's permission bits (owner,
    /// mask or group, other), is not stored when the mode says it all, and clears
    /// set-group-ID unless the caller is in the file's group or holds CAP_FSETID.
    fn set_acl(&self, caller: Caller, ino: InodeNo, name: &[u8], value: &[u8]) -> FsResult<()> {
        self.acls_enforced()?;
        let acl = Acl::decode(value).map_err(|e| {
            tracing::debug!(ino = ino.0, error = %e, "refused an ACL");
            FsError::Invalid
        })?;
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        self.sync_from_body(inner, ino)?;
        let mut inode = Self::load(inner, ino)?;
        if inode.kind == Kind::Symlink {
            return Err(FsError::NotSupported);
        }
        let access = name == acl::ACCESS;
        if !access && inode.kind != Kind::Dir {
            return Err(FsError::Access);
        }
        self.track_inode(inner, ino);
        let mut tx = Batch::new(&inner.store)?;
        if access {
            inode.perm = acl.equiv_mode(inode.perm);
            if inode.perm & libc::S_ISGID != 0 && !in_group_or_fsetid(caller, inode.gid) {
                inode.perm &= !libc::S_ISGID;
            }
            Self::put_access_acl(&tx, ino, &acl)?;
        } else {
            tx.set_xattr(ino, acl::DEFAULT, &acl.encode())?;
        }
        inode.ctime = Nanos::now();
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        inner.no_xattrs.remove(&ino);
        self.fed_inode(inner, Op::Attrib, ino, inode.kind, Some(inode.size));
        Ok(())
    }

    /// Stores `acl` as the access ACL of `ino`, or none when the mode says it all.
    fn put_access_acl(tx: &Batch<'_>, ino: InodeNo, acl: &Acl) -> FsResult<()> {
        if acl.is_minimal() {
            tx.remove_xattr(ino, acl::ACCESS)?;
        } else {
            tx.set_xattr(ino, acl::ACCESS, &acl.encode())?;
        }
        Ok(())
    }

    /// chmod of an inode with an access ACL rewrites it (owner, mask or group, other) as
    /// ext4's `posix_acl_chmod` does: the inode's access ACL for its new `perm`, to store
    /// with it; `None` when it has none (or ACLs are not enforced).
    pub(super) fn acl_after_chmod(
        &self,
        inner: &mut Inner,
        ino: InodeNo,
        perm: u32,
    ) -> FsResult<Option<Acl>> {
        if !self.posix_acls() {
            return Ok(None);
        }
        let Some(v) = Self::xattr_cached(inner, ino, acl::ACCESS)? else {
            return Ok(None);
        };
        let mut a = Acl::decode(&v).map_err(FsError::StoredAcl)?;
        a.chmod(perm);
        Ok(Some(a))
    }

    /// Saves what `acl_after_chmod` made, in the chmod's transaction.
    pub(super) fn save_chmod_acl(tx: &Batch<'_>, ino: InodeNo, acl: Option<&Acl>) -> FsResult<()> {
        match acl {
            Some(a) => Self::put_access_acl(tx, ino, a),
            None => Ok(()),
        }
    }

    /// A new inode's mode and ACLs, as ext4's `posix_acl_create` makes them: with a default
    /// ACL on `parent`, the mode masked by it (the umask does not apply) and the ACL xattrs
    /// it inherits, returned to store with it; without one, the mode masked by `umask`.
    /// Symlinks get neither.
    pub(super) fn inherit_acl(
        &self,
        inner: &mut Inner,
        parent: InodeNo,
        inode: &mut Inode,
        umask: u32,
    ) -> FsResult<Vec<(&'static [u8], Vec<u8>)>> {
        if inode.kind == Kind::Symlink {
            return Ok(Vec::new());
        }
        let default = if self.posix_acls() {
            Self::xattr_cached(inner, parent, acl::DEFAULT)?
        } else {
            None
        };
        let Some(v) = default else {
            inode.perm &= !(umask & 0o777);
            return Ok(Vec::new());
        };
        let d = Acl::decode(&v).map_err(FsError::StoredAcl)?;
        let got = acl::inherit(&d, inode.perm, inode.kind == Kind::Dir);
        inode.perm = got.perm;
        let mut out = Vec::new();
        if let Some(a) = got.access {
            out.push((acl::ACCESS, a.encode()));
        }
        if let Some(a) = got.default {
            out.push((acl::DEFAULT, a.encode()));
        }
        Ok(out)
    }

    pub fn getxattr(&self, ino: InodeNo, name: &[u8]) -> FsResult<Vec<u8>> {
        if name.len() > XATTR_NAME_MAX {
            return Err(FsError::Range);
        }
        if acl::is_acl_name(name) {
            self.acls_enforced()?;
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        Self::load(inner, ino)?;
        Self::xattr_cached(inner, ino, name)?.ok_or(FsError::NoAttr)
    }

    /// One xattr's value; remembers inodes that have none at all, so the kernel's
    /// `security.capability` probes cost no SQLite query.
    pub(super) fn xattr_cached(
        inner: &mut Inner,
        ino: InodeNo,
        name: &[u8],
    ) -> FsResult<Option<Vec<u8>>> {
        if inner.no_xattrs.contains(&ino) {
            return Ok(None);
        }
        let v = inner.store.read().xattr(ino, name)?;
        if v.is_none() && inner.store.read().xattr_names(ino)?.is_empty() {
            Self::has_no_xattrs(inner, ino);
        }
        Ok(v)
    }

    /// Remembers that `ino` has no xattr at all (known from the store, or because keel just
    /// created it with none): the kernel's `security.capability` probe before the first
    /// write of every new file then costs no SQLite query.
    pub(super) fn has_no_xattrs(inner: &mut Inner, ino: InodeNo) {
        if inner.no_xattrs.len() >= NO_XATTRS_MAX {
            inner.no_xattrs.clear();
        }
        inner.no_xattrs.insert(ino);
    }

    /// Drops from a file what `loss` costs it on ext4: the set-ID bits the kernel would
    /// clear for this caller (see [`setid_lost`]) and `security.capability`. With
    /// FUSE_HANDLE_KILLPRIV_V2 the kernel leaves this to the filesystem and, in return, stops
    /// asking for `security.capability` before every write. Every kind of file but a
    /// directory loses them on chown (a FIFO, socket or device node as much as a regular
    /// file: `chown_common` asks for it on anything but a directory); directories keep
    /// everything. Returns whether anything was dropped.
    pub fn drop_setid(&self, ino: InodeNo, loss: SetIdLoss) -> FsResult<bool> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        self.sync_from_body(inner, ino)?;
        self.track_inode(inner, ino);
        Self::kill_privs_locked(inner, ino, loss)
    }

    /// An open that truncates (O_TRUNC, writable) is a modification: drops what
    /// `drop_setid` drops for `caller` (the kernel leaves this to the filesystem under
    /// FUSE_HANDLE_KILLPRIV_V2, and fuser does not pass FUSE_OPEN_KILL_SUIDGID). Other opens
    /// change nothing.
    pub fn drop_setid_on_open(&self, ino: InodeNo, flags: i32, caller: Caller) -> FsResult<bool> {
        if flags & libc::O_TRUNC != 0 && flags & libc::O_ACCMODE != libc::O_RDONLY {
            self.drop_setid(ino, SetIdLoss::Modify(caller))
        } else {
            Ok(false)
        }
    }

    pub(super) fn kill_privs_locked(
        inner: &mut Inner,
        ino: InodeNo,
        loss: SetIdLoss,
    ) -> FsResult<bool> {
        let mut inode = Self::load(inner, ino)?;
        if inode.kind == Kind::Dir {
            return Ok(false);
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
            return Ok(false);
        }
        inode.perm = perm;
        inode.ctime = Nanos::now();
        let mut tx = Batch::new(&inner.store)?;
        if cap {
            tx.remove_xattr(ino, CAPABILITY_XATTR)?;
        }
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        Ok(true)
    }

    /// All xattr names, each followed by a NUL byte (the ACL xattrs only while the kernel
    /// enforces ACLs).
    pub fn listxattr(&self, ino: InodeNo) -> FsResult<Vec<u8>> {
        let guard = self.lock();
        let inner: &Inner = &guard;
        Self::load(inner, ino)?;
        let acls = self.posix_acls();
        let mut out = Vec::new();
        for n in inner.store.read().xattr_names(ino)? {
            if acls || !acl::is_acl_name(&n) {
                out.extend_from_slice(&n);
                out.push(0);
            }
        }
        Ok(out)
    }

    /// Removes an xattr. Removing an ACL the inode does not have succeeds, as on ext4 (the
    /// mode stays as it is either way).
    pub fn removexattr(&self, ino: InodeNo, name: &[u8]) -> FsResult<()> {
        let is_acl = acl::is_acl_name(name);
        if is_acl {
            self.acls_enforced()?;
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let mut inode = Self::load(inner, ino)?;
        inode.ctime = Nanos::now();
        self.track_inode(inner, ino);
        let mut tx = Batch::new(&inner.store)?;
        if !tx.remove_xattr(ino, name)? {
            return if is_acl { Ok(()) } else { Err(FsError::NoAttr) };
        }
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        self.fed_inode(inner, Op::Attrib, ino, inode.kind, Some(inode.size));
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workspace::fs::SetTime;

    #[test]
    fn setid_bits_lost_as_on_ext4() {
        let c = Caller {
            uid: 1000,
            gid: 100,
            pid: 0,
            umask: 0,
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

    #[test]
    fn setattr_shapes() {
        let c = Caller {
            uid: 1,
            gid: 1,
            pid: 0,
            umask: 0,
        };
        let loss = |mode, uid, gid, size, times: bool| {
            let t = times.then_some(SetTime::Now);
            SetAttr {
                mode,
                uid,
                gid,
                size,
                atime: t,
                mtime: t,
                ..SetAttr::default()
            }
            .setid_loss(c)
        };
        let chown = Some(SetIdLoss::Chown(c));
        assert_eq!(loss(None, Some(2), None, None, false), chown);
        assert_eq!(loss(None, None, Some(2), None, false), chown);
        // chown(f, -1, -1)
        assert_eq!(loss(None, None, None, None, false), chown);
        assert_eq!(
            loss(None, None, None, Some(0), false),
            Some(SetIdLoss::Modify(c))
        );
        assert_eq!(loss(Some(0o644), None, None, None, false), None);
        assert_eq!(loss(None, None, None, None, true), None);
    }

    #[test]
    fn xattr_replies_fit_the_callers_buffer() {
        assert_eq!(
            XattrReply::fit(b"abc".to_vec(), 0).unwrap(),
            XattrReply::Size(3)
        );
        assert_eq!(
            XattrReply::fit(b"abc".to_vec(), 3).unwrap(),
            XattrReply::Value(b"abc".to_vec())
        );
        assert!(matches!(
            XattrReply::fit(b"abc".to_vec(), 2),
            Err(FsError::Range)
        ));
    }
}

//! The thin adapter between the kernel's FUSE requests (fuser) and `WorkspaceFs`: converts
//! arguments and replies, nothing else. All POSIX decisions live in `fs.rs`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BackingId, BsdFileFlags, CopyFileRangeFlags, Errno, FileAttr, FileHandle,
    FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig,
    LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use super::fs::{Attr, Caller, FsError, OpenInfo, SetAttr, SetTime, WorkspaceFs};
use crate::meta::{InodeNo as Ino, Kind, Nanos};

/// Kernel cache lifetimes.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub attr: Duration,
    pub entry: Duration,
    pub negative: Duration,
}

/// Kernel features requested at init.
#[derive(Debug, Clone)]
pub struct KernelFeatures {
    pub writeback_cache: bool,
    /// Ask for FUSE passthrough (`Some(true)` = required, `Some(false)` = if offered).
    pub passthrough: Option<bool>,
    /// Set here when the kernel accepted passthrough; read by `WorkspaceFs`.
    pub passthrough_on: Arc<AtomicBool>,
}

pub struct FuseAdapter {
    fs: Arc<WorkspaceFs>,
    timeouts: Timeouts,
    features: KernelFeatures,
    /// Backing files registered with the kernel, per inode, with their handle count.
    backing: Mutex<HashMap<u64, (BackingId, u32)>>,
    /// FUSE_HANDLE_KILLPRIV_V2 is on: keel drops setuid/setgid itself (see `kill_privs`).
    killpriv: bool,
}

impl FuseAdapter {
    pub fn new(fs: Arc<WorkspaceFs>, timeouts: Timeouts, features: KernelFeatures) -> Self {
        FuseAdapter {
            fs,
            timeouts,
            features,
            backing: Mutex::new(HashMap::new()),
            killpriv: false,
        }
    }

    fn backing(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (BackingId, u32)>> {
        self.backing.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn backing_failed(&self, fh: u64, e: &std::io::Error) {
        tracing::warn!(error = %e, "passthrough registration failed");
        let _ = self.fs.release(fh);
    }
}

/// The kernel wants one backing id per inode for all its passthrough handles: reuse the
/// registered one, or register `file` with `open` for the first handle.
fn acquire_backing<'m>(
    map: &'m mut HashMap<u64, (BackingId, u32)>,
    ino: u64,
    file: &std::fs::File,
    open: impl FnOnce(&std::fs::File) -> std::io::Result<BackingId>,
) -> std::io::Result<&'m BackingId> {
    use std::collections::hash_map::Entry;
    match map.entry(ino) {
        Entry::Occupied(e) => {
            let (id, n) = e.into_mut();
            *n += 1;
            Ok(id)
        }
        Entry::Vacant(v) => {
            let id = open(file)?;
            Ok(&v.insert((id, 1)).0)
        }
    }
}

thread_local! {
    static READ_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn errno(e: &FsError) -> Errno {
    if let FsError::Io(_) | FsError::Meta(_) = e {
        tracing::debug!(error = %e, "request failed");
    }
    Errno::from_i32(e.errno())
}

fn ino(i: INodeNo) -> Ino {
    Ino(i.0)
}

fn time(n: Nanos) -> SystemTime {
    if n.0 >= 0 {
        UNIX_EPOCH + Duration::from_nanos(n.0 as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(n.0.unsigned_abs())
    }
}

fn nanos(t: SystemTime) -> Nanos {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Nanos(d.as_nanos() as i64),
        Err(e) => Nanos(-(e.duration().as_nanos() as i64)),
    }
}

fn file_type(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDev => FileType::CharDevice,
        Kind::BlockDev => FileType::BlockDevice,
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    let i = &a.inode;
    FileAttr {
        ino: INodeNo(i.ino.0),
        size: i.size,
        blocks: a.blocks,
        atime: time(i.atime),
        mtime: time(i.mtime),
        ctime: time(i.ctime),
        crtime: time(i.ctime),
        kind: file_type(i.kind),
        perm: i.perm as u16,
        nlink: i.nlink,
        uid: i.uid,
        gid: i.gid,
        rdev: i.rdev,
        blksize: 4096,
        flags: 0,
    }
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

/// What FUSE_HANDLE_KILLPRIV_V2 leaves to keel on a setattr. fuser drops the kernel's
/// FATTR_KILL_SUIDGID, so it is inferred from the same rule: always on chown of a non-directory
/// (`kill_privs` ignores directories), on truncate only for a caller without CAP_FSETID, which
/// for keel's users means a non-root one.
fn kill_on_setattr(req: &Request, uid: Option<u32>, gid: Option<u32>, size: Option<u64>) -> bool {
    uid.is_some() || gid.is_some() || (size.is_some() && req.uid() != 0)
}

/// FOPEN_NOFLUSH: close(2) sends no FLUSH, one round trip less per file. `release` saves
/// what FLUSH would have, and the kernel ignores the flag (and flushes its dirty pages) when
/// the writeback cache is on.
fn fopen_flags(info: &OpenInfo) -> FopenFlags {
    let mut f = FopenFlags::FOPEN_NOFLUSH;
    if info.keep_cache {
        f |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if info.direct_io {
        f |= FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES;
    }
    f
}

fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(t) => SetTime::At(nanos(t)),
    }
}

impl FuseAdapter {
    fn entry(&self, reply: ReplyEntry, r: Result<Attr, FsError>) {
        match r {
            Ok(a) => reply.entry_with_ttls(
                &self.timeouts.entry,
                &self.timeouts.attr,
                &file_attr(&a),
                Generation(0),
            ),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn empty(reply: ReplyEmpty, r: Result<(), FsError>) {
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let mut wanted = InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_AUTO_INVAL_DATA
            | InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_ASYNC_DIO
            | InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP
            | InitFlags::FUSE_ATOMIC_O_TRUNC
            // keel drops setuid/setgid itself; the kernel then stops sending a GETXATTR of
            // security.capability before every write (it marks checked inodes S_NOSEC).
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        let mut passthrough = false;
        if let Some(required) = self.features.passthrough {
            if config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH)
                && config.set_max_stack_depth(1).is_ok()
                && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            {
                passthrough = true;
            } else if required {
                tracing::warn!(
                    "kernel does not offer FUSE passthrough; file I/O goes through keel"
                );
            }
        }
        self.features
            .passthrough_on
            .store(passthrough, Ordering::Relaxed);
        // The kernel cannot combine passthrough with its writeback cache on one mount.
        if self.features.writeback_cache && !passthrough {
            wanted |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        for flag in wanted.iter() {
            if config.add_capabilities(flag).is_err() {
                tracing::debug!(?flag, "kernel does not offer this FUSE capability");
            } else if flag == InitFlags::FUSE_HANDLE_KILLPRIV_V2 {
                self.killpriv = true;
            }
        }
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        Ok(())
    }

    fn destroy(&mut self) {
        if let Err(e) = self.fs.shutdown() {
            tracing::error!(error = %e, "final sync of the workspace failed");
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.fs.lookup(ino(parent), name.as_bytes()) {
            Err(FsError::NotFound) if !self.timeouts.negative.is_zero() => {
                // ino 0 with a lifetime: the kernel caches the negative entry.
                let mut a = file_attr(&Attr {
                    inode: crate::meta::Inode {
                        ino: Ino(0),
                        kind: Kind::File,
                        perm: 0,
                        uid: 0,
                        gid: 0,
                        nlink: 0,
                        size: 0,
                        atime: Nanos(0),
                        mtime: Nanos(0),
                        ctime: Nanos(0),
                        rdev: 0,
                        parent: Ino(0),
                        storage: crate::meta::Storage::Inline,
                    },
                    blocks: 0,
                });
                a.ino = INodeNo(0);
                reply.entry_with_ttls(&self.timeouts.negative, &Duration::ZERO, &a, Generation(0));
            }
            r => self.entry(reply, r),
        }
    }

    fn forget(&self, _req: &Request, i: INodeNo, nlookup: u64) {
        self.fs.forget(ino(i), nlookup);
    }

    fn getattr(&self, _req: &Request, i: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino(i)) {
            Ok(a) => reply.attr(&self.timeouts.attr, &file_attr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        i: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
            ctime: ctime.map(nanos),
            kill_privs: self.killpriv && kill_on_setattr(req, uid, gid, size),
        };
        match self.fs.setattr(ino(i), &set) {
            Ok(a) => reply.attr(&self.timeouts.attr, &file_attr(&a)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readlink(&self, _req: &Request, i: INodeNo, reply: ReplyData) {
        match self.fs.readlink(ino(i)) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let r = self
            .fs
            .mknod(caller(req), ino(parent), name.as_bytes(), mode, rdev);
        self.entry(reply, r);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let r = self
            .fs
            .mkdir(caller(req), ino(parent), name.as_bytes(), mode);
        self.entry(reply, r);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.unlink(ino(parent), name.as_bytes()));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.rmdir(ino(parent), name.as_bytes()));
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let r = self.fs.symlink(
            caller(req),
            ino(parent),
            link_name.as_bytes(),
            target.as_os_str().as_bytes(),
        );
        self.entry(reply, r);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = self.fs.rename(
            ino(parent),
            name.as_bytes(),
            ino(newparent),
            newname.as_bytes(),
            flags.bits(),
        );
        Self::empty(reply, r);
    }

    fn link(
        &self,
        _req: &Request,
        i: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let r = self.fs.link(ino(i), ino(newparent), newname.as_bytes());
        self.entry(reply, r);
    }

    fn open(&self, req: &Request, i: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // fuser drops FUSE_OPEN_KILL_SUIDGID; the kernel sets it for an O_TRUNC open by a
        // caller without CAP_FSETID, which for keel's users means a non-root one.
        if self.killpriv && flags.0 & libc::O_TRUNC != 0 && req.uid() != 0 {
            if let Err(e) = self.fs.kill_privs(ino(i)) {
                return reply.error(errno(&e));
            }
        }
        match self.fs.open(ino(i), flags.0) {
            Ok((fh, info)) => match &info.backing {
                None => reply.opened(FileHandle(fh), fopen_flags(&info)),
                Some(file) => {
                    let mut map = self.backing();
                    match acquire_backing(&mut map, i.0, file, |f| reply.open_backing(f)) {
                        Ok(id) => reply.opened_passthrough(FileHandle(fh), fopen_flags(&info), id),
                        Err(e) => {
                            drop(map);
                            self.backing_failed(fh, &e);
                            reply.error(Errno::EIO);
                        }
                    }
                }
            },
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        i: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        READ_BUF.with(|b| {
            let mut buf = b.borrow_mut();
            match self.fs.read(ino(i), offset, size, &mut buf) {
                Ok(()) => reply.data(&buf),
                Err(e) => reply.error(errno(&e)),
            }
            // Do not keep a huge buffer around after a big read.
            if buf.capacity() > (2 << 20) {
                *buf = Vec::new();
            }
        });
    }

    fn write(
        &self,
        _req: &Request,
        i: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            if let Err(e) = self.fs.kill_privs(ino(i)) {
                return reply.error(errno(&e));
            }
        }
        match self.fs.write(ino(i), offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        i: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        Self::empty(reply, self.fs.flush(ino(i)));
    }

    fn release(
        &self,
        _req: &Request,
        _i: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        match self.fs.release(fh.0) {
            Ok(passthrough) => {
                if passthrough {
                    let mut map = self.backing();
                    if let Some((_, n)) = map.get_mut(&_i.0) {
                        *n -= 1;
                        if *n == 0 {
                            map.remove(&_i.0);
                        }
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        i: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        Self::empty(reply, self.fs.fsync(ino(i), datasync));
    }

    fn opendir(&self, _req: &Request, i: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.fs.opendir(ino(i)) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        _i: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let r = self.fs.readdir(fh.0, offset, |e, next| {
            reply.add(
                INodeNo(e.ino.0),
                next,
                file_type(e.kind),
                OsStr::from_bytes(&e.name),
            )
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        _i: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let ttl = self.timeouts.entry;
        let r = self.fs.readdirplus(fh.0, offset, |e, a, next| {
            reply.add(
                INodeNo(e.ino.0),
                next,
                OsStr::from_bytes(&e.name),
                &ttl,
                &file_attr(a),
                Generation(0),
            )
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _i: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.fs.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _i: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        Self::empty(reply, self.fs.fsyncdir());
    }

    fn statfs(&self, _req: &Request, _i: INodeNo, reply: ReplyStatfs) {
        match self.fs.statfs() {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
            ),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        i: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        Self::empty(
            reply,
            self.fs.setxattr(ino(i), name.as_bytes(), value, flags),
        );
    }

    fn getxattr(&self, _req: &Request, i: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.fs.getxattr(ino(i), name.as_bytes()) {
            Ok(v) => xattr_reply(reply, &v, size),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn listxattr(&self, _req: &Request, i: INodeNo, size: u32, reply: ReplyXattr) {
        match self.fs.listxattr(ino(i)) {
            Ok(v) => xattr_reply(reply, &v, size),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn removexattr(&self, _req: &Request, i: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.removexattr(ino(i), name.as_bytes()));
    }

    fn access(&self, req: &Request, i: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        Self::empty(reply, self.fs.access(ino(i), caller(req), mask.bits()));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        match self
            .fs
            .create(caller(req), ino(parent), name.as_bytes(), mode, flags)
        {
            Ok((a, fh, info)) => match &info.backing {
                None => reply.created(
                    &self.timeouts.entry,
                    &file_attr(&a),
                    Generation(0),
                    FileHandle(fh),
                    fopen_flags(&info),
                ),
                Some(file) => {
                    let mut map = self.backing();
                    let ino = a.inode.ino.0;
                    match acquire_backing(&mut map, ino, file, |f| reply.open_backing(f)) {
                        Ok(id) => reply.created_passthrough(
                            &self.timeouts.entry,
                            &file_attr(&a),
                            Generation(0),
                            FileHandle(fh),
                            fopen_flags(&info),
                            id,
                        ),
                        Err(e) => {
                            drop(map);
                            self.backing_failed(fh, &e);
                            reply.error(Errno::EIO);
                        }
                    }
                }
            },
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        i: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        Self::empty(reply, self.fs.fallocate(ino(i), offset, length, mode));
    }

    fn lseek(
        &self,
        _req: &Request,
        i: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let data = match whence {
            libc::SEEK_DATA => true,
            libc::SEEK_HOLE => false,
            _ => return reply.error(Errno::EINVAL),
        };
        if offset < 0 {
            return reply.error(Errno::ENXIO);
        }
        match self.fs.seek(ino(i), offset as u64, data) {
            Ok(o) => reply.offset(o as i64),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let len = len.min(u64::from(u32::MAX) & !0xfff);
        // As for a write: the kernel leaves dropping setuid/setgid to keel.
        if self.killpriv && req.uid() != 0 {
            if let Err(e) = self.fs.kill_privs(ino(ino_out)) {
                return reply.error(errno(&e));
            }
        }
        match self
            .fs
            .copy_file_range(ino(ino_in), offset_in, ino(ino_out), offset_out, len)
        {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// No ioctl applies to workspace files: ENOTTY, what a regular file on ext4 answers to a
    /// terminal ioctl (every `isatty` check, e.g. Python's `open`, asks), without the
    /// "not implemented" warning fuser's default logs for each.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }
}

fn xattr_reply(reply: ReplyXattr, v: &[u8], size: u32) {
    if size == 0 {
        reply.size(v.len() as u32);
    } else if v.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(v);
    }
}

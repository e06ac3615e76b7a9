//! The thin `fuser::Filesystem` adapter over `WorkspaceFs`: converts fuser's arguments and
//! replies, negotiates INIT, registers passthrough backing files and counts the requests it
//! serves; nothing else. All POSIX decisions live in `fs.rs`, which knows no fuser type.
//!
//! Where fuser 0.18 does not carry something keel needs, the smallest workaround is here,
//! each named where it is met: the set-ID requests it drops (`FATTR_KILL_SUIDGID`,
//! `FUSE_OPEN_KILL_SUIDGID`: decided from the caller, see `setid_on_setattr`), setattr times
//! before 1970 (see `from_system_time`), the single lifetime of READDIRPLUS and CREATE
//! replies (see `readdirplus`), and its private `ForgetOne` (see `RequestCounters`).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BackingId, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem,
    FopenFlags, Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
    WriteFlags,
};

use super::backing::Backings;
use super::metrics::{self as fuse_metrics, Op};

use super::fs::{
    Attr, Caller, FsError, OpenInfo, SetAttr, SetIdLoss, SetTime, WorkspaceFs, XattrReply,
};
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
    /// Set here when the kernel agreed to enforce POSIX ACLs; read by `WorkspaceFs`.
    pub posix_acl_on: Arc<AtomicBool>,
}

/// The largest WRITE (and READ) keel accepts in one request.
pub const MAX_WRITE: u32 = 1 << 20;

pub struct FuseAdapter {
    fs: Arc<WorkspaceFs>,
    timeouts: Timeouts,
    features: KernelFeatures,
    /// Backing files registered with the kernel, per passthrough handle (an `Arc`, so a
    /// reply can carry the id after the lock is let go).
    backing: Mutex<Backings<BackingId>>,
    /// FUSE_HANDLE_KILLPRIV_V2 is on: keel drops setuid/setgid itself.
    killpriv: AtomicBool,
    /// Requests served, all of them and those the caller does not wait for.
    requests: Arc<RequestCounters>,
    /// The session's notifier, set once the session exists (before any request but INIT):
    /// tells the kernel to drop cached attributes keel changed outside a reply.
    notifier: Arc<OnceLock<fuser::Notifier>>,
}

/// The requests keel served on one mount, for status and benchmarks.
///
/// `all` counts every request fuser hands to keel, FORGETs included. `unwaited` counts the
/// ones no system call waits for: FORGET, RELEASE and RELEASEDIR (the kernel sends them
/// after the syscall returned, or from a background close). fuser gap: its `ForgetOne` is
/// private, so keel cannot take a BATCH_FORGET whole; fuser's default hands it over as one
/// `forget` per inode, so both counters count one request per inode forgotten, not one per
/// BATCH_FORGET the kernel sent. INTERRUPT never reaches keel (fuser answers it itself), so
/// neither counter sees it.
#[derive(Debug, Default)]
pub struct RequestCounters {
    all: AtomicU64,
    unwaited: AtomicU64,
}

impl RequestCounters {
    /// Every request served.
    pub fn all(&self) -> u64 {
        self.all.load(Ordering::Relaxed)
    }

    /// The requests no caller waits for (FORGET per inode, RELEASE, RELEASEDIR).
    pub fn unwaited(&self) -> u64 {
        self.unwaited.load(Ordering::Relaxed)
    }
}

impl FuseAdapter {
    pub fn new(fs: Arc<WorkspaceFs>, timeouts: Timeouts, features: KernelFeatures) -> Self {
        FuseAdapter {
            fs,
            timeouts,
            features,
            backing: Mutex::new(Backings::default()),
            killpriv: AtomicBool::new(false),
            requests: Arc::new(RequestCounters::default()),
            notifier: Arc::default(),
        }
    }

    /// Where the session puts its notifier once it exists (see `notifier`).
    pub fn notifier_slot(&self) -> Arc<OnceLock<fuser::Notifier>> {
        self.notifier.clone()
    }

    /// Tells the kernel that the attributes it caches of `ino` are stale, before the reply
    /// to the request that changed them outside a reply of attributes: a WRITE that cleared
    /// set-ID bits (the kernel drops only size and times after a write), an open that lets
    /// the kernel map a body writable (see `open`). The kernel handles the notification
    /// within the write to /dev/fuse, touching no lock the waiting request holds; one for
    /// an inode it no longer caches (ENOENT) is no error.
    fn forget_attrs(&self, ino: u64) {
        let Some(n) = self.notifier.get() else {
            return;
        };
        // A negative offset: the attributes only, not the page cache.
        match n.inval_inode(INodeNo(ino), -1, 0) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => tracing::debug!(ino, error = %e, "cannot invalidate cached attributes"),
        }
    }

    /// Tells the kernel to drop its cached pages of `ino` in `[offset, offset + len)`, from
    /// another thread: the kernel waits for the write-back of those pages to end, and a
    /// write-back may need this thread to serve it.
    fn drop_cached_pages(&self, ino: u64, offset: u64, len: usize) {
        let Some(n) = self.notifier.get().cloned() else {
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("keel-inval".into())
            .spawn(
                move || match n.inval_inode(INodeNo(ino), offset as i64, len as i64) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => tracing::debug!(ino, error = %e, "cannot drop cached pages"),
                },
            );
        if let Err(e) = spawned {
            tracing::warn!(ino, error = %e, "cannot drop the cached pages of a failed write");
        }
    }

    /// The counters of requests served, for status and benchmarks.
    pub fn requests(&self) -> Arc<RequestCounters> {
        self.requests.clone()
    }

    /// Counts a request and times it until the returned guard drops (after the reply).
    fn count(&self, op: Op) -> fuse_metrics::Timer {
        self.requests.all.fetch_add(1, Ordering::Relaxed);
        fuse_metrics::begin(op)
    }

    /// Counts a request no caller waits for (see `RequestCounters`).
    fn count_unwaited(&self, op: Op) -> fuse_metrics::Timer {
        self.requests.unwaited.fetch_add(1, Ordering::Relaxed);
        self.count(op)
    }

    fn backing(&self) -> std::sync::MutexGuard<'_, Backings<BackingId>> {
        self.backing.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn killpriv(&self) -> bool {
        self.killpriv.load(Ordering::Relaxed)
    }

    /// A passthrough handle whose backing file the kernel refused: release it (the caller
    /// answers EIO).
    fn backing_failed(&self, fh: u64, e: std::io::Error) {
        tracing::warn!(error = %e, "passthrough registration failed");
        let _ = self.fs.release(fh);
    }

    fn file_attr(&self, a: &Attr) -> FileAttr {
        file_attr(a)
    }

    /// How long the kernel may cache `a`: not at all when it can change unseen (a shared
    /// writable mapping of a passthrough body, `Attr::volatile`).
    fn attr_ttl(&self, a: &Attr) -> Duration {
        if a.volatile {
            Duration::ZERO
        } else {
            self.timeouts.attr
        }
    }

    /// The one lifetime of a reply that carries a name and attributes together (fuser gap,
    /// see `readdirplus`): the shorter of the two.
    fn entry_ttl(&self, a: &Attr) -> Duration {
        self.timeouts.entry.min(self.attr_ttl(a))
    }

    fn reply_entry(&self, r: ReplyEntry, res: Result<Attr, FsError>) {
        match res {
            Ok(a) => r.entry_with_ttls(
                &self.attr_ttl(&a),
                &self.timeouts.entry,
                &self.file_attr(&a),
                Generation(u64::from(a.generation)),
            ),
            Err(e) => r.error(errno(&e)),
        }
    }

    fn reply_attr(&self, r: ReplyAttr, res: Result<Attr, FsError>) {
        match res {
            Ok(a) => r.attr(&self.attr_ttl(&a), &self.file_attr(&a)),
            Err(e) => r.error(errno(&e)),
        }
    }
}

/// The reply's errno for `e`, counted and logged under the request's operation.
/// Reads into this thread's buffer and answers.
fn serve_read(fs: &WorkspaceFs, ino: Ino, offset: u64, size: u32, reply: ReplyData) {
    READ_BUF.with(|b| {
        let mut buf = b.borrow_mut();
        match fs.read(ino, offset, size, &mut buf) {
            Ok(()) => {
                fuse_metrics::read_bytes(buf.len());
                reply.data(&buf)
            }
            Err(e) => reply.error(errno(&e)),
        }
        // Do not keep a huge buffer around after a big read.
        if buf.capacity() > (2 << 20) {
            *buf = Vec::new();
        }
    })
}

fn errno(e: &FsError) -> Errno {
    fail(e.errno(), e)
}

/// Counts and logs a failed request (see `fuse_metrics::failed`).
fn fail(errno: i32, why: &dyn std::fmt::Display) -> Errno {
    fuse_metrics::failed(errno, why);
    Errno::from_i32(errno)
}

fn reply_empty(r: ReplyEmpty, res: Result<(), FsError>) {
    match res {
        Ok(()) => r.ok(),
        Err(e) => r.error(errno(&e)),
    }
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
        umask: 0,
    }
}

/// The caller of a request that creates, with its umask (keel applies it, FUSE_DONT_MASK).
fn creator(req: &Request, umask: u32) -> Caller {
    Caller {
        umask,
        ..caller(req)
    }
}

fn to_system_time(n: Nanos) -> SystemTime {
    let abs = Duration::from_nanos(n.0.unsigned_abs());
    if n.0 >= 0 {
        UNIX_EPOCH + abs
    } else {
        UNIX_EPOCH - abs
    }
}

/// fuser gap: it turns a setattr time before 1970, (secs < 0, nsec), into the epoch minus
/// (|secs| + nsec), not minus (|secs| - nsec). That is still one-to-one, so it is undone
/// here: whole seconds before the epoch are `secs`, the fraction is `nsec`.
fn from_system_time(t: SystemTime) -> Nanos {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => Nanos(i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
        Err(e) => {
            let d = e.duration();
            let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            Nanos(
                secs.saturating_mul(-1_000_000_000)
                    .saturating_add(i64::from(d.subsec_nanos())),
            )
        }
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
        atime: to_system_time(i.atime),
        mtime: to_system_time(i.mtime),
        ctime: to_system_time(i.ctime),
        crtime: UNIX_EPOCH,
        kind: file_type(i.kind),
        perm: (i.perm & 0o7777) as u16,
        nlink: i.nlink,
        uid: i.uid,
        gid: i.gid,
        rdev: i.rdev,
        blksize: 4096,
        flags: 0,
    }
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
        TimeOrNow::SpecificTime(t) => SetTime::At(from_system_time(t)),
    }
}

fn name(n: &OsStr) -> &[u8] {
    n.as_bytes()
}

impl Filesystem for FuseAdapter {
    /// Chooses the connection's features from what the kernel offers.
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let offered = config.capabilities();
        let mut wanted = InitFlags::FUSE_ASYNC_READ
            | InitFlags::FUSE_BIG_WRITES
            | InitFlags::FUSE_MAX_PAGES
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_AUTO_INVAL_DATA
            | InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_ASYNC_DIO
            | InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP
            | InitFlags::FUSE_ATOMIC_O_TRUNC
            // File handles (open_by_handle_at, NFS-style tools): the kernel looks up "." and
            // ".." by inode number for an inode it no longer caches; entries carry the
            // inode's generation.
            | InitFlags::FUSE_EXPORT_SUPPORT
            // The kernel enforces the ACLs keel stores (keel keeps them in step with the
            // mode and inherits default ACLs), and leaves the umask to keel, which applies
            // it unless a default ACL takes its place.
            | InitFlags::FUSE_POSIX_ACL
            | InitFlags::FUSE_DONT_MASK
            // keel drops setuid/setgid itself; the kernel then stops sending a GETXATTR of
            // security.capability before every write (it marks checked inodes S_NOSEC).
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        let mut passthrough = false;
        if let Some(required) = self.features.passthrough {
            if offered.contains(InitFlags::FUSE_PASSTHROUGH) {
                wanted |= InitFlags::FUSE_PASSTHROUGH;
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
        let flags = wanted & offered;
        // Only offered flags are added, so this cannot fail.
        let _ = config.add_capabilities(flags);
        self.killpriv.store(
            flags.contains(InitFlags::FUSE_HANDLE_KILLPRIV_V2),
            Ordering::Relaxed,
        );
        // Both or neither: without FUSE_DONT_MASK the kernel would apply the umask where a
        // default ACL must replace it.
        let acls = flags.contains(InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK);
        if !acls {
            tracing::warn!("kernel does not enforce POSIX ACLs over FUSE: ACL xattrs are refused");
        }
        self.features.posix_acl_on.store(acls, Ordering::Relaxed);
        // KernelConfig has no getter: setting any allowed value returns the kernel's.
        let readahead = config
            .set_max_readahead(1)
            .map_or(MAX_WRITE, |kernel| kernel.min(MAX_WRITE));
        let _ = config.set_max_readahead(readahead);
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        if passthrough {
            let _ = config.set_max_stack_depth(1);
        }
        tracing::debug!(flags = format!("{:#x}", flags.bits()), "FUSE init");
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEntry) {
        let _t = self.count(Op::Lookup);
        match self.fs.lookup(Ino(parent.0), name(n)) {
            Err(FsError::NotFound) if !self.timeouts.negative.is_zero() => {
                // nodeid 0 with a lifetime: the kernel caches the negative entry.
                let a = FileAttr {
                    ino: INodeNo(0),
                    size: 0,
                    blocks: 0,
                    atime: UNIX_EPOCH,
                    mtime: UNIX_EPOCH,
                    ctime: UNIX_EPOCH,
                    crtime: UNIX_EPOCH,
                    kind: FileType::RegularFile,
                    perm: 0,
                    nlink: 0,
                    uid: 0,
                    gid: 0,
                    rdev: 0,
                    blksize: 0,
                    flags: 0,
                };
                reply.entry_with_ttls(&Duration::ZERO, &self.timeouts.negative, &a, Generation(0));
            }
            res => self.reply_entry(reply, res),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let _t = self.count_unwaited(Op::Forget);
        self.fs.forget(Ino(ino.0), nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _t = self.count(Op::Getattr);
        self.reply_attr(reply, self.fs.getattr(Ino(ino.0)));
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
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
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _t = self.count(Op::Setattr);
        let mut set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
            ctime: ctime.map(from_system_time),
            drop_setid: None,
        };
        if self.killpriv() {
            set.drop_setid = set.setid_loss(caller(req));
        }
        self.reply_attr(reply, self.fs.setattr(Ino(ino.0), &set));
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _t = self.count(Op::Readlink);
        match self.fs.readlink(Ino(ino.0)) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _t = self.count(Op::Mknod);
        let res = self
            .fs
            .mknod(creator(req, umask), Ino(parent.0), name(n), mode, rdev);
        self.reply_entry(reply, res);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _t = self.count(Op::Mkdir);
        let res = self
            .fs
            .mkdir(creator(req, umask), Ino(parent.0), name(n), mode);
        self.reply_entry(reply, res);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let _t = self.count(Op::Unlink);
        reply_empty(reply, self.fs.unlink(Ino(parent.0), name(n)));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let _t = self.count(Op::Rmdir);
        reply_empty(reply, self.fs.rmdir(Ino(parent.0), name(n)));
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let _t = self.count(Op::Symlink);
        let res = self.fs.symlink(
            caller(req),
            Ino(parent.0),
            name(link_name),
            target.as_os_str().as_bytes(),
        );
        self.reply_entry(reply, res);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        n: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _t = self.count(Op::Rename);
        let res = self.fs.rename(
            Ino(parent.0),
            name(n),
            Ino(newparent.0),
            name(newname),
            flags.bits(),
        );
        reply_empty(reply, res);
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _t = self.count(Op::Link);
        let res = self.fs.link(Ino(ino.0), Ino(newparent.0), name(newname));
        self.reply_entry(reply, res);
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.count(Op::Open);
        let (i, flags) = (Ino(ino.0), flags.0);
        // fuser gap: it does not pass FUSE_OPEN_KILL_SUIDGID; `fs` decides from the flags
        // and the caller.
        if self.killpriv() {
            match self.fs.drop_setid_on_open(i, flags, caller(req)) {
                Ok(true) => self.forget_attrs(i.0),
                Ok(false) => {}
                Err(e) => return reply.error(errno(&e)),
            }
        }
        match self.fs.open(i, flags) {
            Ok((fh, info)) => match &info.backing {
                None => reply.opened(FileHandle(fh), fopen_flags(&info)),
                Some(file) => {
                    // A read-write passthrough handle can map the body shared: from now on
                    // keel answers its attributes uncached (`Attr::volatile`), and what the
                    // kernel cached before this open must go too, or a `stat` after a
                    // write through the mapping would show the times from before.
                    if flags & libc::O_ACCMODE == libc::O_RDWR {
                        self.forget_attrs(i.0);
                    }
                    let got = self
                        .backing()
                        .acquire(i.0, fh, file, |f| reply.open_backing(f));
                    match got {
                        Ok(id) => {
                            fuse_metrics::passthrough_open();
                            reply.opened_passthrough(FileHandle(fh), fopen_flags(&info), &id)
                        }
                        Err(e) => {
                            self.backing_failed(fh, e);
                            reply.error(fail(libc::EIO, &"passthrough registration failed"));
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
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let t = self.count(Op::Read);
        let size = size.min(MAX_WRITE);
        let ino = Ino(ino.0);
        if self.fs.lazy_active() {
            // Bytes still on the remote: a fetch thread reads and answers, this worker
            // goes on serving.
            let fs = self.fs.clone();
            let job: super::fs::Deferred = Box::new(move || {
                t.moved_here();
                serve_read(&fs, ino, offset, size, reply);
                drop(t);
                // After the reply: what the read fetched becomes durable and recorded.
                fs.settle_fetched();
            });
            if let Some(job) = self.fs.defer_fetch(ino, offset, u64::from(size), job) {
                job();
            }
            return;
        }
        let _t = t;
        serve_read(&self.fs, ino, offset, size, reply);
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _t = self.count(Op::Write);
        let i = Ino(ino.0);
        // The kernel asks for this (it decided from the caller, as for ext4).
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            match self.fs.drop_setid(i, SetIdLoss::Modify(caller(req))) {
                // After a write the kernel drops only its cached size and times: a direct
                // write would leave `stat` showing the bits keel just cleared.
                Ok(true) => self.forget_attrs(i.0),
                Ok(false) => {}
                Err(e) => return reply.error(errno(&e)),
            }
        }
        match self.fs.write(i, offset, data) {
            // A short write (the volume filled up part way; what went in is recorded) of
            // cached pages: the kernel's write-back looks only at the error and would take
            // every page as written. Say ENOSPC (reported at the next fsync) and drop the
            // pages, so reads show what the store has.
            Ok(n)
                if (n as usize) < data.len()
                    && write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) =>
            {
                fuse_metrics::write_bytes(n as usize);
                reply.error(Errno::from_i32(libc::ENOSPC));
                self.drop_cached_pages(i.0, offset, data.len());
            }
            Ok(n) => {
                fuse_metrics::write_bytes(n as usize);
                reply.written(n)
            }
            Err(e) => {
                reply.error(errno(&e));
                // A write-back of cached pages that found no room (ENOSPC on a full state
                // volume): the kernel reports it at the next fsync, but keeps the pages,
                // clean, so reads would go on showing bytes the store does not have (and
                // that are gone at the next start).
                if write_flags.contains(WriteFlags::FUSE_WRITE_CACHE) {
                    self.drop_cached_pages(i.0, offset, data.len());
                }
            }
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let _t = self.count(Op::Flush);
        reply_empty(reply, self.fs.flush(Ino(ino.0)));
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.count_unwaited(Op::Release);
        match self.fs.release(fh.0) {
            Ok(passthrough) => {
                if passthrough {
                    self.backing().release(ino.0, fh.0);
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.count(Op::Fsync);
        reply_empty(reply, self.fs.fsync(Ino(ino.0), datasync));
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.count(Op::Opendir);
        match self.fs.opendir(Ino(ino.0)) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _t = self.count(Op::Readdir);
        let res = self.fs.readdir(fh.0, offset, |e, next| {
            reply.add(
                INodeNo(e.ino.0),
                next,
                file_type(e.kind),
                OsStr::from_bytes(&e.name),
            )
        });
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// fuser gap: READDIRPLUS entries take one lifetime for the name and the attributes;
    /// the shorter of keel's two is used (a shorter lifetime only means asking again).
    fn readdirplus(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let _t = self.count(Op::Readdirplus);
        let res = self.fs.readdirplus(fh.0, offset, |e, a, next| {
            let mut attr = self.file_attr(a);
            attr.ino = INodeNo(e.ino.0);
            reply.add(
                INodeNo(e.ino.0),
                next,
                OsStr::from_bytes(&e.name),
                &self.entry_ttl(a),
                &attr,
                Generation(u64::from(a.generation)),
            )
        });
        match res {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        let _t = self.count_unwaited(Op::Releasedir);
        self.fs.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.count(Op::Fsyncdir);
        reply_empty(reply, self.fs.fsyncdir());
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _t = self.count(Op::Statfs);
        match self.fs.statfs() {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
            ),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        n: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _t = self.count(Op::Setxattr);
        let res = self
            .fs
            .setxattr(caller(req), Ino(ino.0), name(n), value, flags);
        reply_empty(reply, res);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, n: &OsStr, size: u32, reply: ReplyXattr) {
        let _t = self.count(Op::Getxattr);
        match self
            .fs
            .getxattr(Ino(ino.0), name(n))
            .and_then(|v| XattrReply::fit(v, size))
        {
            Ok(XattrReply::Size(n)) => reply.size(n),
            Ok(XattrReply::Value(v)) => reply.data(&v),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _t = self.count(Op::Listxattr);
        match self
            .fs
            .listxattr(Ino(ino.0))
            .and_then(|v| XattrReply::fit(v, size))
        {
            Ok(XattrReply::Size(n)) => reply.size(n),
            Ok(XattrReply::Value(v)) => reply.data(&v),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, n: &OsStr, reply: ReplyEmpty) {
        let _t = self.count(Op::Removexattr);
        reply_empty(reply, self.fs.removexattr(Ino(ino.0), name(n)));
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let _t = self.count(Op::Access);
        reply_empty(reply, self.fs.access(Ino(ino.0), caller(req), mask.bits()));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        n: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _t = self.count(Op::Create);
        match self
            .fs
            .create(creator(req, umask), Ino(parent.0), name(n), mode, flags)
        {
            Ok((a, fh, info)) => {
                let attr = self.file_attr(&a);
                // fuser gap: CREATE's reply takes one lifetime for the name and the
                // attributes; the shorter of keel's two is used.
                let ttl = self.entry_ttl(&a);
                match &info.backing {
                    None => reply.created(
                        &ttl,
                        &attr,
                        Generation(u64::from(a.generation)),
                        FileHandle(fh),
                        fopen_flags(&info),
                    ),
                    Some(file) => {
                        let ino = a.inode.ino.0;
                        let got = self
                            .backing()
                            .acquire(ino, fh, file, |f| reply.open_backing(f));
                        match got {
                            Ok(id) => {
                                fuse_metrics::passthrough_open();
                                reply.created_passthrough(
                                    &ttl,
                                    &attr,
                                    Generation(u64::from(a.generation)),
                                    FileHandle(fh),
                                    fopen_flags(&info),
                                    &id,
                                )
                            }
                            Err(e) => {
                                self.backing_failed(fh, e);
                                reply.error(fail(libc::EIO, &"passthrough registration failed"));
                            }
                        }
                    }
                }
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// No ioctl applies to workspace files: ENOTTY, what a regular file on ext4 answers to a
    /// terminal ioctl (every `isatty` check, e.g. Python's `open`, asks).
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        let _t = self.count(Op::Ioctl);
        reply.error(fail(libc::ENOTTY, &"no ioctl applies"));
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _t = self.count(Op::Fallocate);
        reply_empty(reply, self.fs.fallocate(Ino(ino.0), offset, length, mode));
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let _t = self.count(Op::Lseek);
        match self.fs.lseek(Ino(ino.0), offset, whence) {
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
        let _t = self.count(Op::CopyFileRange);
        let len = len.min(u64::from(u32::MAX) & !0xfff);
        // As for a write: the kernel leaves dropping setuid/setgid to keel.
        if self.killpriv() {
            match self
                .fs
                .drop_setid(Ino(ino_out.0), SetIdLoss::Modify(caller(req)))
            {
                Ok(true) => self.forget_attrs(ino_out.0),
                Ok(false) => {}
                Err(e) => return reply.error(errno(&e)),
            }
        }
        match self
            .fs
            .copy_file_range(Ino(ino_in.0), offset_in, Ino(ino_out.0), offset_out, len)
        {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

thread_local! {
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_convert_across_the_epoch() {
        for n in [0i64, 1, 999_999_999, 1_000_000_000, -1, -1_500_000_000] {
            let t = to_system_time(Nanos(n));
            let d = t.duration_since(UNIX_EPOCH);
            match d {
                Ok(d) => assert_eq!(d.as_nanos() as i64, n),
                Err(e) => assert_eq!(-(e.duration().as_nanos() as i64), n),
            }
        }
        // fuser's reading of (secs -2, nsec 500_000_000), i.e. -1.5 s: the epoch minus 2.5 s.
        let fuser = UNIX_EPOCH - Duration::new(2, 500_000_000);
        assert_eq!(from_system_time(fuser), Nanos(-1_500_000_000));
        assert_eq!(
            from_system_time(UNIX_EPOCH + Duration::new(3, 7)),
            Nanos(3_000_000_007)
        );
        assert_eq!(
            from_system_time(UNIX_EPOCH - Duration::new(3, 0)),
            Nanos(-3_000_000_000)
        );
    }
}

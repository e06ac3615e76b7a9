//! The thin adapter between decoded FUSE requests (`proto::Op`) and `WorkspaceFs`: converts
//! arguments and replies, negotiates INIT, registers passthrough backing files, nothing else.
//! All POSIX decisions live in `fs.rs`; the transports that carry requests live in `serve.rs`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::fs::{Attr, Caller, FsError, OpenInfo, SetAttr, SetTime, WorkspaceFs};
use super::proto::{
    fopen, init_flags, AttrOut, EntryOut, InHeader, InitIn, InitOut, Op, Reply, StatfsOut, TimeIn,
};
use crate::meta::{InodeNo as Ino, Nanos};
use crate::sys::fusedev::{BackingId, FuseDev};

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

/// The largest WRITE (and READ) keel accepts in one request.
pub const MAX_WRITE: u32 = 1 << 20;

pub struct FuseAdapter {
    fs: Arc<WorkspaceFs>,
    /// The connection, for registering backing files (replaced if the mount is redone).
    dev: Mutex<Arc<FuseDev>>,
    timeouts: Timeouts,
    features: KernelFeatures,
    /// Backing files registered with the kernel, per inode, with their handle count.
    backing: Mutex<HashMap<u64, (BackingId, u32)>>,
    /// FUSE_HANDLE_KILLPRIV_V2 is on: keel drops setuid/setgid itself (see `kill_privs`).
    killpriv: AtomicBool,
}

impl FuseAdapter {
    pub fn new(
        fs: Arc<WorkspaceFs>,
        dev: Arc<FuseDev>,
        timeouts: Timeouts,
        features: KernelFeatures,
    ) -> Self {
        FuseAdapter {
            fs,
            dev: Mutex::new(dev),
            timeouts,
            features,
            backing: Mutex::new(HashMap::new()),
            killpriv: AtomicBool::new(false),
        }
    }

    fn backing(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (BackingId, u32)>> {
        self.backing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serves a new connection (the mount was redone on `dev`).
    pub fn set_dev(&self, dev: Arc<FuseDev>) {
        *self.dev.lock().unwrap_or_else(|p| p.into_inner()) = dev;
    }

    fn killpriv(&self) -> bool {
        self.killpriv.load(Ordering::Relaxed)
    }

    /// Registers (or reuses) the backing file of a passthrough handle; on failure releases
    /// the handle and answers EIO.
    fn backing_id(&self, ino: u64, fh: u64, file: &std::fs::File) -> Result<i32, ()> {
        let dev = self.dev.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut map = self.backing();
        match acquire_backing(&mut map, ino, file, |f| dev.backing_open(f)) {
            Ok(id) => Ok(id.id()),
            Err(e) => {
                drop(map);
                tracing::warn!(error = %e, "passthrough registration failed");
                let _ = self.fs.release(fh);
                Err(())
            }
        }
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

fn errno(e: &FsError) -> i32 {
    if let FsError::Io(_) | FsError::Meta(_) = e {
        tracing::debug!(error = %e, "request failed");
    }
    e.errno()
}

/// Seconds and nanoseconds of a timestamp (nanoseconds always positive).
fn split_time(n: Nanos) -> (i64, u32) {
    (
        n.0.div_euclid(1_000_000_000),
        n.0.rem_euclid(1_000_000_000) as u32,
    )
}

fn join_time(secs: i64, nsec: u32) -> Nanos {
    Nanos(
        secs.saturating_mul(1_000_000_000)
            .saturating_add(i64::from(nsec)),
    )
}

fn attr_out(a: &Attr) -> AttrOut {
    let i = &a.inode;
    AttrOut {
        ino: i.ino.0,
        size: i.size,
        blocks: a.blocks,
        atime: split_time(i.atime),
        mtime: split_time(i.mtime),
        ctime: split_time(i.ctime),
        mode: i.kind.mode_bits() | (i.perm & 0o7777),
        nlink: i.nlink,
        uid: i.uid,
        gid: i.gid,
        rdev: i.rdev,
        blksize: 4096,
    }
}

fn caller(h: &InHeader) -> Caller {
    Caller {
        uid: h.uid,
        gid: h.gid,
    }
}

/// What FUSE_HANDLE_KILLPRIV_V2 leaves to keel on a setattr besides the kernel's own
/// FATTR_KILL_SUIDGID: always on chown of a non-directory (`kill_privs` ignores
/// directories), on truncate for a caller without CAP_FSETID, which for keel's users means a
/// non-root one.
fn kill_on_setattr(h: &InHeader, uid: Option<u32>, gid: Option<u32>, size: Option<u64>) -> bool {
    uid.is_some() || gid.is_some() || (size.is_some() && h.uid != 0)
}

/// FOPEN_NOFLUSH: close(2) sends no FLUSH, one round trip less per file. `release` saves
/// what FLUSH would have, and the kernel ignores the flag (and flushes its dirty pages) when
/// the writeback cache is on.
fn fopen_flags(info: &OpenInfo) -> u32 {
    let mut f = fopen::NOFLUSH;
    if info.keep_cache {
        f |= fopen::KEEP_CACHE;
    }
    if info.direct_io {
        f |= fopen::DIRECT_IO | fopen::PARALLEL_DIRECT_WRITES;
    }
    f
}

fn set_time(t: TimeIn) -> SetTime {
    match t {
        TimeIn::Now => SetTime::Now,
        TimeIn::At(s, ns) => SetTime::At(join_time(s, ns)),
    }
}

/// The outcome of INIT: the reply, and whether FUSE over io_uring was agreed.
#[derive(Debug, Clone, Copy)]
pub struct Negotiated {
    pub out: InitOut,
    pub io_uring: bool,
}

impl FuseAdapter {
    fn entry(&self, a: &Attr) -> EntryOut {
        EntryOut {
            nodeid: a.inode.ino.0,
            entry_ttl: self.timeouts.entry,
            attr_ttl: self.timeouts.attr,
            attr: attr_out(a),
        }
    }

    fn reply_entry(&self, r: &mut Reply, res: Result<Attr, FsError>) {
        match res {
            Ok(a) => r.entry(&self.entry(&a)),
            Err(e) => r.err(errno(&e)),
        }
    }

    fn reply_attr(&self, r: &mut Reply, res: Result<Attr, FsError>) {
        match res {
            Ok(a) => r.attr(self.timeouts.attr, &attr_out(&a)),
            Err(e) => r.err(errno(&e)),
        }
    }

    fn reply_empty(r: &mut Reply, res: Result<(), FsError>) {
        match res {
            Ok(()) => r.clear(),
            Err(e) => r.err(errno(&e)),
        }
    }

    /// Chooses the connection's features from what the kernel offers; `io_uring`: keel has
    /// its rings ready and asks to be served through them.
    pub fn init(&self, i: &InitIn, io_uring: bool) -> Negotiated {
        let offered = i.flags;
        let mut wanted = init_flags::ASYNC_READ
            | init_flags::BIG_WRITES
            | init_flags::MAX_PAGES
            | init_flags::DO_READDIRPLUS
            | init_flags::READDIRPLUS_AUTO
            | init_flags::PARALLEL_DIROPS
            | init_flags::AUTO_INVAL_DATA
            | init_flags::CACHE_SYMLINKS
            | init_flags::ASYNC_DIO
            | init_flags::DIRECT_IO_ALLOW_MMAP
            | init_flags::ATOMIC_O_TRUNC
            // keel drops setuid/setgid itself; the kernel then stops sending a GETXATTR of
            // security.capability before every write (it marks checked inodes S_NOSEC).
            | init_flags::HANDLE_KILLPRIV_V2
            | init_flags::INIT_EXT;
        let mut passthrough = false;
        if let Some(required) = self.features.passthrough {
            if offered & init_flags::PASSTHROUGH != 0 {
                wanted |= init_flags::PASSTHROUGH;
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
            wanted |= init_flags::WRITEBACK_CACHE;
        }
        if io_uring {
            wanted |= init_flags::OVER_IO_URING;
        }
        let flags = wanted & offered;
        self.killpriv.store(
            flags & init_flags::HANDLE_KILLPRIV_V2 != 0,
            Ordering::Relaxed,
        );
        let max_readahead = i.max_readahead.min(1 << 20);
        Negotiated {
            out: InitOut {
                max_readahead,
                flags,
                max_background: 64,
                congestion_threshold: 48,
                max_write: MAX_WRITE,
                max_pages: (MAX_WRITE.max(max_readahead) / 4096) as u16,
                max_stack_depth: if passthrough { 1 } else { 0 },
            },
            io_uring: flags & init_flags::OVER_IO_URING != 0,
        }
    }

    /// Runs one request and leaves its answer in `r` (ignored for FORGET and INTERRUPT).
    pub fn dispatch(&self, h: &InHeader, op: Op<'_>, r: &mut Reply) {
        r.clear();
        let i = Ino(h.nodeid);
        let fs = &*self.fs;
        match op {
            // Both come only on the connection's first message, handled by the session.
            Op::Init(_) | Op::Destroy => r.err(libc::EIO),
            Op::Lookup { name } => match fs.lookup(i, name) {
                Err(FsError::NotFound) if !self.timeouts.negative.is_zero() => {
                    // nodeid 0 with a lifetime: the kernel caches the negative entry.
                    r.entry(&EntryOut {
                        nodeid: 0,
                        entry_ttl: self.timeouts.negative,
                        attr_ttl: Duration::ZERO,
                        attr: AttrOut::default(),
                    });
                }
                res => self.reply_entry(r, res),
            },
            Op::Forget { nlookup } => fs.forget(i, nlookup),
            Op::BatchForget(pairs) => {
                for (ino, n) in pairs {
                    fs.forget(Ino(ino), n);
                }
            }
            Op::Getattr => self.reply_attr(r, fs.getattr(i)),
            Op::Setattr(s) => {
                let set = SetAttr {
                    mode: s.mode,
                    uid: s.uid,
                    gid: s.gid,
                    size: s.size,
                    atime: s.atime.map(set_time),
                    mtime: s.mtime.map(set_time),
                    ctime: s.ctime.map(|(s, ns)| join_time(s, ns)),
                    kill_privs: self.killpriv()
                        && (s.kill_suidgid || kill_on_setattr(h, s.uid, s.gid, s.size)),
                };
                self.reply_attr(r, fs.setattr(i, &set));
            }
            Op::Readlink => match fs.readlink(i) {
                Ok(t) => r.data(&t),
                Err(e) => r.err(errno(&e)),
            },
            Op::Mknod { mode, rdev, name } => {
                self.reply_entry(r, fs.mknod(caller(h), i, name, mode, rdev))
            }
            Op::Mkdir { mode, name } => self.reply_entry(r, fs.mkdir(caller(h), i, name, mode)),
            Op::Unlink { name } => Self::reply_empty(r, fs.unlink(i, name)),
            Op::Rmdir { name } => Self::reply_empty(r, fs.rmdir(i, name)),
            Op::Symlink { name, target } => {
                self.reply_entry(r, fs.symlink(caller(h), i, name, target))
            }
            Op::Rename {
                newdir,
                flags,
                name,
                newname,
            } => Self::reply_empty(r, fs.rename(i, name, Ino(newdir), newname, flags)),
            Op::Link { oldnodeid, name } => self.reply_entry(r, fs.link(Ino(oldnodeid), i, name)),
            Op::Open {
                flags,
                kill_suidgid,
            } => self.open(h, i, flags, kill_suidgid, r),
            Op::Read { offset, size, .. } => READ_BUF.with(|b| {
                let mut buf = b.borrow_mut();
                match fs.read(i, offset, size.min(MAX_WRITE), &mut buf) {
                    Ok(()) => r.data(&buf),
                    Err(e) => r.err(errno(&e)),
                }
                // Do not keep a huge buffer around after a big read.
                if buf.capacity() > (2 << 20) {
                    *buf = Vec::new();
                }
            }),
            Op::Write {
                offset,
                kill_suidgid,
                data,
                ..
            } => {
                if kill_suidgid {
                    if let Err(e) = fs.kill_privs(i) {
                        return r.err(errno(&e));
                    }
                }
                match fs.write(i, offset, data) {
                    Ok(n) => r.written(n),
                    Err(e) => r.err(errno(&e)),
                }
            }
            Op::Statfs => match fs.statfs() {
                Ok(s) => r.statfs(&StatfsOut {
                    blocks: s.blocks,
                    bfree: s.bfree,
                    bavail: s.bavail,
                    files: s.files,
                    ffree: s.ffree,
                    bsize: s.bsize,
                    namelen: s.namelen,
                    frsize: s.frsize,
                }),
                Err(e) => r.err(errno(&e)),
            },
            Op::Release { fh } => match fs.release(fh) {
                Ok(passthrough) => {
                    if passthrough {
                        let mut map = self.backing();
                        if let Some((_, n)) = map.get_mut(&h.nodeid) {
                            *n -= 1;
                            if *n == 0 {
                                map.remove(&h.nodeid);
                            }
                        }
                    }
                    r.clear();
                }
                Err(e) => r.err(errno(&e)),
            },
            Op::Fsync { datasync, .. } => Self::reply_empty(r, fs.fsync(i, datasync)),
            Op::Setxattr { flags, name, value } => {
                Self::reply_empty(r, fs.setxattr(i, name, value, flags))
            }
            Op::Getxattr { size, name } => match fs.getxattr(i, name) {
                Ok(v) => xattr_reply(r, &v, size),
                Err(e) => r.err(errno(&e)),
            },
            Op::Listxattr { size } => match fs.listxattr(i) {
                Ok(v) => xattr_reply(r, &v, size),
                Err(e) => r.err(errno(&e)),
            },
            Op::Removexattr { name } => Self::reply_empty(r, fs.removexattr(i, name)),
            Op::Flush { .. } => Self::reply_empty(r, fs.flush(i)),
            Op::Opendir => match fs.opendir(i) {
                Ok(fh) => r.open(fh, 0, 0),
                Err(e) => r.err(errno(&e)),
            },
            Op::Readdir { fh, offset, size } => {
                let mut d = r.dir(size);
                let res = fs.readdir(fh, offset, |e, next| {
                    d.add(e.ino.0, next, e.kind.mode_bits(), &e.name)
                });
                if let Err(e) = res {
                    r.err(errno(&e));
                }
            }
            Op::Readdirplus { fh, offset, size } => {
                let mut d = r.dir(size);
                let res = fs.readdirplus(fh, offset, |e, a, next| {
                    let mut entry = self.entry(a);
                    entry.nodeid = e.ino.0;
                    entry.attr_ttl = self.timeouts.attr;
                    d.add_plus(&entry, next, &e.name)
                });
                if let Err(e) = res {
                    r.err(errno(&e));
                }
            }
            Op::Releasedir { fh } => fs.releasedir(fh),
            Op::Fsyncdir => Self::reply_empty(r, fs.fsyncdir()),
            Op::Access { mask } => Self::reply_empty(r, fs.access(i, caller(h), mask)),
            Op::Create { flags, mode, name } => self.create(h, i, flags, mode, name, r),
            Op::Interrupt => {}
            // No ioctl applies to workspace files: ENOTTY, what a regular file on ext4
            // answers to a terminal ioctl (every `isatty` check, e.g. Python's `open`, asks).
            Op::Ioctl => r.err(libc::ENOTTY),
            Op::Fallocate {
                offset,
                length,
                mode,
            } => Self::reply_empty(r, fs.fallocate(i, offset, length, mode)),
            Op::Lseek { offset, whence } => {
                let data = match whence {
                    libc::SEEK_DATA => true,
                    libc::SEEK_HOLE => false,
                    _ => return r.err(libc::EINVAL),
                };
                if offset < 0 {
                    return r.err(libc::ENXIO);
                }
                match fs.seek(i, offset as u64, data) {
                    Ok(o) => r.offset(o),
                    Err(e) => r.err(errno(&e)),
                }
            }
            Op::CopyFileRange {
                off_in,
                nodeid_out,
                off_out,
                len,
            } => {
                let len = len.min(u64::from(u32::MAX) & !0xfff);
                // As for a write: the kernel leaves dropping setuid/setgid to keel.
                if self.killpriv() && h.uid != 0 {
                    if let Err(e) = fs.kill_privs(Ino(nodeid_out)) {
                        return r.err(errno(&e));
                    }
                }
                match fs.copy_file_range(i, off_in, Ino(nodeid_out), off_out, len) {
                    Ok(n) => r.written(n as u32),
                    Err(e) => r.err(errno(&e)),
                }
            }
            Op::Unsupported(_) => r.err(libc::ENOSYS),
        }
    }

    fn open(&self, h: &InHeader, i: Ino, flags: i32, kill: bool, r: &mut Reply) {
        // The kernel asks (FUSE_OPEN_KILL_SUIDGID) for an O_TRUNC open by a caller without
        // CAP_FSETID, which for keel's users means a non-root one.
        if self.killpriv() && (kill || (flags & libc::O_TRUNC != 0 && h.uid != 0)) {
            if let Err(e) = self.fs.kill_privs(i) {
                return r.err(errno(&e));
            }
        }
        match self.fs.open(i, flags) {
            Ok((fh, info)) => match &info.backing {
                None => r.open(fh, fopen_flags(&info), 0),
                Some(file) => match self.backing_id(i.0, fh, file) {
                    Ok(id) => r.open(fh, fopen_flags(&info) | fopen::PASSTHROUGH, id),
                    Err(()) => r.err(libc::EIO),
                },
            },
            Err(e) => r.err(errno(&e)),
        }
    }

    fn create(&self, h: &InHeader, parent: Ino, flags: i32, mode: u32, name: &[u8], r: &mut Reply) {
        match self.fs.create(caller(h), parent, name, mode, flags) {
            Ok((a, fh, info)) => {
                let e = self.entry(&a);
                match &info.backing {
                    None => r.create(&e, fh, fopen_flags(&info), 0),
                    Some(file) => match self.backing_id(a.inode.ino.0, fh, file) {
                        Ok(id) => r.create(&e, fh, fopen_flags(&info) | fopen::PASSTHROUGH, id),
                        Err(()) => r.err(libc::EIO),
                    },
                }
            }
            Err(e) => r.err(errno(&e)),
        }
    }
}

fn xattr_reply(r: &mut Reply, v: &[u8], size: u32) {
    if size == 0 {
        r.xattr_size(v.len() as u32);
    } else if v.len() > size as usize {
        r.err(libc::ERANGE);
    } else {
        r.data(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_split_and_join_across_the_epoch() {
        for n in [0i64, 1, 999_999_999, 1_000_000_000, -1, -1_500_000_000] {
            let (s, ns) = split_time(Nanos(n));
            assert!(ns < 1_000_000_000);
            assert_eq!(join_time(s, ns), Nanos(n));
        }
        assert_eq!(split_time(Nanos(-1)), (-1, 999_999_999));
    }
}

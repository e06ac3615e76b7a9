//! File data: open, read, write, flush, release, fsync, fallocate, seek and
//! copy_file_range, over inline bytes or a body file.

use crate::meta::Nanos;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::group::Batch;
use super::namespace::New;
use super::node::body_stamp;
use super::node::{Data, Node, OpenFile};
use super::{
    lazy, Attr, Caller, FsError, FsResult, FsyncHook, Handle, Inner, OpenInfo, WorkspaceFs,
};
use crate::config::CacheMode;
use crate::meta::{Inode, InodeNo, Kind, Storage};
use crate::sys;
use std::sync::atomic::Ordering;

/// The end of a write of `len` bytes at `offset`, or EFBIG past the largest file size.
pub(super) fn write_end(offset: u64, len: u64) -> FsResult<u64> {
    offset
        .checked_add(len)
        .filter(|e| *e <= i64::MAX as u64)
        .ok_or(FsError::Io(io::Error::from_raw_os_error(libc::EFBIG)))
}

/// Copies bytes `[off_in, off_in + len)` of body `src` to `off_out` in body `dst`, inside
/// the kernel where it can (`copy_file_range(2)`), else through a buffer. Past the end of
/// `src` (a body shorter than its file) the bytes are zeros, as `read` serves them. On an
/// error, also how many bytes were copied before it (as `write_body`).
pub(super) fn copy_body_range(
    src: &File,
    off_in: u64,
    dst: &File,
    off_out: u64,
    len: u64,
) -> Result<(), (u64, io::Error)> {
    pub(super) const PIECE: u64 = 1 << 20;
    let mut done = 0u64;
    let mut in_kernel = true;
    let mut buf = Vec::new();
    while done < len {
        let (at_in, at_out) = (off_in + done, off_out + done);
        let n = if in_kernel {
            let want = (len - done).min(1 << 30) as usize;
            match sys::file::copy_range(src, at_in, dst, at_out, want) {
                Ok(n) => n as u64,
                Err(e) if copy_unsupported(&e) => {
                    in_kernel = false;
                    continue;
                }
                Err(e) => return Err((done, e)),
            }
        } else {
            buf.resize((len - done).min(PIECE) as usize, 0);
            let n = src.read_at(&mut buf, at_in).map_err(|e| (done, e))?;
            write_body(dst, &buf[..n], at_out).map_err(|(k, e)| (done + k as u64, e))?;
            n as u64
        };
        if n == 0 {
            break;
        }
        done += n;
    }
    let zeros = vec![0u8; (len - done).min(PIECE) as usize];
    while done < len {
        let n = (len - done).min(PIECE) as usize;
        write_body(dst, &zeros[..n], off_out + done).map_err(|(k, e)| (done + k as u64, e))?;
        done += n as u64;
    }
    Ok(())
}

/// `copy_file_range(2)` cannot copy between these two files (another filesystem, or one
/// that does not support it): copy through a buffer instead.
pub(super) fn copy_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS)
    )
}

/// Fills `buf` (zeroed by the caller) from body `f` at `offset`. A body shorter than its
/// file reads as zeros (sparse tail): those bytes of `buf` stay as they are.
pub(super) fn read_body(f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64)? {
            0 => break,
            n => done += n,
        }
    }
    Ok(())
}

/// Writes `data` at `offset` of body `f`; on an error, also how many bytes went in before
/// it (a full volume can take the first part of a write).
pub(super) fn write_body(f: &File, data: &[u8], offset: u64) -> Result<(), (usize, io::Error)> {
    let mut done = 0;
    while done < data.len() {
        match f.write_at(&data[done..], offset + done as u64) {
            Ok(0) => return Err((done, io::Error::from(io::ErrorKind::WriteZero))),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((done, e)),
        }
    }
    Ok(())
}

impl WorkspaceFs {
    // ----- files -----

    pub(super) fn open_info(&self, node: &Node, inode: &Inode, flags: i32) -> OpenInfo {
        let direct = flags & libc::O_DIRECT != 0;
        match self.opts.cache {
            CacheMode::None => OpenInfo {
                keep_cache: false,
                direct_io: true,
                backing: None,
            },
            CacheMode::Kernel => OpenInfo {
                keep_cache: true,
                direct_io: direct,
                backing: None,
            },
            CacheMode::Auto => OpenInfo {
                keep_cache: node.cache_stamp == (inode.mtime, inode.size) || node.opens > 1,
                direct_io: direct,
                backing: None,
            },
        }
    }

    pub(super) fn new_handle(inner: &mut Inner, h: Handle) -> u64 {
        let fh = inner.next_fh;
        inner.next_fh += 1;
        inner.handles.insert(fh, h);
        fh
    }

    pub fn open(&self, ino: InodeNo, flags: i32) -> FsResult<(u64, OpenInfo)> {
        self.open_as(ino, flags, false)
    }

    /// Stored/Known/Lingering → Open (`ensure_open`, then one handle more).
    /// `fresh`: the file was just created. Opened read-write, it starts inline with a handle
    /// through keel (databases read back what they write, through the page cache), so small
    /// files never cost a body file; it moves to a body once it outgrows `inline_max`, and
    /// later opens hand its I/O to the kernel. Opened write-only (what `cp`, `echo >` and
    /// package managers do), it takes a body from the pool and passthrough at once, so its
    /// bytes go straight to the body. Any inline file that takes a body to be passed through
    /// goes back inline at its last close if it stayed small (`back_inline`).
    pub(super) fn open_as(
        &self,
        ino: InodeNo,
        flags: i32,
        fresh: bool,
    ) -> FsResult<(u64, OpenInfo)> {
        let mut guard = self.lock();
        self.open_locked(&mut guard, ino, flags, fresh)
    }

    /// `open_as` with the lock held.
    fn open_locked(
        &self,
        inner: &mut Inner,
        ino: InodeNo,
        flags: i32,
        fresh: bool,
    ) -> FsResult<(u64, OpenInfo)> {
        self.ensure_open(inner, ino)?;
        // What a mapping wrote since the last close, before a new stamp is taken.
        self.sync_mapped(inner, ino)?;
        // A writer may go through passthrough, unseen until its close: the state before.
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            self.track_inode(inner, ino);
        }
        // Not a file this open created: nothing to truncate, and its times must stay those
        // the create replied with (the write-back cache keeps the kernel's).
        if flags & libc::O_TRUNC != 0 && flags & libc::O_ACCMODE != libc::O_RDONLY && !fresh {
            self.sync_from_body(inner, ino)?;
            self.lazy_drop_from(inner, ino, 0)?;
            let t = Nanos::now();
            let of = self.file_of(inner, ino)?;
            if of.inode.size != 0 {
                self.resize(of, 0)?;
            }
            of.inode.mtime = t;
            of.inode.ctime = t;
            of.dirty = true;
            of.changed();
            Self::rebase(inner, ino)?;
            self.fed_touched(inner, ino);
        }
        // The kernel would read the sparse body directly: a file with windows still to
        // fetch is served through keel until it is complete.
        let inode = Self::load(inner, ino)?;
        if flags & libc::O_ACCMODE != libc::O_WRONLY && inode.storage == Storage::Body {
            self.record_open(ino, inode.size);
        }
        // A kernel write through a passthrough handle never reaches keel, so nothing would
        // drop setuid/setgid: writers of such files go through keel (unless passthrough
        // handles are open already: the kernel refuses to mix the two).
        let privileged = inode.perm & (libc::S_ISUID | libc::S_ISGID) != 0
            && flags & libc::O_ACCMODE != libc::O_RDONLY;
        let passthrough = self.opts.passthrough.load(Ordering::Relaxed)
            && !self.lazy_incomplete(inner, ino, inode.size)?;
        let node = inner.nodes.get_mut(&ino).expect("loaded");
        let mut backing = None;
        let mut writer = false;
        let write_only = flags & libc::O_ACCMODE == libc::O_WRONLY;
        // The kernel refuses to mix cached and passthrough handles on one inode.
        if passthrough
            && (!fresh || write_only)
            && node.opens == node.pt_opens
            && !(privileged && node.opens == 0)
        {
            let of = node.open.as_mut().expect("loaded");
            let mut known = None;
            if flags & libc::O_ACCMODE != libc::O_RDONLY {
                if matches!(of.data, Data::Inline(_)) {
                    known = self.to_body(of)?;
                    of.pt_body = true;
                }
                // A reader of a file with no body reads zeros through keel; a writer
                // passed through needs the body now.
                self.materialize(of)?;
            }
            if let Data::Body(f) = &of.data {
                // A readable handle can be mapped, and a mapping outlives the file: this
                // body must never become another file's.
                if !write_only {
                    self.pool.expose(ino.0);
                }
                if of.pt_base.is_none() {
                    of.pt_base = Some(match known {
                        Some(stamp) => stamp,
                        None => body_stamp(f)?,
                    });
                }
                // Read-write: the kernel may map the body shared and write it unseen.
                if flags & libc::O_ACCMODE == libc::O_RDWR {
                    of.pt_mappable = true;
                }
                if flags & libc::O_ACCMODE != libc::O_RDONLY {
                    of.pt_writers += 1;
                    of.pt_unseen = true;
                    writer = true;
                }
                backing = Some(f.clone());
                node.pt_opens += 1;
            }
        }
        let pt = backing.is_some();
        node.opens += 1;
        let inode = node.open.as_ref().expect("loaded").inode.clone();
        let mut info = self.open_info(node, &inode, flags);
        if pt {
            info.keep_cache = false;
            info.direct_io = false;
        } else if fresh && self.opts.passthrough.load(Ordering::Relaxed) && write_only {
            // A new write-only file kept from passthrough (setuid): the kernel hands keel the
            // caller's pages instead of copying them into its page cache, which nobody reads
            // from a write-only handle.
            info.direct_io = true;
        }
        info.backing = backing;
        let fh = Self::new_handle(
            inner,
            Handle::File {
                ino,
                passthrough: pt,
                writer,
            },
        );
        Ok((fh, info))
    }

    pub fn create(
        &self,
        caller: Caller,
        parent: InodeNo,
        name: &[u8],
        mode: u32,
        flags: i32,
    ) -> FsResult<(Attr, u64, OpenInfo)> {
        // One lock for both: nothing can come between the insert and the open, so the new
        // file is loaded from what was inserted instead of read back from the store.
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let attr = self.make_locked(
            inner,
            caller,
            parent,
            name,
            New {
                kind: Kind::File,
                perm: mode & 0o7777,
                rdev: 0,
                target: None,
            },
        )?;
        Self::load_created(inner, attr.inode.clone());
        let (fh, info) = self.open_locked(inner, attr.inode.ino, flags, true)?;
        Ok((attr, fh, info))
    }

    /// Clones what a data operation needs without holding the lock during I/O.
    pub(super) fn file_of<'a>(
        &self,
        inner: &'a mut Inner,
        ino: InodeNo,
    ) -> FsResult<&'a mut OpenFile> {
        self.ensure_open(inner, ino)?;
        self.sync_from_body(inner, ino)?;
        Ok(inner
            .nodes
            .get_mut(&ino)
            .and_then(|n| n.open.as_mut())
            .expect("loaded"))
    }

    pub fn read(&self, ino: InodeNo, offset: u64, size: u32, buf: &mut Vec<u8>) -> FsResult<()> {
        buf.clear();
        self.lazy_fetch(
            ino,
            offset,
            offset.saturating_add(u64::from(size)),
            lazy::READAHEAD_WINDOWS,
        )?;
        let body = {
            let mut guard = self.lock();
            let inner: &mut Inner = &mut guard;
            let of = self.file_of(inner, ino)?;
            if offset >= of.inode.size {
                return Ok(());
            }
            let n = (of.inode.size - offset).min(u64::from(size)) as usize;
            match &of.data {
                Data::Inline(v) => {
                    let o = offset as usize;
                    buf.extend_from_slice(&v[o..o + n]);
                    return Ok(());
                }
                Data::Body(f) => {
                    self.record_read(ino, offset, n as u64, of.inode.size);
                    (f.clone(), n)
                }
                Data::Holes => {
                    buf.resize(n, 0);
                    return Ok(());
                }
            }
        };
        let (f, n) = body;
        buf.resize(n, 0);
        read_body(&f, buf, offset)?;
        Ok(())
    }

    pub fn write(&self, ino: InodeNo, offset: u64, data: &[u8]) -> FsResult<u32> {
        if data.is_empty() {
            return Ok(0);
        }
        let room = self.room_for_data(data.len() as u64)?;
        let data = &data[..room as usize];
        let end = write_end(offset, data.len() as u64)?;
        let claim = self.lazy_prepare_write(ino, offset, end)?;
        if let Some(f) = self.write_target(ino, offset, end, Some(data))? {
            match write_body(&f, data, offset) {
                Ok(()) => self.finish_write(ino, claim, &f, offset, end)?,
                // The volume had room for only part of it. What went in changed the file
                // and must be in the next checkpoint: it is recorded, and the caller gets
                // a short write, as from ext4 (its next write finds no room: ENOSPC). Not
                // over windows still to fetch (`claim`): a fetch overwrites them whole.
                Err((n, _)) if n > 0 && claim.is_none() => {
                    self.finish_write(ino, None, &f, offset, offset + n as u64)?;
                    return Ok(n as u32);
                }
                Err((_, e)) => return Err(e.into()),
            }
        }
        Ok(data.len() as u32)
    }

    /// Under the lock, before bytes `[offset, end)` are written: moves a file that outgrows
    /// `inline_max` to a body and returns the body, to be written without the lock. An
    /// inline file gets `data` right here and `None` comes back (also without `data`, when
    /// the caller must then write through `write`).
    pub(super) fn write_target(
        &self,
        ino: InodeNo,
        offset: u64,
        end: u64,
        data: Option<&[u8]>,
    ) -> FsResult<Option<Arc<File>>> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let inline_max = self.opts.inline_max;
        if !inner.trackers.is_empty() {
            self.file_of(inner, ino)?;
            self.track_inode(inner, ino);
        }
        let of = self.file_of(inner, ino)?;
        if end > inline_max {
            self.to_body(of)?;
        }
        self.materialize(of)?;
        let target = match &mut of.data {
            Data::Body(f) => Some(f.clone()),
            Data::Holes => unreachable!("materialized above"),
            Data::Inline(v) => {
                if let Some(data) = data {
                    if (v.len() as u64) < end {
                        v.resize(end as usize, 0);
                    }
                    v[offset as usize..end as usize].copy_from_slice(data);
                    let t = Nanos::now();
                    of.inode.size = of.inode.size.max(end);
                    of.inode.mtime = t;
                    of.inode.ctime = t;
                    of.touch(offset, end, self.opts.chunk_size);
                }
                None
            }
        };
        if target.is_none() {
            self.fed_touched(inner, ino);
        }
        Ok(target)
    }

    /// After bytes `[offset, end)` went into body `f` without the lock: records them.
    pub(super) fn finish_write(
        &self,
        ino: InodeNo,
        claim: Option<lazy::Claim<'_>>,
        f: &File,
        offset: u64,
        end: u64,
    ) -> FsResult<()> {
        self.lazy_finish_write(claim, f)?;
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        if let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) {
            let t = Nanos::now();
            of.inode.size = of.inode.size.max(end);
            of.inode.mtime = t;
            of.inode.ctime = t;
            of.touch(offset, end, self.opts.chunk_size);
        }
        self.fed_touched(inner, ino);
        Self::rebase(inner, ino)
    }

    /// Commits a file's pending attributes (on close of a descriptor).
    pub fn flush(&self, ino: InodeNo) -> FsResult<()> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        self.sync_from_body(inner, ino)?;
        self.fed_closed(inner, ino);
        Self::write_back(inner, ino)
    }

    /// Closes a file handle; returns whether it was a passthrough handle. Open → Loaded at
    /// the last handle, then `settle` (see `node.rs`'s life cycle). One lock section: the
    /// next request (often the LOOKUP of the next file) waits for the lock once, not twice.
    pub fn release(&self, fh: u64) -> FsResult<bool> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let Some(Handle::File {
            ino,
            passthrough,
            writer,
        }) = inner.handles.remove(&fh)
        else {
            return Err(FsError::BadHandle);
        };
        // A kernel write through a passthrough handle, or through a shared mapping of one
        // after its close, shows only in the body: look before the file is settled. What a
        // writable one wrote is marked whatever the body's stamp says (`sync_written`).
        let synced = if writer {
            if let Some(of) = inner.nodes.get_mut(&ino).and_then(|n| n.open.as_mut()) {
                of.pt_writers = of.pt_writers.saturating_sub(1);
            }
            self.sync_written(inner, ino)
        } else {
            self.sync_from_body(inner, ino)
        };
        if let Err(e) = synced {
            tracing::warn!(ino = ino.0, error = %e, "release: cannot stat the body");
        }
        // The stamp of a body that may stay mapped writable after this close.
        let mut mapped = None;
        if let Some(node) = inner.nodes.get_mut(&ino) {
            node.opens = node.opens.saturating_sub(1);
            if passthrough {
                node.pt_opens = node.pt_opens.saturating_sub(1);
                if node.pt_opens == 0 {
                    if let Some(of) = node.open.as_mut() {
                        let base = of.pt_base.take();
                        if std::mem::take(&mut of.pt_mappable) {
                            mapped = base;
                        }
                    }
                }
            }
        }
        self.settle(inner, ino)?;
        if let Some(stamp) = mapped {
            self.watch_mapped(inner, ino, stamp);
        }
        Ok(passthrough)
    }

    /// Makes a file's bytes and metadata durable.
    pub fn fsync(&self, ino: InodeNo, datasync: bool) -> FsResult<()> {
        let body = {
            let guard = self.lock();
            let inner: &Inner = &guard;
            match inner.nodes.get(&ino).and_then(|n| n.open.as_deref()) {
                Some(
                    of @ OpenFile {
                        data: Data::Body(f),
                        ..
                    },
                ) => {
                    // The body must be at its name before that name is made durable.
                    of.name_body()?;
                    Some(f.clone())
                }
                _ => None,
            }
        };
        if let Some(f) = body {
            if datasync {
                f.sync_data()?;
            } else {
                f.sync_all()?;
            }
            self.bodies.sync_entry(ino.0)?;
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        // What passthrough handles wrote, whatever the body's stamp says (`sync_written`).
        self.sync_written(inner, ino)?;
        Self::write_back(inner, ino)?;
        inner.sync(self.opts.chunk_size)?;
        drop(guard);
        if let Some(hook) = self.fsync_hook.get() {
            hook().map_err(|e| {
                tracing::error!(ino = ino.0, error = %e, "fsync: the checkpoint to the remote failed");
                FsError::Io(io::Error::other(e))
            })?;
        }
        Ok(())
    }

    /// Installs what every fsync must also do (once; later calls are ignored).
    pub fn set_fsync_hook(&self, hook: FsyncHook) {
        let _ = self.fsync_hook.set(hook);
    }

    pub fn fallocate(&self, ino: InodeNo, offset: u64, len: u64, mode: i32) -> FsResult<()> {
        const KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
        const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE;
        if mode & !(KEEP_SIZE | PUNCH | ZERO) != 0 {
            return Err(FsError::NotSupported);
        }
        if mode & PUNCH != 0 && (mode & KEEP_SIZE == 0 || mode & ZERO != 0) {
            return Err(FsError::Invalid);
        }
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= i64::MAX as u64)
            .ok_or(FsError::Io(io::Error::from_raw_os_error(libc::EFBIG)))?;
        if mode & (PUNCH | ZERO) != 0 {
            self.lazy_prepare_change(ino, offset, end)?;
        }
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        if mode & PUNCH == 0 {
            self.room_for_allocation(inner, len)?;
        }
        if !inner.trackers.is_empty() {
            self.file_of(inner, ino)?;
            self.track_inode(inner, ino);
        }
        let of = self.file_of(inner, ino)?;
        if mode & PUNCH == 0 {
            self.materialize(of)?;
        }
        let grows = mode & KEEP_SIZE == 0 && end > of.inode.size;
        if grows {
            self.resize(of, end)?;
        }
        let zero_end = end.min(of.inode.size);
        if mode & (PUNCH | ZERO) != 0 && offset < zero_end {
            match &mut of.data {
                Data::Inline(v) => v[offset as usize..zero_end as usize].fill(0),
                Data::Body(f) => {
                    let m = if mode & PUNCH != 0 {
                        PUNCH | KEEP_SIZE
                    } else {
                        ZERO | KEEP_SIZE
                    };
                    if sys::file::fallocate(f, m, offset, zero_end - offset).is_err() {
                        zero_fill(f, offset, zero_end)?;
                    }
                }
                // A hole punched into a file of holes (it was not materialized).
                Data::Holes => {}
            }
        } else if mode & (PUNCH | ZERO) == 0 {
            if let Data::Body(f) = &of.data {
                // Reserve the space so later writes cannot fail with ENOSPC.
                match sys::file::fallocate(f, KEEP_SIZE, offset, len) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        if mode & (PUNCH | ZERO) != 0 && offset < zero_end {
            of.touch(offset, zero_end, self.opts.chunk_size);
        }
        // Like ext4 and tmpfs: every successful fallocate is a modification.
        let t = Nanos::now();
        of.inode.mtime = t;
        of.inode.ctime = t;
        of.dirty = true;
        of.changed();
        let inode = of.inode.clone();
        let mut tx = Batch::new(&inner.store)?;
        tx.save(&inner.nodes, &inode)?;
        tx.commit(&mut inner.nodes)?;
        Self::rebase(inner, ino)?;
        self.fed_touched(inner, ino);
        self.settle(inner, ino)
    }

    /// Before a preallocation of up to `len` bytes (fallocate, zero range): ENOSPC when the
    /// state volume cannot hold it, before anything is allocated. Otherwise the operations
    /// already acknowledged are committed first. A failed fallocate keeps what it allocated
    /// on ext4, so one that fills the volume would leave no room to commit them (and, with
    /// their unlinks lost, no way to free it); a preallocation filling it all the same
    /// (other writers) then fails alone, and the next operations find the volume full and
    /// commit one by one, with the metadata reserve.
    fn room_for_allocation(&self, inner: &mut Inner, len: u64) -> FsResult<()> {
        if self.room_for_data(len)? < len {
            return Err(FsError::NoSpace);
        }
        if let Ok(s) = sys::file::statvfs(&self.state_dir) {
            if len > s.blocks_avail.saturating_mul(s.fragment_size) {
                return Err(FsError::NoSpace);
            }
        }
        inner.commit_group(self.opts.chunk_size)?;
        // The next operation looks at the free space again (and stops grouping if low).
        inner.space_checked = None;
        Ok(())
    }

    /// Before keel writes file bytes (a write, a copy, a preallocation): once the metadata
    /// reserve was given back on a full volume (`freeing`), what it held is kept for the
    /// commits of deletes, which are what make room again. Spent on data, a sandbox that
    /// keeps writing would leave no room to delete anything, and every later delete would
    /// fail with ENOSPC. So while the reserve is not held (and cannot be taken back), a
    /// write of `len` bytes gets what is free beyond what it held (a short write), or
    /// ENOSPC when nothing is. Returns how many bytes may be written. Writes through
    /// passthrough handles are the kernel's, which keel cannot hold back.
    fn room_for_data(&self, len: u64) -> FsResult<u64> {
        if self.reserve.held() {
            return Ok(len);
        }
        self.reserve.refill_if_room();
        if self.reserve.held() {
            return Ok(len);
        }
        let Some(v) = super::VolumeUsage::of(&self.state_dir) else {
            return Ok(len);
        };
        match v.avail.saturating_sub(super::RESERVE_BYTES) {
            0 if len > 0 => Err(FsError::NoSpace),
            beyond => Ok(len.min(beyond)),
        }
    }

    /// `lseek(2)` as far as the filesystem sees it: only SEEK_DATA and SEEK_HOLE reach it
    /// (EINVAL for any other `whence`), and a negative offset has no data after it (ENXIO).
    pub fn lseek(&self, ino: InodeNo, offset: i64, whence: i32) -> FsResult<u64> {
        let data = match whence {
            libc::SEEK_DATA => true,
            libc::SEEK_HOLE => false,
            _ => return Err(FsError::Invalid),
        };
        let offset = u64::try_from(offset).map_err(|_| FsError::NoData)?;
        self.seek(ino, offset, data)
    }

    /// SEEK_DATA (`data = true`) or SEEK_HOLE from `offset`.
    pub fn seek(&self, ino: InodeNo, offset: u64, data: bool) -> FsResult<u64> {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let size = self.file_of(inner, ino)?.inode.size;
        if offset >= size {
            return Err(FsError::NoData);
        }
        // Windows still to fetch are holes in the body but data in the file: report no
        // holes until the file is complete (allowed: holes are optional).
        if self.lazy_incomplete(inner, ino, size)? {
            return Ok(if data { offset } else { size });
        }
        let of = self.file_of(inner, ino)?;
        match &of.data {
            Data::Inline(_) => Ok(if data { offset } else { size }),
            Data::Holes if data => Err(FsError::NoData),
            Data::Holes => Ok(offset),
            Data::Body(f) => match sys::file::seek_data_hole(f, offset, data) {
                Ok(o) => Ok(o.min(size)),
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                    if data {
                        Err(FsError::NoData)
                    } else {
                        Ok(size)
                    }
                }
                Err(e) => Err(e.into()),
            },
        }
    }

    pub fn copy_file_range(
        &self,
        ino_in: InodeNo,
        off_in: u64,
        ino_out: InodeNo,
        off_out: u64,
        len: u64,
    ) -> FsResult<u64> {
        let src_size = {
            let mut guard = self.lock();
            let inner: &mut Inner = &mut guard;
            self.file_of(inner, ino_in)?.inode.size
        };
        if off_in >= src_size || len == 0 {
            return Ok(0);
        }
        let len = len.min(src_size - off_in);
        if let Some(n) = self.copy_bodies(ino_in, off_in, ino_out, off_out, len)? {
            return Ok(n);
        }
        let mut buf = Vec::new();
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(1 << 20) as u32;
            self.read(ino_in, off_in + done, n, &mut buf)?;
            if buf.is_empty() {
                break;
            }
            // A write the volume cut short (or refused) after some bytes were copied: the
            // count so far, as copy_file_range(2) says it.
            let w = match self.write(ino_out, off_out + done, &buf) {
                Ok(w) => w as u64,
                Err(_) if done > 0 => break,
                Err(e) => return Err(e),
            };
            done += w;
            if w < buf.len() as u64 {
                break;
            }
        }
        Ok(done)
    }

    /// Copies `len` bytes between two files that have bodies without the bytes leaving the
    /// kernel (`copy_file_range(2)` between the body files). `None` when either file is
    /// inline: the caller copies through a buffer.
    pub(super) fn copy_bodies(
        &self,
        ino_in: InodeNo,
        off_in: u64,
        ino_out: InodeNo,
        off_out: u64,
        len: u64,
    ) -> FsResult<Option<u64>> {
        let len = self.room_for_data(len)?;
        let end = write_end(off_out, len)?;
        if end <= self.opts.inline_max {
            return Ok(None);
        }
        self.lazy_fetch(ino_in, off_in, off_in.saturating_add(len), 0)?;
        let src = {
            let mut guard = self.lock();
            let inner: &mut Inner = &mut guard;
            match &self.file_of(inner, ino_in)?.data {
                Data::Body(f) => f.clone(),
                Data::Inline(_) | Data::Holes => return Ok(None),
            }
        };
        let claim = self.lazy_prepare_write(ino_out, off_out, end)?;
        let Some(dst) = self.write_target(ino_out, off_out, end, None)? else {
            return Ok(None);
        };
        match copy_body_range(&src, off_in, &dst, off_out, len) {
            Ok(()) => self.finish_write(ino_out, claim, &dst, off_out, end)?,
            // Part of it went in before the volume filled: recorded, a short copy (`write`).
            Err((n, _)) if n > 0 && claim.is_none() => {
                self.finish_write(ino_out, None, &dst, off_out, off_out + n)?;
                return Ok(Some(n));
            }
            Err((_, e)) => return Err(e.into()),
        }
        Ok(Some(len))
    }
}

pub(super) fn zero_fill(f: &File, from: u64, to: u64) -> io::Result<()> {
    let zeros = vec![0u8; (to - from).min(1 << 20) as usize];
    let mut off = from;
    while off < to {
        let n = ((to - off) as usize).min(zeros.len());
        f.write_all_at(&zeros[..n], off)?;
        off += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workspace::fs::FsOptions;
    use std::path::Path;
    use std::sync::atomic::AtomicBool;

    const CHUNK: u64 = 64 << 10;

    /// A workspace whose kernel agreed to passthrough, with a 3-window file `f` in a body,
    /// everything so far taken by a checkpoint.
    fn passthrough_fs(dir: &Path) -> (WorkspaceFs, InodeNo) {
        let fs = WorkspaceFs::new(
            dir,
            FsOptions {
                cache: CacheMode::Auto,
                inline_max: 64,
                chunk_size: CHUNK,
                passthrough: Arc::new(AtomicBool::new(true)),
                posix_acl: Arc::new(AtomicBool::new(true)),
            },
        )
        .unwrap();
        let root = Caller {
            uid: 0,
            gid: 0,
            pid: 0,
            umask: 0,
        };
        let (a, fh, _) = fs
            .create(root, InodeNo::ROOT, b"f", 0o644, libc::O_RDWR)
            .unwrap();
        fs.write(a.inode.ino, 0, &vec![b'a'; 3 * CHUNK as usize])
            .unwrap();
        fs.release(fh).unwrap();
        taken_by_a_checkpoint(&fs);
        assert_eq!(marked(&fs), []);
        (fs, a.inode.ino)
    }

    /// What a checkpoint does to the change tables: it takes every window marked so far
    /// (while a writable passthrough handle is open, the next `sync_all` marks its file's
    /// windows again).
    fn taken_by_a_checkpoint(fs: &WorkspaceFs) {
        fs.sync_all().unwrap();
        let guard = fs.lock();
        let tx = guard.store.write().unwrap();
        tx.clear_all_changes().unwrap();
        tx.commit().unwrap();
        drop(guard);
        fs.lock().sync(CHUNK).unwrap();
    }

    /// The windows the next checkpoint will take.
    fn marked(fs: &WorkspaceFs) -> Vec<(InodeNo, u64)> {
        fs.sync_all().unwrap();
        fs.lock().store.read().backlog_windows().unwrap()
    }

    /// The kernel writes `byte` over the first window of the body through a passthrough
    /// handle, and the body's stamp does not show it: on a state volume whose clock ticks
    /// coarser than the writes, a write of the same size within the tick of keel's last
    /// look leaves size, mtime and ctime as keel saw them (here keel looks right after).
    fn unseen_write(fs: &WorkspaceFs, ino: InodeNo, body: &File, byte: u8) {
        body.write_all_at(&vec![byte; CHUNK as usize], 0).unwrap();
        let mut guard = fs.lock();
        WorkspaceFs::rebase(&mut guard, ino).unwrap();
    }

    #[test]
    fn a_passthrough_write_the_bodys_stamp_does_not_show_is_in_the_next_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let (fs, ino) = passthrough_fs(dir.path());
        let all: Vec<_> = (0..3).map(|w| (ino, w)).collect();
        // At the release of the writable handle.
        let (fh, info) = fs.open(ino, libc::O_WRONLY).unwrap();
        let body = info.backing.expect("a passthrough handle");
        unseen_write(&fs, ino, &body, b'b');
        fs.release(fh).unwrap();
        assert_eq!(marked(&fs), all, "after the release");
        taken_by_a_checkpoint(&fs);
        // While it is open: at the checkpoint (sync_all), then at fsync.
        let (fh, info) = fs.open(ino, libc::O_RDWR).unwrap();
        let body = info.backing.expect("a passthrough handle");
        unseen_write(&fs, ino, &body, b'c');
        assert_eq!(marked(&fs), all, "at a checkpoint while open");
        taken_by_a_checkpoint(&fs);
        unseen_write(&fs, ino, &body, b'd');
        fs.fsync(ino, true).unwrap();
        assert_eq!(
            fs.lock().store.read().backlog_windows().unwrap(),
            all,
            "at fsync"
        );
        fs.release(fh).unwrap();
        taken_by_a_checkpoint(&fs);
        // Once no writable handle is open, a read-only one marks nothing.
        let (fh, info) = fs.open(ino, libc::O_RDONLY).unwrap();
        assert!(info.backing.is_some());
        fs.release(fh).unwrap();
        assert_eq!(marked(&fs), [], "after a read-only handle");
    }

    fn file_with(dir: &Path, name: &str, bytes: &[u8]) -> File {
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join(name))
            .unwrap();
        f.write_all_at(bytes, 0).unwrap();
        f
    }

    fn contents(f: &File) -> Vec<u8> {
        let mut v = vec![0u8; f.metadata().unwrap().len() as usize];
        f.read_exact_at(&mut v, 0).unwrap();
        v
    }

    #[test]
    fn body_copy_lands_at_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let src = file_with(dir.path(), "src", &data);
        let dst = file_with(dir.path(), "dst", b"0123456789");
        copy_body_range(&src, 5, &dst, 4, data.len() as u64 - 5).unwrap();
        let mut want = b"0123".to_vec();
        want.extend_from_slice(&data[5..]);
        assert!(contents(&dst) == want, "copied bytes differ");
    }

    #[test]
    fn body_copy_past_a_short_source_writes_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let src = file_with(dir.path(), "src", b"abc");
        let dst = file_with(dir.path(), "dst", &[7u8; 10]);
        copy_body_range(&src, 1, &dst, 2, 6).unwrap();
        assert_eq!(contents(&dst), b"\x07\x07bc\0\0\0\0\x07\x07");
    }
}

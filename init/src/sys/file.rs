//! File and filesystem syscalls the workspace needs beyond std: fallocate, SEEK_DATA/HOLE,
//! statvfs, flock, copy_file_range, rename without replacing, and writing a range of a file
//! out to disk and out of the page cache (sync_file_range, posix_fadvise). Thin safe
//! wrappers over `nix` and `libc`.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;

fn io_err(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// `fallocate(2)` with raw mode bits (FALLOC_FL_*).
pub fn fallocate(f: &File, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let flags = nix::fcntl::FallocateFlags::from_bits_retain(mode);
    nix::fcntl::fallocate(f.as_fd(), flags, offset as i64, len as i64).map_err(io_err)
}

/// `lseek(2)` with SEEK_DATA (`data = true`) or SEEK_HOLE.
pub fn seek_data_hole(f: &File, offset: u64, data: bool) -> io::Result<u64> {
    let whence = if data {
        nix::unistd::Whence::SeekData
    } else {
        nix::unistd::Whence::SeekHole
    };
    nix::unistd::lseek(f.as_fd(), offset as i64, whence)
        .map(|o| o as u64)
        .map_err(io_err)
}

/// Free-space numbers of the filesystem holding `path`.
#[derive(Debug, Clone, Copy)]
pub struct SpaceInfo {
    pub block_size: u64,
    pub fragment_size: u64,
    pub blocks: u64,
    pub blocks_free: u64,
    pub blocks_avail: u64,
    pub files: u64,
    pub files_free: u64,
}

pub fn statvfs(path: &Path) -> io::Result<SpaceInfo> {
    let s = nix::sys::statvfs::statvfs(path).map_err(io_err)?;
    Ok(SpaceInfo {
        block_size: s.block_size(),
        fragment_size: s.fragment_size(),
        blocks: s.blocks(),
        blocks_free: s.blocks_free(),
        blocks_avail: s.blocks_available(),
        files: s.files(),
        files_free: s.files_free(),
    })
}

/// An exclusive advisory lock held for as long as the value lives.
#[derive(Debug)]
pub struct LockFile {
    _lock: nix::fcntl::Flock<File>,
}

/// Takes an exclusive non-blocking `flock` on `path` (created 0600 if needed).
/// Returns `Ok(None)` when another process holds it.
pub fn try_lock(path: &Path) -> io::Result<Option<LockFile>> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(Some(LockFile { _lock: l })),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(io_err(e)),
    }
}

/// `copy_file_range(2)` between two files at explicit offsets; returns bytes copied.
pub fn copy_range(
    src: &File,
    src_off: u64,
    dst: &File,
    dst_off: u64,
    len: usize,
) -> io::Result<usize> {
    let mut so = src_off as i64;
    let mut d_o = dst_off as i64;
    nix::fcntl::copy_file_range(src.as_fd(), Some(&mut so), dst.as_fd(), Some(&mut d_o), len)
        .map_err(io_err)
}

/// `renameat2(2)` with RENAME_NOREPLACE: moves `from` to `to` unless `to` exists
/// (then `EEXIST`, and nothing moves).
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let cwd = nix::fcntl::AT_FDCWD;
    nix::fcntl::renameat2(
        cwd,
        from,
        cwd,
        to,
        nix::fcntl::RenameFlags::RENAME_NOREPLACE,
    )
    .map_err(io_err)
}

/// Starts writing the dirty pages of `f` in `offset..offset + len` to disk and returns
/// without waiting for them (sync_file_range with SYNC_FILE_RANGE_WRITE).
pub fn start_writeback(f: &File, offset: u64, len: u64) -> io::Result<()> {
    sync_range(f, offset, len, libc::SYNC_FILE_RANGE_WRITE)
}

/// Writes the pages of `f` in `offset..offset + len` to disk, waiting for any write of them
/// already under way and for its own, then drops them from the page cache
/// (POSIX_FADV_DONTNEED): a later read of the range reads the disk.
pub fn write_out_and_drop(f: &File, offset: u64, len: u64) -> io::Result<()> {
    sync_range(
        f,
        offset,
        len,
        libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER,
    )?;
    drop_cached(f, offset, len)
}

/// Drops the clean pages of `f` in `offset..offset + len` from the page cache
/// (POSIX_FADV_DONTNEED); dirty ones stay.
pub fn drop_cached(f: &File, offset: u64, len: u64) -> io::Result<()> {
    let (o, l) = (off_t(offset)?, off_t(len)?);
    nix::fcntl::posix_fadvise(
        f.as_fd(),
        o,
        l,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .map_err(io_err)
}

/// Reads what the page cache holds of `f` from `offset` into `buf`, never the disk
/// (preadv2 with RWF_NOWAIT): EAGAIN when the page at `offset` is not cached. For tests of
/// what keel leaves in the cache.
#[cfg(test)]
pub fn read_cached(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: the one iovec points at `buf`, writable for its whole length for the whole
    // call, and `f` keeps the descriptor open.
    let n = unsafe { libc::preadv2(f.as_raw_fd(), &iov, 1, off_t(offset)?, libc::RWF_NOWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

fn off_t(n: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(n).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))
}

fn sync_range(f: &File, offset: u64, len: u64, flags: libc::c_uint) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let (o, l) = (off_t(offset)?, off_t(len)?);
    // SAFETY: sync_file_range takes a descriptor, which `f` keeps open for the whole call,
    // and plain integers; it touches no memory of ours.
    if unsafe { libc::sync_file_range(f.as_raw_fd(), o, l, flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `syncfs(2)`: writes out every dirty page of the filesystem holding `path`.
pub fn syncfs(path: &Path) -> io::Result<()> {
    let dir = File::open(path)?;
    nix::unistd::syncfs(&dir).map_err(io_err)
}

/// Detaches whatever is mounted on `path` (`umount -l`), e.g. a dead FUSE mount that only
/// answers ENOTCONN. Returns whether something was unmounted.
pub fn detach_mount(path: &Path) -> io::Result<bool> {
    match nix::mount::umount2(path, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => Ok(false),
        Err(e) => Err(io_err(e)),
    }
}

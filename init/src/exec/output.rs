//! One output stream of a process, kept in a bounded file in keel's private state: the first
//! quarter of `limit` bytes (the head) is written once, the rest is a ring holding the last
//! three quarters (the tail). Bytes are addressed by their offset in the whole stream, so a
//! client resumes with `from=`; an offset whose bytes were dropped (between the head and the
//! tail, or overwritten while it was read) reads as a gap up to the first byte kept.
//!
//! One writer (the process's pump thread), any number of readers. The writer announces how
//! far it is about to write (`writing`) before it writes and publishes the new length
//! (`len`) after, so a reader that read ring bytes checks afterwards that the writer did
//! not reach them meanwhile.
//!
//! A stream kept in a file larger than [`CACHE_WINDOW`] twice over keeps only its last
//! `CACHE_WINDOW` bytes in the page cache: the writer starts the disk write of each
//! [`CACHE_STEP`] it completes and drops the step a window behind from the cache, and a
//! reader that far behind drops the steps it read. Without it a 1 GiB stream is 1 GiB of
//! new page cache, charged to the container's memory and, in a VM whose host backs guest
//! memory on first touch, ~3 s of CPU per GiB in keel's writes (BENCHMARKS.md, "Output
//! throughput"); the pages dropped are the ones the next steps reuse.

use std::fs::File;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::OnceLock;

/// How many bytes behind the writer a long stream keeps in the page cache.
pub const CACHE_WINDOW: u64 = 32 << 20;
/// The writer starts a disk write, and drops an older range, once per this many bytes.
const CACHE_STEP: u64 = 4 << 20;

/// What a read found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunk {
    /// This many bytes, from the offset asked for.
    Data(usize),
    /// Nothing is kept from the offset asked for up to `to` (the next byte kept).
    Gap { to: u64 },
    /// Nothing after the offset yet.
    Nothing,
}

#[derive(Debug)]
pub struct Output {
    /// Made at the first byte written: a process that prints nothing (most of them) costs
    /// no file create, unlink or open descriptor.
    file: OnceLock<File>,
    path: PathBuf,
    head: u64,
    tail: u64,
    len: AtomicU64,
    writing: AtomicU64,
    /// The stream offset up to which the disk write was started (a multiple of
    /// `CACHE_STEP`; the one writer's).
    written_back: AtomicU64,
}

impl Output {
    /// A new, empty stream keeping `limit` bytes in a file at `path` (0600), made when the
    /// first byte is written.
    pub fn create(path: &Path, limit: u64) -> Output {
        let head = limit / 4;
        Output {
            file: OnceLock::new(),
            path: path.to_path_buf(),
            head,
            tail: limit - head,
            len: AtomicU64::new(0),
            writing: AtomicU64::new(0),
            written_back: AtomicU64::new(0),
        }
    }

    /// The stream's file, made now if nothing was written yet (the one writer only).
    fn file_for_write(&self) -> io::Result<&File> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(f) = self.file.get() {
            return Ok(f);
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&self.path)?;
        Ok(self.file.get_or_init(|| f))
    }

    /// The stream's file, there once a byte was written (`len` > 0).
    fn file_for_read(&self) -> io::Result<&File> {
        self.file
            .get()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no output file yet"))
    }

    /// Bytes written to the stream so far (kept or not).
    pub fn len(&self) -> u64 {
        self.len.load(SeqCst)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes dropped so far (written but no longer kept).
    pub fn dropped(&self) -> u64 {
        self.len().saturating_sub(self.head + self.tail)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where logical offset `pos` lives in the file, and how many bytes from there are
    /// contiguous.
    fn place(&self, pos: u64) -> (u64, u64) {
        if pos < self.head {
            (pos, self.head - pos)
        } else {
            let r = (pos - self.head) % self.tail;
            (self.head + r, self.tail - r)
        }
    }

    /// Appends `buf` (the one writer only).
    pub fn append(&self, mut buf: &[u8]) -> io::Result<()> {
        let mut pos = self.len.load(SeqCst);
        // Of a buffer longer than the ring, only its last `tail` bytes can be kept.
        if pos >= self.head && buf.len() as u64 > self.tail {
            let skip = buf.len() - self.tail as usize;
            pos += skip as u64;
            buf = &buf[skip..];
        }
        if buf.is_empty() {
            return Ok(());
        }
        let file = self.file_for_write()?;
        self.writing.store(pos + buf.len() as u64, SeqCst);
        while !buf.is_empty() {
            let (at, room) = self.place(pos);
            let n = (room as usize).min(buf.len());
            file.write_all_at(&buf[..n], at)?;
            pos += n as u64;
            buf = &buf[n..];
        }
        self.len.store(pos, SeqCst);
        self.bound_cache(file, pos);
        Ok(())
    }

    /// Moves what the pipe `pipe` holds now (at most `max` bytes, in one contiguous piece
    /// of the file) into the stream without copying it through keel (the one writer only).
    /// 0: the pipe is empty (or at its end: a read tells which). EINVAL: the pipe cannot be
    /// spliced into the file; `append` what is read instead.
    pub fn splice_from(&self, pipe: BorrowedFd<'_>, max: usize) -> io::Result<usize> {
        let want = crate::sys::pipe::available(pipe)?.min(max);
        if want == 0 {
            return Ok(0);
        }
        let pos = self.len.load(SeqCst);
        let (at, room) = self.place(pos);
        let n = (room as usize).min(want);
        let file = self.file_for_write()?;
        // Exactly what the pipe holds (nobody else reads it) or less: announced before.
        self.writing.store(pos + n as u64, SeqCst);
        let moved = crate::sys::pipe::splice_to_file(pipe, file, at, n)?;
        self.len.store(pos + moved as u64, SeqCst);
        self.bound_cache(file, pos + moved as u64);
        Ok(moved)
    }

    /// After the writer reached `len`: for a file larger than twice the cache window, the
    /// disk write of each step completed since the last call starts, and the step a window
    /// behind it, written out by now (or waited for: the writer then goes at the disk's
    /// pace), leaves the page cache. A smaller file stays cached whole; its pages are
    /// rewritten in place. Failures only leave pages cached: the bytes are in the file.
    fn bound_cache(&self, file: &File, len: u64) {
        if self.head + self.tail <= 2 * CACHE_WINDOW {
            return;
        }
        let mut at = self.written_back.load(SeqCst);
        // Bytes the ring no longer holds need no disk write (a buffer longer than the
        // ring skipped them).
        at = at.max(len.saturating_sub(self.tail) / CACHE_STEP * CACHE_STEP);
        while at + CACHE_STEP <= len {
            for (off, n) in self.file_ranges(at, at + CACHE_STEP) {
                let _ = crate::sys::file::start_writeback(file, off, n);
            }
            if let Some(old) = at.checked_sub(CACHE_WINDOW) {
                for (off, n) in self.file_ranges(old, old + CACHE_STEP) {
                    let _ = crate::sys::file::write_out_and_drop(file, off, n);
                }
            }
            at += CACHE_STEP;
        }
        self.written_back.store(at, SeqCst);
    }

    /// A reader read stream offsets `from..from + n`: the whole steps it finished with this
    /// read, when the writer has dropped them from the page cache already (they are a
    /// window behind it), leave the cache again, so a reader far behind the writer does not
    /// grow it by the stream's size. Whole steps: the cache holds large folios, and one
    /// that reaches past the range dropped stays.
    fn uncache_read(&self, file: &File, from: u64, n: u64) {
        let dropped_to = self.written_back.load(SeqCst).saturating_sub(CACHE_WINDOW);
        let start = from / CACHE_STEP * CACHE_STEP;
        let end = (from + n).min(dropped_to) / CACHE_STEP * CACHE_STEP;
        if start < end {
            for (off, len) in self.file_ranges(start, end) {
                let _ = crate::sys::file::drop_cached(file, off, len);
            }
        }
    }

    /// The pieces of the file holding stream offsets `from..to` (not wider than the ring).
    fn file_ranges(&self, mut from: u64, to: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        while from < to {
            let (at, room) = self.place(from);
            let n = room.min(to - from);
            out.push((at, n));
            from += n;
        }
        out
    }

    /// Reads from logical offset `from` into `buf`.
    pub fn read(&self, from: u64, buf: &mut [u8]) -> io::Result<Chunk> {
        let len = self.len();
        if from >= len || buf.is_empty() {
            return Ok(Chunk::Nothing);
        }
        if from < self.head {
            let n = (self.head.min(len) - from).min(buf.len() as u64) as usize;
            if n > 0 {
                let file = self.file_for_read()?;
                file.read_exact_at(&mut buf[..n], from)?;
                self.uncache_read(file, from, n as u64);
                return Ok(Chunk::Data(n));
            }
        }
        let first = self.head.max(len.saturating_sub(self.tail));
        if from < first {
            return Ok(Chunk::Gap { to: first });
        }
        let (at, room) = self.place(from);
        let n = (len - from).min(room).min(buf.len() as u64) as usize;
        let file = self.file_for_read()?;
        file.read_exact_at(&mut buf[..n], at)?;
        // The writer may have reached these bytes while they were read.
        let reached = self.writing.load(SeqCst);
        if reached > from + self.tail {
            return Ok(Chunk::Gap {
                to: self.head.max(reached - self.tail),
            });
        }
        self.uncache_read(file, from, n as u64);
        Ok(Chunk::Data(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn read_all(o: &Output, mut from: u64) -> (Vec<u8>, Vec<(u64, u64)>) {
        let (mut data, mut gaps) = (Vec::new(), Vec::new());
        let mut buf = [0u8; 7];
        loop {
            match o.read(from, &mut buf).unwrap() {
                Chunk::Data(n) => {
                    data.extend_from_slice(&buf[..n]);
                    from += n as u64;
                }
                Chunk::Gap { to } => {
                    gaps.push((from, to));
                    from = to;
                }
                Chunk::Nothing => return (data, gaps),
            }
        }
    }

    #[test]
    fn small_output_is_kept_whole_and_resumable() {
        let d = tempfile::tempdir().unwrap();
        let o = Output::create(&d.path().join("out"), 100);
        o.append(b"hello ").unwrap();
        o.append(b"world").unwrap();
        assert_eq!(o.len(), 11);
        assert_eq!(read_all(&o, 0), (b"hello world".to_vec(), vec![]));
        assert_eq!(read_all(&o, 6), (b"world".to_vec(), vec![]));
        assert_eq!(read_all(&o, 11), (vec![], vec![]));
    }

    #[test]
    fn bytes_spliced_from_a_pipe_keep_the_head_and_tail_as_appended_ones() {
        use std::io::Write;
        let d = tempfile::tempdir().unwrap();
        let o = Output::create(&d.path().join("out"), 100);
        let (r, w) = nix::unistd::pipe().unwrap();
        let mut w = std::fs::File::from(w);
        // Nothing in the pipe: nothing moved, and no file made yet.
        assert_eq!(o.splice_from(r.as_fd(), 1 << 20).unwrap(), 0);
        assert!(!d.path().join("out").exists());
        let all: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        for c in all.chunks(130) {
            w.write_all(c).unwrap();
            let mut moved = 0;
            while moved < c.len() {
                let n = o.splice_from(r.as_fd(), 1 << 20).unwrap();
                assert!(n > 0, "the pipe holds {} more bytes", c.len() - moved);
                moved += n;
            }
        }
        let (data, gaps) = read_all(&o, 0);
        assert_eq!(gaps, vec![(25, 925)]);
        assert_eq!(&data[..25], &all[..25]);
        assert_eq!(&data[25..], &all[925..]);
        assert_eq!(o.len(), 1000);
    }

    #[test]
    fn a_long_stream_keeps_only_its_last_window_in_the_page_cache() {
        use crate::sys::file::read_cached;
        let d = tempfile::tempdir().unwrap();
        let fs = nix::sys::statfs::statfs(d.path()).unwrap();
        if fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC {
            eprintln!("skipped: a tmpfs file lives in the page cache");
            return;
        }
        let o = Output::create(&d.path().join("out"), 1 << 30);
        let mib: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
        for _ in 0..128 {
            o.append(&mib).unwrap();
        }
        let f = o.file_for_read().unwrap();
        let mut page = [0u8; 4096];
        let not_cached = |at: u64, page: &mut [u8]| matches!(read_cached(f, page, at), Err(e) if e.raw_os_error() == Some(libc::EAGAIN));
        // The writer wrote its first steps out and dropped them; the last ones are cached.
        assert!(
            not_cached(0, &mut page),
            "the stream's first page is still cached"
        );
        assert_eq!(read_cached(f, &mut page, (128 << 20) - 4096).unwrap(), 4096);
        // A reader far behind reads them from the disk, exactly, and drops them again.
        let mut buf = vec![0u8; 8 << 20];
        assert_eq!(o.read(0, &mut buf).unwrap(), Chunk::Data(8 << 20));
        assert!(buf.chunks(1 << 20).all(|c| c == &mib[..]));
        assert!(
            not_cached(0, &mut page),
            "a reader left the first page cached"
        );
        assert!(
            not_cached(4 << 20, &mut page),
            "a reader left its second step cached"
        );
    }

    #[test]
    fn head_and_tail_are_kept_and_the_gap_is_marked() {
        let d = tempfile::tempdir().unwrap();
        // 25 bytes of head, 75 of tail.
        let o = Output::create(&d.path().join("out"), 100);
        let all: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        for c in all.chunks(13) {
            o.append(c).unwrap();
        }
        let (data, gaps) = read_all(&o, 0);
        assert_eq!(gaps, vec![(25, 925)]);
        assert_eq!(&data[..25], &all[..25]);
        assert_eq!(&data[25..], &all[925..]);
        assert_eq!(o.dropped(), 900);
        // Resuming inside the tail reads exactly the bytes from there.
        assert_eq!(read_all(&o, 990).0, all[990..].to_vec());
        // A buffer longer than the ring keeps its end.
        o.append(&all).unwrap();
        assert_eq!(read_all(&o, 0).0[25..], all[925..]);
        assert_eq!(o.len(), 2000);
    }
}

//! Lazily restored bodies: which chunk windows of which files are not fetched yet, and
//! fetching them on demand. A lazy restore creates no body for a file with stored windows
//! (the first open or fetch creates it, sparse at the file's size) and lists its windows
//! in the store's `missing_window` table; this module owns the in-memory copy of that
//! list (loaded per file on first use) and every path that must see real bytes first:
//! reads (with readahead for sequential readers), partial writes, truncates, fallocate,
//! SEEK_DATA/SEEK_HOLE and passthrough opens.
//!
//! A fetch marks its windows in flight (other users of those windows wait), does the
//! network I/O with no lock held, writes the verified bytes into the body, makes the body
//! durable (one `fdatasync` per request, plus its directory entry on a file's first fetch),
//! and only then removes the windows' rows. A crash
//! anywhere in between leaves the rows in place, so the window is fetched again: a read
//! never sees the sparse zeros of a window that has data.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use super::{Data, FsError, FsResult, Inner, WorkspaceFs};
use crate::chunk::chunker::{window_count, window_range};
use crate::chunk::{ChunkId, ChunkSource, FetchError};
use crate::meta::InodeNo;

/// Windows fetched ahead of a sequential reader, after the ones it asked for.
pub const READAHEAD_WINDOWS: usize = 4;

/// Not-yet-fetched windows of one file.
#[derive(Default)]
pub(super) struct FileWindows {
    /// Window index → the chunk holding its bytes.
    missing: BTreeMap<u64, ChunkId>,
    /// Windows some thread is fetching or overwriting right now.
    inflight: BTreeSet<u64>,
    /// Where the last read ended (sequential readers get readahead).
    next_off: u64,
    /// The body's directory entry was made durable (once per file and mount: the body may
    /// have been created since the restore).
    entry_durable: bool,
}

#[derive(Default)]
pub(super) struct Lazy {
    /// The state dir had missing windows when it was opened (nothing to do otherwise).
    active: AtomicBool,
    source: OnceLock<Arc<dyn ChunkSource>>,
    files: Mutex<HashMap<InodeNo, FileWindows>>,
    changed: Condvar,
}

impl Lazy {
    pub(super) fn new(active: bool) -> Lazy {
        Lazy {
            active: AtomicBool::new(active),
            ..Default::default()
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<InodeNo, FileWindows>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops what is known about a file's missing windows (a rollback gave it a whole body).
    pub(super) fn forget(&self, ino: InodeNo) {
        self.lock().remove(&ino);
    }
}

/// Windows this thread marked in flight; unmarked (and waiters woken) on drop.
pub(super) struct Claim<'a> {
    lazy: &'a Lazy,
    ino: InodeNo,
    idx: Vec<u64>,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut files = self.lazy.lock();
        if let Some(f) = files.get_mut(&self.ino) {
            for i in &self.idx {
                f.inflight.remove(i);
            }
        }
        drop(files);
        self.lazy.changed.notify_all();
    }
}

fn fetch_error(ino: InodeNo, idx: u64, e: &FetchError) -> FsError {
    tracing::error!(
        ino = ino.0,
        window = idx,
        error = %e,
        "lazy restore: cannot fetch window {idx} of inode {} ({e}); the read fails with EIO",
        ino.0
    );
    FsError::Fetch(format!("inode {} window {idx}: {e}", ino.0))
}

impl WorkspaceFs {
    /// Installs where missing windows come from (once; later calls are ignored).
    pub fn set_chunk_source(&self, source: Arc<dyn ChunkSource>) {
        let _ = self.lazy.source.set(source);
    }

    /// Whether the state dir had windows left to fetch when it was opened.
    pub fn lazy_active(&self) -> bool {
        self.lazy.active.load(Ordering::Relaxed)
    }

    /// Windows not fetched yet, over all files.
    pub fn missing_windows(&self) -> FsResult<u64> {
        Ok(self.lock().store.read().missing_window_count()?)
    }

    /// Loads (once) the missing windows of a file; rows past its end are stale (a shrink
    /// that committed before their removal did) and are dropped.
    fn lazy_file<'m>(
        &self,
        inner: &Inner,
        files: &'m mut HashMap<InodeNo, FileWindows>,
        ino: InodeNo,
        size: u64,
    ) -> FsResult<&'m mut FileWindows> {
        if let std::collections::hash_map::Entry::Vacant(v) = files.entry(ino) {
            let rows = inner.store.read().missing_windows(ino)?;
            let count = window_count(size, self.opts.chunk_size);
            if rows.iter().any(|(i, _)| *i >= count) {
                let tx = inner.store.write()?;
                tx.truncate_missing_windows(ino, count)?;
                tx.commit()?;
            }
            let missing = rows
                .into_iter()
                .filter(|(i, _)| *i < count)
                .map(|(i, id)| (i, ChunkId(id)))
                .collect();
            v.insert(FileWindows {
                missing,
                ..Default::default()
            });
        }
        Ok(files.get_mut(&ino).expect("inserted"))
    }

    /// The body of a file for fetched bytes: the open file's handle, or the body file,
    /// created sparse at the file's size if the restore left it out.
    fn lazy_body(&self, inner: &Inner, ino: InodeNo) -> FsResult<Arc<File>> {
        if let Some(of) = inner.nodes.get(&ino).and_then(|n| n.open.as_ref()) {
            if let Data::Body(f) = &of.data {
                return Ok(f.clone());
            }
        }
        let size = Self::load(inner, ino)?.size;
        let f = self.bodies.open_rw(ino.0)?;
        if f.metadata()?.len() < size {
            f.set_len(size)?;
        }
        Ok(Arc::new(f))
    }

    /// Does this file still have windows to fetch? (Called with the lock held.)
    pub(super) fn lazy_incomplete(&self, inner: &Inner, ino: InodeNo, size: u64) -> FsResult<bool> {
        if !self.lazy_active() {
            return Ok(false);
        }
        let mut files = self.lazy.lock();
        Ok(!self
            .lazy_file(inner, &mut files, ino, size)?
            .missing
            .is_empty())
    }

    /// Makes the windows holding bytes `[from, to)` of a file present in its body;
    /// `readahead`: also fetch up to that many windows after them when the caller reads
    /// sequentially. A window that cannot be fetched or fails verification is an error
    /// (EIO) naming the inode, window and chunk.
    pub(super) fn lazy_fetch(
        &self,
        ino: InodeNo,
        from: u64,
        to: u64,
        readahead: usize,
    ) -> FsResult<()> {
        if !self.lazy_active() {
            return Ok(());
        }
        let cs = self.opts.chunk_size;
        let (claim, need, ids, body) = loop {
            let guard = self.lock();
            let inner: &Inner = &guard;
            let size = match Self::load(inner, ino) {
                Ok(i) => i.size,
                Err(FsError::NotFound) => return Ok(()),
                Err(e) => return Err(e),
            };
            let mut files = self.lazy.lock();
            let f = self.lazy_file(inner, &mut files, ino, size)?;
            let to = to.min(size);
            if f.missing.is_empty() || from >= to {
                return Ok(());
            }
            let sequential = from == f.next_off;
            let need: Vec<u64> = f
                .missing
                .range(from / cs..to.div_ceil(cs))
                .map(|(i, _)| *i)
                .collect();
            if need.is_empty() {
                f.next_off = to;
                return Ok(());
            }
            if need.iter().any(|i| f.inflight.contains(i)) {
                drop(guard);
                drop(self.lazy.changed.wait(files));
                continue;
            }
            f.next_off = to;
            let mut take = need.clone();
            if readahead > 0 && sequential {
                let last = *need.last().expect("not empty");
                let ahead = last + 1..last + 1 + readahead as u64;
                take.extend(
                    f.missing
                        .range(ahead)
                        .map(|(i, _)| *i)
                        .filter(|i| !f.inflight.contains(i)),
                );
            }
            let ids: Vec<ChunkId> = take.iter().map(|i| f.missing[i]).collect();
            drop(files);
            let body = self.lazy_body(inner, ino)?;
            let mut files = self.lazy.lock();
            let f = files.get_mut(&ino).expect("loaded above");
            f.inflight.extend(take.iter().copied());
            let claim = Claim {
                lazy: &self.lazy,
                ino,
                idx: take,
            };
            break (claim, need, ids, body);
        };
        let op = crate::logging::Op::start("lazy_fetch");
        let results = match self.lazy.source.get() {
            Some(s) => s.fetch(&ids),
            None => ids
                .iter()
                .map(|id| {
                    Err(FetchError::Remote {
                        id: *id,
                        reason: "no remote is configured to fetch lazily restored data from".into(),
                    })
                })
                .collect(),
        };
        // Write what arrived, under the lock so a concurrent truncate cannot interleave
        // (windows it dropped are skipped).
        op.step("write");
        let mut written = Vec::new();
        let mut err = None;
        {
            let guard = self.lock();
            let inner: &Inner = &guard;
            let size = Self::load(inner, ino).map(|i| i.size).unwrap_or(0);
            let files = self.lazy.lock();
            for ((idx, id), r) in claim.idx.iter().zip(&ids).zip(results) {
                let still = files
                    .get(&ino)
                    .is_some_and(|f| f.missing.get(idx) == Some(id));
                match r {
                    Ok(data) if still => {
                        let range = window_range(*idx, size, cs);
                        let n = data.len().min((range.end - range.start) as usize);
                        if let Err(e) = body.write_all_at(&data[..n], range.start) {
                            err.get_or_insert(FsError::Io(e));
                            continue;
                        }
                        written.push(*idx);
                    }
                    Ok(_) => {}
                    Err(e) if need.contains(idx) => {
                        let fe = fetch_error(ino, *idx, &e);
                        err.get_or_insert(fe);
                    }
                    Err(e) => {
                        tracing::debug!(ino = ino.0, window = idx, error = %e, "readahead fetch failed");
                    }
                }
            }
        }
        if !written.is_empty() {
            // Durable bytes (and the body's name) before the record that says they are there.
            op.step("record");
            body.sync_data()?;
            let named = self.lazy.lock().get(&ino).is_some_and(|f| f.entry_durable);
            if !named {
                self.bodies.sync_entry(ino.0)?;
                if let Some(f) = self.lazy.lock().get_mut(&ino) {
                    f.entry_durable = true;
                }
            }
            self.lazy_record(ino, &written);
        }
        drop(claim);
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records windows as present (their bytes are durable in the body).
    /// Committed at once rather than with the metadata group: a fetch costs a round trip to
    /// the remote, a commit (no fsync) far less, and a crash then never fetches it again.
    fn lazy_record(&self, ino: InodeNo, idx: &[u64]) {
        let mut guard = self.lock();
        let inner: &mut Inner = &mut guard;
        let r = (|| -> FsResult<()> {
            let tx = inner.store.write()?;
            tx.remove_missing_windows(ino, idx.iter().copied())?;
            tx.commit()?;
            inner.commit_group(self.opts.chunk_size)?;
            Ok(())
        })();
        match r {
            Ok(()) => {
                let mut files = self.lazy.lock();
                if let Some(f) = files.get_mut(&ino) {
                    for i in idx {
                        f.missing.remove(i);
                    }
                }
            }
            // The bytes are in the body; the window is simply fetched again next time.
            Err(e) => tracing::warn!(ino = ino.0, error = %e, "cannot record fetched windows"),
        }
    }

    /// Before writing bytes `[off, end)`: fetches the missing windows the write covers only
    /// in part, and claims the ones it overwrites whole (no fetch). Finish with
    /// `lazy_finish_write` once the bytes are in the body.
    pub(super) fn lazy_prepare_write(
        &self,
        ino: InodeNo,
        off: u64,
        end: u64,
    ) -> FsResult<Option<Claim<'_>>> {
        if !self.lazy_active() || end <= off {
            return Ok(None);
        }
        let cs = self.opts.chunk_size;
        loop {
            let guard = self.lock();
            let inner: &Inner = &guard;
            let size = Self::load(inner, ino)?.size;
            let mut files = self.lazy.lock();
            let f = self.lazy_file(inner, &mut files, ino, size)?;
            let mut partial = Vec::new();
            let mut full = Vec::new();
            for (i, _) in f.missing.range(off / cs..end.div_ceil(cs)) {
                let r = window_range(*i, size, cs);
                if off <= r.start && end >= r.end {
                    full.push(*i);
                } else {
                    partial.push(*i);
                }
            }
            if !partial.is_empty() {
                drop(files);
                drop(guard);
                for i in partial {
                    self.lazy_fetch(ino, i * cs, i * cs + 1, 0)?;
                }
                continue;
            }
            if full.is_empty() {
                return Ok(None);
            }
            if full.iter().any(|i| f.inflight.contains(i)) {
                drop(guard);
                drop(self.lazy.changed.wait(files));
                continue;
            }
            f.inflight.extend(full.iter().copied());
            return Ok(Some(Claim {
                lazy: &self.lazy,
                ino,
                idx: full,
            }));
        }
    }

    /// The overwritten windows' new bytes are in `body`: make them durable, then record
    /// the windows as present (a crash before that fetches the old bytes again, as if the
    /// unacknowledged write never happened).
    pub(super) fn lazy_finish_write(&self, claim: Option<Claim<'_>>, body: &File) -> FsResult<()> {
        let Some(claim) = claim else { return Ok(()) };
        body.sync_data()?;
        self.lazy_record(claim.ino, &claim.idx);
        Ok(())
    }

    /// Before a truncate to `size`: fetches the window the new end falls inside (its
    /// head is kept), so only whole windows are ever dropped.
    pub(super) fn lazy_prepare_truncate(&self, ino: InodeNo, size: u64) -> FsResult<()> {
        if size % self.opts.chunk_size != 0 {
            self.lazy_fetch(ino, size, size + 1, 0)?;
        }
        Ok(())
    }

    /// The file is about to become `size` bytes long (lock held): windows past the new end
    /// stop existing, so they are no longer missing.
    pub(super) fn lazy_drop_from(&self, inner: &Inner, ino: InodeNo, size: u64) -> FsResult<()> {
        if !self.lazy_active() {
            return Ok(());
        }
        let cur = Self::load(inner, ino)?.size;
        let count = window_count(size, self.opts.chunk_size);
        let mut files = self.lazy.lock();
        let f = self.lazy_file(inner, &mut files, ino, cur)?;
        if f.missing.range(count..).next().is_none() {
            return Ok(());
        }
        let tx = inner.store.write()?;
        tx.truncate_missing_windows(ino, count)?;
        tx.commit()?;
        f.missing.retain(|i, _| *i < count);
        Ok(())
    }

    /// Fetches every missing window of every file, `batch` windows per request, until done
    /// or `stop` is set (background prefetch). Returns the windows fetched; a file whose
    /// window fails is skipped (its reads report the failure).
    pub fn prefetch_all(&self, stop: &AtomicBool, batch: usize) -> u64 {
        let _op = crate::logging::Op::start("prefetch");
        let cs = self.opts.chunk_size;
        let batch = batch.max(1) as u64;
        let list = match self.lock().store.read().files_with_missing_windows() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "prefetch: cannot list files to fetch");
                return 0;
            }
        };
        let mut fetched = 0;
        for ino in list {
            let size = match self.getattr(ino) {
                Ok(a) => a.inode.size,
                Err(_) => continue,
            };
            let mut w = 0;
            while w < window_count(size, cs) {
                if stop.load(Ordering::Relaxed) {
                    return fetched;
                }
                let before = self.missing_in(ino).unwrap_or(0);
                if let Err(e) = self.lazy_fetch(ino, w * cs, (w + batch) * cs, 0) {
                    tracing::warn!(ino = ino.0, error = %e, "prefetch: skipping the rest of a file");
                    break;
                }
                fetched += before.saturating_sub(self.missing_in(ino).unwrap_or(0));
                w += batch;
            }
        }
        tracing::info!(windows = fetched, "prefetch: done");
        fetched
    }

    fn missing_in(&self, ino: InodeNo) -> Option<u64> {
        self.lazy.lock().get(&ino).map(|f| f.missing.len() as u64)
    }
}

//! Lazily restored bodies: which chunk windows of which files are not fetched yet, and
//! fetching them on demand. A lazy restore creates no body for a file with stored windows
//! (the first open or fetch creates it, sparse at the file's size) and lists its windows
//! in the store's `missing_window` table; this module owns the in-memory copy of that
//! list (loaded per file on first use) and every path that must see real bytes first:
//! reads (with readahead for sequential readers), partial writes, truncates, fallocate,
//! SEEK_DATA/SEEK_HOLE and passthrough opens.
//!
//! A READ that must fetch first runs on a fetch thread (`defer_fetch`), not on the FUSE
//! worker that took it, so readers waiting for the remote are not capped at the FUSE
//! threads.
//!
//! A fetch marks its windows in flight (other users of those windows wait), does the
//! network I/O with no lock held and writes the verified bytes into the body: from then on
//! the window is present for every reader, but its row stays in the store, *unsettled*,
//! until `settle_windows` makes the body durable (`fdatasync`, plus its directory entry on a
//! file's first fetch) and only then removes the rows, many windows and files at once,
//! off the read's path (after its reply). A crash anywhere in between leaves the rows in
//! place, so the window is fetched again: a read never sees the sparse zeros of a window
//! that has data. A window whose row is still there is never changed: every path that
//! changes a file's bytes (write, truncate, fallocate, copy into it) settles the file
//! first, and the checkpoint's flush settles everything, so a checkpoint may take the
//! chunk a row names as the window's bytes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use super::fetchers::{Deferred, Fetchers, FETCH_THREADS};
use super::{Data, FsError, FsResult, Inner, WorkspaceFs};
use crate::chunk::chunker::{window_count, window_range};
use crate::chunk::{ChunkId, ChunkSource, FetchError};
use crate::meta::InodeNo;

/// Windows fetched ahead of a sequential reader, after the ones it asked for.
pub const READAHEAD_WINDOWS: usize = 4;
/// Unsettled windows at which a fetch settles them itself (bounds the bodies held open).
const SETTLE_AT: usize = 4096;

/// Not-yet-fetched windows of one file.
#[derive(Default)]
pub(super) struct FileWindows {
    /// Window index → the chunk holding its bytes.
    pub(super) missing: BTreeMap<u64, ChunkId>,
    /// Windows some thread is fetching or overwriting right now.
    pub(super) inflight: BTreeSet<u64>,
    /// Where the last read ended (sequential readers get readahead).
    next_off: u64,
    /// The body's directory entry was made durable (once per file and mount: the body may
    /// have been created since the restore).
    entry_durable: bool,
    /// Windows fetched into the body whose rows are still in the store (see
    /// `settle_windows`),
    /// and the body they are in.
    unsettled: Vec<u64>,
    body: Option<Arc<File>>,
}

#[derive(Default)]
pub(super) struct Lazy {
    /// The state dir had missing windows when it was opened (nothing to do otherwise).
    active: AtomicBool,
    source: OnceLock<Arc<dyn ChunkSource>>,
    files: Mutex<HashMap<InodeNo, FileWindows>>,
    pub(super) changed: Condvar,
    /// Where requests that must wait for the remote run (see `WorkspaceFs::defer_fetch`).
    fetchers: Arc<Fetchers>,
    /// Windows fetched but not settled yet, over all files.
    unsettled: AtomicUsize,
    /// Held by the one `settle_windows` running.
    settling: Mutex<()>,
    /// Fetches a reader or writer waits for right now (the prefetch yields to them).
    pub(super) foreground: AtomicUsize,
    /// Directories a reader fetched a file of, for the prefetch to take their other files
    /// first (most recent last).
    pub(super) hints: Mutex<Vec<InodeNo>>,
}

impl Lazy {
    pub(super) fn new(active: bool) -> Lazy {
        let l = Lazy {
            active: AtomicBool::new(active),
            ..Default::default()
        };
        l.fetchers.max.store(FETCH_THREADS, Ordering::Relaxed);
        l
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<InodeNo, FileWindows>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops what is known about a file's missing windows (a rollback gave it a whole body
    /// and removed its rows).
    pub(super) fn forget(&self, ino: InodeNo) {
        if let Some(f) = self.lock().remove(&ino) {
            self.unsettled
                .fetch_sub(f.unsettled.len(), Ordering::Relaxed);
        }
    }
}

/// Windows this thread marked in flight; unmarked (and waiters woken) on drop.
pub(super) struct Claim<'a> {
    pub(super) lazy: &'a Lazy,
    pub(super) ino: InodeNo,
    pub(super) idx: Vec<u64>,
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
    FsError::Fetch {
        at: format!("inode {} window {idx}: ", ino.0),
        source: Box::new(e.clone()),
    }
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

    /// At most `n` requests wait for the remote at once, each on a fetch thread of its own
    /// (default `FETCH_THREADS`).
    pub fn set_fetch_threads(&self, n: usize) {
        self.lazy.fetchers.max.store(n.max(1), Ordering::Relaxed);
    }

    /// A request touching bytes `[off, off + len)` of `ino` that must first fetch some of
    /// them from the remote is queued to a fetch thread (which runs `job`, and `job`
    /// answers the kernel), so the FUSE worker goes on serving: parallel readers of data
    /// not fetched yet are not limited to the FUSE threads, nor is anything else waiting
    /// behind them. `Some(job)` back: nothing to fetch (or no thread), run it now.
    pub fn defer_fetch(&self, ino: InodeNo, off: u64, len: u64, job: Deferred) -> Option<Deferred> {
        if !self.lazy_active() || !self.would_fetch(ino, off, len) {
            return Some(job);
        }
        self.lazy.fetchers.submit(job).err()
    }

    /// Whether bytes `[off, off + len)` of `ino` hold windows not fetched yet.
    fn would_fetch(&self, ino: InodeNo, off: u64, len: u64) -> bool {
        let cs = self.opts.chunk_size;
        let range = off / cs..off.saturating_add(len).div_ceil(cs).max(off / cs + 1);
        if let Some(f) = self.lazy.lock().get(&ino) {
            return f.missing.range(range).next().is_some();
        }
        let guard = self.lock();
        let inner: &Inner = &guard;
        let Ok(size) = Self::load(inner, ino).map(|i| i.size) else {
            return false;
        };
        let mut files = self.lazy.lock();
        match self.lazy_file(inner, &mut files, ino, size) {
            Ok(f) => f.missing.range(range).next().is_some(),
            Err(_) => false,
        }
    }

    /// Stops taking requests for the fetch threads (at shutdown).
    pub(super) fn close_fetchers(&self) {
        self.lazy.fetchers.close();
    }

    /// Windows not fetched yet, over all files (what was fetched is settled first).
    pub fn missing_windows(&self) -> FsResult<u64> {
        self.settle_windows(None)?;
        Ok(self.lock().store.read().missing_window_count()?)
    }

    /// Loads (once) the missing windows of a file; rows past its end are stale (a shrink
    /// that committed before their removal did) and are dropped.
    pub(super) fn lazy_file<'m>(
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
    pub(super) fn lazy_body(&self, inner: &Inner, ino: InodeNo) -> FsResult<Arc<File>> {
        if let Some(of) = inner.nodes.get(&ino).and_then(|n| n.open.as_ref()) {
            if let Data::Body(f) = &of.data {
                return Ok(f.clone());
            }
        }
        let size = Self::load(inner, ino)?.size;
        Ok(Arc::new(self.sparse_body(ino, size)?))
    }

    /// Does this file still have windows to fetch or settle? (Called with the lock held.)
    pub(super) fn lazy_incomplete(&self, inner: &Inner, ino: InodeNo, size: u64) -> FsResult<bool> {
        if !self.lazy_active() {
            return Ok(false);
        }
        let mut files = self.lazy.lock();
        let f = self.lazy_file(inner, &mut files, ino, size)?;
        // Unsettled windows too: a passthrough writer would change them unseen.
        Ok(!f.missing.is_empty() || !f.unsettled.is_empty())
    }

    /// Makes the windows holding bytes `[from, to)` of a file present in its body;
    /// `readahead`: also fetch up to that many windows after them when the caller reads
    /// sequentially. A window that cannot be fetched or fails verification is an error
    /// (EIO) naming the inode, window and chunk. Returns how many windows this call fetched
    /// (readahead included; 0 when they were there, or fetched by another thread meanwhile).
    pub(super) fn lazy_fetch(
        &self,
        ino: InodeNo,
        from: u64,
        to: u64,
        readahead: usize,
    ) -> FsResult<u64> {
        if !self.lazy_active() {
            return Ok(0);
        }
        let cs = self.opts.chunk_size;
        let (claim, need, ids, body) = loop {
            let guard = self.lock();
            let inner: &Inner = &guard;
            let size = match Self::load(inner, ino) {
                Ok(i) => i.size,
                Err(FsError::NotFound) => return Ok(0),
                Err(e) => return Err(e),
            };
            let mut files = self.lazy.lock();
            let f = self.lazy_file(inner, &mut files, ino, size)?;
            let to = to.min(size);
            if f.missing.is_empty() || from >= to {
                return Ok(0);
            }
            let sequential = from == f.next_off;
            let need: Vec<u64> = f
                .missing
                .range(from / cs..to.div_ceil(cs))
                .map(|(i, _)| *i)
                .collect();
            if need.is_empty() {
                f.next_off = to;
                return Ok(0);
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
            if let Ok(i) = Self::load(inner, ino) {
                self.hint(i.parent);
            }
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
        let _op = crate::logging::Op::start("lazy_fetch");
        self.lazy.foreground.fetch_add(1, Ordering::SeqCst);
        let results = self.fetch_chunks(&ids);
        self.lazy.foreground.fetch_sub(1, Ordering::SeqCst);
        self.lazy.changed.notify_all();
        let n = self.land(ino, &body, &claim.idx, &ids, results, &need)?;
        drop(claim);
        if self.lazy.unsettled.load(Ordering::Relaxed) >= SETTLE_AT {
            self.settle_fetched();
        }
        Ok(n)
    }

    /// The chunks `ids` from the remote (each an error without one).
    pub(super) fn fetch_chunks(&self, ids: &[ChunkId]) -> Vec<Result<bytes::Bytes, FetchError>> {
        match self.lazy.source.get() {
            Some(s) => s.fetch(ids),
            None => ids
                .iter()
                .map(|id| {
                    Err(FetchError::Remote {
                        id: *id,
                        reason: "no remote is configured to fetch lazily restored data from".into(),
                    })
                })
                .collect(),
        }
    }

    /// A reader fetched a file of directory `dir`: the prefetch takes its other files next.
    fn hint(&self, dir: InodeNo) {
        let mut h = self.lazy.hints.lock().unwrap_or_else(|p| p.into_inner());
        if h.last() != Some(&dir) {
            h.retain(|d| *d != dir);
            h.push(dir);
            if h.len() > 64 {
                h.remove(0);
            }
        }
    }

    /// Writes what a fetch brought into `body` (under the lock, so a concurrent truncate
    /// cannot interleave: windows it dropped meanwhile are skipped) and marks the windows
    /// present, unsettled. A window of `need` that could not be fetched is the error;
    /// others (readahead) are logged. Returns the windows written.
    pub(super) fn land(
        &self,
        ino: InodeNo,
        body: &Arc<File>,
        idx: &[u64],
        ids: &[ChunkId],
        results: Vec<Result<bytes::Bytes, FetchError>>,
        need: &[u64],
    ) -> FsResult<u64> {
        let cs = self.opts.chunk_size;
        let mut written = 0;
        let mut err = None;
        let guard = self.lock();
        let inner: &Inner = &guard;
        let size = Self::load(inner, ino).map(|i| i.size).unwrap_or(0);
        let mut files = self.lazy.lock();
        for ((i, id), r) in idx.iter().zip(ids).zip(results) {
            let Some(f) = files.get_mut(&ino).filter(|f| f.missing.get(i) == Some(id)) else {
                continue;
            };
            match r {
                Ok(data) => {
                    let range = window_range(*i, size, cs);
                    let n = data.len().min((range.end - range.start) as usize);
                    if let Err(e) = body.write_all_at(&data[..n], range.start) {
                        err.get_or_insert(FsError::Io(e));
                        continue;
                    }
                    f.missing.remove(i);
                    f.unsettled.push(*i);
                    f.body.get_or_insert_with(|| body.clone());
                    written += 1;
                }
                Err(e) if need.contains(i) => {
                    let fe = fetch_error(ino, *i, &e);
                    err.get_or_insert(fe);
                }
                Err(e) => {
                    tracing::debug!(ino = ino.0, window = i, error = %e, "readahead fetch failed");
                }
            }
        }
        drop(files);
        drop(guard);
        self.lazy
            .unsettled
            .fetch_add(written as usize, Ordering::Relaxed);
        match err {
            Some(e) => Err(e),
            None => Ok(written),
        }
    }

    /// Settles what fetches left unsettled (see the module's notes), unless another thread
    /// is settling, which then takes these too. Errors are logged: the windows stay
    /// unsettled and are settled later (or fetched again after a crash).
    pub fn settle_fetched(&self) {
        while self.lazy.unsettled.load(Ordering::Relaxed) > 0 {
            let Ok(g) = self.lazy.settling.try_lock() else {
                return;
            };
            let r = self.settle_locked(None);
            drop(g);
            if let Err(e) = r {
                tracing::warn!(error = %e, "lazy restore: cannot settle fetched windows; they are fetched again after a crash");
                return;
            }
        }
    }

    /// Settles the fetched windows of `ino` (every file: `None`), waiting for a settle
    /// already running: on return none of its windows has a row left while its bytes are
    /// in the body.
    pub(super) fn settle_windows(&self, ino: Option<InodeNo>) -> FsResult<()> {
        if !self.lazy_active() || self.lazy.unsettled.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        let _g = self.lazy.settling.lock().unwrap_or_else(|p| p.into_inner());
        self.settle_locked(ino)
    }

    /// `settle_windows` with the settling lock held: bodies durable (and named), then the rows
    /// removed in one transaction.
    fn settle_locked(&self, only: Option<InodeNo>) -> FsResult<()> {
        let work: Vec<(InodeNo, Arc<File>, Vec<u64>, bool)> = {
            let mut files = self.lazy.lock();
            files
                .iter_mut()
                .filter(|(i, f)| !f.unsettled.is_empty() && only.is_none_or(|o| o == **i))
                .filter_map(|(i, f)| {
                    let body = f.body.clone()?;
                    Some((*i, body, std::mem::take(&mut f.unsettled), f.entry_durable))
                })
                .collect()
        };
        if work.is_empty() {
            return Ok(());
        }
        let put_back = |work: Vec<(InodeNo, Arc<File>, Vec<u64>, bool)>| {
            let mut files = self.lazy.lock();
            for (ino, _, idx, _) in work {
                match files.get_mut(&ino) {
                    Some(f) => f.unsettled.extend(idx),
                    None => {
                        self.lazy.unsettled.fetch_sub(idx.len(), Ordering::Relaxed);
                    }
                }
            }
        };
        // Durable bytes (and the bodies' names) before the records that say they are there.
        let durable = (|| -> std::io::Result<()> {
            for (ino, body, _, named) in &work {
                body.sync_data()?;
                if !named {
                    self.bodies.sync_entry(ino.0)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = durable {
            put_back(work);
            return Err(e.into());
        }
        let recorded = {
            let mut guard = self.lock();
            let inner: &mut Inner = &mut guard;
            (|| -> FsResult<()> {
                let tx = inner.store.write()?;
                for (ino, _, idx, _) in &work {
                    tx.remove_missing_windows(*ino, idx.iter().copied())?;
                }
                tx.commit()?;
                inner.commit_group(self.opts.chunk_size)?;
                Ok(())
            })()
        };
        if let Err(e) = recorded {
            put_back(work);
            return Err(e);
        }
        let n: usize = work.iter().map(|w| w.2.len()).sum();
        self.lazy.unsettled.fetch_sub(n, Ordering::Relaxed);
        let mut files = self.lazy.lock();
        for (ino, _, _, _) in &work {
            if let Some(f) = files.get_mut(ino) {
                f.entry_durable = true;
                if f.unsettled.is_empty() {
                    f.body = None;
                }
            }
        }
        Ok(())
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
            // Windows fetched before (by reads, or just now) are settled before they change.
            self.settle_windows(Some(ino))?;
            let guard = self.lock();
            let inner: &Inner = &guard;
            let size = Self::load(inner, ino)?.size;
            let mut files = self.lazy.lock();
            let f = self.lazy_file(inner, &mut files, ino, size)?;
            if !f.unsettled.is_empty() {
                // Fetched by another thread meanwhile.
                continue;
            }
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
        self.settle_windows(Some(ino))
    }

    /// Before changing bytes `[off, end)` in place (fallocate's punch or zero): fetches the
    /// windows they touch and settles the file.
    pub(super) fn lazy_prepare_change(&self, ino: InodeNo, off: u64, end: u64) -> FsResult<()> {
        self.lazy_fetch(ino, off, end, 0)?;
        self.settle_windows(Some(ino))
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
        if f.missing.range(count..).next().is_none() && !f.unsettled.iter().any(|i| *i >= count) {
            return Ok(());
        }
        let tx = inner.store.write()?;
        tx.truncate_missing_windows(ino, count)?;
        tx.commit()?;
        f.missing.retain(|i, _| *i < count);
        // Their rows are gone with the others past the end.
        let before = f.unsettled.len();
        f.unsettled.retain(|i| *i < count);
        self.lazy
            .unsettled
            .fetch_sub(before - f.unsettled.len(), Ordering::Relaxed);
        Ok(())
    }
}

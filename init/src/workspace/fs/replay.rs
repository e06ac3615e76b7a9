//! Fetching a lazily restored workspace ahead of its readers, many windows in flight at
//! once across files: the *replay* of a read set (the windows the last session read, in the
//! order it first read them: what the next session most likely reads first), and the
//! *prefetch* of every other window, which follows what is being read (the other files of
//! a directory a reader fetched from come before unrelated ones) and yields to any read that
//! waits for the remote. Both claim windows as the readers do (a reader that wants a window
//! in flight waits for it rather than fetching it again), land them through `lazy::land`
//! and settle them in batches.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::lazy::Claim;
use super::{FsResult, Inner, WorkspaceFs};
use crate::chunk::ChunkId;
use crate::meta::{InodeNo, Kind};

/// Batches fetched at once by a replay or prefetch (each of `parallel` windows).
const PIPELINE: usize = 2;

/// What a replay or prefetch did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayReport {
    /// Windows fetched.
    pub windows: u64,
    /// Windows the set named that were not there to fetch (present already, in flight for
    /// a reader, or gone: a file deleted or shrunk since).
    pub skipped: u64,
    /// Windows that could not be fetched (their reads will say why).
    pub failed: u64,
    pub elapsed: Duration,
}

/// One window claimed for a batch: where it goes and which chunk it is.
struct Wanted {
    ino: InodeNo,
    idx: u64,
    id: ChunkId,
}

/// A file's claim on the windows a batch fetches, with the body they are written to.
type Held<'a> = (Claim<'a>, Arc<File>);

impl WorkspaceFs {
    /// Fetches the windows `set` names ((inode, window index), in order), `parallel` of
    /// them per batch with `PIPELINE` batches in flight, until done or `stop` is set.
    /// Windows that are not missing are skipped.
    pub fn replay(&self, set: &[(u64, u64)], parallel: usize, stop: &AtomicBool) -> ReplayReport {
        let _op = crate::logging::Op::start("replay");
        let t0 = Instant::now();
        let report = Mutex::new(ReplayReport::default());
        let source = Mutex::new(set.iter().map(|(i, x)| (InodeNo(*i), *x)));
        std::thread::scope(|s| {
            for _ in 0..PIPELINE {
                s.spawn(|| loop {
                    if stop.load(Ordering::Relaxed) || !self.lazy_active() {
                        return;
                    }
                    let mut skipped = 0;
                    let batch = {
                        let mut src = source.lock().unwrap_or_else(|p| p.into_inner());
                        self.claim_batch(&mut *src, parallel, &mut skipped)
                    };
                    let Some((wanted, claims)) = batch else {
                        report.lock().unwrap_or_else(|p| p.into_inner()).skipped += skipped;
                        return;
                    };
                    let (ok, failed) = self.fetch_batch(&wanted, &claims);
                    drop(claims);
                    self.settle_fetched();
                    let mut r = report.lock().unwrap_or_else(|p| p.into_inner());
                    r.windows += ok;
                    r.failed += failed;
                    r.skipped += skipped;
                });
            }
        });
        let mut r = report.into_inner().unwrap_or_else(|p| p.into_inner());
        r.elapsed = t0.elapsed();
        r
    }

    /// Claims up to `n` windows from `from` that are missing and not in flight (a claim per
    /// file, with its body); `skipped` counts the rest. `None` once `from` is exhausted and
    /// nothing was claimed.
    fn claim_batch<'a>(
        &'a self,
        from: &mut dyn Iterator<Item = (InodeNo, u64)>,
        n: usize,
        skipped: &mut u64,
    ) -> Option<(Vec<Wanted>, Vec<Held<'a>>)> {
        let mut wanted = Vec::new();
        let mut claims: HashMap<InodeNo, Held<'a>> = HashMap::new();
        // The iterator may take the lock itself: taken per window here.
        for (ino, idx) in &mut *from {
            let guard = self.lock();
            let inner: &Inner = &guard;
            match self.claim_one(inner, &mut claims, ino, idx) {
                Ok(Some(id)) => wanted.push(Wanted { ino, idx, id }),
                Ok(None) | Err(_) => *skipped += 1,
            }
            if wanted.len() >= n.max(1) {
                break;
            }
        }
        if wanted.is_empty() {
            return None;
        }
        Some((wanted, claims.into_values().collect()))
    }

    /// Claims window `idx` of `ino` if it is missing and nobody fetches it: its chunk.
    fn claim_one<'a>(
        &'a self,
        inner: &Inner,
        claims: &mut HashMap<InodeNo, Held<'a>>,
        ino: InodeNo,
        idx: u64,
    ) -> FsResult<Option<ChunkId>> {
        let size = match Self::load(inner, ino) {
            Ok(i) if i.kind == Kind::File => i.size,
            Ok(_) | Err(_) => return Ok(None),
        };
        let wanted =
            |files: &mut HashMap<InodeNo, super::lazy::FileWindows>| -> FsResult<Option<ChunkId>> {
                let f = self.lazy_file(inner, files, ino, size)?;
                Ok(f.missing
                    .get(&idx)
                    .copied()
                    .filter(|_| !f.inflight.contains(&idx)))
            };
        if wanted(&mut self.lazy.lock())?.is_none() {
            return Ok(None);
        }
        // Created (sparse) only for a window that is there to fetch; the lock is held, so
        // nothing changes the file meanwhile.
        let body = match claims.get(&ino) {
            Some(_) => None,
            None => Some(self.lazy_body(inner, ino)?),
        };
        let mut files = self.lazy.lock();
        let Some(id) = wanted(&mut files)? else {
            return Ok(None);
        };
        files.get_mut(&ino).expect("loaded").inflight.insert(idx);
        drop(files);
        let (claim, _) = claims.entry(ino).or_insert_with(|| {
            let claim = Claim {
                lazy: &self.lazy,
                ino,
                idx: Vec::new(),
            };
            (claim, body.expect("opened for a new claim"))
        });
        claim.idx.push(idx);
        Ok(Some(id))
    }

    /// Fetches the claimed windows (each distinct chunk once) and lands them per file.
    /// Returns (windows written, windows that failed).
    fn fetch_batch(&self, wanted: &[Wanted], claims: &[(Claim<'_>, Arc<File>)]) -> (u64, u64) {
        let mut ids: Vec<ChunkId> = wanted.iter().map(|w| w.id).collect();
        ids.sort();
        ids.dedup();
        let got: HashMap<ChunkId, _> = ids.iter().copied().zip(self.fetch_chunks(&ids)).collect();
        let (mut ok, mut failed) = (0, 0);
        for (claim, body) in claims {
            let mine: Vec<&Wanted> = wanted.iter().filter(|w| w.ino == claim.ino).collect();
            let idx: Vec<u64> = mine.iter().map(|w| w.idx).collect();
            let cids: Vec<ChunkId> = mine.iter().map(|w| w.id).collect();
            let results = cids.iter().map(|c| got[c].clone()).collect();
            failed += mine.iter().filter(|w| got[&w.id].is_err()).count() as u64;
            match self.land(claim.ino, body, &idx, &cids, results, &[]) {
                Ok(n) => ok += n,
                Err(e) => {
                    tracing::warn!(ino = claim.ino.0, error = %e, "background fetch: cannot write a file's windows")
                }
            }
        }
        (ok, failed)
    }

    /// Fetches every missing window of every file in the background, `parallel` windows per
    /// batch, until done or `stop` is set: the other files of directories readers fetch from
    /// first, then the rest in inode order; while a reader waits for the remote, it waits.
    /// Returns what it did.
    pub fn prefetch_all(&self, stop: &AtomicBool, parallel: usize) -> ReplayReport {
        let _op = crate::logging::Op::start("prefetch");
        let t0 = Instant::now();
        let list = match self.lock().store.read().files_with_missing_windows() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "prefetch: cannot list files to fetch");
                return ReplayReport::default();
            }
        };
        let order = Mutex::new(PrefetchOrder {
            list: list.into(),
            queued: VecDeque::new(),
            dirs_done: HashSet::new(),
        });
        let report = Mutex::new(ReplayReport::default());
        std::thread::scope(|s| {
            for _ in 0..PIPELINE {
                s.spawn(|| loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    self.yield_to_readers(stop);
                    let mut skipped = 0;
                    let batch = {
                        let mut o = order.lock().unwrap_or_else(|p| p.into_inner());
                        let mut it = PrefetchIter {
                            fs: self,
                            o: &mut o,
                        };
                        self.claim_batch(&mut it, parallel, &mut skipped)
                    };
                    let Some((wanted, claims)) = batch else {
                        return;
                    };
                    let (ok, failed) = self.fetch_batch(&wanted, &claims);
                    drop(claims);
                    self.settle_fetched();
                    let mut r = report.lock().unwrap_or_else(|p| p.into_inner());
                    r.windows += ok;
                    r.failed += failed;
                    r.skipped += skipped;
                });
            }
        });
        let mut r = report.into_inner().unwrap_or_else(|p| p.into_inner());
        r.elapsed = t0.elapsed();
        tracing::info!(
            windows = r.windows,
            failed = r.failed,
            seconds = r.elapsed.as_secs_f64(),
            "prefetch: done"
        );
        r
    }

    /// Waits while a reader or writer waits for the remote (checked every 20 ms at most).
    fn yield_to_readers(&self, stop: &AtomicBool) {
        let mut files = self.lazy.lock();
        while self.lazy.foreground.load(Ordering::SeqCst) > 0 && !stop.load(Ordering::Relaxed) {
            files = self
                .lazy
                .changed
                .wait_timeout(files, Duration::from_millis(20))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The files of directory `dir` (regular files only, at most `MAX_SIBLINGS`).
    fn files_in(&self, dir: InodeNo) -> Vec<InodeNo> {
        let Ok(entries) = self.lock().store.read().list(dir) else {
            return Vec::new();
        };
        entries
            .into_iter()
            .filter(|d| d.kind == Kind::File)
            .map(|d| d.ino)
            .take(MAX_SIBLINGS)
            .collect()
    }

    /// Every missing window of `ino` not in flight, in order.
    fn missing_of(&self, ino: InodeNo) -> Vec<u64> {
        let guard = self.lock();
        let inner: &Inner = &guard;
        let Ok(size) = Self::load(inner, ino).map(|i| i.size) else {
            return Vec::new();
        };
        let mut files = self.lazy.lock();
        match self.lazy_file(inner, &mut files, ino, size) {
            Ok(f) => f
                .missing
                .keys()
                .copied()
                .filter(|i| !f.inflight.contains(i))
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// Files of one hinted directory taken by the prefetch at most.
const MAX_SIBLINGS: usize = 4096;

/// Where the prefetch is: the files left in inode order, and windows queued from the
/// directories readers fetched from.
struct PrefetchOrder {
    list: VecDeque<InodeNo>,
    queued: VecDeque<(InodeNo, u64)>,
    dirs_done: HashSet<InodeNo>,
}

/// The prefetch's next windows: a hinted directory's files first, then the inode order.
struct PrefetchIter<'a, 'b> {
    fs: &'a WorkspaceFs,
    o: &'b mut PrefetchOrder,
}

impl Iterator for PrefetchIter<'_, '_> {
    type Item = (InodeNo, u64);

    fn next(&mut self) -> Option<(InodeNo, u64)> {
        loop {
            if let Some(w) = self.o.queued.pop_front() {
                return Some(w);
            }
            let hint = {
                let mut h = self.fs.lazy.hints.lock().unwrap_or_else(|p| p.into_inner());
                h.pop()
            };
            if let Some(dir) = hint {
                if self.o.dirs_done.insert(dir) {
                    for f in self.fs.files_in(dir) {
                        self.o
                            .queued
                            .extend(self.fs.missing_of(f).into_iter().map(|i| (f, i)));
                    }
                }
                continue;
            }
            let ino = self.o.list.pop_front()?;
            self.o
                .queued
                .extend(self.fs.missing_of(ino).into_iter().map(|i| (ino, i)));
        }
    }
}

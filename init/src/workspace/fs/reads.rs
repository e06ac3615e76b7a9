//! The read set: which chunk windows of which files were read since the mount, in the order
//! they were first read, at most `max` bytes of them (the least recently read go first).
//! Checkpoints record it on the remote and the next cold start fetches it first (see
//! `replay`): a session mostly reads again what the last one read. A read that reaches
//! keel counts the windows it touches; an open for reading counts the file's first windows,
//! since reads of a passed-through file never reach keel.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::WorkspaceFs;
use crate::chunk::chunker::{window_count, window_range};
use crate::meta::InodeNo;

/// Windows an open for reading counts (the whole of files up to this many windows).
pub const OPEN_WINDOWS: u64 = 2;

/// The read set by default, in bytes of windows.
pub const READ_SET_MAX: u64 = 256 << 20;

/// One window's place in the log.
#[derive(Clone, Copy)]
struct Entry {
    first: u64,
    last: u64,
    bytes: u64,
}

#[derive(Default)]
struct Log {
    /// Accesses so far (each window's `first` and `last` are taken from it).
    clock: u64,
    entries: HashMap<(u64, u64), Entry>,
    /// `last` → window, for dropping the least recently read.
    by_last: BTreeMap<u64, (u64, u64)>,
    bytes: u64,
    /// Bumped whenever the set (not only its order) changes.
    generation: u64,
}

pub(super) struct ReadLog {
    max: std::sync::atomic::AtomicU64,
    log: Mutex<Log>,
}

impl Default for ReadLog {
    fn default() -> Self {
        ReadLog {
            max: std::sync::atomic::AtomicU64::new(READ_SET_MAX),
            log: Mutex::default(),
        }
    }
}

/// Accesses a window may be behind the newest before a read of it moves it up again (the
/// order of a window read over and over needs no update per request).
const REFRESH_AFTER: u64 = 1024;

impl ReadLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Window `idx` of `ino`, `bytes` long, was read.
    fn touch(&self, ino: u64, idx: u64, bytes: u64) {
        let max = self.max.load(std::sync::atomic::Ordering::Relaxed);
        if max == 0 {
            return;
        }
        let mut l = self.lock();
        l.clock += 1;
        let now = l.clock;
        match l.entries.get_mut(&(ino, idx)) {
            Some(e) if now - e.last < REFRESH_AFTER => {}
            Some(e) => {
                let old = e.last;
                e.last = now;
                l.by_last.remove(&old);
                l.by_last.insert(now, (ino, idx));
            }
            None => {
                l.entries.insert(
                    (ino, idx),
                    Entry {
                        first: now,
                        last: now,
                        bytes,
                    },
                );
                l.by_last.insert(now, (ino, idx));
                l.bytes += bytes;
                l.generation += 1;
                while l.bytes > max {
                    let Some((_, k)) = l.by_last.pop_first() else {
                        break;
                    };
                    if let Some(e) = l.entries.remove(&k) {
                        l.bytes -= e.bytes;
                    }
                }
            }
        }
    }
}

impl WorkspaceFs {
    /// Keeps at most `bytes` of windows in the read set (0: records none).
    pub fn set_read_set_max(&self, bytes: u64) {
        self.reads
            .max
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes `[off, off + len)` of `ino`, a file of `size` bytes, were read.
    pub(super) fn record_read(&self, ino: InodeNo, off: u64, len: u64, size: u64) {
        let cs = self.opts.chunk_size;
        if len == 0 || off >= size {
            return;
        }
        let end = off.saturating_add(len).min(size);
        for idx in off / cs..end.div_ceil(cs) {
            let r = window_range(idx, size, cs);
            self.reads.touch(ino.0, idx, r.end - r.start);
        }
    }

    /// `ino`, a file of `size` bytes kept in a body, was opened for reading.
    pub(super) fn record_open(&self, ino: InodeNo, size: u64) {
        let cs = self.opts.chunk_size;
        for idx in 0..window_count(size, cs).min(OPEN_WINDOWS) {
            let r = window_range(idx, size, cs);
            self.reads.touch(ino.0, idx, r.end - r.start);
        }
    }

    /// The read set, windows in the order they were first read, and its generation (the
    /// same generation: the same set).
    pub fn read_set(&self) -> (u64, Vec<(u64, u64)>) {
        let l = self.reads.lock();
        let mut v: Vec<(u64, (u64, u64))> = l.entries.iter().map(|(k, e)| (e.first, *k)).collect();
        v.sort_unstable();
        (l.generation, v.into_iter().map(|(_, k)| k).collect())
    }

    /// The read set's generation (see `read_set`), cheaply.
    pub fn read_set_generation(&self) -> u64 {
        self.reads.lock().generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_first_read_order_and_drops_the_least_recently_read() {
        let log = ReadLog::default();
        log.max.store(3 * 10, std::sync::atomic::Ordering::Relaxed);
        log.touch(1, 0, 10);
        log.touch(2, 0, 10);
        log.touch(1, 0, 10);
        log.touch(3, 5, 10);
        let g = log.lock().generation;
        assert_eq!(g, 3);
        // Over the budget: the least recently read goes, (1, 0): reading it again came too
        // soon after its first read to move it up (REFRESH_AFTER).
        log.touch(4, 1, 10);
        let l = log.lock();
        let mut keys: Vec<_> = l.entries.iter().map(|(k, e)| (e.first, *k)).collect();
        keys.sort();
        let keys: Vec<_> = keys.into_iter().map(|(_, k)| k).collect();
        assert_eq!(keys, vec![(2, 0), (3, 5), (4, 1)]);
        assert_eq!(l.bytes, 30);
    }
}

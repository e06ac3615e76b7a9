//! The workspace's change feed (`GET /watch`): an ordered, bounded journal of what the
//! filesystem's mutating operations did (create, modify, attrib, delete, rename, and
//! `rescan` when a rollback or a lost commit group replaced more than can be listed), each
//! event with the path(s) it changed and a cursor. It holds no FUSE or SQLite types: `fs`
//! appends to it under its lock (so the order is the order the operations took effect),
//! readers take events after a cursor and may wait for more.
//!
//! Recording starts at the first watch (or the first exec that asks for its diff) and then
//! runs until keel stops: until then mutating operations pay one atomic load. The journal
//! keeps the newest `window` events (and at most `MAX_BYTES` of paths): a reader whose cursor
//! fell out of it is told so (`FeedError::Gone`), never given a silent gap.
//!
//! A cursor is `RUN-SEQ` (hex): `RUN` names this journal (a fresh random number per keel
//! start), `SEQ` the last event the reader has; a cursor of another run is refused
//! (`FeedError::OtherRun`), as its numbers mean nothing here.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::meta::{InodeNo, Kind, Nanos};

/// Events kept by default (`[workspace] watch_window`; the config owns the number).
pub const DEFAULT_WINDOW: usize = crate::config::workspace::DEFAULT_WATCH_WINDOW;
/// Bytes of paths the journal keeps at most, whatever the window.
pub const MAX_BYTES: usize = 64 << 20;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A new name: a file, directory, symlink, node created, or a hard link made.
    Create,
    /// A file's bytes or size changed (at its first change after an open and, if it
    /// changed again, when it is closed: the last event of a write comes after its last
    /// byte).
    Modify,
    /// Mode, owner, times or xattrs changed.
    Attrib,
    /// A name removed.
    Delete,
    /// A name moved (`from` → `path`); `replaced`: it took the place of another.
    Rename,
    /// Too much changed to list (a rollback, a lost commit group): rescan `path`.
    Rescan,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Modify => "modify",
            Op::Attrib => "attrib",
            Op::Delete => "delete",
            Op::Rename => "rename",
            Op::Rescan => "rescan",
        }
    }
}

/// The name of a kind, as `keel diff` writes it.
pub fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::File => "file",
        Kind::Dir => "dir",
        Kind::Symlink => "symlink",
        Kind::Fifo => "fifo",
        Kind::Socket => "socket",
        Kind::CharDev => "char",
        Kind::BlockDev => "block",
    }
}

/// One change, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub seq: u64,
    pub time: Nanos,
    pub op: Op,
    pub kind: Kind,
    pub ino: InodeNo,
    /// `/`-rooted, relative to the workspace (names that are not UTF-8: lossy).
    pub path: String,
    /// For `Rename`: where it was.
    pub from: Option<String>,
    /// Regular files: the size after the change.
    pub size: Option<u64>,
    /// `Rename` over an existing name, or an exchange (`RENAME_EXCHANGE`).
    pub replaced: bool,
    /// `Rescan`: why.
    pub reason: Option<&'static str>,
}

/// An event before it has its number and time.
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub op: Op,
    pub kind: Kind,
    pub ino: InodeNo,
    pub path: String,
    pub from: Option<String>,
    pub size: Option<u64>,
    pub replaced: bool,
    pub reason: Option<&'static str>,
}

impl NewEvent {
    pub fn new(op: Op, kind: Kind, ino: InodeNo, path: String) -> NewEvent {
        NewEvent {
            op,
            kind,
            ino,
            path,
            from: None,
            size: None,
            replaced: false,
            reason: None,
        }
    }
}

/// A position in the feed: the reader has every event up to `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub run: u64,
    pub seq: u64,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}-{:x}", self.run, self.seq)
    }
}

impl std::str::FromStr for Cursor {
    type Err = FeedError;
    fn from_str(s: &str) -> Result<Cursor, FeedError> {
        let bad = || FeedError::BadCursor(s.to_string());
        let (r, q) = s.split_once('-').ok_or_else(bad)?;
        Ok(Cursor {
            run: u64::from_str_radix(r, 16).map_err(|_| bad())?,
            seq: u64::from_str_radix(q, 16).map_err(|_| bad())?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FeedError {
    #[error("cursor {0:?} is not one keel gave (RUN-SEQ, hex)")]
    BadCursor(String),
    #[error(
        "cursor {cursor} is from another keel run (this one is {run:x}): rescan, then watch from now"
    )]
    OtherRun { cursor: Cursor, run: u64 },
    #[error(
        "cursor {cursor} is older than the feed's window (it keeps the newest events; the oldest it has follows {oldest}): rescan, then watch from now"
    )]
    Gone { cursor: Cursor, oldest: Cursor },
    #[error("cursor {cursor} is ahead of the feed (its newest event is {newest})")]
    Ahead { cursor: Cursor, newest: Cursor },
    #[error("the workspace is unmounting: the feed has ended")]
    Closed,
}

struct Ring {
    events: VecDeque<Event>,
    /// Sequence number of the next event (the first is 1; cursor seq 0: before any).
    next: u64,
    bytes: usize,
    window: usize,
    closed: bool,
}

impl Ring {
    /// The cursor just before the oldest event kept.
    fn oldest(&self) -> u64 {
        self.next - 1 - self.events.len() as u64
    }
}

/// The journal. One per mounted filesystem.
pub struct Feed {
    run: u64,
    active: AtomicBool,
    ring: Mutex<Ring>,
    more: Condvar,
    /// Readers waiting on `more` (counted under the ring's lock): a push with none wakes
    /// nobody, so it costs no futex call.
    waiting: AtomicUsize,
}

impl fmt::Debug for Feed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Feed")
            .field("run", &self.run)
            .field("active", &self.active())
            .finish_non_exhaustive()
    }
}

impl Default for Feed {
    fn default() -> Self {
        Feed::new(DEFAULT_WINDOW)
    }
}

/// A number that differs between keel runs (and between feeds of one process).
fn run_id() -> u64 {
    // Small enough to read, never 0.
    (crate::random::u64() >> 16).max(1)
}

impl Feed {
    pub fn new(window: usize) -> Feed {
        Feed {
            run: run_id(),
            active: AtomicBool::new(false),
            ring: Mutex::new(Ring {
                events: VecDeque::new(),
                next: 1,
                bytes: 0,
                window: window.max(1),
                closed: false,
            }),
            more: Condvar::new(),
            waiting: AtomicUsize::new(0),
        }
    }

    fn ring(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets how many events are kept (from the config, before the mount).
    pub fn set_window(&self, window: usize) {
        self.ring().window = window.max(1);
    }

    /// Whether events are being recorded (one relaxed load: the mutating operations' cost
    /// until the first watch).
    pub fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Starts recording; true the first time. The filesystem calls it under its lock.
    pub fn activate(&self) -> bool {
        !self.active.swap(true, Ordering::SeqCst)
    }

    /// The cursor after the newest event.
    pub fn now(&self) -> Cursor {
        Cursor {
            run: self.run,
            seq: self.ring().next - 1,
        }
    }

    /// Appends events (in order; the caller holds the filesystem's lock).
    pub fn push(&self, evs: impl IntoIterator<Item = NewEvent>) {
        let time = crate::meta::Nanos::now();
        let mut r = self.ring();
        if r.closed {
            return;
        }
        let mut any = false;
        for e in evs {
            let seq = r.next;
            r.next += 1;
            r.bytes += e.path.len() + e.from.as_ref().map_or(0, String::len);
            r.events.push_back(Event {
                seq,
                time,
                op: e.op,
                kind: e.kind,
                ino: e.ino,
                path: e.path,
                from: e.from,
                size: e.size,
                replaced: e.replaced,
                reason: e.reason,
            });
            any = true;
        }
        while r.events.len() > r.window || (r.bytes > MAX_BYTES && r.events.len() > 1) {
            if let Some(old) = r.events.pop_front() {
                r.bytes -= old.path.len() + old.from.as_ref().map_or(0, String::len);
            }
        }
        drop(r);
        if any && self.waiting.load(Ordering::SeqCst) > 0 {
            self.more.notify_all();
        }
    }

    /// Ends the feed (the workspace unmounts): readers get `Closed` once they have read
    /// everything.
    pub fn close(&self) {
        self.ring().closed = true;
        self.more.notify_all();
    }

    /// Checks a reader's cursor against the feed.
    pub fn check(&self, c: Cursor) -> Result<(), FeedError> {
        let r = self.ring();
        self.check_in(&r, c)
    }

    fn check_in(&self, r: &Ring, c: Cursor) -> Result<(), FeedError> {
        if c.run != self.run {
            return Err(FeedError::OtherRun {
                cursor: c,
                run: self.run,
            });
        }
        let newest = r.next - 1;
        if c.seq > newest {
            return Err(FeedError::Ahead {
                cursor: c,
                newest: Cursor {
                    run: self.run,
                    seq: newest,
                },
            });
        }
        if c.seq < r.oldest() {
            return Err(FeedError::Gone {
                cursor: c,
                oldest: Cursor {
                    run: self.run,
                    seq: r.oldest(),
                },
            });
        }
        Ok(())
    }

    /// Up to `max` events after `after`, waiting at most `wait` for the first when there
    /// are none (an empty answer: none came meanwhile).
    pub fn read(&self, after: Cursor, max: usize, wait: Duration) -> Result<Vec<Event>, FeedError> {
        let mut r = self.ring();
        if r.next - 1 == after.seq && !r.closed && !wait.is_zero() {
            self.waiting.fetch_add(1, Ordering::SeqCst);
            r = self
                .more
                .wait_timeout_while(r, wait, |r| r.next - 1 == after.seq && !r.closed)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        self.check_in(&r, after)?;
        let skip = (after.seq - r.oldest()) as usize;
        let out: Vec<Event> = r.events.iter().skip(skip).take(max).cloned().collect();
        if out.is_empty() && r.closed {
            return Err(FeedError::Closed);
        }
        Ok(out)
    }

    /// Events after `after` up to `until` (inclusive), all of them or `Gone`.
    pub fn range(&self, after: Cursor, until: Cursor) -> Result<Vec<Event>, FeedError> {
        let r = self.ring();
        self.check_in(&r, after)?;
        self.check_in(&r, until)?;
        let skip = (after.seq - r.oldest()) as usize;
        let n = until.seq.saturating_sub(after.seq) as usize;
        Ok(r.events.iter().skip(skip).take(n).cloned().collect())
    }
}

/// Which events a reader wants: those at `path` or, with `recursive`, anywhere below it,
/// else its direct entries (for a rename, either end; `rescan` of a path above it too).
#[derive(Debug, Clone)]
pub struct Filter {
    /// `/`-rooted without a trailing `/` ("" is the root).
    dir: String,
    recursive: bool,
}

impl Filter {
    /// `path` relative to the workspace root (a leading `/` optional); `..` is refused.
    pub fn new(path: &str, recursive: bool) -> Result<Filter, String> {
        let mut dir = String::new();
        for c in path.split('/').filter(|c| !c.is_empty() && *c != ".") {
            if c == ".." {
                return Err(format!("path {path:?}: `..` is not allowed"));
            }
            dir.push('/');
            dir.push_str(c);
        }
        Ok(Filter { dir, recursive })
    }

    /// The watched path, `/`-rooted.
    pub fn path(&self) -> &str {
        if self.dir.is_empty() {
            "/"
        } else {
            &self.dir
        }
    }

    pub fn recursive(&self) -> bool {
        self.recursive
    }

    fn covers(&self, p: &str) -> bool {
        if p == self.dir {
            return true;
        }
        let Some(rest) = p
            .strip_prefix(self.dir.as_str())
            .and_then(|r| r.strip_prefix('/'))
        else {
            return false;
        };
        self.recursive || !rest.contains('/')
    }

    pub fn wants(&self, e: &Event) -> bool {
        if e.op == Op::Rescan {
            // A rescan of a path above the watched one, or of one below it.
            return self.covers(&e.path)
                || e.path == "/"
                || self.dir.starts_with(&format!("{}/", e.path));
        }
        self.covers(&e.path) || e.from.as_deref().is_some_and(|f| self.covers(f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(op: Op, path: &str) -> NewEvent {
        NewEvent::new(op, Kind::File, InodeNo(7), path.to_string())
    }

    #[test]
    fn events_in_order_after_a_cursor_and_resumed() {
        let f = Feed::new(100);
        let start = f.now();
        assert_eq!(start.seq, 0);
        f.push([ev(Op::Create, "/a"), ev(Op::Modify, "/a")]);
        let got = f.read(start, 10, Duration::ZERO).unwrap();
        assert_eq!(
            got.iter().map(|e| (e.seq, e.op)).collect::<Vec<_>>(),
            vec![(1, Op::Create), (2, Op::Modify)]
        );
        // Resumed after the first: only the second.
        let c = Cursor {
            run: start.run,
            seq: 1,
        };
        let got = f.read(c, 10, Duration::ZERO).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].seq, 2);
        // Nothing new: an empty answer after the wait.
        assert!(f.read(f.now(), 10, Duration::ZERO).unwrap().is_empty());
        // The cursor's text round trips.
        let c2: Cursor = c.to_string().parse().unwrap();
        assert_eq!(c2, c);
        assert!(matches!(
            "x".parse::<Cursor>(),
            Err(FeedError::BadCursor(_))
        ));
    }

    #[test]
    fn a_cursor_older_than_the_window_or_of_another_run_is_refused() {
        let f = Feed::new(3);
        let start = f.now();
        f.push((0..5).map(|i| ev(Op::Create, &format!("/f{i}"))));
        match f.read(start, 10, Duration::ZERO) {
            Err(FeedError::Gone { oldest, .. }) => assert_eq!(oldest.seq, 2),
            other => panic!("{other:?}"),
        }
        // The oldest kept cursor still reads the window whole.
        let c = Cursor {
            run: start.run,
            seq: 2,
        };
        let got = f.read(c, 10, Duration::ZERO).unwrap();
        assert_eq!(
            got.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(),
            ["/f2", "/f3", "/f4"]
        );
        let other = Cursor {
            run: start.run + 1,
            seq: 0,
        };
        assert!(matches!(f.check(other), Err(FeedError::OtherRun { .. })));
        let ahead = Cursor {
            run: start.run,
            seq: 9,
        };
        assert!(matches!(f.check(ahead), Err(FeedError::Ahead { .. })));
    }

    #[test]
    fn a_closed_feed_ends_its_readers_after_what_they_have_not_read() {
        let f = std::sync::Arc::new(Feed::new(10));
        let start = f.now();
        let g = f.clone();
        let t = std::thread::spawn(move || g.read(start, 10, Duration::from_secs(600)));
        f.push([ev(Op::Create, "/x")]);
        assert_eq!(t.join().unwrap().unwrap().len(), 1);
        f.close();
        assert_eq!(f.read(start, 10, Duration::ZERO).unwrap().len(), 1);
        let end = Cursor {
            run: start.run,
            seq: 1,
        };
        assert_eq!(
            f.read(end, 10, Duration::from_secs(600)),
            Err(FeedError::Closed)
        );
    }

    #[test]
    fn filters_by_path_recursively_or_not() {
        let e = |op, p: &str, from: Option<&str>| Event {
            seq: 1,
            time: Nanos(0),
            op,
            kind: Kind::File,
            ino: InodeNo(2),
            path: p.into(),
            from: from.map(String::from),
            size: None,
            replaced: false,
            reason: None,
        };
        let flat = Filter::new("src/", false).unwrap();
        assert_eq!(flat.path(), "/src");
        assert!(flat.wants(&e(Op::Create, "/src", None)));
        assert!(flat.wants(&e(Op::Create, "/src/a", None)));
        assert!(!flat.wants(&e(Op::Create, "/src/a/b", None)));
        assert!(!flat.wants(&e(Op::Create, "/srcx", None)));
        assert!(flat.wants(&e(Op::Rename, "/elsewhere", Some("/src/a"))));
        let deep = Filter::new("/src", true).unwrap();
        assert!(deep.wants(&e(Op::Create, "/src/a/b", None)));
        assert!(!deep.wants(&e(Op::Create, "/other/src/a", None)));
        assert!(deep.wants(&e(Op::Rescan, "/", None)));
        assert!(!deep.wants(&e(Op::Rescan, "/other", None)));
        let all = Filter::new("", true).unwrap();
        assert_eq!(all.path(), "/");
        assert!(all.wants(&e(Op::Modify, "/x/y/z", None)));
        assert!(Filter::new("a/../b", true).is_err());
    }
}

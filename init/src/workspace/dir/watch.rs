//! Change notification for the `dir` provider: one inotify watch per directory of the tree,
//! so a periodic checkpoint walks only the directories something happened in instead of
//! the whole tree. The walk stays the truth; this only narrows it, and whenever it cannot
//! vouch for the whole tree the next walk is full:
//!
//! - until a full walk has added a watch to every directory (watches are added before a
//!   directory is listed, so nothing written after its listing goes unseen), and again
//!   after a directory could not be watched;
//! - after the event queue overflowed (`IN_Q_OVERFLOW`), or a directory was removed or
//!   moved (the paths below it change: a full walk relearns them);
//! - every [`FULL_EVERY`]th periodic walk, and always for the final checkpoint, `keel
//!   checkpoint`, `snapshot create`, `diff` and `rollback` (the caller chooses those);
//! - for good once keel's share of the host's watch limit is reached (half of
//!   `fs.inotify.max_user_watches`, read, never changed: the limit is per user, and the
//!   sandbox's own watchers, a dev server or a test runner, may be the same user) or the
//!   limit itself: the watches are dropped and every walk is full, said once.
//!
//! Writes through a shared writable mmap make no event (only `IN_CLOSE_WRITE`, when the last
//! reference to the open file goes, which a mapping holds). So every directory with a file
//! open now (an `IN_OPEN` not yet matched by an `IN_CLOSE_*`) is walked by every narrowed
//! walk, which compares the file's size, mtime and ctime (a write fault through a mapping
//! moves the mtime) like any walk. Opens are counted per directory: a file renamed to
//! another directory while open closes there, so the first directory may stay counted (a
//! wasted listing) and the second undercounted — the periodic full walk bounds that case.
//!
//! A file opened (or mapped) before its directory got its watch — before keel watched the
//! tree, or in a directory made and used before a walk found it — made no `IN_OPEN` that
//! could be counted. So after every full walk, and after a narrowed walk that watched a
//! directory for the first time, keel reads from /proc which files are open now
//! (`sys::open_files`: every process's descriptors and shared mappings), and every narrowed
//! walk lists their directories too until the next such reading. Reading /proc after the
//! watches are added leaves no gap: an open still held then is found, one made after its
//! watch was counted, and a mapping closed before is no longer written through (its close,
//! if after the watch, is `IN_CLOSE_WRITE`, see below). It costs one pass over the
//! processes' fds and maps, however large the tree, and only when watches were added: a
//! narrowed walk that watched nothing new reads nothing. (Counting each new directory as
//! open until some walk could vouch for it would need the same reading to vouch, and
//! before it would list the whole tree after the first full walk.) The pass runs without
//! the state's lock (events keep being read meanwhile) and keeps directories, not paths;
//! the entries it reads are capped (a process can hold one file open a million times):
//! past the cap, or while /proc cannot be listed, the next walk is full.
//!
//! Reading another uid's fds and maps takes ptrace access (`CAP_SYS_PTRACE`, which
//! container runtimes drop by default), so a keel that is not root, and a root keel whose
//! `[init] user` is not root, may not see the sandbox's processes at all. When any process
//! could not be read the pass cannot vouch for the opens made before a watch: every
//! directory watched for the first time since the last full walk is listed by every
//! narrowed walk until the next full one (which compares every file, and is at most
//! [`FULL_EVERY`] walks away), and the log says so once. A directory watched before the
//! last full walk, with a file a hidden process opened before that watch and writes through
//! a mapping, is caught by that periodic full walk, as is a process that sees the tree by
//! another path (another mount namespace).
//!
//! A second write to a mapped page that is still dirty makes no fault, so no time moves:
//! a walk between the two writes would take the file as unchanged for good. So every file
//! closed after being open for writing since the last walk began ([`Rewritten`]) has its
//! bytes read again by the next walk (full or narrowed) whatever its times say; once every
//! process is gone (the final checkpoint) each mapping's close has been reported. The list
//! holds at most [`REWRITTEN_FILES`] names; past that it names their directories, every
//! file of which is read again.

use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::sys::inotify::{self, Event, Inotify, Mask, Wd};
use crate::sys::open_files;

/// A periodic walk is full every this many (the rest walk what changed).
pub const FULL_EVERY: u32 = 10;

/// Files [`Rewritten`] names one by one; past this it names their directories.
pub const REWRITTEN_FILES: usize = 16_384;

/// Files closed after being open for writing since a walk began (paths below the tree's
/// root), whose bytes the next walk reads again whatever their times say (see the module's
/// note on mappings).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Rewritten {
    files: HashSet<PathBuf>,
    /// Directories every file of which counts (when `files` was full).
    dirs: HashSet<PathBuf>,
}

impl Rewritten {
    /// Whether the file at `path` (below the root) must be read again.
    pub fn contains(&self, path: &Path) -> bool {
        !self.is_empty()
            && (self.files.contains(path)
                || self.dirs.contains(path.parent().unwrap_or(Path::new(""))))
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty() && self.dirs.is_empty()
    }

    /// The file `name` of the directory `dir`.
    fn insert(&mut self, dir: &Path, name: &std::ffi::OsStr) {
        if self.dirs.contains(dir) {
            return;
        }
        if self.files.len() < REWRITTEN_FILES {
            self.files.insert(dir.join(name));
        } else {
            self.dirs.insert(dir.to_path_buf());
        }
    }

    /// What `other` names too (a walk that failed gives its list back).
    fn merge(&mut self, other: Rewritten) {
        for d in other.dirs {
            self.dirs.insert(d);
        }
        for f in other.files {
            let dir = f.parent().unwrap_or(Path::new("")).to_path_buf();
            if let Some(name) = f.file_name() {
                self.insert(&dir, name);
            }
        }
    }
}

/// What the next walk must cover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Every directory, and why.
    Full(String),
    /// Only these directories (below the tree's root; `""` is the root), listed whole; new
    /// directories found in them are walked whole too; the files of `rewritten` read again.
    Dirs(Vec<PathBuf>, Rewritten),
}

#[derive(Default)]
struct State {
    wds: HashMap<Wd, PathBuf>,
    dirty: HashSet<PathBuf>,
    rewritten: Rewritten,
    /// Files open now per watched directory (by watch: a directory renamed keeps it, one
    /// removed takes its count with it).
    open: HashMap<Wd, u32>,
    /// Directories (below the root) with a file open when /proc was last read (see the
    /// module's note on opens made before a watch): listed by every narrowed walk until the
    /// next reading.
    held_open: HashSet<PathBuf>,
    /// A directory got its first watch since /proc was last read.
    new_watch: bool,
    /// The directories that got their first watch since the last full walk committed (by
    /// watch, as `open`; that walk compared every file of those it watched itself).
    fresh: HashSet<Wd>,
    /// The last reading of /proc could not read some process: narrowed walks list `fresh`
    /// too (see the module's note on permissions).
    unvouched: bool,
    /// Why the next walk must be full.
    full: Option<String>,
    /// Why the watcher gave up for good.
    dead: Option<String>,
    narrowed_since_full: u32,
    /// Fallback reasons said in the log already (each once).
    said: HashSet<&'static str>,
}

impl State {
    /// Says `what` in the log the first time for `kind`, later only when debugging.
    fn say_once(&mut self, kind: &'static str, what: &str) {
        if self.said.insert(kind) {
            tracing::warn!("change notification: {what} (said once)");
        } else {
            tracing::debug!("change notification: {what}");
        }
    }

    fn need_full(&mut self, kind: &'static str, why: String) {
        if self.said.insert(kind) {
            tracing::info!(
                "change notification: {why}: the next checkpoint walks the whole tree (said once)"
            );
        } else {
            tracing::debug!("change notification: {why}: the next walk is full");
        }
        if self.full.is_none() {
            self.full = Some(why);
        }
    }

    fn apply(&mut self, e: Event) {
        if e.mask.contains(Mask::IN_Q_OVERFLOW) {
            self.need_full(
                "overflow",
                "the inotify queue overflowed (fs.inotify.max_queued_events)".into(),
            );
            return;
        }
        if e.mask.contains(Mask::IN_IGNORED) {
            self.wds.remove(&e.wd);
            self.open.remove(&e.wd);
            self.fresh.remove(&e.wd);
            return;
        }
        let Some(dir) = self.wds.get(&e.wd).cloned() else {
            return; // a watch dropped since
        };
        let Some(name) = e.name else {
            // About the watched directory itself: its parent's watch reports the same with
            // a name (and a narrowed walk always looks at the root). The root going away
            // is a rollback's swap: relearned by a full walk.
            if dir.as_os_str().is_empty()
                && e.mask.intersects(Mask::IN_DELETE_SELF | Mask::IN_MOVE_SELF)
            {
                self.need_full("root", "the tree's root was replaced".into());
            }
            return;
        };
        if e.mask.contains(Mask::IN_ISDIR) {
            if e.mask
                .intersects(Mask::IN_DELETE | Mask::IN_MOVED_FROM | Mask::IN_MOVED_TO)
            {
                self.need_full("dirmove", "a directory was removed or moved".into());
            } else if e.mask.intersects(Mask::IN_CREATE | Mask::IN_ATTRIB) {
                self.dirty.insert(dir);
            }
            return;
        }
        if e.mask.contains(Mask::IN_OPEN) {
            *self.open.entry(e.wd).or_default() += 1;
        }
        if e.mask.contains(Mask::IN_CLOSE_WRITE) {
            self.rewritten.insert(&dir, &name);
        }
        if e.mask
            .intersects(Mask::IN_CLOSE_WRITE | Mask::IN_CLOSE_NOWRITE)
        {
            if let Some(n) = self.open.get_mut(&e.wd) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.open.remove(&e.wd);
                }
            }
        }
        if e.mask.intersects(
            Mask::IN_CREATE
                | Mask::IN_DELETE
                | Mask::IN_MODIFY
                | Mask::IN_ATTRIB
                | Mask::IN_MOVED_FROM
                | Mask::IN_MOVED_TO
                | Mask::IN_CLOSE_WRITE,
        ) {
            self.dirty.insert(dir);
        }
    }
}

/// The events a watch asks for.
fn mask() -> Mask {
    Mask::IN_CREATE
        | Mask::IN_DELETE
        | Mask::IN_MODIFY
        | Mask::IN_ATTRIB
        | Mask::IN_MOVED_FROM
        | Mask::IN_MOVED_TO
        | Mask::IN_OPEN
        | Mask::IN_CLOSE_WRITE
        | Mask::IN_CLOSE_NOWRITE
        | Mask::IN_DELETE_SELF
        | Mask::IN_MOVE_SELF
}

/// The watches of one tree and what they reported since the last walk.
pub struct Watch {
    root: PathBuf,
    /// The most directories watched (see the module's note on the limit).
    cap: usize,
    fd: Arc<Inotify>,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    /// See [`Watch::hold`].
    held: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn lock(s: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads what is queued and applies it, under the state's lock (so no event read is
/// between the reader and the state when a walk takes its plan).
fn drain(fd: &Inotify, st: &mut State) {
    loop {
        match fd.read() {
            Ok(v) if v.is_empty() => return,
            Ok(v) => v.into_iter().for_each(|e| st.apply(e)),
            Err(e) => {
                st.need_full("read", format!("reading inotify events failed: {e}"));
                return;
            }
        }
    }
}

impl Watch {
    /// An inotify instance for the tree at `root`, its events read by a thread as they
    /// come (so the kernel's queue rarely overflows). No directory is watched yet: the
    /// first walk is full and adds the watches.
    pub fn start(root: &Path) -> io::Result<Watch> {
        let fd = Arc::new(Inotify::new()?);
        let state = Arc::new(Mutex::new(State {
            full: Some("no walk has watched the tree yet".into()),
            ..State::default()
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicBool::new(false));
        let (fd2, state2, stop2, held2) = (fd.clone(), state.clone(), stop.clone(), held.clone());
        let thread = std::thread::Builder::new()
            .name("keel-inotify".into())
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) {
                    if held2.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    match fd2.ready(Duration::from_millis(200)) {
                        Ok(true) => drain(&fd2, &mut lock(&state2)),
                        Ok(false) => {}
                        Err(e) => {
                            lock(&state2).dead =
                                Some(format!("waiting for inotify events failed: {e}"));
                            return;
                        }
                    }
                }
            })?;
        Ok(Watch {
            root: root.to_path_buf(),
            cap: inotify::max_user_watches().map_or(usize::MAX, |n| (n / 2).max(1) as usize),
            fd,
            state,
            stop,
            held,
            thread: Some(thread),
        })
    }

    /// Watches the directory at `rel` below the root (its watch kept when it has one), as
    /// a walk is about to list it. A directory that cannot be watched makes the next walk
    /// full; the host's watch limit makes every walk full from now on.
    pub fn add(&self, rel: &Path) {
        {
            let mut st = lock(&self.state);
            if st.dead.is_some() {
                return;
            }
            if st.wds.len() >= self.cap {
                st.dead = Some(format!(
                    "{} directories are watched, keel's share of the host's inotify watch limit (half of fs.inotify.max_user_watches, shared by every process of this user)",
                    st.wds.len()
                ));
                return;
            }
        }
        let r = self.fd.add_dir(&self.root.join(rel), mask());
        let mut st = lock(&self.state);
        match r {
            Ok(wd) => {
                if st.wds.insert(wd, rel.to_path_buf()).is_none() {
                    st.new_watch = true;
                    st.fresh.insert(wd);
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                if st.dead.is_none() {
                    st.dead = Some(format!(
                        "the host's inotify watch limit is reached (fs.inotify.max_user_watches = {}, shared by every process of this user; {} watched here)",
                        inotify::max_user_watches().map_or("?".into(), |n| n.to_string()),
                        st.wds.len()
                    ));
                }
            }
            // Gone since it was listed: the event that says so makes the next walk full.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => st.need_full(
                "unwatchable",
                format!("cannot watch {}: {e}", self.root.join(rel).display()),
            ),
        }
    }

    /// Whether the reader thread leaves the events in the kernel's queue (a test's way to
    /// make it overflow; a walk still reads them).
    pub fn hold(&self, on: bool) {
        self.held.store(on, Ordering::Relaxed);
    }

    /// Why the watcher gave up for good, if it did.
    pub fn dead(&self) -> Option<String> {
        lock(&self.state).dead.clone()
    }

    /// How many directories are watched.
    pub fn watched(&self) -> usize {
        lock(&self.state).wds.len()
    }

    /// A full walk starts: what was reported so far is covered by it (what happens from
    /// now on goes to the next walk); the files it reads again (see [`Rewritten`]).
    pub fn begin_full(&self) -> Rewritten {
        let mut st = lock(&self.state);
        drain(&self.fd, &mut st);
        st.full = None;
        st.dirty.clear();
        st.narrowed_since_full = 0;
        std::mem::take(&mut st.rewritten)
    }

    /// What the next periodic walk must cover, everything reported until now included;
    /// what it hands out is forgotten (see [`Watch::force_full`] when that walk fails).
    pub fn plan(&self) -> Plan {
        let mut st = lock(&self.state);
        drain(&self.fd, &mut st);
        if let Some(why) = &st.dead {
            return Plan::Full(why.clone());
        }
        if let Some(why) = &st.full {
            return Plan::Full(why.clone());
        }
        if st.narrowed_since_full + 1 >= FULL_EVERY {
            return Plan::Full(format!("every {FULL_EVERY}th periodic walk is full"));
        }
        st.narrowed_since_full += 1;
        let mut dirs: Vec<PathBuf> = st.dirty.drain().collect();
        let open: Vec<PathBuf> = st
            .open
            .keys()
            .filter_map(|wd| st.wds.get(wd))
            .cloned()
            .collect();
        dirs.extend(open);
        dirs.extend(st.held_open.iter().cloned());
        if st.unvouched {
            dirs.extend(st.fresh.iter().filter_map(|wd| st.wds.get(wd)).cloned());
        }
        dirs.sort();
        dirs.dedup();
        Plan::Dirs(dirs, std::mem::take(&mut st.rewritten))
    }

    /// A walk (`full` or not) committed: after a full one, or one that watched a directory
    /// for the first time, the directories with a file open now are read from /proc (see
    /// the module's note on opens made before a watch), without holding the state's lock.
    /// /proc that cannot be read, or read past its cap, makes the next walk full.
    pub fn walked(&self, full: bool) {
        {
            let mut st = lock(&self.state);
            if !(full || st.new_watch) || st.dead.is_some() {
                return;
            }
            // Cleared before the reading: a watch added from now on is not covered by it
            // and asks for the next one.
            st.new_watch = false;
            if full {
                st.fresh.clear();
            }
        }
        // Spelled as the kernel prints it (the tree's path may pass through a symlink).
        let root = std::fs::canonicalize(&self.root).unwrap_or_else(|_| self.root.clone());
        let scan = open_files::open_dirs_below(&root, open_files::Caps::default()).map(|s| {
            let held: HashSet<PathBuf> = s
                .dirs
                .iter()
                .filter_map(|d| d.strip_prefix(&root).ok())
                // A directory removed since, holding a file still open, is no longer in
                // the tree (a narrowed walk could not list it).
                .filter(|d| root.join(d).is_dir())
                .map(Path::to_path_buf)
                .collect();
            (held, s.denied, s.capped)
        });
        self.took(scan);
    }

    /// What a reading of /proc found (the directories below the root, the processes that
    /// could not be read, whether a cap stopped it), applied to the plans to come.
    fn took(&self, scan: io::Result<(HashSet<PathBuf>, usize, bool)>) {
        let mut st = lock(&self.state);
        match scan {
            Ok((held, denied, capped)) => {
                st.held_open = held;
                st.unvouched = denied > 0;
                if denied > 0 {
                    st.say_once(
                        "procdenied",
                        &format!("{denied} processes' open files cannot be read in /proc (another user's, without CAP_SYS_PTRACE): every directory watched since the last full walk is walked each time until the next full walk"),
                    );
                }
                if capped {
                    st.need_full(
                        "proccap",
                        "too many open files in /proc to read them all".into(),
                    );
                }
            }
            Err(e) => {
                st.held_open.clear();
                st.need_full(
                    "proc",
                    format!("cannot list /proc to find the files open before their directory was watched: {e}"),
                );
            }
        }
    }

    /// A walk that took `r` (from `plan` or `begin_full`) did not commit: the next one
    /// reads those files again.
    pub fn give_back_rewritten(&self, r: Rewritten) {
        lock(&self.state).rewritten.merge(r);
    }

    /// The walk of the last plan failed or could not decide: the next one is full.
    pub fn force_full(&self, why: String) {
        lock(&self.state).need_full("fallback", why);
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dirs(w: &Watch) -> Vec<PathBuf> {
        match w.plan() {
            Plan::Dirs(d, _) => d,
            Plan::Full(why) => panic!("full walk: {why}"),
        }
    }

    #[test]
    fn a_process_proc_cannot_read_keeps_new_directories_walked_until_a_full_walk() {
        let tmp = tempfile::tempdir().unwrap();
        for d in ["old", "new"] {
            std::fs::create_dir(tmp.path().join(d)).unwrap();
        }
        let w = Watch::start(tmp.path()).unwrap();
        w.begin_full();
        w.add(Path::new(""));
        w.add(Path::new("old"));
        w.walked(true);
        // A narrowed walk finds "new"; some process's fds could not be read.
        w.add(Path::new("new"));
        w.took(Ok((HashSet::new(), 1, false)));
        assert_eq!(dirs(&w), vec![PathBuf::from("new")]);
        assert_eq!(dirs(&w), vec![PathBuf::from("new")]);
        // A reading that saw every process vouches for it again.
        w.took(Ok((HashSet::new(), 0, false)));
        assert_eq!(dirs(&w), Vec::<PathBuf>::new());
        // A full walk compared it: not held after it, whatever the reading says.
        w.took(Ok((HashSet::new(), 1, false)));
        w.begin_full();
        w.walked(true);
        w.took(Ok((HashSet::new(), 1, false)));
        assert_eq!(dirs(&w), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_reading_stopped_by_its_cap_makes_the_next_walk_full() {
        let tmp = tempfile::tempdir().unwrap();
        let w = Watch::start(tmp.path()).unwrap();
        w.begin_full();
        w.add(Path::new(""));
        w.walked(true);
        assert_eq!(dirs(&w), Vec::<PathBuf>::new());
        w.took(Ok((HashSet::new(), 0, true)));
        assert!(matches!(w.plan(), Plan::Full(_)));
    }
}

//! The body store: a directory of sparse files, one per file id, sharded by the low byte
//! of the id so no directory grows past a few thousand entries; and the pool of emptied body
//! files the workspace reuses instead of creating and removing files.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::sys;

#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("create body dir {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },
}

/// Creates `path` and missing parents with mode 0700: bodies hold workspace bytes, which
/// only keel may read whatever the umask.
fn private_dir(path: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
}

#[derive(Debug, Clone)]
pub struct BodyStore {
    root: PathBuf,
}

impl BodyStore {
    /// Opens the store rooted at `root`, creating its shard directories (0700, like `root`
    /// if it is missing; every body file is 0600).
    pub fn open(root: &Path) -> Result<BodyStore, BodyError> {
        for shard in 0..=255u32 {
            let p = root.join(format!("{shard:02x}"));
            private_dir(&p).map_err(|source| BodyError::CreateDir { path: p, source })?;
        }
        Ok(BodyStore {
            root: root.to_path_buf(),
        })
    }

    pub fn path(&self, id: u64) -> PathBuf {
        self.root.join(format!("{:02x}/{id:x}", id & 0xff))
    }

    fn shard(&self, id: u64) -> PathBuf {
        self.root.join(format!("{:02x}", id & 0xff))
    }

    /// Opens a body for reading and writing, creating an empty one when absent.
    pub fn open_rw(&self, id: u64) -> io::Result<File> {
        self.open_with(id, true)
    }

    /// Opens a body for reading and writing if it exists; `None` when it does not (a
    /// lazily restored all-zero file has none until something is written to it).
    pub fn open_existing(&self, id: u64) -> io::Result<Option<File>> {
        match self.open_with(id, false) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn open_with(&self, id: u64, create: bool) -> io::Result<File> {
        let open = |flags: i32| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(create)
                .truncate(false)
                .mode(0o600)
                .custom_flags(flags)
                .open(self.path(id))
        };
        // O_NOATIME is refused for files we do not own; retry without it.
        open(libc::O_CLOEXEC | libc::O_NOATIME).or_else(|e| match e.raw_os_error() {
            Some(libc::EPERM) => open(libc::O_CLOEXEC),
            _ => Err(e),
        })
    }

    /// Size and allocated 512-byte blocks of a body, if it exists.
    pub fn stat(&self, id: u64) -> io::Result<Option<(u64, u64)>> {
        use std::os::unix::fs::MetadataExt;
        match std::fs::metadata(self.path(id)) {
            Ok(m) => Ok(Some((m.len(), m.blocks()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The metadata of a body (its size and times), if it exists.
    pub fn metadata(&self, id: u64) -> io::Result<Option<std::fs::Metadata>> {
        match std::fs::metadata(self.path(id)) {
            Ok(m) => Ok(Some(m)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes a body; a missing one is not an error.
    pub fn remove(&self, id: u64) -> io::Result<()> {
        match std::fs::remove_file(self.path(id)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Makes the directory entry of a body durable (after creating it).
    pub fn sync_entry(&self, id: u64) -> io::Result<()> {
        File::open(self.shard(id))?.sync_all()
    }

    /// Ids of every body present (for fsck and orphan cleanup).
    pub fn ids(&self) -> io::Result<Vec<u64>> {
        let mut out = Vec::new();
        for shard in 0..=255u32 {
            let dir = self.root.join(format!("{shard:02x}"));
            for e in std::fs::read_dir(dir)? {
                let e = e?;
                if let Some(id) = e
                    .file_name()
                    .to_str()
                    .and_then(|s| u64::from_str_radix(s, 16).ok())
                {
                    out.push(id);
                }
            }
        }
        out.sort_unstable();
        Ok(out)
    }
}

/// Most emptied body files the pool keeps; past this, bodies are removed.
pub const POOL_MAX: usize = 4096;

/// Below this many free files the pool asks its filler (`BodyPool::run_filler`) for more.
pub const POOL_LOW: usize = 64;

/// How many free files the filler makes the pool hold.
pub const POOL_FILL: usize = 256;

/// Emptied body files kept for reuse in `<bodies>/pool`, named by a counter. Taking one is a
/// rename where a new body would allocate an inode, and giving one back is a truncate and a
/// rename where removing it would free one. That matters on ext4 without a journal: each
/// inode allocation scans past every inode of its group freed in the last few seconds, so a
/// workload that deletes and creates files (builds, tests, package installs) paid more for
/// each new body the more it had just deleted.
///
/// Only the filesystem's own pool may take and give back (one `keel mount` per state dir).
#[derive(Debug)]
pub struct BodyPool {
    store: BodyStore,
    dir: PathBuf,
    max: usize,
    state: Mutex<PoolState>,
    /// Signalled when `recycle_released` is done with a body.
    recycled: Condvar,
    /// Signalled when the pool runs low, or the filler is to stop.
    filler: Condvar,
    /// Held through `recycle_released`: one call at a time.
    recycler: Mutex<()>,
    /// Set while bodies are handed to the kernel as passthrough backing files: a process
    /// may then hold a shared mapping of a body, which outlives the file's close and any
    /// truncate, so a body a file used goes to another file only when it is known never to
    /// have been handed over readable (`safe`; a write-only handle cannot be mapped);
    /// any other is removed.
    exposed: Option<Arc<AtomicBool>>,
}

/// At most this many bodies are remembered as never handed to the kernel readable; past it
/// new bodies are not, and are removed rather than reused when their files no longer need
/// them.
const SAFE_MAX: usize = 65_536;

#[derive(Debug, Default)]
struct PoolState {
    free: Vec<u64>,
    next: u64,
    /// Files (by id) whose body came from this pool and was never handed to the kernel
    /// with a readable handle (see `exposed`).
    safe: HashSet<u64>,
    /// Bodies of files that went back inline, kept at their names until the metadata that
    /// says so is committed (`release_held`); `create` takes such a body back first.
    held: HashSet<u64>,
    /// Held bodies whose change is committed, waiting for `recycle_released`.
    released: HashSet<u64>,
    /// The released body `recycle_released` is moving to the pool right now.
    recycling: Option<u64>,
    /// `create` calls waiting for that body.
    waiting: usize,
    /// Slots taken but given back without a name, to be emptied (`recycle_released`), and
    /// whether each may be reused (else removed).
    returned: Vec<(u64, bool)>,
    /// The pool ran low and the filler has not caught up yet.
    fill_asked: bool,
    /// The filler is to stop.
    fill_stop: bool,
}

/// A body handed out by [`BodyPool::take`].
#[derive(Debug)]
pub enum Fresh {
    /// Already at the file's name.
    Named(File),
    /// Still under this pool slot's name.
    Slot(u64, File),
}

impl BodyPool {
    /// Opens the pool of `store`, creating its directory; files a previous run left in it
    /// are reused (`create` empties one that a crash left with bytes).
    pub fn open(store: &BodyStore) -> Result<BodyPool, BodyError> {
        Self::open_with_max(store, POOL_MAX)
    }

    fn open_with_max(store: &BodyStore, max: usize) -> Result<BodyPool, BodyError> {
        let dir = store.root.join("pool");
        let create_err = |source| BodyError::CreateDir {
            path: dir.clone(),
            source,
        };
        private_dir(&dir).map_err(create_err)?;
        let mut free = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(create_err)? {
            let e = e.map_err(create_err)?;
            match e.file_name().to_str().and_then(|s| s.parse::<u64>().ok()) {
                Some(n) if free.len() < max => free.push(n),
                _ => {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let next = free.iter().max().map_or(0, |m| m + 1);
        Ok(BodyPool {
            store: store.clone(),
            dir,
            max,
            state: Mutex::new(PoolState {
                free,
                next,
                ..PoolState::default()
            }),
            recycled: Condvar::new(),
            filler: Condvar::new(),
            recycler: Mutex::new(()),
            exposed: None,
        })
    }

    /// From now on, while `flag` is set (the kernel passes file I/O through to bodies), a
    /// body a file used is removed rather than pooled: see `exposed`.
    pub fn never_reuse_while(mut self, flag: Arc<AtomicBool>) -> BodyPool {
        self.exposed = Some(flag);
        self
    }

    /// Whether the body file `id` used may go to another file (see `exposed`); forgets it.
    fn reusable(&self, st: &mut PoolState, id: u64) -> bool {
        let safe = st.safe.remove(&id);
        safe || !self
            .exposed
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The body of `id` is handed to the kernel with a readable handle: a process may map
    /// it, so it is never reused for another file (see `exposed`).
    pub fn expose(&self, id: u64) {
        self.lock().safe.remove(&id);
    }

    /// `id` has a body from this pool, not handed to the kernel yet.
    fn handed_out(st: &mut PoolState, id: u64) {
        if st.safe.len() < SAFE_MAX {
            st.safe.insert(id);
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot(&self, n: u64) -> PathBuf {
        self.dir.join(n.to_string())
    }

    /// Pooled files ready for reuse.
    pub fn len(&self) -> usize {
        self.lock().free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An empty body for `id`: its own held or stale body if it has one, else a pooled file,
    /// else a new file.
    pub fn create(&self, id: u64) -> io::Result<File> {
        let pooled = {
            let mut st = self.lock();
            while st.recycling == Some(id) {
                st.waiting += 1;
                st = self.recycled.wait(st).unwrap_or_else(|p| p.into_inner());
                st.waiting -= 1;
            }
            // Its own body, not recycled yet.
            let own = st.held.remove(&id) | st.released.remove(&id);
            if own {
                None
            } else {
                Self::handed_out(&mut st, id);
                self.pop_free(&mut st)
            }
        };
        if let Some(n) = pooled {
            match sys::file::rename_noreplace(&self.slot(n), &self.store.path(id)) {
                Ok(()) => {}
                // Gone from the pool directory: a new file it is.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                // A stale body holds the name (EEXIST), or the rename failed: keep the
                // pooled file and open what is there.
                Err(_) => self.lock().free.push(n),
            }
        }
        let f = self.store.open_rw(id)?;
        // A stale or own body, or a pooled one whose truncate a crash kept off the disk.
        // Truncating an empty file is not free on ext4: it makes the next close flush it.
        if f.metadata()?.len() != 0 {
            f.set_len(0)?;
        }
        Ok(f)
    }

    /// Keeps the body of `id` at its name until `release_held` (its file went back inline).
    pub fn hold(&self, id: u64) {
        self.lock().held.insert(id);
    }

    /// An empty body for `id` that need not be at its name yet: a pooled file under its
    /// slot name ([`Fresh::Slot`]; [`BodyPool::name_slot`] moves it to `id` once the store
    /// is about to say the file has a body, [`BodyPool::give_back`] returns it unrenamed
    /// if the file goes back inline), or, when `id` has a held body of its own or the pool
    /// is empty, what [`BodyPool::create`] gives.
    pub fn take(&self, id: u64) -> io::Result<Fresh> {
        self.take_stat(id).map(|(f, _)| f)
    }

    /// [`BodyPool::take`], with the slot's metadata as it hands the file out when it
    /// looked at it anyway (a slot found empty): a caller that needs the body's times
    /// need not ask again.
    pub fn take_stat(&self, id: u64) -> io::Result<(Fresh, Option<std::fs::Metadata>)> {
        let slot = {
            let mut st = self.lock();
            let own =
                st.held.contains(&id) || st.released.contains(&id) || st.recycling == Some(id);
            if own {
                None
            } else {
                let n = self.pop_free(&mut st);
                if n.is_some() {
                    Self::handed_out(&mut st, id);
                }
                n
            }
        };
        if let Some(n) = slot {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(self.slot(n))
            {
                Ok(f) => {
                    // A crash may have left bytes in it (see `create`).
                    let m = f.metadata()?;
                    if m.len() != 0 {
                        f.set_len(0)?;
                        return Ok((Fresh::Slot(n, f), None));
                    }
                    return Ok((Fresh::Slot(n, f), Some(m)));
                }
                // Gone from the pool directory: a new body it is.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    self.lock().free.push(n);
                    return Err(e);
                }
            }
        }
        Ok((Fresh::Named(self.create(id)?), None))
    }

    /// Moves a taken slot to the name of `id`. Whatever is at that name is stale (the store
    /// never said `id` had a body): it is replaced.
    pub fn name_slot(&self, slot: u64, id: u64) -> io::Result<()> {
        std::fs::rename(self.slot(slot), self.store.path(id))
    }

    /// Returns a slot taken for `id` that was never named: emptied off the request path
    /// (`recycle_released`), then free again, or removed (see `exposed`).
    pub fn give_back(&self, slot: u64, id: u64) {
        let mut st = self.lock();
        let reuse = self.reusable(&mut st, id);
        st.returned.push((slot, reuse));
    }

    /// The metadata that made the held bodies' files inline is committed: they may go to
    /// the pool (`recycle_released`). Returns whether there are any.
    pub fn release_held(&self) -> bool {
        let mut st = self.lock();
        let held = std::mem::take(&mut st.held);
        st.released.extend(held);
        !st.released.is_empty()
    }

    /// Gives the released bodies to the pool, off the request path. `create` waits for a
    /// body being recycled, so it either takes its body back before or finds it gone after.
    /// Slots given back unrenamed are emptied here too. Calls run one at a time, so when one
    /// returns, every body released before it began is in the pool, including those a
    /// concurrent call (the committer's, while `shutdown` calls) was still moving.
    pub fn recycle_released(&self) {
        let _one = self.recycler.lock().unwrap_or_else(|p| p.into_inner());
        let returned = std::mem::take(&mut self.lock().returned);
        for (n, reusable) in returned {
            if !reusable {
                if let Err(e) = std::fs::remove_file(self.slot(n)) {
                    if e.kind() != io::ErrorKind::NotFound {
                        tracing::warn!(slot = n, error = %e, "cannot remove a used pool file");
                    }
                }
                continue;
            }
            let emptied = OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(self.slot(n))
                .and_then(|f| {
                    if f.metadata()?.len() != 0 {
                        f.set_len(0)?;
                    }
                    Ok(())
                });
            match emptied {
                Ok(()) => self.lock().free.push(n),
                Err(e) => tracing::warn!(slot = n, error = %e, "cannot empty a pooled body"),
            }
        }
        loop {
            let (id, slot) = {
                let mut st = self.lock();
                let Some(&id) = st.released.iter().next() else {
                    return;
                };
                st.released.remove(&id);
                st.recycling = Some(id);
                let reuse = self.reusable(&mut st, id);
                (id, self.reserve_slot(&mut st).filter(|_| reuse))
            };
            let r = self.empty_into(id, slot);
            let mut st = self.lock();
            st.recycling = None;
            match r {
                Ok(true) => st.free.extend(slot),
                Ok(false) => {}
                Err(e) => tracing::warn!(id, error = %e, "cannot recycle a body file"),
            }
            if st.waiting > 0 {
                self.recycled.notify_all();
            }
        }
    }

    /// Forgets the held bodies without touching them: the commit that made their files
    /// inline was lost, so the bodies are what the store still points at.
    pub fn keep_held(&self) {
        self.lock().held.clear();
    }

    /// Empties the body of a deleted file into the pool, or removes it when the pool is
    /// full. A missing body is not an error.
    pub fn recycle(&self, id: u64) -> io::Result<()> {
        let slot = {
            let mut st = self.lock();
            let reuse = self.reusable(&mut st, id);
            self.reserve_slot(&mut st).filter(|_| reuse)
        };
        if self.empty_into(id, slot)? {
            self.lock().free.extend(slot);
        }
        Ok(())
    }

    /// A free pooled file, if any; wakes the filler when that leaves the pool low.
    fn pop_free(&self, st: &mut PoolState) -> Option<u64> {
        let n = st.free.pop();
        self.ask_fill(st);
        n
    }

    /// Wakes the filler when the pool runs low (once until it has filled it).
    fn ask_fill(&self, st: &mut PoolState) {
        if st.free.len() < POOL_LOW.min(self.max) && !st.fill_asked {
            st.fill_asked = true;
            self.filler.notify_one();
        }
    }

    /// The filler: until `stop_filler`, waits for the pool to run low and then creates
    /// empty files in it up to `POOL_FILL`. A new body costs ext4 an inode allocation,
    /// which without a journal scans past every inode freed in the last seconds
    /// (`recently_deleted`: ~250 µs a file after a `rm -rf` here, against a rename or an
    /// open for a pooled one), so new files are made here, off the request path, and
    /// `take` finds one ready. Run it on a thread of its own, at a low priority.
    pub fn run_filler(&self) {
        let mut st = self.lock();
        loop {
            while !st.fill_asked && !st.fill_stop {
                st = self.filler.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            if st.fill_stop {
                return;
            }
            drop(st);
            let filled = self.fill(POOL_FILL);
            if let Err(e) = &filled {
                tracing::warn!(error = %e, "cannot add empty files to the body pool");
            }
            st = self.lock();
            st.fill_asked = false;
            // A take between `fill`'s last look and this lock found `fill_asked` still set
            // and asked for nothing: look again, or the pool would stay low until the next
            // take. Not after a failure: the next take asks again, and a full disk would
            // otherwise keep this thread failing in a loop.
            if filled.is_ok() {
                self.ask_fill(&mut st);
            }
        }
    }

    /// Asks the filler to top the pool up if it is low (as taking a file does).
    pub fn request_fill(&self) {
        self.ask_fill(&mut self.lock());
    }

    /// Ends `run_filler` (after the file it is making, if any).
    pub fn stop_filler(&self) {
        self.lock().fill_stop = true;
        self.filler.notify_all();
    }

    /// Creates empty files in the pool until it holds `want` free ones (at most its
    /// maximum) or the filler is stopped; returns how many it made.
    pub fn fill(&self, want: usize) -> io::Result<usize> {
        let mut made = 0;
        loop {
            let n = {
                let mut st = self.lock();
                if st.fill_stop || st.free.len() >= want.min(self.max) {
                    return Ok(made);
                }
                st.next += 1;
                st.next - 1
            };
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC)
                .open(self.slot(n))?;
            self.lock().free.push(n);
            made += 1;
        }
    }

    /// A pool slot for one more file, or `None` when the pool is full.
    fn reserve_slot(&self, st: &mut PoolState) -> Option<u64> {
        (st.free.len() < self.max).then(|| {
            st.next += 1;
            st.next - 1
        })
    }

    /// Moves the body of `id`, emptied, to pool slot `slot` (or removes it without a slot).
    /// Returns whether the slot now holds a file.
    fn empty_into(&self, id: u64, slot: Option<u64>) -> io::Result<bool> {
        let Some(n) = slot else {
            return self.store.remove(id).map(|()| false);
        };
        let path = self.store.path(id);
        match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            // Emptied before it is closed: ext4 flushes a file truncated to zero at its
            // close, which costs nothing now that it has no data left.
            Ok(f) => {
                if f.metadata()?.len() != 0 {
                    f.set_len(0)?;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        }
        match std::fs::rename(&path, self.slot(n)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};

    fn setup(max: usize) -> (tempfile::TempDir, BodyStore, BodyPool) {
        let dir = tempfile::tempdir().unwrap();
        let store = BodyStore::open(&dir.path().join("store")).unwrap();
        let pool = BodyPool::open_with_max(&store, max).unwrap();
        (dir, store, pool)
    }

    fn body_with(pool: &BodyPool, id: u64, bytes: &[u8]) -> u64 {
        let f = pool.create(id).unwrap();
        f.write_all_at(bytes, 0).unwrap();
        f.metadata().unwrap().ino()
    }

    #[test]
    fn a_recycled_body_is_emptied_and_becomes_the_next_new_body() {
        let (_d, store, pool) = setup(8);
        let inode = body_with(&pool, 1, b"old bytes");
        pool.recycle(1).unwrap();
        assert!(store.stat(1).unwrap().is_none(), "moved out of its name");
        assert_eq!(pool.len(), 1);
        let f = pool.create(2).unwrap();
        let m = f.metadata().unwrap();
        assert_eq!((m.ino(), m.len()), (inode, 0), "same file, emptied");
        assert!(pool.is_empty());
        assert_eq!(store.ids().unwrap(), vec![2], "the pool is not a body");
    }

    /// While bodies are handed to the kernel (passthrough), a body handed over readable
    /// (`expose`) never goes back to the pool: a deleted file's, a released (gone inline)
    /// one's, a slot given back. One only ever handed over write-only (no mapping can hold
    /// it) is reused, as every body is without passthrough; so is none whose history the
    /// pool does not know (a body from before this run).
    #[test]
    fn exposed_bodies_are_removed_not_pooled() {
        let (_d, store, pool) = setup(8);
        let flag = Arc::new(AtomicBool::new(true));
        let pool = pool.never_reuse_while(flag.clone());
        body_with(&pool, 1, b"old bytes");
        pool.expose(1);
        pool.recycle(1).unwrap();
        assert!(store.stat(1).unwrap().is_none());
        assert!(
            pool.is_empty(),
            "a deleted file's exposed body is not pooled"
        );
        body_with(&pool, 2, b"inline again");
        pool.expose(2);
        pool.hold(2);
        assert!(pool.release_held());
        pool.recycle_released();
        assert!(store.stat(2).unwrap().is_none() && pool.is_empty());
        pool.fill(1).unwrap();
        let Fresh::Slot(n, _f) = pool.take(3).unwrap() else {
            panic!("a pooled slot");
        };
        pool.expose(3);
        pool.give_back(n, 3);
        pool.recycle_released();
        assert!(pool.is_empty(), "an exposed slot given back is not pooled");
        // Handed over write-only only: reused.
        pool.fill(1).unwrap();
        let Fresh::Slot(n, _f) = pool.take(4).unwrap() else {
            panic!("a pooled slot");
        };
        pool.give_back(n, 4);
        pool.recycle_released();
        assert_eq!(pool.len(), 1, "a write-only slot goes back to the pool");
        body_with(&pool, 5, b"written");
        assert!(pool.is_empty(), "it became this body");
        pool.recycle(5).unwrap();
        assert_eq!(pool.len(), 1, "and a write-only body of a deleted file");
        // A body the pool did not hand out (from before this run): removed.
        std::fs::create_dir_all(store.path(6).parent().unwrap()).unwrap();
        std::fs::write(store.path(6), b"older").unwrap();
        pool.recycle(6).unwrap();
        assert_eq!(pool.len(), 1);
        // Without passthrough every body is reused.
        flag.store(false, std::sync::atomic::Ordering::Relaxed);
        std::fs::create_dir_all(store.path(7).parent().unwrap()).unwrap();
        std::fs::write(store.path(7), b"older").unwrap();
        pool.recycle(7).unwrap();
        assert_eq!(pool.len(), 2);
    }

    #[test]
    fn a_held_body_keeps_its_name_until_recycled_and_can_be_taken_back() {
        let (_d, store, pool) = setup(8);
        let inode = body_with(&pool, 5, b"abc");
        pool.hold(5);
        assert_eq!(store.stat(5).unwrap().map(|s| s.0), Some(3));
        // The file needs a body again before the commit: it gets its own, emptied.
        let f = pool.create(5).unwrap();
        assert_eq!(
            (f.metadata().unwrap().ino(), f.metadata().unwrap().len()),
            (inode, 0)
        );
        assert!(!pool.release_held(), "taken back, so nothing to recycle");
        pool.recycle_released();
        assert!(store.stat(5).unwrap().is_some());
        pool.hold(5);
        assert!(pool.release_held());
        // Taken back between the commit and the recycling: stays too.
        let f = pool.create(5).unwrap();
        f.write_all_at(b"live", 0).unwrap();
        pool.recycle_released();
        assert_eq!(store.stat(5).unwrap().map(|s| s.0), Some(4));
        pool.hold(5);
        pool.release_held();
        pool.recycle_released();
        assert!(store.stat(5).unwrap().is_none());
        assert_eq!(pool.len(), 1);
    }

    #[test]
    fn a_second_recycler_returns_only_after_the_one_in_flight() {
        let (_d, store, pool) = setup(8);
        let pool = std::sync::Arc::new(pool);
        body_with(&pool, 3, b"abc");
        pool.hold(3);
        pool.release_held();
        // A call in flight (the committer's) holds the recycler; this one (shutdown's)
        // must wait for it rather than find nothing to do and return.
        let in_flight = pool.recycler.lock().unwrap();
        let second = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.recycle_released())
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            !second.is_finished(),
            "returned while another call was recycling"
        );
        drop(in_flight);
        second.join().unwrap();
        assert!(store.stat(3).unwrap().is_none(), "moved out of its name");
        assert_eq!(pool.len(), 1);
    }

    #[test]
    fn kept_bodies_stay_where_the_store_points() {
        let (_d, store, pool) = setup(8);
        body_with(&pool, 7, b"still mine");
        pool.hold(7);
        pool.keep_held();
        assert!(!pool.release_held());
        pool.recycle_released();
        assert_eq!(store.stat(7).unwrap().map(|s| s.0), Some(10));
    }

    #[test]
    fn fill_makes_empty_slots_up_to_the_pool_maximum() {
        let (dir, _store, pool) = setup(8);
        assert_eq!(pool.fill(5).unwrap(), 5);
        assert_eq!(pool.len(), 5);
        assert_eq!(pool.fill(100).unwrap(), 3, "never past the maximum");
        let files: Vec<_> = std::fs::read_dir(dir.path().join("store/pool"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .collect();
        assert_eq!(files, vec![0; 8], "eight empty files in the pool directory");
        // A taken slot is one of them, and reopening the pool adopts the rest.
        assert!(matches!(pool.take(1).unwrap(), Fresh::Slot(..)));
        drop(pool);
        let store = BodyStore::open(&dir.path().join("store")).unwrap();
        assert_eq!(BodyPool::open_with_max(&store, 8).unwrap().len(), 8);
    }

    #[test]
    fn the_filler_tops_up_a_low_pool_until_stopped() {
        let (_dir, _store, pool) = setup(POOL_MAX);
        // Taking from an empty pool makes a new body and asks for more; the ask is kept
        // for a filler that starts after it. (Taken before the filler runs: a take racing
        // a fill that has just finished would leave 255, which is right but not testable.)
        assert!(matches!(pool.take(1).unwrap(), Fresh::Named(_)));
        let pool = std::sync::Arc::new(pool);
        let filling = pool.clone();
        let filler = std::thread::spawn(move || filling.run_filler());
        // Full and the filler idle (it clears its ask only after `fill` returned): a take
        // while it still looks would make it add one more. The bound is for a filler that
        // never runs, not a speed.
        let filled = |pool: &BodyPool| {
            let t0 = std::time::Instant::now();
            loop {
                let st = pool.lock();
                if (st.free.len() == POOL_FILL && !st.fill_asked)
                    || t0.elapsed() > std::time::Duration::from_secs(120)
                {
                    return st.free.len();
                }
                drop(st);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        assert_eq!(filled(&pool), POOL_FILL);
        // Above the low mark a take asks for nothing; the filler stays asleep.
        for id in 2..(2 + (POOL_FILL - POOL_LOW) as u64) {
            assert!(matches!(pool.take(id).unwrap(), Fresh::Slot(..)));
        }
        assert_eq!(pool.len(), POOL_LOW);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(pool.len(), POOL_LOW);
        // One more take leaves it low: the filler tops it up again.
        assert!(matches!(pool.take(1000).unwrap(), Fresh::Slot(..)));
        assert_eq!(filled(&pool), POOL_FILL);
        pool.stop_filler();
        filler.join().unwrap();
    }

    #[test]
    fn a_full_pool_removes_and_a_missing_body_is_no_error() {
        let (_d, store, pool) = setup(1);
        body_with(&pool, 1, b"a");
        body_with(&pool, 2, b"b");
        pool.recycle(1).unwrap();
        pool.recycle(2).unwrap();
        assert_eq!(pool.len(), 1);
        assert!(store.ids().unwrap().is_empty());
        pool.recycle(3).unwrap();
        assert_eq!(pool.len(), 1);
    }

    #[test]
    fn the_pool_outlives_the_process_and_stale_bytes_are_dropped() {
        let (d, store, pool) = setup(8);
        body_with(&pool, 1, b"x");
        pool.recycle(1).unwrap();
        drop(pool);
        // A crash may leave bytes in a pooled file: the create that takes it empties it.
        let slot = d.path().join("store/pool/0");
        std::fs::write(&slot, b"left over").unwrap();
        let pool = BodyPool::open_with_max(&store, 8).unwrap();
        assert_eq!(pool.len(), 1);
        let f = pool.create(9).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 0);
        assert!(!slot.exists());
    }

    #[test]
    fn a_stale_body_under_the_name_is_reused_and_the_pooled_file_kept() {
        let (_d, store, pool) = setup(8);
        body_with(&pool, 1, b"x");
        pool.recycle(1).unwrap();
        std::fs::write(store.path(4), b"stale").unwrap();
        let f = pool.create(4).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 0);
        assert_eq!(pool.len(), 1);
    }
}

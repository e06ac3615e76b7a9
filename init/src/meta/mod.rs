//! The inode store: every inode, directory entry, xattr and inline file body of a workspace in
//! one SQLite database (WAL, `synchronous=NORMAL`). One short transaction per mutating
//! operation; `sync` makes everything committed so far durable. Nothing outside this module
//! touches rusqlite. This module imports no sibling module.
//!
//! Group commit (the filesystem's connection only, see [`Store::enable_group_commit`]): one
//! write transaction stays open across many operations, each of which is a SAVEPOINT inside
//! it, so an operation is wholly in or wholly out, and a crash loses at most a suffix of the
//! operations since the last commit. The owner commits the group when it is due (age, count,
//! or a writer on another connection of this process waiting for the lock); `sync`,
//! `checkpoint` and `read_view` commit it first.

mod bulk;
mod generation;
mod host;
mod lazy;
mod persist;
mod schema;

pub use bulk::{amend_bulk, create_bulk, Amender, BulkWriter};
pub use generation::Generations;
pub use host::{HostRow, PROVIDER_KEY, TREE_KEY};
pub use lazy::MissingRow;
pub use persist::{ChangeCounts, ChunkRow, Xattrs, ROLLBACK_RENAMES, ROLLBACK_TMP};

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, Connection, OptionalExtension};

/// An inode number, stable from create until the inode is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InodeNo(pub u64);

impl InodeNo {
    pub const ROOT: InodeNo = InodeNo(1);
}

/// A timestamp in nanoseconds since the Unix epoch (negative before 1970).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Nanos(pub i64);

impl Nanos {
    /// Now (`crate::time::now_ns`).
    pub fn now() -> Nanos {
        Nanos(crate::time::now_ns())
    }
}

/// What kind of file an inode is. Stored as the `S_IFMT` bits of the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

impl Kind {
    pub fn from_mode(mode: u32) -> Option<Kind> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => Kind::File,
            libc::S_IFDIR => Kind::Dir,
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFIFO => Kind::Fifo,
            libc::S_IFSOCK => Kind::Socket,
            libc::S_IFCHR => Kind::CharDev,
            libc::S_IFBLK => Kind::BlockDev,
            _ => return None,
        })
    }

    pub fn mode_bits(self) -> u32 {
        match self {
            Kind::File => libc::S_IFREG,
            Kind::Dir => libc::S_IFDIR,
            Kind::Symlink => libc::S_IFLNK,
            Kind::Fifo => libc::S_IFIFO,
            Kind::Socket => libc::S_IFSOCK,
            Kind::CharDev => libc::S_IFCHR,
            Kind::BlockDev => libc::S_IFBLK,
        }
    }
}

/// Where a regular file's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// In the `inline_data` table (small files).
    Inline,
    /// In a body file under the state dir, named after the inode.
    Body,
}

/// One inode's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inode {
    pub ino: InodeNo,
    pub kind: Kind,
    /// Permission bits incl. setuid/setgid/sticky (no `S_IFMT`).
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime: Nanos,
    pub mtime: Nanos,
    pub ctime: Nanos,
    pub rdev: u32,
    /// Parent directory (directories only; used for `..` and the rename-into-self check).
    pub parent: InodeNo,
    pub storage: Storage,
}

#[cfg(test)]
impl Inode {
    /// A file for tests, not inserted yet: mode 0644, root's, one link, every time 1 ns,
    /// under the root.
    pub fn test_file(size: u64, storage: Storage) -> Inode {
        Inode {
            ino: InodeNo(0),
            kind: Kind::File,
            perm: 0o644,
            uid: 0,
            gid: 0,
            nlink: 1,
            size,
            atime: Nanos(1),
            mtime: Nanos(1),
            ctime: Nanos(1),
            rdev: 0,
            parent: InodeNo::ROOT,
            storage,
        }
    }
}

/// A directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirent {
    pub name: Vec<u8>,
    pub ino: InodeNo,
    pub kind: Kind,
}

#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("open database {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error("{path} is not a keel state database: {reason}")]
    Foreign { path: String, reason: String },
    #[error("database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("make database {path} private (0600): {source}")]
    Private {
        path: String,
        source: std::io::Error,
    },
    #[error("stat database {path}: {source}")]
    Stat {
        path: String,
        source: std::io::Error,
    },
    #[error("corrupt row for inode {0}: {1}")]
    Corrupt(u64, String),
    #[error("bulk restore into {path}: {reason}")]
    Bulk { path: String, reason: String },
}

impl MetaError {
    /// True when the failure is the disk being full (SQLITE_FULL).
    pub fn is_full(&self) -> bool {
        matches!(self, MetaError::Sql(rusqlite::Error::SqliteFailure(e, _))
            if e.code == rusqlite::ErrorCode::DiskFull)
            || matches!(self, MetaError::Sql(rusqlite::Error::SqliteFailure(e, _))
            if e.extended_code == rusqlite::ffi::SQLITE_IOERR_WRITE)
    }
}

pub type Result<T> = std::result::Result<T, MetaError>;

/// The open database. Not `Sync`: callers serialise access (the workspace holds it under a
/// mutex).
pub struct Store {
    conn: Connection,
    group: Option<Group>,
    dirs: Arc<DirCache>,
    /// Writers of this database file waiting, on every connection of this process.
    waiting: Arc<Waiting>,
}

/// Directory inodes as this store's connection sees them (its open group included), for
/// reading without the lock that serialises the store: `getattr` of a directory is the
/// request that follows every create, unlink and rename in it (the kernel refetches the
/// directory's attributes for the next permission check). Filled by the store's owner
/// with what it read, and brought up to date by every transaction of this connection when
/// it commits; emptied when SQLite rolls an open group back.
#[derive(Default)]
pub struct DirCache {
    map: Mutex<HashMap<InodeNo, Inode>>,
}

/// Entries kept at most (the cache starts over when full).
const DIR_CACHE_MAX: usize = 1 << 16;

impl DirCache {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<InodeNo, Inode>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, ino: InodeNo) -> Option<Inode> {
        self.map().get(&ino).cloned()
    }

    /// Remembers a directory as read from the store. The caller must hold what serialises
    /// the store, so no transaction commits between its read and this call.
    pub fn put(&self, inode: &Inode) {
        if inode.kind != Kind::Dir {
            return;
        }
        let mut m = self.map();
        if m.len() >= DIR_CACHE_MAX {
            m.clear();
        }
        m.insert(inode.ino, inode.clone());
    }

    fn apply(&self, changes: Vec<(InodeNo, Option<Inode>)>) {
        if changes.is_empty() {
            return;
        }
        let mut m = self.map();
        for (ino, now) in changes {
            match now {
                // Only entries already cached are refreshed: `put` decides what is kept.
                Some(inode) => {
                    if let Some(e) = m.get_mut(&ino) {
                        *e = inode;
                    }
                }
                None => {
                    m.remove(&ino);
                }
            }
        }
    }

    fn clear(&self) {
        self.map().clear();
    }
}

/// SQL statements this process's stores started (`Counted::counted`), for the counters
/// `keel mount` logs on SIGUSR1: a benchmark divides them by the FUSE requests served.
static STATEMENTS: AtomicU64 = AtomicU64::new(0);

/// SQL statements started so far through the stores' statement cache (every operation's
/// statements go through it; a group's BEGIN and COMMIT do not).
pub fn statements_run() -> u64 {
    STATEMENTS.load(Ordering::Relaxed)
}

/// `prepare_cached`, counted in [`statements_run`].
pub(crate) trait Counted {
    fn counted(&self, sql: &str) -> rusqlite::Result<rusqlite::CachedStatement<'_>>;
}

impl Counted for Connection {
    fn counted(&self, sql: &str) -> rusqlite::Result<rusqlite::CachedStatement<'_>> {
        STATEMENTS.fetch_add(1, Ordering::Relaxed);
        self.prepare_cached(sql)
    }
}

/// Ceiling of SQLite's page cache per connection, KiB (`[workspace] meta_cache`, else the
/// memory budget's `fs_cache` share; until set, that of the default budget).
static CACHE_KIB: AtomicU32 = AtomicU32::new(0);

/// Sets the page cache ceiling of every connection opened from now on in this process (and
/// caps `limit_cache`). Set once, before the workspace opens its store.
pub fn set_cache_ceiling(bytes: u64) {
    let kib = (bytes / 1024).clamp(1024, u64::from(u32::MAX)) as u32;
    CACHE_KIB.store(kib, Ordering::SeqCst);
}

fn cache_ceiling_kib() -> u32 {
    match CACHE_KIB.load(Ordering::SeqCst) {
        0 => (crate::budget::shares().fs_cache / 1024) as u32,
        kib => kib,
    }
}

/// Writers on connections without group commit that are waiting to start a transaction on
/// one database file, in this process: a grouping store of that file commits its open group
/// as soon as it sees one, and stops grouping until they are through. One counter per file
/// (its device and inode), shared by every `Store` open on it: a writer on another database
/// (a fork's, a restore's, a parallel test's) has no lock to wait for here.
#[derive(Default)]
struct Waiting(AtomicUsize);

/// A database file: its device and inode.
type FileKey = (u64, u64);

/// The counters of the database files open in this process.
static WAITING: Mutex<Vec<(FileKey, std::sync::Weak<Waiting>)>> = Mutex::new(Vec::new());

impl Waiting {
    /// The counter of the database file at `path` (created with the file's first store).
    fn of(path: &Path) -> std::io::Result<Arc<Waiting>> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)?;
        let key = (m.dev(), m.ino());
        let mut all = WAITING.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|(_, w)| w.strong_count() > 0);
        if let Some(w) = all
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(w);
        }
        let w = Arc::new(Waiting::default());
        all.push((key, Arc::downgrade(&w)));
        Ok(w)
    }

    fn any(&self) -> bool {
        self.0.load(Ordering::SeqCst) > 0
    }
}

/// One writer waiting (`Waiting`), for as long as it lives.
struct WaitingWriter<'a>(&'a Waiting);

impl<'a> WaitingWriter<'a> {
    fn new(w: &'a Waiting) -> WaitingWriter<'a> {
        w.0.fetch_add(1, Ordering::SeqCst);
        WaitingWriter(w)
    }
}

impl Drop for WaitingWriter<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// State of group commit on a store that uses it.
struct Group {
    /// When the open group began (`None`: no group open).
    since: Cell<Option<Instant>>,
    /// Operations released into the open group.
    ops: Cell<u32>,
    /// An open group was found rolled back by SQLite after an error (not yet reported).
    lost: Cell<bool>,
    /// Called whenever a new group begins (the owner arms its commit timer).
    on_open: Box<dyn Fn() + Send>,
    /// One transaction per operation for now (e.g. the volume is nearly full).
    paused: Cell<bool>,
    /// Inodes whose `changed` row an operation released into the open group wrote: no
    /// other connection can claim it before the group commits, so the open group need not
    /// write it again (every create, unlink and close in a directory marked the directory
    /// once more). Emptied when a group begins or is lost.
    marked: RefCell<HashSet<InodeNo>>,
}

/// When a group commit is due.
#[derive(Debug, Clone, Copy)]
pub struct GroupLimits {
    pub max_age: Duration,
    pub max_ops: u32,
}

impl Store {
    /// Opens (creating when absent) the database at `path` and checks it is keel's.
    pub fn open(path: &Path, now: Nanos) -> Result<Store> {
        let p = path.display().to_string();
        let existed = make_private(path).map_err(|e| MetaError::Private {
            path: p.clone(),
            source: e,
        })?;
        let conn = Connection::open(path).map_err(|source| MetaError::Open {
            path: p.clone(),
            source,
        })?;
        schema::configure(&conn).map_err(|e| classify_open_error(&p, e))?;
        if existed {
            schema::check(&conn, &p)?;
        } else {
            schema::create(&conn, now)?;
        }
        lazy::ensure_schema(&conn)?;
        schema::ensure_totals(&conn)?;
        // Room for every statement keel prepares (about 60; rusqlite's default keeps 16, so
        // the per-operation ones were evicted and parsed again all the time).
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        let waiting = Waiting::of(path).map_err(|source| MetaError::Stat {
            path: p.clone(),
            source,
        })?;
        Ok(Store {
            conn,
            group: None,
            dirs: Arc::default(),
            waiting,
        })
    }

    /// Caps this connection's SQLite page cache at `kib` KiB (never above the ceiling,
    /// `set_cache_ceiling`, 32 MiB unless configured). A connection that reads the database once
    /// per pass, like the checkpointer's, gains little from more: its pages stay in the
    /// kernel's page cache anyway.
    pub fn limit_cache(&self, kib: u32) -> Result<()> {
        self.conn.execute_batch(&format!(
            "PRAGMA cache_size=-{}",
            kib.min(cache_ceiling_kib())
        ))?;
        Ok(())
    }

    /// The directory inodes readable without this store (see [`DirCache`]).
    pub fn dir_cache(&self) -> &Arc<DirCache> {
        &self.dirs
    }

    /// Turns on group commit for this connection (the filesystem's; never for a connection
    /// that only checkpoints or reads). `on_open` runs each time a new group begins.
    pub fn enable_group_commit(&mut self, on_open: Box<dyn Fn() + Send>) {
        self.group = Some(Group {
            since: Cell::new(None),
            ops: Cell::new(0),
            lost: Cell::new(false),
            on_open,
            paused: Cell::new(false),
            marked: RefCell::default(),
        });
    }

    /// Pauses group commit (each operation commits on its own, so a failing commit fails
    /// that operation alone) or resumes it. Takes effect at the next group.
    pub fn pause_group_commit(&self, paused: bool) {
        if let Some(g) = &self.group {
            g.paused.set(paused);
        }
    }

    /// Whether a group is open (uncommitted operations may be in it).
    pub fn group_open(&self) -> bool {
        self.group.as_ref().is_some_and(|g| g.since.get().is_some())
    }

    /// Whether the open group should be committed now.
    pub fn group_due(&self, limits: GroupLimits) -> bool {
        let Some(g) = &self.group else {
            return false;
        };
        let Some(since) = g.since.get() else {
            return false;
        };
        g.ops.get() >= limits.max_ops || since.elapsed() >= limits.max_age || self.waiting.any()
    }

    /// How long until the open group reaches `max_age` (`None`: no group open).
    pub fn group_due_in(&self, max_age: Duration) -> Option<Duration> {
        let since = self.group.as_ref()?.since.get()?;
        Some(max_age.saturating_sub(since.elapsed()))
    }

    /// True once after SQLite rolled back an open group because of an error (a full disk):
    /// every operation of that group is gone, so the owner must forget what it assumed
    /// committed.
    pub fn take_group_lost(&self) -> bool {
        self.group.as_ref().is_some_and(|g| g.lost.replace(false))
    }

    /// Commits the open group, if any. On failure the group stays open when SQLite kept the
    /// transaction (retry later), or is reported lost (`take_group_lost`).
    pub fn commit_group(&self) -> Result<()> {
        let Some(g) = &self.group else {
            return Ok(());
        };
        if g.since.get().is_none() {
            return Ok(());
        }
        match self.conn.execute_batch("COMMIT") {
            Ok(()) => {
                g.since.set(None);
                g.ops.set(0);
                Ok(())
            }
            Err(e) => {
                self.note_if_lost();
                Err(e.into())
            }
        }
    }

    /// After an error inside a group: if SQLite rolled the whole transaction back, the group
    /// is gone.
    fn note_if_lost(&self) {
        if let Some(g) = &self.group {
            group_gone(&self.conn, g, &self.dirs);
        }
    }

    /// A read-only view (each statement in its own implicit transaction).
    pub fn read(&self) -> Tx<'_> {
        Tx {
            conn: &self.conn,
            open: false,
            group: None,
            dirs: &self.dirs,
            changes: RefCell::default(),
            marked: RefCell::default(),
        }
    }

    /// Starts a write transaction; it rolls back unless `commit` is called. With group
    /// commit on, it is a savepoint in the open group (which it begins when none is open).
    pub fn write(&self) -> Result<Tx<'_>> {
        if let Some(g) = &self.group {
            let open = g.since.get().is_some();
            if open || (!g.paused.get() && !self.waiting.any()) {
                if !open {
                    self.conn.execute_batch("BEGIN IMMEDIATE")?;
                    g.marked.borrow_mut().clear();
                    g.since.set(Some(Instant::now()));
                    g.ops.set(0);
                    (g.on_open)();
                }
                if let Err(e) = run_cached(&self.conn, "SAVEPOINT op") {
                    self.note_if_lost();
                    return Err(e.into());
                }
                return Ok(Tx {
                    conn: &self.conn,
                    open: true,
                    group: Some(g),
                    dirs: &self.dirs,
                    changes: RefCell::default(),
                    marked: RefCell::default(),
                });
            }
            // Paused, or another connection wants the lock: one transaction per operation.
            return self.write_plain();
        }
        let _waiting = WaitingWriter::new(&self.waiting);
        self.write_plain()
    }

    /// A transaction of its own, never part of a group.
    fn write_plain(&self) -> Result<Tx<'_>> {
        self.conn.execute_batch("BEGIN IMMEDIATE")?;
        Ok(Tx {
            conn: &self.conn,
            open: true,
            group: None,
            dirs: &self.dirs,
            changes: RefCell::default(),
            marked: RefCell::default(),
        })
    }

    /// Makes every committed transaction durable (fsync of the WAL), committing the open
    /// group first.
    pub fn sync(&self) -> Result<()> {
        self.commit_group()?;
        self.conn.execute_batch("PRAGMA synchronous=FULL")?;
        let r = (|| -> Result<()> {
            let tx = if self.group.is_some() {
                self.write_plain()?
            } else {
                self.write()?
            };
            tx.conn
                .counted("UPDATE meta SET value = value + 1 WHERE key = 'syncs'")?
                .execute([])?;
            tx.commit()
        })();
        self.conn.execute_batch("PRAGMA synchronous=NORMAL")?;
        r
    }

    /// Checkpoints the WAL into the main database file and truncates it (clean shutdown).
    pub fn checkpoint(&self) -> Result<()> {
        self.commit_group()?;
        self.conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok(())
    }

    /// Runs SQLite's own consistency check; returns the problems it found.
    pub fn integrity_check(&self) -> Result<Vec<String>> {
        let mut st = self.conn.prepare("PRAGMA integrity_check")?;
        let rows = st.query_map([], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for r in rows {
            let r = r?;
            if r != "ok" {
                out.push(r);
            }
        }
        Ok(out)
    }
}

/// Makes the database at `path` private before SQLite opens it: a new one is created empty
/// with mode 0600 (SQLite would make it 0644 minus the umask), and SQLite gives the `-wal`
/// and `-shm` files it creates the database file's mode; an existing database or WAL/SHM
/// with a looser mode (an older keel) is made 0600. Returns whether the database held
/// anything (an empty file is what this function left when the open that followed failed).
fn make_private(path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    const MODE: u32 = 0o600;
    let tighten = |p: &Path| -> std::io::Result<Option<u64>> {
        match std::fs::symlink_metadata(p) {
            Ok(m) => {
                if m.mode() & 0o7077 != 0 && m.file_type().is_file() {
                    std::fs::set_permissions(p, std::fs::Permissions::from_mode(MODE))?;
                }
                Ok(Some(m.len()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    };
    let db_len = match tighten(path)? {
        Some(n) => n,
        None => {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(MODE)
                .open(path)
            {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            0
        }
    };
    let mut wal_len = 0;
    for suffix in ["-wal", "-shm"] {
        let mut side = path.as_os_str().to_owned();
        side.push(suffix);
        let len = tighten(Path::new(&side))?;
        if suffix == "-wal" {
            wal_len = len.unwrap_or(0);
        }
    }
    Ok(db_len > 0 || wal_len > 0)
}

fn classify_open_error(path: &str, e: rusqlite::Error) -> MetaError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::NotADatabase => {
            MetaError::Foreign {
                path: path.to_string(),
                reason: "file is not a SQLite database".into(),
            }
        }
        _ => MetaError::Sql(e),
    }
}

/// A transaction (or, from `Store::read`, plain autocommit reads; or, with group commit, one
/// operation's savepoint in the open group).
pub struct Tx<'a> {
    conn: &'a Connection,
    open: bool,
    group: Option<&'a Group>,
    dirs: &'a DirCache,
    /// Inodes written by this transaction, for `dirs` once it commits (`None`: deleted, or
    /// not a directory).
    changes: RefCell<Vec<(InodeNo, Option<Inode>)>>,
    /// Inodes this savepoint of the group marked changed, for the group's `marked` once it
    /// is released (a savepoint rolled back takes its rows with it).
    marked: RefCell<Vec<InodeNo>>,
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if self.open {
            if let Some(g) = self.group {
                if self
                    .conn
                    .execute_batch("ROLLBACK TO op; RELEASE op")
                    .is_err()
                    || self.conn.is_autocommit()
                {
                    group_gone(self.conn, g, self.dirs);
                }
            } else {
                let _ = self.conn.execute_batch("ROLLBACK");
            }
        }
    }
}

/// Records that SQLite rolled back the open group (after an error): what the directory
/// cache learnt from its operations is gone too.
fn group_gone(conn: &Connection, g: &Group, dirs: &DirCache) {
    if g.since.get().is_some() && conn.is_autocommit() {
        g.since.set(None);
        g.ops.set(0);
        g.lost.set(true);
        g.marked.borrow_mut().clear();
        dirs.clear();
    }
}

/// `?1, ..., ?12` for the columns of `inode_cols!`. Macros rather than constants, so that
/// statements are `concat!`ed at compile time: `prepare_cached` runs on every operation, and
/// a `format!` there allocated and formatted its key each time.
macro_rules! inode_params {
    () => {
        "?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12"
    };
}
pub(crate) use inode_params;

/// An inode's values in `inode_cols!` order; `ino: None` binds NULL (a new number).
pub(crate) fn inode_row(ino: Option<InodeNo>, inode: &Inode) -> [Value; 12] {
    [
        ino.map_or(Value::Null, |i| Value::Integer(i.0 as i64)),
        Value::Integer(i64::from(inode.kind.mode_bits() | inode.perm)),
        Value::Integer(i64::from(inode.uid)),
        Value::Integer(i64::from(inode.gid)),
        Value::Integer(i64::from(inode.nlink)),
        Value::Integer(inode.size as i64),
        Value::Integer(inode.atime.0),
        Value::Integer(inode.mtime.0),
        Value::Integer(inode.ctime.0),
        Value::Integer(i64::from(inode.rdev)),
        Value::Integer(inode.parent.0 as i64),
        Value::Integer(storage_code(inode.storage)),
    ]
}

macro_rules! inode_cols {
    () => {
        "ino, mode, uid, gid, nlink, size, atime, mtime, ctime, rdev, parent, storage"
    };
}
pub(crate) use inode_cols;

fn row_to_inode(r: &rusqlite::Row<'_>) -> rusqlite::Result<(u64, u32, Inode)> {
    let ino: i64 = r.get(0)?;
    let mode: u32 = r.get(1)?;
    let storage: i64 = r.get(11)?;
    Ok((
        ino as u64,
        mode,
        Inode {
            ino: InodeNo(ino as u64),
            kind: Kind::File,
            perm: mode & 0o7777,
            uid: r.get(2)?,
            gid: r.get(3)?,
            nlink: r.get(4)?,
            size: r.get::<_, i64>(5)? as u64,
            atime: Nanos(r.get(6)?),
            mtime: Nanos(r.get(7)?),
            ctime: Nanos(r.get(8)?),
            rdev: r.get(9)?,
            parent: InodeNo(r.get::<_, i64>(10)? as u64),
            storage: if storage == 0 {
                Storage::Inline
            } else {
                Storage::Body
            },
        },
    ))
}

/// Prepared statements kept per connection.
const STATEMENT_CACHE: usize = 128;

/// A statement run on every operation (the group's savepoints): prepared once, not parsed
/// each time as `execute_batch` would.
fn run_cached(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.counted(sql)?.execute([]).map(|_| ())
}

fn finish_inode((ino, mode, mut inode): (u64, u32, Inode)) -> Result<Inode> {
    inode.kind = Kind::from_mode(mode)
        .ok_or_else(|| MetaError::Corrupt(ino, format!("bad mode {mode:o}")))?;
    Ok(inode)
}

impl Tx<'_> {
    pub fn commit(mut self) -> Result<()> {
        if let Some(g) = self.group {
            // The operation joins the group; it is committed with it.
            if let Err(e) = run_cached(self.conn, "RELEASE op") {
                return Err(e.into()); // Drop rolls the savepoint back.
            }
            self.open = false;
            g.ops.set(g.ops.get() + 1);
            g.marked.borrow_mut().extend(self.marked.take());
            self.dirs.apply(self.changes.take());
            return Ok(());
        }
        self.open = false;
        if let Err(e) = self.conn.execute_batch("COMMIT") {
            let _ = self.conn.execute_batch("ROLLBACK");
            return Err(e.into());
        }
        self.dirs.apply(self.changes.take());
        Ok(())
    }

    /// Notes an inode this transaction wrote, for the directory cache: a directory's new
    /// row, or `None` when the inode was deleted or its kind is unknown. A file written with
    /// its row is never cached (and inode numbers are never reused), so it is skipped: file
    /// writes are the hot path and take no cache lock.
    fn wrote(&self, ino: InodeNo, now: Option<&Inode>) {
        let now = match now {
            Some(i) if i.kind != Kind::Dir => return,
            Some(i) => Some(Inode { ino, ..i.clone() }),
            None => None,
        };
        self.changes.borrow_mut().push((ino, now));
    }

    pub fn get(&self, ino: InodeNo) -> Result<Option<Inode>> {
        let mut st = self.conn.counted(concat!(
            "SELECT ",
            inode_cols!(),
            " FROM inode WHERE ino = ?1"
        ))?;
        let row = st.query_row([ino.0 as i64], row_to_inode).optional()?;
        row.map(finish_inode).transpose()
    }

    /// Inserts a new inode and returns its number (`inode.ino` is ignored).
    pub fn insert(&self, inode: &Inode) -> Result<InodeNo> {
        // ino NULL: SQLite picks the next number (AUTOINCREMENT: never one used before).
        self.conn
            .counted(concat!(
                "INSERT INTO inode (",
                inode_cols!(),
                ") VALUES (",
                inode_params!(),
                ")"
            ))?
            .execute(params_from_iter(inode_row(None, inode)))?;
        let ino = InodeNo(self.conn.last_insert_rowid() as u64);
        self.mark_changed(ino)?;
        Ok(ino)
    }

    pub fn update(&self, inode: &Inode) -> Result<()> {
        self.conn
            .counted(
                "UPDATE inode SET mode=?2, uid=?3, gid=?4, nlink=?5, size=?6, atime=?7, mtime=?8,
                 ctime=?9, rdev=?10, parent=?11, storage=?12 WHERE ino=?1",
            )?
            .execute(params_from_iter(inode_row(Some(inode.ino), inode)))?;
        self.wrote(inode.ino, Some(inode));
        self.mark_changed(inode.ino)
    }

    /// Records that an inode's metadata, entries or xattrs changed since the last checkpoint.
    pub fn mark_changed(&self, ino: InodeNo) -> Result<()> {
        if let Some(g) = self.group {
            if g.marked.borrow().contains(&ino) {
                return Ok(());
            }
            self.marked.borrow_mut().push(ino);
        }
        self.conn
            .counted("INSERT OR IGNORE INTO changed (ino) VALUES (?1)")?
            .execute([ino.0 as i64])?;
        Ok(())
    }

    /// Records that chunk windows `idx` of a file body were written since the last checkpoint.
    pub fn mark_dirty_windows(
        &self,
        ino: InodeNo,
        idx: impl IntoIterator<Item = u64>,
    ) -> Result<()> {
        let mut st = self
            .conn
            .counted("INSERT OR IGNORE INTO dirty_window (ino, idx) VALUES (?1, ?2)")?;
        for i in idx {
            st.execute(params![ino.0 as i64, i as i64])?;
        }
        Ok(())
    }

    /// Deletes an inode with its xattrs, inline data and symlink target.
    pub fn delete(&self, ino: InodeNo) -> Result<()> {
        self.delete_known(ino, None, true)
    }

    /// Deletes an inode of a known kind (`None`: unknown), with only the rows an inode of
    /// that kind can have (inline bytes and dirty windows: regular files; a target:
    /// symlinks); its xattrs too unless the caller knows it has none. Each statement that
    /// finds nothing still costs an index search, and `rm` runs this once per file.
    pub fn delete_known(&self, ino: InodeNo, kind: Option<Kind>, xattrs: bool) -> Result<()> {
        let file = kind.is_none_or(|k| k == Kind::File);
        let symlink = kind.is_none_or(|k| k == Kind::Symlink);
        for (sql, needed) in [
            ("DELETE FROM inode WHERE ino = ?1", true),
            ("DELETE FROM xattr WHERE ino = ?1", xattrs),
            ("DELETE FROM inline_data WHERE ino = ?1", file),
            ("DELETE FROM symlink WHERE ino = ?1", symlink),
            ("DELETE FROM dirty_window WHERE ino = ?1", file),
        ] {
            if needed {
                self.conn.counted(sql)?.execute([ino.0 as i64])?;
            }
        }
        self.wrote(ino, None);
        self.mark_changed(ino)
    }

    pub fn lookup(&self, parent: InodeNo, name: &[u8]) -> Result<Option<Dirent>> {
        let mut st = self
            .conn
            .counted("SELECT ino, kind FROM dirent WHERE parent = ?1 AND name = ?2")?;
        let r = st
            .query_row(params![parent.0 as i64, name], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, u32>(1)?))
            })
            .optional()?;
        match r {
            None => Ok(None),
            Some((ino, kind)) => Ok(Some(Dirent {
                name: name.to_vec(),
                ino: InodeNo(ino as u64),
                kind: Kind::from_mode(kind)
                    .ok_or_else(|| MetaError::Corrupt(ino as u64, "bad dirent kind".into()))?,
            })),
        }
    }

    /// The inode entry `name` of `parent` points at, in one statement (`lookup`, then
    /// `get`, is two): a LOOKUP or an unlink of a name whose inode is not loaded needs both.
    /// `None` when there is no such entry (or, in a corrupt store, no row for its inode).
    pub fn lookup_inode(&self, parent: InodeNo, name: &[u8]) -> Result<Option<Inode>> {
        let mut st = self.conn.counted(
            "SELECT i.ino, i.mode, i.uid, i.gid, i.nlink, i.size, i.atime, i.mtime, i.ctime,
                    i.rdev, i.parent, i.storage
             FROM dirent d JOIN inode i ON i.ino = d.ino WHERE d.parent = ?1 AND d.name = ?2",
        )?;
        let row = st
            .query_row(params![parent.0 as i64, name], row_to_inode)
            .optional()?;
        row.map(finish_inode).transpose()
    }

    pub fn link(&self, parent: InodeNo, name: &[u8], ino: InodeNo, kind: Kind) -> Result<()> {
        self.conn
            .counted("INSERT INTO dirent (parent, name, ino, kind) VALUES (?1, ?2, ?3, ?4)")?
            .execute(params![
                parent.0 as i64,
                name,
                ino.0 as i64,
                kind.mode_bits()
            ])?;
        Ok(())
    }

    /// `link` of a name that must be new: false, and nothing inserted, when `parent`
    /// already has an entry `name` (the table's primary key is the check, so a create needs
    /// no `SELECT` of the name first and stays exact whoever wrote the entry). The caller
    /// drops the transaction then, which undoes what it did before.
    pub fn link_new(&self, parent: InodeNo, name: &[u8], ino: InodeNo, kind: Kind) -> Result<bool> {
        match self.link(parent, name, ino, kind) {
            Ok(()) => Ok(true),
            Err(MetaError::Sql(rusqlite::Error::SqliteFailure(e, _)))
                if e.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Points an existing entry at another inode (rename over, exchange).
    pub fn relink(&self, parent: InodeNo, name: &[u8], ino: InodeNo, kind: Kind) -> Result<()> {
        self.conn
            .counted("UPDATE dirent SET ino = ?3, kind = ?4 WHERE parent = ?1 AND name = ?2")?
            .execute(params![
                parent.0 as i64,
                name,
                ino.0 as i64,
                kind.mode_bits()
            ])?;
        Ok(())
    }

    pub fn unlink(&self, parent: InodeNo, name: &[u8]) -> Result<()> {
        self.conn
            .counted("DELETE FROM dirent WHERE parent = ?1 AND name = ?2")?
            .execute(params![parent.0 as i64, name])?;
        Ok(())
    }

    /// Every entry naming `ino`, as (parent, name) in key order. Indexed only once
    /// [`Tx::index_names`] ran (the change feed's paths); before, a scan of the entries.
    pub fn names_of(&self, ino: InodeNo) -> Result<Vec<(InodeNo, Vec<u8>)>> {
        let mut st = self
            .conn
            .counted("SELECT parent, name FROM dirent WHERE ino = ?1 ORDER BY parent, name")?;
        let v = st
            .query_map([ino.0 as i64], |r| {
                Ok((InodeNo(r.get::<_, i64>(0)? as u64), r.get::<_, Vec<u8>>(1)?))
            })?
            .collect::<rusqlite::Result<_>>()?;
        Ok(v)
    }

    /// Indexes the entries by the inode they name (for `names_of`), once: every insert and
    /// delete of an entry maintains it from then on. Built when the change feed starts
    /// recording, so a workspace nobody watches never pays for it.
    pub fn index_names(&self) -> Result<()> {
        self.conn
            .execute_batch("CREATE INDEX IF NOT EXISTS dirent_ino ON dirent(ino)")?;
        Ok(())
    }

    pub fn dir_is_empty(&self, dir: InodeNo) -> Result<bool> {
        let mut st = self
            .conn
            .counted("SELECT 1 FROM dirent WHERE parent = ?1 LIMIT 1")?;
        Ok(st
            .query_row([dir.0 as i64], |_| Ok(()))
            .optional()?
            .is_none())
    }

    /// All entries of a directory, in name order.
    pub fn list(&self, dir: InodeNo) -> Result<Vec<Dirent>> {
        let mut st = self
            .conn
            .counted("SELECT name, ino, kind FROM dirent WHERE parent = ?1 ORDER BY name")?;
        let rows = st.query_map([dir.0 as i64], |r| {
            Ok((
                r.get::<_, Vec<u8>>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, u32>(2)?,
            ))
        })?;
        let mut out = Vec::new();
        for r in rows {
            let (name, ino, kind) = r?;
            out.push(Dirent {
                name,
                ino: InodeNo(ino as u64),
                kind: Kind::from_mode(kind)
                    .ok_or_else(|| MetaError::Corrupt(ino as u64, "bad dirent kind".into()))?,
            });
        }
        Ok(out)
    }

    pub fn symlink_target(&self, ino: InodeNo) -> Result<Option<Vec<u8>>> {
        Ok(self
            .conn
            .counted("SELECT target FROM symlink WHERE ino = ?1")?
            .query_row([ino.0 as i64], |r| r.get(0))
            .optional()?)
    }

    pub fn set_symlink_target(&self, ino: InodeNo, target: &[u8]) -> Result<()> {
        self.conn
            .counted("INSERT OR REPLACE INTO symlink (ino, target) VALUES (?1, ?2)")?
            .execute(params![ino.0 as i64, target])?;
        Ok(())
    }

    pub fn inline_data(&self, ino: InodeNo) -> Result<Vec<u8>> {
        Ok(self
            .conn
            .counted("SELECT data FROM inline_data WHERE ino = ?1")?
            .query_row([ino.0 as i64], |r| r.get(0))
            .optional()?
            .unwrap_or_default())
    }

    pub fn set_inline_data(&self, ino: InodeNo, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            self.conn
                .counted("DELETE FROM inline_data WHERE ino = ?1")?
                .execute([ino.0 as i64])?;
        } else {
            self.conn
                .counted("INSERT OR REPLACE INTO inline_data (ino, data) VALUES (?1, ?2)")?
                .execute(params![ino.0 as i64, data])?;
        }
        Ok(())
    }

    pub fn xattr(&self, ino: InodeNo, name: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self
            .conn
            .counted("SELECT value FROM xattr WHERE ino = ?1 AND name = ?2")?
            .query_row(params![ino.0 as i64, name], |r| r.get(0))
            .optional()?)
    }

    pub fn set_xattr(&self, ino: InodeNo, name: &[u8], value: &[u8]) -> Result<()> {
        self.conn
            .counted("INSERT OR REPLACE INTO xattr (ino, name, value) VALUES (?1, ?2, ?3)")?
            .execute(params![ino.0 as i64, name, value])?;
        Ok(())
    }

    /// Bytes (names and values) of `ino`'s xattrs other than `name`.
    pub fn xattr_bytes_except(&self, ino: InodeNo, name: &[u8]) -> Result<u64> {
        let n: i64 = self
            .conn
            .counted(
                "SELECT COALESCE(SUM(length(name) + length(value)), 0) FROM xattr \
                 WHERE ino = ?1 AND name != ?2",
            )?
            .query_row(params![ino.0 as i64, name], |r| r.get(0))?;
        Ok(n as u64)
    }

    /// Removes an xattr; returns whether it existed.
    pub fn remove_xattr(&self, ino: InodeNo, name: &[u8]) -> Result<bool> {
        let n = self
            .conn
            .counted("DELETE FROM xattr WHERE ino = ?1 AND name = ?2")?
            .execute(params![ino.0 as i64, name])?;
        Ok(n > 0)
    }

    pub fn xattr_names(&self, ino: InodeNo) -> Result<Vec<Vec<u8>>> {
        let mut st = self
            .conn
            .counted("SELECT name FROM xattr WHERE ino = ?1 ORDER BY name")?;
        let rows = st.query_map([ino.0 as i64], |r| r.get::<_, Vec<u8>>(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Inodes with no remaining links (left over when keel stopped while files were open).
    pub fn orphans(&self) -> Result<Vec<Inode>> {
        let mut st = self.conn.counted(concat!(
            "SELECT ",
            inode_cols!(),
            " FROM inode WHERE nlink = 0"
        ))?;
        let rows = st.query_map([], row_to_inode)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(finish_inode(r?)?);
        }
        Ok(out)
    }

    /// Number of inodes (for statfs), from the running totals (no scan).
    pub fn inode_count(&self) -> Result<u64> {
        Ok(self
            .conn
            .counted("SELECT rows FROM inode_totals")?
            .query_row([], |r| r.get::<_, i64>(0))?
            .max(0) as u64)
    }

    /// (inodes with a link, bytes of the linked regular files): what a snapshot of the
    /// tree holds, from the running totals the inode table's triggers keep (no scan).
    pub fn live_totals(&self) -> Result<(u64, u64)> {
        let (n, b) = self
            .conn
            .counted("SELECT live, bytes FROM inode_totals")?
            .query_row([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
        Ok((n.max(0) as u64, b.max(0) as u64))
    }

    /// The highest inode number in the table (0: none); an index lookup, no scan (fsck's
    /// sample draws from 1..=this).
    pub fn max_ino(&self) -> Result<u64> {
        Ok(self
            .conn
            .counted("SELECT coalesce(max(ino), 0) FROM inode")?
            .query_row([], |r| r.get::<_, i64>(0))?
            .max(0) as u64)
    }

    /// Every inode (for fsck and tests).
    pub fn all_inodes(&self) -> Result<Vec<Inode>> {
        let mut st = self.conn.counted(concat!(
            "SELECT ",
            inode_cols!(),
            " FROM inode ORDER BY ino"
        ))?;
        let rows = st.query_map([], row_to_inode)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(finish_inode(r?)?);
        }
        Ok(out)
    }

    /// Every directory entry as (parent, entry) (for fsck and tests).
    pub fn all_dirents(&self) -> Result<Vec<(InodeNo, Dirent)>> {
        let mut st = self
            .conn
            .counted("SELECT parent, name, ino, kind FROM dirent ORDER BY parent, name")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, u32>(3)?,
            ))
        })?;
        let mut out = Vec::new();
        for r in rows {
            let (p, name, ino, kind) = r?;
            out.push((
                InodeNo(p as u64),
                Dirent {
                    name,
                    ino: InodeNo(ino as u64),
                    kind: Kind::from_mode(kind)
                        .ok_or_else(|| MetaError::Corrupt(ino as u64, "bad dirent kind".into()))?,
                },
            ));
        }
        Ok(out)
    }
}

fn storage_code(s: Storage) -> i64 {
    match s {
        Storage::Inline => 0,
        Storage::Body => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(perm: u32) -> Inode {
        Inode {
            ino: InodeNo(0),
            kind: Kind::File,
            perm,
            uid: 1,
            gid: 2,
            nlink: 1,
            size: 0,
            atime: Nanos(1),
            mtime: Nanos(2),
            ctime: Nanos(3),
            rdev: 0,
            parent: InodeNo::ROOT,
            storage: Storage::Inline,
        }
    }

    #[test]
    fn create_root_and_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("test.db");
        let s = Store::open(&p, Nanos(5)).unwrap();
        let root = s.read().get(InodeNo::ROOT).unwrap().unwrap();
        assert_eq!(root.kind, Kind::Dir);
        assert_eq!(root.nlink, 2);
        let tx = s.write().unwrap();
        let ino = tx.insert(&file(0o644)).unwrap();
        tx.link(InodeNo::ROOT, b"a", ino, Kind::File).unwrap();
        tx.set_xattr(ino, b"user.x", b"1").unwrap();
        tx.commit().unwrap();
        // A rolled-back transaction leaves nothing behind.
        {
            let tx = s.write().unwrap();
            tx.unlink(InodeNo::ROOT, b"a").unwrap();
        }
        drop(s);
        let s = Store::open(&p, Nanos(6)).unwrap();
        let d = s.read().lookup(InodeNo::ROOT, b"a").unwrap().unwrap();
        assert_eq!(d.ino, ino);
        let got = s.read().get(ino).unwrap().unwrap();
        assert_eq!(got.perm, 0o644);
        assert_eq!(s.read().xattr(ino, b"user.x").unwrap().unwrap(), b"1");
    }

    /// The scan the running totals replace: (rows, live inodes, bytes of live files).
    fn scanned(s: &Store) -> (u64, u64, u64) {
        let all = s.read().all_inodes().unwrap();
        let live: Vec<_> = all.iter().filter(|i| i.nlink > 0).collect();
        let bytes = live
            .iter()
            .filter(|i| i.kind == Kind::File)
            .map(|i| i.size)
            .sum();
        (all.len() as u64, live.len() as u64, bytes)
    }

    fn totals(s: &Store) -> (u64, u64, u64) {
        let r = s.read();
        let (live, bytes) = r.live_totals().unwrap();
        (r.inode_count().unwrap(), live, bytes)
    }

    #[test]
    fn inode_totals_follow_every_writer_and_are_rebuilt_for_old_state_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("test.db");
        let s = Store::open(&p, Nanos(5)).unwrap();
        assert_eq!(totals(&s), (1, 1, 0), "the root alone");
        let tx = s.write().unwrap();
        let a = tx
            .insert(&Inode {
                size: 100,
                ..file(0o644)
            })
            .unwrap();
        let b = tx
            .insert(&Inode {
                size: 7,
                ..file(0o644)
            })
            .unwrap();
        let d = tx
            .insert(&Inode {
                kind: Kind::Dir,
                nlink: 2,
                size: 4096,
                ..file(0o755)
            })
            .unwrap();
        tx.commit().unwrap();
        assert_eq!(
            totals(&s),
            (4, 4, 107),
            "a directory's size is not file bytes"
        );
        let tx = s.write().unwrap();
        let mut ia = tx.get(a).unwrap().unwrap();
        ia.size = 1000;
        tx.update(&ia).unwrap();
        let mut ib = tx.get(b).unwrap().unwrap();
        ib.nlink = 0; // unlinked, still open: not in a snapshot, still a row
        tx.update(&ib).unwrap();
        tx.commit().unwrap();
        assert_eq!(totals(&s), scanned(&s));
        assert_eq!(totals(&s), (4, 3, 1000));
        // A rolled-back change leaves the totals as they were.
        {
            let tx = s.write().unwrap();
            tx.delete(a).unwrap();
        }
        assert_eq!(totals(&s), (4, 3, 1000));
        let tx = s.write().unwrap();
        tx.delete(b).unwrap();
        tx.set_nlink(d, 0).unwrap();
        // restore's writer replaces rows under their own number
        tx.put_inode_exact(&Inode {
            ino: a,
            size: 5,
            ..file(0o600)
        })
        .unwrap();
        tx.put_inode_exact(&Inode {
            ino: InodeNo(77),
            size: 11,
            ..file(0o600)
        })
        .unwrap();
        tx.commit().unwrap();
        assert_eq!(totals(&s), scanned(&s));
        assert_eq!(totals(&s), (4, 3, 16));
        // A state dir from before the totals: they are built on open from one scan.
        s.conn
            .execute_batch(
                "DROP TRIGGER inode_totals_ins; DROP TRIGGER inode_totals_del;
                 DROP TRIGGER inode_totals_upd; DROP TABLE inode_totals;",
            )
            .unwrap();
        drop(s);
        let s = Store::open(&p, Nanos(6)).unwrap();
        assert_eq!(totals(&s), (4, 3, 16));
        let tx = s.write().unwrap();
        tx.insert(&Inode {
            size: 4,
            ..file(0o644)
        })
        .unwrap();
        tx.commit().unwrap();
        assert_eq!(totals(&s), (5, 4, 20), "and kept from then on");
        // fsck's comparison and repair.
        s.conn
            .execute_batch("UPDATE inode_totals SET live = 9")
            .unwrap();
        let (counted, kept) = s.read().inode_totals_both().unwrap();
        assert_eq!((counted, kept), ([5, 4, 20], [5, 9, 20]));
        let tx = s.write().unwrap();
        tx.recount_inode_totals().unwrap();
        tx.commit().unwrap();
        assert_eq!(totals(&s), (5, 4, 20));
    }

    #[test]
    fn group_commit_keeps_whole_operations_and_loses_only_the_open_group() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("test.db");
        let opened = std::sync::Arc::new(AtomicUsize::new(0));
        let mut s = Store::open(&p, Nanos(5)).unwrap();
        let o = opened.clone();
        s.enable_group_commit(Box::new(move || {
            o.fetch_add(1, Ordering::SeqCst);
        }));
        let limits = GroupLimits {
            max_age: Duration::from_secs(3600),
            max_ops: 2,
        };
        let add = |name: &[u8], keep: bool| {
            let tx = s.write().unwrap();
            let ino = tx.insert(&file(0o600)).unwrap();
            tx.link(InodeNo::ROOT, name, ino, Kind::File).unwrap();
            if keep {
                tx.commit().unwrap();
            }
        };
        add(b"a", true);
        add(b"failed", false); // rolled back alone
        assert!(s.group_open());
        assert!(!s.group_due(limits));
        add(b"b", true);
        assert!(s.group_due(limits), "two operations reach max_ops");
        // The connection sees its own uncommitted group; another one does not.
        assert!(s.read().lookup(InodeNo::ROOT, b"b").unwrap().is_some());
        assert!(s.read().lookup(InodeNo::ROOT, b"failed").unwrap().is_none());
        let other = Store::open(&p, Nanos(6)).unwrap();
        assert!(other.read().lookup(InodeNo::ROOT, b"a").unwrap().is_none());
        s.commit_group().unwrap();
        assert!(!s.group_open());
        assert!(other.read().lookup(InodeNo::ROOT, b"a").unwrap().is_some());
        assert!(other.read().lookup(InodeNo::ROOT, b"b").unwrap().is_some());
        // A new group is never committed: dropping the connection (a crash) loses it whole.
        add(b"c", true);
        add(b"d", true);
        assert_eq!(opened.load(Ordering::SeqCst), 2);
        drop(s);
        let r = other.read();
        assert!(r.lookup(InodeNo::ROOT, b"c").unwrap().is_none());
        assert!(r.lookup(InodeNo::ROOT, b"d").unwrap().is_none());
        assert!(r.lookup(InodeNo::ROOT, b"a").unwrap().is_some());
    }

    #[test]
    fn lookup_inode_joins_the_entry_to_its_row() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("test.db"), Nanos(5)).unwrap();
        let tx = s.write().unwrap();
        let a = tx.insert(&file(0o640)).unwrap();
        tx.link(InodeNo::ROOT, b"a", a, Kind::File).unwrap();
        tx.commit().unwrap();
        let r = s.read();
        assert_eq!(
            r.lookup_inode(InodeNo::ROOT, b"a").unwrap(),
            r.get(a).unwrap()
        );
        assert_eq!(
            r.lookup_inode(InodeNo::ROOT, b"a").unwrap().unwrap().perm,
            0o640
        );
        assert!(r.lookup_inode(InodeNo::ROOT, b"b").unwrap().is_none());
        assert!(r.lookup_inode(a, b"a").unwrap().is_none());
    }

    /// A create checks its name by inserting the entry: a taken name fails only that
    /// operation, inside a group or alone, and leaves no inode row behind.
    #[test]
    fn link_new_refuses_a_taken_name_and_the_dropped_operation_leaves_nothing() {
        for group in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let mut s = Store::open(&dir.path().join("test.db"), Nanos(5)).unwrap();
            if group {
                s.enable_group_commit(Box::new(|| {}));
            }
            let tx = s.write().unwrap();
            let a = tx.insert(&file(0o600)).unwrap();
            assert!(tx.link_new(InodeNo::ROOT, b"a", a, Kind::File).unwrap());
            tx.commit().unwrap();
            let rows = s.read().inode_count().unwrap();
            {
                let tx = s.write().unwrap();
                let b = tx.insert(&file(0o600)).unwrap();
                assert!(!tx.link_new(InodeNo::ROOT, b"a", b, Kind::File).unwrap());
            }
            assert_eq!(s.read().inode_count().unwrap(), rows, "group {group}");
            assert_eq!(
                s.read().lookup(InodeNo::ROOT, b"a").unwrap().unwrap().ino,
                a
            );
            // The transaction (and the group) go on working.
            let tx = s.write().unwrap();
            let c = tx.insert(&file(0o600)).unwrap();
            assert!(tx.link_new(InodeNo::ROOT, b"c", c, Kind::File).unwrap());
            tx.commit().unwrap();
            s.commit_group().unwrap();
            assert!(s.read().orphans().unwrap().is_empty());
            assert_eq!(s.read().inode_count().unwrap(), rows + 1, "group {group}");
        }
    }

    #[test]
    fn dir_cache_follows_committed_writes_of_its_connection_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Store::open(&dir.path().join("test.db"), Nanos(5)).unwrap();
        s.enable_group_commit(Box::new(|| {}));
        let cache = s.dir_cache().clone();
        let root = s.read().get(InodeNo::ROOT).unwrap().unwrap();
        assert!(
            cache.get(InodeNo::ROOT).is_none(),
            "filled only by its owner"
        );
        cache.put(&root);
        assert_eq!(cache.get(InodeNo::ROOT), Some(root.clone()));
        // Files are never kept: their attributes depend on more than the row.
        let tx = s.write().unwrap();
        let f = tx.insert(&file(0o600)).unwrap();
        tx.commit().unwrap();
        cache.put(&s.read().get(f).unwrap().unwrap());
        assert!(cache.get(f).is_none());

        let with_mtime = |m: i64| Inode {
            mtime: Nanos(m),
            ..root.clone()
        };
        // A committed operation (inside the open group) refreshes the entry...
        let tx = s.write().unwrap();
        tx.update(&with_mtime(100)).unwrap();
        assert_eq!(
            cache.get(InodeNo::ROOT).unwrap().mtime,
            root.mtime,
            "not before commit"
        );
        tx.commit().unwrap();
        assert_eq!(cache.get(InodeNo::ROOT).unwrap().mtime, Nanos(100));
        // ...a rolled-back one does not.
        let tx = s.write().unwrap();
        tx.update(&with_mtime(200)).unwrap();
        drop(tx);
        assert_eq!(cache.get(InodeNo::ROOT).unwrap().mtime, Nanos(100));
        assert_eq!(
            s.read().get(InodeNo::ROOT).unwrap().unwrap().mtime,
            Nanos(100)
        );

        // A deleted directory is forgotten.
        let tx = s.write().unwrap();
        let d = tx
            .insert(&Inode {
                kind: Kind::Dir,
                nlink: 2,
                ..file(0o755)
            })
            .unwrap();
        tx.commit().unwrap();
        cache.put(&s.read().get(d).unwrap().unwrap());
        assert!(cache.get(d).is_some());
        let tx = s.write().unwrap();
        tx.delete(d).unwrap();
        tx.commit().unwrap();
        assert!(cache.get(d).is_none());

        // SQLite rolling the open group back takes what the cache learnt from it along.
        s.commit_group().unwrap();
        let tx = s.write().unwrap();
        tx.update(&with_mtime(300)).unwrap();
        tx.commit().unwrap();
        assert_eq!(cache.get(InodeNo::ROOT).unwrap().mtime, Nanos(300));
        s.conn.execute_batch("ROLLBACK").unwrap();
        s.note_if_lost();
        assert!(s.take_group_lost());
        assert!(cache.get(InodeNo::ROOT).is_none());
        assert_eq!(
            s.read().get(InodeNo::ROOT).unwrap().unwrap().mtime,
            Nanos(100)
        );
    }

    #[test]
    fn foreign_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("test.db");
        std::fs::write(
            &p,
            b"definitely not sqlite, just some bytes that are long enough",
        )
        .unwrap();
        let e = Store::open(&p, Nanos(0)).err().unwrap();
        assert!(matches!(e, MetaError::Foreign { .. }), "{e}");
    }
}

//! The remote object store behind one small synchronous trait: get, ranged get, head, put
//! (overwrite / create-if-absent / update-if-version), delete, list. Implementations:
//! `FsRemote` (`file://`, durable with one `syncfs` per checkpoint step), `MemRemote` (tests,
//! with failure injection), `ObjectStoreRemote` (S3/R2/GCS/Azure through `object_store`), and
//! `Counted`, a wrapper that counts requests and bytes (tests and progress reports).
//!
//! Keys are `/`-separated paths relative to the store root (a bucket, or a directory).

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;

use crate::sys;

/// Why a remote operation failed. `is_temporary` tells whether retrying may help.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("remote object {key} not found")]
    NotFound { key: String },
    #[error("remote object {key} already exists")]
    AlreadyExists { key: String },
    #[error("remote object {key} changed since it was read (conditional write refused)")]
    Precondition { key: String },
    #[error("remote {op} {key}: {reason}")]
    Temporary {
        op: &'static str,
        key: String,
        reason: String,
    },
    #[error("remote {op} {key}: {reason}")]
    Permanent {
        op: &'static str,
        key: String,
        reason: String,
    },
    #[error("remote URL {url}: {reason}")]
    Open { url: String, reason: String },
}

impl RemoteError {
    pub fn is_temporary(&self) -> bool {
        matches!(self, RemoteError::Temporary { .. })
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, RemoteError::NotFound { .. })
    }

    fn io(op: &'static str, key: &str, e: io::Error) -> RemoteError {
        match e.kind() {
            io::ErrorKind::NotFound => RemoteError::NotFound {
                key: key.to_string(),
            },
            io::ErrorKind::AlreadyExists => RemoteError::AlreadyExists {
                key: key.to_string(),
            },
            io::ErrorKind::Interrupted | io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
                RemoteError::Temporary {
                    op,
                    key: key.to_string(),
                    reason: e.to_string(),
                }
            }
            _ => RemoteError::Permanent {
                op,
                key: key.to_string(),
                reason: e.to_string(),
            },
        }
    }
}

pub type RemoteResult<T> = Result<T, RemoteError>;

/// What `head` and `list` say about an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    pub modified: SystemTime,
    /// Opaque version (ETag or equivalent) for conditional updates.
    pub version: Option<String>,
}

/// How `put` treats an object already present under the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutMode {
    Overwrite,
    /// Fail with `AlreadyExists` when present.
    Create,
    /// Fail with `Precondition` unless the current version is this one.
    Update(String),
}

/// An object store. All methods block; implementations may run I/O in parallel inside
/// `put_many`/`get_many`.
pub trait Remote: Send + Sync {
    /// Human-readable location (no credentials).
    fn describe(&self) -> String;
    fn get(&self, key: &str) -> RemoteResult<Bytes>;
    fn get_range(&self, key: &str, range: Range<u64>) -> RemoteResult<Bytes>;
    /// `None` when absent.
    fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>>;
    /// Returns the new version, when the store has one.
    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>>;
    /// Deleting an absent object is not an error.
    fn delete(&self, key: &str) -> RemoteResult<()>;
    /// Every object whose key starts with `prefix`, in key order.
    fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>>;
    /// Makes every completed `put` durable (no-op where puts are durable on return).
    fn flush(&self) -> RemoteResult<()> {
        Ok(())
    }
    /// The local directory holding the objects (`file://`), for `keel fsck`'s mode check.
    fn local_root(&self) -> Option<&Path> {
        None
    }
    /// Creates objects that may already exist (content-addressed): an existing object is
    /// left alone. Returns, in input order, whether each was actually written.
    fn put_many_absent(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        let mut out = Vec::with_capacity(items.len());
        for (k, d) in items {
            match self.put(&k, d, PutMode::Create) {
                Ok(_) => out.push(true),
                Err(RemoteError::AlreadyExists { .. }) => out.push(false),
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
    /// Like `put_many_absent`, but an object that is already there gets a fresh
    /// modification time (it is written again, or touched where the store can do that):
    /// gc deletes unreferenced objects by age, and an old unreferenced chunk that a
    /// checkpoint is about to name again must not look old while that checkpoint runs.
    /// Returns, in input order, whether each was absent (written for the first time).
    fn put_many_fresh(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        let mut out = Vec::with_capacity(items.len());
        for (k, d) in items {
            match self.put(&k, d.clone(), PutMode::Create) {
                Ok(_) => out.push(true),
                Err(RemoteError::AlreadyExists { .. }) => {
                    self.put(&k, d, PutMode::Overwrite)?;
                    out.push(false);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
    /// Fetches several objects; results in input order.
    fn get_many(&self, keys: &[String]) -> Vec<RemoteResult<Bytes>> {
        keys.iter().map(|k| self.get(k)).collect()
    }
    /// Fetches several byte ranges (of packs); results in input order.
    fn get_ranges(&self, reqs: &[(String, Range<u64>)]) -> Vec<RemoteResult<Bytes>> {
        reqs.iter()
            .map(|(k, r)| self.get_range(k, r.clone()))
            .collect()
    }
}

// ---------------------------------------------------------------------------------------

/// `file://` remote: one file per object under a root directory. Writes go to a temporary
/// file and are renamed (create-if-absent uses `link`, which fails atomically when the
/// name exists). Durability comes from `flush` (one `syncfs` of the volume), which the
/// checkpoint calls before each object that references earlier ones.
pub struct FsRemote {
    root: PathBuf,
    tmp_seq: AtomicU64,
}

impl FsRemote {
    /// Opens the store at `root`, creating it (0700, like every directory below it; every
    /// object is 0600) when absent.
    pub fn open(root: &Path) -> RemoteResult<FsRemote> {
        crate::state::private::create_dir_all(root).map_err(|e| RemoteError::Open {
            url: format!("file://{}", root.display()),
            reason: e.to_string(),
        })?;
        Ok(FsRemote {
            root: root.to_path_buf(),
            tmp_seq: AtomicU64::new(0),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    fn version(m: &std::fs::Metadata) -> String {
        use std::os::unix::fs::MetadataExt;
        format!(
            "{:x}-{:x}-{:x}",
            m.ino(),
            m.mtime_nsec() ^ (m.mtime() << 30),
            m.len()
        )
    }

    fn info(key: &str, m: &std::fs::Metadata) -> ObjectInfo {
        ObjectInfo {
            key: key.to_string(),
            size: m.len(),
            modified: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            version: Some(Self::version(m)),
        }
    }

    fn write_tmp(&self, path: &Path, key: &str, data: &[u8]) -> RemoteResult<PathBuf> {
        let dir = path.parent().expect("object path has a parent");
        crate::state::private::create_dir_all(dir).map_err(|e| RemoteError::io("put", key, e))?;
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".tmp.{}.{n}", std::process::id()));
        // 0600 from the start: the rename (or link) keeps the temporary file's mode. A stale
        // one of the same name (a crashed keel with the same pid) is replaced.
        let create = || {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(crate::state::private::FILE_MODE)
                .open(&tmp)
        };
        let mut f = match create() {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                std::fs::remove_file(&tmp).and_then(|()| create())
            }
            r => r,
        }
        .map_err(|e| RemoteError::io("put", key, e))?;
        f.write_all(data)
            .map_err(|e| RemoteError::io("put", key, e))?;
        Ok(tmp)
    }
}

impl Remote for FsRemote {
    fn describe(&self) -> String {
        format!("file://{}", self.root.display())
    }

    fn get(&self, key: &str) -> RemoteResult<Bytes> {
        std::fs::read(self.path(key))
            .map(Bytes::from)
            .map_err(|e| RemoteError::io("get", key, e))
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> RemoteResult<Bytes> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(self.path(key)).map_err(|e| RemoteError::io("get", key, e))?;
        let mut buf = vec![0u8; (range.end - range.start) as usize];
        let mut done = 0;
        while done < buf.len() {
            let n = f
                .read_at(&mut buf[done..], range.start + done as u64)
                .map_err(|e| RemoteError::io("get", key, e))?;
            if n == 0 {
                break;
            }
            done += n;
        }
        buf.truncate(done);
        Ok(Bytes::from(buf))
    }

    fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
        match std::fs::metadata(self.path(key)) {
            Ok(m) => Ok(Some(Self::info(key, &m))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(RemoteError::io("head", key, e)),
        }
    }

    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>> {
        let path = self.path(key);
        if mode == PutMode::Create && path.exists() {
            return Err(RemoteError::AlreadyExists {
                key: key.to_string(),
            });
        }
        if let PutMode::Update(v) = &mode {
            // Single host: the state-dir lock already serialises writers, so a
            // check-then-rename is enough here.
            let cur = self.head(key)?.and_then(|i| i.version);
            if cur.as_deref() != Some(v.as_str()) {
                return Err(RemoteError::Precondition {
                    key: key.to_string(),
                });
            }
        }
        let tmp = self.write_tmp(&path, key, &data)?;
        let r = if mode == PutMode::Create {
            let r = std::fs::hard_link(&tmp, &path);
            let _ = std::fs::remove_file(&tmp);
            r
        } else {
            std::fs::rename(&tmp, &path)
        };
        r.map_err(|e| RemoteError::io("put", key, e))?;
        let m = std::fs::metadata(&path).map_err(|e| RemoteError::io("put", key, e))?;
        Ok(Some(Self::version(&m)))
    }

    fn delete(&self, key: &str) -> RemoteResult<()> {
        match std::fs::remove_file(self.path(key)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RemoteError::io("delete", key, e)),
        }
    }

    fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>> {
        // Walk from the deepest directory the prefix names.
        let dir_part = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let mut out = Vec::new();
        let mut stack = vec![(self.root.join(dir_part), dir_part.to_string())];
        while let Some((dir, rel)) = stack.pop() {
            let rd = match std::fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(RemoteError::io("list", prefix, e)),
            };
            for e in rd {
                let e = e.map_err(|e| RemoteError::io("list", prefix, e))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(".tmp.") {
                    continue;
                }
                let key = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                let ft = e
                    .file_type()
                    .map_err(|e| RemoteError::io("list", prefix, e))?;
                if ft.is_dir() {
                    if key.starts_with(prefix) || prefix.starts_with(&format!("{key}/")) {
                        stack.push((e.path(), key));
                    }
                } else if key.starts_with(prefix) {
                    let m = match e.metadata() {
                        Ok(m) => m,
                        // Deleted since the directory was read (by a gc, a marker's
                        // owner): not listed, as it would not be a moment later.
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) => return Err(RemoteError::io("list", prefix, e)),
                    };
                    out.push(Self::info(&key, &m));
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    fn flush(&self) -> RemoteResult<()> {
        sys::file::syncfs(&self.root).map_err(|e| RemoteError::io("sync", "", e))
    }

    fn local_root(&self) -> Option<&Path> {
        Some(&self.root)
    }

    fn put_many_absent(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        // Local disk: parallel writes do not help much; existing objects are skipped by
        // name (content-addressed keys; a damaged one of the wrong size is rewritten).
        let mut out = Vec::with_capacity(items.len());
        for (k, d) in items {
            match self.head(&k)? {
                Some(i) if i.size == d.len() as u64 => out.push(false),
                _ => {
                    self.put(&k, d, PutMode::Overwrite)?;
                    out.push(true);
                }
            }
        }
        Ok(out)
    }
    fn put_many_fresh(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        // An object that is there (right size) is touched rather than rewritten; one that a
        // gc deleted meanwhile is written again.
        let mut out = Vec::with_capacity(items.len());
        for (k, d) in items {
            let touched = match self.head(&k)? {
                Some(i) if i.size == d.len() as u64 => std::fs::OpenOptions::new()
                    .write(true)
                    .open(self.path(&k))
                    .and_then(|f| f.set_modified(SystemTime::now()))
                    .is_ok(),
                _ => false,
            };
            if !touched {
                self.put(&k, d, PutMode::Overwrite)?;
            }
            out.push(!touched);
        }
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------

/// In-memory remote for tests. `fail_after(n)` makes every operation after the next `n`
/// fail with a temporary error (a remote that went away).
#[derive(Default)]
pub struct MemRemote {
    objects: Mutex<BTreeMap<String, (Bytes, SystemTime, u64)>>,
    version: AtomicU64,
    budget: Mutex<Option<u64>>,
}

impl MemRemote {
    pub fn new() -> MemRemote {
        MemRemote::default()
    }

    /// Lets `n` more operations succeed, then fails every one (`None`: never fail).
    pub fn fail_after(&self, n: Option<u64>) {
        *self.budget.lock().unwrap() = n;
    }

    fn gate(&self, op: &'static str, key: &str) -> RemoteResult<()> {
        let mut b = self.budget.lock().unwrap();
        match b.as_mut() {
            None => Ok(()),
            Some(0) => Err(RemoteError::Temporary {
                op,
                key: key.to_string(),
                reason: "injected failure: remote unreachable".into(),
            }),
            Some(n) => {
                *n -= 1;
                Ok(())
            }
        }
    }

    /// Replaces an object's bytes in place (corruption tests).
    pub fn tamper(&self, key: &str, f: impl FnOnce(&mut Vec<u8>)) {
        let mut m = self.objects.lock().unwrap();
        if let Some((d, _, _)) = m.get_mut(key) {
            let mut v = d.to_vec();
            f(&mut v);
            *d = Bytes::from(v);
        }
    }

    /// Backdates every object (gc grace tests).
    pub fn age_all(&self, by: std::time::Duration) {
        for (_, t, _) in self.objects.lock().unwrap().values_mut() {
            *t -= by;
        }
    }

    pub fn keys(&self) -> Vec<String> {
        self.objects.lock().unwrap().keys().cloned().collect()
    }
}

impl Remote for MemRemote {
    fn describe(&self) -> String {
        "memory://".into()
    }

    fn get(&self, key: &str) -> RemoteResult<Bytes> {
        self.gate("get", key)?;
        self.objects
            .lock()
            .unwrap()
            .get(key)
            .map(|o| o.0.clone())
            .ok_or_else(|| RemoteError::NotFound {
                key: key.to_string(),
            })
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> RemoteResult<Bytes> {
        let d = self.get(key)?;
        let end = (range.end as usize).min(d.len());
        let start = (range.start as usize).min(end);
        Ok(d.slice(start..end))
    }

    fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
        self.gate("head", key)?;
        Ok(self
            .objects
            .lock()
            .unwrap()
            .get(key)
            .map(|(d, t, v)| ObjectInfo {
                key: key.to_string(),
                size: d.len() as u64,
                modified: *t,
                version: Some(v.to_string()),
            }))
    }

    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>> {
        self.gate("put", key)?;
        let mut m = self.objects.lock().unwrap();
        match (&mode, m.get(key)) {
            (PutMode::Create, Some(_)) => {
                return Err(RemoteError::AlreadyExists {
                    key: key.to_string(),
                })
            }
            (PutMode::Update(v), cur) if cur.map(|c| c.2.to_string()).as_ref() != Some(v) => {
                return Err(RemoteError::Precondition {
                    key: key.to_string(),
                })
            }
            _ => {}
        }
        let v = self.version.fetch_add(1, Ordering::Relaxed) + 1;
        m.insert(key.to_string(), (data, SystemTime::now(), v));
        Ok(Some(v.to_string()))
    }

    fn delete(&self, key: &str) -> RemoteResult<()> {
        self.gate("delete", key)?;
        self.objects.lock().unwrap().remove(key);
        Ok(())
    }

    fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>> {
        self.gate("list", prefix)?;
        Ok(self
            .objects
            .lock()
            .unwrap()
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (d, t, v))| ObjectInfo {
                key: k.clone(),
                size: d.len() as u64,
                modified: *t,
                version: Some(v.to_string()),
            })
            .collect())
    }
}

// ---------------------------------------------------------------------------------------

/// Request and byte counters of a `Counted` remote.
#[derive(Debug, Default)]
pub struct Counters {
    pub gets: AtomicU64,
    pub bytes_got: AtomicU64,
    pub puts: AtomicU64,
    pub bytes_put: AtomicU64,
    pub deletes: AtomicU64,
    pub lists: AtomicU64,
    pub heads: AtomicU64,
}

/// A snapshot of `Counters`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub gets: u64,
    pub bytes_got: u64,
    pub puts: u64,
    pub bytes_put: u64,
    pub deletes: u64,
    pub lists: u64,
    pub heads: u64,
}

impl Counts {
    pub fn since(&self, earlier: &Counts) -> Counts {
        Counts {
            gets: self.gets - earlier.gets,
            bytes_got: self.bytes_got - earlier.bytes_got,
            puts: self.puts - earlier.puts,
            bytes_put: self.bytes_put - earlier.bytes_put,
            deletes: self.deletes - earlier.deletes,
            lists: self.lists - earlier.lists,
            heads: self.heads - earlier.heads,
        }
    }
}

/// Wraps a remote and counts what goes through it (bytes actually written: a
/// content-addressed put of an object that exists is not counted).
pub struct Counted {
    inner: Arc<dyn Remote>,
    c: Counters,
}

impl Counted {
    pub fn new(inner: Arc<dyn Remote>) -> Counted {
        Counted {
            inner,
            c: Counters::default(),
        }
    }

    pub fn counts(&self) -> Counts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counts {
            gets: l(&self.c.gets),
            bytes_got: l(&self.c.bytes_got),
            puts: l(&self.c.puts),
            bytes_put: l(&self.c.bytes_put),
            deletes: l(&self.c.deletes),
            lists: l(&self.c.lists),
            heads: l(&self.c.heads),
        }
    }

    fn add(a: &AtomicU64, n: u64) {
        a.fetch_add(n, Ordering::Relaxed);
    }

    /// Runs a batched put and counts the objects it wrote for the first time.
    fn count_written(
        &self,
        items: Vec<(String, Bytes)>,
        put: impl FnOnce(Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>>,
    ) -> RemoteResult<Vec<bool>> {
        let sizes: Vec<u64> = items.iter().map(|(_, d)| d.len() as u64).collect();
        let written = put(items)?;
        for (w, n) in written.iter().zip(sizes) {
            if *w {
                Self::add(&self.c.puts, 1);
                Self::add(&self.c.bytes_put, n);
            }
        }
        Ok(written)
    }
}

impl Remote for Counted {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn get(&self, key: &str) -> RemoteResult<Bytes> {
        let r = self.inner.get(key)?;
        Self::add(&self.c.gets, 1);
        Self::add(&self.c.bytes_got, r.len() as u64);
        Ok(r)
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> RemoteResult<Bytes> {
        let r = self.inner.get_range(key, range)?;
        Self::add(&self.c.gets, 1);
        Self::add(&self.c.bytes_got, r.len() as u64);
        Ok(r)
    }

    fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
        Self::add(&self.c.heads, 1);
        self.inner.head(key)
    }

    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>> {
        let n = data.len() as u64;
        let r = self.inner.put(key, data, mode)?;
        Self::add(&self.c.puts, 1);
        Self::add(&self.c.bytes_put, n);
        Ok(r)
    }

    fn delete(&self, key: &str) -> RemoteResult<()> {
        Self::add(&self.c.deletes, 1);
        self.inner.delete(key)
    }

    fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>> {
        Self::add(&self.c.lists, 1);
        self.inner.list(prefix)
    }

    fn flush(&self) -> RemoteResult<()> {
        self.inner.flush()
    }

    fn local_root(&self) -> Option<&Path> {
        self.inner.local_root()
    }

    fn put_many_absent(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        self.count_written(items, |i| self.inner.put_many_absent(i))
    }

    fn put_many_fresh(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        // Counted like `put_many_absent`: refreshing an object that exists is not.
        self.count_written(items, |i| self.inner.put_many_fresh(i))
    }

    fn get_many(&self, keys: &[String]) -> Vec<RemoteResult<Bytes>> {
        let r = self.inner.get_many(keys);
        for x in r.iter().flatten() {
            Self::add(&self.c.gets, 1);
            Self::add(&self.c.bytes_got, x.len() as u64);
        }
        r
    }

    fn get_ranges(&self, reqs: &[(String, Range<u64>)]) -> Vec<RemoteResult<Bytes>> {
        let r = self.inner.get_ranges(reqs);
        for x in r.iter().flatten() {
            Self::add(&self.c.gets, 1);
            Self::add(&self.c.bytes_got, x.len() as u64);
        }
        r
    }
}

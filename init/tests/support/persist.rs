//! Helpers shared by the persist tests: a workspace opened without a kernel, tree
//! building, a full dump of a tree (paths, inode numbers, metadata, xattrs, bytes) for
//! comparisons, and checkpoint plumbing over a counted remote.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use keel::config::CacheMode;
use keel::meta::{InodeNo, Kind};
use keel::persist::remote::{ObjectInfo, PutMode, RemoteResult};
use keel::persist::{
    CheckpointOptions, CheckpointReport, Counted, PersistParams, Persister, Remote, Repo,
};
use keel::workspace::fs::{Caller, FsOptions, SetAttr, SetTime, WorkspaceFs};

pub const ROOT: Caller = Caller {
    uid: 0,
    gid: 0,
    pid: 0,
    umask: 0,
};
pub const CHUNK: u64 = 64 * 1024;

pub fn fs_opts() -> FsOptions {
    FsOptions {
        cache: CacheMode::Auto,
        inline_max: 4096,
        chunk_size: CHUNK,
        passthrough: Default::default(),
        posix_acl: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
    }
}

pub fn open_fs(dir: &Path) -> WorkspaceFs {
    WorkspaceFs::new(dir, fs_opts()).expect("open workspace")
}

pub fn params() -> PersistParams {
    PersistParams {
        chunk_size: CHUNK,
        compact_every: 8,
        pack_below: 64 << 10,
        pack_size: 4 << 20,
        threads: 2,
    }
}

pub fn persister(dir: &Path, remote: Arc<dyn Remote>) -> Persister {
    Persister::open(dir, Repo::new(remote, "ws"), params()).expect("open persister")
}

/// A persister that stores every chunk as its own object (`pack_below = 0`), as keel did
/// before packs: for tests that count the GETs of single windows.
pub fn persister_loose(dir: &Path, remote: Arc<dyn Remote>) -> Persister {
    let params = PersistParams {
        pack_below: 0,
        ..params()
    };
    Persister::open(dir, Repo::new(remote, "ws"), params).expect("open persister")
}

pub fn checkpoint(p: &mut Persister) -> CheckpointReport {
    p.checkpoint(&CheckpointOptions::default())
        .expect("checkpoint")
}

pub fn counted(inner: Arc<dyn Remote>) -> Arc<Counted> {
    Arc::new(Counted::new(inner))
}

pub fn resolve(fs: &WorkspaceFs, path: &str) -> InodeNo {
    let mut ino = InodeNo::ROOT;
    for part in path.split('/').filter(|p| !p.is_empty()) {
        ino = fs
            .lookup(ino, part.as_bytes())
            .unwrap_or_else(|e| panic!("lookup {path}: {e}"))
            .inode
            .ino;
    }
    ino
}

fn split(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

pub fn mkdir(fs: &WorkspaceFs, path: &str) -> InodeNo {
    let (p, n) = split(path);
    fs.mkdir(ROOT, resolve(fs, p), n.as_bytes(), 0o755)
        .unwrap()
        .inode
        .ino
}

/// Creates (or truncates) a file and writes `data`.
pub fn write_file(fs: &WorkspaceFs, path: &str, data: &[u8]) -> InodeNo {
    let (p, n) = split(path);
    let parent = resolve(fs, p);
    let ino = match fs.lookup(parent, n.as_bytes()) {
        Ok(a) => {
            fs.setattr(
                a.inode.ino,
                &SetAttr {
                    size: Some(0),
                    ..Default::default()
                },
            )
            .unwrap();
            a.inode.ino
        }
        Err(_) => {
            let (a, fh, _) = fs
                .create(ROOT, parent, n.as_bytes(), 0o644, libc::O_RDWR)
                .unwrap();
            fs.release(fh).unwrap();
            a.inode.ino
        }
    };
    write_at(fs, ino, 0, data);
    ino
}

pub fn write_at(fs: &WorkspaceFs, ino: InodeNo, off: u64, data: &[u8]) {
    let (fh, _) = fs.open(ino, libc::O_RDWR).unwrap();
    let mut done = 0;
    while done < data.len() {
        let n = (data.len() - done).min(1 << 20);
        fs.write(ino, off + done as u64, &data[done..done + n])
            .unwrap();
        done += n;
    }
    fs.flush(ino).unwrap();
    fs.release(fh).unwrap();
}

pub fn read_all(fs: &WorkspaceFs, ino: InodeNo) -> Result<Vec<u8>, keel::workspace::fs::FsError> {
    let (fh, _) = fs.open(ino, libc::O_RDONLY)?;
    let mut out = Vec::new();
    let mut buf = Vec::new();
    loop {
        fs.read(ino, out.len() as u64, 1 << 20, &mut buf)?;
        if buf.is_empty() {
            break;
        }
        out.extend_from_slice(&buf);
    }
    fs.release(fh)?;
    Ok(out)
}

/// Pseudo-random bytes (xorshift), reproducible from `seed`.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Everything observable about a tree, keyed by path.
pub fn dump(fs: &WorkspaceFs) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(InodeNo::ROOT, String::from("/"))];
    while let Some((ino, path)) = stack.pop() {
        let a = fs.getattr(ino).unwrap();
        let i = &a.inode;
        let mut xs = Vec::new();
        let names = fs.listxattr(ino).unwrap();
        for n in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            xs.push(format!(
                "{}={:?}",
                String::from_utf8_lossy(n),
                fs.getxattr(ino, n).unwrap()
            ));
        }
        let content = match i.kind {
            Kind::File => {
                let b = read_all(fs, ino).unwrap();
                format!("bytes:{}:{}", b.len(), blake(&b))
            }
            Kind::Symlink => format!(
                "target:{:?}",
                String::from_utf8_lossy(&fs.readlink(ino).unwrap())
            ),
            _ => String::new(),
        };
        out.insert(
            path.clone(),
            format!(
                "ino={} kind={:?} perm={:o} uid={} gid={} nlink={} size={} atime={} mtime={} ctime={} rdev={} x=[{}] {}",
                i.ino.0, i.kind, i.perm, i.uid, i.gid, i.nlink, i.size, i.atime.0, i.mtime.0, i.ctime.0, i.rdev,
                xs.join(","), content
            ),
        );
        if i.kind == Kind::Dir {
            let fh = fs.opendir(ino).unwrap();
            let mut ents = Vec::new();
            fs.readdir(fh, 0, |e, _| {
                ents.push(e.clone());
                false
            })
            .unwrap();
            fs.releasedir(fh);
            for e in ents {
                if e.name == b"." || e.name == b".." {
                    continue;
                }
                let p = format!(
                    "{}{}{}",
                    path,
                    if path == "/" { "" } else { "/" },
                    String::from_utf8_lossy(&e.name)
                );
                stack.push((e.ino, p));
            }
        }
    }
    out
}

fn blake(b: &[u8]) -> String {
    keel::chunk::ChunkId::of(b).to_hex()[..16].to_string()
}

/// A tree with every kind of inode and metadata.
pub fn build_rich_tree(fs: &WorkspaceFs) {
    mkdir(fs, "d");
    mkdir(fs, "d/e");
    write_file(fs, "d/small", b"hello");
    write_file(fs, "d/e/big", &noise(1, 300_000));
    let sparse = write_file(fs, "sparse", b"");
    write_at(fs, sparse, 5 * CHUNK + 7, b"tail");
    let big = resolve(fs, "d/e/big");
    fs.link(big, InodeNo::ROOT, b"hardlink").unwrap();
    fs.symlink(ROOT, InodeNo::ROOT, b"sym", b"d/e/big").unwrap();
    fs.mknod(ROOT, InodeNo::ROOT, b"fifo", libc::S_IFIFO | 0o640, 0)
        .unwrap();
    fs.mknod(ROOT, InodeNo::ROOT, b"chr", libc::S_IFCHR | 0o600, 0x0103)
        .unwrap();
    let small = resolve(fs, "d/small");
    fs.setxattr(ROOT, small, b"user.k", b"v\0bin", 0).unwrap();
    fs.setattr(
        small,
        &SetAttr {
            mode: Some(0o4711),
            uid: Some(1000),
            gid: Some(2000),
            atime: Some(SetTime::At(keel::meta::Nanos(123_456_789))),
            mtime: Some(SetTime::At(keel::meta::Nanos(-5))),
            ..Default::default()
        },
    )
    .unwrap();
    write_file(fs, "empty", b"");
}

/// A remote that shows `on(op, key)` every keyed request before passing it on, batches key
/// by key (`op`: "get", "get_range", "head", "put", "delete", "get_many",
/// "put_many_absent", "put_many_fresh"): tests count requests with it, or act at a chosen
/// moment.
pub struct Tap {
    inner: Arc<dyn Remote>,
    on: Box<OnRequest>,
}

/// What a `Tap` calls with (op, key).
type OnRequest = dyn Fn(&str, &str) + Send + Sync;

impl Tap {
    pub fn new(
        inner: Arc<dyn Remote>,
        on: impl Fn(&str, &str) + Send + Sync + 'static,
    ) -> Arc<Tap> {
        Arc::new(Tap {
            inner,
            on: Box::new(on),
        })
    }

    fn each(&self, op: &str, items: &[(String, Bytes)]) {
        for (k, _) in items {
            (self.on)(op, k);
        }
    }
}

impl Remote for Tap {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn get(&self, key: &str) -> RemoteResult<Bytes> {
        (self.on)("get", key);
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, range: Range<u64>) -> RemoteResult<Bytes> {
        (self.on)("get_range", key);
        self.inner.get_range(key, range)
    }
    fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
        (self.on)("head", key);
        self.inner.head(key)
    }
    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>> {
        (self.on)("put", key);
        self.inner.put(key, data, mode)
    }
    fn delete(&self, key: &str) -> RemoteResult<()> {
        (self.on)("delete", key);
        self.inner.delete(key)
    }
    fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>> {
        self.inner.list(prefix)
    }
    fn flush(&self) -> RemoteResult<()> {
        self.inner.flush()
    }
    fn put_many_absent(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        self.each("put_many_absent", &items);
        self.inner.put_many_absent(items)
    }
    fn put_many_fresh(&self, items: Vec<(String, Bytes)>) -> RemoteResult<Vec<bool>> {
        self.each("put_many_fresh", &items);
        self.inner.put_many_fresh(items)
    }
    fn get_many(&self, keys: &[String]) -> Vec<RemoteResult<Bytes>> {
        for k in keys {
            (self.on)("get_many", k);
        }
        self.inner.get_many(keys)
    }
}

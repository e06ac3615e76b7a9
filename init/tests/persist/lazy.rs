//! Lazy restore without a kernel (`WorkspaceFs` called directly): a lazy restore fetches no
//! chunk; a read fetches exactly the windows it touches (plus the designed readahead for
//! sequential readers); reading everything gives the original tree; checkpoints after a
//! lazy restore upload only what changed and never hash an unfetched window's sparse zeros
//! (also after a crash); a corrupt chunk fails the read with EIO naming it; a crash between
//! the body write and its record refetches instead of showing zeros; truncates and whole
//! window overwrites respect unfetched windows. Over `MemRemote` and over real S3 (moto).
//! Every chunk is its own object here (`persister_loose`), so a GET is a window; reads
//! from packs are `persist_packs`'s.

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use keel::chunk::ChunkId;
use keel::meta::InodeNo;
use keel::persist::hydrate::RemoteChunks;
use keel::persist::restore::{restore, restore_with, RestoreMode};
use keel::persist::{MemRemote, Remote, Repo};
use keel::workspace::fs::{SetAttr, WorkspaceFs};
use support::persist::*;

/// Designed readahead: a sequential read fetches this many windows after its own.
const READAHEAD: u64 = 4;

/// A remote that counts GETs of chunk objects (keys under `/chunks/`), single and batched.
/// Also records their keys, in the order they were asked for.
fn chunk_gets(inner: Arc<dyn Remote>) -> (Arc<Tap>, Arc<AtomicU64>, Arc<Mutex<Vec<String>>>) {
    let gets = Arc::new(AtomicU64::new(0));
    let keys = Arc::new(Mutex::new(Vec::new()));
    let (g, k) = (gets.clone(), keys.clone());
    let tap = Tap::new(inner, move |op, key| {
        if matches!(op, "get" | "get_range" | "get_many") && key.contains("/chunks/") {
            g.fetch_add(1, Ordering::SeqCst);
            k.lock().unwrap().push(key.to_string());
        }
    });
    (tap, gets, keys)
}

fn a_bytes() -> Vec<u8> {
    noise(11, 10 * CHUNK as usize)
}
fn b_bytes() -> Vec<u8> {
    noise(12, 7 * CHUNK as usize + 1234)
}

/// Size of `lz/holes`.
const HOLES: u64 = 6 * CHUNK + 9;

/// The rich tree plus multi-window files: `lz/a` (10 windows), `lz/b` (8, the last
/// short), `lz/c` (sparse: data in windows 3 and 9 only), `lz/holes` (no data at all: a
/// lazy restore leaves it without a body).
fn build(fs: &WorkspaceFs) {
    build_rich_tree(fs);
    mkdir(fs, "lz");
    write_file(fs, "lz/a", &a_bytes());
    write_file(fs, "lz/b", &b_bytes());
    let c = write_file(fs, "lz/c", b"");
    write_at(fs, c, 3 * CHUNK + 5, b"xyz");
    write_at(fs, c, 9 * CHUNK, b"tail");
    let h = write_file(fs, "lz/holes", b"");
    fs.setattr(
        h,
        &SetAttr {
            size: Some(HOLES),
            ..Default::default()
        },
    )
    .unwrap();
}

struct Lazy {
    _src: tempfile::TempDir,
    dst: tempfile::TempDir,
    remote: Arc<Tap>,
    /// Chunk GETs through `remote` so far.
    gets: Arc<AtomicU64>,
    /// Their keys, in order.
    keys: Arc<Mutex<Vec<String>>>,
    /// The source tree as checkpointed.
    want: BTreeMap<String, String>,
    /// Windows the lazy restore left to fetch.
    missing: u64,
}

impl Lazy {
    /// Chunk GETs so far.
    fn n(&self) -> u64 {
        self.gets.load(Ordering::SeqCst)
    }

    fn new(inner: Arc<dyn Remote>) -> Lazy {
        let (remote, gets, keys) = chunk_gets(Arc::new(keel::persist::Counted::new(inner)));
        let src = tempfile::tempdir().unwrap();
        let fs = open_fs(src.path());
        build(&fs);
        let want = dump(&fs);
        fs.shutdown().unwrap();
        drop(fs);
        let mut p = persister_loose(src.path(), remote.clone());
        checkpoint(&mut p);
        drop(p);
        let dst = tempfile::tempdir().unwrap();
        let before = gets.load(Ordering::SeqCst);
        let mut repo = Repo::new(remote.clone(), "ws");
        let r = restore_with(&mut repo, None, dst.path(), RestoreMode::Lazy).unwrap();
        assert_eq!(
            gets.load(Ordering::SeqCst),
            before,
            "a lazy restore fetched chunks"
        );
        assert_eq!(r.chunks_fetched, 0);
        assert!(r.windows_missing > 20, "{r:?}");
        Lazy {
            _src: src,
            dst,
            remote,
            gets,
            keys,
            want,
            missing: r.windows_missing,
        }
    }

    fn open(&self) -> WorkspaceFs {
        let fs = open_fs(self.dst.path());
        let mut repo = Repo::new(self.remote.clone(), "ws");
        repo.manifest().unwrap();
        fs.set_chunk_source(Arc::new(RemoteChunks::new(repo)));
        fs
    }
}

fn read(fs: &WorkspaceFs, ino: InodeNo, off: u64, len: u64) -> Vec<u8> {
    let mut buf = Vec::new();
    fs.read(ino, off, len as u32, &mut buf).unwrap();
    buf
}

fn windows_of(v: &[u8]) -> u64 {
    (v.len() as u64).div_ceil(CHUNK)
}

fn win(v: &[u8], idx: u64) -> &[u8] {
    let s = (idx * CHUNK) as usize;
    &v[s..(s + CHUNK as usize).min(v.len())]
}

/// Restores the head eagerly elsewhere and dumps it.
fn eager_dump(remote: Arc<dyn Remote>) -> (tempfile::TempDir, BTreeMap<String, String>) {
    let dir = tempfile::tempdir().unwrap();
    restore(&mut Repo::new(remote, "ws"), None, dir.path()).unwrap();
    let fs = open_fs(dir.path());
    let d = dump(&fs);
    drop(fs);
    (dir, d)
}

fn on_demand(inner: Arc<dyn Remote>) {
    let l = Lazy::new(inner);
    let fs = l.open();
    let g0 = l.n();
    let a = resolve(&fs, "lz/a");
    let b = resolve(&fs, "lz/b");
    // The restore created no body for files with stored windows: start time does not grow
    // with the number of files. The first fetch creates it, sparse at the file's size.
    let bodies = keel::chunk::BodyStore::open(&l.dst.path().join(keel::state::BODIES)).unwrap();
    assert_eq!(
        bodies.stat(a.0).unwrap(),
        None,
        "body of a before first use"
    );
    assert_eq!(
        bodies.stat(b.0).unwrap(),
        None,
        "body of b before first use"
    );

    // A random read: exactly its window.
    assert_eq!(read(&fs, a, 3 * CHUNK, CHUNK), win(&a_bytes(), 3));
    assert_eq!(l.n() - g0, 1, "random read of one window");
    let (len, _) = bodies
        .stat(a.0)
        .unwrap()
        .expect("the first fetch created a's body");
    assert_eq!(len, a_bytes().len() as u64);
    assert_eq!(
        read(&fs, a, 3 * CHUNK + 10, 100),
        &win(&a_bytes(), 3)[10..110]
    );
    assert_eq!(l.n() - g0, 1, "a fetched window is not fetched again");

    // A sequential reader: its window plus READAHEAD more, then nothing until it reaches
    // the first window not fetched yet.
    let g1 = l.n();
    assert_eq!(read(&fs, b, 0, CHUNK), win(&b_bytes(), 0));
    assert_eq!(l.n() - g1, 1 + READAHEAD, "sequential read + readahead");
    for i in 1..=READAHEAD {
        assert_eq!(read(&fs, b, i * CHUNK, CHUNK), win(&b_bytes(), i));
    }
    assert_eq!(l.n() - g1, 1 + READAHEAD, "readahead windows were fetched");
    assert_eq!(read(&fs, b, 5 * CHUNK, CHUNK), win(&b_bytes(), 5));
    // Windows 6 and 7 are all that is left of b.
    assert_eq!(l.n() - g1, 8, "each window of b fetched exactly once");

    // One small write: fetches its window first, and the checkpoint after it uploads only
    // that window (everything else keeps its chunk id, fetched or not).
    let g2 = l.n();
    write_at(&fs, a, 7 * CHUNK + 10, b"patch");
    assert_eq!(l.n() - g2, 1, "a partial write fetches its window");
    let mut want_a = a_bytes();
    want_a[(7 * CHUNK + 10) as usize..(7 * CHUNK + 15) as usize].copy_from_slice(b"patch");
    fs.sync_all().unwrap();
    let mut p = persister_loose(l.dst.path(), l.remote.clone());
    let r = checkpoint(&mut p);
    assert_eq!(r.windows_hashed, 1, "{r}");
    assert_eq!(r.chunks_uploaded, 1, "{r}");
    assert_eq!(r.chunk_bytes_uploaded, CHUNK, "{r}");
    drop(p);

    // Reading everything: the original tree (with the patch), each chunk fetched once.
    let got = dump(&fs);
    assert_eq!(fs.missing_windows().unwrap(), 0);
    assert_eq!(
        l.n() - g0,
        l.missing,
        "every stored window fetched exactly once"
    );
    assert_eq!(read_all(&fs, a).unwrap(), want_a);
    let strip = |d: &BTreeMap<String, String>| {
        let mut d = d.clone();
        d.remove("/lz/a");
        d.remove("/lz");
        d
    };
    assert_eq!(strip(&got), strip(&l.want), "lazily restored tree differs");
    assert!(got["/lz/a"].contains(&format!("size={}", want_a.len())));

    // The snapshot taken while most windows were unfetched restores to the same bytes.
    drop(fs);
    let (_d, eager) = eager_dump(l.remote.clone());
    assert_eq!(eager["/lz/a"], got["/lz/a"]);
    assert_eq!(strip(&eager), strip(&l.want));
}

#[test]
fn lazy_restore_fetches_on_demand_mem() {
    on_demand(Arc::new(MemRemote::new()));
}

#[test]
fn lazy_restore_fetches_on_demand_s3() {
    let Some((_moto, port)) = support::s3::start_moto() else {
        return;
    };
    let cfg = support::s3::s3_config(port);
    let repo = keel::persist::open_remote("s3://keel", &cfg).unwrap();
    on_demand(repo.remote.clone());
}

/// A lazily restored file of holes only has no body, and reading it needs none: its open,
/// reads, SEEK_DATA and SEEK_HOLE, stat and close make nothing on the state volume (the
/// read-only open created the body, which fails with ENOSPC on a full volume and EROFS on a
/// read-only one). Its first write makes the body; the bytes read back, and a checkpoint
/// and an eager restore keep them.
#[test]
fn reading_a_lazily_restored_file_of_holes_creates_no_body() {
    let l = Lazy::new(Arc::new(MemRemote::new()));
    let fs = l.open();
    let h = resolve(&fs, "lz/holes");
    let bodies = keel::chunk::BodyStore::open(&l.dst.path().join("bodies")).unwrap();
    assert_eq!(bodies.stat(h.0).unwrap(), None, "the restore made a body");
    let g = l.n();

    let (fh, _) = fs.open(h, libc::O_RDONLY).unwrap();
    assert_eq!(read(&fs, h, 0, HOLES + 100), vec![0u8; HOLES as usize]);
    assert_eq!(read(&fs, h, 2 * CHUNK + 3, 10), vec![0u8; 10]);
    assert_eq!(
        fs.seek(h, 0, true).err().map(|e| e.errno()),
        Some(libc::ENXIO)
    );
    assert_eq!(fs.seek(h, 5, false).unwrap(), 5);
    let a = fs.getattr(h).unwrap();
    assert_eq!((a.inode.size, a.blocks), (HOLES, 0));
    fs.release(fh).unwrap();
    assert_eq!(read_all(&fs, h).unwrap(), vec![0u8; HOLES as usize]);
    assert_eq!(bodies.stat(h.0).unwrap(), None, "reading made a body");
    assert_eq!(l.n(), g, "reading a file of holes fetched chunks");

    // The first write makes the body, sparse but for what it wrote.
    write_at(&fs, h, CHUNK + 1, b"x");
    let mut want = vec![0u8; HOLES as usize];
    want[CHUNK as usize + 1] = b'x';
    assert_eq!(read_all(&fs, h).unwrap(), want);
    let (len, _) = bodies.stat(h.0).unwrap().expect("the write made a body");
    assert_eq!(len, HOLES);
    fs.sync_all().unwrap();
    let mut p = persister_loose(l.dst.path(), l.remote.clone());
    checkpoint(&mut p);
    drop(p);
    drop(fs);
    let (d, _) = eager_dump(l.remote.clone());
    let eager = open_fs(d.path());
    assert_eq!(read_all(&eager, resolve(&eager, "lz/holes")).unwrap(), want);
}

#[test]
fn checkpoint_after_a_crash_never_hashes_unfetched_windows() {
    let l = Lazy::new(Arc::new(MemRemote::new()));
    let mut p = persister_loose(l.dst.path(), l.remote.clone());
    // Mounted, then killed: every body looks modified since the last clean point.
    p.mark_running(true).unwrap();
    let fs = l.open();
    let a = resolve(&fs, "lz/a");
    assert_eq!(read(&fs, a, 0, CHUNK), win(&a_bytes(), 0));
    let missing = fs.missing_windows().unwrap();
    assert_eq!(missing, l.missing - 1 - READAHEAD);
    drop(fs);
    drop(p);

    let mut p = persister_loose(l.dst.path(), l.remote.clone());
    let r = checkpoint(&mut p);
    // Every window of every body was suspect; the unfetched ones kept their ids. Files the
    // crashed mount never touched have no body yet, so nothing of theirs is suspect.
    let fs = open_fs(l.dst.path());
    let bodies = keel::chunk::BodyStore::open(&l.dst.path().join(keel::state::BODIES)).unwrap();
    let (mut windows, mut untouched) = (0, 0);
    for path in ["d/e/big", "sparse", "lz/a", "lz/b", "lz/c"] {
        let ino = resolve(&fs, path);
        let w = fs.getattr(ino).unwrap().inode.size.div_ceil(CHUNK);
        windows += w;
        if bodies.stat(ino.0).unwrap().is_none() {
            untouched += w;
        }
    }
    drop(fs);
    assert!(untouched > 0, "some files were never opened");
    // Untouched files have every window missing or all-zero (not hashed either way).
    let zero_untouched = untouched - (missing - (windows_of(&a_bytes()) - 1 - READAHEAD));
    assert_eq!(r.windows_hashed, windows - missing - zero_untouched, "{r}");
    assert_eq!(r.chunks_uploaded, 0, "{r}");
    let (_d, eager) = eager_dump(l.remote.clone());
    assert_eq!(
        eager, l.want,
        "a checkpoint after a crash changed file data"
    );
}

/// Collects what `tracing` logs on this thread.
#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogBuf {
    type Writer = LogBuf;
    fn make_writer(&'a self) -> LogBuf {
        self.clone()
    }
}

#[test]
fn corrupt_chunk_fails_the_read_with_eio_naming_it() {
    let mem = Arc::new(MemRemote::new());
    let l = Lazy::new(mem.clone());
    let bad = ChunkId::of(win(&a_bytes(), 2));
    let key = Repo::new(mem.clone(), "ws").chunk_key(&bad);
    assert!(mem.keys().contains(&key));
    mem.tamper(&key, |v| {
        let junk = noise(99, v.len());
        v.copy_from_slice(&junk)
    });
    let fs = l.open();
    let a = resolve(&fs, "lz/a");
    let b = resolve(&fs, "lz/b");
    let log = LogBuf::default();
    let sub = tracing_subscriber::fmt()
        .with_writer(log.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(sub, || {
        let mut buf = Vec::new();
        for _ in 0..2 {
            let e = fs.read(a, 2 * CHUNK + 7, 100, &mut buf).unwrap_err();
            assert_eq!(e.errno(), libc::EIO, "{e}");
            assert!(e.to_string().contains(&bad.to_hex()), "{e}");
        }
        // Other windows and files read fine.
        assert_eq!(read(&fs, a, CHUNK, CHUNK), win(&a_bytes(), 1));
        assert_eq!(read_all(&fs, b).unwrap(), b_bytes());
    });
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(&bad.to_hex())).collect();
    assert_eq!(lines.len(), 2, "one line per failed read:\n{text}");
    assert!(
        lines[0].contains("window 2") && lines[0].contains("corrupt"),
        "{}",
        lines[0]
    );
    assert!(fs.missing_windows().unwrap() > 0);
}

#[test]
fn crash_between_body_write_and_record_refetches() {
    let l = Lazy::new(Arc::new(MemRemote::new()));
    let fs = l.open();
    let a = resolve(&fs, "lz/a");
    // Recorded: window 5 (a random read: no readahead), settled as after a read's reply.
    assert_eq!(read(&fs, a, 5 * CHUNK, 10), &win(&a_bytes(), 5)[..10]);
    fs.settle_fetched();
    // Written into the body but never recorded (killed in between): window 1 holds junk.
    let bodies = keel::chunk::BodyStore::open(&l.dst.path().join(keel::state::BODIES)).unwrap();
    let f = bodies.open_rw(a.0).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&vec![0xAA; CHUNK as usize / 2], CHUNK)
        .unwrap();
    drop(f);
    // No clean close.
    drop(fs);

    let fs = l.open();
    let g = l.n();
    let got = read_all(&fs, a).unwrap();
    assert_eq!(got, a_bytes(), "wrong bytes after a crash");
    for i in 0..10 {
        assert!(win(&got, i).iter().any(|b| *b != 0), "window {i} is zeros");
    }
    assert_eq!(l.n() - g, 9, "the recorded window is not fetched again");
}

#[test]
fn truncate_overwrite_and_seek_respect_unfetched_windows() {
    let l = Lazy::new(Arc::new(MemRemote::new()));
    let fs = l.open();
    let a = resolve(&fs, "lz/a");
    let b = resolve(&fs, "lz/b");
    let g = l.n();

    // SEEK_HOLE sees no holes while windows are missing.
    assert_eq!(fs.seek(b, 0, false).unwrap(), b_bytes().len() as u64);
    assert_eq!(fs.seek(b, 100, true).unwrap(), 100);

    // Shrink into window 2 (fetched first, its head kept), then grow again: the windows
    // past the cut are gone (zeros), not fetched.
    let cut = 2 * CHUNK + 100;
    let set = |size| SetAttr {
        size: Some(size),
        ..Default::default()
    };
    fs.setattr(a, &set(cut)).unwrap();
    assert_eq!(l.n() - g, 1, "truncate fetches the window it cuts");
    fs.setattr(a, &set(10 * CHUNK)).unwrap();
    let got = read_all(&fs, a).unwrap();
    assert_eq!(&got[..cut as usize], &a_bytes()[..cut as usize]);
    assert!(got[cut as usize..].iter().all(|b| *b == 0));
    assert_eq!(l.n() - g, 3, "windows 0 and 1 fetched, none past the cut");

    // A write over a whole window needs no fetch; the window stays present after reopen.
    let g = l.n();
    let fill = vec![0x55u8; CHUNK as usize];
    write_at(&fs, b, 3 * CHUNK, &fill);
    assert_eq!(l.n() - g, 0, "a whole-window overwrite fetched");
    assert_eq!(read(&fs, b, 3 * CHUNK, CHUNK), fill);
    assert_eq!(l.n() - g, 0);
    fs.sync_all().unwrap();
    drop(fs);
    let fs = l.open();
    let b = resolve(&fs, "lz/b");
    let mut want = b_bytes();
    want[3 * CHUNK as usize..4 * CHUNK as usize].copy_from_slice(&fill);
    assert_eq!(read_all(&fs, b).unwrap(), want);
    assert_eq!(l.n() - g, 7, "the overwritten window was fetched after all");
}

#[test]
fn fsck_does_not_call_unfetched_windows_corrupt() {
    use keel::persist::fsck::{fsck, FsckOptions, Level};
    let l = Lazy::new(Arc::new(MemRemote::new()));
    let fs = l.open();
    let a = resolve(&fs, "lz/a");
    assert_eq!(read(&fs, a, 4 * CHUNK, 10), &win(&a_bytes(), 4)[..10]);
    fs.shutdown().unwrap();
    drop(fs);
    let opts = FsckOptions {
        repair: false,
        quick: false,
        chunk_size: CHUNK,
        remote: Some(Repo::new(l.remote.clone(), "ws")),
        missing_remote: None,
    };
    let rep = fsck(l.dst.path(), &opts).unwrap();
    let bad: Vec<_> = rep
        .findings
        .iter()
        .filter(|f| f.level != Level::Note)
        .collect();
    assert!(bad.is_empty(), "{bad:?}");
    // It did look at the fetched windows.
    assert!(rep.windows_hashed >= 1, "{rep:?}");
    // A fetched window damaged behind keel's back is still found.
    let bodies = keel::chunk::BodyStore::open(&l.dst.path().join(keel::state::BODIES)).unwrap();
    use std::os::unix::fs::FileExt;
    bodies
        .open_rw(a.0)
        .unwrap()
        .write_all_at(b"damage", 4 * CHUNK)
        .unwrap();
    let rep = fsck(l.dst.path(), &opts).unwrap();
    assert_eq!(rep.count(Level::Error), 1, "{:?}", rep.findings);
}

/// A rollback that makes a lazily restored body file inline again forgets the windows it
/// had left to fetch: reading the file then fetches nothing (it failed, with no chunk
/// source, when they were left listed), writes after a remount do not bring the body's old
/// bytes back, and the checkpoint after names none of the old chunks.
#[test]
fn a_rollback_to_an_inline_file_forgets_its_unfetched_windows() {
    use keel::persist::history::{Changed, View};
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let src = tempfile::tempdir().unwrap();
    let fs = open_fs(src.path());
    let f = write_file(&fs, "f", b"small\n");
    fs.shutdown().unwrap();
    drop(fs);
    let mut p = persister_loose(src.path(), remote.clone());
    let small = checkpoint(&mut p).seq.unwrap();
    drop(p);
    let fs = open_fs(src.path());
    assert_eq!(write_file(&fs, "f", &noise(5, 3 * CHUNK as usize)), f);
    fs.shutdown().unwrap();
    drop(fs);
    let mut p = persister_loose(src.path(), remote.clone());
    let big = checkpoint(&mut p).seq.unwrap();
    drop(p);
    let dst = tempfile::tempdir().unwrap();
    let mut repo = Repo::new(remote.clone(), "ws");
    let r = restore_with(&mut repo, None, dst.path(), RestoreMode::Lazy).unwrap();
    assert_eq!(r.windows_missing, 3, "{r:?}");
    // No chunk source: nothing fetches the windows in the background, and nothing after
    // the rollback needs to (the target's file is inline).
    let fs = Arc::new(open_fs(dst.path()));
    let (cur, target) = (
        repo.load_tree(big).unwrap().0,
        repo.load_tree(small).unwrap().0,
    );
    let changed = Changed::between(&cur, &target);
    let live = keel::boot::live::FuseLive {
        fs: fs.clone(),
        inval: Arc::new(|_: &_| Ok(())),
    };
    keel::persist::agent::LiveTree::roll_back(
        &live,
        &repo,
        &View::of(&cur),
        &View::of(&target),
        &changed,
        None,
    )
    .unwrap();
    // An inline file: nothing to fetch (a window left listed fails this read here, and
    // with a chunk source would be fetched into a body nobody reads).
    assert_eq!(read_all(&fs, f).unwrap(), b"small\n");
    // Mounted again: what is left to fetch comes from the store.
    fs.shutdown().unwrap();
    drop((live, fs));
    let fs = open_fs(dst.path());
    fs.set_chunk_source(Arc::new(RemoteChunks::new(repo.clone())));
    write_at(&fs, f, 1, b"XY");
    assert_eq!(read_all(&fs, f).unwrap(), b"sXYll\n");
    // Past the inline limit: a body again, then written into.
    write_at(&fs, f, 5000, b"far");
    write_at(&fs, f, 3, b"Z");
    let mut want = b"sXYZl\n".to_vec();
    want.resize(5000, 0);
    want.extend_from_slice(b"far");
    assert_eq!(read_all(&fs, f).unwrap(), want);
    fs.shutdown().unwrap();
    drop(fs);
    let mut p = persister_loose(dst.path(), remote.clone());
    let after = checkpoint(&mut p).seq.unwrap();
    let t = repo.load_tree(after).unwrap().0;
    let old: Vec<ChunkId> = noise(5, 3 * CHUNK as usize)
        .chunks(CHUNK as usize)
        .map(ChunkId::of)
        .collect();
    match &t.inodes[&f.0].data {
        keel::persist::format::TreeData::Chunks(m) => {
            assert!(m.iter().flatten().all(|id| !old.contains(id)), "{m:?}");
        }
        other => panic!("f is {other:?}"),
    }
}

/// A lazily restored state dir that finds a head another writer made after its restore (a
/// takeover while it was stopped) still checkpoints: that head is kept as `diverged-N`, the
/// windows not fetched yet are carried over as they are (not fetched, still missing
/// locally), and the new head holds the whole tree.
#[test]
fn a_foreign_head_after_a_lazy_restore_carries_the_unfetched_windows_over() {
    let l = Lazy::new(Arc::new(MemRemote::new()));
    // The other writer: restores the head elsewhere, adds a file, checkpoints.
    let other = tempfile::tempdir().unwrap();
    let mut repo = Repo::new(l.remote.clone(), "ws");
    restore(&mut repo, None, other.path()).unwrap();
    let fs2 = open_fs(other.path());
    write_file(&fs2, "theirs", b"the other writer's\n");
    fs2.shutdown().unwrap();
    drop(fs2);
    let theirs = checkpoint(&mut persister_loose(other.path(), l.remote.clone()))
        .seq
        .unwrap();

    let fs = l.open();
    write_file(&fs, "mine", b"this state dir's\n");
    fs.shutdown().unwrap();
    drop(fs);
    let before = l.n();
    let r = checkpoint(&mut persister_loose(l.dst.path(), l.remote.clone()));
    assert!(r.full, "{r}");
    assert_eq!(l.n(), before, "the checkpoint fetched chunks");
    assert_eq!(
        open_fs(l.dst.path()).missing_windows().unwrap(),
        l.missing,
        "unfetched windows are still missing here"
    );
    assert_eq!(
        keel::persist::snapshots::resolve(&repo, &format!("diverged-{theirs}")).unwrap(),
        theirs
    );
    let (_d, head) = eager_dump(l.remote.clone());
    for (path, was) in &l.want {
        if path != "/" {
            assert_eq!(head.get(path), Some(was), "{path} in the new head");
        }
    }
    assert!(head["/mine"].contains("bytes:17:"), "{}", head["/mine"]);
    assert_eq!(head.len(), l.want.len() + 1, "{:?}", head.keys());
}

/// A rollback that stopped after its transaction committed but before its bodies were
/// renamed into place (a crash in between) is finished at the next start: the body the
/// record names goes into place, its windows are dirty again, the record and the temporary
/// dir go, and the next checkpoint carries the new bytes. (Not lazy: here because these
/// tests drive `WorkspaceFs` without a kernel.)
#[test]
fn a_rollback_stopped_before_its_renames_is_finished_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let fs = open_fs(dir.path());
    let ino = write_file(&fs, "f", &noise(1, 3 * CHUNK as usize));
    fs.shutdown().unwrap();
    drop(fs);
    checkpoint(&mut persister_loose(dir.path(), remote.clone()));
    // What the rollback leaves: the new body built, the record of where it goes committed.
    let tmp = dir.path().join("rollback.tmp");
    std::fs::create_dir(&tmp).unwrap();
    let new = noise(2, 3 * CHUNK as usize);
    std::fs::write(tmp.join(ino.0.to_string()), &new).unwrap();
    let store =
        keel::meta::Store::open(&dir.path().join(keel::state::META_DB), keel::meta::Nanos(1))
            .unwrap();
    let tx = store.write().unwrap();
    tx.persist_set("rollback_renames", &format!("[[{0},{0}]]", ino.0))
        .unwrap();
    tx.commit().unwrap();
    drop(store);

    let fs = open_fs(dir.path());
    assert!(
        read(&fs, ino, 0, 3 * CHUNK) == new,
        "the new body is in place"
    );
    assert!(!tmp.exists());
    let want = dump(&fs);
    fs.shutdown().unwrap();
    drop(fs);
    let r = checkpoint(&mut persister_loose(dir.path(), remote.clone()));
    assert_eq!(r.windows_hashed, 3, "{r}");
    let (_d, got) = eager_dump(remote);
    assert_eq!(got["/f"], want["/f"], "the remote has the new bytes");
    let store =
        keel::meta::Store::open(&dir.path().join(keel::state::META_DB), keel::meta::Nanos(2))
            .unwrap();
    assert_eq!(store.read().persist_get("rollback_renames").unwrap(), None);
}

/// The prefetch's count is the windows it fetched: every stored window, each once (it
/// counted only what a file had left after its first batch, nothing for small files).
#[test]
fn prefetch_counts_every_window_it_fetches() {
    let l = Lazy::new(Arc::new(MemRemote::new()));
    let fs = l.open();
    let g0 = l.n();
    let done = fs
        .prefetch_all(&std::sync::atomic::AtomicBool::new(false), 3)
        .windows;
    assert_eq!(fs.missing_windows().unwrap(), 0);
    assert_eq!(l.n() - g0, l.missing, "each window fetched once");
    assert_eq!(done, l.missing, "the prefetch's own count");
    assert_eq!(dump(&fs), l.want);
}

/// A window a read fetched (its row not settled yet) and a write then changed keeps the
/// write: the write settles the file first, so neither a restart after a crash (which would
/// fetch the old bytes over it) nor a checkpoint (which would take the row's chunk as the
/// window's bytes) goes back to what the remote holds.
#[test]
fn a_fetched_window_written_before_it_settled_keeps_the_write() {
    let l = Lazy::new(Arc::new(MemRemote::new()));
    let fs = l.open();
    let a = resolve(&fs, "lz/a");
    assert_eq!(read(&fs, a, 2 * CHUNK, 10), &win(&a_bytes(), 2)[..10]);
    write_at(&fs, a, 2 * CHUNK + 5, b"changed");
    let mut want = a_bytes();
    want[(2 * CHUNK + 5) as usize..(2 * CHUNK + 12) as usize].copy_from_slice(b"changed");
    fs.fsync(a, false).unwrap();
    // Killed: nothing settled since.
    drop(fs);
    let fs = l.open();
    assert!(
        read_all(&fs, a).unwrap() == want,
        "the write is lost after the crash"
    );
    fs.sync_all().unwrap();
    let mut p = persister_loose(l.dst.path(), l.remote.clone());
    checkpoint(&mut p);
    drop(p);
    drop(fs);
    let (_d, eager) = eager_dump(l.remote.clone());
    let fs = open_fs(_d.path());
    let got = read_all(&fs, resolve(&fs, "lz/a")).unwrap();
    assert!(got == want, "the write is not in the checkpoint");
    drop(eager);
}

/// The prefetch follows the readers: once a read fetched from a file of `lz/`, the other
/// windows of `lz/`'s files are fetched before any other file's, although `d/e/big` and
/// `sparse` come first in inode order (the control: without that read, the prefetch starts
/// with one of them). Two batches are in flight, so one `lz/` window may land after the
/// first other one; never more.
#[test]
fn prefetch_takes_the_directory_a_reader_fetched_from_first() {
    let stop = std::sync::atomic::AtomicBool::new(false);
    // The chunks of lz/'s files (content-addressed: the same keys in every `Lazy`).
    let lz: std::collections::HashSet<String> = {
        let l = Lazy::new(Arc::new(MemRemote::new()));
        let fs = l.open();
        for p in ["lz/a", "lz/b", "lz/c"] {
            read_all(&fs, resolve(&fs, p)).unwrap();
        }
        let keys = l.keys.lock().unwrap().clone();
        keys.into_iter().collect()
    };
    assert!(lz.len() > 10, "{}", lz.len());

    let control = Lazy::new(Arc::new(MemRemote::new()));
    let fs = control.open();
    let mark = control.keys.lock().unwrap().len();
    fs.prefetch_all(&stop, 1);
    let first = control.keys.lock().unwrap()[mark].clone();
    assert!(
        !lz.contains(&first),
        "inode order starts in lz/: the test shows nothing"
    );
    drop(fs);

    let l = Lazy::new(Arc::new(MemRemote::new()));
    let fs = l.open();
    let a = resolve(&fs, "lz/a");
    assert_eq!(read(&fs, a, 5 * CHUNK, 10), &win(&a_bytes(), 5)[..10]);
    let mark = l.keys.lock().unwrap().len();
    let r = fs.prefetch_all(&stop, 1);
    assert_eq!(fs.missing_windows().unwrap(), 0);
    assert_eq!(dump(&fs), l.want);
    let got = l.keys.lock().unwrap()[mark..].to_vec();
    assert_eq!(got.len() as u64, r.windows, "each window fetched once");
    let other = got
        .iter()
        .position(|k| !lz.contains(k))
        .expect("other files were fetched too");
    let late: Vec<_> = got[other..].iter().filter(|k| lz.contains(*k)).collect();
    assert!(
        late.len() <= 1,
        "{} windows of lz/ were fetched after another file's (order: {:?})",
        late.len(),
        got.iter().map(|k| lz.contains(k)).collect::<Vec<_>>()
    );
}

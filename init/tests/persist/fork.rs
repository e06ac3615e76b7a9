//! Forks: `fork` makes a workspace from another's head without copying chunks; both sides
//! then diverge and each restores to exactly its own tree; gc of the origin keeps what the
//! fork (and a fork of the fork) needs and deletes what nobody needs; gc of a fork leaves
//! the origin's chunks alone; the refusals say what is wrong. Over `file://` URLs (one
//! store root per workspace directory) and over real S3 (moto), plus the `keel fork` CLI.

use crate::support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use keel::chunk::ChunkId;
use keel::config::PersistConfig;
use keel::persist::fork::{delete_fork, fork};
use keel::persist::fsck::{fsck, FsckOptions};
use keel::persist::remote::PutMode;
use keel::persist::{
    gc, open_remote, restore, CheckpointOptions, Counted, Persister, Remote, Repo,
};
use support::persist::*;

fn open(url: &str, cfg: &PersistConfig) -> (Repo, Arc<Counted>) {
    let r = open_remote(url, cfg).unwrap_or_else(|e| panic!("open {url}: {e}"));
    let c = Arc::new(Counted::new(r.remote.clone()));
    let mut repo = Repo::new(c.clone(), r.ws());
    repo.manifest().unwrap();
    (repo, c)
}

/// Restores the head of `url` into a fresh dir: (dir, dump).
fn restore_dump(url: &str, cfg: &PersistConfig) -> (tempfile::TempDir, BTreeMap<String, String>) {
    let dir = tempfile::tempdir().unwrap();
    let (mut repo, _) = open(url, cfg);
    restore::restore(&mut repo, None, dir.path()).unwrap_or_else(|e| panic!("restore {url}: {e}"));
    let fs = open_fs(dir.path());
    let d = dump(&fs);
    drop(fs);
    (dir, d)
}

fn fsck_clean(dir: &Path, url: &str, cfg: &PersistConfig) {
    let (repo, _) = open(url, cfg);
    let r = fsck(
        dir,
        &FsckOptions {
            chunk_size: CHUNK,
            remote: Some(repo),
            ..Default::default()
        },
    )
    .unwrap();
    let f: Vec<_> = r.findings.iter().map(|f| &f.what).collect();
    assert!(r.is_clean(), "fsck of {url}: {f:?}");
    assert!(r.chunks_checked > 0, "fsck checked no remote chunk");
}

fn window_ids(data: &[u8]) -> Vec<ChunkId> {
    data.chunks(CHUNK as usize).map(ChunkId::of).collect()
}

/// How many of `ids` the chunk store holds, as their own objects or in a pack.
fn present(repo: &Repo, ids: &[ChunkId]) -> usize {
    let packed = repo.load_packs(None).unwrap();
    ids.iter()
        .filter(|id| {
            packed.contains(id) || repo.remote.head(&repo.chunk_key(id)).unwrap().is_some()
        })
        .count()
}

/// Distinct chunks on the chunk store (own objects and packed).
fn chunk_count(repo: &Repo) -> usize {
    let mut ids: std::collections::HashSet<ChunkId> = repo
        .list_chunks()
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    ids.extend(repo.load_packs(None).unwrap().ids());
    ids.len()
}

fn gc_now(repo: &Repo, p: &Persister) -> gc::GcReport {
    let mut r = repo.clone();
    gc::gc(&mut r, Some(p.store()), 1, Duration::ZERO).expect("gc")
}

fn scenario(url: impl Fn(&str) -> String, cfg: &PersistConfig) {
    let (o_url, f_url, g_url) = (url("origin"), url("fork"), url("fork2"));
    let (origin, oc) = open(&o_url, cfg);

    // The origin: a rich tree plus files the later steps follow by chunk id.
    let a = tempfile::tempdir().unwrap();
    let fs_a = open_fs(a.path());
    build_rich_tree(&fs_a);
    let keep = noise(7, 4 * CHUNK as usize);
    let doomed = noise(8, 3 * CHUNK as usize);
    write_file(&fs_a, "keep.bin", &keep);
    write_file(&fs_a, "doomed.bin", &doomed);
    let mut pa = Persister::open(a.path(), origin.clone(), params()).unwrap();
    checkpoint(&mut pa);
    let at_fork = dump(&fs_a);

    // Fork: four small objects, no chunk.
    let (mut fork_repo, fc) = open(&f_url, cfg);
    let chunks_before = chunk_count(&origin);
    let (o0, f0) = (oc.counts(), fc.counts());
    let r = fork(&mut origin.clone(), &mut fork_repo, None).expect("fork");
    let puts = oc.counts().since(&o0).puts + fc.counts().since(&f0).puts;
    assert_eq!(r.seq, 1);
    assert_eq!(puts, 4, "manifest, fork record, snapshot, head");
    assert_eq!(chunk_count(&origin), chunks_before, "fork copied chunks");
    assert_eq!(r.chunks as usize, chunks_before, "{r:?}");
    fork_repo.manifest().unwrap();
    assert_eq!(chunk_count(&fork_repo), chunks_before);

    // The fork restores to the origin's tree; it lists its snapshot.
    let b = tempfile::tempdir().unwrap();
    restore::restore(&mut fork_repo.clone(), None, b.path()).expect("restore fork");
    let fs_b = open_fs(b.path());
    assert_eq!(dump(&fs_b), at_fork);
    let snaps = fork_repo.list_snapshots().unwrap();
    assert_eq!(snaps.len(), 1);
    assert!(fork_repo.read_header(1).unwrap().is_full());

    // Diverge. Origin: new file, rewrite a window, delete a file the fork keeps.
    let a_only = noise(11, 2 * CHUNK as usize);
    write_file(&fs_a, "a_only", &a_only);
    write_at(&fs_a, resolve(&fs_a, "keep.bin"), 0, &noise(12, 100));
    fs_a.unlink(keel::meta::InodeNo::ROOT, b"doomed.bin")
        .unwrap();
    checkpoint(&mut pa);
    // Fork: a new file and a changed small one; only the new windows are uploaded.
    let mut pb = Persister::open(b.path(), fork_repo.clone(), params()).unwrap();
    let b_only = noise(21, 2 * CHUNK as usize);
    write_file(&fs_b, "b_only", &b_only);
    write_file(&fs_b, "d/small", b"the fork says hi");
    let rb = checkpoint(&mut pb);
    assert!(!rb.full, "{rb}");
    assert_eq!(rb.chunks_uploaded, 2, "{rb}");
    let (dump_a, dump_b) = (dump(&fs_a), dump(&fs_b));
    assert_ne!(dump_a, dump_b);
    assert_eq!(restore_dump(&o_url, cfg).1, dump_a);
    assert_eq!(restore_dump(&f_url, cfg).1, dump_b);

    // Garbage on the origin: a file written, checkpointed, removed, compacted away.
    let tmp = noise(31, 2 * CHUNK as usize);
    write_file(&fs_a, "tmp.bin", &tmp);
    checkpoint(&mut pa);
    fs_a.unlink(keel::meta::InodeNo::ROOT, b"tmp.bin").unwrap();
    pa.checkpoint(&CheckpointOptions {
        full: true,
        ..Default::default()
    })
    .unwrap();
    let dump_a = dump(&fs_a);
    assert_eq!(present(&origin, &window_ids(&tmp)), 2);

    // gc of the origin: drops its old snapshots and the garbage, keeps what the fork uses.
    let g = gc_now(&origin, &pa);
    assert_eq!(g.sharing, 1, "{g}");
    assert!(g.warnings.is_empty(), "{g}");
    assert!(g.snapshots_deleted >= 3, "{g}");
    assert!(g.chunks_deleted >= 2, "{g}");
    assert_eq!(present(&origin, &window_ids(&tmp)), 0, "garbage kept");
    assert_eq!(
        present(&origin, &window_ids(&doomed)),
        3,
        "fork's chunks deleted"
    );
    assert_eq!(
        present(&origin, &window_ids(&keep)),
        4,
        "fork's old window deleted"
    );
    let (fb, d) = restore_dump(&f_url, cfg);
    assert_eq!(d, dump_b);
    fsck_clean(fb.path(), &f_url, cfg);

    // gc of the fork: the origin's own chunks stay.
    let g = gc_now(&fork_repo, &pb);
    assert_eq!(g.sharing, 1, "{g}");
    assert_eq!(
        present(&origin, &window_ids(&a_only)),
        2,
        "origin's chunks deleted"
    );
    let (fa, d) = restore_dump(&o_url, cfg);
    assert_eq!(d, dump_a);
    fsck_clean(fa.path(), &o_url, cfg);

    // A fork of the fork shares the root store and registers there.
    let (mut fork2, _) = open(&g_url, cfg);
    let r2 = fork(&mut fork_repo.clone(), &mut fork2, None).expect("fork of a fork");
    assert_eq!(r2.seq, 2);
    fork2.manifest().unwrap();
    assert_eq!(chunk_count(&fork2), chunk_count(&origin));
    assert_eq!(restore_dump(&g_url, cfg).1, dump_b);
    let g = gc_now(&origin, &pa);
    assert_eq!(g.sharing, 2, "{g}");

    // Delete the middle fork: fork2 still holds b_only, so gc keeps it.
    delete_fork(&mut fork_repo.clone()).expect("delete fork");
    let g = gc_now(&origin, &pa);
    assert_eq!(g.sharing, 1, "{g}");
    assert!(g.warnings.is_empty(), "{g}");
    assert_eq!(present(&origin, &window_ids(&b_only)), 2);
    let (fg, d) = restore_dump(&g_url, cfg);
    assert_eq!(d, dump_b);
    fsck_clean(fg.path(), &g_url, cfg);
    assert!(restore::restore(
        &mut open(&f_url, cfg).0,
        None,
        tempfile::tempdir().unwrap().path()
    )
    .is_err());

    // A registered fork whose manifest vanished is ignored with a warning; what only it
    // used goes.
    fork2
        .remote
        .delete(&fork2.key("keel-workspace.json"))
        .unwrap();
    let g = gc_now(&origin, &pa);
    assert_eq!(g.sharing, 0, "{g}");
    assert_eq!(g.warnings.len(), 1, "{g}");
    assert!(g.warnings[0].contains("no longer exists"), "{g}");
    assert_eq!(present(&origin, &window_ids(&b_only)), 0);
    assert_eq!(restore_dump(&o_url, cfg).1, dump_a);

    // Refusals.
    let (mut again, _) = open(&o_url, cfg);
    let e = fork(&mut again, &mut open(&url("fork3"), cfg).0, Some(1)).unwrap_err();
    assert!(e.to_string().contains("read source snapshot 1"), "{e}");
    let (mut f3, _) = open(&url("fork3"), cfg);
    fork(&mut again, &mut f3, None).expect("fork3");
    let e = fork(&mut again, &mut open(&url("fork3"), cfg).0, None).unwrap_err();
    assert!(e.to_string().contains("already holds a workspace"), "{e}");
    let e = fork(&mut again, &mut open(&o_url, cfg).0, None).unwrap_err();
    assert!(e.to_string().contains("already holds a workspace"), "{e}");
    let (mut empty, _) = open(&url("empty"), cfg);
    let e = fork(&mut empty, &mut open(&url("x"), cfg).0, None).unwrap_err();
    assert!(e.to_string().contains("holds no keel workspace"), "{e}");
    empty.ensure_manifest(1).unwrap();
    let e = fork(&mut empty, &mut open(&url("x"), cfg).0, None).unwrap_err();
    assert!(e.to_string().contains("no head"), "{e}");
    let e = delete_fork(&mut again).unwrap_err();
    assert!(e.to_string().contains("not a fork"), "{e}");
    drop(fs_a);
    drop(fs_b);
}

#[test]
fn fork_file_urls() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path().to_path_buf();
    let cfg = PersistConfig::default();
    scenario(|n| format!("file://{}/{n}", r.display()), &cfg);
    // Forks reach the chunk store of their origin by a relative path.
    let m = std::fs::read_to_string(r.join("fork3/keel-workspace.json")).unwrap();
    assert!(m.contains("\"../origin/chunks\""), "{m}");
    // A bucket is another store.
    let (mut o, _) = open(&format!("file://{}/origin", r.display()), &cfg);
    let mut s3 = open_remote("s3://keel/fork", &cfg).unwrap();
    let e = fork(&mut o, &mut s3, None).unwrap_err().to_string();
    assert!(e.contains("same bucket"), "{e}");
}

#[test]
fn fork_s3() {
    let Some((_moto, port)) = support::s3::start_moto() else {
        return;
    };
    let cfg = support::s3::s3_config(port);
    scenario(
        |n| match n {
            "origin" => "s3://keel/team/origin".into(),
            n => format!("s3://keel/forks-of-origin/{n}"),
        },
        &cfg,
    );
    let (f3, _) = open("s3://keel/forks-of-origin/fork3", &cfg);
    assert_eq!(f3.chunks(), "team/origin/chunks");
    let (mut o, _) = open("s3://keel/team/origin", &cfg);
    let mut other = open_remote("s3://elsewhere/fork", &cfg).unwrap();
    let e = fork(&mut o, &mut other, None).unwrap_err().to_string();
    assert!(e.contains("same bucket"), "{e}");
}

/// A fork in the making (record written, no head yet) pins the source snapshot it is made
/// from against the source's gc.
#[test]
fn pending_fork_pins_its_source_snapshot() {
    let root = tempfile::tempdir().unwrap();
    let cfg = PersistConfig::default();
    let url = format!("file://{}/origin", root.path().display());
    let (origin, _) = open(&url, &cfg);
    let a = tempfile::tempdir().unwrap();
    let fs = open_fs(a.path());
    let first = noise(3, 2 * CHUNK as usize);
    write_file(&fs, "f", &first);
    let mut p = Persister::open(a.path(), origin.clone(), params()).unwrap();
    checkpoint(&mut p);
    // The fork's first two steps, by hand: manifest and record.
    let pending = root.path().join("pending");
    std::fs::create_dir_all(&pending).unwrap();
    std::fs::write(
        pending.join("keel-workspace.json"),
        r#"{"format":1,"id":"p1","chunks":"../origin/chunks","created_ns":1}"#,
    )
    .unwrap();
    std::fs::create_dir_all(root.path().join("origin/forks")).unwrap();
    std::fs::write(
        root.path().join("origin/forks/p1"),
        r#"{"id":"p1","path":"../pending","from":"","from_seq":1,"created_ns":1}"#,
    )
    .unwrap();
    for i in 0..3u64 {
        write_file(&fs, "f", &noise(100 + i, 100));
        p.checkpoint(&CheckpointOptions {
            full: true,
            ..Default::default()
        })
        .unwrap();
    }
    let g = gc_now(&origin, &p);
    let left: Vec<u64> = origin
        .list_snapshots()
        .unwrap()
        .iter()
        .map(|s| s.0)
        .collect();
    assert_eq!(left, vec![1, 4], "{g}");
    assert_eq!(present(&origin, &window_ids(&first)), 2, "{g}");
    // Once the pending fork is gone, its pin goes too.
    std::fs::remove_file(pending.join("keel-workspace.json")).unwrap();
    let g = gc_now(&origin, &p);
    assert_eq!(g.warnings.len(), 1, "{g}");
    let left: Vec<u64> = origin
        .list_snapshots()
        .unwrap()
        .iter()
        .map(|s| s.0)
        .collect();
    assert_eq!(left, vec![4], "{g}");
    assert_eq!(present(&origin, &window_ids(&first)), 0, "{g}");
    drop(fs);
}

/// A hook run once, just before the first `op` ("put" or "head") on a key containing `at`
/// through the `Tap` that `hooked` makes: another process acting at the worst moment.
type HookFn = (&'static str, String, Box<dyn FnOnce() + Send>);

#[derive(Default)]
struct Hook(Mutex<Option<HookFn>>);

impl Hook {
    fn arm(&self, op: &'static str, at: &str, f: impl FnOnce() + Send + 'static) {
        *self.0.lock().unwrap() = Some((op, at.to_string(), Box::new(f)));
    }
    fn fire(&self, op: &str, key: &str) {
        let mut h = self.0.lock().unwrap();
        if h.as_ref()
            .is_some_and(|(o, at, _)| *o == op && key.contains(at.as_str()))
        {
            let (_, _, f) = h.take().unwrap();
            drop(h);
            f();
        }
    }
    fn fired(&self) -> bool {
        self.0.lock().unwrap().is_none()
    }
}

/// `inner` behind a `Tap` that runs the returned hook.
fn hooked(inner: Arc<dyn Remote>) -> (Arc<Tap>, Arc<Hook>) {
    let hook = Arc::new(Hook::default());
    let h = hook.clone();
    (Tap::new(inner, move |op, key| h.fire(op, key)), hook)
}

/// Gives the objects `keys` of `repo`'s store (a `file://` one) this modification time.
fn set_age(repo: &Repo, keys: &[String], t: SystemTime) {
    let root = repo.describe();
    let root = Path::new(root.strip_prefix("file://").unwrap());
    for k in keys {
        std::fs::File::options()
            .write(true)
            .open(root.join(k))
            .and_then(|f| f.set_modified(t))
            .unwrap_or_else(|e| panic!("set mtime of {k}: {e}"));
    }
}

/// Places `data`'s windows in `repo`'s chunk store as chunks no snapshot names (dropped by
/// every snapshot, or left by a checkpoint that died), two hours old. Their keys.
fn stale_chunks(repo: &Repo, data: &[u8]) -> Vec<String> {
    let keys: Vec<String> = window_ids(data)
        .iter()
        .map(|id| repo.chunk_key(id))
        .collect();
    for (k, w) in keys.iter().zip(data.chunks(CHUNK as usize)) {
        repo.remote
            .put(k, Bytes::copy_from_slice(w), PutMode::Create)
            .unwrap();
    }
    set_age(repo, &keys, SystemTime::now() - Duration::from_secs(7200));
    keys
}

const GRACE: Duration = Duration::from_secs(3600);

/// An origin workspace at `<root>/origin`, seen through a `hooked` tap, with one file
/// `first` checkpointed, and a fork of it at `<root>/fork`.
struct Forked {
    root: tempfile::TempDir,
    cfg: PersistConfig,
    o_url: String,
    hook: Arc<Hook>,
    origin: Repo,
    fork_repo: Repo,
    /// The origin's state dir.
    dir: tempfile::TempDir,
    fs: keel::workspace::fs::WorkspaceFs,
    p: Persister,
}

fn origin_and_fork(first: &[u8]) -> Forked {
    let root = tempfile::tempdir().unwrap();
    let cfg = PersistConfig::default();
    let o_url = format!("file://{}/origin", root.path().display());
    let f_url = format!("file://{}/fork", root.path().display());
    let plain = open_remote(&o_url, &cfg).unwrap();
    let (tapped, hook) = hooked(plain.remote.clone());
    let mut origin = Repo::new(tapped, plain.ws());
    origin.manifest().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    write_file(&fs, "first", first);
    let mut p = Persister::open(dir.path(), origin.clone(), params()).unwrap();
    checkpoint(&mut p);
    let (mut fork_repo, _) = open(&f_url, &cfg);
    fork(&mut origin.clone(), &mut fork_repo, None).expect("fork");
    Forked {
        root,
        cfg,
        o_url,
        hook,
        origin,
        fork_repo,
        dir,
        fs,
        p,
    }
}

/// Checkpoints with the fork's gc run after the chunks are checked and before the snapshot
/// is written: (the checkpoint's report, the gc's).
fn checkpoint_racing_gc(
    p: &mut Persister,
    hook: &Hook,
    fork_repo: &Repo,
) -> (keel::persist::CheckpointReport, gc::GcReport) {
    checkpoint_racing_gc_after(p, hook, fork_repo, || {})
}

/// [`checkpoint_racing_gc`], with `before` run just before the gc.
fn checkpoint_racing_gc_after(
    p: &mut Persister,
    hook: &Hook,
    fork_repo: &Repo,
    before: impl Fn() + Send + Sync + 'static,
) -> (keel::persist::CheckpointReport, gc::GcReport) {
    let report = Arc::new(Mutex::new(None));
    let (r, mut g) = (report.clone(), fork_repo.clone());
    hook.arm("put", "snapshots/", move || {
        before();
        *r.lock().unwrap() = Some(gc::gc(&mut g, None, 1, GRACE).expect("fork gc"));
    });
    let c = checkpoint(p);
    assert!(hook.fired());
    let g = report.lock().unwrap().take().unwrap();
    (c, g)
}

/// A checkpoint that finds a chunk already in the store but unreferenced and old (so past
/// gc's grace window) refreshes it: a gc of a workspace sharing the store, running between
/// the chunk uploads and the new head, leaves it alone, and the new snapshot restores.
#[test]
fn a_checkpoint_reusing_an_old_unreferenced_chunk_survives_a_sharing_gc() {
    let Forked {
        root: _root,
        cfg,
        o_url,
        hook,
        origin,
        fork_repo,
        dir: _dir,
        fs,
        mut p,
    } = origin_and_fork(&noise(40, 2 * CHUNK as usize));

    let data = noise(41, 2 * CHUNK as usize);
    let keys = stale_chunks(&origin, &data);
    write_file(&fs, "again", &data);
    let (c, g) = checkpoint_racing_gc(&mut p, &hook, &fork_repo);
    let (dir, got) = restore_dump(&o_url, &cfg);
    assert_eq!(got, dump(&fs));
    fsck_clean(dir.path(), &o_url, &cfg);
    assert_eq!(present(&origin, &window_ids(&data)), 2, "{g}");
    assert_eq!((g.chunks_deleted, g.young_skipped), (0, 2), "{g}");
    assert_eq!((c.chunks_uploaded, c.chunks_refreshed), (0, 2), "{c}");

    // Chunks the last snapshot names are not refreshed: that snapshot protects them.
    set_age(
        &origin,
        &keys,
        SystemTime::now() - Duration::from_secs(7200),
    );
    write_file(&fs, "third", &data);
    let c = checkpoint(&mut p);
    assert_eq!((c.chunks_uploaded, c.chunks_refreshed), (0, 0), "{c}");
    // Nothing pins them for good: once nothing names them, gc takes them.
    fs.unlink(keel::meta::InodeNo::ROOT, b"again").unwrap();
    fs.unlink(keel::meta::InodeNo::ROOT, b"third").unwrap();
    p.checkpoint(&CheckpointOptions {
        full: true,
        ..Default::default()
    })
    .unwrap();
    let g = gc_now(&origin, &p);
    assert!(g.chunks_deleted >= 2, "{g}");
    assert_eq!(present(&origin, &window_ids(&data)), 0, "{g}");
    drop(fs);
}

/// A checkpoint that outlasts gc's grace window on a shared chunk store: the chunks it
/// uploaded first are older than the window before its snapshot names them. Its in-flight
/// marker keeps the gc of a workspace sharing the store from taking them, and goes once the
/// head names them.
#[test]
fn a_checkpoint_longer_than_the_grace_window_keeps_its_chunks_from_a_sharing_gc() {
    let Forked {
        root: _root,
        cfg,
        o_url,
        hook,
        origin,
        fork_repo,
        dir: _dir,
        fs,
        mut p,
    } = origin_and_fork(&noise(50, 2 * CHUNK as usize));
    let data = noise(51, 2 * CHUNK as usize);
    let keys: Vec<String> = window_ids(&data)
        .iter()
        .map(|id| origin.chunk_key(id))
        .collect();
    write_file(&fs, "long", &data);
    let o = origin.clone();
    let (c, g) = checkpoint_racing_gc_after(&mut p, &hook, &fork_repo, move || {
        // As if the pass began three hours ago and uploaded its chunks two hours ago.
        let marker = o
            .remote
            .get(&o.in_flight_key())
            .expect("an in-flight marker");
        let mut m: keel::persist::fork::InFlight = serde_json::from_slice(&marker).unwrap();
        m.started_ns -= 3 * 3600 * 1_000_000_000;
        o.remote
            .put(
                &o.in_flight_key(),
                Bytes::from(serde_json::to_vec(&m).unwrap()),
                PutMode::Overwrite,
            )
            .unwrap();
        set_age(&o, &keys, SystemTime::now() - Duration::from_secs(7200));
    });
    assert_eq!(c.chunks_uploaded, 2, "{c}");
    assert_eq!((g.chunks_deleted, g.young_skipped), (0, 2), "{g}");
    let (dir, got) = restore_dump(&o_url, &cfg);
    assert_eq!(got, dump(&fs));
    fsck_clean(dir.path(), &o_url, &cfg);
    assert!(
        origin
            .remote
            .head(&origin.in_flight_key())
            .unwrap()
            .is_none(),
        "the marker outlived the checkpoint"
    );
    drop(fs);
}

/// The chunks of a file unlinked while still open stay in its local chunk map, but no
/// snapshot after the unlink names them: a checkpoint reusing them refreshes them too.
#[test]
fn chunks_only_an_open_unlinked_file_maps_are_refreshed_when_reused() {
    let Forked {
        root: _root,
        cfg,
        o_url,
        hook,
        origin,
        fork_repo,
        dir: _dir,
        fs,
        mut p,
    } = origin_and_fork(&noise(60, CHUNK as usize));
    // A file checkpointed, then unlinked while open; compacted away on the origin.
    let data = noise(61, 2 * CHUNK as usize);
    let ino = write_file(&fs, "doomed", &data);
    checkpoint(&mut p);
    let (fh, _) = fs.open(ino, libc::O_RDONLY).unwrap();
    fs.unlink(keel::meta::InodeNo::ROOT, b"doomed").unwrap();
    p.checkpoint(&CheckpointOptions {
        full: true,
        ..Default::default()
    })
    .unwrap();
    gc_now(&origin, &p);
    let keys: Vec<String> = window_ids(&data)
        .iter()
        .map(|id| origin.chunk_key(id))
        .collect();
    assert_eq!(
        present(&origin, &window_ids(&data)),
        2,
        "the open file's map keeps them"
    );
    set_age(
        &origin,
        &keys,
        SystemTime::now() - Duration::from_secs(7200),
    );
    // The same bytes again, with the fork's gc at the worst moment.
    write_file(&fs, "again", &data);
    let (c, g) = checkpoint_racing_gc(&mut p, &hook, &fork_repo);
    let (dir, got) = restore_dump(&o_url, &cfg);
    assert_eq!(got, dump(&fs));
    fsck_clean(dir.path(), &o_url, &cfg);
    assert_eq!(g.chunks_deleted, 0, "{g}");
    assert_eq!(c.chunks_refreshed, 2, "{c}");
    fs.release(fh).unwrap();
    drop(fs);
}

/// gc looks at an object's age again right before deleting it: a chunk refreshed by a
/// checkpoint after gc listed the store stays.
#[test]
fn gc_spares_a_chunk_refreshed_after_it_listed_the_store() {
    let root = tempfile::tempdir().unwrap();
    let cfg = PersistConfig::default();
    let o_url = format!("file://{}/origin", root.path().display());
    let (origin, _) = open(&o_url, &cfg);
    let a = tempfile::tempdir().unwrap();
    let fs = open_fs(a.path());
    write_file(&fs, "f", &noise(50, CHUNK as usize));
    let mut p = Persister::open(a.path(), origin.clone(), params()).unwrap();
    checkpoint(&mut p);
    let data = noise(51, 2 * CHUNK as usize);
    let keys = stale_chunks(&origin, &data);
    let (tapped, hook) = hooked(origin.remote.clone());
    let mut g = Repo::new(tapped, origin.ws());
    let (o, k) = (origin.clone(), keys[0].clone());
    hook.arm("head", &keys[0], move || {
        set_age(&o, &[k], SystemTime::now());
    });
    let r = gc::gc(&mut g, Some(p.store()), 1, GRACE).unwrap();
    assert!(hook.fired(), "{r}");
    assert_eq!((r.chunks_deleted, r.young_skipped), (1, 1), "{r}");
    assert_eq!(present(&origin, &window_ids(&data)), 1, "{r}");
    drop(fs);
}

/// An origin at `<root>/origin` (seen through a `hooked` tap) whose snapshot 1 holds
/// `doomed` (three chunks) and whose snapshot 2, the head, a full one, no longer does; the
/// origin's state dir stays open. The snapshot object 1 and the chunks of `doomed` are made
/// two hours old (past `GRACE`) when `age_snapshot` says so, else only the chunks.
struct Dropped {
    root: tempfile::TempDir,
    cfg: PersistConfig,
    plain: Repo,
    hook: Arc<Hook>,
    origin: Repo,
    doomed: Vec<u8>,
    at_1: BTreeMap<String, String>,
    _dir: tempfile::TempDir,
    fs: keel::workspace::fs::WorkspaceFs,
    p: Persister,
}

fn dropped_snapshot(age_snapshot: bool) -> Dropped {
    let root = tempfile::tempdir().unwrap();
    let cfg = PersistConfig::default();
    let o_url = format!("file://{}/origin", root.path().display());
    let mut plain = open_remote(&o_url, &cfg).unwrap();
    plain.manifest().unwrap();
    let (tapped, hook) = hooked(plain.remote.clone());
    let mut origin = Repo::new(tapped, plain.ws());
    origin.manifest().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    write_file(&fs, "stays", &noise(70, CHUNK as usize));
    let doomed = noise(71, 3 * CHUNK as usize);
    write_file(&fs, "doomed", &doomed);
    let mut p = Persister::open(dir.path(), origin.clone(), params()).unwrap();
    assert_eq!(checkpoint(&mut p).seq, Some(1));
    let at_1 = dump(&fs);
    fs.unlink(keel::meta::InodeNo::ROOT, b"doomed").unwrap();
    let r = p
        .checkpoint(&CheckpointOptions {
            full: true,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(r.seq, Some(2));
    let mut old: Vec<String> = window_ids(&doomed)
        .iter()
        .map(|id| origin.chunk_key(id))
        .collect();
    if age_snapshot {
        old.push(origin.snapshot_key(1));
    }
    set_age(&origin, &old, SystemTime::now() - Duration::from_secs(7200));
    Dropped {
        root,
        cfg,
        plain,
        hook,
        origin,
        doomed,
        at_1,
        _dir: dir,
        fs,
        p,
    }
}

/// `keel fork --seq 1` while a gc of the origin that drops snapshot 1 runs: the gc read the
/// fork records before the fork registered, and reaches snapshot 1 just as the fork begins.
/// The fork waits for that gc to end, then finds snapshot 1 gone and makes no fork; it never
/// names chunks the gc deletes. (Before, it read snapshot 1 at once, and the gc then deleted
/// the chunks of `doomed` under the finished fork.) A fork of the head in the same race waits
/// too, and is whole.
#[test]
fn a_fork_racing_a_gc_of_its_source_never_names_a_chunk_that_gc_deletes() {
    let Dropped {
        root,
        cfg,
        plain,
        hook,
        origin,
        doomed,
        at_1: _,
        _dir,
        fs,
        p,
    } = dropped_snapshot(true);
    let f_url = format!("file://{}/fork", root.path().display());
    for seq in [1u64, 2] {
        // What the fork does, seen from the test: it finished, or it is waiting for the gc
        // (it reads the gc's marker).
        let state: Arc<(Mutex<Option<&'static str>>, std::sync::Condvar)> = Arc::default();
        let tell = |state: &Arc<(Mutex<Option<&'static str>>, std::sync::Condvar)>, what| {
            *state.0.lock().unwrap() = Some(what);
            state.1.notify_all();
        };
        let st = state.clone();
        let watched = Tap::new(plain.remote.clone(), move |op, key| {
            if op == "get" && key.contains("gc-running/") {
                tell(&st, "waits");
            }
        });
        let mut src = Repo::new(watched, plain.ws());
        src.manifest().unwrap();
        let (mut dst, _) = open(&format!("{f_url}{seq}"), &cfg);
        let forked = Arc::new(Mutex::new(None));
        let (out, st) = (forked.clone(), state.clone());
        // The gc is about to delete snapshot 1 (the second round: an old chunk nothing
        // names, as a checkpoint that died leaves).
        let at = if seq == 1 {
            origin.snapshot_key(1)
        } else {
            stale_chunks(&origin, &noise(72, CHUNK as usize)).remove(0)
        };
        hook.arm("head", &at, move || {
            let t = std::thread::spawn(move || {
                let r = fork(&mut src, &mut dst, Some(seq));
                tell(&st, "done");
                r
            });
            let (m, cv) = &*state;
            let g = cv
                .wait_timeout_while(m.lock().unwrap(), Duration::from_secs(120), |s| s.is_none())
                .unwrap()
                .0;
            assert!(g.is_some(), "the fork neither finished nor waited");
            *out.lock().unwrap() = Some(t);
        });
        let g = gc::gc(&mut origin.clone(), Some(p.store()), 1, GRACE).expect("gc");
        assert!(hook.fired(), "{g}");
        let t = forked.lock().unwrap().take().unwrap();
        let r = t.join().unwrap();
        if seq == 1 {
            assert_eq!(g.snapshots_deleted, 1, "{g}");
            assert_eq!(present(&origin, &window_ids(&doomed)), 0, "{g}");
            let e = r.expect_err("a fork of a snapshot the gc took was made");
            assert!(
                matches!(
                    e,
                    keel::persist::fork::ForkError::LoadSnapshot { seq: 1, .. }
                ),
                "{e}"
            );
            // Nothing of it is left: no manifest, no record.
            assert!(!root.path().join("fork1/keel-workspace.json").exists());
            assert_eq!(
                std::fs::read_dir(root.path().join("origin/forks"))
                    .unwrap()
                    .count(),
                0
            );
        } else {
            let r = r.expect("fork of the head");
            assert_eq!(r.seq, 2);
            let (dir, got) = restore_dump(&format!("{f_url}2"), &cfg);
            assert_eq!(got, dump(&fs));
            fsck_clean(dir.path(), &format!("{f_url}2"), &cfg);
        }
    }
    drop(fs);
}

/// gc leaves a dropped snapshot that is younger than the grace window in place, and while
/// it is there it can be read: the chunks it names stay with it, even old ones no kept
/// snapshot names. A fork of it (or a restore) is whole.
#[test]
fn a_young_dropped_snapshot_keeps_its_chunks_until_it_goes() {
    let Dropped {
        root,
        cfg,
        plain: _,
        hook: _,
        origin,
        doomed,
        at_1,
        _dir,
        fs,
        p,
    } = dropped_snapshot(false);
    let g = gc::gc(&mut origin.clone(), Some(p.store()), 1, GRACE).expect("gc");
    assert_eq!((g.snapshots_deleted, g.chunks_deleted), (0, 0), "{g}");
    assert_eq!(present(&origin, &window_ids(&doomed)), 3, "{g}");
    let f_url = format!("file://{}/fork", root.path().display());
    let (mut dst, _) = open(&f_url, &cfg);
    fork(&mut origin.clone(), &mut dst, Some(1)).expect("fork of snapshot 1");
    let (dir, got) = restore_dump(&f_url, &cfg);
    assert_eq!(got, at_1);
    fsck_clean(dir.path(), &f_url, &cfg);
    drop(fs);
}

/// A checkpoint-in-flight marker its checkpoint no longer renews (the checkpoint died: its
/// keel was killed) holds no sharing gc back; one that is renewed does.
#[test]
fn a_checkpoint_in_flight_marker_nobody_renews_holds_no_gc_back() {
    let Forked {
        root: _root,
        cfg: _,
        o_url: _,
        hook: _,
        origin,
        fork_repo,
        dir: _dir,
        fs,
        p: _,
    } = origin_and_fork(&noise(80, CHUNK as usize));
    let now = keel::time::now_ns();
    let hour = 3600 * 1_000_000_000i64;
    for (expires, kept) in [(now - 1_000_000_000, false), (now + hour, true)] {
        let data = noise(81 + u64::from(kept), 2 * CHUNK as usize);
        stale_chunks(&origin, &data);
        // Began three hours ago, before the (two hours old) chunks were written.
        let m = keel::persist::fork::InFlight {
            started_ns: now - 3 * hour,
            expires_ns: Some(expires),
        };
        origin
            .remote
            .put(
                &origin.in_flight_key(),
                Bytes::from(serde_json::to_vec(&m).unwrap()),
                PutMode::Overwrite,
            )
            .unwrap();
        let g = gc::gc(&mut fork_repo.clone(), None, 1, GRACE).expect("fork gc");
        let left = present(&origin, &window_ids(&data));
        if kept {
            assert_eq!((left, g.chunks_deleted), (2, 0), "a live marker: {g}");
        } else {
            assert_eq!(
                (left, g.chunks_deleted),
                (0, 2),
                "a marker that ran out: {g}"
            );
        }
    }
    drop(fs);
}

fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env_remove("KEEL_CONFIG")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The CLI: a keel "serving" the origin (a control socket in its state dir) is asked for a
/// checkpoint first; list, restore, fsck and gc work on the fork; refusals are one line.
#[test]
fn fork_cli() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let o_url = format!("file://{}/origin", r.display());
    let f_url = format!("file://{}/fork", r.display());
    let cfg_path = r.join("config.toml");
    std::fs::write(
        &cfg_path,
        format!("[persist]\nremote = \"{o_url}\"\nkeep = 1\ngc_grace = \"0s\"\n"),
    )
    .unwrap();
    let cfg_s = cfg_path.to_str().unwrap();
    let a = r.join("a");
    std::fs::create_dir_all(&a).unwrap();
    let fs = open_fs(&a);
    build_rich_tree(&fs);
    let (origin, _) = open(&o_url, &PersistConfig::default());
    let mut p = Persister::open(&a, origin, params()).unwrap();
    checkpoint(&mut p);

    // Something the running keel has not checkpointed yet; its control socket checkpoints
    // on request.
    write_file(&fs, "late", b"written after the last checkpoint");
    let sock = a.join(keel::state::CONTROL_SOCK);
    let listener = UnixListener::bind(&sock).unwrap();
    let server = std::thread::spawn(move || {
        let mut asked = Vec::new();
        for _ in 0..2 {
            let (mut c, _) = listener.accept().unwrap();
            let mut r = BufReader::new(&c);
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            // The rest of the head (the client sends no body).
            let mut h = String::new();
            while r.read_line(&mut h).unwrap() > 0 && h != "\r\n" {
                h.clear();
            }
            let asked_for = line.split(' ').take(2).collect::<Vec<_>>().join(" ");
            let body = match asked_for.as_str() {
                "GET /status" => r#"{"mount": {"mounted": false, "mount_point": "/"}}"#.to_string(),
                "POST /checkpoint" => serde_json::json!({
                    "ok": true,
                    "done": checkpoint(&mut p).to_string(),
                })
                .to_string(),
                _ => r#"{"ok": false, "error": "unexpected"}"#.to_string(),
            };
            write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            asked.push(asked_for);
        }
        (asked, p)
    });
    let a_s = a.to_str().unwrap();
    let o = keel(&["fork", "--config", cfg_s, "--state", a_s, "--to", &f_url]);
    assert!(o.status.success(), "{}", text(&o));
    let (asked, p) = server.join().unwrap();
    std::fs::remove_file(&sock).unwrap();
    assert_eq!(asked, vec!["GET /status", "POST /checkpoint"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("forked snapshot 2 of"), "{}", text(&o));
    assert!(out.contains("none copied"), "{}", text(&o));
    let at_fork = dump(&fs);

    // Refusals: one line each, exit 1.
    let o = keel(&["fork", "--config", cfg_s, "--state", a_s, "--to", &f_url]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("already holds a workspace"), "{}", text(&o));
    assert_eq!(err.trim_end().lines().count(), 1, "{}", text(&o));
    let nowhere = format!("file://{}/nothing", r.display());
    let o = keel(&["fork", "--from", &nowhere, "--to", &format!("{f_url}2")]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("holds no keel workspace"),
        "{}",
        text(&o)
    );
    let o = keel(&["fork", "--from", &o_url, "--to", "s3://keel/f"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("must live in the same bucket"),
        "{}",
        text(&o)
    );
    let o = keel(&["fork", "--delete", &o_url]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("not a fork"),
        "{}",
        text(&o)
    );

    // snapshot list / restore / fsck on the fork.
    let b = r.join("b");
    let b_s = b.to_str().unwrap();
    let o = keel(&["snapshot", "list", "--state", b_s, "--remote", &f_url]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("full") && out.contains("(head)"), "{out}");
    let o = keel(&[
        "snapshot", "restore", "latest", "--state", b_s, "--remote", &f_url,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let fs_b = open_fs(&b);
    assert_eq!(dump(&fs_b), at_fork);
    drop(fs_b);
    let o = keel(&["fsck", "--state", b_s, "--remote", &f_url]);
    assert!(o.status.success(), "{}", text(&o));

    // gc of the origin sees the fork; deleting the fork works.
    drop(p);
    let o = keel(&["gc", "--config", cfg_s, "--state", a_s]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("shared with 1 other"),
        "{}",
        text(&o)
    );
    let o = keel(&["fork", "--delete", &f_url]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!r.join("fork/keel-workspace.json").exists());
    assert!(std::fs::read_dir(r.join("origin/forks"))
        .unwrap()
        .next()
        .is_none());
    drop(fs);
}

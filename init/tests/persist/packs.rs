//! Packs (issue 41), without a kernel: a checkpoint of many small files writes a few packs
//! rather than an object per file, and a restore from them (eager, or lazy with one ranged
//! GET per read) equals the tree byte for byte; gc keeps a half-dead pack whole, rewrites
//! a mostly dead one with every live chunk and deletes a dead one; a fork sharing a pack
//! survives the gc of its source (also when that gc repacks it); fsck finds a corrupted
//! pack entry (and repairs it from the local bytes) and a damaged index; a remote written
//! by the build before packs (a fixture) restores, and takes packed checkpoints on top.

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel::config::PersistConfig;
use keel::meta::InodeNo;
use keel::persist::fork::fork;
use keel::persist::fsck::{fsck, FsckOptions, FsckReport};
use keel::persist::hydrate::RemoteChunks;
use keel::persist::restore::{restore, restore_with, RestoreMode};
use keel::persist::{gc, open_remote, FsRemote, MemRemote, Persister, Remote, Repo};
use keel::workspace::fs::WorkspaceFs;
use support::persist::*;

/// `n` files of 5–25 KB in directory `dir` (seeded by `seed`): each one chunk, packed.
fn small_files(fs: &WorkspaceFs, dir: &str, n: u64, seed: u64) {
    mkdir(fs, dir);
    for i in 0..n {
        let len = 5_000 + ((seed * 31 + i * 7_919) % 20_000) as usize;
        write_file(fs, &format!("{dir}/f{i}.js"), &noise(seed * 1000 + i, len));
    }
}

/// Objects under the chunk store: (loose chunks, pack objects, index objects).
fn objects(repo: &Repo) -> (usize, usize, usize) {
    let loose = repo.list_chunks().unwrap().len();
    let packs = repo.list_packs().unwrap();
    let p = packs.iter().filter(|p| p.pack.is_some()).count();
    let i = packs.iter().filter(|p| p.index.is_some()).count();
    (loose, p, i)
}

fn restore_dump(repo: &Repo) -> (tempfile::TempDir, BTreeMap<String, String>) {
    let dir = tempfile::tempdir().unwrap();
    restore(&mut repo.clone(), None, dir.path()).expect("restore");
    let fs = open_fs(dir.path());
    let d = dump(&fs);
    drop(fs);
    (dir, d)
}

fn fsck_of(state: &Path, repo: &Repo, repair: bool) -> FsckReport {
    fsck(
        state,
        &FsckOptions {
            repair,
            chunk_size: CHUNK,
            remote: Some(repo.clone()),
            ..Default::default()
        },
    )
    .unwrap()
}

fn assert_clean(r: &FsckReport) {
    let f: Vec<_> = r.findings.iter().map(|f| &f.what).collect();
    assert!(r.is_clean(), "fsck: {f:?}");
    assert!(r.chunks_checked > 0, "fsck checked no remote chunk");
}

/// A full snapshot: with `keep = 1`, no older snapshot stays for the head's chain.
fn checkpoint_full(p: &mut Persister) -> keel::persist::CheckpointReport {
    p.checkpoint(&keel::persist::CheckpointOptions {
        full: true,
        ..Default::default()
    })
    .expect("checkpoint")
}

/// Every chunk the files of `p`'s state dir are made of (holes left out).
fn chunk_ids(p: &Persister) -> Vec<keel::chunk::ChunkId> {
    p.store()
        .read()
        .all_file_chunks()
        .unwrap()
        .values()
        .flat_map(|rows| {
            rows.iter()
                .filter_map(|(_, id)| id.map(keel::chunk::ChunkId))
        })
        .collect()
}

fn gc_now(repo: &Repo, p: &Persister) -> gc::GcReport {
    gc::gc(&mut repo.clone(), Some(p.store()), 1, Duration::ZERO).expect("gc")
}

#[test]
fn a_restore_from_packs_equals_the_tree_byte_for_byte() {
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let src = tempfile::tempdir().unwrap();
    let fs = open_fs(src.path());
    build_rich_tree(&fs);
    mkdir(&fs, "node_modules");
    small_files(&fs, "node_modules/a", 120, 1);
    small_files(&fs, "node_modules/b", 120, 2);
    small_files(&fs, "src", 60, 3);
    write_file(&fs, "big.bin", &noise(4, 5 * CHUNK as usize + 99));
    let mut p = persister(src.path(), remote.clone());
    let r = checkpoint(&mut p);
    // 300 small files + the rich tree's and big.bin's windows.
    assert!(r.packed_chunks >= 300, "{r}");
    assert!(r.packs_uploaded >= 2, "{r}");
    let repo = Repo::new(remote.clone(), "ws");
    let (loose, packs, idx) = objects(&repo);
    assert_eq!(packs, idx, "every pack has its index");
    assert_eq!(
        loose + packs + idx,
        (r.chunks_uploaded - r.packed_chunks + 2 * r.packs_uploaded) as usize
    );
    assert!(
        (loose + packs + idx) * 4 <= r.chunks_uploaded as usize,
        "{loose} loose + {packs} packs for {} chunks: not 4x fewer objects",
        r.chunks_uploaded
    );
    // Delta on top: a changed small file and a new one go into a new pack.
    write_file(
        &fs,
        "src/f1.js",
        b"rewritten, and short enough to be inline",
    );
    write_file(&fs, "src/new.js", &noise(77, 9_000));
    write_file(&fs, "src/new2.js", &noise(78, 9_000));
    let r2 = checkpoint(&mut p);
    assert_eq!((r2.packs_uploaded, r2.packed_chunks), (1, 3), "{r2}");
    let want = dump(&fs);

    // Eager.
    let (dir, got) = restore_dump(&repo);
    assert_eq!(got, want);
    assert_clean(&fsck_of(dir.path(), &repo, false));

    // Lazy: reading one small file is one ranged GET of its pack (after the indexes are
    // read once), never a whole-object GET of a chunk.
    let gets: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let g = gets.clone();
    let tap = Tap::new(remote.clone(), move |op, key| {
        if key.contains("/chunks/") {
            g.lock().unwrap().push((op.to_string(), key.to_string()));
        }
    });
    let dst = tempfile::tempdir().unwrap();
    let mut lrepo = Repo::new(tap.clone(), "ws");
    let rep = restore_with(&mut lrepo, None, dst.path(), RestoreMode::Lazy).unwrap();
    assert!(rep.windows_missing > 300, "{rep:?}");
    let lfs = open_fs(dst.path());
    let mut reader = Repo::new(tap.clone(), "ws");
    reader.manifest().unwrap();
    lfs.set_chunk_source(Arc::new(RemoteChunks::new(reader)));
    gets.lock().unwrap().clear();
    let ino = resolve(&lfs, "node_modules/b/f7.js");
    let first = read_all(&lfs, ino).unwrap();
    let seen = gets.lock().unwrap().clone();
    let data: Vec<_> = seen
        .iter()
        .filter(|(op, k)| !(op == "get_many" && k.ends_with(".idx")))
        .collect();
    assert_eq!(data.len(), 1, "{seen:?}");
    assert_eq!(data[0].0, "get_range");
    assert!(data[0].1.ends_with(".pack"), "{seen:?}");
    let want_line = &want["/node_modules/b/f7.js"];
    assert!(want_line.ends_with(&format!("bytes:{}:{}", first.len(), {
        let h = keel::chunk::ChunkId::of(&first).to_hex();
        h[..16].to_string()
    })));
    // Its neighbour in the directory came with it (read around): no GET.
    gets.lock().unwrap().clear();
    read_all(&lfs, resolve(&lfs, "node_modules/b/f8.js")).unwrap();
    assert_eq!(gets.lock().unwrap().len(), 0, "{:?}", gets.lock().unwrap());
    // A file of another directory: one ranged GET, no index read again.
    read_all(&lfs, resolve(&lfs, "node_modules/a/f3.js")).unwrap();
    assert_eq!(gets.lock().unwrap().len(), 1, "{:?}", gets.lock().unwrap());
    assert_eq!(dump(&lfs), want, "lazily read tree");
}

#[test]
fn a_batch_of_chunks_of_one_pack_is_one_ranged_get() {
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let src = tempfile::tempdir().unwrap();
    let fs = open_fs(src.path());
    small_files(&fs, "pkg", 100, 5);
    let mut p = persister(src.path(), remote.clone());
    let r = checkpoint(&mut p);
    assert_eq!(r.packs_uploaded, 1, "{r}");
    let n = Arc::new(AtomicU64::new(0));
    let c = n.clone();
    let tap = Tap::new(remote.clone(), move |op, key| {
        if op == "get_range" && key.ends_with(".pack") {
            c.fetch_add(1, Ordering::SeqCst);
        }
    });
    let repo = Repo::new(tap, "ws");
    let ids = chunk_ids(&p);
    assert_eq!(ids.len(), 100);
    let got = repo.get_chunks(&ids);
    assert!(got.iter().all(|r| r.is_ok()));
    assert_eq!(
        n.load(Ordering::SeqCst),
        1,
        "100 chunks of one pack, one read"
    );
}

#[test]
fn gc_keeps_a_half_dead_pack_repacks_a_mostly_dead_one_and_deletes_a_dead_one() {
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let src = tempfile::tempdir().unwrap();
    let fs = open_fs(src.path());
    mkdir(&fs, "x");
    // 20 files of 10,000 bytes each: one pack of 200,000 bytes.
    for i in 0..20u64 {
        write_file(&fs, &format!("x/f{i}"), &noise(500 + i, 10_000));
    }
    let mut p = persister(src.path(), remote.clone());
    let r = checkpoint(&mut p);
    assert_eq!(r.packs_uploaded, 1, "{r}");
    let repo = Repo::new(remote.clone(), "ws");
    let old = repo.list_packs().unwrap()[0].name;
    let unlink = |from: u64, to: u64| {
        for i in from..to {
            fs.unlink(resolve(&fs, "x"), format!("f{i}").as_bytes())
                .unwrap();
        }
    };

    // 8 of 20 dead (40%): kept whole.
    unlink(0, 8);
    checkpoint_full(&mut p);
    let g = gc_now(&repo, &p);
    assert_eq!(
        (g.packs_kept, g.packs_repacked, g.packs_deleted),
        (1, 0, 0),
        "{g}"
    );
    let (_d, got) = restore_dump(&repo);
    assert_eq!(got, dump(&fs), "every live chunk kept");

    // 14 of 20 dead: rewritten with the 6 live ones; the old pack and index go.
    unlink(8, 14);
    checkpoint_full(&mut p);
    let g = gc_now(&repo, &p);
    assert_eq!(
        (g.packs_kept, g.packs_repacked, g.packs_deleted),
        (0, 1, 0),
        "{g}"
    );
    let packs = repo.list_packs().unwrap();
    assert_eq!(packs.len(), 1);
    assert_ne!(packs[0].name, old);
    assert!(remote.head(&repo.pack_key(&old)).unwrap().is_none());
    assert!(remote.head(&repo.pack_index_key(&old)).unwrap().is_none());
    let map = repo.load_packs(None).unwrap();
    assert_eq!(map.len(), 6);
    let (d, got) = restore_dump(&repo);
    assert_eq!(got, dump(&fs), "every live chunk kept by the repack");
    assert_clean(&fsck_of(d.path(), &repo, false));
    assert_clean(&fsck_of(src.path(), &repo, false));

    // All dead: the pack and its index go.
    unlink(14, 20);
    checkpoint_full(&mut p);
    let g = gc_now(&repo, &p);
    assert_eq!(
        (g.packs_kept, g.packs_repacked, g.packs_deleted),
        (0, 0, 1),
        "{g}"
    );
    assert_eq!(objects(&repo), (0, 0, 0));
}

#[test]
fn gc_removes_half_a_pack_a_checkpoint_left_once_old_enough() {
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let src = tempfile::tempdir().unwrap();
    let fs = open_fs(src.path());
    small_files(&fs, "d", 10, 9);
    let mut p = persister(src.path(), remote.clone());
    checkpoint(&mut p);
    let repo = Repo::new(remote.clone(), "ws");
    // A pack whose index was never written, and an index whose pack is gone.
    let b = keel::persist::pack::build(&[(
        keel::chunk::ChunkId::of(b"orphan"),
        bytes::Bytes::from_static(b"orphan"),
    )]);
    let c = keel::persist::pack::build(&[(
        keel::chunk::ChunkId::of(b"lost"),
        bytes::Bytes::from_static(b"lost"),
    )]);
    let put = |k: String, d: bytes::Bytes| {
        remote
            .put(&k, d, keel::persist::remote::PutMode::Create)
            .unwrap();
    };
    put(repo.pack_key(&b.index.name), b.data.clone());
    put(repo.pack_index_key(&c.index.name), c.index_bytes.clone());
    let r = fsck_of(src.path(), &repo, false);
    let says = |what: &str| r.findings.iter().any(|f| f.what.contains(what));
    assert!(says("has no index"), "{:?}", r.findings);
    assert!(says("names a pack that is not there"), "{:?}", r.findings);
    // Young: left alone.
    let g = gc::gc(
        &mut repo.clone(),
        Some(p.store()),
        1,
        Duration::from_secs(3600),
    )
    .unwrap();
    assert_eq!(g.packs_deleted, 0, "{g}");
    let g = gc_now(&repo, &p);
    assert_eq!((g.packs_kept, g.packs_deleted), (1, 2), "{g}");
    assert_clean(&fsck_of(src.path(), &repo, false));
}

/// Opens `url` as a workspace (manifest read or made).
fn open(url: &str) -> Repo {
    let mut r = open_remote(url, &PersistConfig::default()).unwrap();
    r.ensure_manifest(0).unwrap();
    r
}

#[test]
fn a_fork_sharing_a_pack_survives_the_sources_gc() {
    let root = tempfile::tempdir().unwrap();
    let url = |n: &str| format!("file://{}/{n}", root.path().display());
    let origin = open(&url("origin"));
    let a = tempfile::tempdir().unwrap();
    let fs_a = open_fs(a.path());
    mkdir(&fs_a, "x");
    for i in 0..10u64 {
        write_file(&fs_a, &format!("x/f{i}"), &noise(900 + i, 10_000));
    }
    let mut pa = Persister::open(a.path(), origin.clone(), params()).unwrap();
    assert_eq!(checkpoint(&mut pa).packs_uploaded, 1);
    let at_fork = dump(&fs_a);
    let mut fork_repo = open_remote(&url("fork"), &PersistConfig::default()).unwrap();
    fork(&mut origin.clone(), &mut fork_repo, None).expect("fork");
    fork_repo.manifest().unwrap();
    let b = tempfile::tempdir().unwrap();
    restore(&mut fork_repo.clone(), None, b.path()).unwrap();
    let fs_b = open_fs(b.path());
    let mut pb = Persister::open(b.path(), fork_repo.clone(), params()).unwrap();

    // The origin drops 9 of the 10: for it the pack is mostly dead, for the fork all live.
    for i in 0..9u64 {
        fs_a.unlink(resolve(&fs_a, "x"), format!("f{i}").as_bytes())
            .unwrap();
    }
    checkpoint_full(&mut pa);
    let g = gc_now(&origin, &pa);
    assert_eq!(
        (g.packs_kept, g.packs_repacked, g.packs_deleted),
        (1, 0, 0),
        "{g}"
    );
    assert_eq!(g.sharing, 1, "{g}");
    let (d, got) = restore_dump(&fork_repo);
    assert_eq!(got, at_fork, "the fork after its source's gc");
    assert_clean(&fsck_of(d.path(), &fork_repo, false));

    // The fork drops 7 too: 3 of 10 live in all, so the fork's gc (its old snapshot
    // goes) repacks what both need; the origin's gc then keeps the new pack; both restore,
    // the origin through a reader that held the old index.
    // (Its own repo: nothing below reads the indexes for it.)
    let reader = open(&url("origin"));
    assert_eq!(reader.load_packs(None).unwrap().len(), 10);
    for i in 0..7u64 {
        fs_b.unlink(resolve(&fs_b, "x"), format!("f{i}").as_bytes())
            .unwrap();
    }
    checkpoint_full(&mut pb);
    let g = gc_now(&fork_repo, &pb);
    assert_eq!(
        (g.packs_kept, g.packs_repacked, g.packs_deleted),
        (0, 1, 0),
        "{g}"
    );
    let g = gc_now(&origin, &pa);
    assert_eq!(
        (g.packs_kept, g.packs_repacked, g.packs_deleted),
        (1, 0, 0),
        "{g}"
    );
    let ids = chunk_ids(&pb);
    assert_eq!(ids.len(), 3);
    // Its index names a pack that is gone: the miss reads the indexes again.
    assert!(reader.get_chunks(&ids).iter().all(|r| r.is_ok()));
    let (_, got) = restore_dump(&fork_repo);
    assert_eq!(got, dump(&fs_b));
    let (_, got) = restore_dump(&origin);
    assert_eq!(got, dump(&fs_a));
    assert_clean(&fsck_of(b.path(), &fork_repo, false));
    assert_clean(&fsck_of(a.path(), &origin, false));
}

#[test]
fn fsck_finds_a_corrupted_pack_entry_and_repairs_it_from_local_bytes() {
    let mem = Arc::new(MemRemote::new());
    let remote: Arc<dyn Remote> = mem.clone();
    let src = tempfile::tempdir().unwrap();
    let fs = open_fs(src.path());
    small_files(&fs, "d", 10, 11);
    let mut p = persister(src.path(), remote.clone());
    checkpoint(&mut p);
    let repo = Repo::new(remote.clone(), "ws");
    let map = repo.load_packs(None).unwrap();
    let pack = &map.packs[0];
    let victim = map.entries(0).nth(3).unwrap();
    mem.tamper(&repo.pack_key(&pack.name), |b| {
        b[victim.off as usize + 5] ^= 0x40;
    });
    let r = fsck_of(src.path(), &repo, false);
    let bad: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.what.contains(&victim.id.to_hex()))
        .collect();
    assert_eq!(bad.len(), 1, "{:?}", r.findings);
    assert!(bad[0].what.contains("corrupt"), "{}", bad[0].what);
    assert!(!r.is_clean());
    // A lazy reader of that file gets an error, never the damaged bytes.
    let got = Repo::new(remote.clone(), "ws").get_chunks(&[victim.id]);
    assert!(got[0].is_err());
    // Repair: the local window still hashes to the id, so it is uploaded on its own.
    let r = fsck_of(src.path(), &repo, true);
    assert!(r.findings.iter().any(|f| f.repaired), "{:?}", r.findings);
    assert_clean(&fsck_of(src.path(), &repo, false));
    let (_d, got) = restore_dump(&repo);
    assert_eq!(got, dump(&fs));

    // A damaged index is an error too (its chunks are unreachable through it).
    mem.tamper(&repo.pack_index_key(&pack.name), |b| b[30] ^= 1);
    let r = fsck_of(src.path(), &repo, false);
    assert!(
        r.findings
            .iter()
            .any(|f| f.what.contains("checksum mismatch")),
        "{:?}",
        r.findings
    );
    assert!(!r.is_clean());
}

/// Copies a directory tree.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
        }
    }
}

#[test]
fn a_remote_written_before_packs_restores_and_takes_packed_checkpoints() {
    // tests/fixtures/remote-before-packs.tar: a file:// remote written by keel before packs
    // (a full snapshot and a delta, every chunk its own object), and the dump of its tree.
    let fx = tempfile::tempdir().unwrap();
    let tar = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/remote-before-packs.tar");
    tar::Archive::new(std::fs::File::open(&tar).unwrap())
        .unpack(fx.path())
        .unwrap();
    let want: BTreeMap<String, String> =
        serde_json::from_slice(&std::fs::read(fx.path().join("dump.json")).unwrap()).unwrap();
    let root = tempfile::tempdir().unwrap();
    copy_tree(&fx.path().join("remote"), &root.path().join("remote"));
    let remote: Arc<dyn Remote> = Arc::new(FsRemote::open(&root.path().join("remote")).unwrap());
    let repo = Repo::new(remote.clone(), "ws");
    assert_eq!(
        repo.list_packs().unwrap().len(),
        0,
        "the fixture has no packs"
    );
    let loose_before = repo.list_chunks().unwrap().len();
    assert!(loose_before > 15);

    let (dir, got) = restore_dump(&repo);
    assert_eq!(got, want, "eager restore of the old remote");
    // Lazily, read through the filesystem.
    let lazy = tempfile::tempdir().unwrap();
    restore_with(&mut repo.clone(), None, lazy.path(), RestoreMode::Lazy).unwrap();
    let lfs = open_fs(lazy.path());
    lfs.set_chunk_source(Arc::new(RemoteChunks::new(repo.clone())));
    assert_eq!(dump(&lfs), want, "lazy restore of the old remote");
    drop(lfs);

    // The new build checkpoints on top: small new files go into a pack; the old loose
    // chunks stay where they are and still restore.
    let fs = open_fs(dir.path());
    small_files(&fs, "pkg/lib/new", 12, 13);
    write_at(&fs, resolve(&fs, "pkg/lib/m5.js"), 0, b"edited");
    let mut p = Persister::open(dir.path(), repo.clone(), params()).unwrap();
    let r = checkpoint(&mut p);
    assert_eq!(r.packs_uploaded, 1, "{r}");
    let after = dump(&fs);
    let (_, got) = restore_dump(&repo);
    assert_eq!(got, after);
    let g = gc_now(&repo, &p);
    assert_eq!(g.packs_kept, 1, "{g}");
    let (d2, got) = restore_dump(&repo);
    assert_eq!(got, after, "after gc");
    assert_clean(&fsck_of(d2.path(), &repo, false));
    let _ = InodeNo::ROOT;
}

/// A lazy start loads the pack indexes ahead of the first read (`Repo::load_packs_ahead`,
/// what `keel mount` and `keel run` call once the chunk source is wired): the first read of
/// a packed chunk is then one ranged GET, no index GET in front of it. A read racing that
/// load waits for it: every index is fetched once either way.
#[test]
fn the_pack_indexes_load_ahead_of_the_first_read_and_only_once() {
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let src = tempfile::tempdir().unwrap();
    let fs = open_fs(src.path());
    small_files(&fs, "a", 120, 1);
    small_files(&fs, "b", 120, 2);
    let mut p = persister(src.path(), remote.clone());
    let r = checkpoint(&mut p);
    assert!(r.packs_uploaded >= 1 && r.packed_chunks >= 240, "{r}");
    let want = dump(&fs);
    let packs = objects(&Repo::new(remote.clone(), "ws")).2;
    let gets: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let g = gets.clone();
    let tap = Tap::new(remote.clone(), move |op, key| {
        if key.contains("/chunks/") {
            g.lock().unwrap().push((op.to_string(), key.to_string()));
        }
    });
    let index_gets = || {
        gets.lock()
            .unwrap()
            .iter()
            .filter(|(op, k)| op == "get_many" && k.ends_with(".idx"))
            .count()
    };
    let lazy_fs = |dst: &Path| {
        restore_with(
            &mut Repo::new(tap.clone(), "ws"),
            None,
            dst,
            RestoreMode::Lazy,
        )
        .unwrap();
        let lfs = open_fs(dst);
        let mut reader = Repo::new(tap.clone(), "ws");
        reader.manifest().unwrap();
        lfs.set_chunk_source(Arc::new(RemoteChunks::new(reader.clone())));
        (lfs, reader)
    };

    // Ahead of the read: the read is one ranged GET of a pack.
    let dst = tempfile::tempdir().unwrap();
    let (lfs, reader) = lazy_fs(dst.path());
    gets.lock().unwrap().clear();
    reader.load_packs_ahead().expect("started").join().unwrap();
    assert_eq!(index_gets(), packs, "{:?}", gets.lock().unwrap());
    gets.lock().unwrap().clear();
    let got = read_all(&lfs, resolve(&lfs, "b/f7.js")).unwrap();
    let seen = gets.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        seen[0].0 == "get_range" && seen[0].1.ends_with(".pack"),
        "{seen:?}"
    );
    assert!(want["/b/f7.js"].contains(&format!("bytes:{}:", got.len())));

    // Racing: the load ahead and a read started together fetch every index once.
    let dst = tempfile::tempdir().unwrap();
    let (lfs, reader) = lazy_fs(dst.path());
    gets.lock().unwrap().clear();
    std::thread::scope(|s| {
        let ahead = reader.load_packs_ahead().expect("started");
        let read = s.spawn(|| read_all(&lfs, resolve(&lfs, "a/f3.js")).unwrap());
        ahead.join().unwrap();
        read.join().unwrap();
    });
    assert_eq!(index_gets(), packs, "{:?}", gets.lock().unwrap());
    assert_eq!(dump(&lfs), want, "lazily read tree");
}

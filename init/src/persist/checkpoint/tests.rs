//! Unit tests of the checkpoint's steps, each on a fresh state dir and an in-memory remote
//! (the whole checkpoint is tested end to end in `tests/persist/checkpoint.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::steps::{
    lazy_windows_carry_over, retries_image, wants_full, Job, Pass, Prior, COMPACT_FLOOR,
};
use super::*;
use crate::chunk::ChunkId;
use crate::meta::Inode;
use crate::persist::format::DataRec;
use crate::persist::repo::Head;
use crate::persist::{MemRemote, Remote};

/// Window size of the test state dirs: small, so a few bytes make several windows.
const CS: u64 = 4096;

struct Fixture {
    _dir: tempfile::TempDir,
    p: Persister,
    remote: Arc<MemRemote>,
}

fn params() -> PersistParams {
    PersistParams {
        chunk_size: CS,
        compact_every: 10,
        pack_below: 64 << 10,
        pack_size: 4 << 20,
        threads: 2,
    }
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    drop(crate::state::open_store(dir.path(), Nanos(1)).unwrap());
    let remote = Arc::new(MemRemote::new());
    let repo = Repo::new(remote.clone(), "ws");
    let p = Persister::open(dir.path(), repo, params()).unwrap();
    Fixture {
        _dir: dir,
        p,
        remote,
    }
}

/// A file under the root whose body holds `data`, every window dirty.
fn add_file(p: &Persister, name: &[u8], data: &[u8]) -> InodeNo {
    let tx = p.store.write().unwrap();
    let ino = tx
        .insert(&Inode::test_file(data.len() as u64, Storage::Body))
        .unwrap();
    tx.link(InodeNo::ROOT, name, ino, Kind::File).unwrap();
    tx.mark_dirty_windows(ino, 0..window_count(data.len() as u64, CS))
        .unwrap();
    tx.commit().unwrap();
    std::fs::write(p.bodies.path(ino.0), data).unwrap();
    ino
}

/// Three windows: two of distinct bytes, the last all zeros.
fn three_windows() -> Vec<u8> {
    let mut v = vec![1u8; CS as usize];
    v.extend(vec![2u8; CS as usize]);
    v.extend(vec![0u8; CS as usize]);
    v
}

fn first(p: &mut Persister) -> CheckpointReport {
    p.checkpoint(&CheckpointOptions::default()).unwrap()
}

/// A `Pass` as the steps before collection leave it, for the state dir as it is.
fn pass_for(p: &mut Persister, full: bool) -> Pass {
    p.claim_changes(Nanos(now_ns())).unwrap();
    let prior = p.read_prior().unwrap();
    let head = p.read_fenced_head().unwrap();
    let mut pass = Pass::new(prior, full, head);
    p.collect_changes(&mut pass).unwrap();
    pass
}

#[test]
fn claim_changes_moves_recorded_changes_to_the_pending_set() {
    let f = fixture();
    add_file(&f.p, b"a", b"x");
    assert!(!f.p.store.read().unclaimed_changes().unwrap().is_empty());
    f.p.claim_changes(Nanos(42)).unwrap();
    let r = f.p.store.read();
    assert!(r.unclaimed_changes().unwrap().is_empty());
    let pending = r.pending_changes().unwrap();
    assert_eq!(pending.windows, 1);
    assert!(pending.inodes >= 1 && pending.dirents == 1, "{pending:?}");
    assert_eq!(
        r.persist_get("clean_before").unwrap().as_deref(),
        Some("42")
    );
}

#[test]
fn read_prior_trusts_only_the_remote_it_checkpointed_to() {
    let mut f = fixture();
    let prior = f.p.read_prior().unwrap();
    assert_eq!(prior.last_seq, None);
    assert!(!prior.trusted, "a remote never checkpointed to");
    assert!(!prior.remote_id.is_empty());
    add_file(&f.p, b"a", &three_windows());
    assert_eq!(first(&mut f.p).seq, Some(1));
    let prior = f.p.read_prior().unwrap();
    assert_eq!(prior.last_seq, Some(1));
    assert!(prior.trusted);
    assert_eq!(
        (prior.chunk_size, prior.base, prior.deltas),
        (Some(CS), Some(1), 0)
    );
    assert!(prior.full_bytes > 0);
    // Another remote (another id) is not trusted with the same local record.
    f.p.repo = Repo::new(Arc::new(MemRemote::new()), "ws");
    assert!(!f.p.read_prior().unwrap().trusted);
}

#[test]
fn lazy_windows_carry_over_only_to_their_remote_in_their_chunk_size() {
    let mut prior = Prior {
        trusted: true,
        chunk_size: Some(CS),
        ..Default::default()
    };
    assert!(
        lazy_windows_carry_over(&prior, CS * 2).is_ok(),
        "none missing"
    );
    prior.missing = HashMap::from([(InodeNo(5), vec![(0, [7; 32]), (3, [8; 32])])]);
    assert!(lazy_windows_carry_over(&prior, CS).is_ok());
    let e = lazy_windows_carry_over(&prior, CS * 2).unwrap_err();
    assert!(e.to_string().contains("2 windows"), "{e}");
    assert!(e.to_string().contains("chunk size changed"), "{e}");
    prior.trusted = false;
    let e = lazy_windows_carry_over(&prior, CS).unwrap_err();
    assert!(
        e.to_string()
            .contains("not the one they were restored from"),
        "{e}"
    );
    // The same remote, where another writer checkpointed since (`foreign`): carried over.
    prior.diverged = true;
    assert!(lazy_windows_carry_over(&prior, CS).is_ok());
    assert!(lazy_windows_carry_over(&prior, CS * 2).is_err());
}

#[test]
fn wants_full_when_asked_new_untrusted_resized_or_deltas_add_up() {
    let params = params();
    let delta = Prior {
        last_seq: Some(3),
        trusted: true,
        chunk_size: Some(CS),
        deltas: 2,
        delta_bytes: 10,
        full_bytes: 100,
        ..Default::default()
    };
    assert!(!wants_full(&delta, false, &params));
    assert!(wants_full(&delta, true, &params));
    let cases = [
        Prior {
            last_seq: None,
            ..delta.clone()
        },
        Prior {
            trusted: false,
            ..delta.clone()
        },
        Prior {
            chunk_size: Some(CS * 2),
            ..delta.clone()
        },
        Prior {
            deltas: 9,
            ..delta.clone()
        },
        Prior {
            delta_bytes: COMPACT_FLOOR + 1,
            ..delta.clone()
        },
    ];
    for c in &cases {
        assert!(wants_full(c, false, &params), "{c:?}");
    }
    // Deltas past an eighth of a large full snapshot: full (the restore would replay
    // them); up to an eighth, or under the floor, a delta.
    let big = |delta_bytes| Prior {
        full_bytes: 40 << 20,
        delta_bytes,
        ..delta.clone()
    };
    assert!(!wants_full(&big(5 << 20), false, &params));
    assert!(wants_full(&big((5 << 20) + 1), false, &params));
    let small = Prior {
        full_bytes: 1000,
        delta_bytes: COMPACT_FLOOR,
        ..delta.clone()
    };
    assert!(!wants_full(&small, false, &params));
}

#[test]
fn a_missing_image_is_retried_at_once_then_less_and_less_often() {
    let p = |failures, deltas| Prior {
        last_seq: Some(3),
        trusted: true,
        chunk_size: Some(CS),
        deltas,
        base_without_image: true,
        image_failures: failures,
        ..Default::default()
    };
    assert!(retries_image(&p(1, 0), false), "at once after one failure");
    assert!(!retries_image(&p(1, 0), true), "never under a deadline");
    assert!(!retries_image(&p(2, 0), false));
    assert!(retries_image(&p(2, 1), false));
    assert!(!retries_image(&p(3, 2), false));
    assert!(retries_image(&p(3, 3), false));
    assert!(!retries_image(&p(40, 62), false));
    assert!(retries_image(&p(40, 63), false), "at most 63 deltas apart");
    // Written under a deadline (no build tried): retried at once.
    assert!(retries_image(&p(0, 0), false));
    let with = Prior {
        base_without_image: false,
        ..p(1, 5)
    };
    assert!(!retries_image(&with, false));
}

#[test]
fn void_stale_chunk_maps_clears_maps_of_another_remote_or_chunk_size() {
    let mut f = fixture();
    let ino = add_file(&f.p, b"a", &three_windows());
    first(&mut f.p);
    let maps = |p: &Persister| p.store.read().file_chunks(ino).unwrap().len();
    assert_eq!(maps(&f.p), 3);
    let prior = f.p.read_prior().unwrap();
    f.p.void_stale_chunk_maps(&prior).unwrap();
    assert_eq!(maps(&f.p), 3, "same remote, same chunk size: kept");
    // A file inline now has no map to patch: the maps a keel before `record_locally`
    // dropped them left behind go, once per state dir.
    let other = add_file(&f.p, b"b", &three_windows());
    first(&mut f.p);
    let inline_again = |p: &Persister, legacy: bool| {
        let tx = p.store.write().unwrap();
        let mut i = tx.get(other).unwrap().unwrap();
        i.storage = Storage::Inline;
        tx.update(&i).unwrap();
        if legacy {
            tx.persist_set(super::steps::INLINE_MAPS_SWEPT, "0")
                .unwrap();
        }
        tx.commit().unwrap();
    };
    let other_maps = |p: &Persister| p.store.read().file_chunks(other).unwrap().len();
    inline_again(&f.p, false);
    f.p.void_stale_chunk_maps(&prior).unwrap();
    assert_eq!(
        other_maps(&f.p),
        3,
        "swept once already: the checkpoint sees to it"
    );
    inline_again(&f.p, true);
    f.p.void_stale_chunk_maps(&prior).unwrap();
    assert_eq!(maps(&f.p), 3, "a body file keeps its map");
    assert_eq!(other_maps(&f.p), 0, "a state dir not swept yet");
    let resized = Prior {
        chunk_size: Some(CS * 2),
        ..prior.clone()
    };
    f.p.void_stale_chunk_maps(&resized).unwrap();
    assert_eq!(maps(&f.p), 0);
}

#[test]
fn read_fenced_head_reads_the_remote_head() {
    let mut f = fixture();
    assert!(f.p.read_fenced_head().unwrap().is_none());
    add_file(&f.p, b"a", b"x");
    first(&mut f.p);
    let (h, _) = f.p.read_fenced_head().unwrap().unwrap();
    assert_eq!(h.seq, 1);
    assert_eq!(h.epoch, 0, "no lease");
}

#[test]
fn collect_changes_takes_the_whole_tree_or_just_the_changes() {
    let mut f = fixture();
    let a = add_file(&f.p, b"a", &three_windows());
    let pass = pass_for(&mut f.p, true);
    // A full pass keeps the chunked file's record for its map and spills the rest.
    assert_eq!(pass.body.inodes.len(), 1, "a");
    let spill = pass.spill.as_ref().expect("a full pass spills");
    assert_eq!(spill.inodes.len(), 1, "the root");
    assert_eq!(spill.dirents.len(), 1);
    assert_eq!(pass.inode_records(), 2);
    assert_eq!((pass.inode_total, pass.file_bytes), (2, 3 * CS));
    let idx: Vec<u64> = pass.jobs.iter().map(|j| j.idx).collect();
    assert_eq!(idx, [0, 1, 2], "windows never hashed");
    first(&mut f.p);

    // A delta: one window rewritten, one file added, `a` then removed.
    let tx = f.p.store.write().unwrap();
    tx.mark_dirty_windows(a, [1]).unwrap();
    tx.commit().unwrap();
    let b = add_file(&f.p, b"b", b"hello");
    let pass = pass_for(&mut f.p, false);
    let jobs: Vec<(InodeNo, u64)> = pass.jobs.iter().map(|j| (j.ino, j.idx)).collect();
    assert_eq!(jobs, [(a, 1), (b, 0)]);
    assert!(pass.body.inodes.iter().any(|r| r.ino == b.0));
    assert!(pass.body.dirents.iter().any(|d| d.name == b"b"));
    assert_eq!(pass.inode_total, 3);

    let tx = f.p.store.write().unwrap();
    tx.unlink(InodeNo::ROOT, b"a").unwrap();
    tx.delete(a).unwrap();
    tx.commit().unwrap();
    let pass = pass_for(&mut f.p, false);
    assert!(pass.body.deleted.contains(&a.0));
    assert!(pass
        .body
        .unlinked
        .contains(&(InodeNo::ROOT.0, b"a".to_vec())));
}

#[test]
fn a_delta_is_whole_when_the_tree_changes_between_the_claim_and_the_collection() {
    // Found by the kill-anywhere soak (a git commit under periodic checkpoints): a name
    // claimed by the checkpoint (`main`) was pointed at a new inode (`main.lock` renamed
    // over it) after the claim and before the delta was collected; the delta named the new
    // inode without its record, and its directory's nlink without the new subdirectory's
    // entry, so the snapshot restored with a dangling entry and a wrong link count.
    let mut f = fixture();
    let old = add_file(&f.p, b"main", b"one");
    first(&mut f.p);
    // A change the checkpoint claims: `main` rewritten in place, its entry touched.
    let tx = f.p.store.write().unwrap();
    tx.mark_dirty_windows(old, [0]).unwrap();
    tx.relink(InodeNo::ROOT, b"main", old, Kind::File).unwrap();
    tx.mark_changed(InodeNo::ROOT).unwrap();
    tx.commit().unwrap();
    f.p.claim_changes(Nanos(now_ns())).unwrap();
    // After the claim: a new inode renamed over `main`, a new subdirectory.
    let tx = f.p.store.write().unwrap();
    let new = tx.insert(&Inode::test_file(3, Storage::Body)).unwrap();
    tx.relink(InodeNo::ROOT, b"main", new, Kind::File).unwrap();
    tx.delete(old).unwrap();
    let mut dir = Inode::test_file(0, Storage::Body);
    dir.kind = Kind::Dir;
    dir.nlink = 2;
    let sub = tx.insert(&dir).unwrap();
    tx.link(InodeNo::ROOT, b"sub", sub, Kind::Dir).unwrap();
    let mut root = tx.get(InodeNo::ROOT).unwrap().unwrap();
    root.nlink += 1;
    tx.update(&root).unwrap();
    tx.commit().unwrap();
    let prior = f.p.read_prior().unwrap();
    let head = f.p.read_fenced_head().unwrap();
    let mut pass = Pass::new(prior, false, head);
    f.p.collect_changes(&mut pass).unwrap();
    let records: Vec<u64> = pass.body.inodes.iter().map(|r| r.ino).collect();
    for d in &pass.body.dirents {
        assert!(
            records.contains(&d.ino),
            "the delta names inode {} ({:?}) without its record; records {records:?}",
            d.ino,
            String::from_utf8_lossy(&d.name)
        );
    }
    let root_rec = pass.body.inodes.iter().find(|r| r.ino == InodeNo::ROOT.0);
    if root_rec.is_some_and(|r| r.nlink == 3) {
        assert!(
            pass.body.dirents.iter().any(|d| d.name == b"sub"),
            "the root's nlink counts `sub`, whose entry the delta lacks"
        );
    }
    assert!(pass.body.deleted.contains(&old.0));
}

#[test]
fn reuse_unfetched_windows_takes_their_chunk_without_hashing() {
    let prior = Prior {
        missing: HashMap::from([(InodeNo(9), vec![(1, [7; 32])])]),
        ..Default::default()
    };
    let mut pass = Pass::new(prior, false, None);
    pass.jobs = (0..3)
        .map(|idx| Job {
            ino: InodeNo(9),
            idx,
            range: idx * CS..(idx + 1) * CS,
        })
        .collect();
    pass.reuse_unfetched_windows();
    let left: Vec<u64> = pass.jobs.iter().map(|j| j.idx).collect();
    assert_eq!(left, [0, 2]);
    assert_eq!(pass.hashed[&InodeNo(9)], [(1, Some([7; 32]))]);
}

#[test]
fn hash_and_upload_sends_each_distinct_nonzero_chunk_once() {
    let mut f = fixture();
    let mut data = three_windows();
    data.extend(vec![1u8; CS as usize]); // the first window again
    add_file(&f.p, b"a", &data);
    let mut pass = pass_for(&mut f.p, true);
    f.p.hash_and_upload(&mut pass, None).unwrap();
    let r = &pass.report;
    assert_eq!((r.windows_hashed, r.bytes_hashed), (4, 4 * CS));
    assert_eq!((r.chunks_uploaded, r.chunk_bytes_uploaded), (2, 2 * CS));
    let one = ChunkId::of(&vec![1u8; CS as usize]);
    // Both small enough for one pack (two objects: the pack and its index).
    assert_eq!((r.packs_uploaded, r.packed_chunks), (1, 2));
    assert!(f.remote.head(&f.p.repo.chunk_key(&one)).unwrap().is_none());
    assert_eq!(
        f.p.repo.get_chunks(&[one])[0].as_ref().unwrap().len(),
        CS as usize
    );
    let rows = &pass.hashed.values().next().unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(
        rows.iter().filter(|(_, id)| id.is_none()).count(),
        1,
        "zeros"
    );

    // A deadline already passed: nothing hashed, everything left pending.
    let mut pass = pass_for(&mut f.p, true);
    let e =
        f.p.hash_and_upload(&mut pass, Some(Instant::now()))
            .unwrap_err();
    assert!(
        matches!(e, CheckpointError::Deadline { done: 0, total: 4 }),
        "{e}"
    );
}

#[test]
fn fill_chunk_maps_writes_whole_maps_for_new_files_and_patches_for_old() {
    let mut f = fixture();
    let a = add_file(&f.p, b"a", &three_windows());
    first(&mut f.p);
    let tx = f.p.store.write().unwrap();
    tx.mark_dirty_windows(a, [0]).unwrap();
    tx.commit().unwrap();
    std::fs::write(f.p.bodies.path(a.0), {
        let mut v = three_windows();
        v[0] = 9;
        v
    })
    .unwrap();
    let b = add_file(&f.p, b"b", b"new");
    let mut pass = pass_for(&mut f.p, false);
    f.p.hash_and_upload(&mut pass, None).unwrap();
    pass.fill_chunk_maps(CS);
    let data = |pass: &Pass, ino: InodeNo| {
        let rec = pass.body.inodes.iter().find(|r| r.ino == ino.0).unwrap();
        match &rec.data {
            DataRec::Chunks { complete, patch } => (*complete, patch.len()),
            d => panic!("{d:?}"),
        }
    };
    assert_eq!(data(&pass, a), (false, 1), "one window patched");
    assert_eq!(data(&pass, b), (true, 1), "a new file's whole map");
    pass.full = true;
    pass.fill_chunk_maps(CS);
    assert_eq!(
        data(&pass, a),
        (true, 3),
        "a full snapshot names every window"
    );
}

#[test]
fn upload_snapshot_skips_numbers_left_by_a_dead_checkpoint() {
    let mut f = fixture();
    add_file(&f.p, b"a", b"x");
    let mut pass = pass_for(&mut f.p, true);
    f.p.hash_and_upload(&mut pass, None).unwrap();
    pass.fill_chunk_maps(CS);
    f.p.repo.put_snapshot(1, b"left behind".to_vec()).unwrap();
    let seq = f.p.upload_snapshot(&mut pass, None).unwrap();
    assert_eq!(seq, 2);
    assert!(pass.report.snapshot_bytes > 0);
    let (h, body) = f.p.repo.read_snapshot(2).unwrap();
    assert_eq!((h.seq, h.base, h.parent), (2, 2, None));
    assert_eq!(body.inodes.len(), 2);
}

#[test]
fn advance_head_writes_only_over_the_head_it_read() {
    let mut f = fixture();
    add_file(&f.p, b"a", b"x");
    let pass = pass_for(&mut f.p, true);
    f.p.advance_head(&pass, 7).unwrap();
    assert_eq!(f.p.repo.read_head().unwrap().unwrap().0.seq, 7);
    // `pass` read no head: writing again would overwrite one written meanwhile.
    let e = f.p.advance_head(&pass, 8).unwrap_err();
    assert!(
        matches!(e, CheckpointError::AdvanceHead { seq: 8, .. }),
        "{e}"
    );
    let pass = Pass::new(Prior::default(), true, f.p.read_fenced_head().unwrap());
    f.p.advance_head(&pass, 8).unwrap();
    let h: Head = f.p.repo.read_head().unwrap().unwrap().0;
    assert_eq!(h.seq, 8);
}

#[test]
fn record_locally_commits_maps_counters_and_clears_pending() {
    let mut f = fixture();
    let a = add_file(&f.p, b"a", &three_windows());
    let mut pass = pass_for(&mut f.p, false);
    f.p.hash_and_upload(&mut pass, None).unwrap();
    pass.report.snapshot_bytes = 123;
    pass.prior.deltas = 4;
    pass.prior.delta_bytes = 1000;
    f.p.record_locally(&pass, 5).unwrap();
    let r = f.p.store.read();
    assert!(r.pending_changes().unwrap().is_empty());
    assert_eq!(r.file_chunks(a).unwrap().len(), 3);
    let kv = |k: &str| r.persist_get(k).unwrap().unwrap_or_default();
    assert_eq!(kv("last_seq"), "5");
    assert_eq!(kv("deltas_since_full"), "5");
    assert_eq!(kv("delta_bytes_since_full"), "1123");
    assert_eq!(kv("remote_id"), pass.prior.remote_id);
}

#[test]
fn checkpoint_runs_the_steps_in_order_and_then_has_nothing_to_do() {
    let mut f = fixture();
    add_file(&f.p, b"a", &three_windows());
    let r = first(&mut f.p);
    assert_eq!((r.seq, r.full, r.chunks_uploaded), (Some(1), true, 2));
    assert!(!f.p.has_changes().unwrap());
    let r = first(&mut f.p);
    assert_eq!(r.seq, None, "{r}");
}

/// The backlog as sets of every changed inode and window would count it (what `backlog`
/// did before it streamed them).
fn backlog_by_sets(p: &Persister) -> (u64, u64, u64) {
    use std::collections::BTreeSet;
    let v = p.store.read_view().unwrap();
    let inodes: BTreeSet<InodeNo> = v.backlog_inodes().unwrap().into_iter().collect();
    let (mut files, mut bytes) = (BTreeSet::new(), 0);
    for (ino, idx) in v.backlog_windows().unwrap() {
        if let Some(i) = v.get(ino).unwrap() {
            files.insert(ino);
            let r = window_range(idx, i.size, CS);
            bytes += r.end - r.start;
        }
    }
    let mut all = inodes.clone();
    all.extend(files.iter().copied());
    for ino in &inodes {
        match v.get(*ino).unwrap() {
            Some(i)
                if !files.contains(ino) && i.kind == Kind::File && i.storage == Storage::Inline =>
            {
                files.insert(*ino);
                bytes += i.size;
            }
            _ => {}
        }
    }
    (all.len() as u64, files.len() as u64, bytes)
}

#[test]
fn backlog_counts_claimed_and_unclaimed_changes_once_each() {
    let f = fixture();
    let a = add_file(&f.p, b"a", &three_windows());
    f.p.claim_changes(Nanos(now_ns())).unwrap();
    let tx = f.p.store.write().unwrap();
    // Window 1 of a again (claimed and unclaimed: counted once), an inline file, the
    // change of an inode gone since, and windows of an inode gone since (they name
    // nothing).
    tx.mark_dirty_windows(a, [1]).unwrap();
    let b = tx.insert(&Inode::test_file(5, Storage::Inline)).unwrap();
    tx.mark_changed(b).unwrap();
    tx.mark_changed(InodeNo(9998)).unwrap();
    tx.mark_dirty_windows(InodeNo(9999), [0, 3]).unwrap();
    tx.commit().unwrap();
    let got = f.p.backlog().unwrap();
    assert_eq!((got.files, got.bytes), (2, 3 * CS + 5), "{got}");
    assert_eq!((got.inodes, got.files, got.bytes), backlog_by_sets(&f.p));
    assert!(got.inodes >= 3, "a, b and the gone 9998 at least: {got}");
}

/// A file that a snapshot records inline (a rollback made it so, or it went back from a
/// passthrough body) and that then gets a body again with the bytes it had before: the
/// next delta must carry its whole map, not only the windows that differ from the map it
/// had two snapshots ago, or a restore reads those windows as zeros. Through a delta and
/// through a full snapshot.
#[test]
fn a_file_inline_in_between_gets_its_whole_map_back() {
    for full_in_between in [false, true] {
        let mut f = fixture();
        let data = three_windows();
        let a = add_file(&f.p, b"a", &data);
        first(&mut f.p);
        let body = |p: &Persister, storage, size| {
            let tx = p.store.write().unwrap();
            let mut i = tx.get(a).unwrap().unwrap();
            (i.storage, i.size) = (storage, size);
            tx.update(&i).unwrap();
            if storage == Storage::Inline {
                tx.set_inline_data(a, b"small").unwrap();
            } else {
                tx.mark_dirty_windows(a, 0..window_count(size, CS)).unwrap();
            }
            tx.commit().unwrap();
        };
        body(&f.p, Storage::Inline, 5);
        let opts = CheckpointOptions {
            full: full_in_between,
            ..Default::default()
        };
        let r = f.p.checkpoint(&opts).unwrap();
        assert_eq!(r.full, full_in_between);
        body(&f.p, Storage::Body, data.len() as u64);
        let r = first(&mut f.p);
        assert!(!r.full);
        let (tree, _) = f.p.repo().load_tree(r.seq.unwrap()).unwrap();
        let want: Vec<Option<ChunkId>> = data
            .chunks(CS as usize)
            .map(|w| (!w.iter().all(|b| *b == 0)).then(|| ChunkId::of(w)))
            .collect();
        assert_eq!(
            tree.inodes[&a.0].data,
            crate::persist::format::TreeData::Chunks(want),
            "inline in between, {}",
            if full_in_between { "full" } else { "delta" }
        );
    }
}

/// The names the remote gives snapshot `seq`.
fn names_of(repo: &Repo, seq: u64) -> Vec<String> {
    crate::persist::snapshots::names(repo)
        .unwrap()
        .into_values()
        .filter(|r| r.seq == seq)
        .map(|r| r.name)
        .collect()
}

/// A head this state dir did not write (another keel checkpointed after taking the workspace
/// over, and its gc took chunks) is kept as `diverged-S` and followed by a full snapshot
/// that offers every chunk again; a head the state dir was advancing to when it stopped is
/// its own; a head naming no snapshot only distrusts the maps.
#[test]
fn a_foreign_head_is_named_and_followed_by_a_full_snapshot() {
    let mut f = fixture();
    add_file(&f.p, b"a", &three_windows());
    first(&mut f.p);
    add_file(&f.p, b"b", b"second");
    let own = first(&mut f.p).seq.unwrap();
    assert!(names_of(&f.p.repo, own).is_empty());
    // Marked before its head was written, for a checkpoint that dies in between.
    assert_eq!(
        kv_u64(&f.p.store.read(), foreign::ADVANCING).unwrap(),
        Some(own)
    );

    // Another writer restored `own`, wrote `other` on it, and its gc took every chunk.
    let other = own + 1;
    f.p.repo.put_test(other, Some(own), &Default::default());
    let (h, version) = f.p.repo.read_head().unwrap().unwrap();
    let foreign = Head {
        seq: other,
        writer: "elsewhere:1".into(),
        ..h
    };
    f.p.repo.write_head(&foreign, version).unwrap();
    for (id, _) in f.p.repo.list_chunks().unwrap() {
        f.remote.delete(&f.p.repo.chunk_key(&id)).unwrap();
    }
    add_file(&f.p, b"c", b"third");
    let r = first(&mut f.p);
    let new = r.seq.unwrap();
    assert!(r.full, "{r}");
    assert!(r.chunks_uploaded >= 2, "every chunk offered again: {r}");
    let h = f.p.repo.read_header(new).unwrap();
    assert_eq!((h.parent, h.prev), (None, Some(other)), "{h:?}");
    assert_eq!(names_of(&f.p.repo, other), vec![foreign::name_of(other)]);

    // A head this state dir was advancing to when it stopped: its own, nothing named.
    add_file(&f.p, b"d", b"fourth");
    let next = new + 1;
    f.p.mark_advancing(next).unwrap();
    f.p.repo.put_test(next, Some(new), &Default::default());
    let (h, version) = f.p.repo.read_head().unwrap().unwrap();
    f.p.repo
        .write_head(&Head { seq: next, ..h }, version)
        .unwrap();
    let r = first(&mut f.p);
    assert!(!r.full, "{r}");
    assert!(names_of(&f.p.repo, next).is_empty());

    // A head naming a snapshot that is not there: nothing to keep, a full snapshot.
    let (h, version) = f.p.repo.read_head().unwrap().unwrap();
    let ghost = r.seq.unwrap() + 5;
    f.p.repo
        .write_head(&Head { seq: ghost, ..h }, version)
        .unwrap();
    add_file(&f.p, b"e", b"fifth");
    let r = first(&mut f.p);
    assert!(r.full, "{r}");
    assert!(r.seq.unwrap() > ghost);
    assert!(names_of(&f.p.repo, ghost).is_empty());
}

/// A checkpoint whose head write reached the remote but whose reply was lost (it fails
/// before recording anything) finds that head its own at the next checkpoint: the state dir
/// recorded it as the head it was advancing to before writing it, so nothing is named
/// `diverged-N` and no full snapshot is forced.
#[test]
fn a_head_written_but_not_recorded_is_recognised_as_its_own() {
    use crate::persist::remote::{ObjectInfo, RemoteResult};
    use std::sync::atomic::{AtomicBool, Ordering};
    struct LostHeadReply {
        inner: Arc<MemRemote>,
        lose: AtomicBool,
    }
    impl Remote for LostHeadReply {
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn get(&self, key: &str) -> RemoteResult<bytes::Bytes> {
            self.inner.get(key)
        }
        fn get_range(&self, key: &str, r: std::ops::Range<u64>) -> RemoteResult<bytes::Bytes> {
            self.inner.get_range(key, r)
        }
        fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
            self.inner.head(key)
        }
        fn put(
            &self,
            key: &str,
            data: bytes::Bytes,
            mode: crate::persist::remote::PutMode,
        ) -> RemoteResult<Option<String>> {
            let r = self.inner.put(key, data, mode)?;
            if key.ends_with("/head") && self.lose.swap(false, Ordering::SeqCst) {
                return Err(crate::persist::remote::RemoteError::Permanent {
                    op: "put",
                    key: key.to_string(),
                    reason: "the reply was lost".into(),
                });
            }
            Ok(r)
        }
        fn delete(&self, key: &str) -> RemoteResult<()> {
            self.inner.delete(key)
        }
        fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>> {
            self.inner.list(prefix)
        }
    }
    let dir = tempfile::tempdir().unwrap();
    drop(crate::state::open_store(dir.path(), Nanos(1)).unwrap());
    let remote = Arc::new(LostHeadReply {
        inner: Arc::new(MemRemote::new()),
        lose: AtomicBool::new(false),
    });
    let mut p = Persister::open(dir.path(), Repo::new(remote.clone(), "ws"), params()).unwrap();
    add_file(&p, b"a", b"one");
    first(&mut p);
    add_file(&p, b"b", b"two");
    remote.lose.store(true, Ordering::SeqCst);
    let e = p.checkpoint(&CheckpointOptions::default()).unwrap_err();
    assert!(e.to_string().contains("reply was lost"), "{e}");
    let (moved, _) = p.repo.read_head().unwrap().unwrap();
    assert_ne!(
        kv_u64(&p.store.read(), "last_seq").unwrap(),
        Some(moved.seq),
        "not recorded"
    );
    add_file(&p, b"c", b"three");
    let r = first(&mut p);
    assert!(!r.full, "{r}");
    assert!(r.seq.unwrap() > moved.seq, "{r}");
    assert!(names_of(&p.repo, moved.seq).is_empty());
}

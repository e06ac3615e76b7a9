//! Checkpoints against a real S3 endpoint (moto_server on 127.0.0.1, started here): full and
//! incremental checkpoints through `object_store`, restore round trip, gc, and the
//! conditional head update that refuses a writer working from a stale head.
//!
//! Needs `moto_server` and python3 with boto3 (`pip install "moto[server]"`); without them
//! the test prints a skip line, or panics when `KEEL_REQUIRE_S3` is set.

use crate::support;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::persist::repo::Head;
use keel::persist::{open_remote, restore, Counted, PersistParams, Persister, Remote, RemoteError};
use support::persist::*;
use support::s3::{s3_config, start_moto};

#[test]
fn s3_checkpoint_restore_gc_and_stale_head() {
    let Some((_moto, port)) = start_moto() else {
        return;
    };
    let cfg = s3_config(port);
    let repo = open_remote("s3://keel/work/space", &cfg).expect("open s3 remote");
    let counted = Arc::new(Counted::new(repo.remote.clone()));
    let repo = keel::persist::Repo::new(counted.clone(), "work/space");
    let params = PersistParams {
        chunk_size: CHUNK,
        compact_every: 8,
        pack_below: 64 << 10,
        pack_size: 4 << 20,
        threads: 2,
    };

    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    build_rich_tree(&fs);
    for i in 0..50u64 {
        write_file(&fs, &format!("f{i}"), &noise(i, 1000 + i as usize * 3000));
    }
    let mut p = Persister::open(dir.path(), repo.clone(), params.clone()).unwrap();
    let c0 = counted.counts();
    let r = checkpoint(&mut p);
    assert!(r.full && r.chunks_uploaded > 0, "{r}");
    let cold = counted.counts().since(&c0);

    write_file(&fs, "f3", b"changed on s3");
    let c1 = counted.counts();
    let r = checkpoint(&mut p);
    let inc = counted.counts().since(&c1);
    assert!(!r.full && r.inodes == 1, "{r}");
    assert!(
        inc.bytes_put < 2_000 && inc.bytes_put * 100 < cold.bytes_put,
        "incremental {inc:?} vs cold {cold:?}"
    );

    // Restore through S3 into a fresh state dir: identical tree.
    let target = tempfile::tempdir().unwrap();
    let mut r2 = repo.clone();
    restore::restore(&mut r2, None, target.path()).expect("restore from s3");
    assert_eq!(dump(&open_fs(target.path())), dump(&fs));
    // A lazy one starts from the full snapshot's metadata image, fetched through S3, and
    // replays the delta after it.
    let lazy_target = tempfile::tempdir().unwrap();
    let lr = restore::restore_with(
        &mut repo.clone(),
        None,
        lazy_target.path(),
        restore::RestoreMode::Lazy,
    )
    .expect("lazy restore from s3");
    assert!(lr.phases.iter().any(|(p, _)| *p == "image"), "{lr:?}");
    assert!(lr.windows_missing > 0, "{lr:?}");
    let fs_lazy = open_fs(lazy_target.path());
    let f3 = resolve(&fs_lazy, "f3");
    assert_eq!(fs_lazy.getattr(f3).unwrap().inode.size, 13);
    assert_eq!(
        read_all(&fs_lazy, resolve(&fs_lazy, "d/small")).unwrap(),
        b"hello"
    );

    // A writer working from a stale head is refused by the conditional PUT.
    let (head, version) = repo.read_head().unwrap().unwrap();
    let stale = Head {
        seq: head.seq + 10,
        ..head.clone()
    };
    repo.write_head(&stale, version.clone())
        .expect("update from the current version");
    let err = repo
        .write_head(
            &Head {
                seq: head.seq + 11,
                ..head
            },
            version,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            keel::persist::repo::RepoError::Remote(RemoteError::Precondition { .. })
        ),
        "{err}"
    );
    // The checkpoint reads the moved head and writes after it.
    write_file(&fs, "f4", b"after the head moved");
    let r = checkpoint(&mut p);
    assert!(r.seq.unwrap() > head.seq + 10, "{r}");

    // gc with everything young deletes nothing; the listing through S3 sees every chunk.
    let mut r3 = repo.clone();
    let g = keel::persist::gc::gc(&mut r3, Some(p.store()), 2, Duration::from_secs(3600)).unwrap();
    assert_eq!(g.chunks_deleted, 0, "{g}");
    assert!(g.chunks_kept > 0, "{g}");
}

#[test]
fn s3_unreachable_reports_backlog() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    write_file(&fs, "a", &noise(1, 100_000));
    // Nothing listens on this port.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cfg = s3_config(port);
    cfg.concurrency = 2;
    let repo = open_remote("s3://keel/p", &cfg).unwrap();
    let remote: Arc<dyn Remote> = repo.remote.clone();
    let mut p = Persister::open(
        dir.path(),
        keel::persist::Repo::new(remote, "p"),
        PersistParams {
            chunk_size: CHUNK,
            compact_every: 8,
            pack_below: 64 << 10,
            pack_size: 4 << 20,
            threads: 2,
        },
    )
    .unwrap();
    let t0 = Instant::now();
    let e = p.checkpoint(&Default::default()).unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "gave up only after {:?}",
        t0.elapsed()
    );
    let b = p.backlog().unwrap();
    assert_eq!((b.files, b.bytes), (1, 100_000), "{e}: {b}");
}

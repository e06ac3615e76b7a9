//! Checkpoint → restore round trips without a kernel: a restored state dir shows the same
//! tree, inode numbers, metadata, xattrs and bytes as the original, at the head and at older
//! snapshots, across deltas and compactions; a restore over a flipped chunk byte fails
//! naming the chunk.

use crate::support;

use std::sync::Arc;

use keel::persist::{restore, MemRemote, Remote, Repo};
use support::persist::*;

fn restore_into(
    remote: Arc<dyn Remote>,
    seq: Option<u64>,
) -> (
    tempfile::TempDir,
    std::collections::BTreeMap<String, String>,
) {
    let dir = tempfile::tempdir().unwrap();
    let mut repo = Repo::new(remote, "ws");
    restore::restore(&mut repo, seq, dir.path()).expect("restore");
    let fs = open_fs(dir.path());
    let d = dump(&fs);
    drop(fs);
    (dir, d)
}

#[test]
fn restore_roundtrip_across_deltas_and_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let fs = open_fs(dir.path());
    build_rich_tree(&fs);
    let mut p = persister(dir.path(), remote.clone());
    let r1 = checkpoint(&mut p);
    assert!(r1.full, "{r1}");
    let s1 = r1.seq.unwrap();
    let at1 = dump(&fs);

    // A series of deltas: rename, overwrite part of a big file, shrink, delete, new dir.
    let mut history = vec![(s1, at1.clone())];
    for round in 0..10u64 {
        match round % 5 {
            0 => {
                write_file(&fs, &format!("r{round}"), b"renamed");
                let root = keel::meta::InodeNo::ROOT;
                fs.rename(
                    root,
                    format!("r{round}").as_bytes(),
                    root,
                    format!("r{round}b").as_bytes(),
                    0,
                )
                .unwrap();
            }
            1 => write_at(
                &fs,
                resolve(&fs, "d/e/big"),
                CHUNK * 2 + round,
                &noise(round, 1000),
            ),
            2 => {
                let ino = resolve(&fs, "sparse");
                fs.setattr(
                    ino,
                    &keel::workspace::fs::SetAttr {
                        size: Some(CHUNK * (round % 3 + 1)),
                        ..Default::default()
                    },
                )
                .unwrap();
            }
            3 => {
                mkdir(&fs, &format!("n{round}"));
                write_file(&fs, &format!("n{round}/f"), &noise(round, 9000));
            }
            _ => {
                let _ = fs.unlink(keel::meta::InodeNo::ROOT, b"hardlink");
                fs.setxattr(
                    ROOT,
                    resolve(&fs, "d"),
                    format!("user.r{round}").as_bytes(),
                    b"x",
                    0,
                )
                .unwrap();
            }
        }
        let r = checkpoint(&mut p);
        history.push((r.seq.unwrap(), dump(&fs)));
    }
    // compact_every = 8: at least one compaction happened along the way.
    let fulls = history
        .iter()
        .filter(|(s, _)| {
            Repo::new(remote.clone(), "ws")
                .read_header(*s)
                .unwrap()
                .is_full()
        })
        .count();
    assert!(
        fulls >= 2,
        "expected a compaction, got {fulls} full snapshots"
    );

    let (_d, got) = restore_into(remote.clone(), None);
    assert_eq!(got, history.last().unwrap().1, "head restore differs");
    for (seq, want) in &history {
        let (_d, got) = restore_into(remote.clone(), Some(*seq));
        assert_eq!(&got, want, "restore of snapshot {seq} differs");
    }
    // Nothing changed: no snapshot.
    assert_eq!(checkpoint(&mut p).seq, None);
}

#[test]
fn restored_state_checkpoints_incrementally() {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    {
        let fs = open_fs(dir.path());
        build_rich_tree(&fs);
        checkpoint(&mut persister(dir.path(), remote.clone()));
    }
    let (rdir, _) = restore_into(remote.clone(), None);
    let fs = open_fs(rdir.path());
    write_file(&fs, "new", b"after restore");
    let c = counted(remote.clone());
    let mut p = persister(rdir.path(), c.clone());
    let r = checkpoint(&mut p);
    assert!(!r.full, "{r}");
    assert_eq!(r.chunks_uploaded, 0, "{r}");
    let (_d, got) = restore_into(remote, None);
    assert_eq!(got, dump(&fs));
}

/// keel killed while files were being written: bytes that reached a body without the write
/// being recorded are found at the next start (body newer than the last point where every
/// write was recorded) and go into the next checkpoint.
#[test]
fn unrecorded_writes_after_a_crash_are_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let fs = open_fs(dir.path());
    let ino = write_file(&fs, "f", &noise(3, 4 * CHUNK as usize));
    {
        let mut p = persister(dir.path(), remote.clone());
        p.mark_running(true).unwrap();
        checkpoint(&mut p);
        // A write the filesystem had not recorded when keel died: straight into the body.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let body =
            dir.path()
                .join(keel::state::BODIES)
                .join(format!("{:02x}/{:x}", ino.0 & 0xff, ino.0));
        let f = std::fs::OpenOptions::new().write(true).open(body).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"unrecorded", 2 * CHUNK + 5).unwrap();
        // (killed: no mark_running(false))
    }
    let mut p = persister(dir.path(), remote.clone());
    let r = checkpoint(&mut p);
    assert!(r.windows_hashed >= 1 && r.chunks_uploaded == 1, "{r}");
    let (_d, got) = restore_into(remote, None);
    assert_eq!(got, dump(&fs));
    let bytes = read_all(&fs, ino).unwrap();
    assert_eq!(&bytes[(2 * CHUNK + 5) as usize..][..10], b"unrecorded");
}

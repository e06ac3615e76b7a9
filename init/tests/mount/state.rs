//! Real-mount tests: the state dir. One keel per state dir; corrupt or foreign state dirs are
//! refused with a one-line reason and left untouched; a full state volume gives the writer
//! ENOSPC and the store stays usable; a preallocation larger than the volume fails alone.

use crate::support;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use support::mount::{errno, pattern, spawn_mount, Keel, MountOutcome};
use support::sys;

/// path → (len, blake3) of every regular file under `dir`, plus directory names.
fn file_digests(dir: &Path) -> BTreeMap<PathBuf, Option<(u64, blake3::Hash)>> {
    support::mount::walk(dir)
        .into_iter()
        .map(|rel| {
            let full = dir.join(&rel);
            let md = fs::symlink_metadata(&full).unwrap();
            let v = md
                .is_file()
                .then(|| (md.len(), support::mount::hash_file(&full)));
            (rel, v)
        })
        .collect()
}

/// Panics listing only the entries that differ.
#[track_caller]
fn assert_untouched(
    before: &BTreeMap<PathBuf, Option<(u64, blake3::Hash)>>,
    after: &BTreeMap<PathBuf, Option<(u64, blake3::Hash)>>,
    what: &str,
) {
    let mut diffs = Vec::new();
    for (p, b) in before {
        match after.get(p) {
            None => diffs.push(format!("{}: removed", p.display())),
            Some(a) if a != b => diffs.push(format!("{}: {b:?} -> {a:?}", p.display())),
            _ => {}
        }
    }
    for p in after.keys().filter(|p| !before.contains_key(*p)) {
        diffs.push(format!("{}: created", p.display()));
    }
    assert!(
        diffs.is_empty(),
        "keel modified {what}:\n  {}",
        diffs.join("\n  ")
    );
}

/// Expects `keel mount` on `state` to refuse: non-zero exit, nothing mounted, a clear one-line
/// reason (not a panic). Returns stderr.
fn expect_refused(state: &Path, scratch: &Path, what: &str) -> String {
    let mnt = scratch.join(format!("mnt-refused-{}", what.replace(' ', "-")));
    let log = scratch.join(format!("refused-{}.log", what.replace(' ', "-")));
    match spawn_mount(state, &mnt, &[], &log) {
        MountOutcome::Mounted(mut child) => {
            sys::kill(child.id(), libc::SIGTERM);
            support::mount::wait_timeout(&mut child, support::mount::STOP_TIMEOUT);
            support::mount::lazy_unmount(&mnt);
            panic!("{what}: keel mounted it, expected a refusal");
        }
        MountOutcome::Exited { status, stderr } => {
            assert!(!status.success(), "{what}: keel exited 0 without mounting");
            assert!(!support::mount::is_fuse_mount(&mnt));
            let text = stderr.trim();
            assert!(!text.is_empty(), "{what}: no reason printed");
            assert!(!text.contains("panicked"), "{what}: keel panicked:\n{text}");
            let state_s = state.to_string_lossy();
            assert!(
                text.lines()
                    .any(|l| l.contains(state_s.as_ref()) || l.to_lowercase().contains("state")),
                "{what}: the reason should name the state dir:\n{text}"
            );
            text.to_string()
        }
    }
}

#[test]
fn second_mount_on_same_state_is_refused() {
    let mut k = keel_or_skip!();
    fs::write(k.p("f"), b"first").unwrap();
    let stderr = expect_refused(&k.state, k.scratch(), "second mount");
    eprintln!("second mount refused with: {stderr}");
    // The first mount is unaffected.
    assert_eq!(fs::read(k.p("f")).unwrap(), b"first");
    fs::write(k.p("g"), b"still writable").unwrap();
    // After a clean stop the lock is released.
    k.remount();
    assert_eq!(fs::read(k.p("g")).unwrap(), b"still writable");
    // And after kill -9 too (a stale lock must not block the next start).
    k.crash_remount();
    assert_eq!(fs::read(k.p("f")).unwrap(), b"first");
}

#[test]
fn a_mount_removes_what_an_interrupted_checkpoint_left_and_nothing_else() {
    // A crash while a full snapshot was being built leaves its metadata image (a SQLite
    // file and its journal) and, from older builds, its spill files beside the database.
    let mut k = keel_or_skip!();
    fs::write(k.p("f"), b"kept").unwrap();
    // A clean stop (its full snapshot made), so the next mount's checkpoints build no
    // image of their own while the test looks.
    k.stop();
    let leftovers = [
        "meta.db.image",
        "meta.db.image-journal",
        "meta.db.snapshot-inodes",
        "meta.db.snapshot-dirents",
    ];
    for name in leftovers {
        fs::write(k.state.join(name), vec![7u8; 64 << 10]).unwrap();
    }
    // A file of the user's kind next to them, with a similar name, stays.
    fs::write(k.state.join("meta.db.image.bak"), b"not keel's scratch").unwrap();
    k.start_again();
    let log = k.log_text();
    assert!(
        log.contains("removed what an interrupted checkpoint left"),
        "no log line for the removal:\n{log}"
    );
    for name in leftovers {
        assert!(!k.state.join(name).exists(), "{name} left after the mount");
    }
    assert!(k.state.join("meta.db.image.bak").exists());
    assert_eq!(fs::read(k.p("f")).unwrap(), b"kept");
}

#[test]
fn existing_empty_state_dir_is_accepted() {
    if !support::mount::fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("volume");
    fs::create_dir(&state).unwrap(); // e.g. a fresh Docker volume
    let k = Keel::start_in(tmp, state, &[]);
    fs::write(k.p("x"), b"x").unwrap();
}

#[test]
fn corrupt_state_dir_is_refused_and_left_untouched() {
    let mut k = keel_or_skip!();
    fs::write(k.p("precious"), pattern(100_000, 1)).unwrap();
    k.stop();
    // Corrupt every SQLite database in the state dir (keel's metadata store).
    let mut dbs = Vec::new();
    for rel in support::mount::walk(&k.state) {
        let full = k.state.join(&rel);
        if !full.is_file() {
            continue;
        }
        let mut head = [0u8; 16];
        let n = fs::File::open(&full).unwrap().read(&mut head).unwrap();
        if n == 16 && &head == b"SQLite format 3\0" {
            dbs.push(full);
        }
    }
    assert!(
        !dbs.is_empty(),
        "no SQLite database found in the state dir (test needs updating?): {:?}",
        support::mount::walk(&k.state)
    );
    for db in &dbs {
        let f = OpenOptions::new().write(true).open(db).unwrap();
        f.set_len(fs::metadata(db).unwrap().len().max(8192))
            .unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &pattern(4096, 99), 0).unwrap();
    }
    let before = file_digests(&k.state);
    let stderr = expect_refused(&k.state, k.scratch(), "corrupt state");
    eprintln!("corrupt state refused with: {stderr}");
    assert_untouched(&before, &file_digests(&k.state), "a corrupt state dir");
}

#[test]
fn foreign_state_dir_is_refused_and_left_untouched() {
    if !support::mount::fuse_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("not-keel");
    fs::create_dir_all(state.join("photos")).unwrap();
    fs::write(state.join("notes.txt"), b"someone else's data").unwrap();
    fs::write(state.join("photos/a.jpg"), pattern(10_000, 4)).unwrap();
    let before = file_digests(&state);
    let stderr = expect_refused(&state, tmp.path(), "foreign dir");
    eprintln!("foreign state dir refused with: {stderr}");
    assert_untouched(&before, &file_digests(&state), "a foreign directory");

    // A regular file where the state dir should be.
    let file = tmp.path().join("a-file");
    fs::write(&file, b"not a dir").unwrap();
    expect_refused(&file, tmp.path(), "state is a file");
    assert_eq!(fs::read(&file).unwrap(), b"not a dir");
}

/// Unmounts the tmpfs state volume when the test ends (after Keel has unmounted).
struct TmpfsGuard(PathBuf);
impl Drop for TmpfsGuard {
    fn drop(&mut self) {
        support::mount::lazy_unmount(&self.0);
    }
}

#[test]
fn full_state_volume_gives_enospc_and_recovers() {
    if !support::mount::fuse_available() {
        return;
    }
    // Drop order: keel unmounts, then the tmpfs volume, then its (empty) directory.
    let vol_dir = tempfile::tempdir().unwrap();
    let vol = vol_dir.path().join("volume");
    fs::create_dir(&vol).unwrap();
    sys::mount_tmpfs(&vol, "size=48m,mode=755").expect("mount a 48 MiB tmpfs state volume");
    let _vol_guard = TmpfsGuard(vol.clone());
    let tmp = tempfile::tempdir().unwrap();
    let mut k = Keel::start_in(tmp, vol.join("state"), &[]);

    let keep = pattern(200_000, 5);
    fs::write(k.p("keep.bin"), &keep).unwrap();
    fs::File::open(k.p("keep.bin")).unwrap().sync_all().unwrap();

    // Fill the volume through the workspace. The error may surface at write, fsync or close.
    let chunk = pattern(1 << 20, 6);
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(k.p("filler.bin"))
        .unwrap();
    let mut err = None;
    for i in 0..256 {
        if let Err(e) = f.write_all(&chunk) {
            err = Some(e);
            break;
        }
        if i % 4 == 3 {
            if let Err(e) = f.sync_all() {
                err = Some(e);
                break;
            }
        }
    }
    if err.is_none() {
        err = f.sync_all().err();
    }
    drop(f);
    let err = err.expect("wrote 256 MiB into a 48 MiB state volume without an error");
    assert_eq!(
        errno(&err),
        libc::ENOSPC,
        "full state volume must give ENOSPC, got {err}"
    );

    // The store is consistent: the old file reads back, the filler can be deleted, and the
    // space comes back for new writes.
    assert!(
        fs::read(k.p("keep.bin")).unwrap() == keep,
        "keep.bin damaged by ENOSPC"
    );
    fs::remove_file(k.p("filler.bin")).unwrap();
    fs::write(k.p("after.txt"), b"written after ENOSPC").unwrap();
    k.remount();
    assert!(fs::read(k.p("keep.bin")).unwrap() == keep);
    assert_eq!(fs::read(k.p("after.txt")).unwrap(), b"written after ENOSPC");
    assert!(!k.p("filler.bin").exists());
    fs::write(k.p("big-again.bin"), pattern(8 << 20, 7)).unwrap();
    k.stop();
}

/// A preallocation larger than the state volume's free space (xfstests generic/213) fails
/// with ENOSPC and takes nothing. On ext4 a failing fallocate keeps what it allocated: it
/// filled the volume, the open metadata group could not commit (its acknowledged operations
/// were lost) and the unlink of the file could not free the space, so every later create
/// failed.
#[test]
fn a_fallocate_larger_than_the_free_space_fails_and_takes_nothing() {
    if !support::mount::fuse_available() {
        return;
    }
    let vol_dir = tempfile::tempdir().unwrap();
    let vol = vol_dir.path().join("volume");
    fs::create_dir(&vol).unwrap();
    sys::mount_ext4_image(&vol_dir.path().join("volume.img"), 128 << 20, &vol)
        .expect("mount a 128 MiB ext4 state volume (mkfs.ext4, mount -o loop)");
    let _vol_guard = TmpfsGuard(vol.clone());
    let tmp = tempfile::tempdir().unwrap();
    let mut k = Keel::start_in(tmp, vol.join("state"), &[]);

    let avail = |p: &Path| {
        let s = sys::statvfs(p).unwrap();
        s.f_bavail * s.f_frsize
    };
    fs::write(k.p("before.txt"), b"acknowledged").unwrap();
    let free = avail(&k.mnt);
    let f = fs::File::create(k.p("ouch")).unwrap();
    let r = sys::fallocate(&f, 0, 0, 2 * free as i64);
    assert_eq!(
        r.map_err(|e| errno(&e)),
        Err(libc::ENOSPC),
        "fallocate of twice the free space"
    );
    drop(f);
    fs::remove_file(k.p("ouch")).unwrap();
    let left = avail(&k.mnt);
    assert!(
        left > free / 2,
        "the failed fallocate kept the space: {left} bytes free of {free}"
    );
    fs::write(k.p("after.txt"), pattern(1 << 20, 3)).unwrap();
    k.remount();
    assert_eq!(fs::read(k.p("before.txt")).unwrap(), b"acknowledged");
    assert_eq!(fs::read(k.p("after.txt")).unwrap(), pattern(1 << 20, 3));
    assert!(!k.p("ouch").exists());
    let log = k.log_text();
    assert!(
        !log.contains("operations since the last commit are lost"),
        "{log}"
    );
    k.stop();
}

//! `diff=true`'s change tracker without a kernel: between two checkpoints, seeded random
//! operations of every kind (files inline and with bodies of several windows, appends,
//! rewrites with the same bytes, truncates, renames of files and directories over others,
//! exchanges, hard links, unlinks, rmdirs, chmods, xattrs, symlinks), and the tracker's diff
//! must equal `keel diff` of the two snapshots, change for change.

use crate::support;

use std::sync::Arc;

use keel::exec::around::diff_tracked;
use keel::meta::InodeNo;
use keel::persist::{MemRemote, Repo};
use keel::workspace::fs::{SetAttr, WorkspaceFs};
use support::persist::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const NAMES: &[&str] = &["a", "b", "d/x", "d/y", "d/e/z", "f/w", "d", "f", "d/e", "g"];

fn split(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

fn find(fs: &WorkspaceFs, path: &str) -> Option<InodeNo> {
    let mut ino = InodeNo::ROOT;
    for part in path.split('/').filter(|p| !p.is_empty()) {
        ino = fs.lookup(ino, part.as_bytes()).ok()?.inode.ino;
    }
    Some(ino)
}

fn parent_of(fs: &WorkspaceFs, path: &str) -> Option<(InodeNo, String)> {
    let (p, n) = split(path);
    Some((find(fs, p)?, n.to_string()))
}

/// One random operation; what fails (no such file, not empty, ...) changes nothing.
fn op(fs: &WorkspaceFs, rng: &mut Rng) {
    let path = NAMES[rng.below(NAMES.len() as u64) as usize];
    let other = NAMES[rng.below(NAMES.len() as u64) as usize];
    let Some((dir, name)) = parent_of(fs, path) else {
        return;
    };
    let n = name.as_bytes();
    let size = match rng.below(3) {
        0 => rng.below(100) as usize,
        1 => 3000 + rng.below(3000) as usize,
        _ => 70_000 + rng.below(150_000) as usize,
    };
    match rng.below(14) {
        0 | 1 => {
            if let Ok((a, fh, _)) = fs.create(ROOT, dir, n, 0o644, libc::O_RDWR) {
                fs.release(fh).unwrap();
                write_at(fs, a.inode.ino, 0, &noise(rng.next(), size));
            }
        }
        2 => {
            if let Some(ino) = find(fs, path).filter(|i| {
                fs.getattr(*i)
                    .is_ok_and(|a| a.inode.kind == keel::meta::Kind::File)
            }) {
                let at = fs.getattr(ino).unwrap().inode.size;
                write_at(fs, ino, at, &noise(rng.next(), 1 + size % 5000));
            }
        }
        3 => {
            // The same bytes again: no change for a diff.
            if let Some(ino) = find(fs, path) {
                if let Ok(bytes) = read_all(fs, ino) {
                    write_at(fs, ino, 0, &bytes);
                }
            }
        }
        4 => {
            if let Some(ino) = find(fs, path) {
                let _ = fs.setattr(
                    ino,
                    &SetAttr {
                        size: Some(rng.below(80_000)),
                        ..Default::default()
                    },
                );
            }
        }
        5 => {
            let _ = fs.mkdir(ROOT, dir, n, 0o755);
        }
        6 | 7 => {
            if let Some((od, on)) = parent_of(fs, other) {
                let flags = [0, 0, 1, 2][rng.below(4) as usize];
                let _ = fs.rename(dir, n, od, on.as_bytes(), flags);
            }
        }
        8 => {
            if let (Some(ino), Some((od, on))) = (find(fs, path), parent_of(fs, other)) {
                let _ = fs.link(ino, od, on.as_bytes());
            }
        }
        9 => {
            let _ = fs.unlink(dir, n);
        }
        10 => {
            let _ = fs.rmdir(dir, n);
        }
        11 => {
            if let Some(ino) = find(fs, path) {
                let _ = fs.setattr(
                    ino,
                    &SetAttr {
                        mode: Some([0o600, 0o644, 0o755][rng.below(3) as usize]),
                        ..Default::default()
                    },
                );
            }
        }
        12 => {
            if let Some(ino) = find(fs, path) {
                let v = [b"1".as_slice(), b"2"][rng.below(2) as usize];
                let _ = fs.setxattr(ROOT, ino, b"user.k", v, 0);
            }
        }
        _ => {
            let _ = fs.symlink(ROOT, dir, n, other.as_bytes());
        }
    }
}

#[test]
fn the_trackers_diff_equals_keel_diff_of_the_snapshots_around() {
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    for seed in 1..=24u64 {
        let dir = tempfile::tempdir().unwrap();
        let fs = open_fs(dir.path());
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        for _ in 0..30 {
            op(&fs, &mut rng);
        }
        let remote = Arc::new(MemRemote::new());
        let mut p = persister(dir.path(), remote.clone());
        fs.sync_all().unwrap();
        let a = checkpoint(&mut p).seq.expect("a first snapshot");
        let t = fs.track_start().unwrap();
        for _ in 0..40 {
            op(&fs, &mut rng);
        }
        let tracked = fs.track_finish(t).unwrap();
        fs.sync_all().unwrap();
        let b = checkpoint(&mut p).seq.unwrap_or(a);
        let want = keel::persist::diff::diff(&Repo::new(remote, "ws"), a, b).unwrap();
        let got = diff_tracked(tracked, CHUNK);
        assert_eq!(
            got.changes, want.changes,
            "seed {seed}: the tracker's diff differs from keel diff {a}..{b}"
        );
        for c in &want.changes {
            *seen.entry(c.change.to_string()).or_default() += 1;
            for w in &c.what {
                *seen.entry(format!("modified {w}")).or_default() += 1;
            }
        }
    }
    // The operations made every kind of change the comparison is about.
    for kind in [
        "added",
        "removed",
        "renamed",
        "modified",
        "modified content",
        "modified mode",
        "modified xattrs",
    ] {
        assert!(
            seen.get(kind).is_some_and(|n| *n > 0),
            "no {kind}: {seen:?}"
        );
    }
}

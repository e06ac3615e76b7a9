//! The change feed as the filesystem fills it, without a kernel: each mutating operation
//! appends its event with the paths it changed (hard links under every name, a renamed
//! directory's children under the new path), in the order the operations took effect; a
//! file's writes are one `modify` at the first change and one more at close when it changed
//! again; nothing is recorded before the first watch.

use crate::support;

use std::time::Duration;

use keel::meta::{InodeNo, Kind};
use keel::workspace::feed::{Cursor, Event, Op};
use keel::workspace::fs::{SetAttr, WorkspaceFs};
use support::persist::*;

fn since(fs: &WorkspaceFs, c: Cursor) -> Vec<Event> {
    fs.feed().read(c, 100_000, Duration::ZERO).unwrap()
}

/// (op, path, from) of each event.
fn summary(evs: &[Event]) -> Vec<(&'static str, String, Option<String>)> {
    evs.iter()
        .map(|e| (e.op.as_str(), e.path.clone(), e.from.clone()))
        .collect()
}

fn ev(op: &'static str, path: &str) -> (&'static str, String, Option<String>) {
    (op, path.to_string(), None)
}

fn mv(from: &str, to: &str) -> (&'static str, String, Option<String>) {
    ("rename", to.to_string(), Some(from.to_string()))
}

#[test]
fn namespace_changes_with_their_paths_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    // Before the first watch nothing is recorded.
    mkdir(&fs, "/early");
    assert!(!fs.feed().active());
    let c = fs.watch().unwrap();
    assert_eq!(c.seq, 0, "events recorded before the first watch");
    mkdir(&fs, "/src");
    let src = resolve(&fs, "/src");
    let (a, fh, _) = fs.create(ROOT, src, b"a.rs", 0o644, libc::O_RDWR).unwrap();
    fs.release(fh).unwrap();
    fs.rename(src, b"a.rs", src, b"b.rs", 0).unwrap();
    fs.link(a.inode.ino, InodeNo::ROOT, b"hard").unwrap();
    fs.symlink(ROOT, src, b"ln", b"b.rs").unwrap();
    fs.setattr(
        a.inode.ino,
        &SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .unwrap();
    fs.unlink(InodeNo::ROOT, b"hard").unwrap();
    // A directory renamed: what is made in it afterwards has the new path.
    fs.rename(InodeNo::ROOT, b"src", resolve(&fs, "/early"), b"lib", 0)
        .unwrap();
    mkdir(&fs, "/early/lib/sub");
    fs.rmdir(resolve(&fs, "/early/lib"), b"sub").unwrap();
    // Renamed over another name.
    write_file(&fs, "/x", b"x");
    write_file(&fs, "/y", b"y");
    let c2 = fs.feed().now();
    fs.rename(InodeNo::ROOT, b"x", InodeNo::ROOT, b"y", 0)
        .unwrap();
    let got = since(&fs, c);
    let s = summary(&got);
    assert_eq!(
        s[..11],
        [
            ev("create", "/src"),
            ev("create", "/src/a.rs"),
            mv("/src/a.rs", "/src/b.rs"),
            ev("create", "/hard"),
            ev("create", "/src/ln"),
            // A change to an inode with two names: under each.
            ev("attrib", "/hard"),
            ev("attrib", "/src/b.rs"),
            ev("delete", "/hard"),
            mv("/src", "/early/lib"),
            ev("create", "/early/lib/sub"),
            ev("delete", "/early/lib/sub"),
        ],
        "{s:#?}"
    );
    assert_eq!(got[0].kind, Kind::Dir);
    assert_eq!(got[4].kind, Kind::Symlink);
    // Sequence numbers follow one another.
    for (i, e) in got.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1);
    }
    let last = since(&fs, c2);
    assert_eq!(summary(&last), [mv("/x", "/y")]);
    assert!(last[0].replaced);
}

#[test]
fn a_write_is_reported_at_its_first_change_and_at_close_after_its_last() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    let ino = write_file(&fs, "/f", b"");
    let c = fs.watch().unwrap();
    let (fh, _) = fs.open(ino, libc::O_RDWR).unwrap();
    fs.write(ino, 0, b"hello").unwrap();
    let first = since(&fs, c);
    assert_eq!(summary(&first), [ev("modify", "/f")]);
    assert_eq!(first[0].size, Some(5));
    // More writes: nothing until the close.
    fs.write(ino, 5, &vec![b'x'; 10_000]).unwrap();
    fs.write(ino, 10_005, b"!").unwrap();
    assert_eq!(since(&fs, c).len(), 1);
    fs.flush(ino).unwrap();
    fs.release(fh).unwrap();
    let all = since(&fs, c);
    assert_eq!(summary(&all), [ev("modify", "/f"), ev("modify", "/f")]);
    assert_eq!(
        all[1].size,
        Some(10_006),
        "the last event has the final size"
    );
    // One write and a close: one event.
    let c = fs.feed().now();
    write_at(&fs, ino, 0, b"H");
    assert_eq!(summary(&since(&fs, c)), [ev("modify", "/f")]);
    // A truncate without a handle.
    let c = fs.feed().now();
    fs.setattr(
        ino,
        &SetAttr {
            size: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    let t = since(&fs, c);
    assert_eq!(summary(&t), [ev("modify", "/f")]);
    assert_eq!(t[0].size, Some(1));
}

#[test]
fn the_window_keeps_the_newest_events() {
    let dir = tempfile::tempdir().unwrap();
    let fs = open_fs(dir.path());
    fs.feed().set_window(4);
    let c = fs.watch().unwrap();
    for i in 0..6 {
        mkdir(&fs, &format!("/d{i}"));
    }
    assert!(matches!(
        fs.feed().read(c, 10, Duration::ZERO),
        Err(keel::workspace::feed::FeedError::Gone { .. })
    ));
    let kept = Cursor { run: c.run, seq: 2 };
    let evs = since(&fs, kept);
    assert_eq!(
        evs.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(),
        ["/d2", "/d3", "/d4", "/d5"]
    );
    assert!(evs.iter().all(|e| e.op == Op::Create));
}

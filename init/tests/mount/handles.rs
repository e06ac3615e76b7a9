//! File handles (`name_to_handle_at`, `open_by_handle_at`) on a keel mount, as tools that
//! keep handles use them (xfstests generic/426, 467, 477, 756, 777): a handle opens its file
//! after the kernel forgot the inode (here: across a remount, a new kernel cache), after a
//! rename, through another hard link; it is stale (ESTALE) once the file is deleted, and a
//! forged one names nothing outside the workspace. Needs root and /dev/fuse: fails when CI is
//! set, skips otherwise.

use crate::support;

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;

use support::sys::{self, FileHandle};

fn read_by_handle(k: &support::mount::Keel, h: &FileHandle) -> std::io::Result<Vec<u8>> {
    let mut f = sys::open_by_handle(&k.mnt, h, libc::O_RDONLY)?;
    let mut v = Vec::new();
    f.read_to_end(&mut v)?;
    Ok(v)
}

#[test]
fn handles_open_their_files_after_the_kernel_forgot_them() {
    let Some(mut k) = support::mount::Keel::start(&[]) else {
        return;
    };
    fs::create_dir_all(k.p("d/sub")).unwrap();
    fs::write(k.p("d/sub/f"), b"small").unwrap();
    fs::write(k.p("d/big"), vec![7u8; 100_000]).unwrap();
    fs::write(k.p("gone"), b"doomed").unwrap();
    fs::write(k.p("linked"), b"two names").unwrap();
    let f = sys::name_to_handle(&k.p("d/sub/f")).unwrap();
    let big = sys::name_to_handle(&k.p("d/big")).unwrap();
    let dir = sys::name_to_handle(&k.p("d/sub")).unwrap();
    let gone = sys::name_to_handle(&k.p("gone")).unwrap();
    let linked = sys::name_to_handle(&k.p("linked")).unwrap();
    let root = sys::name_to_handle(&k.mnt).unwrap();
    let dir_ino = fs::metadata(k.p("d/sub")).unwrap().ino();
    assert_eq!(read_by_handle(&k, &f).unwrap(), b"small", "while cached");

    // A new kernel cache: every inode is looked up by number.
    k.remount();
    assert_eq!(read_by_handle(&k, &f).unwrap(), b"small");
    assert_eq!(read_by_handle(&k, &big).unwrap(), vec![7u8; 100_000]);
    let d = sys::open_by_handle(&k.mnt, &dir, libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
    assert_eq!(d.metadata().unwrap().ino(), dir_ino);
    let r = sys::open_by_handle(&k.mnt, &root, libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
    assert_eq!(
        r.metadata().unwrap().ino(),
        fs::metadata(&k.mnt).unwrap().ino()
    );
    drop((d, r));

    // Renamed (its directory too), linked elsewhere and unlinked, deleted.
    fs::rename(k.p("d/sub"), k.p("moved")).unwrap();
    fs::rename(k.p("moved/f"), k.p("moved/g")).unwrap();
    fs::hard_link(k.p("linked"), k.p("d/other")).unwrap();
    fs::remove_file(k.p("linked")).unwrap();
    fs::remove_file(k.p("gone")).unwrap();
    k.remount();
    assert_eq!(read_by_handle(&k, &f).unwrap(), b"small", "after a rename");
    assert_eq!(read_by_handle(&k, &linked).unwrap(), b"two names");
    let e = read_by_handle(&k, &gone).expect_err("a deleted file's handle");
    assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    // Its directory removed (the kernel still caches nothing of it).
    fs::remove_file(k.p("moved/g")).unwrap();
    fs::remove_dir(k.p("moved")).unwrap();
    k.remount();
    for h in [&f, &dir] {
        let e = sys::open_by_handle(&k.mnt, h, libc::O_RDONLY).expect_err("deleted");
        assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    }
    assert_eq!(read_by_handle(&k, &big).unwrap(), vec![7u8; 100_000]);
}

/// A handle is the inode number and its generation: one with another generation, or naming
/// a number no inode has, is stale; whatever a forged handle opens is in the workspace.
#[test]
fn forged_handles_are_stale_or_stay_in_the_workspace() {
    let Some(mut k) = support::mount::Keel::start(&[]) else {
        return;
    };
    fs::write(k.p("f"), b"x").unwrap();
    let h = sys::name_to_handle(&k.p("f")).unwrap();
    k.remount();
    let dev = fs::metadata(&k.mnt).unwrap().dev();
    // FUSE's handle: the node id (high, low 32 bits) and the generation, native-endian u32s.
    assert_eq!(h.bytes.len(), 12, "{h:?}");
    let mut other_gen = h.clone();
    other_gen.bytes[8] ^= 0x5a;
    let e =
        sys::open_by_handle(&k.mnt, &other_gen, libc::O_RDONLY).expect_err("another generation");
    assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    for ino in (1u64..64).chain([1 << 20, u64::from(u32::MAX) + 5, u64::MAX]) {
        for gen in [0u32, 1] {
            let mut bytes = Vec::new();
            bytes.extend(((ino >> 32) as u32).to_ne_bytes());
            bytes.extend((ino as u32).to_ne_bytes());
            bytes.extend(gen.to_ne_bytes());
            let forged = FileHandle {
                kind: h.kind,
                bytes,
            };
            match sys::open_by_handle(&k.mnt, &forged, libc::O_RDONLY) {
                Ok(f) => assert_eq!(f.metadata().unwrap().dev(), dev, "ino {ino} gen {gen}"),
                Err(e) => assert!(
                    matches!(e.raw_os_error(), Some(libc::ESTALE) | Some(libc::ENOENT)),
                    "ino {ino} gen {gen}: {e}"
                ),
            }
        }
    }
}

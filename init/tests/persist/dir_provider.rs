//! The `dir` workspace provider without FUSE or a kernel mount: a walk of a plain directory
//! brings the store up to date and a checkpoint of it restores into the FUSE provider's
//! store byte for byte (contents, modes, owners, set-ID bits, symlinks, hard links, FIFOs,
//! device nodes, xattrs, sparse files, mtimes); a FUSE provider's snapshot builds into a
//! directory the same way; a walk after one change hashes only that file's windows and
//! nothing when nothing changed; a rename keeps the inode; a file swapped for a symlink
//! out of the tree between the walk and the checkpoint is never read through it.
//! Needs root (owners, device nodes); fails loudly under `CI=1` without it.

use crate::support;

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use keel::meta::{InodeNo, Kind};
use keel::persist::restore::{self, RestoreMode};
use keel::persist::{MemRemote, Remote, Repo};
use keel::workspace::dir::DirTree;
use keel::workspace::fs::WorkspaceFs;
use support::persist::*;

fn is_root() -> bool {
    let root = unsafe_free_euid() == 0;
    if !root && std::env::var_os("CI").is_some() {
        panic!("dir_provider tests need root (owners, device nodes) and CI is set");
    }
    root
}

fn unsafe_free_euid() -> u32 {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(1)
}

fn blake(b: &[u8]) -> String {
    keel::chunk::ChunkId::of(b).to_hex()[..16].to_string()
}

/// Everything the two providers must agree on, per path: kind, mode, owner, links (not of
/// directories), size, mtime, rdev, xattrs, and the bytes' hash or the symlink's target.
type Manifest = BTreeMap<String, String>;

#[allow(clippy::too_many_arguments)]
fn line(
    kind: &str,
    perm: u32,
    uid: u32,
    gid: u32,
    nlink: u64,
    size: u64,
    mtime: i64,
    rdev: u64,
    xattrs: Vec<String>,
    content: String,
) -> String {
    format!(
        "{kind} {perm:o} {uid}:{gid} n{nlink} s{size} t{mtime} r{rdev:x} [{}] {content}",
        xattrs.join(",")
    )
}

pub(super) fn host_manifest(root: &Path) -> Manifest {
    let mut out = Manifest::new();
    let mut stack = vec![(root.to_path_buf(), String::from("/"))];
    while let Some((p, rel)) = stack.pop() {
        let m = std::fs::symlink_metadata(&p).unwrap();
        let ft = m.file_type();
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_symlink() {
            "sym"
        } else if ft.is_file() {
            "file"
        } else if ft.is_fifo() {
            "fifo"
        } else if ft.is_char_device() {
            "chr"
        } else {
            "other"
        };
        let mut xs = Vec::new();
        if ft.is_dir() || ft.is_file() {
            let mut names = xattr_names(&p);
            names.sort();
            for n in names {
                xs.push(format!(
                    "{}={:?}",
                    String::from_utf8_lossy(&n),
                    xattr_get(&p, &n)
                ));
            }
        }
        let content = if ft.is_file() {
            let b = std::fs::read(&p).unwrap();
            format!("bytes:{}:{}", b.len(), blake(&b))
        } else if ft.is_symlink() {
            format!(
                "target:{:?}",
                std::fs::read_link(&p).unwrap().to_string_lossy()
            )
        } else {
            String::new()
        };
        let mtime = m.mtime() * 1_000_000_000 + m.mtime_nsec();
        out.insert(
            rel.clone(),
            line(
                kind,
                m.mode() & 0o7777,
                m.uid(),
                m.gid(),
                if ft.is_dir() { 0 } else { m.nlink() },
                if ft.is_file() || ft.is_symlink() {
                    m.size()
                } else {
                    0
                },
                mtime,
                m.rdev(),
                xs,
                content,
            ),
        );
        if ft.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().to_string();
                let r = if rel == "/" {
                    format!("/{name}")
                } else {
                    format!("{rel}/{name}")
                };
                stack.push((e.path(), r));
            }
        }
    }
    out
}

pub(super) fn fs_manifest(fs: &WorkspaceFs) -> Manifest {
    let mut out = Manifest::new();
    let mut stack = vec![(InodeNo::ROOT, String::from("/"))];
    while let Some((ino, rel)) = stack.pop() {
        let i = fs.getattr(ino).unwrap().inode;
        let kind = match i.kind {
            Kind::Dir => "dir",
            Kind::Symlink => "sym",
            Kind::File => "file",
            Kind::Fifo => "fifo",
            Kind::CharDev => "chr",
            _ => "other",
        };
        let mut xs = Vec::new();
        if matches!(i.kind, Kind::Dir | Kind::File) {
            let names = fs.listxattr(ino).unwrap();
            let mut names: Vec<&[u8]> =
                names.split(|b| *b == 0).filter(|n| !n.is_empty()).collect();
            names.sort();
            for n in names {
                xs.push(format!(
                    "{}={:?}",
                    String::from_utf8_lossy(n),
                    fs.getxattr(ino, n).unwrap()
                ));
            }
        }
        let content = match i.kind {
            Kind::File => {
                let b = read_all(fs, ino).unwrap();
                format!("bytes:{}:{}", b.len(), blake(&b))
            }
            Kind::Symlink => format!(
                "target:{:?}",
                String::from_utf8_lossy(&fs.readlink(ino).unwrap())
            ),
            _ => String::new(),
        };
        out.insert(
            rel.clone(),
            line(
                kind,
                i.perm,
                i.uid,
                i.gid,
                if i.kind == Kind::Dir {
                    0
                } else {
                    u64::from(i.nlink)
                },
                if matches!(i.kind, Kind::File | Kind::Symlink) {
                    i.size
                } else {
                    0
                },
                i.mtime.0,
                u64::from(i.rdev),
                xs,
                content,
            ),
        );
        if i.kind == Kind::Dir {
            let fh = fs.opendir(ino).unwrap();
            let mut ents = Vec::new();
            fs.readdir(fh, 0, |e, _| {
                ents.push(e.clone());
                false
            })
            .unwrap();
            fs.releasedir(fh);
            for e in ents {
                if e.name == b"." || e.name == b".." {
                    continue;
                }
                let name = String::from_utf8_lossy(&e.name).to_string();
                let r = if rel == "/" {
                    format!("/{name}")
                } else {
                    format!("{rel}/{name}")
                };
                stack.push((e.ino, r));
            }
        }
    }
    out
}

fn xattr_names(p: &Path) -> Vec<Vec<u8>> {
    let f = std::fs::File::open(p).unwrap();
    use std::os::fd::AsFd;
    keel::sys::tree::list_xattrs(f.as_fd()).unwrap()
}

fn xattr_get(p: &Path, n: &[u8]) -> Vec<u8> {
    let f = std::fs::File::open(p).unwrap();
    use std::os::fd::AsFd;
    keel::sys::tree::get_xattr(f.as_fd(), n).unwrap().unwrap()
}

pub(super) fn xattr_set(p: &Path, n: &[u8], v: &[u8]) {
    let f = std::fs::File::open(p).unwrap();
    use std::os::fd::AsFd;
    keel::sys::tree::set_xattr(f.as_fd(), n, v).unwrap();
}

pub(super) fn set_mtime(p: &Path, ns: i64) {
    let dir = std::fs::File::open(p.parent().unwrap()).unwrap();
    use std::os::fd::AsFd;
    keel::sys::tree::lutimes_at(dir.as_fd(), p.file_name().unwrap(), ns, ns).unwrap();
}

fn mkfifo(p: &Path, mode: u32) {
    let dir = std::fs::File::open(p.parent().unwrap()).unwrap();
    use std::os::fd::AsFd;
    keel::sys::tree::mknod_at(dir.as_fd(), p.file_name().unwrap(), libc::S_IFIFO | mode, 0)
        .unwrap();
}

/// The same kinds of entries as `build_rich_tree`, made on the host.
fn build_host_tree(root: &Path) {
    std::fs::create_dir_all(root.join("d/e")).unwrap();
    std::fs::write(root.join("d/small"), b"hello").unwrap();
    std::fs::write(root.join("d/e/big"), noise(1, 300_000)).unwrap();
    let sparse = std::fs::File::create(root.join("sparse")).unwrap();
    use std::os::unix::fs::FileExt;
    sparse.write_all_at(b"tail", 5 * CHUNK + 7).unwrap();
    drop(sparse);
    std::fs::hard_link(root.join("d/e/big"), root.join("hardlink")).unwrap();
    std::os::unix::fs::symlink("d/e/big", root.join("sym")).unwrap();
    mkfifo(&root.join("fifo"), 0o640);
    xattr_set(&root.join("d/small"), b"user.k", b"v\0bin");
    std::os::unix::fs::chown(root.join("d/small"), Some(1000), Some(2000)).unwrap();
    std::fs::set_permissions(
        root.join("d/small"),
        std::fs::Permissions::from_mode(0o4711),
    )
    .unwrap();
    std::fs::write(root.join("empty"), b"").unwrap();
    for i in 0..50 {
        std::fs::write(
            root.join(format!("d/f{i}")),
            format!("file {i}\n").repeat(i * 40),
        )
        .unwrap();
    }
    set_mtime(&root.join("d/small"), 1_000_000_007);
    set_mtime(&root.join("d/e"), 2_000_000_000);
}

/// Every entry's mtime (directories' last) moved to a fixed time well before the walk, so
/// that no file is within the walk's clock tick ("racy", looked at again by the next walk)
/// whatever the machine's speed.
pub(super) fn backdate(root: &Path) {
    let mut all = walkdir(root);
    all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in all.iter().chain(std::iter::once(&root.to_path_buf())) {
        if p != root {
            set_mtime(p, 1_500_000_000_000_000_000 + p.as_os_str().len() as i64);
        }
    }
}

pub(super) fn dir_persister(
    state: &Path,
    remote: Arc<dyn Remote>,
    tree: &DirTree,
) -> keel::persist::Persister {
    let mut p = persister(state, remote);
    p.set_body_opener(Some(tree.opener()));
    p
}

pub(super) fn restore_eager(remote: Arc<dyn Remote>, into: &Path) {
    let mut repo = Repo::new(remote, "ws");
    restore::restore_for_mount(&mut repo, into, RestoreMode::Eager, CHUNK).expect("restore");
}

#[test]
fn a_dir_tree_restores_into_the_fuse_store_byte_for_byte() {
    if !is_root() {
        return;
    }
    let a = tempfile::tempdir().unwrap();
    let tree = DirTree::open(a.path(), 4096, CHUNK).unwrap();
    build_host_tree(tree.root());
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let mut p = dir_persister(a.path(), remote.clone(), &tree);
    let walk = tree.scan().unwrap();
    assert!(walk.created >= 57, "{walk}");
    let r = checkpoint(&mut p);
    assert!(r.seq.is_some(), "{r}");
    let want = host_manifest(tree.root());

    let c = tempfile::tempdir().unwrap();
    restore_eager(remote.clone(), c.path());
    let fs = open_fs(c.path());
    assert_eq!(fs_manifest(&fs), want);
    drop(fs);

    // And back into a directory: the same tree.
    let b = tempfile::tempdir().unwrap();
    restore_eager(remote, b.path());
    let back = DirTree::open(b.path(), 4096, CHUNK).unwrap();
    assert_eq!(host_manifest(back.root()), want);
    // The bodies went into the tree (hard links, then removed): none is left beside it.
    let left: Vec<_> = walkdir(&b.path().join(keel::state::BODIES))
        .into_iter()
        .filter(|p| p.is_file())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

fn walkdir(p: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![p.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd {
            let e = e.unwrap().path();
            if e.is_dir() && !e.is_symlink() {
                stack.push(e.clone());
            }
            out.push(e);
        }
    }
    out
}

#[test]
fn a_fuse_store_builds_into_a_dir_tree_byte_for_byte() {
    if !is_root() {
        return;
    }
    let a = tempfile::tempdir().unwrap();
    let fs = open_fs(a.path());
    build_rich_tree(&fs);
    let want = fs_manifest(&fs);
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let mut p = persister(a.path(), remote.clone());
    checkpoint(&mut p);
    drop(p);
    drop(fs);

    let b = tempfile::tempdir().unwrap();
    restore_eager(remote, b.path());
    let tree = DirTree::open(b.path(), 4096, CHUNK).unwrap();
    assert_eq!(host_manifest(tree.root()), want);
    // Sparse: the 5-window hole is not written.
    let m = std::fs::metadata(tree.root().join("sparse")).unwrap();
    assert!(
        m.blocks() * 512 < 5 * CHUNK,
        "sparse file takes {} blocks",
        m.blocks()
    );
    // Nothing changed since the build: the walk finds nothing.
    let w = tree.scan().unwrap();
    assert_eq!((w.created, w.changed, w.removed), (0, 0, 0), "{w}");

    // The same state dir switched from FUSE to dir: built from its own bodies.
    let fs = open_fs(a.path());
    drop(fs);
    let same = DirTree::open(a.path(), 4096, CHUNK).unwrap();
    assert_eq!(host_manifest(same.root()), want);
}

#[test]
fn a_walk_after_one_change_hashes_only_that_file() {
    if !is_root() {
        return;
    }
    let a = tempfile::tempdir().unwrap();
    let tree = DirTree::open(a.path(), 4096, CHUNK).unwrap();
    build_host_tree(tree.root());
    let big = noise(9, 40 * CHUNK as usize);
    std::fs::write(tree.root().join("huge"), &big).unwrap();
    backdate(tree.root());
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let mut p = dir_persister(a.path(), remote.clone(), &tree);
    tree.scan().unwrap();
    checkpoint(&mut p);

    // Nothing changed: nothing to checkpoint.
    let w = tree.scan().unwrap();
    assert_eq!((w.created, w.changed, w.removed), (0, 0, 0), "{w}");
    assert_eq!(checkpoint(&mut p).seq, None);

    // One byte of the 40-window file: its windows are hashed, one chunk is new.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(tree.root().join("huge"))
        .unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(b"X", 17 * CHUNK + 3).unwrap();
    drop(f);
    set_mtime(&tree.root().join("huge"), 1_600_000_000_000_000_000);
    let w = tree.scan().unwrap();
    assert_eq!((w.created, w.rewritten, w.removed), (0, 1, 0), "{w}");
    let r = checkpoint(&mut p);
    assert_eq!(r.windows_hashed, 40, "{r}");
    assert_eq!(r.chunks_uploaded, 1, "{r}");

    // A rename keeps the inode: no bytes hashed. A removal and a new hard link.
    std::fs::rename(tree.root().join("huge"), tree.root().join("d/huge2")).unwrap();
    std::fs::remove_file(tree.root().join("d/f3")).unwrap();
    std::fs::hard_link(tree.root().join("d/f4"), tree.root().join("f4link")).unwrap();
    let w = tree.scan().unwrap();
    assert_eq!((w.created, w.rewritten, w.removed), (0, 0, 1), "{w}");
    let r = checkpoint(&mut p);
    assert_eq!(r.windows_hashed, 0, "{r}");

    let want = host_manifest(tree.root());
    let c = tempfile::tempdir().unwrap();
    restore_eager(remote, c.path());
    let fs = open_fs(c.path());
    assert_eq!(fs_manifest(&fs), want);
}

#[test]
fn a_file_swapped_for_a_symlink_after_the_walk_is_not_read_through_it() {
    if !is_root() {
        return;
    }
    let a = tempfile::tempdir().unwrap();
    let secret = a.path().join("secret");
    std::fs::write(&secret, noise(5, 100_000)).unwrap();
    let tree = DirTree::open(a.path(), 4096, CHUNK).unwrap();
    std::fs::create_dir(tree.root().join("d")).unwrap();
    std::fs::write(tree.root().join("d/f"), noise(6, 100_000)).unwrap();
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let mut p = dir_persister(a.path(), remote.clone(), &tree);
    tree.scan().unwrap();
    // Between the walk and the checkpoint's read: the directory becomes a symlink, and the
    // file's path then names another file (here one moved in; a symlink out of the tree
    // is refused by the beneath-only resolution before that).
    std::fs::rename(tree.root().join("d"), tree.root().join("d.old")).unwrap();
    std::fs::create_dir(tree.root().join("x")).unwrap();
    std::fs::rename(&secret, tree.root().join("x/f")).unwrap();
    std::os::unix::fs::symlink("x", tree.root().join("d")).unwrap();
    let e = p
        .checkpoint(&keel::persist::CheckpointOptions::default())
        .expect_err("the file changed since the walk");
    assert!(e.to_string().contains("read body"), "{e}");
    // The next walk sees the tree as it is; the checkpoint stores the symlink as a symlink.
    tree.scan().unwrap();
    checkpoint(&mut p);
    let c = tempfile::tempdir().unwrap();
    restore_eager(remote, c.path());
    let fs = open_fs(c.path());
    let m = fs_manifest(&fs);
    assert!(m["/d"].starts_with("sym "), "{}", m["/d"]);
    assert_eq!(m, host_manifest(tree.root()));
}

#[test]
fn fsck_is_clean_and_an_offline_checkpoint_is_refused_on_a_dir_state_dir() {
    if !is_root() {
        return;
    }
    let a = tempfile::tempdir().unwrap();
    let tree = DirTree::open(a.path(), 4096, CHUNK).unwrap();
    build_host_tree(tree.root());
    let remote: Arc<dyn Remote> = Arc::new(MemRemote::new());
    let mut p = dir_persister(a.path(), remote.clone(), &tree);
    tree.scan().unwrap();
    checkpoint(&mut p);
    drop(p);
    // Its bytes are in the tree, not in bodies: fsck checks the rest and finds nothing.
    for quick in [false, true] {
        let opts = keel::persist::fsck::FsckOptions {
            repair: false,
            quick,
            chunk_size: CHUNK,
            remote: Some(Repo::new(remote.clone(), "ws")),
            missing_remote: None,
        };
        let rep = keel::persist::fsck::fsck(a.path(), &opts).unwrap();
        assert!(rep.is_clean(), "{:?}", rep.findings);
    }
    // A checkpoint that would read bodies (none: the files are in the tree) is refused.
    std::fs::write(tree.root().join("d/small"), b"changed").unwrap();
    tree.scan().unwrap();
    let mut offline = persister(a.path(), remote);
    let e = offline
        .checkpoint(&keel::persist::CheckpointOptions::default())
        .expect_err("no opener");
    assert!(e.to_string().contains("dir workspace"), "{e}");
}

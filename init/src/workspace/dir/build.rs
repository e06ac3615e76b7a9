//! Building a whole tree from a description of it (`Source`: the store and its bodies
//! after a restore or under FUSE, or a snapshot for a rollback): directories, files
//! (hard-linked from a body, from the live tree when their bytes are the same, or written
//! from inline bytes or chunks, holes kept), symlinks, hard links, FIFOs, sockets and
//! device nodes, then xattrs, owners, modes and times (directories' last, deepest first, so
//! that nothing written into them moves their mtime afterwards). The tree is built in a
//! directory of its own (0700 while it is built) that the caller swaps in.
//!
//! What the process may not do is counted and reported, not fatal: xattrs outside `user.`
//! without CAP_SYS_ADMIN, owners other than its own without CAP_CHOWN, device nodes
//! without CAP_MKNOD.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{DirError, Paths};
use crate::chunk::BodyStore;
use crate::meta::{Inode, InodeNo, Kind, Storage, Store};
use crate::sys::tree as t;

/// What a source holds for a file's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceData {
    None,
    Inline(Vec<u8>),
    Symlink(Vec<u8>),
    /// Bytes the source writes (`Source::write_bytes`) or links (`Source::body_path`).
    Body,
}

/// One inode as a source describes it.
#[derive(Debug, Clone)]
pub struct SourceInode {
    pub inode: Inode,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub data: SourceData,
}

/// A tree to build.
pub trait Source {
    /// The entries of directory `dir`: name, inode, kind.
    fn entries(&self, dir: InodeNo) -> Result<Vec<(Vec<u8>, InodeNo, Kind)>, DirError>;
    fn inode(&self, ino: InodeNo) -> Result<Option<SourceInode>, DirError>;
    /// A file holding exactly the bytes of `ino`, private to keel, to hard-link.
    fn body_path(&self, _ino: InodeNo) -> Option<PathBuf> {
        None
    }
    /// Whether the live tree's file for `ino` (as the last walk found it) holds the bytes
    /// `ino` has here.
    fn same_bytes_as_live(&self, _ino: InodeNo) -> bool {
        false
    }
    /// Writes the bytes of `ino` into the new, empty file `f` (holes left unwritten).
    fn write_bytes(&self, ino: InodeNo, _size: u64, _f: &File) -> io::Result<u64> {
        Err(io::Error::other(format!("no bytes for inode {}", ino.0)))
    }
}

/// What a build did.
#[derive(Debug, Clone, Default)]
pub struct BuildReport {
    pub files: u64,
    pub dirs: u64,
    pub bytes: u64,
    /// Files hard-linked from the live tree (bytes unchanged).
    pub reused: u64,
    /// Xattrs, owners and device nodes the process was not allowed to set or make.
    pub skipped_xattrs: u64,
    pub skipped_owners: u64,
    pub skipped_nodes: u64,
    pub elapsed: Duration,
}

impl BuildReport {
    /// ", ..." naming what could not be set, or nothing.
    pub fn skipped_note(&self) -> String {
        let mut parts = Vec::new();
        for (n, what) in [
            (
                self.skipped_xattrs,
                "xattrs (not user.*: need CAP_SYS_ADMIN)",
            ),
            (self.skipped_owners, "owners (need CAP_CHOWN)"),
            (self.skipped_nodes, "device nodes (need CAP_MKNOD)"),
        ] {
            if n > 0 {
                parts.push(format!("{n} {what}"));
            }
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!("; NOT set: {}", parts.join(", "))
        }
    }
}

fn denied(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::ENOTSUP)
    )
}

struct Builder<'a> {
    src: &'a dyn Source,
    dest: PathBuf,
    reuse: Option<(&'a OwnedFd, &'a Paths)>,
    /// The first name of each inode with more than one, below `dest`.
    first: HashMap<InodeNo, PathBuf>,
    report: BuildReport,
}

/// Builds the tree `src` describes at `dest` (which must not exist). `reuse`: the live
/// tree's root and where the last walk found its files, for files whose bytes are the
/// same.
pub fn build(
    src: &dyn Source,
    dest: &Path,
    reuse: Option<(&OwnedFd, &Paths)>,
) -> Result<BuildReport, DirError> {
    let t0 = Instant::now();
    let err = |source| DirError::Build {
        path: dest.to_path_buf(),
        source,
    };
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dest)
            .map_err(err)?;
    }
    let root_fd = super::open_dir(dest)?;
    let mut b = Builder {
        src,
        dest: dest.to_path_buf(),
        reuse,
        first: HashMap::new(),
        report: BuildReport::default(),
    };
    let mut dirs: Vec<(PathBuf, SourceInode)> = Vec::new();
    let mut stack: Vec<(InodeNo, OwnedFd, PathBuf)> = vec![(
        InodeNo::ROOT,
        root_fd.try_clone().map_err(err)?,
        PathBuf::new(),
    )];
    let mut progress = Instant::now();
    while let Some((dir, fd, rel)) = stack.pop() {
        b.report.dirs += 1;
        for (name, ino, kind) in src.entries(dir)? {
            let name = OsStr::from_bytes(&name).to_os_string();
            let path = rel.join(&name);
            if let Some(sub) = b.entry(&root_fd, &fd, &name, &path, ino, kind, &mut dirs)? {
                stack.push((ino, sub, path));
            }
        }
        if progress.elapsed() >= Duration::from_secs(5) {
            progress = Instant::now();
            tracing::info!(
                files = b.report.files,
                dirs = b.report.dirs,
                bytes = b.report.bytes,
                "building the workspace tree"
            );
        }
    }
    // Directories' attributes last, deepest first; the root's on the new tree itself.
    for (rel, si) in dirs.iter().rev() {
        let parent = rel.parent().unwrap_or(Path::new(""));
        let pfd = open_below(&root_fd, parent).map_err(|e| b.at(rel, e))?;
        let name = rel.file_name().unwrap_or_default();
        b.attrs(&pfd, name, rel, si)?;
    }
    if let Some(root) = src.inode(InodeNo::ROOT)? {
        let parent = super::open_dir(dest.parent().unwrap_or(Path::new("/")))?;
        let name = dest.file_name().unwrap_or_default();
        b.attrs(&parent, name, Path::new(""), &root)?;
    }
    b.report.elapsed = t0.elapsed();
    Ok(b.report)
}

/// Opens the directory `rel` below `root` (built by keel, nobody else writes there).
fn open_below(root: &OwnedFd, rel: &Path) -> io::Result<OwnedFd> {
    if rel.as_os_str().is_empty() {
        return root.try_clone();
    }
    crate::sys::beneath::open_beneath(
        root.as_fd(),
        rel,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    )
}

impl Builder<'_> {
    fn at(&self, rel: &Path, source: io::Error) -> DirError {
        DirError::Build {
            path: self.dest.join(rel),
            source,
        }
    }

    /// Makes one entry; a directory to fill is returned open.
    #[allow(clippy::too_many_arguments)]
    fn entry(
        &mut self,
        root: &OwnedFd,
        dir: &OwnedFd,
        name: &OsStr,
        path: &Path,
        ino: InodeNo,
        kind: Kind,
        dirs: &mut Vec<(PathBuf, SourceInode)>,
    ) -> Result<Option<OwnedFd>, DirError> {
        if let Some(first) = self.first.get(&ino) {
            let from = open_below(root, first.parent().unwrap_or(Path::new("")))
                .map_err(|e| self.at(path, e))?;
            t::link_at(
                from.as_fd(),
                first.file_name().unwrap_or_default(),
                dir.as_fd(),
                name,
            )
            .map_err(|e| self.at(path, e))?;
            return Ok(None);
        }
        let Some(si) = self.src.inode(ino)? else {
            tracing::warn!(path = %path.display(), ino = ino.0, "an entry names an inode the snapshot does not have: left out");
            return Ok(None);
        };
        let at = |e| DirError::Build {
            path: self.dest.join(path),
            source: e,
        };
        match kind {
            Kind::Dir => {
                t::mkdir_at(dir.as_fd(), name, 0o700).map_err(at)?;
                let fd = t::open_at(dir.as_fd(), name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
                    .map_err(at)?;
                dirs.push((path.to_path_buf(), si));
                return Ok(Some(fd));
            }
            Kind::File => {
                self.file(dir, name, path, ino, &si)?;
                self.report.files += 1;
            }
            Kind::Symlink => {
                let target = match &si.data {
                    SourceData::Symlink(v) => v.clone(),
                    _ => Vec::new(),
                };
                t::symlink_at(OsStr::from_bytes(&target), dir.as_fd(), name).map_err(at)?;
            }
            Kind::Fifo | Kind::Socket | Kind::CharDev | Kind::BlockDev => {
                let mode = kind.mode_bits() | (si.inode.perm & 0o777);
                match t::mknod_at(dir.as_fd(), name, mode, u64::from(si.inode.rdev)) {
                    Ok(()) => {}
                    Err(e) if denied(&e) => {
                        self.report.skipped_nodes += 1;
                        return Ok(None);
                    }
                    Err(e) => return Err(at(e)),
                }
            }
        }
        self.attrs(dir, name, path, &si)?;
        if si.inode.nlink > 1 {
            self.first.insert(ino, path.to_path_buf());
        }
        Ok(None)
    }

    /// A regular file: its bytes from a body, the live tree or the source.
    fn file(
        &mut self,
        dir: &OwnedFd,
        name: &OsStr,
        path: &Path,
        ino: InodeNo,
        si: &SourceInode,
    ) -> Result<(), DirError> {
        let at = |e| DirError::Build {
            path: self.dest.join(path),
            source: e,
        };
        let size = si.inode.size;
        if si.data == SourceData::Body {
            if let Some(body) = self.src.body_path(ino) {
                t::link_path(&body, dir.as_fd(), name).map_err(at)?;
                let f = t::open_at(dir.as_fd(), name, libc::O_WRONLY, 0).map_err(at)?;
                let f = File::from(f);
                if f.metadata().map_err(at)?.len() != size {
                    f.set_len(size).map_err(at)?;
                }
                self.report.bytes += size;
                return Ok(());
            }
            if self.src.same_bytes_as_live(ino) && self.link_live(dir, name, ino, size) {
                self.report.reused += 1;
                return Ok(());
            }
        }
        let fd = t::open_at(
            dir.as_fd(),
            name,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )
        .map_err(at)?;
        let mut f = File::from(fd);
        match &si.data {
            SourceData::Inline(v) => {
                f.write_all(v).map_err(at)?;
                self.report.bytes += v.len() as u64;
            }
            SourceData::Body => {
                self.report.bytes += self.src.write_bytes(ino, size, &f).map_err(at)?;
            }
            _ => {}
        }
        if f.metadata().map_err(at)?.len() != size {
            f.set_len(size).map_err(at)?;
        }
        Ok(())
    }

    /// Hard-links the live tree's file of `ino` (opened beneath the live root, and only if
    /// it is still the host inode the last walk found, of the same size) into the new tree.
    fn link_live(&self, dir: &OwnedFd, name: &OsStr, ino: InodeNo, size: u64) -> bool {
        let Some((live, paths)) = self.reuse else {
            return false;
        };
        let Some((rel, host)) = paths.get(&ino) else {
            return false;
        };
        let Ok(fd) = crate::sys::beneath::open_beneath(
            live.as_fd(),
            rel,
            libc::O_PATH | libc::O_NOFOLLOW,
            0,
        ) else {
            return false;
        };
        match t::fstat(fd.as_fd()) {
            Ok(st) if st.ino == *host && st.size == size && st.kind() == libc::S_IFREG => {}
            _ => return false,
        }
        t::link_fd(fd.as_fd(), dir.as_fd(), name).is_ok()
    }

    /// Xattrs, owner, mode and times of the entry `name` of `dir`.
    fn attrs(
        &mut self,
        dir: &OwnedFd,
        name: &OsStr,
        path: &Path,
        si: &SourceInode,
    ) -> Result<(), DirError> {
        let at = |e| DirError::Build {
            path: self.dest.join(path),
            source: e,
        };
        let i = &si.inode;
        let name = if name.is_empty() {
            OsStr::new(".")
        } else {
            name
        };
        if matches!(i.kind, Kind::File | Kind::Dir) && !si.xattrs.is_empty() {
            let flags = libc::O_RDONLY
                | libc::O_NONBLOCK
                | if i.kind == Kind::Dir {
                    libc::O_DIRECTORY
                } else {
                    0
                };
            let fd = t::open_at(dir.as_fd(), name, flags, 0).map_err(at)?;
            for (n, v) in &si.xattrs {
                match t::set_xattr(fd.as_fd(), n, v) {
                    Ok(()) => {}
                    Err(e) if denied(&e) => self.report.skipped_xattrs += 1,
                    Err(e) => return Err(at(e)),
                }
            }
        }
        match t::lchown_at(dir.as_fd(), name, i.uid, i.gid) {
            Ok(()) => {}
            Err(e) if denied(&e) => self.report.skipped_owners += 1,
            Err(e) => return Err(at(e)),
        }
        if i.kind != Kind::Symlink {
            t::chmod_at(dir.as_fd(), name, i.perm).map_err(at)?;
        }
        t::lutimes_at(dir.as_fd(), name, i.atime.0, i.mtime.0).map_err(at)?;
        Ok(())
    }
}

/// The store and its bodies as a source (a restore into `dir`, or a state dir the FUSE
/// provider wrote).
pub(super) struct StoreSource<'a> {
    store: &'a std::sync::Mutex<Store>,
    bodies: &'a BodyStore,
}

impl<'a> StoreSource<'a> {
    pub(super) fn new(store: &'a std::sync::Mutex<Store>, bodies: &'a BodyStore) -> Self {
        StoreSource { store, bodies }
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Source for StoreSource<'_> {
    fn entries(&self, dir: InodeNo) -> Result<Vec<(Vec<u8>, InodeNo, Kind)>, DirError> {
        Ok(self
            .store()
            .read()
            .list(dir)?
            .into_iter()
            .map(|d| (d.name, d.ino, d.kind))
            .collect())
    }

    fn inode(&self, ino: InodeNo) -> Result<Option<SourceInode>, DirError> {
        let s = self.store();
        let r = s.read();
        let Some(inode) = r.get(ino)? else {
            return Ok(None);
        };
        let mut xattrs = Vec::new();
        for n in r.xattr_names(ino)? {
            if let Some(v) = r.xattr(ino, &n)? {
                xattrs.push((n, v));
            }
        }
        let data = match (inode.kind, inode.storage) {
            (Kind::File, Storage::Inline) => SourceData::Inline(r.inline_data(ino)?),
            (Kind::File, Storage::Body) => SourceData::Body,
            (Kind::Symlink, _) => SourceData::Symlink(r.symlink_target(ino)?.unwrap_or_default()),
            _ => SourceData::None,
        };
        Ok(Some(SourceInode {
            inode,
            xattrs,
            data,
        }))
    }

    fn body_path(&self, ino: InodeNo) -> Option<PathBuf> {
        let p = self.bodies.path(ino.0);
        p.exists().then_some(p)
    }

    /// A body file that is not there holds zeros (a file extended with a hole and never
    /// written): nothing to write.
    fn write_bytes(&self, _ino: InodeNo, _size: u64, _f: &File) -> io::Result<u64> {
        Ok(0)
    }
}

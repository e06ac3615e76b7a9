//! The walk: every entry of the tree, depth first through directory fds (never following
//! a symlink), compared with what the last walk recorded, and the store brought up to date
//! in one transaction, the way the FUSE write path records the same changes: new inodes
//! and entries, attributes, xattrs, symlink targets, inline bytes for small files, and
//! every window of a file whose bytes may have changed marked dirty (the checkpoint hashes
//! those and uploads only the chunks the remote lacks).
//!
//! An entry is the same inode as before when its host inode is (a rename or a new hard link
//! keeps the store's inode number), and unchanged when its size, mtime and ctime are too:
//! any change of bytes, mode, owner, xattrs or links moves the ctime. A file whose mtime
//! is within `RACY_NS` of the walk is recorded with an impossible mtime, so the next walk
//! looks at it again (a write in the same clock tick would leave the times as they were).
//! Without a record (after a build), an entry whose name, kind, size and mtime match the
//! store is taken as it is. A directory that cannot be read keeps what the store had below
//! it. Entries that vanish while the walk runs are skipped; a directory met twice (renamed
//! during the walk) is taken once.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::watch::Rewritten;
use super::{kind_of, DirError, Paths};
use crate::chunk::chunker::window_count;
use crate::meta::{HostRow, Inode, InodeNo, Kind, Nanos, Storage, Store, Tx};
use crate::sys::tree::{self as t, FullStat};

/// A file modified this close to the walk is looked at again by the next one.
const RACY_NS: i64 = 50_000_000;

/// What one walk found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanReport {
    pub entries: u64,
    pub dirs: u64,
    /// Inodes new to the store.
    pub created: u64,
    /// Inodes whose attributes, xattrs or bytes changed.
    pub changed: u64,
    /// Files whose bytes may have changed (their windows are hashed by the checkpoint).
    pub rewritten: u64,
    pub removed: u64,
    /// Directories that could not be read (what the store had below them is kept).
    pub unreadable: u64,
    pub elapsed: Duration,
    /// Of `elapsed`: reading the store's entries and the last walk's records.
    pub loaded: Duration,
    /// Only the directories change notification named were listed (see `watch`).
    pub narrowed: bool,
}

impl std::fmt::Display for ScanReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "walked {} entries in {} {}dirs in {:.1} ms ({:.1} ms reading the store): {} new, {} changed ({} rewritten), {} gone",
            self.entries,
            self.dirs,
            if self.narrowed { "changed " } else { "" },
            self.elapsed.as_secs_f64() * 1e3,
            self.loaded.as_secs_f64() * 1e3,
            self.created,
            self.changed,
            self.rewritten,
            self.removed
        )?;
        if self.unreadable > 0 {
            write!(f, ", {} unreadable dirs kept as they were", self.unreadable)?;
        }
        Ok(())
    }
}

/// The store as the walk starts, and what the walk found so far.
struct Walk<'a> {
    tx: &'a Tx<'a>,
    inline_max: u64,
    chunk_size: u64,
    start_ns: i64,
    /// Inode records read so far (only those the walk needs: changed, new, renamed).
    inodes: HashMap<InodeNo, Inode>,
    /// Inodes whose links may have changed in this walk (their link count is checked at
    /// the end, and those left without a name are deleted).
    touched: HashSet<InodeNo>,
    /// The store's entries of each directory not walked yet.
    entries: HashMap<InodeNo, HashMap<Vec<u8>, (InodeNo, Kind)>>,
    host: HashMap<InodeNo, HostRow>,
    /// Built from `host` when first needed (see `by_host()`); until then the host inodes
    /// of new entries wait in `new_hosts`.
    by_host: Option<HashMap<u64, InodeNo>>,
    new_hosts: Vec<(u64, InodeNo)>,
    /// Names found per inode; subdirectories found per directory.
    names: HashMap<InodeNo, u32>,
    subdirs: HashMap<InodeNo, u32>,
    /// Inodes whose record this walk already brought up to date.
    synced: HashSet<InodeNo>,
    /// Files whose bytes are read again whatever their times say (`watch::Rewritten`).
    rewritten: &'a Rewritten,
    paths: Paths,
    report: ScanReport,
    /// A narrowed walk (`scan_dirs`): only some directories are listed, existing
    /// subdirectories are not descended into, and what it cannot decide from the
    /// directories it lists (`bail`) sends the caller to a full walk.
    narrowed: bool,
    /// Directories listed whole by this walk.
    walked: HashSet<InodeNo>,
    bail: Option<String>,
}

/// How a walk goes: files up to `inline_max` bytes are kept inline, bigger ones in windows
/// of `chunk_size`; the files of `rewritten` are read again whatever their times say;
/// `on_dir` is called with each directory's path below the root before it is listed (the
/// watcher adds its watch then).
#[derive(Clone, Copy)]
pub(super) struct Opts<'a> {
    pub inline_max: u64,
    pub chunk_size: u64,
    pub rewritten: &'a Rewritten,
    pub on_dir: &'a dyn Fn(&Path),
}

/// Walks the tree at `root` into `store`; returns what it did and where each file kept in
/// a body is.
pub(super) fn scan(
    store: &Store,
    root: &Path,
    opts: &Opts<'_>,
) -> Result<(ScanReport, Paths), DirError> {
    let on_dir = opts.on_dir;
    let t0 = Instant::now();
    let walk_err = |path: &Path, source: std::io::Error| DirError::Walk {
        path: path.to_path_buf(),
        source,
    };
    let root_fd = super::open_dir(root)?;
    let root_st = t::fstat(root_fd.as_fd()).map_err(|e| walk_err(root, e))?;
    let tx = store.write()?;
    let mut entries: HashMap<InodeNo, HashMap<Vec<u8>, (InodeNo, Kind)>> = HashMap::new();
    for (p, d) in tx.all_dirents()? {
        entries
            .entry(p)
            .or_default()
            .insert(d.name, (d.ino, d.kind));
    }
    let host = tx.host_rows()?;
    let loaded = t0.elapsed();
    let mut w = Walk::new(&tx, opts, entries, host, HashMap::new(), false);
    // The root: inode 1 whatever its host inode.
    w.sync(
        InodeNo::ROOT,
        &root_st,
        Some(&root_fd),
        InodeNo::ROOT,
        Path::new(""),
    )?;
    w.note_host(root_st.ino, InodeNo::ROOT);
    w.walk(root, vec![(root_fd, InodeNo::ROOT, PathBuf::new())], on_dir)?;
    w.finish()?;
    let Walk {
        mut report, paths, ..
    } = w;
    tx.commit()?;
    report.elapsed = t0.elapsed();
    report.loaded = loaded;
    Ok((report, paths))
}

/// What a narrowed walk did: done (the report and where each file kept in a body is now),
/// or a full walk is needed (nothing was written), and why.
pub(super) enum Narrowed {
    Done(ScanReport),
    NeedFull(String),
}

/// A narrowed walk: the directories `dirs` (paths below the root, each in the store and
/// watched) listed whole and compared with the store's entries of each, new directories
/// found in them walked whole, the root's own attributes looked at; `paths` (the last
/// walk's) brought up to date. Whatever it cannot decide from those directories alone (a
/// directory replaced, removed or moved; a hard link to a file elsewhere; a name of a
/// hard-linked file gone) leaves the store as it was and asks for a full walk.
pub(super) fn scan_dirs(
    store: &Store,
    root: &Path,
    dirs: &[PathBuf],
    paths: &mut Paths,
    opts: &Opts<'_>,
) -> Result<Narrowed, DirError> {
    let on_dir = opts.on_dir;
    let t0 = Instant::now();
    let walk_err = |path: &Path, source: std::io::Error| DirError::Walk {
        path: path.to_path_buf(),
        source,
    };
    let root_fd = super::open_dir(root)?;
    let root_st = t::fstat(root_fd.as_fd()).map_err(|e| walk_err(root, e))?;
    let tx = store.write()?;
    // Each directory's inode (by its names from the root) and the records of it and of
    // its entries, all before the walk (a file renamed between two of them is found by
    // its host inode in either).
    let mut host = tx.host_rows_in(InodeNo::ROOT)?;
    let mut todo = Vec::new();
    for rel in dirs {
        let (mut ino, mut parent) = (InodeNo::ROOT, InodeNo::ROOT);
        for c in rel.components() {
            match tx.lookup(ino, c.as_os_str().as_bytes())? {
                Some(d) if d.kind == Kind::Dir => (parent, ino) = (ino, d.ino),
                _ => {
                    return Ok(Narrowed::NeedFull(format!(
                        "{} is not in the store",
                        rel.display()
                    )))
                }
            }
        }
        if ino != InodeNo::ROOT {
            host.extend(tx.host_rows_in(ino)?);
        }
        todo.push((rel.clone(), ino, parent));
    }
    let loaded = t0.elapsed();
    let mut w = Walk::new(&tx, opts, HashMap::new(), host, std::mem::take(paths), true);
    let r = narrowed_walk(&mut w, root, &root_fd, &root_st, todo, on_dir);
    let Walk {
        mut report,
        paths: new_paths,
        bail,
        ..
    } = w;
    *paths = new_paths;
    r?;
    if let Some(why) = bail {
        return Ok(Narrowed::NeedFull(why)); // the transaction is dropped: nothing written
    }
    tx.commit()?;
    report.elapsed = t0.elapsed();
    report.loaded = loaded;
    report.narrowed = true;
    Ok(Narrowed::Done(report))
}
/// The listing part of [`scan_dirs`]: each directory of `todo` (its path, inode and
/// parent's inode) opened beneath the root, checked to be the host inode the store knows,
/// its own attributes synced, then walked.
fn narrowed_walk(
    w: &mut Walk<'_>,
    root: &Path,
    root_fd: &OwnedFd,
    root_st: &FullStat,
    todo: Vec<(PathBuf, InodeNo, InodeNo)>,
    on_dir: &dyn Fn(&Path),
) -> Result<(), DirError> {
    let walk_err = |path: &Path, source: std::io::Error| DirError::Walk {
        path: path.to_path_buf(),
        source,
    };
    w.sync(
        InodeNo::ROOT,
        root_st,
        Some(root_fd),
        InodeNo::ROOT,
        Path::new(""),
    )?;
    let mut stack = Vec::new();
    let open = |rel: &Path| {
        crate::sys::beneath::open_beneath(
            root_fd.as_fd(),
            rel,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
            0,
        )
    };
    for (rel, ino, parent) in todo {
        if ino == InodeNo::ROOT {
            let fd = root_fd.try_clone().map_err(|e| walk_err(root, e))?;
            stack.push((fd, ino, rel));
            continue;
        }
        let up = match rel.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let (fd, up_fd) = match (open(&rel), open(up)) {
            (Ok(fd), Ok(up_fd)) => (fd, up_fd),
            (Err(e), _) | (_, Err(e)) => {
                w.bail = Some(format!("{}: {e}", rel.display()));
                return Ok(());
            }
        };
        let st = t::fstat(fd.as_fd()).map_err(|e| walk_err(&rel, e))?;
        if w.host.get(&ino).is_none_or(|h| h.host_ino != st.ino) {
            w.bail = Some(format!("{} was replaced", rel.display()));
            return Ok(());
        }
        // Its own attributes (an entry made or removed in it moves its times), which
        // its parent's listing would look at.
        w.sync(ino, &st, Some(&up_fd), parent, &rel)?;
        stack.push((fd, ino, rel));
    }
    w.walk(root, stack, on_dir)?;
    if w.bail.is_none() {
        w.finish()?;
    }
    Ok(())
}

fn vanished(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP) | Some(libc::ENXIO)
    )
}

impl<'a> Walk<'a> {
    /// A walk in `tx` as `opts` say, starting from the store's `entries` per directory (a
    /// narrowed walk reads those of the directories it lists as it goes), the last walk's
    /// `host` records and `paths`, found nothing yet.
    fn new(
        tx: &'a Tx<'a>,
        opts: &Opts<'a>,
        entries: HashMap<InodeNo, HashMap<Vec<u8>, (InodeNo, Kind)>>,
        host: HashMap<InodeNo, HostRow>,
        paths: Paths,
        narrowed: bool,
    ) -> Self {
        Walk {
            tx,
            inline_max: opts.inline_max,
            chunk_size: opts.chunk_size,
            start_ns: Nanos::now().0,
            inodes: HashMap::new(),
            touched: HashSet::new(),
            entries,
            host,
            by_host: None,
            new_hosts: Vec::new(),
            names: HashMap::new(),
            subdirs: HashMap::new(),
            synced: HashSet::new(),
            rewritten: opts.rewritten,
            paths,
            report: ScanReport::default(),
            narrowed,
            walked: HashSet::new(),
            bail: None,
        }
    }

    /// Lists the directories of `stack` and those found below them (below each known one
    /// too, unless the walk is narrowed), comparing each entry with the store.
    fn walk(
        &mut self,
        root: &Path,
        mut stack: Vec<(OwnedFd, InodeNo, PathBuf)>,
        on_dir: &dyn Fn(&Path),
    ) -> Result<(), DirError> {
        while let Some((fd, dir, rel)) = stack.pop() {
            if self.bail.is_some() {
                return Ok(());
            }
            if !self.walked.insert(dir) {
                continue; // named twice (a narrowed walk's directory and its new parent)
            }
            self.report.dirs += 1;
            on_dir(&rel);
            let names = match t::read_names(fd.as_fd()) {
                Ok(n) => n,
                Err(e) if self.narrowed => {
                    self.bail = Some(format!("cannot read {}: {e}", rel.display()));
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(path = %root.join(&rel).display(), error = %e, "cannot read a directory of the workspace: keeping what the last checkpoint had below it");
                    self.report.unreadable += 1;
                    self.keep_subtree(dir);
                    continue;
                }
            };
            let mut old = match self.entries.remove(&dir) {
                Some(o) => o,
                None if self.narrowed => self
                    .tx
                    .list(dir)?
                    .into_iter()
                    .map(|d| (d.name, (d.ino, d.kind)))
                    .collect(),
                None => HashMap::new(),
            };
            for name in names {
                if let Some(sub) = self.entry(&fd, dir, &rel, &name, &mut old)? {
                    stack.push(sub);
                }
                if self.bail.is_some() {
                    return Ok(());
                }
            }
            for (name, (ino, kind)) in old {
                if self.narrowed {
                    // What a narrowed walk cannot follow: a directory gone (its subtree), a
                    // name gone of a file that has others (where its bytes are read from).
                    if kind == Kind::Dir || self.inode(ino)?.is_some_and(|i| i.nlink > 1) {
                        self.bail = Some(format!(
                            "{} went and was a directory or a hard link",
                            rel.join(OsStr::from_bytes(&name)).display()
                        ));
                        return Ok(());
                    }
                }
                self.tx.unlink(dir, &name)?;
                self.touched.insert(ino);
            }
        }
        Ok(())
    }

    /// Host inode → store inode, built when first needed (a new name, a rename, a hard link).
    fn by_host(&mut self) -> &HashMap<u64, InodeNo> {
        if self.by_host.is_none() {
            let mut m: HashMap<u64, InodeNo> =
                self.host.iter().map(|(i, h)| (h.host_ino, *i)).collect();
            m.extend(self.new_hosts.iter().copied());
            self.by_host = Some(m);
        }
        self.by_host.as_ref().expect("just built")
    }

    /// Records that host inode `host` is store inode `ino` (a new one, or the root).
    fn note_host(&mut self, host: u64, ino: InodeNo) {
        match self.by_host.as_mut() {
            Some(m) => {
                m.insert(host, ino);
            }
            None => self.new_hosts.push((host, ino)),
        }
    }

    /// The store's record of `ino` (read once).
    fn inode(&mut self, ino: InodeNo) -> Result<Option<&Inode>, DirError> {
        if !self.inodes.contains_key(&ino) {
            match self.tx.get(ino)? {
                Some(i) if i.nlink > 0 || ino == InodeNo::ROOT => {
                    self.inodes.insert(ino, i);
                }
                _ => return Ok(None),
            }
        }
        Ok(self.inodes.get(&ino))
    }

    /// One entry of directory `dir` (open as `fd`, at `rel` below the root): linked in the
    /// store to the inode it is; a directory to walk is returned.
    fn entry(
        &mut self,
        fd: &OwnedFd,
        dir: InodeNo,
        rel: &Path,
        name: &OsStr,
        old: &mut HashMap<Vec<u8>, (InodeNo, Kind)>,
    ) -> Result<Option<(OwnedFd, InodeNo, PathBuf)>, DirError> {
        let path = rel.join(name);
        let st = match t::lstat_at(fd.as_fd(), name) {
            Ok(s) => s,
            Err(e) if vanished(&e) => return Ok(None),
            Err(source) => return Err(DirError::Walk { path, source }),
        };
        let Some(kind) = kind_of(st.mode) else {
            return Ok(None);
        };
        self.report.entries += 1;
        let prev = old.get(name.as_bytes()).copied();
        // The common case, decided without the store: the same host inode at the same name,
        // its size and times as the last walk recorded them, one link.
        if let Some((pi, pk)) = prev {
            let same = pk == kind
                && kind != Kind::Dir
                && st.nlink == 1
                && !(kind == Kind::File && self.rewritten.contains(&path))
                && self.host.get(&pi).is_some_and(|h| {
                    h.host_ino == st.ino
                        && h.size == st.size
                        && h.mtime == st.mtime_ns
                        && h.ctime == st.ctime_ns
                });
            if same {
                old.remove(name.as_bytes());
                self.names.insert(pi, 1);
                if kind == Kind::File {
                    self.paths.insert(pi, (path, st.ino));
                }
                return Ok(None);
            }
        }
        let key = name.as_bytes().to_vec();
        // Which inode of the store this is: the one at this name if it is the same host
        // inode (or has no record yet and looks the same), else the one that host inode
        // is anywhere (renamed, or another hard link), else a new one.
        let same_here = match prev {
            Some((pi, pk)) if pk == kind => match self.host.get(&pi) {
                Some(h) => (h.host_ino == st.ino).then_some(pi),
                None => self
                    .inode(pi)?
                    .is_some_and(|i| looks_same(i, &st))
                    .then_some(pi),
            },
            _ => None,
        };
        // Found under another name: a rename or a hard link keeps the mtime; a host inode
        // number freed and given to a new file (most filesystems reuse them at once) does
        // not, and is a new inode (a file renamed and rewritten counts as new too).
        let known = match same_here {
            Some(i) => Some(i),
            None => match self.by_host().get(&st.ino).copied() {
                Some(i)
                    if (self.synced.contains(&i)
                        || self
                            .host
                            .get(&i)
                            .is_some_and(|h| h.mtime == st.mtime_ns || kind == Kind::Dir))
                        && self.inode(i)?.is_some_and(|x| x.kind == kind) =>
                {
                    Some(i)
                }
                _ => None,
            },
        };
        if kind == Kind::Dir && known.is_some_and(|i| self.names.contains_key(&i)) {
            return Ok(None); // met twice: renamed while the walk ran
        }
        if self.narrowed {
            let why = if matches!(prev, Some((_, Kind::Dir))) && same_here.is_none() {
                Some("a directory was replaced")
            } else if kind == Kind::Dir && known.is_some() && same_here.is_none() {
                Some("a directory was moved here")
            } else if kind != Kind::Dir && known.is_none() && st.nlink > 1 {
                Some("a hard link to a file that may be named elsewhere")
            } else {
                None
            };
            if let Some(why) = why {
                self.bail = Some(format!("{}: {why}", path.display()));
                return Ok(None);
            }
        }
        // A directory is opened before it is linked: one that went meanwhile is skipped.
        let sub = if kind == Kind::Dir {
            match t::open_at(
                fd.as_fd(),
                name,
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NONBLOCK,
                0,
            ) {
                Ok(s) => match t::fstat(s.as_fd()) {
                    Ok(x) if x.ino == st.ino => Some(s),
                    _ => return Ok(None),
                },
                Err(e) if vanished(&e) => return Ok(None),
                Err(source) => return Err(DirError::Walk { path, source }),
            }
        } else {
            None
        };
        let ino = match known {
            Some(i) => i,
            None => self.create(&st, kind, dir)?,
        };
        if !self.synced.contains(&ino) {
            self.sync(ino, &st, Some(fd), dir, &path)?;
        }
        old.remove(&key);
        if prev != Some((ino, kind)) {
            if let Some((was, _)) = prev {
                self.tx.relink(dir, &key, ino, kind)?;
                self.touched.insert(was);
            } else {
                self.tx.link(dir, &key, ino, kind)?;
            }
            self.touched.insert(ino);
        }
        *self.names.entry(ino).or_default() += 1;
        if kind == Kind::File {
            self.paths.insert(ino, (path.clone(), st.ino));
        }
        Ok(match sub {
            Some(s) => {
                *self.subdirs.entry(dir).or_default() += 1;
                // A narrowed walk lists only new directories below those it was given.
                (!self.narrowed || known.is_none()).then_some((s, ino, path))
            }
            None => None,
        })
    }

    /// A new inode for a host file (its record follows in `sync`).
    fn create(&mut self, st: &FullStat, kind: Kind, parent: InodeNo) -> Result<InodeNo, DirError> {
        let mut i = inode_of(st, kind, parent);
        i.storage = Storage::Inline;
        i.size = 0;
        // Never "the same as the store": `sync` records it whole.
        i.mtime = Nanos(i64::MIN);
        let ino = self.tx.insert(&i)?;
        i.ino = ino;
        self.inodes.insert(ino, i);
        self.touched.insert(ino);
        self.note_host(st.ino, ino);
        self.report.created += 1;
        Ok(ino)
    }

    /// Brings inode `ino`'s record up to date with `st` (of the entry `path`, in the
    /// directory `dir_fd`; `None`: the root).
    fn sync(
        &mut self,
        ino: InodeNo,
        st: &FullStat,
        dir_fd: Option<&OwnedFd>,
        parent: InodeNo,
        path: &Path,
    ) -> Result<(), DirError> {
        self.synced.insert(ino);
        let rec = self.host.get(&ino).copied();
        // Closed after being open for writing since the last walk: its times may not say
        // that its bytes changed (a mapped page written again).
        let reread = self.rewritten.contains(path);
        if !reread
            && rec.is_some_and(|h| {
                h.host_ino == st.ino
                    && h.size == st.size
                    && h.mtime == st.mtime_ns
                    && h.ctime == st.ctime_ns
            })
        {
            return Ok(()); // the common case: nothing read from the store
        }
        let Some(cur) = self.inode(ino)?.cloned() else {
            return Ok(());
        };
        let unchanged =
            !reread && rec.is_none() && looks_same(&cur, st) && cur.perm == st.mode & 0o7777;
        let row = HostRow {
            host_ino: st.ino,
            size: st.size,
            // A file modified within the clock's reach of this walk: looked at again next
            // time (a write in the same tick would leave its times as they are).
            mtime: if cur.kind == Kind::File && st.mtime_ns + RACY_NS >= self.start_ns {
                i64::MIN
            } else {
                st.mtime_ns
            },
            ctime: st.ctime_ns,
        };
        if unchanged {
            // Built from the store (nothing else writes the tree before the walk that
            // follows a build): taken as it is, times and all.
            self.tx.put_host(
                ino,
                &HostRow {
                    mtime: st.mtime_ns,
                    ..row
                },
            )?;
            return Ok(());
        }
        let bytes_may_differ = reread
            || match rec {
                Some(h) => h.host_ino != st.ino || h.size != st.size || h.mtime != st.mtime_ns,
                None => cur.size != st.size || cur.mtime.0 != st.mtime_ns,
            };
        let kind = cur.kind;
        let mut new = inode_of(
            st,
            kind,
            if kind == Kind::Dir {
                parent
            } else {
                cur.parent
            },
        );
        new.ino = ino;
        new.nlink = cur.nlink;
        new.storage = cur.storage;
        let name = path.file_name().unwrap_or(OsStr::new("."));
        let at = |source| DirError::Walk {
            path: path.to_path_buf(),
            source,
        };
        // Files and directories: their xattrs (and a file's bytes) through an fd.
        let fd = match (kind, dir_fd) {
            (Kind::File | Kind::Dir, Some(d)) => {
                let flags = libc::O_RDONLY
                    | libc::O_NONBLOCK
                    | libc::O_NOATIME
                    | if kind == Kind::Dir {
                        libc::O_DIRECTORY
                    } else {
                        0
                    };
                match t::open_at(d.as_fd(), name, flags, 0) {
                    Ok(f) => match t::fstat(f.as_fd()) {
                        Ok(x) if x.ino == st.ino => Some(f),
                        _ => None,
                    },
                    Err(e) if vanished(&e) => None,
                    Err(e) => return Err(at(e)),
                }
            }
            _ => None,
        };
        let mut differs = false;
        if kind == Kind::File && bytes_may_differ {
            if st.size <= self.inline_max {
                let mut data = Vec::with_capacity(st.size as usize);
                if let Some(f) = &fd {
                    let mut file = std::fs::File::from(f.try_clone().map_err(at)?);
                    file.by_ref()
                        .take(self.inline_max)
                        .read_to_end(&mut data)
                        .map_err(at)?;
                }
                new.size = data.len() as u64;
                new.storage = Storage::Inline;
                if cur.storage != Storage::Inline || self.tx.inline_data(ino)? != data {
                    self.tx.set_inline_data(ino, &data)?;
                    self.report.rewritten += 1;
                    differs = true;
                }
            } else {
                if cur.storage == Storage::Inline {
                    self.tx.remove_inline_data(ino)?;
                }
                new.storage = Storage::Body;
                self.tx
                    .mark_dirty_windows(ino, 0..window_count(st.size, self.chunk_size))?;
                self.report.rewritten += 1;
                differs = true;
            }
        }
        if kind == Kind::Symlink {
            let name = path.file_name().unwrap_or(OsStr::new("."));
            if let Some(d) = dir_fd {
                match t::read_link_at(d.as_fd(), name) {
                    Ok(target) => {
                        let target = target.as_bytes().to_vec();
                        if self.tx.symlink_target(ino)?.as_deref() != Some(&target[..]) {
                            self.tx.set_symlink_target(ino, &target)?;
                            differs = true;
                        }
                    }
                    Err(e) if vanished(&e) => {}
                    Err(e) => return Err(at(e)),
                }
            }
        }
        if let Some(f) = &fd {
            differs |= self.sync_xattrs(ino, f)?;
        }
        // Access times alone are no change (every read moves them).
        let same = Inode {
            atime: cur.atime,
            ..new.clone()
        } == cur;
        if differs || !same {
            self.tx.update(&new)?;
            self.inodes.insert(ino, new);
            self.touched.insert(ino);
            self.report.changed += 1;
        }
        self.tx.put_host(ino, &row)?;
        Ok(())
    }

    /// Makes the store's xattrs of `ino` those of the open file `fd`; whether any differed.
    fn sync_xattrs(&self, ino: InodeNo, fd: &OwnedFd) -> Result<bool, DirError> {
        let err = |source| DirError::Walk {
            path: PathBuf::from(format!("(xattrs of inode {})", ino.0)),
            source,
        };
        let mut host: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for n in t::list_xattrs(fd.as_fd()).map_err(err)? {
            if let Some(v) = t::get_xattr(fd.as_fd(), &n).map_err(err)? {
                host.push((n, v));
            }
        }
        let stored = self.tx.xattr_names(ino)?;
        let mut differs = false;
        for n in &stored {
            if !host.iter().any(|(h, _)| h == n) {
                self.tx.remove_xattr(ino, n)?;
                differs = true;
            }
        }
        for (n, v) in &host {
            if self.tx.xattr(ino, n)?.as_deref() != Some(&v[..]) {
                self.tx.set_xattr(ino, n, v)?;
                differs = true;
            }
        }
        Ok(differs)
    }

    /// [`Walk::finish`] of a narrowed walk: link counts from the store (the entries of the
    /// directories not listed are as they were), directories' only for those listed whole.
    fn finish_narrowed(&mut self) -> Result<(), DirError> {
        let mut touched: Vec<InodeNo> = self.touched.iter().copied().collect();
        touched.extend(self.walked.iter().copied());
        touched.sort();
        touched.dedup();
        for ino in touched {
            let Some(i) = self.inode(ino)?.cloned() else {
                continue;
            };
            let want = if i.kind == Kind::Dir {
                if !self.walked.contains(&ino) {
                    continue;
                }
                2 + self.subdirs.get(&ino).copied().unwrap_or(0)
            } else {
                let n = self.tx.names_of(ino)?.len() as u32;
                if n == 0 {
                    self.tx.delete(ino)?;
                    self.paths.remove(&ino);
                    self.report.removed += 1;
                    continue;
                }
                n
            };
            if i.nlink != want {
                let mut x = i.clone();
                x.nlink = want;
                self.tx.update(&x)?;
            }
        }
        Ok(())
    }

    /// A directory that could not be read keeps everything the store had below it.
    fn keep_subtree(&mut self, dir: InodeNo) {
        let mut todo = vec![dir];
        while let Some(d) = todo.pop() {
            let Some(es) = self.entries.remove(&d) else {
                continue;
            };
            for (_, (ino, kind)) in es {
                *self.names.entry(ino).or_default() += 1;
                self.synced.insert(ino);
                if kind == Kind::Dir {
                    *self.subdirs.entry(d).or_default() += 1;
                    todo.push(ino);
                }
            }
        }
    }

    /// After the walk: entries of directories that are gone, inodes with no name left,
    /// link counts.
    fn finish(&mut self) -> Result<(), DirError> {
        if self.narrowed {
            return self.finish_narrowed();
        }
        // Directories not walked are gone: their entries, and what they named.
        let gone_dirs: Vec<InodeNo> = self.entries.keys().copied().collect();
        for d in gone_dirs {
            if let Some(es) = self.entries.remove(&d) {
                self.touched.extend(es.values().map(|(i, _)| *i));
            }
            self.tx.unlink_all(d)?;
        }
        self.touched.insert(InodeNo::ROOT);
        let mut touched: Vec<InodeNo> = self.touched.iter().copied().collect();
        touched.sort();
        for ino in touched {
            let names = self.names.get(&ino).copied();
            let Some(i) = self.inode(ino)?.cloned() else {
                continue;
            };
            if names.is_none() && ino != InodeNo::ROOT {
                self.tx.delete(ino)?;
                self.report.removed += 1;
                continue;
            }
            let want = if i.kind == Kind::Dir {
                2 + self.subdirs.get(&ino).copied().unwrap_or(0)
            } else {
                names.unwrap_or(1)
            };
            if i.nlink != want {
                let mut x = i.clone();
                x.nlink = want;
                self.tx.update(&x)?;
            }
        }
        Ok(())
    }
}

/// An inode record from a host `lstat` (link count and storage are the caller's).
fn inode_of(st: &FullStat, kind: Kind, parent: InodeNo) -> Inode {
    Inode {
        ino: InodeNo(0),
        kind,
        perm: st.mode & 0o7777,
        uid: st.uid,
        gid: st.gid,
        nlink: 1,
        size: match kind {
            Kind::File | Kind::Symlink => st.size,
            _ => 0,
        },
        atime: Nanos(st.atime_ns),
        mtime: Nanos(st.mtime_ns),
        ctime: Nanos(st.ctime_ns),
        rdev: st.rdev as u32,
        parent,
        storage: Storage::Inline,
    }
}

/// A host entry with no record yet is the store's inode as it is when its kind, owner, size
/// (of files and symlinks) and mtime are (a tree built from the store).
fn looks_same(i: &Inode, st: &FullStat) -> bool {
    i.kind.mode_bits() == st.mode & libc::S_IFMT
        && i.uid == st.uid
        && i.gid == st.gid
        && i.mtime.0 == st.mtime_ns
        && match i.kind {
            Kind::File | Kind::Symlink => i.size == st.size,
            _ => true,
        }
}

//! `keel fsck --quick`: the checks whose cost does not grow with the workspace.
//!
//! Local: the root is a directory; the running inode totals are consistent (and, when
//! nothing changed since the last checkpoint, equal the totals in that snapshot's header);
//! a sample of directories, namely those of up to `CHANGES` inodes and `CHANGES` entries
//! changed since the last checkpoint (the lowest-numbered), the root, and `RANDOM_DIRS` drawn at random, gets the full per-directory checks:
//! each entry names an existing inode of the right kind with a link, subdirectories point
//! back at it, its link count matches, it is named by its parent all the way up to the
//! root, symlinks have targets, and the bodies of its files exist with the right size and
//! a chunk map that fits (up to `HASHED` windows re-hashed). Remote: the manifest and head
//! decode, the headers of the head's and the local snapshot's chains decode and link up,
//! and the chunks the sampled files name exist (one `HEAD` each, up to `PROBED`).
//!
//! Not done: SQLite's integrity check, the inode and entry tables as a whole (link counts of
//! files outside the sample, unreachable inodes, orphan bodies), every window, every chunk.
//! That is the full `keel fsck`; this is a sample and says so.

use std::collections::{BTreeSet, HashSet};

use super::{check_body, BodyCtx, FsckError, FsckOptions, FsckReport, Level};
use crate::chunk::BodyStore;
use crate::meta::{Inode, InodeNo, Kind, Storage, Store, Tx};
use crate::persist::format::Header;

/// Changed inodes and entries (since the last checkpoint) whose directories are checked.
pub const CHANGES: usize = 256;
/// Directories drawn at random.
pub const RANDOM_DIRS: usize = 32;
/// Windows re-hashed at most, over all sampled files.
pub const HASHED: u64 = 64;
/// Remote chunks probed at most.
pub const PROBED: usize = 256;
/// Parent links followed up to the root at most (deeper: a loop).
const MAX_DEPTH: usize = 4096;

/// What the quick check sampled (the report's summary line).
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub dirs: u64,
    pub changed: u64,
    pub snapshots: u64,
}

pub(super) fn check(
    store: &Store,
    bodies: &BodyStore,
    pending: std::collections::HashMap<u64, std::path::PathBuf>,
    rep: &mut FsckReport,
    opts: &FsckOptions,
) -> Result<Sample, FsckError> {
    let r = store.read();
    let mut sample = Sample::default();
    match r.get(InodeNo::ROOT)? {
        Some(root) if root.kind == Kind::Dir => {}
        _ => rep.add(
            Level::Error,
            "the root inode is missing or not a directory".into(),
            false,
        ),
    }
    let rows = r.inode_count()?;
    let (live, bytes) = r.live_totals()?;
    if live > rows {
        rep.add(
            Level::Warning,
            format!("inode totals say {live} linked inodes but only {rows} inodes"),
            false,
        );
    }

    // The directories to check: the root, those the recorded changes touch, a random draw.
    let mut dirs: BTreeSet<InodeNo> = BTreeSet::new();
    dirs.insert(InodeNo::ROOT);
    let changed = r.backlog_inodes()?;
    let changed_dirents = r.backlog_dirents()?;
    let windows = r.backlog_windows()?;
    let nothing_changed = changed.is_empty() && changed_dirents.is_empty() && windows.is_empty();
    for ino in changed.iter().take(CHANGES) {
        sample.changed += 1;
        if let Some(i) = r.get(*ino)? {
            dirs.insert(if i.kind == Kind::Dir { i.ino } else { i.parent });
        }
    }
    for (parent, _) in changed_dirents.iter().take(CHANGES) {
        sample.changed += 1;
        dirs.insert(*parent);
    }
    let max = r.max_ino()?;
    let mut drawn = 0;
    for _ in 0..RANDOM_DIRS * 4 {
        if drawn == RANDOM_DIRS || max == 0 {
            break;
        }
        let Some(i) = r.get(InodeNo(1 + crate::random::below(max)))? else {
            continue;
        };
        if i.nlink == 0 {
            continue;
        }
        if dirs.insert(if i.kind == Kind::Dir { i.ino } else { i.parent }) {
            drawn += 1;
        }
    }

    let dirty: HashSet<(InodeNo, u64)> = windows.into_iter().collect();
    let ctx = BodyCtx {
        pending,
        cs: opts.chunk_size,
        maps_fit: r
            .persist_get("chunk_size")?
            .and_then(|v| v.parse::<u64>().ok())
            == Some(opts.chunk_size),
        unclean: r.persist_get("running")?.as_deref() == Some("1"),
        repair: false,
    };
    let mut budget = HASHED;
    let mut files: Vec<Inode> = Vec::new();
    crate::progress::stage("sampled directories checked", Some(dirs.len() as u64));
    for d in &dirs {
        sample.dirs += 1;
        crate::progress::set(sample.dirs);
        check_dir(&r, *d, rep, &mut files)?;
    }
    for i in &files {
        rep.bodies += 1;
        let missing: HashSet<u64> = r.missing_windows(i.ino)?.iter().map(|m| m.0).collect();
        if !missing.is_empty() && bodies.stat(i.ino.0).ok().flatten().is_none() {
            continue; // lazily restored: the body comes at first use
        }
        let skip = |idx: u64| dirty.contains(&(i.ino, idx)) || missing.contains(&idx);
        let map = r.file_chunks(i.ino)?;
        check_body(bodies, i, Some(&map), &skip, &ctx, &mut budget, rep, None)?;
    }

    if let Some(repo) = &opts.remote {
        let header = check_remote(&r, repo.clone(), &files, rep, &mut sample)?;
        match header {
            Some(h) if nothing_changed && (h.inodes, h.file_bytes) != (live, bytes) => rep.add(
                Level::Warning,
                format!(
                    "inode totals say {live} linked inodes / {bytes} file bytes, the last checkpoint's snapshot {} says {} / {} and nothing changed since",
                    h.seq, h.inodes, h.file_bytes
                ),
                false,
            ),
            _ => {}
        }
    }
    Ok(sample)
}

/// The per-directory checks of the full fsck for one directory, plus its path to the root.
/// Its files with a body go to `files`.
fn check_dir(
    r: &Tx,
    d: InodeNo,
    rep: &mut FsckReport,
    files: &mut Vec<Inode>,
) -> Result<(), FsckError> {
    let Some(dir) = r.get(d)? else {
        return Ok(()); // removed since it was recorded as changed
    };
    if dir.kind != Kind::Dir {
        rep.add(
            Level::Error,
            format!(
                "inode {} is the parent of an inode but not a directory",
                d.0
            ),
            false,
        );
        return Ok(());
    }
    if dir.nlink == 0 {
        return Ok(()); // removed while in use: cleaned at the next mount
    }
    let mut subdirs = 0;
    for e in r.list(d)? {
        rep.entries += 1;
        let shown = String::from_utf8_lossy(&e.name);
        let Some(t) = r.get(e.ino)? else {
            rep.add(
                Level::Error,
                format!(
                    "entry `{shown}` in directory {} names missing inode {}",
                    d.0, e.ino.0
                ),
                false,
            );
            continue;
        };
        rep.inodes += 1;
        if t.kind != e.kind {
            rep.add(
                Level::Error,
                format!(
                    "entry `{shown}` says {:?} but inode {} is {:?}",
                    e.kind, e.ino.0, t.kind
                ),
                false,
            );
        }
        if t.nlink == 0 {
            rep.add(
                Level::Error,
                format!(
                    "inode {} has nlink 0 but entry `{shown}` in directory {} names it",
                    t.ino.0, d.0
                ),
                false,
            );
        }
        match t.kind {
            Kind::Dir => {
                subdirs += 1;
                if t.parent != d {
                    rep.add(
                        Level::Error,
                        format!(
                            "directory {} has parent {} but lives in {}",
                            t.ino.0, t.parent.0, d.0
                        ),
                        false,
                    );
                }
            }
            Kind::Symlink if r.symlink_target(t.ino)?.is_none() => rep.add(
                Level::Error,
                format!("symlink {} has no target", t.ino.0),
                false,
            ),
            Kind::File if t.storage == Storage::Body => files.push(t),
            _ => {}
        }
    }
    if dir.nlink != 2 + subdirs {
        rep.add(
            Level::Error,
            format!(
                "directory {} has nlink {} but {} links",
                d.0,
                dir.nlink,
                2 + subdirs
            ),
            false,
        );
    }
    // Up to the root, each directory named by its parent.
    let mut at = dir;
    for _ in 0..MAX_DEPTH {
        if at.ino == InodeNo::ROOT {
            return Ok(());
        }
        let named = r.list(at.parent)?.iter().any(|e| e.ino == at.ino);
        let parent = r.get(at.parent)?;
        match parent {
            Some(p) if named && p.kind == Kind::Dir => at = p,
            _ => {
                rep.add(
                    Level::Error,
                    format!(
                        "directory {} is not reachable from the root (its parent {} does not name directory {})",
                        d.0, at.parent.0, at.ino.0
                    ),
                    false,
                );
                return Ok(());
            }
        }
    }
    rep.add(
        Level::Error,
        format!(
            "directory {} is not reachable from the root (a parent loop)",
            d.0
        ),
        false,
    );
    Ok(())
}

/// The remote's manifest, head, the header chains of the head and of the local last
/// snapshot, and the chunks of the sampled files. Returns the local last snapshot's header.
fn check_remote(
    r: &Tx,
    mut repo: crate::persist::Repo,
    files: &[Inode],
    rep: &mut FsckReport,
    sample: &mut Sample,
) -> Result<Option<Header>, FsckError> {
    let Some((local_seq, head)) = super::remote_start(r, &mut repo, rep, true)? else {
        return Ok(None);
    };
    let mut local_header = None;
    let mut walked: HashSet<u64> = HashSet::new();
    let mut fulls = Vec::new();
    for s in head.into_iter().chain(local_seq) {
        let mut at = Some(s);
        while let Some(seq) = at {
            if !walked.insert(seq) {
                break;
            }
            match repo.read_header(seq) {
                Ok(h) if h.seq != seq => {
                    rep.add(
                        Level::Error,
                        format!("snapshot {seq}: its header says it is snapshot {}", h.seq),
                        false,
                    );
                    at = None;
                }
                Ok(h) => {
                    sample.snapshots += 1;
                    if h.is_full() {
                        fulls.push(h.clone());
                    }
                    if Some(seq) == local_seq {
                        local_header = Some(h.clone());
                    }
                    if h.parent.is_some_and(|p| p >= seq) {
                        rep.add(
                            Level::Error,
                            format!("snapshot {seq}: parent {:?} is not older", h.parent),
                            false,
                        );
                        at = None;
                    } else {
                        at = h.parent;
                    }
                }
                Err(e) => {
                    rep.add(
                        Level::Error,
                        format!("snapshot {seq} (in the chain of {s}): {e}"),
                        false,
                    );
                    at = None;
                }
            }
        }
    }
    for what in crate::persist::image::check(&repo, &fulls, false) {
        rep.add(Level::Warning, what, false);
    }
    let mut probed = 0;
    // Read once, at the first chunk that is not a single object.
    let mut packs: Option<Option<std::sync::Arc<crate::persist::pack::PackMap>>> = None;
    'files: for i in files {
        for (idx, id) in r.file_chunks(i.ino)? {
            let Some(id) = id else { continue };
            if probed == PROBED {
                break 'files;
            }
            probed += 1;
            rep.chunks_checked += 1;
            let id = crate::chunk::ChunkId(id);
            let head = repo.remote.head(&repo.chunk_key(&id));
            if let Ok(None) = head {
                let map = packs.get_or_insert_with(|| match repo.load_packs(None) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        rep.add(Level::Error, format!("read pack indexes: {e}"), false);
                        None
                    }
                });
                if map.as_ref().is_some_and(|m| m.contains(&id)) {
                    continue;
                }
            }
            match head {
                Ok(Some(_)) => {}
                Ok(None) => rep.add(
                    Level::Error,
                    format!(
                        "chunk {id} is referenced but missing on the remote (window {idx} of file {})",
                        i.ino.0
                    ),
                    false,
                ),
                Err(e) => rep.add(Level::Error, format!("chunk {id}: {e}"), false),
            }
        }
    }
    Ok(local_header)
}

//! Restore: materializes a snapshot (its chain from the last full snapshot) into an empty
//! state dir that `keel mount` can mount: the same inode numbers, hard links, metadata,
//! xattrs, symlinks, special files and bytes. Every chunk is checked against its blake3
//! id before its bytes are written; a mismatch fails the restore naming the chunk and the
//! file. Bodies are made durable before the metadata that references them commits.
//!
//! Lazy mode (`[persist] restore = "lazy"`) writes only the metadata: each stored window is
//! listed as missing with its chunk id, and a file that has any gets no body until the
//! mounted filesystem first opens or fetches it (only all-zero files get their sparse body
//! here). Time is O(metadata), not O(files) file creations.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::checkpoint::now_ns;
use super::format::{Tree, TreeData};
use super::repo::{Repo, RepoError};
use crate::chunk::{BodyStore, ChunkId};
use crate::meta::{InodeNo, Kind, MetaError, Nanos, Store};
use crate::sys;

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("state dir {path}: {reason}")]
    StateDir { path: PathBuf, reason: String },
    #[error("read head: {0}")]
    ReadHead(RepoError),
    #[error("the remote {0} has no snapshot to restore")]
    NoSnapshot(String),
    #[error("load snapshot {seq}: {source}")]
    LoadSnapshot { seq: u64, source: RepoError },
    #[error("fetch chunk {id} (window {idx} of inode {ino}): {source}")]
    FetchChunk {
        id: ChunkId,
        ino: u64,
        idx: u64,
        source: RepoError,
    },
    #[error("write body of inode {ino}: {source}")]
    WriteBody { ino: u64, source: std::io::Error },
    #[error("write metadata: {0}")]
    Meta(#[from] MetaError),
    #[error("snapshot {seq}: inode {ino} has a bad mode {mode:o}")]
    BadMode { seq: u64, ino: u64, mode: u32 },
}

#[derive(Debug, Clone, Default)]
pub struct RestoreReport {
    pub seq: u64,
    pub inodes: u64,
    pub files: u64,
    pub file_bytes: u64,
    pub chunks_fetched: u64,
    pub bytes_fetched: u64,
    /// Windows left to fetch on first use (lazy mode).
    pub windows_missing: u64,
    pub elapsed_s: f64,
}

/// Whether restore fetches file data now or leaves it for first use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreMode {
    /// Fetch every chunk before the restore returns.
    Eager,
    /// Metadata only; windows are fetched when first used.
    Lazy,
}

/// Fetch this many chunks per round trip batch.
const FETCH_BATCH: usize = 64;

/// Which snapshot to restore: `None` = the head.
pub fn resolve_seq(repo: &Repo, seq: Option<u64>) -> Result<u64, RestoreError> {
    match seq {
        Some(s) => Ok(s),
        None => match repo.read_head().map_err(RestoreError::ReadHead)? {
            Some((h, _)) => Ok(h.seq),
            None => Err(RestoreError::NoSnapshot(repo.describe())),
        },
    }
}

/// Restores snapshot `seq` (default: the head) of `repo` into `state_dir`, which must be
/// empty or absent. The caller holds the state dir lock. A restore that fails removes what
/// it wrote.
pub fn restore(
    repo: &mut Repo,
    seq: Option<u64>,
    state_dir: &Path,
) -> Result<RestoreReport, RestoreError> {
    restore_with(repo, seq, state_dir, RestoreMode::Eager)
}

/// `restore` in the given mode.
pub fn restore_with(
    repo: &mut Repo,
    seq: Option<u64>,
    state_dir: &Path,
    mode: RestoreMode,
) -> Result<RestoreReport, RestoreError> {
    let r = restore_inner(repo, seq, state_dir, mode);
    if r.is_err() && !matches!(r, Err(RestoreError::StateDir { .. })) {
        // Leave the state dir empty again.
        let _ = std::fs::remove_dir_all(state_dir.join("bodies"));
        for f in ["meta.db", "meta.db-wal", "meta.db-shm"] {
            let _ = std::fs::remove_file(state_dir.join(f));
        }
    }
    r
}

fn restore_inner(
    repo: &mut Repo,
    seq: Option<u64>,
    state_dir: &Path,
    mode: RestoreMode,
) -> Result<RestoreReport, RestoreError> {
    let t0 = Instant::now();
    let bad = |reason: String| RestoreError::StateDir {
        path: state_dir.to_path_buf(),
        reason,
    };
    super::secure_state_dir(state_dir).map_err(|e| bad(e.to_string()))?;
    for e in std::fs::read_dir(state_dir)
        .map_err(|e| bad(e.to_string()))?
        .flatten()
    {
        let n = e.file_name().to_string_lossy().into_owned();
        if !["lock", "lost+found", ".keep", super::LEASE_HOLDER_FILE].contains(&n.as_str()) {
            return Err(bad(format!(
                "not empty (holds `{n}`); restore only into an empty state dir"
            )));
        }
    }
    let manifest = repo.manifest().map_err(RestoreError::ReadHead)?;
    let seq = resolve_seq(repo, seq)?;
    let (tree, headers) = repo
        .load_tree(seq)
        .map_err(|source| RestoreError::LoadSnapshot { seq, source })?;
    tracing::info!(
        "restore: snapshot {seq}: {} inodes, {} bytes of file data (chain of {})",
        tree.inodes.len(),
        tree.file_bytes(),
        headers.len()
    );
    let bodies = BodyStore::open(&state_dir.join("bodies")).map_err(|e| bad(e.to_string()))?;
    let mut report = RestoreReport {
        seq,
        inodes: tree.inodes.len() as u64,
        ..Default::default()
    };
    let wanted = create_bodies(&tree, &bodies, &mut report, mode)?;
    if mode == RestoreMode::Eager {
        fetch_bodies(repo, tree.chunk_size, &wanted, &bodies, &mut report)?;
    }
    sys::file::syncfs(state_dir).map_err(|e| bad(format!("sync bodies: {e}")))?;

    let store = Store::open(&state_dir.join("meta.db"), Nanos(now_ns()))?;
    let tx = store.write()?;
    for t in tree.inodes.values() {
        let r = &t.rec;
        let inode = t.inode().ok_or(RestoreError::BadMode {
            seq,
            ino: r.ino,
            mode: r.mode,
        })?;
        tx.put_inode_exact(&inode)?;
        for (n, v) in &r.xattrs {
            tx.set_xattr(inode.ino, n, v)?;
        }
        match &t.data {
            TreeData::Inline(v) => tx.set_inline_data(inode.ino, v)?,
            TreeData::Symlink(v) => tx.set_symlink_target(inode.ino, v)?,
            TreeData::Chunks(m) => {
                let rows: Vec<_> = m
                    .iter()
                    .enumerate()
                    .map(|(i, id)| (i as u64, id.map(|c| c.0)))
                    .collect();
                tx.set_file_chunks(inode.ino, &rows)?;
                if mode == RestoreMode::Lazy {
                    let missing: Vec<_> = m
                        .iter()
                        .enumerate()
                        .filter_map(|(i, id)| id.map(|c| (i as u64, c.0)))
                        .collect();
                    tx.add_missing_windows(inode.ino, &missing)?;
                    report.windows_missing += missing.len() as u64;
                }
            }
            TreeData::None => {}
        }
    }
    for ((parent, name), (ino, kind)) in &tree.dirents {
        let k = Kind::from_mode(*kind).ok_or(RestoreError::BadMode {
            seq,
            ino: *ino,
            mode: *kind,
        })?;
        tx.link(InodeNo(*parent), name, InodeNo(*ino), k)?;
    }
    tx.clear_all_changes()?;
    let last = headers.last().expect("a chain has at least one snapshot");
    let deltas = headers.len() as u64 - 1;
    tx.persist_set("last_seq", &seq.to_string())?;
    tx.persist_set("base_seq", &last.base.to_string())?;
    tx.persist_set("deltas_since_full", &deltas.to_string())?;
    tx.persist_set("delta_bytes_since_full", "0")?;
    tx.persist_set("chunk_size", &tree.chunk_size.to_string())?;
    tx.persist_set("remote", &repo.describe())?;
    if let Some(m) = &manifest {
        tx.persist_set("remote_id", &m.id)?;
    }
    tx.persist_set("clean_before", &now_ns().to_string())?;
    tx.persist_set("restored_from", &seq.to_string())?;
    tx.commit()?;
    store.sync()?;
    store.checkpoint()?;
    report.elapsed_s = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Creates the bodies at their full size (sparse: all-zero windows stay holes); returns
/// (ino, idx, id) for every stored window. Lazy mode creates only the bodies with no stored
/// window: the filesystem creates the others when it first needs them.
fn create_bodies(
    tree: &Tree,
    bodies: &BodyStore,
    report: &mut RestoreReport,
    mode: RestoreMode,
) -> Result<Vec<(u64, u64, ChunkId)>, RestoreError> {
    let mut wanted: Vec<(u64, u64, ChunkId)> = Vec::new();
    for t in tree.inodes.values() {
        if let TreeData::Chunks(m) = &t.data {
            report.files += 1;
            report.file_bytes += t.rec.size;
            let stored = m.iter().any(Option::is_some);
            for (i, id) in m.iter().enumerate() {
                if let Some(id) = id {
                    wanted.push((t.rec.ino, i as u64, *id));
                }
            }
            if stored && mode == RestoreMode::Lazy {
                continue;
            }
            let f = bodies
                .open_rw(t.rec.ino)
                .map_err(|source| RestoreError::WriteBody {
                    ino: t.rec.ino,
                    source,
                })?;
            f.set_len(t.rec.size)
                .map_err(|source| RestoreError::WriteBody {
                    ino: t.rec.ino,
                    source,
                })?;
        }
    }
    Ok(wanted)
}

fn fetch_bodies(
    repo: &Repo,
    cs: u64,
    wanted: &[(u64, u64, ChunkId)],
    bodies: &BodyStore,
    report: &mut RestoreReport,
) -> Result<(), RestoreError> {
    crate::progress::stage("chunks fetched", Some(wanted.len() as u64));
    let mut open: HashMap<u64, std::fs::File> = HashMap::new();
    for (n, batch) in wanted.chunks(FETCH_BATCH).enumerate() {
        let mut ids: Vec<ChunkId> = batch.iter().map(|w| w.2).collect();
        ids.sort();
        ids.dedup();
        let mut got: HashMap<ChunkId, Result<bytes::Bytes, RepoError>> =
            ids.iter().copied().zip(repo.get_chunks(&ids)).collect();
        for (ino, idx, id) in batch {
            if got.get(id).is_some_and(|r| r.is_err()) {
                let source = got.remove(id).expect("present").expect_err("checked");
                return Err(RestoreError::FetchChunk {
                    id: *id,
                    ino: *ino,
                    idx: *idx,
                    source,
                });
            }
        }
        for (ino, idx, id) in batch {
            let data = got[id].as_ref().expect("checked above");
            let f = match open.entry(*ino) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => v.insert(
                    bodies
                        .open_rw(*ino)
                        .map_err(|source| RestoreError::WriteBody { ino: *ino, source })?,
                ),
            };
            f.write_all_at(data, idx * cs)
                .map_err(|source| RestoreError::WriteBody { ino: *ino, source })?;
        }
        for r in got.values().flatten() {
            report.chunks_fetched += 1;
            report.bytes_fetched += r.len() as u64;
        }
        let (chunks, bytes) = (report.chunks_fetched, report.bytes_fetched);
        super::metrics::restore_progress(chunks, bytes, wanted.len());
        if open.len() > 256 {
            open.clear();
        }
        crate::progress::set(((n + 1) * FETCH_BATCH).min(wanted.len()) as u64);
    }
    Ok(())
}

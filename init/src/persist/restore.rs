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

use super::format::{Header, Tree, TreeData, TreeInode};
use super::repo::{Chain, Repo, RepoError};
use crate::chunk::{BodyStore, ChunkId};
use crate::meta::{create_bulk, BulkWriter, InodeNo, Kind, MetaError, Nanos};
use crate::state;
use crate::sys;
use crate::time::now_ns;

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
    /// Restoring from the metadata image (a failure falls back to the snapshot chain).
    #[error("{0}")]
    Image(#[source] Box<super::image::ImageError>),
}

impl RestoreError {
    /// The remote could not be reached or did not answer in time (a later try may work).
    pub fn is_temporary(&self) -> bool {
        match self {
            RestoreError::ReadHead(e)
            | RestoreError::LoadSnapshot { source: e, .. }
            | RestoreError::FetchChunk { source: e, .. } => e.is_temporary(),
            _ => false,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct RestoreReport {
    pub seq: u64,
    /// Metadata only: windows are fetched on first use.
    pub lazy: bool,
    pub inodes: u64,
    /// Files with a body and their bytes (lazy: those with a window to fetch).
    pub files: u64,
    pub file_bytes: u64,
    pub chunks_fetched: u64,
    pub bytes_fetched: u64,
    /// Windows left to fetch on first use (lazy mode).
    pub windows_missing: u64,
    pub elapsed_s: f64,
    /// Where the time went: (phase, seconds), in order (load, bodies, rows, indexes, sync).
    pub phases: Vec<(&'static str, f64)>,
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
        None => match repo.head_now().map_err(RestoreError::ReadHead)? {
            Some(h) => Ok(h.seq),
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
    restore_checked(repo, seq, state_dir, mode, None)
}

/// The head, restored for a filesystem that fetches windows of `chunk_size` bytes: lazily
/// when `mode` says so and the snapshot was cut in windows of that size, else eagerly (with
/// a warning). `RestoreReport::lazy` says which.
pub fn restore_for_mount(
    repo: &mut Repo,
    state_dir: &Path,
    mode: RestoreMode,
    chunk_size: u64,
) -> Result<RestoreReport, RestoreError> {
    restore_checked(repo, None, state_dir, mode, Some(chunk_size))
}

fn restore_checked(
    repo: &mut Repo,
    seq: Option<u64>,
    state_dir: &Path,
    mode: RestoreMode,
    windows: Option<u64>,
) -> Result<RestoreReport, RestoreError> {
    let _op = crate::logging::Op::start("restore");
    let _peak = crate::budget::track("restore");
    let r = restore_inner(repo, seq, state_dir, mode, windows);
    if r.is_err() && state::restore_unfinished(state_dir) {
        // Leave the state dir empty again.
        if remove_restore_output(state_dir).is_ok() {
            let _ = std::fs::remove_file(state_dir.join(UNFINISHED));
        }
    }
    r
}

/// Present in a state dir from before a restore writes anything until its database is in
/// place: a state dir with it and no `meta.db` holds an unfinished restore.
const UNFINISHED: &str = state::RESTORE_UNFINISHED;

/// The database a restore builds, renamed to `meta.db` when it is complete and durable.
const BUILDING_DB: &str = state::META_DB_RESTORING;

/// The time of each phase of a restore.
struct Laps {
    at: Instant,
    done: Vec<(&'static str, f64)>,
}

impl Laps {
    /// Phase `name` ended at `end`.
    fn to(&mut self, name: &'static str, end: Instant) {
        self.done.push((name, (end - self.at).as_secs_f64()));
        self.at = end;
    }
}

/// Removes what a restore writes before its database is in place (not the marker).
fn remove_restore_output(state_dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(state_dir.join(state::BODIES)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    for suffix in ["", "-wal", "-shm", "-journal"] {
        match std::fs::remove_file(state_dir.join(format!("{BUILDING_DB}{suffix}"))) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// fsync of a file or a directory.
fn sync_file(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

/// Every row of the tree: inodes with their xattrs, inline bytes, symlink targets, chunk
/// maps (and in lazy mode their missing windows), then the entries, each table in key
/// order (the tree's maps are sorted), so every insert appends.
fn write_rows(
    w: &mut BulkWriter<'_>,
    tree: &Tree,
    seq: u64,
    mode: RestoreMode,
    report: &mut RestoreReport,
) -> Result<(), RestoreError> {
    for t in tree.inodes.values() {
        write_inode(w, t, seq, mode, report)?;
    }
    for ((parent, name), (ino, kind)) in &tree.dirents {
        let k = Kind::from_mode(*kind).ok_or(RestoreError::BadMode {
            seq,
            ino: *ino,
            mode: *kind,
        })?;
        w.dirent(InodeNo(*parent), name, InodeNo(*ino), k)?;
    }
    Ok(())
}

/// The rows of one inode of snapshot `seq`'s tree: the inode, its xattrs, its data (and
/// in lazy mode its missing windows). Also what a metadata image holds (see `image`).
pub(super) fn write_inode(
    w: &mut BulkWriter<'_>,
    t: &TreeInode,
    seq: u64,
    mode: RestoreMode,
    report: &mut RestoreReport,
) -> Result<(), RestoreError> {
    let r = &t.rec;
    let inode = t.inode().ok_or(RestoreError::BadMode {
        seq,
        ino: r.ino,
        mode: r.mode,
    })?;
    w.inode(&inode)?;
    for (n, v) in &r.xattrs {
        w.xattr(inode.ino, n, v)?;
    }
    match &t.data {
        TreeData::Inline(v) => w.inline_data(inode.ino, v)?,
        TreeData::Symlink(v) => w.symlink(inode.ino, v)?,
        TreeData::Chunks(m) => {
            for (i, id) in m.iter().enumerate() {
                w.chunk(inode.ino, i as u64, id.as_ref().map(|c| &c.0))?;
            }
            if mode == RestoreMode::Lazy {
                for (i, id) in m.iter().enumerate() {
                    if let Some(id) = id {
                        w.missing(inode.ino, i as u64, &id.0)?;
                        report.windows_missing += 1;
                    }
                }
            }
        }
        TreeData::None => {}
    }
    Ok(())
}

fn restore_inner(
    repo: &mut Repo,
    seq: Option<u64>,
    state_dir: &Path,
    mut mode: RestoreMode,
    windows: Option<u64>,
) -> Result<RestoreReport, RestoreError> {
    let t0 = Instant::now();
    let bad = |reason: String| RestoreError::StateDir {
        path: state_dir.to_path_buf(),
        reason,
    };
    state::secure(state_dir).map_err(|e| bad(e.to_string()))?;
    let unfinished = state_dir.join(UNFINISHED).exists();
    if unfinished {
        tracing::warn!(state = %state_dir.display(), "restore: a restore into this state dir did not finish; starting it over");
        remove_restore_output(state_dir)
            .map_err(|e| bad(format!("remove what the unfinished restore wrote: {e}")))?;
    }
    for e in std::fs::read_dir(state_dir)
        .map_err(|e| bad(e.to_string()))?
        .flatten()
    {
        let n = e.file_name().to_string_lossy().into_owned();
        if !state::RESTORE_MAY_HOLD.contains(&n.as_str()) {
            return Err(bad(format!(
                "not empty (holds `{n}`); restore only into an empty state dir"
            )));
        }
    }
    // Durable before anything else is written: a crash from here until meta.db appears
    // leaves a state dir the next restore recognises and starts over.
    state::private::write(&state_dir.join(UNFINISHED), b"")
        .and_then(|()| sync_file(&state_dir.join(UNFINISHED)))
        .and_then(|()| sync_file(state_dir))
        .map_err(|e| bad(format!("write {UNFINISHED}: {e}")))?;
    let manifest = repo.manifest().map_err(RestoreError::ReadHead)?;
    let seq = resolve_seq(repo, seq)?;
    let remote_id = manifest.as_ref().map(|m| m.id.clone());
    let mut laps = Laps {
        at: t0,
        done: Vec::new(),
    };
    let building = state_dir.join(BUILDING_DB);
    // Each object of the chain is fetched once: the deltas now, the full snapshot only
    // when there is no usable metadata image.
    let mut chain = repo
        .fetch_chain(seq)
        .map_err(|source| RestoreError::LoadSnapshot { seq, source })?;
    let cut = chain.last().chunk_size;
    if mode == RestoreMode::Lazy && windows.is_some_and(|w| w != cut) {
        tracing::warn!(
            snapshot_chunk_size = cut,
            chunk_size = windows,
            "the snapshot was cut into other windows than [workspace] chunk_size: restoring eagerly"
        );
        mode = RestoreMode::Eager;
    }
    if mode == RestoreMode::Lazy && chain.full.image.is_some() {
        crate::logging::step("restore", "image");
        if let Some(report) = from_image(repo, &chain, state_dir, remote_id.as_deref(), &mut laps) {
            return finish(state_dir, report, laps, t0);
        }
    }
    crate::logging::step("restore", "load");
    chain
        .full_object(repo)
        .map_err(|source| RestoreError::LoadSnapshot { seq, source })?;
    let (tree, headers) = chain
        .tree(repo)
        .map_err(|source| RestoreError::LoadSnapshot { seq, source })?;
    laps.to("load", Instant::now());
    tracing::info!(
        "restore: snapshot {seq}: {} inodes, {} bytes of file data (chain of {})",
        tree.inodes.len(),
        tree.file_bytes(),
        headers.len()
    );
    let bodies = crate::state::open_bodies(state_dir).map_err(|e| bad(e.to_string()))?;
    let mut report = RestoreReport {
        seq,
        lazy: mode == RestoreMode::Lazy,
        inodes: tree.inodes.len() as u64,
        ..Default::default()
    };
    crate::logging::step("restore", "bodies");
    let wanted = create_bodies(&tree, &bodies, &mut report, mode)?;
    if mode == RestoreMode::Eager {
        crate::logging::step("restore", "fetch_chunks");
        fetch_bodies(repo, tree.chunk_size, &wanted, &bodies, &mut report)?;
    }
    sys::file::syncfs(state_dir).map_err(|e| bad(format!("sync bodies: {e}")))?;
    laps.to("bodies", Instant::now());

    let state = state_rows(repo, &headers, remote_id.as_deref());
    let mut rows_done = None;
    crate::logging::step("restore", "rows");
    create_bulk(
        &building,
        Nanos(now_ns()),
        |w| -> Result<(), RestoreError> {
            write_rows(w, &tree, seq, mode, &mut report)?;
            rows_done = Some(Instant::now());
            for (k, v) in &state {
                w.persist_set(k, v)?;
            }
            Ok(())
        },
    )?;
    if let Some(at) = rows_done {
        laps.to("rows", at);
    }
    laps.to("indexes", Instant::now());
    finish(state_dir, report, laps, t0)
}

/// The checkpoint bookkeeping a restored database starts with: it is at the chain's last
/// snapshot (`headers`, full snapshot first).
fn state_rows(
    repo: &Repo,
    headers: &[Header],
    remote_id: Option<&str>,
) -> Vec<(&'static str, String)> {
    let last = headers.last().expect("a chain has at least one snapshot");
    let seq = last.seq;
    let deltas = headers.len() as u64 - 1;
    let mut v = vec![
        ("last_seq", seq.to_string()),
        ("base_seq", last.base.to_string()),
        ("deltas_since_full", deltas.to_string()),
        ("delta_bytes_since_full", "0".to_string()),
        ("chunk_size", last.chunk_size.to_string()),
        ("remote", repo.describe()),
    ];
    if let Some(id) = remote_id {
        v.push(("remote_id", id.to_string()));
    }
    v.push(("clean_before", now_ns().to_string()));
    v.push(("restored_from", seq.to_string()));
    v
}

/// A lazy restore from the metadata image of the chain's full snapshot (see `image`),
/// the chain's deltas replayed onto it: `None`, after a one-line warning, when the image
/// cannot be used (what it wrote is removed; the caller decodes the chain instead).
fn from_image(
    repo: &Repo,
    chain: &Chain,
    state_dir: &Path,
    remote_id: Option<&str>,
    laps: &mut Laps,
) -> Option<RestoreReport> {
    let headers = chain.headers();
    let seq = chain.last().seq;
    let mut report = RestoreReport {
        seq,
        lazy: true,
        ..Default::default()
    };
    let state = state_rows(repo, &headers, remote_id);
    // Nothing but the database is written: `finish` makes it durable (no syncfs of the
    // whole volume, which waits for every other writer's dirty pages too).
    let r = super::image::restore(
        repo,
        chain,
        &state_dir.join(BUILDING_DB),
        &state,
        &mut report,
        &mut |name| laps.to(name, Instant::now()),
    );
    match r {
        Ok(()) => {
            tracing::info!(
                "restore: snapshot {seq} from the metadata image of snapshot {} and {} deltas: {} inodes, {} windows to fetch",
                headers[0].seq,
                headers.len() - 1,
                report.inodes,
                report.windows_missing
            );
            Some(report)
        }
        Err(e) => {
            tracing::warn!(state = %state_dir.display(), "restore: metadata image of snapshot {} not used ({e}); decoding the snapshot chain instead", headers[0].seq);
            if let Err(e) = remove_restore_output(state_dir) {
                tracing::warn!(state = %state_dir.display(), error = %e, "restore: remove what the image restore wrote");
            }
            laps.to("image (not used)", Instant::now());
            None
        }
    }
}

/// Makes the built database durable, renames it to `meta.db` and drops the marker.
fn finish(
    state_dir: &Path,
    mut report: RestoreReport,
    mut laps: Laps,
    t0: Instant,
) -> Result<RestoreReport, RestoreError> {
    let bad = |reason: String| RestoreError::StateDir {
        path: state_dir.to_path_buf(),
        reason,
    };
    let building = state_dir.join(BUILDING_DB);
    crate::logging::step("restore", "finish");
    // The database is durable before it becomes the workspace (the rename), and the rename
    // before the marker goes.
    sync_file(&building).map_err(|e| bad(format!("sync {BUILDING_DB}: {e}")))?;
    sys::file::rename_noreplace(&building, &state::meta_db(state_dir))
        .map_err(|e| bad(format!("rename {BUILDING_DB} to {}: {e}", state::META_DB)))?;
    // From here on the restore is complete: nothing may fail it (the caller would remove
    // the workspace). A marker left behind is only noise: meta.db present means done.
    if let Err(e) = sync_file(state_dir)
        .and_then(|()| std::fs::remove_file(state_dir.join(UNFINISHED)))
        .and_then(|()| sync_file(state_dir))
    {
        tracing::warn!(state = %state_dir.display(), error = %e, "restore: finishing touches failed");
    }
    laps.to("sync", Instant::now());
    report.phases = laps.done;
    report.elapsed_s = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Creates the bodies at their full size (sparse: all-zero windows stay holes); returns
/// (ino, idx, id) for every stored window. Lazy mode creates none: the filesystem creates a
/// body at the first fetch of one of its windows, or (all holes) at the file's first open.
fn create_bodies(
    tree: &Tree,
    bodies: &BodyStore,
    report: &mut RestoreReport,
    mode: RestoreMode,
) -> Result<Vec<(u64, u64, ChunkId)>, RestoreError> {
    let mut wanted: Vec<(u64, u64, ChunkId)> = Vec::new();
    for t in tree.inodes.values() {
        if let TreeData::Chunks(m) = &t.data {
            let stored = m.iter().any(Option::is_some);
            if stored || mode == RestoreMode::Eager {
                report.files += 1;
                report.file_bytes += t.rec.size;
            }
            for (i, id) in m.iter().enumerate() {
                if let Some(id) = id {
                    wanted.push((t.rec.ino, i as u64, *id));
                }
            }
            if mode == RestoreMode::Lazy {
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

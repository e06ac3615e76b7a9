//! Garbage collection: snapshot retention and unreferenced chunks.
//!
//! Retention walks the head's history (`prev` links) and keeps the newest `keep`
//! snapshots plus every snapshot their chains need (a delta needs its parent, back to a
//! full snapshot), and the snapshot the local state was last checkpointed as. A chunk is
//! kept when any kept snapshot names it, or the local chunk maps do. Anything else older
//! than the grace window is deleted; younger objects may belong to a checkpoint in
//! progress and are left for the next run. Age is the object's modification time, looked
//! at again just before each delete: a checkpoint that names an unreferenced chunk the
//! store already holds refreshes it (`Remote::put_many_fresh`) rather than skipping it,
//! so it counts as young until that checkpoint's snapshot protects it.
//!
//! A chunk store shared with forks (see `fork`) also keeps every chunk that any snapshot of
//! another workspace on it names, and the snapshot a fork in the making is built from.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, SystemTime};

use super::format::body_chunk_ids;
use super::remote::ObjectInfo;
use super::repo::{Repo, RepoError};
use crate::chunk::ChunkId;
use crate::meta::{MetaError, Store};

#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("list remote: {0}")]
    List(RepoError),
    #[error("read snapshot {seq}: {source}")]
    ReadSnapshot { seq: u64, source: RepoError },
    #[error("delete {key}: {source}")]
    Delete {
        key: String,
        source: super::remote::RemoteError,
    },
    #[error("look at {key} again before deleting it: {source}")]
    Recheck {
        key: String,
        source: super::remote::RemoteError,
    },
    #[error("state database: {0}")]
    Meta(#[from] MetaError),
    #[error("read the other workspaces on the chunk store: {0}")]
    ReadSharers(RepoError),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub snapshots_kept: u64,
    pub snapshots_deleted: u64,
    pub chunks_kept: u64,
    pub chunks_deleted: u64,
    pub bytes_deleted: u64,
    /// Unreferenced objects left alone because they are younger than the grace window.
    pub young_skipped: u64,
    /// Other workspaces (origin, forks) sharing the chunk store whose references were kept.
    pub sharing: u64,
    /// Registered workspaces that were ignored, and why.
    pub warnings: Vec<String>,
}

impl std::fmt::Display for GcReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kept {} snapshots and {} chunks; deleted {} snapshots and {} chunks ({} bytes); {} young unreferenced objects left for later",
            self.snapshots_kept, self.chunks_kept, self.snapshots_deleted, self.chunks_deleted, self.bytes_deleted, self.young_skipped
        )?;
        if self.sharing > 0 {
            write!(
                f,
                "; chunk store shared with {} other workspaces",
                self.sharing
            )?;
        }
        for w in &self.warnings {
            write!(f, "; warning: {w}")?;
        }
        Ok(())
    }
}

/// Runs gc on `repo`. `store` (the local state, if any) protects its last snapshot and its
/// chunk maps.
pub fn gc(
    repo: &mut Repo,
    store: Option<&Store>,
    keep: u32,
    grace: Duration,
) -> Result<GcReport, GcError> {
    let _ = repo.manifest().map_err(GcError::List)?;
    // Before any snapshot is deleted: what the others on the chunk store need.
    let shared = super::fork::shared_refs(repo).map_err(GcError::ReadSharers)?;
    let now = SystemTime::now();
    let old_enough = |t: SystemTime| now.duration_since(t).map(|d| d >= grace).unwrap_or(false);
    let snaps = repo.list_snapshots().map_err(GcError::List)?;
    let present: BTreeSet<u64> = snaps.iter().map(|(s, _)| *s).collect();
    let head = repo.read_head().map_err(GcError::List)?.map(|(h, _)| h.seq);
    let local_seq: Option<u64> = match store {
        Some(s) => s
            .read()
            .persist_get("last_seq")?
            .and_then(|v| v.parse().ok()),
        None => None,
    };

    // Newest `keep` of the head's history.
    let mut kept: BTreeSet<u64> = BTreeSet::new();
    let mut at = head;
    while let Some(s) = at {
        if kept.len() >= keep as usize || !present.contains(&s) {
            break;
        }
        kept.insert(s);
        at = repo
            .read_header(s)
            .map_err(|source| GcError::ReadSnapshot { seq: s, source })?
            .prev;
    }
    if let Some(s) = local_seq.filter(|s| present.contains(s)) {
        kept.insert(s);
    }
    kept.extend(shared.pinned.iter().filter(|s| present.contains(s)));
    // Chain closure, and the chunks every kept snapshot names.
    let mut chunks: HashSet<ChunkId> = HashSet::new();
    let mut todo: Vec<u64> = kept.iter().copied().collect();
    let mut closed: BTreeSet<u64> = BTreeSet::new();
    while let Some(s) = todo.pop() {
        if !closed.insert(s) {
            continue;
        }
        let (h, b) = repo
            .read_snapshot(s)
            .map_err(|source| GcError::ReadSnapshot { seq: s, source })?;
        chunks.extend(body_chunk_ids(&b));
        if let Some(p) = h.parent {
            todo.push(p);
        }
    }
    if let Some(s) = store {
        for rows in s.read().all_file_chunks()?.values() {
            chunks.extend(rows.iter().filter_map(|(_, id)| id.map(ChunkId)));
        }
    }

    chunks.extend(shared.chunks);
    let mut report = GcReport {
        snapshots_kept: closed.len() as u64,
        sharing: shared.workspaces,
        warnings: shared.warnings,
        ..Default::default()
    };
    let listed = repo.list_chunks().map_err(GcError::List)?;
    crate::progress::stage(
        "objects swept (snapshots, then chunks)",
        Some((snaps.len() + listed.len()) as u64),
    );
    let mut swept = 0;
    for (seq, info) in &snaps {
        if sweep(repo, info, closed.contains(seq), &old_enough, &mut report)? == Fate::Deleted {
            report.snapshots_deleted += 1;
        }
        swept += 1;
        crate::progress::set(swept);
    }
    for (id, info) in listed {
        swept += 1;
        crate::progress::set(swept);
        match sweep(repo, &info, chunks.contains(&id), &old_enough, &mut report)? {
            Fate::Referenced => report.chunks_kept += 1,
            Fate::Deleted => {
                report.chunks_deleted += 1;
                report.bytes_deleted += info.size;
            }
            Fate::Young | Fate::Gone => {}
        }
    }
    tracing::info!(report = %report, "gc");
    Ok(report)
}

/// What `sweep` did with one listed object.
#[derive(Debug, PartialEq, Eq)]
enum Fate {
    Referenced,
    /// Unreferenced but younger than the grace window (counted in `young_skipped`).
    Young,
    /// Unreferenced and already gone when looked at again.
    Gone,
    Deleted,
}

/// Deletes a listed object that nothing kept references once it is older than the grace
/// window. Its age is looked at again right before the delete: a checkpoint that names an
/// existing unreferenced chunk again refreshes its age before writing the snapshot, maybe
/// after this gc listed it. (What remains is a refresh landing between that last look and
/// the delete; the chunk store has no conditional delete to close it.)
fn sweep(
    repo: &Repo,
    info: &ObjectInfo,
    referenced: bool,
    old_enough: &impl Fn(SystemTime) -> bool,
    report: &mut GcReport,
) -> Result<Fate, GcError> {
    if referenced {
        return Ok(Fate::Referenced);
    }
    if !old_enough(info.modified) {
        report.young_skipped += 1;
        return Ok(Fate::Young);
    }
    let again = repo
        .remote
        .head(&info.key)
        .map_err(|source| GcError::Recheck {
            key: info.key.clone(),
            source,
        })?;
    match again {
        None => return Ok(Fate::Gone),
        Some(now) if !old_enough(now.modified) => {
            report.young_skipped += 1;
            return Ok(Fate::Young);
        }
        Some(_) => {}
    }
    repo.remote
        .delete(&info.key)
        .map_err(|source| GcError::Delete {
            key: info.key.clone(),
            source,
        })?;
    Ok(Fate::Deleted)
}

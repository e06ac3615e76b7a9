//! The bridge between a snapshot tree (`persist::format::Tree`) and the mounted
//! filesystem's rollback (`fs::WorkspaceFs::rollback`): what differs between the tree at
//! the last checkpoint and the target, the target as the filesystem asks for it, and the
//! kernel invalidations once it is applied (through the FUSE session's notifier,
//! `workspace::Invalidate`). Part of the start sequence: it joins persist's trees to the
//! workspace's filesystem, which know nothing of each other.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::chunk::{ChunkId, ChunkSource, FetchError};
use crate::meta::{InodeNo, Kind};
use crate::persist::format::TreeData;
use crate::persist::history::{Changed, View};
use crate::persist::hydrate::RemoteChunks;
use crate::persist::Repo;
use crate::workspace::fs::{RollbackPlan, RollbackTarget, Target, TargetData, WorkspaceFs};
use crate::workspace::Invalidate;

/// The inodes and entries that differ between `cur` and `target`, among those `changed`
/// names (a superset: what the snapshots between them touched).
pub fn plan(cur: &View, target: &View, changed: &Changed) -> RollbackPlan {
    let mut inodes = BTreeSet::new();
    let mut bodies = BTreeSet::new();
    for &ino in &changed.inodes {
        let (before, after) = (cur.inode(ino), target.inode(ino));
        if before == after {
            continue;
        }
        inodes.insert(InodeNo(ino));
        if let Some(t) = after {
            let bytes_differ = before.is_none_or(|b| b.data != t.data || b.rec.size != t.rec.size);
            if matches!(t.data, TreeData::Chunks(_)) && bytes_differ {
                bodies.insert(InodeNo(ino));
            }
        }
    }
    let entries = changed
        .dirents
        .iter()
        .filter(|(p, n)| cur.dirent(*p, n) != target.dirent(*p, n))
        .map(|(p, n)| (InodeNo(*p), n.clone()))
        .collect();
    RollbackPlan {
        inodes,
        bodies,
        entries,
    }
}

struct TreeTarget<'a, 'b> {
    tree: &'a View<'b>,
    chunks: RemoteChunks,
}

impl RollbackTarget for TreeTarget<'_, '_> {
    fn inode(&self, ino: InodeNo) -> Option<Target> {
        let t = self.tree.inode(ino.0)?;
        let r = &t.rec;
        Some(Target {
            inode: t.inode()?,
            xattrs: r.xattrs.clone(),
            data: match &t.data {
                TreeData::None => TargetData::None,
                TreeData::Inline(v) => TargetData::Inline(v.clone()),
                TreeData::Symlink(v) => TargetData::Symlink(v.clone()),
                TreeData::Chunks(m) => TargetData::Chunks(m.clone()),
            },
        })
    }

    fn entry(&self, parent: InodeNo, name: &[u8]) -> Option<(InodeNo, Kind)> {
        let (ino, kind) = self.tree.dirent(parent.0, name)?;
        Some((InodeNo(ino), Kind::from_mode(kind)?))
    }

    fn links(&self, inos: &BTreeSet<InodeNo>) -> Vec<(InodeNo, Vec<u8>)> {
        if inos.is_empty() {
            return Vec::new();
        }
        self.tree
            .dirents_where(|(ino, _)| inos.contains(&InodeNo(*ino)))
            .into_iter()
            .map(|((p, n), _)| (InodeNo(p), n))
            .collect()
    }

    fn chunk_size(&self) -> u64 {
        self.tree.chunk_size()
    }

    fn fetch(&self, ids: &[ChunkId]) -> Vec<Result<Bytes, FetchError>> {
        self.chunks.fetch(ids)
    }
}

/// Why the mounted workspace could not be rolled back.
#[derive(Debug, thiserror::Error)]
pub enum LiveRollbackError {
    #[error("the snapshot was cut into {snapshot} byte windows, the workspace into {workspace}: restore it with keel snapshot restore instead")]
    WindowSize { snapshot: u64, workspace: u64 },
    #[error("rollback: {0}")]
    Apply(#[source] crate::workspace::fs::FsError),
}

/// What the checkpoint service calls to roll the mounted workspace back.
pub fn rollback_fn(fs: Arc<WorkspaceFs>, inval: Invalidate) -> crate::persist::agent::RollbackFn {
    Box::new(
        move |repo: &Repo, cur: &View, target: &View, changed: &Changed| {
            if cur.chunk_size() != target.chunk_size() {
                return Err(LiveRollbackError::WindowSize {
                    snapshot: target.chunk_size(),
                    workspace: cur.chunk_size(),
                }
                .into());
            }
            let p = plan(cur, target, changed);
            let t = TreeTarget {
                tree: target,
                chunks: RemoteChunks::new(repo.clone()),
            };
            let r = fs.rollback(&p, &t).map_err(LiveRollbackError::Apply)?;
            let t0 = Instant::now();
            let mut inval_failed = 0u64;
            for i in &r.inval {
                if inval(i).is_err() {
                    inval_failed += 1;
                }
            }
            Ok(serde_json::json!({
                "inodes": r.inodes,
                "entries": r.entries,
                "bodies_rebuilt": r.bodies,
                "body_bytes": r.body_bytes,
                "open_files_kept": r.kept_open,
                "renumbered": r.renumbered,
                "changed_after_checkpoint": r.late,
                "invalidations": r.inval.len(),
                "invalidations_unknown_to_kernel": inval_failed,
                "invalidate_ms": (t0.elapsed().as_secs_f64() * 1e6).round() / 1e3,
            }))
        },
    )
}

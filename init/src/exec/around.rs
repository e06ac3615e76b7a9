//! The workspace options of `POST /exec`, carried out by the checkpoint service (so they
//! never overlap a checkpoint or a rollback):
//!
//! - before the spawn: a snapshot, named `snapshot=NAME` when asked (kept until deleted),
//!   else (for `rollback_on`, and `diff` without a FUSE workspace) named
//!   `exec-<id>-before-<secs>` only while the process runs, so retention cannot collect it
//!   meanwhile; for `diff` on the FUSE workspace, a change tracker (`workspace::fs::track`):
//!   no snapshot;
//! - after the exit: `diff`, the changes of every writer while the command ran: from the
//!   tracker (the state before of what changed, against the state now, compared by
//!   `persist::diff::diff_trees` exactly as `keel diff` compares two snapshots, in time
//!   proportional to the change), else the checkpoint service's diff from the snapshot
//!   before to the live workspace (checkpointed first);
//!   `rollback_on` (a live rollback to that snapshot when the command failed or timed out;
//!   the state it rolled back from stays as `before-rollback-N`), `checkpoint=wait` (the
//!   result names the snapshot on the remote that holds the command's writes).
//!
//! What they found goes into the exit event under `snapshot_before`, `snapshot`, `diff`,
//! `rollback`, `checkpoint`; a step that failed under `errors`.

use std::collections::BTreeMap;
use std::time::Instant;

use serde_json::{json, Map, Value};

use super::record::ProcessId;
use super::request::{Around, RollbackOn};
use crate::persist::agent::{Diff, Op, Rollback, SnapshotCreate};
use crate::persist::format::{DataRec, InodeRec, Tree, TreeData, TreeInode};
use crate::persist::service::ServiceError;
use crate::persist::CheckpointHandle;
use crate::workspace::fs::{Content, Seen, Side, TrackId, Tracked};
use crate::workspace::MountedHandle;

/// What the step before the spawn left: the snapshot, the name that pins it only for the
/// process's time, the change tracker.
#[derive(Debug, Clone, Default)]
pub struct Before {
    pub seq: Option<u64>,
    pin: Option<String>,
    track: Option<(MountedHandle, TrackId)>,
}

/// The snapshot before the spawn, when an option needs one, and the change tracker for
/// `diff` on the FUSE workspace (`ws`).
pub fn before(
    a: &Around,
    id: ProcessId,
    agent: &CheckpointHandle,
    ws: Option<&MountedHandle>,
) -> Result<Before, ServiceError> {
    let track = match ws.filter(|_| a.diff) {
        Some(w) => match w.track_start() {
            Ok(t) => Some((w.clone(), t)),
            Err(e) => {
                tracing::warn!(error = %e, "exec {id}: no change tracker; diff from snapshots");
                None
            }
        },
        None => None,
    };
    let message = format!("before exec {id}");
    let (name, pin) = match &a.snapshot {
        Some(n) => (n.clone(), None),
        None if (a.diff && track.is_none()) || a.rollback_on.is_some() => {
            let secs = crate::time::now_ns() / 1_000_000_000;
            let n = format!("exec-{id}-before-{secs}");
            (n.clone(), Some(n))
        }
        None => {
            return Ok(Before {
                track,
                ..Default::default()
            })
        }
    };
    let v = agent.agent(Op::SnapshotCreate(SnapshotCreate {
        name: Some(name),
        message,
    }));
    let v = match v {
        Ok(v) => v,
        Err(e) => {
            if let Some((w, t)) = track {
                let _ = w.track_finish(t);
            }
            return Err(e);
        }
    };
    Ok(Before {
        seq: v["id"].as_u64(),
        pin,
        track,
    })
}

/// A tracked side as the part of a snapshot tree a diff looks at.
fn tree(side: Side, chunk_size: u64) -> Tree {
    let inodes = side
        .inodes
        .into_values()
        .map(
            |Seen {
                 inode,
                 xattrs,
                 content,
             }| {
                let rec = InodeRec {
                    ino: inode.ino.0,
                    mode: inode.kind.mode_bits() | inode.perm,
                    uid: inode.uid,
                    gid: inode.gid,
                    nlink: inode.nlink,
                    size: inode.size,
                    atime: inode.atime.0,
                    mtime: inode.mtime.0,
                    ctime: inode.ctime.0,
                    rdev: inode.rdev,
                    parent: inode.parent.0,
                    xattrs,
                    data: DataRec::None,
                };
                let data = match content {
                    Content::None => TreeData::None,
                    Content::Inline(v) => TreeData::Inline(v),
                    Content::Symlink(v) => TreeData::Symlink(v),
                    Content::Chunks(ids) => TreeData::Chunks(ids),
                };
                (inode.ino.0, TreeInode { rec, data })
            },
        )
        .collect();
    let dirents: BTreeMap<(u64, Vec<u8>), (u64, u32)> = side
        .dirents
        .into_iter()
        .map(|((p, n), (ino, kind))| ((p.0, n), (ino.0, kind.mode_bits())))
        .collect();
    Tree {
        seq: None,
        chunk_size,
        inodes,
        dirents,
    }
}

/// What a tracker saw, compared as `keel diff` compares two snapshots.
pub fn diff_tracked(t: Tracked, chunk_size: u64) -> crate::persist::diff::Diff {
    crate::persist::diff::diff_trees(&tree(t.before, chunk_size), &tree(t.after, chunk_size))
}

/// The changes the tracker saw, as `keel diff` of two snapshots shows them.
fn tracked_diff(w: &MountedHandle, t: TrackId, from: Option<u64>) -> Result<Value, String> {
    let t0 = Instant::now();
    let tracked = w.track_finish(t).map_err(|e| e.to_string())?;
    let d = diff_tracked(tracked, w.chunk_size());
    let mut v = serde_json::to_value(&d).map_err(|e| e.to_string())?;
    v["from"] = from.into();
    v["to"] = Value::Null;
    v["trees"] = "tracked".into();
    v["duration_ms"] = (t0.elapsed().as_secs_f64() * 1e3).into();
    Ok(v)
}

/// The options after the exit (`success`: exit code 0; `spawned`: the command started at
/// all, its exec did not fail).
pub fn after(
    a: &Around,
    b: &Before,
    spawned: bool,
    success: bool,
    timed_out: bool,
    agent: &CheckpointHandle,
) -> Map<String, Value> {
    let mut m = Map::new();
    let mut errors: Vec<String> = Vec::new();
    if let Some(s) = b.seq {
        m.insert("snapshot_before".into(), s.into());
    }
    if let Some(n) = &a.snapshot {
        m.insert("snapshot".into(), n.clone().into());
    }
    // The snapshot that holds the command's writes (and, after a rollback, the one after).
    let mut last: Option<u64> = None;
    let mut tracked = None;
    if let Some((w, t)) = &b.track {
        match tracked_diff(w, *t, b.seq) {
            Ok(v) => tracked = Some(v),
            Err(e) => errors.push(format!("diff: {e}")),
        }
    } else if let (true, Some(from)) = (a.diff, b.seq) {
        let op = Op::Diff(Diff {
            from: from.to_string(),
            to: None,
        });
        match agent.agent(op) {
            Ok(v) => {
                last = v["diff"]["to"].as_u64();
                m.insert("diff".into(), v["diff"].clone());
            }
            Err(e) => errors.push(format!("diff: {e}")),
        }
    }
    if let (Some(on), Some(to)) = (a.rollback_on, b.seq) {
        // A command that never started changed nothing: a rollback would only undo what
        // others wrote meanwhile.
        let wanted = spawned
            && match on {
                RollbackOn::Failure => !success || timed_out,
                RollbackOn::Timeout => timed_out,
            };
        if wanted {
            let op = Op::Rollback(Rollback {
                to: to.to_string(),
                restart: Some(false),
            });
            match agent.agent(op) {
                Ok(v) => {
                    last = v["snapshot"].as_u64().or(last);
                    let mut r = json!({ "rolled_back": true, "to": to, "on": on.as_str() });
                    for k in ["from", "snapshot", "undo"] {
                        if !v[k].is_null() {
                            r[k] = v[k].clone();
                        }
                    }
                    m.insert("rollback".into(), r);
                }
                Err(e) => {
                    errors.push(format!("rollback to snapshot {to}: {e}"));
                    m.insert(
                        "rollback".into(),
                        json!({ "rolled_back": false, "to": to, "on": on.as_str() }),
                    );
                }
            }
        } else {
            m.insert(
                "rollback".into(),
                json!({ "rolled_back": false, "on": on.as_str() }),
            );
        }
    }
    if a.checkpoint_wait {
        match last {
            Some(s) => {
                m.insert("checkpoint".into(), s.into());
            }
            None => match agent.agent(Op::Checkpoint) {
                Ok(v) => {
                    m.insert("checkpoint".into(), v["id"].clone());
                    // The tracked changes are those between the snapshot before and this.
                    if let Some(d) = tracked.as_mut().filter(|_| b.seq.is_some()) {
                        d["to"] = v["id"].clone();
                    }
                }
                Err(e) => errors.push(format!("checkpoint: {e}")),
            },
        }
    }
    if let Some(d) = tracked {
        m.insert("diff".into(), d);
    }
    unpin(b, agent, &mut errors);
    if !errors.is_empty() {
        m.insert("errors".into(), errors.into());
    }
    m
}

/// The process never started (or never got its thread): its change tracker ends and the
/// name that pinned the snapshot before goes (what it could not delete is returned).
pub fn abandon(b: &Before, agent: Option<&CheckpointHandle>) -> Vec<String> {
    if let Some((w, t)) = &b.track {
        let _ = w.track_finish(*t);
    }
    let mut errors = Vec::new();
    if let Some(agent) = agent {
        unpin(b, agent, &mut errors);
    }
    errors
}

/// When keel stops before the options after the exit could run: nothing is diffed, rolled
/// back or checkpointed, and the temporary name of the snapshot before goes all the same.
pub fn skipped(a: &Around, b: &Before, why: &str, agent: &CheckpointHandle) -> Map<String, Value> {
    let mut errors = abandon(b, Some(agent));
    errors.insert(0, format!("diff, rollback and checkpoint skipped: {why}"));
    let mut m = Map::new();
    if let Some(s) = b.seq {
        m.insert("snapshot_before".into(), s.into());
    }
    if let Some(n) = &a.snapshot {
        m.insert("snapshot".into(), n.clone().into());
    }
    m.insert("errors".into(), errors.into());
    m
}

/// Drops the name that kept the snapshot before for the process's time.
fn unpin(b: &Before, agent: &CheckpointHandle, errors: &mut Vec<String>) {
    let Some(n) = &b.pin else { return };
    let r = agent
        .repo()
        .map_err(|e| e.to_string())
        .and_then(|repo| crate::persist::snapshots::delete(&repo, n).map_err(|e| e.to_string()));
    if let Err(e) = r {
        errors.push(format!("delete the name {n}: {e}"));
    }
}

//! What agents and their hosts ask of a running workspace: a named snapshot now, and a
//! rollback of the live workspace to a snapshot. Both run on the checkpoint service's
//! worker thread (`service::Cmd::Agent`), so they never overlap a checkpoint; a rollback
//! asked for while a checkpoint or another rollback runs is refused at once
//! (`service::CheckpointHandle::agent`).
//!
//! A rollback: flush and checkpoint (the state it leaves is a snapshot, named
//! `before-rollback-N` so it can be rolled back to, whatever the retention), load that tree
//! and the target's, hand both to the mounted filesystem (`RollbackFn`, set by the
//! workspace session), then checkpoint again: the rolled-back tree is snapshot N.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::checkpoint::{now_ns, CheckpointOptions};
use super::format::Tree;
use super::repo::Repo;
use super::service::Worker;
use super::snapshots;

/// `keel snapshot create`, `POST /snapshots`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotCreate {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub message: String,
}

/// `keel rollback`, `POST /rollback`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rollback {
    /// `ID|NAME|head`.
    pub to: String,
}

/// An operation for the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Op {
    SnapshotCreate(SnapshotCreate),
    Rollback(Rollback),
}

/// Makes the mounted workspace equal to `target` (the tree at the last checkpoint is
/// `current`); returns what it did, as JSON.
pub type RollbackFn = Box<dyn Fn(&Repo, &Tree, &Tree) -> Result<serde_json::Value, String> + Send>;

fn ms(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

/// The snapshot the local state was last checkpointed as.
fn last_seq(w: &Worker) -> Result<Option<u64>, String> {
    Ok(w.p
        .store()
        .read()
        .persist_get("last_seq")
        .map_err(|e| e.to_string())?
        .and_then(|v| v.parse().ok()))
}

pub(super) fn run(w: &mut Worker, op: Op) -> Result<serde_json::Value, String> {
    match op {
        Op::SnapshotCreate(c) => create(w, &c),
        Op::Rollback(r) => rollback(w, &r),
    }
}

fn create(w: &mut Worker, c: &SnapshotCreate) -> Result<serde_json::Value, String> {
    let t0 = Instant::now();
    if let Some(n) = &c.name {
        snapshots::check_name(n).map_err(|e| e.to_string())?;
    }
    let r = w.checkpoint(CheckpointOptions::default(), !w.paused)?;
    let seq = match r.seq {
        Some(s) => s,
        None => last_seq(w)?.ok_or("the workspace has no snapshot and nothing to checkpoint")?,
    };
    let repo = w.p.repo().clone();
    let rec = snapshots::record(&repo, seq, c.name.as_deref(), &c.message, now_ns())
        .map_err(|e| e.to_string())?;
    Ok(serde_json::json!({
        "id": seq,
        "name": rec.name,
        "message": rec.message,
        "new_snapshot": r.seq.is_some(),
        "checkpoint": r.to_string(),
        "duration_ms": ms(t0),
    }))
}

fn rollback(w: &mut Worker, req: &Rollback) -> Result<serde_json::Value, String> {
    let t0 = Instant::now();
    if w.rollback.is_none() {
        return Err("rollback needs the mounted workspace (keel run or keel mount)".into());
    }
    let repo = w.p.repo().clone();
    let target = snapshots::resolve(&repo, &req.to).map_err(|e| e.to_string())?;
    let before = w.checkpoint(CheckpointOptions::default(), true)?;
    let current = match before.seq {
        Some(s) => s,
        None => last_seq(w)?.ok_or("the workspace has no snapshot yet")?,
    };
    let t_ckpt = ms(t0);
    let t1 = Instant::now();
    let load = |seq: u64| {
        repo.load_tree(seq)
            .map(|(t, _)| t)
            .map_err(|e| format!("load snapshot {seq}: {e}"))
    };
    let cur = load(current)?;
    let tgt = if target == current {
        cur.clone()
    } else {
        load(target)?
    };
    let t_load = ms(t1);
    let t2 = Instant::now();
    let f = w.rollback.as_ref().expect("checked above");
    let detail = f(&repo, &cur, &tgt)?;
    let t_apply = ms(t2);
    let t3 = Instant::now();
    let after = w.checkpoint(CheckpointOptions::default(), false)?;
    let new = after.seq.unwrap_or(current);
    let undo = format!("before-rollback-{new}");
    snapshots::record(
        &repo,
        current,
        Some(&undo),
        &format!("the workspace before the rollback to snapshot {target}"),
        now_ns(),
    )
    .map_err(|e| e.to_string())?;
    Ok(serde_json::json!({
        "from": current,
        "to": target,
        "snapshot": new,
        "undo": undo,
        "applied": detail,
        "checkpoint_before_ms": t_ckpt,
        "load_trees_ms": t_load,
        "apply_ms": t_apply,
        "checkpoint_after_ms": ms(t3),
        "duration_ms": ms(t0),
    }))
}

//! The workspace options of `POST /exec`, carried out by the checkpoint service (so they
//! never overlap a checkpoint or a rollback):
//!
//! - before the spawn: a snapshot, named `snapshot=NAME` when asked (kept until deleted),
//!   else (for `diff` and `rollback_on`) named `exec-<id>-before-<secs>` only while the
//!   process runs, so retention cannot collect it meanwhile;
//! - after the exit: `diff` (the checkpoint service's diff from that snapshot to the live
//!   workspace, checkpointed first: the changes of every writer while the command ran),
//!   `rollback_on` (a live rollback to that snapshot when the command failed or timed out;
//!   the state it rolled back from stays as `before-rollback-N`), `checkpoint=wait` (the
//!   result names the snapshot on the remote that holds the command's writes).
//!
//! What they found goes into the exit event under `snapshot_before`, `snapshot`, `diff`,
//! `rollback`, `checkpoint`; a step that failed under `errors`.

use serde_json::{json, Map, Value};

use super::record::ProcessId;
use super::request::{Around, RollbackOn};
use crate::persist::agent::{Diff, Op, Rollback, SnapshotCreate};
use crate::persist::service::ServiceError;
use crate::persist::CheckpointHandle;

/// What the step before the spawn left: the snapshot, and the name that pins it only for
/// the process's time.
#[derive(Debug, Clone, Default)]
pub struct Before {
    pub seq: Option<u64>,
    pin: Option<String>,
}

/// The snapshot before the spawn, when an option needs one.
pub fn before(a: &Around, id: ProcessId, agent: &CheckpointHandle) -> Result<Before, ServiceError> {
    let message = format!("before exec {id}");
    let (name, pin) = match &a.snapshot {
        Some(n) => (n.clone(), None),
        None if a.diff || a.rollback_on.is_some() => {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let n = format!("exec-{id}-before-{secs}");
            (n.clone(), Some(n))
        }
        None => return Ok(Before::default()),
    };
    let v = agent.agent(Op::SnapshotCreate(SnapshotCreate {
        name: Some(name),
        message,
    }))?;
    Ok(Before {
        seq: v["id"].as_u64(),
        pin,
    })
}

/// The options after the exit (`success`: exit code 0).
pub fn after(
    a: &Around,
    b: &Before,
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
    if let (true, Some(from)) = (a.diff, b.seq) {
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
        let wanted = match on {
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
                }
                Err(e) => errors.push(format!("checkpoint: {e}")),
            },
        }
    }
    unpin(b, agent, &mut errors);
    if !errors.is_empty() {
        m.insert("errors".into(), errors.into());
    }
    m
}

/// When keel stops before the options after the exit could run.
pub fn skipped(a: &Around, b: &Before, why: &str) -> Map<String, Value> {
    let mut m = Map::new();
    if let Some(s) = b.seq {
        m.insert("snapshot_before".into(), s.into());
    }
    if let Some(n) = &a.snapshot {
        m.insert("snapshot".into(), n.clone().into());
    }
    m.insert(
        "errors".into(),
        vec![format!("diff, rollback and checkpoint skipped: {why}")].into(),
    );
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

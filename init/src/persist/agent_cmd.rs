//! What `keel snapshot create|list|delete` and `keel diff` do on a stopped state dir and its
//! remote (`--state DIR` or the config). A running keel answers them through its control API
//! instead (`control::agent_client` decides which); a rollback is only ever that. The
//! command line for them is in the binary's `cli/`.

use super::agent::SnapshotCreate;
use super::checkpoint::{CheckpointError, CheckpointOptions};
use super::diff::DiffError;
use super::ops::{repo_of, with_offline_writer, OpsError};
use super::snapshots::SnapshotsError;
use super::{diff, snapshots};
use crate::config::Config;
use crate::meta::MetaError;
use crate::time::now_ns;

/// Why `keel snapshot` or `keel diff` failed on a stopped state dir. The messages are the
/// command line's.
#[derive(Debug, thiserror::Error)]
pub enum AgentCmdError {
    /// Finding the running keel, opening the remote or the stopped state dir (boxed: the
    /// steps' errors are large).
    #[error(transparent)]
    Ops(Box<OpsError>),
    #[error("{0}")]
    Checkpoint(#[source] Box<CheckpointError>),
    #[error("{0}")]
    ReadState(#[source] MetaError),
    #[error("the workspace has no snapshot and nothing to checkpoint")]
    NoSnapshot,
    #[error("{0}")]
    CheckName(#[source] SnapshotsError),
    #[error("{0}")]
    RecordSnapshot(#[source] SnapshotsError),
    #[error("{0}")]
    ListSnapshots(#[source] SnapshotsError),
    #[error("{0}")]
    DeleteName(#[source] SnapshotsError),
    #[error("{0}")]
    ResolveSnapshot(#[source] SnapshotsError),
    #[error("{0}")]
    Diff(#[source] DiffError),
}

/// `keel diff`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiffOptions {
    pub from: String,
    /// `None`: the live workspace.
    pub to: Option<String>,
    pub json: bool,
    /// A unified diff of this one file instead of the list of changes.
    pub path: Option<String>,
}

impl From<OpsError> for AgentCmdError {
    fn from(e: OpsError) -> Self {
        AgentCmdError::Ops(Box::new(e))
    }
}

/// Checkpoints a stopped state dir as its one writer; returns the snapshot it is now at.
fn checkpoint_offline(cfg: &Config) -> Result<u64, AgentCmdError> {
    with_offline_writer(cfg, |p| {
        let r = p
            .checkpoint(&CheckpointOptions::default())
            .map_err(|e| AgentCmdError::Checkpoint(Box::new(e)))?;
        match r.seq {
            Some(s) => Ok(s),
            None => p
                .store()
                .read()
                .persist_get("last_seq")
                .map_err(AgentCmdError::ReadState)?
                .and_then(|v| v.parse().ok())
                .ok_or(AgentCmdError::NoSnapshot),
        }
    })
}

/// A snapshot of the stopped workspace now, recorded under a name (see `snapshots`).
pub fn snapshot_create(
    cfg: &Config,
    c: &SnapshotCreate,
) -> Result<serde_json::Value, AgentCmdError> {
    if let Some(n) = &c.name {
        snapshots::check_name(n).map_err(AgentCmdError::CheckName)?;
    }
    let seq = checkpoint_offline(cfg)?;
    let rec = snapshots::record(&repo_of(cfg)?, seq, c.name.as_deref(), &c.message, now_ns())
        .map_err(AgentCmdError::RecordSnapshot)?;
    Ok(serde_json::json!({ "id": seq, "name": rec.name, "message": rec.message }))
}

pub fn snapshot_list(cfg: &Config) -> Result<snapshots::Listing, AgentCmdError> {
    snapshots::list(&repo_of(cfg)?).map_err(AgentCmdError::ListSnapshots)
}

/// Removes a name: the snapshot falls under retention again.
pub fn snapshot_delete(cfg: &Config, what: &str) -> Result<Vec<String>, AgentCmdError> {
    snapshots::delete(&repo_of(cfg)?, what).map_err(AgentCmdError::DeleteName)
}

/// `keel diff` of a stopped workspace, from its remote: the changes as text or JSON,
/// written to `out` as they are found, or a unified diff of one file. `to` defaults to the
/// workspace as it is, checkpointed first. At most `[control] diff_max_entries` changed
/// entries (0: any).
pub fn diff(
    cfg: &Config,
    o: &DiffOptions,
    out: &mut dyn std::io::Write,
) -> Result<(), AgentCmdError> {
    let limit = cfg.control.diff_max_entries;
    let format = if o.json {
        diff::Format::Json
    } else {
        diff::Format::Text
    };
    let to = match &o.to {
        Some(t) => t.clone(),
        None => {
            checkpoint_offline(cfg)?;
            "head".to_string()
        }
    };
    let repo = repo_of(cfg)?;
    let from = snapshots::resolve(&repo, &o.from).map_err(AgentCmdError::ResolveSnapshot)?;
    let to = snapshots::resolve(&repo, &to).map_err(AgentCmdError::ResolveSnapshot)?;
    if let Some(p) = &o.path {
        let mut text = diff::file_diff(&repo, from, to, p).map_err(AgentCmdError::Diff)?;
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        return out
            .write_all(text.as_bytes())
            .map_err(|e| AgentCmdError::Diff(DiffError::Write(e)));
    }
    let mut answer = diff::Answer::new(out, format, from, to);
    diff::diff_how_each(&repo, from, to, limit, &mut |c| answer.change(c))
        .map_err(AgentCmdError::Diff)?;
    answer.finish(&[]).map_err(AgentCmdError::Diff)?;
    Ok(())
}

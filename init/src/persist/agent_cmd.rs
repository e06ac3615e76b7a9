//! What `keel snapshot create|list|delete`, `keel diff` and `keel rollback` do: each finds
//! the running keel the way `keel checkpoint` does (`--state DIR` or the config; its
//! `persist.sock`) and otherwise works on the stopped state dir and its remote. The command
//! line for them is in the binary's `cli/`.

use std::path::Path;
use std::time::Duration;

use super::agent::{Op, Rollback, SnapshotCreate};
use super::checkpoint::{CheckpointError, CheckpointOptions};
use super::control::RequestError;
use super::diff::DiffError;
use super::ops::{ask, ask_stream, repo_of, with_offline_writer, OpsError};
use super::snapshots::SnapshotsError;
use super::{control, diff, snapshots};
use crate::config::Config;
use crate::meta::MetaError;
use crate::sys;
use crate::time::now_ns;

/// Why `keel snapshot`, `keel diff` or `keel rollback` failed on this side of the running
/// keel (its own refusals arrive as its answer). The messages are the command line's.
#[derive(Debug, thiserror::Error)]
pub enum AgentCmdError {
    /// Finding the running keel, opening the remote or the stopped state dir (boxed: the
    /// steps' errors are large).
    #[error(transparent)]
    Ops(Box<OpsError>),
    #[error("unexpected answer from keel: {0}")]
    Answer(#[source] serde_json::Error),
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
    /// Asking the running keel to checkpoint before a diff against the live workspace.
    #[error("{0}")]
    AskCheckpoint(#[source] RequestError),
    #[error("{0}")]
    Diff(#[source] DiffError),
    #[error("no keel runs on {}: rollback works on a mounted workspace (a stopped one is restored with keel snapshot restore)", .0.display())]
    NotRunning(std::path::PathBuf),
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

/// Sends `op` to the keel running on the state dir; `Ok(None)`: none runs there.
fn ask_agent(cfg: &Config, op: &Op) -> Result<Option<serde_json::Value>, AgentCmdError> {
    let line = format!(
        "agent {}",
        serde_json::to_string(op).expect("op serialises")
    );
    match ask(&cfg.workspace.state_dir, &line)? {
        Some(r) => serde_json::from_str(&r)
            .map(Some)
            .map_err(AgentCmdError::Answer),
        None => Ok(None),
    }
}

/// Pushes what the kernel caches for the running keel's mount into keel (from this
/// process, like `keel checkpoint`).
fn sync_mount(cfg: &Config) -> Result<(), AgentCmdError> {
    if let Some(mp) = ask(&cfg.workspace.state_dir, "mount-point")? {
        if let Err(e) = sys::file::syncfs(Path::new(&mp)) {
            eprintln!("keel: syncfs {mp}: {e} (going on with what keel has)");
        }
    }
    Ok(())
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

/// A snapshot of the live workspace now, recorded under a name (see `snapshots`).
pub fn snapshot_create(
    cfg: &Config,
    c: &SnapshotCreate,
) -> Result<serde_json::Value, AgentCmdError> {
    if let Some(n) = &c.name {
        snapshots::check_name(n).map_err(AgentCmdError::CheckName)?;
    }
    sync_mount(cfg)?;
    if let Some(v) = ask_agent(cfg, &Op::SnapshotCreate(c.clone()))? {
        return Ok(v);
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

/// `keel diff`: the changes as text or JSON, written to `out` as they are found (by the
/// running keel, over `persist.sock`, else from the remote here), or a unified diff of one
/// file. At most `limit` changed entries (0: any).
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
    if o.path.is_none() {
        // A running keel compares from its history of recent snapshots (`history`).
        if o.to.is_none() {
            sync_mount(cfg)?;
        }
        let req = control::DiffRequest {
            diff: super::agent::Diff {
                from: o.from.clone(),
                to: o.to.clone(),
            },
            format,
            limit,
        };
        let line = format!(
            "diff {}",
            serde_json::to_string(&req).expect("request serialises")
        );
        if ask_stream(&cfg.workspace.state_dir, &line, out)? {
            return Ok(());
        }
    }
    let to = match &o.to {
        Some(t) => t.clone(),
        None => {
            // The live workspace: checkpointed first, then it is the head.
            sync_mount(cfg)?;
            let running = control::request(
                &cfg.workspace.state_dir,
                "checkpoint",
                Duration::from_secs(3600),
            )
            .map_err(AgentCmdError::AskCheckpoint)?;
            if running.is_none() {
                checkpoint_offline(cfg)?;
            }
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

/// `keel rollback`: only against a running keel (a stopped workspace is restored with
/// `keel snapshot restore`).
pub fn rollback(cfg: &Config, r: &Rollback) -> Result<serde_json::Value, AgentCmdError> {
    sync_mount(cfg)?;
    ask_agent(cfg, &Op::Rollback(r.clone()))?
        .ok_or_else(|| AgentCmdError::NotRunning(cfg.workspace.state_dir.clone()))
}

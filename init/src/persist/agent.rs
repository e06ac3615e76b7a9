//! What agents and their hosts ask of a running workspace: a named snapshot now, and a
//! rollback of the live workspace to a snapshot. Both run on the checkpoint service's
//! worker thread (`service::Cmd::Agent`), so they never overlap a checkpoint; a rollback
//! asked for while a checkpoint or another rollback runs is refused at once
//! (`service::CheckpointHandle::agent`).
//!
//! A rollback: flush and checkpoint (the state it leaves is a snapshot, named
//! `rollback-from-M` while the rollback runs and `before-rollback-N` once it is done, so it
//! can be rolled back to, whatever the retention or a gc meanwhile), see that tree and the
//! target's (from the history, or only the parts the snapshots between them touched,
//! `diff::sparse`), hand both to the live workspace (`LiveTree`, which the workspace's
//! start hands the service), then checkpoint again: the rolled-back tree is snapshot N. A rollback that
//! changes nothing makes no snapshot and names none: its undo is the snapshot it started
//! from.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::checkpoint::CheckpointOptions;
use super::diff::Sparse;
use super::format::Tree;
use super::history::{Changed, History, HistoryError, View};
use super::repo::{Repo, RepoError};
use super::service::Worker;
use super::snapshots::{self, SnapshotsError};
use crate::meta::MetaError;
use crate::time::now_ns;

/// Why an agent operation (snapshot create, diff, rollback) failed. The messages are the
/// ones `keel snapshot`, `keel diff` and `keel rollback` print.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    ReadState(#[from] MetaError),
    #[error(transparent)]
    LoadHistory(#[from] HistoryError),
    #[error("load snapshot {seq}: {source}")]
    LoadSnapshot {
        seq: u64,
        #[source]
        source: RepoError,
    },
    /// The two sides of a diff read from the newer one's chain (`diff::sparse`).
    #[error(transparent)]
    Diff(super::diff::DiffError),
    #[error(transparent)]
    ResolveSnapshot(SnapshotsError),
    #[error(transparent)]
    CheckName(SnapshotsError),
    #[error(transparent)]
    RecordSnapshot(SnapshotsError),
    /// The checkpoint the operation takes first (boxed: a service error may carry an
    /// agent error).
    #[error("{0}")]
    Checkpoint(#[source] Box<super::service::ServiceError>),
    #[error("{0}")]
    NoSnapshot(&'static str),
    #[error("rollback needs the mounted workspace (keel run or keel mount)")]
    NotMounted,
    #[error("{}", NO_MAIN)]
    NoMain,
    #[error(transparent)]
    Main(#[from] MainCommandError),
    /// The live workspace's rollback (`LiveTree::roll_back`) failed.
    #[error("{0}")]
    Apply(#[source] super::service::BoxError),
    /// A rollback failed after it named the state before it (`pin`): where to go back.
    #[error("{source}; the workspace before the rollback is snapshot {seq}, named {pin}")]
    Unfinished {
        seq: u64,
        pin: String,
        #[source]
        source: Box<AgentError>,
    },
}

/// Why the supervisor could not stop or start the main command.
#[derive(Debug, thiserror::Error)]
pub enum MainCommandError {
    #[error("stop the main command: {0}")]
    Stop(#[source] HoldFailure),
    #[error("start the main command again: {0}")]
    Start(#[source] HoldFailure),
}

/// Why a hold of the main command did not reach the state asked for.
#[derive(Debug, thiserror::Error)]
pub enum HoldFailure {
    #[error("keel is stopping")]
    Stopping,
    #[error("the supervisor did not answer within {0:?}")]
    NoAnswer(std::time::Duration),
    #[error("its process group was still there {0:?} after the stop signal (SIGKILL sent: a process in uninterruptible sleep?); nothing was rolled back, and the command starts again once the group is gone")]
    NotStopped(std::time::Duration),
}

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
    /// Stop the main command (its process group) first and start it again after
    /// (`keel run` only). `None`: the provider's default (the `dir` provider stops it,
    /// since a rollback replaces the tree its processes work in; FUSE rolls back live).
    #[serde(default)]
    pub restart: Option<bool>,
}

/// The main command of `keel run`, for `keel rollback --restart` (the supervisor's
/// `MainHold`).
pub trait MainCommand: Send + Sync {
    /// Sends the stop signal to its process group, SIGKILL after the grace, and returns once
    /// nothing of the group is left. When that does not happen in time it fails, and the
    /// command is started again by itself once the group is gone (`start` is not called).
    fn stop(&self) -> Result<(), MainCommandError>;
    /// Runs it again with the same command line.
    fn start(&self) -> Result<(), MainCommandError>;
}

/// An operation for the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Op {
    SnapshotCreate(SnapshotCreate),
    Rollback(Rollback),
    Diff(Diff),
    /// A checkpoint of the live workspace (the kernel's writeback included), answered with
    /// the snapshot that holds it (`{"id": N, "new_snapshot": bool}`): what processes
    /// started through the API wait for (`checkpoint=wait`), with no name recorded.
    Checkpoint,
}

/// `keel diff` and `GET /diff` against a running keel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Diff {
    /// `ID|NAME|head`.
    pub from: String,
    /// `None`: the live workspace (flushed and checkpointed first).
    #[serde(default)]
    pub to: Option<String>,
}

/// The live workspace as a rollback reaches it. The workspace's side implements it (the
/// FUSE filesystem with its kernel notifier, or the `dir` provider's tree: `boot::live`)
/// and hands it to the checkpoint service when it starts it (`Service::start_with`); this
/// is all persist knows of the filesystem.
pub trait LiveTree: Send {
    /// Makes the live workspace equal to `target` (the tree at the last checkpoint is
    /// `current`); returns what it did, as JSON. `changed` names every inode and entry that
    /// may differ between the two. With a `Sparse`, the two views hold only what may differ
    /// (and the directories): what else the rollback needs of the target is read from it
    /// (`Sparse::read_to`).
    fn roll_back(
        &self,
        repo: &Repo,
        current: &View,
        target: &View,
        changed: &Changed,
        sparse: Option<&Sparse>,
    ) -> Result<serde_json::Value, super::service::BoxError>;
}

fn ms(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

/// The snapshot the local state was last checkpointed as.
fn last_seq(w: &Worker) -> Result<Option<u64>, AgentError> {
    Ok(w.p
        .store()
        .read()
        .persist_get("last_seq")?
        .and_then(|v| v.parse().ok()))
}

pub(super) fn run(w: &mut Worker, op: Op) -> Result<serde_json::Value, AgentError> {
    let _peak = crate::budget::track(match &op {
        Op::SnapshotCreate(_) => "snapshot_create",
        Op::Rollback(_) => "rollback",
        Op::Diff(_) => "diff",
        Op::Checkpoint => "checkpoint",
    });
    let r = match op {
        Op::SnapshotCreate(c) => create(w, &c),
        Op::Rollback(r) => rollback(w, &r),
        Op::Diff(d) => diff(w, &d),
        Op::Checkpoint => checkpoint(w),
    };
    // A large workspace's tree is not kept between operations (history::max_tree_records),
    // nor any while keel is near its memory budget.
    if w.history.as_ref().is_some_and(|h| {
        !h.worth_keeping()
            || crate::budget::pressure(
                "the snapshot history is dropped (diffs and rollbacks read the snapshots instead)",
            )
    }) {
        w.history = None;
        crate::sys::mem::release_free_heap();
    }
    r
}

/// The worker's history at `seq` (the last checkpoint), loaded (one chain decode) when it
/// is not there yet or no longer follows the checkpoints.
fn history_at(w: &mut Worker, seq: u64) -> Result<&History, AgentError> {
    if w.history.as_ref().is_none_or(|h| h.seq() != seq) {
        let h = History::load(w.p.repo(), seq)?;
        w.history = Some(h);
    }
    Ok(w.history.as_ref().expect("set above"))
}

/// The worker's history at `current` (`history_at`), made when it is not there by loading
/// `target`'s tree and advancing it along the snapshots to `current` when `target` is older
/// and on the same line: then `target` is in the window and a rollback holds one tree and
/// the changes, not the current tree and the target's.
fn history_seeing(w: &mut Worker, current: u64, target: u64) -> Result<(), AgentError> {
    if w.history.as_ref().is_some_and(|h| h.seq() == current) || target >= current {
        return history_at(w, current).map(|_| ());
    }
    let near = current - target <= super::history::MAX_ALONG;
    if let Some(mut h) = near
        .then(|| History::load(w.p.repo(), target).ok())
        .flatten()
    {
        let repo = w.p.repo();
        // Every step must keep `target` in the window, or the walk is for nothing.
        if (target + 1..=current)
            .all(|s| matches!(h.advance_any(repo, s), Ok(true)) && h.has(target))
        {
            w.history = Some(h);
            return Ok(());
        }
    }
    history_at(w, current).map(|_| ())
}

/// Whether the worker keeps (or would keep, by its header's inode count) the history at
/// `seq`: past `history::max_tree_records` an operation decodes only the trees it needs,
/// since loading the history there would cost a whole tree for nothing kept.
fn keeps_history(w: &Worker, seq: u64) -> Result<bool, AgentError> {
    if w.history.as_ref().is_some_and(|h| h.seq() == seq) {
        return Ok(true);
    }
    let h =
        w.p.repo()
            .read_header(seq)
            .map_err(|source| AgentError::LoadSnapshot { seq, source })?;
    Ok(History::would_keep(h.inodes))
}

/// A snapshot outside the history, decoded from its chain.
fn load(repo: &Repo, seq: u64) -> Result<Tree, AgentError> {
    repo.load_tree(seq)
        .map(|(t, _)| t)
        .map_err(|source| AgentError::LoadSnapshot { seq, source })
}

fn diff(w: &mut Worker, req: &Diff) -> Result<serde_json::Value, AgentError> {
    let t0 = Instant::now();
    let (repo, from, to, head) = diff_sides(w, req)?;
    let mut changes = Vec::new();
    let (how, t_hist) = diff_each(w, &repo, (from, to, head), 0, t0, &mut |c| {
        changes.push(c.clone());
        Ok(())
    })?;
    let d = super::diff::Diff { from, to, changes };
    Ok(diff_json(&d, how, t0, t_hist))
}

/// `keel diff` and `GET /diff` written to `out` as the changes are found (text, or JSON
/// with `trees` and `duration_ms` at its end): keel holds no more of the answer than a
/// change. More than `limit` changed entries (0: no limit) is an error before anything is
/// written, as is every other failure; a writer that fails (the client gone) ends it.
pub(super) fn diff_to(
    w: &mut Worker,
    req: &Diff,
    format: super::diff::Format,
    limit: u64,
    out: &mut dyn std::io::Write,
) -> Result<(), AgentError> {
    let t0 = Instant::now();
    let (repo, from, to, head) = diff_sides(w, req)?;
    let mut answer = super::diff::Answer::new(out, format, from, to);
    let (how, _) = diff_each(w, &repo, (from, to, head), limit, t0, &mut |c| {
        answer.change(c)
    })?;
    answer
        .finish(&[("trees", how.into()), ("duration_ms", ms(t0).into())])
        .map_err(AgentError::Diff)?;
    Ok(())
}

/// The remote and the two snapshots of a diff (and the last checkpoint), the live
/// workspace checkpointed first when `to` is not given.
fn diff_sides(w: &mut Worker, req: &Diff) -> Result<(Repo, u64, u64, u64), AgentError> {
    let repo = w.p.repo().clone();
    if req.to.is_none() {
        if !w.paused {
            sync_kernel(w);
        }
        w.checkpoint(CheckpointOptions::default(), !w.paused)
            .map_err(|e| AgentError::Checkpoint(Box::new(e)))?;
    }
    let resolve = |what: &str| snapshots::resolve(&repo, what).map_err(AgentError::ResolveSnapshot);
    let from = resolve(&req.from)?;
    let to = resolve(req.to.as_deref().unwrap_or("head"))?;
    let head = last_seq(w)?.ok_or(AgentError::NoSnapshot("the workspace has no snapshot yet"))?;
    Ok((repo, from, to, head))
}

/// Hands each change from `from` to `to` to `out`; returns how the trees were got and when
/// (ms after `t0`) they were there.
fn diff_each(
    w: &mut Worker,
    repo: &Repo,
    (from, to, head): (u64, u64, u64),
    limit: u64,
    t0: Instant,
    out: &mut dyn FnMut(&super::diff::Change) -> Result<(), super::diff::DiffError>,
) -> Result<(&'static str, f64), AgentError> {
    if !keeps_history(w, head)? {
        // A large workspace: as a stopped one is compared (`diff::diff_how`: the parts of
        // the trees the snapshots between touched, else one tree advanced along them, else
        // both decoded), with no history tree beside them.
        let how = super::diff::diff_how_each(repo, from, to, limit, out).map_err(AgentError::Diff);
        // The trees are gone: give their pages back (RSS stayed at the peak before).
        crate::sys::mem::release_free_heap();
        return Ok((how?, ms(t0)));
    }
    let h = history_at(w, head)?;
    let t_hist = ms(t0);
    let how = match (h.view(from), h.view(to), h.changed(from, to)) {
        (Some(a), Some(b), Some(c)) => {
            super::diff::diff_views_each(&a, &b, &c, limit, out).map_err(AgentError::Diff)?;
            "history"
        }
        (a, b, _) => {
            let ta = match a {
                Some(v) => v.to_tree(),
                None => load(repo, from)?,
            };
            let tb = match b {
                Some(v) => v.to_tree(),
                None => load(repo, to)?,
            };
            super::diff::diff_trees_each(&ta, &tb, limit, out).map_err(AgentError::Diff)?;
            "decoded"
        }
    };
    Ok((how, t_hist))
}

/// The answer to a diff: its text, the changes, and how keel got them (`how`: from the
/// history, the parts of the trees the snapshots between touched, along the snapshots
/// between them, or from decoded trees, for programs that measure; the changes are the
/// same).
fn diff_json(d: &super::diff::Diff, how: &str, t0: Instant, t_hist: f64) -> serde_json::Value {
    let text = super::diff::render(d);
    let mut v = serde_json::to_value(d).expect("diff serialises");
    v["trees"] = how.into();
    v["duration_ms"] = ms(t0).into();
    serde_json::json!({
        "text": text,
        "diff": v,
        "history_ms": t_hist,
    })
}

/// Pushes what the kernel holds in its writeback cache for the mount into keel, so that
/// a write made before the request (the file still open, never fsynced) is part of it. The
/// `syncfs` runs on a thread of its own: the kernel turns it into FUSE writes that the
/// session's threads serve while the worker waits; should one of them wait on the worker
/// (`fsync = "remote"`), the worker goes on after `KERNEL_SYNC_WAIT` with what keel has
/// rather than deadlock.
fn sync_kernel(w: &Worker) {
    let mp = w.mount_point.clone();
    if mp.as_os_str().is_empty() {
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("keel-syncfs".into())
        .spawn(move || {
            let _ = tx.send(crate::sys::file::syncfs(&mp));
        });
    if spawned.is_err() {
        tracing::warn!("syncfs of the mount: no thread; going on with what keel has");
        return;
    }
    match rx.recv_timeout(KERNEL_SYNC_WAIT) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "syncfs of the mount failed; going on with what keel has"),
        Err(_) => tracing::warn!("syncfs of the mount still runs after {KERNEL_SYNC_WAIT:?}; going on with what keel has"),
    }
}

/// How long an agent operation waits for the kernel's writeback (`sync_kernel`).
const KERNEL_SYNC_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

fn checkpoint(w: &mut Worker) -> Result<serde_json::Value, AgentError> {
    let t0 = Instant::now();
    if !w.paused {
        sync_kernel(w);
    }
    let r = w
        .checkpoint(CheckpointOptions::default(), !w.paused)
        .map_err(|e| AgentError::Checkpoint(Box::new(e)))?;
    let seq = match r.seq {
        Some(s) => s,
        None => last_seq(w)?.ok_or(AgentError::NoSnapshot(
            "the workspace has no snapshot and nothing to checkpoint",
        ))?,
    };
    Ok(serde_json::json!({
        "id": seq,
        "new_snapshot": r.seq.is_some(),
        "checkpoint": r.to_string(),
        "duration_ms": ms(t0),
    }))
}

fn create(w: &mut Worker, c: &SnapshotCreate) -> Result<serde_json::Value, AgentError> {
    let t0 = Instant::now();
    if let Some(n) = &c.name {
        snapshots::check_name(n).map_err(AgentError::CheckName)?;
    }
    if !w.paused {
        sync_kernel(w);
    }
    // A named snapshot is what diffs and rollbacks name: from the first one on, the worker
    // keeps the history (one chain decode, here), so that this one and the one before are
    // in it.
    // A large workspace's history is not kept (`keeps_history`): none is loaded.
    if let Some(seq) = last_seq(w)? {
        if keeps_history(w, seq)? {
            history_at(w, seq)?;
        }
    }
    let rss_history = crate::sys::mem::rss_mib();
    let r = w
        .checkpoint(CheckpointOptions::default(), !w.paused)
        .map_err(|e| AgentError::Checkpoint(Box::new(e)))?;
    let seq = match r.seq {
        Some(s) => s,
        None => last_seq(w)?.ok_or(AgentError::NoSnapshot(
            "the workspace has no snapshot and nothing to checkpoint",
        ))?,
    };
    if w.history.is_none() && keeps_history(w, seq)? {
        // The workspace's first snapshot: the history starts at it.
        history_at(w, seq)?;
    }
    let repo = w.p.repo().clone();
    let rec = snapshots::record(&repo, seq, c.name.as_deref(), &c.message, now_ns())
        .map_err(AgentError::RecordSnapshot)?;
    Ok(serde_json::json!({
        "id": seq,
        "name": rec.name,
        "message": rec.message,
        "new_snapshot": r.seq.is_some(),
        "checkpoint": r.to_string(),
        "duration_ms": ms(t0),
        // keel's memory (MiB, now / peak so far) after the history step and at the end,
        // for programs that measure.
        "rss_mib": {
            "history": rss_history,
            "end": crate::sys::mem::rss_mib(),
        },
    }))
}

/// Why `rollback --restart` is refused under `keel mount`.
pub const NO_MAIN: &str = "--restart needs keel run: keel mount supervises no command";

fn rollback(w: &mut Worker, req: &Rollback) -> Result<serde_json::Value, AgentError> {
    let t0 = Instant::now();
    if w.live.is_none() {
        return Err(AgentError::NotMounted);
    }
    let repo = w.p.repo().clone();
    let target = snapshots::resolve(&repo, &req.to).map_err(AgentError::ResolveSnapshot)?;
    let restart = req
        .restart
        .unwrap_or(w.rollback_restarts && w.main.is_some());
    if !restart {
        return rollback_to(w, target, t0);
    }
    let Some(main) = w.main.clone() else {
        return Err(AgentError::NoMain);
    };
    main.stop()?;
    let stopped_ms = ms(t0);
    let r = rollback_to(w, target, t0);
    // Started again whether the rollback worked or not.
    let started = main.start();
    let mut v = r?;
    started?;
    v["main_stopped_ms"] = stopped_ms.into();
    v["restarted"] = true.into();
    v["duration_ms"] = ms(t0).into();
    Ok(v)
}

fn rollback_to(w: &mut Worker, target: u64, t0: Instant) -> Result<serde_json::Value, AgentError> {
    let op = crate::logging::Op::start("rollback");
    let repo = w.p.repo().clone();
    if !w.paused {
        sync_kernel(w);
    }
    let before = w
        .checkpoint(CheckpointOptions::default(), true)
        .map_err(|e| AgentError::Checkpoint(Box::new(e)))?;
    let current = match before.seq {
        Some(s) => s,
        None => last_seq(w)?.ok_or(AgentError::NoSnapshot("the workspace has no snapshot yet"))?,
    };
    let t_ckpt = ms(t0);
    // Named until the rollback is done and its undo named, so that no gc (the checkpoint
    // after it, or one making room on the volume) takes the state before it meanwhile.
    op.step("pin");
    let pin = format!("rollback-from-{current}");
    snapshots::record(
        &repo,
        current,
        Some(&pin),
        &format!("the workspace before a rollback to snapshot {target} that has not finished"),
        now_ns(),
    )
    .map_err(AgentError::RecordSnapshot)?;
    let (mut answer, undo) = roll_and_checkpoint(w, &repo, current, target, &op).map_err(|e| {
        AgentError::Unfinished {
            seq: current,
            pin: pin.clone(),
            source: Box::new(e),
        }
    })?;
    op.step("unpin");
    if let Err(e) = snapshots::delete(&repo, &pin) {
        tracing::warn!(error = %e, name = %pin, "rollback: cannot drop the name it held");
    }
    answer["undo"] = undo.into();
    answer["checkpoint_before_ms"] = t_ckpt.into();
    answer["duration_ms"] = ms(t0).into();
    Ok(answer)
}

/// The rollback itself, from `current` (checkpointed, pinned) to `target`, then the
/// checkpoint that makes the result a snapshot and the name of its undo. Returns the answer
/// and that name (`current`'s id when nothing changed: the workspace is as it was, and a
/// `before-rollback-N` name would take N's from the rollback that made N).
fn roll_and_checkpoint(
    w: &mut Worker,
    repo: &super::repo::Repo,
    current: u64,
    target: u64,
    op: &crate::logging::Op,
) -> Result<(serde_json::Value, String), AgentError> {
    op.step("load");
    let t1 = Instant::now();
    // The history when it already sees both; else the parts of the two trees that can
    // differ (`diff::sparse`: what the deltas between them touch, or across a full snapshot
    // also what differs between the two full snapshots), rather than a history loaded for
    // it (a whole tree, the whole workspace's on a large one); else the history made to see
    // the target, or with the target decoded.
    let seen = w
        .history
        .as_ref()
        .is_some_and(|h| h.seq() == current && h.has(target));
    let sparse = if seen {
        None
    } else {
        super::diff::sparse(repo, current, target).map_err(AgentError::Diff)?
    };
    let decoded;
    let (cur, tgt, changed, how) = match &sparse {
        Some(s) => (View::of(&s.from), View::of(&s.to), s.changed.clone(), s.how),
        None => {
            history_seeing(w, current, target)?;
            let h = w.history.as_ref().expect("loaded above");
            match (h.view(target), h.changed(current, target)) {
                (Some(v), Some(c)) => (View::of(h.tree()), v, c, "history"),
                _ => {
                    decoded = load(repo, target)?;
                    let c = Changed::between(h.tree(), &decoded);
                    (View::of(h.tree()), View::of(&decoded), c, "decoded")
                }
            }
        }
    };
    let t_load = ms(t1);
    let t2 = Instant::now();
    op.step("apply");
    let live = w.live.as_ref().expect("checked above");
    let detail = live
        .roll_back(repo, &cur, &tgt, &changed, sparse.as_ref())
        .map_err(AgentError::Apply)?;
    drop((cur, tgt));
    drop(sparse);
    // What the trees held goes back to the system (RSS stays at the peak otherwise).
    crate::sys::mem::release_free_heap();
    let t_apply = ms(t2);
    op.step("checkpoint_after");
    let t3 = Instant::now();
    let after = w
        .checkpoint(CheckpointOptions::default(), false)
        .map_err(|e| AgentError::Checkpoint(Box::new(e)))?;
    let new = after.seq.unwrap_or(current);
    let undo = if new == current {
        current.to_string()
    } else {
        op.step("name_undo");
        let undo = format!("before-rollback-{new}");
        snapshots::record(
            repo,
            current,
            Some(&undo),
            &format!("the workspace before the rollback to snapshot {target}"),
            now_ns(),
        )
        .map_err(AgentError::RecordSnapshot)?;
        undo
    };
    let answer = serde_json::json!({
        "from": current,
        "to": target,
        "snapshot": new,
        "applied": detail,
        "load_trees_ms": t_load,
        "trees": how,
        "apply_ms": t_apply,
        "checkpoint_after_ms": ms(t3),
    });
    Ok((answer, undo))
}

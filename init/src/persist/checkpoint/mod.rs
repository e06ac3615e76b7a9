//! Checkpoints: claim the change set → hash the dirty chunk windows of file bodies (only
//! those, plus windows never hashed) → upload the chunks the remote lacks → write a
//! snapshot (a delta, or a full one every `compact_every` deltas) → advance the head →
//! record the new chunk maps locally.
//!
//! Crash safety: the claimed change set lives in the `pending_*` tables until the local
//! commit at the very end, so a checkpoint that fails or is killed at any point is redone
//! by the next one (uploads are idempotent: chunks are content-addressed, snapshots are
//! created under a fresh sequence number). On the remote, chunks are made durable before
//! the snapshot that names them, and the snapshot before the head that points at it.
//!
//! Writes the filesystem made but had not recorded when keel was killed are found at the
//! next start (`recover_unrecorded_writes`): any body modified after the last point where
//! every write was known to be recorded is re-hashed whole.

mod foreign;
mod steps;
#[cfg(test)]
mod tests;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use self::steps::Pass;
use super::format;
use super::lease::LeaseHandle;
use super::remote::RemoteError;
use super::repo::{Repo, RepoError};
use crate::chunk::chunker::{window_count, window_range};
use crate::chunk::BodyStore;
use crate::meta::{InodeNo, Kind, MetaError, Nanos, Storage, Store, Tx};
use crate::time::now_ns;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("state database: {0}")]
    Meta(#[from] MetaError),
    #[error("open state dir {path}: {reason}")]
    OpenState { path: PathBuf, reason: String },
    #[error("read body of inode {ino}: {source}")]
    ReadBody { ino: u64, source: std::io::Error },
    #[error("upload chunks: {0}")]
    UploadChunks(RemoteError),
    #[error("write snapshot {seq}: {source}")]
    WriteSnapshot { seq: u64, source: RemoteError },
    #[error("advance head to snapshot {seq}: {source}")]
    AdvanceHead { seq: u64, source: RepoError },
    #[error("read remote head: {0}")]
    ReadHead(RepoError),
    #[error("remote manifest: {0}")]
    Manifest(RepoError),
    #[error("make uploads durable: {0}")]
    FlushRemote(RemoteError),
    #[error("encode snapshot: {0}")]
    Encode(#[from] format::FormatError),
    #[error("{windows} windows of lazily restored files are not fetched yet and cannot be carried over ({why}); read those files (or set [persist] prefetch = true) before checkpointing")]
    LazyIncomplete { windows: u64, why: &'static str },
    #[error("deadline passed after {done} of {total} chunk windows")]
    Deadline { done: usize, total: usize },
    #[error("{0}")]
    Lease(#[from] super::lease::LeaseError),
    #[error("look for the snapshot the remote's head names: {0}")]
    FindForeignHead(RemoteError),
    #[error("keep the remote's head, which another writer made: {0}")]
    KeepForeignHead(Box<super::snapshots::SnapshotsError>),
    /// A sharing gc may have taken chunks this checkpoint uploaded: redone by the next one.
    #[error("{0}")]
    InFlightLapsed(#[from] super::marker::Lapsed),
}

/// What one checkpoint did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointReport {
    /// `None` when there was nothing to checkpoint.
    pub seq: Option<u64>,
    pub full: bool,
    pub inodes: u64,
    pub windows_hashed: u64,
    pub bytes_hashed: u64,
    pub chunks_uploaded: u64,
    pub chunk_bytes_uploaded: u64,
    /// Chunks the remote already had but the last checkpoint's chunk maps did not name:
    /// rewritten or touched (fresh age) so that no gc deletes them meanwhile.
    pub chunks_refreshed: u64,
    /// Chunks uploaded inside packs (counted in `chunks_uploaded` too), and the packs.
    pub packed_chunks: u64,
    pub packs_uploaded: u64,
    pub snapshot_bytes: u64,
    /// Passes of hashing and uploading (each at most the memory budget's `hash_batch`).
    pub batches: u64,
    pub elapsed: Duration,
}

impl std::fmt::Display for CheckpointReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.seq {
            None => write!(f, "nothing changed since the last checkpoint"),
            Some(s) => write!(
                f,
                "snapshot {s} ({}): {} inodes changed, {} windows / {} bytes hashed, {} chunks / {} bytes uploaded{}{}, snapshot {} bytes, {:.3}s{}",
                if self.full { "full" } else { "delta" },
                self.inodes,
                self.windows_hashed,
                self.bytes_hashed,
                self.chunks_uploaded,
                self.chunk_bytes_uploaded,
                match self.packs_uploaded {
                    0 => String::new(),
                    n => format!(" ({} of them in {n} packs)", self.packed_chunks),
                },
                match self.chunks_refreshed {
                    0 => String::new(),
                    n => format!(" ({n} already there, refreshed)"),
                },
                self.snapshot_bytes,
                self.elapsed.as_secs_f64(),
                match self.batches {
                    0 | 1 => String::new(),
                    n => format!(" in {n} batches"),
                }
            ),
        }
    }
}

/// What has not reached the remote yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Inodes (files, directories, links...) with changes not in any snapshot.
    pub inodes: u64,
    /// Regular files among them whose bytes changed.
    pub files: u64,
    /// File bytes in changed chunk windows (and changed inline files).
    pub bytes: u64,
}

impl std::fmt::Display for Backlog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} files / {} bytes of file data ({} changed inodes) did not reach the remote",
            self.files, self.bytes, self.inodes
        )
    }
}

/// Knobs of one checkpoint.
#[derive(Debug, Clone, Default)]
pub struct CheckpointOptions {
    /// Give up (leaving everything pending for the next checkpoint) after this instant.
    pub deadline: Option<Instant>,
    /// Write a full snapshot even if a delta would do.
    pub full: bool,
    /// When every write before this time was known to be recorded in the store (the
    /// caller flushed the filesystem); default: the start of the checkpoint.
    pub synced_at: Option<Nanos>,
}

/// Tunables that come from the config.
#[derive(Debug, Clone)]
pub struct PersistParams {
    pub chunk_size: u64,
    pub compact_every: u32,
    pub threads: usize,
    /// Chunks smaller than this are uploaded in packs (0: none are; see `persist::pack`).
    pub pack_below: u64,
    /// Bytes of chunks per pack.
    pub pack_size: u64,
}

/// Body modification times are coarse: rescan bodies modified this close to the point.
const MTIME_SLACK_NS: i64 = 2_000_000_000;

/// Opens a file's bytes by inode number, for a workspace that does not keep them in the
/// state dir's bodies (the `dir` provider's tree). An error fails the checkpoint.
pub type BodyOpener = std::sync::Arc<dyn Fn(u64) -> std::io::Result<std::fs::File> + Send + Sync>;

/// Checkpoints one state dir to one remote. Holds its own connection to the state
/// database, so it runs alongside a mounted filesystem.
pub struct Persister {
    pub(crate) store: Store,
    pub(crate) bodies: BodyStore,
    pub(crate) repo: Repo,
    pub(crate) params: PersistParams,
    recovered: bool,
    /// The single-writer lease that fences every head write (`None`: no lease).
    lease: Option<LeaseHandle>,
    /// Where file bytes are read from when not from `bodies` (see [`BodyOpener`]).
    pub(crate) opener: Option<BodyOpener>,
    state_dir: PathBuf,
}

fn kv_u64(tx: &Tx<'_>, k: &str) -> Result<Option<u64>, MetaError> {
    Ok(tx.persist_get(k)?.and_then(|v| v.parse().ok()))
}

fn kv_i64(tx: &Tx<'_>, k: &str) -> Result<Option<i64>, MetaError> {
    Ok(tx.persist_get(k)?.and_then(|v| v.parse().ok()))
}

impl Persister {
    pub fn open(
        state_dir: &Path,
        repo: Repo,
        params: PersistParams,
    ) -> Result<Persister, CheckpointError> {
        let bad = |reason: String| CheckpointError::OpenState {
            path: state_dir.to_path_buf(),
            reason,
        };
        if !crate::state::has_workspace(state_dir) {
            return Err(bad(format!(
                "no {}: not a keel state dir (mount it once first)",
                crate::state::META_DB
            )));
        }
        let store = crate::state::open_store(state_dir, Nanos(now_ns()))?;
        // The checkpointer walks the changes once per checkpoint, so a large cache would only
        // hold memory between checkpoints: the budget's `checkpoint_cache` share.
        store.limit_cache((crate::budget::shares().checkpoint_cache / 1024) as u32)?;
        let bodies = crate::state::open_bodies(state_dir).map_err(|e| bad(e.to_string()))?;
        Ok(Persister {
            store,
            bodies,
            repo,
            params,
            recovered: false,
            lease: None,
            opener: None,
            state_dir: state_dir.to_path_buf(),
        })
    }

    /// Fences every later checkpoint with `lease`: none starts unless it is held, and the
    /// head is written only after the remote confirmed it is still ours.
    pub fn set_lease(&mut self, lease: Option<LeaseHandle>) {
        self.lease = lease;
    }

    /// Reads file bytes through `opener` instead of the state dir's bodies.
    pub fn set_body_opener(&mut self, opener: Option<BodyOpener>) {
        self.opener = opener;
    }

    pub fn lease(&self) -> Option<&LeaseHandle> {
        self.lease.as_ref()
    }

    pub fn repo(&self) -> &Repo {
        &self.repo
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Records that the filesystem is running on this state dir (writes may not be
    /// recorded yet until it stops cleanly).
    pub fn mark_running(&mut self, running: bool) -> Result<(), CheckpointError> {
        if running {
            self.recover_unrecorded_writes()?;
        }
        let tx = self.store.write()?;
        if running {
            tx.persist_set("running", "1")?;
        } else {
            tx.persist_set("running", "0")?;
            tx.persist_set("clean_before", &now_ns().to_string())?;
        }
        tx.commit()?;
        if !running {
            self.store.sync()?;
        }
        Ok(())
    }

    /// After keel was killed while mounted: marks every body modified since the last
    /// point where all writes were recorded as wholly dirty. Returns how many.
    pub fn recover_unrecorded_writes(&mut self) -> Result<u64, CheckpointError> {
        if self.recovered {
            return Ok(0);
        }
        self.recovered = true;
        let (running, clean_before) = {
            let r = self.store.read();
            (
                r.persist_get("running")?,
                kv_i64(&r, "clean_before")?.unwrap_or(0),
            )
        };
        if running.as_deref() != Some("1") {
            return Ok(0);
        }
        let suspects = self.bodies_modified_since(clean_before - MTIME_SLACK_NS)?;
        let tx = self.store.write()?;
        for (ino, size) in &suspects {
            tx.mark_whole_file_dirty(*ino, window_count(*size, self.params.chunk_size))?;
        }
        tx.persist_set("running", "0")?;
        tx.commit()?;
        if !suspects.is_empty() {
            tracing::warn!(
                files = suspects.len(),
                "keel stopped without flushing: files modified just before will be re-hashed at the next checkpoint"
            );
        }
        Ok(suspects.len() as u64)
    }

    /// Body files (ino, size) whose mtime is at or after `since_ns`.
    pub(crate) fn bodies_modified_since(
        &self,
        since_ns: i64,
    ) -> Result<Vec<(InodeNo, u64)>, CheckpointError> {
        let mut out = Vec::new();
        let r = self.store.read();
        r.for_each_inode(|i| {
            if i.kind == Kind::File && i.storage == Storage::Body {
                if let Ok(m) = std::fs::metadata(self.bodies.path(i.ino.0)) {
                    let mt = m.mtime() * 1_000_000_000 + m.mtime_nsec();
                    if mt >= since_ns {
                        out.push((i.ino, i.size));
                    }
                }
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Is there anything a checkpoint would write?
    pub fn has_changes(&self) -> Result<bool, CheckpointError> {
        let r = self.store.read();
        Ok(!r.unclaimed_changes()?.is_empty()
            || !r.pending_changes()?.is_empty()
            || kv_u64(&r, "last_seq")?.is_none())
    }

    /// What has not reached the remote.
    pub fn backlog(&self) -> Result<Backlog, CheckpointError> {
        backlog(&self.store, self.params.chunk_size)
    }

    /// Takes a checkpoint (and counts it in the metrics).
    pub fn checkpoint(
        &mut self,
        opts: &CheckpointOptions,
    ) -> Result<CheckpointReport, CheckpointError> {
        let t0 = Instant::now();
        if self.opener.is_none() && self.store.is_dir_workspace()? {
            return Err(CheckpointError::OpenState {
                path: self.state_dir.clone(),
                reason: "it holds a dir workspace, whose files only the keel running on it walks and checkpoints (start keel on it, then keel checkpoint)".into(),
            });
        }
        let op = crate::logging::Op::start("checkpoint");
        let _peak = crate::budget::track("checkpoint");
        let r = self.take_checkpoint(opts, &op);
        let done = r.as_ref().ok();
        let outcome = done.map(|r| (r.seq.is_some(), r.chunks_uploaded, r.chunk_bytes_uploaded));
        super::metrics::checkpoint(outcome, t0.elapsed());
        r
    }

    /// The checkpoint itself, one named step after another (see `steps`). The change set
    /// stays claimed but pending until `record_locally` commits, so a failure at any step
    /// leaves it for the next checkpoint.
    fn take_checkpoint(
        &mut self,
        opts: &CheckpointOptions,
        op: &crate::logging::Op,
    ) -> Result<CheckpointReport, CheckpointError> {
        let t0 = Instant::now();
        if let Some(l) = &self.lease {
            l.check()?;
        }
        // No remote request of this checkpoint (retries included) outlives its deadline.
        let _deadline = super::retry::deadline_scope(opts.deadline);
        self.recover_unrecorded_writes()?;

        // 1. Claim the change set; decide between nothing, a delta and a full snapshot.
        op.step("claim");
        self.claim_changes(opts.synced_at.unwrap_or(Nanos(now_ns())))?;
        let mut prior = self.read_prior()?;
        if !steps::wants_full(&prior, opts.full, &self.params)
            && self.store.read().pending_changes()?.is_empty()
        {
            return Ok(CheckpointReport {
                elapsed: t0.elapsed(),
                ..Default::default()
            });
        }
        op.step("read_head");
        let head = self.read_fenced_head()?;
        self.follow_foreign_head(&mut prior, head.as_ref().map(|h| &h.0))?;
        steps::lazy_windows_carry_over(&prior, self.params.chunk_size)?;
        self.void_stale_chunk_maps(&prior)?;
        let full = steps::wants_full(&prior, opts.full, &self.params)
            || steps::retries_image(&prior, opts.deadline.is_some());

        // 2. A consistent view of what changed.
        op.step("collect");
        let mut pass = Pass::new(prior, full, head);
        self.collect_changes(&mut pass)?;

        // 3. Hash the windows, upload the chunks the remote lacks.
        op.step("upload_chunks");
        pass.reuse_unfetched_windows();
        self.hash_and_upload(&mut pass, opts.deadline)?;
        pass.fill_chunk_maps(self.params.chunk_size);

        // 4. Upload the snapshot, after the chunks it names are durable. On a shared chunk
        // store, only while the in-flight marker kept them from the sharers' gc all along.
        if let Some(m) = &pass.in_flight {
            m.check()?;
        }
        op.step("upload_snapshot");
        let seq = self.upload_snapshot(&mut pass, opts.deadline)?;

        // 5. Advance the head, fenced by the lease; the marker goes once the head names
        // what it protected (or, at any failure, with the pass).
        op.step("advance_head");
        self.advance_head(&pass, seq)?;
        if let Some(m) = pass.in_flight.take() {
            if let Err(e) = m.finish() {
                tracing::warn!(error = %e, "cannot remove the checkpoint-in-flight marker; it runs out by itself");
            }
        }

        // 6. Record it locally: new chunk maps, pending set done.
        op.step("record_locally");
        self.record_locally(&pass, seq)?;
        let mut report = pass.report;
        report.seq = Some(seq);
        report.elapsed = t0.elapsed();
        tracing::info!(report = %report, "checkpoint");
        Ok(report)
    }
}

/// What has not reached the remote, from the change tracking tables: one pass over the
/// changed inodes in order, one lookup each (nothing kept per inode: a first checkpoint
/// after creating 1M files has 1M of them, and maps of them cost ~300 MiB).
pub fn backlog(store: &Store, chunk_size: u64) -> Result<Backlog, CheckpointError> {
    let view = store.read_view()?;
    let mut b = Backlog::default();
    view.for_each_backlog_inode(|ino, changed, windows| -> Result<(), CheckpointError> {
        let Some(i) = view.get(ino)? else {
            // Gone since: its deletion is the change (windows alone name nothing).
            b.inodes += u64::from(changed);
            return Ok(());
        };
        if !windows.is_empty() {
            b.inodes += 1;
            b.files += 1;
            for idx in windows {
                let r = window_range(*idx, i.size, chunk_size);
                b.bytes += r.end - r.start;
            }
        } else if changed {
            b.inodes += 1;
            if i.kind == Kind::File && i.storage == Storage::Inline {
                b.files += 1;
                b.bytes += i.size;
            }
        }
        Ok(())
    })?;
    Ok(b)
}

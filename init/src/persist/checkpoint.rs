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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use super::format::{self, Body, DataRec, DirentRec, Header, InodeRec};
use super::lease::LeaseHandle;
use super::remote::RemoteError;
use super::repo::{Head, Repo, RepoError};
use crate::chunk::chunker::{is_zero, window_count, window_range};
use crate::chunk::{BodyStore, ChunkId};
use crate::meta::{ChunkRow, Inode, InodeNo, Kind, MetaError, Nanos, Storage, Store, Tx};

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
    pub snapshot_bytes: u64,
    pub elapsed: Duration,
}

impl std::fmt::Display for CheckpointReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.seq {
            None => write!(f, "nothing changed since the last checkpoint"),
            Some(s) => write!(
                f,
                "snapshot {s} ({}): {} inodes changed, {} windows / {} bytes hashed, {} chunks / {} bytes uploaded{}, snapshot {} bytes, {:.3}s",
                if self.full { "full" } else { "delta" },
                self.inodes,
                self.windows_hashed,
                self.bytes_hashed,
                self.chunks_uploaded,
                self.chunk_bytes_uploaded,
                match self.chunks_refreshed {
                    0 => String::new(),
                    n => format!(" ({n} already there, refreshed)"),
                },
                self.snapshot_bytes,
                self.elapsed.as_secs_f64()
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
}

/// Bytes of windows hashed per batch (bounds memory while uploading: keel's peak RSS during
/// a checkpoint is about this plus the snapshot's trees).
const BATCH_BYTES: u64 = 32 << 20;
/// SQLite page cache of the checkpointer's connection, KiB: it walks the changes once per
/// checkpoint, so a large cache only holds memory between checkpoints.
const CHECKPOINT_CACHE_KIB: u32 = 4096;
/// Deltas may add up to the size of the last full snapshot (at least this) before the next
/// checkpoint compacts them into a full one.
const COMPACT_FLOOR: u64 = 256 << 10;
/// Body modification times are coarse: rescan bodies modified this close to the point.
const MTIME_SLACK_NS: i64 = 2_000_000_000;

pub fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

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
}

/// A hashed window: its id and bytes (`None` for an all-zero window).
type Hashed = (Option<ChunkId>, Option<Bytes>);

/// One window to hash.
struct Job {
    ino: InodeNo,
    idx: u64,
    range: std::ops::Range<u64>,
}

/// A file's part of a checkpoint.
struct FileWork {
    inode: Inode,
    /// The chunk map before this checkpoint.
    old: BTreeMap<u64, Option<[u8; 32]>>,
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
        if !state_dir.join("meta.db").exists() {
            return Err(bad(
                "no meta.db: not a keel state dir (mount it once first)".into(),
            ));
        }
        let store = Store::open(&state_dir.join("meta.db"), Nanos(now_ns()))?;
        store.limit_cache(CHECKPOINT_CACHE_KIB)?;
        let bodies = BodyStore::open(&state_dir.join("bodies")).map_err(|e| bad(e.to_string()))?;
        Ok(Persister {
            store,
            bodies,
            repo,
            params,
            recovered: false,
            lease: None,
        })
    }

    /// Fences every later checkpoint with `lease`: none starts unless it is held, and the
    /// head is written only after the remote confirmed it is still ours.
    pub fn set_lease(&mut self, lease: Option<LeaseHandle>) {
        self.lease = lease;
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
        let r = self.take_checkpoint(opts);
        let done = r.as_ref().ok();
        let outcome = done.map(|r| (r.seq.is_some(), r.chunks_uploaded, r.chunk_bytes_uploaded));
        super::metrics::checkpoint(outcome, t0.elapsed());
        r
    }

    fn take_checkpoint(
        &mut self,
        opts: &CheckpointOptions,
    ) -> Result<CheckpointReport, CheckpointError> {
        let t0 = Instant::now();
        if let Some(l) = &self.lease {
            l.check()?;
        }
        // No remote request of this checkpoint (retries included) outlives its deadline.
        let _deadline = super::retry::deadline_scope(opts.deadline);
        self.recover_unrecorded_writes()?;
        let synced_at = opts.synced_at.unwrap_or(Nanos(now_ns()));
        let cs = self.params.chunk_size;

        // 1. Claim the change set (it stays pending until step 6 commits).
        {
            let tx = self.store.write()?;
            tx.claim_changes()?;
            tx.persist_set("clean_before", &synced_at.0.to_string())?;
            tx.commit()?;
        }

        // Remote identity: a replaced or different remote cannot be trusted to hold the
        // chunks the local maps name.
        let manifest = self
            .repo
            .ensure_manifest(now_ns())
            .map_err(CheckpointError::Manifest)?;
        let (last_seq, trusted, deltas, delta_bytes, full_bytes, old_cs, base) = {
            let r = self.store.read();
            let remote_id = r.persist_get("remote_id")?;
            (
                kv_u64(&r, "last_seq")?,
                remote_id.as_deref() == Some(manifest.id.as_str()),
                kv_u64(&r, "deltas_since_full")?.unwrap_or(0),
                kv_u64(&r, "delta_bytes_since_full")?.unwrap_or(0),
                kv_u64(&r, "full_bytes")?.unwrap_or(0),
                kv_u64(&r, "chunk_size")?,
                kv_u64(&r, "base_seq")?,
            )
        };
        let missing = self.store.read().all_missing_windows()?;
        if !missing.is_empty() && (old_cs != Some(cs) || !trusted) {
            return Err(CheckpointError::LazyIncomplete {
                windows: missing.values().map(|v| v.len() as u64).sum(),
                why: if old_cs != Some(cs) {
                    "the chunk size changed"
                } else {
                    "the remote is not the one they were restored from"
                },
            });
        }
        if old_cs.is_some_and(|c| c != cs) || (!trusted && last_seq.is_some()) {
            // Windows changed size, or this remote is not the one the chunk maps were
            // uploaded to (a new remote, a restored state dir, a wiped bucket): every chunk
            // map is void, so every window is hashed and offered to the remote again
            // (chunks it already holds are not rewritten).
            let tx = self.store.write()?;
            tx.clear_file_chunks()?;
            tx.commit()?;
        }
        let pending = self.store.read().pending_changes()?;
        let full = opts.full
            || last_seq.is_none()
            || !trusted
            || old_cs != Some(cs)
            || deltas + 1 >= u64::from(self.params.compact_every)
            || delta_bytes > full_bytes.max(COMPACT_FLOOR);
        if pending.is_empty() && !full {
            return Ok(CheckpointReport {
                elapsed: t0.elapsed(),
                ..Default::default()
            });
        }
        let head = self.repo.read_head().map_err(CheckpointError::ReadHead)?;
        if let (Some(l), Some((h, _))) = (&self.lease, &head) {
            l.check_head_epoch(h.epoch)?;
        }

        // 2. A consistent view of what changed.
        let mut body = Body::default();
        let mut files: HashMap<InodeNo, FileWork> = HashMap::new();
        let mut jobs: Vec<Job> = Vec::new();
        let (inode_total, file_bytes) = {
            let view = self.store.read_view()?;
            let pwin = view.pending_windows()?;
            let mut win_by_ino: BTreeMap<InodeNo, BTreeSet<u64>> = BTreeMap::new();
            for (ino, idx) in pwin {
                win_by_ino.entry(ino).or_default().insert(idx);
            }
            let mut totals = (0u64, 0u64);
            if full {
                let xattrs = view.all_xattrs()?;
                let inline = view.all_inline_data()?;
                let links = view.all_symlinks()?;
                let mut maps = view.all_file_chunks()?;
                let mut inodes = Vec::new();
                view.for_each_inode(|i| {
                    inodes.push(i);
                    Ok(())
                })?;
                // Unlinked but still open: not part of the tree.
                for i in inodes.into_iter().filter(|i| i.nlink > 0) {
                    totals.0 += 1;
                    if i.kind == Kind::File {
                        totals.1 += i.size;
                    }
                    let x = xattrs.get(&i.ino).cloned().unwrap_or_default();
                    let data = self.data_of(
                        &i,
                        &inline,
                        &links,
                        &mut maps,
                        &win_by_ino,
                        &mut files,
                        &mut jobs,
                    );
                    body.inodes.push(rec_of(&i, x, data));
                }
                for (parent, d) in view.all_dirents()? {
                    body.dirents.push(DirentRec {
                        parent: parent.0,
                        name: d.name,
                        ino: d.ino.0,
                        kind: d.kind.mode_bits(),
                    });
                }
            } else {
                let mut touched: BTreeSet<InodeNo> = view.pending_inodes()?.into_iter().collect();
                touched.extend(win_by_ino.keys().copied());
                for ino in touched {
                    let Some(i) = view.get(ino)?.filter(|i| i.nlink > 0) else {
                        body.deleted.push(ino.0);
                        continue;
                    };
                    let x = view.xattrs_of(ino)?;
                    let mut inline = HashMap::new();
                    let mut links = HashMap::new();
                    let mut maps = HashMap::new();
                    match (i.kind, i.storage) {
                        (Kind::File, Storage::Inline) => {
                            inline.insert(ino, view.inline_data(ino)?);
                        }
                        (Kind::File, Storage::Body) => {
                            maps.insert(ino, view.file_chunks(ino)?);
                        }
                        (Kind::Symlink, _) => {
                            if let Some(t) = view.symlink_target(ino)? {
                                links.insert(ino, t);
                            }
                        }
                        _ => {}
                    }
                    let data = self.data_of(
                        &i,
                        &inline,
                        &links,
                        &mut maps,
                        &win_by_ino,
                        &mut files,
                        &mut jobs,
                    );
                    body.inodes.push(rec_of(&i, x, data));
                }
                for (parent, name) in view.pending_dirents()? {
                    match view.lookup(parent, &name)? {
                        Some(d) => body.dirents.push(DirentRec {
                            parent: parent.0,
                            name,
                            ino: d.ino.0,
                            kind: d.kind.mode_bits(),
                        }),
                        None => body.unlinked.push((parent.0, name)),
                    }
                }
                totals = view.live_totals()?;
            }
            totals
        };

        // 3. Hash the windows, upload what the remote lacks.
        let mut hashed: HashMap<InodeNo, Vec<ChunkRow>> = HashMap::new();
        // A window not fetched yet (lazy restore) holds its chunk by definition: every
        // change to it fetches it first. Never hash its sparse zeros.
        if !missing.is_empty() {
            jobs.retain(|j| {
                let id = missing
                    .get(&j.ino)
                    .and_then(|m| m.binary_search_by_key(&j.idx, |r| r.0).ok().map(|k| m[k].1));
                match id {
                    Some(id) => {
                        hashed.entry(j.ino).or_default().push((j.idx, Some(id)));
                        false
                    }
                    None => true,
                }
            });
        }
        let mut report = CheckpointReport {
            full,
            inodes: body.inodes.len() as u64,
            ..Default::default()
        };
        let mut seen: HashSet<ChunkId> = HashSet::new();
        let total = jobs.len();
        let mut done = 0usize;
        crate::progress::stage("windows hashed", Some(total as u64));
        // Whether reused chunks need a fresh age (asked once, at the first upload).
        let mut shared: Option<bool> = None;
        while done < total {
            if opts.deadline.is_some_and(|d| Instant::now() > d) {
                return Err(CheckpointError::Deadline { done, total });
            }
            let mut end = done;
            let mut bytes = 0;
            while end < total && (bytes < BATCH_BYTES || end == done) {
                bytes += jobs[end].range.end - jobs[end].range.start;
                end += 1;
            }
            let results = self.hash_batch(&jobs[done..end])?;
            let mut upload: Vec<(String, Bytes)> = Vec::new();
            for (job, (id, data)) in jobs[done..end].iter().zip(results) {
                report.windows_hashed += 1;
                report.bytes_hashed += job.range.end - job.range.start;
                hashed
                    .entry(job.ino)
                    .or_default()
                    .push((job.idx, id.map(|c| c.0)));
                // A chunk the local chunk maps name is in the last snapshot, which keeps it
                // on the remote. Any other may be there already but unreferenced (every
                // snapshot dropped it, on this workspace or on one sharing the store) and
                // old: on a shared store, the gc of another workspace may delete it before
                // the head names it again, so it is refreshed, not skipped. (This
                // workspace's own gc runs under its lease, never during a checkpoint.)
                if let (Some(id), Some(data)) = (id, data) {
                    if seen.insert(id) && !(trusted && self.store.read().has_chunk(&id.0)?) {
                        upload.push((self.repo.chunk_key(&id), data));
                    }
                }
            }
            if !upload.is_empty() {
                let sizes: Vec<u64> = upload.iter().map(|(_, d)| d.len() as u64).collect();
                let fresh = match shared {
                    Some(s) => s,
                    None => *shared.insert(
                        super::fork::store_is_shared(&self.repo)
                            .map_err(CheckpointError::Manifest)?,
                    ),
                };
                let remote = &self.repo.remote;
                let written = if fresh {
                    remote.put_many_fresh(upload)
                } else {
                    remote.put_many_absent(upload)
                }
                .map_err(CheckpointError::UploadChunks)?;
                for (w, n) in written.iter().zip(sizes) {
                    if *w {
                        report.chunks_uploaded += 1;
                        report.chunk_bytes_uploaded += n;
                    } else if fresh {
                        report.chunks_refreshed += 1;
                    }
                }
            }
            done = end;
            crate::progress::set(done as u64);
        }

        // Fill in the chunk maps of the snapshot.
        for rec in &mut body.inodes {
            let Some(fw) = files.get(&InodeNo(rec.ino)) else {
                continue;
            };
            let nwin = window_count(fw.inode.size, cs);
            let new: BTreeMap<u64, Option<[u8; 32]>> = hashed
                .get(&fw.inode.ino)
                .map(|v| v.iter().copied().collect())
                .unwrap_or_default();
            let complete = full || fw.old.is_empty();
            let patch: Vec<(u64, Option<[u8; 32]>)> = if complete {
                (0..nwin)
                    .map(|i| (i, new.get(&i).or_else(|| fw.old.get(&i)).copied().flatten()))
                    .collect()
            } else {
                new.iter()
                    .filter(|(i, id)| fw.old.get(i) != Some(id))
                    .map(|(i, id)| (*i, *id))
                    .collect()
            };
            rec.data = DataRec::Chunks { complete, patch };
        }

        // 4. Write the snapshot, after the chunks it names are durable.
        self.repo
            .remote
            .flush()
            .map_err(CheckpointError::FlushRemote)?;
        let mut seq = last_seq
            .unwrap_or(0)
            .max(head.as_ref().map(|h| h.0.seq).unwrap_or(0))
            + 1;
        // A full snapshot's metadata image, named in its header (see `image`); not under
        // a deadline (the stop's last checkpoint): building it takes seconds at 1M files.
        let image = (full && opts.deadline.is_none())
            .then(|| super::image::publish(&self.repo, &self.store, &body, cs))
            .flatten();
        let header = |seq| Header {
            format: format::FORMAT,
            seq,
            parent: if full { None } else { last_seq },
            base: if full { seq } else { base.unwrap_or(seq) },
            prev: last_seq,
            created_ns: now_ns(),
            chunk_size: cs,
            inodes: inode_total,
            file_bytes,
            image,
        };
        let mut data;
        loop {
            if opts.deadline.is_some_and(|d| Instant::now() > d) {
                return Err(CheckpointError::Deadline { done, total });
            }
            data = format::encode(&header(seq), &body)?;
            match self.repo.put_snapshot(seq, data.clone()) {
                Ok(()) => break,
                // Left behind by a checkpoint that died before recording it: skip the number.
                Err(RemoteError::AlreadyExists { .. }) => seq += 1,
                Err(source) => return Err(CheckpointError::WriteSnapshot { seq, source }),
            }
        }
        report.snapshot_bytes = data.len() as u64;
        self.repo
            .remote
            .flush()
            .map_err(CheckpointError::FlushRemote)?;

        // 5. Advance the head, fenced by the lease.
        let epoch = match &self.lease {
            Some(l) => l.check_remote()?,
            None => 0,
        };
        let new_head = Head {
            seq,
            created_ns: now_ns(),
            writer: writer_name(),
            epoch,
        };
        self.repo
            .write_head(&new_head, head.and_then(|h| h.1).or(None))
            .map_err(|source| CheckpointError::AdvanceHead { seq, source })?;
        self.repo
            .remote
            .flush()
            .map_err(CheckpointError::FlushRemote)?;

        // 6. Record it locally: new chunk maps, pending set done.
        let tx = self.store.write()?;
        for (ino, fw) in &files {
            if let Some(rows) = hashed.get(ino) {
                tx.set_file_chunks(*ino, rows)?;
            }
            tx.truncate_file_chunks(*ino, window_count(fw.inode.size, cs))?;
        }
        tx.clear_pending()?;
        tx.persist_set("last_seq", &seq.to_string())?;
        tx.persist_set("chunk_size", &cs.to_string())?;
        tx.persist_set("remote_id", &manifest.id)?;
        tx.persist_set("remote", &self.repo.describe())?;
        tx.persist_set("last_checkpoint_ns", &now_ns().to_string())?;
        if full {
            tx.persist_set("base_seq", &seq.to_string())?;
            tx.persist_set("deltas_since_full", "0")?;
            tx.persist_set("delta_bytes_since_full", "0")?;
            tx.persist_set("full_bytes", &data.len().to_string())?;
        } else {
            tx.persist_set("deltas_since_full", &(deltas + 1).to_string())?;
            tx.persist_set(
                "delta_bytes_since_full",
                &(delta_bytes + data.len() as u64).to_string(),
            )?;
        }
        tx.commit()?;
        report.seq = Some(seq);
        report.elapsed = t0.elapsed();
        tracing::info!(report = %report, "checkpoint");
        Ok(report)
    }

    /// The snapshot record of a file's data; queues the windows of a body that need
    /// hashing (dirty ones and ones never hashed).
    #[allow(clippy::too_many_arguments)]
    fn data_of(
        &self,
        i: &Inode,
        inline: &HashMap<InodeNo, Vec<u8>>,
        links: &HashMap<InodeNo, Vec<u8>>,
        maps: &mut HashMap<InodeNo, Vec<ChunkRow>>,
        dirty: &BTreeMap<InodeNo, BTreeSet<u64>>,
        files: &mut HashMap<InodeNo, FileWork>,
        jobs: &mut Vec<Job>,
    ) -> DataRec {
        match (i.kind, i.storage) {
            (Kind::File, Storage::Inline) => {
                let mut v = inline.get(&i.ino).cloned().unwrap_or_default();
                v.resize(i.size as usize, 0);
                DataRec::Inline(v)
            }
            (Kind::File, Storage::Body) => {
                let cs = self.params.chunk_size;
                let nwin = window_count(i.size, cs);
                let old: BTreeMap<u64, Option<[u8; 32]>> = maps
                    .remove(&i.ino)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|(x, _)| *x < nwin)
                    .collect();
                let empty = BTreeSet::new();
                let d = dirty.get(&i.ino).unwrap_or(&empty);
                for idx in 0..nwin {
                    if d.contains(&idx) || !old.contains_key(&idx) {
                        jobs.push(Job {
                            ino: i.ino,
                            idx,
                            range: window_range(idx, i.size, cs),
                        });
                    }
                }
                files.insert(
                    i.ino,
                    FileWork {
                        inode: i.clone(),
                        old,
                    },
                );
                // Filled in once the windows are hashed.
                DataRec::Chunks {
                    complete: false,
                    patch: Vec::new(),
                }
            }
            (Kind::Symlink, _) => DataRec::Symlink(links.get(&i.ino).cloned().unwrap_or_default()),
            _ => DataRec::None,
        }
    }

    /// Reads and hashes windows on several threads: (id, bytes) per job; `None` id for an
    /// all-zero window (no bytes kept).
    fn hash_batch(&self, jobs: &[Job]) -> Result<Vec<Hashed>, CheckpointError> {
        let next = AtomicUsize::new(0);
        let out: Mutex<Vec<Option<Hashed>>> = Mutex::new(vec![None; jobs.len()]);
        let err: Mutex<Option<CheckpointError>> = Mutex::new(None);
        let files: Mutex<HashMap<InodeNo, Option<Arc<File>>>> = Mutex::new(HashMap::new());
        let threads = self.params.threads.clamp(1, 16).min(jobs.len().max(1));
        let bodies = &self.bodies;
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= jobs.len() {
                        break;
                    }
                    let job = &jobs[k];
                    let f = {
                        let mut m = files.lock().unwrap();
                        m.entry(job.ino)
                            .or_insert_with(|| {
                                File::open(bodies.path(job.ino.0)).ok().map(Arc::new)
                            })
                            .clone()
                    };
                    // A window that is one hole in the body (sparse file) is all zeros:
                    // no need to read or hash it.
                    if let Some(f) = &f {
                        let hole = match crate::sys::file::seek_data_hole(f, job.range.start, true)
                        {
                            Ok(data_at) => data_at >= job.range.end,
                            Err(e) => e.raw_os_error() == Some(libc::ENXIO),
                        };
                        if hole {
                            out.lock().unwrap()[k] = Some((None, None));
                            continue;
                        }
                    }
                    let mut buf = vec![0u8; (job.range.end - job.range.start) as usize];
                    if let Some(f) = f {
                        let mut n = 0;
                        while n < buf.len() {
                            match f.read_at(&mut buf[n..], job.range.start + n as u64) {
                                // Shorter body: the rest reads as zeros (sparse tail).
                                Ok(0) => break,
                                Ok(r) => n += r,
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                Err(source) => {
                                    *err.lock().unwrap() = Some(CheckpointError::ReadBody {
                                        ino: job.ino.0,
                                        source,
                                    });
                                    return;
                                }
                            }
                        }
                    }
                    let r = if is_zero(&buf) {
                        (None, None)
                    } else {
                        let id = ChunkId::of(&buf);
                        (Some(id), Some(Bytes::from(buf)))
                    };
                    out.lock().unwrap()[k] = Some(r);
                });
            }
        });
        if let Some(e) = err.into_inner().unwrap() {
            return Err(e);
        }
        Ok(out
            .into_inner()
            .unwrap()
            .into_iter()
            .map(|r| r.expect("every job ran"))
            .collect())
    }
}

fn rec_of(i: &Inode, xattrs: Vec<(Vec<u8>, Vec<u8>)>, data: DataRec) -> InodeRec {
    InodeRec {
        ino: i.ino.0,
        mode: i.kind.mode_bits() | i.perm,
        uid: i.uid,
        gid: i.gid,
        nlink: i.nlink,
        size: i.size,
        atime: i.atime.0,
        mtime: i.mtime.0,
        ctime: i.ctime.0,
        rdev: i.rdev,
        parent: i.parent.0,
        xattrs,
        data,
    }
}

fn writer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}:{}", host.trim(), std::process::id())
}

/// What has not reached the remote, from the change tracking tables.
pub fn backlog(store: &Store, chunk_size: u64) -> Result<Backlog, CheckpointError> {
    let view = store.read_view()?;
    let mut b = Backlog::default();
    let inodes: BTreeSet<InodeNo> = view.backlog_inodes()?.into_iter().collect();
    let windows = view.backlog_windows()?;
    let mut files: BTreeSet<InodeNo> = BTreeSet::new();
    let mut sizes: HashMap<InodeNo, Option<Inode>> = HashMap::new();
    for (ino, idx) in &windows {
        let i = match sizes.get(ino) {
            Some(i) => i.clone(),
            None => {
                let i = view.get(*ino)?;
                sizes.insert(*ino, i.clone());
                i
            }
        };
        if let Some(i) = i {
            files.insert(*ino);
            let r = window_range(*idx, i.size, chunk_size);
            b.bytes += r.end - r.start;
        }
    }
    let mut all: BTreeSet<InodeNo> = inodes.clone();
    all.extend(files.iter().copied());
    for ino in &inodes {
        if files.contains(ino) {
            continue;
        }
        if let Some(i) = view.get(*ino)? {
            if i.kind == Kind::File && i.storage == Storage::Inline {
                files.insert(*ino);
                b.bytes += i.size;
            }
        }
    }
    b.inodes = all.len() as u64;
    b.files = files.len() as u64;
    Ok(b)
}

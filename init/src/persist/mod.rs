//! Durability beyond the local disk: checkpoints of the workspace to a remote object store
//! (content-addressed blake3 chunks shared by every snapshot, metadata snapshots as deltas
//! with periodic compaction, a head pointer), restore of any snapshot into an empty state
//! dir, garbage collection with snapshot retention, `fsck` of a state dir and its remote, and
//! the background service (periodic checkpoints, the checkpoints, snapshots, diffs and
//! rollbacks the control API asks of it through `CheckpointHandle`, the final checkpoint
//! at shutdown), and the single-writer lease that fences every head write; remote requests
//! retry temporary failures within the caller's deadline. Everything it keeps on disk (state
//! dir, `file://` remote) is private to keel's user: 0700 directories, 0600 files
//! (`state::private`).
//! Depends on `meta` and `chunk`, never on `workspace`.

pub mod agent;
pub mod agent_cmd;
pub mod checkpoint;
pub mod diff;
pub mod fork;
pub mod format;
pub mod fsck;
pub mod gc;
mod gc_packs;
pub mod history;
pub mod hydrate;
pub mod image;
pub mod lease;
pub mod marker;
pub mod metrics;
pub mod objstore;
pub mod ops;
pub mod pack;
pub mod readset;
pub mod remote;
pub mod repo;
pub mod restore;
pub mod retry;
pub mod service;
pub mod snapshots;

use std::path::Path;
use std::sync::Arc;

pub use checkpoint::{
    Backlog, CheckpointError, CheckpointOptions, CheckpointReport, PersistParams, Persister,
};
pub use remote::{Counted, FsRemote, MemRemote, Remote, RemoteError};
pub use repo::Repo;
pub use service::{CheckpointHandle, PersistState, Service};

use crate::config::{PersistConfig, WorkspaceConfig};
use crate::state::{self, private};

/// Opens the remote named by `url`: the store and the key prefix of the workspace in it.
pub fn open_remote(url: &str, cfg: &PersistConfig) -> Result<Repo, RemoteError> {
    if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(RemoteError::Open {
                url: url.into(),
                reason: "file:// needs an absolute path".into(),
            });
        }
        let r: Arc<dyn Remote> = Arc::new(FsRemote::open(Path::new(path))?);
        return Ok(Repo::new(r, ""));
    }
    let (scheme, rest) = url.split_once("://").ok_or_else(|| RemoteError::Open {
        url: url.into(),
        reason: "not a URL".into(),
    })?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let r: Arc<dyn Remote> = Arc::new(objstore::ObjectStoreRemote::open(
        &format!("{scheme}://{bucket}"),
        cfg,
    )?);
    Ok(Repo::new(r, prefix))
}

/// Makes the state dir private at start, and a local `file://` remote when it exists (one
/// that does not is created 0700 when first opened): created 0700, and tightened with one
/// log line each when an older keel or a volume driver left them with looser modes (see
/// [`state::private`]). A directory that does not look like keel's is left alone (a
/// state dir holding someone else's files is then refused by the mount, untouched).
pub fn secure_at_start(state_dir: &Path, cfg: Option<&PersistConfig>) -> std::io::Result<()> {
    state::secure(state_dir)?;
    if let Some(url) = cfg.and_then(|c| c.remote_url(state_dir)) {
        secure_remote(&url)?;
    }
    Ok(())
}

/// What marks a `file://` remote's root as keel's, and what one keel has not written much
/// to yet may hold.
const REMOTE_MARKERS: &[&str] = &["keel-workspace.json", "head", "lease"];
const REMOTE_FRESH: &[&str] = &["chunks", "snapshots", "forks", "names", ".tmp.*"];

/// Tightens the `file://` remote at `url` if it exists, is keel's, and its root is loose
/// (see [`private::secure_dir`]); other remotes are left alone.
pub fn secure_remote(url: &str) -> std::io::Result<()> {
    match url.strip_prefix("file://").map(Path::new) {
        Some(root)
            if root.is_absolute()
                && root.is_dir()
                && private::looks_like_keels(root, REMOTE_MARKERS, REMOTE_FRESH)? =>
        {
            private::secure_dir(root, "file:// remote").map(|_| ())
        }
        _ => Ok(()),
    }
}

/// Takes the single-writer lease of the workspace's remote (with its own connection, so
/// renewals never queue behind a checkpoint's uploads). `Ok(None)` when the lease is off
/// (`lease_ttl = "0s"`, no remote, or the default remote inside the state dir).
///
/// A live lease whose holder is the one this state dir recorded is reclaimed without a
/// takeover when no keel runs on the state dir: `state_locked` says the caller holds the
/// state dir's lock; otherwise the lock must be free.
pub fn acquire_lease(
    state_dir: &Path,
    cfg: &PersistConfig,
    state_locked: bool,
) -> Result<Option<lease::Lease>, lease::LeaseError> {
    if !cfg.lease_enabled() {
        return Ok(None);
    }
    let Some(url) = cfg.remote_url(state_dir) else {
        return Ok(None);
    };
    let repo = open_remote(&url, cfg).map_err(|source| lease::LeaseError::Open { url, source })?;
    acquire_recorded(
        state_dir,
        repo.remote.clone(),
        &repo.lease_key(),
        cfg,
        state_locked,
    )
    .map(Some)
}

/// Takes the lease `key` on `remote` with this state dir's holder id (`lease.holder`),
/// recorded *before* the remote sees it when the state dir exists: a keel killed between
/// the two writes (or whose write's reply was lost) leaves a live lease the next start here
/// recognises as its own, instead of one nobody can take before it expires. The id stays
/// the state dir's across starts. A state dir not there yet is made, and the id recorded,
/// only once the lease is taken. Another keel's state dir (its lock held) is left alone: a
/// fresh id, not recorded.
fn acquire_recorded(
    state_dir: &Path,
    remote: Arc<dyn remote::Remote>,
    key: &str,
    cfg: &PersistConfig,
    state_locked: bool,
) -> Result<lease::Lease, lease::LeaseError> {
    let previous = previous_holder(state_dir, state_locked);
    let reclaim = previous.as_ref().and_then(|p| p.id.clone());
    let holder = reclaim.clone().unwrap_or_else(lease::new_holder_id);
    let record = previous.is_some() && reclaim.is_none();
    // A state dir that is not there yet is made only once the lease is taken: a refused or
    // failed command leaves nothing behind (and no lease can carry an id before it exists).
    let exists = state_dir.is_dir();
    let warn = |e: std::io::Error| tracing::warn!(error = %e, "cannot record the lease holder in the state dir; after a crash the next start waits for the lease to expire");
    if record && exists {
        record_holder(state_dir, &holder).unwrap_or_else(warn);
    }
    let l = lease::Lease::acquire(
        remote,
        key,
        cfg.lease_ttl,
        cfg.takeover,
        reclaim.as_deref(),
        &holder,
    )?;
    if record && !exists {
        private::create_dir_all(state_dir)
            .and_then(|()| record_holder(state_dir, &holder))
            .unwrap_or_else(warn);
    }
    Ok(l)
}

/// Records a new holder id. Written once per state dir (its id is kept from then on), and
/// before any lease carries it: a kill mid-write leaves no id and no lease with it.
fn record_holder(state_dir: &Path, holder: &str) -> std::io::Result<()> {
    private::write(&state_dir.join(state::LEASE_HOLDER), holder.as_bytes())
}

/// How long a start on a state dir holding a workspace tries to reach the remote for the
/// lease before it starts with the lease pending.
const START_LEASE_BUDGET: std::time::Duration = std::time::Duration::from_secs(10);

/// `acquire_lease` for a start on a state dir that holds a workspace (the caller holds its
/// lock): when the remote does not answer, keel starts anyway with the lease pending
/// (`Lease::pending`) rather than not at all; its local workspace works and checkpoints
/// wait for the lease.
pub fn acquire_lease_at_start(
    state_dir: &Path,
    cfg: &PersistConfig,
) -> Result<Option<lease::Lease>, lease::LeaseError> {
    let has_workspace = state::has_workspace(state_dir);
    let r = {
        // A remote that does not answer should not keep a workspace that is here from
        // starting for the whole retry budget.
        let _d = retry::deadline_scope(
            has_workspace.then(|| std::time::Instant::now() + START_LEASE_BUDGET),
        );
        acquire_lease(state_dir, cfg, true)
    };
    match r {
        Err(e) if e.is_temporary() && has_workspace => {
            let Some(url) = cfg.remote_url(state_dir) else {
                return Err(e);
            };
            let repo =
                open_remote(&url, cfg).map_err(|source| lease::LeaseError::Open { url, source })?;
            let reclaim = previous_holder(state_dir, true).and_then(|p| p.id);
            let l = lease::Lease::pending(
                repo.remote.clone(),
                &repo.lease_key(),
                cfg.lease_ttl,
                cfg.takeover,
                reclaim.as_deref(),
                &e,
            );
            if reclaim.is_none() {
                if let Err(e) = record_holder(state_dir, &l.holder_id()) {
                    tracing::warn!(error = %e, "cannot record the lease holder in the state dir");
                }
            }
            Ok(Some(l))
        }
        r => r,
    }
}

/// This state dir's lease holder, when no other keel can be running on it (`None`: one
/// is, its id is not ours to use or change).
struct Previous {
    /// The id recorded by an earlier start, if any.
    id: Option<String>,
}

fn previous_holder(state_dir: &Path, state_locked: bool) -> Option<Previous> {
    if !state_locked {
        // Free now (dropped at once): whoever recorded the id is gone. (No state dir yet:
        // nobody runs on it either.)
        match state::try_lock(state_dir) {
            Ok(Some(_)) => {}
            Ok(None) => return None,
            Err(_) if !state_dir.join(state::LOCK).exists() => {}
            Err(_) => return None,
        }
    }
    let id = std::fs::read_to_string(state_dir.join(state::LEASE_HOLDER))
        .ok()
        .map(|id| id.trim().to_string())
        .filter(|id| !id.is_empty());
    Some(Previous { id })
}

/// Checkpoint parameters from the config.
pub fn params(ws: &WorkspaceConfig, p: &PersistConfig) -> PersistParams {
    PersistParams {
        chunk_size: ws.chunk_size,
        compact_every: p.compact_every,
        pack_below: p.pack_below,
        pack_size: p.pack_size,
        threads: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use remote::{MemRemote, ObjectInfo, PutMode, Remote, RemoteError, RemoteResult};

    /// A remote whose writes land but whose replies are lost: to the next start, the same
    /// as a keel killed right after its lease reached the remote.
    struct ReplyLost(Arc<MemRemote>);

    impl Remote for ReplyLost {
        fn describe(&self) -> String {
            self.0.describe()
        }
        fn get(&self, key: &str) -> RemoteResult<Bytes> {
            self.0.get(key)
        }
        fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> RemoteResult<Bytes> {
            self.0.get_range(key, range)
        }
        fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
            self.0.head(key)
        }
        fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>> {
            self.0.put(key, data, mode)?;
            Err(RemoteError::Temporary {
                op: "put",
                key: key.to_string(),
                reason: "injected: the reply was lost".into(),
            })
        }
        fn delete(&self, key: &str) -> RemoteResult<()> {
            self.0.delete(key)
        }
        fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>> {
            self.0.list(prefix)
        }
    }

    /// The soak's finding: a start killed after its lease write reached the remote but
    /// before it recorded the holder left a live lease the next start refused ("in use by
    /// another writer") until it expired. The id is recorded first now, so it reclaims.
    #[test]
    fn a_start_whose_lease_landed_unrecorded_is_followed_by_one_that_reclaims_it() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        std::fs::create_dir(&state).unwrap();
        let mem = Arc::new(MemRemote::new());
        let cfg = PersistConfig {
            lease_ttl: std::time::Duration::from_secs(600),
            ..Default::default()
        };
        for round in 1..=3u64 {
            let e = acquire_recorded(
                &state,
                Arc::new(ReplyLost(mem.clone())),
                "lease",
                &cfg,
                false,
            )
            .err()
            .expect("the reply was lost");
            assert!(e.is_temporary(), "{e}");
            let l = acquire_recorded(&state, mem.clone(), "lease", &cfg, false)
                .unwrap_or_else(|e| panic!("round {round}: the next start was refused: {e}"));
            assert_eq!(l.info().epoch, 2 * round, "each write is a new epoch");
            drop(l); // killed: never released, still live
        }
        // Another state dir is still refused while it is live.
        let other = d.path().join("other");
        let e = acquire_recorded(&other, mem.clone(), "lease", &cfg, false)
            .err()
            .expect("another state dir must not take a live lease");
        assert!(e.to_string().contains("in use by another writer"), "{e}");
        assert!(!other.exists(), "a refused command made its state dir");
    }
}

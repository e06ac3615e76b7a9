//! One-shot persistence operations for the command line on a stopped state dir, on a config
//! it has made: `keel checkpoint`, `gc`, `fsck`, `snapshot restore`, `fork`. Each locks the
//! state dir and works on it directly; a running keel is asked through its control API
//! instead (`control::agent_client` decides which, and asks it). Long work reports to
//! `crate::progress`.

use std::path::{Path, PathBuf};

use super::checkpoint::{CheckpointError, CheckpointOptions, Persister};
use super::fork::ForkError;
use super::fsck::{FsckError, FsckReport};
use super::gc::GcError;
use super::lease::LeaseError;
use super::restore::{RestoreError, RestoreReport};
use super::{gc, open_remote, params, restore, RemoteError, Repo};
use crate::config::Config;
use crate::meta::MetaError;
use crate::sys;

/// Why a one-shot persistence command failed. The messages are the one-liners the command
/// line prints after `keel: <command>: `; the steps' own errors print as they are.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("no remote configured ([persist] remote = \"none\")")]
    NoRemote,
    #[error("{0}")]
    OpenRemote(#[source] RemoteError),
    #[error("{}: {source}", path.display())]
    CreateStateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("lock {}: {source}", path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state dir {} is in use by a running keel (it did not answer on its control socket)", .0.display())]
    InUse(PathBuf),
    #[error("{0}")]
    OpenState(#[source] Box<CheckpointError>),
    #[error("{0}")]
    AcquireLease(#[source] LeaseError),
    #[error("start lease renewal: {0}")]
    StartRenewal(#[source] std::io::Error),
    /// The checkpoint failed; `backlog` is what stays local.
    #[error("{source}; {backlog}")]
    Checkpoint {
        #[source]
        source: Box<CheckpointError>,
        backlog: String,
    },
    #[error("{0}")]
    OpenStore(#[source] MetaError),
    #[error("{0}")]
    Gc(#[source] GcError),
    #[error("{0}")]
    Fsck(#[source] FsckError),
    #[error("--remote URL (or [persist] remote) is required: the default remote lives inside the state dir being restored")]
    RestoreNeedsRemote,
    #[error("{0}")]
    Restore(#[source] RestoreError),
    #[error("no source: pass --from URL or configure [persist] remote")]
    NoForkSource,
    #[error("{0}")]
    Fork(#[source] ForkError),
}

pub(super) fn repo_of(cfg: &Config) -> Result<Repo, OpsError> {
    let url = cfg
        .persist
        .remote_url(&cfg.workspace.state_dir)
        .ok_or(OpsError::NoRemote)?;
    open_remote(&url, &cfg.persist).map_err(OpsError::OpenRemote)
}

/// Locks a state dir that no running keel holds.
pub(super) fn lock_offline(state: &Path) -> Result<sys::file::LockFile, OpsError> {
    crate::state::private::create_dir_all(state).map_err(|source| OpsError::CreateStateDir {
        path: state.to_path_buf(),
        source,
    })?;
    crate::state::try_lock(state)
        .map_err(|source| OpsError::Lock {
            path: state.to_path_buf(),
            source,
        })?
        .ok_or_else(|| OpsError::InUse(state.to_path_buf()))
}

/// What a command printed and whether it succeeded.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub text: String,
    pub ok: bool,
}

/// `keel checkpoint [--full]` of a stopped state dir, as its one writer.
pub fn checkpoint_offline(cfg: &Config, full: bool) -> Result<Answer, OpsError> {
    with_offline_writer(cfg, |p| {
        match p.checkpoint(&CheckpointOptions {
            full,
            ..Default::default()
        }) {
            Ok(r) => Ok(Answer {
                text: r.to_string(),
                ok: true,
            }),
            Err(e) => {
                let backlog = p.backlog().map(|b| b.to_string()).unwrap_or_default();
                Err(OpsError::Checkpoint {
                    source: Box::new(e),
                    backlog,
                })
            }
        }
    })
}

/// Runs `f` on the persister of a stopped state dir as the workspace's one writer: the state
/// dir locked and the lease held (and renewed) until `f` returns, since the head may move.
/// `f`'s error type is the caller's, one that can say why the writer did not open.
pub(super) fn with_offline_writer<T, E: From<OpsError>>(
    cfg: &Config,
    f: impl FnOnce(&mut Persister) -> Result<T, E>,
) -> Result<T, E> {
    let state = &cfg.workspace.state_dir;
    let _lock = lock_offline(state)?;
    let mut p = Persister::open(state, repo_of(cfg)?, params(&cfg.workspace, &cfg.persist))
        .map_err(|e| OpsError::OpenState(Box::new(e)))?;
    let lease = renewed_lease(state, &cfg.persist)?;
    if let Some(l) = &lease {
        p.set_lease(Some(l.handle()));
    }
    let _lease = super::lease::ReleaseOnDrop::new(lease);
    f(&mut p)
}

/// The workspace's lease for an offline command on the locked `state` dir, renewed until
/// dropped (`None` when the remote needs none).
fn renewed_lease(
    state: &Path,
    persist: &crate::config::PersistConfig,
) -> Result<Option<super::lease::Lease>, OpsError> {
    let mut lease = super::acquire_lease(state, persist, true).map_err(OpsError::AcquireLease)?;
    if let Some(l) = lease.as_mut() {
        l.start_renewal().map_err(OpsError::StartRenewal)?;
    }
    Ok(lease)
}

/// `keel gc` of a stopped state dir's remote.
pub fn gc(cfg: &Config) -> Result<String, OpsError> {
    let state = &cfg.workspace.state_dir;
    let _lock = lock_offline(state)?;
    let mut repo = repo_of(cfg)?;
    // Under the workspace's lease, as the running keel's own gc is: a live writer may name
    // again any chunk the sweep finds unreferenced. Never taken over or waited for (whatever
    // `takeover` says for starts): a gc must not fence a live writer.
    let refuse = crate::config::PersistConfig {
        takeover: crate::config::Takeover::Refuse,
        ..cfg.persist.clone()
    };
    let _lease = super::lease::ReleaseOnDrop::new(renewed_lease(state, &refuse)?);
    let store = if crate::state::has_workspace(state) {
        Some(
            crate::state::open_store(state, crate::meta::Nanos(crate::time::now_ns()))
                .map_err(OpsError::OpenStore)?,
        )
    } else {
        None
    };
    let r = gc::gc_with(
        &mut repo,
        store.as_ref(),
        &gc::Retention::of(&cfg.persist),
        cfg.persist.gc_grace,
    )
    .map_err(OpsError::Gc)?;
    Ok(r.to_string())
}

/// What `keel fsck` checks besides the state dir.
#[derive(Debug, Default, Clone, Copy)]
pub struct FsckFlags {
    pub repair: bool,
    pub quick: bool,
    /// Do not check the remote the state dir checkpointed to.
    pub no_remote: bool,
}

/// `keel fsck` of a stopped state dir (and, unless `no_remote`, its remote).
pub fn fsck(cfg: &Config, flags: FsckFlags) -> Result<FsckReport, OpsError> {
    let state = &cfg.workspace.state_dir;
    let _lock = lock_offline(state)?;
    let url = cfg.persist.remote_url(state).filter(|_| !flags.no_remote);
    // A `file://` remote that is not there is reported, not opened (that would create it).
    let missing = url
        .as_deref()
        .and_then(|u| u.strip_prefix("file://"))
        .is_some_and(|p| !Path::new(p).exists());
    let (remote, missing_remote) = match url {
        Some(u) if missing => (None, Some(u)),
        Some(u) => (
            Some(open_remote(&u, &cfg.persist).map_err(OpsError::OpenRemote)?),
            None,
        ),
        None => (None, None),
    };
    let opts = super::fsck::FsckOptions {
        repair: flags.repair,
        quick: flags.quick,
        chunk_size: cfg.workspace.chunk_size,
        remote,
        missing_remote,
    };
    super::fsck::fsck(state, &opts).map_err(OpsError::Fsck)
}

/// `keel snapshot restore`: snapshot `seq` (default: the head) into the empty state dir.
pub fn snapshot_restore(cfg: &Config, seq: Option<u64>) -> Result<RestoreReport, OpsError> {
    let state = &cfg.workspace.state_dir;
    if cfg.persist.remote.is_empty() {
        return Err(OpsError::RestoreNeedsRemote);
    }
    let _lock = lock_offline(state)?;
    let mut repo = repo_of(cfg)?;
    restore::restore(&mut repo, seq, state).map_err(OpsError::Restore)
}

/// `keel fork --to URL [--from URL] [--seq N]`: a new workspace from a snapshot of the
/// source (default: the configured remote; a keel serving it here was asked to checkpoint
/// first, by `control::agent_client::fork`).
pub fn fork(
    cfg: &Config,
    to: &str,
    from: Option<&str>,
    seq: Option<u64>,
) -> Result<super::fork::ForkReport, OpsError> {
    let from = match from {
        Some(f) => f.to_string(),
        None => cfg
            .persist
            .remote_url(&cfg.workspace.state_dir)
            .ok_or(OpsError::NoForkSource)?,
    };
    let mut src = open_remote(&from, &cfg.persist).map_err(OpsError::OpenRemote)?;
    let mut dst = open_remote(to, &cfg.persist).map_err(OpsError::OpenRemote)?;
    super::fork::fork(&mut src, &mut dst, seq).map_err(OpsError::Fork)
}

/// `keel fork --delete URL`.
pub fn fork_delete(cfg: &Config, url: &str) -> Result<super::fork::DeleteReport, OpsError> {
    let mut repo = open_remote(url, &cfg.persist).map_err(OpsError::OpenRemote)?;
    super::fork::delete_fork(&mut repo).map_err(OpsError::Fork)
}

//! Mounting and unmounting the workspace: locks the state dir, opens the store, starts the
//! multi-threaded FUSE session, and on shutdown flushes and unmounts.

use std::path::{Path, PathBuf};

use crate::config::WorkspaceConfig;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("state dir {path}: already in use by another keel (lock held on {lock})")]
    StateLocked { path: PathBuf, lock: PathBuf },
    #[error("state dir {path}: {reason}")]
    OpenState { path: PathBuf, reason: String },
    #[error("mount {path}: {source}")]
    Mount { path: PathBuf, source: std::io::Error },
    #[error("flush: {0}")]
    Flush(String),
    #[error("unmount {path}: {source}")]
    Unmount { path: PathBuf, source: std::io::Error },
}

/// A mounted workspace. Dropping it without `unmount` still unmounts (best effort).
pub struct Mounted {
    mount_point: PathBuf,
}

/// Mounts the workspace described by `cfg` and returns once the kernel has accepted it.
pub fn mount(cfg: &WorkspaceConfig) -> Result<Mounted, SessionError> {
    Err(SessionError::Mount {
        path: cfg.mount_point.clone(),
        source: std::io::Error::other("not implemented yet"),
    })
}

impl Mounted {
    pub fn mount_point(&self) -> &Path {
        &self.mount_point
    }

    /// Makes every file whose close returned durable in the local store.
    pub fn flush(&self) -> Result<(), SessionError> {
        Ok(())
    }

    /// Flushes, then unmounts and waits for the FUSE workers to finish.
    pub fn unmount(self) -> Result<(), SessionError> {
        Ok(())
    }
}

//! The durable FUSE workspace: POSIX semantics in `fs` (no protocol types), the thin
//! `fuser::Filesystem` adapter from requests to `fs` in `fuse` (with the passthrough ids it
//! registered, `backing`), and locking the state dir,
//! mounting, serving (fuser's worker threads over `/dev/fuse`) and unmounting in `session`;
//! the change feed's journal in `feed` (appended to by `fs`, read by `GET /watch`).
//! Knows nothing of checkpoints: `boot` wires the persist service in (`session::Finisher`).

mod backing;
pub mod dir;
pub mod feed;
pub mod fs;
pub mod fuse;
pub mod metrics;
pub mod session;

pub use session::{
    lock_state, mount_locked, open_locked, Finisher, Invalidate, Mounted, MountedHandle, Opened,
    SessionError, StateLock,
};

//! The durable FUSE workspace: POSIX semantics in `fs` (no protocol types), the thin
//! `fuser::Filesystem` adapter from requests to `fs` in `fuse`, and mounting, serving
//! (fuser's worker threads over `/dev/fuse`) and unmounting in `session`.

pub mod cli;
pub mod fs;
pub mod fuse;
pub mod live;
pub mod metrics;
pub mod session;

pub use session::{mount, mount_persistent, Mounted, MountedHandle, SessionError};

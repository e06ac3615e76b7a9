//! The durable FUSE workspace: POSIX semantics in `fs` (no fuser types), the thin kernel
//! adapter in `fuse`, and mounting/unmounting in `session`.

pub mod cli;
pub mod fs;
pub mod fuse;
pub mod session;

pub use session::{mount, mount_persistent, Mounted, MountedHandle, SessionError};

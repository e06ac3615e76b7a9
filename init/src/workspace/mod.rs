//! The durable FUSE workspace: POSIX semantics in `fs` (no protocol types), the FUSE wire
//! format in `proto`, the thin adapter from requests to `fs` in `fuse`, the transports
//! (`/dev/fuse`, io_uring) in `serve`, the ring threads' scheduling class in `sched`, and
//! mounting/unmounting in `session`.

pub mod cli;
pub mod fs;
pub mod fuse;
pub mod proto;
pub mod sched;
pub mod serve;
pub mod session;

pub use session::{mount, mount_persistent, Mounted, MountedHandle, SessionError};

//! Real-mount tests (root and `/dev/fuse`; they fail loudly under `CI` without them): POSIX
//! behaviour of a `keel mount` seen through the kernel, compared with ext4 where the kernel
//! decides (ACLs, set-ID bits), and what survives a remount, a cold start or a lazy restore.
//! Also `WorkspaceFs` without a mount: against a model (`fs_model`), its change tracking and
//! its watch. One test binary per area, each file a module, so the test command links it once.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod acl;
mod basic;
mod cold;
mod fs_model;
mod fs_track;
mod fs_watch;
mod full_volume;
mod handles;
mod lazy;
mod mmap;
mod persist;
mod session;
mod setid;
mod sparse;
mod stale;
mod state;

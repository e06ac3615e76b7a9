//! Persistence: checkpoints, restores, leases, forks, retention, fsck and rollback, through
//! the remote trait (in memory, `file://`, a real S3 endpoint) and on real mounts. One test
//! binary, each file a module (`modes` runs its passes in a child process: it sets the
//! umask, which is per process).

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod bench;
mod checkpoint;
mod crash;
mod dir_bench;
mod dir_provider;
mod dir_watch;
mod fork;
mod fsck_quick;
mod image;
mod lazy;
mod lease;
mod modes;
mod packs;
mod private;
mod restore;
mod retention;
mod rollback;
mod roundtrip;
mod s3;

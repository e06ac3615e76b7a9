//! What the integration tests share, included once by each test binary's `main.rs`:
//! `keel` is the one harness for a running keel (`keel mount` or `keel run`, cleaned up even
//! when a test panics); `mount` gates on root + `/dev/fuse`, compares trees and waits
//! (`poll_for`); `pid1` starts `keel run` as a subreaper or a true PID 1 and watches its
//! processes (read from /proc by `procs`); `persist` opens a `WorkspaceFs` without a kernel
//! and drives checkpoints over a counted remote; `control` speaks HTTP to the control API;
//! `s3` runs moto as a real S3 endpoint; `sys` holds the raw syscalls the tests make. The
//! gates (root, `/dev/fuse`) fail loudly when `CI` is set.

#![allow(dead_code)] // each test crate uses a different subset

pub mod control;
pub mod keel;
#[macro_use]
pub mod mount;
pub mod persist;
pub mod pid1;
pub mod procs;
pub mod s3;
pub mod sys;

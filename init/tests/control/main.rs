//! The control API (HTTP on the socket and on TCP): status, snapshots and rollback, exec and
//! processes, files, against in-process servers and the built `keel run`. One test binary,
//! each file a module.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod api;
mod budget;
mod deep_diff;
mod e2e;
mod exec;
mod exec_workspace;
mod files;
mod starve;
mod watch;
mod workspace;

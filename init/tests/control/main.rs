//! The control API (HTTP on the socket and on TCP): status, snapshots and rollback, exec and
//! processes, files, against in-process servers and the built `keel run`; with them what needs
//! neither root nor a mount: config parsing and the shipped config files, the OpenAPI
//! description against the route table, the layer rules, and how a panic is logged. One test
//! binary, each file a module.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod api;
mod budget;
mod config;
mod config_files;
mod deep_diff;
mod e2e;
mod exec;
mod exec_workspace;
mod files;
mod layers;
mod openapi;
mod panic;
mod starve;
mod watch;
mod workspace;

//! Tests that need neither root nor a kernel mount: config parsing and the shipped config
//! files, `WorkspaceFs` against a model, the OpenAPI description against the route table, the
//! layer rules, and how a panic is logged. One test binary, each file a module.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod config;
mod config_files;
mod fs_model;
mod fs_track;
mod fs_watch;
mod layers;
mod openapi;
mod panic;

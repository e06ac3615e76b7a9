//! keel: a PID-1 init and a durable FUSE workspace for Linux sandboxes.
//!
//! `main.rs` and `cli/` (the binary) parse the command line and exit; everything else lives
//! here and never imports from `cli/`. Dependencies point one way: `workspace` → `meta`,
//! `chunk`; `meta`, `chunk` and `sys` import no sibling.

#![deny(unsafe_code)]

pub mod boot;
pub mod chunk;
pub mod config;
pub mod control;
pub mod logging;
pub mod meta;
pub mod persist;
pub mod progress;
pub mod run;
pub mod shutdown;
pub mod supervisor;
// The one module with unsafe code (syscalls through libc/nix), each block with a SAFETY note.
#[allow(unsafe_code)]
pub mod sys;
pub mod workspace;

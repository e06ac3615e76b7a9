//! keel: a PID-1 init and a durable FUSE workspace for Linux sandboxes.
//!
//! `main.rs` and `cli/` (the binary) parse the command line, run a command and turn its
//! outcome into an exit code; everything else lives here and never imports from `cli/`.
//! The layers, each importing only those below it (`tests/control/layers.rs` checks every
//! `crate::` path):
//!
//! ```text
//! cli                                               the binary: commands, exit codes
//!  │
//! run · boot · supervisor · exec · control · shutdown   start, supervise, stop, the API
//!  │     └ boot::workspace: lock → lease → restore → mount → checkpoints → rollback
//!  │
//! workspace      persist                            the FUSE fs │ checkpoints, remotes
//!  │                │                               (never each other)
//! config · state · meta · chunk                     the state dir; the SQLite store; bodies
//!  │
//! sys · logging · progress · time · random · budget   syscalls and unsafe; leaves
//! ```
//!
//! Within the top layer: `run` uses `boot`, `supervisor`, `exec`, `control` and `shutdown`;
//! `supervisor` (the one reaper, the stop) and `control` (the routes) use `exec`, which uses
//! neither; `control` uses `files` (the files API's helper processes), which uses `exec`'s
//! launch template;
//! `shutdown` uses `boot` (the workspace it stops); `control` uses `workspace` and
//! `persist` for `/status`, `/checkpoint` and the agent routes, never `run`. No circle
//! between modules, no exception listed.

#![deny(unsafe_code)]

pub mod boot;
pub mod budget;
pub mod chunk;
pub mod config;
pub mod control;
pub mod exec;
pub mod files;
pub mod logging;
pub mod meta;
pub mod persist;
pub mod progress;
pub mod random;
pub mod run;
pub mod shutdown;
pub mod state;
pub mod supervisor;
// The one module with unsafe code (syscalls through libc/nix), each block with a SAFETY note.
#[allow(unsafe_code)]
pub mod sys;
pub mod time;
pub mod workspace;

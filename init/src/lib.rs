//! keel: a PID-1 init and a durable FUSE workspace for Linux sandboxes.
//!
//! `main.rs` and `cli/` (the binary) parse the command line and exit; everything else lives
//! here and never imports from `cli/`. The layers, each importing only those below it:
//!
//! ```text
//! run · boot · supervisor · control · shutdown     start, supervise, stop, the API
//! workspace · persist                              the FUSE fs; checkpoints and remotes
//! meta · chunk · config                            the SQLite store; bodies and chunks
//! sys · logging · progress                         syscalls and unsafe; leaves
//! ```
//!
//! `workspace` and `persist` do not import each other, and there is no circle between
//! modules; `tests/layers.rs` checks both and lists the two edges not fixed yet (the start
//! sequence that wires persist into the mount still lives in `workspace/session.rs`, and
//! `persist/cli.rs` still falls back to the control socket).

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

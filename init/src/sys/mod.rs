//! The only module that talks to the kernel directly: small safe wrappers around syscalls
//! (through `nix`/`libc`). Every `unsafe` block in keel lives here, with a `// SAFETY:` note.

pub mod beneath;
pub mod caps;
pub mod cgroup;
pub mod creds;
pub mod eventfd;
pub mod fgsig;
pub mod file;
pub mod inotify;
pub mod mem;
pub mod mount;
pub mod ns;
pub mod open_files;
pub mod pipe;
pub mod process;
pub mod pty;
pub mod sched;
pub mod seccomp;
pub mod signal;
pub mod socket;
pub mod spawn;
pub mod tree;

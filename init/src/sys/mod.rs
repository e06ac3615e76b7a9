//! The only module that talks to the kernel directly: small safe wrappers around syscalls
//! (through `nix`/`libc`). Every `unsafe` block in keel lives here, with a `// SAFETY:` note.
pub mod fgsig;
pub mod file;

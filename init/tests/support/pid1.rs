//! Helpers for the PID-1 integration tests: start `keel run` (through the one harness,
//! `support::keel`) with a config in a temp dir, poll for outcomes with deadlines, and read
//! the process tree from /proc.

use std::path::Path;

pub const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// A config with the workspace disabled (no FUSE in these tests), a short grace, plus `init`
/// extra lines for `[init]` and `rest` appended (other tables).
pub fn config(init: &str, rest: &str) -> String {
    format!("[init]\nworkspace = false\n{init}\n{rest}\n")
}

/// True when running as root. Without root: panics when `CI` is set, else the test is skipped.
pub fn require_root(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{what} needs root, and CI is set: refusing to skip");
    }
    eprintln!("skipping {what}: needs root");
    false
}

/// True when running as root with /dev/fuse. Without either: panics when `CI` is set, else the
/// test is skipped.
pub fn require_root_and_fuse(what: &str) -> bool {
    if !require_root(what) {
        return false;
    }
    if !std::path::Path::new("/dev/fuse").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{what}: /dev/fuse is missing and CI is set: refusing to skip"
        );
        eprintln!("skipping {what}: no /dev/fuse");
        return false;
    }
    true
}

pub use super::keel::{Keel, Opts, LIMIT};

/// Starts `keel run` with `config_text` (written to DIR/config.toml) and `argv` after `--`.
/// `$D` in argv and config is replaced by the temp dir path.
pub fn start(config_text: &str, argv: &[&str]) -> Keel {
    Keel::run(config_text, argv, Opts::default())
}

pub fn start_with(config_text: &str, argv: &[&str], opts: Opts) -> Keel {
    Keel::run(config_text, argv, opts)
}

/// Polls `f` until it returns Some; panics naming `what` after `LIMIT`.
pub fn poll<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    super::mount::poll_for(LIMIT, f).unwrap_or_else(|| panic!("timed out waiting for {what}"))
}

#[allow(unused_imports)] // each test crate uses a different subset
pub use super::procs::{alive, descendants, processes};

pub fn read(path: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned()
}

/// A hex mask line (`SigBlk:` etc.) from /proc status text.
pub fn status_mask(status: &str, key: &str) -> u64 {
    let line = status
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("no {key} in {status}"));
    u64::from_str_radix(line[key.len()..].trim(), 16).unwrap()
}

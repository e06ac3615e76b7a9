//! `keel run [--takeover[=MODE]] [--] [CMD [ARGS]...]`, also bare `keel CMD ARGS`: keel as the
//! container's init. Options end at the command: what follows is the command's.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use keel::run::RunError;

/// Run as the container's init (PID 1): boot, mount the workspace, supervise CMD and the
/// configured services, then save the workspace and exit with CMD's status.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub lease: super::TakeoverArg,
    /// The main command and its arguments (none: only the configured services)
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

pub fn main(config: Option<&Path>, a: RunArgs) -> i32 {
    let r = keel::run::main(keel::run::RunOptions {
        config: config.map(Path::to_path_buf),
        takeover: a.lease.takeover,
        command: a.command,
    });
    match r {
        Ok(code) => code,
        Err(e) => exit_code(&e),
    }
}

/// A bare `keel WORD ...`: `keel run WORD ...`, unless keel is not PID 1 and WORD is neither
/// a path nor a command on PATH. On a host that is a mistyped subcommand (`keel restor`), and
/// running it would set up an init first (the state dir, the mount point): refused before
/// anything is made, exit 2. As PID 1 (a container's entrypoint) the word always runs:
/// a command may live where only the mount makes it appear.
pub fn implicit(config: Option<&Path>, a: RunArgs) -> i32 {
    if let Some(word) = a.command.first() {
        if !keel::sys::process::is_pid1() && !runnable(word) {
            eprintln!(
                "keel: '{}' is not a keel subcommand and no command of that name is on PATH \
                 (`keel --help` lists the subcommands; `keel run -- CMD` runs CMD anyway)",
                word.to_string_lossy()
            );
            return super::EXIT_USAGE;
        }
    }
    main(config, a)
}

/// `word` names a path (it holds a `/`) or an executable file in a directory of PATH.
fn runnable(word: &OsStr) -> bool {
    if word.as_bytes().contains(&b'/') {
        return true;
    }
    let Some(path) = std::env::var_os("PATH") else {
        return false;
    };
    std::env::split_paths(&path).any(|dir| {
        std::fs::metadata(dir.join(word))
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    })
}

/// keel's exit code when `keel run` stopped before supervising anything (the error is
/// logged already): 2 for usage and config, 1 for setup.
fn exit_code(e: &RunError) -> i32 {
    match e {
        RunError::Config(_) | RunError::Credentials(_) => super::EXIT_USAGE,
        RunError::Control(keel::control::ControlError::Token(_)) => super::EXIT_USAGE,
        _ => super::EXIT_SETUP,
    }
}

#[cfg(test)]
mod tests {
    use super::runnable;
    use std::ffi::OsStr;

    #[test]
    fn a_path_or_a_command_on_path_is_runnable_and_a_typo_is_not() {
        assert!(runnable(OsStr::new("/nonexistent/cmd")));
        assert!(runnable(OsStr::new("./cmd")));
        assert!(runnable(OsStr::new("sh")));
        assert!(!runnable(OsStr::new("restor")));
        assert!(!runnable(OsStr::new("keel-no-such-command-anywhere")));
    }
}

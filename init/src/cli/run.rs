//! `keel run [--takeover[=MODE]] [--] [CMD [ARGS]...]`, also bare `keel CMD ARGS`: keel as the
//! container's init. Options end at the command: what follows is the command's.

use std::ffi::OsString;
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

/// keel's exit code when `keel run` stopped before supervising anything (the error is
/// logged already): 2 for usage and config, 1 for setup.
fn exit_code(e: &RunError) -> i32 {
    match e {
        RunError::Config(_) | RunError::Credentials(_) => super::EXIT_USAGE,
        RunError::Control(keel::control::ControlError::Token(_)) => super::EXIT_USAGE,
        _ => super::EXIT_SETUP,
    }
}

//! `keel run [--takeover[=MODE]] [--] [CMD [ARGS]...]`, also bare `keel CMD ARGS`: keel as the
//! container's init. Options end at the command: what follows is the command's.

use std::ffi::OsString;
use std::path::Path;

use keel::config::Takeover;

/// Run as the container's init (PID 1): boot, mount the workspace, supervise CMD and the
/// configured services, then save the workspace and exit with CMD's status.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Take the workspace's lease from a keel that still holds it: wait for it, or force
    /// (the bare flag) [overrides [persist] takeover = refuse|wait|force]
    #[arg(
        long,
        value_name = "MODE",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "force"
    )]
    pub takeover: Option<Takeover>,
    /// The main command and its arguments (none: only the configured services)
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

pub fn main(config: Option<&Path>, a: RunArgs) -> i32 {
    keel::run::main(keel::run::RunOptions {
        config: config.map(Path::to_path_buf),
        takeover: a.takeover,
        command: a.command,
    })
}

//! `keel checkpoint [--state DIR] [--full] [--takeover[=MODE]]`.

use std::path::{Path, PathBuf};

use super::{persist_config, progress, report};

/// Checkpoint the workspace to its remote now (through the running keel if there is one)
#[derive(clap::Args, Debug)]
pub struct CheckpointArgs {
    /// The state dir [default: [workspace] state_dir]
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// The remote [default: [persist] remote]
    #[arg(long, value_name = "URL")]
    remote: Option<String>,
    /// Write a full snapshot, not a delta
    #[arg(long)]
    full: bool,
    #[command(flatten)]
    lease: super::TakeoverArg,
}

pub fn main(config: Option<&Path>, a: CheckpointArgs) -> i32 {
    report("checkpoint", || {
        let cfg = persist_config(config, a.state.as_deref(), a.remote.as_deref(), a.lease)?;
        let line = progress::show("checkpoint", || {
            keel::control::agent_client::checkpoint(&cfg, a.full)
        })?;
        println!("{line}");
        Ok(0)
    })
}

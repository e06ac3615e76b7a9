//! `keel gc [--state DIR]`.

use std::path::{Path, PathBuf};

use super::{persist_config, progress, report};

/// Remove old snapshots and chunks no kept snapshot uses (through the running keel if any)
#[derive(clap::Args, Debug)]
pub struct GcArgs {
    /// The state dir [default: [workspace] state_dir]
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// The remote [default: [persist] remote]
    #[arg(long, value_name = "URL")]
    remote: Option<String>,
}

pub fn main(config: Option<&Path>, a: GcArgs) -> i32 {
    report("gc", || {
        let cfg = persist_config(
            config,
            a.state.as_deref(),
            a.remote.as_deref(),
            super::TakeoverArg::default(),
        )?;
        println!(
            "{}",
            progress::show("gc", || keel::control::agent_client::gc(&cfg))?
        );
        Ok(0)
    })
}

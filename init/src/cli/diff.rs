//! `keel diff A [B] [--json] [-- PATH]`.

use std::path::{Path, PathBuf};

use keel::persist::agent_cmd::DiffOptions;

use super::{persist_config, report};

/// What changed from snapshot A to snapshot B (default: the live workspace, checkpointed first)
#[derive(clap::Args, Debug)]
pub struct DiffArgs {
    /// The snapshot to compare from: its id or name
    #[arg(value_name = "A")]
    from: String,
    /// The snapshot to compare to: its id or name [default: the live workspace]
    #[arg(value_name = "B")]
    to: Option<String>,
    /// The state dir [default: [workspace] state_dir]
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// Print the changes as JSON
    #[arg(long)]
    json: bool,
    /// A unified diff of this one file instead of the list of changes
    #[arg(last = true, value_name = "PATH")]
    path: Option<String>,
}

pub fn main(config: Option<&Path>, a: DiffArgs) -> i32 {
    report("diff", || {
        let cfg = persist_config(
            config,
            a.state.as_deref(),
            None,
            super::TakeoverArg::default(),
        )?;
        // Written as it arrives: a diff of a huge or deep tree is never held here.
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdout.lock());
        keel::control::agent_client::diff(
            &cfg,
            &DiffOptions {
                from: a.from,
                to: a.to,
                json: a.json,
                path: a.path,
            },
            &mut out,
        )?;
        std::io::Write::flush(&mut out).map_err(|e| format!("write the answer: {e}"))?;
        Ok(0)
    })
}

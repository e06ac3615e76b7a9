//! `keel rollback ID|NAME`.

use std::path::{Path, PathBuf};

use keel::persist::agent::Rollback;

use super::{persist_config, print_json, report};

/// Make the mounted workspace equal to a snapshot, now, without a restart (undo: roll back to
/// the `before-rollback-N` snapshot it names)
#[derive(clap::Args, Debug)]
pub struct RollbackArgs {
    /// The snapshot: its id or name
    #[arg(value_name = "ID|NAME")]
    to: String,
    /// The state dir of the running keel [default: [workspace] state_dir]
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// Print the answer as JSON
    #[arg(long)]
    json: bool,
    /// Stop the main command of keel run first (its process group: the stop signal, SIGKILL
    /// after [shutdown] grace) and start it again after the rollback
    #[arg(long, conflicts_with = "no_restart")]
    restart: bool,
    /// Leave the main command running (the default with the FUSE provider; the `dir`
    /// provider stops it first, as the rollback swaps the tree it works in)
    #[arg(long)]
    no_restart: bool,
}

pub fn main(config: Option<&Path>, a: RollbackArgs) -> i32 {
    report("rollback", || {
        let cfg = persist_config(
            config,
            a.state.as_deref(),
            None,
            super::TakeoverArg::default(),
        )?;
        let v = keel::control::agent_client::rollback(
            &cfg,
            &Rollback {
                to: a.to,
                restart: match (a.restart, a.no_restart) {
                    (true, _) => Some(true),
                    (_, true) => Some(false),
                    _ => None,
                },
            },
        )?;
        if a.json {
            print_json(&v);
        } else if v["applied"]["provider"] == "dir" {
            println!(
                "rolled back from snapshot {} to {}: now snapshot {} (undo: keel rollback {}), tree rebuilt: {} files ({} unchanged, linked), {} dirs, {} bytes written, {} ms",
                v["from"],
                v["to"],
                v["snapshot"],
                v["undo"].as_str().unwrap_or(""),
                v["applied"]["files"],
                v["applied"]["files_unchanged_linked"],
                v["applied"]["dirs"],
                v["applied"]["bytes_written"],
                v["duration_ms"]
            );
            if v["restarted"] == true {
                println!("the main command was stopped before and started again after");
            }
        } else {
            println!(
                "rolled back from snapshot {} to {}: now snapshot {} (undo: keel rollback {}), {} inodes, {} entries, {} open files keep their old bytes until closed, {} ms",
                v["from"],
                v["to"],
                v["snapshot"],
                v["undo"].as_str().unwrap_or(""),
                v["applied"]["inodes"],
                v["applied"]["entries"],
                v["applied"]["open_files_kept"],
                v["duration_ms"]
            );
            if v["restarted"] == true {
                println!("the main command was stopped before and started again after");
            }
        }
        Ok(0)
    })
}

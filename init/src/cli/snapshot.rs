//! `keel snapshot create|list|delete|restore`.

use std::path::{Path, PathBuf};

use keel::persist::agent::SnapshotCreate;

use super::{persist_config, print_json, progress, report, Failed};

/// Snapshot the live workspace, list or delete snapshots, or restore one into an empty state dir
#[derive(clap::Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Snapshot the live workspace now (flushing what is open); a named snapshot is kept until deleted
    Create {
        /// The state dir of the running keel [default: [workspace] state_dir]
        #[arg(long, value_name = "DIR")]
        state: Option<PathBuf>,
        /// A name to find it by (not all digits) [default: its id]
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
        /// A message kept with it
        #[arg(long, short = 'm', value_name = "TEXT", default_value = "")]
        message: String,
        /// Print the answer as JSON
        #[arg(long)]
        json: bool,
    },
    /// Drop a snapshot's name: it falls under retention ([persist] keep) again
    Delete {
        /// The snapshot: its id or name
        #[arg(value_name = "ID|NAME")]
        what: String,
        /// The state dir [default: [workspace] state_dir]
        #[arg(long, value_name = "DIR")]
        state: Option<PathBuf>,
        /// The remote [default: [persist] remote]
        #[arg(long, value_name = "URL")]
        remote: Option<String>,
    },
    /// List the snapshots on the remote
    List {
        /// The state dir whose remote to list [default: [workspace] state_dir]
        #[arg(long, value_name = "DIR")]
        state: Option<PathBuf>,
        /// The remote to list [default: [persist] remote]
        #[arg(long, value_name = "URL")]
        remote: Option<String>,
        /// Print the listing as JSON
        #[arg(long)]
        json: bool,
    },
    /// Restore a snapshot into an empty state dir
    Restore {
        /// The snapshot: its id, or `latest`
        #[arg(value_name = "ID")]
        id: String,
        /// The empty state dir to restore into
        #[arg(long, value_name = "DIR", required = true)]
        state: PathBuf,
        /// The remote to restore from [default: [persist] remote]
        #[arg(long, value_name = "URL")]
        remote: Option<String>,
    },
}

pub fn main(config: Option<&Path>, c: SnapshotCommand) -> i32 {
    report("snapshot", || match c {
        SnapshotCommand::Create {
            state,
            name,
            message,
            json,
        } => {
            let cfg = persist_config(
                config,
                state.as_deref(),
                None,
                super::TakeoverArg::default(),
            )?;
            let v = keel::control::agent_client::snapshot_create(
                &cfg,
                &SnapshotCreate { name, message },
            )?;
            if json {
                print_json(&v);
            } else {
                println!("{}", v["id"]);
            }
            Ok(0)
        }
        SnapshotCommand::List {
            state,
            remote,
            json,
        } => {
            let cfg = persist_config(
                config,
                state.as_deref(),
                remote.as_deref(),
                super::TakeoverArg::default(),
            )?;
            println!(
                "{}",
                keel::control::agent_client::snapshot_list(&cfg, json)?
            );
            Ok(0)
        }
        SnapshotCommand::Delete {
            what,
            state,
            remote,
        } => {
            let cfg = persist_config(
                config,
                state.as_deref(),
                remote.as_deref(),
                super::TakeoverArg::default(),
            )?;
            for n in keel::control::agent_client::snapshot_delete(&cfg, &what)? {
                println!("deleted name {n}");
            }
            Ok(0)
        }
        SnapshotCommand::Restore { id, state, remote } => {
            let seq = match id.as_str() {
                "latest" | "head" => None,
                n => Some(
                    n.parse::<u64>()
                        .map_err(|_| Failed::usage(format!("`{id}` is not a snapshot id")))?,
                ),
            };
            let cfg = persist_config(
                config,
                Some(&state),
                remote.as_deref(),
                super::TakeoverArg::default(),
            )?;
            let r = progress::show("restore", || {
                keel::persist::ops::snapshot_restore(&cfg, seq)
            })?;
            println!(
                "restored snapshot {} into {}: {} inodes, {} files, {} bytes, {} chunks fetched ({} bytes) in {:.2}s",
                r.seq,
                cfg.workspace.state_dir.display(),
                r.inodes,
                r.files,
                r.file_bytes,
                r.chunks_fetched,
                r.bytes_fetched,
                r.elapsed_s
            );
            Ok(0)
        }
    })
}

//! `keel snapshot list|restore`.

use std::path::{Path, PathBuf};

use super::{persist_config, progress, report, Failed};

/// List the remote's snapshots, or restore one into an empty state dir
#[derive(clap::Subcommand, Debug)]
pub enum SnapshotCommand {
    /// List the snapshots on the remote
    List {
        /// The state dir whose remote to list [default: [workspace] state_dir]
        #[arg(long, value_name = "DIR")]
        state: Option<PathBuf>,
        /// The remote to list [default: [persist] remote]
        #[arg(long, value_name = "URL")]
        remote: Option<String>,
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
        SnapshotCommand::List { state, remote } => {
            let cfg = persist_config(config, state.as_deref(), remote.as_deref(), None)?;
            print!("{}", keel::persist::cli::snapshot_list(&cfg)?);
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
            let cfg = persist_config(config, Some(&state), remote.as_deref(), None)?;
            let r = progress::show("restore", || {
                keel::persist::cli::snapshot_restore(&cfg, seq)
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

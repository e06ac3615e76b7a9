//! `keel fork --to URL [--from URL] [--seq N]`, `keel fork --delete URL`.

use std::path::{Path, PathBuf};

use super::{persist_config, progress, report};

/// Make a new workspace from a snapshot, sharing its chunks; or delete a fork
#[derive(clap::Args, Debug)]
pub struct ForkArgs {
    /// Where the new workspace goes (a remote URL)
    #[arg(long, value_name = "URL", required_unless_present = "delete")]
    to: Option<String>,
    /// The workspace to fork [default: [persist] remote]
    #[arg(long, value_name = "URL")]
    from: Option<String>,
    /// The snapshot to fork [default: the head, checkpointed first by a keel serving it]
    #[arg(long, value_name = "N")]
    seq: Option<u64>,
    /// The state dir whose remote is the default source
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// Remove the fork at URL (its chunks go at the next gc)
    #[arg(long, value_name = "URL", conflicts_with_all = ["to", "from", "seq"])]
    delete: Option<String>,
}

pub fn main(config: Option<&Path>, a: ForkArgs) -> i32 {
    report("fork", || {
        let cfg = persist_config(
            config,
            a.state.as_deref(),
            None,
            super::TakeoverArg::default(),
        )?;
        if let Some(url) = &a.delete {
            let r = keel::persist::ops::fork_delete(&cfg, url)?;
            println!(
                "deleted fork {url} (workspace id {}): {} objects removed; chunks only it used go at the next gc of a workspace sharing the store",
                r.id, r.objects_deleted
            );
            return Ok(0);
        }
        let to = a.to.as_deref().unwrap_or_default();
        let r = progress::show("fork", || {
            keel::control::agent_client::fork(&cfg, to, a.from.as_deref(), a.seq)
        })?;
        let from = a
            .from
            .clone()
            .or_else(|| cfg.persist.remote_url(&cfg.workspace.state_dir))
            .unwrap_or_default();
        println!(
            "forked snapshot {} of {from} into {to} (workspace id {}): {} inodes, {} bytes of file data, {} chunks shared through `{}` (none copied)",
            r.seq, r.id, r.inodes, r.file_bytes, r.chunks, r.chunk_store
        );
        Ok(0)
    })
}

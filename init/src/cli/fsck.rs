//! `keel fsck --state DIR [--repair] [--quick] [--no-remote]`.

use std::path::{Path, PathBuf};

use keel::persist::fsck::Level;
use keel::persist::ops::FsckFlags;

use super::{persist_config, progress, report};

/// Check a stopped state dir and the remote it checkpoints to (exit 1: errors found)
#[derive(clap::Args, Debug)]
pub struct FsckArgs {
    /// The state dir to check
    #[arg(long, value_name = "DIR", required = true)]
    state: PathBuf,
    /// The remote [default: [persist] remote]
    #[arg(long, value_name = "URL")]
    remote: Option<String>,
    /// Fix what can be fixed without losing data
    #[arg(long)]
    repair: bool,
    /// Check a sample, in a time independent of the workspace's size: the directories
    /// of up to 256 changes since the last checkpoint, the root and 32 random directories (entries, link
    /// counts, parents up to the root, bodies, up to 64 windows re-hashed), the running
    /// totals against the last snapshot's header, the remote's snapshot header chains and up
    /// to 256 chunks of the sampled files. No SQLite integrity check, no whole-table checks
    /// (unreachable inodes, file link counts, orphan bodies). With --repair: the full check
    #[arg(long)]
    quick: bool,
    /// Do not check the remote
    #[arg(long)]
    no_remote: bool,
}

pub fn main(config: Option<&Path>, a: FsckArgs) -> i32 {
    report("fsck", || {
        let cfg = persist_config(
            config,
            Some(&a.state),
            a.remote.as_deref(),
            super::TakeoverArg::default(),
        )?;
        let flags = FsckFlags {
            repair: a.repair,
            quick: a.quick,
            no_remote: a.no_remote,
        };
        let r = progress::show("fsck", || keel::persist::ops::fsck(&cfg, flags))?;
        for f in &r.findings {
            let lvl = match f.level {
                Level::Error => "error",
                Level::Warning => "warning",
                Level::Note => "note",
            };
            println!(
                "{lvl}: {}{}",
                f.what,
                if f.repaired { " [repaired]" } else { "" }
            );
        }
        if let Some(s) = &r.sample {
            println!(
                "fsck --quick checked a sample: {} directories (the root, those of {} changes since the last checkpoint, up to 32 at random), {} snapshot headers; keel fsck without --quick checks everything",
                s.dirs, s.changed, s.snapshots
            );
        }
        let remote = if r.remote_checked {
            format!("{} remote chunks verified", r.chunks_checked)
        } else {
            "the remote not checked".to_string()
        };
        println!(
            "fsck {}: {} inodes, {} entries, {} bodies, {} windows re-hashed, {remote}; {} errors, {} warnings, {} repaired ({:.2}s)",
            cfg.workspace.state_dir.display(),
            r.inodes,
            r.entries,
            r.bodies,
            r.windows_hashed,
            r.count(Level::Error),
            r.count(Level::Warning),
            r.findings.iter().filter(|f| f.repaired).count(),
            r.elapsed_s
        );
        Ok(if r.is_clean() { 0 } else { super::EXIT_FAILED })
    })
}

//! The `keel` binary: picks the subcommand and turns its result into the process exit code.
//! This is the only place that exits.

use std::ffi::OsString;

const USAGE: &str = "usage:
  keel run [--config FILE] [--takeover[=wait|force]] [--] CMD [ARGS...]
                                                run as the container's init (PID 1)
  keel mount --state DIR MOUNTPOINT [--cache auto|kernel|none] [--passthrough auto|on|off]
             [--threads N] [--config FILE] ...       (keel mount --help for all options)
                                                mount the workspace in the foreground
  keel status [--socket PATH] [--config FILE]   print the running keel's status (JSON)
  keel checkpoint [--state DIR] [--full]        checkpoint the workspace to its remote now
  keel gc [--state DIR]                         remove old snapshots and unreferenced chunks
  keel fsck --state DIR [--repair] [--quick]    check a stopped state dir and its remote
  keel snapshot list|restore ID ...             list snapshots / restore one into an empty dir
  keel snapshot create [--name N] [-m TEXT]     snapshot the live workspace now, kept until deleted
  keel snapshot delete ID|NAME                  drop a snapshot's name (retention applies again)
  keel diff A [B] [--json] [-- PATH]            what changed from A to B (default: live)
  keel rollback ID|NAME                         make the mounted workspace equal to a snapshot
  keel fork --to URL [--from URL] [--seq N]     new workspace from a snapshot, sharing its chunks
  keel fork --delete URL                        remove a fork (its chunks go at the next gc)
  keel [--config FILE] [--] CMD [ARGS...]       same as `keel run`";

fn main() {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let code = match args.first().and_then(|a| a.to_str()) {
        Some("mount") => {
            args.remove(0);
            keel::workspace::cli::mount_main(args)
        }
        Some("status") => {
            args.remove(0);
            keel::control::client::status_main(args)
        }
        Some("checkpoint") => {
            args.remove(0);
            keel::persist::cli::checkpoint_main(args)
        }
        Some("gc") => {
            args.remove(0);
            keel::persist::cli::gc_main(args)
        }
        Some("fsck") => {
            args.remove(0);
            keel::persist::cli::fsck_main(args)
        }
        Some("snapshot") => {
            args.remove(0);
            keel::persist::cli::snapshot_main(args)
        }
        Some("diff") => {
            args.remove(0);
            keel::persist::agent_cli::diff_main(args)
        }
        Some("rollback") => {
            args.remove(0);
            keel::persist::agent_cli::rollback_main(args)
        }
        Some("fork") => {
            args.remove(0);
            keel::persist::fork::fork_main(args)
        }
        Some("run") => {
            args.remove(0);
            keel::run::main(args)
        }
        Some("-h") | Some("--help") | Some("help") => {
            println!("{USAGE}");
            0
        }
        Some("--version") | Some("-V") => {
            println!("keel {}", env!("CARGO_PKG_VERSION"));
            0
        }
        _ => keel::run::main(args),
    };
    std::process::exit(code);
}

//! The command line, on clap: one file per subcommand, each an `Args` struct and a `main`
//! that makes the config (`--config`, then `KEEL_CONFIG`, then /etc/keel/config.toml, see
//! `Config::resolve`), puts its flags over it and calls the library's typed entry point.
//! Usage errors are clap's, exit 2; config errors exit 2; a failed command exits 1. A bare
//! `keel CMD ARGS` is `keel run CMD ARGS`. To add a subcommand: a file here with its `Args`
//! and `main`, a variant in `Command` and a line in `main`.

mod checkpoint;
mod completions;
mod diff;
mod exec;
mod files;
mod fork;
mod fsck;
mod gc;
mod mount;
mod progress;
mod rollback;
mod run;
mod snapshot;
mod status;

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};
use keel::config::{Config, Takeover};

/// PID-1 init and durable FUSE workspace for Linux sandboxes.
///
/// Run a container's main command as `keel [run] [--] CMD [ARGS]...`: keel reaps, forwards
/// signals, supervises the configured services and mounts /workspace, which survives the
/// container through checkpoints to a remote (see `keel run --help`).
#[derive(Parser, Debug)]
#[command(
    name = "keel",
    version,
    args_conflicts_with_subcommands = true,
    after_help = "Without a subcommand, `keel [OPTIONS] [--] CMD [ARGS]...` is `keel run`."
)]
pub struct Cli {
    /// The config file [default: /etc/keel/config.toml if it exists, else built-in defaults]
    // An OsString: an empty KEEL_CONFIG reads as unset (`config::config_file`).
    #[arg(
        long,
        short = 'c',
        global = true,
        env = "KEEL_CONFIG",
        value_name = "FILE",
        value_parser = clap::builder::ValueParser::os_string()
    )]
    config: Option<std::ffi::OsString>,
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: run::RunArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    Run(run::RunArgs),
    Mount(mount::MountArgs),
    Status(status::StatusArgs),
    Checkpoint(checkpoint::CheckpointArgs),
    Gc(gc::GcArgs),
    Fsck(fsck::FsckArgs),
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCommand),
    Diff(diff::DiffArgs),
    Rollback(rollback::RollbackArgs),
    Exec(exec::ExecArgs),
    Files(files::FilesArgs),
    #[command(name = "files-helper", hide = true)]
    FilesHelper(files::HelperArgs),
    Fork(fork::ForkArgs),
    Completions(completions::CompletionsArgs),
}

/// Parses the command line and runs the subcommand; returns the exit code.
pub fn main() -> i32 {
    // Before anything is opened: what keel was started with is the main command's too.
    keel::sys::process::note_inherited_fds();
    let cli = Cli::parse();
    let config = cli.config.as_deref().map(Path::new);
    // Commands that print and exit stop quietly when their reader goes away
    // (`keel status | head`); the init and the mount keep std's SIGPIPE handling.
    if !matches!(
        cli.command,
        None | Some(Command::Run(_)) | Some(Command::Mount(_))
    ) {
        let _ = keel::sys::signal::default_sigpipe();
    }
    match cli.command {
        None => {
            // Nested ones too: `keel restor` meant `keel snapshot restore`.
            let cmd = <Cli as clap::CommandFactory>::command();
            let names: Vec<String> = cmd
                .get_subcommands()
                .flat_map(|c| std::iter::once(c).chain(c.get_subcommands()))
                .filter(|c| !c.is_hide_set())
                .map(|c| c.get_name().to_string())
                .collect();
            run::implicit(config, cli.run, &names)
        }
        Some(Command::Run(a)) => run::main(config, a),
        Some(Command::Mount(a)) => mount::main(config, a),
        Some(Command::Status(a)) => status::main(config, a),
        Some(Command::Checkpoint(a)) => checkpoint::main(config, a),
        Some(Command::Gc(a)) => gc::main(config, a),
        Some(Command::Fsck(a)) => fsck::main(config, a),
        Some(Command::Snapshot(a)) => snapshot::main(config, a),
        Some(Command::Diff(a)) => diff::main(config, a),
        Some(Command::Rollback(a)) => rollback::main(config, a),
        Some(Command::Exec(a)) => exec::main(config, a),
        Some(Command::Files(a)) => files::main(config, a),
        Some(Command::FilesHelper(a)) => files::helper(a),
        Some(Command::Fork(a)) => fork::main(config, a),
        Some(Command::Completions(a)) => completions::main(a),
    }
}

/// Exit code of usage and config errors.
const EXIT_USAGE: i32 = 2;
/// Exit code of a command that failed.
const EXIT_FAILED: i32 = 1;
/// Exit code when `keel run` itself fails to set up.
const EXIT_SETUP: i32 = 1;

/// How a subcommand failed: the exit code and the one line that says why.
#[derive(Debug)]
struct Failed {
    code: i32,
    line: String,
}

impl Failed {
    /// A usage or config error (exit 2).
    fn usage(line: impl ToString) -> Self {
        Failed {
            code: EXIT_USAGE,
            line: line.to_string(),
        }
    }
}

impl From<String> for Failed {
    /// The command itself failed (exit 1).
    fn from(line: String) -> Self {
        Failed {
            code: EXIT_FAILED,
            line,
        }
    }
}

/// A typed error of the library: the command itself failed (exit 1), the error's one line.
macro_rules! failed_from {
    ($($t:ty),* $(,)?) => {$(
        impl From<$t> for Failed {
            fn from(e: $t) -> Self {
                Failed::from(e.to_string())
            }
        }
    )*};
}
failed_from!(
    keel::persist::ops::OpsError,
    keel::control::agent_client::AgentClientError,
);

/// Runs a subcommand's body with logging set up: `keel: WHAT: why` and its exit code on
/// failure.
fn report(what: &str, f: impl FnOnce() -> Result<i32, Failed>) -> i32 {
    keel::logging::init();
    match f() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("keel: {what}: {}", e.line);
            e.code
        }
    }
}

/// Prints `v` as pretty JSON on stdout.
fn print_json(v: &impl serde::Serialize) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).expect("value serialises")
    );
}

/// `p` made absolute against the working directory.
fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(p))
            .unwrap_or_else(|_| p.to_path_buf())
    }
}

/// `--takeover[=MODE]`, the same on `keel run`, `keel mount` and `keel checkpoint`.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct TakeoverArg {
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
}

impl TakeoverArg {
    /// The flag over `[persist] takeover`.
    pub fn apply(self, cfg: &mut Config) {
        if let Some(t) = self.takeover {
            cfg.persist.takeover = t;
        }
    }
}

/// The config of a persist command: the config file, then `--state`, `--remote` and
/// `--takeover` over it, its `[persist]` table checked.
fn persist_config(
    config: Option<&Path>,
    state: Option<&Path>,
    remote: Option<&str>,
    lease: TakeoverArg,
) -> Result<Config, Failed> {
    let mut cfg = Config::resolve(config).map_err(Failed::usage)?;
    if let Some(s) = state {
        cfg.workspace.state_dir = absolute(s);
    }
    if let Some(r) = remote {
        cfg.persist.remote = r.to_string();
    }
    lease.apply(&mut cfg);
    cfg.persist
        .validate()
        .map_err(|e| Failed::usage(e.to_string()))?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("keel").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_bare_command_is_keel_run() {
        let c = parse(&["sh", "-c", "exit 3"]).unwrap();
        assert!(c.command.is_none());
        assert_eq!(c.run.command, ["sh", "-c", "exit 3"]);
        let c = parse(&["--config", "/x", "--", "sh", "--config", "y"]).unwrap();
        assert_eq!(c.config.as_deref(), Some("/x".as_ref()));
        assert_eq!(c.run.command, ["sh", "--config", "y"]);
        let c = parse(&["--takeover", "ls", "-l"]).unwrap();
        assert_eq!(c.run.lease.takeover, Some(Takeover::Force));
        assert_eq!(c.run.command, ["ls", "-l"]);
        assert!(parse(&["--bogus", "ls"]).is_err());
    }

    #[test]
    fn run_stops_reading_options_at_the_command() {
        let c = parse(&["run", "--takeover=wait", "ls", "--takeover", "-c", "x"]).unwrap();
        let Some(Command::Run(r)) = c.command else {
            panic!("not run")
        };
        assert_eq!(r.lease.takeover, Some(Takeover::Wait));
        assert_eq!(r.command, ["ls", "--takeover", "-c", "x"]);
        let c = parse(&["run", "-c", "/c", "--", "--help"]).unwrap();
        assert_eq!(c.config.as_deref(), Some("/c".as_ref()));
        let Some(Command::Run(r)) = c.command else {
            panic!("not run")
        };
        assert_eq!(r.command, ["--help"]);
        assert!(parse(&["run", "--takeover=steal", "ls"]).is_err());
        assert!(parse(&["run", "--config"]).is_err());
    }

    #[test]
    fn usage_errors_exit_2() {
        for bad in [
            &["mount"][..],
            &["mount", "/a", "/b"],
            &["mount", "--threads", "0", "/m"],
            &["mount", "--passthrough", "yes", "/m"],
            &["fsck"],
            &["snapshot"],
            &["snapshot", "restore", "--state", "/s"],
            &["fork"],
            &["fork", "--delete", "x", "--to", "y"],
            &["gc", "--full"],
            &["fsck", "--state", "/s", "--seq", "1"],
            &["status", "extra"],
            &["completions", "tcsh"],
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
        assert_eq!(parse(&["--help"]).unwrap_err().exit_code(), 0);
        assert_eq!(parse(&["mount", "--help"]).unwrap_err().exit_code(), 0);
        assert_eq!(parse(&["--version"]).unwrap_err().exit_code(), 0);
    }

    #[test]
    fn the_config_flag_reaches_every_subcommand() {
        for (sub, rest) in [
            (&["mount"][..], &["/m"][..]),
            (&["status"], &[]),
            (&["checkpoint"], &[]),
            (&["gc"], &[]),
            (&["fsck"], &["--state", "/s"]),
            (&["snapshot", "list"], &[]),
            (&["fork"], &["--to", "file:///f"]),
            (&["run"], &["true"]),
        ] {
            let args = [sub, &["--config", "/c.toml"], rest].concat();
            let c = parse(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(c.config.as_deref(), Some("/c.toml".as_ref()), "{args:?}");
        }
    }
}

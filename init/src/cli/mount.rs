//! `keel mount --state DIR MOUNTPOINT [OPTIONS]`: the workspace in the foreground; options
//! override the `[workspace]` table of the config.

use std::path::{Path, PathBuf};
use std::time::Duration;

use keel::config::{CacheMode, Config, Switch};

use super::{absolute, report, Failed};

/// Mount the workspace in the foreground until SIGTERM/SIGINT/SIGHUP, then save and unmount
#[derive(clap::Args, Debug)]
pub struct MountArgs {
    /// Where to mount the workspace
    #[arg(value_name = "MOUNTPOINT")]
    mount_point: PathBuf,
    /// The state dir [default: [workspace] state_dir]
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// The mount's source, as mount tables show it [default: [workspace] fsname, else
    /// keel:<state dir>]
    #[arg(long, value_name = "NAME")]
    fsname: Option<String>,
    /// Kernel caching of file data: auto, kernel or none
    #[arg(long, value_name = "MODE")]
    cache: Option<CacheMode>,
    /// FUSE passthrough of reads and writes: auto, on or off
    #[arg(long, value_name = "MODE")]
    passthrough: Option<Switch>,
    /// The kernel's write-back cache: on or off
    #[arg(long, value_name = "on|off", value_parser = on_off)]
    writeback_cache: Option<bool>,
    /// Threads serving FUSE requests (1 to 64)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=64))]
    threads: Option<u8>,
    /// How long the kernel caches attributes (e.g. 1s, 500ms)
    #[arg(long, value_name = "D", value_parser = duration)]
    attr_timeout: Option<Duration>,
    /// How long the kernel caches names
    #[arg(long, value_name = "D", value_parser = duration)]
    entry_timeout: Option<Duration>,
    /// How long the kernel caches a name's absence
    #[arg(long, value_name = "D", value_parser = duration)]
    negative_timeout: Option<Duration>,
    #[command(flatten)]
    lease: super::TakeoverArg,
    /// Record the change feed from the start, as once something watches (to measure what
    /// a watcher costs the filesystem)
    #[arg(long, hide = true)]
    record_changes: bool,
    /// Gone: keel serves FUSE over /dev/fuse only
    #[arg(long, hide = true, num_args = 0..=1, value_name = "X")]
    io_uring: Option<Option<String>>,
    /// Gone: keel serves FUSE over /dev/fuse only
    #[arg(long, hide = true, num_args = 0..=1, value_name = "X")]
    ring_sched: Option<Option<String>>,
}

/// Why a `keel mount` flag's value is not one, or the mount failed.
#[derive(Debug, thiserror::Error)]
enum MountError {
    #[error("expected on or off")]
    NotOnOff,
    #[error("block signals: {0}")]
    BlockSignals(#[source] std::io::Error),
    #[error("{0}")]
    Start(#[source] keel::boot::workspace::StartError),
    #[error("{0}")]
    Control(#[source] keel::control::ControlError),
    #[error("{0}")]
    Unmount(#[source] keel::workspace::SessionError),
}

/// Exit code of a `keel mount` that saved everything in its state dir but not all of it to
/// the remote (the final checkpoint failed or ran out of time): what is missing is uploaded
/// first at the next start on that state dir, and lost if the state dir is thrown away.
/// EX_TEMPFAIL of sysexits.h.
const EXIT_REMOTE_BEHIND: i32 = 75;

impl From<MountError> for Failed {
    fn from(e: MountError) -> Self {
        let code = match &e {
            MountError::Unmount(keel::workspace::SessionError::Finish(_)) => EXIT_REMOTE_BEHIND,
            _ => super::EXIT_FAILED,
        };
        Failed {
            code,
            line: e.to_string(),
        }
    }
}

fn on_off(v: &str) -> Result<bool, MountError> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(MountError::NotOnOff),
    }
}

fn duration(v: &str) -> Result<Duration, keel::config::units::UnitError> {
    keel::config::units::parse_duration(v)
}

/// The config with the flags over its `[workspace]` table, checked.
fn config(config: Option<&Path>, a: &MountArgs) -> Result<Config, Failed> {
    for (gone, flag) in [(&a.io_uring, "--io-uring"), (&a.ring_sched, "--ring-sched")] {
        if gone.is_some() {
            return Err(Failed::usage(format!(
                "{flag} is gone: keel serves FUSE over /dev/fuse only (drop the option)"
            )));
        }
    }
    let mut cfg = Config::resolve(config).map_err(Failed::usage)?;
    a.lease.apply(&mut cfg);
    let ws = &mut cfg.workspace;
    if let Some(s) = &a.state {
        ws.state_dir = absolute(s);
    }
    ws.mount_point = absolute(&a.mount_point);
    if let Some(n) = &a.fsname {
        ws.fsname = Some(n.clone());
    }
    ws.cache = a.cache.unwrap_or(ws.cache);
    ws.passthrough = a.passthrough.unwrap_or(ws.passthrough);
    ws.writeback_cache = a.writeback_cache.unwrap_or(ws.writeback_cache);
    ws.attr_timeout = a.attr_timeout.unwrap_or(ws.attr_timeout);
    ws.entry_timeout = a.entry_timeout.unwrap_or(ws.entry_timeout);
    ws.negative_timeout = a.negative_timeout.unwrap_or(ws.negative_timeout);
    ws.threads = a.threads.map_or(ws.threads, usize::from);
    ws.validate().map_err(|e| Failed::usage(e.to_string()))?;
    Ok(cfg)
}

pub fn main(config_file: Option<&Path>, a: MountArgs) -> i32 {
    report("mount", || {
        let cfg = config(config_file, &a)?;
        mount_foreground(&cfg, a.record_changes)?;
        Ok(0)
    })
}

/// Mounts `cfg`'s workspace like `keel run` does (lock, lease, restore of an empty state
/// dir, checkpoints: `boot::workspace`) and serves it until a stop signal or an unmount from
/// outside, then saves and unmounts; SIGUSR1 logs the count of FUSE requests served. The
/// control API's Unix socket (`control::start_socket`) is up from the mount to the end of the
/// unmount: `keel checkpoint`, `keel gc` and the agent commands reach the mount there.
fn mount_foreground(cfg: &Config, record_changes: bool) -> Result<(), MountError> {
    use keel::sys::fgsig::{Stop, StopSignals};
    let signals = StopSignals::block().map_err(MountError::BlockSignals)?;
    let mut ws = keel::boot::workspace::start(cfg).map_err(MountError::Start)?;
    // The model is filled before the socket serves it: the first client sees the mount, and
    // its checkpoint reaches the checkpoint service, not the default flush.
    let status = keel::control::StatusHandle::new(cfg);
    status.mounted(cfg, ws.mounted());
    // Nothing to supervise: `/health` is ok while the workspace is mounted.
    status.set_services(Vec::new(), None);
    if let Some(p) = ws.persist() {
        keel::control::publish_checkpoints(&status, p);
    }
    let control = match keel::control::start_socket(cfg, &status) {
        Ok(c) => c,
        Err(e) => {
            // Saved and unmounted as at a stop, so the failure leaves nothing behind (and
            // nothing holds the checkpoint service beside the final checkpoint).
            status.unmounting();
            if let Err(u) = ws.unmount() {
                tracing::warn!(error = %u, "unmount after the control socket failed");
            }
            return Err(MountError::Control(e));
        }
    };
    let mounted = ws.mounted().expect("keel mount mounts FUSE");
    if record_changes {
        if let Err(e) = mounted.handle().watch() {
            tracing::warn!(error = %e, "cannot start the change feed");
        }
    }
    loop {
        match signals.wait_or(mounted.ended().fd()) {
            // SIGUSR1: the counters (benchmarks divide keel's CPU time by the requests).
            Ok(Stop::Signal("SIGUSR1")) => {
                let h = mounted.handle();
                tracing::info!(
                    fuse_requests = h.fuse_requests(),
                    fuse_requests_unwaited = h.fuse_requests_unwaited(),
                    sql_statements = keel::meta::statements_run(),
                    by_op = %keel::workspace::metrics::requests_by_op(),
                    "counters"
                );
                continue;
            }
            Ok(Stop::Signal(sig)) => tracing::info!(signal = sig, "stopping"),
            Ok(Stop::Ended) => {
                tracing::warn!(
                    mount_point = %mounted.mount_point().display(),
                    "the workspace was unmounted from outside (or its connection aborted); saving and stopping"
                );
                // No stop signal: no grace period runs out, so the final checkpoint is not
                // cut at `[persist] flush_timeout` (a save whose outcome depended on the
                // machine's load).
                if let Some(s) = ws.persist_mut() {
                    s.set_final_unbounded();
                }
            }
            Err(e) => tracing::warn!(error = %e, "waiting for signals failed; unmounting"),
        }
        break;
    }
    control.status().unmounting();
    let r = ws.unmount().map_err(MountError::Unmount);
    control.stop();
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use keel::config::Takeover;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: MountArgs,
    }

    fn parse(args: &[&str]) -> Result<MountArgs, clap::Error> {
        T::try_parse_from(std::iter::once("mount").chain(args.iter().copied())).map(|t| t.a)
    }

    #[test]
    fn flags_override_the_config() {
        let a = parse(&[
            "--state",
            "/s",
            "/m",
            "--cache=kernel",
            "--threads",
            "4",
            "--attr-timeout",
            "2s",
            "--writeback-cache=off",
            "--passthrough",
            "on",
            "--takeover",
        ])
        .unwrap();
        let cfg = config(None, &a).unwrap();
        let ws = &cfg.workspace;
        assert_eq!(ws.state_dir, Path::new("/s"));
        assert_eq!(ws.mount_point, Path::new("/m"));
        assert_eq!(ws.cache, CacheMode::Kernel);
        assert_eq!(ws.threads, 4);
        assert_eq!(ws.attr_timeout, Duration::from_secs(2));
        assert!(!ws.writeback_cache);
        assert_eq!(ws.passthrough, Switch::On);
        assert_eq!(cfg.persist.takeover, Takeover::Force);
        assert_eq!(ws.fsname(), "keel:/s");
        let a = parse(&["--state", "s", "/m", "--fsname", "keel:scratch"]).unwrap();
        let cfg = config(None, &a).unwrap();
        assert_eq!(cfg.workspace.fsname(), "keel:scratch");
        // The default names the state dir made absolute.
        let a = parse(&["--state", "rel/s", "/m"]).unwrap();
        let want = format!(
            "keel:{}",
            std::env::current_dir().unwrap().join("rel/s").display()
        );
        assert_eq!(config(None, &a).unwrap().workspace.fsname(), want);
    }

    #[test]
    fn bad_input_is_a_usage_error() {
        for bad in [
            &["--threads", "0", "/m"][..],
            &["--bogus", "/m"],
            &["/a", "/b"],
            &["--state"],
            &["--passthrough", "yes", "/m"],
            &["--takeover=x", "/m"],
            &["--writeback-cache", "maybe", "/m"],
            &["/m", "--fsname"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let e = config(None, &parse(&["--fsname", "", "/m"]).unwrap()).unwrap_err();
        assert_eq!(e.line, "workspace.fsname: must not be empty");
        assert_eq!(e.code, 2);
        let e = config(None, &parse(&["--io-uring=off", "/m"]).unwrap()).unwrap_err();
        assert_eq!(
            e.line,
            "--io-uring is gone: keel serves FUSE over /dev/fuse only (drop the option)"
        );
        assert_eq!(e.code, 2);
        let e = config(None, &parse(&["--ring-sched", "idle", "/m"]).unwrap()).unwrap_err();
        assert!(e.line.starts_with("--ring-sched is gone"), "{}", e.line);
    }
}

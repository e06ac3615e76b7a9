//! `keel mount`: mounts the workspace in the foreground until SIGTERM/SIGINT/SIGHUP, then
//! syncs and unmounts; SIGUSR1 logs the count of FUSE requests served. Options override the `[workspace]` table of the config file.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::config::units::parse_duration;
use crate::config::{Config, Switch};
use crate::sys::fgsig::{Stop, StopSignals};
use std::time::Duration;

const USAGE: &str = "usage: keel mount --state DIR MOUNTPOINT [--cache auto|kernel|none]
       [--passthrough auto|on|off] [--writeback-cache on|off] [--threads N]
       [--attr-timeout D] [--entry-timeout D] [--negative-timeout D] [--config FILE]
       [--takeover[=wait|force]]";

/// Parsed `keel mount` arguments.
#[derive(Debug, Default, PartialEq)]
pub struct MountArgs {
    pub state: Option<PathBuf>,
    pub mount_point: Option<PathBuf>,
    pub cache: Option<String>,
    pub passthrough: Option<Switch>,
    pub writeback_cache: Option<bool>,
    pub attr_timeout: Option<Duration>,
    pub entry_timeout: Option<Duration>,
    pub negative_timeout: Option<Duration>,
    pub threads: Option<usize>,
    pub config: Option<PathBuf>,
    /// Over `[persist] takeover`; a bare `--takeover` is `force`.
    pub takeover: Option<crate::config::Takeover>,
}

pub fn parse(args: Vec<OsString>) -> Result<MountArgs, String> {
    let mut out = MountArgs::default();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy().into_owned();
        let (flag, inline) = match s.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (s.clone(), None),
        };
        let mut value = |name: &str| -> Result<OsString, String> {
            match &inline {
                Some(v) => Ok(OsString::from(v)),
                None => it.next().ok_or_else(|| format!("{name} needs a value")),
            }
        };
        match flag.as_str() {
            "--takeover" => {
                out.takeover = Some(match &inline {
                    None => crate::config::Takeover::Force,
                    Some(v) => v.parse().map_err(|e| format!("--takeover: {e}"))?,
                })
            }
            "--state" => out.state = Some(PathBuf::from(value("--state")?)),
            "--cache" => out.cache = Some(value("--cache")?.to_string_lossy().into_owned()),
            "--passthrough" => {
                let v = value(&flag)?.to_string_lossy().into_owned();
                out.passthrough = Some(v.parse().map_err(|e| format!("{flag}: {e}"))?);
            }
            "--io-uring" | "--ring-sched" => {
                return Err(format!(
                    "{flag} is gone: keel serves FUSE over /dev/fuse only (drop the option)"
                ))
            }
            "--threads" => {
                let v = value("--threads")?;
                let n = v
                    .to_str()
                    .and_then(|v| v.parse().ok())
                    .filter(|n| (1..=64).contains(n))
                    .ok_or_else(|| {
                        format!(
                            "--threads: `{}` is not a number from 1 to 64",
                            v.to_string_lossy()
                        )
                    })?;
                out.threads = Some(n);
            }
            "--writeback-cache" => {
                out.writeback_cache = Some(match value("--writeback-cache")?.to_str() {
                    Some("on") => true,
                    Some("off") => false,
                    _ => return Err("--writeback-cache: expected on or off".into()),
                })
            }
            "--attr-timeout" | "--entry-timeout" | "--negative-timeout" => {
                let v = value(&flag)?;
                let d = parse_duration(&v.to_string_lossy()).map_err(|e| format!("{flag}: {e}"))?;
                match flag.as_str() {
                    "--attr-timeout" => out.attr_timeout = Some(d),
                    "--entry-timeout" => out.entry_timeout = Some(d),
                    _ => out.negative_timeout = Some(d),
                }
            }
            "--config" => out.config = Some(PathBuf::from(value("--config")?)),
            "-h" | "--help" => return Err(USAGE.to_string()),
            f if f.starts_with('-') => return Err(format!("unknown option `{f}`\n{USAGE}")),
            _ => {
                if out.mount_point.is_some() {
                    return Err(format!("unexpected argument `{s}`\n{USAGE}"));
                }
                out.mount_point = Some(PathBuf::from(a));
            }
        }
    }
    Ok(out)
}

fn absolute(p: PathBuf) -> PathBuf {
    if p.is_absolute() {
        p
    } else {
        std::env::current_dir().map(|d| d.join(&p)).unwrap_or(p)
    }
}

pub fn mount_main(args: Vec<OsString>) -> i32 {
    crate::logging::init();
    let a = match parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("keel: mount: {e}");
            return 2;
        }
    };
    let config_path = a
        .config
        .clone()
        .or_else(|| std::env::var_os("KEEL_CONFIG").map(PathBuf::from));
    let mut cfg = match &config_path {
        Some(p) => match Config::load(p) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("keel: {e}");
                return 2;
            }
        },
        None => Config::default(),
    };
    if let Some(t) = a.takeover {
        cfg.persist.takeover = t;
    }
    let ws = &mut cfg.workspace;
    if let Some(s) = a.state {
        ws.state_dir = absolute(s);
    }
    match a.mount_point {
        Some(m) => ws.mount_point = absolute(m),
        None => {
            eprintln!("keel: mount: missing MOUNTPOINT\n{USAGE}");
            return 2;
        }
    }
    if let Some(c) = a.cache {
        match c.parse() {
            Ok(c) => ws.cache = c,
            Err(e) => {
                eprintln!("keel: mount: --cache: {e}");
                return 2;
            }
        }
    }
    ws.passthrough = a.passthrough.unwrap_or(ws.passthrough);
    if let Some(w) = a.writeback_cache {
        ws.writeback_cache = w;
    }
    ws.attr_timeout = a.attr_timeout.unwrap_or(ws.attr_timeout);
    ws.entry_timeout = a.entry_timeout.unwrap_or(ws.entry_timeout);
    ws.negative_timeout = a.negative_timeout.unwrap_or(ws.negative_timeout);
    if let Some(t) = a.threads {
        ws.threads = t;
    }
    if let Err((key, reason)) = ws.validate() {
        eprintln!("keel: mount: {key}: {reason}");
        return 2;
    }
    let signals = match StopSignals::block() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("keel: mount: block signals: {e}");
            return 1;
        }
    };
    let mounted = match mount(&cfg) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("keel: mount: {e}");
            return 1;
        }
    };
    loop {
        match signals.wait_or(mounted.ended().fd()) {
            // SIGUSR1: the counters (benchmarks divide keel's CPU time by the requests).
            Ok(Stop::Signal("SIGUSR1")) => {
                let h = mounted.handle();
                tracing::info!(
                    fuse_requests = h.fuse_requests(),
                    fuse_requests_unwaited = h.fuse_requests_unwaited(),
                    "counters"
                );
                continue;
            }
            Ok(Stop::Signal(sig)) => tracing::info!(signal = sig, "stopping"),
            Ok(Stop::Ended) => tracing::warn!(
                mount_point = %mounted.mount_point().display(),
                "the workspace was unmounted from outside (or its connection aborted); saving and stopping"
            ),
            Err(e) => tracing::warn!(error = %e, "waiting for signals failed; unmounting"),
        }
        break;
    }
    match mounted.unmount() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("keel: mount: {e}");
            1
        }
    }
}

/// Mounts like `keel run` does: an empty state dir with a configured remote that holds a
/// snapshot gets it back first (lazily by default), under the lease, so a fresh state dir
/// never starts empty and checkpoints an empty tree over the workspace.
fn mount(cfg: &Config) -> Result<crate::workspace::Mounted, String> {
    if !crate::persist::cli::restore_wanted(cfg) {
        return crate::workspace::mount_persistent(&cfg.workspace, &cfg.persist)
            .map_err(|e| e.to_string());
    }
    let mut lease = crate::persist::cli::lease_and_restore(cfg).map_err(|e| e.to_string())?;
    crate::workspace::session::mount_persistent_leased(&cfg.workspace, &cfg.persist, lease.take())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn parses_all_options() {
        let a = parse(args(&[
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
        ]))
        .unwrap();
        assert_eq!(a.attr_timeout, Some(Duration::from_secs(2)));
        assert_eq!(a.writeback_cache, Some(false));
        assert_eq!(a.state, Some(PathBuf::from("/s")));
        assert_eq!(a.mount_point, Some(PathBuf::from("/m")));
        assert_eq!(a.cache.as_deref(), Some("kernel"));
        assert_eq!(a.threads, Some(4));
        assert_eq!(a.passthrough, Some(Switch::On));
    }

    #[test]
    fn rejects_bad_input() {
        assert!(parse(args(&["--threads", "0", "/m"])).is_err());
        assert!(parse(args(&["--bogus"])).is_err());
        assert!(parse(args(&["/a", "/b"])).is_err());
        assert!(parse(args(&["--state"])).is_err());
        let e = parse(args(&["--passthrough", "yes", "/m"])).unwrap_err();
        assert_eq!(e, "--passthrough: `yes` is not one of auto, on, off");
        let e = parse(args(&["--io-uring=off", "/m"])).unwrap_err();
        assert_eq!(
            e,
            "--io-uring is gone: keel serves FUSE over /dev/fuse only (drop the option)"
        );
        let e = parse(args(&["--ring-sched", "idle", "/m"])).unwrap_err();
        assert!(e.starts_with("--ring-sched is gone"), "{e}");
        let a = parse(args(&["/m", "--takeover"])).unwrap();
        assert_eq!(a.takeover, Some(crate::config::Takeover::Force));
        let a = parse(args(&["--takeover=wait", "/m"])).unwrap();
        assert_eq!(a.takeover, Some(crate::config::Takeover::Wait));
        assert_eq!(a.mount_point, Some(PathBuf::from("/m")));
        assert!(parse(args(&["--takeover=x", "/m"])).is_err());
    }
}

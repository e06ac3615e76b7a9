//! The persist subcommands: `keel checkpoint`, `keel gc`, `keel fsck`, `keel snapshot
//! list|restore`. Each talks to the running keel over the control socket when the state
//! dir is mounted, and otherwise locks the state dir and works on it directly.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::checkpoint::{CheckpointOptions, Persister};
use super::fsck::{fsck, FsckOptions, Level};
use super::{control, gc, open_remote, params, restore, Repo};
use crate::config::Config;
use crate::sys;

pub const USAGE: &str = "usage:
  keel checkpoint [--state DIR] [--config FILE] [--full] [--takeover[=wait|force]]
  keel gc [--state DIR] [--config FILE]
  keel fsck --state DIR [--repair] [--quick] [--no-remote] [--config FILE]
  keel snapshot list [--state DIR | --remote URL] [--config FILE]
  keel snapshot restore ID|latest --state DIR [--remote URL] [--config FILE]";

#[derive(Debug, Default)]
pub(super) struct Args {
    pub(super) state: Option<PathBuf>,
    pub(super) config: Option<PathBuf>,
    pub(super) remote: Option<String>,
    takeover: Option<crate::config::Takeover>,
    flags: Vec<String>,
    positional: Vec<String>,
}

/// One argument of a persist subcommand, as `each_flag` hands it over: `--flag value`,
/// `--flag=value`, a bare flag or a positional argument.
pub(super) struct Flag<'a> {
    /// The flag (`--state` of `--state=x`), or the whole argument when it has no `=value`.
    pub(super) name: &'a str,
    /// The argument as given.
    pub(super) arg: &'a str,
    /// The `=value` part, if any.
    pub(super) inline: Option<&'a str>,
    rest: &'a mut dyn Iterator<Item = String>,
}

impl Flag<'_> {
    /// The flag's value: its `=value`, else the next argument.
    pub(super) fn value(&mut self) -> Result<String, String> {
        match self.inline {
            Some(v) => Ok(v.to_string()),
            None => self
                .rest
                .next()
                .ok_or_else(|| format!("{} needs a value", self.name)),
        }
    }
}

/// The flag loop of every persist subcommand: calls `each` once per argument, in order
/// (a flag's value taken with `Flag::value` is not handed over again).
pub(super) fn each_flag(
    args: Vec<OsString>,
    mut each: impl FnMut(&mut Flag<'_>) -> Result<(), String>,
) -> Result<(), String> {
    let mut it = args.into_iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(a) = it.next() {
        let (name, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v)),
            _ => (a.as_str(), None),
        };
        each(&mut Flag {
            name,
            arg: &a,
            inline,
            rest: &mut it,
        })?;
    }
    Ok(())
}

impl Args {
    /// `--state DIR` and `--config FILE`, which every subcommand takes. `Ok(false)`: `f` is
    /// neither.
    pub(super) fn common_flag(&mut self, f: &mut Flag<'_>) -> Result<bool, String> {
        match f.name {
            "--state" => self.state = Some(PathBuf::from(f.value()?)),
            "--config" => self.config = Some(PathBuf::from(f.value()?)),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

fn parse(args: Vec<OsString>) -> Result<Args, String> {
    let mut out = Args::default();
    each_flag(args, |f| {
        if out.common_flag(f)? {
            return Ok(());
        }
        match f.name {
            "--takeover" => {
                out.takeover = Some(match f.inline {
                    None => crate::config::Takeover::Force,
                    Some(v) => v.parse().map_err(|e| format!("--takeover: {e}"))?,
                })
            }
            "--remote" => out.remote = Some(f.value()?),
            "--full" | "--repair" | "--quick" | "--no-remote" => out.flags.push(f.name.to_string()),
            "-h" | "--help" => return Err(USAGE.into()),
            n if n.starts_with('-') => return Err(format!("unknown option `{n}`\n{USAGE}")),
            _ => out.positional.push(f.arg.to_string()),
        }
        Ok(())
    })?;
    Ok(out)
}

fn absolute(p: PathBuf) -> PathBuf {
    if p.is_absolute() {
        p
    } else {
        std::env::current_dir().map(|d| d.join(&p)).unwrap_or(p)
    }
}

pub(super) fn load(a: &Args) -> Result<Config, String> {
    let path = a
        .config
        .clone()
        .or_else(|| std::env::var_os("KEEL_CONFIG").map(PathBuf::from));
    let mut cfg = match path {
        Some(p) => Config::load(&p).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    if let Some(s) = &a.state {
        cfg.workspace.state_dir = absolute(s.clone());
    }
    if let Some(r) = &a.remote {
        cfg.persist.remote = r.clone();
    }
    if let Some(t) = a.takeover {
        cfg.persist.takeover = t;
    }
    cfg.persist
        .validate()
        .map_err(|(k, r)| format!("{k}: {r}"))?;
    Ok(cfg)
}

pub(super) fn repo_of(cfg: &Config) -> Result<Repo, String> {
    let url = cfg
        .persist
        .remote_url(&cfg.workspace.state_dir)
        .ok_or_else(|| "no remote configured ([persist] remote = \"none\")".to_string())?;
    open_remote(&url, &cfg.persist).map_err(|e| e.to_string())
}

/// A remote is configured and the state dir has no workspace yet: `restore_on_start` asks
/// the remote for a snapshot.
pub fn restore_wanted(cfg: &Config) -> bool {
    !cfg.persist.remote.is_empty() && !cfg.workspace.state_dir.join("meta.db").exists()
}

/// Why `lease_and_restore` failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Lease(#[from] super::lease::LeaseError),
    #[error("restore from the remote: {0}")]
    Restore(String),
}

/// What `keel run` and `keel mount` do before mounting: take the single-writer lease before
/// anything reads or writes the remote, then give an empty state dir the remote's latest
/// snapshot (`restore_on_start`). The lease is released on drop unless taken out of it.
pub fn lease_and_restore(cfg: &Config) -> Result<super::lease::ReleaseOnDrop, StartError> {
    // Private before anything is written there; a dir that cannot be made is reported by
    // the steps that need it.
    if let Err(e) = super::secure_at_start(&cfg.workspace.state_dir, Some(&cfg.persist)) {
        tracing::warn!(state = %cfg.workspace.state_dir.display(), error = %e, "cannot make the state dir private");
    }
    let lease = super::lease::ReleaseOnDrop::new(super::acquire_lease(
        &cfg.workspace.state_dir,
        &cfg.persist,
        false,
    )?);
    match restore_on_start(cfg) {
        Ok(Some(what)) => tracing::info!("{what}"),
        Ok(None) => {}
        Err(e) => return Err(StartError::Restore(e)),
    }
    Ok(lease)
}

/// At start with an empty state dir and a configured remote that holds a snapshot, restores
/// the remote's head first: a fresh container with no state volume gets its workspace back.
/// `Ok(None)`: nothing to do (state present, default remote, or an empty remote).
pub fn restore_on_start(cfg: &Config) -> Result<Option<String>, String> {
    let state = &cfg.workspace.state_dir;
    if !restore_wanted(cfg) {
        return Ok(None);
    }
    let _lock = lock_offline(state)?;
    let mut repo = repo_of(cfg)?;
    let mode = restore_mode(cfg, &mut repo);
    match restore::restore_with(&mut repo, None, state, false, mode) {
        Ok(r) => Ok(Some(format!(
            "restored snapshot {} from {} ({}): {} files, {} bytes, {} chunks fetched, {} windows left to fetch on first use, in {:.2}s",
            r.seq,
            repo.describe(),
            if mode == restore::RestoreMode::Lazy { "lazy" } else { "eager" },
            r.files,
            r.file_bytes,
            r.chunks_fetched,
            r.windows_missing,
            r.elapsed_s
        ))),
        Err(restore::RestoreError::NoSnapshot(_)) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// The configured restore mode; lazy needs the snapshot's window size to be the configured
/// one (the filesystem fetches by window), else the restore is eager.
fn restore_mode(cfg: &Config, repo: &mut Repo) -> restore::RestoreMode {
    if cfg.persist.restore == crate::config::persist::RestoreMode::Eager {
        return restore::RestoreMode::Eager;
    }
    let cs = restore::resolve_seq(repo, None)
        .ok()
        .and_then(|seq| repo.read_header(seq).ok())
        .map(|h| h.chunk_size);
    match cs {
        Some(cs) if cs != cfg.workspace.chunk_size => {
            tracing::warn!(
                snapshot_chunk_size = cs,
                chunk_size = cfg.workspace.chunk_size,
                "the snapshot was cut into other windows than [workspace] chunk_size: restoring eagerly"
            );
            restore::RestoreMode::Eager
        }
        _ => restore::RestoreMode::Lazy,
    }
}

/// Locks a state dir that no running keel holds.
pub(super) fn lock_offline(state: &Path) -> Result<sys::file::LockFile, String> {
    super::private::create_dir_all(state).map_err(|e| format!("{}: {e}", state.display()))?;
    sys::file::try_lock(&state.join("lock"))
        .map_err(|e| format!("lock {}: {e}", state.display()))?
        .ok_or_else(|| {
            format!(
                "state dir {} is in use by a running keel that does not answer on persist.sock (checkpoints off, or still starting)",
                state.display()
            )
        })
}

/// Asks the running keel; while the state dir is locked but the socket is not up yet (keel
/// is starting), retries for a few seconds. `None`: no keel runs there.
pub(super) fn ask(state: &Path, cmd: &str) -> Result<Option<String>, String> {
    let t0 = std::time::Instant::now();
    loop {
        if let Some(r) = control::request(state, cmd, Duration::from_secs(3600))? {
            return Ok(Some(r));
        }
        let held = state.join("lock").exists()
            && sys::file::try_lock(&state.join("lock"))
                .ok()
                .flatten()
                .is_none();
        if !held || t0.elapsed() > Duration::from_secs(5) {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub(super) fn run(what: &str, f: impl FnOnce() -> Result<i32, String>) -> i32 {
    crate::logging::init();
    match f() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("keel: {what}: {e}");
            1
        }
    }
}

pub fn checkpoint_main(args: Vec<OsString>) -> i32 {
    run("checkpoint", || {
        let a = parse(args)?;
        let cfg = load(&a)?;
        let full = a.flags.iter().any(|f| f == "--full");
        let state = &cfg.workspace.state_dir;
        let cmd = if full {
            "checkpoint full"
        } else {
            "checkpoint"
        };
        if let Some(mp) = ask(state, "mount-point")? {
            // Push what the kernel still caches for the mount into keel first; from this
            // process, so a keel killed meanwhile cannot deadlock on its own mount.
            if let Err(e) = sys::file::syncfs(Path::new(&mp)) {
                eprintln!("keel: checkpoint: syncfs {mp}: {e} (checkpointing what keel has)");
            }
        }
        if let Some(r) = control::request(state, cmd, Duration::from_secs(3600))? {
            println!("{r}");
            return Ok(0);
        }
        // keel run without persist.sock: its HTTP control API may still take the request.
        let http = crate::control::default_socket(&cfg);
        if http.exists() {
            if let Ok((code, body)) = crate::control::client::request(&http, "POST", "/checkpoint")
            {
                println!("{}", body.trim());
                return Ok(if code == 200 { 0 } else { 1 });
            }
        }
        let _lock = lock_offline(state)?;
        let mut p = Persister::open(state, repo_of(&cfg)?, params(&cfg.workspace, &cfg.persist))
            .map_err(|e| e.to_string())?;
        // The head moves: only as the workspace's one writer.
        let mut lease =
            super::acquire_lease(state, &cfg.persist, true).map_err(|e| e.to_string())?;
        if let Some(l) = lease.as_mut() {
            l.start_renewal()
                .map_err(|e| format!("start lease renewal: {e}"))?;
            p.set_lease(Some(l.handle()));
        }
        let _lease = super::lease::ReleaseOnDrop::new(lease);
        match p.checkpoint(&CheckpointOptions {
            full,
            progress: true,
            ..Default::default()
        }) {
            Ok(r) => {
                println!("{r}");
                Ok(0)
            }
            Err(e) => {
                let b = p.backlog().map(|b| b.to_string()).unwrap_or_default();
                Err(format!("{e}; {b}"))
            }
        }
    })
}

pub fn gc_main(args: Vec<OsString>) -> i32 {
    run("gc", || {
        let a = parse(args)?;
        let cfg = load(&a)?;
        let state = &cfg.workspace.state_dir;
        if let Some(r) = ask(state, "gc")? {
            println!("{r}");
            return Ok(0);
        }
        let _lock = lock_offline(state)?;
        let mut repo = repo_of(&cfg)?;
        let store = if state.join("meta.db").exists() {
            Some(
                crate::meta::Store::open(
                    &state.join("meta.db"),
                    crate::meta::Nanos(super::checkpoint::now_ns()),
                )
                .map_err(|e| e.to_string())?,
            )
        } else {
            None
        };
        let r = gc::gc(
            &mut repo,
            store.as_ref(),
            cfg.persist.keep,
            cfg.persist.gc_grace,
        )
        .map_err(|e| e.to_string())?;
        println!("{r}");
        Ok(0)
    })
}

pub fn fsck_main(args: Vec<OsString>) -> i32 {
    run("fsck", || {
        let a = parse(args)?;
        if a.state.is_none() {
            return Err(format!("--state DIR is required\n{USAGE}"));
        }
        let cfg = load(&a)?;
        let state = &cfg.workspace.state_dir;
        let _lock = lock_offline(state)?;
        let remote = if a.flags.iter().any(|f| f == "--no-remote") {
            None
        } else {
            // The remote this state dir checkpointed to, if any.
            cfg.persist
                .remote_url(state)
                .filter(|u| !u.starts_with("file://") || Path::new(&u[7..]).exists())
                .map(|u| open_remote(&u, &cfg.persist))
                .transpose()
                .map_err(|e| e.to_string())?
        };
        let opts = FsckOptions {
            repair: a.flags.iter().any(|f| f == "--repair"),
            quick: a.flags.iter().any(|f| f == "--quick"),
            chunk_size: cfg.workspace.chunk_size,
            remote,
            progress: true,
        };
        let r = fsck(state, &opts).map_err(|e| e.to_string())?;
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
        println!(
            "fsck {}: {} inodes, {} entries, {} bodies, {} windows re-hashed, {} remote chunks verified; {} errors, {} warnings, {} repaired ({:.2}s)",
            state.display(),
            r.inodes,
            r.entries,
            r.bodies,
            r.windows_hashed,
            r.chunks_checked,
            r.count(Level::Error),
            r.count(Level::Warning),
            r.findings.iter().filter(|f| f.repaired).count(),
            r.elapsed_s
        );
        Ok(if r.is_clean() { 0 } else { 1 })
    })
}

pub fn snapshot_main(mut args: Vec<OsString>) -> i32 {
    if let Some(sub) = args.first().map(|a| a.to_string_lossy().into_owned()) {
        if let Some(code) = super::agent_cli::snapshot_main(&sub, args[1..].to_vec()) {
            return code;
        }
    }
    run("snapshot", || {
        if args.is_empty() {
            return Err(USAGE.into());
        }
        let sub = args.remove(0).to_string_lossy().into_owned();
        let a = parse(args)?;
        let cfg = load(&a)?;
        match sub.as_str() {
            "list" => {
                let repo = repo_of(&cfg)?;
                let head = repo
                    .read_head()
                    .map_err(|e| e.to_string())?
                    .map(|h| h.0.seq);
                let snaps = repo.list_snapshots().map_err(|e| e.to_string())?;
                println!(
                    "{:>8}  {:<5}  {:>8}  {:>10}  {:>14}  created",
                    "id", "kind", "parent", "inodes", "file bytes"
                );
                for (seq, info) in snaps {
                    match repo.read_header(seq) {
                        Ok(h) => println!(
                            "{:>8}  {:<5}  {:>8}  {:>10}  {:>14}  {}{}",
                            seq,
                            if h.is_full() { "full" } else { "delta" },
                            h.parent
                                .map(|p| p.to_string())
                                .unwrap_or_else(|| "-".into()),
                            h.inodes,
                            h.file_bytes,
                            fmt_time(h.created_ns),
                            if Some(seq) == head { "  (head)" } else { "" }
                        ),
                        Err(e) => println!("{seq:>8}  unreadable ({} bytes): {e}", info.size),
                    }
                }
                Ok(0)
            }
            "restore" => {
                let id = a
                    .positional
                    .first()
                    .ok_or_else(|| format!("missing snapshot ID\n{USAGE}"))?;
                let seq = if id == "latest" || id == "head" {
                    None
                } else {
                    Some(
                        id.parse::<u64>()
                            .map_err(|_| format!("`{id}` is not a snapshot id"))?,
                    )
                };
                if a.state.is_none() {
                    return Err(format!("--state DIR is required\n{USAGE}"));
                }
                let state = &cfg.workspace.state_dir;
                if cfg.persist.remote.is_empty() {
                    return Err("--remote URL (or [persist] remote) is required: the default remote lives inside the state dir being restored".into());
                }
                let _lock = lock_offline(state)?;
                let mut repo = repo_of(&cfg)?;
                let r = restore::restore(&mut repo, seq, state, true).map_err(|e| e.to_string())?;
                println!(
                    "restored snapshot {} into {}: {} inodes, {} files, {} bytes, {} chunks fetched ({} bytes) in {:.2}s",
                    r.seq,
                    state.display(),
                    r.inodes,
                    r.files,
                    r.file_bytes,
                    r.chunks_fetched,
                    r.bytes_fetched,
                    r.elapsed_s
                );
                Ok(0)
            }
            other => Err(format!("unknown snapshot command `{other}`\n{USAGE}")),
        }
    })
}

pub(crate) fn fmt_time(ns: i64) -> String {
    let s = ns.div_euclid(1_000_000_000);
    let (days, rem) = (s.div_euclid(86400), s.rem_euclid(86400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn parses_flags_values_and_positionals() {
        let a = parse(args(&[
            "--state=/s",
            "--config",
            "c.toml",
            "--remote",
            "file:///r",
            "--full",
            "--takeover=wait",
            "7",
        ]))
        .unwrap();
        assert_eq!(a.state.as_deref(), Some(Path::new("/s")));
        assert_eq!(a.config.as_deref(), Some(Path::new("c.toml")));
        assert_eq!(a.remote.as_deref(), Some("file:///r"));
        assert_eq!(a.flags, ["--full"]);
        assert_eq!(a.takeover, Some(crate::config::Takeover::Wait));
        assert_eq!(a.positional, ["7"]);
        assert_eq!(
            parse(args(&["--takeover"])).unwrap().takeover,
            Some(crate::config::Takeover::Force)
        );
        assert_eq!(
            parse(args(&["--state"])).unwrap_err(),
            "--state needs a value"
        );
        assert!(parse(args(&["--bogus=1"]))
            .unwrap_err()
            .starts_with("unknown option `--bogus`\nusage:"));
        assert_eq!(parse(args(&["--help"])).unwrap_err(), USAGE);
    }
}

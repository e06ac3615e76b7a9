//! `keel run`: load the config, then the boot order — block signals →
//! boot (subreaper, `chdir /`, container mounts, limits) → control API → resolve services →
//! check and mount the workspace → supervise → stop → flush + unmount the workspace → stop the
//! control API → exit code. Each step publishes into the control API's `StatusHandle`.
//! A bad config or a failed boot step ends here with one line and nothing started or mounted.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Instant;

use tracing::{error, info};

use crate::boot::workspace::Workspace;
use crate::boot::{self, WorkspacePlan};
use crate::config::Config;
use crate::supervisor::Supervisor;

/// Why `keel run` stopped before supervising anything.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Signals(#[from] crate::sys::signal::SignalError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Supervisor(#[from] crate::supervisor::SupervisorError),
    #[error("workspace: {0}")]
    Workspace(#[source] boot::workspace::StartError),
    #[error(transparent)]
    Lease(crate::persist::lease::LeaseError),
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error(transparent)]
    Credentials(#[from] crate::config::credentials::CredentialsError),
    #[error("{0} (or set [init] isolate_state = false)")]
    Isolate(crate::sys::ns::NsError),
}

impl From<boot::workspace::StartError> for RunError {
    /// A refused lease says so on its own (it names the holder and the way out).
    fn from(e: boot::workspace::StartError) -> Self {
        match e {
            boot::workspace::StartError::Lease(l) => RunError::Lease(l),
            e => RunError::Workspace(e),
        }
    }
}

/// What `keel run` was asked for on its command line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// `--config` or `KEEL_CONFIG` (see `Config::resolve`).
    pub config: Option<PathBuf>,
    /// `--takeover[=refuse|wait|force]` (bare: force), over `[persist] takeover`.
    pub takeover: Option<crate::config::Takeover>,
    /// The main command and its arguments (may be empty when services are configured).
    pub command: Vec<OsString>,
}

/// Entry point of `keel run`: the main command's exit code once everything has stopped,
/// or why nothing was started (already logged; `cli` turns it into keel's exit code).
pub fn main(args: RunOptions) -> Result<i32, RunError> {
    let t0 = Instant::now();
    // First, before any thread can exist: every signal to keel arrives on the signalfd.
    let signals = match crate::sys::signal::block_all() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("keel: error: {e}");
            return Err(e.into());
        }
    };
    crate::logging::init();
    // Before any child exists: no process keel starts may read keel's memory, environment or
    // root through /proc, or ptrace it, without CAP_SYS_PTRACE.
    if let Err(e) = crate::sys::ns::set_not_dumpable() {
        tracing::warn!("PR_SET_DUMPABLE 0: {e}");
    }
    let (cfg, booted, mut supervisor, mounted, control, processes) = match setup(args, signals) {
        Ok(v) => v,
        Err(e) => {
            error!("{e}");
            return Err(e);
        }
    };
    // Before "ready": a caller that waited for it may start a process at once.
    supervisor.open_exec();
    info!(
        "ready after {} ({})",
        crate::shutdown::secs(t0.elapsed()),
        if booted.pid1 { "PID 1" } else { "subreaper" }
    );
    let code = supervisor.run();
    // Every process is gone: their records finish (output drained, exit published) before
    // the final checkpoint and before the API stops.
    processes.wait_all_done(std::time::Duration::from_secs(2));
    let mut unfinished = None;
    if let Some(m) = mounted {
        let since = Instant::now();
        control.status().unmounting();
        unfinished = crate::shutdown::finish_workspace(m, cfg.shutdown.flush_timeout, since).err();
        control
            .status()
            .set_mount(crate::control::MountState::Unmounted);
    }
    control.stop();
    let took = crate::shutdown::secs(t0.elapsed());
    match unfinished {
        // The last line a platform keeps says what did not reach the remote.
        Some(e) => error!("exit {code} after {took}: {e}"),
        None => info!("exit {code} after {took}"),
    }
    Ok(code)
}

type Setup = (
    Config,
    boot::Booted,
    Supervisor,
    Option<Workspace>,
    crate::control::Control,
    std::sync::Arc<crate::exec::Processes>,
);

/// Everything before supervision, in order; on error nothing has been started or mounted.
fn setup(args: RunOptions, signals: crate::sys::signal::Signals) -> Result<Setup, RunError> {
    let mut cfg = Config::resolve(args.config.as_deref())?;
    if let Some(t) = args.takeover {
        cfg.persist.takeover = t;
    }
    // While keel has one thread: the remote's credentials and the control token leave keel's
    // environment (and its /proc/<pid>/environ) for memory only keel's remote client reads.
    crate::config::credentials::take_from_env(&cfg.init.secret_env);
    // Read once, before anything is mounted: a bad file stops the start here.
    crate::config::credentials::for_config(&cfg.persist)?;
    let booted = boot::boot(&cfg)?;
    // Before anything creates files in the state dir (control socket): the state dir's lock,
    // the single-writer lease before anything reads or writes the remote, the restore of an
    // empty state dir. Released if the start fails from here on.
    // Which provider serves the workspace, before the restore (the `dir` provider's is
    // eager).
    let plan = boot::check_workspace(&cfg)?;
    let prepared = if cfg.init.workspace {
        Some(boot::workspace::prepare_for(
            &cfg,
            matches!(plan, WorkspacePlan::Dir(_)),
        )?)
    } else {
        None
    };
    // The control API runs on its own threads, which inherit the blocked signal mask.
    let control = crate::control::start(&cfg)?;
    let mut supervisor = Supervisor::new(&cfg, args.command, &booted, signals)?;
    supervisor.set_status(control.status().clone());
    // Processes started through the API: the supervisor reaps and stops them, the control
    // API starts and reads them.
    let processes = crate::exec::Processes::new(&cfg);
    supervisor.set_exec(processes.clone());
    control.status().set_exec(processes.clone());
    control.status().mounting(&cfg);
    let main = supervisor
        .main_hold()
        .map(|h| h as std::sync::Arc<dyn crate::persist::agent::MainCommand>);
    let mounted = mount_workspace(&cfg, plan, prepared, main)?;
    if let Some(w) = &mounted {
        give_fresh_workspace_to_user(&cfg, w.mount_point());
        if let Some(p) = w.persist() {
            crate::control::publish_checkpoints(control.status(), p);
        }
    }
    control
        .status()
        .mounted(&cfg, mounted.as_ref().and_then(|w| w.mounted()));
    processes.set_workspace(
        mounted
            .as_ref()
            .and_then(|w| w.mounted())
            .map(|m| m.handle()),
    );
    if let Some(ns) = sandbox_namespace(&cfg, &booted, mounted.as_ref())? {
        supervisor.set_sandbox_ns(ns);
    }
    Ok((cfg, booted, supervisor, mounted, control, processes))
}

/// What the sandbox must not see: the state dir, a local `file://` remote outside it and the
/// credentials file are covered; the default control socket's directory is read-only. A
/// control socket inside a covered directory (a keel that is not PID 1 keeps it in the state
/// dir) is bound into the cover at the same path, read-only, so `keel status`, `keel
/// checkpoint` and the agent commands reach it from inside as they do from outside.
pub fn sandbox_covers(cfg: &Config) -> Vec<(PathBuf, crate::sys::ns::Cover)> {
    use crate::sys::ns::Cover;
    let state = canon(&cfg.workspace.state_dir);
    let mut out = vec![(state.clone(), Cover::EmptyDir)];
    if let Some(url) = cfg.persist.remote_url(&cfg.workspace.state_dir) {
        if let Some(dir) = url.strip_prefix("file://") {
            let dir = canon(std::path::Path::new(dir));
            if !dir.starts_with(&state) {
                out.push((dir, Cover::EmptyDir));
            }
        }
    }
    if let Some(f) = &cfg.persist.credentials_file {
        out.extend(credentials_covers(f, &crate::sys::mount::mount_points()));
    }
    let run = std::path::Path::new(crate::config::control::RUN_SOCKET);
    if let Some(dir) = run.parent().filter(|d| d.is_dir()) {
        out.push((dir.to_path_buf(), Cover::ReadOnly));
    }
    let socket = cfg
        .control
        .socket_path(cfg, crate::sys::process::is_root_pid1())
        .filter(|s| {
            std::fs::symlink_metadata(s).is_ok_and(|m| {
                use std::os::unix::fs::FileTypeExt;
                m.file_type().is_socket()
            })
        });
    if let Some(s) = socket.map(|s| canon(&s)) {
        let covered = out
            .iter()
            .any(|(d, c)| *c == Cover::EmptyDir && s.starts_with(d));
        if covered {
            out.push((s, Cover::Socket));
        }
    }
    out
}

/// `p` with every symlink resolved, or as it is when that fails (it does not exist yet).
fn canon(p: &std::path::Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// How the credentials file is hidden: the file it names now, covered by an empty one. A path
/// through a symlink can name another file later. In a Kubernetes Secret volume it does at
/// every rotation (`credentials` → `..data/credentials` → `..2026_01_01_00_00_00.1/…`, and the
/// kubelet makes a new directory and swaps `..data`; an item path `keel/credentials` links
/// `keel` instead), which the cover of the old file does not hide: when the nearest mount
/// above the path holds such a `..data` link, that whole volume is covered, the Secret's
/// other keys with it. A path through a symlink anywhere else is only warned about.
fn credentials_covers(
    file: &std::path::Path,
    mounts: &[PathBuf],
) -> Vec<(PathBuf, crate::sys::ns::Cover)> {
    use crate::sys::ns::Cover;
    let real = canon(file);
    let mut out = Vec::new();
    if real != file {
        let volume = file
            .ancestors()
            .skip(1)
            .map(canon)
            .find(|d| mounts.contains(d))
            .filter(|d| {
                d.parent().is_some()
                    && std::fs::symlink_metadata(d.join("..data"))
                        .is_ok_and(|m| m.file_type().is_symlink())
            });
        match volume {
            Some(dir) => out.push((dir, Cover::EmptyDir)),
            None => tracing::warn!(
                "[persist] credentials_file {} goes through a symlink (to {}): the sandbox \
                 cannot read that file, but could read another one the path named later; \
                 name the file itself, or mount the secret as a volume of its own",
                file.display(),
                real.display()
            ),
        }
    }
    out.push((real, Cover::EmptyFile));
    out
}

/// The mount namespace everything keel starts runs in (`[init] isolate_state`, on by
/// default while the workspace is enabled). Without CAP_SYS_ADMIN keel cannot make one: it
/// says so and starts children in its own namespace.
fn sandbox_namespace(
    cfg: &Config,
    booted: &boot::Booted,
    mounted: Option<&Workspace>,
) -> Result<Option<crate::sys::ns::SandboxNs>, RunError> {
    if !cfg.init.isolate_state || !cfg.init.workspace {
        return Ok(None);
    }
    if mounted.is_some_and(|w| w.dir_tree().is_some()) {
        // The tree lives in the state dir, which the namespace would cover.
        tracing::warn!(
            "STATE NOT ISOLATED: with the dir provider the workspace lives in {}, so no sandbox namespace covers it (use the FUSE provider to hide it)",
            cfg.workspace.state_dir.display()
        );
        return Ok(None);
    }
    if !crate::sys::caps::has_sys_admin() {
        tracing::warn!(
            "STATE NOT ISOLATED: without CAP_SYS_ADMIN keel cannot hide {} from the processes it starts",
            cfg.workspace.state_dir.display()
        );
        return Ok(None);
    }
    let t0 = Instant::now();
    let covers = sandbox_covers(cfg);
    for (p, c) in &covers {
        if *c == crate::sys::ns::Cover::EmptyDir && !p.exists() {
            let _ = crate::state::private::create_dir_all(p);
        }
    }
    // In keel's own mount namespace (PID 1), mounts made later on the workspace mount point
    // (a remount) reach the sandbox's slave copy only from a shared parent.
    if booted.pid1 {
        if let Some(parent) = cfg.workspace.mount_point.parent() {
            if let Err(e) = crate::sys::ns::share_mount_of(parent) {
                tracing::warn!("{e}: a later remount of the workspace would not reach the sandbox");
            }
        }
    }
    let ns = crate::sys::ns::make_sandbox_ns(&covers).map_err(RunError::Isolate)?;
    let shown: Vec<String> = covers
        .iter()
        .filter(|(p, _)| p.exists())
        .filter(|(_, c)| *c != crate::sys::ns::Cover::Socket)
        .map(|(p, c)| match c {
            crate::sys::ns::Cover::ReadOnly => format!("{} (read-only)", p.display()),
            _ => p.display().to_string(),
        })
        .collect();
    let reachable: Vec<String> = covers
        .iter()
        .filter(|(_, c)| *c == crate::sys::ns::Cover::Socket)
        .map(|(p, _)| p.display().to_string())
        .collect();
    info!(
        "sandbox namespace in {:.1} ms: hidden from everything keel starts: {}{}{}",
        t0.elapsed().as_secs_f64() * 1000.0,
        shown.join(", "),
        if reachable.is_empty() {
            String::new()
        } else {
            format!(
                "; the control socket stays reachable there: {}",
                reachable.join(", ")
            )
        },
        if mounted.is_some() {
            ""
        } else {
            " (no workspace mounted)"
        }
    );
    Ok(Some(ns))
}

/// A fresh (empty, root-owned) workspace is handed to the user the main command runs as, so
/// a non-root sandbox user can create files in `/workspace`. A workspace with content keeps
/// its owner: whoever set it up decided.
fn give_fresh_workspace_to_user(cfg: &Config, mount_point: &std::path::Path) {
    use std::os::unix::fs::MetadataExt;
    let Some(user) = cfg.init.user.as_deref() else {
        return;
    };
    let Ok(ids) = crate::sys::process::resolve_ids(user, cfg.init.group.as_deref()) else {
        return; // the supervisor reports a bad user
    };
    let Ok(meta) = std::fs::metadata(mount_point) else {
        return;
    };
    let empty = std::fs::read_dir(mount_point)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    if ids.uid != 0 && meta.uid() == 0 && empty {
        match std::os::unix::fs::chown(mount_point, Some(ids.uid), Some(ids.gid)) {
            Ok(()) => info!(
                "workspace {} now belongs to {}",
                mount_point.display(),
                ids.name
            ),
            Err(e) => tracing::warn!("cannot give {} to {}: {e}", mount_point.display(), ids.name),
        }
    }
}

/// Checks the prerequisites and mounts the workspace `prepared` (locked, leased,
/// restored); `None` when disabled or a plain dir.
fn mount_workspace(
    cfg: &Config,
    plan: WorkspacePlan,
    prepared: Option<boot::workspace::Prepared>,
    main: Option<std::sync::Arc<dyn crate::persist::agent::MainCommand>>,
) -> Result<Option<Workspace>, RunError> {
    let Some(prepared) = prepared else {
        return Ok(None);
    };
    let opened = match plan {
        WorkspacePlan::Disabled => return Ok(None),
        WorkspacePlan::Dir(why) => prepared.open_dir(cfg, main, &why)?,
        WorkspacePlan::Fuse => match prepared.mount(cfg, main.clone()) {
            Ok(w) => w,
            Err(e) => match e.mount_source().and_then(boot::mount_denied_hint) {
                Some(h) => {
                    let WorkspacePlan::Dir(why) = boot::unavailable(cfg, format!("{e}: {h}"))?
                    else {
                        unreachable!("unavailable gives Dir or an error")
                    };
                    // The failed mount let go of the state dir: take it again.
                    boot::workspace::prepare_for(cfg, true)?.open_dir(cfg, main, &why)?
                }
                None => return Err(e.into()),
            },
        },
    };
    let mut w = opened;
    if let Some(p) = w.persist_mut() {
        // Leave a quarter of the flush budget to report what did not get out.
        p.set_final_budget(cfg.shutdown.flush_timeout * 3 / 4);
    }
    Ok(Some(w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::ns::Cover;

    /// The control socket is bound into a cover only when it lies in a covered directory
    /// (a keel that is not PID 1 keeps it in the state dir); one outside stays as it is.
    #[test]
    fn a_control_socket_is_bound_into_a_cover_only_when_one_hides_it() {
        let d = tempfile::tempdir().unwrap();
        let d = std::fs::canonicalize(d.path()).unwrap();
        let state = d.join("state");
        std::fs::create_dir(&state).unwrap();
        let mut cfg = Config::default();
        cfg.workspace.state_dir = state.clone();
        cfg.persist.remote = "none".into();
        let inside = state.join(crate::state::CONTROL_SOCK);
        crate::sys::socket::dead_socket(&inside).unwrap();
        cfg.control.socket = Some(inside.clone());
        let sockets = |cfg: &Config| -> Vec<PathBuf> {
            sandbox_covers(cfg)
                .into_iter()
                .filter(|(_, c)| *c == Cover::Socket)
                .map(|(p, _)| p)
                .collect()
        };
        assert_eq!(sockets(&cfg), vec![inside]);
        let outside = d.join("run.sock");
        crate::sys::socket::dead_socket(&outside).unwrap();
        cfg.control.socket = Some(outside);
        assert_eq!(sockets(&cfg), Vec::<PathBuf>::new());
        // Not there (the server could not bind it): nothing to bind.
        cfg.control.socket = Some(state.join("gone.sock"));
        assert_eq!(sockets(&cfg), Vec::<PathBuf>::new());
    }

    #[test]
    fn a_credentials_file_in_a_secret_volume_hides_the_whole_volume() {
        use std::os::unix::fs::symlink;
        let d = tempfile::tempdir().unwrap();
        let vol = d.path().join("secret");
        // The kubelet's layout: a timestamped directory, `..data` naming it, and the keys
        // (one of them an item path `keel/credentials`) linked through `..data`.
        std::fs::create_dir_all(vol.join("..2026_a/keel")).unwrap();
        std::fs::write(vol.join("..2026_a/credentials"), "K=V\n").unwrap();
        std::fs::write(vol.join("..2026_a/keel/credentials"), "K=V\n").unwrap();
        symlink("..2026_a", vol.join("..data")).unwrap();
        symlink("..data/credentials", vol.join("credentials")).unwrap();
        symlink("..data/keel", vol.join("keel")).unwrap();
        let vol = std::fs::canonicalize(&vol).unwrap();
        let mounts = [vol.clone()];
        for (given, real) in [
            ("credentials", "..2026_a/credentials"),
            ("keel/credentials", "..2026_a/keel/credentials"),
        ] {
            assert_eq!(
                credentials_covers(&vol.join(given), &mounts),
                vec![
                    (vol.clone(), Cover::EmptyDir),
                    (vol.join(real), Cover::EmptyFile)
                ],
                "{given}"
            );
            // Not a mount of its own: the file the path names now (and a warning).
            assert_eq!(
                credentials_covers(&vol.join(given), &[]),
                vec![(vol.join(real), Cover::EmptyFile)],
                "{given}"
            );
        }
        // The file itself, even in a Secret volume: the file.
        let file = vol.join("..2026_a/credentials");
        assert_eq!(
            credentials_covers(&file, &mounts),
            vec![(file, Cover::EmptyFile)]
        );
        // A symlink in a volume that is not a Secret's (no `..data`): the file only.
        let other = d.path().join("home");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("real"), "K=V\n").unwrap();
        symlink("real", other.join("creds")).unwrap();
        let other = std::fs::canonicalize(&other).unwrap();
        assert_eq!(
            credentials_covers(&other.join("creds"), std::slice::from_ref(&other)),
            vec![(other.join("real"), Cover::EmptyFile)]
        );
    }
}

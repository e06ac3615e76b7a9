//! Container setup before anything runs, one function per step, in order: remember the
//! caller's cwd, become a subreaper unless PID 1, `chdir /`, mount /proc, /dev/shm and /run
//! where the runtime did not (PID 1 only: never touch the host), hostname, rlimits, umask, and
//! the pre-mount checks of the workspace (mount point, /dev/fuse, CAP_SYS_ADMIN) that name the
//! missing `docker run`/`podman run` flag. Then the workspace's start sequence
//! (`workspace`: lock, lease, restore, mount, checkpoint service, rollback) and the bridge
//! from persist's snapshot trees to the mounted filesystem (`live`).

pub mod live;
pub mod workspace;

use std::path::{Path, PathBuf};

use tracing::{debug, info, warn};

use crate::config::{Config, FuseUnavailable, Provider};
use crate::sys::{caps, mount, process};

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Process(#[from] process::ProcessError),
    #[error("workspace mount point {0} exists and is not a directory")]
    MountPointNotDir(PathBuf),
    #[error("workspace mount point {path}: cannot create: {source}")]
    MountPointCreate {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("FUSE unavailable: {0}")]
    FuseUnavailable(String),
    #[error("workspace.provider = \"fuse\", but {0} holds a `dir` workspace (its tree is {0}/workspace): start with provider = \"dir\" or \"auto\", or restore it from the remote into an empty state dir")]
    DirState(PathBuf),
}

/// What boot learned about where keel runs.
#[derive(Debug, Clone)]
pub struct Booted {
    /// keel is PID 1 (of a container or PID namespace).
    pub pid1: bool,
    /// The directory keel was started in; children start there.
    pub caller_cwd: PathBuf,
    /// stdin is a terminal to hand to the main service.
    pub tty: bool,
}

/// Runs the process-level setup steps in order.
pub fn boot(cfg: &Config) -> Result<Booted, BootError> {
    let caller_cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
    let pid1 = process::is_pid1();
    if !pid1 {
        process::become_subreaper()?;
        debug!("not PID 1: child subreaper");
    }
    process::chdir_root()?;
    if pid1 {
        container_mounts();
        if let Some(h) = &cfg.init.hostname {
            process::set_hostname(h)?;
        }
    } else if cfg.init.hostname.is_some() {
        warn!("init.hostname ignored: keel is not PID 1 (would change the host's name)");
    }
    for (name, lim) in &cfg.init.rlimits {
        process::set_rlimit(name, lim.soft, lim.hard)?;
    }
    if let Some(bits) = cfg.init.umask_bits() {
        process::set_umask(bits);
    }
    Ok(Booted {
        pid1,
        caller_cwd,
        tty: process::has_tty(),
    })
}

/// Mounts /proc, /dev/shm and /run where the runtime did not. Failures are warnings: an
/// unprivileged container still runs, just without them.
fn container_mounts() {
    if !mount::proc_mounted() {
        match mount::mount_proc() {
            Ok(()) => info!("mounted /proc"),
            Err(e) => warn!("{e}"),
        }
    }
    let points = mount::mount_points();
    for (path, mode, noexec) in [("/dev/shm", 0o1777, true), ("/run", 0o755, false)] {
        let p = Path::new(path);
        if points.iter().any(|m| m == p) {
            continue;
        }
        if points.iter().any(|m| m.starts_with(p)) {
            debug!("{path}: runtime mounted files inside it; leaving it alone");
            continue;
        }
        match mount::mount_tmpfs(p, mode, noexec) {
            Ok(()) => info!("mounted tmpfs on {path}"),
            Err(e) => warn!("{e}"),
        }
    }
}

/// How the workspace will be provided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkspacePlan {
    /// Not wanted (`[init] workspace = false`).
    Disabled,
    /// Mount the FUSE filesystem.
    Fuse,
    /// The `dir` provider: a plain directory on the state volume; why it was chosen.
    Dir(String),
}

/// Which provider serves the workspace (`[workspace] provider`), checking /dev/fuse and
/// CAP_SYS_ADMIN for FUSE (naming the missing flag) and creating its mount point. `auto`
/// keeps a state dir the `dir` provider wrote with `dir`, and falls back to `dir` when FUSE
/// cannot be mounted unless `on_fuse_unavailable = "fail"`.
pub fn check_workspace(cfg: &Config) -> Result<WorkspacePlan, BootError> {
    if !cfg.init.workspace {
        return Ok(WorkspacePlan::Disabled);
    }
    let ws = &cfg.workspace;
    let holds_dir = ws.state_dir.join(crate::workspace::dir::TREE).is_dir();
    match ws.provider {
        Provider::Dir => return Ok(WorkspacePlan::Dir("workspace.provider = \"dir\"".into())),
        Provider::Auto if holds_dir => {
            return Ok(WorkspacePlan::Dir(format!(
                "{} holds a dir workspace (provider = \"auto\" keeps it)",
                ws.state_dir.display()
            )))
        }
        Provider::Fuse if holds_dir => return Err(BootError::DirState(ws.state_dir.clone())),
        _ => {}
    }
    let mp = &cfg.workspace.mount_point;
    match std::fs::metadata(mp) {
        Ok(m) if !m.is_dir() => return Err(BootError::MountPointNotDir(mp.clone())),
        Ok(_) => {}
        Err(_) => std::fs::create_dir_all(mp).map_err(|source| BootError::MountPointCreate {
            path: mp.clone(),
            source,
        })?,
    }
    let mut missing = Vec::new();
    if let Err(e) = mount::probe_dev_fuse() {
        missing.push(format!(
            "/dev/fuse cannot be opened ({e}): run the container with --device /dev/fuse"
        ));
    }
    if !caps::has_sys_admin() {
        missing.push(
            "CAP_SYS_ADMIN is missing: run the container with --cap-add SYS_ADMIN".to_string(),
        );
    }
    if missing.is_empty() {
        return Ok(WorkspacePlan::Fuse);
    }
    unavailable(cfg, missing.join("; "))
}

/// Applies `provider` and `on_fuse_unavailable` to a reason FUSE cannot be used.
pub fn unavailable(cfg: &Config, reason: String) -> Result<WorkspacePlan, BootError> {
    match (cfg.workspace.provider, cfg.workspace.on_fuse_unavailable) {
        (Provider::Fuse, _) | (_, FuseUnavailable::Fail) => Err(BootError::FuseUnavailable(reason)),
        (_, FuseUnavailable::Dir) => Ok(WorkspacePlan::Dir(format!(
            "FUSE cannot be mounted ({reason}; or set on_fuse_unavailable = \"fail\" to stop instead)"
        ))),
    }
}

/// The hint for a mount(2) that failed although the checks passed.
pub fn mount_denied_hint(err: &std::io::Error) -> Option<&'static str> {
    matches!(err.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES)).then_some(
        "mount(2) was denied despite CAP_SYS_ADMIN (AppArmor or seccomp): run the container with --security-opt apparmor=unconfined",
    )
}

//! The control API, the one protocol of a running keel: an HTTP/1.1 server on hyper that
//! reports keel's state and serves checkpoints, gc, named snapshots, diffs, rollbacks,
//! processes and files. `status` is the shared model everything publishes into (and
//! `publish_checkpoints` wires the checkpoint service in); `server` runs the listeners (TCP
//! when `[control] listen` is set, and the Unix socket for root, keel's user and `[control]
//! group`: `start` under `keel run`, `start_socket`, the socket alone, under `keel mount`)
//! and converts hyper's requests to `api`'s, which routes; `auth` checks tokens; `metrics` is
//! the Prometheus exposition; `client` speaks to the socket, and `agent_client` is the
//! command line's one way to a running keel. Everything here runs on its own threads and
//! never blocks the supervisor.

pub mod agent_client;
pub mod api;
pub mod auth;
pub mod client;
pub mod files;
pub mod metrics;
pub mod processes;
pub mod routes;
pub mod server;
pub mod snapshots;
pub mod status;
pub mod stream_client;
pub mod watch;

pub use status::{
    CheckpointFn, CheckpointReport, LeaseStatus, MountState, PersistStatus, ServiceState,
    ServiceStatus, StatusHandle,
};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::config::Config;
use api::Access;
use server::{Server, ServerError};

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control.token: {0}")]
    Token(#[source] crate::config::control::ControlConfigError),
    #[error("control.listen: {0}")]
    Listen(ServerError),
    #[error("control.socket: {0}")]
    Socket(ServerError),
    #[error("control.group: {0}")]
    Group(#[source] crate::sys::process::ProcessError),
}

/// The running control servers. Stop them (or drop them) as the very last step.
#[derive(Debug)]
pub struct Control {
    status: StatusHandle,
    tcp: Option<Server>,
    unix: Option<Server>,
    /// The state dir's socket of a keel that is PID 1 (beside /run/keel's).
    state_unix: Option<Server>,
}

/// Starts what `[control]` asks for. A TCP listener that cannot bind, or an explicitly
/// configured socket that cannot be created, is an error; a default socket (the state dir's,
/// /run/keel's) is a convenience under `keel run` and only warns.
pub fn start(cfg: &Config) -> Result<Control, ControlError> {
    let status = &StatusHandle::new(cfg);
    let c = &cfg.control;
    let tcp = match &c.listen {
        Some(addr) => {
            let token = c.effective_token().map_err(ControlError::Token)?;
            let secured = token.is_some();
            let s = server::serve_tcp(
                addr,
                status.clone(),
                Access::Token(token),
                server::Limits::of(c),
            )
            .map_err(ControlError::Listen)?;
            let bound = s.local_addr().map(|a| a.to_string());
            let shown = bound.as_deref().unwrap_or(addr);
            if secured {
                info!("control API on http://{shown} (bearer token required except /health)");
            } else if s.local_addr().is_some_and(|a| a.ip().is_loopback()) {
                info!(
                    "control API on http://{shown} (no token: /status, /metrics and POST /checkpoint only; snapshots, diffs and rollbacks need [control] token or KEEL_CONTROL_TOKEN)"
                );
            } else {
                warn!(
                    "control API on http://{shown} without a token: whoever reaches the port can read /status and /metrics and POST /checkpoint; snapshots, diffs and rollbacks are refused (set [control] token or KEEL_CONTROL_TOKEN)"
                );
            }
            Some(s)
        }
        None => None,
    };
    let path = c.socket_path(cfg, crate::sys::process::is_root_pid1());
    let unix = match &path {
        Some(path) => serve_socket(cfg, status, path, false)?,
        None => None,
    };
    // A keel that is PID 1 serves /run/keel/control.sock for its sandbox; the host reaches
    // the state dir only (`keel checkpoint --state` on a bind-mounted dir), so the socket is
    // served there too. The sandbox's cover over the state dir hides this one.
    let in_state = cfg.workspace.state_dir.join(crate::state::CONTROL_SOCK);
    let state_unix = match &path {
        Some(p) if *p == Path::new(crate::config::control::RUN_SOCKET) => {
            serve_socket(cfg, status, &in_state, false)?
        }
        _ => None,
    };
    Ok(Control {
        status: status.clone(),
        tcp,
        unix,
        state_unix,
    })
}

/// What `keel mount` serves: the Unix socket only (`[control] socket`, else the state dir's
/// `control.sock`), with the same rights as under `keel run`, and no TCP listener: a mount
/// on a host is reached by root, keel's user and `[control] group`, like its state dir.
/// `status` is the model already filled (mounted, services, checkpoints), so the first
/// client sees the mount as it is. The socket is the mount's only way in (checkpoints, gc,
/// the agent commands): one that cannot be made is an error wherever it is.
pub fn start_socket(cfg: &Config, status: &StatusHandle) -> Result<Control, ControlError> {
    let path = cfg
        .control
        .socket
        .clone()
        .unwrap_or_else(|| cfg.workspace.state_dir.join(crate::state::CONTROL_SOCK));
    let unix = serve_socket(cfg, status, &path, true)?;
    Ok(Control {
        status: status.clone(),
        tcp: None,
        unix,
        state_unix: None,
    })
}

/// The Unix socket at `path`. One that cannot be created is an error when `required` (`[control]
/// socket` names it, or `keel mount`, whose only way in it is), and only warns otherwise (at
/// the default place of `keel run`, which has TCP and `keel exec`, it is a convenience).
fn serve_socket(
    cfg: &Config,
    status: &StatusHandle,
    path: &std::path::Path,
    required: bool,
) -> Result<Option<Server>, ControlError> {
    let c = &cfg.control;
    let group = match &c.group {
        Some(g) => Some(crate::sys::process::resolve_group(g).map_err(ControlError::Group)?),
        None => None,
    };
    match server::serve_unix(path, status.clone(), group, server::Limits::of(c)) {
        Ok(s) => Ok(Some(s)),
        Err(e) if required || c.socket.is_some() => Err(ControlError::Socket(e)),
        Err(e) => {
            warn!("no control socket for `keel status`, `keel checkpoint` and the agent commands: {e}");
            Ok(None)
        }
    }
}

/// `POST /checkpoint` takes a real checkpoint to the remote, the agent routes reach the
/// checkpoint service, and `/status` shows the backlog, the failures and the lease, updated
/// after every checkpoint attempt and lease renewal.
pub fn publish_checkpoints(status: &StatusHandle, svc: &crate::persist::Service) {
    let observer: crate::persist::service::StateObserver = {
        let status = status.clone();
        std::sync::Arc::new(move |st: &crate::persist::PersistState| {
            status.update_persist(|p| {
                p.dirty_bytes = Some(st.backlog.bytes);
                p.dirty_files = Some(st.backlog.files);
                p.backlog_inodes = Some(st.backlog.inodes);
                p.remote_backlog_bytes = Some(st.backlog.bytes);
                p.last_checkpoint = st.last_checkpoint_ns.map(|ns| {
                    std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns.max(0) as u64)
                });
                p.consecutive_failures = Some(st.consecutive_failures);
                p.last_error = st.last_error.clone();
                p.remote_disk_bytes = st.remote_disk_bytes;
                p.lease = Some(match &st.lease {
                    None => LeaseStatus {
                        held: false,
                        state: "disabled".into(),
                        holder: None,
                        epoch: None,
                        expires: None,
                        error: None,
                    },
                    Some(l) => LeaseStatus {
                        held: l.state == crate::persist::lease::LeaseState::Held,
                        state: l.state.as_str().into(),
                        holder: Some(l.holder.clone()),
                        epoch: Some(l.epoch),
                        expires: Some(
                            std::time::UNIX_EPOCH
                                + std::time::Duration::from_nanos(l.expires_ns.max(0) as u64),
                        ),
                        error: l.error.clone(),
                    },
                });
            });
        })
    };
    svc.set_observer(observer);
    let h = svc.handle();
    status.set_agent(h.clone());
    status.set_checkpoint(Box::new(move || {
        Ok(CheckpointReport::of(&h.checkpoint_now()?))
    }));
}

impl Control {
    /// The model the servers report from; publish into it.
    pub fn status(&self) -> &StatusHandle {
        &self.status
    }

    /// The TCP address the HTTP API listens on.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().and_then(|s| s.local_addr())
    }

    /// Stops both listeners and removes the socket file.
    pub fn stop(self) {
        if let Some(s) = self.tcp {
            s.stop();
        }
        for s in [self.unix, self.state_unix].into_iter().flatten() {
            s.stop();
        }
    }
}

/// Where `keel status` and `keel checkpoint` look by default: `[control] socket`, else the
/// state dir's `control.sock` when it exists, else `/run/keel/control.sock` when it exists
/// and PID 1 is keel (a keel that is PID 1 puts it there; inside the sandbox the state dir
/// is empty), else the state dir's (so the error names it).
pub fn default_socket(cfg: &Config) -> PathBuf {
    if let Some(s) = &cfg.control.socket {
        return s.clone();
    }
    let in_state = cfg.workspace.state_dir.join(crate::state::CONTROL_SOCK);
    let run = PathBuf::from(crate::config::control::RUN_SOCKET);
    if !in_state.exists() && run.exists() && pid1_is_keel() {
        return run;
    }
    in_state
}

/// Whether PID 1 here is keel: inside keel's container, where its socket is `RUN_SOCKET`
/// (on a host, a socket left there by something else must not be taken for the state dir's).
fn pid1_is_keel() -> bool {
    std::fs::read_to_string("/proc/1/comm").is_ok_and(|c| c.trim_end() == "keel")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `keel mount`'s socket is its only way in: one that cannot be made (here its state
    /// dir's, where a plain file has the name) fails the start rather than warn, even at the
    /// default place.
    #[test]
    fn the_mounts_socket_that_cannot_be_made_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.workspace.state_dir = dir.path().to_path_buf();
        std::fs::write(dir.path().join(crate::state::CONTROL_SOCK), "").unwrap();
        let e = start_socket(&cfg, &StatusHandle::new(&cfg)).unwrap_err();
        assert!(matches!(e, ControlError::Socket(_)), "{e}");
    }
}

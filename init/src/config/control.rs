//! The `[control]` table: the small HTTP control API (`/health`, `/status`, `/checkpoint`,
//! `/metrics`) is off unless `listen` is set; `token` (or `KEEL_CONTROL_TOKEN`, which wins)
//! guards every route but `/health`. `socket` moves or enables the root-only Unix socket that
//! `keel status` reads (default `/run/keel/control.sock` for a root keel that is PID 1, else
//! `<state_dir>/control.sock`, whenever the workspace is enabled); `group` opens it to a group.

use super::BadKey;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

/// Environment variable that supplies (and overrides) the bearer token.
pub const TOKEN_ENV: &str = "KEEL_CONTROL_TOKEN";

/// The control socket of a keel that is PID 1 (a container), outside the state dir.
pub const RUN_SOCKET: &str = "/run/keel/control.sock";

/// Why a `[control]` value (or `KEEL_CONTROL_TOKEN`) is not usable; the config error names
/// the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlConfigError {
    #[error("`{0}` is not host:port (e.g. \"0.0.0.0:8787\" or \"127.0.0.1:8787\")")]
    NotHostPort(String),
    #[error("`{listen}`: `{port}` is not a port number")]
    BadPort { listen: String, port: String },
    #[error("is empty (leave the key out for no token)")]
    EmptyToken,
    #[error("is longer than 1024 bytes")]
    LongToken,
    #[error("must be visible ASCII without spaces")]
    TokenChars,
    /// `KEEL_CONTROL_TOKEN` from the credentials file is not a usable token.
    #[error("{TOKEN_ENV} (credentials file): {0}")]
    CredentialsToken(#[source] Box<ControlConfigError>),
    /// `KEEL_CONTROL_TOKEN` from the environment is not a usable token.
    #[error("{TOKEN_ENV}: {0}")]
    EnvToken(#[source] Box<ControlConfigError>),
}

/// A secret string: never shown by `Debug`, so a logged config cannot leak it.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlConfig {
    /// `host:port` for the HTTP API, e.g. "0.0.0.0:8787". Unset: no TCP listener at all.
    pub listen: Option<String>,
    /// Bearer token every route but `/health` requires. `KEEL_CONTROL_TOKEN` overrides it.
    pub token: Option<Secret>,
    /// Unix socket for `keel status` and `keel checkpoint`. Default while the workspace is
    /// enabled: `/run/keel/control.sock` when keel is PID 1 and root (a container; outside the state
    /// dir, so the sandbox reaches it), else `<workspace.state_dir>/control.sock` (which the
    /// sandbox reaches bound into the cover of the state dir); none when `[init] workspace =
    /// false`.
    pub socket: Option<PathBuf>,
    /// A group (name or gid) whose members may use the socket too (0660, directory 0750).
    /// Unset: root and keel's own user only (0600, directory 0700).
    pub group: Option<String>,
    /// Time a client has to send its whole request head once connected (then the body gets
    /// the same again).
    #[serde(with = "super::units::duration_str")]
    pub head_timeout: Duration,
    /// Connections whose request head is still coming, per listener; past it the oldest
    /// such connection is closed to make room for the new one.
    pub max_pending: usize,
    /// The same, per peer address (per uid on the Unix socket): the oldest of that peer's
    /// is closed first.
    pub max_pending_per_peer: usize,
    /// Requests served at once per listener and per class (the token's holder or a
    /// privileged socket peer; everyone else), the next ones of that class get 503 "busy".
    /// `/health` and the answers that need no handler (401, 404) take no slot.
    pub max_connections: usize,
    /// Changed entries one diff answer (`keel diff`, `GET /diff`) may hold; past it the
    /// diff is refused with one line naming the limit. 0: no limit.
    pub diff_max_entries: u64,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            listen: None,
            token: None,
            socket: None,
            group: None,
            head_timeout: Duration::from_secs(3),
            max_pending: 512,
            max_pending_per_peer: 64,
            max_connections: 256,
            diff_max_entries: 1_000_000,
        }
    }
}

impl ControlConfig {
    pub fn validate(&self) -> Result<(), BadKey> {
        let bad = |k: &str, why: String| Err(BadKey::new(format!("control.{k}"), why));
        if let Some(l) = &self.listen {
            if let Err(why) = check_listen(l) {
                return bad("listen", why.to_string());
            }
        }
        if let Some(t) = &self.token {
            if let Err(why) = check_token(t.expose()) {
                return bad("token", why.to_string());
            }
        }
        if let Some(g) = &self.group {
            let ok = !g.is_empty()
                && g.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
            if !ok {
                return bad("group", format!("`{g}` is not a group name or gid"));
            }
        }
        if self.head_timeout.is_zero() || self.head_timeout > Duration::from_secs(3600) {
            return bad("head_timeout", "must be more than 0 and at most 1h".into());
        }
        for (k, v) in [
            ("max_pending", self.max_pending),
            ("max_pending_per_peer", self.max_pending_per_peer),
            ("max_connections", self.max_connections),
        ] {
            if v == 0 || v > 65536 {
                return bad(k, format!("{v} must be between 1 and 65536"));
            }
        }
        if self.max_pending_per_peer > self.max_pending {
            return bad(
                "max_pending_per_peer",
                format!(
                    "{} is more than max_pending ({})",
                    self.max_pending_per_peer, self.max_pending
                ),
            );
        }
        if let Some(s) = &self.socket {
            if !s.is_absolute() {
                return bad(
                    "socket",
                    format!("`{}` must be an absolute path", s.display()),
                );
            }
            // sun_path holds 108 bytes including the terminating NUL.
            if s.as_os_str().len() > 107 {
                return bad("socket", "path is longer than 107 bytes".into());
            }
        }
        Ok(())
    }

    /// The token in effect: `KEEL_CONTROL_TOKEN` from the credentials file read at start,
    /// else from the environment when set and non-empty, else `token`.
    pub fn effective_token(&self) -> Result<Option<Secret>, ControlConfigError> {
        if let Some(v) = super::credentials::loaded().and_then(|c| c.get(TOKEN_ENV)) {
            check_token(v).map_err(|why| ControlConfigError::CredentialsToken(Box::new(why)))?;
            return Ok(Some(Secret(v.to_string())));
        }
        match super::credentials::value(TOKEN_ENV) {
            Some(v) if !v.is_empty() => {
                check_token(&v).map_err(|why| ControlConfigError::EnvToken(Box::new(why)))?;
                Ok(Some(Secret(v)))
            }
            _ => Ok(self.token.clone()),
        }
    }

    /// Where the control socket lives, if anywhere: `socket`, else (workspace enabled)
    /// `/run/keel/control.sock` for a keel that is PID 1 and root (`root_pid1`),
    /// `<state_dir>/control.sock` otherwise (a non-root PID 1, as in a restricted pod,
    /// cannot make `/run/keel`; its sandbox is its own user and reaches the state dir anyway).
    pub fn socket_path(&self, cfg: &super::Config, root_pid1: bool) -> Option<PathBuf> {
        match &self.socket {
            Some(p) => Some(p.clone()),
            None if cfg.init.workspace && root_pid1 => Some(PathBuf::from(RUN_SOCKET)),
            None if cfg.init.workspace => {
                Some(cfg.workspace.state_dir.join(crate::state::CONTROL_SOCK))
            }
            None => None,
        }
    }
}

/// `host:port` with a numeric port; the host may be an IP, `[v6]` or a name.
fn check_listen(l: &str) -> Result<(), ControlConfigError> {
    if l.parse::<std::net::SocketAddr>().is_ok() {
        return Ok(());
    }
    let Some((host, port)) = l.rsplit_once(':') else {
        return Err(ControlConfigError::NotHostPort(l.to_string()));
    };
    if port.parse::<u16>().is_err() {
        return Err(ControlConfigError::BadPort {
            listen: l.to_string(),
            port: port.to_string(),
        });
    }
    if host.is_empty() || host.contains(':') || host.contains(char::is_whitespace) {
        return Err(ControlConfigError::NotHostPort(l.to_string()));
    }
    Ok(())
}

/// A token must be usable in an `Authorization: Bearer` header: visible ASCII, 1–1024 bytes.
fn check_token(t: &str) -> Result<(), ControlConfigError> {
    if t.is_empty() {
        return Err(ControlConfigError::EmptyToken);
    }
    if t.len() > 1024 {
        return Err(ControlConfigError::LongToken);
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ControlConfigError::TokenChars);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::path::Path;

    fn parse(t: &str) -> Result<Config, crate::config::ConfigError> {
        Config::parse(t, Path::new("c.toml"))
    }

    #[test]
    fn off_by_default() {
        let c = parse("").unwrap();
        assert!(c.control.listen.is_none());
        assert!(c.control.token.is_none());
        assert_eq!(
            c.control.socket_path(&c, false),
            Some(PathBuf::from("/var/lib/keel/control.sock"))
        );
        assert_eq!(
            c.control.socket_path(&c, true),
            Some(PathBuf::from(RUN_SOCKET)),
            "PID 1 keeps it out of the state dir the sandbox cannot see"
        );
        assert!(c.control.group.is_none());
        let c = parse("[init]\nworkspace = false\n").unwrap();
        assert_eq!(c.control.socket_path(&c, true), None);
    }

    #[test]
    fn bad_values_are_named() {
        for (text, key) in [
            ("[control]\nlisten = \"8787\"\n", "control.listen"),
            ("[control]\nlisten = \"0.0.0.0:http\"\n", "control.listen"),
            ("[control]\nlisten = \"\"\n", "control.listen"),
            ("[control]\ntoken = \"\"\n", "control.token"),
            ("[control]\ntoken = \"a b\"\n", "control.token"),
            ("[control]\nsocket = \"rel.sock\"\n", "control.socket"),
            ("[control]\ngroup = \"a b\"\n", "control.group"),
            ("[control]\nport = 1\n", "control.port"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(key), "{text:?}: {e}");
        }
        for ok in ["0.0.0.0:8787", "127.0.0.1:0", "[::]:8787", "localhost:8787"] {
            parse(&format!("[control]\nlisten = \"{ok}\"\n")).unwrap();
        }
    }

    #[test]
    fn shipped_config_documents_every_key() {
        let text = include_str!("../../../config/config.toml");
        let section: String = text
            .lines()
            .skip_while(|l| *l != "[control]")
            .take_while(|l| !l.starts_with("# [[service]]"))
            .map(|l| match l.strip_prefix("# ") {
                Some(kv)
                    if kv.split_once(" = ").is_some_and(|(k, _)| {
                        k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                    }) =>
                {
                    format!("{kv}\n")
                }
                _ if l.starts_with('#') => String::new(),
                _ => format!("{l}\n"),
            })
            .collect();
        let c = parse(&section).unwrap();
        assert_eq!(c.control.listen.as_deref(), Some("0.0.0.0:8787"));
        assert!(c.control.token.is_some());
        assert!(c.control.socket.is_some());
        // As shipped (commented out), everything is off.
        let c = parse(text).unwrap();
        assert!(c.control.listen.is_none() && c.control.token.is_none());
    }

    #[test]
    fn token_never_shows_in_debug() {
        let c = parse("[control]\ntoken = \"hunter2-very-secret\"\n").unwrap();
        assert_eq!(
            c.control.token.as_ref().unwrap().expose(),
            "hunter2-very-secret"
        );
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}

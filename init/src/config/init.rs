//! The `[init]` table: what keel sets up for itself and every process it starts — hostname,
//! umask, environment, resource limits, the main service's user, capability bounding set,
//! how signals reach the main service, and whether the workspace is mounted at all.

use super::BadKey;
use serde::Deserialize;
use std::collections::BTreeMap;

use super::signal_name;

/// Where forwarded signals go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ForwardTo {
    /// The main service's whole process group (dumb-init style; the default).
    Group,
    /// Only the main service's own process (tini without `-g`).
    Process,
}

/// One resource limit: a number (soft = hard), `"unlimited"`, or `[soft, hard]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rlimit {
    pub soft: u64,
    pub hard: u64,
}

/// `u64::MAX` stands for RLIM_INFINITY.
pub const UNLIMITED: u64 = u64::MAX;

impl<'de> Deserialize<'de> for Rlimit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum One {
            N(u64),
            S(String),
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(One),
            Pair(One, One),
        }
        fn one<E: serde::de::Error>(v: One) -> Result<u64, E> {
            match v {
                One::N(n) => Ok(n),
                One::S(s) if s == "unlimited" || s == "infinity" => Ok(UNLIMITED),
                One::S(s) => Err(E::custom(format!(
                    "`{s}` is not a limit (a number, \"unlimited\" or [soft, hard])"
                ))),
            }
        }
        match Raw::deserialize(d)? {
            Raw::One(v) => {
                let n = one(v)?;
                Ok(Rlimit { soft: n, hard: n })
            }
            Raw::Pair(s, h) => Ok(Rlimit {
                soft: one(s)?,
                hard: one(h)?,
            }),
        }
    }
}

/// Resource names accepted in `[init.rlimits]` (as `ulimit`/prlimit name them).
pub const RLIMIT_NAMES: &[&str] = &[
    "as",
    "core",
    "cpu",
    "data",
    "fsize",
    "locks",
    "memlock",
    "msgqueue",
    "nice",
    "nofile",
    "nproc",
    "rss",
    "rtprio",
    "rttime",
    "sigpending",
    "stack",
];

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InitConfig {
    /// Hostname to set (only when keel is PID 1 in its own UTS namespace).
    pub hostname: Option<String>,
    /// umask for keel and every service, octal string such as "0022".
    pub umask: Option<String>,
    /// Extra environment for every service (on top of keel's own environment).
    pub env: BTreeMap<String, String>,
    /// Resource limits for keel and everything it starts.
    pub rlimits: BTreeMap<String, Rlimit>,
    /// User (name or uid) the main service runs as; default: keel's own user.
    pub user: Option<String>,
    /// Group (name or gid) for the main service; default: the user's primary group.
    pub group: Option<String>,
    /// Set `no_new_privs` for the main service (services have their own key).
    pub no_new_privs: bool,
    /// Capabilities removed from every service's bounding, inheritable and ambient sets.
    pub drop_capabilities: Vec<String>,
    /// Where forwarded signals go: "group" or "process".
    pub forward_to: ForwardTo,
    /// Mount the workspace (`false` for development and tests: no FUSE at all).
    pub workspace: bool,
    /// Run everything keel starts in a mount namespace of its own where the state dir, a local
    /// `file://` remote and the credentials file are covered (empty, read-only), and the
    /// control socket's directory is read-only. On by default.
    pub isolate_state: bool,
    /// More variables no process keel starts may inherit, on top of `AWS_*`, `GOOGLE_*`,
    /// `AZURE_*` and `KEEL_CONTROL_TOKEN`: exact names, or prefixes written `PREFIX*`.
    pub secret_env: Vec<String>,
    /// Secret variables the main command gets anyway, by exact name (e.g. `AWS_REGION`).
    pub pass_env: Vec<String>,
}

impl Default for InitConfig {
    fn default() -> Self {
        Self {
            hostname: None,
            umask: None,
            env: BTreeMap::new(),
            rlimits: BTreeMap::new(),
            user: None,
            group: None,
            no_new_privs: false,
            drop_capabilities: vec!["SYS_ADMIN".to_string(), "DAC_READ_SEARCH".to_string()],
            forward_to: ForwardTo::Group,
            workspace: true,
            isolate_state: true,
            secret_env: Vec::new(),
            pass_env: Vec::new(),
        }
    }
}

impl InitConfig {
    pub fn validate(&self) -> Result<(), BadKey> {
        let bad = |k: &str, why: String| Err(BadKey::new(format!("init.{k}"), why));
        if let Some(h) = &self.hostname {
            if h.is_empty() || h.len() > 64 || h.contains('\0') {
                return bad("hostname", format!("`{h}` must be 1-64 bytes"));
            }
        }
        if let Some(u) = &self.umask {
            if parse_umask(u).is_none() {
                return bad("umask", format!("`{u}` is not an octal mode like \"0022\""));
            }
        }
        for (name, lim) in &self.rlimits {
            if !RLIMIT_NAMES.contains(&name.as_str()) {
                return bad(
                    &format!("rlimits.{name}"),
                    format!("unknown limit (one of {})", RLIMIT_NAMES.join(", ")),
                );
            }
            if lim.soft > lim.hard {
                return bad(
                    &format!("rlimits.{name}"),
                    "soft limit is above hard limit".into(),
                );
            }
        }
        for c in &self.drop_capabilities {
            if capability_name(c).is_none() {
                return bad(
                    "drop_capabilities",
                    format!("`{c}` is not a capability name"),
                );
            }
        }
        for k in self.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return bad(&format!("env.{k}"), "not a valid variable name".into());
            }
        }
        for k in &self.secret_env {
            if !is_var_name(k.strip_suffix('*').unwrap_or(k)) {
                return bad(
                    "secret_env",
                    format!("`{k}` is not a variable name or a PREFIX* pattern"),
                );
            }
        }
        check_pass_env("init.pass_env", &self.pass_env)
    }

    pub fn umask_bits(&self) -> Option<u32> {
        self.umask.as_deref().and_then(parse_umask)
    }
}

/// `[A-Za-z_][A-Za-z0-9_]*`.
pub fn is_var_name(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Validates a `pass_env` list: exact variable names.
pub fn check_pass_env(key: &str, names: &[String]) -> Result<(), BadKey> {
    match names.iter().find(|k| !is_var_name(k)) {
        Some(k) => Err(BadKey::new(
            key.to_string(),
            format!("`{k}` is not a variable name"),
        )),
        None => Ok(()),
    }
}

impl InitConfig {
    /// Whether no process keel starts may inherit `name` (see `config::credentials`).
    pub fn is_secret_var(&self, name: &str) -> bool {
        super::credentials::is_secret_var(name, &self.secret_env)
    }
}

/// Parses an octal umask such as "0022" or "077".
pub fn parse_umask(s: &str) -> Option<u32> {
    let v = u32::from_str_radix(s.trim(), 8).ok()?;
    (v <= 0o777).then_some(v)
}

/// Normalises "SYS_ADMIN", "CAP_SYS_ADMIN", "sys_admin" to "CAP_SYS_ADMIN" if it names one.
pub fn capability_name(s: &str) -> Option<String> {
    let up = s.trim().to_ascii_uppercase();
    let full = if up.starts_with("CAP_") {
        up
    } else {
        format!("CAP_{up}")
    };
    full.parse::<caps::Capability>().ok().map(|_| full)
}

/// Validates a signal name for serde users in this module family.
pub fn check_signal(key: &str, s: &str) -> Result<(), BadKey> {
    signal_name(s).map(|_| ()).ok_or_else(|| {
        BadKey::new(
            key.to_string(),
            format!("`{s}` is not a signal name (e.g. \"SIGTERM\")"),
        )
    })
}

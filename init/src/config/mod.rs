//! The one TOML file that configures keel (`/etc/keel/config.toml`, `--config`, `KEEL_CONFIG`):
//! typed, validated values. Unknown keys, wrong types and bad values are rejected with the
//! file, the key and the reason in one line, before anything is mounted or started. The
//! values that name places may use `${VAR}` / `${VAR:-default}` (see `expand`).

pub mod control;
pub mod credentials;
pub mod exec;
pub mod expand;
pub mod files;
pub mod init;
pub mod persist;
pub mod sandbox;
pub mod service;
pub mod shutdown;
pub mod units;
pub mod workspace;

pub use control::ControlConfig;
pub use exec::ExecConfig;
pub use files::FilesConfig;
pub use init::{ForwardTo, InitConfig, Rlimit};
pub use persist::{FsyncMode, PersistConfig, Takeover};
pub use sandbox::{SandboxConfig, Seccomp};
pub use service::{Probe, Readiness, Restart, ServiceConfig};
pub use shutdown::ShutdownConfig;
pub use workspace::{CacheMode, FuseUnavailable, Passthrough, Provider, Switch, WorkspaceConfig};

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Where the image looks for its config when neither `--config` nor `KEEL_CONFIG` is given.
pub const DEFAULT_PATH: &str = "/etc/keel/config.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config {path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {path}: {key}: {reason}")]
    Invalid {
        path: PathBuf,
        key: String,
        reason: String,
    },
}

/// A config value that does not validate: its key (`persist.remote`) and the problem, in
/// words (`ConfigError::Invalid` adds the file).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct BadKey {
    pub key: String,
    pub problem: String,
}

impl BadKey {
    pub fn new(key: String, problem: String) -> BadKey {
        BadKey { key, problem }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub init: InitConfig,
    pub workspace: WorkspaceConfig,
    pub shutdown: ShutdownConfig,
    pub service: Vec<ServiceConfig>,
    pub control: ControlConfig,
    pub persist: PersistConfig,
    pub exec: ExecConfig,
    pub files: FilesConfig,
    pub sandbox: SandboxConfig,
}

impl Config {
    /// Parses and validates TOML text, expanding `${VAR}` from the process environment;
    /// `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        Self::parse_with_env(text, path, &|name| std::env::var(name).ok())
    }

    /// `parse` with the variables of `${VAR}` looked up by `lookup`.
    pub fn parse_with_env(
        text: &str,
        path: &Path,
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let mut cfg: Config = toml::from_str(text).map_err(|e| {
            let key = e
                .span()
                .map(|sp| key_at(text, sp.start))
                .unwrap_or_else(|| "(file)".to_string());
            ConfigError::Invalid {
                path: path.to_path_buf(),
                key,
                reason: e.message().trim().replace('\n', " "),
            }
        })?;
        cfg.expand_places(lookup)
            .and_then(|()| cfg.validate())
            .map_err(|BadKey { key, problem }| ConfigError::Invalid {
                path: path.to_path_buf(),
                key,
                reason: problem,
            })?;
        Ok(cfg)
    }

    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// The config every subcommand runs with: the file named (`--config`, else
    /// `KEEL_CONFIG`), else `DEFAULT_PATH` if it exists, else the built-in defaults.
    /// Sets this process's memory budget from it (`crate::budget::set`).
    pub fn resolve(named: Option<&Path>) -> Result<Self, ConfigError> {
        let cfg = match config_file(named, Path::new(DEFAULT_PATH)) {
            Some(p) => Self::load(&p)?,
            None => Self::default(),
        };
        crate::budget::set(cfg.workspace.budget());
        Ok(cfg)
    }

    /// Expands `${VAR}` in the keys of `expand::EXPANDED_KEYS` (in this order).
    fn expand_places(&mut self, lookup: &dyn Fn(&str) -> Option<String>) -> Result<(), BadKey> {
        let x = |key: &str, v: &str| {
            expand::expand(v, lookup).map_err(|e| BadKey::new(key.to_string(), e.to_string()))
        };
        let xp = |key: &str, p: &mut PathBuf| -> Result<(), BadKey> {
            if let Some(s) = p.to_str() {
                *p = PathBuf::from(x(key, s)?);
            }
            Ok(())
        };
        // An optional key whose variables expand to "" is as if it were not set
        // (`endpoint = "${EP:-}"`); a literal "" is still validated as written.
        let xo = |key: &str, v: &mut Option<String>| -> Result<(), BadKey> {
            if let Some(s) = v.as_deref().filter(|s| s.contains('$')) {
                *v = Some(x(key, s)?).filter(|s| !s.is_empty());
            }
            Ok(())
        };
        xp("workspace.mount_point", &mut self.workspace.mount_point)?;
        xp("workspace.state_dir", &mut self.workspace.state_dir)?;
        self.persist.remote = x("persist.remote", &self.persist.remote)?;
        xo("persist.endpoint", &mut self.persist.endpoint)?;
        xo("persist.region", &mut self.persist.region)?;
        xo("control.listen", &mut self.control.listen)?;
        if let Some(p) = &mut self.persist.credentials_file {
            xp("persist.credentials_file", p)?;
        }
        if let Some(p) = &mut self.control.socket {
            xp("control.socket", p)?;
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), BadKey> {
        self.init.validate()?;
        self.workspace.validate()?;
        self.shutdown.validate()?;
        service::validate(&self.service)?;
        self.control.validate()?;
        self.persist.validate()?;
        self.exec.validate()?;
        self.files.validate()?;
        self.sandbox.validate()?;
        Ok(())
    }
}

/// Signal number for "SIGTERM", "TERM", "sigterm" or "15"; `None` if it names none.
pub fn signal_name(s: &str) -> Option<i32> {
    let t = s.trim();
    if let Ok(n) = t.parse::<i32>() {
        return nix::sys::signal::Signal::try_from(n).ok().map(|s| s as i32);
    }
    let up = t.to_ascii_uppercase();
    let full = if up.starts_with("SIG") {
        up
    } else {
        format!("SIG{up}")
    };
    full.parse::<nix::sys::signal::Signal>()
        .ok()
        .map(|s| s as i32)
}

/// Splits `http://host:port/path` into (host:port, path); `None` for anything else.
pub fn parse_http_url(url: &str) -> Option<(String, String)> {
    let rest = url.strip_prefix("http://")?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if hostport.is_empty() {
        return None;
    }
    let hostport = if hostport
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        hostport.to_string()
    } else if hostport.contains(':') && !hostport.ends_with(']') {
        return None;
    } else {
        format!("{hostport}:80")
    };
    Some((hostport, path.to_string()))
}

/// Best-effort name of the key at byte offset `pos`: `table.key` from the nearest table header
/// above and the key on that line, so errors can name it.
fn key_at(text: &str, pos: usize) -> String {
    let pos = pos.min(text.len());
    let before = &text[..pos];
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    let line_end = text[pos..]
        .find('\n')
        .map(|i| pos + i)
        .unwrap_or(text.len());
    let line = text[line_start..line_end].trim();
    let mut table = String::new();
    for l in before[..line_start].lines().rev() {
        let l = l.trim();
        if l.starts_with('[') {
            table = l.trim_matches(|c| c == '[' || c == ']').trim().to_string();
            break;
        }
    }
    let lineno = before.matches('\n').count() + 1;
    let key = if line.starts_with('[') {
        line.trim_matches(|c| c == '[' || c == ']')
            .trim()
            .to_string()
    } else if let Some((k, _)) = line.split_once('=') {
        let k = k.trim();
        if table.is_empty() {
            k.to_string()
        } else {
            format!("{table}.{k}")
        }
    } else if table.is_empty() {
        "(file)".to_string()
    } else {
        table
    };
    format!("{key} (line {lineno})")
}

/// Which file `Config::resolve` reads: `named` (an empty name counts as none), else
/// `default` if it exists; `None`: no file, the built-in defaults.
pub fn config_file(named: Option<&Path>, default: &Path) -> Option<PathBuf> {
    match named.filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => Some(p.to_path_buf()),
        None => default.exists().then(|| default.to_path_buf()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_named_file_then_the_default_if_present_then_none() {
        let d = tempfile::tempdir().unwrap();
        let default = d.path().join("config.toml");
        let named = Path::new("/x/named.toml");
        assert_eq!(config_file(None, &default), None);
        assert_eq!(config_file(Some(Path::new("")), &default), None);
        assert_eq!(config_file(Some(named), &default), Some(named.into()));
        std::fs::write(&default, "").unwrap();
        assert_eq!(config_file(None, &default), Some(default.clone()));
        assert_eq!(config_file(Some(named), &default), Some(named.into()));
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::parse(
            "[workspace]\ncache = \"auto\"\nbogus = 1\n",
            Path::new("x.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("workspace.bogus"), "{err}");
        assert!(err.contains("x.toml"), "{err}");
    }

    #[test]
    fn removed_transport_keys_are_named_and_refused() {
        for (toml, key) in [
            ("[workspace]\nio_uring = \"auto\"\n", "workspace.io_uring"),
            (
                "[workspace]\nring_sched = \"idle\"\n",
                "workspace.ring_sched",
            ),
        ] {
            let err = Config::parse(toml, Path::new("x.toml"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{err}");
            assert!(err.contains("gone"), "{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn bad_value_is_named() {
        let err = Config::parse("[workspace]\ncache = \"fast\"\n", Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("workspace.cache"), "{err}");
        let err = Config::parse("[workspace]\nchunk_size = \"3MiB\"\n", Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("workspace.chunk_size"), "{err}");
    }

    #[test]
    fn memory_budget_is_auto_or_a_size_within_bounds() {
        let parse = |v: &str| {
            Config::parse(
                &format!("[workspace]\nmemory_budget = {v}\n"),
                Path::new("x.toml"),
            )
        };
        assert_eq!(parse("\"auto\"").unwrap().workspace.memory_budget, None);
        assert_eq!(
            parse("\"96MiB\"").unwrap().workspace.memory_budget,
            Some(96 << 20)
        );
        assert_eq!(
            Config::parse("", Path::new("x.toml"))
                .unwrap()
                .workspace
                .memory_budget,
            None
        );
        for bad in ["\"8MiB\"", "\"100GiB\"", "\"lots\"", "\"Auto\""] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains("workspace.memory_budget"), "{bad}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn meta_cache_is_a_size_within_bounds() {
        let c = Config::parse("[workspace]\nmeta_cache = \"8MiB\"\n", Path::new("x.toml")).unwrap();
        assert_eq!(c.workspace.meta_cache, Some(8 << 20));
        for bad in ["\"512KiB\"", "\"2GiB\"", "\"lots\""] {
            let err = Config::parse(
                &format!("[workspace]\nmeta_cache = {bad}\n"),
                Path::new("x.toml"),
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("workspace.meta_cache"), "{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn service_keys_are_named() {
        let p = Path::new("c.toml");
        let err = Config::parse(
            "[[service]]\nname = \"a\"\ncommand = [\"x\"]\nrestart = \"sometimes\"\n",
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("service.restart"), "{err}");
        let err = Config::parse(
            "[[service]]\nname = \"a\"\ncommand = [\"x\"]\ndepends_on = [\"b\"]\n",
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("service[0].depends_on") && err.contains("`b`"),
            "{err}"
        );
        let cyc = "[[service]]\nname=\"a\"\ncommand=\"x\"\ndepends_on=[\"b\"]\n[[service]]\nname=\"b\"\ncommand=\"x\"\ndepends_on=[\"a\"]\n";
        let err = Config::parse(cyc, p).unwrap_err().to_string();
        assert!(err.contains("cycle"), "{err}");
        let err = Config::parse("[shutdown]\ngrace = \"6 parsecs\"\n", p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("shutdown.grace"), "{err}");
        let err = Config::parse("[init]\nrlimits = { nofiles = 10 }\n", p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("init.rlimits.nofiles"), "{err}");
        let err = Config::parse("[[service]]\nname=\"a\"\ncommand=\"x\"\nready = { file = \"/x\", http = \"http://a:1/\" }\n", p)
            .unwrap_err()
            .to_string();
        assert!(err.contains("service[0].ready"), "{err}");
    }

    #[test]
    fn service_order_and_values() {
        let text = "[init]\nrlimits = { nofile = 1024, core = [0, \"unlimited\"] }\numask = \"027\"\n\
            [[service]]\nname=\"web\"\ncommand=[\"web\"]\ndepends_on=[\"db\"]\nready = { http = \"http://127.0.0.1:8080/health\" }\n\
            [[service]]\nname=\"db\"\ncommand=\"db --serve\"\nrestart=\"on-failure\"\n";
        let c = Config::parse(text, Path::new("c.toml")).unwrap();
        assert_eq!(service::order(&c.service).unwrap(), vec![1, 0]);
        assert_eq!(
            c.service[1].command.argv(),
            vec!["/bin/sh", "-c", "db --serve"]
        );
        assert_eq!(
            c.init.rlimits["core"],
            Rlimit {
                soft: 0,
                hard: init::UNLIMITED
            }
        );
        assert_eq!(c.init.umask_bits(), Some(0o027));
        assert!(matches!(
            c.service[0].ready.as_ref().unwrap().probe(),
            Some(Probe::Http(_))
        ));
        assert_eq!(signal_name("term"), Some(15));
        assert_eq!(signal_name("SIGUSR1"), Some(10));
        assert_eq!(signal_name("SIGNOPE"), None);
        assert_eq!(
            parse_http_url("http://localhost/x"),
            Some(("localhost:80".into(), "/x".into()))
        );
    }

    #[test]
    fn shipped_config_parses_and_matches_the_defaults() {
        let text = include_str!("../../../config/config.toml");
        let c = Config::parse(text, Path::new("config/config.toml")).unwrap();
        let d = Config::default();
        assert_eq!(c.shutdown.grace, d.shutdown.grace);
        assert_eq!(c.shutdown.flush_timeout, d.shutdown.flush_timeout);
        assert_eq!(c.init.drop_capabilities, d.init.drop_capabilities);
        assert_eq!(c.exec.max_processes, d.exec.max_processes);
        assert_eq!(c.exec.output_limit, d.exec.output_limit);
        assert_eq!(c.exec.retention, d.exec.retention);
        assert_eq!(c.exec.max_request_body, d.exec.max_request_body);
        // The commented service example, uncommented, is valid too.
        let example: String = text
            .lines()
            .skip_while(|l| *l != "# [[service]]")
            .filter(|l| !l.starts_with("# # "))
            .map(|l| {
                l.trim_start_matches("# ")
                    .split(" # ")
                    .next()
                    .unwrap_or("")
                    .to_string()
                    + "\n"
            })
            .collect();
        let c = Config::parse(&example, Path::new("example")).unwrap();
        assert_eq!(c.service[0].name, "db");
    }

    #[test]
    fn every_expanded_key_is_expanded_and_named() {
        let env = |n: &str| (n == "ID").then(|| "w1".to_string());
        for key in expand::EXPANDED_KEYS {
            let (table, k) = key.split_once('.').unwrap();
            let text = format!("[{table}]\n{k} = \"/x/${{NOPE}}\"\n");
            let e = Config::parse_with_env(&text, Path::new("p.toml"), &env)
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                format!(
                    "config p.toml: {key}: ${{NOPE}} is not set and has no default \
                     (set NOPE, or write ${{NOPE:-default}})"
                )
            );
        }
        let text = "[workspace]\nmount_point = \"/w/${ID}\"\nstate_dir = \"/s/${ID}\"\n\
            [persist]\nremote = \"s3://b/${ID}\"\nendpoint = \"${EP:-http://127.0.0.1:9}\"\n\
            region = \"${REGION:-auto}\"\n\
            [control]\nlisten = \"0.0.0.0:${PORT:-8787}\"\nsocket = \"/run/${ID}.sock\"\n";
        let c = Config::parse_with_env(text, Path::new("p.toml"), &env).unwrap();
        assert_eq!(c.workspace.mount_point, PathBuf::from("/w/w1"));
        assert_eq!(c.workspace.state_dir, PathBuf::from("/s/w1"));
        assert_eq!(c.persist.remote, "s3://b/w1");
        assert_eq!(c.persist.endpoint.as_deref(), Some("http://127.0.0.1:9"));
        assert_eq!(c.persist.region.as_deref(), Some("auto"));
        assert_eq!(c.control.listen.as_deref(), Some("0.0.0.0:8787"));
        assert_eq!(c.control.socket, Some(PathBuf::from("/run/w1.sock")));
    }

    #[test]
    fn expanded_values_are_validated_and_other_keys_are_literal() {
        let env = |n: &str| (n == "REL").then(|| "relative".to_string());
        let e = Config::parse_with_env(
            "[workspace]\nstate_dir = \"${REL}\"\n",
            Path::new("p.toml"),
            &env,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("workspace.state_dir") && e.contains("`relative`"),
            "{e}"
        );
        // A key that names no place keeps its `$` as written.
        let c = Config::parse_with_env(
            "[control]\ntoken = \"a$b${REL}\"\n",
            Path::new("p.toml"),
            &env,
        )
        .unwrap();
        assert_eq!(c.control.token.unwrap().expose(), "a$b${REL}");
        // An optional key that expands to nothing is unset.
        let c = Config::parse_with_env(
            "[persist]\nendpoint = \"${EP:-}\"\nregion = \"${REL}\"\n",
            Path::new("p.toml"),
            &env,
        )
        .unwrap();
        assert_eq!(c.persist.endpoint, None);
        assert_eq!(c.persist.region.as_deref(), Some("relative"));
    }

    #[test]
    fn shipped_profiles_parse_with_their_variables() {
        let env = |n: &str| match n {
            "KEEL_WORKSPACE_ID" => Some("0123abcd".to_string()),
            "R2_ENDPOINT" => Some("https://acct.r2.cloudflarestorage.com".to_string()),
            _ => None,
        };
        let text = include_str!("../../../config/cloudflare.toml");
        let c = Config::parse_with_env(text, Path::new("cloudflare.toml"), &env).unwrap();
        assert_eq!(c.persist.remote, "s3://keel-workspaces/0123abcd");
        assert_eq!(
            c.persist.endpoint.as_deref(),
            Some("https://acct.r2.cloudflarestorage.com")
        );
        assert_eq!(c.persist.restore, persist::RestoreMode::Lazy);
        assert!(!c.persist.interval.is_zero());
        assert!(
            c.persist.lease_enabled(),
            "one writer per instance id, by the lease"
        );
        let e = Config::parse_with_env(text, Path::new("cloudflare.toml"), &|_| None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("persist.remote") && e.contains("${KEEL_WORKSPACE_ID} is not set"),
            "{e}"
        );
        for f in [
            include_str!("../../../config/config.toml"),
            include_str!("../../../config/docker.toml"),
            include_str!("../../../config/ci.toml"),
        ] {
            Config::parse_with_env(f, Path::new("profile.toml"), &|_| None).unwrap();
        }
    }

    #[test]
    fn defaults() {
        let c = Config::parse("", Path::new("x.toml")).unwrap();
        assert_eq!(c.workspace.cache, CacheMode::Auto);
        assert_eq!(c.workspace.mount_point, PathBuf::from("/workspace"));
    }
}

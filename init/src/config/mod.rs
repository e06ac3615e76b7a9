//! The one TOML file that configures keel (`/etc/keel/config.toml`, `--config`, `KEEL_CONFIG`):
//! typed, validated values. Unknown keys, wrong types and bad values are rejected with the
//! file, the key and the reason in one line, before anything is mounted or started.

pub mod control;
pub mod init;
pub mod persist;
pub mod service;
pub mod shutdown;
pub mod units;
pub mod workspace;

pub use control::ControlConfig;
pub use init::{ForwardTo, InitConfig, Rlimit};
pub use persist::{FsyncMode, PersistConfig, Takeover};
pub use service::{Probe, Readiness, Restart, ServiceConfig};
pub use shutdown::ShutdownConfig;
pub use workspace::{CacheMode, FuseUnavailable, Passthrough, Switch, WorkspaceConfig};

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

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub init: InitConfig,
    pub workspace: WorkspaceConfig,
    pub shutdown: ShutdownConfig,
    pub service: Vec<ServiceConfig>,
    pub control: ControlConfig,
    pub persist: PersistConfig,
}

impl Config {
    /// Parses and validates TOML text; `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| {
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
        cfg.validate()
            .map_err(|(key, reason)| ConfigError::Invalid {
                path: path.to_path_buf(),
                key,
                reason,
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

    fn validate(&self) -> Result<(), (String, String)> {
        self.init.validate()?;
        self.workspace.validate()?;
        self.shutdown.validate()?;
        service::validate(&self.service)?;
        self.control.validate()?;
        self.persist.validate()?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn defaults() {
        let c = Config::parse("", Path::new("x.toml")).unwrap();
        assert_eq!(c.workspace.cache, CacheMode::Auto);
        assert_eq!(c.workspace.mount_point, PathBuf::from("/workspace"));
    }
}

//! The one TOML file that configures keel (`/etc/keel/config.toml`, `--config`, `KEEL_CONFIG`):
//! typed, validated values. Unknown keys, wrong types and bad values are rejected with the
//! file, the key and the reason in one line, before anything is mounted or started.

pub mod units;
pub mod workspace;

pub use workspace::{CacheMode, FuseUnavailable, Passthrough, WorkspaceConfig};

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
    pub workspace: WorkspaceConfig,
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
        self.workspace.validate()?;
        Ok(())
    }
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
    fn defaults() {
        let c = Config::parse("", Path::new("x.toml")).unwrap();
        assert_eq!(c.workspace.cache, CacheMode::Auto);
        assert_eq!(c.workspace.mount_point, PathBuf::from("/workspace"));
    }
}

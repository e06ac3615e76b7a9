//! The `[files]` table: limits of the files API (`/files`): the largest upload and the most
//! entries one listing returns.

use super::BadKey;
use serde::Deserialize;

use super::units::size_str;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilesConfig {
    /// Largest `PUT /files` body (413 beyond; the file is left as it was).
    #[serde(with = "size_str")]
    pub max_upload: u64,
    /// Most entries one `GET /files?list=1` returns (then `"truncated": true`).
    pub max_list_entries: u32,
}

impl Default for FilesConfig {
    fn default() -> Self {
        FilesConfig {
            max_upload: 1 << 30,
            max_list_entries: 100_000,
        }
    }
}

impl FilesConfig {
    pub fn validate(&self) -> Result<(), BadKey> {
        let bad = |k: &str, why: &str| Err(BadKey::new(format!("files.{k}"), why.to_string()));
        if self.max_upload == 0 {
            return bad("max_upload", "must be at least 1 byte");
        }
        if self.max_list_entries == 0 {
            return bad("max_list_entries", "must be at least 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use std::path::Path;

    #[test]
    fn defaults_and_bad_values() {
        let c = Config::parse("", Path::new("c.toml")).unwrap();
        assert_eq!(c.files.max_upload, 1 << 30);
        assert_eq!(c.files.max_list_entries, 100_000);
        let c = Config::parse(
            "[files]\nmax_upload = \"4KiB\"\nmax_list_entries = 7\n",
            Path::new("c.toml"),
        )
        .unwrap();
        assert_eq!((c.files.max_upload, c.files.max_list_entries), (4096, 7));
        for t in [
            "[files]\nmax_upload = \"0\"\n",
            "[files]\nmax_list_entries = 0\n",
        ] {
            assert!(Config::parse(t, Path::new("c.toml")).is_err(), "{t}");
        }
        assert!(Config::parse("[files]\nnope = 1\n", Path::new("c.toml")).is_err());
    }
}

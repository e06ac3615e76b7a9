//! `[persist] credentials_file`: the remote's credentials from a file (a mounted secret)
//! instead of the container's environment. The file holds `KEY=VALUE` lines (blank lines and
//! `#` comments ignored, an `export ` prefix tolerated) whose keys are the variables the remote
//! reads from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `GOOGLE_*`,
//! `AZURE_*`, ...; `KEEL_CONTROL_TOKEN` too). It is read once per process; its values win over
//! the environment, go only to keel's own remote client (never `set_var`, never a child), and
//! are redacted from every error string. Also here: which variable names are secrets that no
//! child of keel may inherit.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Why the credentials file cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CredentialsError {
    #[error("credentials file {}: cannot read: {reason}", path.display())]
    Read { path: PathBuf, reason: String },
    #[error("credentials file {}: line {line}: {reason}", path.display())]
    Malformed {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

/// The parsed file: `(KEY, VALUE)` in file order (a later line with the same key wins).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    vars: Vec<(String, String)>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&str> = self.vars.iter().map(|(k, _)| k.as_str()).collect();
        write!(f, "Credentials({keys:?}, values redacted)")
    }
}

impl Credentials {
    /// Parses the text of a credentials file; `path` only names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, CredentialsError> {
        let mut vars: Vec<(String, String)> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let bad = |reason: &str| CredentialsError::Malformed {
                path: path.to_path_buf(),
                line: i + 1,
                reason: reason.to_string(),
            };
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let l = l.strip_prefix("export ").map(str::trim_start).unwrap_or(l);
            let Some((k, v)) = l.split_once('=') else {
                return Err(bad("not KEY=VALUE"));
            };
            let k = k.trim();
            if k.is_empty()
                || k.starts_with(|c: char| c.is_ascii_digit())
                || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            {
                return Err(bad(
                    "the key is not a variable name ([A-Za-z_][A-Za-z0-9_]*)",
                ));
            }
            let v = v.trim();
            let v = match (v.chars().next(), v.chars().last()) {
                (Some(q @ ('"' | '\'')), Some(e)) if v.len() >= 2 && e == q => &v[1..v.len() - 1],
                (Some('"' | '\''), _) => return Err(bad("unterminated quote")),
                _ => v,
            };
            vars.retain(|(ek, _)| ek != k);
            vars.push((k.to_string(), v.to_string()));
        }
        Ok(Credentials { vars })
    }

    /// Reads and parses `path`; `warn` gets a line when the file is readable by group or others.
    pub fn read(path: &Path, warn: impl FnOnce(String)) -> Result<Self, CredentialsError> {
        use std::os::unix::fs::PermissionsExt;
        let err = |e: std::io::Error| CredentialsError::Read {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let meta = std::fs::metadata(path).map_err(err)?;
        if meta.permissions().mode() & 0o044 != 0 {
            warn(format!(
                "credentials file {} is readable by group or others (mode {:04o}): make it 0600 or 0400",
                path.display(),
                meta.permissions().mode() & 0o7777
            ));
        }
        let text = std::fs::read_to_string(path).map_err(err)?;
        Self::parse(&text, path)
    }

    /// Every `(KEY, VALUE)` whose key starts with `prefix` (e.g. `AWS_`).
    pub fn with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a str, &'a str)> {
        self.vars
            .iter()
            .filter(move |(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// The value of `key`, if the file sets it.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.vars
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Every value (to redact them).
    pub fn values(&self) -> impl Iterator<Item = &str> {
        self.vars.iter().map(|(_, v)| v.as_str())
    }

    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }
}

/// The file this process read (once), or the error it gave.
static LOADED: OnceLock<(PathBuf, Result<Credentials, CredentialsError>)> = OnceLock::new();

/// Reads `path` the first time it is called in this process and returns that result ever
/// after (a later call naming another path gets the first file's result).
pub fn load(path: &Path) -> Result<&'static Credentials, CredentialsError> {
    let (_, r) = LOADED.get_or_init(|| {
        let r = Credentials::read(path, |w| tracing::warn!("{w}"));
        (path.to_path_buf(), r)
    });
    r.as_ref().map_err(Clone::clone)
}

/// The credentials read by `load`, when it succeeded.
pub fn loaded() -> Option<&'static Credentials> {
    LOADED.get().and_then(|(_, r)| r.as_ref().ok())
}

/// The credentials for `cfg`: none without `credentials_file`, else the file (read once).
pub fn for_config(
    cfg: &super::PersistConfig,
) -> Result<Option<&'static Credentials>, CredentialsError> {
    match &cfg.credentials_file {
        None => Ok(None),
        Some(p) => load(p).map(Some),
    }
}

/// The secret variables `keel run` took out of its own environment at start (see
/// `take_from_env`), so neither its children nor `/proc/<keel>/environ` show them.
static FROM_ENV: OnceLock<Credentials> = OnceLock::new();

/// Moves every secret variable (`is_secret_var` with `extra`) out of keel's environment into
/// this module, once. keel must still be single-threaded. Returns how many were taken.
pub fn take_from_env(extra: &[String]) -> usize {
    let mut n = 0;
    FROM_ENV.get_or_init(|| {
        let vars = crate::sys::process::take_env(|k| is_secret_var(k, extra));
        n = vars.len();
        Credentials { vars }
    });
    n
}

/// The value keel uses for the secret variable `key`: the credentials file's, else the one
/// taken from the environment at start, else the environment's.
pub fn value(key: &str) -> Option<String> {
    loaded()
        .and_then(|c| c.get(key))
        .or_else(|| FROM_ENV.get().and_then(|c| c.get(key)))
        .map(str::to_string)
        .or_else(|| std::env::var(key).ok())
}

/// The `(KEY, VALUE)` pairs with `prefix` that keel took from its environment at start (they
/// are no longer in it, so the remote's `from_env` builders miss them).
pub fn taken_with_prefix(
    prefix: &'static str,
) -> impl Iterator<Item = (&'static str, &'static str)> {
    FROM_ENV
        .get()
        .into_iter()
        .flat_map(move |c| c.with_prefix(prefix))
}

/// Every secret value this process knows of (file and environment), to redact them.
pub fn secret_values() -> impl Iterator<Item = &'static str> {
    loaded()
        .into_iter()
        .chain(FROM_ENV.get())
        .flat_map(|c| c.values())
}

/// Prefixes of the variables keel's remote clients read: never passed to a child.
pub const SECRET_PREFIXES: &[&str] = &["AWS_", "GOOGLE_", "AZURE_"];

/// True when no child of keel may inherit the variable `name`: the remote's variables, the
/// control token, keel's crash-test hook (`KEEL_DIE_AT`), and whatever `extra` names (exact
/// names, or prefixes written `PREFIX*`).
pub fn is_secret_var(name: &str, extra: &[String]) -> bool {
    SECRET_PREFIXES.iter().any(|p| name.starts_with(p))
        || name == super::control::TOKEN_ENV
        || name == crate::logging::DIE_AT_ENV
        || extra.iter().any(|e| match e.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == e,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<Credentials, CredentialsError> {
        Credentials::parse(text, Path::new("/run/secrets/keel/credentials"))
    }

    #[test]
    fn parses_key_value_lines_comments_export_and_quotes() {
        let c = p("# R2 token for tenant 7\n\nAWS_ACCESS_KEY_ID=AKIA123\nexport AWS_SECRET_ACCESS_KEY = \"s3cr=t/+x\"\n  AWS_REGION='auto'\nAWS_ENDPOINT_URL=https://acct.r2.cloudflarestorage.com\nEMPTY=\nAWS_ACCESS_KEY_ID=AKIA456\n").unwrap();
        assert_eq!(c.get("AWS_ACCESS_KEY_ID"), Some("AKIA456"), "last one wins");
        assert_eq!(c.get("AWS_SECRET_ACCESS_KEY"), Some("s3cr=t/+x"));
        assert_eq!(c.get("AWS_REGION"), Some("auto"));
        assert_eq!(c.get("EMPTY"), Some(""));
        assert_eq!(c.with_prefix("AWS_").count(), 4);
        assert!(!format!("{c:?}").contains("s3cr"), "{c:?}");
        assert!(p("").unwrap().is_empty());
    }

    #[test]
    fn malformed_lines_are_named_by_file_and_line() {
        for (text, line, why) in [
            ("A=1\nnot a pair\n", 2, "not KEY=VALUE"),
            ("\n\n=x\n", 3, "variable name"),
            ("AWS KEY=x\n", 1, "variable name"),
            ("1AWS=x\n", 1, "variable name"),
            ("K=\"open\n", 1, "unterminated quote"),
        ] {
            let e = p(text).unwrap_err().to_string();
            assert!(
                e.starts_with("credentials file /run/secrets/keel/credentials: line "),
                "{e}"
            );
            assert!(e.contains(&format!("line {line}: ")), "{text:?}: {e}");
            assert!(e.contains(why), "{text:?}: {e}");
            assert!(!e.contains('\n'));
        }
    }

    #[test]
    fn reading_warns_about_a_file_others_can_read_and_names_a_missing_one() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("creds");
        std::fs::write(&f, "AWS_SECRET_ACCESS_KEY=abcdef123\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut warned = None;
        let c = Credentials::read(&f, |w| warned = Some(w)).unwrap();
        assert_eq!(c.get("AWS_SECRET_ACCESS_KEY"), Some("abcdef123"));
        let w = warned.expect("a warning for mode 0644");
        assert!(
            w.contains("readable by group or others") && w.contains("0644"),
            "{w}"
        );
        assert!(!w.contains("abcdef123"));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut warned = None;
        Credentials::read(&f, |w| warned = Some(w)).unwrap();
        assert_eq!(warned, None);
        let e = Credentials::read(&d.path().join("missing"), |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing: cannot read"), "{e}");
    }

    #[test]
    fn secret_variables() {
        let extra = vec!["MY_TOKEN".to_string(), "VAULT_*".to_string()];
        for s in [
            "AWS_SECRET_ACCESS_KEY",
            "AWS_REGION",
            "GOOGLE_SERVICE_ACCOUNT",
            "AZURE_STORAGE_ACCOUNT_KEY",
            "KEEL_CONTROL_TOKEN",
            "KEEL_DIE_AT",
            "MY_TOKEN",
            "VAULT_ADDR",
        ] {
            assert!(is_secret_var(s, &extra), "{s}");
        }
        for s in ["PATH", "HOME", "KEEL_LOG", "MY_TOKEN_2", "AWSX", "VAULT"] {
            assert!(!is_secret_var(s, &extra), "{s}");
        }
    }
}

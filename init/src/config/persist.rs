//! The `[persist]` table: where checkpoints go (the remote), how often they are taken, which
//! snapshots are kept (by count, age and size), and the budgets of the final checkpoint at shutdown. Validated
//! here, used by `persist/`.

use super::BadKey;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::units::{duration_str, opt_duration_str, opt_size_str, size_str};

/// When `fsync` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FsyncMode {
    /// Once the bytes are durable on the state volume.
    Local,
    /// Once a checkpoint holding them reached the remote.
    Remote,
}

/// What a starting writer does when another live writer holds the workspace's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Takeover {
    /// Fail the start, naming the holder.
    #[default]
    Refuse,
    /// Wait until the holder's lease runs out (at most its expiry plus one ttl), then take it.
    Wait,
    /// Take it at once; the old holder stops checkpointing at its next renewal.
    Force,
}

/// A `--takeover=MODE` that is not one of the modes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not one of refuse, wait, force")]
pub struct ParseTakeoverError(pub String);

impl std::str::FromStr for Takeover {
    type Err = ParseTakeoverError;
    fn from_str(s: &str) -> Result<Self, ParseTakeoverError> {
        match s {
            "refuse" => Ok(Takeover::Refuse),
            "wait" => Ok(Takeover::Wait),
            "force" => Ok(Takeover::Force),
            other => Err(ParseTakeoverError(other.to_string())),
        }
    }
}

/// How a start with an empty state dir restores the remote's head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestoreMode {
    /// Metadata first; file data fetched on first read (mount in well under a second).
    Lazy,
    /// Every chunk fetched before the workspace is mounted.
    Eager,
}

/// When a lazily restored workspace fetches the windows the last session read (its read
/// set, recorded by every checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReplayMode {
    /// Before the workspace is mounted (before `keel run`'s main command starts).
    Before,
    /// In the background from the mount on, beside the main command.
    Beside,
    /// Not at all.
    Off,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PersistConfig {
    /// Object store URL: `file:///path`, `s3://bucket/prefix`, `gs://...`, `az://...`;
    /// empty = `file://<state_dir>/remote`; `none` = no checkpoints.
    pub remote: String,
    /// Checkpoint this often when something changed (`0s` = only on demand and at stop).
    #[serde(with = "duration_str")]
    pub interval: Duration,
    pub fsync: FsyncMode,
    /// Snapshots kept on the remote (older ones are removed by gc).
    pub keep: u32,
    /// Unnamed snapshots older than this are removed by gc (`None`: any age).
    #[serde(with = "opt_duration_str")]
    pub keep_age: Option<Duration>,
    /// Unnamed snapshots are removed by gc, oldest first, until the kept ones hold at most
    /// this many bytes on the remote (`None`: any size). See `persist::gc`.
    #[serde(with = "opt_size_str")]
    pub keep_size: Option<u64>,
    /// Write a full snapshot after this many deltas (compaction).
    pub compact_every: u32,
    /// Chunks smaller than this go into packs (0: every chunk is its own object).
    #[serde(with = "size_str")]
    pub pack_below: u64,
    /// Bytes of chunks a pack holds (it is cut once it reaches this).
    #[serde(with = "size_str")]
    pub pack_size: u64,
    /// Unreferenced chunks younger than this are kept (an upload may be about to use them).
    #[serde(with = "duration_str")]
    pub gc_grace: Duration,
    /// Run gc after every this many checkpoints (0 = only `keel gc`).
    pub gc_every: u32,
    /// Budget of the final checkpoint at shutdown.
    #[serde(with = "duration_str")]
    pub flush_timeout: Duration,
    /// Parallel uploads/downloads.
    pub concurrency: usize,
    /// Restore at start into an empty state dir: `lazy` or `eager`.
    pub restore: RestoreMode,
    /// After a lazy restore, fetch every remaining window in the background.
    pub prefetch: bool,
    /// When a lazy restore fetches the last session's read set.
    pub replay: ReplayMode,
    /// Bytes of windows the read set holds at most (the most recently read); 0 records none.
    #[serde(with = "size_str")]
    pub read_set: u64,
    /// S3-compatible endpoint (MinIO, R2, moto, ...); also `AWS_ENDPOINT_URL`.
    pub endpoint: Option<String>,
    /// Region (also `AWS_REGION`).
    pub region: Option<String>,
    /// Path-style S3 requests (`http://host/bucket/key`), which most non-AWS servers need.
    pub path_style: bool,
    /// Allow plain `http://` endpoints.
    pub allow_http: bool,
    /// Single-writer lease on the remote: how long it lasts unless renewed (renewed every
    /// third of it). `0s` turns the lease off.
    #[serde(with = "duration_str")]
    pub lease_ttl: Duration,
    /// What to do when another live writer holds the lease.
    pub takeover: Takeover,
    /// How long a start with an empty state dir (a new host) keeps trying a remote that does
    /// not answer before it gives up: without the remote it has no workspace to serve.
    /// `0s`: give up after one round of retries.
    #[serde(with = "duration_str")]
    pub start_wait: Duration,
    /// A file of `KEY=VALUE` lines with the remote's credentials (the variables it would read
    /// from the environment), read once at start; its values win over the environment and
    /// never reach a process keel starts. See `config::credentials`.
    pub credentials_file: Option<PathBuf>,
}

impl Default for PersistConfig {
    fn default() -> Self {
        Self {
            remote: String::new(),
            interval: Duration::from_secs(30),
            fsync: FsyncMode::Local,
            keep: 16,
            keep_age: None,
            keep_size: None,
            compact_every: 32,
            pack_below: 64 << 10,
            pack_size: 4 << 20,
            gc_grace: Duration::from_secs(15 * 60),
            gc_every: 16,
            flush_timeout: Duration::from_secs(2),
            concurrency: 16,
            restore: RestoreMode::Lazy,
            prefetch: false,
            replay: ReplayMode::Beside,
            read_set: 256 << 20,
            endpoint: None,
            region: None,
            path_style: true,
            allow_http: false,
            lease_ttl: Duration::from_secs(30),
            takeover: Takeover::Refuse,
            start_wait: Duration::from_secs(60),
            credentials_file: None,
        }
    }
}

impl PersistConfig {
    pub fn validate(&self) -> Result<(), BadKey> {
        let bad = |k: &str, why: String| Err(BadKey::new(format!("persist.{k}"), why));
        let r = self.remote.as_str();
        if !(r.is_empty()
            || r == "none"
            || ["file://", "s3://", "gs://", "az://", "abfs://", "memory://"]
                .iter()
                .any(|p| r.starts_with(p)))
        {
            return bad(
                "remote",
                format!("`{r}` is not a file://, s3://, gs:// or az:// URL (or \"none\")"),
            );
        }
        if self.keep == 0 {
            return bad("keep", "must keep at least 1 snapshot".into());
        }
        if self.keep_age.is_some_and(|a| a.is_zero()) {
            return bad(
                "keep_age",
                "must be more than 0 (leave the key out to keep snapshots of any age)".into(),
            );
        }
        if self.keep_size == Some(0) {
            return bad(
                "keep_size",
                "must be more than 0 (leave the key out to keep snapshots of any size)".into(),
            );
        }
        if self.compact_every == 0 {
            return bad("compact_every", "must be at least 1".into());
        }
        if self.pack_below > 0 && !(64 << 10..=256 << 20).contains(&self.pack_size) {
            return bad(
                "pack_size",
                format!("{} bytes is not between 64KiB and 256MiB", self.pack_size),
            );
        }
        if self.pack_below > 16 << 20 {
            return bad(
                "pack_below",
                format!(
                    "{} bytes is more than 16MiB (packs are for small chunks; 0 turns them off)",
                    self.pack_below
                ),
            );
        }
        if !(1..=256).contains(&self.concurrency) {
            return bad(
                "concurrency",
                format!("{} is not between 1 and 256", self.concurrency),
            );
        }
        if !self.lease_ttl.is_zero() && self.lease_ttl < Duration::from_secs(1) {
            return bad(
                "lease_ttl",
                format!(
                    "{:?} is too short: use at least 1s, or 0s to turn the lease off",
                    self.lease_ttl
                ),
            );
        }
        if let Some(f) = &self.credentials_file {
            if !f.is_absolute() {
                return bad(
                    "credentials_file",
                    format!("`{}` must be an absolute path", f.display()),
                );
            }
        }
        Ok(())
    }

    /// Whether checkpoints are fenced by the single-writer lease: on for every configured
    /// remote unless `lease_ttl = "0s"`; off for the default remote inside the state dir
    /// (only this state dir can write it, and its lock already admits one keel).
    pub fn lease_enabled(&self) -> bool {
        !self.lease_ttl.is_zero() && !self.remote.is_empty() && self.remote != "none"
    }

    /// The remote URL in effect for a state dir (`None`: checkpoints are off).
    pub fn remote_url(&self, state_dir: &Path) -> Option<String> {
        match self.remote.as_str() {
            "none" => None,
            "" => Some(format!(
                "file://{}",
                state_dir.join(crate::state::REMOTE).display()
            )),
            r => Some(r.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use super::*;

    #[test]
    fn parses_and_validates() {
        let c = Config::parse(
            "[persist]\nremote = \"s3://b/p\"\ninterval = \"10s\"\nfsync = \"remote\"\nkeep = 3\n",
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.persist.interval, Duration::from_secs(10));
        assert_eq!(c.persist.fsync, FsyncMode::Remote);
        assert_eq!(c.persist.keep, 3);
        assert_eq!(c.persist.restore, RestoreMode::Lazy);
        assert!(!c.persist.prefetch);
        let c = Config::parse(
            "[persist]\nrestore = \"eager\"\nprefetch = true\n",
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.persist.restore, RestoreMode::Eager);
        assert!(c.persist.prefetch);
        let e = Config::parse("[persist]\nrestore = \"later\"\n", Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("later"), "{e}");
        let e = Config::parse("[persist]\nremote = \"ftp://x\"\n", Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("persist.remote"), "{e}");
        let d = PersistConfig::default();
        assert_eq!(
            d.remote_url(Path::new("/s")).as_deref(),
            Some("file:///s/remote")
        );
        assert!(
            !d.lease_enabled(),
            "no lease for the remote inside the state dir"
        );
        assert_eq!(d.takeover, Takeover::Refuse);
    }

    #[test]
    fn lease_keys() {
        let c = Config::parse(
            "[persist]\nremote = \"s3://b/p\"\nlease_ttl = \"10s\"\ntakeover = \"wait\"\n",
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.persist.lease_ttl, Duration::from_secs(10));
        assert_eq!(c.persist.takeover, Takeover::Wait);
        assert!(c.persist.lease_enabled());
        let c = Config::parse(
            "[persist]\nremote = \"s3://b/p\"\nlease_ttl = \"0s\"\n",
            Path::new("x.toml"),
        )
        .unwrap();
        assert!(!c.persist.lease_enabled());
        for bad in ["lease_ttl = \"100ms\"", "takeover = \"steal\""] {
            let e = Config::parse(&format!("[persist]\n{bad}\n"), Path::new("x.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad.split(' ').next().unwrap()), "{e}");
        }
        assert_eq!("force".parse::<Takeover>(), Ok(Takeover::Force));
        assert!("x".parse::<Takeover>().is_err());
    }

    #[test]
    fn retention_keys() {
        let d = PersistConfig::default();
        assert_eq!((d.keep_age, d.keep_size), (None, None), "off by default");
        let c = Config::parse(
            "[persist]\nkeep = 100\nkeep_age = \"7d\"\nkeep_size = \"20GiB\"\n",
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.persist.keep_age, Some(Duration::from_secs(7 * 86400)));
        assert_eq!(c.persist.keep_size, Some(20 << 30));
        let c = Config::parse("[persist]\nkeep_size = 4096\n", Path::new("x.toml")).unwrap();
        assert_eq!(c.persist.keep_size, Some(4096));
        for (bad, key) in [
            ("keep_age = \"0s\"", "persist.keep_age"),
            ("keep_age = \"7 weeks\"", "keep_age"),
            ("keep_age = 7", "keep_age"),
            ("keep_size = \"0\"", "persist.keep_size"),
            ("keep_size = \"20GB\"", "keep_size"),
            ("keep_size = -1", "keep_size"),
        ] {
            let e = Config::parse(&format!("[persist]\n{bad}\n"), Path::new("x.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{bad}: {e}");
            assert_eq!(e.lines().count(), 1, "{bad}: {e}");
        }
    }
}

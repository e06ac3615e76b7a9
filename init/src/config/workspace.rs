//! The `[workspace]` table: where the FUSE workspace is mounted, where its state lives, and
//! how the kernel caches it. Owned by the filesystem side; validated here, used by `workspace/`.

use super::BadKey;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

use super::units::{duration_str, size_str};

/// Page-cache policy for file contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheMode {
    /// Keep the page cache across opens while the file is unchanged; drop it when it changed.
    Auto,
    /// Never drop the page cache on open (fastest; single writer only).
    Kernel,
    /// Direct I/O: no page cache for file contents.
    None,
}

/// A mode given on the command line (`keel mount --cache`, `--passthrough`) that is not one
/// of its values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseModeError {
    #[error("cache mode `{0}` is not one of auto, kernel, none")]
    CacheMode(String),
    #[error("`{0}` is not one of auto, on, off")]
    Switch(String),
}

impl std::str::FromStr for CacheMode {
    type Err = ParseModeError;
    fn from_str(s: &str) -> Result<Self, ParseModeError> {
        match s {
            "auto" => Ok(Self::Auto),
            "kernel" => Ok(Self::Kernel),
            "none" => Ok(Self::None),
            _ => Err(ParseModeError::CacheMode(s.to_string())),
        }
    }
}

impl CacheMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Kernel => "kernel",
            Self::None => "none",
        }
    }
}

/// A kernel feature to use when offered (`auto`), to insist on (`on`), or to leave off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Switch {
    Auto,
    On,
    Off,
}

impl std::str::FromStr for Switch {
    type Err = ParseModeError;
    fn from_str(s: &str) -> Result<Self, ParseModeError> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            _ => Err(ParseModeError::Switch(s.to_string())),
        }
    }
}

/// Whether to hand file I/O to the kernel via FUSE passthrough.
pub type Passthrough = Switch;

/// What to do when FUSE cannot be mounted (no `/dev/fuse`, no CAP_SYS_ADMIN) and the
/// provider is `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FuseUnavailable {
    /// Stop, naming the missing `docker run` / `podman run` flag.
    Fail,
    /// Use the `dir` provider (durable: checkpoints found by walking the tree). The old
    /// name `plain-dir` (a workspace that was not durable) now means this.
    #[serde(alias = "plain-dir")]
    Dir,
}

/// How `/workspace` is provided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Provider {
    /// FUSE when it can be mounted, else `dir` (unless `on_fuse_unavailable = "fail"`).
    Auto,
    /// FUSE or nothing: a start without `/dev/fuse` or CAP_SYS_ADMIN stops.
    Fuse,
    /// A plain directory on the state volume, checkpointed by walking it.
    Dir,
}

impl Provider {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fuse => "fuse",
            Self::Dir => "dir",
        }
    }
}

/// How keel's default mount source starts (`keel:<state dir>`). Older keels mounted with the
/// source `keel` alone.
pub const FSNAME_PREFIX: &str = "keel:";

/// The longest mount source mount(2) takes: a string of at most PATH_MAX bytes with its NUL.
const FSNAME_MAX: usize = 4095;

/// Why `name` cannot be a mount source: empty, longer than mount(2) takes, or holding a
/// control character (a newline would forge lines in the tools that print mount tables).
fn check_fsname(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > FSNAME_MAX {
        return Err(format!(
            "`{}...` is {} bytes, more than {FSNAME_MAX}",
            name.chars().take(40).collect::<String>(),
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(format!("{name:?} holds a control character"));
    }
    Ok(())
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkspaceConfig {
    /// Where the workspace is mounted.
    pub mount_point: PathBuf,
    /// Durable state: metadata database, file bodies, chunks.
    pub state_dir: PathBuf,
    /// The mount's source as /proc/self/mountinfo, `df` and `findmnt` show it (what tells
    /// one keel mount from another); None: `keel:<state_dir>` ([`Self::fsname`]).
    pub fsname: Option<String>,
    pub cache: CacheMode,
    /// FUSE worker threads (0 = number of CPUs, at least 2).
    pub threads: usize,
    #[serde(with = "duration_str")]
    pub attr_timeout: Duration,
    #[serde(with = "duration_str")]
    pub entry_timeout: Duration,
    #[serde(with = "duration_str")]
    pub negative_timeout: Duration,
    /// Kernel writeback cache (batches small writes; not used together with passthrough).
    pub writeback_cache: bool,
    pub passthrough: Passthrough,
    /// Removed keys (FUSE over io_uring and its ring threads' scheduling class): accepted
    /// by the parser only to refuse them in `validate` with a line that says they are gone.
    #[serde(rename = "io_uring")]
    pub removed_io_uring: Option<serde::de::IgnoredAny>,
    #[serde(rename = "ring_sched")]
    pub removed_ring_sched: Option<serde::de::IgnoredAny>,
    /// Files up to this size are stored inline in the metadata database.
    #[serde(with = "size_str")]
    pub inline_max: u64,
    /// Chunk window for checkpoints (power of two, 64 KiB – 8 MiB).
    #[serde(with = "size_str")]
    pub chunk_size: u64,
    /// Ceiling of SQLite's page cache on the filesystem's connection to meta.db (1 MiB –
    /// 1 GiB); `None`: the memory budget's share (`budget::Shares::fs_cache`).
    #[serde(default, with = "super::units::opt_size_str")]
    pub meta_cache: Option<u64>,
    /// keel's own memory budget: `None` (`"auto"`, the default) derives it from the cgroup's
    /// `memory.max` (see `budget`); else a size, 16 MiB – 64 GiB.
    #[serde(with = "memory_budget")]
    pub memory_budget: Option<u64>,
    pub on_fuse_unavailable: FuseUnavailable,
    /// Events the change feed (`GET /watch`) keeps for readers to resume from (1 – 10M).
    pub watch_window: usize,
    /// `auto` (FUSE when it can mount, else `dir`), `fuse` or `dir`.
    pub provider: Provider,
}

/// Events the change feed keeps by default (`watch_window`).
pub const DEFAULT_WATCH_WINDOW: usize = 65536;

impl Default for WorkspaceConfig {
    fn default() -> Self {
        Self {
            mount_point: PathBuf::from("/workspace"),
            state_dir: PathBuf::from("/var/lib/keel"),
            fsname: None,
            cache: CacheMode::Auto,
            threads: 0,
            attr_timeout: Duration::from_secs(60),
            entry_timeout: Duration::from_secs(60),
            negative_timeout: Duration::from_secs(60),
            writeback_cache: true,
            passthrough: Passthrough::Auto,
            removed_io_uring: None,
            removed_ring_sched: None,
            inline_max: 4096,
            chunk_size: 512 * 1024,
            meta_cache: None,
            memory_budget: None,
            on_fuse_unavailable: FuseUnavailable::Dir,
            watch_window: DEFAULT_WATCH_WINDOW,
            provider: Provider::Auto,
        }
    }
}

impl WorkspaceConfig {
    /// Checks values serde cannot: ranges and relations between keys.
    pub fn validate(&self) -> Result<(), BadKey> {
        let bad = |k: &str, why: String| Err(BadKey::new(format!("workspace.{k}"), why));
        for (key, set) in [
            ("io_uring", self.removed_io_uring.is_some()),
            ("ring_sched", self.removed_ring_sched.is_some()),
        ] {
            if set {
                return bad(
                    key,
                    "this key is gone: keel serves FUSE over /dev/fuse only (remove the line)"
                        .into(),
                );
            }
        }
        if !self.mount_point.is_absolute() {
            return bad(
                "mount_point",
                format!("`{}` must be an absolute path", self.mount_point.display()),
            );
        }
        if !self.state_dir.is_absolute() {
            return bad(
                "state_dir",
                format!("`{}` must be an absolute path", self.state_dir.display()),
            );
        }
        if let Err(why) = check_fsname(&self.fsname()) {
            return bad("fsname", why);
        }
        if self.threads > 64 {
            return bad("threads", format!("{} is more than 64", self.threads));
        }
        if !self.chunk_size.is_power_of_two() || !(64 << 10..=8 << 20).contains(&self.chunk_size) {
            return bad(
                "chunk_size",
                format!(
                    "{} must be a power of two between 64KiB and 8MiB",
                    self.chunk_size
                ),
            );
        }
        if let Some(m) = self.meta_cache.filter(|m| !(1 << 20..=1 << 30).contains(m)) {
            return bad("meta_cache", format!("{m} must be between 1MiB and 1GiB"));
        }
        if let Some(m) = self.memory_budget.filter(|m| {
            !(crate::budget::MIN_CONFIGURED..=crate::budget::MAX_CONFIGURED).contains(m)
        }) {
            return bad(
                "memory_budget",
                format!("{m} must be \"auto\" or between 16MiB and 64GiB"),
            );
        }
        if !(1..=10_000_000).contains(&self.watch_window) {
            return bad(
                "watch_window",
                format!("{} must be between 1 and 10000000", self.watch_window),
            );
        }
        if self.inline_max > 64 * 1024 {
            return bad(
                "inline_max",
                format!("{} is larger than 64KiB", self.inline_max),
            );
        }
        Ok(())
    }

    /// The mount's source: `fsname` if set, else `keel:` and the state dir.
    pub fn fsname(&self) -> String {
        self.fsname
            .clone()
            .unwrap_or_else(|| format!("{FSNAME_PREFIX}{}", self.state_dir.display()))
    }

    /// The memory budget this config gives in this process (see `budget`).
    pub fn budget(&self) -> crate::budget::Budget {
        crate::budget::Budget::detect(self.memory_budget)
    }

    /// Worker threads to actually start.
    pub fn effective_threads(&self) -> usize {
        if self.threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
                .clamp(2, 8)
        } else {
            self.threads
        }
    }
}

/// serde helper for `memory_budget`: `"auto"` (`None`) or a size.
mod memory_budget {
    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        N(u64),
        S(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Some(n)),
            Raw::S(s) if s == "auto" => Ok(None),
            Raw::S(s) => super::super::units::parse_size(&s)
                .map(Some)
                .map_err(|e| serde::de::Error::custom(format!("{e} (or \"auto\")"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fsname_defaults_to_keel_and_the_state_dir() {
        let mut ws = WorkspaceConfig {
            state_dir: "/srv/a b/state".into(),
            ..Default::default()
        };
        assert_eq!(ws.fsname(), "keel:/srv/a b/state");
        assert_eq!(ws.validate(), Ok(()));
        ws.fsname = Some("keel:test".into());
        assert_eq!(ws.fsname(), "keel:test");
        assert_eq!(ws.validate(), Ok(()));
    }

    #[test]
    fn a_bad_fsname_is_refused_with_the_key() {
        for (name, why) in [
            ("", "must not be empty"),
            ("a\nb", "holds a control character"),
            ("x\t", "holds a control character"),
        ] {
            let ws = WorkspaceConfig {
                fsname: Some(name.into()),
                ..Default::default()
            };
            let BadKey {
                key,
                problem: reason,
            } = ws.validate().unwrap_err();
            assert_eq!(key, "workspace.fsname");
            assert!(reason.contains(why), "{name:?}: {reason}");
        }
        let long = WorkspaceConfig {
            state_dir: PathBuf::from(format!("/{}", "d".repeat(4091))),
            ..Default::default()
        };
        let BadKey {
            key,
            problem: reason,
        } = long.validate().unwrap_err();
        assert_eq!(key, "workspace.fsname");
        assert!(reason.contains("4097 bytes, more than 4095"), "{reason}");
    }
}

//! keel's memory budget: how much memory keel itself may use, where that figure comes from
//! (`[workspace] memory_budget`: a size, or `auto` from the cgroup v2 `memory.max` of keel's
//! own cgroup), the one place every memory-sized knob is derived from it ([`Shares`]), and
//! what keel measures against it (RSS, the peak of the last checkpoint and of the last
//! operation, [`track`]) and does when it is near it ([`pressure`]).
//!
//! A leaf: it reads `/proc` and `/sys/fs/cgroup` with `std::fs` and imports nothing of keel,
//! so `meta`, `persist`, `workspace` and `control` all take their sizes from here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

const MIB: u64 = 1 << 20;

/// The smallest budget `auto` gives (a quarter of a 64 MiB container would leave keel too
/// little for its SQLite caches and one hashing batch).
pub const FLOOR: u64 = 32 * MIB;
/// The largest budget `auto` gives, whatever the container has.
pub const AUTO_CEILING: u64 = 1 << 30;
/// The budget without a memory limit to derive it from: enough for the old fixed sizes
/// except the filesystem's SQLite cache (16 MiB of its 32), which keeps keel's peak through
/// a 30,000-file install under 64 MiB (BENCHMARKS.md, "Memory").
pub const NO_LIMIT: u64 = 128 * MIB;
/// The share of the container's limit `auto` takes: a quarter.
pub const LIMIT_SHARE: u64 = 4;
/// The range of an explicit `memory_budget`.
pub const MIN_CONFIGURED: u64 = 16 * MIB;
pub const MAX_CONFIGURED: u64 = 64 << 30;

/// Where the budget came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `[workspace] memory_budget = "SIZE"`.
    Configured,
    /// A quarter of this cgroup `memory.max` (bytes; v1: `memory.limit_in_bytes`), within
    /// [`FLOOR`]..[`AUTO_CEILING`].
    Cgroup { limit: u64 },
    /// No memory limit above keel (or no cgroup v2): [`NO_LIMIT`].
    NoLimit,
    /// A `memory.max` that could not be read as a limit (the reason): [`NO_LIMIT`].
    Unreadable(String),
}

/// keel's memory budget, bytes, and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    pub source: Source,
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} MiB ", self.bytes / MIB)?;
        match &self.source {
            Source::Configured => write!(f, "([workspace] memory_budget)"),
            Source::Cgroup { limit } => write!(
                f,
                "(a quarter of the cgroup's memory.max of {} MiB)",
                limit / MIB
            ),
            Source::NoLimit => write!(f, "(no cgroup memory limit)"),
            Source::Unreadable(why) => write!(f, "(memory.max unreadable: {why})"),
        }
    }
}

/// A cgroup v1 `memory.limit_in_bytes` at or past this is "no limit" (v1 writes its
/// largest page count in bytes, 9223372036854771712 on x86-64, rather than `max`).
const V1_UNLIMITED: u64 = 1 << 60;

/// Reads a cgroup v2 `memory.max` (or a v1 `memory.limit_in_bytes`): `Ok(None)` for `max`
/// (no limit), the limit in bytes, or why the text is not one.
pub fn parse_memory_max(text: &str) -> Result<Option<u64>, String> {
    let t = text.trim();
    if t == "max" {
        return Ok(None);
    }
    match t.parse::<u64>() {
        Ok(0) => Err("a limit of 0 bytes".into()),
        Ok(n) if n >= V1_UNLIMITED => Ok(None),
        Ok(n) => Ok(Some(n)),
        Err(_) => Err(format!("{t:?} is neither a number nor \"max\"")),
    }
}

impl Budget {
    /// The budget `auto` gives under a memory limit of `limit` bytes (`None`: no limit).
    pub fn from_limit(limit: Option<u64>) -> Budget {
        match limit {
            Some(limit) => Budget {
                bytes: (limit / LIMIT_SHARE).clamp(FLOOR, AUTO_CEILING),
                source: Source::Cgroup { limit },
            },
            None => Budget {
                bytes: NO_LIMIT,
                source: Source::NoLimit,
            },
        }
    }

    /// The budget from the config (`Some(bytes)`) or, for `auto`, from the `memory.max` texts
    /// of keel's cgroup and each of its ancestors (`limits`, innermost first; the lowest
    /// limit is the one that binds). A text that is not a limit gives [`NO_LIMIT`] and says so.
    pub fn derive(configured: Option<u64>, limits: &[String]) -> Budget {
        if let Some(bytes) = configured {
            return Budget {
                bytes,
                source: Source::Configured,
            };
        }
        let mut lowest: Option<u64> = None;
        for text in limits {
            match parse_memory_max(text) {
                Ok(Some(n)) => lowest = Some(lowest.map_or(n, |l| l.min(n))),
                Ok(None) => {}
                Err(why) => {
                    return Budget {
                        bytes: NO_LIMIT,
                        source: Source::Unreadable(why),
                    }
                }
            }
        }
        Budget::from_limit(lowest)
    }

    /// The budget for this process: `configured`, else from its cgroup (see [`Self::derive`]).
    pub fn detect(configured: Option<u64>) -> Budget {
        if configured.is_some() {
            return Budget::derive(configured, &[]);
        }
        Budget::derive(None, &own_memory_max())
    }

    /// What each consumer may use (see [`Shares`]).
    pub fn shares(&self) -> Shares {
        Shares::of(self.bytes)
    }
}

/// The memory limits of keel's cgroup and its ancestors up to the mount's root, innermost
/// first: cgroup v2's `memory.max` (the root group has none), and on a host whose memory
/// controller is still on cgroup v1 (`N:memory:/path` in /proc/self/cgroup) its
/// `memory.limit_in_bytes`. Inside a container the group's own path may not exist under the
/// mount (runc mounts the container's group as the root): the walk up then finds the root's.
fn own_memory_max() -> Vec<String> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut out = Vec::new();
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, rel) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        let (root, file) = if controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
        } else {
            continue;
        };
        let root = std::path::Path::new(root);
        let mut dir = root.join(rel.trim_start_matches('/'));
        loop {
            if let Ok(t) = std::fs::read_to_string(dir.join(file)) {
                out.push(t);
            }
            if dir == root || !dir.pop() || !dir.starts_with(root) {
                break;
            }
        }
    }
    out
}

/// The sizes derived from a budget `B` (one place; each share below). Caches and batches are
/// also capped where more stops paying (the values keel used before it had a budget), so a
/// large budget is a ceiling, not a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    pub budget: u64,
    /// SQLite page cache of the filesystem's connection: B/8, at most 32 MiB (unless
    /// `[workspace] meta_cache` says otherwise), at least 1 MiB.
    pub fs_cache: u64,
    /// The checkpointer's connection: B/32, 1..4 MiB (it reads each change once per pass).
    pub checkpoint_cache: u64,
    /// Bulk writers (a restore's or a rollback's metadata apply): B/8, 2..16 MiB.
    pub bulk_cache: u64,
    /// fsck's connection: B/16, 1..8 MiB.
    pub fsck_cache: u64,
    /// Bytes of a delta snapshot's records kept in memory while it is built; past it they
    /// go to a spill file beside meta.db (a full snapshot always spills): B/16, 1..8 MiB.
    pub snapshot_records: u64,
    /// Bytes of chunk windows a checkpoint hashes and uploads per batch: B/16, 2..16 MiB
    /// (the batch's windows are held until uploaded, and the packs built of its small
    /// chunks are copies: a checkpoint holds about twice this).
    pub hash_batch: u64,
    /// Records the snapshot history keeps (undo steps and the kept tree, about 300 bytes
    /// each): B/4 of them, 20,000..200,000.
    pub history_records: usize,
    /// Bytes of an answer keel builds whole (a snapshot list, a process record, an error:
    /// the API's JSON answers) past which it stops writing it and answers 413 saying so:
    /// B/8, at least 4 MiB. Diffs stream and are bounded by `[control] diff_max_entries`.
    pub answer_bytes: u64,
}

impl Shares {
    pub fn of(b: u64) -> Shares {
        Shares {
            budget: b,
            fs_cache: (b / 8).clamp(MIB, 32 * MIB),
            checkpoint_cache: (b / 32).clamp(MIB, 4 * MIB),
            bulk_cache: (b / 8).clamp(2 * MIB, 16 * MIB),
            fsck_cache: (b / 16).clamp(MIB, 8 * MIB),
            snapshot_records: (b / 16).clamp(MIB, 8 * MIB),
            hash_batch: (b / 16).clamp(2 * MIB, 16 * MIB),
            history_records: ((b / 4) / 300).clamp(20_000, 200_000) as usize,
            answer_bytes: (b / 8).max(4 * MIB),
        }
    }
}

static BUDGET: Mutex<Option<Budget>> = Mutex::new(None);

/// Sets this process's budget (once at start, before the stores open).
pub fn set(b: Budget) {
    *BUDGET.lock().unwrap_or_else(|e| e.into_inner()) = Some(b);
}

/// This process's budget: the one [`set`], else the default without a limit.
pub fn get() -> Budget {
    BUDGET
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_else(|| Budget::from_limit(None))
}

/// The shares of this process's budget.
pub fn shares() -> Shares {
    Shares::of(get().bytes)
}

/// keel's resident memory now, bytes (`VmRSS`), and its peak since the last reset (`VmHWM`).
pub fn rss() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let l = s.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = l[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Peaks, bytes: keel's since start (kept across resets), and the last checkpoint's and last
/// operation's (with its name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peaks {
    pub since_start: u64,
    pub last_checkpoint: Option<u64>,
    pub last_op: Option<(&'static str, u64)>,
}

static SINCE_START: AtomicU64 = AtomicU64::new(0);
static LAST_CHECKPOINT: AtomicU64 = AtomicU64::new(0);
static LAST_OP: Mutex<Option<(&'static str, u64)>> = Mutex::new(None);
/// Operations under way: the peak is reset only when none is (so overlapping ones each see
/// at least their own peak).
static RUNNING: AtomicU64 = AtomicU64::new(0);

/// The peaks so far (the process's own peak folded in).
pub fn peaks() -> Peaks {
    let now = rss().map_or(0, |(_, hwm)| hwm);
    Peaks {
        since_start: SINCE_START.load(Ordering::Relaxed).max(now),
        last_checkpoint: match LAST_CHECKPOINT.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        },
        last_op: *LAST_OP.lock().unwrap_or_else(|e| e.into_inner()),
    }
}

/// Measures the peak RSS of one operation: starts the kernel's peak (`VmHWM`) afresh
/// (writing 5 to `/proc/self/clear_refs`, after keeping the peak so far in
/// [`Peaks::since_start`]) unless another tracked operation runs, and records the peak
/// when dropped.
#[must_use = "the operation's peak is taken when the guard drops"]
pub struct Tracked(&'static str);

pub fn track(op: &'static str) -> Tracked {
    if RUNNING.fetch_add(1, Ordering::SeqCst) == 0 {
        if let Some((_, hwm)) = rss() {
            SINCE_START.fetch_max(hwm, Ordering::Relaxed);
        }
        // Not allowed (an old kernel, a read-only /proc): the peak is then since the start.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    }
    Tracked(op)
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let peak = rss().map_or(0, |(_, hwm)| hwm);
        SINCE_START.fetch_max(peak, Ordering::Relaxed);
        if self.0 == "checkpoint" {
            LAST_CHECKPOINT.store(peak, Ordering::Relaxed);
        }
        *LAST_OP.lock().unwrap_or_else(|e| e.into_inner()) = Some((self.0, peak));
        RUNNING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether keel's RSS is past three quarters of its budget now. The first time in a row it
/// is, one line says so and what keel does about it (`what`); the line comes again only
/// after keel was back under.
pub fn pressure(what: &str) -> bool {
    static SAID: AtomicBool = AtomicBool::new(false);
    let b = get().bytes;
    let Some((now, _)) = rss() else {
        return false;
    };
    let over = now > b / 4 * 3;
    if over && !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "memory: keel uses {} MiB of its {} MiB budget: {what}",
            now / MIB,
            b / MIB
        );
    } else if !over {
        SAID.store(false, Ordering::Relaxed);
    }
    over
}

#[cfg(test)]
mod tests {
    use super::*;

    fn derive(texts: &[&str]) -> Budget {
        let v: Vec<String> = texts.iter().map(|s| s.to_string()).collect();
        Budget::derive(None, &v)
    }

    #[test]
    fn a_256_mib_container_gives_64_mib() {
        let b = derive(&["268435456\n"]);
        assert_eq!(b.bytes, 64 * MIB);
        assert_eq!(b.source, Source::Cgroup { limit: 256 * MIB });
        let s = b.shares();
        assert_eq!(s.fs_cache, 8 * MIB);
        assert_eq!(s.checkpoint_cache, 2 * MIB);
        assert_eq!(s.bulk_cache, 8 * MIB);
        assert_eq!(s.fsck_cache, 4 * MIB);
        assert_eq!(s.snapshot_records, 4 * MIB);
        assert_eq!(s.hash_batch, 4 * MIB);
        assert_eq!(s.history_records, 55_924);
        assert_eq!(s.answer_bytes, 8 * MIB);
        assert!(b.to_string().contains("memory.max of 256 MiB"), "{b}");
    }

    #[test]
    fn a_1_gib_container_gives_256_mib_with_the_old_ceilings() {
        let b = derive(&["1073741824"]);
        assert_eq!(b.bytes, 256 * MIB);
        let s = b.shares();
        assert_eq!(s.fs_cache, 32 * MIB);
        assert_eq!(s.checkpoint_cache, 4 * MIB);
        assert_eq!(s.bulk_cache, 16 * MIB);
        assert_eq!(s.fsck_cache, 8 * MIB);
        assert_eq!(s.snapshot_records, 8 * MIB);
        assert_eq!(s.hash_batch, 16 * MIB);
        assert_eq!(s.history_records, 200_000);
    }

    #[test]
    fn no_limit_gives_the_fixed_default() {
        let v1_unlimited = "9223372036854771712\n";
        for texts in [
            &[][..],
            &["max\n"][..],
            &["max", "max"][..],
            &[v1_unlimited][..],
        ] {
            let b = derive(texts);
            assert_eq!(b.bytes, NO_LIMIT);
            assert_eq!(b.source, Source::NoLimit);
        }
        let s = Shares::of(NO_LIMIT);
        assert_eq!(s.fs_cache, 16 * MIB);
        assert_eq!(s.checkpoint_cache, 4 * MIB);
        assert_eq!(s.bulk_cache, 16 * MIB);
        assert_eq!(s.hash_batch, 8 * MIB);
        assert_eq!(s.history_records, 111_848);
    }

    #[test]
    fn the_lowest_limit_of_the_ancestors_binds_with_floor_and_ceiling() {
        assert_eq!(derive(&["max", "536870912", "max"]).bytes, 128 * MIB);
        assert_eq!(derive(&["1073741824", "268435456"]).bytes, 64 * MIB);
        assert_eq!(derive(&["67108864"]).bytes, FLOOR);
        assert_eq!(derive(&["68719476736"]).bytes, AUTO_CEILING);
    }

    #[test]
    fn a_malformed_memory_max_falls_back_and_says_why() {
        for bad in ["", "lots", "-5", "0", "12 MiB"] {
            let b = derive(&[bad]);
            assert_eq!(b.bytes, NO_LIMIT, "{bad:?}");
            let Source::Unreadable(why) = &b.source else {
                panic!("{bad:?}: {:?}", b.source)
            };
            assert!(!why.is_empty());
            assert!(b.to_string().contains("unreadable"), "{b}");
        }
    }

    #[test]
    fn a_configured_budget_wins_over_the_cgroup() {
        let b = Budget::derive(Some(48 * MIB), &["268435456".into()]);
        assert_eq!(b.bytes, 48 * MIB);
        assert_eq!(b.source, Source::Configured);
    }

    #[test]
    fn tiny_budgets_keep_working_floors() {
        let s = Shares::of(16 * MIB);
        assert_eq!(s.fs_cache, 2 * MIB);
        assert_eq!(s.checkpoint_cache, MIB);
        assert_eq!(s.hash_batch, 2 * MIB);
        assert_eq!(s.history_records, 20_000);
        assert_eq!(s.answer_bytes, 4 * MIB);
    }
}

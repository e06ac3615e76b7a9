//! Garbage collection: snapshot retention and unreferenced chunks.
//!
//! Retention (`decide`) walks the head's history (`prev` links), newest first, and keeps
//! unnamed snapshots until the first one past any limit of `[persist]` that is set: `keep`
//! (count), `keep_age` (older than that, by the time the snapshot was taken) and
//! `keep_size` (the kept snapshots would need more than that many bytes on the remote); it
//! and every older one go. Always kept, whatever the limits: the head, every snapshot a name
//! records (`snapshots`: kept until the name is deleted), the snapshot the local state was
//! last checkpointed as, and every snapshot the kept ones' chains need (a delta needs its
//! parent, back to a full snapshot). Size is counted as what the kept snapshots hold on
//! the remote: each snapshot object's bytes plus the bytes of every distinct chunk their
//! bodies name, each chunk counted once. The always-kept ones are counted first, so they
//! use the budget before the unnamed history does.
//!
//! A chunk is kept when any kept snapshot names it, or the local chunk maps do, or a dropped
//! snapshot that is left for now because it is young (it can still be read until it goes).
//! Anything else older than the grace window is deleted; younger objects may belong to a
//! checkpoint in progress and are left for the next run. Age is the object's modification time, looked
//! at again just before each delete: a checkpoint that names an unreferenced chunk the
//! store already holds refreshes it (`Remote::put_many_fresh`) rather than skipping it,
//! so it counts as young until that checkpoint's snapshot protects it.
//!
//! A chunk store shared with forks (see `fork`) also keeps every chunk that any snapshot of
//! another workspace on it names, the snapshot a fork in the making is built from, and every
//! chunk written since another workspace's checkpoint in progress began (its in-flight
//! marker, `Repo::in_flight_key`): a checkpoint may outlast the grace window, and the
//! chunks it uploaded first are unreferenced until its snapshot lands. Before it reads who
//! shares the store, gc leaves a live marker of its own there (`fork::announce_gc`): a fork
//! registered too late for this gc to see waits for it to end before reading its source.
//!
//! Packs (`gc_packs`) follow the same rules by what is in them: one is kept while any live
//! chunk is in it, deleted once none is, and rewritten with its live chunks only once more
//! than half of its bytes are dead.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, SystemTime};

use super::format::object_chunk_ids;
use super::marker::LiveMarker;
use super::remote::ObjectInfo;
use super::repo::{Repo, RepoError};
use crate::chunk::ChunkId;
use crate::meta::{MetaError, Store};

#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("list remote: {0}")]
    List(RepoError),
    #[error("read snapshot {seq}: {source}")]
    ReadSnapshot { seq: u64, source: RepoError },
    #[error("delete {key}: {source}")]
    Delete {
        key: String,
        source: super::remote::RemoteError,
    },
    #[error("look at {key} again before deleting it: {source}")]
    Recheck {
        key: String,
        source: super::remote::RemoteError,
    },
    #[error("state database: {0}")]
    Meta(#[from] MetaError),
    /// Boxed: a remote's error would make every `GcError` (and what holds one) larger.
    #[error("read the snapshot names: {0}")]
    Names(#[source] Box<super::snapshots::SnapshotsError>),
    #[error("metadata images: {0}")]
    Images(super::image::ImageError),
    #[error("read the other workspaces on the chunk store: {0}")]
    ReadSharers(RepoError),
    #[error("announce the gc to forks in the making: {0}")]
    Announce(RepoError),
    #[error("stopped: {0}")]
    MarkerLapsed(#[from] super::marker::Lapsed),
    #[error("repack {key}: {source}")]
    Repack {
        key: String,
        source: super::remote::RemoteError,
    },
}

/// The limits on unnamed history (`[persist] keep`, `keep_age`, `keep_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Snapshots of the head's history kept, the head included.
    pub keep: u32,
    /// Unnamed snapshots taken longer ago than this go (`None`: no limit).
    pub max_age: Option<Duration>,
    /// Unnamed snapshots go, oldest first, until the kept ones hold at most this many
    /// bytes on the remote (`None`: no limit).
    pub max_bytes: Option<u64>,
}

impl Retention {
    /// Only a count.
    pub fn count(keep: u32) -> Self {
        Retention {
            keep,
            max_age: None,
            max_bytes: None,
        }
    }

    /// The limits `[persist]` sets.
    pub fn of(cfg: &crate::config::PersistConfig) -> Self {
        Retention {
            keep: cfg.keep,
            max_age: cfg.keep_age,
            max_bytes: cfg.keep_size,
        }
    }
}

/// What retention needs to know of one snapshot.
#[derive(Debug, Clone, Default)]
pub struct SnapFacts {
    /// The snapshot taken before it (history).
    pub prev: Option<u64>,
    /// The snapshot its delta applies to (chain); `None` when full.
    pub parent: Option<u64>,
    pub created_ns: i64,
    /// Bytes of the snapshot object.
    pub bytes: u64,
    /// Chunks its body names.
    pub chunks: Vec<ChunkId>,
}

/// Which limit ended the kept history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Keep,
    KeepAge,
    KeepSize,
}

impl Limit {
    pub fn key(self) -> &'static str {
        match self {
            Limit::Keep => "keep",
            Limit::KeepAge => "keep_age",
            Limit::KeepSize => "keep_size",
        }
    }
}

/// What retention keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    /// Every kept snapshot, chains closed.
    pub kept: BTreeSet<u64>,
    /// Every chunk a kept snapshot names.
    pub chunks: HashSet<ChunkId>,
    /// Bytes the kept snapshots hold on the remote (objects plus distinct chunks).
    pub kept_bytes: u64,
    /// The newest snapshot of the history that a limit dropped (it and older ones go
    /// unless something else keeps them), and the limit.
    pub cut: Option<(u64, Limit)>,
}

/// Adds snapshots with their chains to a decision, loading each once.
struct Closer<'a, E> {
    load: &'a mut dyn FnMut(u64) -> Result<SnapFacts, E>,
    chunk_bytes: &'a dyn Fn(&ChunkId) -> u64,
    facts: HashMap<u64, SnapFacts>,
    d: Decision,
}

impl<E> Closer<'_, E> {
    fn facts(&mut self, seq: u64) -> Result<&SnapFacts, E> {
        if !self.facts.contains_key(&seq) {
            let f = (self.load)(seq)?;
            self.facts.insert(seq, f);
        }
        Ok(&self.facts[&seq])
    }

    /// Keeps `seq` and its chain unless that would take the kept bytes past `limit`;
    /// whether it is kept.
    fn add(&mut self, seq: u64, limit: Option<u64>) -> Result<bool, E> {
        let mut seqs = Vec::new();
        let mut at = Some(seq);
        while let Some(s) = at.filter(|s| !self.d.kept.contains(s) && !seqs.contains(s)) {
            seqs.push(s);
            at = self.facts(s)?.parent;
        }
        let mut new_chunks: HashSet<ChunkId> = HashSet::new();
        let mut bytes = 0u64;
        for s in &seqs {
            let f = &self.facts[s];
            bytes += f.bytes;
            for c in &f.chunks {
                if !self.d.chunks.contains(c) && new_chunks.insert(*c) {
                    bytes += (self.chunk_bytes)(c);
                }
            }
        }
        if limit.is_some_and(|l| self.d.kept_bytes.saturating_add(bytes) > l) {
            return Ok(false);
        }
        for s in &seqs {
            // In `d.chunks` now; a whole tree's list need not stay twice in memory.
            if let Some(f) = self.facts.get_mut(s) {
                f.chunks = Vec::new();
            }
        }
        self.d.kept.extend(seqs);
        self.d.chunks.extend(new_chunks);
        self.d.kept_bytes += bytes;
        Ok(true)
    }
}

/// The retention decision (see the module doc). `pinned` are kept whatever the limits
/// (names, the local state's snapshot, what other workspaces need); `present` are the
/// snapshots on the remote (the history walk ends at the first one missing); `load` reads
/// one snapshot, `chunk_bytes` says how big a chunk is on the remote (0 when absent).
pub fn decide<E>(
    head: Option<u64>,
    present: &BTreeSet<u64>,
    pinned: &BTreeSet<u64>,
    rules: &Retention,
    now_ns: i64,
    chunk_bytes: &dyn Fn(&ChunkId) -> u64,
    load: &mut dyn FnMut(u64) -> Result<SnapFacts, E>,
) -> Result<Decision, E> {
    let mut c = Closer {
        load,
        chunk_bytes,
        facts: HashMap::new(),
        d: Decision::default(),
    };
    for s in pinned.iter().filter(|s| present.contains(s)) {
        c.add(*s, None)?;
    }
    let max_age_ns = rules
        .max_age
        .map(|a| i64::try_from(a.as_nanos()).unwrap_or(i64::MAX));
    let mut at = head;
    let mut n = 0u64;
    while let Some(s) = at.filter(|s| present.contains(s)) {
        if n > 0 {
            if n >= u64::from(rules.keep) {
                c.d.cut = Some((s, Limit::Keep));
                break;
            }
            let created = c.facts(s)?.created_ns;
            if max_age_ns.is_some_and(|m| now_ns.saturating_sub(created) > m) {
                c.d.cut = Some((s, Limit::KeepAge));
                break;
            }
        }
        // The head stays whatever its size.
        if !c.add(s, rules.max_bytes.filter(|_| n > 0))? {
            c.d.cut = Some((s, Limit::KeepSize));
            break;
        }
        at = c.facts(s)?.prev;
        n += 1;
    }
    Ok(c.d)
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub snapshots_kept: u64,
    pub snapshots_deleted: u64,
    pub chunks_kept: u64,
    pub chunks_deleted: u64,
    /// Packs kept (some chunk in them is live), deleted (none is, or a piece without its
    /// other half), and rewritten with their live chunks only (more than half dead).
    pub packs_kept: u64,
    pub packs_deleted: u64,
    pub packs_repacked: u64,
    /// Metadata images no kept snapshot names any more (see `image`).
    pub images_deleted: u64,
    /// Bytes of the deleted objects (snapshots, chunks and images).
    pub bytes_deleted: u64,
    /// Bytes the kept snapshots hold on the remote (see the module doc).
    pub kept_bytes: u64,
    /// The limit that ended the kept history, and the newest snapshot it dropped.
    pub cut: Option<(u64, Limit)>,
    /// Unreferenced objects left alone because they are younger than the grace window.
    pub young_skipped: u64,
    /// Other workspaces (origin, forks) sharing the chunk store whose references were kept.
    pub sharing: u64,
    /// Registered workspaces that were ignored, and why.
    pub warnings: Vec<String>,
}

impl std::fmt::Display for GcReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "freed {} snapshots, {} chunks, {} bytes; kept {} snapshots ({} bytes with the chunks they name) and {} chunks",
            self.snapshots_deleted,
            self.chunks_deleted,
            self.bytes_deleted,
            self.snapshots_kept,
            self.kept_bytes,
            self.chunks_kept
        )?;
        if self.packs_kept + self.packs_deleted + self.packs_repacked > 0 {
            write!(
                f,
                "; packs: {} kept, {} deleted, {} repacked",
                self.packs_kept, self.packs_deleted, self.packs_repacked
            )?;
        }
        if let Some((seq, limit)) = self.cut {
            write!(f, "; history ended by {} at snapshot {seq}", limit.key())?;
        }
        write!(
            f,
            "; {} young unreferenced objects left for later",
            self.young_skipped
        )?;
        if self.sharing > 0 {
            write!(
                f,
                "; chunk store shared with {} other workspaces",
                self.sharing
            )?;
        }
        for w in &self.warnings {
            write!(f, "; warning: {w}")?;
        }
        Ok(())
    }
}

/// Runs gc on `repo`, keeping the newest `keep` snapshots (see [`gc_with`]).
pub fn gc(
    repo: &mut Repo,
    store: Option<&Store>,
    keep: u32,
    grace: Duration,
) -> Result<GcReport, GcError> {
    gc_with(repo, store, &Retention::count(keep), grace)
}

/// Runs gc on `repo` with the retention `rules`. `store` (the local state, if any)
/// protects its last snapshot and its chunk maps.
pub fn gc_with(
    repo: &mut Repo,
    store: Option<&Store>,
    rules: &Retention,
    grace: Duration,
) -> Result<GcReport, GcError> {
    let op = crate::logging::Op::start("gc");
    let _peak = crate::budget::track("gc");
    let _ = repo.manifest().map_err(GcError::List)?;
    // Announced before the fork records are read, and alive until the last delete: a fork
    // registered after that read waits for this gc to end before it reads its source.
    let running = super::fork::announce_gc(repo).map_err(GcError::Announce)?;
    // Before any snapshot is deleted: what the others on the chunk store need.
    let shared = super::fork::shared_refs(repo).map_err(GcError::ReadSharers)?;
    let now = SystemTime::now();
    let old_enough = |t: SystemTime| now.duration_since(t).map(|d| d >= grace).unwrap_or(false);
    // A chunk written since another workspace's checkpoint in progress began may be one its
    // snapshot will name (a checkpoint can outlast the grace window): kept, with the grace
    // window again as the margin for the two clocks.
    let in_flight = shared.in_flight_since;
    let old_chunk = |t: SystemTime| old_enough(t) && in_flight.is_none_or(|s| t + grace < s);
    let snaps = repo.list_snapshots().map_err(GcError::List)?;
    let present: BTreeSet<u64> = snaps.iter().map(|(s, _)| *s).collect();
    let snap_bytes: HashMap<u64, u64> = snaps.iter().map(|(s, i)| (*s, i.size)).collect();
    let head = repo.read_head().map_err(GcError::List)?.map(|(h, _)| h.seq);
    let local_seq: Option<u64> = match store {
        Some(s) => s
            .read()
            .persist_get("last_seq")?
            .and_then(|v| v.parse().ok()),
        None => None,
    };
    let listed = repo.list_chunks().map_err(GcError::List)?;
    let mut chunk_sizes: HashMap<ChunkId, u64> =
        listed.iter().map(|(id, i)| (*id, i.size)).collect();
    let packs_listed = repo.list_packs().map_err(GcError::List)?;
    let pack_map = repo
        .load_listed_packs(&packs_listed, None)
        .map_err(GcError::List)?;
    for k in 0..pack_map.packs.len() {
        for e in pack_map.entries(k) {
            chunk_sizes.entry(e.id).or_insert(u64::from(e.len));
        }
    }

    // Kept whatever the limits: the local state's snapshot, what the others need, and
    // named snapshots (until their name is deleted).
    let mut pinned: BTreeSet<u64> = local_seq.into_iter().collect();
    pinned.extend(shared.pinned.iter().copied());
    pinned.extend(super::snapshots::pinned(repo).map_err(|e| GcError::Names(Box::new(e)))?);
    let now_ns = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    let repo_ref: &Repo = repo;
    let mut load = |s: u64| -> Result<SnapFacts, GcError> {
        // The body is read one record at a time: only its chunk ids stay.
        let err = |source| GcError::ReadSnapshot { seq: s, source };
        let (key, data) = repo_ref.snapshot_object(s).map_err(|e| err(e.into()))?;
        let mut chunks = Vec::new();
        let h =
            object_chunk_ids(&key, &data, &mut |c| chunks.push(c)).map_err(|e| err(e.into()))?;
        Ok(SnapFacts {
            prev: h.prev,
            parent: h.parent,
            created_ns: h.created_ns,
            bytes: snap_bytes.get(&s).copied().unwrap_or(0),
            chunks,
        })
    };
    op.step("decide");
    let decision = decide(
        head,
        &present,
        &pinned,
        rules,
        now_ns,
        &|c| chunk_sizes.get(c).copied().unwrap_or(0),
        &mut load,
    )?;
    let closed = decision.kept;
    let mut chunks = decision.chunks;
    if let Some(s) = store {
        for rows in s.read().all_file_chunks()?.values() {
            chunks.extend(rows.iter().filter_map(|(_, id)| id.map(ChunkId)));
        }
    }

    chunks.extend(shared.chunks);
    let mut report = GcReport {
        snapshots_kept: closed.len() as u64,
        kept_bytes: decision.kept_bytes,
        cut: decision.cut,
        sharing: shared.workspaces,
        warnings: shared.warnings,
        ..Default::default()
    };
    crate::progress::stage(
        "objects swept (snapshots, then chunks)",
        Some((snaps.len() + listed.len()) as u64),
    );
    let mut swept = 0;
    op.step("sweep_snapshots");
    for (seq, info) in &snaps {
        match sweep(
            repo,
            &running,
            info,
            closed.contains(seq),
            &old_enough,
            &mut report,
        )? {
            Fate::Deleted => {
                report.snapshots_deleted += 1;
                report.bytes_deleted += info.size;
            }
            // Dropped, but left for now: until it goes it can still be read (restored,
            // forked, rolled back to), so the chunks it names stay with it.
            Fate::Young => chunks.extend(load(*seq)?.chunks),
            Fate::Referenced | Fate::Gone => {}
        }
        swept += 1;
        crate::progress::set(swept);
    }
    op.step("sweep_chunks");
    for (id, info) in listed {
        swept += 1;
        crate::progress::set(swept);
        match sweep(
            repo,
            &running,
            &info,
            chunks.contains(&id),
            &old_chunk,
            &mut report,
        )? {
            Fate::Referenced => report.chunks_kept += 1,
            Fate::Deleted => {
                report.chunks_deleted += 1;
                report.bytes_deleted += info.size;
            }
            Fate::Young | Fate::Gone => {}
        }
    }
    op.step("sweep_packs");
    super::gc_packs::sweep_packs(
        repo,
        &running,
        &packs_listed,
        &pack_map,
        &chunks,
        &old_chunk,
        &mut report,
    )?;
    // Metadata images go with the last kept snapshot that names them.
    op.step("sweep_images");
    let (n, bytes) = super::image::sweep(repo, &closed, grace).map_err(GcError::Images)?;
    report.images_deleted = n;
    report.bytes_deleted += bytes;
    if let Err(e) = running.finish() {
        tracing::warn!(error = %e, "gc: cannot remove its marker; it runs out by itself");
    }
    tracing::info!(report = %report, "gc");
    Ok(report)
}

/// What `sweep` did with one listed object.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Fate {
    Referenced,
    /// Unreferenced but younger than the grace window (counted in `young_skipped`).
    Young,
    /// Unreferenced and already gone when looked at again.
    Gone,
    Deleted,
}

/// Deletes a listed object that nothing kept references once it is older than the grace
/// window. Its age is looked at again right before the delete: a checkpoint that names an
/// existing unreferenced chunk again refreshes its age before writing the snapshot, maybe
/// after this gc listed it. (What remains is a refresh landing between that last look and
/// the delete; the chunk store has no conditional delete to close it.)
pub(super) fn sweep(
    repo: &Repo,
    running: &LiveMarker,
    info: &ObjectInfo,
    referenced: bool,
    old_enough: &impl Fn(SystemTime) -> bool,
    report: &mut GcReport,
) -> Result<Fate, GcError> {
    if referenced {
        return Ok(Fate::Referenced);
    }
    if !old_enough(info.modified) {
        report.young_skipped += 1;
        return Ok(Fate::Young);
    }
    // A fork in the making stops waiting for this gc once its marker ran out.
    running.check()?;
    let again = repo
        .remote
        .head(&info.key)
        .map_err(|source| GcError::Recheck {
            key: info.key.clone(),
            source,
        })?;
    match again {
        None => return Ok(Fate::Gone),
        Some(now) if !old_enough(now.modified) => {
            report.young_skipped += 1;
            return Ok(Fate::Young);
        }
        Some(_) => {}
    }
    repo.remote
        .delete(&info.key)
        .map_err(|source| GcError::Delete {
            key: info.key.clone(),
            source,
        })?;
    Ok(Fate::Deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400_000_000_000;

    /// Snapshots 1..=10, one a day, full at 1 and 6, deltas otherwise; each object is 100
    /// bytes and names its own 1000-byte chunk plus chunk 0 (1000 bytes, shared by all).
    fn history() -> HashMap<u64, SnapFacts> {
        (1..=10u64)
            .map(|s| {
                let full = s == 1 || s == 6;
                let facts = SnapFacts {
                    prev: (s > 1).then(|| s - 1),
                    parent: (!full).then(|| s - 1),
                    created_ns: s as i64 * DAY,
                    bytes: 100,
                    chunks: vec![ChunkId([s as u8; 32]), ChunkId([0; 32])],
                };
                (s, facts)
            })
            .collect()
    }

    fn run(rules: Retention, pinned: &[u64], present: &[u64]) -> (Decision, Vec<u64>) {
        try_run(rules, pinned, present).unwrap()
    }

    /// `decide` on `history()` where only `present` can be read.
    fn try_run(
        rules: Retention,
        pinned: &[u64],
        present: &[u64],
    ) -> Result<(Decision, Vec<u64>), u64> {
        let mut h = history();
        h.retain(|s, _| present.contains(s));
        let mut loaded = Vec::new();
        let mut load = |s: u64| -> Result<SnapFacts, u64> {
            loaded.push(s);
            h.get(&s).cloned().ok_or(s)
        };
        let d = decide(
            Some(10),
            &present.iter().copied().collect(),
            &pinned.iter().copied().collect(),
            &rules,
            10 * DAY + 1,
            &|_| 1000,
            &mut load,
        )?;
        Ok((d, loaded))
    }

    fn all() -> Vec<u64> {
        (1..=10).collect()
    }

    fn kept(d: &Decision) -> Vec<u64> {
        d.kept.iter().copied().collect()
    }

    #[test]
    fn count_keeps_the_newest_and_their_chain() {
        let (d, loaded) = run(Retention::count(3), &[], &all());
        // 10, 9, 8 by count; 7 and 6 because 8 is a delta of 7, a delta of full 6.
        assert_eq!(kept(&d), vec![6, 7, 8, 9, 10]);
        assert_eq!(d.cut, Some((7, Limit::Keep)));
        // Objects 6..10, chunks 6..10 and the shared one once.
        assert_eq!(d.kept_bytes, 5 * 100 + 6 * 1000);
        assert_eq!(d.chunks.len(), 6);
        let mut l = loaded.clone();
        l.sort();
        l.dedup();
        assert_eq!(l.len(), loaded.len(), "each snapshot read once: {loaded:?}");
        let (d, _) = run(Retention::count(100), &[], &all());
        assert_eq!(kept(&d), all());
        assert_eq!(d.cut, None);
    }

    #[test]
    fn age_drops_what_is_older_but_never_the_head() {
        let age = |a: Duration| Retention {
            keep: 100,
            max_age: Some(a),
            max_bytes: None,
        };
        // Now is just after day 10: 9 is a day old, 8 two days, 7 three.
        let (d, _) = run(age(Duration::from_secs(60 * 3600)), &[], &all());
        assert_eq!(kept(&d), vec![6, 7, 8, 9, 10], "7 kept only for 8's chain");
        assert_eq!(d.cut, Some((7, Limit::KeepAge)));
        let (d, _) = run(age(Duration::from_secs(3600)), &[], &all());
        assert_eq!(
            kept(&d),
            vec![6, 7, 8, 9, 10],
            "the head and its chain stay"
        );
        assert_eq!(d.cut, Some((9, Limit::KeepAge)));
        // Count still applies alongside age: whichever ends the history first.
        let (d, _) = run(
            Retention {
                keep: 1,
                ..age(Duration::from_secs(30 * 86400))
            },
            &[],
            &all(),
        );
        assert_eq!(d.cut, Some((9, Limit::Keep)));
    }

    #[test]
    fn size_counts_objects_and_distinct_chunks_and_keeps_the_head() {
        let size = |b: u64| Retention {
            keep: 100,
            max_age: None,
            max_bytes: Some(b),
        };
        // Head 10 with chain 6..9: 5 objects + 6 chunks = 6500 bytes. 5 (delta of 4..1)
        // would add 5 objects and 5 chunks: 5500.
        let (d, _) = run(size(6500), &[], &all());
        assert_eq!(kept(&d), vec![6, 7, 8, 9, 10]);
        assert_eq!(d.cut, Some((5, Limit::KeepSize)));
        assert_eq!(d.kept_bytes, 6500);
        let (d, _) = run(size(12_000), &[], &all());
        assert_eq!(kept(&d), all());
        assert_eq!(d.kept_bytes, 10 * 100 + 11 * 1000);
        let (d, _) = run(size(11_999), &[], &all());
        assert_eq!(kept(&d), vec![6, 7, 8, 9, 10]);
        // Below the head's own size: the head (and its chain) still stays.
        let (d, _) = run(size(1), &[], &all());
        assert_eq!(kept(&d), vec![6, 7, 8, 9, 10]);
        assert_eq!(d.cut, Some((9, Limit::KeepSize)));
        assert!(d.kept_bytes > 1);
    }

    #[test]
    fn named_are_kept_whatever_the_limits_and_counted_first() {
        let rules = Retention {
            keep: 1,
            max_age: Some(Duration::from_secs(1)),
            max_bytes: Some(1),
        };
        // 3 is a delta of 2, of 1 (full).
        let (d, _) = run(rules, &[3], &all());
        assert_eq!(kept(&d), vec![1, 2, 3, 6, 7, 8, 9, 10]);
        // A named snapshot uses the size budget before the unnamed history: with room for
        // 1..3 (named, with its chain) and the head's chain 6..10 only, 5 and older go.
        let rules = Retention {
            keep: 100,
            max_age: None,
            max_bytes: Some(3 * 100 + 4 * 1000 + 5 * 100 + 5 * 1000),
        };
        let (d, _) = run(rules, &[3], &all());
        assert_eq!(kept(&d), vec![1, 2, 3, 6, 7, 8, 9, 10]);
        assert_eq!(d.cut, Some((5, Limit::KeepSize)));
        let (d, _) = run(Retention::count(100), &[3], &all());
        assert_eq!(
            kept(&d),
            all(),
            "no limit hit: the named one changes nothing"
        );
        // A pinned snapshot no longer on the remote is skipped, not read.
        let (d, loaded) = run(Retention::count(1), &[42], &all());
        assert_eq!(kept(&d), vec![6, 7, 8, 9, 10]);
        assert!(!loaded.contains(&42));
    }

    #[test]
    fn the_history_ends_at_a_missing_snapshot() {
        let present: Vec<u64> = (6..=10).collect();
        let (d, loaded) = run(Retention::count(100), &[], &present);
        assert_eq!(kept(&d), present);
        assert_eq!(d.cut, None);
        assert!(!loaded.contains(&5), "{loaded:?}");
        // A kept delta whose parent is gone is an error, not a silent partial keep.
        let present: Vec<u64> = (6..=10).filter(|s| *s != 8).collect();
        let e = try_run(Retention::count(100), &[], &present).unwrap_err();
        assert_eq!(e, 8, "the snapshot that could not be read");
    }
}

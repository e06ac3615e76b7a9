//! `keel fsck`: checks a state dir that is not mounted, and its remote.
//!
//! Local: SQLite's integrity check; the running inode totals match the table; every entry
//! names an existing inode of the right kind in an existing directory; link counts and
//! directory parents agree with the entries; every directory is reachable from the root;
//! bodies exist with the size the metadata says; chunk maps fit their files, and every
//! window not changed since the last checkpoint still hashes to its recorded chunk.
//! Remote: the manifest, head and snapshot chains decode; every chunk the head and the
//! local state reference exists and hashes to its name. All of it reads every row.
//!
//! `quick` (without `repair`) checks a sample instead, at a cost independent of the
//! workspace's size: see [`quick`].
//!
//! Modes: every file and directory of the state dir and of a local `file://` remote that
//! group or others may access is a warning (`repair` makes it 0600/0700).
//!
//! Findings are errors (damage), warnings (leftovers of operations that were never
//! acknowledged when keel was killed; harmless, fixed at the next mount or checkpoint) and
//! notes. `repair` fixes what it can without losing data: it re-links unreachable inodes
//! under `/lost+found`, corrects link counts and entry kinds, drops entries to missing
//! inodes and orphan bodies, re-marks unrecorded writes, and re-uploads corrupt remote
//! chunks from local bytes that still hash to their name.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use bytes::Bytes;

use super::remote::PutMode;
use super::repo::Repo;
use crate::chunk::chunker::window_range;
use crate::chunk::{BodyStore, ChunkId};
use crate::state::{self, private};
use crate::time::now_ns;
pub use quick::Sample;

mod bodies;
mod quick;
mod tree;

use bodies::{check_bodies, check_body, pending_renames, BodyCtx};
use tree::check_tree;

use crate::meta::{InodeNo, MetaError, Nanos, Store, Tx};

#[derive(Debug, thiserror::Error)]
pub enum FsckError {
    #[error("state dir {path}: {reason}")]
    OpenState { path: PathBuf, reason: String },
    #[error("state database: {0}")]
    Meta(#[from] MetaError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Note,
    Warning,
    Error,
}

#[derive(Debug, Clone)]
pub struct Finding {
    pub level: Level,
    pub what: String,
    pub repaired: bool,
}

#[derive(Debug, Clone, Default)]
pub struct FsckReport {
    pub findings: Vec<Finding>,
    pub inodes: u64,
    pub entries: u64,
    pub bodies: u64,
    pub windows_hashed: u64,
    pub chunks_checked: u64,
    /// The remote was checked (`chunks_checked` means something).
    pub remote_checked: bool,
    pub elapsed_s: f64,
    /// `quick`: what was sampled (the counts above are of the sample).
    pub sample: Option<Sample>,
}

impl FsckReport {
    pub fn count(&self, level: Level) -> usize {
        self.findings
            .iter()
            .filter(|f| f.level == level && !f.repaired)
            .count()
    }

    /// No unrepaired errors.
    pub fn is_clean(&self) -> bool {
        self.count(Level::Error) == 0
    }

    fn add(&mut self, level: Level, what: String, repaired: bool) {
        self.findings.push(Finding {
            level,
            what,
            repaired,
        });
    }
}

#[derive(Clone, Default)]
pub struct FsckOptions {
    pub repair: bool,
    /// Check a sample, at a cost independent of the workspace's size (see `quick`);
    /// ignored with `repair`.
    pub quick: bool,
    pub chunk_size: u64,
    /// The remote to check too.
    pub remote: Option<Repo>,
    /// A `file://` remote that was to be checked but whose directory is not there (not
    /// opened: that would create it).
    pub missing_remote: Option<String>,
}

/// A state dir without a database that a keel start locked and left before writing
/// anything of the workspace: it holds keel's lock and nothing but the files a start makes
/// before its restore (the lease holder, control sockets) or a volume brings.
fn started_only(state_dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return false;
    };
    let mut locked = false;
    for e in entries {
        let Ok(e) = e else { return false };
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            return false;
        };
        if !state::STARTED_ONLY.contains(&name) {
            return false;
        }
        locked |= name == state::LOCK;
    }
    locked
}

pub fn fsck(state_dir: &Path, opts: &FsckOptions) -> Result<FsckReport, FsckError> {
    let _peak = crate::budget::track("fsck");
    let t0 = Instant::now();
    let bad = |reason: String| FsckError::OpenState {
        path: state_dir.to_path_buf(),
        reason,
    };
    let mut rep = FsckReport::default();
    if !state::has_workspace(state_dir) {
        if state_dir.join(state::RESTORE_UNFINISHED).exists() {
            // A first start (or `keel snapshot restore`) killed before its database was in
            // place: nothing is lost, the next one starts the restore over.
            rep.add(
                Level::Note,
                "a restore into this state dir did not finish (it holds no workspace yet); the next keel run, keel mount or keel snapshot restore starts it over".into(),
                false,
            );
            rep.elapsed_s = t0.elapsed().as_secs_f64();
            return Ok(rep);
        }
        if started_only(state_dir) {
            // A first start killed after it locked the state dir and before its restore
            // began (taking the lease, say): nothing is lost, the next start restores.
            rep.add(
                Level::Note,
                "no workspace here yet: a keel start was stopped before it restored or created one (it holds only keel's lock); the next keel run or keel mount does".into(),
                false,
            );
            rep.elapsed_s = t0.elapsed().as_secs_f64();
            return Ok(rep);
        }
        return Err(bad(format!("no {}: not a keel state dir", state::META_DB)));
    }
    // Before anything opens a file: opening the database makes it private by itself.
    check_modes(state_dir, "state dir", &mut rep, opts.repair);
    if let Some(root) = opts.remote.as_ref().and_then(|r| r.remote.local_root()) {
        // A remote inside the state dir was walked with it.
        if !root.starts_with(state_dir) {
            check_modes(root, "file:// remote", &mut rep, opts.repair);
        }
    }
    let store = state::open_store(state_dir, Nanos(now_ns()))?;
    // Every check reads each table once, in order: more cache would not be hit again.
    // SQLite's page cache for fsck: the budget's share (the peak is this plus ~48 bytes an
    // inode).
    store.limit_cache((crate::budget::shares().fsck_cache / 1024) as u32)?;
    rep.remote_checked = opts.remote.is_some();
    if let Some(url) = &opts.missing_remote {
        let last: Option<u64> = store
            .read()
            .persist_get("last_seq")?
            .and_then(|v| v.parse().ok());
        match last {
            Some(seq) => rep.add(
                Level::Error,
                format!("remote {url} is not there, but snapshot {seq} was checkpointed to it (mount it at that path, name it with --remote URL, or skip it with --no-remote)"),
                false,
            ),
            None => rep.add(
                Level::Note,
                format!("remote {url} does not exist yet (nothing was checkpointed to it)"),
                false,
            ),
        }
    }
    let bodies = state::open_bodies(state_dir).map_err(|e| bad(e.to_string()))?;
    // The `dir` provider keeps file bytes in its tree, checked by the walk of every
    // checkpoint against their host inodes: there are no bodies to check.
    let dir_tree = store.is_dir_workspace()?;
    if dir_tree {
        rep.add(
            Level::Note,
            format!(
                "dir workspace: file bytes live in {}, not in bodies: the local body check is skipped",
                state_dir.join(state::TREE).display()
            ),
            false,
        );
    }
    let pending = pending_renames(&store.read(), state_dir, &mut rep)?;
    if opts.quick && !opts.repair && !dir_tree {
        rep.sample = Some(quick::check(&store, &bodies, pending, &mut rep, opts)?);
        rep.elapsed_s = t0.elapsed().as_secs_f64();
        return Ok(rep);
    }
    for p in store.integrity_check()? {
        rep.add(Level::Error, format!("sqlite integrity: {p}"), false);
    }
    check_tree(&store, &mut rep, opts.repair)?;
    check_totals(&store, &mut rep, opts.repair)?;
    if !dir_tree {
        check_bodies(&store, &bodies, pending, &mut rep, opts)?;
    }
    if let Some(repo) = &opts.remote {
        check_remote(&store, &bodies, repo.clone(), &mut rep, opts)?;
    }
    rep.elapsed_s = t0.elapsed().as_secs_f64();
    Ok(rep)
}

/// Loose entries named one by one; past these, one summary line.
const LOOSE_SHOWN: usize = 10;

/// Warns about every file or directory under `root` that group or others may access (keel
/// makes them 0600/0700, see `private`); `repair` makes them private.
fn check_modes(root: &Path, what: &str, rep: &mut FsckReport, repair: bool) {
    let loose = match private::loose_paths(root) {
        Ok(l) => l,
        Err(e) => {
            rep.add(
                Level::Warning,
                format!("{what} {}: cannot check file modes: {e}", root.display()),
                false,
            );
            return;
        }
    };
    let mut rest_fixed = 0;
    for (n, l) in loose.iter().enumerate() {
        let done = repair
            && match private::tighten(&l.path, l.is_dir) {
                Ok(()) => true,
                Err(e) => {
                    rep.add(
                        Level::Warning,
                        format!("{}: cannot make it private: {e}", l.path.display()),
                        false,
                    );
                    false
                }
            };
        if n >= LOOSE_SHOWN {
            rest_fixed += done as usize;
        } else {
            rep.add(
                Level::Warning,
                format!(
                    "{what} {}: {} is group- or world-accessible (mode {:04o}; keel keeps {})",
                    l.path.display(),
                    if l.is_dir { "directory" } else { "file" },
                    l.mode,
                    if l.is_dir { "0700" } else { "0600" }
                ),
                done,
            );
        }
    }
    if loose.len() > LOOSE_SHOWN {
        let rest = loose.len() - LOOSE_SHOWN;
        rep.add(
            Level::Warning,
            format!(
                "{what} {}: {rest} more group- or world-accessible files/dirs{}",
                root.display(),
                if repair {
                    format!(" ({rest_fixed} made private)")
                } else {
                    String::new()
                }
            ),
            repair && rest_fixed == rest,
        );
    }
}

/// The running inode totals (statfs, snapshot headers) against a count of the table.
fn check_totals(store: &Store, rep: &mut FsckReport, repair: bool) -> Result<(), FsckError> {
    let (counted, kept) = store.read().inode_totals_both()?;
    if counted != kept {
        if repair {
            let tx = store.write()?;
            tx.recount_inode_totals()?;
            tx.commit()?;
        }
        rep.add(
            Level::Warning,
            format!(
                "inode totals say {} inodes / {} linked / {} file bytes, the table holds {} / {} / {}",
                kept[0], kept[1], kept[2], counted[0], counted[1], counted[2]
            ),
            repair,
        );
    }
    Ok(())
}

/// The snapshot this state dir last checkpointed, and the remote's head.
pub(super) type RemoteStart = (Option<u64>, Option<u64>);

/// Where every check of the remote starts: the snapshot this state dir last checkpointed
/// (`last_seq`) and the remote's head. `None` (reported) when the remote cannot be checked
/// further: no manifest, unreadable, or (with `stop_on_foreign`) not the remote this state
/// dir checkpointed to, which the full check only warns about.
pub(super) fn remote_start(
    r: &Tx,
    repo: &mut Repo,
    rep: &mut FsckReport,
    stop_on_foreign: bool,
) -> Result<Option<RemoteStart>, FsckError> {
    let local_seq: Option<u64> = r.persist_get("last_seq")?.and_then(|v| v.parse().ok());
    let remote_id = r.persist_get("remote_id")?;
    let where_ = repo.describe();
    match repo.manifest() {
        Ok(Some(m)) => {
            if remote_id.is_some() && remote_id.as_deref() != Some(m.id.as_str()) {
                rep.add(Level::Warning, format!("remote {where_} is not the one this state dir checkpointed to (next checkpoint writes a full snapshot)"), false);
                if stop_on_foreign {
                    return Ok(None);
                }
            }
        }
        Ok(None) => {
            if local_seq.is_some() {
                rep.add(Level::Error, format!("remote {where_} has no workspace manifest but snapshot {local_seq:?} was checkpointed there"), false);
            }
            return Ok(None);
        }
        Err(e) => {
            rep.add(Level::Error, format!("remote {where_}: {e}"), false);
            return Ok(None);
        }
    }
    match repo.read_head() {
        Ok(h) => Ok(Some((local_seq, h.map(|h| h.0.seq)))),
        Err(e) => {
            rep.add(Level::Error, format!("remote head: {e}"), false);
            Ok(None)
        }
    }
}

/// Reads every snapshot of the chain that `seq` ends, each decoded one record at a time
/// (never a whole tree in memory), adding the chunk ids they name to `wanted`; the chain's
/// full snapshot's header (`None` when it was read already, as part of an earlier chain).
fn chain_chunks(
    repo: &Repo,
    seq: u64,
    wanted: &mut BTreeSet<ChunkId>,
    read: &mut BTreeSet<u64>,
) -> Result<Option<super::format::Header>, super::repo::RepoError> {
    let mut at = Some(seq);
    while let Some(s) = at.filter(|s| read.insert(*s)) {
        let (key, data) = repo.snapshot_object(s)?;
        let h = super::format::check_object(&key, &data, &mut |c| {
            wanted.insert(c);
        })?;
        if h.is_full() {
            return Ok(Some(h));
        }
        at = h.parent;
    }
    Ok(None)
}

fn check_remote(
    store: &Store,
    bodies: &BodyStore,
    mut repo: Repo,
    rep: &mut FsckReport,
    opts: &FsckOptions,
) -> Result<(), FsckError> {
    let r = store.read();
    let Some((local_seq, head)) = remote_start(&r, &mut repo, rep, false)? else {
        return Ok(());
    };
    let mut wanted: BTreeSet<ChunkId> = BTreeSet::new();
    let seqs: BTreeSet<u64> = head.into_iter().chain(local_seq).collect();
    let mut fulls = Vec::new();
    let mut read = BTreeSet::new();
    for s in seqs {
        match chain_chunks(&repo, s, &mut wanted, &mut read) {
            Ok(Some(full)) => fulls.push(full),
            Ok(None) => {}
            Err(e) => rep.add(Level::Error, format!("snapshot {s}: {e}"), false),
        }
    }
    for what in super::image::check(&repo, &fulls, true) {
        rep.add(Level::Warning, what, false);
    }
    // Local chunk maps describe the last checkpoint: the remote must hold them too.
    let maps = r.all_file_chunks()?;
    let mut local_windows: HashMap<ChunkId, (InodeNo, u64)> = HashMap::new();
    for (ino, rows) in &maps {
        for (idx, id) in rows {
            if let Some(id) = id {
                wanted.insert(ChunkId(*id));
                local_windows.entry(ChunkId(*id)).or_insert((*ino, *idx));
            }
        }
    }
    let mut stored: HashSet<ChunkId> = match repo.list_chunks() {
        Ok(v) => v.into_iter().map(|(id, _)| id).collect(),
        Err(e) => {
            rep.add(Level::Error, format!("list chunks: {e}"), false);
            return Ok(());
        }
    };
    check_packs(&repo, &mut stored, rep);
    let mut bad_ids = Vec::new();
    for id in &wanted {
        if !stored.contains(id) {
            bad_ids.push((
                *id,
                format!("chunk {id} is referenced but missing on the remote"),
            ));
        }
    }
    if !opts.quick {
        let ids: Vec<ChunkId> = wanted
            .iter()
            .filter(|id| stored.contains(id))
            .copied()
            .collect();
        crate::progress::stage("remote chunks verified", Some(ids.len() as u64));
        for (n, batch) in ids.chunks(64).enumerate() {
            for (id, res) in batch.iter().zip(repo.get_chunks(batch)) {
                rep.chunks_checked += 1;
                if let Err(e) = res {
                    bad_ids.push((*id, e.to_string()));
                }
            }
            crate::progress::set(((n + 1) * 64).min(ids.len()) as u64);
        }
    }
    let cs = opts.chunk_size;
    for (id, why) in bad_ids {
        let mut repaired = false;
        if opts.repair {
            // Re-upload from a local window that still hashes to the id.
            if let Some((ino, idx)) = local_windows.get(&id) {
                // One lookup per bad chunk: never the whole inode table.
                if let Some(i) = r.get(*ino)? {
                    let range = window_range(*idx, i.size, cs);
                    if let Ok(f) = std::fs::File::open(bodies.path(ino.0)) {
                        let mut buf = vec![0u8; (range.end - range.start) as usize];
                        if f.read_exact_at(&mut buf, range.start).is_ok() && ChunkId::of(&buf) == id
                        {
                            repaired = repo
                                .remote
                                .put(&repo.chunk_key(&id), Bytes::from(buf), PutMode::Overwrite)
                                .is_ok();
                        }
                    }
                }
            }
        }
        let who = local_windows
            .get(&id)
            .map(|(ino, idx)| format!(" (window {idx} of file {})", ino.0))
            .unwrap_or_default();
        rep.add(Level::Error, format!("{why}{who}"), repaired);
    }
    Ok(())
}

/// The packs on the chunk store: each index must read back (else the chunks it names are
/// unreachable), and every pack must have its index and every index its pack. Adds the
/// chunks the indexes name to `stored`; their bytes are checked with every other chunk's.
fn check_packs(repo: &Repo, stored: &mut HashSet<ChunkId>, rep: &mut FsckReport) {
    let listed = match repo.list_packs() {
        Ok(l) => l,
        Err(e) => {
            rep.add(Level::Error, format!("list packs: {e}"), false);
            return;
        }
    };
    for p in &listed {
        match (&p.pack, &p.index) {
            (Some(pack), None) => rep.add(
                Level::Warning,
                format!(
                    "pack {} has no index (a checkpoint cut short; gc removes it)",
                    pack.key
                ),
                false,
            ),
            (None, Some(idx)) => rep.add(
                Level::Error,
                format!("pack index {} names a pack that is not there", idx.key),
                false,
            ),
            _ => {}
        }
    }
    match repo.load_listed_packs(&listed, None) {
        Ok(map) => {
            for why in &map.bad {
                rep.add(Level::Error, why.clone(), false);
            }
            let sizes: HashMap<ChunkId, u64> = listed
                .iter()
                .filter_map(|p| p.pack.as_ref().map(|i| (p.name, i.size)))
                .collect();
            for p in &map.packs {
                if let Some(size) = sizes.get(&p.name).filter(|s| **s != p.len) {
                    rep.add(
                        Level::Error,
                        format!(
                            "pack {}: {size} bytes, but its index says {}",
                            repo.pack_key(&p.name),
                            p.len
                        ),
                        false,
                    );
                }
            }
            stored.extend(map.ids());
        }
        Err(e) => rep.add(Level::Error, format!("read pack indexes: {e}"), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> FsckOptions {
        FsckOptions {
            chunk_size: 4096,
            ..Default::default()
        }
    }

    #[test]
    fn a_state_dir_a_start_left_before_its_restore_is_clean_with_a_note() {
        // Found by the kill-anywhere soak: keel killed at start while it took the lease, on
        // a fresh state dir (a new host restoring the remote lazily): the dir held only the
        // lock, and fsck said "no meta.db: not a keel state dir" (exit 1).
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(state::LOCK), b"").unwrap();
        let rep = fsck(d.path(), &opts()).expect("a state dir a start left");
        assert!(rep.is_clean(), "{:?}", rep.findings);
        assert!(
            rep.findings
                .iter()
                .any(|f| f.what.contains("no workspace here yet")),
            "{:?}",
            rep.findings
        );
        std::fs::write(d.path().join(state::LEASE_HOLDER), b"x").unwrap();
        assert!(fsck(d.path(), &opts()).unwrap().is_clean());
        // Anything else without a database is not taken for a state dir keel started on.
        std::fs::create_dir(d.path().join(state::BODIES)).unwrap();
        assert!(fsck(d.path(), &opts()).is_err());
        let empty = tempfile::tempdir().unwrap();
        assert!(
            fsck(empty.path(), &opts()).is_err(),
            "no lock: keel never started there"
        );
    }
}

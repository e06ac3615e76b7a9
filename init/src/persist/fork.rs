//! Forks: a new workspace made from a snapshot of another one in O(metadata), sharing its
//! chunk store, and the registry that lets gc of any workspace on a shared chunk store see
//! every other workspace that uses it.
//!
//! ```text
//! <owner>/chunks/<aa>/<hex>     the chunk store (`<owner>` is the workspace that created it)
//! <owner>/forks/<fork id>       one record per fork using this store (`ForkRecord`, JSON)
//! <owner>/gc-running/<id>       one live marker per gc of the store under way (`marker`)
//! <fork>/keel-workspace.json    manifest whose `chunks` names `<owner>/chunks`
//! <fork>/snapshots/<seq>        one full snapshot: the source's tree at the forked seq
//! <fork>/head                   written last
//! ```
//!
//! A fork of a fork points at the same root store and registers there too. Order of a fork:
//! manifest, registration (durable), wait for every gc of the store under way, read the
//! source snapshot, write it, head. Every gc first leaves a live marker under
//! `<owner>/gc-running/` and only then reads the fork records: so a gc either reads the
//! registration, or was under way when the fork looked for gcs, and the fork read nothing
//! of the source before that gc ended (a snapshot it dropped is then gone, and no fork is
//! made). While a registered fork has no head yet, its record pins the source snapshot it
//! is being made from. Keys in a record are relative to `<owner>`, so
//! the same record reads right from every workspace's store root: for `file://` remotes
//! (one store root per workspace directory) the keys climb out with `..` (forks refer to
//! their source by relative path and must move together with it); in a bucket they must
//! stay inside it, which is why a fork must live in the same bucket as its chunks.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::format::{self, Header};
use super::marker::Liveness;
use super::remote::{PutMode, RemoteError};
use super::repo::{Head, Manifest, Repo, RepoError};
use crate::chunk::ChunkId;
use crate::time::now_ns;

#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("{0} holds no keel workspace (no keel-workspace.json)")]
    NoWorkspace(String),
    #[error("{0} has no snapshot yet (no head): checkpoint it first")]
    NoHead(String),
    #[error("target {0} already holds a workspace; pick another URL or `keel fork --delete` it")]
    TargetExists(String),
    #[error("target {to} is not in the store of the source's chunks ({chunks}): forks share chunks, so they must live in the same bucket")]
    DifferentStore { to: String, chunks: String },
    #[error("target {to} overlaps {what} of the source")]
    Overlap { to: String, what: &'static str },
    #[error("{0} owns its chunk store (it is not a fork); only forks can be deleted")]
    NotAFork(String),
    #[error("read source: {0}")]
    ReadSource(RepoError),
    #[error("read source snapshot {seq}: {source}")]
    LoadSnapshot { seq: u64, source: RepoError },
    #[error("read target: {0}")]
    ReadTarget(RepoError),
    #[error("write manifest: {0}")]
    WriteManifest(RemoteError),
    #[error("write fork record {key}: {source}")]
    Register { key: String, source: RemoteError },
    #[error("encode snapshot: {0}")]
    Encode(#[from] format::FormatError),
    #[error("write snapshot {seq}: {source}")]
    WriteSnapshot { seq: u64, source: RemoteError },
    #[error("write head: {0}")]
    WriteHead(RepoError),
    #[error("flush remote: {0}")]
    Flush(RemoteError),
    #[error("look for a gc of the chunk store under way: {0}")]
    WaitForGc(RemoteError),
    #[error("delete {key}: {source}")]
    Delete { key: String, source: RemoteError },
}

/// What `<owner>/forks/<id>` says about one fork. Keys relative to `<owner>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkRecord {
    /// The fork's manifest id (also the record's name).
    pub id: String,
    /// Where the fork lives.
    pub path: String,
    /// The workspace it was forked from, and the snapshot.
    pub from: String,
    pub from_seq: u64,
    pub created_ns: i64,
}

#[derive(Debug, Clone, Default)]
pub struct ForkReport {
    pub id: String,
    pub seq: u64,
    pub inodes: u64,
    pub file_bytes: u64,
    /// Distinct chunks the fork's snapshot names (all shared, none copied).
    pub chunks: u64,
    /// The chunk store, as a key of the target's store.
    pub chunk_store: String,
}

#[derive(Debug, Clone, Default)]
pub struct DeleteReport {
    pub id: String,
    pub objects_deleted: u64,
}

// ------------------------------------------------------------------------------------
// Keys and locations.

/// Lexically normalised `/`-separated key parts: no empty or `.` parts, `x/..` folded;
/// leading `..` parts stay.
fn norm<'a>(parts: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for p in parts {
        match p {
            "" | "." => {}
            ".." if out.last().is_some_and(|l| l != "..") => {
                out.pop();
            }
            p => out.push(p.to_string()),
        }
    }
    out
}

fn norm_key(k: &str) -> String {
    norm(k.split('/')).join("/")
}

fn join(a: &str, b: &str) -> String {
    norm_key(&format!("{a}/{b}"))
}

fn parent(k: &str) -> String {
    match k.rsplit_once('/') {
        Some((p, _)) => p.to_string(),
        None => String::new(),
    }
}

/// A place in some store, absolute: a filesystem path (`file://`, where each workspace
/// directory is its own store root) or a key in a named bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Loc {
    /// `None`: the local filesystem.
    bucket: Option<String>,
    parts: Vec<String>,
}

fn root_of(repo: &Repo) -> Loc {
    let d = repo.describe();
    match d.strip_prefix("file://") {
        Some(p) => {
            let p = std::fs::canonicalize(p).unwrap_or_else(|_| Path::new(p).to_path_buf());
            let s = p.to_string_lossy().into_owned();
            Loc {
                bucket: None,
                parts: norm(s.split('/')),
            }
        }
        None => Loc {
            bucket: Some(d),
            parts: Vec::new(),
        },
    }
}

/// Where `key` of `repo`'s store is. `None`: a bucket key that climbs out of the bucket.
fn loc(repo: &Repo, key: &str) -> Option<Loc> {
    let root = root_of(repo);
    let mut parts = norm(root.parts.iter().map(String::as_str).chain(key.split('/')));
    if parts.first().is_some_and(|p| p == "..") {
        if root.bucket.is_some() {
            return None;
        }
        // `/..` is `/`.
        parts.retain(|p| p != "..");
    }
    Some(Loc {
        bucket: root.bucket,
        parts,
    })
}

/// `to` relative to `from` (same store).
fn rel(from: &Loc, to: &Loc) -> String {
    let common = from
        .parts
        .iter()
        .zip(&to.parts)
        .take_while(|(a, b)| a == b)
        .count();
    let mut out: Vec<&str> = vec![".."; from.parts.len() - common];
    out.extend(to.parts[common..].iter().map(String::as_str));
    out.join("/")
}

/// The key under which `repo` reaches `at`; `None` when `at` is in another store.
fn key_in(repo: &Repo, at: &Loc) -> Option<String> {
    let root = root_of(repo);
    if root.bucket != at.bucket {
        return None;
    }
    Some(rel(&root, at))
}

/// `inner` is `outer` or below it.
fn within(inner: &Loc, outer: &Loc) -> bool {
    inner.bucket == outer.bucket && inner.parts.starts_with(&outer.parts)
}

/// `key` of `repo`'s store as the key `repo` reaches it by, normalised (`None`: a key
/// that climbs out of a bucket).
fn canon(repo: &Repo, key: &str) -> Option<String> {
    loc(repo, key).and_then(|l| key_in(repo, &l))
}

// ------------------------------------------------------------------------------------
// Fork, delete.

/// Creates a fork of `src` (snapshot `seq`, default its head) at `dst`, which must hold no
/// workspace and live in the same store as the source's chunks. No chunk is copied.
pub fn fork(src: &mut Repo, dst: &mut Repo, seq: Option<u64>) -> Result<ForkReport, ForkError> {
    let op = crate::logging::Op::start("fork");
    let _peak = crate::budget::track("fork");
    if src.manifest().map_err(ForkError::ReadSource)?.is_none() {
        return Err(ForkError::NoWorkspace(describe(src)));
    }
    let seq = match seq {
        Some(s) => s,
        None => match src.read_head().map_err(ForkError::ReadSource)? {
            Some((h, _)) => h.seq,
            None => return Err(ForkError::NoHead(describe(src))),
        },
    };
    let to = describe(dst);
    // Where things are, as keys of the target's store.
    let bad_store = || ForkError::DifferentStore {
        to: to.clone(),
        chunks: format!("{}/{}", src.describe(), src.chunks()),
    };
    let owner_src = parent(src.chunks());
    let chunks_at = loc(src, src.chunks()).ok_or_else(bad_store)?;
    let owner_at = loc(src, &owner_src).ok_or_else(bad_store)?;
    let src_at = loc(src, src.ws()).ok_or_else(bad_store)?;
    let chunks_key = key_in(dst, &chunks_at).ok_or_else(bad_store)?;
    let dst_at = loc(dst, dst.ws()).ok_or_else(bad_store)?;
    if dst_at == src_at {
        return Err(ForkError::TargetExists(to));
    }
    for (what, k) in [
        ("the chunk store", src.chunks().to_string()),
        ("the fork records", join(&owner_src, "forks")),
        ("the snapshots", join(src.ws(), "snapshots")),
    ] {
        if loc(src, &k).is_some_and(|l| within(&dst_at, &l)) {
            return Err(ForkError::Overlap { to, what });
        }
    }
    if dst.manifest().map_err(ForkError::ReadTarget)?.is_some() {
        return Err(ForkError::TargetExists(to));
    }
    // Fail fast on a snapshot that is not there, before anything is claimed.
    src.read_header(seq)
        .map_err(|source| ForkError::LoadSnapshot { seq, source })?;
    crate::progress::stage(
        "steps (manifest, registration, running gcs, read the snapshot, snapshot, head)",
        Some(6),
    );

    // 1. The manifest (claims the target).
    op.step("manifest");
    let id = crate::random::id();
    let m = Manifest {
        format: format::FORMAT,
        id: id.clone(),
        chunks: chunks_key.clone(),
        created_ns: now_ns(),
    };
    let data = serde_json::to_vec_pretty(&m).expect("manifest serialises");
    match dst.remote.put(
        &dst.key("keel-workspace.json"),
        Bytes::from(data),
        PutMode::Create,
    ) {
        Ok(_) => {}
        Err(RemoteError::AlreadyExists { .. }) => return Err(ForkError::TargetExists(to)),
        Err(e) => return Err(ForkError::WriteManifest(e)),
    }
    crate::progress::set(1);
    let made = (|| -> Result<ForkReport, ForkError> {
        // 2. The record on the chunk store, durable before anything names the chunks.
        op.step("register");
        let rec = ForkRecord {
            id: id.clone(),
            path: rel(&owner_at, &dst_at),
            from: rel(&owner_at, &src_at),
            from_seq: seq,
            created_ns: now_ns(),
        };
        let key = join(&owner_src, &format!("forks/{id}"));
        let data = serde_json::to_vec_pretty(&rec).expect("record serialises");
        src.remote
            .put(&key, Bytes::from(data), PutMode::Create)
            .map_err(|source| ForkError::Register { key, source })?;
        src.remote.flush().map_err(ForkError::Flush)?;
        crate::progress::set(2);

        // 3. A gc of the store that began before the record existed decided what to keep
        // without it, and may still be deleting what the snapshot names: wait for each to
        // end. Every gc announces itself before it reads the records, so one that does not
        // show here yet will read this one (see `announce_gc`).
        wait_for_gcs(src, &owner_src)?;
        crate::progress::set(3);

        // 4. The source tree, now pinned by the record: still whole, or gone (a gc took
        // that snapshot before the record existed) and then no fork is made.
        let (tree, headers) = src
            .load_tree(seq)
            .map_err(|source| ForkError::LoadSnapshot { seq, source })?;
        crate::progress::set(4);

        // 5. One full snapshot of the tree, 6. the head.
        op.step("snapshot");
        let last = headers.last().expect("a chain has a snapshot");
        let header = Header {
            format: format::FORMAT,
            seq,
            parent: None,
            base: seq,
            prev: None,
            created_ns: last.created_ns,
            chunk_size: tree.chunk_size,
            inodes: tree.inodes.len() as u64,
            file_bytes: tree.file_bytes(),
            image: None,
        };
        let bytes = format::encode(&header, &tree.full_body())?;
        dst.put_snapshot(seq, bytes)
            .map_err(|source| ForkError::WriteSnapshot { seq, source })?;
        dst.remote.flush().map_err(ForkError::Flush)?;
        crate::progress::set(5);
        let head = Head {
            seq,
            created_ns: now_ns(),
            writer: format!("keel fork (pid {})", std::process::id()),
            // A fresh workspace: its first writer takes the lease at epoch 1.
            epoch: 0,
        };
        op.step("head");
        dst.write_head(&head, None).map_err(ForkError::WriteHead)?;
        dst.remote.flush().map_err(ForkError::Flush)?;
        crate::progress::set(6);
        Ok(ForkReport {
            id: id.clone(),
            seq,
            inodes: header.inodes,
            file_bytes: header.file_bytes,
            chunks: tree.chunk_ids().len() as u64,
            chunk_store: chunks_key.clone(),
        })
    })();
    if made.is_err() {
        op.step("undo");
        // Leave no half fork behind: no head was written, so nothing depends on it.
        let _ = dst.remote.delete(&dst.snapshot_key(seq));
        let _ = src.remote.delete(&join(&owner_src, &format!("forks/{id}")));
        let _ = dst.remote.delete(&dst.key("keel-workspace.json"));
    }
    made
}

/// The prefix of the markers of the gcs running on the chunk store owned by `owner`.
fn gc_markers(owner: &str) -> String {
    join(owner, "gc-running") + "/"
}

/// Tells forks in the making that a gc of `repo`'s chunk store is under way: a live marker
/// (see `marker`) under `<owner>/gc-running/`, written before the gc reads the fork records
/// and kept until it is done. A fork registers first and looks for these after: either the
/// gc reads its record, or the fork sees the marker and waits for the gc to end.
pub fn announce_gc(repo: &Repo) -> Result<super::marker::LiveMarker, RepoError> {
    let (_, owner, _) = store_keys(repo)?;
    let key = format!("{}{}", gc_markers(&owner), crate::random::id());
    Ok(super::marker::LiveMarker::start(
        repo.remote.clone(),
        &key,
        super::marker::MARKER_TTL,
    )?)
}

/// Waits until each gc of the chunk store owned by `owner` that is under way now has ended
/// (its marker removed, or run out: that gc died).
fn wait_for_gcs(src: &Repo, owner: &str) -> Result<(), ForkError> {
    let running = src
        .remote
        .list(&gc_markers(owner))
        .map_err(ForkError::WaitForGc)?;
    for info in running {
        let mut told = false;
        loop {
            let (m, _) = super::marker::read(src.remote.as_ref(), &info.key)
                .map_err(ForkError::WaitForGc)?;
            if !m.is_some_and(|m| m.liveness(now_ns()) == Liveness::Live) {
                break;
            }
            if !told {
                tracing::info!(
                    marker = %info.key,
                    "fork: a gc of the chunk store is under way; waiting for it to end"
                );
                told = true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    Ok(())
}

fn describe(repo: &Repo) -> String {
    if repo.ws().is_empty() {
        repo.describe()
    } else {
        format!("{}/{}", repo.describe(), repo.ws())
    }
}

/// Removes a fork: its head, snapshots, lease and manifest, then its record on the chunk
/// store. Its chunks stay until gc of a workspace that shares the store finds them unused.
pub fn delete_fork(repo: &mut Repo) -> Result<DeleteReport, ForkError> {
    let Some(m) = repo.manifest().map_err(ForkError::ReadTarget)? else {
        return Err(ForkError::NoWorkspace(describe(repo)));
    };
    if norm_key(&m.chunks) == join(repo.ws(), "chunks") {
        return Err(ForkError::NotAFork(describe(repo)));
    }
    let mut keys = vec![repo.key("head"), repo.key("lease")];
    for (_, info) in repo.list_snapshots().map_err(ForkError::ReadTarget)? {
        keys.push(info.key);
    }
    keys.push(repo.key("keel-workspace.json"));
    keys.push(join(&parent(repo.chunks()), &format!("forks/{}", m.id)));
    let mut n = 0;
    for key in keys {
        if repo
            .remote
            .head(&key)
            .map_err(|source| ForkError::Delete {
                key: key.clone(),
                source,
            })?
            .is_none()
        {
            continue;
        }
        repo.remote
            .delete(&key)
            .map_err(|source| ForkError::Delete { key, source })?;
        n += 1;
    }
    repo.remote.flush().map_err(ForkError::Flush)?;
    Ok(DeleteReport {
        id: m.id,
        objects_deleted: n,
    })
}

// ------------------------------------------------------------------------------------
// What gc needs to know about the other workspaces on a shared chunk store.

/// The other workspaces using `repo`'s chunk store and what they reference.
#[derive(Debug, Default)]
pub struct SharedRefs {
    /// Snapshots of `repo` that a fork in the making is being built from.
    pub pinned: BTreeSet<u64>,
    /// Chunks named by any snapshot of any other workspace on the store.
    pub chunks: HashSet<ChunkId>,
    /// How many other workspaces were considered.
    pub workspaces: u64,
    /// When the oldest checkpoint still uploading in another workspace began (its
    /// in-flight marker): chunks written since may be named by the snapshot it has yet to
    /// write.
    pub in_flight_since: Option<SystemTime>,
    pub warnings: Vec<String>,
}

/// What a checkpoint uploading to a shared chunk store leaves at `Repo::in_flight_key`: a
/// live marker (see `marker`), void once its checkpoint stops renewing it.
pub use super::marker::MarkerRecord as InFlight;

/// Notes when workspace `ws`'s checkpoint in progress (if any) began.
fn in_flight_of(other: &Repo, ws: &str, out: &mut SharedRefs) -> Result<(), RepoError> {
    let (m, bad) = super::marker::read(other.remote.as_ref(), &other.in_flight_key())?;
    if bad {
        out.warnings.push(format!(
            "workspace `{ws}`: its checkpoint-in-flight marker does not parse; ignored"
        ));
    }
    let Some(m) = m else {
        return Ok(());
    };
    match m.liveness(now_ns()) {
        Liveness::Live => {}
        Liveness::RanOut => {
            tracing::info!(
                "gc: workspace `{ws}`: its checkpoint-in-flight marker ran out (left by a checkpoint that is gone); ignored"
            );
            return Ok(());
        }
        Liveness::TooOld => {
            out.warnings.push(format!(
                "workspace `{ws}`: a checkpoint-in-flight marker more than a day old (left by a checkpoint that died); ignored"
            ));
            return Ok(());
        }
    }
    let since = UNIX_EPOCH + Duration::from_nanos(m.started_ns.max(0) as u64);
    out.in_flight_since = Some(out.in_flight_since.map_or(since, |s| s.min(since)));
    Ok(())
}

/// Chunk ids named by snapshot `seq` and the chain it builds on. A snapshot that is gone
/// was removed by its own gc meanwhile: `Ok(false)`.
fn chain_chunks(
    repo: &Repo,
    seq: u64,
    out: &mut HashSet<ChunkId>,
    seen: &mut BTreeSet<u64>,
) -> Result<bool, RepoError> {
    let mut at = Some(seq);
    while let Some(s) = at {
        if !seen.insert(s) {
            return Ok(true);
        }
        let read = repo
            .snapshot_object(s)
            .map_err(RepoError::from)
            .and_then(|(key, data)| {
                format::object_chunk_ids(&key, &data, &mut |c| {
                    out.insert(c);
                })
                .map_err(RepoError::from)
            });
        match read {
            Ok(h) => at = h.parent,
            Err(RepoError::Remote(e)) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// `repo`'s chunk store, the workspace that owns it, and `repo` itself, as canonical keys.
fn store_keys(repo: &Repo) -> Result<(String, String, String), RepoError> {
    let unreachable = |k: &str| RepoError::Parse {
        what: "chunk store key",
        key: k.to_string(),
        reason: "climbs out of the bucket".into(),
    };
    let chunks = canon(repo, repo.chunks()).ok_or_else(|| unreachable(repo.chunks()))?;
    let owner = parent(&chunks);
    let me = canon(repo, repo.ws()).ok_or_else(|| unreachable(repo.ws()))?;
    Ok((chunks, owner, me))
}

/// Whether another workspace may run a gc on `repo`'s chunk store: `repo` is a fork (its
/// chunks live under another workspace), or its store has fork records. One LIST at most.
/// (Its manifest must have been read.)
pub fn store_is_shared(repo: &Repo) -> Result<bool, RepoError> {
    let (_, owner, me) = store_keys(repo)?;
    if owner != me {
        return Ok(true);
    }
    Ok(!repo.remote.list(&(join(&owner, "forks") + "/"))?.is_empty())
}

/// Reads the fork records of `repo`'s chunk store (its manifest must have been read) and
/// collects what every other workspace on the store references: every snapshot it holds
/// (a superset of what its own gc keeps), and for a fork still being made, the source
/// snapshot it is made from.
pub fn shared_refs(repo: &Repo) -> Result<SharedRefs, RepoError> {
    let mut out = SharedRefs::default();
    let files = root_of(repo).bucket.is_none();
    let (chunks, owner, me) = store_keys(repo)?;
    let prefix = join(&owner, "forks") + "/";
    let mut users: Vec<(String, Option<(String, u64)>)> = vec![(owner.clone(), None)];
    for info in repo.remote.list(&prefix)? {
        let b = match repo.remote.get(&info.key) {
            Ok(b) => b,
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(e.into()),
        };
        let rec: ForkRecord = serde_json::from_slice(&b).map_err(|e| RepoError::Parse {
            what: "fork record",
            key: info.key.clone(),
            reason: e.to_string(),
        })?;
        match (
            canon(repo, &join(&owner, &rec.path)),
            canon(repo, &join(&owner, &rec.from)),
        ) {
            (Some(ws), Some(from)) => users.push((ws, Some((from, rec.from_seq)))),
            _ => out.warnings.push(format!(
                "fork record {} names a place outside the bucket; ignored",
                info.key
            )),
        }
    }
    for (ws, pin) in users {
        if ws == me {
            continue;
        }
        let mut other = Repo::new(repo.remote.clone(), &ws);
        let m = match other.manifest() {
            Ok(Some(m)) => m,
            Ok(None) => {
                out.warnings.push(format!(
                    "workspace `{ws}` is registered on chunk store `{chunks}` but no longer exists (no manifest); ignored"
                ));
                continue;
            }
            Err(e) => return Err(e),
        };
        // A manifest names its chunks from its own store root (for `file://`, its directory).
        let theirs = if files {
            join(&ws, &m.chunks)
        } else {
            m.chunks.clone()
        };
        if canon(repo, &theirs).as_deref() != Some(chunks.as_str()) {
            if pin.is_some() {
                out.warnings.push(format!(
                    "workspace `{ws}` is registered on chunk store `{chunks}` but its manifest names `{}`; ignored",
                    m.chunks
                ));
            }
            continue;
        }
        out.workspaces += 1;
        in_flight_of(&other, &ws, &mut out)?;
        let mut seen = BTreeSet::new();
        match other.read_head()? {
            Some(_) => {
                for (seq, _) in other.list_snapshots()? {
                    chain_chunks(&other, seq, &mut out.chunks, &mut seen)?;
                }
            }
            None => {
                // Being made (or died while being made): its source snapshot stays.
                let Some((from, seq)) = pin else { continue };
                if from == me {
                    out.pinned.insert(seq);
                } else {
                    let src = Repo::new(repo.remote.clone(), &from);
                    if !chain_chunks(&src, seq, &mut out.chunks, &mut seen)? {
                        out.warnings.push(format!(
                            "fork `{ws}` (no head yet) is made from snapshot {seq} of `{from}`, which is gone"
                        ));
                    }
                }
            }
        }
    }
    for w in &out.warnings {
        tracing::warn!("gc: {w}");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn at(bucket: Option<&str>, p: &str) -> Loc {
        Loc {
            bucket: bucket.map(String::from),
            parts: norm(p.split('/')),
        }
    }

    #[test]
    fn keys_normalise_and_relate() {
        assert_eq!(norm_key("a//b/./c/../d/"), "a/b/d");
        assert_eq!(norm_key("../x/../../y"), "../../y");
        assert_eq!(join("../origin", "../fork1"), "../fork1");
        assert_eq!(join("", "forks/x"), "forks/x");
        assert_eq!(parent("team/origin/chunks"), "team/origin");
        assert_eq!(parent("chunks"), "");
        let (o, f) = (at(None, "/r/origin"), at(None, "/r/forks/f1"));
        assert_eq!(rel(&o, &f), "../forks/f1");
        assert_eq!(rel(&f, &o), "../../origin");
        assert_eq!(rel(&o, &o), "");
        assert_eq!(
            rel(&at(Some("s3://b"), ""), &at(Some("s3://b"), "a/b")),
            "a/b"
        );
        assert!(within(
            &at(None, "/r/origin/chunks/x"),
            &at(None, "/r/origin/chunks")
        ));
        assert!(!within(
            &at(None, "/r/origin/chunksx"),
            &at(None, "/r/origin/chunks")
        ));
        assert!(!within(&at(Some("s3://a"), "x"), &at(Some("s3://b"), "x")));
    }

    #[test]
    fn bucket_keys_cannot_climb_out() {
        let repo = Repo::new(Arc::new(crate::persist::MemRemote::new()), "ws");
        assert!(loc(&repo, "../../x").is_none());
        assert_eq!(canon(&repo, "a/../b").as_deref(), Some("b"));
        let fs = tempfile::tempdir().unwrap();
        let root = fs.path().join("origin");
        let repo = Repo::new(Arc::new(crate::persist::FsRemote::open(&root).unwrap()), "");
        assert_eq!(
            canon(&repo, "../fork/../origin/chunks").as_deref(),
            Some("chunks")
        );
        assert_eq!(canon(&repo, "../fork").as_deref(), Some("../fork"));
    }
}

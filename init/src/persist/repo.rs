//! The layout of a workspace on its remote, on top of the `Remote` trait:
//!
//! ```text
//! <ws>/keel-workspace.json      manifest: format, id, where the chunks live
//! <ws>/head                     {"seq": N, "epoch": E, ...}: the latest snapshot (conditional writes)
//! <ws>/lease                    the single-writer lease (see `lease`)
//! <ws>/snapshots/<seq:016x>     snapshot objects (full or delta, see `format`)
//! <ws>/images/<blake3>.db.zst  metadata images of full snapshots (see `image`)
//! <chunks>/<aa>/<64 hex>        chunk objects, named by blake3, shared by all snapshots
//! <chunks>/packs/<blake3>.pack   small chunks packed together, and their index (`pack`)
//! <chunks>/packs/<blake3>.idx
//! ```
//!
//! A chunk is read from a pack when a pack's index names it (one ranged read for the
//! chunks of one pack that lie close together), else from its own object.
//!
//! `<chunks>` is `<ws>/chunks` for a new workspace; the manifest records it so a fork
//! points at the chunk store of the workspace it came from (`fork`, which also keeps the
//! `<ws>/forks/` records of who shares a store).

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::format::{self, Body, FormatError, Header, Tree};
use super::pack::{self, PackCache, PackMap};

/// Pack index objects fetched at once while the pack map loads.
const INDEX_BATCH: usize = 64;
use super::remote::{ObjectInfo, PutMode, Remote, RemoteError};
use crate::chunk::ChunkId;

#[derive(Debug, thiserror::Error)]
pub enum RepoError {
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("remote {what} {key}: {reason}")]
    Parse {
        what: &'static str,
        key: String,
        reason: String,
    },
    #[error("chunk {id} is corrupt on the remote (its bytes hash to {actual})")]
    ChunkCorrupt { id: ChunkId, actual: ChunkId },
    #[error("the remote has no snapshot yet (no head)")]
    NoHead,
    /// A chunk's pack could not be read (`what` names the chunk and the pack).
    #[error("{what}: {reason}")]
    PackRead { what: String, reason: String },
    #[error(transparent)]
    Pack(#[from] pack::PackError),
}

impl RepoError {
    /// The remote could not be reached or did not answer in time (a later try may work).
    pub fn is_temporary(&self) -> bool {
        matches!(self, RepoError::Remote(e) if e.is_temporary())
    }
}

/// The workspace manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    /// Random id; a local state dir remembers it to notice a remote that was replaced.
    pub id: String,
    /// Key prefix of the chunk store.
    pub chunks: String,
    pub created_ns: i64,
}

/// The head pointer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    pub seq: u64,
    pub created_ns: i64,
    /// Who wrote it (host and pid).
    pub writer: String,
    /// Lease epoch of the writer (0: written without a lease).
    #[serde(default)]
    pub epoch: u64,
}

/// A workspace on a remote.
#[derive(Clone)]
pub struct Repo {
    pub remote: Arc<dyn Remote>,
    ws: String,
    chunks: String,
    /// The chunk store's pack indexes, shared by the clones (see `pack`).
    packs: Arc<PackCache>,
    /// Chunks read around wanted ones in packs, until asked for (`pack::Around`).
    around: Arc<pack::Around>,
}

fn join(a: &str, b: &str) -> String {
    if a.is_empty() {
        b.to_string()
    } else {
        format!("{a}/{b}")
    }
}

impl Repo {
    /// A workspace under key prefix `ws` (may be empty) of `remote`.
    pub fn new(remote: Arc<dyn Remote>, ws: &str) -> Repo {
        let ws = ws.trim_matches('/').to_string();
        let chunks = join(&ws, "chunks");
        Repo {
            remote,
            ws,
            chunks,
            packs: Arc::new(PackCache::default()),
            around: Arc::default(),
        }
    }

    pub fn describe(&self) -> String {
        self.remote.describe()
    }

    /// Key prefix of the workspace in its store (may be empty).
    pub fn ws(&self) -> &str {
        &self.ws
    }

    /// Key prefix of the chunk store (the manifest's, once read).
    pub fn chunks(&self) -> &str {
        &self.chunks
    }

    /// Key of `rel` inside the workspace (`head`, `keel-workspace.json`, ...).
    pub fn key(&self, rel: &str) -> String {
        join(&self.ws, rel)
    }

    pub fn chunk_key(&self, id: &ChunkId) -> String {
        let h = id.to_hex();
        format!("{}/{}/{}", self.chunks, &h[..2], h)
    }

    pub fn chunk_prefix(&self) -> String {
        format!("{}/", self.chunks)
    }

    /// The single-writer lease object (see `lease`).
    pub fn lease_key(&self) -> String {
        self.key("lease")
    }

    /// The marker of a checkpoint uploading to a chunk store shared with forks: the gc of
    /// another workspace on that store keeps the chunks written since it began (`gc`).
    pub fn in_flight_key(&self) -> String {
        self.key("checkpoint-in-flight")
    }

    pub fn snapshot_key(&self, seq: u64) -> String {
        self.key(&format!("snapshots/{seq:016x}"))
    }

    /// Reads the manifest, creating it (and adopting its chunk location) when absent.
    pub fn ensure_manifest(&mut self, now_ns: i64) -> Result<Manifest, RepoError> {
        let key = self.key("keel-workspace.json");
        match self.remote.get(&key) {
            Ok(b) => {
                let m: Manifest = serde_json::from_slice(&b).map_err(|e| RepoError::Parse {
                    what: "manifest",
                    key: key.clone(),
                    reason: e.to_string(),
                })?;
                self.chunks = m.chunks.clone();
                Ok(m)
            }
            Err(e) if e.is_not_found() => {
                let m = Manifest {
                    format: format::FORMAT,
                    id: crate::random::id(),
                    chunks: self.chunks.clone(),
                    created_ns: now_ns,
                };
                let data = serde_json::to_vec_pretty(&m).expect("manifest serialises");
                match self.remote.put(&key, Bytes::from(data), PutMode::Create) {
                    Ok(_) => Ok(m),
                    // Someone else created it first: use theirs.
                    Err(RemoteError::AlreadyExists { .. }) => self.ensure_manifest(now_ns),
                    Err(e) => Err(e.into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Reads the manifest if there is one (without creating it).
    pub fn manifest(&mut self) -> Result<Option<Manifest>, RepoError> {
        let key = self.key("keel-workspace.json");
        match self.remote.get(&key) {
            Ok(b) => {
                let m: Manifest = serde_json::from_slice(&b).map_err(|e| RepoError::Parse {
                    what: "manifest",
                    key,
                    reason: e.to_string(),
                })?;
                self.chunks = m.chunks.clone();
                Ok(Some(m))
            }
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The head and its version (for a conditional update).
    pub fn read_head(&self) -> Result<Option<(Head, Option<String>)>, RepoError> {
        let key = self.key("head");
        let Some(info) = self.remote.head(&key)? else {
            return Ok(None);
        };
        let b = match self.remote.get(&key) {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let h: Head = serde_json::from_slice(&b).map_err(|e| RepoError::Parse {
            what: "head",
            key,
            reason: e.to_string(),
        })?;
        Ok(Some((h, info.version)))
    }

    /// The head as it is now, in one request (no version: not for a conditional update).
    pub fn head_now(&self) -> Result<Option<Head>, RepoError> {
        let key = self.key("head");
        let b = match self.remote.get(&key) {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| RepoError::Parse {
                what: "head",
                key,
                reason: e.to_string(),
            })
    }

    /// Points the head at a snapshot; `expected` is the version read before (None: the
    /// head must not exist yet).
    pub fn write_head(
        &self,
        head: &Head,
        expected: Option<String>,
    ) -> Result<Option<String>, RepoError> {
        let key = self.key("head");
        let data = Bytes::from(serde_json::to_vec(head).expect("head serialises"));
        let mode = match expected {
            Some(v) => PutMode::Update(v),
            None => PutMode::Create,
        };
        Ok(self.remote.put(&key, data, mode)?)
    }

    pub fn put_snapshot(&self, seq: u64, data: Vec<u8>) -> Result<(), RemoteError> {
        self.remote
            .put(&self.snapshot_key(seq), Bytes::from(data), PutMode::Create)?;
        Ok(())
    }

    /// Snapshot `seq`'s object as stored, and its key (what errors about it name).
    pub fn snapshot_object(&self, seq: u64) -> Result<(String, Bytes), RemoteError> {
        let key = self.snapshot_key(seq);
        let b = self.remote.get(&key)?;
        Ok((key, b))
    }

    pub fn read_snapshot(&self, seq: u64) -> Result<(Header, Body), RepoError> {
        let (key, b) = self.snapshot_object(seq)?;
        Ok(format::decode(&key, &b)?)
    }

    pub fn read_header(&self, seq: u64) -> Result<Header, RepoError> {
        let key = self.snapshot_key(seq);
        let b = self.remote.get_range(&key, 0..4096)?;
        Ok(format::decode_header(&key, &b)?.0)
    }

    /// Every snapshot object: (seq, info), oldest first.
    pub fn list_snapshots(&self) -> Result<Vec<(u64, ObjectInfo)>, RepoError> {
        let prefix = self.key("snapshots/");
        let mut out = Vec::new();
        for i in self.remote.list(&prefix)? {
            if let Ok(seq) = u64::from_str_radix(&i.key[prefix.len()..], 16) {
                out.push((seq, i));
            }
        }
        out.sort_by_key(|(s, _)| *s);
        Ok(out)
    }

    /// Materializes the tree of snapshot `seq` by replaying its chain from the full
    /// snapshot it builds on. Returns the tree and the headers of the chain. The chain's
    /// objects are held as fetched (compressed) and each body is replayed a record at a
    /// time (`Tree::apply_object`), so the memory is the tree's and the objects', never a
    /// decoded body's.
    pub fn load_tree(&self, seq: u64) -> Result<(Tree, Vec<Header>), RepoError> {
        self.fetch_chain(seq)?.tree(self)
    }

    /// The snapshot objects that make the tree of `seq`, as fetched (compressed), in the
    /// order they replay: the full snapshot first, `seq` last.
    pub fn chain_objects(&self, seq: u64) -> Result<Vec<(String, Bytes)>, RepoError> {
        let mut chain = self.fetch_chain(seq)?;
        chain.full_object(self)?;
        Ok(chain.into_objects())
    }

    /// The chain of snapshot `seq`, each object fetched once: the header of its full
    /// snapshot (the object itself only when asked, `Chain::full_object`: a restore from
    /// the metadata image never needs it) and the deltas after it, whole. Two round trips
    /// whatever the chain's length: `seq`'s header names the full snapshot (`base`), then
    /// the base's header and every snapshot after it up to `seq` are fetched at once, and
    /// the parent links are followed through what came back (an object between the two that
    /// is not in the chain, left by a checkpoint that never moved the head, is dropped).
    pub fn fetch_chain(&self, seq: u64) -> Result<Chain, RepoError> {
        let top = self.read_header(seq)?;
        let base = top.base;
        let mut objects: std::collections::HashMap<u64, (String, Bytes)> = Default::default();
        let mut full = None;
        if !top.is_full() && base < seq && seq - base <= CHAIN_SPECULATE {
            let seqs: Vec<u64> = (base + 1..=seq).collect();
            let keys: Vec<String> = seqs.iter().map(|s| self.snapshot_key(*s)).collect();
            let (got, base_header) = std::thread::scope(|sc| {
                let h = sc.spawn(|| self.read_header(base));
                (self.remote.get_many(&keys), h.join())
            });
            for ((s, key), r) in seqs.into_iter().zip(keys).zip(got) {
                match r {
                    Ok(b) => {
                        objects.insert(s, (key, b));
                    }
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e.into()),
                }
            }
            match base_header {
                Ok(r) => full = Some(r?),
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        let mut deltas = Vec::new();
        let mut at = seq;
        let full = loop {
            if at == seq && top.is_full() {
                break top;
            }
            if let Some(f) = full
                .as_ref()
                .filter(|f: &&Header| f.seq == at && f.is_full())
            {
                break f.clone();
            }
            let (key, b) = match objects.remove(&at) {
                Some(o) => o,
                None => {
                    // Not fetched ahead: a chain longer than the speculation, or a base
                    // that is not where the header said.
                    let h = self.read_header(at)?;
                    if h.is_full() {
                        break h;
                    }
                    self.snapshot_object(at)?
                }
            };
            let h = format::decode_header(&key, &b)?.0;
            let parent = h.parent;
            if h.is_full() {
                // A full snapshot fetched whole after all: keep it.
                return Ok(Chain {
                    full: h,
                    full_obj: Some((key, b)),
                    deltas: deltas.into_iter().rev().collect(),
                });
            }
            deltas.push((key, h, b));
            at = parent.expect("a delta has a parent");
        };
        deltas.reverse();
        Ok(Chain {
            full,
            full_obj: None,
            deltas,
        })
    }

    /// The prefix of the chunk store's packs and their indexes.
    pub fn pack_prefix(&self) -> String {
        format!("{}/packs/", self.chunks)
    }

    pub fn pack_key(&self, name: &ChunkId) -> String {
        format!("{}{}.pack", self.pack_prefix(), name.to_hex())
    }

    pub fn pack_index_key(&self, name: &ChunkId) -> String {
        format!("{}{}.idx", self.pack_prefix(), name.to_hex())
    }

    /// Every pack object and index object on the chunk store: (name, pack, index), either
    /// may be missing (a pack whose index was never written, an index left by a gc cut
    /// short).
    pub fn list_packs(&self) -> Result<Vec<PackObjects>, RepoError> {
        let prefix = self.pack_prefix();
        let mut by: std::collections::BTreeMap<ChunkId, PackObjects> = Default::default();
        for i in self.remote.list(&prefix)? {
            let name = &i.key[prefix.len()..];
            let (hex, is_idx) = match (name.strip_suffix(".pack"), name.strip_suffix(".idx")) {
                (Some(h), _) => (h, false),
                (_, Some(h)) => (h, true),
                _ => continue,
            };
            let Ok(id) = ChunkId::from_hex(hex) else {
                continue;
            };
            let e = by.entry(id).or_insert_with(|| PackObjects {
                name: id,
                pack: None,
                index: None,
            });
            if is_idx {
                e.index = Some(i);
            } else {
                e.pack = Some(i);
            }
        }
        Ok(by.into_values().collect())
    }

    /// Reads the index of every pack on the chunk store (those `prev` already holds are not
    /// fetched again) and makes it the map the clones of this repo read through.
    pub fn load_packs(&self, prev: Option<&PackMap>) -> Result<Arc<PackMap>, RepoError> {
        let listed = self.list_packs()?;
        self.load_listed_packs(&listed, prev)
    }

    /// `load_packs` from a listing already made.
    pub fn load_listed_packs(
        &self,
        listed: &[PackObjects],
        prev: Option<&PackMap>,
    ) -> Result<Arc<PackMap>, RepoError> {
        let known: std::collections::HashMap<ChunkId, usize> = prev
            .filter(|p| p.store == self.chunks)
            .map(|p| {
                p.packs
                    .iter()
                    .enumerate()
                    .map(|(k, i)| (i.name, k))
                    .collect()
            })
            .unwrap_or_default();
        // By name: the map's pack order (which copy of a chunk in two packs is read first).
        let mut names: Vec<ChunkId> = listed
            .iter()
            .filter(|p| p.index.is_some())
            .map(|p| p.name)
            .collect();
        names.sort();
        names.dedup();
        let mut b = pack::PackMapBuilder::new(&self.chunks);
        // Indexes fetched a batch at a time and each added (then dropped) before the next
        // batch: a load holds one batch of index objects beside the table, not all of them.
        for batch in names.chunks(INDEX_BATCH) {
            let fetch: Vec<&ChunkId> = batch.iter().filter(|n| !known.contains_key(n)).collect();
            let keys: Vec<String> = fetch.iter().map(|n| self.pack_index_key(n)).collect();
            let mut got = std::collections::HashMap::new();
            for ((name, key), r) in fetch.iter().zip(&keys).zip(self.remote.get_many(&keys)) {
                match r {
                    Ok(bytes) => match pack::decode_index(key, **name, &bytes) {
                        Ok(i) => {
                            got.insert(**name, i);
                        }
                        Err(e) => b.bad(e.to_string()),
                    },
                    // Deleted since the listing (a gc): its chunks are elsewhere by now.
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e.into()),
                }
            }
            for name in batch {
                match (known.get(name), prev) {
                    (Some(k), Some(p)) => b.add_from(p, *k),
                    _ => {
                        if let Some(i) = got.remove(name) {
                            b.add(i);
                        }
                    }
                }
            }
        }
        let map = Arc::new(b.finish());
        self.packs.set(map.clone());
        Ok(map)
    }

    /// The pack map, loaded once (an error is logged and reads go to loose chunks only); a
    /// load under way (`load_packs_ahead`) is waited for, not repeated.
    fn packs_now(&self) -> Option<Arc<PackMap>> {
        let loaded = || self.packs.get().filter(|m| m.store == self.chunks);
        if let Some(m) = loaded() {
            return Some(m);
        }
        let _one = self.packs.loading.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = loaded() {
            return Some(m);
        }
        match self.load_packs(None) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the pack indexes; reading loose chunks only");
                None
            }
        }
    }

    /// Loads the pack map on a thread of its own, so that the first read of a packed chunk
    /// does not wait for the listing and the index GETs (a lazy start calls it right after
    /// the restore); a read that comes first waits for this load rather than making its own.
    /// The thread, to wait for (`None`: it could not be started, after a warning).
    pub fn load_packs_ahead(&self) -> Option<std::thread::JoinHandle<()>> {
        let repo = self.clone();
        let started = std::thread::Builder::new()
            .name("keel-pack-index".into())
            .spawn(move || {
                let t = std::time::Instant::now();
                if let Some(m) = repo.packs_now() {
                    tracing::info!(
                        packs = m.packs.len(),
                        chunks = m.len(),
                        map_mib = m.heap_bytes() >> 20,
                        seconds = t.elapsed().as_secs_f64(),
                        "pack indexes loaded ahead of the first read"
                    );
                }
            });
        started
            .inspect_err(|e| tracing::warn!(error = %e, "cannot start loading the pack indexes ahead; the first read loads them"))
            .ok()
    }

    /// Fetches chunks and checks each against its id. Results in input order. A chunk an
    /// index names is read from its pack (one ranged read for the wanted chunks of a pack
    /// that lie close together, `pack::plan_reads`), else, or when that fails, from its own
    /// object; one that is in neither makes the pack indexes be read again (a pack written or
    /// repacked since they were) before it counts as missing.
    pub fn get_chunks(&self, ids: &[ChunkId]) -> Vec<Result<Bytes, RepoError>> {
        let mut out: Vec<Option<Result<Bytes, RepoError>>> = (0..ids.len()).map(|_| None).collect();
        let mut all: Vec<usize> = Vec::with_capacity(ids.len());
        for (k, id) in ids.iter().enumerate() {
            match self.around.take(id).filter(|b| id.verify(b)) {
                Some(b) => out[k] = Some(Ok(b)),
                None => all.push(k),
            }
        }
        if all.is_empty() {
            return out
                .into_iter()
                .map(|r| r.expect("every chunk has a result"))
                .collect();
        }
        let map = self.packs_now();
        let rest = match &map {
            Some(m) => self.fetch_packed(m, ids, &all, &mut out),
            None => all,
        };
        let keys: Vec<String> = rest.iter().map(|k| self.chunk_key(&ids[*k])).collect();
        let mut again = Vec::new();
        for (k, r) in rest.iter().zip(self.remote.get_many(&keys)) {
            let id = ids[*k];
            match r {
                Ok(b) => {
                    let actual = ChunkId::of(&b);
                    out[*k] = Some(if actual == id {
                        Ok(b)
                    } else {
                        Err(RepoError::ChunkCorrupt { id, actual })
                    });
                }
                Err(e) if e.is_not_found() => {
                    // A pack's bytes that did not match stay the error to report.
                    if !matches!(out[*k], Some(Err(RepoError::ChunkCorrupt { .. }))) {
                        again.push(*k);
                    }
                    if out[*k].is_none() {
                        out[*k] = Some(Err(e.into()));
                    }
                }
                Err(e) => {
                    if out[*k].is_none() {
                        out[*k] = Some(Err(e.into()));
                    }
                }
            }
        }
        if !again.is_empty() {
            match self.load_packs(map.as_deref()) {
                Ok(m) => {
                    let mut retry: Vec<Option<Result<Bytes, RepoError>>> =
                        (0..ids.len()).map(|_| None).collect();
                    self.fetch_packed(&m, ids, &again, &mut retry);
                    for k in again {
                        if let Some(r @ Ok(_)) = retry[k].take() {
                            out[k] = Some(r);
                        } else if let Some(r @ Err(RepoError::ChunkCorrupt { .. })) =
                            retry[k].take()
                        {
                            out[k] = Some(r);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the pack indexes again");
                }
            }
        }
        out.into_iter()
            .map(|r| r.expect("every chunk has a result"))
            .collect()
    }

    /// Reads the chunks at `which` (positions in `ids`) that `map` places in packs into
    /// `out`; returns the positions left to read from their own objects (not packed, or the
    /// pack read failed or did not verify: that error is in `out` meanwhile).
    fn fetch_packed(
        &self,
        map: &PackMap,
        ids: &[ChunkId],
        which: &[usize],
        out: &mut [Option<Result<Bytes, RepoError>>],
    ) -> Vec<usize> {
        let mut rest = Vec::new();
        let mut wanted = Vec::new();
        for k in which {
            match map.find(&ids[*k]).first() {
                Some(l) => wanted.push((*k, *l)),
                None => rest.push(*k),
            }
        }
        if wanted.is_empty() {
            return rest;
        }
        let reads = pack::widen(pack::plan_reads(wanted), |p| map.packs[p as usize].len);
        let reqs: Vec<(String, std::ops::Range<u64>)> = reads
            .iter()
            .map(|r| {
                let name = map.packs[r.pack as usize].name;
                (self.pack_key(&name), r.range.clone())
            })
            .collect();
        for ((read, (key, _)), got) in reads.iter().zip(&reqs).zip(self.remote.get_ranges(&reqs)) {
            if let Ok(b) = &got {
                self.keep_around(map, read, b, ids);
            }
            for (k, off, len) in &read.parts {
                let id = ids[*k];
                let at = (off - read.range.start) as usize;
                let piece = match &got {
                    Ok(b) if b.len() >= at + *len as usize => b.slice(at..at + *len as usize),
                    Ok(b) => {
                        out[*k] = Some(Err(RepoError::PackRead {
                            what: format!("chunk {id} in pack {key}"),
                            reason: format!(
                                "the pack is shorter than its index says ({} bytes at {})",
                                b.len(),
                                read.range.start
                            ),
                        }));
                        rest.push(*k);
                        continue;
                    }
                    Err(e) => {
                        out[*k] = Some(Err(RepoError::PackRead {
                            what: format!("chunk {id} in pack {key}"),
                            reason: e.to_string(),
                        }));
                        rest.push(*k);
                        continue;
                    }
                };
                let actual = ChunkId::of(&piece);
                if actual == id {
                    out[*k] = Some(Ok(piece));
                } else {
                    out[*k] = Some(Err(RepoError::ChunkCorrupt { id, actual }));
                    rest.push(*k);
                }
            }
        }
        rest
    }

    /// Keeps the chunks of `pack` that a read fetched without being asked for them.
    fn keep_around(&self, map: &PackMap, read: &pack::Read, got: &Bytes, ids: &[ChunkId]) {
        let end = read.range.start + got.len() as u64;
        for e in map
            .entries_from(read.pack as usize, read.range.start)
            .take_while(|e| e.range().end <= end)
        {
            if read.parts.iter().any(|(k, _, _)| ids[*k] == e.id) {
                continue;
            }
            let at = (e.off - read.range.start) as usize;
            self.around.put(e.id, &got[at..at + e.len as usize]);
        }
    }

    /// Every chunk object: (id, info).
    pub fn list_chunks(&self) -> Result<Vec<(ChunkId, ObjectInfo)>, RepoError> {
        let mut out = Vec::new();
        for i in self.remote.list(&self.chunk_prefix())? {
            let name = i.key.rsplit('/').next().unwrap_or("");
            if let Ok(id) = ChunkId::from_hex(name) {
                out.push((id, i));
            }
        }
        Ok(out)
    }
}

/// The objects of one pack as listed (see `Repo::list_packs`).
#[derive(Debug, Clone)]
pub struct PackObjects {
    pub name: ChunkId,
    pub pack: Option<ObjectInfo>,
    pub index: Option<ObjectInfo>,
}

/// Snapshots between a chain's full snapshot and its head fetched at once on the guess that
/// they are its deltas (`Repo::fetch_chain`); a longer chain is walked one object at a time.
const CHAIN_SPECULATE: u64 = 256;

/// A snapshot's chain as fetched (see `Repo::fetch_chain`).
pub struct Chain {
    /// The header of the full snapshot the chain starts from.
    pub full: Header,
    /// The full snapshot's object, once fetched: (key, bytes).
    full_obj: Option<(String, Bytes)>,
    /// The deltas after it, in replay order: (key, header, object).
    pub deltas: Vec<(String, Header, Bytes)>,
}

impl Chain {
    /// Every header, the full snapshot first.
    pub fn headers(&self) -> Vec<Header> {
        std::iter::once(self.full.clone())
            .chain(self.deltas.iter().map(|d| d.1.clone()))
            .collect()
    }

    /// The last snapshot's header (the one the chain was fetched for).
    pub fn last(&self) -> &Header {
        self.deltas.last().map_or(&self.full, |d| &d.1)
    }

    /// Fetches the full snapshot's object (once).
    pub fn full_object(&mut self, repo: &Repo) -> Result<&(String, Bytes), RepoError> {
        if self.full_obj.is_none() {
            self.full_obj = Some(repo.snapshot_object(self.full.seq)?);
        }
        Ok(self.full_obj.as_ref().expect("fetched"))
    }

    /// The objects in replay order (the full snapshot's first, when fetched).
    pub fn into_objects(self) -> Vec<(String, Bytes)> {
        self.full_obj
            .into_iter()
            .chain(self.deltas.into_iter().map(|(k, _, b)| (k, b)))
            .collect()
    }

    /// The tree the chain describes, and its headers (fetches the full snapshot).
    pub fn tree(mut self, repo: &Repo) -> Result<(Tree, Vec<Header>), RepoError> {
        self.full_object(repo)?;
        let mut tree = Tree::default();
        let mut headers = Vec::new();
        for (key, b) in &self.into_objects() {
            headers.push(tree.apply_object(key, b)?);
        }
        Ok((tree, headers))
    }
}

#[cfg(test)]
impl Repo {
    /// Stores `body` as snapshot `seq` on `parent` (none: a full snapshot), with
    /// `Header::test`'s header (tests).
    pub fn put_test(&self, seq: u64, parent: Option<u64>, body: &format::Body) {
        let h = format::Header::test(seq, parent);
        self.put_snapshot(seq, format::encode(&h, body).unwrap())
            .unwrap();
    }
}

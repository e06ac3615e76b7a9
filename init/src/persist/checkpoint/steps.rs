//! The steps of one checkpoint, in the order `Persister::take_checkpoint` calls them. What
//! the early steps find (the prior record, the change set, the windows to hash) travels to
//! the later ones (upload, snapshot, head, local record) in one `Pass`. Each step is
//! either a pure decision (`wants_full`, `lazy_windows_carry_over`), a change to the `Pass`
//! alone, or one kind of I/O (the state database or the remote), so each is tested alone.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;

use super::{kv_u64, CheckpointError, CheckpointReport, PersistParams, Persister};
use crate::chunk::chunker::{is_zero, window_count, window_range};
use crate::chunk::ChunkId;
use crate::meta::{ChunkRow, Inode, InodeNo, Kind, MissingRow, Nanos, Storage, Tx};
use crate::persist::format::{
    self, Body, BodyWriter, DataRec, DirentRec, Header, InodeRec, Section, Spill,
};
use crate::persist::pack::{Built, Packer};
use crate::persist::remote::{PutMode, RemoteError};
use crate::persist::repo::Head;
use crate::time::now_ns;

/// `persist_state` key: the chunk maps of inline files were dropped once (see
/// `void_stale_chunk_maps`).
pub(super) const INLINE_MAPS_SWEPT: &str = "inline_chunk_maps_swept";

/// `persist_state` key: whether the chain's full snapshot has a metadata image ("1"/"0";
/// absent: not known, taken as having one).
pub(super) const BASE_IMAGE: &str = "base_image";
/// `persist_state` key: full snapshots in a row written without their image because it
/// could not be built or uploaded (see `retries_image`).
pub(super) const IMAGE_FAILURES: &str = "image_failures";

/// Deltas may add up to an eighth of the size of the last full snapshot (at least this)
/// before the next checkpoint compacts them into a full one: a fresh restore loads the full
/// snapshot's image at once and applies the deltas after it (in bulk, `image::apply_delta`),
/// so what they hold is the part of the restore that grows with the history (issue 41: six
/// deltas that changed 450k of 547k inodes, replayed record by record, took a fresh host
/// 6.96 s instead of ~0.9 s). Measured at 1M files (BENCHMARKS.md, "A fresh host after a
/// real session"): an inode a delta changed costs the restore ~3-3.5 µs of CPU (its record
/// and its entry's, decoded and inserted), an inode of the image ~0.5 µs (download,
/// decompress), and both snapshot kinds take ~10 bytes an inode; so deltas of an eighth of
/// the full snapshot's bytes add at most ~0.75x the image's restore work (a quarter let
/// them add ~1.5x). The price is about twice as many full snapshots while a workspace
/// grows (each ~10 MB + a ~22 MB image and ~5.5 s of checkpoint work at 1M files, quiet).
pub(super) const COMPACT_FLOOR: u64 = 256 << 10;
/// The deltas' share of the full snapshot's size past which the next one is full.
pub(super) const COMPACT_SHARE: u64 = 8;

/// A hashed window: its id and bytes (`None` for an all-zero window).
type Hashed = (Option<ChunkId>, Option<Bytes>);

/// One window to hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Job {
    pub ino: InodeNo,
    pub idx: u64,
    pub range: std::ops::Range<u64>,
}

/// A file's part of a checkpoint.
pub(super) struct FileWork {
    pub inode: Inode,
    /// The chunk map before this checkpoint.
    pub old: BTreeMap<u64, Option<[u8; 32]>>,
}

/// What the local record and the remote's identity say before a checkpoint.
#[derive(Debug, Clone, Default)]
pub(super) struct Prior {
    /// The remote's id (from its manifest), recorded locally when the checkpoint commits.
    pub remote_id: String,
    pub last_seq: Option<u64>,
    /// The remote is the one the local chunk maps were uploaded to.
    pub trusted: bool,
    pub deltas: u64,
    pub delta_bytes: u64,
    pub full_bytes: u64,
    /// The chunk size of the local chunk maps (`None`: never checkpointed).
    pub chunk_size: Option<u64>,
    pub base: Option<u64>,
    /// Windows of lazily restored files not fetched yet, and the chunk each holds.
    pub missing: HashMap<InodeNo, Vec<MissingRow>>,
    /// The remote's head was written by someone else (`foreign`) on the remote the chunk maps
    /// were uploaded to.
    pub diverged: bool,
    /// The full snapshot the chain starts from has no metadata image (its build or upload
    /// failed, or it was written under a deadline): every fresh restore decodes the chain.
    pub base_without_image: bool,
    /// Full snapshots in a row whose image could not be built or uploaded.
    pub image_failures: u64,
}

/// One checkpoint in progress: what each step leaves for the next.
pub(super) struct Pass {
    pub prior: Prior,
    pub full: bool,
    /// The remote head before this checkpoint, and its version for the conditional write.
    pub head: Option<(Head, Option<String>)>,
    /// The in-flight marker this checkpoint keeps for the workspaces sharing its chunk
    /// store (removed when the pass is dropped, whatever its outcome).
    pub in_flight: Option<crate::persist::marker::LiveMarker>,
    /// The snapshot being built. A full snapshot keeps only its chunked files' records
    /// here (their maps are filled in after hashing); the rest are in `spill`.
    pub body: Body,
    /// A full snapshot's other records, set aside on disk as they are read (see
    /// `collect_tree`), so the tree is never in memory at once.
    pub spill: Option<FullSpill>,
    pub files: HashMap<InodeNo, FileWork>,
    /// A delta's inodes whose records went to `spill` (no chunked file among them).
    pub spilled: Vec<InodeNo>,
    pub jobs: Vec<Job>,
    /// Live inodes and file bytes of the whole tree (the snapshot header's totals).
    pub inode_total: u64,
    pub file_bytes: u64,
    /// The new chunk map rows of each file.
    pub hashed: HashMap<InodeNo, Vec<ChunkRow>>,
    /// A full snapshot's metadata image, named in its header (see `persist::image`).
    pub image: Option<format::ImageRef>,
    /// An image was built for it (none is under a deadline): `image` is `None` only when
    /// that failed.
    pub image_tried: bool,
    pub report: CheckpointReport,
}

impl Pass {
    pub fn new(prior: Prior, full: bool, head: Option<(Head, Option<String>)>) -> Pass {
        Pass {
            prior,
            full,
            head,
            in_flight: None,
            body: Body::default(),
            spill: None,
            files: HashMap::new(),
            spilled: Vec::new(),
            jobs: Vec::new(),
            inode_total: 0,
            file_bytes: 0,
            hashed: HashMap::new(),
            image: None,
            image_tried: false,
            report: CheckpointReport {
                full,
                ..Default::default()
            },
        }
    }

    /// Adds one live inode to the snapshot (its data record via `data_of`).
    fn add_inode(
        &mut self,
        i: &Inode,
        xattrs: Vec<(Vec<u8>, Vec<u8>)>,
        found: &mut Found,
        dirty: &Dirty,
        chunk_size: u64,
    ) {
        let data = self.data_of(i, found, dirty, chunk_size);
        self.body.inodes.push(rec_of(i, xattrs, data));
    }

    /// The snapshot record of a file's data; queues the windows of a body that need
    /// hashing (dirty ones and ones never hashed).
    fn data_of(&mut self, i: &Inode, found: &mut Found, dirty: &Dirty, cs: u64) -> DataRec {
        match (i.kind, i.storage) {
            (Kind::File, Storage::Inline) => {
                let mut v = found.inline.remove(&i.ino).unwrap_or_default();
                v.resize(i.size as usize, 0);
                DataRec::Inline(v)
            }
            (Kind::File, Storage::Body) => {
                let nwin = window_count(i.size, cs);
                let old: BTreeMap<u64, Option<[u8; 32]>> = found
                    .maps
                    .remove(&i.ino)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|(x, _)| *x < nwin)
                    .collect();
                for idx in 0..nwin {
                    if dirty.contains(i.ino, idx) || !old.contains_key(&idx) {
                        self.jobs.push(Job {
                            ino: i.ino,
                            idx,
                            range: window_range(idx, i.size, cs),
                        });
                    }
                }
                self.files.insert(
                    i.ino,
                    FileWork {
                        inode: i.clone(),
                        old,
                    },
                );
                // Filled in once the windows are hashed (`fill_chunk_maps`).
                DataRec::Chunks {
                    complete: false,
                    patch: Vec::new(),
                }
            }
            (Kind::Symlink, _) => {
                DataRec::Symlink(found.links.get(&i.ino).cloned().unwrap_or_default())
            }
            _ => DataRec::None,
        }
    }

    /// A window not fetched yet (lazy restore) holds its chunk by definition: every change
    /// to it fetches it first. Its chunk goes to the new map as is; its sparse zeros are
    /// never hashed.
    pub fn reuse_unfetched_windows(&mut self) {
        let missing = &self.prior.missing;
        if missing.is_empty() {
            return;
        }
        let hashed = &mut self.hashed;
        self.jobs.retain(|j| {
            let id = missing
                .get(&j.ino)
                .and_then(|m| m.binary_search_by_key(&j.idx, |r| r.0).ok().map(|k| m[k].1));
            match id {
                Some(id) => {
                    hashed.entry(j.ino).or_default().push((j.idx, Some(id)));
                    false
                }
                None => true,
            }
        });
    }

    /// Fills in the chunk maps of the snapshot's file records from the hashed windows: the
    /// whole map for a full snapshot or a file new to the remote, else the changed windows.
    pub fn fill_chunk_maps(&mut self, cs: u64) {
        for rec in &mut self.body.inodes {
            let Some(fw) = self.files.get(&InodeNo(rec.ino)) else {
                continue;
            };
            let nwin = window_count(fw.inode.size, cs);
            let new: BTreeMap<u64, Option<[u8; 32]>> = self
                .hashed
                .get(&fw.inode.ino)
                .map(|v| v.iter().copied().collect())
                .unwrap_or_default();
            let complete = self.full || fw.old.is_empty();
            let patch: Vec<(u64, Option<[u8; 32]>)> = if complete {
                (0..nwin)
                    .map(|i| (i, new.get(&i).or_else(|| fw.old.get(&i)).copied().flatten()))
                    .collect()
            } else {
                new.iter()
                    .filter(|(i, id)| fw.old.get(i) != Some(id))
                    .map(|(i, id)| (*i, *id))
                    .collect()
            };
            rec.data = DataRec::Chunks { complete, patch };
        }
    }

    /// The snapshot's header for sequence number `seq`.
    pub fn header(&self, seq: u64, cs: u64) -> Header {
        let (full, last_seq) = (self.full, self.prior.last_seq);
        Header {
            format: format::FORMAT,
            seq,
            parent: if full { None } else { last_seq },
            base: if full {
                seq
            } else {
                self.prior.base.unwrap_or(seq)
            },
            prev: last_seq,
            created_ns: now_ns(),
            chunk_size: cs,
            inodes: self.inode_total,
            file_bytes: self.file_bytes,
            image: self.image,
        }
    }

    /// The first sequence number to try: past both the local record and the remote head.
    pub fn next_seq(&self) -> u64 {
        self.prior
            .last_seq
            .unwrap_or(0)
            .max(self.head.as_ref().map(|h| h.0.seq).unwrap_or(0))
            + 1
    }
}

/// A snapshot's records other than its chunked files', set aside on disk in the order they
/// will be written: a full snapshot's always, a delta's once its records in memory pass the
/// budget's share (`budget::Shares::snapshot_records`).
pub(super) struct FullSpill {
    pub inodes: Spill,
    pub dirents: Spill,
    pub unlinked: Spill,
}

impl FullSpill {
    fn create(store: &crate::meta::Store) -> Result<FullSpill, CheckpointError> {
        let spill = |name: &str| -> Result<Spill, CheckpointError> {
            let path = store
                .scratch_path(name)
                .ok_or_else(|| format::FormatError::Spill {
                    path: name.to_string(),
                    source: std::io::Error::other("the state database has no file to spill beside"),
                })?;
            Ok(Spill::create(path)?)
        };
        Ok(FullSpill {
            inodes: spill(crate::state::SCRATCH_INODES)?,
            dirents: spill(crate::state::SCRATCH_DIRENTS)?,
            unlinked: spill(crate::state::SCRATCH_UNLINKED)?,
        })
    }
}

/// Heap bytes an inode record holds, about (a delta's records in memory are counted by it).
fn rec_bytes(r: &InodeRec) -> u64 {
    let data = match &r.data {
        DataRec::Inline(v) | DataRec::Symlink(v) => v.len(),
        DataRec::Chunks { patch, .. } => patch.len() * 48,
        DataRec::None => 0,
    };
    let x: usize = r.xattrs.iter().map(|(k, v)| k.len() + v.len() + 48).sum();
    (160 + data + x) as u64
}

impl Pass {
    /// Inode records in the snapshot being built.
    pub fn inode_records(&self) -> u64 {
        self.body.inodes.len() as u64 + self.spill.as_ref().map_or(0, |s| s.inodes.len())
    }

    /// Encodes the snapshot object (under a provisional header: see `upload_snapshot`).
    fn encode(&mut self, seq: u64, cs: u64) -> Result<Vec<u8>, CheckpointError> {
        let h = self.header(seq, cs);
        let Some(sp) = self.spill.take() else {
            return Ok(format::encode(&h, &self.body)?);
        };
        let b = &self.body;
        let mut w = BodyWriter::new(&h)?;
        w.begin(Section::Inodes, sp.inodes.len() + b.inodes.len() as u64)?;
        w.splice(Section::Inodes, sp.inodes)?;
        for r in &b.inodes {
            w.inode(r)?;
        }
        w.begin(Section::Deleted, b.deleted.len() as u64)?;
        for d in &b.deleted {
            w.deleted(*d)?;
        }
        w.begin(Section::Dirents, sp.dirents.len() + b.dirents.len() as u64)?;
        w.splice(Section::Dirents, sp.dirents)?;
        for d in &b.dirents {
            w.dirent(d)?;
        }
        w.begin(
            Section::Unlinked,
            sp.unlinked.len() + b.unlinked.len() as u64,
        )?;
        w.splice(Section::Unlinked, sp.unlinked)?;
        for (parent, name) in &b.unlinked {
            w.unlinked(*parent, name)?;
        }
        Ok(w.finish()?)
    }
}

/// The claimed windows written since the last checkpoint, sorted by (inode, window) as
/// `pending_windows` returns them: 16 bytes a window. (A map of sets cost ~130 bytes an
/// inode: 130 MiB of a first full snapshot's peak at 1M newly written files.)
pub(super) struct Dirty(Vec<(InodeNo, u64)>);

impl Dirty {
    fn contains(&self, ino: InodeNo, idx: u64) -> bool {
        self.0.binary_search(&(ino, idx)).is_ok()
    }
}

/// Data of the inodes a snapshot names, read from the state database up front.
#[derive(Default)]
struct Found {
    inline: HashMap<InodeNo, Vec<u8>>,
    links: HashMap<InodeNo, Vec<u8>>,
    maps: HashMap<InodeNo, Vec<ChunkRow>>,
}

/// Whether windows not fetched yet can be carried over as they are: only to the remote they
/// were restored from, in the chunk size they were cut in. Also after another writer
/// checkpointed the same remote (`diverged`): its gc may have taken some of their chunks,
/// but refusing would leave the state dir unable to checkpoint at all (a window whose chunk
/// is gone cannot be read here either); `foreign` warns.
pub(super) fn lazy_windows_carry_over(prior: &Prior, cs: u64) -> Result<(), CheckpointError> {
    if prior.missing.is_empty()
        || (prior.chunk_size == Some(cs) && (prior.trusted || prior.diverged))
    {
        return Ok(());
    }
    Err(CheckpointError::LazyIncomplete {
        windows: prior.missing.values().map(|v| v.len() as u64).sum(),
        why: if prior.chunk_size != Some(cs) {
            "the chunk size changed"
        } else {
            "the remote is not the one they were restored from"
        },
    })
}

/// Whether this checkpoint (which has changes to write) writes a full snapshot to give the
/// chain a metadata image its base lacks: at once after one failed build (a transient
/// ENOSPC, a remote hiccup), then after 1, 3, 7... deltas while it keeps failing (at most
/// 63), never under a deadline (a checkpoint under one builds no image).
pub(super) fn retries_image(prior: &Prior, under_deadline: bool) -> bool {
    if !prior.base_without_image || under_deadline || prior.last_seq.is_none() {
        return false;
    }
    let wait = (1u64 << prior.image_failures.saturating_sub(1).min(6)) - 1;
    prior.deltas >= wait
}

/// Whether this checkpoint writes a full snapshot rather than a delta.
pub(super) fn wants_full(prior: &Prior, asked: bool, params: &PersistParams) -> bool {
    asked
        || prior.last_seq.is_none()
        || !prior.trusted
        || prior.chunk_size != Some(params.chunk_size)
        || prior.deltas + 1 >= u64::from(params.compact_every)
        || prior.delta_bytes > (prior.full_bytes / COMPACT_SHARE).max(COMPACT_FLOOR)
}

impl Persister {
    /// Moves the unclaimed changes to the pending set (where they stay until
    /// `record_locally`) and records that every write before `synced_at` is in it.
    pub(super) fn claim_changes(&self, synced_at: Nanos) -> Result<(), CheckpointError> {
        let tx = self.store.write()?;
        tx.claim_changes()?;
        tx.persist_set("clean_before", &synced_at.0.to_string())?;
        tx.commit()?;
        Ok(())
    }

    /// The local record of past checkpoints, and whether the remote is the one it names: a
    /// replaced or different remote cannot be trusted to hold the chunks the maps name.
    pub(super) fn read_prior(&mut self) -> Result<Prior, CheckpointError> {
        let manifest = self
            .repo
            .ensure_manifest(now_ns())
            .map_err(CheckpointError::Manifest)?;
        let r = self.store.read();
        let recorded = r.persist_get("remote_id")?;
        Ok(Prior {
            trusted: recorded.as_deref() == Some(manifest.id.as_str()),
            remote_id: manifest.id,
            last_seq: kv_u64(&r, "last_seq")?,
            deltas: kv_u64(&r, "deltas_since_full")?.unwrap_or(0),
            delta_bytes: kv_u64(&r, "delta_bytes_since_full")?.unwrap_or(0),
            full_bytes: kv_u64(&r, "full_bytes")?.unwrap_or(0),
            chunk_size: kv_u64(&r, "chunk_size")?,
            base: kv_u64(&r, "base_seq")?,
            missing: r.all_missing_windows()?,
            diverged: false,
            base_without_image: r.persist_get(BASE_IMAGE)?.as_deref() == Some("0"),
            image_failures: kv_u64(&r, IMAGE_FAILURES)?.unwrap_or(0),
        })
    }

    /// Windows changed size, or this remote is not the one the chunk maps were uploaded to
    /// (a new remote, a restored state dir, a wiped bucket): every chunk map is void, so
    /// every window is hashed and offered to the remote again (chunks it already holds are
    /// not rewritten). Else, once per state dir, the maps of files that are inline now are.
    pub(super) fn void_stale_chunk_maps(&self, prior: &Prior) -> Result<(), CheckpointError> {
        let cs = self.params.chunk_size;
        if prior.chunk_size.is_some_and(|c| c != cs) || (!prior.trusted && prior.last_seq.is_some())
        {
            let tx = self.store.write()?;
            tx.clear_file_chunks()?;
            tx.commit()?;
        } else if self.store.read().persist_get(INLINE_MAPS_SWEPT)?.as_deref() != Some("1") {
            // Once per state dir: the maps a keel before `record_locally` dropped them left
            // behind (see there).
            let tx = self.store.write()?;
            tx.drop_inline_chunk_maps()?;
            tx.persist_set(INLINE_MAPS_SWEPT, "1")?;
            tx.commit()?;
        }
        Ok(())
    }

    /// The remote head, refused if a later lease epoch wrote it.
    pub(super) fn read_fenced_head(
        &self,
    ) -> Result<Option<(Head, Option<String>)>, CheckpointError> {
        let head = self.repo.read_head().map_err(CheckpointError::ReadHead)?;
        if let (Some(l), Some((h, _))) = (&self.lease, &head) {
            l.check_head_epoch(h.epoch)?;
        }
        Ok(head)
    }

    /// Builds the snapshot's records (the whole tree, or the changed inodes and dirents)
    /// from one consistent view, and queues the windows to hash. A delta takes the changes
    /// recorded after the claim too (see `Tx::snapshot_inodes`): the claimed ones alone, read
    /// as they are now, are not a closed set.
    pub(super) fn collect_changes(&self, pass: &mut Pass) -> Result<(), CheckpointError> {
        let view = self.store.read_view()?;
        // A full snapshot hashes only body files' windows; a delta also takes the inodes
        // of the others as changed.
        let dirty = Dirty(if pass.full {
            view.snapshot_body_windows()?
        } else {
            view.snapshot_windows()?
        });
        if pass.full {
            self.collect_tree(&view, &dirty, pass)
        } else {
            self.collect_delta(&view, &dirty, pass)
        }
    }

    /// A full snapshot's records: every live inode and every dirent, streamed from the
    /// view. Chunked files' records wait in `pass.body` for their maps; every other record
    /// goes to a spill file beside the database as it is read, so memory does not grow with
    /// the tree (what grows is per chunked file, and the xattrs).
    fn collect_tree(
        &self,
        view: &Tx<'_>,
        dirty: &Dirty,
        pass: &mut Pass,
    ) -> Result<(), CheckpointError> {
        let cs = self.params.chunk_size;
        let mut sp = FullSpill::create(&self.store)?;
        let mut xattrs = view.all_xattrs()?;
        view.for_each_live_inode_with_data(|i, data| -> Result<(), CheckpointError> {
            pass.inode_total += 1;
            if i.kind == Kind::File {
                pass.file_bytes += i.size;
            }
            let x = xattrs.remove(&i.ino).unwrap_or_default();
            let mut found = Found::default();
            match (i.kind, i.storage, data) {
                (Kind::File, Storage::Body, _) => {
                    found.maps.insert(i.ino, view.file_chunks(i.ino)?);
                    pass.add_inode(&i, x, &mut found, dirty, cs);
                    return Ok(());
                }
                (Kind::File, _, Some(d)) => {
                    found.inline.insert(i.ino, d);
                }
                (Kind::Symlink, _, Some(t)) => {
                    found.links.insert(i.ino, t);
                }
                _ => {}
            }
            let data = pass.data_of(&i, &mut found, dirty, cs);
            sp.inodes.push(&rec_of(&i, x, data))?;
            Ok(())
        })?;
        view.for_each_dirent(|parent, name, ino, kind| -> Result<(), CheckpointError> {
            sp.dirents.push(&DirentRec {
                parent: parent.0,
                name,
                ino: ino.0,
                kind: kind.mode_bits(),
            })?;
            Ok(())
        })?;
        pass.spill = Some(sp);
        Ok(())
    }

    /// A delta's records: the changed inodes (or their deletion) and dirents (or their
    /// removal).
    fn collect_delta(
        &self,
        view: &Tx<'_>,
        dirty: &Dirty,
        pass: &mut Pass,
    ) -> Result<(), CheckpointError> {
        let cs = self.params.chunk_size;
        // Records kept in memory until this many bytes; the rest go to a spill file.
        let keep = crate::budget::shares().snapshot_records;
        let mut held = 0u64;
        let mut touched: BTreeSet<InodeNo> = view.snapshot_inodes()?.into_iter().collect();
        touched.extend(dirty.0.iter().map(|(ino, _)| *ino));
        for ino in touched {
            let Some(i) = view.get(ino)?.filter(|i| i.nlink > 0) else {
                pass.body.deleted.push(ino.0);
                continue;
            };
            let x = view.xattrs_of(ino)?;
            let mut found = Found::default();
            match (i.kind, i.storage) {
                (Kind::File, Storage::Inline) => {
                    found.inline.insert(ino, view.inline_data(ino)?);
                }
                (Kind::File, Storage::Body) => {
                    found.maps.insert(ino, view.file_chunks(ino)?);
                }
                (Kind::Symlink, _) => {
                    if let Some(t) = view.symlink_target(ino)? {
                        found.links.insert(ino, t);
                    }
                }
                _ => {}
            }
            if i.kind == Kind::File && i.storage == Storage::Body {
                // Its record waits in memory for its chunk map (`fill_chunk_maps`).
                pass.add_inode(&i, x, &mut found, dirty, cs);
                held += 256;
                continue;
            }
            let rec = rec_of(&i, x, pass.data_of(&i, &mut found, dirty, cs));
            held += rec_bytes(&rec);
            if held > keep && pass.spill.is_none() {
                pass.spill = Some(FullSpill::create(&self.store)?);
            }
            match &mut pass.spill {
                Some(sp) => {
                    sp.inodes.push(&rec)?;
                    pass.spilled.push(ino);
                }
                None => pass.body.inodes.push(rec),
            }
        }
        for (parent, name) in view.snapshot_dirents()? {
            held += 64 + name.len() as u64;
            if held > keep && pass.spill.is_none() {
                pass.spill = Some(FullSpill::create(&self.store)?);
            }
            let d = view.lookup(parent, &name)?;
            match (d, &mut pass.spill) {
                (Some(d), Some(sp)) => sp.dirents.push(&DirentRec {
                    parent: parent.0,
                    name,
                    ino: d.ino.0,
                    kind: d.kind.mode_bits(),
                })?,
                (Some(d), None) => pass.body.dirents.push(DirentRec {
                    parent: parent.0,
                    name,
                    ino: d.ino.0,
                    kind: d.kind.mode_bits(),
                }),
                (None, Some(sp)) => sp.unlinked.push(&(parent.0, name.as_slice()))?,
                (None, None) => pass.body.unlinked.push((parent.0, name)),
            }
        }
        (pass.inode_total, pass.file_bytes) = view.live_totals()?;
        Ok(())
    }

    /// Hashes the queued windows batch by batch and uploads the chunks the remote lacks,
    /// giving up (everything stays pending) once `deadline` passed.
    pub(super) fn hash_and_upload(
        &self,
        pass: &mut Pass,
        deadline: Option<Instant>,
    ) -> Result<(), CheckpointError> {
        pass.report.inodes = pass.inode_records();
        let mut seen: HashSet<ChunkId> = HashSet::new();
        let total = pass.jobs.len();
        let mut done = 0usize;
        crate::progress::stage("windows hashed", Some(total as u64));
        // Whether reused chunks need a fresh age (asked once, at the first upload).
        let mut shared: Option<bool> = None;
        let mut packer = Packer::new(self.params.pack_below, self.params.pack_size);
        // Bytes of windows hashed per batch, held until uploaded (with at most one pack
        // being filled): the budget's share, halved once when keel is near its budget (not
        // at every batch: a keel whose store alone sits near the budget, as at a million
        // files, would hash a window at a time and trim its heap each round).
        let mut batch = crate::budget::shares().hash_batch;
        let mut halved = false;
        while done < total {
            if !halved && crate::budget::pressure("checkpoint batches are halved until it is not") {
                crate::sys::mem::release_free_heap();
                batch = (batch / 2).max(self.params.chunk_size);
                halved = true;
            }
            if deadline.is_some_and(|d| Instant::now() > d) {
                return Err(CheckpointError::Deadline { done, total });
            }
            let mut end = done;
            let mut bytes = 0;
            while end < total && (bytes < batch || end == done) {
                bytes += pass.jobs[end].range.end - pass.jobs[end].range.start;
                end += 1;
            }
            pass.report.batches += 1;
            let results = self.hash_batch(&pass.jobs[done..end])?;
            let mut upload: Vec<(String, Bytes)> = Vec::new();
            for (job, (id, data)) in pass.jobs[done..end].iter().zip(results) {
                pass.report.windows_hashed += 1;
                pass.report.bytes_hashed += job.range.end - job.range.start;
                pass.hashed
                    .entry(job.ino)
                    .or_default()
                    .push((job.idx, id.map(|c| c.0)));
                // A chunk the local chunk maps name is in the last snapshot, which keeps it
                // on the remote. Any other may be there already but unreferenced (every
                // snapshot dropped it, on this workspace or on one sharing the store) and
                // old: on a shared store, the gc of another workspace may delete it before
                // the head names it again, so it is refreshed, not skipped. (This
                // workspace's own gc runs under its lease, never during a checkpoint.)
                if let (Some(id), Some(data)) = (id, data) {
                    if seen.insert(id)
                        && !(pass.prior.trusted && self.store.read().has_chunk(&id.0)?)
                    {
                        if packer.takes(data.len()) {
                            // Grouped by directory, then file and window.
                            let dir = pass.files.get(&job.ino).map_or(0, |f| f.inode.parent.0);
                            packer.add((dir, job.ino.0, job.idx), id, data);
                        } else {
                            upload.push((self.repo.chunk_key(&id), data));
                        }
                    }
                }
            }
            let last = end == total;
            let (packs, loose) = packer.cut(last);
            upload.extend(
                loose
                    .into_iter()
                    .map(|(id, d)| (self.repo.chunk_key(&id), d)),
            );
            if !upload.is_empty() {
                self.upload_chunks(upload, &mut shared, &mut pass.in_flight, &mut pass.report)?;
            }
            if !packs.is_empty() {
                self.upload_packs(packs, &mut shared, &mut pass.in_flight, &mut pass.report)?;
            }
            done = end;
            crate::progress::set(done as u64);
        }
        Ok(())
    }

    /// Uploads packs, then their indexes (a listed index always names a pack that was
    /// written), with the same freshness rules as single chunks (`upload_chunks`).
    fn upload_packs(
        &self,
        packs: Vec<Built>,
        shared: &mut Option<bool>,
        in_flight: &mut Option<crate::persist::marker::LiveMarker>,
        report: &mut CheckpointReport,
    ) -> Result<(), CheckpointError> {
        let mut data = Vec::with_capacity(packs.len());
        let mut index = Vec::with_capacity(packs.len());
        let mut counts = Vec::with_capacity(packs.len());
        for b in packs {
            counts.push((b.index.entries.len() as u64, b.data.len() as u64));
            data.push((self.repo.pack_key(&b.index.name), b.data));
            index.push((self.repo.pack_index_key(&b.index.name), b.index_bytes));
        }
        let written = self.put_objects(data, shared, in_flight)?;
        for (w, (chunks, bytes)) in written.iter().zip(counts) {
            if *w {
                report.packs_uploaded += 1;
                report.packed_chunks += chunks;
                report.chunks_uploaded += chunks;
                report.chunk_bytes_uploaded += bytes;
            }
        }
        self.put_objects(index, shared, in_flight)?;
        Ok(())
    }

    /// Uploads one batch of chunks: only the absent ones, or every one with a fresh age
    /// when the store is shared (`shared` is asked of the remote once, then remembered).
    /// Before the first upload to a shared store, the in-flight marker tells the gc of the
    /// workspaces sharing it that this checkpoint uploads from now on (`Repo::in_flight_key`;
    /// kept alive until the head names what it uploaded, see `marker`).
    fn upload_chunks(
        &self,
        upload: Vec<(String, Bytes)>,
        shared: &mut Option<bool>,
        in_flight: &mut Option<crate::persist::marker::LiveMarker>,
        report: &mut CheckpointReport,
    ) -> Result<(), CheckpointError> {
        let sizes: Vec<u64> = upload.iter().map(|(_, d)| d.len() as u64).collect();
        let fresh = shared.unwrap_or(false);
        let written = self.put_objects(upload, shared, in_flight)?;
        let fresh = fresh || shared.unwrap_or(false);
        for (w, n) in written.iter().zip(sizes) {
            if *w {
                report.chunks_uploaded += 1;
                report.chunk_bytes_uploaded += n;
            } else if fresh {
                report.chunks_refreshed += 1;
            }
        }
        Ok(())
    }

    /// Writes content-addressed objects: only the absent ones, or every one with a fresh
    /// age when the store is shared (see `upload_chunks`). Whether each was written.
    fn put_objects(
        &self,
        upload: Vec<(String, Bytes)>,
        shared: &mut Option<bool>,
        in_flight: &mut Option<crate::persist::marker::LiveMarker>,
    ) -> Result<Vec<bool>, CheckpointError> {
        let fresh = match *shared {
            Some(s) => s,
            None => {
                let s = crate::persist::fork::store_is_shared(&self.repo)
                    .map_err(CheckpointError::Manifest)?;
                if s {
                    *in_flight = Some(
                        crate::persist::marker::LiveMarker::start(
                            self.repo.remote.clone(),
                            &self.repo.in_flight_key(),
                            crate::persist::marker::MARKER_TTL,
                        )
                        .map_err(CheckpointError::UploadChunks)?,
                    );
                }
                *shared.insert(s)
            }
        };
        let remote = &self.repo.remote;
        if fresh {
            remote.put_many_fresh(upload)
        } else {
            remote.put_many_absent(upload)
        }
        .map_err(CheckpointError::UploadChunks)
    }

    /// Uploads the snapshot (full or delta) once the chunks it names are durable, under the
    /// first free sequence number, and makes it durable. Returns its sequence number.
    pub(super) fn upload_snapshot(
        &self,
        pass: &mut Pass,
        deadline: Option<Instant>,
    ) -> Result<u64, CheckpointError> {
        let cs = self.params.chunk_size;
        self.repo
            .remote
            .flush()
            .map_err(CheckpointError::FlushRemote)?;
        let mut seq = pass.next_seq();
        let mut obj = pass.encode(seq, cs)?;
        // A full snapshot's metadata image, built from the object's records, then named in
        // its header. Not under a deadline (the stop's last checkpoint): building it takes
        // seconds at 1M files.
        if pass.full && deadline.is_none() {
            // What collecting the tree freed, back to the kernel before the image build.
            crate::sys::mem::release_free_heap();
            pass.image = super::super::image::publish(&self.repo, &self.store, &obj, cs);
            pass.image_tried = true;
        }
        let data = loop {
            if deadline.is_some_and(|d| Instant::now() > d) {
                let total = pass.jobs.len();
                return Err(CheckpointError::Deadline { done: total, total });
            }
            format::replace_header(&mut obj, &pass.header(seq, cs))?;
            let len = obj.len();
            let bytes = Bytes::from(obj);
            let key = self.repo.snapshot_key(seq);
            match self.repo.remote.put(&key, bytes.clone(), PutMode::Create) {
                Ok(_) => break len,
                // Left behind by a checkpoint that died before recording it: skip the number.
                Err(RemoteError::AlreadyExists { .. }) => {
                    obj = Vec::from(bytes);
                    seq += 1;
                }
                Err(source) => return Err(CheckpointError::WriteSnapshot { seq, source }),
            }
        };
        pass.report.snapshot_bytes = data as u64;
        self.repo
            .remote
            .flush()
            .map_err(CheckpointError::FlushRemote)?;
        Ok(seq)
    }

    /// Points the remote head at snapshot `seq`, after the lease is confirmed still ours,
    /// and only if the head is still the one this checkpoint read.
    pub(super) fn advance_head(&self, pass: &Pass, seq: u64) -> Result<(), CheckpointError> {
        let epoch = match &self.lease {
            Some(l) => l.check_remote()?,
            None => 0,
        };
        let new_head = Head {
            seq,
            created_ns: now_ns(),
            writer: writer_name(),
            epoch,
        };
        let expected = pass.head.as_ref().and_then(|h| h.1.clone());
        self.mark_advancing(seq)?;
        self.repo
            .write_head(&new_head, expected)
            .map_err(|source| CheckpointError::AdvanceHead { seq, source })?;
        self.repo
            .remote
            .flush()
            .map_err(CheckpointError::FlushRemote)?;
        Ok(())
    }

    /// Commits the checkpoint locally: the new chunk maps, the pending set done, and the
    /// counters that decide the next checkpoint's kind.
    pub(super) fn record_locally(&self, pass: &Pass, seq: u64) -> Result<(), CheckpointError> {
        let cs = self.params.chunk_size;
        let size = pass.report.snapshot_bytes;
        let tx = self.store.write()?;
        for (ino, fw) in &pass.files {
            if let Some(rows) = pass.hashed.get(ino) {
                tx.set_file_chunks(*ino, rows)?;
            }
            tx.truncate_file_chunks(*ino, window_count(fw.inode.size, cs))?;
        }
        // A file this snapshot records without a body (it went inline, by a rollback or
        // back from a passthrough body) has no chunk map in it any more. Its old map would
        // let the next delta that gives it a body again patch only the windows that differ
        // from it, over a tree that holds no map: those left out would read as zeros.
        // (A file unlinked while open is in no snapshot but keeps its map, as a delta's
        // deleted inodes do: chunks only it names are refreshed when reused.)
        if pass.full {
            for ino in tx.inodes_with_chunks()? {
                if !pass.files.contains_key(&ino) && tx.get(ino)?.is_some_and(|i| i.nlink > 0) {
                    tx.truncate_file_chunks(ino, 0)?;
                }
            }
        } else {
            let kept = pass.body.inodes.iter().map(|r| InodeNo(r.ino));
            for ino in kept.chain(pass.spilled.iter().copied()) {
                if !pass.files.contains_key(&ino) {
                    tx.truncate_file_chunks(ino, 0)?;
                }
            }
        }
        tx.clear_pending()?;
        tx.persist_set("last_seq", &seq.to_string())?;
        tx.persist_set("chunk_size", &cs.to_string())?;
        tx.persist_set("remote_id", &pass.prior.remote_id)?;
        tx.persist_set("remote", &self.repo.describe())?;
        tx.persist_set("last_checkpoint_ns", &now_ns().to_string())?;
        if pass.full {
            let failures = match pass.image {
                Some(_) => 0,
                None if pass.image_tried => pass.prior.image_failures + 1,
                None => pass.prior.image_failures,
            };
            tx.persist_set(BASE_IMAGE, if pass.image.is_some() { "1" } else { "0" })?;
            tx.persist_set(IMAGE_FAILURES, &failures.to_string())?;
            tx.persist_set("base_seq", &seq.to_string())?;
            tx.persist_set("deltas_since_full", "0")?;
            tx.persist_set("delta_bytes_since_full", "0")?;
            tx.persist_set("full_bytes", &size.to_string())?;
        } else {
            tx.persist_set("deltas_since_full", &(pass.prior.deltas + 1).to_string())?;
            tx.persist_set(
                "delta_bytes_since_full",
                &(pass.prior.delta_bytes + size).to_string(),
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Reads and hashes windows on several threads: (id, bytes) per job; `None` id for an
    /// all-zero window (no bytes kept).
    fn hash_batch(&self, jobs: &[Job]) -> Result<Vec<Hashed>, CheckpointError> {
        let next = AtomicUsize::new(0);
        let out: Mutex<Vec<Option<Hashed>>> = Mutex::new(vec![None; jobs.len()]);
        let err: Mutex<Option<CheckpointError>> = Mutex::new(None);
        let files: Mutex<HashMap<InodeNo, Option<Arc<File>>>> = Mutex::new(HashMap::new());
        let threads = self.params.threads.clamp(1, 16).min(jobs.len().max(1));
        let bodies = &self.bodies;
        let opener = self.opener.as_ref();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= jobs.len() {
                        break;
                    }
                    let job = &jobs[k];
                    let f = {
                        let mut m = files.lock().unwrap();
                        match m.get(&job.ino) {
                            Some(f) => f.clone(),
                            None => {
                                let f = match opener {
                                    // Bytes that cannot be read fail the checkpoint.
                                    Some(open) => match open(job.ino.0) {
                                        Ok(f) => Some(Arc::new(f)),
                                        Err(source) => {
                                            *err.lock().unwrap() =
                                                Some(CheckpointError::ReadBody {
                                                    ino: job.ino.0,
                                                    source,
                                                });
                                            return;
                                        }
                                    },
                                    None => File::open(bodies.path(job.ino.0)).ok().map(Arc::new),
                                };
                                m.insert(job.ino, f.clone());
                                f
                            }
                        }
                    };
                    // A window that is one hole in the body (sparse file) is all zeros:
                    // no need to read or hash it.
                    if let Some(f) = &f {
                        let hole = match crate::sys::file::seek_data_hole(f, job.range.start, true)
                        {
                            Ok(data_at) => data_at >= job.range.end,
                            Err(e) => e.raw_os_error() == Some(libc::ENXIO),
                        };
                        if hole {
                            out.lock().unwrap()[k] = Some((None, None));
                            continue;
                        }
                    }
                    let mut buf = vec![0u8; (job.range.end - job.range.start) as usize];
                    if let Some(f) = f {
                        let mut n = 0;
                        while n < buf.len() {
                            match f.read_at(&mut buf[n..], job.range.start + n as u64) {
                                // Shorter body: the rest reads as zeros (sparse tail).
                                Ok(0) => break,
                                Ok(r) => n += r,
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                Err(source) => {
                                    *err.lock().unwrap() = Some(CheckpointError::ReadBody {
                                        ino: job.ino.0,
                                        source,
                                    });
                                    return;
                                }
                            }
                        }
                    }
                    let r = if is_zero(&buf) {
                        (None, None)
                    } else {
                        let id = ChunkId::of(&buf);
                        (Some(id), Some(Bytes::from(buf)))
                    };
                    out.lock().unwrap()[k] = Some(r);
                });
            }
        });
        if let Some(e) = err.into_inner().unwrap() {
            return Err(e);
        }
        Ok(out
            .into_inner()
            .unwrap()
            .into_iter()
            .map(|r| r.expect("every job ran"))
            .collect())
    }
}

fn rec_of(i: &Inode, xattrs: Vec<(Vec<u8>, Vec<u8>)>, data: DataRec) -> InodeRec {
    InodeRec {
        ino: i.ino.0,
        mode: i.kind.mode_bits() | i.perm,
        uid: i.uid,
        gid: i.gid,
        nlink: i.nlink,
        size: i.size,
        atime: i.atime.0,
        mtime: i.mtime.0,
        ctime: i.ctime.0,
        rdev: i.rdev,
        parent: i.parent.0,
        xattrs,
        data,
    }
}

fn writer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}:{}", host.trim(), std::process::id())
}

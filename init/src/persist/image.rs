//! Metadata images: with every full snapshot the checkpoint also uploads the database a
//! lazy restore of that snapshot writes (`images/<blake3>.db.zst` in the workspace: the
//! SQLite file `meta::create_bulk` builds from the snapshot's rows, zstd-compressed), and
//! records its hash and size in the snapshot's header. A fresh host then restores by
//! downloading one object, checking its hash and decompressing it, and replays only the
//! delta snapshots after it onto the database: no decode of the full snapshot, no row by
//! row insert of a million inodes.
//!
//! The image is an optimisation, never the only copy: a checkpoint that cannot build or
//! upload one writes its snapshot without it, and a restore that finds the image missing,
//! corrupt or unusable warns in one line and decodes the snapshot chain as before. Names
//! are content hashes, so a retried checkpoint that uploads the same image again is a
//! no-op. gc keeps an image while a kept snapshot names it; fsck checks that the images of
//! the checked chains are there (the full check also re-hashes them).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use super::format::{Body, DataRec, Header, ImageRef, InodeRec, TreeData, TreeInode};
use super::remote::{PutMode, RemoteError};
use super::repo::{Chain, Repo, RepoError};
use super::restore::{write_inode, RestoreError, RestoreMode, RestoreReport};
use crate::chunk::ChunkId;
use crate::meta::{amend_bulk, create_bulk, Amender, InodeNo, Kind, MetaError, Nanos, Store};

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("the state database has no file to build the image beside")]
    NoScratch,
    #[error("build the image database: {0}")]
    Build(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("read or compress {path}: {source}")]
    Compress {
        path: String,
        source: std::io::Error,
    },
    #[error("upload {key}: {source}")]
    Upload { key: String, source: RemoteError },
    #[error("fetch {key}: {source}")]
    Fetch { key: String, source: RemoteError },
    #[error("{key} is corrupt: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("decompress {key} into {path}: {source}")]
    Decompress {
        key: String,
        path: String,
        source: std::io::Error,
    },
    #[error("read delta snapshot {seq}: {source}")]
    ReadDelta { seq: u64, source: RepoError },
    #[error("apply delta snapshot {seq}: {source}")]
    ApplyDelta {
        seq: u64,
        #[source]
        source: DeltaError,
    },
    #[error("image database: {0}")]
    Db(#[from] MetaError),
    #[error("list images: {0}")]
    List(RemoteError),
    #[error("delete {key}: {source}")]
    Delete { key: String, source: RemoteError },
    #[error("start the thread that decodes the deltas: {0}")]
    Decoder(#[source] std::io::Error),
    #[error("the thread decoding the deltas ended before the last one")]
    DecoderGone,
}

/// Which step of replaying one delta snapshot onto the image database failed.
#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    #[error("{0}")]
    Db(#[source] MetaError),
    #[error("{0}")]
    WriteInode(#[source] Box<RestoreError>),
    #[error("entry {name:?} has a bad kind {kind:o}")]
    BadKind { name: String, kind: u32 },
}

/// Key of the image object with blake3 `hash`.
pub fn key(repo: &Repo, hash: &[u8; 32]) -> String {
    repo.key(&format!("images/{}.db.zst", ChunkId(*hash).to_hex()))
}

/// zstd level of an image: 3 compresses a metadata database about 4-5x at several hundred
/// MB/s; higher levels cost the checkpoint far more time than they save the restore.
const LEVEL: i32 = 3;

/// Builds the image of the full snapshot object `obj` (its body read one record at a
/// time) and uploads it; `None` (after a one-line error, counted in the metrics) when that
/// fails: the snapshot is then written without an image, and the checkpoint records so, so
/// that a later one retries (`checkpoint::steps::retries_image`).
pub fn publish(repo: &Repo, store: &Store, obj: &[u8], chunk_size: u64) -> Option<ImageRef> {
    let t0 = Instant::now();
    crate::logging::step("checkpoint", "image");
    match build_and_upload(repo, store, obj, chunk_size) {
        Ok((r, raw)) => {
            tracing::info!(
                "checkpoint: metadata image {} ({} bytes, {raw} uncompressed) in {:.2} s",
                ChunkId(r.hash),
                r.size,
                t0.elapsed().as_secs_f64()
            );
            Some(r)
        }
        Err(e) => {
            tracing::error!("checkpoint: no metadata image for this full snapshot (fresh restores decode it instead; the next checkpoint with changes writes a full snapshot again to retry): {e}");
            super::metrics::image_failed();
            None
        }
    }
}

fn build_and_upload(
    repo: &Repo,
    store: &Store,
    obj: &[u8],
    cs: u64,
) -> Result<(ImageRef, u64), ImageError> {
    let path = store
        .scratch_path(crate::state::SCRATCH_IMAGE)
        .ok_or(ImageError::NoScratch)?;
    let _ = std::fs::remove_file(&path);
    let built = build(&path, obj, cs);
    // The bulk connection's page cache is freed now; hand it back before the compressed
    // image (one large allocation, which glibc maps anew rather than reusing it) is made.
    crate::sys::mem::release_free_heap();
    let packed = built.and_then(|()| compress(&path));
    let _ = std::fs::remove_file(&path);
    let (data, raw) = packed?;
    let r = ImageRef {
        hash: ChunkId::of(&data).0,
        size: data.len() as u64,
    };
    let key = key(repo, &r.hash);
    match repo.remote.put(&key, Bytes::from(data), PutMode::Create) {
        // Same name, same bytes: a retry uploaded it already.
        Ok(_) | Err(RemoteError::AlreadyExists { .. }) => Ok((r, raw)),
        Err(source) => Err(ImageError::Upload { key, source }),
    }
}

/// `rec` as a tree holds it: the record without its data, and the data on top of `old`
/// (the inode's previous data, for a chunk-map patch).
fn tree_inode(rec: &InodeRec, old: Option<TreeData>, cs: u64) -> TreeInode {
    TreeInode {
        rec: InodeRec {
            xattrs: rec.xattrs.clone(),
            data: DataRec::None,
            ..*rec
        },
        data: TreeData::of(rec.data.clone(), old, rec.size, cs),
    }
}

/// Writes the rows a lazy restore of the full snapshot `body` writes into a new database.
fn build(path: &Path, obj: &[u8], cs: u64) -> Result<(), ImageError> {
    let mut scratch = RestoreReport::default();
    let (h, mut r) = super::format::reader("(snapshot being written)", obj)
        .map_err(|e| ImageError::Build(e.into()))?;
    create_bulk(path, Nanos(0), |w| -> Result<(), RestoreError> {
        let fmt = |e: super::format::FormatError| RestoreError::LoadSnapshot {
            seq: h.seq,
            source: e.into(),
        };
        while let Some(rec) = r.next_inode().map_err(fmt)? {
            write_inode(
                w,
                &tree_inode(&rec, None, cs),
                0,
                RestoreMode::Lazy,
                &mut scratch,
            )?;
        }
        while let Some(d) = r.next_dirent().map_err(fmt)? {
            let k = Kind::from_mode(d.kind).ok_or(RestoreError::BadMode {
                seq: 0,
                ino: d.ino,
                mode: d.kind,
            })?;
            w.dirent(InodeNo(d.parent), &d.name, InodeNo(d.ino), k)?;
        }
        Ok(())
    })
    .map_err(|e| ImageError::Build(e.into()))
}

/// The file at `path`, zstd-compressed, and its uncompressed size.
fn compress(path: &Path) -> Result<(Vec<u8>, u64), ImageError> {
    let io = |source| ImageError::Compress {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let raw = f.metadata().map_err(io)?.len();
    let mut enc =
        zstd::stream::Encoder::new(Vec::with_capacity(raw as usize / 4), LEVEL).map_err(io)?;
    std::io::copy(&mut f, &mut enc).map_err(io)?;
    Ok((enc.finish().map_err(io)?, raw))
}

/// Restores a chain (its full snapshot must name an image) lazily into `building`: the
/// image, then the deltas (as the chain fetched them). No body is created: a file with
/// windows to fetch gets its body at its first fetch, one that is all holes at its first
/// open. `state` holds the bookkeeping rows to set. Fills the counts of `report`. The deltas are decoded on a thread of their own from the start, while the
/// image is fetched and decompressed and while the earlier ones are applied (one decoded
/// delta waits beside the one being applied).
pub(super) fn restore(
    repo: &Repo,
    chain: &Chain,
    building: &Path,
    state: &[(&'static str, String)],
    report: &mut RestoreReport,
    laps: &mut dyn FnMut(&'static str),
) -> Result<(), ImageError> {
    std::thread::scope(|s| {
        // A rendezvous: one delta decoded ahead of the one being applied, no more.
        let (tx, rx) = std::sync::mpsc::sync_channel(0);
        let decoder = std::thread::Builder::new()
            .name("keel-delta-decode".into())
            .spawn_scoped(s, move || {
                let mut took = Duration::ZERO;
                for (key, h, obj) in &chain.deltas {
                    let t = Instant::now();
                    let r = super::format::decode(key, obj)
                        .map(|(_, b)| b)
                        .map_err(|source| ImageError::ReadDelta {
                            seq: h.seq,
                            source: source.into(),
                        });
                    took += t.elapsed();
                    let failed = r.is_err();
                    // The receiver gone: the restore failed before it took every delta.
                    if tx.send((h.seq, h.chunk_size, r)).is_err() || failed {
                        break;
                    }
                }
                took
            });
        let decoder = match decoder {
            Ok(d) => d,
            Err(e) => return Err(ImageError::Decoder(e)),
        };
        let r = restore_decoded(repo, chain, building, state, report, laps, rx);
        let decoding = decoder.join().unwrap_or_default();
        if r.is_ok() {
            tracing::info!(
                "restore: {} deltas decoded in {:.2} s of their own thread",
                chain.deltas.len(),
                decoding.as_secs_f64()
            );
        }
        r
    })
}

/// A delta decoded: (seq, its chunk size, its body).
type Decoded = (u64, u64, Result<Body, ImageError>);

/// `restore`, the deltas taken from `decoded` in chain order.
#[allow(clippy::too_many_arguments)]
fn restore_decoded(
    repo: &Repo,
    chain: &Chain,
    building: &Path,
    state: &[(&'static str, String)],
    report: &mut RestoreReport,
    laps: &mut dyn FnMut(&'static str),
    decoded: std::sync::mpsc::Receiver<Decoded>,
) -> Result<(), ImageError> {
    let full = &chain.full;
    let r = full.image.expect("the caller checked");
    let key = key(repo, &r.hash);
    let data = repo.remote.get(&key).map_err(|source| ImageError::Fetch {
        key: key.clone(),
        source,
    })?;
    let corrupt = |reason: String| ImageError::Corrupt {
        key: key.clone(),
        reason,
    };
    if data.len() as u64 != r.size {
        return Err(corrupt(format!(
            "{} bytes, the header of snapshot {} says {}",
            data.len(),
            full.seq,
            r.size
        )));
    }
    let actual = ChunkId::of(&data);
    if actual.0 != r.hash {
        return Err(corrupt(format!("its bytes hash to {actual}")));
    }
    let dec = |source| ImageError::Decompress {
        key: key.clone(),
        path: building.display().to_string(),
        source,
    };
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(building)
        .map_err(dec)?;
    zstd::stream::copy_decode(&data[..], &mut out).map_err(dec)?;
    out.flush().map_err(dec)?;
    drop(out);
    drop(data);
    laps("image");

    let mut counts = [0; 3];
    let (mut records, mut waited) = (0, Duration::ZERO);
    amend_bulk(building, |a| -> Result<(), ImageError> {
        for (_, h, _) in &chain.deltas {
            let t = Instant::now();
            let (seq, cs, b) = decoded.recv().map_err(|_| ImageError::DecoderGone)?;
            waited += t.elapsed();
            debug_assert_eq!(seq, h.seq);
            let b = b?;
            records += b.inodes.len() + b.deleted.len() + b.dirents.len() + b.unlinked.len();
            apply_delta(a, &b, cs).map_err(|source| ImageError::ApplyDelta { seq, source })?;
        }
        for (k, v) in state {
            a.persist_set(k, v)?;
        }
        laps("deltas");
        counts = a.missing_counts()?;
        Ok(())
    })?;
    laps("counts");
    tracing::info!(
        "restore: {} deltas, {records} records applied in bulk ({:.2} s of it waiting for their decoding)",
        chain.deltas.len(),
        waited.as_secs_f64()
    );
    [report.files, report.file_bytes, report.windows_missing] = counts;
    report.inodes = chain.last().inodes;
    Ok(())
}

/// Replays one delta snapshot onto the database, as `Tree::apply` replays it onto a tree,
/// in bulk: the deleted inodes removed with one statement a table, then each run of records
/// with distinct numbers (a delta names an inode once, so one run) as one removal of the
/// inodes it re-states and batched inserts of what they become, then the unlinked entries
/// removed and the entries written the same way. A record that patches a chunk map reads
/// the map it patches first; an inode numbered above every inode already in the database
/// is new, so nothing is read or removed for it (after a session that created many files,
/// most records of its deltas).
fn apply_delta(a: &mut Amender<'_>, b: &Body, cs: u64) -> Result<(), DeltaError> {
    let e = DeltaError::Db;
    let deleted: Vec<InodeNo> = b.deleted.iter().map(|i| InodeNo(*i)).collect();
    a.delete_inodes(&deleted).map_err(e)?;
    let mut rest = &b.inodes[..];
    while !rest.is_empty() {
        let mut seen = HashSet::new();
        let n = rest
            .iter()
            .position(|r| !seen.insert(r.ino))
            .unwrap_or(rest.len());
        apply_records(a, &rest[..n], cs)?;
        rest = &rest[n..];
    }
    a.remove_dirents(b.unlinked.iter().map(|(p, n)| (InodeNo(*p), &n[..])))
        .map_err(e)?;
    for d in &b.dirents {
        let k = Kind::from_mode(d.kind).ok_or_else(|| DeltaError::BadKind {
            name: String::from_utf8_lossy(&d.name).into_owned(),
            kind: d.kind,
        })?;
        a.put_dirent(InodeNo(d.parent), &d.name, InodeNo(d.ino), k)
            .map_err(e)?;
    }
    Ok(())
}

/// Records of distinct inodes: each replaces its inode (a chunk-map patch laid over the map
/// the database holds).
fn apply_records(a: &mut Amender<'_>, recs: &[InodeRec], cs: u64) -> Result<(), DeltaError> {
    let e = DeltaError::Db;
    let known = a.max_ino().map_err(e)?;
    let mut old = HashMap::new();
    for rec in recs.iter().filter(|r| r.ino <= known.0) {
        if let DataRec::Chunks {
            complete: false, ..
        } = rec.data
        {
            let map = a.chunk_map(InodeNo(rec.ino)).map_err(e)?;
            old.insert(
                rec.ino,
                TreeData::Chunks(map.into_iter().map(|c| c.map(ChunkId)).collect()),
            );
        }
    }
    let restated: Vec<InodeNo> = recs
        .iter()
        .filter(|r| r.ino <= known.0)
        .map(|r| InodeNo(r.ino))
        .collect();
    a.delete_inodes(&restated).map_err(e)?;
    let mut scratch = RestoreReport::default();
    for rec in recs {
        let t = tree_inode(rec, old.remove(&rec.ino), cs);
        write_inode(a.writer(), &t, 0, RestoreMode::Lazy, &mut scratch)
            .map_err(|x| DeltaError::WriteInode(Box::new(x)))?;
    }
    Ok(())
}

/// gc: deletes every image object that no kept snapshot (`kept`) names and that is older
/// than `grace` (younger ones may belong to a checkpoint in progress). Returns (deleted,
/// bytes deleted).
pub fn sweep(repo: &Repo, kept: &BTreeSet<u64>, grace: Duration) -> Result<(u64, u64), ImageError> {
    let mut named = BTreeSet::new();
    for s in kept {
        // A kept snapshot whose header cannot be read protects nothing here: its own
        // problem is gc's and fsck's to report.
        if let Ok(Some(r)) = repo.read_header(*s).map(|h| h.image) {
            named.insert(key(repo, &r.hash));
        }
    }
    let now = SystemTime::now();
    let old = |t: SystemTime| now.duration_since(t).map(|d| d >= grace).unwrap_or(false);
    let (mut n, mut bytes) = (0, 0);
    for info in repo
        .remote
        .list(&repo.key("images/"))
        .map_err(ImageError::List)?
    {
        if named.contains(&info.key) || !old(info.modified) {
            continue;
        }
        match repo.remote.head(&info.key) {
            Ok(Some(again)) if old(again.modified) => {}
            _ => continue,
        }
        repo.remote
            .delete(&info.key)
            .map_err(|source| ImageError::Delete {
                key: info.key.clone(),
                source,
            })?;
        n += 1;
        bytes += info.size;
    }
    Ok((n, bytes))
}

/// fsck: problems with the images the headers of full snapshots (`fulls`) name: missing,
/// or (with `rehash`, which downloads them) not the size or hash the header records.
pub fn check(repo: &Repo, fulls: &[Header], rehash: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for h in fulls {
        let Some(r) = h.image else { continue };
        if !seen.insert(r.hash) {
            continue;
        }
        let key = key(repo, &r.hash);
        let what = format!("metadata image {key} of snapshot {}", h.seq);
        if rehash {
            match repo.remote.get(&key) {
                Ok(b) if b.len() as u64 != r.size => out.push(format!(
                    "{what} holds {} bytes, its header says {} (restores decode the snapshot instead)",
                    b.len(),
                    r.size
                )),
                Ok(b) if ChunkId::of(&b).0 != r.hash => out.push(format!(
                    "{what} is corrupt: its bytes hash to {} (restores decode the snapshot instead)",
                    ChunkId::of(&b)
                )),
                Ok(_) => {}
                Err(e) if e.is_not_found() => out.push(format!(
                    "{what} is missing on the remote (restores decode the snapshot instead)"
                )),
                Err(e) => out.push(format!("{what}: {e}")),
            }
        } else {
            match repo.remote.head(&key) {
                Ok(Some(i)) if i.size != r.size => out.push(format!(
                    "{what} holds {} bytes, its header says {} (restores decode the snapshot instead)",
                    i.size, r.size
                )),
                Ok(Some(_)) => {}
                Ok(None) => out.push(format!(
                    "{what} is missing on the remote (restores decode the snapshot instead)"
                )),
                Err(e) => out.push(format!("{what}: {e}")),
            }
        }
    }
    out
}

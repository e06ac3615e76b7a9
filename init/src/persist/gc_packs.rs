//! gc of packs (see `pack`): after the live chunk set is known (`gc::gc_with`), each pack
//! on the chunk store is kept while any live chunk is in it; deleted, index first, once none
//! is and both objects are older than the grace window (looked at again before each
//! delete, as single chunks are); rewritten as a new pack of its live chunks (each
//! verified first; a pack with a damaged live chunk is left whole for fsck to report) once
//! more than half of its bytes are dead, the old one going the same way as a dead one. A
//! pack whose index was never written (a checkpoint killed between the two) and an index
//! whose pack is gone are deleted once old enough. A new pack is written before the old
//! one goes, so a reader that still holds the old index misses, reads the indexes again
//! and finds the chunk in the new one.

use std::collections::{HashMap, HashSet};
use std::time::SystemTime;

use super::gc::{sweep, Fate, GcError, GcReport};
use super::marker::LiveMarker;
use super::pack::{self, Entry, PackInfo, PackMap};
use super::remote::ObjectInfo;
use super::repo::{PackObjects, Repo};
use crate::chunk::ChunkId;

/// Sweeps every listed pack against the `live` chunks (see the module doc).
pub(super) fn sweep_packs(
    repo: &Repo,
    running: &LiveMarker,
    listed: &[PackObjects],
    map: &PackMap,
    live: &HashSet<ChunkId>,
    old: &impl Fn(SystemTime) -> bool,
    report: &mut GcReport,
) -> Result<(), GcError> {
    let by_name: HashMap<ChunkId, usize> = map
        .packs
        .iter()
        .enumerate()
        .map(|(k, p)| (p.name, k))
        .collect();
    for po in listed {
        match (&po.pack, &po.index, by_name.get(&po.name)) {
            (Some(pack), Some(idx), Some(k)) => {
                let pi = &map.packs[*k];
                let alive: Vec<Entry> = map.entries(*k).filter(|e| live.contains(&e.id)).collect();
                let live_bytes: u64 = alive.iter().map(|e| u64::from(e.len)).sum();
                if alive.is_empty() {
                    if delete_pair(repo, running, pack, idx, old, report)? {
                        report.packs_deleted += 1;
                    }
                } else if live_bytes * 2 < pi.len && old(pack.modified) {
                    match repack(repo, running, pi, &alive)? {
                        Ok(()) => {
                            report.chunks_kept += alive.len() as u64;
                            if delete_pair(repo, running, pack, idx, old, report)? {
                                report.packs_repacked += 1;
                            } else {
                                report.packs_kept += 1;
                            }
                        }
                        Err(why) => {
                            report.warnings.push(why);
                            report.packs_kept += 1;
                            report.chunks_kept += alive.len() as u64;
                        }
                    }
                } else {
                    report.packs_kept += 1;
                    report.chunks_kept += alive.len() as u64;
                }
            }
            // An index that cannot be read: nobody knows what is in the pack, so both stay
            // (`keel fsck` reports it).
            (Some(_), Some(idx), None) => {
                report.packs_kept += 1;
                report.warnings.push(format!(
                    "pack index {} cannot be read; the pack is kept",
                    idx.key
                ));
            }
            // Half a pack: useless alone.
            (Some(one), None, _) | (None, Some(one), _) => {
                if sweep(repo, running, one, false, old, report)? == Fate::Deleted {
                    report.bytes_deleted += one.size;
                    report.packs_deleted += 1;
                }
            }
            (None, None, _) => {}
        }
    }
    Ok(())
}

/// Deletes a pack's index, then the pack, each once old enough; whether both went.
fn delete_pair(
    repo: &Repo,
    running: &LiveMarker,
    pack: &ObjectInfo,
    idx: &ObjectInfo,
    old: &impl Fn(SystemTime) -> bool,
    report: &mut GcReport,
) -> Result<bool, GcError> {
    if !old(pack.modified) {
        report.young_skipped += 1;
        return Ok(false);
    }
    match sweep(repo, running, idx, false, old, report)? {
        Fate::Deleted => report.bytes_deleted += idx.size,
        Fate::Gone => {}
        Fate::Young | Fate::Referenced => return Ok(false),
    }
    match sweep(repo, running, pack, false, old, report)? {
        Fate::Deleted => {
            report.bytes_deleted += pack.size;
            Ok(true)
        }
        Fate::Gone => Ok(true),
        Fate::Young | Fate::Referenced => Ok(false),
    }
}

/// Writes a new pack of the `alive` chunks of `pi` (and its index), each verified first.
/// `Ok(Err(why))`: left as it is (a live chunk does not match its id, or the pack is
/// gone).
fn repack(
    repo: &Repo,
    running: &LiveMarker,
    pi: &PackInfo,
    alive: &[Entry],
) -> Result<Result<(), String>, GcError> {
    running.check()?;
    let key = repo.pack_key(&pi.name);
    let data = match repo.remote.get(&key) {
        Ok(d) => d,
        Err(e) if e.is_not_found() => return Ok(Err(format!("pack {key} vanished"))),
        Err(source) => return Err(GcError::Repack { key, source }),
    };
    let mut parts = Vec::with_capacity(alive.len());
    for e in alive {
        let r = e.range();
        let piece = match data.get(r.start as usize..r.end as usize) {
            Some(_) => data.slice(r.start as usize..r.end as usize),
            None => return Ok(Err(format!("pack {key} is shorter than its index"))),
        };
        if !e.id.verify(&piece) {
            return Ok(Err(format!(
                "pack {key}: live chunk {} is damaged; the pack is kept (keel fsck)",
                e.id
            )));
        }
        parts.push((e.id, piece));
    }
    let b = pack::build(&parts);
    let put = |k: String, d| {
        repo.remote
            .put_many_fresh(vec![(k.clone(), d)])
            .map_err(|source| GcError::Repack { key: k, source })
    };
    put(repo.pack_key(&b.index.name), b.data)?;
    put(repo.pack_index_key(&b.index.name), b.index_bytes)?;
    repo.remote.flush().map_err(|source| GcError::Repack {
        key: key.clone(),
        source,
    })?;
    Ok(Ok(()))
}

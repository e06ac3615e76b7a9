//! The body check of `keel fsck`: every body file belongs to a file (`repair` removes the
//! others); every file's body exists, no longer or shorter than its size; its chunk map fits
//! it; and every window not changed since the last checkpoint (nor waiting for a lazy
//! fetch) still hashes to its recorded chunk. After keel was killed, a window that does not
//! is an unrecorded write (`repair` marks the file for re-hashing), not damage.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::{FsckError, FsckOptions, FsckReport, Level};
use crate::chunk::chunker::{is_zero, window_count, window_range};
use crate::chunk::{BodyStore, ChunkId};
use crate::meta::{ChunkRow, Inode, InodeNo, Kind, Storage, Store, Tx};

/// What the body check reads once from the state database: 8 bytes per file with a body
/// (each file's inode and chunk map are looked up when it is checked, never all at once).
struct BodyScan {
    /// The files with a body, in inode order.
    files: Vec<InodeNo>,
    /// Windows changed since the last checkpoint: their chunk is not recorded yet.
    dirty: HashSet<(InodeNo, u64)>,
    /// Windows of a lazy restore not fetched yet: holes by design, not damage.
    missing: HashSet<(InodeNo, u64)>,
    /// keel was killed while mounted.
    unclean: bool,
    /// The chunk size the chunk maps were made with.
    map_cs: Option<u64>,
}

pub(super) fn check_bodies(
    store: &Store,
    bodies: &BodyStore,
    pending: std::collections::HashMap<u64, PathBuf>,
    rep: &mut FsckReport,
    opts: &FsckOptions,
) -> Result<(), FsckError> {
    let scan = BodyScan::read(&store.read())?;
    let mut ids = bodies.ids().map_err(|e| FsckError::OpenState {
        path: PathBuf::from(crate::state::BODIES),
        reason: e.to_string(),
    })?;
    ids.sort_unstable();
    let tx = if opts.repair {
        Some(store.write()?)
    } else {
        None
    };
    scan.check_orphans(bodies, &ids, rep, opts.repair);
    scan.check_files(&store.read(), bodies, &ids, pending, rep, opts, tx.as_ref())?;
    if let Some(tx) = tx {
        tx.commit()?;
    }
    Ok(())
}

fn is_body(i: &Inode) -> bool {
    i.kind == Kind::File && i.storage == Storage::Body
}

impl BodyScan {
    fn read(r: &Tx) -> Result<BodyScan, FsckError> {
        let mut files = Vec::new();
        r.for_each_inode(|i| {
            if is_body(&i) {
                files.push(i.ino);
            }
            Ok(())
        })?;
        files.sort_unstable();
        Ok(BodyScan {
            files,
            dirty: r.backlog_windows()?.into_iter().collect(),
            missing: r
                .all_missing_windows()?
                .into_iter()
                .flat_map(|(ino, rows)| rows.into_iter().map(move |(idx, _)| (ino, idx)))
                .collect(),
            unclean: r.persist_get("running")?.as_deref() == Some("1"),
            map_cs: r.persist_get("chunk_size")?.and_then(|v| v.parse().ok()),
        })
    }

    /// Body files (`ids`) no file owns: a note each (with `repair`: removed).
    fn check_orphans(&self, bodies: &BodyStore, ids: &[u64], rep: &mut FsckReport, repair: bool) {
        for id in ids {
            if self.files.binary_search(&InodeNo(*id)).is_err() {
                let removed = repair && bodies.remove(*id).is_ok();
                rep.add(
                    Level::Note,
                    format!("body file {id:x} belongs to no file"),
                    removed,
                );
            }
        }
    }

    /// `check_body` for every file with a body, except lazily restored ones whose body
    /// comes at first use (`present`: the body files there are, sorted). Each file's inode
    /// and chunk map are read from `r` when it is checked.
    #[allow(clippy::too_many_arguments)]
    fn check_files(
        &self,
        r: &Tx,
        bodies: &BodyStore,
        present: &[u64],
        pending: std::collections::HashMap<u64, PathBuf>,
        rep: &mut FsckReport,
        opts: &FsckOptions,
        tx: Option<&Tx>,
    ) -> Result<(), FsckError> {
        let lazy_files: HashSet<InodeNo> = self.missing.iter().map(|(ino, _)| *ino).collect();
        crate::progress::stage("local file bodies checked", Some(self.files.len() as u64));
        let ctx = BodyCtx {
            pending,
            cs: opts.chunk_size,
            maps_fit: self.map_cs == Some(opts.chunk_size),
            unclean: self.unclean,
            repair: opts.repair,
        };
        let mut budget = if opts.quick { 0 } else { u64::MAX };
        for &ino in &self.files {
            rep.bodies += 1;
            crate::progress::set(rep.bodies);
            if present.binary_search(&ino.0).is_err() && lazy_files.contains(&ino) {
                continue;
            }
            // Read before any repair of this file: still a file with a body.
            let Some(i) = r.get(ino)?.filter(is_body) else {
                continue;
            };
            let skip =
                |idx: u64| self.dirty.contains(&(ino, idx)) || self.missing.contains(&(ino, idx));
            let map = r.file_chunks(ino)?;
            let map = (!map.is_empty()).then_some(map.as_slice());
            check_body(bodies, &i, map, &skip, &ctx, &mut budget, rep, tx)?;
        }
        Ok(())
    }
}

/// What checking one file's body needs besides the file.
pub(super) struct BodyCtx {
    /// Bodies a rollback built and had not renamed into place when it was stopped (inode ->
    /// the built file): the next start renames them, so they are what is checked.
    pub pending: std::collections::HashMap<u64, PathBuf>,
    pub cs: u64,
    /// The chunk maps were made with `cs` (else their window numbers mean other ranges).
    pub maps_fit: bool,
    /// keel was killed while mounted: a window that no longer hashes to its chunk was
    /// written without a record, not damaged.
    pub unclean: bool,
    pub repair: bool,
}

impl BodyCtx {
    /// The file that is `ino`'s body: a rollback's built body still waiting to be renamed
    /// into place, else the body store's.
    fn body_path(&self, bodies: &BodyStore, ino: u64) -> PathBuf {
        match self.pending.get(&ino) {
            Some(p) if p.exists() => p.clone(),
            _ => bodies.path(ino),
        }
    }
}

/// The bodies a stopped rollback has still to rename into place (`Tx::rollback_renames`),
/// and a note saying so; an unreadable record is an error.
pub(super) fn pending_renames(
    r: &Tx,
    state_dir: &std::path::Path,
    rep: &mut FsckReport,
) -> Result<std::collections::HashMap<u64, PathBuf>, FsckError> {
    let renames = match r.rollback_renames()? {
        Ok(v) => v,
        Err(e) => {
            rep.add(Level::Error, e, false);
            return Ok(Default::default());
        }
    };
    if !renames.is_empty() {
        rep.add(
            Level::Note,
            format!(
                "a rollback was stopped while renaming its {} built bodies into place: the next start finishes it (checked as they will be)",
                renames.len()
            ),
            false,
        );
    }
    let tmp = state_dir.join(crate::meta::ROLLBACK_TMP);
    Ok(renames
        .into_iter()
        .map(|(at, name)| (at, tmp.join(name.to_string())))
        .collect())
}

/// One file's body (`i` has `Storage::Body`): present unless `i` is empty, no longer or
/// shorter than `i.size`, a chunk map that fits, and up to `budget` windows not `skip`ped
/// (dirty or not fetched yet) re-hashed against their recorded chunk.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_body(
    bodies: &BodyStore,
    i: &Inode,
    map: Option<&[ChunkRow]>,
    skip: &dyn Fn(u64) -> bool,
    ctx: &BodyCtx,
    budget: &mut u64,
    rep: &mut FsckReport,
    tx: Option<&Tx>,
) -> Result<(), FsckError> {
    let path = ctx.body_path(bodies, i.ino.0);
    // Every window recorded, each a hole, none written since: an absent body loses nothing
    // (a lazy restore from a metadata image leaves it out; reads see zeros, and the first
    // write, truncate or writable passthrough open creates it sparse at the file's size). A map that is empty, short or of another chunk size, or a dirty
    // window, is not that: the body is missing.
    let nwin = window_count(i.size, ctx.cs);
    let all_holes = map.is_some_and(|m| {
        ctx.maps_fit
            && !m.is_empty()
            && m.len() as u64 == nwin
            && m.iter()
                .enumerate()
                .all(|(k, (idx, id))| *idx == k as u64 && id.is_none())
            && !(0..nwin).any(skip)
    });
    if all_holes && !path.exists() {
        return Ok(());
    }
    if !check_body_length(&path, i, rep) {
        return Ok(());
    }
    let Some(map) = map else { return Ok(()) };
    if !ctx.maps_fit {
        return Ok(());
    }
    check_map_length(i, map, ctx, rep, tx)?;
    if *budget == 0 {
        return Ok(());
    }
    let f = match File::open(&path) {
        Ok(f) => f,
        Err(e) => {
            rep.add(
                Level::Error,
                format!("file {}: cannot read body: {e}", i.ino.0),
                false,
            );
            return Ok(());
        }
    };
    if rehash_windows(&f, i, map, skip, ctx, budget, rep) {
        if let Some(tx) = tx {
            tx.mark_whole_file_dirty(i.ino, window_count(i.size, ctx.cs))?;
        }
        rep.add(
            Level::Warning,
            format!("file {}: written after the last checkpoint without a record (keel was killed); re-hashed at the next checkpoint", i.ino.0),
            ctx.repair,
        );
    }
    Ok(())
}

/// The body's length against the file's size. False when there is no body file (an error
/// unless the file is empty): nothing more to check.
fn check_body_length(path: &std::path::Path, i: &Inode, rep: &mut FsckReport) -> bool {
    let ino = i.ino;
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if i.size > 0 {
                rep.add(
                    Level::Error,
                    format!(
                        "file {}: body file is missing ({} bytes lost)",
                        ino.0, i.size
                    ),
                    false,
                );
            }
            return false;
        }
        Err(_) => 0,
    };
    if len > i.size {
        rep.add(
            Level::Warning,
            format!("file {}: body holds {} bytes past its size {} (writes never acknowledged; trimmed at next open)", ino.0, len - i.size, i.size),
            false,
        );
    } else if len < i.size {
        rep.add(
            Level::Warning,
            format!(
                "file {}: body is {} bytes shorter than its size {} (reads as zeros)",
                ino.0,
                i.size - len,
                i.size
            ),
            false,
        );
    }
    true
}

/// A chunk map naming windows past the file's end (with `tx`: trimmed).
fn check_map_length(
    i: &Inode,
    map: &[ChunkRow],
    ctx: &BodyCtx,
    rep: &mut FsckReport,
    tx: Option<&Tx>,
) -> Result<(), FsckError> {
    let nwin = window_count(i.size, ctx.cs);
    if map.iter().any(|(x, _)| *x >= nwin) {
        if let Some(tx) = tx {
            tx.truncate_file_chunks(i.ino, nwin)?;
        }
        rep.add(
            Level::Note,
            format!("file {}: chunk map longer than the file", i.ino.0),
            ctx.repair,
        );
    }
    Ok(())
}

/// Re-hashes up to `budget` windows of `map` not `skip`ped and compares each with its
/// recorded chunk: a mismatch is an error, or (after an unclean stop) an unrecorded write,
/// for which it returns true.
fn rehash_windows(
    f: &File,
    i: &Inode,
    map: &[ChunkRow],
    skip: &dyn Fn(u64) -> bool,
    ctx: &BodyCtx,
    budget: &mut u64,
    rep: &mut FsckReport,
) -> bool {
    let nwin = window_count(i.size, ctx.cs);
    let mut unrecorded = false;
    for (idx, id) in map.iter().filter(|(x, _)| *x < nwin) {
        if skip(*idx) {
            continue;
        }
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        let range = window_range(*idx, i.size, ctx.cs);
        let mut buf = vec![0u8; (range.end - range.start) as usize];
        let mut n = 0;
        while n < buf.len() {
            match f.read_at(&mut buf[n..], range.start + n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(_) => break,
            }
        }
        rep.windows_hashed += 1;
        let actual = if is_zero(&buf) {
            None
        } else {
            Some(ChunkId::of(&buf).0)
        };
        if actual != *id {
            if ctx.unclean {
                unrecorded = true;
            } else {
                rep.add(
                    Level::Error,
                    format!("file {}: window {idx} no longer matches its checkpointed chunk (local body damaged or written behind keel's back)", i.ino.0),
                    false,
                );
            }
        }
    }
    unrecorded
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::Nanos;

    const CS: u64 = 4096;

    struct Dir {
        _dir: tempfile::TempDir,
        store: Store,
        bodies: BodyStore,
    }

    fn dir() -> Dir {
        let d = tempfile::tempdir().unwrap();
        Dir {
            store: crate::state::open_store(d.path(), Nanos(1)).unwrap(),
            bodies: crate::state::open_bodies(d.path()).unwrap(),
            _dir: d,
        }
    }

    fn ctx(unclean: bool) -> BodyCtx {
        BodyCtx {
            pending: Default::default(),
            cs: CS,
            maps_fit: true,
            unclean,
            repair: false,
        }
    }

    /// A linked file of `size` bytes with a body holding `data`, and the chunk map of
    /// `data`'s windows.
    fn file(d: &Dir, size: u64, data: Option<&[u8]>) -> (Inode, Vec<ChunkRow>) {
        let tx = d.store.write().unwrap();
        let mut i = Inode::test_file(size, Storage::Body);
        i.ino = tx.insert(&i).unwrap();
        tx.link(
            InodeNo::ROOT,
            format!("f{}", i.ino.0).as_bytes(),
            i.ino,
            Kind::File,
        )
        .unwrap();
        tx.commit().unwrap();
        let mut map = Vec::new();
        if let Some(data) = data {
            std::fs::write(d.bodies.path(i.ino.0), data).unwrap();
            for (k, w) in data.chunks(CS as usize).enumerate() {
                let id = (!is_zero(w)).then(|| ChunkId::of(w).0);
                map.push((k as u64, id));
            }
        }
        (i, map)
    }

    #[test]
    fn body_scan_reads_dirty_windows_and_an_unclean_stop() {
        let d = dir();
        let (i, _) = file(&d, 10, Some(b"0123456789"));
        let tx = d.store.write().unwrap();
        tx.mark_dirty_windows(i.ino, [0]).unwrap();
        tx.persist_set("running", "1").unwrap();
        tx.persist_set("chunk_size", "4096").unwrap();
        tx.commit().unwrap();
        let scan = BodyScan::read(&d.store.read()).unwrap();
        assert!(scan.dirty.contains(&(i.ino, 0)));
        assert!(scan.unclean);
        assert_eq!(scan.map_cs, Some(CS));
        assert_eq!(scan.files, [i.ino]);
    }

    #[test]
    fn check_orphans_notes_and_removes_bodies_of_no_file() {
        let d = dir();
        let (i, _) = file(&d, 1, Some(b"x"));
        std::fs::write(d.bodies.path(999), b"stray").unwrap();
        let scan = BodyScan::read(&d.store.read()).unwrap();
        let mut rep = FsckReport::default();
        scan.check_orphans(&d.bodies, &[i.ino.0, 999], &mut rep, false);
        assert_eq!(rep.findings.len(), 1);
        assert!(rep.findings[0].what.contains("3e7"), "{:?}", rep.findings);
        assert!(d.bodies.path(999).exists());
        let mut rep = FsckReport::default();
        scan.check_orphans(&d.bodies, &[999], &mut rep, true);
        assert!(rep.findings[0].repaired);
        assert!(!d.bodies.path(999).exists());
    }

    #[test]
    fn check_body_length_reports_missing_long_and_short_bodies() {
        let d = dir();
        // (size, body, more to check, finding's level, what it says)
        type Case<'a> = (u64, Option<&'a [u8]>, bool, Level, &'a str);
        let cases: [Case; 3] = [
            (5, None, false, Level::Error, "missing (5 bytes lost)"),
            (
                2,
                Some(b"abcd"),
                true,
                Level::Warning,
                "2 bytes past its size",
            ),
            (9, Some(b"abcd"), true, Level::Warning, "5 bytes shorter"),
        ];
        for (size, data, more, level, what) in cases {
            let (i, _) = file(&d, size, data);
            let mut rep = FsckReport::default();
            assert_eq!(
                check_body_length(&d.bodies.path(i.ino.0), &i, &mut rep),
                more
            );
            assert_eq!(rep.findings.len(), 1);
            assert_eq!(rep.findings[0].level, level);
            assert!(rep.findings[0].what.contains(what), "{:?}", rep.findings);
        }
        let (empty, _) = file(&d, 0, None);
        let mut rep = FsckReport::default();
        assert!(!check_body_length(
            &d.bodies.path(empty.ino.0),
            &empty,
            &mut rep
        ));
        assert!(rep.findings.is_empty(), "an empty file needs no body");
    }

    #[test]
    fn check_map_length_trims_maps_past_the_end() {
        let d = dir();
        let (i, mut map) = file(&d, 3, Some(b"abc"));
        map.push((4, Some([1; 32])));
        let tx = d.store.write().unwrap();
        tx.set_file_chunks(i.ino, &map).unwrap();
        let mut rep = FsckReport::default();
        check_map_length(&i, &map, &ctx(false), &mut rep, Some(&tx)).unwrap();
        tx.commit().unwrap();
        assert_eq!(rep.findings.len(), 1);
        assert_eq!(d.store.read().file_chunks(i.ino).unwrap().len(), 1);
        let mut rep = FsckReport::default();
        check_map_length(&i, &map[..1], &ctx(false), &mut rep, None).unwrap();
        assert!(rep.findings.is_empty());
    }

    #[test]
    fn rehash_windows_finds_changed_windows_within_budget() {
        let d = dir();
        let mut data = vec![7u8; 2 * CS as usize];
        data.extend(vec![0u8; CS as usize]);
        let (i, map) = file(&d, data.len() as u64, Some(&data));
        data[CS as usize] = 8; // window 1 changes behind keel's back
        std::fs::write(d.bodies.path(i.ino.0), &data).unwrap();
        let f = File::open(d.bodies.path(i.ino.0)).unwrap();
        let none = |_: u64| false;

        let mut rep = FsckReport::default();
        let mut budget = u64::MAX;
        assert!(!rehash_windows(
            &f,
            &i,
            &map,
            &none,
            &ctx(false),
            &mut budget,
            &mut rep
        ));
        assert_eq!(rep.windows_hashed, 3);
        let errs: Vec<_> = rep.findings.iter().map(|f| &f.what).collect();
        assert_eq!(errs.len(), 1);
        assert!(errs[0].contains("window 1 no longer matches"), "{errs:?}");

        // After an unclean stop it is an unrecorded write, not damage.
        let mut rep = FsckReport::default();
        assert!(rehash_windows(
            &f,
            &i,
            &map,
            &none,
            &ctx(true),
            &mut budget,
            &mut rep
        ));
        assert!(rep.findings.is_empty());

        // Skipped windows and an exhausted budget hash nothing.
        let mut rep = FsckReport::default();
        let dirty = |idx: u64| idx == 1;
        let mut budget = 1;
        assert!(!rehash_windows(
            &f,
            &i,
            &map,
            &dirty,
            &ctx(false),
            &mut budget,
            &mut rep
        ));
        assert_eq!((rep.windows_hashed, budget), (1, 0));
        assert!(rep.findings.is_empty());
    }

    #[test]
    fn check_bodies_marks_unrecorded_writes_for_rehashing_on_repair() {
        let d = dir();
        let (i, map) = file(&d, 4, Some(b"abcd"));
        std::fs::write(d.bodies.path(i.ino.0), b"abcX").unwrap();
        let tx = d.store.write().unwrap();
        tx.set_file_chunks(i.ino, &map).unwrap();
        tx.persist_set("running", "1").unwrap();
        tx.persist_set("chunk_size", "4096").unwrap();
        tx.commit().unwrap();
        let opts = FsckOptions {
            repair: true,
            chunk_size: CS,
            ..Default::default()
        };
        let mut rep = FsckReport::default();
        check_bodies(&d.store, &d.bodies, Default::default(), &mut rep, &opts).unwrap();
        assert_eq!(rep.bodies, 1);
        assert_eq!(rep.findings.len(), 1, "{:?}", rep.findings);
        assert!(rep.findings[0].repaired);
        assert_eq!(d.store.read().backlog_windows().unwrap(), [(i.ino, 0)]);
    }
}

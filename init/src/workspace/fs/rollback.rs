//! Rollback of the live workspace to a snapshot, while mounted.
//!
//! The caller (persist, after a checkpoint) names the inodes and entries that differ
//! between the last checkpoint and the target, and answers what the target holds for any
//! inode or entry (`RollbackTarget`). Bodies of files whose bytes change are built first,
//! without the lock, under temporary names in the state dir. Then, under the filesystem's
//! one lock, so that no request sees part of it: whatever changed since the checkpoint is
//! added to the plan; a file that is open and changes or goes stays, for its handles, as it
//! was and unlinked (exactly like a file unlinked while open: removed at its last close),
//! and the target's version of it gets a new inode number, so the kernel keeps the two
//! files' pages apart; the new bodies are renamed into place and every store change commits
//! in one transaction and is synced. The kernel's caches are invalidated after the lock is released (the kernel may
//! call back into the filesystem while it drops pages): `RollbackReport::inval` lists what.
//!
//! The changes are recorded like any others (changed inodes, dirty windows, entries), so the
//! next checkpoint writes the rolled-back tree as a new snapshot whose parent is the one
//! rolled back from.
//!
//! Crash safety: the transaction also records which built bodies go where
//! (`ROLLBACK_RENAMES`); the bodies are renamed into place after it commits, and the record
//! is dropped after that. A crash between the commit and the renames is finished at the next
//! start (`finish_rollback_renames`): the new metadata never meets the old bytes, nor the
//! old metadata the new bytes; a transaction that fails renames nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;

use super::{FsError, FsResult, Inner, WorkspaceFs};
use crate::chunk::chunker::window_count;
use crate::chunk::{BodyStore, ChunkId, FetchError};
use crate::meta::{Inode, InodeNo, Kind, Storage, Store, ROLLBACK_RENAMES, ROLLBACK_TMP};

/// What the target snapshot holds for one inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub inode: Inode,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub data: TargetData,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetData {
    None,
    Inline(Vec<u8>),
    Symlink(Vec<u8>),
    /// Window ids (`None`: an all-zero window).
    Chunks(Vec<Option<ChunkId>>),
}

/// The snapshot to roll back to, as the filesystem asks about it.
pub trait RollbackTarget {
    /// The inode in the target; `None` when the target does not have it.
    fn inode(&self, ino: InodeNo) -> Option<Target>;
    /// The entry in the target.
    fn entry(&self, parent: InodeNo, name: &[u8]) -> Option<(InodeNo, Kind)>;
    /// Window size of the target's chunk maps.
    fn chunk_size(&self) -> u64;
    /// The target's entries that name any of `inos`.
    fn links(&self, inos: &BTreeSet<InodeNo>) -> Vec<(InodeNo, Vec<u8>)>;
    /// Chunk bytes by id, verified, one result per id in order.
    fn fetch(&self, ids: &[ChunkId]) -> Vec<Result<Bytes, FetchError>>;
    /// Called once the inodes and entries the rollback asks about are known (those changed
    /// after the checkpoint included), before it asks about them: a target read only in
    /// part reads the rest here. Entries naming those inodes are asked for too (`links`).
    fn prepare(
        &self,
        _inodes: &BTreeSet<InodeNo>,
        _entries: &BTreeSet<(InodeNo, Vec<u8>)>,
    ) -> FsResult<()> {
        Ok(())
    }
}

/// What differs between the last checkpoint and the target.
#[derive(Debug, Clone, Default)]
pub struct RollbackPlan {
    pub inodes: BTreeSet<InodeNo>,
    /// Regular files among `inodes` whose bytes differ (their bodies are rebuilt).
    pub bodies: BTreeSet<InodeNo>,
    pub entries: BTreeSet<(InodeNo, Vec<u8>)>,
}

/// One invalidation for the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inval {
    /// Attributes, cached pages and cached ACLs of an inode (a rollback may change its ACL
    /// xattrs, which the kernel otherwise keeps using until it refreshes the attributes).
    Inode(InodeNo),
    /// A name in a directory.
    Entry(InodeNo, Vec<u8>),
}

#[derive(Debug, Clone, Default)]
pub struct RollbackReport {
    pub inodes: u64,
    pub entries: u64,
    /// Bodies rebuilt from chunks.
    pub bodies: u64,
    pub body_bytes: u64,
    /// Files open when the rollback came that changed or went: their handles keep the old
    /// inode (unlinked, removed at the last close).
    pub kept_open: u64,
    /// Target inodes that got a new number (the old one was open).
    pub renumbered: u64,
    /// Inodes and entries changed after the checkpoint, rolled back too.
    pub late: u64,
    pub inval: Vec<Inval>,
}

fn fetch_err(e: FetchError) -> FsError {
    FsError::Fetch {
        at: String::new(),
        source: Box::new(e),
    }
}

/// The state-dir key recording a committed rollback's bodies still to rename into place:
/// Where a rollback builds bodies.
fn rollback_tmp(state_dir: &Path) -> PathBuf {
    state_dir.join(ROLLBACK_TMP)
}

/// Renames each built body (`rollback.tmp/<name>`) over inode `at`'s body. One already
/// renamed (a start finishing a rollback a crash interrupted) is skipped.
fn rename_built(state_dir: &Path, bodies: &BodyStore, renames: &[(u64, u64)]) -> io::Result<()> {
    for &(at, name) in renames {
        let src = rollback_tmp(state_dir).join(name.to_string());
        if !src.exists() {
            continue;
        }
        let dst = bodies.path(at);
        if let Some(d) = dst.parent() {
            std::fs::create_dir_all(d)?;
        }
        std::fs::rename(&src, &dst)?;
        // A kill point between renames (`KEEL_DIE_AT=rollback/renamed_body`).
        crate::logging::step("rollback", "renamed_body");
    }
    Ok(())
}

/// At start: the bodies of a rollback whose transaction committed but which stopped before
/// renaming them all go into place now (see the module doc), and their windows are marked
/// dirty again (a checkpoint may have read the old bytes meanwhile, had the renames failed
/// rather than the process stopped). Returns how many were listed.
pub(super) fn finish_rollback_renames(
    state_dir: &Path,
    store: &Store,
    bodies: &BodyStore,
    chunk_size: u64,
) -> FsResult<usize> {
    let renames = store
        .read()
        .rollback_renames()?
        .map_err(|e| FsError::Io(io::Error::other(e)))?;
    if renames.is_empty() {
        return Ok(0);
    }
    rename_built(state_dir, bodies, &renames)?;
    let tx = store.write()?;
    for &(at, _) in &renames {
        if let Some(i) = tx.get(InodeNo(at))? {
            tx.mark_whole_file_dirty(InodeNo(at), window_count(i.size, chunk_size))?;
        }
    }
    tx.persist_remove(ROLLBACK_RENAMES)?;
    tx.commit()?;
    let _ = std::fs::remove_dir_all(rollback_tmp(state_dir));
    Ok(renames.len())
}

impl WorkspaceFs {
    fn rollback_tmp(&self) -> PathBuf {
        rollback_tmp(&self.state_dir)
    }

    /// Writes the target's bytes of `ino` into a new file under `rollback.tmp`.
    fn build_body(
        &self,
        ino: InodeNo,
        size: u64,
        map: &[Option<ChunkId>],
        t: &dyn RollbackTarget,
        report: &mut RollbackReport,
    ) -> FsResult<PathBuf> {
        let path = self.rollback_tmp().join(ino.0.to_string());
        // 0600 as every body (it becomes one by a rename): not the umask's 0644.
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)?;
        let cs = t.chunk_size();
        let wanted: Vec<(usize, ChunkId)> = map
            .iter()
            .enumerate()
            .filter_map(|(i, id)| id.map(|id| (i, id)))
            .collect();
        for batch in wanted.chunks(64) {
            let ids: Vec<ChunkId> = batch.iter().map(|(_, id)| *id).collect();
            for ((idx, _), got) in batch.iter().zip(t.fetch(&ids)) {
                let b = got.map_err(fetch_err)?;
                f.write_all_at(&b, *idx as u64 * cs)?;
                report.body_bytes += b.len() as u64;
            }
        }
        f.set_len(size)?;
        f.sync_all()?;
        report.bodies += 1;
        Ok(path)
    }

    /// Makes the workspace equal to the target: see the module doc.
    pub fn rollback(
        &self,
        plan: &RollbackPlan,
        t: &dyn RollbackTarget,
    ) -> FsResult<RollbackReport> {
        let mut report = RollbackReport::default();
        let tmp = self.rollback_tmp();
        let _ = std::fs::remove_dir_all(&tmp);
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new().mode(0o700).create(&tmp)?;
        }
        let r = self.rollback_in(plan, t, &mut report);
        let _ = std::fs::remove_dir_all(&tmp);
        r.map(|()| report)
    }

    fn rollback_in(
        &self,
        plan: &RollbackPlan,
        t: &dyn RollbackTarget,
        report: &mut RollbackReport,
    ) -> FsResult<()> {
        // Bodies first, without the lock.
        crate::logging::step("rollback", "build_bodies");
        let mut built: BTreeMap<InodeNo, PathBuf> = BTreeMap::new();
        for &ino in &plan.bodies {
            if let Some(Target {
                inode,
                data: TargetData::Chunks(map),
                ..
            }) = t.inode(ino)
            {
                let p = self.build_body(ino, inode.size, &map, t, report)?;
                built.insert(ino, p);
            }
        }
        let mut guard = self.lock();
        crate::logging::step("rollback", "locked");
        let inner: &mut Inner = &mut guard;
        // Everything open is in the store first, so that what changed since the checkpoint
        // shows in its change tables.
        let dirty: Vec<InodeNo> = inner
            .nodes
            .iter()
            .filter(|(_, n)| n.open.as_ref().is_some_and(|o| o.dirty) || n.pt_opens > 0)
            .map(|(i, _)| *i)
            .collect();
        for ino in dirty {
            self.sync_written(inner, ino)?;
            Self::write_back(inner, ino)?;
        }
        inner.commit_group(self.opts.chunk_size)?;
        let mut inodes = plan.inodes.clone();
        let mut entries = plan.entries.clone();
        {
            let r = inner.store.read();
            for ino in r.backlog_inodes()? {
                report.late += u64::from(inodes.insert(ino));
            }
            for (ino, _) in r.backlog_windows()? {
                report.late += u64::from(inodes.insert(ino));
            }
            for e in r.backlog_dirents()? {
                report.late += u64::from(entries.insert(e));
            }
        }
        t.prepare(&inodes, &entries)?;
        // Open files that change or go stay as they are for their handles, unlinked (like
        // an unlinked file, removed at the last close); the target's version of one gets a
        // new inode number, so the kernel caches its pages apart from the old ones.
        let open: BTreeSet<InodeNo> = inodes
            .iter()
            .copied()
            .filter(|i| Self::is_open(inner, *i))
            .collect();
        let renumber: BTreeSet<InodeNo> = open
            .iter()
            .copied()
            .filter(|i| t.inode(*i).is_some_and(|x| x.inode.kind != Kind::Dir))
            .collect();
        let orphans: BTreeSet<InodeNo> = open
            .iter()
            .copied()
            .filter(|i| renumber.contains(i) || t.inode(*i).is_none())
            .collect();
        // Bodies of late changes (rare: written after the checkpoint) and of files that get
        // a new number, under the lock.
        for &ino in &inodes {
            let late = !plan.inodes.contains(&ino);
            if built.contains_key(&ino) || !(late || renumber.contains(&ino)) {
                continue;
            }
            if let Some(Target {
                inode,
                data: TargetData::Chunks(map),
                ..
            }) = t.inode(ino)
            {
                let p = self.build_body(ino, inode.size, &map, t, report)?;
                built.insert(ino, p);
            }
        }
        entries.extend(t.links(&renumber));
        for ino in &inodes {
            if let Some(node) = inner.nodes.get_mut(ino) {
                node.cache_stamp = super::NO_STAMP;
                if orphans.contains(ino) {
                    if let Some(of) = node.open.as_mut() {
                        of.inode.nlink = 0;
                    }
                } else if node.opens == 0 {
                    if let Some(of) = node.open.take() {
                        of.drop_provisional();
                    }
                }
            }
            inner.lingering.retain(|x| x != ino);
            inner.mapped.forget(*ino);
            inner.no_xattrs.remove(ino);
            self.lazy.forget(*ino);
        }
        // The store, in one transaction; new bodies go into place just before it commits
        // (see the module doc).
        let mut gone_bodies: Vec<InodeNo> = Vec::new();
        let mut new_no: BTreeMap<InodeNo, InodeNo> = BTreeMap::new();
        crate::logging::step("rollback", "transaction");
        let tx = inner.store.write()?;
        for &ino in &inodes {
            let before = tx.get(ino)?;
            let was_body = before
                .as_ref()
                .is_some_and(|i| i.kind == Kind::File && i.storage == Storage::Body);
            if orphans.contains(&ino) {
                if let Some(mut i) = before.clone() {
                    i.nlink = 0;
                    tx.update(&i)?;
                }
                report.kept_open += 1;
            }
            let Some(target) = t.inode(ino) else {
                if before.is_some() && !orphans.contains(&ino) {
                    tx.delete(ino)?;
                    tx.truncate_missing_windows(ino, 0)?;
                    if was_body {
                        gone_bodies.push(ino);
                    }
                }
                continue;
            };
            let mut inode = target.inode.clone();
            inode.storage = match target.data {
                TargetData::Chunks(_) => Storage::Body,
                _ => Storage::Inline,
            };
            let at = if renumber.contains(&ino) {
                let n = tx.insert(&inode)?;
                new_no.insert(ino, n);
                n
            } else {
                tx.put_inode_exact(&inode)?;
                tx.mark_changed(ino)?;
                for n in tx.xattr_names(ino)? {
                    tx.remove_xattr(ino, &n)?;
                }
                if was_body && inode.storage == Storage::Inline {
                    gone_bodies.push(ino);
                }
                ino
            };
            for (n, v) in &target.xattrs {
                tx.set_xattr(at, n, v)?;
            }
            // A lazily restored body that goes inline leaves no window to fetch: one left
            // listed would still be fetched, old bytes and all, when the file is next read.
            if !matches!(target.data, TargetData::Chunks(_)) {
                tx.truncate_missing_windows(at, 0)?;
            }
            match &target.data {
                TargetData::Inline(v) => tx.set_inline_data(at, v)?,
                TargetData::Symlink(v) => tx.set_symlink_target(at, v)?,
                TargetData::Chunks(_) if built.contains_key(&ino) => {
                    tx.truncate_missing_windows(at, 0)?;
                    tx.mark_whole_file_dirty(at, window_count(inode.size, self.opts.chunk_size))?;
                }
                _ => {}
            }
        }
        for (parent, name) in &entries {
            let want = t
                .entry(*parent, name)
                .map(|(i, k)| (new_no.get(&i).copied().unwrap_or(i), k));
            let have = tx.lookup(*parent, name)?.map(|d| (d.ino, d.kind));
            match (have, want) {
                (a, b) if a == b => continue,
                (Some(_), None) => tx.unlink(*parent, name)?,
                (Some(_), Some((ino, kind))) => tx.relink(*parent, name, ino, kind)?,
                (None, Some((ino, kind))) => tx.link(*parent, name, ino, kind)?,
                (None, None) => unreachable!("equal, handled above"),
            }
            report.entries += 1;
        }
        let renames: Vec<(u64, u64)> = built
            .keys()
            .map(|ino| (new_no.get(ino).copied().unwrap_or(*ino).0, ino.0))
            .collect();
        if !renames.is_empty() {
            let v = serde_json::to_string(&renames).expect("pairs of numbers serialise");
            tx.persist_set(ROLLBACK_RENAMES, &v)?;
        }
        tx.commit()?;
        if !renames.is_empty() {
            // The transaction may only have joined the open metadata group (`Tx::commit` in
            // a group releases a savepoint): it must be committed, and durable, before the
            // first body is renamed, or a kill between the two leaves the old metadata over
            // new bytes with no record of the renames (the soak found it: a kill at
            // `rollback/rename_bodies`).
            inner.sync(self.opts.chunk_size)?;
            crate::logging::step("rollback", "rename_bodies");
            rename_built(&self.state_dir, &self.bodies, &renames)?;
            let tx = inner.store.write()?;
            tx.persist_remove(ROLLBACK_RENAMES)?;
            tx.commit()?;
        }
        inner.sync(self.opts.chunk_size)?;
        self.fed_rescan(inner, "rollback");
        for ino in gone_bodies {
            Self::discard_body(inner, ino);
        }
        report.inodes = inodes.len() as u64;
        report.renumbered = new_no.len() as u64;
        report.inval = inodes
            .iter()
            .map(|i| Inval::Inode(*i))
            .chain(entries.iter().map(|(p, n)| Inval::Entry(*p, n.clone())))
            .collect();
        Ok(())
    }
}

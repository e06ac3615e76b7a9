//! The bridge between a snapshot tree (`persist::format::Tree`) and the mounted
//! filesystem's rollback (`fs::WorkspaceFs::rollback`): what differs between the tree at
//! the last checkpoint and the target, the target as the filesystem asks for it, and the
//! kernel invalidations once it is applied (through the FUSE session's notifier,
//! `workspace::Invalidate`). `FuseLive` and `DirLive` are the two providers' `LiveTree`s,
//! handed to the checkpoint service at start. Part of the start sequence: it joins
//! persist's trees to the workspace's filesystem, which know nothing of each other.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::chunk::{ChunkId, ChunkSource, FetchError};
use crate::meta::{InodeNo, Kind};
use crate::persist::agent::LiveTree;
use crate::persist::diff::Sparse;
use crate::persist::format::{Tree, TreeData, TreeInode};
use crate::persist::history::{Changed, View};
use crate::persist::hydrate::RemoteChunks;
use crate::persist::service::BoxError;
use crate::persist::Repo;
use crate::workspace::dir::{DirError, DirTree, Source as DirSource, SourceData, SourceInode};
use crate::workspace::fs::{
    FsError, RollbackPlan, RollbackTarget, Target, TargetData, WorkspaceFs,
};
use crate::workspace::Invalidate;

/// The inodes and entries that differ between `cur` and `target`, among those `changed`
/// names (a superset: what the snapshots between them touched).
pub fn plan(cur: &View, target: &View, changed: &Changed) -> RollbackPlan {
    let mut inodes = BTreeSet::new();
    let mut bodies = BTreeSet::new();
    for &ino in &changed.inodes {
        let (before, after) = (cur.inode(ino), target.inode(ino));
        if before == after {
            continue;
        }
        inodes.insert(InodeNo(ino));
        if let Some(t) = after {
            let bytes_differ = before.is_none_or(|b| b.data != t.data || b.rec.size != t.rec.size);
            if matches!(t.data, TreeData::Chunks(_)) && bytes_differ {
                bodies.insert(InodeNo(ino));
            }
        }
    }
    let entries = changed
        .dirents
        .iter()
        .filter(|(p, n)| cur.dirent(*p, n) != target.dirent(*p, n))
        .map(|(p, n)| (InodeNo(*p), n.clone()))
        .collect();
    RollbackPlan {
        inodes,
        bodies,
        entries,
    }
}

struct TreeTarget<'a, 'b> {
    tree: &'a View<'b>,
    /// A target read only in part (`diff::Sparse`): what it covers, and the rest of what
    /// the rollback asks about, read by `prepare`.
    sparse: Option<&'a Sparse>,
    more: RefCell<Tree>,
    chunks: RemoteChunks,
}

impl<'a, 'b> TreeTarget<'a, 'b> {
    /// The target `tree`; with `sparse`, a tree read only in part (`tree` is its `to` side).
    fn new(tree: &'a View<'b>, sparse: Option<&'a Sparse>, repo: &Repo) -> Self {
        TreeTarget {
            tree,
            sparse,
            more: RefCell::new(Tree::default()),
            chunks: RemoteChunks::new(repo.clone()),
        }
    }

    /// The target's record for `ino`, from the tree or from what `prepare` read.
    fn with_inode<R>(&self, ino: u64, f: impl FnOnce(Option<&TreeInode>) -> R) -> R {
        match self.sparse {
            Some(s) if !s.covers_inode(ino) => f(self.more.borrow().inodes.get(&ino)),
            _ => f(self.tree.inode(ino)),
        }
    }
}

impl RollbackTarget for TreeTarget<'_, '_> {
    fn inode(&self, ino: InodeNo) -> Option<Target> {
        self.with_inode(ino.0, |t| {
            let t = t?;
            let r = &t.rec;
            Some(Target {
                inode: t.inode()?,
                xattrs: r.xattrs.clone(),
                data: match &t.data {
                    TreeData::None => TargetData::None,
                    TreeData::Inline(v) => TargetData::Inline(v.clone()),
                    TreeData::Symlink(v) => TargetData::Symlink(v.clone()),
                    TreeData::Chunks(m) => TargetData::Chunks(m.clone()),
                },
            })
        })
    }

    fn entry(&self, parent: InodeNo, name: &[u8]) -> Option<(InodeNo, Kind)> {
        let (ino, kind) = match self.sparse {
            Some(s) if !s.covers_entry(parent.0, name) => {
                *self.more.borrow().dirents.get(&(parent.0, name.to_vec()))?
            }
            _ => self.tree.dirent(parent.0, name)?,
        };
        Some((InodeNo(ino), Kind::from_mode(kind)?))
    }

    fn links(&self, inos: &BTreeSet<InodeNo>) -> Vec<(InodeNo, Vec<u8>)> {
        if inos.is_empty() {
            return Vec::new();
        }
        let names = |(ino, _): &(u64, u32)| inos.contains(&InodeNo(*ino));
        let mut out: BTreeSet<(u64, Vec<u8>)> = self
            .tree
            .dirents_where(names)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        if self.sparse.is_some() {
            let more = self.more.borrow();
            out.extend(
                more.dirents
                    .iter()
                    .filter(|(_, v)| names(v))
                    .map(|(k, _)| k.clone()),
            );
        }
        out.into_iter().map(|(p, n)| (InodeNo(p), n)).collect()
    }

    fn chunk_size(&self) -> u64 {
        self.tree.chunk_size()
    }

    fn fetch(&self, ids: &[ChunkId]) -> Vec<Result<Bytes, FetchError>> {
        self.chunks.fetch(ids)
    }

    /// A target read in part reads, in one more pass over its chain, the inodes and
    /// entries it does not cover (changed after the checkpoint, so not among what the
    /// snapshots between touched), and the entries naming those inodes. It runs under the
    /// filesystem's lock: when anything changed after the checkpoint, requests wait for
    /// one replay of the chain (at a million files, with a writer creating files
    /// throughout, the whole apply held the lock 0.39–0.43 s for ~11,000 late changes).
    fn prepare(
        &self,
        inodes: &BTreeSet<InodeNo>,
        entries: &BTreeSet<(InodeNo, Vec<u8>)>,
    ) -> Result<(), FsError> {
        let Some(s) = self.sparse else {
            return Ok(());
        };
        let inodes: BTreeSet<u64> = inodes
            .iter()
            .map(|i| i.0)
            .filter(|i| !s.covers_inode(*i))
            .collect();
        let entries: BTreeSet<(u64, Vec<u8>)> = entries
            .iter()
            .filter(|(p, n)| !s.covers_entry(p.0, n))
            .map(|(p, n)| (p.0, n.clone()))
            .collect();
        if inodes.is_empty() && entries.is_empty() {
            return Ok(());
        }
        let t = s
            .read_to(&inodes, &entries)
            .map_err(|e| FsError::Io(std::io::Error::other(e)))?;
        *self.more.borrow_mut() = t;
        Ok(())
    }
}

/// Why the mounted workspace could not be rolled back.
#[derive(Debug, thiserror::Error)]
pub enum LiveRollbackError {
    #[error("the snapshot was cut into {snapshot} byte windows, the workspace into {workspace}: restore it with keel snapshot restore instead")]
    WindowSize { snapshot: u64, workspace: u64 },
    #[error("rollback: {0}")]
    Apply(#[source] crate::workspace::fs::FsError),
}

/// The mounted FUSE workspace as a rollback reaches it: the filesystem applies the plan,
/// then the kernel forgets what it cached of what changed.
pub struct FuseLive {
    pub fs: Arc<WorkspaceFs>,
    pub inval: Invalidate,
}

impl LiveTree for FuseLive {
    fn roll_back(
        &self,
        repo: &Repo,
        cur: &View,
        target: &View,
        changed: &Changed,
        sparse: Option<&Sparse>,
    ) -> Result<serde_json::Value, BoxError> {
        if cur.chunk_size() != target.chunk_size() {
            return Err(LiveRollbackError::WindowSize {
                snapshot: target.chunk_size(),
                workspace: cur.chunk_size(),
            }
            .into());
        }
        let p = plan(cur, target, changed);
        let t = TreeTarget::new(target, sparse, repo);
        let r = self.fs.rollback(&p, &t).map_err(LiveRollbackError::Apply)?;
        let t0 = Instant::now();
        let mut inval_failed = 0u64;
        for i in &r.inval {
            if (self.inval)(i).is_err() {
                inval_failed += 1;
            }
        }
        Ok(serde_json::json!({
            "inodes": r.inodes,
            "entries": r.entries,
            "bodies_rebuilt": r.bodies,
            "body_bytes": r.body_bytes,
            "open_files_kept": r.kept_open,
            "renumbered": r.renumbered,
            "changed_after_checkpoint": r.late,
            "invalidations": r.inval.len(),
            "invalidations_unknown_to_kernel": inval_failed,
            "invalidate_ms": (t0.elapsed().as_secs_f64() * 1e6).round() / 1e3,
        }))
    }
}

/// A snapshot tree as the `dir` provider builds it: entries and inodes from the tree,
/// bytes from the remote's chunks, or hard-linked from the live tree when the file's
/// bytes did not change between the last checkpoint (`cur`) and the target.
struct SnapshotSource<'a> {
    tree: &'a Tree,
    cur: &'a View<'a>,
    chunks: RemoteChunks,
}

impl DirSource for SnapshotSource<'_> {
    fn entries(&self, dir: InodeNo) -> Result<Vec<(Vec<u8>, InodeNo, Kind)>, DirError> {
        Ok(self
            .tree
            .dirents
            .range((dir.0, Vec::new())..(dir.0 + 1, Vec::new()))
            .filter_map(|((_, name), (ino, kind))| {
                Some((name.clone(), InodeNo(*ino), Kind::from_mode(*kind)?))
            })
            .collect())
    }

    fn inode(&self, ino: InodeNo) -> Result<Option<SourceInode>, DirError> {
        let Some(t) = self.tree.inodes.get(&ino.0) else {
            return Ok(None);
        };
        let Some(inode) = t.inode() else {
            return Ok(None);
        };
        Ok(Some(SourceInode {
            inode,
            xattrs: t.rec.xattrs.clone(),
            data: match &t.data {
                TreeData::None => SourceData::None,
                TreeData::Inline(v) => SourceData::Inline(v.clone()),
                TreeData::Symlink(v) => SourceData::Symlink(v.clone()),
                TreeData::Chunks(_) => SourceData::Body,
            },
        }))
    }

    fn same_bytes_as_live(&self, ino: InodeNo) -> bool {
        match (self.cur.inode(ino.0), self.tree.inodes.get(&ino.0)) {
            (Some(a), Some(b)) => a.rec.size == b.rec.size && a.data == b.data,
            _ => false,
        }
    }

    fn write_bytes(&self, ino: InodeNo, _size: u64, f: &std::fs::File) -> std::io::Result<u64> {
        use std::os::unix::fs::FileExt;
        let Some(TreeData::Chunks(map)) = self.tree.inodes.get(&ino.0).map(|t| &t.data) else {
            return Ok(0);
        };
        let cs = self.tree.chunk_size;
        let wanted: Vec<(usize, ChunkId)> = map
            .iter()
            .enumerate()
            .filter_map(|(i, id)| id.map(|id| (i, id)))
            .collect();
        let mut n = 0;
        for batch in wanted.chunks(64) {
            let ids: Vec<ChunkId> = batch.iter().map(|(_, id)| *id).collect();
            for ((idx, _), got) in batch.iter().zip(self.chunks.fetch(&ids)) {
                let b = got.map_err(|e| std::io::Error::other(e.to_string()))?;
                f.write_all_at(&b, *idx as u64 * cs)?;
                n += b.len() as u64;
            }
        }
        Ok(n)
    }
}

/// A `dir` workspace as a rollback reaches it: the whole target tree is built beside the
/// live one (files whose bytes did not change hard-linked from it, the others fetched) and
/// swapped in with one rename; the walk then records it, and the service's next checkpoint
/// makes it a snapshot.
pub struct DirLive(pub Arc<DirTree>);

impl LiveTree for DirLive {
    fn roll_back(
        &self,
        repo: &Repo,
        cur: &View,
        target: &View,
        _changed: &Changed,
        sparse: Option<&Sparse>,
    ) -> Result<serde_json::Value, BoxError> {
        let full = match sparse {
            Some(_) => repo.load_tree(target.seq)?.0,
            None => target.to_tree(),
        };
        let src = SnapshotSource {
            tree: &full,
            cur,
            chunks: RemoteChunks::new(repo.clone()),
        };
        let r = self.0.build_and_swap(&src)?;
        Ok(serde_json::json!({
            "provider": "dir",
            "files": r.files,
            "dirs": r.dirs,
            "files_unchanged_linked": r.reused,
            "bytes_written": r.bytes,
            "build_ms": (r.elapsed.as_secs_f64() * 1e6).round() / 1e3,
            "not_set": r.skipped_note(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::diff::sparse;
    use crate::persist::format::{Body, DataRec, DirentRec, InodeRec};
    use crate::persist::MemRemote;

    /// A target read in part answers, once `prepare` has read what it does not cover
    /// (inodes and entries changed after the checkpoint, say), exactly as the whole tree:
    /// inodes, entries present and absent, every link of an inode. Along one chain and
    /// across a full snapshot (`"merged"`), either way.
    #[test]
    fn a_sparse_target_answers_as_the_whole_tree_once_prepared() {
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        let mut root = InodeRec::test(1, libc::S_IFDIR | 0o755, DataRec::None);
        root.nlink = 3;
        repo.put_test(
            1,
            None,
            &Body {
                inodes: vec![
                    root,
                    InodeRec::test(2, libc::S_IFDIR | 0o755, DataRec::None),
                    InodeRec::test_file(3, "three\n"),
                    InodeRec::test_file(4, "four\n"),
                    InodeRec::test_file(8, "linked twice\n"),
                ],
                dirents: vec![
                    DirentRec::test(1, "d", 2, libc::S_IFDIR),
                    DirentRec::test(2, "three", 3, libc::S_IFREG),
                    DirentRec::test(1, "four", 4, libc::S_IFREG),
                    DirentRec::test(1, "u", 8, libc::S_IFREG),
                    DirentRec::test(2, "u2", 8, libc::S_IFREG),
                ],
                ..Default::default()
            },
        );
        repo.put_test(
            2,
            Some(1),
            &Body {
                inodes: vec![
                    InodeRec::test_file(3, "changed\n"),
                    InodeRec::test_file(5, "new\n"),
                ],
                dirents: vec![DirentRec::test(1, "five", 5, libc::S_IFREG)],
                ..Default::default()
            },
        );
        let s = sparse(&repo, 2, 1).unwrap().expect("1 is on 2's chain");
        assert!(!s.covers_inode(8) && !s.covers_inode(4) && s.covers_inode(3));
        answers_as_the_whole_tree(&repo, &s, 1);
        // Across a full snapshot (both chains read, the full snapshots merged), either way:
        // 3 compacts 2, as a checkpoint would.
        repo.put_test(3, None, &repo.load_tree(2).unwrap().0.full_body());
        repo.put_test(
            4,
            Some(3),
            &Body {
                inodes: vec![InodeRec::test_file(9, "nine\n")],
                dirents: vec![DirentRec::test(2, "nine", 9, libc::S_IFREG)],
                ..Default::default()
            },
        );
        for (from, to) in [(4, 1), (1, 4), (2, 4), (4, 2)] {
            let s = sparse(&repo, from, to).unwrap().unwrap();
            assert_eq!(s.how, "merged", "{from} -> {to}");
            assert!(!s.covers_inode(8), "{from} -> {to}: unchanged, not read");
            answers_as_the_whole_tree(&repo, &s, to);
        }
    }

    /// `s` (a target read in part, snapshot `to`) answers, once prepared, as the whole tree
    /// of `to` does: inodes, entries present and absent, every link of an inode.
    fn answers_as_the_whole_tree(repo: &Repo, s: &Sparse, to: u64) {
        let whole_tree = repo.load_tree(to).unwrap().0;
        let whole_view = View::of(&whole_tree);
        let part_view = View::of(&s.to);
        let whole = TreeTarget::new(&whole_view, None, repo);
        let part = TreeTarget::new(&part_view, Some(s), repo);
        let inodes: BTreeSet<InodeNo> = [1, 3, 4, 5, 8, 9].into_iter().map(InodeNo).collect();
        let entries: BTreeSet<(InodeNo, Vec<u8>)> = [
            (1, "u"),
            (2, "u2"),
            (1, "four"),
            (1, "five"),
            (2, "three"),
            (2, "nine"),
            (1, "nothing"),
        ]
        .into_iter()
        .map(|(p, n)| (InodeNo(p), n.as_bytes().to_vec()))
        .collect();
        // Before `prepare`, an uncovered inode is not answered for (the whole tree has it).
        assert!(part.inode(InodeNo(8)).is_none() && whole.inode(InodeNo(8)).is_some());
        part.prepare(&inodes, &entries).unwrap();
        for i in &inodes {
            assert_eq!(part.inode(*i), whole.inode(*i), "{to}: inode {i:?}");
        }
        for (p, n) in &entries {
            assert_eq!(
                part.entry(*p, n),
                whole.entry(*p, n),
                "{to}: entry {p:?} {n:?}"
            );
        }
        for i in [8, 3, 5, 4, 9] {
            let one = BTreeSet::from([InodeNo(i)]);
            assert_eq!(part.links(&one), whole.links(&one), "{to}: links of {i}");
        }
        assert_eq!(part.links(&BTreeSet::from([InodeNo(8)])).len(), 2);
    }

    /// A hard link renamed over before the snapshots between: the target's links of the
    /// inode and the renamed-over name are its own, not the names' earlier values, both
    /// for an inode the sparse side covers and for one `prepare` reads (changed after the
    /// checkpoint, say).
    #[test]
    fn a_sparse_target_does_not_keep_a_name_renamed_over_before_the_window() {
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        let root = InodeRec::test(1, libc::S_IFDIR | 0o755, DataRec::None);
        // /a and /h name 5, /c and /i name 7; /b (6) is renamed over /a, /d (9) over /c.
        repo.put_test(
            1,
            None,
            &Body {
                inodes: vec![
                    root,
                    InodeRec::test_file(5, "five\n"),
                    InodeRec::test_file(6, "six\n"),
                    InodeRec::test_file(7, "seven\n"),
                    InodeRec::test_file(9, "nine\n"),
                ],
                dirents: vec![
                    DirentRec::test(1, "a", 5, libc::S_IFREG),
                    DirentRec::test(1, "h", 5, libc::S_IFREG),
                    DirentRec::test(1, "b", 6, libc::S_IFREG),
                    DirentRec::test(1, "c", 7, libc::S_IFREG),
                    DirentRec::test(1, "i", 7, libc::S_IFREG),
                    DirentRec::test(1, "d", 9, libc::S_IFREG),
                ],
                ..Default::default()
            },
        );
        repo.put_test(
            2,
            Some(1),
            &Body {
                inodes: vec![
                    InodeRec::test_file(5, "five\n"),
                    InodeRec::test_file(7, "seven\n"),
                ],
                unlinked: vec![(1, b"b".to_vec()), (1, b"d".to_vec())],
                dirents: vec![
                    DirentRec::test(1, "a", 6, libc::S_IFREG),
                    DirentRec::test(1, "c", 9, libc::S_IFREG),
                ],
                ..Default::default()
            },
        );
        // Only 5 changes between 2 and 3: 7 is not covered.
        repo.put_test(
            3,
            Some(2),
            &Body {
                inodes: vec![InodeRec::test_file(5, "five, changed\n")],
                ..Default::default()
            },
        );
        let s = sparse(&repo, 3, 2).unwrap().expect("2 is on 3's chain");
        assert!(s.covers_inode(5) && !s.covers_inode(7));
        let whole_tree = repo.load_tree(2).unwrap().0;
        let (whole_view, part_view) = (View::of(&whole_tree), View::of(&s.to));
        let whole = TreeTarget::new(&whole_view, None, &repo);
        let name = |n: &str| (InodeNo(1), n.as_bytes().to_vec());
        for (inos, names) in [
            (vec![5, 7], vec![]),
            (vec![5, 7], vec![name("a"), name("c")]),
        ] {
            let part = TreeTarget::new(&part_view, Some(&s), &repo);
            let inos: BTreeSet<InodeNo> = inos.into_iter().map(InodeNo).collect();
            part.prepare(&inos, &names.iter().cloned().collect())
                .unwrap();
            for i in [7, 5] {
                let one = BTreeSet::from([InodeNo(i)]);
                assert_eq!(part.links(&one), whole.links(&one), "links of {i}");
                assert_eq!(part.links(&one).len(), 1, "links of {i}");
            }
            for (p, n) in &names {
                assert_eq!(part.entry(*p, n), whole.entry(*p, n), "{n:?}");
            }
        }
        assert_eq!(
            whole.entry(InodeNo(1), b"c"),
            Some((InodeNo(9), Kind::File))
        );
    }
}

//! The checkpoint worker's memory of recent snapshots, so that a diff or a rollback costs
//! what changed rather than what the workspace holds.
//!
//! `History` keeps the decoded tree of the last checkpoint and, for each recent checkpoint,
//! the records it replaced (an undo step: every inode and entry the snapshot touched, with
//! its value before). Each checkpoint reads back only its own snapshot and replays it
//! (`advance`). A snapshot in the window is then seen (`view`) as the last tree with the
//! undo steps after it laid over, without copying the tree: the work is the changes since
//! that snapshot. Two snapshots in the window differ at most in the keys the steps between
//! them touched (`changed`), so a diff of two of them, or a rollback to one, looks only at
//! those. Anything outside the window (older, or before keel started) falls back to decoding
//! the snapshot's chain, as before.
//!
//! The window is bounded by the records it holds (`max_records`); it starts empty when the
//! first named snapshot, diff or rollback loads the tree (the one full decode), so a keel
//! that is never asked for one never holds it; a rollback the window does not already see,
//! and on a large workspace a diff, reads instead only the parts of the two trees it needs
//! when the older snapshot is on the newer's chain (`diff::sparse`). The tree itself is kept only while it is
//! small (`max_tree_records`): a large workspace's tree would hold more memory than keel's
//! whole budget, so there each operation reads those parts, or builds the history it needs
//! (the older snapshot's tree advanced to the newer, `advance_any`, else the chains
//! decoded) and drops it, and
//! one that loads the history only to keep it (a named snapshot) does not load it at all
//! (`History::would_keep`, from the head's header). Snapshots are read a record at a time
//! (`Tree::apply_object`, `format::reader`), never decoded whole.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use super::format::{Tree, TreeInode};
use super::repo::{Repo, RepoError};

/// Records (inodes + entries) the undo steps may hold together; older steps are dropped
/// past it. About 100 bytes to a few KB each (an inline file's bytes are in its record).
/// The memory budget's `history_records` share (200,000 from a 256 MiB budget up).
pub fn max_records() -> usize {
    crate::budget::shares().history_records
}

/// Records (inodes + entries) of the tree above which the history is not kept between
/// operations (`History::worth_keeping`). A record of the decoded tree costs about 250-300
/// bytes of heap (the inode record, its map node, an entry's name and key), so 200,000 is
/// ~50-60 MiB: about 100,000 files. Issue 25 bounds keel's RSS at 150 MiB at 1,000,000
/// files, which a kept tree of that size (~550 MiB) would break many times over. The same
/// share of the memory budget as [`max_records`].
pub fn max_tree_records() -> usize {
    crate::budget::shares().history_records
}

/// Snapshots an operation walks to see an older one with one tree (`diff::diff_along`, a
/// rollback's history): past it the two trees are decoded instead. Each is a GET (and a
/// full snapshot among them a whole-tree comparison), on the checkpoint worker for a
/// running keel.
pub const MAX_ALONG: u64 = 512;

type DirKey = (u64, Vec<u8>);
type DirVal = (u64, u32);

/// What one snapshot replaced.
#[derive(Debug, Default)]
struct Step {
    /// The snapshot this step leads to, and the one it came from.
    seq: u64,
    from: u64,
    inodes: HashMap<u64, Option<TreeInode>>,
    dirents: HashMap<DirKey, Option<DirVal>>,
}

impl Step {
    fn records(&self) -> usize {
        self.inodes.len() + self.dirents.len()
    }
}

/// A tree as it was at one snapshot: a base tree with some records replaced.
pub struct View<'a> {
    pub base: &'a Tree,
    pub seq: u64,
    inodes: HashMap<u64, Option<TreeInode>>,
    dirents: HashMap<DirKey, Option<DirVal>>,
}

impl<'a> View<'a> {
    /// The tree itself.
    pub fn of(base: &'a Tree) -> Self {
        View {
            base,
            seq: base.seq.unwrap_or(0),
            inodes: HashMap::new(),
            dirents: HashMap::new(),
        }
    }

    pub fn inode(&self, ino: u64) -> Option<&TreeInode> {
        match self.inodes.get(&ino) {
            Some(v) => v.as_ref(),
            None => self.base.inodes.get(&ino),
        }
    }

    pub fn dirent(&self, parent: u64, name: &[u8]) -> Option<DirVal> {
        let k = (parent, name.to_vec());
        match self.dirents.get(&k) {
            Some(v) => *v,
            None => self.base.dirents.get(&k).copied(),
        }
    }

    pub fn chunk_size(&self) -> u64 {
        self.base.chunk_size
    }

    /// Every entry, filtered by `keep(value)` (one pass over the base's entries).
    pub fn dirents_where(&self, keep: impl Fn(&DirVal) -> bool) -> Vec<(DirKey, DirVal)> {
        let mut out: Vec<(DirKey, DirVal)> = self
            .base
            .dirents
            .iter()
            .filter(|(k, v)| keep(v) && !self.dirents.contains_key(*k))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for (k, v) in &self.dirents {
            if let Some(v) = v.filter(|v| keep(v)) {
                out.push((k.clone(), v));
            }
        }
        out
    }

    /// The whole tree this view shows (a copy).
    pub fn to_tree(&self) -> Tree {
        let mut t = self.base.clone();
        t.seq = Some(self.seq);
        for (k, v) in &self.inodes {
            match v {
                Some(v) => t.inodes.insert(*k, v.clone()),
                None => t.inodes.remove(k),
            };
        }
        for (k, v) in &self.dirents {
            match v {
                Some(v) => t.dirents.insert(k.clone(), *v),
                None => t.dirents.remove(k),
            };
        }
        t
    }

    /// A tree holding only the inodes in `inos` (those this view has) and the entries of
    /// directories and of those inodes: enough to name them and compare them
    /// (`diff::diff_trees`).
    pub fn partial(&self, inos: &BTreeSet<u64>) -> Tree {
        let dir = |v: &DirVal| v.1 & libc::S_IFMT == libc::S_IFDIR || inos.contains(&v.0);
        Tree {
            seq: Some(self.seq),
            chunk_size: self.base.chunk_size,
            inodes: inos
                .iter()
                .filter_map(|i| self.inode(*i).map(|t| (*i, t.clone())))
                .collect(),
            dirents: self
                .dirents_where(dir)
                .into_iter()
                .collect::<BTreeMap<_, _>>(),
        }
    }
}

/// Inodes and entries that may differ between two views (a superset).
#[derive(Debug, Default, Clone)]
pub struct Changed {
    pub inodes: BTreeSet<u64>,
    pub dirents: BTreeSet<DirKey>,
}

impl Changed {
    /// The keys whose records differ between two trees (when nothing narrower is known):
    /// one merged walk of both trees' maps, holding only what differs.
    pub fn between(a: &Tree, b: &Tree) -> Self {
        Changed {
            inodes: differing(&a.inodes, &b.inodes),
            dirents: differing(&a.dirents, &b.dirents),
        }
    }
}

/// The keys of two sorted maps whose values differ (or that only one has).
fn differing<K: Ord + Clone, V: PartialEq>(a: &BTreeMap<K, V>, b: &BTreeMap<K, V>) -> BTreeSet<K> {
    use std::cmp::Ordering;
    let mut out = BTreeSet::new();
    let (mut x, mut y) = (a.iter().peekable(), b.iter().peekable());
    loop {
        match (x.peek(), y.peek()) {
            (None, None) => break,
            (Some((k, _)), None) | (None, Some((k, _))) => {
                out.insert((*k).clone());
                x.next().or_else(|| y.next());
            }
            (Some((ka, va)), Some((kb, vb))) => match ka.cmp(kb) {
                Ordering::Less => {
                    out.insert((*ka).clone());
                    x.next();
                }
                Ordering::Greater => {
                    out.insert((*kb).clone());
                    y.next();
                }
                Ordering::Equal => {
                    if va != vb {
                        out.insert((*ka).clone());
                    }
                    x.next();
                    y.next();
                }
            },
        }
    }
    out
}

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("load snapshot {seq}: {source}")]
    Load { seq: u64, source: Box<RepoError> },
    #[error("replay snapshot {seq}: {source}")]
    Replay {
        seq: u64,
        source: super::format::FormatError,
    },
}

/// See the module doc.
#[derive(Debug, Default)]
pub struct History {
    tree: Tree,
    /// Oldest first; each step's `from` is the one before's `seq`, the last's `seq` is the
    /// tree's.
    steps: VecDeque<Step>,
    records: usize,
}

impl History {
    /// Decodes the chain of `seq` (the one full decode).
    pub fn load(repo: &Repo, seq: u64) -> Result<Self, HistoryError> {
        let (tree, _) = repo.load_tree(seq).map_err(|e| HistoryError::Load {
            seq,
            source: Box::new(e),
        })?;
        Ok(History {
            tree,
            ..Default::default()
        })
    }

    /// The snapshot the tree is at.
    pub fn seq(&self) -> u64 {
        self.tree.seq.unwrap_or(0)
    }

    pub fn tree(&self) -> &Tree {
        &self.tree
    }

    /// Whether the history of a snapshot of `inodes` inodes (its header's count) would be
    /// kept (`worth_keeping`): an inode is about two records, itself and its entry. Lets
    /// an operation that loads the history only to keep it skip the load.
    pub fn would_keep(inodes: u64) -> bool {
        inodes.saturating_mul(2) <= max_tree_records() as u64
    }

    /// Whether to keep the history after the operation that loaded or used it: only while
    /// its tree holds at most `max_tree_records` records (see the module doc). (The worker
    /// also drops it when keel is near its memory budget: `agent::run`.)
    pub fn worth_keeping(&self) -> bool {
        self.worth_keeping_under(max_tree_records())
    }

    fn worth_keeping_under(&self, limit: usize) -> bool {
        self.tree.inodes.len() + self.tree.dirents.len() <= limit
    }

    /// Replays snapshot `seq` (just written by the checkpoint) onto the tree, keeping what
    /// it replaced. `Ok(false)`: it does not follow the tree, or the tree is past
    /// `max_tree_records` (the caller drops the history). The snapshot is read a record at
    /// a time (`format::reader`), never decoded whole.
    pub fn advance(&mut self, repo: &Repo, seq: u64) -> Result<bool, HistoryError> {
        if !self.worth_keeping() {
            return Ok(false);
        }
        self.advance_any(repo, seq)
    }

    /// `advance` whatever the tree's size: for one operation that holds the history only
    /// while it runs (an offline diff: one tree and the undo steps instead of two trees).
    pub fn advance_any(&mut self, repo: &Repo, seq: u64) -> Result<bool, HistoryError> {
        let load = |e: RepoError| HistoryError::Load {
            seq,
            source: Box::new(e),
        };
        let (key, data) = repo.snapshot_object(seq).map_err(|e| load(e.into()))?;
        let replay = |e| HistoryError::Replay { seq, source: e };
        let (h, mut r) = super::format::reader(&key, &data).map_err(replay)?;
        // Every version a window shows has one chunk size (a `View` reports its base's,
        // and a rollback places chunks by it): a snapshot written with another (keel
        // restarted with a new `chunk_size`, whose first checkpoint is a full snapshot on
        // the same line) ends the window, so an older version is decoded from its own chain.
        if self.tree.chunk_size != 0 && h.chunk_size != self.tree.chunk_size {
            return Ok(false);
        }
        let from = self.seq();
        let mut step = Step {
            seq,
            from,
            ..Default::default()
        };
        if h.is_full() {
            // A full snapshot (compaction) describes the same workspace: what it changed
            // is found by comparing, once.
            if h.prev != Some(from) {
                return Ok(false);
            }
            drop(r);
            let mut new = Tree::default();
            new.apply_object(&key, &data).map_err(replay)?;
            for (k, v) in &self.tree.inodes {
                if new.inodes.get(k) != Some(v) {
                    step.inodes.insert(*k, Some(v.clone()));
                }
            }
            for k in new.inodes.keys() {
                if !self.tree.inodes.contains_key(k) {
                    step.inodes.insert(*k, None);
                }
            }
            for (k, v) in &self.tree.dirents {
                if new.dirents.get(k) != Some(v) {
                    step.dirents.insert(k.clone(), Some(*v));
                }
            }
            for k in new.dirents.keys() {
                if !self.tree.dirents.contains_key(k) {
                    step.dirents.insert(k.clone(), None);
                }
            }
            self.tree = new;
        } else {
            if h.parent != Some(from) {
                return Ok(false);
            }
            // What the delta touches, with its value before (one pass over the body), then
            // the delta replayed.
            let tree = &self.tree;
            r.touched(
                |i| {
                    step.inodes
                        .entry(i)
                        .or_insert_with(|| tree.inodes.get(&i).cloned());
                },
                |k| {
                    let old = tree.dirents.get(&k).copied();
                    step.dirents.entry(k).or_insert(old);
                },
            )
            .map_err(replay)?;
            drop(r);
            self.tree.apply_object(&key, &data).map_err(replay)?;
        }
        self.records += step.records();
        self.steps.push_back(step);
        while self.records > max_records() {
            match self.steps.pop_front() {
                Some(s) => self.records -= s.records(),
                None => break,
            }
        }
        Ok(true)
    }

    /// Position of `seq` among the versions the window can show: 0 = the oldest step's
    /// `from`, `steps.len()` = the tree.
    fn position(&self, seq: u64) -> Option<usize> {
        if seq == self.seq() {
            return Some(self.steps.len());
        }
        match self.steps.iter().position(|s| s.seq == seq) {
            Some(i) => Some(i + 1),
            None => self.steps.front().filter(|s| s.from == seq).map(|_| 0),
        }
    }

    /// Whether `seq` can be seen without decoding its chain.
    pub fn has(&self, seq: u64) -> bool {
        self.position(seq).is_some()
    }

    /// The tree as it was at `seq`; `None` outside the window.
    pub fn view(&self, seq: u64) -> Option<View<'_>> {
        let pos = self.position(seq)?;
        let mut v = View::of(&self.tree);
        v.seq = seq;
        // Newest first, so the oldest step after `seq` has the last word.
        for s in self.steps.iter().skip(pos).rev() {
            for (k, old) in &s.inodes {
                v.inodes.insert(*k, old.clone());
            }
            for (k, old) in &s.dirents {
                v.dirents.insert(k.clone(), *old);
            }
        }
        Some(v)
    }

    /// What may differ between snapshots `a` and `b` (both in the window).
    pub fn changed(&self, a: u64, b: u64) -> Option<Changed> {
        let (pa, pb) = (self.position(a)?, self.position(b)?);
        let (lo, hi) = (pa.min(pb), pa.max(pb));
        let mut c = Changed::default();
        for s in self.steps.iter().skip(lo).take(hi - lo) {
            c.inodes.extend(s.inodes.keys().copied());
            c.dirents.extend(s.dirents.keys().cloned());
        }
        Some(c)
    }
}

/// The inodes a diff must look at: the changed inodes and whatever the changed entries
/// name on either side.
pub fn diff_candidates(a: &View, b: &View, c: &Changed) -> BTreeSet<u64> {
    let mut out = c.inodes.clone();
    for (p, n) in &c.dirents {
        for v in [a.dirent(*p, n), b.dirent(*p, n)].into_iter().flatten() {
            out.insert(v.0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::persist::format::{encode, Body, DataRec, DirentRec, Header, InodeRec, TreeData};
    use crate::persist::remote::MemRemote;

    fn tree(n: u64) -> Tree {
        let mut t = Tree {
            seq: Some(1),
            chunk_size: 4,
            ..Default::default()
        };
        for ino in 1..=n {
            let rec = InodeRec::test(ino, libc::S_IFREG | 0o644, DataRec::None);
            t.inodes.insert(
                ino,
                TreeInode {
                    rec,
                    data: TreeData::Inline(Vec::new()),
                },
            );
            t.dirents
                .insert((1, ino.to_string().into_bytes()), (ino, libc::S_IFREG));
        }
        t
    }

    fn dirent(parent: u64, name: &str, ino: u64) -> DirentRec {
        DirentRec {
            parent,
            name: name.as_bytes().to_vec(),
            ino,
            kind: libc::S_IFREG,
        }
    }

    fn put(repo: &Repo, h: &Header, b: &Body) {
        repo.put_snapshot(h.seq, encode(h, b).unwrap()).unwrap();
    }

    /// Snapshots 1-3 on one line: 1 the full `tree(20)`; 2 resizes 3 (to 7), rewrites 4,
    /// removes 5 and names 3 "new" too; 3 removes 6 and "new".
    fn line_of_three(repo: &Repo) {
        let t = tree(20);
        repo.put_test(1, None, &t.full_body());
        let mut d2 = Body {
            inodes: vec![t.inodes[&3].rec.clone(), t.inodes[&4].rec.clone()],
            deleted: vec![5],
            unlinked: vec![(1, b"5".to_vec())],
            dirents: vec![dirent(1, "new", 3)],
        };
        d2.inodes[0].size = 7;
        repo.put_test(2, Some(1), &d2);
        let d3 = Body {
            deleted: vec![6],
            unlinked: vec![(1, b"6".to_vec()), (1, b"new".to_vec())],
            ..Default::default()
        };
        repo.put_test(3, Some(2), &d3);
    }

    #[test]
    fn the_streamed_chain_and_steps_show_every_snapshot_as_decoded() {
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        line_of_three(&repo);
        // A compaction: the tree of 3 again, as a full snapshot.
        let (t3, _) = repo.load_tree(3).unwrap();
        let f4 = t3.full_body();
        repo.put_test(4, None, &f4);

        // Each tree as the whole-body decode makes it.
        let whole = |seq: u64| {
            let mut chain = Vec::new();
            let mut at = Some(seq);
            while let Some(s) = at {
                let (h, b) = repo.read_snapshot(s).unwrap();
                at = h.parent;
                chain.push((h, b));
            }
            let mut t = Tree::default();
            for (h, b) in chain.into_iter().rev() {
                t.apply(&h, b).unwrap();
            }
            t
        };
        for seq in 1..=4 {
            assert_eq!(
                repo.load_tree(seq).unwrap().0,
                whole(seq),
                "load_tree({seq})"
            );
        }
        assert_eq!(t3.inodes[&3].rec.size, 7);
        assert!(!t3.inodes.contains_key(&5) && !t3.dirents.contains_key(&(1, b"new".to_vec())));

        // The history from 1, advanced by each, shows each.
        let mut h = History::load(&repo, 1).unwrap();
        for seq in 2..=4 {
            assert!(h.advance(&repo, seq).unwrap(), "advance to {seq}");
        }
        for seq in 1..=4 {
            let v = h.view(seq).unwrap();
            let mut want = whole(seq);
            want.seq = Some(seq);
            let mut got = v.to_tree();
            got.chunk_size = want.chunk_size;
            assert_eq!(got, want, "view({seq})");
        }
        let c = h.changed(1, 3).unwrap();
        assert_eq!(c.inodes, [3, 4, 5, 6].into_iter().collect());
        // A snapshot that does not follow the tree ends the history.
        repo.put_test(6, Some(5), &Body::default());
        assert!(!h.advance(&repo, 6).unwrap());
    }

    #[test]
    fn an_offline_diff_along_the_chain_is_the_diff_of_the_whole_trees() {
        use crate::persist::diff::{diff, diff_along, diff_trees};
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        line_of_three(&repo);
        let whole = |a: u64, b: u64| {
            diff_trees(&repo.load_tree(a).unwrap().0, &repo.load_tree(b).unwrap().0)
        };
        for (a, b) in [(1, 2), (1, 3), (2, 3), (3, 1)] {
            let want = whole(a, b);
            assert!(!want.changes.is_empty(), "{a} -> {b}");
            assert_eq!(diff_along(&repo, a, b), Some(want.clone()), "{a} -> {b}");
            assert_eq!(diff(&repo, a, b).unwrap(), want, "{a} -> {b}");
        }
        // 4 follows 2, not 3 (another line): the whole trees are compared instead.
        repo.put_test(4, Some(2), &Body::default());
        assert_eq!(diff_along(&repo, 3, 4), None);
        assert!(!whole(3, 4).changes.is_empty());
        assert_eq!(diff(&repo, 3, 4).unwrap(), whole(3, 4));
    }

    #[test]
    fn a_walk_along_the_snapshots_stops_at_a_chunk_size_change_and_past_max_along() {
        use crate::persist::diff::{diff, diff_along, diff_trees};
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        let full = tree(5).full_body();
        repo.put_test(1, None, &full);
        // keel restarted with another chunk size: its first checkpoint is a full snapshot
        // on the same line (prev = 1) with the new size.
        let mut h2 = Header::test(2, None);
        h2.chunk_size = 8;
        let mut changed = full.clone();
        changed.inodes[0].size = 3;
        put(&repo, &h2, &changed);
        let mut h = History::load(&repo, 1).unwrap();
        assert!(
            !h.advance_any(&repo, 2).unwrap(),
            "the window must not span two chunk sizes"
        );
        assert_eq!(diff_along(&repo, 1, 2), None);
        let whole = diff_trees(&repo.load_tree(1).unwrap().0, &repo.load_tree(2).unwrap().0);
        assert!(!whole.changes.is_empty());
        assert_eq!(diff(&repo, 1, 2).unwrap(), whole);

        // A long line of empty deltas after 2: walked up to MAX_ALONG snapshots, not past.
        let last = 2 + MAX_ALONG + 1;
        for seq in 3..=last {
            let mut hd = Header::test(seq, Some(seq - 1));
            hd.chunk_size = 8;
            put(&repo, &hd, &Body::default());
        }
        assert!(diff_along(&repo, 2, 2 + MAX_ALONG).is_some());
        assert_eq!(diff_along(&repo, 2, last), None);
        assert!(diff(&repo, 2, last).unwrap().changes.is_empty());
    }

    #[test]
    fn changed_between_two_trees_is_exactly_what_differs() {
        let a = tree(10);
        let mut b = tree(12);
        b.inodes.remove(&2);
        b.inodes.get_mut(&5).unwrap().rec.size = 9;
        b.dirents.remove(&(1, b"3".to_vec()));
        b.dirents.insert((1, b"4".to_vec()), (7, libc::S_IFREG));
        let c = Changed::between(&a, &b);
        assert_eq!(c.inodes, [2, 5, 11, 12].into_iter().collect());
        let names: BTreeSet<DirKey> = ["3", "4", "11", "12"]
            .iter()
            .map(|n| (1, n.as_bytes().to_vec()))
            .collect();
        assert_eq!(c.dirents, names);
        assert_eq!(Changed::between(&b, &a).inodes, c.inodes);
        assert!(Changed::between(&a, &a).inodes.is_empty());
        assert!(Changed::between(&Tree::default(), &a).inodes.len() == 10);
    }

    #[test]
    fn only_a_small_tree_is_worth_keeping() {
        let n = max_tree_records() as u64 / 2;
        assert!(History::would_keep(n) && !History::would_keep(n + 1));
        let h = History {
            tree: tree(10),
            ..Default::default()
        };
        assert!(h.worth_keeping_under(20));
        assert!(!h.worth_keeping_under(19));
        assert!(h.worth_keeping());
    }
}

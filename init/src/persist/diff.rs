//! What changed between two snapshots: paths added, removed, modified (content, mode,
//! owner, xattrs, symlink target, type) and renamed (the same inode under another path),
//! with sizes; and a unified diff of one text file.
//!
//! Cost: against a running keel (`agent::Op::Diff`), two snapshots in the checkpoint
//! worker's history (`history`) are compared through `diff_views`: only the inodes and
//! entries the snapshots between them touched, plus one pass over the entries to name them.
//! Otherwise (a stopped workspace, a large one, or a snapshot older than the history), the
//! same parts of the two trees are read from the chains through a filter (`sparse`: what
//! the deltas between them touched, or across a full snapshot what either chain's deltas
//! touched and what differs between the two full snapshots, read as sorted streams
//! (`across`); then the entries naming it and the directories). Only when a full snapshot
//! does not list its records in key order is the older tree advanced along the snapshots
//! to the newer (`diff_along`: one tree and the changes), or both trees materialized from
//! their chains (`Repo::load_tree`) and compared whole. File contents are
//! compared by their chunk ids, never by reading chunks; only `-- PATH` fetches chunks, of
//! that one file.
//!
//! The changes come out one at a time in tree order (`each`: a depth-first walk of both
//! trees, one path buffer each) and are written as they come (`out::Answer`, text or
//! JSON): `keel diff` and `GET /diff` never hold the answer, so a chain of 30,000
//! directories costs keel a path, not the 900 MB of all of them. `diff_trees` and friends
//! collect the same changes, for callers that want them whole.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use super::format::{DirentRec, Tree, TreeData, TreeInode};
use super::history::{Changed, History, View};
use super::repo::{Repo, RepoError};
use crate::chunk::ChunkId;

mod across;
mod each;
mod out;

pub use each::each as diff_trees_each;
pub use out::{Answer, Format};

#[derive(Debug, thiserror::Error)]
pub enum DiffError {
    #[error("load snapshot {seq}: {source}")]
    Load { seq: u64, source: Box<RepoError> },
    #[error("{path}: no such file in snapshot {seq}")]
    NoPath { path: String, seq: u64 },
    #[error("{path}: not a regular file in snapshot {seq}")]
    NotFile { path: String, seq: u64 },
    #[error(
        "{path}: its entry names inode {ino}, which snapshot {seq} does not hold (run `keel fsck`)"
    )]
    Dangling { path: String, ino: u64, seq: u64 },
    #[error("fetch chunk {id} of {path}: {source}")]
    Fetch {
        id: ChunkId,
        path: String,
        source: Box<RepoError>,
    },
    #[error(
        "the diff has {entries} changed entries, more than [control] diff_max_entries = {limit} (compare nearer snapshots, or raise the limit)"
    )]
    TooMany { entries: u64, limit: u64 },
    #[error("write the diff: {0}")]
    Write(#[source] std::io::Error),
}

/// One changed path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    /// `added`, `removed`, `modified` or `renamed`.
    pub change: &'static str,
    pub path: String,
    /// For `renamed`: the path in the first snapshot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// `file`, `dir`, `symlink`, `fifo`, `socket`, `char`, `block`.
    pub kind: &'static str,
    /// What differs: `content`, `mode`, `owner`, `xattrs`, `target`, `type`.
    pub what: Vec<&'static str>,
    pub size_before: Option<u64>,
    pub size_after: Option<u64>,
}

/// The changes between two trees, sorted by path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Diff {
    pub from: u64,
    pub to: u64,
    pub changes: Vec<Change>,
}

fn kind_of(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "file",
        libc::S_IFDIR => "dir",
        libc::S_IFLNK => "symlink",
        libc::S_IFIFO => "fifo",
        libc::S_IFSOCK => "socket",
        libc::S_IFCHR => "char",
        libc::S_IFBLK => "block",
        _ => "unknown",
    }
}

/// Inodes whose record, bytes or entries differ between `a` and `b`.
fn candidates(a: &Tree, b: &Tree) -> BTreeSet<u64> {
    let mut c = BTreeSet::new();
    for (ino, ta) in &a.inodes {
        if b.inodes.get(ino) != Some(ta) {
            c.insert(*ino);
        }
    }
    for ino in b.inodes.keys() {
        if !a.inodes.contains_key(ino) {
            c.insert(*ino);
        }
    }
    for (k, v) in &a.dirents {
        match b.dirents.get(k) {
            Some(w) if w == v => {}
            Some(w) => {
                c.insert(v.0);
                c.insert(w.0);
            }
            None => {
                c.insert(v.0);
            }
        }
    }
    for (k, v) in &b.dirents {
        if !a.dirents.contains_key(k) {
            c.insert(v.0);
        }
    }
    c
}

fn what_changed(a: &TreeInode, b: &TreeInode) -> Vec<&'static str> {
    let mut w = Vec::new();
    if a.rec.mode & libc::S_IFMT != b.rec.mode & libc::S_IFMT {
        return vec!["type"];
    }
    let link = a.rec.mode & libc::S_IFMT == libc::S_IFLNK;
    if !link && (a.data != b.data || a.rec.size != b.rec.size || a.rec.rdev != b.rec.rdev) {
        w.push("content");
    }
    if a.rec.mode != b.rec.mode {
        w.push("mode");
    }
    if (a.rec.uid, a.rec.gid) != (b.rec.uid, b.rec.gid) {
        w.push("owner");
    }
    let mut xa = a.rec.xattrs.clone();
    let mut xb = b.rec.xattrs.clone();
    xa.sort();
    xb.sort();
    if xa != xb {
        w.push("xattrs");
    }
    if link && a.data != b.data {
        w.push("target");
    }
    w
}

/// Compares two trees (`a` the older): every change, in tree order ([`diff_trees_each`]
/// hands them out one at a time instead).
pub fn diff_trees(a: &Tree, b: &Tree) -> Diff {
    let mut changes = Vec::new();
    let r = diff_trees_each(a, b, 0, &mut |c| {
        changes.push(c.clone());
        Ok(())
    });
    debug_assert!(r.is_ok(), "no limit, and collecting cannot fail");
    Diff {
        from: a.seq.unwrap_or(0),
        to: b.seq.unwrap_or(0),
        changes,
    }
}

/// Compares two snapshots seen through the checkpoint worker's history: only the inodes
/// `changed` names (and the entries that name them and the directories) are looked at.
pub fn diff_views(a: &View, b: &View, changed: &Changed) -> Diff {
    let cand = super::history::diff_candidates(a, b, changed);
    diff_trees(&a.partial(&cand), &b.partial(&cand))
}

/// [`diff_views`], each change handed to `out` as it is found (`limit`: as
/// [`diff_trees_each`]).
pub fn diff_views_each(
    a: &View,
    b: &View,
    changed: &Changed,
    limit: u64,
    out: &mut dyn FnMut(&Change) -> Result<(), DiffError>,
) -> Result<(), DiffError> {
    let cand = super::history::diff_candidates(a, b, changed);
    let (ta, tb) = (a.partial(&cand), b.partial(&cand));
    drop(cand);
    diff_trees_each(&ta, &tb, limit, out)
}

/// [`diff_how`], each change handed to `out` as it is found (`limit`: as
/// [`diff_trees_each`]); returns how it got the trees.
pub fn diff_how_each(
    repo: &Repo,
    from: u64,
    to: u64,
    limit: u64,
    out: &mut dyn FnMut(&Change) -> Result<(), DiffError>,
) -> Result<&'static str, DiffError> {
    if let Some(s) = sparse(repo, from, to)? {
        diff_trees_each(&s.from, &s.to, limit, out)?;
        return Ok(s.how);
    }
    if from != to {
        if let Some((h, changed)) = along(repo, from, to) {
            if let (Some(a), Some(b)) = (h.view(from), h.view(to)) {
                diff_views_each(&a, &b, &changed, limit, out)?;
                return Ok("along");
            }
        }
    }
    let load = |seq| load_tree(repo, seq);
    let a = load(from)?;
    let b = if to == from { None } else { Some(load(to)?) };
    diff_trees_each(&a, b.as_ref().unwrap_or(&a), limit, out)?;
    Ok("decoded")
}

/// Snapshot `seq`'s whole tree, decoded.
fn load_tree(repo: &Repo, seq: u64) -> Result<Tree, DiffError> {
    repo.load_tree(seq)
        .map(|(t, _)| t)
        .map_err(|source| DiffError::Load {
            seq,
            source: Box::new(source),
        })
}

/// Compares two snapshots: from the parts of their trees that can differ (`diff_sparse`),
/// else along the line of snapshots between them when each follows the one before
/// (`diff_along`), else both trees loaded whole.
pub fn diff(repo: &Repo, from: u64, to: u64) -> Result<Diff, DiffError> {
    diff_how(repo, from, to).map(|(d, _)| d)
}

/// [`diff`], and how it got the trees (`"sparse"`, `"merged"`, `"along"` or `"decoded"`), for programs
/// that measure; the changes are the same whichever way.
pub fn diff_how(repo: &Repo, from: u64, to: u64) -> Result<(Diff, &'static str), DiffError> {
    if let Some(d) = diff_sparse_how(repo, from, to)? {
        return Ok(d);
    }
    if from != to {
        if let Some(d) = diff_along(repo, from, to) {
            return Ok((d, "along"));
        }
    }
    let load = |seq| load_tree(repo, seq);
    let a = load(from)?;
    let b = if to == from { None } else { Some(load(to)?) };
    Ok((diff_trees(&a, b.as_ref().unwrap_or(&a)), "decoded"))
}

/// The two sides of a diff as far as it looks at them: each snapshot's tree holding only
/// the inodes that may differ (`cand`: what the deltas between them touched, and whatever a
/// touched entry names on either side), the entries naming those inodes and every
/// directory's entry (to name them): the trees `View::partial` gives from the history. A
/// rollback asks about more than that (what changed after its checkpoint): `read_to` reads
/// it from the chain, which the `Sparse` keeps (compressed, as fetched).
pub struct Sparse {
    pub from: Tree,
    pub to: Tree,
    pub changed: Changed,
    pub cand: BTreeSet<u64>,
    chain: Vec<(String, bytes::Bytes)>,
    /// The `to` side's object in `chain`.
    to_at: usize,
    /// How the sides were read: `"sparse"` (along one chain) or `"merged"` (two chains).
    pub how: &'static str,
}

impl Sparse {
    /// Whether `self.to` answers for inode `ino` (else only `read_to` can).
    pub fn covers_inode(&self, ino: u64) -> bool {
        self.cand.contains(&ino)
    }

    /// Whether `self.to` answers for the entry `(parent, name)`: an entry it holds is the
    /// snapshot's, and a touched entry it does not hold is not in the snapshot (what a
    /// touched entry names is in `cand`, so kept); any other may be one it filtered out.
    pub fn covers_entry(&self, parent: u64, name: &[u8]) -> bool {
        let k = (parent, name.to_vec());
        self.to.dirents.contains_key(&k) || self.changed.dirents.contains(&k)
    }

    /// The records of the `to` snapshot for `inodes` and the entries `entries`, and every
    /// entry naming one of `inodes`: one more filtered replay of its chain.
    pub fn read_to(
        &self,
        inodes: &BTreeSet<u64>,
        entries: &BTreeSet<(u64, Vec<u8>)>,
    ) -> Result<Tree, DiffError> {
        let index = by_parent(entries);
        let mut t = Tree::default();
        t.apply_objects_where(
            &self.chain[..=self.to_at],
            |i| inodes.contains(&i),
            |d| inodes.contains(&d.ino) || index.has(d),
        )
        .map_err(|e| DiffError::Load {
            seq: self.to.seq.unwrap_or(0),
            source: Box::new(RepoError::from(e)),
        })?;
        Ok(t)
    }
}

/// Entry keys looked up by parent, so that a filter allocates nothing per entry.
struct ByParent<'a>(HashMap<u64, std::collections::HashSet<&'a [u8]>>);

fn by_parent(keys: &BTreeSet<(u64, Vec<u8>)>) -> ByParent<'_> {
    let mut m: HashMap<u64, std::collections::HashSet<&[u8]>> = HashMap::new();
    for (p, n) in keys {
        m.entry(*p).or_default().insert(n.as_slice());
    }
    ByParent(m)
}

impl ByParent<'_> {
    fn has(&self, d: &DirentRec) -> bool {
        self.0
            .get(&d.parent)
            .is_some_and(|names| names.contains(d.name.as_slice()))
    }
}

/// [`Sparse`] for `from` and `to`: the parts of their trees that can differ, without
/// either tree whole. When the older one is on the newer one's chain (only deltas between
/// them, as checkpoints make them), the keys those deltas touch are all that can differ;
/// the newer's chain is fetched once (held compressed, as `Repo::load_tree` holds it) and
/// the older side taken on the way (`how`: `"sparse"`). Otherwise (a full snapshot between
/// them, or two branches) each one's chain is fetched, and what can differ is what the
/// deltas of either chain touch plus what differs between the two full snapshots they
/// start from, read as two sorted streams (`across`; `how`: `"merged"`). Either way each
/// side is then replayed twice through a filter: first only the touched entries (what they
/// name on each side), then the inodes that may differ, their entries and the directories'.
/// Memory of the change and the directories, not of the tree. `None` when a full snapshot
/// does not list its records in key order (see `across`).
pub fn sparse(repo: &Repo, from: u64, to: u64) -> Result<Option<Sparse>, DiffError> {
    let (lo, hi) = (from.min(to), from.max(to));
    let load = |seq: u64| {
        move |source| DiffError::Load {
            seq,
            source: Box::new(source),
        }
    };
    let format = |seq: u64| move |e: super::format::FormatError| load(seq)(RepoError::from(e));
    let chain = repo.chain_objects(hi).map_err(load(hi))?;
    let mut at = None;
    for (i, (key, b)) in chain.iter().enumerate() {
        if super::format::decode_header(key, b)
            .map_err(format(hi))?
            .0
            .seq
            == lo
        {
            at = Some(i);
        }
    }
    let mut changed = Changed::default();
    let mut older_chain = None;
    let touched_by = |objects: &[(String, bytes::Bytes)], changed: &mut Changed, seq: u64| {
        for (key, b) in objects {
            let (_, mut r) = super::format::reader(key, b).map_err(format(seq))?;
            r.touched(
                |i| {
                    changed.inodes.insert(i);
                },
                |k| {
                    changed.dirents.insert(k);
                },
            )
            .map_err(format(seq))?;
        }
        Ok::<_, DiffError>(())
    };
    // The older side replays `older`; the newer replays `newer`, after the older side's
    // tree when they are one chain (`newer` is then the rest of it).
    let (older, newer, one_chain, how) = match at {
        // The older side is the tree right after its own object; the newer the whole chain.
        Some(at) => {
            touched_by(&chain[at + 1..], &mut changed, hi)?;
            let (before, after) = chain.split_at(at + 1);
            (before, after, true, "sparse")
        }
        None => {
            let older = older_chain.insert(repo.chain_objects(lo).map_err(load(lo))?);
            touched_by(&older[1..], &mut changed, lo)?;
            touched_by(&chain[1..], &mut changed, hi)?;
            let ((ka, a), (kb, b)) = (&older[0], &chain[0]);
            // An error names the snapshot whose chain holds the object that cannot be read.
            let named = |e| format(if across::reads_whole(ka, a) { hi } else { lo })(e);
            if ka != kb && !across::fulls_differ((ka, a), (kb, b), &mut changed).map_err(named)? {
                return Ok(None);
            }
            (&older[..], &chain[..], false, "merged")
        }
    };
    let replay = |keep_inode: &dyn Fn(u64) -> bool, keep_entry: &dyn Fn(&DirentRec) -> bool| {
        let mut older_tree = Tree::default();
        older_tree
            .apply_objects_where(older, keep_inode, keep_entry)
            .map_err(format(lo))?;
        let mut newer_tree = if one_chain {
            older_tree.clone()
        } else {
            Tree::default()
        };
        newer_tree
            .apply_objects_where(newer, keep_inode, keep_entry)
            .map_err(format(hi))?;
        Ok::<_, DiffError>(if from <= to {
            (older_tree, newer_tree)
        } else {
            (newer_tree, older_tree)
        })
    };
    let touched = by_parent(&changed.dirents);
    let (a, b) = replay(&|_| false, &|d| touched.has(d))?;
    let mut cand = changed.inodes.clone();
    cand.extend(a.dirents.values().chain(b.dirents.values()).map(|v| v.0));
    let (a, b) = replay(&|i| cand.contains(&i), &|d| {
        d.kind & libc::S_IFMT == libc::S_IFDIR || cand.contains(&d.ino)
    })?;
    drop(touched);
    // The `to` side's chain, for `read_to`.
    let (chain, to_at) = match (older_chain, at) {
        (_, Some(at)) => {
            let to_at = if from <= to { chain.len() - 1 } else { at };
            (chain, to_at)
        }
        (Some(older), None) if to < from => {
            let n = older.len();
            (older, n - 1)
        }
        _ => {
            let n = chain.len();
            (chain, n - 1)
        }
    };
    Ok(Some(Sparse {
        from: a,
        to: b,
        changed,
        cand,
        chain,
        to_at,
        how,
    }))
}

/// [`diff_trees`] of the two sides [`sparse`] gives: the same changes as the whole trees'.
pub fn diff_sparse(repo: &Repo, from: u64, to: u64) -> Result<Option<Diff>, DiffError> {
    Ok(diff_sparse_how(repo, from, to)?.map(|(d, _)| d))
}

fn diff_sparse_how(
    repo: &Repo,
    from: u64,
    to: u64,
) -> Result<Option<(Diff, &'static str)>, DiffError> {
    Ok(sparse(repo, from, to)?.map(|s| (diff_trees(&s.from, &s.to), s.how)))
}

/// `from` and `to` when every snapshot from the older to the newer follows the one before
/// (as checkpoints make them): the older one's tree is loaded and advanced by each, keeping
/// what each replaced (`History`), and the two are compared through `diff_views`. One tree
/// and the changes in memory instead of two trees (a million files: ~550 MiB, not ~1.1
/// GiB). `None` (the caller loads both trees, and reports any error) when a snapshot between
/// them is missing, does not follow or has another chunk size, when they are more than
/// `history::MAX_ALONG` apart, or when the changes outgrew the history's window.
pub(super) fn diff_along(repo: &Repo, from: u64, to: u64) -> Option<Diff> {
    let (h, changed) = along(repo, from, to)?;
    let (a, b) = (h.view(from)?, h.view(to)?);
    Some(diff_views(&a, &b, &changed))
}

/// The history [`diff_along`] compares through, and what changed between the two.
fn along(repo: &Repo, from: u64, to: u64) -> Option<(History, Changed)> {
    let (lo, hi) = (from.min(to), from.max(to));
    if hi - lo > super::history::MAX_ALONG {
        return None;
    }
    let mut h = History::load(repo, lo).ok()?;
    for seq in lo + 1..=hi {
        // Stop as soon as the older one is out of the window: the walk would be for nothing.
        if !h.advance_any(repo, seq).ok()? || !h.has(lo) {
            return None;
        }
    }
    let changed = h.changed(from, to)?;
    Some((h, changed))
}

/// The diff as text: one line per change, then a summary (no newline after it).
pub fn render(d: &Diff) -> String {
    let mut a = Answer::new(Vec::new(), Format::Text, d.from, d.to);
    for c in &d.changes {
        let _ = a.change(c);
    }
    let mut text = String::from_utf8(a.finish(&[]).unwrap_or_default()).unwrap_or_default();
    text.pop();
    text
}

/// The names `path` walks (`/`-separated, relative to the workspace root; empty and `.`
/// parts skipped).
fn components(path: &str) -> impl Iterator<Item = &str> {
    path.split('/').filter(|p| !p.is_empty() && *p != ".")
}

/// The inode at `path` in `t`.
fn lookup(t: &Tree, path: &str) -> Option<u64> {
    let mut ino = crate::meta::InodeNo::ROOT.0;
    for part in components(path) {
        ino = t.dirents.get(&(ino, part.as_bytes().to_vec()))?.0;
    }
    Some(ino)
}

/// The part of snapshot `seq`'s tree that `path` needs, and the inode at `path` if there is
/// one: two replays of the chain's objects (held compressed, as `Repo::load_tree` holds
/// them), the first keeping only the entries named like the path's components (enough to
/// walk it: every entry on the walk has one of those names), the second only that inode. A
/// million-file workspace costs its snapshot objects and a few records, not a whole tree.
fn path_tree(repo: &Repo, seq: u64, path: &str) -> Result<(Tree, Option<u64>), DiffError> {
    let load = |source| DiffError::Load {
        seq,
        source: Box::new(source),
    };
    let chain = repo.chain_objects(seq).map_err(load)?;
    let names: std::collections::HashSet<&[u8]> = components(path).map(str::as_bytes).collect();
    let replay = |keep_inode: &dyn Fn(u64) -> bool, keep_entry: &dyn Fn(&DirentRec) -> bool| {
        let mut t = Tree::default();
        t.apply_objects_where(&chain, keep_inode, keep_entry)
            .map_err(|e| load(RepoError::from(e)))?;
        Ok::<_, DiffError>(t)
    };
    let walk = replay(&|_| false, &|d| names.contains(d.name.as_slice()))?;
    let Some(ino) = lookup(&walk, path) else {
        return Ok((walk, None));
    };
    Ok((replay(&|i| i == ino, &|_| false)?, Some(ino)))
}

/// The bytes of the regular file `ino` (at `path`) in `t`, the tree of snapshot `seq`;
/// `None` without an inode (a file added or removed between the two).
fn file_bytes(
    repo: &Repo,
    t: &Tree,
    seq: u64,
    path: &str,
    ino: Option<u64>,
) -> Result<Option<Vec<u8>>, DiffError> {
    let Some(ino) = ino else {
        return Ok(None);
    };
    let Some(node) = t.inodes.get(&ino) else {
        return Err(DiffError::Dangling {
            path: path.into(),
            ino,
            seq,
        });
    };
    if node.rec.mode & libc::S_IFMT != libc::S_IFREG {
        return Err(DiffError::NotFile {
            path: path.into(),
            seq,
        });
    }
    let mut out = match &node.data {
        TreeData::Inline(v) => v.clone(),
        TreeData::Chunks(map) => {
            let ids: Vec<ChunkId> = map.iter().flatten().copied().collect();
            let mut got = repo.get_chunks(&ids).into_iter();
            let mut out = Vec::new();
            for id in map {
                match id {
                    None => out.resize(out.len() + t.chunk_size as usize, 0),
                    Some(id) => {
                        let b = got.next().expect("one result per id").map_err(|source| {
                            DiffError::Fetch {
                                id: *id,
                                path: path.into(),
                                source: Box::new(source),
                            }
                        })?;
                        out.extend_from_slice(&b);
                    }
                }
            }
            out
        }
        _ => Vec::new(),
    };
    out.resize(node.rec.size as usize, 0);
    Ok(Some(out))
}

/// A unified diff of the text file `path` between snapshots `from` and `to`.
pub fn file_diff(repo: &Repo, from: u64, to: u64, path: &str) -> Result<String, DiffError> {
    // Both snapshots found before any chunk is fetched (a missing one is the first error).
    let (ta, ia) = path_tree(repo, from, path)?;
    let (tb, ib) = path_tree(repo, to, path)?;
    let a = file_bytes(repo, &ta, from, path, ia)?;
    let b = file_bytes(repo, &tb, to, path, ib)?;
    if a.is_none() && b.is_none() {
        return Err(DiffError::NoPath {
            path: path.into(),
            seq: to,
        });
    }
    let clean = path.trim_start_matches('/');
    let (la, lb) = (
        if a.is_some() {
            format!("a/{clean}@{from}")
        } else {
            "/dev/null".into()
        },
        if b.is_some() {
            format!("b/{clean}@{to}")
        } else {
            "/dev/null".into()
        },
    );
    let (a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
    if a.contains(&0) || b.contains(&0) {
        return Ok(if a == b {
            String::new()
        } else {
            format!("Binary files {la} and {lb} differ\n")
        });
    }
    Ok(unified(&la, &lb, &a, &b, 3))
}

/// Lines of `t`, each with its newline.
fn lines(t: &[u8]) -> Vec<&[u8]> {
    t.split_inclusive(|&c| c == b'\n').collect()
}

/// Most cells the line diff's table may have (lines changed in `a` times lines in `b`).
const MAX_CELLS: usize = 16 << 20;

/// A unified diff of `a` and `b` with `ctx` lines of context (a longest common
/// subsequence of the lines between their common head and tail).
pub fn unified(la: &str, lb: &str, a: &[u8], b: &[u8], ctx: usize) -> String {
    use std::fmt::Write;
    let (xa, xb) = (lines(a), lines(b));
    let head = xa.iter().zip(&xb).take_while(|(x, y)| x == y).count();
    let tail = xa[head..]
        .iter()
        .rev()
        .zip(xb[head..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (ma, mb) = (&xa[head..xa.len() - tail], &xb[head..xb.len() - tail]);
    if ma.is_empty() && mb.is_empty() {
        return String::new();
    }
    if (ma.len() + 1) * (mb.len() + 1) > MAX_CELLS {
        return format!(
            "--- {la}\n+++ {lb}\n(too many changed lines for a line diff: {} and {})\n",
            ma.len(),
            mb.len()
        );
    }
    // lcs[i][j]: longest common subsequence of ma[i..] and mb[j..].
    let w = mb.len() + 1;
    let mut lcs = vec![0u32; (ma.len() + 1) * w];
    for i in (0..ma.len()).rev() {
        for j in (0..mb.len()).rev() {
            lcs[i * w + j] = if ma[i] == mb[j] {
                lcs[(i + 1) * w + j + 1] + 1
            } else {
                lcs[(i + 1) * w + j].max(lcs[i * w + j + 1])
            };
        }
    }
    // The edit script over the whole files: (tag, line index in a, line index in b).
    let mut ops: Vec<(u8, usize, usize)> = (0..head).map(|k| (b' ', k, k)).collect();
    let (mut i, mut j) = (0, 0);
    while i < ma.len() || j < mb.len() {
        if i < ma.len() && j < mb.len() && ma[i] == mb[j] {
            ops.push((b' ', head + i, head + j));
            i += 1;
            j += 1;
        } else if i < ma.len() && (j == mb.len() || lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
            ops.push((b'-', head + i, head + j));
            i += 1;
        } else {
            ops.push((b'+', head + i, head + j));
            j += 1;
        }
    }
    for k in 0..tail {
        ops.push((b' ', xa.len() - tail + k, xb.len() - tail + k));
    }
    let mut out = format!("--- {la}\n+++ {lb}\n");
    let changed: Vec<usize> = (0..ops.len()).filter(|&k| ops[k].0 != b' ').collect();
    let mut k = 0;
    while k < changed.len() {
        // One hunk: changes closer than 2*ctx lines of context join.
        let start = changed[k].saturating_sub(ctx);
        let mut end = changed[k];
        while k < changed.len() && changed[k] <= end + 2 * ctx {
            end = changed[k];
            k += 1;
        }
        let end = (end + ctx + 1).min(ops.len());
        let hunk = &ops[start..end];
        let na = hunk.iter().filter(|o| o.0 != b'+').count();
        let nb = hunk.iter().filter(|o| o.0 != b'-').count();
        let (sa, sb) = (hunk[0].1, hunk[0].2);
        let at = |s: usize, n: usize| if n == 0 { s } else { s + 1 };
        let _ = writeln!(out, "@@ -{},{na} +{},{nb} @@", at(sa, na), at(sb, nb));
        for &(tag, ia, ib) in hunk {
            let line = if tag == b'+' { xb[ib] } else { xa[ia] };
            out.push(tag as char);
            out.push_str(&String::from_utf8_lossy(line));
            if !line.ends_with(b"\n") {
                out.push_str("\n\\ No newline at end of file\n");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::format::{Body, DataRec, DirentRec, InodeRec};
    use crate::persist::remote::MemRemote;
    use std::sync::Arc;

    /// The part of snapshot `seq`'s whole tree a sparse side must hold: the inodes in
    /// `cand`, the entries naming them and every directory's entry.
    fn part_of(repo: &Repo, seq: u64, cand: &BTreeSet<u64>) -> Tree {
        let mut t = repo.load_tree(seq).unwrap().0;
        t.inodes.retain(|i, _| cand.contains(i));
        t.dirents
            .retain(|_, v| v.1 & libc::S_IFMT == libc::S_IFDIR || cand.contains(&v.0));
        t
    }

    /// `sparse(a, b)`'s candidates hold every inode whose record differs between the whole
    /// trees and every inode a differing entry names; its sides are exactly `part_of` the
    /// whole trees, and its diff theirs.
    fn assert_sparse_is_whole(repo: &Repo, a: u64, b: u64) {
        let s = sparse(repo, a, b).unwrap().expect("records in key order");
        let (ta, tb) = (repo.load_tree(a).unwrap().0, repo.load_tree(b).unwrap().0);
        let differ = Changed::between(&ta, &tb);
        assert!(differ.inodes.is_subset(&s.cand), "{a} -> {b}");
        for k in &differ.dirents {
            for v in [ta.dirents.get(k), tb.dirents.get(k)].into_iter().flatten() {
                assert!(s.cand.contains(&v.0), "{a} -> {b}: {k:?}");
            }
        }
        assert_eq!(s.from, part_of(repo, a, &s.cand), "{a} side of {a} -> {b}");
        assert_eq!(s.to, part_of(repo, b, &s.cand), "{b} side of {a} -> {b}");
        assert_eq!(
            diff_trees(&s.from, &s.to),
            diff_trees(&ta, &tb),
            "{a} -> {b}"
        );
    }

    /// `keel diff -- PATH` reads only the entries named like the path's components and the
    /// one inode, and answers as the whole trees would: names that also occur elsewhere
    /// (`f` at the root, `e/d/f`), a file changed, added, removed, and no such path.
    #[test]
    fn a_file_diff_from_the_path_alone_is_the_file_diff_of_the_whole_trees() {
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        let (reg, dk) = (libc::S_IFREG, libc::S_IFDIR);
        repo.put_test(
            1,
            None,
            &Body {
                inodes: vec![
                    InodeRec::test_dir(1),
                    InodeRec::test_dir(2),
                    InodeRec::test_file(3, "one\ntwo\n"),
                    InodeRec::test_file(4, "gee\n"),
                    InodeRec::test_file(5, "root f\n"),
                    InodeRec::test_dir(6),
                    InodeRec::test_dir(7),
                    InodeRec::test_file(8, "e/d/f\n"),
                ],
                dirents: vec![
                    DirentRec::test(1, "d", 2, dk),
                    DirentRec::test(2, "f", 3, reg),
                    DirentRec::test(1, "g", 4, reg),
                    DirentRec::test(1, "f", 5, reg),
                    DirentRec::test(1, "e", 6, dk),
                    DirentRec::test(6, "d", 7, dk),
                    DirentRec::test(7, "f", 8, reg),
                ],
                ..Default::default()
            },
        );
        repo.put_test(
            2,
            Some(1),
            &Body {
                inodes: vec![
                    InodeRec::test_file(3, "one\nTWO\n"),
                    InodeRec::test_file(9, "new\n"),
                ],
                deleted: vec![5],
                unlinked: vec![(1, b"f".to_vec())],
                dirents: vec![DirentRec::test(2, "h", 9, reg)],
            },
        );
        // What file_diff answered before: both whole trees loaded.
        let whole = |path: &str| {
            let side = |seq| {
                let t = repo.load_tree(seq).unwrap().0;
                let ino = lookup(&t, path);
                file_bytes(&repo, &t, seq, path, ino).unwrap()
            };
            (side(1), side(2))
        };
        for path in [
            "d/f", "/d/./f", "f", "d/h", "e/d/f", "g", "d", "nope", "d/f/x",
        ] {
            let got = |seq| {
                path_tree(&repo, seq, path)
                    .and_then(|(t, ino)| file_bytes(&repo, &t, seq, path, ino))
                    .map_err(|e| e.to_string())
            };
            let (a, b) = (got(1), got(2));
            if path == "d" {
                assert!(a.unwrap_err().contains("not a regular file"), "{path}");
                continue;
            }
            assert_eq!((a.unwrap(), b.unwrap()), whole(path), "{path}");
        }
        assert_eq!(
            file_diff(&repo, 1, 2, "d/f").unwrap(),
            "--- a/d/f@1\n+++ b/d/f@2\n@@ -1,2 +1,2 @@\n one\n-two\n+TWO\n"
        );
        assert!(file_diff(&repo, 1, 2, "f")
            .unwrap()
            .contains("+++ /dev/null"));
        assert!(file_diff(&repo, 1, 2, "d/h")
            .unwrap()
            .contains("--- /dev/null"));
        assert_eq!(file_diff(&repo, 1, 2, "e/d/f").unwrap(), "");
        assert!(matches!(
            file_diff(&repo, 1, 2, "nope"),
            Err(DiffError::NoPath { .. })
        ));
    }

    /// The filtered replays hold exactly the whole tree's records for what they keep: a
    /// chunk map patched across deltas, a rename, a directory replaced by a file, an inode
    /// number deleted and reused, and an entry whose inode is gone.
    #[test]
    fn the_path_tree_holds_the_whole_trees_records_for_the_path() {
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        let (reg, dk) = (libc::S_IFREG, libc::S_IFDIR);
        let chunks = |complete, patch: Vec<(u64, u8)>| {
            let mut r = InodeRec::test(
                10,
                reg | 0o644,
                DataRec::Chunks {
                    complete,
                    patch: patch.into_iter().map(|(w, b)| (w, Some([b; 32]))).collect(),
                },
            );
            r.size = 8;
            r
        };
        repo.put_test(
            1,
            None,
            &Body {
                inodes: vec![
                    InodeRec::test_dir(1),
                    InodeRec::test_dir(2),
                    InodeRec::test_file(3, "f\n"),
                    InodeRec::test_dir(6),
                    InodeRec::test_dir(7),
                    InodeRec::test_file(9, "nine\n"),
                    chunks(true, vec![(0, 1), (1, 2)]),
                ],
                dirents: vec![
                    DirentRec::test(1, "d", 2, dk),
                    DirentRec::test(2, "f", 3, reg),
                    DirentRec::test(1, "e", 6, dk),
                    DirentRec::test(6, "d", 7, dk),
                    DirentRec::test(7, "h", 9, reg),
                    DirentRec::test(2, "c", 10, reg),
                ],
                ..Default::default()
            },
        );
        repo.put_test(
            2,
            Some(1),
            &Body {
                inodes: vec![chunks(false, vec![(1, 3)])],
                ..Default::default()
            },
        );
        repo.put_test(
            3,
            Some(2),
            &Body {
                // 9 removed and its number reused for e/h; d/f renamed to e/g; the
                // directory e/d replaced by a file; d/x names an inode that is not there.
                inodes: vec![
                    InodeRec::test_file(9, "new nine\n"),
                    InodeRec::test_file(11, "a file now\n"),
                ],
                deleted: vec![9, 7],
                unlinked: vec![(2, b"f".to_vec()), (6, b"d".to_vec()), (7, b"h".to_vec())],
                dirents: vec![
                    DirentRec::test(6, "h", 9, reg),
                    DirentRec::test(6, "g", 3, reg),
                    DirentRec::test(6, "d", 11, reg),
                    DirentRec::test(2, "x", 12, reg),
                ],
            },
        );
        for seq in 1..=3 {
            let whole = repo.load_tree(seq).unwrap().0;
            for path in ["d/c", "d/f", "e/g", "e/h", "e/d", "e/d/h", "d/x"] {
                let (t, ino) = path_tree(&repo, seq, path).unwrap();
                assert_eq!(ino, lookup(&whole, path), "{path}@{seq}");
                if let Some(i) = ino {
                    assert_eq!(t.inodes.get(&i), whole.inodes.get(&i), "{path}@{seq}");
                    assert_eq!(t.inodes.len(), usize::from(whole.inodes.contains_key(&i)));
                }
            }
        }
        assert!(matches!(
            file_diff(&repo, 2, 3, "d/x"),
            Err(DiffError::Dangling {
                ino: 12,
                seq: 3,
                ..
            })
        ));
    }

    /// A diff from the parts of the trees the deltas touch (`sparse`) is the diff of the
    /// whole trees for every pair on one chain, either way round: content and mode changed,
    /// a file added and removed, renames of a file and of a directory, a hard link, an inode
    /// number reused, a directory replaced by a file, an empty delta. The sides hold only
    /// what may differ and the directories. Across a full snapshot the two chains are read
    /// and the full snapshots merged (`"merged"`), with the same answers; a full snapshot
    /// in no useful order is read whole, and `diff` still answers as the whole trees do.
    #[test]
    fn a_sparse_diff_is_the_diff_of_the_whole_trees() {
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        let (reg, dk) = (libc::S_IFREG, libc::S_IFDIR);
        repo.put_test(
            1,
            None,
            &Body {
                inodes: vec![
                    InodeRec::test_dir(1),
                    InodeRec::test_dir(2),
                    InodeRec::test_file(3, "f\n"),
                    InodeRec::test_file(4, "gee\n"),
                    InodeRec::test_dir(6),
                    InodeRec::test_dir(7),
                    InodeRec::test_file(8, "unchanged\n"),
                    InodeRec::test_file(9, "nine\n"),
                ],
                dirents: vec![
                    DirentRec::test(1, "d", 2, dk),
                    DirentRec::test(2, "f", 3, reg),
                    DirentRec::test(1, "g", 4, reg),
                    DirentRec::test(1, "e", 6, dk),
                    DirentRec::test(6, "d", 7, dk),
                    DirentRec::test(1, "u", 8, reg),
                    DirentRec::test(7, "h", 9, reg),
                ],
                ..Default::default()
            },
        );
        repo.put_test(
            2,
            Some(1),
            &Body {
                inodes: vec![
                    InodeRec::test_file(3, "f2\n"),
                    InodeRec::test_file(5, "new\n"),
                ],
                dirents: vec![
                    DirentRec::test(2, "n", 5, reg),
                    DirentRec::test(6, "link", 3, reg),
                ],
                ..Default::default()
            },
        );
        repo.put_test(
            3,
            Some(2),
            &Body {
                inodes: vec![
                    InodeRec::test_file(9, "new nine\n"),
                    InodeRec::test_file(11, "a file now\n"),
                ],
                deleted: vec![4, 9, 7],
                unlinked: vec![
                    (2, b"f".to_vec()),
                    (1, b"g".to_vec()),
                    (6, b"d".to_vec()),
                    (7, b"h".to_vec()),
                ],
                dirents: vec![
                    DirentRec::test(6, "g", 3, reg),
                    DirentRec::test(6, "h", 9, reg),
                    DirentRec::test(6, "d", 11, reg),
                ],
            },
        );
        let mut x = InodeRec::test_file(5, "new\n");
        x.mode = reg | 0o600;
        repo.put_test(
            4,
            Some(3),
            &Body {
                inodes: vec![x],
                unlinked: vec![(1, b"e".to_vec())],
                dirents: vec![DirentRec::test(1, "x", 6, dk)],
                ..Default::default()
            },
        );
        repo.put_test(5, Some(4), &Body::default());
        repo.put_test(
            6,
            None,
            &Body {
                inodes: vec![
                    InodeRec::test_dir(1),
                    InodeRec::test_file(20, "compacted\n"),
                ],
                dirents: vec![DirentRec::test(1, "c", 20, reg)],
                ..Default::default()
            },
        );
        repo.put_test(
            7,
            Some(6),
            &Body {
                inodes: vec![InodeRec::test_file(20, "changed\n")],
                ..Default::default()
            },
        );
        let whole = |a, b| {
            let (ta, tb) = (repo.load_tree(a).unwrap().0, repo.load_tree(b).unwrap().0);
            diff_trees(&ta, &tb)
        };
        for a in 1..=5 {
            for b in 1..=5 {
                assert_sparse_is_whole(&repo, a, b);
                assert_eq!(diff(&repo, a, b).unwrap(), whole(a, b), "{a} -> {b}");
            }
        }
        let text = render(&whole(1, 5));
        for p in ["/d/n", "/x/g", "/x/link", "/x/h", "/x/d", "/g"] {
            assert!(text.contains(p), "{p} in\n{text}");
        }
        let s = sparse(&repo, 1, 5).unwrap().unwrap();
        assert!(!s.cand.contains(&8), "the unchanged file is not looked at");
        for t in [&s.from, &s.to] {
            assert!(t.inodes.keys().all(|i| s.cand.contains(i)));
            assert!(!t.dirents.values().any(|v| v.0 == 8));
        }
        for (a, b) in [(6, 7), (7, 6)] {
            assert_eq!(diff_sparse(&repo, a, b).unwrap().unwrap(), whole(a, b));
        }
        // Across the full snapshot 6: both chains, and what differs between 1 and 6 (whose
        // entries come in three ascending runs) read as sorted streams.
        for a in 1..=7 {
            for b in 6..=7 {
                for (a, b) in [(a, b), (b, a)] {
                    assert_sparse_is_whole(&repo, a, b);
                    let how = sparse(&repo, a, b).unwrap().unwrap().how;
                    assert_eq!(
                        how,
                        if a.max(b) > 5 && a.min(b) < 6 {
                            "merged"
                        } else {
                            "sparse"
                        }
                    );
                    assert_eq!(diff_how(&repo, a, b).unwrap().1, how);
                }
            }
        }
        // A full snapshot whose records are in no useful order is not merged: whole trees.
        repo.put_test(
            8,
            None,
            &Body {
                inodes: [20, 9, 7, 3, 2, 1]
                    .map(|i| InodeRec::test_file(i, "x\n"))
                    .to_vec(),
                dirents: vec![DirentRec::test(1, "c", 20, reg)],
                ..Default::default()
            },
        );
        for (a, b) in [(3, 8), (8, 3), (7, 8)] {
            assert!(diff_sparse(&repo, a, b).unwrap().is_none(), "{a} -> {b}");
            assert_eq!(diff(&repo, a, b).unwrap(), whole(a, b), "{a} -> {b}");
        }
        assert!(matches!(
            diff_sparse(&repo, 1, 99),
            Err(DiffError::Load { seq: 99, .. })
        ));
        // An older snapshot that is not there: named, whichever way.
        assert!(matches!(
            diff_sparse(&repo, 2, 0),
            Err(DiffError::Load { seq: 0, .. })
        ));
        assert!(matches!(
            diff(&repo, 2, 0),
            Err(DiffError::Load { seq: 0, .. })
        ));
    }

    /// A full snapshot as a checkpoint compacts the chain (the same tree plus what changed
    /// since, the chunked files' records last): across it only what changed is looked at,
    /// each side read from its own chain, and the diff is the whole trees'.
    #[test]
    fn across_a_compaction_only_what_changed_is_looked_at() {
        let (reg, dk) = (libc::S_IFREG, libc::S_IFDIR);
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        let chunked = |ino: u64, w: u8| {
            let mut r = InodeRec::test(
                ino,
                reg | 0o644,
                DataRec::Chunks {
                    complete: true,
                    patch: vec![(0, Some([w; 32]))],
                },
            );
            r.size = 4;
            r
        };
        let files = |names: &[(u64, &str)]| {
            names
                .iter()
                .map(|(i, t)| InodeRec::test_file(*i, t))
                .collect::<Vec<_>>()
        };
        let mut inodes = vec![InodeRec::test_dir(1), InodeRec::test_dir(2)];
        inodes.extend(files(&[(3, "keep\n"), (4, "old\n"), (6, "gone\n")]));
        inodes.push(chunked(5, 1));
        let entries = vec![
            DirentRec::test(1, "d", 2, dk),
            DirentRec::test(2, "a", 3, reg),
            DirentRec::test(2, "b", 4, reg),
            DirentRec::test(2, "big", 5, reg),
            DirentRec::test(2, "z", 6, reg),
        ];
        repo.put_test(
            1,
            None,
            &Body {
                inodes: inodes.clone(),
                dirents: entries.clone(),
                ..Default::default()
            },
        );
        repo.put_test(
            2,
            Some(1),
            &Body {
                inodes: files(&[(4, "new\n")]),
                ..Default::default()
            },
        );
        // 3 compacts 2 and removes /d/z, adds /d/c; the chunked file's record comes last.
        let mut full = vec![InodeRec::test_dir(1), InodeRec::test_dir(2)];
        full.extend(files(&[(3, "keep\n"), (4, "new\n"), (7, "added\n")]));
        full.push(chunked(5, 1));
        let mut ents = entries.clone();
        ents.pop();
        ents.insert(2, DirentRec::test(2, "c", 7, reg));
        repo.put_test(
            3,
            None,
            &Body {
                inodes: full,
                dirents: ents,
                ..Default::default()
            },
        );
        repo.put_test(
            4,
            Some(3),
            &Body {
                inodes: vec![chunked(5, 2)],
                ..Default::default()
            },
        );
        for (a, b) in [(1, 4), (4, 1), (2, 3), (1, 3), (2, 4), (4, 2)] {
            assert_sparse_is_whole(&repo, a, b);
            let s = sparse(&repo, a, b).unwrap().unwrap();
            assert_eq!(s.how, "merged", "{a} -> {b}");
            assert!(
                !s.cand.contains(&3),
                "{a} -> {b}: the unchanged file is not looked at"
            );
        }
        let text = render(&diff(&repo, 1, 4).unwrap());
        for p in ["/d/b", "/d/big", "/d/c", "/d/z"] {
            assert!(text.contains(p), "{p} in\n{text}");
        }
        assert!(!text.contains("/d/a"), "{text}");
    }

    /// Across a compaction, a full snapshot whose records cannot be read is named by the
    /// side whose chain holds it (not by the newer side's), whichever way the diff goes.
    #[test]
    fn an_unreadable_full_snapshot_is_named_by_its_own_side() {
        use crate::persist::format::{encode, Header};
        let file = |i: u64, t: &str| InodeRec::test_file(i, t);
        let entry = |n: &str, i: u64| DirentRec::test(1, n, i, libc::S_IFREG);
        let bodies = [
            (
                1,
                None,
                vec![InodeRec::test_dir(1), file(2, "a\n")],
                vec![entry("a", 2)],
            ),
            (2, Some(1), vec![file(2, "b\n")], vec![]),
            (
                3,
                None,
                vec![InodeRec::test_dir(1), file(2, "c\n")],
                vec![entry("a", 2)],
            ),
            (4, Some(3), vec![file(2, "d\n")], vec![]),
        ];
        for bad in [1, 3] {
            let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
            for (seq, parent, inodes, dirents) in bodies.clone() {
                let body = Body {
                    inodes,
                    dirents,
                    ..Default::default()
                };
                let mut object = encode(&Header::test(seq, parent), &body).unwrap();
                if seq == bad {
                    // Its header reads; its compressed records end too soon.
                    object.truncate(object.len() - 6);
                }
                repo.put_snapshot(seq, object).unwrap();
            }
            // 2's chain starts at 1, 4's at 3: 2 -> 4 merges the two full snapshots.
            let named = if bad == 1 { 2 } else { 4 };
            for (a, b) in [(2, 4), (4, 2)] {
                match sparse(&repo, a, b) {
                    Err(DiffError::Load { seq, .. }) => assert_eq!(seq, named, "{a} -> {b}"),
                    Err(e) => panic!("{a} -> {b}: {e}"),
                    Ok(s) => panic!("{a} -> {b}: read ({:?})", s.map(|s| s.how)),
                }
            }
        }
    }

    /// A name whose value a delta replaced (a rename over it: a new record, no unlink)
    /// before the window must not keep its old value in a sparse side, when the old value
    /// passed the filter and the new one does not: a hard link renamed over, a directory
    /// renamed away and a file made in its place.
    #[test]
    fn a_name_replaced_before_the_window_does_not_linger_in_a_sparse_side() {
        let (reg, dk) = (libc::S_IFREG, libc::S_IFDIR);
        // /a and /h name 5; /b (6) is renamed over /a; then 5 changes.
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        let mut five = InodeRec::test_file(5, "five\n");
        five.nlink = 2;
        repo.put_test(
            1,
            None,
            &Body {
                inodes: vec![
                    InodeRec::test_dir(1),
                    five.clone(),
                    InodeRec::test_file(6, "six\n"),
                ],
                dirents: vec![
                    DirentRec::test(1, "a", 5, reg),
                    DirentRec::test(1, "h", 5, reg),
                    DirentRec::test(1, "b", 6, reg),
                ],
                ..Default::default()
            },
        );
        five.nlink = 1;
        repo.put_test(
            2,
            Some(1),
            &Body {
                inodes: vec![five],
                unlinked: vec![(1, b"b".to_vec())],
                dirents: vec![DirentRec::test(1, "a", 6, reg)],
                ..Default::default()
            },
        );
        repo.put_test(
            3,
            Some(2),
            &Body {
                inodes: vec![InodeRec::test_file(5, "five, changed\n")],
                ..Default::default()
            },
        );
        for (a, b) in [(2, 3), (3, 2), (1, 3), (3, 1)] {
            assert_sparse_is_whole(&repo, a, b);
        }
        assert_eq!(
            render(&diff_sparse(&repo, 2, 3).unwrap().unwrap()),
            "M /h (content)  5 -> 14 bytes\nsnapshot 2 -> 3: 0 added, 0 removed, 1 modified, 0 renamed"
        );
        // /d (directory 10, holding f) renamed to /e and a file made at /d; then /e/f changes.
        let repo = Repo::new(Arc::new(MemRemote::new()), "ws");
        repo.put_test(
            1,
            None,
            &Body {
                inodes: vec![
                    InodeRec::test_dir(1),
                    InodeRec::test_dir(10),
                    InodeRec::test_file(11, "f\n"),
                ],
                dirents: vec![
                    DirentRec::test(1, "d", 10, dk),
                    DirentRec::test(10, "f", 11, reg),
                ],
                ..Default::default()
            },
        );
        repo.put_test(
            2,
            Some(1),
            &Body {
                inodes: vec![InodeRec::test_file(12, "now a file\n")],
                dirents: vec![
                    DirentRec::test(1, "e", 10, dk),
                    DirentRec::test(1, "d", 12, reg),
                ],
                ..Default::default()
            },
        );
        repo.put_test(
            3,
            Some(2),
            &Body {
                inodes: vec![InodeRec::test_file(11, "f changed\n")],
                ..Default::default()
            },
        );
        for (a, b) in [(2, 3), (3, 2), (1, 3), (3, 1)] {
            assert_sparse_is_whole(&repo, a, b);
        }
        assert!(render(&diff_sparse(&repo, 2, 3).unwrap().unwrap()).starts_with("M /e/f "));
    }

    #[test]
    fn unified_diff_has_hunks_with_context() {
        let a = b"1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n";
        let b = b"1\n2\n3\nfour\n5\n6\n7\n8\n9\n10\n11\n";
        let d = unified("a", "b", a, b, 1);
        assert_eq!(
            d,
            "--- a\n+++ b\n@@ -3,3 +3,3 @@\n 3\n-4\n+four\n 5\n@@ -10,1 +10,2 @@\n 10\n+11\n"
        );
        assert_eq!(unified("a", "b", a, a, 3), "");
        let d = unified("a", "b", b"", b"x", 3);
        assert_eq!(
            d,
            "--- a\n+++ b\n@@ -0,0 +1,1 @@\n+x\n\\ No newline at end of file\n"
        );
    }
}

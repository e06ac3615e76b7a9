//! The changes between two trees produced one at a time, in tree order, each path built
//! once: what a diff costs is its records (a few words per changed entry) and one path per
//! side, never the sum of the paths. A chain of 30,000 directories (a 60 KB path at the
//! bottom, 900 MB of paths in all) costs two 60 KB buffers.
//!
//! How: the inodes that may differ (`candidates`) are classified by their entries, named by
//! `(parent, name)` and not by path: removed, added, modified, renamed (the same inode under
//! another path; hard links pair up in path order). Then both trees are walked depth-first
//! (a directory's entries sorted by name, each followed by what is under it), each walk
//! extending and cutting one path buffer, and the walks are merged by path: an entry that
//! has a record is written out with the path its walk holds. A path removed on one side and
//! added on the other (an inode replaced: a rollback of an open file, an editor's rename
//! over) is one modification, or nothing. The old path of a rename is found by walking up
//! the older tree. Order: tree order, i.e. by path compared component by component.

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap, HashSet};

use super::{candidates, kind_of, what_changed, Change, DiffError};
use crate::persist::format::{Tree, TreeInode};

const ROOT: u64 = crate::meta::InodeNo::ROOT.0;

/// An entry: its parent directory and its name.
type Link<'t> = (u64, &'t [u8]);

/// What happens at one entry of one side.
#[derive(Debug, Clone, Copy)]
struct Rec<'t> {
    change: &'static str,
    ino: u64,
    /// For `renamed`: the entry in the older tree.
    from: Option<Link<'t>>,
}

/// One tree as the diff looks at it.
struct Side<'t> {
    t: &'t Tree,
    /// Directory inode -> its entry (the first, as directories have one).
    up: HashMap<u64, Link<'t>>,
    /// Candidate inode -> its entries, in key order.
    links: HashMap<u64, Vec<Link<'t>>>,
}

impl<'t> Side<'t> {
    fn new(t: &'t Tree, cand: &BTreeSet<u64>) -> Self {
        let mut up = HashMap::new();
        let mut links: HashMap<u64, Vec<Link<'t>>> = HashMap::new();
        for ((p, n), (ino, kind)) in &t.dirents {
            if *kind & libc::S_IFMT == libc::S_IFDIR {
                up.entry(*ino).or_insert((*p, n.as_slice()));
            }
            if cand.contains(ino) {
                links.entry(*ino).or_default().push((*p, n.as_slice()));
            }
        }
        Side { t, up, links }
    }

    /// The names from the root down to `l` (`None` in front when a directory above is
    /// reachable from no entry: it is then named `?INO`).
    fn names(&self, l: Link<'t>) -> (Option<u64>, Vec<&'t [u8]>) {
        let mut names = vec![l.1];
        let mut dir = l.0;
        while dir != ROOT {
            match self.up.get(&dir) {
                Some((p, n)) if names.len() <= self.up.len() => {
                    names.push(n);
                    dir = *p;
                }
                _ => {
                    names.reverse();
                    return (Some(dir), names);
                }
            }
        }
        names.reverse();
        (None, names)
    }

    /// The path of `l` (built by walking up: for the old side of a rename, and entries no
    /// walk reaches).
    fn path(&self, l: Link<'t>) -> Vec<u8> {
        let (lost, names) = self.names(l);
        let mut p = match lost {
            Some(ino) => format!("/?{ino}").into_bytes(),
            None => Vec::new(),
        };
        for n in names {
            p.push(b'/');
            p.extend_from_slice(n);
        }
        p
    }
}

/// Orders paths component by component (a directory's entries right after it).
fn tree_order(a: &[u8], b: &[u8]) -> Ordering {
    let key = |c: &u8| if *c == b'/' { 0 } else { *c };
    a.iter().map(key).cmp(b.iter().map(key))
}

/// Whether `la` (in `a`) and `lb` (in `b`) name the same path: the names compared upward
/// until both reach the root, or one directory whose own path is the same on both sides
/// (`same_dir`, remembered).
fn same_path<'t>(
    a: &Side<'t>,
    b: &Side<'t>,
    la: Link<'t>,
    lb: Link<'t>,
    same_dir: &mut HashMap<u64, bool>,
) -> bool {
    let (mut la, mut lb) = (la, lb);
    let limit = a.up.len().min(b.up.len()) + 1;
    for _ in 0..=limit {
        if la.1 != lb.1 {
            return false;
        }
        match (la.0 == ROOT, lb.0 == ROOT) {
            (true, true) => return true,
            (false, false) => {}
            _ => return false,
        }
        if la.0 == lb.0 && dir_unmoved(a, b, la.0, same_dir) {
            return true;
        }
        match (a.up.get(&la.0), b.up.get(&lb.0)) {
            (Some(x), Some(y)) => (la, lb) = (*x, *y),
            _ => return false,
        }
    }
    false
}

/// Whether directory `d` has the same entry on both sides, and so has every directory
/// above it (iterative: a chain is deeper than any stack).
fn dir_unmoved(a: &Side, b: &Side, d: u64, memo: &mut HashMap<u64, bool>) -> bool {
    let mut chain = Vec::new();
    let mut at = d;
    let answer = loop {
        if at == ROOT {
            break true;
        }
        if let Some(v) = memo.get(&at) {
            break *v;
        }
        if chain.len() > a.up.len() {
            break false;
        }
        match (a.up.get(&at), b.up.get(&at)) {
            (Some(x), Some(y)) if x == y => {
                chain.push(at);
                at = x.0;
            }
            _ => {
                memo.insert(at, false);
                break false;
            }
        }
    };
    for c in chain {
        memo.insert(c, answer);
    }
    answer
}

/// What the records say at each entry of each side.
struct Records<'t> {
    a: HashMap<Link<'t>, Rec<'t>>,
    b: HashMap<Link<'t>, Rec<'t>>,
}

impl Records<'_> {
    fn len(&self) -> usize {
        self.a.len() + self.b.len()
    }
}

fn classify<'t>(a: &Side<'t>, b: &Side<'t>, cand: &BTreeSet<u64>) -> Records<'t> {
    let mut r = Records {
        a: HashMap::new(),
        b: HashMap::new(),
    };
    let mut same_dir = HashMap::new();
    let none = Vec::new();
    let rec = |change, ino, from| Rec { change, ino, from };
    for ino in cand {
        let (la, lb) = (
            a.links.get(ino).unwrap_or(&none),
            b.links.get(ino).unwrap_or(&none),
        );
        match (a.t.inodes.get(ino), b.t.inodes.get(ino)) {
            (None, None) => {}
            (Some(_), None) => {
                for l in la {
                    r.a.insert(*l, rec("removed", *ino, None));
                }
            }
            (None, Some(_)) => {
                for l in lb {
                    r.b.insert(*l, rec("added", *ino, None));
                }
            }
            (Some(ta), Some(tb)) => {
                let modified = !what_changed(ta, tb).is_empty();
                // The entries on each side that have one with the same path on the other.
                let mut kept_b = vec![false; lb.len()];
                let mut gone = Vec::new();
                for x in la {
                    let twin = (0..lb.len())
                        .find(|&j| !kept_b[j] && same_path(a, b, *x, lb[j], &mut same_dir));
                    match twin {
                        Some(j) => kept_b[j] = true,
                        None => gone.push(*x),
                    }
                }
                let mut new: Vec<Link> = (0..lb.len())
                    .filter(|&j| !kept_b[j])
                    .map(|j| lb[j])
                    .collect();
                for (j, l) in lb.iter().enumerate() {
                    if kept_b[j] && modified {
                        r.b.insert(*l, rec("modified", *ino, None));
                    }
                }
                // Paths that stayed are left alone; the others pair up as renames in the
                // order of their paths as text, and what is left over was linked or
                // unlinked.
                let text = |s: &Side, l: Link| String::from_utf8_lossy(&s.path(l)).into_owned();
                if gone.len() > 1 {
                    gone.sort_by_cached_key(|x| text(a, *x));
                }
                if new.len() > 1 {
                    new.sort_by_cached_key(|x| text(b, *x));
                }
                for i in 0..gone.len().max(new.len()) {
                    match (gone.get(i), new.get(i)) {
                        (Some(f), Some(t)) => {
                            r.b.insert(*t, rec("renamed", *ino, Some(*f)));
                        }
                        (None, Some(t)) => {
                            r.b.insert(*t, rec("added", *ino, None));
                        }
                        (Some(f), None) => {
                            r.a.insert(*f, rec("removed", *ino, None));
                        }
                        (None, None) => unreachable!("i < max of both lengths"),
                    }
                }
            }
        }
    }
    r
}

/// A depth-first walk of a tree holding the path of the entry it is at.
struct Walk<'t> {
    t: &'t Tree,
    /// The directories being listed: their remaining entries and the length of their path.
    stack: Vec<(EntryIter<'t>, usize)>,
    path: Vec<u8>,
    /// Directories entered (an entry naming one twice is not followed twice).
    entered: HashSet<u64>,
}

type EntryIter<'t> = std::collections::btree_map::Range<'t, (u64, Vec<u8>), (u64, u32)>;

fn entries(t: &Tree, dir: u64) -> EntryIter<'_> {
    t.dirents
        .range((dir, Vec::new())..(dir.saturating_add(1), Vec::new()))
}

impl<'t> Walk<'t> {
    fn new(t: &'t Tree) -> Self {
        Walk {
            t,
            stack: vec![(entries(t, ROOT), 0)],
            path: Vec::new(),
            entered: HashSet::from([ROOT]),
        }
    }

    /// The next entry (its path in `self.path`).
    fn next(&mut self) -> Option<Link<'t>> {
        loop {
            let (it, base) = self.stack.last_mut()?;
            let Some(((p, n), (ino, kind))) = it.next() else {
                self.stack.pop();
                continue;
            };
            self.path.truncate(*base);
            self.path.push(b'/');
            self.path.extend_from_slice(n);
            if *kind & libc::S_IFMT == libc::S_IFDIR && *p != *ino && self.entered.insert(*ino) {
                let len = self.path.len();
                self.stack.push((entries(self.t, *ino), len));
            }
            return Some((*p, n.as_slice()));
        }
    }
}

fn size(t: &TreeInode) -> Option<u64> {
    (t.rec.mode & libc::S_IFMT == libc::S_IFREG).then_some(t.rec.size)
}

/// The change a record stands for, at `path`.
fn change<'t>(a: &Side<'t>, b: &Side<'t>, r: &Rec<'t>, path: &[u8]) -> Change {
    let (ta, tb) = (a.t.inodes.get(&r.ino), b.t.inodes.get(&r.ino));
    let (kind, what, size_before, size_after) = match (ta, tb) {
        (Some(ta), Some(tb)) => (
            kind_of(tb.rec.mode),
            what_changed(ta, tb),
            size(ta),
            size(tb),
        ),
        (Some(ta), None) => (kind_of(ta.rec.mode), Vec::new(), size(ta), None),
        (None, Some(tb)) => (kind_of(tb.rec.mode), Vec::new(), None, size(tb)),
        (None, None) => ("unknown", Vec::new(), None, None),
    };
    Change {
        change: r.change,
        path: String::from_utf8_lossy(path).into_owned(),
        from: r
            .from
            .map(|f| String::from_utf8_lossy(&a.path(f)).into_owned()),
        kind,
        what,
        size_before,
        size_after,
    }
}

/// Compares two trees (`a` the older) and hands each change to `out`, in tree order.
/// `limit` (0: none): more changed entries than that is `DiffError::TooMany`, before
/// anything is handed out.
pub fn each(
    a: &Tree,
    b: &Tree,
    limit: u64,
    out: &mut dyn FnMut(&Change) -> Result<(), DiffError>,
) -> Result<(), DiffError> {
    let cand = candidates(a, b);
    let (sa, sb) = (Side::new(a, &cand), Side::new(b, &cand));
    let mut recs = classify(&sa, &sb, &cand);
    drop(cand);
    if limit > 0 && recs.len() as u64 > limit {
        return Err(DiffError::TooMany {
            entries: recs.len() as u64,
            limit,
        });
    }
    let (mut wa, mut wb) = (Walk::new(a), Walk::new(b));
    let (mut at_a, mut at_b) = (wa.next(), wb.next());
    while !(recs.a.is_empty() && recs.b.is_empty()) {
        let order = match (at_a, at_b) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(_), Some(_)) => tree_order(&wa.path, &wb.path),
        };
        let ra = if order != Ordering::Greater {
            at_a.and_then(|l| recs.a.remove(&l))
        } else {
            None
        };
        let rb = if order != Ordering::Less {
            at_b.and_then(|l| recs.b.remove(&l))
        } else {
            None
        };
        match (ra, rb) {
            (Some(x), Some(y)) if x.change == "removed" && y.change == "added" => {
                // The path now names another inode: one modification, or nothing.
                let (ta, tb) = (a.inodes.get(&x.ino), b.inodes.get(&y.ino));
                if let (Some(ta), Some(tb)) = (ta, tb) {
                    let what = what_changed(ta, tb);
                    if !what.is_empty() {
                        let mut c = change(&sa, &sb, &x, &wa.path);
                        c.change = "modified";
                        c.kind = kind_of(tb.rec.mode);
                        c.what = what;
                        c.size_after = size(tb);
                        out(&c)?;
                    }
                }
            }
            (Some(x), Some(y)) => {
                let (cx, cy) = (
                    change(&sa, &sb, &x, &wa.path),
                    change(&sa, &sb, &y, &wb.path),
                );
                if cx.change <= cy.change {
                    out(&cx)?;
                    out(&cy)?;
                } else {
                    out(&cy)?;
                    out(&cx)?;
                }
            }
            (Some(x), None) => out(&change(&sa, &sb, &x, &wa.path))?,
            (None, Some(y)) => out(&change(&sa, &sb, &y, &wb.path))?,
            (None, None) => {}
        }
        if order != Ordering::Greater {
            at_a = wa.next();
        }
        if order != Ordering::Less {
            at_b = wb.next();
        }
    }
    // Entries no walk reached (a directory no entry names): by the path walking up gives.
    let mut rest: Vec<(Vec<u8>, Change)> = Vec::new();
    for (l, r) in &recs.a {
        let p = sa.path(*l);
        let c = change(&sa, &sb, r, &p);
        rest.push((p, c));
    }
    for (l, r) in &recs.b {
        let p = sb.path(*l);
        let c = change(&sa, &sb, r, &p);
        rest.push((p, c));
    }
    rest.sort_by(|x, y| tree_order(&x.0, &y.0).then(x.1.change.cmp(y.1.change)));
    for (_, c) in &rest {
        out(c)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{diff_trees, lookup, Diff};
    use super::*;
    use crate::persist::format::{Body, DirentRec, Header, InodeRec};
    use std::collections::BTreeSet;
    use std::collections::{BTreeMap, HashMap};

    /// Every path (hard links have several) of the inodes in `wanted`, `/`-rooted, sorted.
    /// Only the directories above them are named, so the cost beyond one pass over the entries
    /// is proportional to the change.
    fn paths(t: &Tree, wanted: &BTreeSet<u64>) -> HashMap<u64, Vec<String>> {
        // ino -> its first entry (parent, name), for directories (one entry each).
        let mut up: HashMap<u64, (u64, &[u8])> = HashMap::new();
        for ((p, n), (ino, kind)) in &t.dirents {
            if *kind & libc::S_IFMT == libc::S_IFDIR {
                up.entry(*ino).or_insert((*p, n.as_slice()));
            }
        }
        let mut memo: HashMap<u64, String> = HashMap::new();
        memo.insert(crate::meta::InodeNo::ROOT.0, String::new());
        fn dir_path(
            ino: u64,
            up: &HashMap<u64, (u64, &[u8])>,
            memo: &mut HashMap<u64, String>,
            depth: usize,
        ) -> String {
            if let Some(p) = memo.get(&ino) {
                return p.clone();
            }
            let s = match up.get(&ino) {
                Some((p, n)) if depth < 4096 => format!(
                    "{}/{}",
                    dir_path(*p, up, memo, depth + 1),
                    String::from_utf8_lossy(n)
                ),
                _ => format!("/?{ino}"),
            };
            memo.insert(ino, s.clone());
            s
        }
        let mut out: HashMap<u64, Vec<String>> = HashMap::new();
        for ((p, n), (ino, _)) in &t.dirents {
            if !wanted.contains(ino) {
                continue;
            }
            let dir = dir_path(*p, &up, &mut memo, 0);
            out.entry(*ino)
                .or_default()
                .push(format!("{dir}/{}", String::from_utf8_lossy(n)));
        }
        for v in out.values_mut() {
            v.sort();
        }
        out
    }

    /// The diff as it was computed before it streamed: every path built and held, sorted
    /// as strings.
    fn reference(a: &Tree, b: &Tree) -> Diff {
        let cand = candidates(a, b);
        let (pa, pb) = (paths(a, &cand), paths(b, &cand));
        let none: Vec<String> = Vec::new();
        let mut changes = Vec::new();
        let size =
            |t: &TreeInode| (t.rec.mode & libc::S_IFMT == libc::S_IFREG).then_some(t.rec.size);
        for (ino, ta) in cand.iter().filter_map(|i| a.inodes.get(i).map(|t| (i, t))) {
            let paths_a = pa.get(ino).unwrap_or(&none);
            match b.inodes.get(ino) {
                None => {
                    for p in paths_a {
                        changes.push(Change {
                            change: "removed",
                            path: p.clone(),
                            from: None,
                            kind: kind_of(ta.rec.mode),
                            what: Vec::new(),
                            size_before: size(ta),
                            size_after: None,
                        });
                    }
                }
                Some(tb) => {
                    let paths_b = pb.get(ino).unwrap_or(&none);
                    let what = what_changed(ta, tb);
                    let (sa, sb) = (size(ta), size(tb));
                    let kind = kind_of(tb.rec.mode);
                    if paths_a == paths_b {
                        if !what.is_empty() {
                            for p in paths_b {
                                changes.push(Change {
                                    change: "modified",
                                    path: p.clone(),
                                    from: None,
                                    kind,
                                    what: what.clone(),
                                    size_before: sa,
                                    size_after: sb,
                                });
                            }
                        }
                        continue;
                    }
                    // Paths that stayed are left alone; the others pair up as renames, and
                    // what is left over was linked or unlinked.
                    let gone: Vec<&String> =
                        paths_a.iter().filter(|p| !paths_b.contains(p)).collect();
                    let new: Vec<&String> =
                        paths_b.iter().filter(|p| !paths_a.contains(p)).collect();
                    for i in 0..gone.len().max(new.len()) {
                        let (change, path, from) = match (gone.get(i), new.get(i)) {
                            (Some(f), Some(t)) => ("renamed", (*t).clone(), Some((*f).clone())),
                            (None, Some(t)) => ("added", (*t).clone(), None),
                            (Some(f), None) => ("removed", (*f).clone(), None),
                            (None, None) => unreachable!("i < max of both lengths"),
                        };
                        changes.push(Change {
                            change,
                            path,
                            from,
                            kind,
                            what: what.clone(),
                            size_before: sa,
                            size_after: sb,
                        });
                    }
                    if !what.is_empty() {
                        for p in paths_b.iter().filter(|p| paths_a.contains(p)) {
                            changes.push(Change {
                                change: "modified",
                                path: p.clone(),
                                from: None,
                                kind,
                                what: what.clone(),
                                size_before: sa,
                                size_after: sb,
                            });
                        }
                    }
                }
            }
        }
        for (ino, tb) in cand.iter().filter_map(|i| b.inodes.get(i).map(|t| (i, t))) {
            if a.inodes.contains_key(ino) {
                continue;
            }
            for p in pb.get(ino).unwrap_or(&none) {
                changes.push(Change {
                    change: "added",
                    path: p.clone(),
                    from: None,
                    kind: kind_of(tb.rec.mode),
                    what: Vec::new(),
                    size_before: None,
                    size_after: size(tb),
                });
            }
        }
        // A path whose inode was replaced by another (a rollback of an open file, an editor
        // that writes a new file and renames it over) is one modification, or none.
        let mut by_path: HashMap<String, (Option<usize>, Option<usize>)> = HashMap::new();
        for (i, c) in changes.iter().enumerate() {
            match c.change {
                "removed" => by_path.entry(c.path.clone()).or_default().0 = Some(i),
                "added" => by_path.entry(c.path.clone()).or_default().1 = Some(i),
                _ => {}
            }
        }
        let mut drop = vec![false; changes.len()];
        for (path, pair) in by_path {
            let (Some(ri), Some(ai)) = pair else { continue };
            let (Some(ia), Some(ib)) = (lookup(a, &path), lookup(b, &path)) else {
                continue;
            };
            let (Some(ta), Some(tb)) = (a.inodes.get(&ia), b.inodes.get(&ib)) else {
                continue;
            };
            let what = what_changed(ta, tb);
            drop[ai] = true;
            if what.is_empty() {
                drop[ri] = true;
            } else {
                let c = &mut changes[ri];
                c.change = "modified";
                c.kind = kind_of(tb.rec.mode);
                c.what = what;
                c.size_after = size(tb);
            }
        }
        let mut keep = drop.into_iter().map(|d| !d);
        changes.retain(|_| keep.next().unwrap_or(true));
        changes.sort_by(|x, y| x.path.cmp(&y.path).then(x.change.cmp(y.change)));
        Diff {
            from: a.seq.unwrap_or(0),
            to: b.seq.unwrap_or(0),
            changes,
        }
    }

    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    const NAMES: [&str; 7] = ["a", "a-", "a.b", "b", "c", "ab", "\u{e9}"];

    fn tree(
        seq: u64,
        inodes: &BTreeMap<u64, InodeRec>,
        dirents: &BTreeMap<(u64, Vec<u8>), (u64, u32)>,
    ) -> Tree {
        let body = Body {
            inodes: inodes.values().cloned().collect(),
            dirents: dirents
                .iter()
                .map(|((p, n), (i, k))| {
                    DirentRec::test(*p, std::str::from_utf8(n).unwrap(), *i, *k)
                })
                .collect(),
            ..Default::default()
        };
        let mut t = Tree::default();
        t.apply(&Header::test(seq, None), body).unwrap();
        t
    }

    fn sorted(mut d: Diff) -> Vec<Change> {
        d.changes
            .sort_by(|x, y| (&x.path, x.change, &x.from).cmp(&(&y.path, y.change, &y.from)));
        d.changes
    }

    /// The streamed diff lists exactly what the diff that held every path listed, over
    /// random trees and random changes (renames of files and directories, hard links,
    /// replaced inodes, removals, additions, modes), in tree order.
    #[test]
    fn the_streamed_diff_lists_what_the_whole_diff_listed() {
        let (reg, dk) = (libc::S_IFREG, libc::S_IFDIR);
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for round in 0..400 {
            let mut inodes = BTreeMap::from([(1, InodeRec::test_dir(1))]);
            let mut ents: BTreeMap<(u64, Vec<u8>), (u64, u32)> = BTreeMap::new();
            let mut dirs = vec![1u64];
            let mut next = 2u64;
            for _ in 0..(5 + rng.below(40)) {
                let parent = dirs[rng.below(dirs.len() as u64) as usize];
                let name = NAMES[rng.below(NAMES.len() as u64) as usize]
                    .as_bytes()
                    .to_vec();
                if ents.contains_key(&(parent, name.clone())) {
                    continue;
                }
                let ino = next;
                next += 1;
                if rng.below(3) == 0 {
                    inodes.insert(ino, InodeRec::test_dir(ino));
                    ents.insert((parent, name), (ino, dk));
                    dirs.push(ino);
                } else {
                    inodes.insert(ino, InodeRec::test_file(ino, &format!("{ino}\n")));
                    ents.insert((parent, name), (ino, reg));
                }
            }
            let a = tree(1, &inodes, &ents);
            for _ in 0..(1 + rng.below(8)) {
                let keys: Vec<_> = ents.keys().cloned().collect();
                if keys.is_empty() {
                    break;
                }
                let k = keys[rng.below(keys.len() as u64) as usize].clone();
                let (ino, kind) = ents[&k];
                let parent = dirs[rng.below(dirs.len() as u64) as usize];
                let name = NAMES[rng.below(NAMES.len() as u64) as usize]
                    .as_bytes()
                    .to_vec();
                let free = !ents.contains_key(&(parent, name.clone()));
                let is_dir = kind == dk;
                let empty_dir = is_dir && !ents.keys().any(|(p, _)| *p == ino);
                match rng.below(7) {
                    0 if !is_dir => {
                        inodes.insert(ino, InodeRec::test_file(ino, &format!("changed {round}\n")));
                    }
                    1 if free && (!is_dir || parent == 1) => {
                        // A rename (a directory only to the root: no cycles).
                        ents.remove(&k);
                        ents.insert((parent, name), (ino, kind));
                    }
                    2 if free && !is_dir => {
                        ents.insert((parent, name), (ino, kind));
                    }
                    3 if !is_dir || empty_dir => {
                        ents.remove(&k);
                        if !ents.values().any(|v| v.0 == ino) {
                            inodes.remove(&ino);
                            dirs.retain(|d| *d != ino);
                        }
                    }
                    4 if !is_dir => {
                        // Another inode at the same path (an editor's rename over it).
                        let n = next;
                        next += 1;
                        let text = if rng.below(2) == 0 {
                            format!("{ino}\n")
                        } else {
                            format!("new {n}\n")
                        };
                        inodes.insert(n, InodeRec::test_file(n, &text));
                        ents.insert(k, (n, reg));
                        if !ents.values().any(|v| v.0 == ino) {
                            inodes.remove(&ino);
                        }
                    }
                    5 => {
                        if let Some(r) = inodes.get_mut(&ino) {
                            r.mode ^= 0o20;
                        }
                    }
                    _ if free => {
                        let n = next;
                        next += 1;
                        inodes.insert(n, InodeRec::test_file(n, "added\n"));
                        ents.insert((parent, name), (n, reg));
                    }
                    _ => {}
                }
            }
            let b = tree(2, &inodes, &ents);
            for (x, y) in [(&a, &b), (&b, &a)] {
                let (got, want) = (diff_trees(x, y), reference(x, y));
                // In tree order: a directory's entries right after it.
                let order: Vec<&str> = got.changes.iter().map(|c| c.path.as_str()).collect();
                let mut by_tree = order.clone();
                by_tree.sort_by(|p, q| tree_order(p.as_bytes(), q.as_bytes()));
                assert_eq!(order, by_tree, "round {round}");
                assert_eq!(sorted(got), sorted(want), "round {round}");
            }
        }
    }

    /// A chain of directories deeper than any stack is walked, and each path is whole.
    #[test]
    fn a_deep_chain_is_listed_with_whole_paths() {
        let depth = 20_000u64;
        let mut inodes = BTreeMap::from([(1, InodeRec::test_dir(1))]);
        let mut ents = BTreeMap::new();
        for i in 0..depth {
            inodes.insert(i + 2, InodeRec::test_dir(i + 2));
            ents.insert((i + 1, b"d".to_vec()), (i + 2, libc::S_IFDIR));
        }
        let b = tree(2, &inodes, &ents);
        let a = tree(
            1,
            &BTreeMap::from([(1, InodeRec::test_dir(1))]),
            &BTreeMap::new(),
        );
        let mut n = 0u64;
        let mut longest = 0;
        diff_trees_each_for_test(&a, &b, &mut |c| {
            n += 1;
            assert_eq!(c.change, "added");
            assert_eq!(c.path.len() as u64, 2 * n, "{n}");
            longest = longest.max(c.path.len());
            Ok(())
        });
        assert_eq!(n, depth);
        assert_eq!(longest as u64, 2 * depth);
        // Over the limit: refused before anything is handed out.
        let mut any = false;
        let e = each(&a, &b, depth - 1, &mut |_| {
            any = true;
            Ok(())
        })
        .unwrap_err();
        assert!(!any);
        assert!(e.to_string().contains("diff_max_entries"), "{e}");
        // The reverse: all removed, by the same paths.
        let mut n = 0u64;
        diff_trees_each_for_test(&b, &a, &mut |c| {
            n += 1;
            assert_eq!((c.change, c.path.len() as u64), ("removed", 2 * n));
            Ok(())
        });
        assert_eq!(n, depth);
    }

    fn diff_trees_each_for_test(
        a: &Tree,
        b: &Tree,
        out: &mut dyn FnMut(&Change) -> Result<(), DiffError>,
    ) {
        each(a, b, 0, out).unwrap();
    }
}

//! The tree check of `keel fsck`: every entry names an existing inode of the right kind in
//! an existing directory; link counts and directory parents agree with the entries; every
//! inode with links is reachable from the root; symlinks have targets. `repair` drops
//! entries to missing inodes, corrects entry kinds and link counts, and re-links inodes no
//! entry names under `/lost+found`. The steps share one `TreeScan`: a sorted array of one
//! 40-byte `Node` per inode and 8 bytes per entry, filled by streaming both tables once, so
//! a million inodes take ~50 MB (whole `Inode`s and entries in maps took ~400).

use super::{FsckError, FsckReport, Level};
use crate::meta::{Inode, InodeNo, Kind, Nanos, Storage, Store, Tx};
use crate::time::now_ns;

/// One inode as the tree check needs it, and what the entries say about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Node {
    ino: InodeNo,
    /// The parent the inode records (meaningful for directories).
    parent: InodeNo,
    /// The directory of the first entry (in entry order) naming it, when `links > 0`.
    named_in: InodeNo,
    nlink: u32,
    /// Sound entries naming it.
    links: u32,
    /// Its subdirectories (each adds one link to it).
    subdirs: u32,
    kind: Kind,
    /// Reachable from the root (set by `mark_reachable`).
    reach: bool,
}

impl Node {
    fn of(i: &Inode) -> Node {
        Node {
            ino: i.ino,
            parent: i.parent,
            named_in: InodeNo(0),
            nlink: i.nlink,
            links: 0,
            subdirs: 0,
            kind: i.kind,
            reach: false,
        }
    }
}

/// A fix to an entry that `repair` applies once the entries were read.
enum EntryFix {
    /// Drop the entry (it names a missing inode).
    Unlink(InodeNo, Vec<u8>),
    /// Give the entry the kind of the inode it names.
    Relink(InodeNo, Vec<u8>, InodeNo, Kind),
}

/// The inodes, and what the entries say about them.
#[derive(Default)]
struct TreeScan {
    /// Every inode, in inode order.
    nodes: Vec<Node>,
    /// (directory, inode) of every sound entry, as indexes into `nodes`, in directory order.
    edges: Vec<(u32, u32)>,
}

pub(super) fn check_tree(
    store: &Store,
    rep: &mut FsckReport,
    repair: bool,
) -> Result<(), FsckError> {
    let mut scan = TreeScan::default();
    store.read().for_each_inode(|i| {
        scan.add_inode(&i);
        Ok(())
    })?;
    scan.sort_nodes();
    rep.inodes = scan.nodes.len() as u64;
    scan.check_root(rep);
    let fixes = scan.check_entries(&store.read(), rep, repair)?;
    let tx = if repair { Some(store.write()?) } else { None };
    if let Some(tx) = &tx {
        apply_fixes(&fixes, tx)?;
    }
    drop(fixes);
    scan.mark_reachable();
    let mut lost = Vec::new();
    for n in &scan.nodes {
        if n.kind == Kind::Dir {
            scan.check_dir_links(n, rep, tx.as_ref())?;
        } else if scan.check_links(n, rep, tx.as_ref())? {
            lost.push(n.ino);
        }
        if n.nlink > 0 && !n.reach && n.links > 0 {
            rep.add(
                Level::Error,
                format!("inode {} is not reachable from the root", n.ino.0),
                false,
            );
        }
        if n.kind == Kind::Symlink && store.read().symlink_target(n.ino)?.is_none() {
            rep.add(
                Level::Error,
                format!("symlink {} has no target", n.ino.0),
                false,
            );
        }
    }
    if let Some(tx) = tx {
        scan.relink_lost(&lost, &tx)?;
        tx.commit()?;
    }
    Ok(())
}

/// Applies the entry fixes `check_entries` collected.
fn apply_fixes(fixes: &[EntryFix], tx: &Tx) -> Result<(), FsckError> {
    for f in fixes {
        match f {
            EntryFix::Unlink(parent, name) => tx.unlink(*parent, name)?,
            EntryFix::Relink(parent, name, ino, kind) => tx.relink(*parent, name, *ino, *kind)?,
        }
    }
    Ok(())
}

impl TreeScan {
    fn add_inode(&mut self, i: &Inode) {
        self.nodes.push(Node::of(i));
    }

    /// `for_each_inode` streams in inode order; anything else is sorted here.
    fn sort_nodes(&mut self) {
        if !self.nodes.is_sorted_by_key(|n| n.ino) {
            self.nodes.sort_unstable_by_key(|n| n.ino);
        }
    }

    fn index(&self, ino: InodeNo) -> Option<usize> {
        self.nodes.binary_search_by_key(&ino, |n| n.ino).ok()
    }

    fn node(&self, ino: InodeNo) -> Option<&Node> {
        self.index(ino).map(|x| &self.nodes[x])
    }

    #[cfg(test)]
    fn links_to(&self, ino: InodeNo) -> u32 {
        self.node(ino).map(|n| n.links).unwrap_or(0)
    }

    fn check_root(&self, rep: &mut FsckReport) {
        match self.node(InodeNo::ROOT) {
            Some(r) if r.kind == Kind::Dir => {}
            _ => rep.add(
                Level::Error,
                "the root inode is missing or not a directory".into(),
                false,
            ),
        }
    }

    /// Each entry of `r`, streamed: in a directory, naming an inode that exists, of the kind
    /// it says (with `repair`: the fixes that drop it, or correct its kind, returned for
    /// `apply_fixes`). Counts the sound ones in the scan.
    fn check_entries(
        &mut self,
        r: &Tx,
        rep: &mut FsckReport,
        repair: bool,
    ) -> Result<Vec<EntryFix>, FsckError> {
        let mut fixes = Vec::new();
        r.for_each_dirent(|parent, name, ino, kind| {
            rep.entries += 1;
            self.check_entry(parent, name, ino, kind, rep, repair.then_some(&mut fixes));
            Ok::<(), FsckError>(())
        })?;
        self.edges.sort_unstable();
        Ok(fixes)
    }

    /// One entry `name` in `parent` naming `ino` as a `kind` (see `check_entries`).
    fn check_entry(
        &mut self,
        parent: InodeNo,
        name: Vec<u8>,
        ino: InodeNo,
        kind: Kind,
        rep: &mut FsckReport,
        fixes: Option<&mut Vec<EntryFix>>,
    ) {
        let shown = || String::from_utf8_lossy(&name).into_owned();
        let p = match self.index(parent) {
            Some(p) if self.nodes[p].kind == Kind::Dir => p,
            _ => {
                rep.add(
                    Level::Error,
                    format!(
                        "entry `{}` is in inode {} which is not a directory",
                        shown(),
                        parent.0
                    ),
                    false,
                );
                return;
            }
        };
        let Some(t) = self.index(ino) else {
            rep.add(
                Level::Error,
                format!(
                    "entry `{}` in directory {} names missing inode {}",
                    shown(),
                    parent.0,
                    ino.0
                ),
                fixes.is_some(),
            );
            if let Some(f) = fixes {
                f.push(EntryFix::Unlink(parent, name));
            }
            return;
        };
        let target = self.nodes[t].kind;
        if target != kind {
            rep.add(
                Level::Error,
                format!(
                    "entry `{}` says {:?} but inode {} is {:?}",
                    shown(),
                    kind,
                    ino.0,
                    target
                ),
                fixes.is_some(),
            );
            if let Some(f) = fixes {
                f.push(EntryFix::Relink(parent, name, ino, target));
            }
        }
        let n = &mut self.nodes[t];
        if n.links == 0 {
            n.named_in = parent;
        }
        n.links += 1;
        if target == Kind::Dir {
            self.nodes[p].subdirs += 1;
        }
        // Indexes fit: 2^32 inodes would take 160 GiB of nodes.
        self.edges.push((p as u32, t as u32));
    }

    /// Marks the inodes reachable from the root through the entries.
    fn mark_reachable(&mut self) {
        let Some(root) = self.index(InodeNo::ROOT) else {
            return;
        };
        let mut stack = vec![root as u32];
        while let Some(d) = stack.pop() {
            let n = &mut self.nodes[d as usize];
            if n.reach {
                continue;
            }
            n.reach = true;
            let from = self.edges.partition_point(|e| e.0 < d);
            let to = self.edges.partition_point(|e| e.0 <= d);
            stack.extend(self.edges[from..to].iter().map(|e| e.1));
        }
    }

    /// A directory: one entry names it (the root: none), in its recorded parent, and its
    /// link count is 2 plus its subdirectories (with `tx`: corrected).
    fn check_dir_links(
        &self,
        i: &Node,
        rep: &mut FsckReport,
        tx: Option<&Tx>,
    ) -> Result<(), FsckError> {
        let (ino, links) = (i.ino, i.links);
        if ino != InodeNo::ROOT {
            if links == 0 && i.nlink == 0 {
                rep.add(
                    Level::Note,
                    format!(
                        "directory {} was removed while in use (cleaned at next mount)",
                        ino.0
                    ),
                    false,
                );
                return Ok(());
            }
            if links != 1 {
                rep.add(
                    Level::Error,
                    format!("directory {} has {links} entries naming it", ino.0),
                    false,
                );
            }
            if links > 0 {
                let p = i.named_in;
                if p != i.parent {
                    rep.add(
                        Level::Error,
                        format!(
                            "directory {} has parent {} but lives in {}",
                            ino.0, i.parent.0, p.0
                        ),
                        false,
                    );
                }
            }
        }
        let want = 2 + i.subdirs;
        if i.nlink != want {
            if let Some(tx) = tx {
                tx.set_nlink(ino, want)?;
            }
            rep.add(
                Level::Error,
                format!("directory {} has nlink {} but {want} links", ino.0, i.nlink),
                tx.is_some(),
            );
        }
        Ok(())
    }

    /// Anything but a directory: its link count is the number of entries naming it (with
    /// `tx`: corrected). True when it has links but no entry (lost: `relink_lost`).
    fn check_links(
        &self,
        i: &Node,
        rep: &mut FsckReport,
        tx: Option<&Tx>,
    ) -> Result<bool, FsckError> {
        let (ino, links) = (i.ino, i.links);
        if links == i.nlink {
            return Ok(false);
        }
        if links == 0 && i.nlink == 0 {
            rep.add(
                Level::Note,
                format!(
                    "inode {} was unlinked while open (removed at next mount)",
                    ino.0
                ),
                false,
            );
            Ok(false)
        } else if links == 0 {
            rep.add(
                Level::Error,
                format!(
                    "inode {} has nlink {} but no entry names it",
                    ino.0, i.nlink
                ),
                tx.is_some(),
            );
            Ok(true)
        } else {
            if let Some(tx) = tx {
                tx.set_nlink(ino, links)?;
            }
            rep.add(
                Level::Error,
                format!("inode {} has nlink {} but {links} entries", ino.0, i.nlink),
                tx.is_some(),
            );
            Ok(false)
        }
    }

    /// Links each `lost` inode as `/lost+found/#<ino>` (made if missing) with one link.
    fn relink_lost(&self, lost: &[InodeNo], tx: &Tx) -> Result<(), FsckError> {
        if lost.is_empty() {
            return Ok(());
        }
        let lf = match tx.lookup(InodeNo::ROOT, b"lost+found")? {
            Some(d) => d.ino,
            None => {
                let t = Nanos(now_ns());
                let dir = Inode {
                    ino: InodeNo(0),
                    kind: Kind::Dir,
                    perm: 0o700,
                    uid: 0,
                    gid: 0,
                    nlink: 2,
                    size: 0,
                    atime: t,
                    mtime: t,
                    ctime: t,
                    rdev: 0,
                    parent: InodeNo::ROOT,
                    storage: Storage::Inline,
                };
                let ino = tx.insert(&dir)?;
                tx.link(InodeNo::ROOT, b"lost+found", ino, Kind::Dir)?;
                let mut root = tx.get(InodeNo::ROOT)?.expect("root checked");
                root.nlink += 1;
                tx.update(&root)?;
                ino
            }
        };
        for ino in lost {
            let kind = self.node(*ino).expect("lost inodes are scanned").kind;
            tx.link(lf, format!("#{}", ino.0).as_bytes(), *ino, kind)?;
            tx.set_nlink(*ino, 1)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let s = crate::state::open_store(dir.path(), Nanos(1)).unwrap();
        (dir, s)
    }

    fn inode(kind: Kind, nlink: u32) -> Inode {
        Inode {
            kind,
            perm: 0o755,
            nlink,
            ..Inode::test_file(0, Storage::Inline)
        }
    }

    /// The scan of `s` after `check_entries`.
    fn scan(s: &Store, rep: &mut FsckReport) -> TreeScan {
        let mut scan = TreeScan::default();
        s.read()
            .for_each_inode(|i| {
                scan.add_inode(&i);
                Ok(())
            })
            .unwrap();
        scan.sort_nodes();
        scan.check_entries(&s.read(), rep, false).unwrap();
        scan
    }

    fn said(rep: &FsckReport, level: Level) -> Vec<String> {
        let f = rep.findings.iter().filter(|f| f.level == level);
        f.map(|f| f.what.clone()).collect()
    }

    #[test]
    fn check_root_wants_a_directory() {
        let mut rep = FsckReport::default();
        TreeScan::default().check_root(&mut rep);
        assert_eq!(rep.count(Level::Error), 1);
        let (_d, s) = store();
        let mut rep = FsckReport::default();
        scan(&s, &mut rep).check_root(&mut rep);
        assert!(rep.findings.is_empty());
    }

    #[test]
    fn check_entries_drops_entries_to_missing_inodes_and_fixes_kinds() {
        let (_d, s) = store();
        let tx = s.write().unwrap();
        let f = tx.insert(&inode(Kind::File, 1)).unwrap();
        tx.link(InodeNo::ROOT, b"f", f, Kind::Dir).unwrap();
        tx.link(InodeNo::ROOT, b"gone", InodeNo(99), Kind::File)
            .unwrap();
        tx.link(f, b"in-a-file", f, Kind::File).unwrap();
        tx.commit().unwrap();
        let mut rep = FsckReport::default();
        let sc = scan(&s, &mut rep);
        let errs = said(&rep, Level::Error);
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(errs.iter().any(|e| e.contains("names missing inode 99")));
        assert!(errs.iter().any(|e| e.contains("says Dir but")));
        assert!(errs.iter().any(|e| e.contains("which is not a directory")));
        assert_eq!(sc.links_to(f), 1, "the entry in the file is not counted");
        assert_eq!(sc.node(InodeNo::ROOT).unwrap().subdirs, 0, "f is a file");

        let mut rep = FsckReport::default();
        let mut sc = TreeScan {
            nodes: sc.nodes,
            ..Default::default()
        };
        for n in &mut sc.nodes {
            n.links = 0;
        }
        let fixes = sc.check_entries(&s.read(), &mut rep, true).unwrap();
        let tx = s.write().unwrap();
        apply_fixes(&fixes, &tx).unwrap();
        tx.commit().unwrap();
        assert_eq!(rep.findings.iter().filter(|f| f.repaired).count(), 2);
        let r = s.read();
        assert!(r.lookup(InodeNo::ROOT, b"gone").unwrap().is_none());
        assert_eq!(
            r.lookup(InodeNo::ROOT, b"f").unwrap().unwrap().kind,
            Kind::File
        );
    }

    #[test]
    fn reachable_follows_entries_from_the_root_only() {
        let mut sc = TreeScan::default();
        for ino in [1, 2, 3, 7, 8] {
            sc.add_inode(&Inode {
                ino: InodeNo(ino),
                ..inode(Kind::Dir, 2)
            });
        }
        // 1 -> 2 -> 3; 7 -> 8 and 7 -> 7 (a loop no entry from the root reaches).
        sc.edges = vec![(0, 1), (1, 2), (3, 4), (3, 3)];
        sc.mark_reachable();
        let r: Vec<u64> = sc
            .nodes
            .iter()
            .filter(|n| n.reach)
            .map(|n| n.ino.0)
            .collect();
        assert_eq!(r, [InodeNo::ROOT.0, 2, 3]);
    }

    #[test]
    fn the_scan_is_compact_sorted_and_counts_what_entries_say() {
        // 40 bytes an inode, 8 an entry: what keeps a million-inode fsck bounded.
        assert!(std::mem::size_of::<Node>() <= 40);
        assert_eq!(std::mem::size_of::<(u32, u32)>(), 8);
        let (_d, s) = store();
        let tx = s.write().unwrap();
        let a = tx.insert(&inode(Kind::Dir, 2)).unwrap();
        tx.link(InodeNo::ROOT, b"a", a, Kind::Dir).unwrap();
        let f = tx
            .insert(&Inode {
                parent: a,
                ..inode(Kind::File, 2)
            })
            .unwrap();
        tx.link(a, b"f", f, Kind::File).unwrap();
        tx.link(InodeNo::ROOT, b"g", f, Kind::File).unwrap();
        tx.commit().unwrap();
        let mut sc = TreeScan::default();
        // Inodes out of order are sorted: lookups are binary searches.
        for i in s.read().all_inodes().unwrap().iter().rev() {
            sc.add_inode(i);
        }
        sc.sort_nodes();
        let inos: Vec<InodeNo> = sc.nodes.iter().map(|n| n.ino).collect();
        assert_eq!(inos, [InodeNo::ROOT, a, f]);
        let mut rep = FsckReport::default();
        assert!(sc
            .check_entries(&s.read(), &mut rep, false)
            .unwrap()
            .is_empty());
        assert_eq!(rep.entries, 3);
        let root = *sc.node(InodeNo::ROOT).unwrap();
        assert_eq!((root.links, root.subdirs), (0, 1));
        let na = *sc.node(a).unwrap();
        assert_eq!((na.links, na.named_in, na.subdirs), (1, InodeNo::ROOT, 0));
        // Entries in (parent, name) order: the root's `g` before `a`'s `f`.
        let nf = *sc.node(f).unwrap();
        assert_eq!((nf.links, nf.named_in), (2, InodeNo::ROOT));
        assert_eq!(sc.edges, [(0, 1), (0, 2), (1, 2)]);
        assert_eq!(sc.node(InodeNo(99)), None);
        sc.mark_reachable();
        assert!(sc.nodes.iter().all(|n| n.reach));
    }

    #[test]
    fn check_dir_links_counts_subdirectories_and_one_entry() {
        let (_d, s) = store();
        let tx = s.write().unwrap();
        let a = tx.insert(&inode(Kind::Dir, 2)).unwrap();
        tx.link(InodeNo::ROOT, b"a", a, Kind::Dir).unwrap();
        let b = tx.insert(&inode(Kind::Dir, 5)).unwrap();
        tx.link(InodeNo::ROOT, b"b", b, Kind::Dir).unwrap();
        tx.link(a, b"b-again", b, Kind::Dir).unwrap();
        tx.commit().unwrap();
        let mut rep = FsckReport::default();
        let sc = scan(&s, &mut rep);
        for i in &sc.nodes {
            sc.check_dir_links(i, &mut rep, None).unwrap();
        }
        let errs = said(&rep, Level::Error);
        // The root has 2 subdirectories (nlink 4 wanted), a has 1 (3), b: two entries, a
        // parent it does not live in, nlink 5 for 2.
        assert!(
            errs.iter()
                .any(|e| e.contains("directory 1 has nlink 2 but 4")),
            "{errs:?}"
        );
        assert!(errs
            .iter()
            .any(|e| e.contains(&format!("directory {} has nlink 2 but 3", a.0))));
        assert!(errs
            .iter()
            .any(|e| e.contains(&format!("directory {} has 2 entries", b.0))));
        assert!(errs
            .iter()
            .any(|e| e.contains(&format!("directory {} has nlink 5 but 2", b.0))));
        let tx = s.write().unwrap();
        let mut rep = FsckReport::default();
        sc.check_dir_links(sc.node(a).unwrap(), &mut rep, Some(&tx))
            .unwrap();
        tx.commit().unwrap();
        assert_eq!(s.read().get(a).unwrap().unwrap().nlink, 3);
    }

    #[test]
    fn check_links_corrects_counts_and_reports_lost_inodes() {
        let (_d, s) = store();
        let tx = s.write().unwrap();
        let two = tx.insert(&inode(Kind::File, 1)).unwrap();
        tx.link(InodeNo::ROOT, b"x", two, Kind::File).unwrap();
        tx.link(InodeNo::ROOT, b"y", two, Kind::File).unwrap();
        let lost = tx.insert(&inode(Kind::File, 1)).unwrap();
        let open = tx.insert(&inode(Kind::File, 0)).unwrap();
        tx.commit().unwrap();
        let mut rep = FsckReport::default();
        let sc = scan(&s, &mut rep);
        let tx = s.write().unwrap();
        assert!(!sc
            .check_links(sc.node(two).unwrap(), &mut rep, Some(&tx))
            .unwrap());
        assert!(sc
            .check_links(sc.node(lost).unwrap(), &mut rep, Some(&tx))
            .unwrap());
        assert!(!sc
            .check_links(sc.node(open).unwrap(), &mut rep, Some(&tx))
            .unwrap());
        tx.commit().unwrap();
        assert_eq!(s.read().get(two).unwrap().unwrap().nlink, 2);
        // nlink 0 and no entry agree (unlinked while open): nothing to say.
        assert!(said(&rep, Level::Note).is_empty());
        assert_eq!(said(&rep, Level::Error).len(), 2);
    }

    #[test]
    fn relink_lost_names_them_in_lost_and_found() {
        let (_d, s) = store();
        let tx = s.write().unwrap();
        let f = tx.insert(&inode(Kind::File, 3)).unwrap();
        tx.commit().unwrap();
        let mut rep = FsckReport::default();
        let sc = scan(&s, &mut rep);
        let tx = s.write().unwrap();
        sc.relink_lost(&[f], &tx).unwrap();
        tx.commit().unwrap();
        let r = s.read();
        let lf = r.lookup(InodeNo::ROOT, b"lost+found").unwrap().unwrap();
        let e = r.lookup(lf.ino, format!("#{}", f.0).as_bytes()).unwrap();
        assert_eq!(e.unwrap().ino, f);
        assert_eq!(r.get(f).unwrap().unwrap().nlink, 1);
        assert_eq!(r.get(InodeNo::ROOT).unwrap().unwrap().nlink, 3);
        // The whole check is clean afterwards.
        drop(r);
        let mut rep = FsckReport::default();
        check_tree(&s, &mut rep, false).unwrap();
        assert!(rep.findings.is_empty(), "{:?}", rep.findings);
    }
}

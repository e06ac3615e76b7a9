//! The tree check of `keel fsck`: every entry names an existing inode of the right kind in
//! an existing directory; link counts and directory parents agree with the entries; every
//! inode with links is reachable from the root; symlinks have targets. `repair` drops
//! entries to missing inodes, corrects entry kinds and link counts, and re-links inodes no
//! entry names under `/lost+found`. The steps share one `TreeScan` of the whole table.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::{FsckError, FsckReport, Level};
use crate::meta::{Dirent, Inode, InodeNo, Kind, Nanos, Storage, Store, Tx};
use crate::persist::checkpoint::now_ns;

/// The inodes, and what the entries say about them.
#[derive(Default)]
struct TreeScan {
    inodes: BTreeMap<InodeNo, Inode>,
    /// The directories whose entries name each inode (once per entry).
    names: HashMap<InodeNo, Vec<InodeNo>>,
    /// The inodes each directory's entries name.
    children: HashMap<InodeNo, Vec<InodeNo>>,
    /// Subdirectories per directory (each adds one link to it).
    subdirs: HashMap<InodeNo, u32>,
}

pub(super) fn check_tree(
    store: &Store,
    rep: &mut FsckReport,
    repair: bool,
) -> Result<(), FsckError> {
    // Streamed into the map: never the whole table as a Vec beside it.
    let mut scan = TreeScan::default();
    store.read().for_each_inode(|i| {
        scan.inodes.insert(i.ino, i);
        Ok(())
    })?;
    let dirents = store.read().all_dirents()?;
    rep.inodes = scan.inodes.len() as u64;
    rep.entries = dirents.len() as u64;
    scan.check_root(rep);
    let tx = if repair { Some(store.write()?) } else { None };
    scan.check_entries(&dirents, rep, tx.as_ref())?;
    let reach = scan.reachable();
    let mut lost = Vec::new();
    for (ino, i) in &scan.inodes {
        if i.kind == Kind::Dir {
            scan.check_dir_links(i, rep, tx.as_ref())?;
        } else if scan.check_links(i, rep, tx.as_ref())? {
            lost.push(*ino);
        }
        if i.nlink > 0 && !reach.contains(ino) && scan.names.contains_key(ino) {
            rep.add(
                Level::Error,
                format!("inode {} is not reachable from the root", ino.0),
                false,
            );
        }
        if i.kind == Kind::Symlink && store.read().symlink_target(*ino)?.is_none() {
            rep.add(
                Level::Error,
                format!("symlink {} has no target", ino.0),
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

impl TreeScan {
    fn links_to(&self, ino: InodeNo) -> u32 {
        self.names.get(&ino).map(|v| v.len() as u32).unwrap_or(0)
    }

    fn check_root(&self, rep: &mut FsckReport) {
        match self.inodes.get(&InodeNo::ROOT) {
            Some(r) if r.kind == Kind::Dir => {}
            _ => rep.add(
                Level::Error,
                "the root inode is missing or not a directory".into(),
                false,
            ),
        }
    }

    /// Each entry: in a directory, naming an inode that exists, of the kind it says (with
    /// `tx`: dropped, or its kind corrected). Records the sound ones in the scan.
    fn check_entries(
        &mut self,
        dirents: &[(InodeNo, Dirent)],
        rep: &mut FsckReport,
        tx: Option<&Tx>,
    ) -> Result<(), FsckError> {
        for (parent, d) in dirents {
            let shown = String::from_utf8_lossy(&d.name);
            match self.inodes.get(parent) {
                Some(p) if p.kind == Kind::Dir => {}
                _ => {
                    rep.add(
                        Level::Error,
                        format!(
                            "entry `{shown}` is in inode {} which is not a directory",
                            parent.0
                        ),
                        false,
                    );
                    continue;
                }
            }
            let Some(target) = self.inodes.get(&d.ino) else {
                if let Some(tx) = tx {
                    tx.unlink(*parent, &d.name)?;
                }
                rep.add(
                    Level::Error,
                    format!(
                        "entry `{shown}` in directory {} names missing inode {}",
                        parent.0, d.ino.0
                    ),
                    tx.is_some(),
                );
                continue;
            };
            if target.kind != d.kind {
                if let Some(tx) = tx {
                    tx.relink(*parent, &d.name, d.ino, target.kind)?;
                }
                rep.add(
                    Level::Error,
                    format!(
                        "entry `{shown}` says {:?} but inode {} is {:?}",
                        d.kind, d.ino.0, target.kind
                    ),
                    tx.is_some(),
                );
            }
            self.names.entry(d.ino).or_default().push(*parent);
            self.children.entry(*parent).or_default().push(d.ino);
            if target.kind == Kind::Dir {
                *self.subdirs.entry(*parent).or_default() += 1;
            }
        }
        Ok(())
    }

    /// The inodes reachable from the root through the entries.
    fn reachable(&self) -> HashSet<InodeNo> {
        let mut reach: HashSet<InodeNo> = HashSet::new();
        let mut stack = vec![InodeNo::ROOT];
        while let Some(d) = stack.pop() {
            if !reach.insert(d) {
                continue;
            }
            for c in self.children.get(&d).into_iter().flatten() {
                stack.push(*c);
            }
        }
        reach
    }

    /// A directory: one entry names it (the root: none), in its recorded parent, and its
    /// link count is 2 plus its subdirectories (with `tx`: corrected).
    fn check_dir_links(
        &self,
        i: &Inode,
        rep: &mut FsckReport,
        tx: Option<&Tx>,
    ) -> Result<(), FsckError> {
        let ino = i.ino;
        let links = self.links_to(ino);
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
            if let Some(p) = self.names.get(&ino).and_then(|v| v.first()) {
                if *p != i.parent {
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
        let want = 2 + self.subdirs.get(&ino).copied().unwrap_or(0);
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
        i: &Inode,
        rep: &mut FsckReport,
        tx: Option<&Tx>,
    ) -> Result<bool, FsckError> {
        let (ino, links) = (i.ino, self.links_to(i.ino));
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
            let i = &self.inodes[ino];
            tx.link(lf, format!("#{}", ino.0).as_bytes(), *ino, i.kind)?;
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
        let s = Store::open(&dir.path().join("meta.db"), Nanos(1)).unwrap();
        (dir, s)
    }

    fn inode(kind: Kind, nlink: u32) -> Inode {
        Inode {
            ino: InodeNo(0),
            kind,
            perm: 0o755,
            uid: 0,
            gid: 0,
            nlink,
            size: 0,
            atime: Nanos(1),
            mtime: Nanos(1),
            ctime: Nanos(1),
            rdev: 0,
            parent: InodeNo::ROOT,
            storage: Storage::Inline,
        }
    }

    /// The scan of `s` after `check_entries`.
    fn scan(s: &Store, rep: &mut FsckReport) -> TreeScan {
        let mut scan = TreeScan {
            inodes: s
                .read()
                .all_inodes()
                .unwrap()
                .into_iter()
                .map(|i| (i.ino, i))
                .collect(),
            ..Default::default()
        };
        let dirents = s.read().all_dirents().unwrap();
        scan.check_entries(&dirents, rep, None).unwrap();
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
        assert_eq!(sc.subdirs.get(&InodeNo::ROOT), None, "f is a file");

        let tx = s.write().unwrap();
        let dirents = tx.all_dirents().unwrap();
        let mut rep = FsckReport::default();
        let mut sc = TreeScan {
            inodes: sc.inodes,
            ..Default::default()
        };
        sc.check_entries(&dirents, &mut rep, Some(&tx)).unwrap();
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
        sc.children.insert(InodeNo::ROOT, vec![InodeNo(2)]);
        sc.children.insert(InodeNo(2), vec![InodeNo(3)]);
        sc.children.insert(InodeNo(7), vec![InodeNo(8), InodeNo(7)]);
        let r = sc.reachable();
        let mut r: Vec<u64> = r.into_iter().map(|i| i.0).collect();
        r.sort();
        assert_eq!(r, [InodeNo::ROOT.0, 2, 3]);
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
        for i in sc.inodes.values() {
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
        sc.check_dir_links(&sc.inodes[&a], &mut rep, Some(&tx))
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
            .check_links(&sc.inodes[&two], &mut rep, Some(&tx))
            .unwrap());
        assert!(sc
            .check_links(&sc.inodes[&lost], &mut rep, Some(&tx))
            .unwrap());
        assert!(!sc
            .check_links(&sc.inodes[&open], &mut rep, Some(&tx))
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

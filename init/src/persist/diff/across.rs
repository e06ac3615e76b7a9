//! What differs between two full snapshots, read as two sorted streams and merged: the
//! keys whose records differ, in memory of what differs, not of the trees (`sparse` across
//! a full snapshot, where no delta says what changed).
//!
//! A full snapshot lists its records in key order in a few ascending runs: a checkpoint
//! writes every inode in number order but its chunked files' records after the others' (two
//! runs), and every entry in (parent, name) order (one run); a fork writes one run of each.
//! One pass over each object finds the runs of both sections, keeping the later runs' records
//! when they are short; a second pass merges them with the first run, the inodes and then
//! the entries by one reader (a long later run gets a reader of its own, which decodes what
//! comes before it once more). An object in more than [`MAX_RUNS`] runs, or naming a key
//! twice, is not read this way (`Ok(false)`: the caller takes whole trees).

use std::cmp::Ordering;

use crate::persist::format::{reader, BodyReader, DirentRec, FormatError, InodeRec};
use crate::persist::history::Changed;

/// Runs a full snapshot's section may come in before it is read some other way.
const MAX_RUNS: usize = 4;

/// A record of a full snapshot's section, read and ordered by its key.
trait Keyed: Sized + PartialEq + Clone {
    fn read(r: &mut BodyReader<'_>) -> Result<Option<Self>, FormatError>;
    fn key_cmp(&self, other: &Self) -> Ordering;
}

impl Keyed for InodeRec {
    fn read(r: &mut BodyReader<'_>) -> Result<Option<Self>, FormatError> {
        r.next_inode()
    }
    fn key_cmp(&self, other: &Self) -> Ordering {
        self.ino.cmp(&other.ino)
    }
}

impl Keyed for DirentRec {
    fn read(r: &mut BodyReader<'_>) -> Result<Option<Self>, FormatError> {
        r.next_dirent()
    }
    fn key_cmp(&self, other: &Self) -> Ordering {
        (self.parent, self.name.as_slice()).cmp(&(other.parent, other.name.as_slice()))
    }
}

/// Records of a full snapshot section's later runs (after the first) kept from the pass
/// that counts them, at most this many per section (a checkpoint's chunked files: few);
/// longer later runs get a reader of their own, which decodes the records before them once
/// more.
const BUFFER_MAX: usize = 1 << 16;

/// How one section of a full snapshot comes: its first run's length, then the later runs,
/// kept or to be read again.
struct Plan<T> {
    first: u64,
    later: Later<T>,
}

enum Later<T> {
    Kept(Vec<Vec<T>>),
    /// (records before the run in the section, the run's length) of each.
    Reread(Vec<(u64, u64)>),
}

impl<T: Keyed> Plan<T> {
    /// Reads the section from `r` (left at its end). `None` when it comes in more than
    /// [`MAX_RUNS`] ascending runs.
    fn of(r: &mut BodyReader<'_>) -> Result<Option<Plan<T>>, FormatError> {
        let mut lens: Vec<u64> = Vec::new();
        let (mut n, mut prev): (u64, Option<T>) = (0, None);
        let mut kept: Option<Vec<Vec<T>>> = Some(Vec::new());
        let mut kept_n = 0;
        while let Some(x) = T::read(r)? {
            if prev
                .as_ref()
                .is_some_and(|p| p.key_cmp(&x) != Ordering::Less)
            {
                if lens.len() + 1 == MAX_RUNS {
                    return Ok(None);
                }
                lens.push(n);
                n = 0;
                if let Some(k) = kept.as_mut() {
                    k.push(Vec::new());
                }
            }
            n += 1;
            if !lens.is_empty() {
                if kept_n == BUFFER_MAX {
                    kept = None;
                }
                if let Some(k) = kept.as_mut() {
                    k.last_mut().expect("a later run").push(x.clone());
                    kept_n += 1;
                }
            }
            prev = Some(x);
        }
        lens.push(n);
        let first = lens[0];
        let later = match kept {
            Some(k) => Later::Kept(k),
            None => {
                let mut before = first;
                let mut runs = Vec::new();
                for len in &lens[1..] {
                    runs.push((before, *len));
                    before += len;
                }
                Later::Reread(runs)
            }
        };
        Ok(Some(Plan { first, later }))
    }
}

/// Where a run's records come from.
enum Src<'a, T> {
    /// A reader of the object and the run's records it has still to give.
    Reader {
        r: BodyReader<'a>,
        left: u64,
    },
    Kept(std::vec::IntoIter<T>),
}

impl<T: Keyed> Src<'_, T> {
    fn pull(&mut self) -> Result<Option<T>, FormatError> {
        match self {
            Src::Reader { r, left } => {
                if *left == 0 {
                    return Ok(None);
                }
                *left -= 1;
                T::read(r)
            }
            Src::Kept(it) => Ok(it.next()),
        }
    }
}

/// One ascending run and its next record.
struct Run<'a, T> {
    src: Src<'a, T>,
    head: Option<T>,
}

/// One section of a full snapshot in key order.
struct Sorted<'a, T> {
    runs: Vec<Run<'a, T>>,
    /// A key came twice: the stream stopped, and its end means nothing.
    twice: bool,
}

impl<'a, T: Keyed> Sorted<'a, T> {
    /// The section as `plan` found it, its first run read by `main` (a reader at the
    /// section's start, or before it), the later ones kept or read again from `data`.
    fn new(
        main: BodyReader<'a>,
        key: &str,
        data: &'a [u8],
        plan: Plan<T>,
    ) -> Result<Self, FormatError> {
        let mut srcs = vec![Src::Reader {
            r: main,
            left: plan.first,
        }];
        match plan.later {
            Later::Kept(runs) => srcs.extend(runs.into_iter().map(|v| Src::Kept(v.into_iter()))),
            Later::Reread(runs) => {
                for (before, len) in runs {
                    let (_, mut r) = reader(key, data)?;
                    for _ in 0..before {
                        T::read(&mut r)?;
                    }
                    srcs.push(Src::Reader { r, left: len });
                }
            }
        }
        let mut runs = Vec::with_capacity(srcs.len());
        for mut src in srcs {
            let head = src.pull()?;
            runs.push(Run { src, head });
        }
        Ok(Sorted { runs, twice: false })
    }

    /// The reader of the first run, for the next section.
    fn into_main(self) -> BodyReader<'a> {
        match self.runs.into_iter().next().map(|r| r.src) {
            Some(Src::Reader { r, .. }) => r,
            _ => unreachable!("the first run is read by the main reader"),
        }
    }

    /// The next record by key; `None` at the end (or once a key came twice).
    fn next(&mut self) -> Result<Option<T>, FormatError> {
        let mut best: Option<usize> = None;
        for i in 0..self.runs.len() {
            let Some(h) = &self.runs[i].head else {
                continue;
            };
            if let Some(b) = best {
                match h.key_cmp(self.runs[b].head.as_ref().expect("a head")) {
                    Ordering::Less => best = Some(i),
                    Ordering::Equal => {
                        self.twice = true;
                        return Ok(None);
                    }
                    Ordering::Greater => {}
                }
            } else {
                best = Some(i);
            }
        }
        let Some(b) = best else {
            return Ok(None);
        };
        let run = &mut self.runs[b];
        let out = run.head.take();
        run.head = run.src.pull()?;
        Ok(out)
    }
}

/// Calls `differs` with each record of `a` or `b` whose key the other lacks or holds with
/// another record (`a`'s when both have it). `Ok(false)` when a key came twice.
fn walk<T: Keyed>(
    a: &mut Sorted<'_, T>,
    b: &mut Sorted<'_, T>,
    mut differs: impl FnMut(T),
) -> Result<bool, FormatError> {
    let (mut x, mut y) = (a.next()?, b.next()?);
    while !a.twice && !b.twice {
        match (x.take(), y.take()) {
            (None, None) => break,
            (Some(p), None) => {
                differs(p);
                x = a.next()?;
            }
            (None, Some(q)) => {
                differs(q);
                y = b.next()?;
            }
            (Some(p), Some(q)) => match p.key_cmp(&q) {
                Ordering::Less => {
                    differs(p);
                    (x, y) = (a.next()?, Some(q));
                }
                Ordering::Greater => {
                    differs(q);
                    (x, y) = (Some(p), b.next()?);
                }
                Ordering::Equal => {
                    if p != q {
                        differs(p);
                    }
                    (x, y) = (a.next()?, b.next()?);
                }
            },
        }
    }
    Ok(!a.twice && !b.twice)
}

/// A full snapshot's two sections as they come (one pass over the object).
struct Plans {
    inodes: Plan<InodeRec>,
    dirents: Plan<DirentRec>,
}

impl Plans {
    fn of(key: &str, data: &[u8]) -> Result<Option<Plans>, FormatError> {
        let (_, mut r) = reader(key, data)?;
        let Some(inodes) = Plan::of(&mut r)? else {
            return Ok(None);
        };
        let Some(dirents) = Plan::of(&mut r)? else {
            return Ok(None);
        };
        Ok(Some(Plans { inodes, dirents }))
    }
}

/// Whether a full snapshot's inodes and entries read to their end without an error: which of
/// the two objects a failed [`fulls_differ`] could not read (each is read whole, to find its
/// runs, before the merge starts).
pub(super) fn reads_whole(key: &str, data: &[u8]) -> bool {
    Plans::of(key, data).is_ok()
}

/// Adds to `changed` every inode and entry whose record differs between the full snapshots
/// `a` and `b` (objects as fetched), or that only one of them has. `Ok(false)` (and
/// `changed` then means nothing) when either does not list its records in key order. Each
/// object is read twice: once to find its runs (keeping the short later ones), once to
/// merge, the entries by the reader that merged the inodes.
pub(super) fn fulls_differ(
    a: (&str, &[u8]),
    b: (&str, &[u8]),
    changed: &mut Changed,
) -> Result<bool, FormatError> {
    let (Some(pa), Some(pb)) = (Plans::of(a.0, a.1)?, Plans::of(b.0, b.1)?) else {
        return Ok(false);
    };
    let (mut ia, mut ib) = (
        Sorted::new(reader(a.0, a.1)?.1, a.0, a.1, pa.inodes)?,
        Sorted::new(reader(b.0, b.1)?.1, b.0, b.1, pb.inodes)?,
    );
    if !walk(&mut ia, &mut ib, |r: InodeRec| {
        changed.inodes.insert(r.ino);
    })? {
        return Ok(false);
    }
    let (mut da, mut db) = (
        Sorted::new(ia.into_main(), a.0, a.1, pa.dirents)?,
        Sorted::new(ib.into_main(), b.0, b.1, pb.dirents)?,
    );
    walk(&mut da, &mut db, |d: DirentRec| {
        changed.dirents.insert((d.parent, d.name));
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::format::{encode, Body, Header};

    fn object(seq: u64, inodes: &[u64], dirents: &[(u64, &str)]) -> Vec<u8> {
        let body = Body {
            inodes: inodes
                .iter()
                .map(|i| InodeRec::test_file(*i, &format!("{i}\n")))
                .collect(),
            dirents: dirents
                .iter()
                .map(|(p, n)| DirentRec::test(*p, n, 100 + *p, libc::S_IFREG))
                .collect(),
            ..Default::default()
        };
        encode(&Header::test(seq, None), &body).unwrap()
    }

    fn differ(a: &[u8], b: &[u8]) -> Option<Changed> {
        let mut c = Changed::default();
        fulls_differ(("a", a), ("b", b), &mut c)
            .unwrap()
            .then_some(c)
    }

    /// Records in two or three ascending runs (a checkpoint's chunked files last) merge
    /// into key order: only what one side lacks or holds otherwise is named.
    #[test]
    fn runs_merge_into_key_order() {
        let a = object(1, &[1, 2, 5, 9, 3, 4, 7], &[(1, "a"), (1, "b"), (2, "a")]);
        let mut b_inodes = vec![1, 3, 5, 9, 2, 4, 8];
        let b = object(2, &b_inodes, &[(1, "b"), (2, "a"), (2, "b")]);
        let c = differ(&a, &b).unwrap();
        assert_eq!(c.inodes.into_iter().collect::<Vec<_>>(), vec![7, 8]);
        assert_eq!(
            c.dirents.into_iter().collect::<Vec<_>>(),
            vec![(1, b"a".to_vec()), (2, b"b".to_vec())]
        );
        // A record that differs in its value only.
        let mut body = Body {
            inodes: b_inodes
                .iter()
                .map(|i| InodeRec::test_file(*i, &format!("{i}\n")))
                .collect(),
            ..Default::default()
        };
        body.inodes[1] = InodeRec::test_file(3, "three\n");
        let b2 = encode(&Header::test(3, None), &body).unwrap();
        let c = differ(&b, &b2).unwrap();
        assert_eq!(c.inodes.into_iter().collect::<Vec<_>>(), vec![3]);
        assert_eq!(c.dirents.len(), 3, "b2 has no entries");
        // Three runs still merge; an empty side names everything.
        b_inodes = vec![4, 5, 1, 2, 3];
        let three = object(4, &b_inodes, &[]);
        let empty = object(5, &[], &[]);
        let c = differ(&three, &empty).unwrap();
        assert_eq!(
            c.inodes.into_iter().collect::<Vec<_>>(),
            vec![1, 2, 3, 4, 5]
        );
        assert!(differ(&three, &three).unwrap().inodes.is_empty());
        // Four runs, the most merged.
        let four = object(6, &[1, 5, 2, 6, 3, 7, 4, 8], &[]);
        let c = differ(&four, &empty).unwrap();
        assert_eq!(
            c.inodes.into_iter().collect::<Vec<_>>(),
            (1..=8).collect::<Vec<_>>()
        );
        // A later run too long to keep is read again, by a reader of its own; the entries
        // after it still come.
        let n = BUFFER_MAX as u64 + 10;
        let odd_then_even: Vec<u64> = (0..n)
            .map(|i| 2 * i + 1)
            .chain((0..n).map(|i| 2 * i + 2))
            .collect();
        let long = object(7, &odd_then_even, &[(1, "a"), (2, "b")]);
        let mut all: Vec<u64> = (1..=2 * n).collect();
        all.retain(|i| *i != 2 * n - 1);
        let most = object(8, &all, &[(1, "a")]);
        let c = differ(&long, &most).unwrap();
        assert_eq!(c.inodes.into_iter().collect::<Vec<_>>(), vec![2 * n - 1]);
        assert_eq!(
            c.dirents.into_iter().collect::<Vec<_>>(),
            vec![(2, b"b".to_vec())]
        );
    }

    /// Records in more runs than merging is worth, or a key listed twice: not read this
    /// way, so the caller decodes whole trees instead of trusting a partial answer.
    #[test]
    fn unordered_or_repeated_records_are_refused() {
        let ok = object(1, &[1, 2, 3], &[(1, "a")]);
        let shuffled = object(2, &[5, 4, 3, 2, 1], &[(1, "a")]);
        assert!(differ(&ok, &shuffled).is_none());
        assert!(differ(&shuffled, &ok).is_none());
        let twice = object(3, &[1, 2, 3, 2], &[(1, "a")]);
        assert!(differ(&ok, &twice).is_none());
        let twice_entry = object(4, &[1, 2, 3], &[(1, "a"), (1, "a")]);
        assert!(differ(&ok, &twice_entry).is_none());
        assert!(differ(&ok, &ok).is_some_and(|c| c.inodes.is_empty() && c.dirents.is_empty()));
    }
}

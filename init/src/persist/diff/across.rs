//! What differs between two full snapshots, read as two sorted streams and merged: the
//! keys whose records differ, in memory of what differs, not of the trees (`sparse` across
//! a full snapshot, where no delta says what changed).
//!
//! A full snapshot lists its records in key order in a few ascending runs: a checkpoint
//! writes every inode in number order but its chunked files' records after the others' (two
//! runs), and every entry in (parent, name) order (one run); a fork writes one run of each.
//! Each run gets its own reader of the object (the later ones skip what comes before), and
//! the runs are merged. An object in more than [`MAX_RUNS`] runs, or naming a key twice,
//! is not read this way (`Ok(false)`: the caller takes whole trees).

use std::cmp::Ordering;

use crate::persist::format::{reader, BodyReader, DirentRec, FormatError, InodeRec};
use crate::persist::history::Changed;

/// Runs a full snapshot's section may come in before it is read some other way: each run
/// past the first decodes the records before it once more.
const MAX_RUNS: usize = 4;

/// A record of a full snapshot's section, read and ordered by its key.
trait Keyed: Sized + PartialEq {
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

/// One ascending run: its reader, the records it has left after `head`, and `head`.
struct Run<'a, T> {
    r: BodyReader<'a>,
    left: u64,
    head: Option<T>,
}

/// One section of a full snapshot in key order.
struct Sorted<'a, T> {
    runs: Vec<Run<'a, T>>,
    /// A key came twice: the stream stopped, and its end means nothing.
    twice: bool,
}

impl<'a, T: Keyed> Sorted<'a, T> {
    /// `None` when the section comes in more than [`MAX_RUNS`] ascending runs.
    fn open(key: &str, data: &'a [u8]) -> Result<Option<Self>, FormatError> {
        let (_, mut r) = reader(key, data)?;
        let mut lens = Vec::new();
        let (mut n, mut prev): (u64, Option<T>) = (0, None);
        while let Some(x) = T::read(&mut r)? {
            if prev
                .as_ref()
                .is_some_and(|p| p.key_cmp(&x) != Ordering::Less)
            {
                if lens.len() + 1 == MAX_RUNS {
                    return Ok(None);
                }
                lens.push(n);
                n = 0;
            }
            n += 1;
            prev = Some(x);
        }
        lens.push(n);
        let mut runs = Vec::with_capacity(lens.len());
        let mut before = 0;
        for len in lens {
            let (_, mut r) = reader(key, data)?;
            for _ in 0..before {
                T::read(&mut r)?;
            }
            before += len;
            let head = if len > 0 { T::read(&mut r)? } else { None };
            runs.push(Run {
                r,
                left: len.saturating_sub(1),
                head,
            });
        }
        Ok(Some(Sorted { runs, twice: false }))
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
        if run.left > 0 {
            run.left -= 1;
            run.head = T::read(&mut run.r)?;
        }
        Ok(out)
    }
}

/// Calls `differs` with each record of `a` or `b` whose key the other lacks or holds with
/// another record (`a`'s when both have it). `Ok(false)` when either is not in key order.
fn walk<T: Keyed>(
    a: (&str, &[u8]),
    b: (&str, &[u8]),
    mut differs: impl FnMut(T),
) -> Result<bool, FormatError> {
    let (Some(mut a), Some(mut b)) = (Sorted::<T>::open(a.0, a.1)?, Sorted::<T>::open(b.0, b.1)?)
    else {
        return Ok(false);
    };
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

/// Adds to `changed` every inode and entry whose record differs between the full snapshots
/// `a` and `b` (objects as fetched), or that only one of them has. `Ok(false)` (and
/// `changed` then means nothing) when either does not list its records in key order.
pub(super) fn fulls_differ(
    a: (&str, &[u8]),
    b: (&str, &[u8]),
    changed: &mut Changed,
) -> Result<bool, FormatError> {
    Ok(walk(a, b, |r: InodeRec| {
        changed.inodes.insert(r.ino);
    })? && walk(a, b, |d: DirentRec| {
        changed.dirents.insert((d.parent, d.name));
    })?)
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

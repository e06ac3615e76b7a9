//! The table of inodes in use (looked up by the kernel, or open), keyed by inode number,
//! without a hash table's slack per entry.
//!
//! Inode numbers are handed out in increasing order, so the ones in use are mostly dense.
//! The table is cut into pages of 64 consecutive numbers; a page holds a bitmap of which
//! are present and only those values, in number order, in a vector sized to them (at most
//! 3 spare slots). Pages sit in a hash table keyed by `ino / 64`, so a dense table costs
//! the value's size plus about one byte per entry (40.7 bytes for a 40-byte value, where
//! the hash map it replaced took 48-byte slots at up to 2x slack); a lone entry in its page
//! costs about 220 bytes. Any `u64` is a valid key.

use std::collections::HashMap;

use crate::meta::InodeNo;

const PAGE_BITS: u32 = 6;
const PAGE: u64 = 1 << PAGE_BITS;
/// Slots a page vector grows by at most (its spare capacity).
const GROW: usize = 4;

struct Page<V> {
    /// Bit `ino % 64` set: that inode is present; its value is at the rank of the bit.
    present: u64,
    items: Vec<V>,
}

impl<V> Page<V> {
    /// Position of `bit`'s value in `items` (the number of present bits below it).
    fn rank(&self, bit: u32) -> usize {
        (self.present & ((1u64 << bit) - 1)).count_ones() as usize
    }
}

/// A map from inode number to `V` (see the module doc).
pub struct NodeMap<V> {
    pages: HashMap<u64, Page<V>>,
    len: usize,
}

fn split(ino: InodeNo) -> (u64, u32) {
    (ino.0 >> PAGE_BITS, (ino.0 & (PAGE - 1)) as u32)
}

impl<V> Default for NodeMap<V> {
    fn default() -> Self {
        NodeMap::new()
    }
}

impl<V> NodeMap<V> {
    pub fn new() -> Self {
        NodeMap {
            pages: HashMap::new(),
            len: 0,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, ino: &InodeNo) -> Option<&V> {
        let (p, bit) = split(*ino);
        let page = self.pages.get(&p)?;
        (page.present >> bit & 1 == 1).then(|| &page.items[page.rank(bit)])
    }

    pub fn get_mut(&mut self, ino: &InodeNo) -> Option<&mut V> {
        let (p, bit) = split(*ino);
        let page = self.pages.get_mut(&p)?;
        if page.present >> bit & 1 == 0 {
            return None;
        }
        let at = page.rank(bit);
        Some(&mut page.items[at])
    }

    /// Sets the value of `ino`; returns the one it replaces.
    pub fn insert(&mut self, ino: InodeNo, v: V) -> Option<V> {
        let (p, bit) = split(ino);
        let page = self.pages.entry(p).or_insert_with(|| Page {
            present: 0,
            items: Vec::new(),
        });
        let at = page.rank(bit);
        if page.present >> bit & 1 == 1 {
            return Some(std::mem::replace(&mut page.items[at], v));
        }
        if page.items.len() == page.items.capacity() {
            let room = PAGE as usize - page.items.len();
            page.items.reserve_exact(GROW.min(room));
        }
        page.items.insert(at, v);
        page.present |= 1 << bit;
        self.len += 1;
        None
    }

    /// The value of `ino`, for `or_default` (as `HashMap::entry`).
    pub fn entry(&mut self, ino: InodeNo) -> Entry<'_, V> {
        Entry { map: self, ino }
    }

    pub fn remove(&mut self, ino: &InodeNo) -> Option<V> {
        let (p, bit) = split(*ino);
        let page = self.pages.get_mut(&p)?;
        if page.present >> bit & 1 == 0 {
            return None;
        }
        let at = page.rank(bit);
        let v = page.items.remove(at);
        page.present &= !(1 << bit);
        self.len -= 1;
        if page.present == 0 {
            self.pages.remove(&p);
            // The page table gives back what a burst of lookups made it grow to.
            let cap = self.pages.capacity();
            if cap > 1024 && self.pages.len() < cap / 4 {
                self.pages.shrink_to(self.pages.len() * 2);
            }
        } else if page.items.capacity() - page.items.len() > GROW {
            page.items.shrink_to(page.items.len() + GROW);
        }
        Some(v)
    }

    /// Every entry, in no particular order. The key derefs to the inode number (as the
    /// `&InodeNo` of `HashMap::iter`, which this map has nowhere to point into).
    pub fn iter(&self) -> impl Iterator<Item = (Key, &V)> {
        self.pages.iter().flat_map(|(p, page)| {
            Bits(page.present)
                .zip(page.items.iter())
                .map(move |(bit, v)| (Key(InodeNo(p << PAGE_BITS | u64::from(bit))), v))
        })
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.pages.values().flat_map(|page| page.items.iter())
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.pages
            .values_mut()
            .flat_map(|page| page.items.iter_mut())
    }

    /// Heap bytes the table holds (page table and page vectors), for measurements.
    #[cfg(test)]
    pub fn heap_bytes(&self) -> usize {
        let table = self.pages.capacity()
            * (std::mem::size_of::<u64>() + std::mem::size_of::<Page<V>>() + 1);
        let items: usize = self
            .pages
            .values()
            .map(|p| p.items.capacity() * std::mem::size_of::<V>())
            .sum();
        table + items
    }
}

/// An inode number yielded by [`NodeMap::iter`]; `*key` is the `InodeNo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key(InodeNo);

impl std::ops::Deref for Key {
    type Target = InodeNo;

    fn deref(&self) -> &InodeNo {
        &self.0
    }
}

/// A slot of the map (see [`NodeMap::entry`]).
pub struct Entry<'a, V> {
    map: &'a mut NodeMap<V>,
    ino: InodeNo,
}

impl<'a, V: Default> Entry<'a, V> {
    pub fn or_default(self) -> &'a mut V {
        if self.map.get(&self.ino).is_none() {
            self.map.insert(self.ino, V::default());
        }
        self.map.get_mut(&self.ino).expect("just inserted")
    }
}

/// The set bits of a word, lowest first.
struct Bits(u64);

impl Iterator for Bits {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// The map against a `BTreeMap` doing the same.
    fn same(m: &NodeMap<u64>, want: &BTreeMap<u64, u64>) {
        assert_eq!(m.len(), want.len());
        let mut got: Vec<(u64, u64)> = m.iter().map(|(i, v)| ((*i).0, *v)).collect();
        got.sort();
        let want_v: Vec<(u64, u64)> = want.iter().map(|(i, v)| (*i, *v)).collect();
        assert_eq!(got, want_v);
        for (i, v) in want {
            assert_eq!(m.get(&InodeNo(*i)), Some(v), "ino {i}");
        }
        let mut vals: Vec<u64> = m.values().copied().collect();
        vals.sort();
        let mut want_vals: Vec<u64> = want.values().copied().collect();
        want_vals.sort();
        assert_eq!(vals, want_vals);
    }

    #[test]
    fn insert_get_remove_iterate_dense_sparse_and_huge() {
        let mut m = NodeMap::new();
        let mut want = BTreeMap::new();
        let keys: Vec<u64> = (1..5000)
            .chain((0..200).map(|k| k * 7919 + 1_000_000))
            .chain([u64::MAX, u64::MAX - 1, u64::MAX - 64, 0, 63, 64, 1 << 40])
            .collect();
        for (n, k) in keys.iter().enumerate() {
            assert_eq!(m.insert(InodeNo(*k), n as u64), want.insert(*k, n as u64));
        }
        same(&m, &want);
        assert_eq!(m.get(&InodeNo(5000)), None);
        assert_eq!(m.get(&InodeNo(u64::MAX - 2)), None);
        // Replacing keeps one entry.
        assert_eq!(m.insert(InodeNo(u64::MAX), 7), want.insert(u64::MAX, 7));
        same(&m, &want);
        // Remove every third key, and some absent ones.
        for k in keys.iter().step_by(3) {
            assert_eq!(m.remove(&InodeNo(*k)), want.remove(k));
            assert_eq!(m.remove(&InodeNo(*k)), None);
        }
        assert_eq!(m.remove(&InodeNo(123_456_789)), None);
        same(&m, &want);
        for v in m.values_mut() {
            *v += 1;
        }
        for v in want.values_mut() {
            *v += 1;
        }
        same(&m, &want);
        *m.entry(InodeNo(42)).or_default() += 5;
        *want.entry(42).or_default() += 5;
        *m.entry(InodeNo(1 << 50)).or_default() += 5;
        *want.entry(1 << 50).or_default() += 5;
        same(&m, &want);
        if let Some(v) = m.get_mut(&InodeNo(2)) {
            *v = 99;
        }
        if let Some(v) = want.get_mut(&2) {
            *v = 99;
        }
        same(&m, &want);
        for k in want.keys().copied().collect::<Vec<_>>() {
            m.remove(&InodeNo(k));
        }
        assert!(m.is_empty());
        assert_eq!(m.iter().count(), 0);
        assert!(m.heap_bytes() < 64 * 1024, "{}", m.heap_bytes());
    }

    /// A dense table costs the value plus about a byte per entry (the hash map it replaces:
    /// 48-byte slots at up to 2x slack). Printed, and bounded loosely.
    #[test]
    fn dense_table_has_no_slack() {
        let mut m: NodeMap<[u64; 5]> = NodeMap::new();
        let n = 200_000u64;
        for i in 1..=n {
            m.insert(InodeNo(i), [i; 5]);
        }
        let per = m.heap_bytes() as f64 / n as f64;
        println!("dense: {per:.1} bytes per 40-byte value");
        assert!(per < 44.0, "{per}");
        // Sparse: every 64th number.
        let mut s: NodeMap<[u64; 5]> = NodeMap::new();
        for i in 0..10_000u64 {
            s.insert(InodeNo(i * 64), [i; 5]);
        }
        println!(
            "one per page: {:.1} bytes per entry",
            s.heap_bytes() as f64 / 10_000.0
        );
    }
}

//! Packs: small chunks stored together, so a checkpoint of many small files writes a few
//! objects of a few MiB rather than one object per file, and a cold start fetches them in a
//! few large reads.
//!
//! ```text
//! <chunks>/packs/<blake3>.pack   the chunks' bytes, one after another (no header)
//! <chunks>/packs/<blake3>.idx    its index: which chunk is where (the format below)
//! ```
//!
//! Both are named by the blake3 of the pack's bytes. A checkpoint writes the pack, then its
//! index, before the snapshot that names any chunk in it. A chunk is found by its id in
//! the indexes of every pack on the chunk store (`PackMap`, loaded once per `Repo`, by a
//! lazy start in the background right after its restore, and again when a lookup misses), else as a loose object (`<chunks>/<aa>/<hex>`): snapshots
//! written before packs, and chunks too large to pack, are loose. The snapshot format does
//! not change: a chunk map names chunk ids, wherever they live.
//!
//! Index object: `KEELPIDX`, version (u32 LE), the pack's length (u64 LE), the entry count
//! (u32 LE), then per entry the chunk id (32 bytes), its offset (u64 LE) and length (u32
//! LE), sorted by offset; last, the blake3 of everything before it (a torn or damaged
//! index is refused whole, never half read).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use crate::chunk::ChunkId;

#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("pack index {key}: {reason}")]
    DecodeIndex { key: String, reason: String },
}

const MAGIC: &[u8; 8] = b"KEELPIDX";
const VERSION: u32 = 1;
const HEAD_LEN: usize = 8 + 4 + 8 + 4;
const ENTRY_LEN: usize = 32 + 8 + 4;

/// Where a chunk sits in its pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub id: ChunkId,
    pub off: u64,
    pub len: u32,
}

impl Entry {
    pub fn range(&self) -> std::ops::Range<u64> {
        self.off..self.off + u64::from(self.len)
    }
}

/// One pack as its index describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackIndex {
    /// The blake3 of the pack's bytes: its name.
    pub name: ChunkId,
    /// The pack's length in bytes.
    pub len: u64,
    /// Its chunks, by offset.
    pub entries: Vec<Entry>,
}

/// A pack ready to upload: its bytes and its index object.
pub struct Built {
    pub index: PackIndex,
    pub data: Bytes,
    pub index_bytes: Bytes,
}

/// Lays `chunks` out one after another in one pack (in the order given: the caller groups
/// them by directory) and writes its index.
pub fn build(chunks: &[(ChunkId, Bytes)]) -> Built {
    let total: usize = chunks.iter().map(|(_, b)| b.len()).sum();
    let mut data = Vec::with_capacity(total);
    let mut entries = Vec::with_capacity(chunks.len());
    for (id, b) in chunks {
        entries.push(Entry {
            id: *id,
            off: data.len() as u64,
            len: u32::try_from(b.len()).expect("a packed chunk is small"),
        });
        data.extend_from_slice(b);
    }
    let index = PackIndex {
        name: ChunkId::of(&data),
        len: data.len() as u64,
        entries,
    };
    let index_bytes = Bytes::from(encode_index(&index));
    Built {
        index,
        data: Bytes::from(data),
        index_bytes,
    }
}

/// The index object of a pack.
pub fn encode_index(p: &PackIndex) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEAD_LEN + p.entries.len() * ENTRY_LEN + 32);
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&p.len.to_le_bytes());
    v.extend_from_slice(&(p.entries.len() as u32).to_le_bytes());
    for e in &p.entries {
        v.extend_from_slice(&e.id.0);
        v.extend_from_slice(&e.off.to_le_bytes());
        v.extend_from_slice(&e.len.to_le_bytes());
    }
    let sum = ChunkId::of(&v);
    v.extend_from_slice(&sum.0);
    v
}

/// Reads the index object stored at `key` for pack `name`, checking its checksum and that
/// every entry lies inside the pack.
pub fn decode_index(key: &str, name: ChunkId, b: &[u8]) -> Result<PackIndex, PackError> {
    let bad = |reason: String| PackError::DecodeIndex {
        key: key.to_string(),
        reason,
    };
    if b.len() < HEAD_LEN + 32 || &b[..8] != MAGIC {
        return Err(bad("not a pack index (bad magic or too short)".into()));
    }
    let (body, sum) = b.split_at(b.len() - 32);
    if ChunkId::of(body).0 != sum {
        return Err(bad("checksum mismatch (torn or damaged)".into()));
    }
    let u32_at = |o: usize| u32::from_le_bytes(body[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(body[o..o + 8].try_into().expect("8 bytes"));
    let version = u32_at(8);
    if version != VERSION {
        return Err(bad(format!(
            "version {version} (this keel reads {VERSION})"
        )));
    }
    let len = u64_at(12);
    let count = u32_at(20) as usize;
    if body.len() != HEAD_LEN + count * ENTRY_LEN {
        return Err(bad(format!("{} bytes for {count} entries", body.len())));
    }
    let mut entries = Vec::with_capacity(count);
    for k in 0..count {
        let o = HEAD_LEN + k * ENTRY_LEN;
        let e = Entry {
            id: ChunkId(body[o..o + 32].try_into().expect("32 bytes")),
            off: u64_at(o + 32),
            len: u32_at(o + 40),
        };
        if e.range().end > len {
            return Err(bad(format!(
                "entry {} ends at {} past the pack's {len} bytes",
                e.id,
                e.range().end
            )));
        }
        entries.push(e);
    }
    Ok(PackIndex { name, len, entries })
}

/// Gathers a checkpoint's small chunks and cuts them into packs: sorted by a key the caller
/// gives (directory, file, window: a directory's files end up together), each pack closed
/// once it holds `size` bytes. What is left at the end goes into one last pack, or loose
/// when it is a single chunk (a pack of one is two objects for one).
pub struct Packer {
    below: u64,
    size: u64,
    pending: Vec<((u64, u64, u64), ChunkId, Bytes)>,
    bytes: u64,
}

impl Packer {
    /// Chunks under `below` bytes are packed (0: none), `size` bytes a pack.
    pub fn new(below: u64, size: u64) -> Packer {
        Packer {
            below,
            size: size.max(1),
            pending: Vec::new(),
            bytes: 0,
        }
    }

    /// Whether a chunk of `len` bytes goes into a pack.
    pub fn takes(&self, len: usize) -> bool {
        (len as u64) < self.below
    }

    pub fn add(&mut self, key: (u64, u64, u64), id: ChunkId, data: Bytes) {
        self.bytes += data.len() as u64;
        self.pending.push((key, id, data));
    }

    /// Bytes waiting for a pack.
    pub fn pending_bytes(&self) -> u64 {
        self.bytes
    }

    /// The packs that are full (with `last`: every chunk, the remainder too) and, with
    /// `last`, a lone remaining chunk to store as its own object.
    pub fn cut(&mut self, last: bool) -> (Vec<Built>, Vec<(ChunkId, Bytes)>) {
        if self.bytes < self.size && !last {
            return (Vec::new(), Vec::new());
        }
        self.pending.sort_by_key(|p| p.0);
        let all = std::mem::take(&mut self.pending);
        self.bytes = 0;
        let parts = |s: &[((u64, u64, u64), ChunkId, Bytes)]| -> Vec<(ChunkId, Bytes)> {
            s.iter().map(|p| (p.1, p.2.clone())).collect()
        };
        let mut packs = Vec::new();
        let (mut start, mut acc) = (0, 0u64);
        for (i, p) in all.iter().enumerate() {
            acc += p.2.len() as u64;
            if acc >= self.size {
                packs.push(build(&parts(&all[start..=i])));
                (start, acc) = (i + 1, 0);
            }
        }
        let tail = &all[start..];
        let mut rest = Vec::new();
        if !last {
            // Not full yet: waits for the next batch.
            self.pending = tail.to_vec();
            self.bytes = acc;
        } else if tail.len() == 1 {
            rest = parts(tail);
        } else if !tail.is_empty() {
            packs.push(build(&parts(tail)));
        }
        (packs, rest)
    }
}

/// Where a chunk is: pack number (in `PackMap::packs`) and its place there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub pack: u32,
    pub off: u64,
    pub len: u32,
}

/// One pack of a `PackMap`: its name and length (its entries are in the map's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackInfo {
    /// The blake3 of the pack's bytes: its name.
    pub name: ChunkId,
    /// The pack's length in bytes.
    pub len: u64,
}

/// One packed chunk as the map keeps it: 40 bytes (the pack is known from where the slot
/// sits; offsets fit in 32 bits because the map refuses a pack of 4 GiB or more).
#[derive(Debug, Clone, Copy)]
struct Slot {
    id: [u8; 32],
    off: u32,
    len: u32,
}

impl Slot {
    fn entry(&self) -> Entry {
        Entry {
            id: ChunkId(self.id),
            off: u64::from(self.off),
            len: self.len,
        }
    }
}

/// Every pack of a chunk store and where each packed chunk is, in 44 bytes a chunk: one
/// flat table of `Slot`s, pack after pack, each pack's by offset (what a read-around and gc
/// walk), and the table's positions sorted by chunk id (what a lookup binary-searches).
/// A hash map of owned ids cost 123-161 bytes a chunk (2M chunks: 307 MiB of keel's RSS).
#[derive(Debug, Default)]
pub struct PackMap {
    /// The chunk store it was loaded for (`Repo::chunks`).
    pub store: String,
    pub packs: Vec<PackInfo>,
    slots: Vec<Slot>,
    /// Where each pack's slots begin in `slots` (one more: the end).
    starts: Vec<u32>,
    /// Positions in `slots` by (chunk id, position): a chunk in several packs (a repack that
    /// was cut short) has several, the first pack's first.
    by_id: Vec<u32>,
    /// Distinct packed chunk ids.
    distinct: usize,
    /// Index objects that could not be read, and why (fsck reports them; reads skip them).
    pub bad: Vec<String>,
}

/// Builds a `PackMap` one pack at a time (each pack's entries are copied into the table and
/// its decoded index dropped, so a load never holds every index twice).
#[derive(Debug, Default)]
pub struct PackMapBuilder {
    map: PackMap,
}

impl PackMapBuilder {
    pub fn new(store: &str) -> PackMapBuilder {
        let mut b = PackMapBuilder::default();
        b.map.store = store.to_string();
        b.map.starts.push(0);
        b
    }

    /// Adds a pack decoded from its index (a pack of 4 GiB or more, which no checkpoint
    /// writes, or a table past 4G chunks, goes to `bad` instead).
    pub fn add(&mut self, p: PackIndex) {
        let fits = u32::try_from(p.len).is_ok()
            && u32::try_from(self.map.slots.len() + p.entries.len()).is_ok();
        if !fits {
            self.map.bad.push(format!(
                "pack {}: {} bytes and {} chunks are more than a pack map holds",
                p.name,
                p.len,
                p.entries.len()
            ));
            return;
        }
        self.map.slots.extend(p.entries.iter().map(|e| Slot {
            id: e.id.0,
            off: e.off as u32,
            len: e.len,
        }));
        self.push(p.name, p.len);
    }

    /// Adds pack `k` of `prev` (an earlier map of the same store) without fetching its index.
    pub fn add_from(&mut self, prev: &PackMap, k: usize) {
        let r = prev.range(k);
        self.map.slots.extend_from_slice(&prev.slots[r]);
        self.push(prev.packs[k].name, prev.packs[k].len);
    }

    fn push(&mut self, name: ChunkId, len: u64) {
        self.map.packs.push(PackInfo { name, len });
        self.map.starts.push(self.map.slots.len() as u32);
    }

    /// Index objects that could not be read.
    pub fn bad(&mut self, why: String) {
        self.map.bad.push(why);
    }

    /// The map, its lookup order sorted (by an 8-byte prefix of each id first, so the sort
    /// moves 16-byte keys rather than chasing positions; whole ids break the rare ties).
    pub fn finish(self) -> PackMap {
        let mut m = self.map;
        let prefix = |s: &Slot| u64::from_be_bytes(s.id[..8].try_into().expect("8 bytes"));
        let mut keys: Vec<(u64, u32)> = m
            .slots
            .iter()
            .enumerate()
            .map(|(k, s)| (prefix(s), k as u32))
            .collect();
        keys.sort_unstable();
        let slots = &m.slots;
        let mut k = 0;
        while k < keys.len() {
            let j = k + keys[k..].partition_point(|x| x.0 == keys[k].0);
            if j - k > 1 {
                keys[k..j].sort_unstable_by(|a, b| {
                    (slots[a.1 as usize].id, a.1).cmp(&(slots[b.1 as usize].id, b.1))
                });
            }
            k = j;
        }
        m.by_id = keys.iter().map(|x| x.1).collect();
        drop(keys);
        m.distinct = m
            .by_id
            .iter()
            .enumerate()
            .filter(|(k, p)| *k == 0 || slots[m.by_id[k - 1] as usize].id != slots[**p as usize].id)
            .count();
        m.slots.shrink_to_fit();
        m
    }
}

impl PackMap {
    /// A map of `packs`, in that order.
    pub fn new(store: &str, packs: Vec<PackIndex>, bad: Vec<String>) -> PackMap {
        let mut b = PackMapBuilder::new(store);
        for p in packs {
            b.add(p);
        }
        for why in bad {
            b.bad(why);
        }
        b.finish()
    }

    fn range(&self, k: usize) -> std::ops::Range<usize> {
        self.starts[k] as usize..self.starts[k + 1] as usize
    }

    /// The pack the slot at `pos` belongs to.
    fn pack_of(&self, pos: usize) -> u32 {
        (self.starts.partition_point(|s| *s as usize <= pos) - 1) as u32
    }

    /// The chunks of pack `k`, by offset.
    pub fn entries(&self, k: usize) -> impl Iterator<Item = Entry> + '_ {
        self.slots[self.range(k)].iter().map(Slot::entry)
    }

    /// The chunks of pack `k` from offset `off` on, by offset.
    pub fn entries_from(&self, k: usize, off: u64) -> impl Iterator<Item = Entry> + '_ {
        let s = &self.slots[self.range(k)];
        let first = s.partition_point(|e| u64::from(e.off) < off);
        s[first..].iter().map(Slot::entry)
    }

    /// Every place chunk `id` is packed, the first one first.
    pub fn find(&self, id: &ChunkId) -> Vec<Loc> {
        let first = self
            .by_id
            .partition_point(|p| self.slots[*p as usize].id < id.0);
        self.by_id[first..]
            .iter()
            .map(|p| (*p as usize, &self.slots[*p as usize]))
            .take_while(|(_, s)| s.id == id.0)
            .map(|(p, s)| Loc {
                pack: self.pack_of(p),
                off: u64::from(s.off),
                len: s.len,
            })
            .collect()
    }

    pub fn contains(&self, id: &ChunkId) -> bool {
        let first = self
            .by_id
            .partition_point(|p| self.slots[*p as usize].id < id.0);
        self.by_id
            .get(first)
            .is_some_and(|p| self.slots[*p as usize].id == id.0)
    }

    /// Every packed chunk id (one in several packs once for each).
    pub fn ids(&self) -> impl Iterator<Item = ChunkId> + '_ {
        self.slots.iter().map(|s| ChunkId(s.id))
    }

    /// Packed chunks in all (distinct ids).
    pub fn len(&self) -> usize {
        self.distinct
    }

    pub fn is_empty(&self) -> bool {
        self.distinct == 0
    }

    /// Heap bytes the map holds (its table, lookup order and packs), for the logs.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.by_id.capacity() * 4
            + self.starts.capacity() * 4
            + self.packs.capacity() * std::mem::size_of::<PackInfo>()
    }
}

/// The pack map a `Repo` and its clones share: loaded on first use (or ahead of it, in the
/// background, by a lazy start), again on a miss.
#[derive(Default)]
pub struct PackCache {
    map: Mutex<Option<Arc<PackMap>>>,
    /// Held while the map is first loaded: a read that needs it meanwhile waits for that
    /// load instead of listing and fetching every index again.
    pub(super) loading: Mutex<()>,
}

impl PackCache {
    pub fn get(&self) -> Option<Arc<PackMap>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set(&self, m: Arc<PackMap>) {
        *self.map.lock().unwrap_or_else(|p| p.into_inner()) = Some(m);
    }
}

/// A read of a pack covers whole aligned blocks of this many bytes around what it wants:
/// the other chunks in them (a directory's other files, as packs are laid out) are kept
/// in the `Around` cache, so reading a directory's files one after another costs one round
/// trip per block rather than one per file.
pub const READ_AROUND: u64 = 1 << 20;
/// Bytes of chunks read around and not asked for yet that are kept at most.
pub const AROUND_BYTES: u64 = 32 << 20;

/// Chunks read around a wanted one (see `READ_AROUND`), taken out at their first use,
/// oldest dropped first past `AROUND_BYTES`. Content-addressed and checked at use, so
/// never stale.
#[derive(Default)]
pub struct Around {
    inner: Mutex<AroundInner>,
}

#[derive(Default)]
struct AroundInner {
    by_id: HashMap<ChunkId, Bytes>,
    order: std::collections::VecDeque<ChunkId>,
    bytes: u64,
}

impl Around {
    /// The bytes of `id` if they were read around, removed from the cache.
    pub fn take(&self, id: &ChunkId) -> Option<Bytes> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let b = g.by_id.remove(id)?;
        g.bytes -= b.len() as u64;
        Some(b)
    }

    pub fn put(&self, id: ChunkId, data: &[u8]) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.by_id.contains_key(&id) {
            return;
        }
        g.bytes += data.len() as u64;
        g.by_id.insert(id, Bytes::copy_from_slice(data));
        g.order.push_back(id);
        while g.bytes > AROUND_BYTES {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            if let Some(b) = g.by_id.remove(&old) {
                g.bytes -= b.len() as u64;
            }
        }
        if g.order.len() > 4 * g.by_id.len() + 64 {
            // Ids taken out linger in the queue: drop them now and then.
            let AroundInner { by_id, order, .. } = &mut *g;
            order.retain(|i| by_id.contains_key(i));
        }
    }
}

/// Widens each read to whole `READ_AROUND` blocks (within the pack's `len`) and joins the
/// reads of a pack that then touch.
pub fn widen(reads: Vec<Read>, len: impl Fn(u32) -> u64) -> Vec<Read> {
    let mut out: Vec<Read> = Vec::new();
    for mut r in reads {
        let l = len(r.pack);
        r.range.start = r.range.start / READ_AROUND * READ_AROUND;
        r.range.end = r
            .range
            .end
            .div_ceil(READ_AROUND)
            .saturating_mul(READ_AROUND)
            .min(l)
            .max(r.range.end);
        if let Some(last) = out.last_mut() {
            if last.pack == r.pack && r.range.start <= last.range.end {
                last.range.end = last.range.end.max(r.range.end);
                last.parts.extend(r.parts);
                continue;
            }
        }
        out.push(r);
    }
    out
}

/// Ranged reads of a pack that fetch several wanted chunks at once: ranges closer than
/// this are read as one (the bytes between are cheaper than another round trip).
pub const MERGE_GAP: u64 = 512 << 10;
/// A merged read spans at most this many bytes.
pub const MERGE_SPAN: u64 = 16 << 20;

/// One ranged read of a pack and the wanted chunks it covers: (position in the request,
/// offset and length inside the pack).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub pack: u32,
    pub range: std::ops::Range<u64>,
    pub parts: Vec<(usize, u64, u32)>,
}

/// Plans the reads for `wanted` (position, location): per pack, by offset, ranges merged
/// while the gap is at most `MERGE_GAP` and the span at most `MERGE_SPAN`.
pub fn plan_reads(mut wanted: Vec<(usize, Loc)>) -> Vec<Read> {
    wanted.sort_by_key(|(_, l)| (l.pack, l.off));
    let mut out: Vec<Read> = Vec::new();
    for (pos, l) in wanted {
        let end = l.off + u64::from(l.len);
        if let Some(r) = out.last_mut() {
            if r.pack == l.pack
                && l.off <= r.range.end + MERGE_GAP
                && end.max(r.range.end) - r.range.start <= MERGE_SPAN
            {
                r.range.end = r.range.end.max(end);
                r.parts.push((pos, l.off, l.len));
                continue;
            }
        }
        out.push(Read {
            pack: l.pack,
            range: l.off..end,
            parts: vec![(pos, l.off, l.len)],
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(n: u8, len: usize) -> (ChunkId, Bytes) {
        let b = Bytes::from(vec![n; len]);
        (ChunkId::of(&b), b)
    }

    #[test]
    fn an_index_round_trips_and_refuses_damage() {
        let b = build(&[chunk(1, 10), chunk(2, 300), chunk(3, 7)]);
        assert_eq!(b.data.len(), 317);
        assert_eq!(b.index.name, ChunkId::of(&b.data));
        let back = decode_index("k", b.index.name, &b.index_bytes).unwrap();
        assert_eq!(back, b.index);
        for e in &back.entries {
            assert!(e.id.verify(&b.data[e.off as usize..e.range().end as usize]));
        }
        // Any flipped byte, a torn tail or a foreign object is refused.
        for at in [0, 9, 13, 30, b.index_bytes.len() - 1] {
            let mut bad = b.index_bytes.to_vec();
            bad[at] ^= 1;
            assert!(decode_index("k", b.index.name, &bad).is_err(), "byte {at}");
        }
        let torn = &b.index_bytes[..b.index_bytes.len() - 5];
        assert!(decode_index("k", b.index.name, torn).is_err());
        assert!(decode_index("k", b.index.name, b"hello").is_err());
    }

    #[test]
    fn an_entry_past_the_pack_is_refused_even_with_a_good_checksum() {
        let mut p = build(&[chunk(1, 10)]).index;
        p.len = 5;
        let e = decode_index("k", p.name, &encode_index(&p)).unwrap_err();
        assert!(e.to_string().contains("past the pack"), "{e}");
    }

    #[test]
    fn the_map_finds_every_copy_first_one_first() {
        let a = build(&[chunk(1, 10), chunk(2, 20)]).index;
        let b = build(&[chunk(2, 20), chunk(3, 5)]).index;
        let two = a.entries[1].id;
        let m = PackMap::new("s", vec![a, b], Vec::new());
        assert_eq!(m.len(), 3);
        let locs = m.find(&two);
        assert_eq!(locs.len(), 2);
        assert_eq!((locs[0].pack, locs[0].off), (0, 10));
        assert_eq!((locs[1].pack, locs[1].off), (1, 0));
        assert!(m.find(&ChunkId([9; 32])).is_empty());
    }

    /// Ids that look like blake3 output (spread over the whole key space).
    fn fake_id(n: u64) -> ChunkId {
        ChunkId::of(&n.to_le_bytes())
    }

    #[test]
    fn the_table_agrees_with_a_hash_map_on_every_lookup() {
        // 40 packs of up to 100 chunks; every 7th chunk also in a later pack (a cut-short
        // repack), so some ids have two places.
        let mut packs = Vec::new();
        let mut want: HashMap<ChunkId, Vec<Loc>> = HashMap::new();
        let mut names: Vec<ChunkId> = (0..40u64).map(|k| fake_id(1_000_000 + k)).collect();
        names.sort();
        for (k, name) in names.iter().enumerate() {
            let mut entries = Vec::new();
            let mut off = 0;
            for j in 0..(k as u64 * 7 % 100) {
                let id = if j % 7 == 3 && k > 0 {
                    fake_id((k as u64 - 1) * 1000 + j)
                } else {
                    fake_id(k as u64 * 1000 + j)
                };
                let len = 10 + j as u32;
                entries.push(Entry { id, off, len });
                want.entry(id).or_default().push(Loc {
                    pack: k as u32,
                    off,
                    len,
                });
                off += u64::from(len);
            }
            packs.push(PackIndex {
                name: *name,
                len: off,
                entries,
            });
        }
        let m = PackMap::new("s", packs.clone(), vec!["one bad".into()]);
        assert_eq!(m.len(), want.len());
        assert_eq!(m.bad, vec!["one bad".to_string()]);
        for (id, locs) in &want {
            assert_eq!(&m.find(id), locs, "{id}");
            assert!(m.contains(id));
        }
        for n in 0..1000 {
            assert!(m.find(&fake_id(5_000_000 + n)).is_empty());
            assert!(!m.contains(&fake_id(5_000_000 + n)));
        }
        for (k, p) in packs.iter().enumerate() {
            assert_eq!(m.entries(k).collect::<Vec<_>>(), p.entries, "pack {k}");
            assert_eq!((m.packs[k].name, m.packs[k].len), (p.name, p.len));
            if let Some(mid) = p.entries.get(p.entries.len() / 2) {
                let from: Vec<Entry> = m.entries_from(k, mid.off).collect();
                assert_eq!(from, p.entries[p.entries.len() / 2..]);
            }
        }
        // A map built on top of an earlier one (packs it knows copied, not fetched) is the
        // same map.
        let mut b = PackMapBuilder::new("s");
        for (k, p) in packs.iter().enumerate() {
            if k.is_multiple_of(2) {
                b.add_from(&m, k);
            } else {
                b.add(p.clone());
            }
        }
        let again = b.finish();
        for (id, locs) in &want {
            assert_eq!(&again.find(id), locs);
        }
        assert_eq!(again.ids().count(), m.ids().count());
    }

    #[test]
    fn a_pack_too_large_for_the_table_is_refused_not_truncated() {
        let mut p = build(&[chunk(1, 10)]).index;
        p.len = 5 << 30;
        let m = PackMap::new("s", vec![p, build(&[chunk(2, 10)]).index], Vec::new());
        assert_eq!(m.packs.len(), 1);
        assert_eq!(m.len(), 1);
        assert!(m.find(&chunk(1, 10).0).is_empty());
        assert_eq!(m.find(&chunk(2, 10).0)[0].pack, 0);
        assert!(
            m.bad[0].contains("more than a pack map holds"),
            "{:?}",
            m.bad
        );
    }

    #[test]
    fn the_packer_groups_by_key_cuts_at_size_and_leaves_a_lone_chunk_loose() {
        let mut p = Packer::new(100, 250);
        assert!(p.takes(99) && !p.takes(100));
        assert!(!Packer::new(0, 250).takes(1), "0 packs nothing");
        // Two directories, added interleaved; 90 bytes each.
        for k in 0..6u8 {
            let (id, b) = chunk(k, 90);
            p.add((u64::from(k % 2), u64::from(k), 0), id, b);
        }
        let (packs, loose) = p.cut(false);
        assert!(loose.is_empty());
        // 540 bytes: two packs of 270 (3 chunks each), nothing left over.
        assert_eq!(packs.len(), 2);
        assert_eq!(p.pending_bytes(), 0);
        let first: Vec<ChunkId> = packs[0].index.entries.iter().map(|e| e.id).collect();
        let dir0: Vec<ChunkId> = [0u8, 2, 4].iter().map(|k| chunk(*k, 90).0).collect();
        assert_eq!(first, dir0, "directory 0's chunks together, in key order");
        // Below the size: kept for the next batch, then the last cut packs it.
        let (id, b) = chunk(9, 50);
        p.add((5, 0, 0), id, b);
        assert!(p.cut(false).0.is_empty());
        let (id2, b2) = chunk(10, 50);
        p.add((4, 0, 0), id2, b2);
        let (packs, loose) = p.cut(true);
        assert_eq!((packs.len(), loose.len()), (1, 0));
        assert_eq!(packs[0].index.entries[0].id, id2);
        // A lone chunk at the end stays loose.
        p.add((1, 0, 0), id, chunk(9, 50).1);
        let (packs, loose) = p.cut(true);
        assert_eq!((packs.len(), loose.len()), (0, 1));
    }

    #[test]
    fn widened_reads_cover_whole_blocks_inside_the_pack_and_join() {
        let l = |pack, off, len| Loc { pack, off, len };
        let reads = plan_reads(vec![
            (0, l(0, READ_AROUND + 10, 10)),
            (1, l(0, 3 * READ_AROUND + 5, 10)),
            (2, l(1, 0, 10)),
        ]);
        assert_eq!(reads.len(), 3);
        let w = widen(reads, |p| if p == 0 { 3 * READ_AROUND + 100 } else { 50 });
        assert_eq!(w.len(), 3, "{w:?}");
        assert_eq!(w[0].range, READ_AROUND..2 * READ_AROUND);
        assert_eq!(w[1].range, 3 * READ_AROUND..3 * READ_AROUND + 100);
        assert_eq!(w[2].range, 0..50);
        // Neighbouring blocks join; others do not.
        let reads = plan_reads(vec![(0, l(0, 10, 10)), (1, l(0, 2 * READ_AROUND + 1, 10))]);
        assert_eq!(reads.len(), 2);
        let w = widen(reads, |_| 10 * READ_AROUND);
        assert_eq!(w.len(), 2, "blocks 0 and 2 do not touch: {w:?}");
        let reads = plan_reads(vec![
            (0, l(0, 10, 10)),
            (1, l(0, READ_AROUND + MERGE_GAP + 100, 10)),
        ]);
        assert_eq!(reads.len(), 2);
        let w = widen(reads, |_| 10 * READ_AROUND);
        assert_eq!(w.len(), 1, "blocks 0 and 1 touch: {w:?}");
        assert_eq!(w[0].range, 0..2 * READ_AROUND);
        assert_eq!(w[0].parts.len(), 2);
    }

    #[test]
    fn the_around_cache_hands_out_once_and_stays_bounded() {
        let a = Around::default();
        let (id, b) = chunk(1, 100);
        a.put(id, &b);
        assert_eq!(a.take(&id).unwrap(), b);
        assert!(a.take(&id).is_none());
        let big = vec![7u8; (AROUND_BYTES / 4) as usize];
        for k in 0..6u8 {
            a.put(ChunkId([k; 32]), &big);
        }
        assert!(a.take(&ChunkId([0; 32])).is_none(), "oldest dropped");
        assert!(a.take(&ChunkId([5; 32])).is_some());
    }

    #[test]
    fn reads_merge_near_ranges_of_one_pack_only() {
        let l = |pack, off, len| Loc { pack, off, len };
        let reads = plan_reads(vec![
            (0, l(0, 1000, 10)),
            (1, l(1, 0, 10)),
            (2, l(0, 0, 100)),
            (3, l(0, 1016 + 2 * MERGE_GAP, 5)),
            (4, l(0, 1010 + MERGE_GAP, 5)),
        ]);
        assert_eq!(reads.len(), 3, "{reads:?}");
        assert_eq!(reads[0].range, 0..1015 + MERGE_GAP);
        assert_eq!(
            reads[0].parts.iter().map(|p| p.0).collect::<Vec<_>>(),
            [2, 0, 4]
        );
        assert_eq!(reads[1].range, 1016 + 2 * MERGE_GAP..1021 + 2 * MERGE_GAP);
        assert_eq!(reads[2].pack, 1);
        // A span limit splits even adjacent chunks.
        let big = u32::try_from(MERGE_SPAN / 2 + 1).unwrap();
        let reads = plan_reads(vec![(0, l(0, 0, big)), (1, l(0, u64::from(big), big))]);
        assert_eq!(reads.len(), 2);
    }
}

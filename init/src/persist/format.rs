//! The snapshot object format and the tree it describes.
//!
//! A snapshot object is `KEELSNAP` + u32 LE header length + header (postcard) + body
//! (postcard, zstd-compressed). A *full* snapshot lists every inode and directory entry; a
//! *delta* lists what changed since its parent (inode upserts and deletions, entry upserts
//! and removals, chunk-map patches), so a checkpoint uploads metadata proportional to the
//! change. A chain is one full snapshot followed by deltas; `Tree::apply` replays it.
//! Inode numbers are kept, so hard links stay hard links.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::chunk::chunker::window_count;
use crate::chunk::ChunkId;
use crate::meta::{Inode, InodeNo, Kind, Nanos, Storage};

pub const MAGIC: &[u8; 8] = b"KEELSNAP";
pub const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("snapshot {key}: not a keel snapshot (bad magic)")]
    Magic { key: String },
    #[error("snapshot {key}: format {found} is newer than this keel reads ({FORMAT})")]
    Version { key: String, found: u32 },
    #[error("snapshot {key}: decode {part}: {reason}")]
    Decode {
        key: String,
        part: &'static str,
        reason: String,
    },
    #[error("snapshot encode: {0}")]
    Encode(String),
    #[error("snapshot {seq}: delta applies to {parent:?} but the chain is at {at:?}")]
    Chain {
        seq: u64,
        parent: Option<u64>,
        at: Option<u64>,
    },
}

/// Summary of a snapshot, readable without decoding its body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub format: u32,
    pub seq: u64,
    /// The snapshot this delta applies to (`None` for a full snapshot).
    pub parent: Option<u64>,
    /// The full snapshot this chain starts from (itself when full).
    pub base: u64,
    /// The snapshot taken before this one in the workspace's history (for a delta, its
    /// parent; for a full snapshot, whatever came before). Retention walks these links.
    pub prev: Option<u64>,
    pub created_ns: i64,
    pub chunk_size: u64,
    /// Totals of the tree this snapshot describes.
    pub inodes: u64,
    pub file_bytes: u64,
    /// The compact metadata image of this (full) snapshot's tree, if one was uploaded
    /// (see `image`). Encoded after the fields above, inside the header's length, so a keel
    /// that predates it reads the header and ignores it, and a header without it (older
    /// snapshots, deltas) decodes as `None`.
    #[serde(skip)]
    pub image: Option<ImageRef>,
}

/// Where a full snapshot's metadata image is and how to check it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRef {
    /// blake3 of the compressed image object (also its name on the remote).
    pub hash: [u8; 32],
    /// Bytes of the compressed image object.
    pub size: u64,
}

impl Header {
    pub fn is_full(&self) -> bool {
        self.parent.is_none()
    }
}

/// A file's bytes as the snapshot stores them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataRec {
    None,
    Inline(#[serde(with = "serde_bytes_compat")] Vec<u8>),
    Symlink(#[serde(with = "serde_bytes_compat")] Vec<u8>),
    /// Chunk map changes: `complete` replaces the whole map, otherwise windows are patched.
    /// `None` is an all-zero window.
    Chunks {
        complete: bool,
        patch: Vec<(u64, Option<[u8; 32]>)>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeRec {
    pub ino: u64,
    /// Including the `S_IFMT` type bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime: i64,
    pub mtime: i64,
    pub ctime: i64,
    pub rdev: u32,
    pub parent: u64,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub data: DataRec,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirentRec {
    pub parent: u64,
    #[serde(with = "serde_bytes_compat")]
    pub name: Vec<u8>,
    pub ino: u64,
    pub kind: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Body {
    pub inodes: Vec<InodeRec>,
    pub deleted: Vec<u64>,
    pub dirents: Vec<DirentRec>,
    pub unlinked: Vec<(u64, Vec<u8>)>,
}

/// Bytes as one length-prefixed blob rather than a sequence of integers.
mod serde_bytes_compat {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
        }
        d.deserialize_bytes(V)
    }
}

/// Encodes a snapshot object.
pub fn encode(h: &Header, b: &Body) -> Result<Vec<u8>, FormatError> {
    let mut hb = postcard::to_stdvec(h).map_err(|e| FormatError::Encode(e.to_string()))?;
    if h.image.is_some() {
        let ext = postcard::to_stdvec(&h.image).map_err(|e| FormatError::Encode(e.to_string()))?;
        hb.extend_from_slice(&ext);
    }
    let bb = postcard::to_stdvec(b).map_err(|e| FormatError::Encode(e.to_string()))?;
    let z = zstd::bulk::compress(&bb, 3).map_err(|e| FormatError::Encode(e.to_string()))?;
    let mut out = Vec::with_capacity(12 + hb.len() + z.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(hb.len() as u32).to_le_bytes());
    out.extend_from_slice(&hb);
    out.extend_from_slice(&z);
    Ok(out)
}

/// Decodes the header only (also from a prefix of the object, for listings).
pub fn decode_header(key: &str, data: &[u8]) -> Result<(Header, usize), FormatError> {
    if data.len() < 12 || &data[..8] != MAGIC {
        return Err(FormatError::Magic {
            key: key.to_string(),
        });
    }
    let n = u32::from_le_bytes(data[8..12].try_into().expect("4 bytes")) as usize;
    let hb = data.get(12..12 + n).ok_or_else(|| FormatError::Decode {
        key: key.to_string(),
        part: "header",
        reason: "truncated".into(),
    })?;
    let (mut h, rest): (Header, &[u8]) =
        postcard::take_from_bytes(hb).map_err(|e| FormatError::Decode {
            key: key.to_string(),
            part: "header",
            reason: e.to_string(),
        })?;
    if !rest.is_empty() {
        h.image = postcard::from_bytes(rest).map_err(|e| FormatError::Decode {
            key: key.to_string(),
            part: "header (image)",
            reason: e.to_string(),
        })?;
    }
    if h.format > FORMAT {
        return Err(FormatError::Version {
            key: key.to_string(),
            found: h.format,
        });
    }
    Ok((h, 12 + n))
}

pub fn decode(key: &str, data: &[u8]) -> Result<(Header, Body), FormatError> {
    let (h, off) = decode_header(key, data)?;
    let dec = |reason: String| FormatError::Decode {
        key: key.to_string(),
        part: "body",
        reason,
    };
    let raw = zstd::stream::decode_all(&data[off..]).map_err(|e| dec(e.to_string()))?;
    let b: Body = postcard::from_bytes(&raw).map_err(|e| dec(e.to_string()))?;
    Ok((h, b))
}

/// A file's content in a materialized tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TreeData {
    None,
    Inline(Vec<u8>),
    Symlink(Vec<u8>),
    Chunks(Vec<Option<ChunkId>>),
}

impl TreeData {
    /// What a record's data makes of the inode's data `old` (its previous data in the
    /// tree, for a chunk-map patch) for a file of `size` bytes cut in `chunk_size` windows.
    pub fn of(data: DataRec, old: Option<TreeData>, size: u64, chunk_size: u64) -> TreeData {
        match data {
            DataRec::None => TreeData::None,
            DataRec::Inline(v) => TreeData::Inline(v),
            DataRec::Symlink(v) => TreeData::Symlink(v),
            DataRec::Chunks { complete, patch } => {
                let mut map = match (complete, old) {
                    (false, Some(TreeData::Chunks(m))) => m,
                    _ => Vec::new(),
                };
                for (idx, id) in patch {
                    let i = idx as usize;
                    if map.len() <= i {
                        map.resize(i + 1, None);
                    }
                    map[i] = id.map(ChunkId);
                }
                map.resize(window_count(size, chunk_size) as usize, None);
                TreeData::Chunks(map)
            }
        }
    }
}

/// One inode of a materialized tree (the record without its data, plus the data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeInode {
    pub rec: InodeRec,
    pub data: TreeData,
}

impl TreeInode {
    /// The inode row this record describes (a body for chunked data, inline otherwise);
    /// `None`: its mode names no file type keel knows.
    pub fn inode(&self) -> Option<Inode> {
        let r = &self.rec;
        Some(Inode {
            ino: InodeNo(r.ino),
            kind: Kind::from_mode(r.mode)?,
            perm: r.mode & 0o7777,
            uid: r.uid,
            gid: r.gid,
            nlink: r.nlink,
            size: r.size,
            atime: Nanos(r.atime),
            mtime: Nanos(r.mtime),
            ctime: Nanos(r.ctime),
            rdev: r.rdev,
            parent: InodeNo(r.parent),
            storage: if matches!(self.data, TreeData::Chunks(_)) {
                Storage::Body
            } else {
                Storage::Inline
            },
        })
    }
}

/// The full tree a snapshot describes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tree {
    /// The snapshot this tree is at.
    pub seq: Option<u64>,
    pub chunk_size: u64,
    pub inodes: BTreeMap<u64, TreeInode>,
    /// (parent, name) -> (ino, kind bits)
    pub dirents: BTreeMap<(u64, Vec<u8>), (u64, u32)>,
}

impl Tree {
    /// Replays one snapshot onto the tree (a full snapshot replaces it).
    pub fn apply(&mut self, h: &Header, b: Body) -> Result<(), FormatError> {
        if h.is_full() {
            *self = Tree::default();
        } else if h.parent != self.seq {
            return Err(FormatError::Chain {
                seq: h.seq,
                parent: h.parent,
                at: self.seq,
            });
        }
        self.seq = Some(h.seq);
        self.chunk_size = h.chunk_size;
        for ino in b.deleted {
            self.inodes.remove(&ino);
        }
        for mut rec in b.inodes {
            let data = std::mem::replace(&mut rec.data, DataRec::None);
            let old = self.inodes.remove(&rec.ino).map(|t| t.data);
            let data = TreeData::of(data, old, rec.size, h.chunk_size);
            self.inodes.insert(rec.ino, TreeInode { rec, data });
        }
        for (p, n) in b.unlinked {
            self.dirents.remove(&(p, n));
        }
        for d in b.dirents {
            self.dirents.insert((d.parent, d.name), (d.ino, d.kind));
        }
        Ok(())
    }

    /// Every chunk id the tree references (with repeats removed).
    pub fn chunk_ids(&self) -> std::collections::BTreeSet<ChunkId> {
        let mut out = std::collections::BTreeSet::new();
        for t in self.inodes.values() {
            if let TreeData::Chunks(m) = &t.data {
                out.extend(m.iter().flatten().copied());
            }
        }
        out
    }

    pub fn file_bytes(&self) -> u64 {
        self.inodes
            .values()
            .filter(|t| t.rec.mode & libc::S_IFMT == libc::S_IFREG)
            .map(|t| t.rec.size)
            .sum()
    }
}

/// Chunk ids mentioned anywhere in a snapshot body (gc: what a kept snapshot protects).
pub fn body_chunk_ids(b: &Body) -> impl Iterator<Item = ChunkId> + '_ {
    b.inodes.iter().flat_map(|r| match &r.data {
        DataRec::Chunks { patch, .. } => {
            patch.iter().filter_map(|(_, id)| id.map(ChunkId)).collect()
        }
        _ => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ino: u64, size: u64, data: DataRec) -> InodeRec {
        InodeRec {
            ino,
            mode: libc::S_IFREG | 0o644,
            uid: 1,
            gid: 2,
            nlink: 1,
            size,
            atime: 1,
            mtime: 2,
            ctime: 3,
            rdev: 0,
            parent: 1,
            xattrs: vec![(b"user.a".to_vec(), b"v".to_vec())],
            data,
        }
    }

    fn header(seq: u64, parent: Option<u64>) -> Header {
        Header {
            format: FORMAT,
            seq,
            parent,
            base: 1,
            prev: parent,
            created_ns: 5,
            chunk_size: 4,
            inodes: 0,
            file_bytes: 0,
            image: None,
        }
    }

    /// The header as keel wrote and read it before metadata images.
    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct HeaderV1 {
        format: u32,
        seq: u64,
        parent: Option<u64>,
        base: u64,
        prev: Option<u64>,
        created_ns: i64,
        chunk_size: u64,
        inodes: u64,
        file_bytes: u64,
    }

    #[test]
    fn the_image_reference_is_invisible_to_older_readers_and_absent_in_older_headers() {
        let mut h = header(7, None);
        h.image = Some(ImageRef {
            hash: [9; 32],
            size: 1234,
        });
        let bytes = encode(&h, &Body::default()).unwrap();
        let (back, _) = decode_header("k", &bytes).unwrap();
        assert_eq!(back, h);
        // An older keel decodes the same header bytes (postcard ignores what follows).
        let n = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
        let old: HeaderV1 = postcard::from_bytes(&bytes[12..12 + n]).unwrap();
        assert_eq!((old.seq, old.parent, old.chunk_size), (7, None, 4));
        // A header an older keel wrote has no image.
        h.image = None;
        let plain = encode(&h, &Body::default()).unwrap();
        let v1 = postcard::to_stdvec(&old).unwrap();
        assert_eq!(&plain[12..12 + v1.len()], &v1[..]);
        assert_eq!(decode_header("k", &plain).unwrap().0.image, None);
        // A damaged image reference is an error, not a silent `None`.
        let mut bad = bytes.clone();
        bad[12 + n - 1] = 0xff;
        assert!(decode_header("k", &bad).is_err());
    }

    #[test]
    fn roundtrip_and_chain() {
        let a = [1u8; 32];
        let b = [2u8; 32];
        let full = Body {
            inodes: vec![rec(
                2,
                10,
                DataRec::Chunks {
                    complete: true,
                    patch: vec![(0, Some(a)), (1, None), (2, Some(a))],
                },
            )],
            dirents: vec![DirentRec {
                parent: 1,
                name: b"f".to_vec(),
                ino: 2,
                kind: libc::S_IFREG,
            }],
            ..Default::default()
        };
        let bytes = encode(&header(1, None), &full).unwrap();
        let (h, body) = decode("k", &bytes).unwrap();
        assert_eq!(body, full);
        assert_eq!(
            decode_header("k", &bytes[..40.min(bytes.len())]).unwrap().0,
            h
        );
        let mut t = Tree::default();
        t.apply(&h, body).unwrap();
        // Delta: shrink to 6 bytes and rewrite window 1.
        let delta = Body {
            inodes: vec![rec(
                2,
                6,
                DataRec::Chunks {
                    complete: false,
                    patch: vec![(1, Some(b))],
                },
            )],
            ..Default::default()
        };
        t.apply(&header(2, Some(1)), delta).unwrap();
        match &t.inodes[&2].data {
            TreeData::Chunks(m) => assert_eq!(m, &vec![Some(ChunkId(a)), Some(ChunkId(b))]),
            other => panic!("{other:?}"),
        }
        // A delta for another parent is refused.
        assert!(t.apply(&header(4, Some(3)), Body::default()).is_err());
        assert!(decode("k", b"NOTASNAPSHOT").is_err());
    }
}

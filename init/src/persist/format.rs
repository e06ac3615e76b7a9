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
    #[error("snapshot records spilled to {path}: {source}")]
    Spill {
        path: String,
        source: std::io::Error,
    },
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

    /// A header for tests: snapshot `seq` on `parent` (none: a full snapshot), one line
    /// of snapshots from 1, chunks of 4 bytes.
    #[cfg(test)]
    pub fn test(seq: u64, parent: Option<u64>) -> Header {
        Header {
            format: FORMAT,
            seq,
            parent,
            base: 1,
            prev: Some(seq - 1).filter(|p| *p > 0),
            created_ns: 0,
            chunk_size: 4,
            inodes: 0,
            file_bytes: 0,
            image: None,
        }
    }
}

#[cfg(test)]
impl InodeRec {
    /// A record for tests: root's, one link, every time 0, under the root, its size the
    /// inline bytes' (0 otherwise).
    pub fn test(ino: u64, mode: u32, data: DataRec) -> InodeRec {
        let size = match &data {
            DataRec::Inline(v) => v.len() as u64,
            _ => 0,
        };
        InodeRec {
            ino,
            mode,
            uid: 0,
            gid: 0,
            nlink: 1,
            size,
            atime: 0,
            mtime: 0,
            ctime: 0,
            rdev: 0,
            parent: 1,
            xattrs: Vec::new(),
            data,
        }
    }
    /// A regular file of `text`, inline (tests).
    pub fn test_file(ino: u64, text: &str) -> InodeRec {
        InodeRec::test(
            ino,
            libc::S_IFREG | 0o644,
            DataRec::Inline(text.as_bytes().to_vec()),
        )
    }

    /// A directory (tests).
    pub fn test_dir(ino: u64) -> InodeRec {
        InodeRec::test(ino, libc::S_IFDIR | 0o755, DataRec::None)
    }
}

#[cfg(test)]
impl DirentRec {
    /// The entry `name` in `parent` naming `ino` of kind `kind` (`S_IFREG`, ...) (tests).
    pub fn test(parent: u64, name: &str, ino: u64, kind: u32) -> DirentRec {
        DirentRec {
            parent,
            name: name.as_bytes().to_vec(),
            ino,
            kind,
        }
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
        // `byte_buf`, not `bytes`: the same bytes on the wire, but postcard then copies
        // them out of a scratch buffer, which the streaming `BodyReader` reuses.
        d.deserialize_byte_buf(V)
    }
}

/// The object's start: magic, header length, header (with the image reference after it).
fn header_bytes(h: &Header) -> Result<Vec<u8>, FormatError> {
    let mut hb = postcard::to_stdvec(h).map_err(|e| FormatError::Encode(e.to_string()))?;
    if h.image.is_some() {
        let ext = postcard::to_stdvec(&h.image).map_err(|e| FormatError::Encode(e.to_string()))?;
        hb.extend_from_slice(&ext);
    }
    let mut out = Vec::with_capacity(12 + hb.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(hb.len() as u32).to_le_bytes());
    out.extend_from_slice(&hb);
    Ok(out)
}

/// Encodes a snapshot object.
pub fn encode(h: &Header, b: &Body) -> Result<Vec<u8>, FormatError> {
    let mut out = header_bytes(h)?;
    let bb = postcard::to_stdvec(b).map_err(|e| FormatError::Encode(e.to_string()))?;
    let z = zstd::bulk::compress(&bb, 3).map_err(|e| FormatError::Encode(e.to_string()))?;
    out.extend_from_slice(&z);
    Ok(out)
}

/// The four record lists of a body, in the order they are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Section {
    Inodes,
    Deleted,
    Dirents,
    Unlinked,
}

const SECTIONS: [Section; 4] = [
    Section::Inodes,
    Section::Deleted,
    Section::Dirents,
    Section::Unlinked,
];

/// Writes a snapshot object one record at a time: each section's count first, then its
/// records, compressed as they come. The body bytes are exactly `postcard`'s encoding of
/// the `Body` holding the same records (a `Vec` is its varint length, then its elements),
/// so objects written this way and by [`encode`] read the same. Memory: the compressed
/// object so far plus one record.
pub struct BodyWriter {
    z: zstd::stream::Encoder<'static, Vec<u8>>,
    /// The section being written (`None`: none begun yet) and its records still due.
    at: Option<Section>,
    left: u64,
    buf: Vec<u8>,
}

impl BodyWriter {
    pub fn new(h: &Header) -> Result<BodyWriter, FormatError> {
        let z = zstd::stream::Encoder::new(header_bytes(h)?, 3)
            .map_err(|e| FormatError::Encode(e.to_string()))?;
        Ok(BodyWriter {
            z,
            at: None,
            left: 0,
            buf: Vec::new(),
        })
    }

    fn write(&mut self, v: &(impl Serialize + ?Sized)) -> Result<(), FormatError> {
        use std::io::Write;
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let buf = postcard::to_extend(v, buf).map_err(|e| FormatError::Encode(e.to_string()))?;
        self.z
            .write_all(&buf)
            .map_err(|e| FormatError::Encode(e.to_string()))?;
        self.buf = buf;
        Ok(())
    }

    /// Starts section `s` with `count` records (sections skipped before it are empty).
    pub fn begin(&mut self, s: Section, count: u64) -> Result<(), FormatError> {
        if self.at.is_some_and(|a| a >= s) {
            return Err(FormatError::Encode(format!(
                "section {s:?} begun after {:?}",
                self.at
            )));
        }
        self.close()?;
        let from = self.at;
        for skipped in SECTIONS
            .into_iter()
            .filter(|x| from.is_none_or(|a| *x > a) && *x < s)
        {
            self.write(&0u64)?;
            self.at = Some(skipped);
        }
        self.write(&count)?;
        self.at = Some(s);
        self.left = count;
        Ok(())
    }

    /// Checks the current section got every record its count promised.
    fn close(&self) -> Result<(), FormatError> {
        match self.left {
            0 => Ok(()),
            n => Err(FormatError::Encode(format!(
                "section {:?}: {n} records fewer than its count",
                self.at
            ))),
        }
    }

    fn record(&mut self, s: Section, v: &(impl Serialize + ?Sized)) -> Result<(), FormatError> {
        if self.at != Some(s) || self.left == 0 {
            return Err(FormatError::Encode(format!(
                "a {s:?} record past its section's count"
            )));
        }
        self.left -= 1;
        self.write(v)
    }

    pub fn inode(&mut self, r: &InodeRec) -> Result<(), FormatError> {
        self.record(Section::Inodes, r)
    }

    pub fn deleted(&mut self, ino: u64) -> Result<(), FormatError> {
        self.record(Section::Deleted, &ino)
    }

    pub fn dirent(&mut self, d: &DirentRec) -> Result<(), FormatError> {
        self.record(Section::Dirents, d)
    }

    pub fn unlinked(&mut self, parent: u64, name: &[u8]) -> Result<(), FormatError> {
        self.record(Section::Unlinked, &(parent, name))
    }

    /// Copies the records of `spill` into the current section `s` (they count against it).
    pub fn splice(&mut self, s: Section, spill: Spill) -> Result<(), FormatError> {
        if self.at != Some(s) || self.left < spill.n {
            return Err(FormatError::Encode(format!(
                "{} spilled {s:?} records past their section's count",
                spill.n
            )));
        }
        let n = spill.n;
        let path = spill.path.clone();
        let err = |source| FormatError::Spill {
            path: path.display().to_string(),
            source,
        };
        let copied = spill.finish().and_then(|file| {
            let mut z = zstd::stream::Decoder::new(file)?;
            std::io::copy(&mut z, &mut self.z)
        });
        let _ = std::fs::remove_file(&path);
        copied.map_err(err)?;
        self.left -= n;
        Ok(())
    }

    /// Ends the body (sections never begun are empty); the whole object.
    pub fn finish(mut self) -> Result<Vec<u8>, FormatError> {
        self.close()?;
        if self.at != Some(Section::Unlinked) {
            self.begin(Section::Unlinked, 0)?;
        }
        self.z
            .finish()
            .map_err(|e| FormatError::Encode(e.to_string()))
    }
}

/// Puts header `h` in place of an encoded object's header (a retry under another
/// sequence number, or once the metadata image is known), without copying the body.
pub fn replace_header(obj: &mut Vec<u8>, h: &Header) -> Result<(), FormatError> {
    let (_, off) = decode_header("(being written)", obj)?;
    obj.splice(..off, header_bytes(h)?);
    Ok(())
}

/// Records of one section set aside in a file beside the state database while their
/// section's count is not known yet (a full snapshot writes its directory records while
/// the file records' chunk maps are still to be hashed), compressed as they come; then
/// [`BodyWriter::splice`]d in. The file is unlinked as soon as it is open: only the open
/// descriptor keeps it, so a crash leaves nothing behind.
pub struct Spill {
    /// Where it was created, for error messages (no longer a name of the file).
    path: std::path::PathBuf,
    z: Option<zstd::stream::Encoder<'static, std::io::BufWriter<std::fs::File>>>,
    n: u64,
    buf: Vec<u8>,
}

impl Spill {
    pub fn create(path: std::path::PathBuf) -> Result<Spill, FormatError> {
        let err = |source| FormatError::Spill {
            path: path.display().to_string(),
            source,
        };
        use std::os::unix::fs::OpenOptionsExt;
        // 0600 from its creation (the records hold inline files' bytes, and with the `dir`
        // provider the state dir is searchable by the sandbox's user, who could open it in
        // the moment it has a name); a new file (O_EXCL), never one found at that name.
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
            _ => {}
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(err)?;
        std::fs::remove_file(&path).map_err(err)?;
        let z = zstd::stream::Encoder::new(std::io::BufWriter::new(f), 1).map_err(err)?;
        Ok(Spill {
            path,
            z: Some(z),
            n: 0,
            buf: Vec::new(),
        })
    }

    /// Records set aside so far.
    pub fn len(&self) -> u64 {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn push(&mut self, v: &(impl Serialize + ?Sized)) -> Result<(), FormatError> {
        use std::io::Write;
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let buf = postcard::to_extend(v, buf).map_err(|e| FormatError::Encode(e.to_string()))?;
        let z = self.z.as_mut().expect("open until finished");
        z.write_all(&buf).map_err(|source| FormatError::Spill {
            path: self.path.display().to_string(),
            source,
        })?;
        self.buf = buf;
        self.n += 1;
        Ok(())
    }

    /// Ends the compressed stream; the file, at its start.
    fn finish(mut self) -> std::io::Result<std::fs::File> {
        use std::io::Seek;
        let z = self.z.take().expect("open until finished");
        let mut f = z.finish()?.into_inner().map_err(|e| e.into_error())?;
        f.rewind()?;
        Ok(f)
    }
}

/// A postcard source over a reader, for owned values: byte strings are copied through one
/// scratch buffer that grows only as far as the data really present.
struct StreamFlavor<R> {
    r: R,
    scratch: Vec<u8>,
}

impl<'de, R: std::io::Read + 'de> postcard::de_flavors::Flavor<'de> for StreamFlavor<R> {
    type Remainder = R;
    type Source = R;

    fn pop(&mut self) -> postcard::Result<u8> {
        let mut b = [0u8; 1];
        self.r
            .read_exact(&mut b)
            .map_err(|_| postcard::Error::DeserializeUnexpectedEnd)?;
        Ok(b[0])
    }

    fn size_hint(&self) -> Option<usize> {
        None
    }

    /// Borrowed bytes cannot outlive a stream; no body field asks for them.
    fn try_take_n(&mut self, _ct: usize) -> postcard::Result<&'de [u8]> {
        Err(postcard::Error::DeserializeBadEncoding)
    }

    fn try_take_n_temp<'a>(&'a mut self, ct: usize) -> postcard::Result<&'a [u8]>
    where
        'de: 'a,
    {
        use std::io::Read;
        self.scratch.clear();
        (&mut self.r)
            .take(ct as u64)
            .read_to_end(&mut self.scratch)
            .map_err(|_| postcard::Error::DeserializeUnexpectedEnd)?;
        if self.scratch.len() != ct {
            return Err(postcard::Error::DeserializeUnexpectedEnd);
        }
        Ok(&self.scratch)
    }

    fn finalize(self) -> postcard::Result<R> {
        Ok(self.r)
    }
}

/// A compressed body being decompressed, buffered for postcard's byte-at-a-time reads.
type Unzip<'a> = std::io::BufReader<zstd::stream::Decoder<'a, std::io::BufReader<&'a [u8]>>>;

/// Reads a snapshot body one record at a time (see [`BodyWriter`]); memory is one record
/// plus the decompressor's window, whatever the tree's size. Sections are read in order:
/// asking for a later one skips (decodes and drops) what is left of the earlier ones.
pub struct BodyReader<'a> {
    de: postcard::Deserializer<'a, StreamFlavor<Unzip<'a>>>,
    key: String,
    /// The section being read (`None`: none yet) and its records still due.
    at: Option<Section>,
    left: u64,
}

/// Opens a snapshot object for streaming: its header and a reader of its body.
pub fn reader<'a>(key: &str, data: &'a [u8]) -> Result<(Header, BodyReader<'a>), FormatError> {
    let (h, off) = decode_header(key, data)?;
    let z = zstd::stream::Decoder::new(&data[off..]).map_err(|e| FormatError::Decode {
        key: key.to_string(),
        part: "body",
        reason: e.to_string(),
    })?;
    let flavor = StreamFlavor {
        r: std::io::BufReader::with_capacity(64 << 10, z),
        scratch: Vec::new(),
    };
    Ok((
        h,
        BodyReader {
            de: postcard::Deserializer::from_flavor(flavor),
            key: key.to_string(),
            at: None,
            left: 0,
        },
    ))
}

impl BodyReader<'_> {
    fn err(&self, e: postcard::Error) -> FormatError {
        FormatError::Decode {
            key: self.key.clone(),
            part: "body",
            reason: e.to_string(),
        }
    }

    fn take<T: serde::de::DeserializeOwned>(&mut self) -> Result<T, FormatError> {
        T::deserialize(&mut self.de).map_err(|e| self.err(e))
    }

    /// Drops one record of section `s`.
    fn skip(&mut self, s: Section) -> Result<(), FormatError> {
        match s {
            Section::Inodes => self.take::<InodeRec>().map(drop),
            Section::Deleted => self.take::<u64>().map(drop),
            Section::Dirents => self.take::<DirentRec>().map(drop),
            Section::Unlinked => self.take::<(u64, Vec<u8>)>().map(drop),
        }
    }

    /// Moves to section `s` (skipping the rest of the earlier ones); whether a record of
    /// it is left to read.
    fn enter(&mut self, s: Section) -> Result<bool, FormatError> {
        if self.at.is_some_and(|a| a > s) {
            return Err(FormatError::Decode {
                key: self.key.clone(),
                part: "body",
                reason: format!("{s:?} asked for after {:?}", self.at),
            });
        }
        while self.at != Some(s) {
            if let Some(a) = self.at {
                while self.left > 0 {
                    self.skip(a)?;
                    self.left -= 1;
                }
            }
            let next = match self.at {
                None => Section::Inodes,
                Some(a) => SECTIONS[SECTIONS.iter().position(|x| *x == a).expect("a section") + 1],
            };
            self.left = self.take::<u64>()?;
            self.at = Some(next);
        }
        Ok(self.left > 0)
    }

    fn next<T: serde::de::DeserializeOwned>(
        &mut self,
        s: Section,
    ) -> Result<Option<T>, FormatError> {
        if !self.enter(s)? {
            return Ok(None);
        }
        self.left -= 1;
        self.take().map(Some)
    }

    /// How many records section `s` has left (moving to it).
    pub fn remaining(&mut self, s: Section) -> Result<u64, FormatError> {
        self.enter(s)?;
        Ok(self.left)
    }

    pub fn next_inode(&mut self) -> Result<Option<InodeRec>, FormatError> {
        self.next(Section::Inodes)
    }

    pub fn next_deleted(&mut self) -> Result<Option<u64>, FormatError> {
        self.next(Section::Deleted)
    }

    pub fn next_dirent(&mut self) -> Result<Option<DirentRec>, FormatError> {
        self.next(Section::Dirents)
    }

    pub fn next_unlinked(&mut self) -> Result<Option<(u64, Vec<u8>)>, FormatError> {
        self.next(Section::Unlinked)
    }

    /// Every key the body touches, the rest of it read: each inode it writes or deletes
    /// (`inode`), each entry it writes or unlinks (`entry`). A delta's keys are all that
    /// can differ between its parent's tree and its own.
    pub fn touched(
        &mut self,
        mut inode: impl FnMut(u64),
        mut entry: impl FnMut((u64, Vec<u8>)),
    ) -> Result<(), FormatError> {
        while let Some(rec) = self.next_inode()? {
            inode(rec.ino);
        }
        while let Some(ino) = self.next_deleted()? {
            inode(ino);
        }
        while let Some(d) = self.next_dirent()? {
            entry((d.parent, d.name));
        }
        while let Some(k) = self.next_unlinked()? {
            entry(k);
        }
        Ok(())
    }
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
        self.start(h)?;
        for ino in b.deleted {
            self.inodes.remove(&ino);
        }
        for rec in b.inodes {
            self.insert(rec, h.chunk_size);
        }
        for (p, n) in b.unlinked {
            self.dirents.remove(&(p, n));
        }
        for d in b.dirents {
            self.dirents.insert((d.parent, d.name), (d.ino, d.kind));
        }
        Ok(())
    }

    /// Replays one snapshot object onto the tree, reading its body a record at a time
    /// (`BodyReader`): the same tree as `apply` of its decoded body, without holding the
    /// body. `apply` removes `deleted` and `unlinked` before it inserts, while the body has
    /// them after the records, so a delta is read twice: once for those two (small: what a
    /// checkpoint removed), once for the records. A full snapshot is read once: it starts
    /// from an empty tree, where removing anything before the inserts changes nothing.
    pub fn apply_object(&mut self, key: &str, data: &[u8]) -> Result<Header, FormatError> {
        self.apply_object_where(key, data, |_| true, |_| true)
    }

    /// [`Tree::apply_object`] keeping only the inodes `keep_inode` and the entries
    /// `keep_entry` accepts: the part of a tree one question needs (`keel diff -- PATH`: the
    /// entries named like the path's components, then the one inode; a diff: what may
    /// differ and the directories), in memory of that part's size, whatever the workspace's.
    /// `keep_inode` must accept the same numbers in every object of a replay. `keep_entry`
    /// may judge an entry by its value: a record it refuses removes the name (a delta
    /// replaces a name's value without unlinking it first, as a rename over it does), so
    /// the tree holds a name exactly when its latest value is accepted.
    pub fn apply_object_where(
        &mut self,
        key: &str,
        data: &[u8],
        keep_inode: impl Fn(u64) -> bool,
        keep_entry: impl Fn(&DirentRec) -> bool,
    ) -> Result<Header, FormatError> {
        let (h, mut r) = reader(key, data)?;
        self.start(&h)?;
        if !h.is_full() {
            // Removed before this delta's records go in (a name unlinked and linked again
            // in one delta ends linked); removing a key the filter never kept is a no-op.
            let (_, mut first) = reader(key, data)?;
            while let Some(ino) = first.next_deleted()? {
                self.inodes.remove(&ino);
            }
            while let Some(k) = first.next_unlinked()? {
                self.dirents.remove(&k);
            }
        }
        while let Some(rec) = r.next_inode()? {
            if keep_inode(rec.ino) {
                self.insert(rec, h.chunk_size);
            }
        }
        while let Some(d) = r.next_dirent()? {
            if keep_entry(&d) {
                self.dirents.insert((d.parent, d.name), (d.ino, d.kind));
            } else if !self.dirents.is_empty() {
                self.dirents.remove(&(d.parent, d.name));
            }
        }
        Ok(h)
    }

    /// [`Tree::apply_object_where`] of each object of a chain (or a run of one), in order.
    pub fn apply_objects_where(
        &mut self,
        objects: &[(String, bytes::Bytes)],
        keep_inode: impl Fn(u64) -> bool,
        keep_entry: impl Fn(&DirentRec) -> bool,
    ) -> Result<(), FormatError> {
        for (key, data) in objects {
            self.apply_object_where(key, data, &keep_inode, &keep_entry)?;
        }
        Ok(())
    }

    /// Starts replaying snapshot `h`: a full snapshot replaces the tree, a delta must follow
    /// the tree's own snapshot (else nothing changes).
    fn start(&mut self, h: &Header) -> Result<(), FormatError> {
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
        Ok(())
    }

    /// Puts one inode record in, its data laid over the inode's data before.
    fn insert(&mut self, mut rec: InodeRec, chunk_size: u64) {
        let data = std::mem::replace(&mut rec.data, DataRec::None);
        let old = self.inodes.remove(&rec.ino).map(|t| t.data);
        let data = TreeData::of(data, old, rec.size, chunk_size);
        self.inodes.insert(rec.ino, TreeInode { rec, data });
    }

    /// The body of a full snapshot of this tree (every inode, its whole chunk map, every
    /// entry), in key order.
    pub fn full_body(&self) -> Body {
        let inodes = self
            .inodes
            .values()
            .map(|t| {
                let mut rec = t.rec.clone();
                rec.data = match &t.data {
                    TreeData::None => DataRec::None,
                    TreeData::Inline(v) => DataRec::Inline(v.clone()),
                    TreeData::Symlink(v) => DataRec::Symlink(v.clone()),
                    TreeData::Chunks(m) => DataRec::Chunks {
                        complete: true,
                        patch: m
                            .iter()
                            .enumerate()
                            .map(|(i, id)| (i as u64, id.map(|c| c.0)))
                            .collect(),
                    },
                };
                rec
            })
            .collect();
        let dirents = self
            .dirents
            .iter()
            .map(|((p, n), (ino, kind))| DirentRec {
                parent: *p,
                name: n.clone(),
                ino: *ino,
                kind: *kind,
            })
            .collect();
        Body {
            inodes,
            dirents,
            ..Default::default()
        }
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

/// Chunk ids a snapshot object's body names, read one record at a time (gc and forks:
/// what a kept snapshot protects, without the body in memory); the object's header.
pub fn object_chunk_ids(
    key: &str,
    data: &[u8],
    out: &mut dyn FnMut(ChunkId),
) -> Result<Header, FormatError> {
    let (h, mut r) = reader(key, data)?;
    chunk_ids_of(&mut r, out)?;
    Ok(h)
}

fn chunk_ids_of(r: &mut BodyReader<'_>, out: &mut dyn FnMut(ChunkId)) -> Result<(), FormatError> {
    while let Some(rec) = r.next_inode()? {
        if let DataRec::Chunks { patch, .. } = rec.data {
            patch
                .into_iter()
                .filter_map(|(_, id)| id)
                .for_each(|id| out(ChunkId(id)));
        }
    }
    Ok(())
}

/// Like [`object_chunk_ids`], but decodes every record of the body to its end (fsck: the
/// whole object must read, not only its file records).
pub fn check_object(
    key: &str,
    data: &[u8],
    out: &mut dyn FnMut(ChunkId),
) -> Result<Header, FormatError> {
    let (h, mut r) = reader(key, data)?;
    chunk_ids_of(&mut r, out)?;
    while r.next_deleted()?.is_some() {}
    while r.next_dirent()?.is_some() {}
    while r.next_unlinked()?.is_some() {}
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spill_has_no_name_once_open_and_gives_back_what_it_was_given() {
        // A crash in the middle of a full snapshot must not leave the spill beside the
        // database: only its descriptor keeps it.
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(crate::state::SCRATCH[4]);
        // One a crashed keel left (readable by all) is not reused.
        std::fs::write(&path, b"stale").unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        let mut sp = Spill::create(path.clone()).unwrap();
        assert!(!path.exists(), "the spill file is still named");
        for i in 0..3u64 {
            sp.push(&i).unwrap();
        }
        assert_eq!(sp.len(), 3);
        let f = sp.finish().unwrap();
        // Private from its creation: inline files' bytes go through it.
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(f.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut zstd::stream::Decoder::new(f).unwrap(), &mut bytes)
            .unwrap();
        let mut rest = bytes.as_slice();
        for i in 0..3u64 {
            let (v, r) = postcard::take_from_bytes::<u64>(rest).unwrap();
            assert_eq!(v, i);
            rest = r;
        }
        assert!(rest.is_empty());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }

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

    /// A body with records in every section and every kind of data.
    fn mixed_body() -> Body {
        let mut inodes: Vec<InodeRec> = (2..40)
            .map(|i| {
                let data = match i % 4 {
                    0 => DataRec::None,
                    1 => DataRec::Inline(vec![i as u8; i as usize * 3]),
                    2 => DataRec::Symlink(b"../target".to_vec()),
                    _ => DataRec::Chunks {
                        complete: i % 8 == 3,
                        patch: vec![(0, Some([i as u8; 32])), (1, None)],
                    },
                };
                rec(i, i * 10, data)
            })
            .collect();
        inodes[3]
            .xattrs
            .push((b"user.big".to_vec(), vec![7; 70_000]));
        Body {
            inodes,
            deleted: vec![90, 91, 1 << 40],
            dirents: (2..40)
                .map(|i| DirentRec {
                    parent: 1,
                    name: format!("name-{i}").into_bytes(),
                    ino: i,
                    kind: libc::S_IFREG,
                })
                .collect(),
            unlinked: vec![(1, b"gone".to_vec()), (5, vec![0xff; 255])],
        }
    }

    /// Writes `b` through a `BodyWriter`.
    fn streamed(h: &Header, b: &Body) -> Vec<u8> {
        let mut w = BodyWriter::new(h).unwrap();
        w.begin(Section::Inodes, b.inodes.len() as u64).unwrap();
        b.inodes.iter().for_each(|r| w.inode(r).unwrap());
        w.begin(Section::Deleted, b.deleted.len() as u64).unwrap();
        b.deleted.iter().for_each(|d| w.deleted(*d).unwrap());
        w.begin(Section::Dirents, b.dirents.len() as u64).unwrap();
        b.dirents.iter().for_each(|d| w.dirent(d).unwrap());
        w.begin(Section::Unlinked, b.unlinked.len() as u64).unwrap();
        b.unlinked
            .iter()
            .for_each(|(p, n)| w.unlinked(*p, n).unwrap());
        w.finish().unwrap()
    }

    /// Reads a whole body through a `BodyReader`.
    fn read_streamed(data: &[u8]) -> (Header, Body) {
        let (h, mut r) = reader("k", data).unwrap();
        let mut b = Body::default();
        while let Some(x) = r.next_inode().unwrap() {
            b.inodes.push(x);
        }
        while let Some(x) = r.next_deleted().unwrap() {
            b.deleted.push(x);
        }
        while let Some(x) = r.next_dirent().unwrap() {
            b.dirents.push(x);
        }
        while let Some(x) = r.next_unlinked().unwrap() {
            b.unlinked.push(x);
        }
        (h, b)
    }

    #[test]
    fn streamed_bodies_are_byte_identical_to_the_whole_body_encoding() {
        let mut h = header(3, None);
        h.image = Some(ImageRef {
            hash: [4; 32],
            size: 9,
        });
        for body in [mixed_body(), Body::default()] {
            let whole = encode(&h, &body).unwrap();
            let stream = streamed(&h, &body);
            let (_, off) = decode_header("k", &stream).unwrap();
            assert_eq!(stream[..off], whole[..off], "the same header");
            let raw = zstd::stream::decode_all(&stream[off..]).unwrap();
            assert_eq!(raw, postcard::to_stdvec(&body).unwrap());
            // Each reads what the other wrote.
            assert_eq!(decode("k", &stream).unwrap(), (h.clone(), body.clone()));
            assert_eq!(read_streamed(&whole), (h.clone(), body.clone()));
        }
        // Sections left out are empty; a later section skips what is left of earlier ones.
        let body = mixed_body();
        let mut w = BodyWriter::new(&h).unwrap();
        w.begin(Section::Dirents, 1).unwrap();
        w.dirent(&body.dirents[0]).unwrap();
        let (_, b) = read_streamed(&w.finish().unwrap());
        assert_eq!(b.dirents, body.dirents[..1]);
        assert!(b.inodes.is_empty() && b.deleted.is_empty() && b.unlinked.is_empty());
        let whole = encode(&h, &body).unwrap();
        let (_, mut r) = reader("k", &whole).unwrap();
        assert_eq!(r.remaining(Section::Unlinked).unwrap(), 2);
        assert_eq!(r.next_unlinked().unwrap(), Some(body.unlinked[0].clone()));
        assert!(r.next_inode().is_err(), "sections are read in order");
        let mut ids = Vec::new();
        object_chunk_ids("k", &whole, &mut |c| ids.push(c)).unwrap();
        assert_eq!(ids.len(), 10, "one id per chunked inode: {ids:?}");
        // A count the records do not match is an encode error, not a bad object.
        let mut w = BodyWriter::new(&h).unwrap();
        w.begin(Section::Inodes, 2).unwrap();
        w.inode(&body.inodes[0]).unwrap();
        assert!(w.begin(Section::Deleted, 0).is_err());
        let mut w = BodyWriter::new(&h).unwrap();
        w.begin(Section::Deleted, 0).unwrap();
        assert!(w.deleted(1).is_err());
        // A truncated body is an error naming the object.
        let cut = &whole[..whole.len() - 20];
        let (_, mut r) = reader("snap-9", cut).unwrap();
        let e = loop {
            match r.next_dirent() {
                Ok(Some(_)) => continue,
                Ok(None) => match r.next_unlinked() {
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("a truncated body read to its end"),
                    Err(e) => break e,
                },
                Err(e) => break e,
            }
        };
        assert!(e.to_string().contains("snap-9"), "{e}");
    }

    #[test]
    fn a_streamed_apply_makes_the_tree_a_whole_body_apply_makes() {
        let full = mixed_body();
        let mut h1 = header(1, None);
        h1.chunk_size = 4;
        let mut a = Tree::default();
        a.apply(&h1, full.clone()).unwrap();
        let mut b = Tree::default();
        assert_eq!(
            b.apply_object("k", &encode(&h1, &full).unwrap()).unwrap(),
            h1
        );
        assert_eq!(a, b);
        // A delta removing what it then puts back (the removal comes first, so the inode
        // and the entry are there after it, and the chunk patch starts from nothing), and
        // patching an inode's chunk map.
        let mut delta = mixed_body();
        delta.inodes.truncate(6);
        delta.deleted = vec![5, 7, 30, 1 << 40];
        delta.dirents.truncate(3);
        delta.unlinked = vec![(1, b"name-2".to_vec()), (1, b"name-20".to_vec())];
        let h2 = header(2, Some(1));
        a.apply(&h2, delta.clone()).unwrap();
        b.apply_object("k", &encode(&h2, &delta).unwrap()).unwrap();
        assert_eq!(a, b);
        assert!(b.inodes.contains_key(&5) && !b.inodes.contains_key(&30));
        assert!(b.dirents.contains_key(&(1, b"name-2".to_vec())));
        assert!(!b.dirents.contains_key(&(1, b"name-20".to_vec())));
        // Out of chain: refused and the tree untouched.
        let e = b
            .apply_object("snap-4", &encode(&header(4, Some(3)), &delta).unwrap())
            .unwrap_err();
        assert!(matches!(e, FormatError::Chain { seq: 4, .. }), "{e}");
        assert_eq!(a, b);
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

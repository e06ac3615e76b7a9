//! `ChunkId`: the blake3 hash of a chunk's bytes, which is also its name on the remote (64
//! lowercase hex digits). Identical bytes anywhere get the same id, so they are stored once.

use std::fmt;

/// The blake3 hash of one chunk.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

#[derive(Debug, thiserror::Error)]
pub enum ChunkIdError {
    #[error("chunk id `{0}` is not 64 hex digits")]
    ParseHex(String),
    #[error("chunk id blob has {0} bytes, expected 32")]
    BlobLength(usize),
}

/// The blake3 hash of a whole file's bytes, fed in pieces (the files API's `ETag`).
#[derive(Default)]
pub struct ContentHasher(blake3::Hasher);

impl ContentHasher {
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    pub fn finish(&self) -> ChunkId {
        ChunkId(*self.0.finalize().as_bytes())
    }
}

impl ChunkId {
    /// Hashes `bytes`.
    pub fn of(bytes: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(bytes).as_bytes())
    }

    /// Does `bytes` hash to this id?
    pub fn verify(&self, bytes: &[u8]) -> bool {
        ChunkId::of(bytes) == *self
    }

    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from(HEX[(b >> 4) as usize]));
            s.push(char::from(HEX[(b & 15) as usize]));
        }
        s
    }

    pub fn from_hex(s: &str) -> Result<ChunkId, ChunkIdError> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return Err(ChunkIdError::ParseHex(s.to_string()));
        }
        let mut out = [0u8; 32];
        for (i, pair) in b.chunks(2).enumerate() {
            let hi = hex_val(pair[0]).ok_or_else(|| ChunkIdError::ParseHex(s.to_string()))?;
            let lo = hex_val(pair[1]).ok_or_else(|| ChunkIdError::ParseHex(s.to_string()))?;
            out[i] = hi << 4 | lo;
        }
        Ok(ChunkId(out))
    }

    pub fn from_slice(b: &[u8]) -> Result<ChunkId, ChunkIdError> {
        let arr: [u8; 32] = b
            .try_into()
            .map_err(|_| ChunkIdError::BlobLength(b.len()))?;
        Ok(ChunkId(arr))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", &self.to_hex()[..16])
    }
}

impl std::str::FromStr for ChunkId {
    type Err = ChunkIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ChunkId::from_hex(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_roundtrip_and_known_value() {
        let id = ChunkId::of(b"");
        // blake3 of the empty input (from the blake3 test vectors).
        assert_eq!(
            id.to_hex(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
        assert_eq!(ChunkId::from_hex(&id.to_hex()).unwrap(), id);
        assert!(ChunkId::from_hex("xyz").is_err());
        assert!(ChunkId::from_hex(&"g".repeat(64)).is_err());
        assert!(id.verify(b""));
        assert!(!id.verify(b"x"));
    }
}

//! The read set on the remote: `<ws>/readset`, the chunk windows (inode, window index) the
//! workspace's sessions read, in the order they were first read, newest session first.
//! Every checkpoint (one with nothing to snapshot too) rewrites it when the mounted
//! filesystem's set changed: this session's windows, then those of the set it found that
//! this session did not read, at most `MAX_WINDOWS`. A cold start fetches it right after the
//! metadata and fetches those windows first (`workspace::fs::replay`). It is a hint only:
//! inode numbers and windows are those of the snapshots (a restore keeps them); a window
//! that is no longer there, or holds other bytes now, is fetched as its current chunk or
//! skipped. Object: `KEELREAD` + zstd(postcard(`ReadSetObject`)).

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::remote::{PutMode, RemoteError};
use super::repo::{Repo, RepoError};

const MAGIC: &[u8; 8] = b"KEELREAD";
const FORMAT: u32 = 1;
/// Windows the object holds at most (a few MiB encoded).
pub const MAX_WINDOWS: usize = 1 << 20;

#[derive(Debug, Serialize, Deserialize)]
struct ReadSetObject {
    format: u32,
    /// The window size the indexes count in.
    chunk_size: u64,
    written_ns: i64,
    /// (inode, window index), each window's inode delta-coded against the one before
    /// (mostly 0 or small: one file's windows, then a nearby file's).
    windows: Vec<(i64, u64)>,
}

/// The key of the read set of `repo`'s workspace.
pub fn key(repo: &Repo) -> String {
    repo.key("readset")
}

/// Encodes a read set of windows counted in `chunk_size` bytes.
pub fn encode(windows: &[(u64, u64)], chunk_size: u64) -> Vec<u8> {
    let mut prev = 0i64;
    let obj = ReadSetObject {
        format: FORMAT,
        chunk_size,
        written_ns: crate::time::now_ns(),
        windows: windows
            .iter()
            .take(MAX_WINDOWS)
            .map(|(ino, idx)| {
                let d = *ino as i64 - prev;
                prev = *ino as i64;
                (d, *idx)
            })
            .collect(),
    };
    let raw = postcard::to_stdvec(&obj).expect("a read set serialises");
    let mut out = MAGIC.to_vec();
    out.extend(zstd::bulk::compress(&raw, 3).expect("zstd of memory"));
    out
}

/// Decodes a read set: its windows, if they are counted in `chunk_size` bytes (a set cut
/// in other windows is of no use: `None`).
pub fn decode(
    key: &str,
    data: &[u8],
    chunk_size: u64,
) -> Result<Option<Vec<(u64, u64)>>, RepoError> {
    let bad = |reason: String| RepoError::Parse {
        what: "read set",
        key: key.to_string(),
        reason,
    };
    let body = data
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| bad("not a keel read set (bad magic)".into()))?;
    let raw = zstd::stream::decode_all(body).map_err(|e| bad(e.to_string()))?;
    let obj: ReadSetObject = postcard::from_bytes(&raw).map_err(|e| bad(e.to_string()))?;
    if obj.format > FORMAT {
        return Err(bad(format!(
            "format {} is newer than this keel reads ({FORMAT})",
            obj.format
        )));
    }
    if obj.chunk_size != chunk_size {
        return Ok(None);
    }
    let mut prev = 0i64;
    Ok(Some(
        obj.windows
            .into_iter()
            .map(|(d, idx)| {
                prev += d;
                (prev as u64, idx)
            })
            .collect(),
    ))
}

/// The workspace's read set, if it has one in windows of `chunk_size` bytes. A read set
/// that cannot be read is reported and taken as none (it is only a hint).
pub fn download(repo: &Repo, chunk_size: u64) -> Vec<(u64, u64)> {
    let key = key(repo);
    match repo.remote.get(&key) {
        Ok(b) => match decode(&key, &b, chunk_size) {
            Ok(Some(v)) => v,
            Ok(None) => Vec::new(),
            Err(e) => {
                tracing::warn!(error = %e, "read set not used");
                Vec::new()
            }
        },
        Err(e) if e.is_not_found() => Vec::new(),
        Err(e) => {
            tracing::warn!(error = %e, "read set not fetched");
            Vec::new()
        }
    }
}

/// Writes the read set (replacing the one there).
pub fn upload(repo: &Repo, windows: &[(u64, u64)], chunk_size: u64) -> Result<(), RemoteError> {
    let data = Bytes::from(encode(windows, chunk_size));
    repo.remote.put(&key(repo), data, PutMode::Overwrite)?;
    Ok(())
}

/// This session's windows first, then the older set's that it did not read, at most
/// `MAX_WINDOWS`.
pub fn merge(newest: &[(u64, u64)], older: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let seen: std::collections::HashSet<&(u64, u64)> = newest.iter().collect();
    newest
        .iter()
        .chain(older.iter().filter(|w| !seen.contains(w)))
        .take(MAX_WINDOWS)
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_in_order_and_refuses_other_windows() {
        let w = vec![(7, 0), (7, 1), (3, 0), (900, 4), (901, 0)];
        let b = encode(&w, 1 << 19);
        assert_eq!(decode("k", &b, 1 << 19).unwrap(), Some(w));
        assert_eq!(decode("k", &b, 1 << 16).unwrap(), None);
        assert!(decode("k", b"KEELSNAPxx", 1 << 19).is_err());
    }

    #[test]
    fn merge_keeps_the_new_order_then_the_old_rest() {
        assert_eq!(
            merge(&[(2, 0), (1, 0)], &[(1, 0), (5, 5), (2, 1)]),
            vec![(2, 0), (1, 0), (5, 5), (2, 1)]
        );
    }
}

//! The remote as the mounted filesystem's source of lazily restored windows:
//! `RemoteChunks` is the `chunk::ChunkSource` a lazy restore's reads fetch through, each
//! chunk checked against its blake3 id (a mismatch is an error naming the chunk, and the
//! read answers EIO, never wrong bytes).

use bytes::Bytes;

use super::repo::RepoError;
use super::Repo;
use crate::chunk::{ChunkId, ChunkSource, FetchError};

/// The remote as the filesystem's source of not-yet-fetched windows (lazy restore): chunks
/// come through `Repo::get_chunks` (parallel `get_many`, each checked against its id).
pub struct RemoteChunks {
    repo: Repo,
}

impl RemoteChunks {
    pub fn new(repo: Repo) -> RemoteChunks {
        RemoteChunks { repo }
    }
}

impl ChunkSource for RemoteChunks {
    fn fetch(&self, ids: &[ChunkId]) -> Vec<Result<Bytes, FetchError>> {
        self.repo
            .get_chunks(ids)
            .into_iter()
            .zip(ids)
            .map(|(r, id)| {
                r.map_err(|e| match e {
                    RepoError::ChunkCorrupt { id, actual } => FetchError::Corrupt { id, actual },
                    e => FetchError::Remote {
                        id: *id,
                        reason: e.to_string(),
                    },
                })
            })
            .collect()
    }
}

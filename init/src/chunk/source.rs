//! Where the bytes of not-yet-fetched chunk windows come from (lazy restore): a small
//! trait the filesystem calls, implemented by `persist` over the remote and wired in by
//! the workspace session, so `workspace/fs` never imports `persist`. Every chunk an
//! implementation returns must already be checked against its id.

use bytes::Bytes;

use super::ChunkId;

/// Why one chunk could not be fetched.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    #[error("chunk {id} is corrupt on the remote (its bytes hash to {actual})")]
    Corrupt { id: ChunkId, actual: ChunkId },
    #[error("fetch chunk {id}: {reason}")]
    Remote { id: ChunkId, reason: String },
}

/// Fetches chunks by id, verified.
pub trait ChunkSource: Send + Sync {
    /// One result per id, in input order; implementations may fetch in parallel.
    fn fetch(&self, ids: &[ChunkId]) -> Vec<Result<Bytes, FetchError>>;
}

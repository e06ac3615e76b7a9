//! Fetch-and-verify of chunk windows for the read path: the piece lazy restore (issue 5)
//! builds on. Given a file's chunk map (the `file_chunk` table, written by checkpoints and
//! by restore), `Hydrator` fetches the chunk of a window from the remote, checks it against
//! its blake3 id, and writes it into the body at the window's offset. A mismatch is an error
//! naming the chunk (the read path answers EIO), never wrong bytes. `RemoteChunks` is the
//! `chunk::ChunkSource` the mounted filesystem fetches lazily restored windows through.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

use bytes::Bytes;

use super::repo::{Repo, RepoError};
use crate::chunk::chunker::window_range;
use crate::chunk::{ChunkId, ChunkSource, FetchError};
use crate::meta::{InodeNo, MetaError, Nanos, Store};
use crate::time::now_ns;

#[derive(Debug, thiserror::Error)]
pub enum HydrateError {
    #[error("state database: {0}")]
    Meta(#[from] MetaError),
    #[error("inode {ino} window {idx}: no checkpointed chunk to fetch")]
    NoChunk { ino: u64, idx: u64 },
    #[error("inode {ino} window {idx}: chunk {id}: {source}")]
    Fetch {
        ino: u64,
        idx: u64,
        id: ChunkId,
        source: RepoError,
    },
    #[error("inode {ino} window {idx}: write body: {source}")]
    WriteBody {
        ino: u64,
        idx: u64,
        source: std::io::Error,
    },
}

impl HydrateError {
    /// The remote returned bytes that do not hash to the chunk's name.
    pub fn is_corrupt(&self) -> bool {
        matches!(
            self,
            HydrateError::Fetch {
                source: RepoError::ChunkCorrupt { .. },
                ..
            }
        )
    }
}

pub struct Hydrator {
    repo: Repo,
    store: Mutex<Store>,
    chunk_size: u64,
}

impl Hydrator {
    /// Opens its own connection to the state database of `state_dir`.
    pub fn open(state_dir: &Path, repo: Repo, chunk_size: u64) -> Result<Hydrator, HydrateError> {
        let store = crate::state::open_store(state_dir, Nanos(now_ns()))?;
        Ok(Hydrator {
            repo,
            store: Mutex::new(store),
            chunk_size,
        })
    }

    /// The chunk ids of windows `idx` of a file (`None`: an all-zero window).
    fn ids(&self, ino: InodeNo, idx: &[u64]) -> Result<Vec<Option<ChunkId>>, HydrateError> {
        let rows = self
            .store
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .read()
            .file_chunks(ino)?;
        idx.iter()
            .map(|i| match rows.iter().find(|(x, _)| x == i) {
                Some((_, id)) => Ok(id.map(ChunkId)),
                None => Err(HydrateError::NoChunk {
                    ino: ino.0,
                    idx: *i,
                }),
            })
            .collect()
    }

    /// The checkpointed bytes of windows `idx` of a file, verified (`None`: all zeros).
    pub fn windows(&self, ino: InodeNo, idx: &[u64]) -> Result<Vec<Option<Bytes>>, HydrateError> {
        let ids = self.ids(ino, idx)?;
        let wanted: Vec<ChunkId> = ids.iter().flatten().copied().collect();
        let mut got = self.repo.get_chunks(&wanted).into_iter();
        let mut out = Vec::with_capacity(ids.len());
        for (i, id) in idx.iter().zip(ids) {
            match id {
                None => out.push(None),
                Some(id) => {
                    let b = got.next().expect("one result per id").map_err(|source| {
                        HydrateError::Fetch {
                            ino: ino.0,
                            idx: *i,
                            id,
                            source,
                        }
                    })?;
                    out.push(Some(b));
                }
            }
        }
        Ok(out)
    }

    /// Fetches windows `idx` of a file of `size` bytes into its body file; returns the bytes
    /// written. All-zero windows are left as holes.
    pub fn hydrate(
        &self,
        ino: InodeNo,
        size: u64,
        idx: &[u64],
        body: &File,
    ) -> Result<u64, HydrateError> {
        let mut n = 0;
        for (i, data) in idx.iter().zip(self.windows(ino, idx)?) {
            let Some(data) = data else { continue };
            let r = window_range(*i, size, self.chunk_size);
            let len = data.len().min((r.end - r.start) as usize);
            body.write_all_at(&data[..len], r.start)
                .map_err(|source| HydrateError::WriteBody {
                    ino: ino.0,
                    idx: *i,
                    source,
                })?;
            n += len as u64;
        }
        super::metrics::hydrated(idx.len(), n);
        Ok(n)
    }
}

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

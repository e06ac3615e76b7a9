//! File bytes on local disk: one *body* file per regular file that outgrew inline storage,
//! written in place (`bodies/XX/<id>` under the state dir), plus the content addressing used
//! by checkpoints: `ChunkId` (blake3) and the fixed windowing of bodies into chunks. This
//! module imports no sibling module except `sys`.

pub mod body;
pub mod chunker;
pub mod id;
pub mod reserve;
pub mod source;

pub use body::{BodyError, BodyPool, BodyStore, Fresh};
pub use id::{ChunkId, ContentHasher};
pub use source::{ChunkSource, FetchError};

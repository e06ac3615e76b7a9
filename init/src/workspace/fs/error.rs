//! What can go wrong in a filesystem operation, and the one errno each becomes.

use std::io;

use super::acl::AclError;
use crate::meta::MetaError;

/// Everything that can go wrong in a filesystem operation. `errno` maps each to the one
/// errno the caller sees.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("name too long")]
    NameTooLong,
    #[error("invalid argument")]
    Invalid,
    #[error("no such attribute")]
    NoAttr,
    #[error("buffer too small")]
    Range,
    #[error("attribute value too large")]
    TooBig,
    #[error("operation not permitted")]
    NotPermitted,
    #[error("permission denied")]
    Access,
    #[error("bad file handle")]
    BadHandle,
    #[error("operation not supported")]
    NotSupported,
    #[error("no data at or after offset")]
    NoData,
    #[error("too many links")]
    TooManyLinks,
    /// A setxattr would take a file's xattrs past `XATTRS_PER_FILE_MAX`.
    #[error("no room for more extended attributes on this file")]
    XattrsFull,
    #[error("the state volume has no room for it")]
    NoSpace,
    #[error("io: {0}")]
    Io(#[from] io::Error),
    #[error("metadata: {0}")]
    Meta(#[from] MetaError),
    /// A window of a lazily restored file could not be fetched; `at` names it (or is empty).
    /// Boxed: two chunk ids would double the size of every `FsError`.
    #[error("lazy restore: {at}{source}")]
    Fetch {
        at: String,
        #[source]
        source: Box<crate::chunk::FetchError>,
    },
    /// An ACL keel stored (or restored) does not parse: the store is damaged.
    #[error("stored ACL: {0}")]
    StoredAcl(AclError),
}

impl FsError {
    /// The errno for this error. One exhaustive match: adding a variant forces a choice here.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::Invalid => libc::EINVAL,
            FsError::NoAttr => libc::ENODATA,
            FsError::Range => libc::ERANGE,
            FsError::TooBig => libc::E2BIG,
            FsError::NotPermitted => libc::EPERM,
            FsError::Access => libc::EACCES,
            FsError::BadHandle => libc::EBADF,
            FsError::NotSupported => libc::EOPNOTSUPP,
            FsError::NoData => libc::ENXIO,
            FsError::TooManyLinks => libc::EMLINK,
            FsError::XattrsFull => libc::ENOSPC,
            FsError::NoSpace => libc::ENOSPC,
            FsError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            FsError::Meta(e) if e.is_full() => libc::ENOSPC,
            FsError::Meta(_) => libc::EIO,
            FsError::Fetch { .. } => libc::EIO,
            FsError::StoredAcl(_) => libc::EIO,
        }
    }
}

pub type FsResult<T> = Result<T, FsError>;

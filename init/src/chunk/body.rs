//! The body store: a directory of sparse files, one per file id, sharded by the low byte
//! of the id so no directory grows past a few thousand entries.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("create body dir {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },
}

#[derive(Debug, Clone)]
pub struct BodyStore {
    root: PathBuf,
}

impl BodyStore {
    /// Opens the store rooted at `root`, creating its shard directories.
    pub fn open(root: &Path) -> Result<BodyStore, BodyError> {
        for shard in 0..=255u32 {
            let p = root.join(format!("{shard:02x}"));
            std::fs::create_dir_all(&p)
                .map_err(|source| BodyError::CreateDir { path: p, source })?;
        }
        Ok(BodyStore {
            root: root.to_path_buf(),
        })
    }

    pub fn path(&self, id: u64) -> PathBuf {
        self.root.join(format!("{:02x}/{id:x}", id & 0xff))
    }

    fn shard(&self, id: u64) -> PathBuf {
        self.root.join(format!("{:02x}", id & 0xff))
    }

    /// Opens a body for reading and writing, creating an empty one when absent.
    pub fn open_rw(&self, id: u64) -> io::Result<File> {
        let open = |flags: i32| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(flags)
                .open(self.path(id))
        };
        // O_NOATIME is refused for files we do not own; retry without it.
        open(libc::O_CLOEXEC | libc::O_NOATIME).or_else(|e| match e.raw_os_error() {
            Some(libc::EPERM) => open(libc::O_CLOEXEC),
            _ => Err(e),
        })
    }

    /// Size and allocated 512-byte blocks of a body, if it exists.
    pub fn stat(&self, id: u64) -> io::Result<Option<(u64, u64)>> {
        use std::os::unix::fs::MetadataExt;
        match std::fs::metadata(self.path(id)) {
            Ok(m) => Ok(Some((m.len(), m.blocks()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes a body; a missing one is not an error.
    pub fn remove(&self, id: u64) -> io::Result<()> {
        match std::fs::remove_file(self.path(id)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Makes the directory entry of a body durable (after creating it).
    pub fn sync_entry(&self, id: u64) -> io::Result<()> {
        File::open(self.shard(id))?.sync_all()
    }

    /// Ids of every body present (for fsck and orphan cleanup).
    pub fn ids(&self) -> io::Result<Vec<u64>> {
        let mut out = Vec::new();
        for shard in 0..=255u32 {
            let dir = self.root.join(format!("{shard:02x}"));
            for e in std::fs::read_dir(dir)? {
                let e = e?;
                if let Some(id) = e
                    .file_name()
                    .to_str()
                    .and_then(|s| u64::from_str_radix(s, 16).ok())
                {
                    out.push(id);
                }
            }
        }
        out.sort_unstable();
        Ok(out)
    }
}

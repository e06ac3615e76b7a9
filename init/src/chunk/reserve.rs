//! A small preallocated file in the state dir that keeps room for metadata when the
//! volume fills up: deleting files must still work on a full disk, and deleting needs a
//! SQLite commit. Released when a commit fails for lack of space, refilled once there is
//! room again. Created 0600, like every file in the state dir.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::sys;

#[derive(Debug)]
pub struct Reserve {
    path: PathBuf,
    size: u64,
    /// The open reserve file while it holds its space.
    held: Mutex<Option<File>>,
}

impl Reserve {
    /// Creates (or reuses) the reserve at `path`; tries to hold `size` bytes.
    pub fn open(path: &Path, size: u64) -> Reserve {
        let r = Reserve {
            path: path.to_path_buf(),
            size,
            held: Mutex::new(None),
        };
        if let Err(e) = r.fill() {
            tracing::warn!(error = %e, "could not reserve space for metadata");
        }
        r
    }

    /// A reserve at `path` that holds nothing until [`Reserve::refill_if_room`] (or a later
    /// `open`) takes its space.
    pub fn unheld(path: &Path, size: u64) -> Reserve {
        Reserve {
            path: path.to_path_buf(),
            size,
            held: Mutex::new(None),
        }
    }

    fn fill(&self) -> io::Result<bool> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&self.path)?;
        match sys::file::fallocate(&f, 0, 0, self.size) {
            Ok(()) => {
                *self.held.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
                Ok(true)
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                f.set_len(0)?;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Whether the reserve holds its space now.
    pub fn held(&self) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Frees the reserved space; returns whether there was any to free.
    pub fn release(&self) -> bool {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        match held.take() {
            Some(f) => {
                let _ = f.set_len(0);
                true
            }
            None => false,
        }
    }

    /// Takes the space back once the volume has room for it several times over.
    pub fn refill_if_room(&self) {
        if self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
        {
            return;
        }
        let Some(dir) = self.path.parent() else {
            return;
        };
        if let Ok(s) = sys::file::statvfs(dir) {
            if s.blocks_avail.saturating_mul(s.fragment_size) > 4 * self.size {
                let _ = self.fill();
            }
        }
    }
}

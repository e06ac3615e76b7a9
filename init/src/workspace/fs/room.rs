//! Room on the state volume: the one place that decides whether keel may write file bytes
//! or create an entry there, and how an update that grows nothing commits on a full volume.
//!
//! Deleting must work on a full volume, and a delete is a SQLite commit: the metadata
//! reserve (`chunk::reserve`) holds room for it while the volume fills, and once it was
//! given back the room it freed is kept for deletes. Every write keel makes and every
//! create asks `Room::claim` first. A claim looks at the free space and at what the claims
//! still in flight were granted, under one lock, so two FUSE workers cannot both see the
//! same free bytes and both take them. A claim ends (its bytes now show in the volume's own
//! numbers) when the write is done.
//!
//! What this cannot hold back: writes through passthrough handles go from the kernel
//! straight to the body file, past keel, and a shared mapping of such a file is written
//! back by the kernel too. They can fill the volume to its last block. The reserve file
//! keeps its room from them while it is held (it is allocated, not counted), which is why
//! deletes first try without giving it back (`WorkspaceFs::freeing` starts the WAL over,
//! see `Store::rewind_wal`), and give it back only when that is not enough; in the moment
//! between giving it back and the delete's commit, a passthrough writer may take the room
//! first, and the delete then fails with ENOSPC like the writer's next write.

use std::path::Path;
use std::sync::Mutex;

use super::{FsError, FsResult, RESERVE_BYTES};
use crate::sys;

/// What a create must find free beyond the kept room: its rows and directory entry, with
/// the pages they may take in the WAL and in the database file when it is checkpointed.
pub(super) const CREATE_ROOM: u64 = 64 << 10;

/// Above this much free space a claim does not ask the volume: the room is plenty, and a
/// statvfs per write would cost every write on a roomy volume.
const PLENTY: u64 = 256 << 20;

/// Bytes granted to writes and creates not finished yet.
#[derive(Debug, Default)]
pub(super) struct Room {
    claimed: Mutex<Claimed>,
}

#[derive(Debug, Default)]
struct Claimed {
    /// Granted to claims still in flight.
    bytes: u64,
    /// What may still be granted without asking the volume: what it had free beyond
    /// `PLENTY` when it was last asked, less what was granted since.
    plenty: u64,
}

/// Room granted to one write or create; given back when dropped.
#[derive(Debug)]
pub(super) struct Claim<'a> {
    room: &'a Room,
    /// Bytes held for the caller (0 when it needed no new room).
    held: u64,
    /// What the caller may write: `len` or less.
    pub(super) granted: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.held > 0 {
            let mut c = self.room.claimed.lock().unwrap_or_else(|p| p.into_inner());
            c.bytes = c.bytes.saturating_sub(self.held);
        }
    }
}

impl Room {
    /// Claims room for writing `len` bytes of which `new` need new blocks (an overwrite of
    /// allocated bytes needs none) in `dir`'s volume, keeping `kept` bytes free for deletes
    /// (the reserve's room when it was given back, else 0). Grants all `len` when `new` fits,
    /// fewer when only part of it does (a short write, as from ext4: the bytes that need no
    /// room are not counted, so the grant is what is free), ENOSPC when nothing does.
    pub(super) fn claim(&self, dir: &Path, kept: u64, len: u64, new: u64) -> FsResult<Claim<'_>> {
        if new == 0 {
            return Ok(Claim {
                room: self,
                held: 0,
                granted: len,
            });
        }
        let mut claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
        if new <= claimed.plenty {
            claimed.plenty -= new;
            return Ok(Claim {
                room: self,
                held: 0,
                granted: len,
            });
        }
        let avail = match sys::file::statvfs(dir) {
            Ok(s) => s.blocks_avail.saturating_mul(s.fragment_size),
            // Without numbers the write itself finds out.
            Err(_) => u64::MAX,
        };
        claimed.plenty = avail.saturating_sub(claimed.bytes).saturating_sub(PLENTY);
        let free = avail.saturating_sub(claimed.bytes).saturating_sub(kept);
        let granted = if new <= free { len } else { free.min(len) };
        if granted == 0 {
            return Err(FsError::NoSpace);
        }
        let held = granted.min(new);
        claimed.bytes += held;
        Ok(Claim {
            room: self,
            held,
            granted,
        })
    }

    /// Claims room for one new entry (create, mkdir, mknod, symlink, link): ENOSPC unless
    /// `CREATE_ROOM` is free beyond `kept` and the claims in flight. A create that could take
    /// the last free pages would leave a checkpoint of the WAL no room to grow the database
    /// file, and then no update could start the WAL over (`Store::rewind_wal`).
    pub(super) fn claim_entry(&self, dir: &Path, kept: u64) -> FsResult<Claim<'_>> {
        let c = self.claim(dir, kept, CREATE_ROOM, CREATE_ROOM)?;
        if c.granted < CREATE_ROOM {
            return Err(FsError::NoSpace);
        }
        Ok(c)
    }
}

/// What must stay free for deletes: the reserve's size once it was given back (while it is
/// held its room is its own).
pub(super) fn kept(reserve_held: bool) -> u64 {
    if reserve_held {
        0
    } else {
        RESERVE_BYTES
    }
}

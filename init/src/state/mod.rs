//! The state dir, owned in one place: the name of every file and directory keel keeps in it,
//! whether a directory is keel's (or fresh enough to become keel's), its lock, its private
//! modes ([`private`]), and opening the store and the bodies it holds. Everything else
//! reaches a state file through this module and never spells its name, so a new file is
//! added here once and every check that lists the state dir's contents learns it.
//!
//! It sits beside `meta` and `chunk` (whose store and bodies it opens) and below `config`
//! (whose defaults name the control socket and the default remote inside the state dir).

pub mod private;

use std::io;
use std::path::{Path, PathBuf};

use crate::chunk::{BodyError, BodyStore};
use crate::meta::{MetaError, Nanos, Store};
use crate::sys::file::LockFile;

/// The metadata store (SQLite; its `-wal` and `-shm` files sit beside it).
pub const META_DB: &str = "meta.db";
/// The database a restore builds, renamed to [`META_DB`] once it is complete and durable.
pub const META_DB_RESTORING: &str = "meta.db.restoring";
/// The body files of regular files, one per inode (see `chunk::BodyStore`).
pub const BODIES: &str = "bodies";
/// The lock a keel holds for as long as it uses the state dir.
pub const LOCK: &str = "lock";
/// The holder id of the lease this state dir's keel took, so that a keel restarted after a
/// crash takes its own lease back at once.
pub const LEASE_HOLDER: &str = "lease.holder";
/// Marks a restore into the state dir that has not finished: present from before the
/// restore writes anything until its database is in place.
pub const RESTORE_UNFINISHED: &str = "restore.unfinished";
/// The space reserves a full volume gives back so that a start can still open the store
/// (see `chunk::reserve`): the running keel's, and the one kept for the next start.
pub const RESERVE: &str = "reserve";
pub const RESERVE_BOOT: &str = "reserve.boot";
/// The control API's Unix socket when keel is not a root PID 1.
pub const CONTROL_SOCK: &str = "control.sock";
/// The socket an older keel's checkpoint service answered a line protocol on (the control
/// API is the only protocol now): a killed one may have left it in a state dir.
pub const OLD_PERSIST_SOCK: &str = "persist.sock";
/// The default `file://` remote (`persist.remote = ""`).
pub const REMOTE: &str = "remote";
/// The `dir` provider's tree, and where a new one is built before it is swapped in.
pub const TREE: &str = "workspace";
pub const TREE_NEW: &str = "workspace.new";
/// The output files of `POST /exec`'s processes.
pub const EXEC: &str = "exec";
/// What a volume may bring with it before keel writes anything.
pub const LOST_FOUND: &str = "lost+found";
pub const KEEP: &str = ".keep";

/// The suffixes of the scratch files a checkpoint builds beside the store
/// (`Store::scratch_path`): the metadata image, and a full snapshot's spill files.
pub const SCRATCH_IMAGE: &str = "image";
pub const SCRATCH_INODES: &str = "snapshot-inodes";
pub const SCRATCH_DIRENTS: &str = "snapshot-dirents";
pub const SCRATCH_UNLINKED: &str = "snapshot-unlinked";

/// Every scratch file name a checkpoint may leave after a crash: the metadata image under
/// construction (a SQLite file, with its journal), and the spill files of a full snapshot,
/// which builds since `Spill` unlinks at once no longer leave (their names are here for
/// state dirs an older keel crashed in).
pub const SCRATCH: &[&str] = &[
    "meta.db.image",
    "meta.db.image-journal",
    "meta.db.image-wal",
    "meta.db.image-shm",
    "meta.db.snapshot-inodes",
    "meta.db.snapshot-dirents",
    "meta.db.snapshot-unlinked",
];

/// What a state dir keel has not initialised yet may hold: what a volume brings, and what a
/// start makes before the store (the lock, the lease holder, the reserves, the control
/// socket), the bodies a restore is writing, the `dir` provider's tree.
const FRESH: &[&str] = &[
    LOST_FOUND,
    KEEP,
    LOCK,
    RESERVE,
    RESERVE_BOOT,
    CONTROL_SOCK,
    LEASE_HOLDER,
    BODIES,
    TREE,
];

/// What a state dir may hold for a restore into it: nothing of a workspace.
pub const RESTORE_MAY_HOLD: &[&str] = &[LOCK, LOST_FOUND, KEEP, LEASE_HOLDER, RESTORE_UNFINISHED];

/// What a start that was stopped after it locked the state dir and before its restore began
/// leaves (with what a volume brings).
pub const STARTED_ONLY: &[&str] = &[
    LOCK,
    LEASE_HOLDER,
    OLD_PERSIST_SOCK,
    CONTROL_SOCK,
    LOST_FOUND,
    KEEP,
];

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot create: {0}")]
    Create(#[source] io::Error),
    #[error("cannot read: {0}")]
    Read(#[source] io::Error),
    #[error("not a keel state dir (it holds `{0}` but no meta.db); refusing to touch it")]
    Foreign(String),
}

/// The store's path in `state_dir`.
pub fn meta_db(state_dir: &Path) -> PathBuf {
    state_dir.join(META_DB)
}

/// Whether `state_dir` holds a workspace (its store is there).
pub fn has_workspace(state_dir: &Path) -> bool {
    meta_db(state_dir).exists()
}

/// Whether a restore into `state_dir` was interrupted before its database was in place.
pub fn restore_unfinished(state_dir: &Path) -> bool {
    !has_workspace(state_dir) && state_dir.join(RESTORE_UNFINISHED).exists()
}

/// Opens (creating when absent) the store of `state_dir`.
pub fn open_store(state_dir: &Path, now: Nanos) -> Result<Store, MetaError> {
    Store::open(&meta_db(state_dir), now)
}

/// Opens (creating when absent) the bodies of `state_dir`.
pub fn open_bodies(state_dir: &Path) -> Result<BodyStore, BodyError> {
    BodyStore::open(&state_dir.join(BODIES))
}

/// Takes the state dir's lock (creating the lock file): `Ok(None)` when another process
/// holds it.
pub fn try_lock(state_dir: &Path) -> io::Result<Option<LockFile>> {
    crate::sys::file::try_lock(&state_dir.join(LOCK))
}

/// Whether a keel holds the state dir's lock now (the lock file is not created to find out).
/// A lock file that cannot be opened counts as held: nobody may take it.
pub fn locked(state_dir: &Path) -> bool {
    state_dir.join(LOCK).exists() && !matches!(try_lock(state_dir), Ok(Some(_)))
}

/// Whether `dir` is keel's: it holds a store or an unfinished restore (which the start's
/// restore removes and starts over), or nothing but what a state dir holds before keel
/// initialises it ([`FRESH`]; an empty or absent directory is fresh). Keel refuses to mount
/// a directory that is not, and never changes the modes of anything in it.
pub fn check_keels(dir: &Path) -> Result<(), StateError> {
    if has_workspace(dir) || dir.join(RESTORE_UNFINISHED).exists() {
        return Ok(());
    }
    let entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        r => r.map_err(StateError::Read)?,
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !FRESH.contains(&name.as_ref()) {
            return Err(StateError::Foreign(name.into_owned()));
        }
    }
    Ok(())
}

/// Creates `dir` (0700) when absent and checks that it is keel's ([`check_keels`]).
pub fn create_checked(dir: &Path) -> Result<(), StateError> {
    private::create_dir_all(dir).map_err(StateError::Create)?;
    check_keels(dir)
}

/// Creates the state dir (0700) if needed and tightens it if it is keel's and loose (see
/// [`private::secure_dir`]); one that is not keel's is left alone (the mount refuses it).
pub fn secure(dir: &Path) -> io::Result<()> {
    private::create_dir_all(dir)?;
    match check_keels(dir) {
        Ok(()) => private::secure_dir(dir, "state dir").map(|_| ()),
        Err(StateError::Foreign(_)) => Ok(()),
        Err(StateError::Read(e) | StateError::Create(e)) => Err(e),
    }
}

/// Removes what a checkpoint interrupted by a crash left beside the store ([`SCRATCH`]);
/// the state dir must be locked (no checkpoint of this state dir runs). Returns how many
/// files and bytes went.
pub fn remove_scratch(state_dir: &Path) -> (u64, u64) {
    let (mut files, mut bytes) = (0, 0);
    for name in SCRATCH {
        let p = state_dir.join(name);
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        match std::fs::remove_file(&p) {
            Ok(()) => {
                files += 1;
                bytes += m.len();
            }
            Err(e) => {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove a checkpoint's leftover scratch file")
            }
        }
    }
    if files > 0 {
        tracing::info!(
            files,
            bytes,
            "removed what an interrupted checkpoint left beside the state database"
        );
    }
    (files, bytes)
}

#[cfg(test)]
mod tests;

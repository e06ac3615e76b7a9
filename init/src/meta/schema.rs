//! The database schema, its version stamp, and the connection settings.

use rusqlite::{Connection, OptionalExtension};

use super::{MetaError, Nanos, Result};

const MAGIC: &str = "keel-workspace";
const VERSION: i64 = 1;

pub(super) fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    conn.execute_batch(
        "PRAGMA journal_mode=WAL;
         PRAGMA synchronous=NORMAL;
         PRAGMA wal_autocheckpoint=4000;
         PRAGMA foreign_keys=OFF;
         PRAGMA temp_store=MEMORY;
         PRAGMA mmap_size=0;",
    )?;
    conn.execute_batch(&format!(
        "PRAGMA cache_size=-{}",
        super::cache_ceiling_kib()
    ))?;
    // Reading one row forces SQLite to look at the file header.
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
    Ok(())
}

pub(super) fn create(conn: &Connection, now: Nanos) -> Result<()> {
    conn.execute_batch(
        "BEGIN;
         CREATE TABLE meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
         CREATE TABLE inode (
            ino INTEGER PRIMARY KEY AUTOINCREMENT,
            mode INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
            nlink INTEGER NOT NULL, size INTEGER NOT NULL,
            atime INTEGER NOT NULL, mtime INTEGER NOT NULL, ctime INTEGER NOT NULL,
            rdev INTEGER NOT NULL, parent INTEGER NOT NULL, storage INTEGER NOT NULL);
         CREATE INDEX inode_orphans ON inode(nlink) WHERE nlink = 0;
         CREATE TABLE dirent (
            parent INTEGER NOT NULL, name BLOB NOT NULL, ino INTEGER NOT NULL, kind INTEGER NOT NULL,
            PRIMARY KEY (parent, name)) WITHOUT ROWID;
         CREATE TABLE xattr (
            ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
            PRIMARY KEY (ino, name)) WITHOUT ROWID;
         CREATE TABLE inline_data (ino INTEGER PRIMARY KEY, data BLOB NOT NULL);
         CREATE TABLE symlink (ino INTEGER PRIMARY KEY, target BLOB NOT NULL);
         -- Change tracking for checkpoints: inodes whose metadata, entries or xattrs changed,
         -- and chunk windows of file bodies written, since the last checkpoint.
         CREATE TABLE changed (ino INTEGER PRIMARY KEY);
         CREATE TABLE dirty_window (ino INTEGER NOT NULL, idx INTEGER NOT NULL,
            PRIMARY KEY (ino, idx)) WITHOUT ROWID;
         -- Checkpoints (persist/). Directory entries added, removed or repointed since the
         -- last checkpoint, recorded by triggers so every writer is covered.
         CREATE TABLE changed_dirent (parent INTEGER NOT NULL, name BLOB NOT NULL,
            PRIMARY KEY (parent, name)) WITHOUT ROWID;
         CREATE TRIGGER dirent_ins AFTER INSERT ON dirent BEGIN
            INSERT OR IGNORE INTO changed_dirent VALUES (NEW.parent, NEW.name); END;
         CREATE TRIGGER dirent_upd AFTER UPDATE ON dirent BEGIN
            INSERT OR IGNORE INTO changed_dirent VALUES (OLD.parent, OLD.name);
            INSERT OR IGNORE INTO changed_dirent VALUES (NEW.parent, NEW.name); END;
         CREATE TRIGGER dirent_del AFTER DELETE ON dirent BEGIN
            INSERT OR IGNORE INTO changed_dirent VALUES (OLD.parent, OLD.name); END;
         -- The change set a checkpoint has claimed but not yet committed: it survives a
         -- failed or interrupted checkpoint, and the next one takes it first.
         CREATE TABLE pending_inode (ino INTEGER PRIMARY KEY);
         CREATE TABLE pending_window (ino INTEGER NOT NULL, idx INTEGER NOT NULL,
            PRIMARY KEY (ino, idx)) WITHOUT ROWID;
         CREATE TABLE pending_dirent (parent INTEGER NOT NULL, name BLOB NOT NULL,
            PRIMARY KEY (parent, name)) WITHOUT ROWID;
         -- Chunk map of every body file as of the last checkpoint: window idx -> blake3 id
         -- (NULL: the window is all zeros). A missing row means: not hashed yet.
         CREATE TABLE file_chunk (ino INTEGER NOT NULL, idx INTEGER NOT NULL, id BLOB,
            PRIMARY KEY (ino, idx)) WITHOUT ROWID;
         CREATE INDEX file_chunk_id ON file_chunk(id) WHERE id IS NOT NULL;
         CREATE TRIGGER inode_del_chunks AFTER DELETE ON inode BEGIN
            DELETE FROM file_chunk WHERE ino = OLD.ino; END;
         -- Checkpoint bookkeeping (last snapshot, compaction counters, remote, ...).
         CREATE TABLE persist_state (key TEXT PRIMARY KEY, value) WITHOUT ROWID;",
    )?;
    conn.execute(
        "INSERT INTO meta (key, value) VALUES ('magic', ?1), ('version', ?2), ('syncs', 0)",
        rusqlite::params![MAGIC, VERSION],
    )?;
    conn.execute(
        "INSERT INTO inode (ino, mode, uid, gid, nlink, size, atime, mtime, ctime, rdev, parent, storage)
         VALUES (1, ?1, 0, 0, 2, 0, ?2, ?2, ?2, 0, 1, 0)",
        rusqlite::params![libc::S_IFDIR | 0o755, now.0],
    )?;
    conn.execute_batch("COMMIT")?;
    Ok(())
}

/// Running totals of the inode table, kept by triggers so that nothing needs to scan it:
/// `rows` (every inode, for statfs), `live` (inodes with a link, what a snapshot holds) and
/// `bytes` (the sizes of the live regular files). Created on open, so state dirs from
/// before it gain it, filled by one scan in the same transaction.
pub(super) fn ensure_totals(conn: &Connection) -> rusqlite::Result<()> {
    let present: Option<i64> = conn
        .query_row(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='inode_totals'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    if present.is_some() {
        return Ok(());
    }
    // A live inode counts 1; a live regular file (S_IFREG, 0o100000) counts its size.
    const LIVE: &str = "(R.nlink > 0)";
    const BYTES: &str =
        "(CASE WHEN R.nlink > 0 AND (R.mode & 61440) = 32768 THEN R.size ELSE 0 END)";
    let of = |e: &str, r: &str| e.replace("R.", &format!("{r}."));
    let sql = format!(
        "BEGIN IMMEDIATE;
         CREATE TABLE IF NOT EXISTS inode_totals (id INTEGER PRIMARY KEY CHECK (id = 0),
            rows INTEGER NOT NULL, live INTEGER NOT NULL, bytes INTEGER NOT NULL);
         INSERT OR IGNORE INTO inode_totals
            SELECT 0, count(*), coalesce(sum({live}), 0), coalesce(sum({bytes}), 0) FROM inode AS R;
         CREATE TRIGGER IF NOT EXISTS inode_totals_ins AFTER INSERT ON inode BEGIN
            UPDATE inode_totals SET rows = rows + 1, live = live + {nlive},
                bytes = bytes + {nbytes}; END;
         CREATE TRIGGER IF NOT EXISTS inode_totals_del AFTER DELETE ON inode BEGIN
            UPDATE inode_totals SET rows = rows - 1, live = live - {olive},
                bytes = bytes - {obytes}; END;
         CREATE TRIGGER IF NOT EXISTS inode_totals_upd AFTER UPDATE OF nlink, size, mode ON inode
            WHEN OLD.nlink != NEW.nlink OR OLD.size != NEW.size OR OLD.mode != NEW.mode BEGIN
            UPDATE inode_totals SET live = live + {nlive} - {olive},
                bytes = bytes + {nbytes} - {obytes}; END;
         COMMIT;",
        live = LIVE,
        bytes = BYTES,
        nlive = of(LIVE, "NEW"),
        nbytes = of(BYTES, "NEW"),
        olive = of(LIVE, "OLD"),
        obytes = of(BYTES, "OLD"),
    );
    conn.execute_batch(&sql).inspect_err(|_| {
        let _ = conn.execute_batch("ROLLBACK");
    })
}

pub(super) fn check(conn: &Connection, path: &str) -> Result<()> {
    let foreign = |reason: String| MetaError::Foreign {
        path: path.to_string(),
        reason,
    };
    let has_meta: Option<String> = conn
        .query_row(
            "SELECT name FROM sqlite_master WHERE type='table' AND name='meta'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    if has_meta.is_none() {
        return Err(foreign("it has no keel `meta` table".into()));
    }
    let magic: Option<String> = conn
        .query_row("SELECT value FROM meta WHERE key='magic'", [], |r| r.get(0))
        .optional()?;
    if magic.as_deref() != Some(MAGIC) {
        return Err(foreign(format!("magic is {magic:?}, expected {MAGIC:?}")));
    }
    let version: i64 = conn.query_row("SELECT value FROM meta WHERE key='version'", [], |r| {
        r.get(0)
    })?;
    if version != VERSION {
        return Err(foreign(format!(
            "schema version {version} is not supported (this keel reads version {VERSION})"
        )));
    }
    Ok(())
}

//! The `dir` provider's record of the tree as its last walk saw it (`dir_host`): for each
//! inode of the store, the host inode that holds it in the plain directory and the host's
//! size, mtime and ctime then. A walk compares each entry's `lstat` with this row: equal,
//! and the entry is unchanged since that walk. Created on first use; a FUSE workspace never
//! has rows here. Rows go with their inode (a trigger), whoever deletes it.

use std::collections::HashMap;

use rusqlite::params;

use super::{Counted, InodeNo, Result, Store, Tx};

/// `persist_state` key: which provider last ran on this state dir (`dir`, or absent).
pub const PROVIDER_KEY: &str = "workspace_provider";
/// `persist_state` key: the `dir` tree holds what the store says (absent: it must be built
/// from the store first).
pub const TREE_KEY: &str = "dir_tree";

impl Store {
    /// Whether the `dir` provider keeps this store's file bytes (in its tree, not bodies).
    pub fn is_dir_workspace(&self) -> Result<bool> {
        Ok(self.read().persist_get(PROVIDER_KEY)?.as_deref() == Some("dir"))
    }
}

/// What the last walk saw of one inode in the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRow {
    pub host_ino: u64,
    pub size: u64,
    pub mtime: i64,
    pub ctime: i64,
}

impl Store {
    /// Creates the `dir_host` table (and its trigger) when absent.
    pub fn ensure_host_map(&self) -> Result<()> {
        self.conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS dir_host (ino INTEGER PRIMARY KEY,
                host_ino INTEGER NOT NULL, size INTEGER NOT NULL,
                mtime INTEGER NOT NULL, ctime INTEGER NOT NULL);
             CREATE TRIGGER IF NOT EXISTS dir_host_del AFTER DELETE ON inode BEGIN
                DELETE FROM dir_host WHERE ino = OLD.ino; END;",
        )?;
        Ok(())
    }
}

impl Tx<'_> {
    /// Every row of `dir_host`.
    pub fn host_rows(&self) -> Result<HashMap<InodeNo, HostRow>> {
        let mut st = self
            .conn
            .counted("SELECT ino, host_ino, size, mtime, ctime FROM dir_host")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                HostRow {
                    host_ino: r.get::<_, i64>(1)? as u64,
                    size: r.get::<_, i64>(2)? as u64,
                    mtime: r.get(3)?,
                    ctime: r.get(4)?,
                },
            ))
        })?;
        let mut out = HashMap::new();
        for r in rows {
            let (ino, row) = r?;
            out.insert(InodeNo(ino as u64), row);
        }
        Ok(out)
    }

    /// The rows of directory `dir` and of every inode it names (a narrowed walk's).
    pub fn host_rows_in(&self, dir: InodeNo) -> Result<HashMap<InodeNo, HostRow>> {
        let mut st = self.conn.counted(
            "SELECT ino, host_ino, size, mtime, ctime FROM dir_host
             WHERE ino = ?1 OR ino IN (SELECT ino FROM dirent WHERE parent = ?1)",
        )?;
        let rows = st.query_map([dir.0 as i64], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                HostRow {
                    host_ino: r.get::<_, i64>(1)? as u64,
                    size: r.get::<_, i64>(2)? as u64,
                    mtime: r.get(3)?,
                    ctime: r.get(4)?,
                },
            ))
        })?;
        let mut out = HashMap::new();
        for r in rows {
            let (ino, row) = r?;
            out.insert(InodeNo(ino as u64), row);
        }
        Ok(out)
    }

    pub fn put_host(&self, ino: InodeNo, row: &HostRow) -> Result<()> {
        self.conn
            .counted(
                "INSERT OR REPLACE INTO dir_host (ino, host_ino, size, mtime, ctime)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                ino.0 as i64,
                row.host_ino as i64,
                row.size as i64,
                row.mtime,
                row.ctime
            ])?;
        Ok(())
    }

    /// Drops a file's inline bytes (it moved to a body).
    pub fn remove_inline_data(&self, ino: InodeNo) -> Result<()> {
        self.conn
            .counted("DELETE FROM inline_data WHERE ino = ?1")?
            .execute([ino.0 as i64])?;
        Ok(())
    }

    pub fn clear_host(&self) -> Result<()> {
        self.conn.counted("DELETE FROM dir_host")?.execute([])?;
        Ok(())
    }

    /// Removes every entry of directory `dir` (no triggers skipped: each removal is a
    /// change).
    pub fn unlink_all(&self, dir: InodeNo) -> Result<()> {
        self.conn
            .counted("DELETE FROM dirent WHERE parent = ?1")?
            .execute([dir.0 as i64])?;
        Ok(())
    }
}

//! Lazy restore bookkeeping: the `missing_window` table lists the chunk windows of file
//! bodies whose bytes are not in the body yet (a lazy restore created the body sparse),
//! each with the blake3 id of the chunk that holds them. A row is removed only after the
//! fetched bytes are durable in the body, or when the window stops existing (truncate,
//! overwrite, unlink). Created on open, so state dirs from before it gain it.

use std::collections::HashMap;

use rusqlite::{params, Connection, OptionalExtension};

use super::{Counted, InodeNo, Result, Store, Tx};

/// One not-yet-fetched window: (window index, chunk id).
pub type MissingRow = (u64, [u8; 32]);

pub(super) fn ensure_schema(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS missing_window (ino INTEGER NOT NULL, idx INTEGER NOT NULL,
            id BLOB NOT NULL, PRIMARY KEY (ino, idx)) WITHOUT ROWID;
         CREATE TRIGGER IF NOT EXISTS inode_del_missing AFTER DELETE ON inode BEGIN
            DELETE FROM missing_window WHERE ino = OLD.ino; END;",
    )
}

fn rows_of(st: &mut rusqlite::CachedStatement<'_>, ino: i64) -> Result<Vec<MissingRow>> {
    let rows = st.query_map([ino], |r| {
        Ok((r.get::<_, i64>(0)? as u64, r.get::<_, Vec<u8>>(1)?))
    })?;
    let mut out = Vec::new();
    for r in rows {
        let (idx, id) = r?;
        if let Ok(id) = id.try_into() {
            out.push((idx, id));
        }
    }
    Ok(out)
}

impl Store {
    /// Is any window of any file still missing? (Cheap: the fast path of every read.)
    pub fn any_missing_windows(&self) -> Result<bool> {
        Ok(self
            .conn
            .counted("SELECT 1 FROM missing_window LIMIT 1")?
            .query_row([], |_| Ok(()))
            .optional()?
            .is_some())
    }
}

impl Tx<'_> {
    /// The missing windows of one file, in window order.
    pub fn missing_windows(&self, ino: InodeNo) -> Result<Vec<MissingRow>> {
        let mut st = self
            .conn
            .counted("SELECT idx, id FROM missing_window WHERE ino = ?1 ORDER BY idx")?;
        rows_of(&mut st, ino.0 as i64)
    }

    /// Every missing window, by file (checkpoints, fsck).
    pub fn all_missing_windows(&self) -> Result<HashMap<InodeNo, Vec<MissingRow>>> {
        let mut st = self
            .conn
            .counted("SELECT ino, idx, id FROM missing_window ORDER BY ino, idx")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)? as u64,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, Vec<u8>>(2)?,
            ))
        })?;
        let mut out: HashMap<InodeNo, Vec<MissingRow>> = HashMap::new();
        for r in rows {
            let (ino, idx, id) = r?;
            if let Ok(id) = id.try_into() {
                out.entry(InodeNo(ino)).or_default().push((idx, id));
            }
        }
        Ok(out)
    }

    /// Files that still have missing windows, in inode order (background prefetch).
    pub fn files_with_missing_windows(&self) -> Result<Vec<InodeNo>> {
        let mut st = self
            .conn
            .counted("SELECT DISTINCT ino FROM missing_window ORDER BY ino")?;
        let rows = st.query_map([], |r| r.get::<_, i64>(0))?;
        Ok(rows
            .map(|r| r.map(|i| InodeNo(i as u64)))
            .collect::<rusqlite::Result<_>>()?)
    }

    /// Number of missing windows (status, tests).
    pub fn missing_window_count(&self) -> Result<u64> {
        Ok(self
            .conn
            .counted("SELECT count(*) FROM missing_window")?
            .query_row([], |r| r.get::<_, i64>(0))? as u64)
    }

    /// Records windows of a file as not fetched yet (lazy restore).
    pub fn add_missing_windows(&self, ino: InodeNo, rows: &[MissingRow]) -> Result<()> {
        let mut st = self
            .conn
            .counted("INSERT OR REPLACE INTO missing_window (ino, idx, id) VALUES (?1, ?2, ?3)")?;
        for (idx, id) in rows {
            st.execute(params![ino.0 as i64, *idx as i64, &id[..]])?;
        }
        Ok(())
    }

    /// Records windows as present (fetched and durable, or overwritten whole).
    pub fn remove_missing_windows(
        &self,
        ino: InodeNo,
        idx: impl IntoIterator<Item = u64>,
    ) -> Result<()> {
        let mut st = self
            .conn
            .counted("DELETE FROM missing_window WHERE ino = ?1 AND idx = ?2")?;
        for i in idx {
            st.execute(params![ino.0 as i64, i as i64])?;
        }
        Ok(())
    }

    /// Forgets missing windows `from..` of a file (it got shorter).
    pub fn truncate_missing_windows(&self, ino: InodeNo, from: u64) -> Result<()> {
        self.conn
            .counted("DELETE FROM missing_window WHERE ino = ?1 AND idx >= ?2")?
            .execute(params![ino.0 as i64, from as i64])?;
        Ok(())
    }
}

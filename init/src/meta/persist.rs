//! Queries for checkpoints (used by `persist/`): claiming the change set, consistent read
//! views, per-file chunk maps, bulk reads for full snapshots, restore inserts and
//! checkpoint bookkeeping. Chunk ids are plain 32-byte arrays here; `chunk::ChunkId` wraps
//! them outside this module.

use std::collections::HashMap;

use rusqlite::{params, params_from_iter, OptionalExtension};

use super::{
    finish_inode, inode_cols, inode_params, inode_row, row_to_inode, Counted, Inode, InodeNo,
    Result, Store, Tx,
};

/// The `persist_state` key of a rollback's pending body renames (see `Tx::rollback_renames`).
pub const ROLLBACK_RENAMES: &str = "rollback_renames";
/// The state dir's directory where a rollback builds bodies before renaming them into place.
pub const ROLLBACK_TMP: &str = "rollback.tmp";

/// One window of a file's chunk map: `None` is an all-zero window (a hole).
pub type ChunkRow = (u64, Option<[u8; 32]>);

/// An inode's xattrs as (name, value) pairs.
pub type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// Sizes of the change tracking tables.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChangeCounts {
    pub inodes: u64,
    pub windows: u64,
    pub dirents: u64,
}

impl ChangeCounts {
    pub fn is_empty(&self) -> bool {
        self.inodes == 0 && self.windows == 0 && self.dirents == 0
    }
}

/// The (ino, window) rows of a query selecting those two columns, in its order.
pub(super) fn window_rows(st: &mut rusqlite::CachedStatement<'_>) -> Result<Vec<(InodeNo, u64)>> {
    let rows = st.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
    let mut out = Vec::new();
    for r in rows {
        let (i, x) = r?;
        out.push((InodeNo(i as u64), x as u64));
    }
    Ok(out)
}

fn blob32(v: Option<Vec<u8>>) -> Option<[u8; 32]> {
    v.and_then(|b| b.try_into().ok())
}

impl Store {
    /// Starts a read transaction: every query on it sees one consistent state of the
    /// database, while other connections keep writing (WAL).
    pub fn read_view(&self) -> Result<Tx<'_>> {
        self.commit_group()?;
        self.conn.execute_batch("BEGIN DEFERRED")?;
        // The snapshot is taken at the first read.
        self.conn
            .query_row("SELECT count(*) FROM meta", [], |_| Ok(()))?;
        Ok(Tx {
            conn: &self.conn,
            open: true,
            group: None,
            dirs: &self.dirs,
            changes: std::cell::RefCell::default(),
            marked: std::cell::RefCell::default(),
        })
    }
}

impl Tx<'_> {
    fn count(&self, sql: &str) -> Result<u64> {
        Ok(self
            .conn
            .counted(sql)?
            .query_row([], |r| r.get::<_, i64>(0))? as u64)
    }

    /// Changes recorded since the last claim (not yet claimed by a checkpoint).
    pub fn unclaimed_changes(&self) -> Result<ChangeCounts> {
        Ok(ChangeCounts {
            inodes: self.count("SELECT count(*) FROM changed")?,
            windows: self.count("SELECT count(*) FROM dirty_window")?,
            dirents: self.count("SELECT count(*) FROM changed_dirent")?,
        })
    }

    /// Changes claimed by a checkpoint that has not committed (failed or interrupted).
    pub fn pending_changes(&self) -> Result<ChangeCounts> {
        Ok(ChangeCounts {
            inodes: self.count("SELECT count(*) FROM pending_inode")?,
            windows: self.count("SELECT count(*) FROM pending_window")?,
            dirents: self.count("SELECT count(*) FROM pending_dirent")?,
        })
    }

    /// Moves every recorded change into the pending set of the checkpoint about to run.
    pub fn claim_changes(&self) -> Result<()> {
        self.conn.execute_batch(
            "INSERT OR IGNORE INTO pending_inode SELECT ino FROM changed;
             DELETE FROM changed;
             INSERT OR IGNORE INTO pending_window SELECT ino, idx FROM dirty_window;
             DELETE FROM dirty_window;
             INSERT OR IGNORE INTO pending_dirent SELECT parent, name FROM changed_dirent;
             DELETE FROM changed_dirent;",
        )?;
        Ok(())
    }

    /// Forgets the pending set (the checkpoint that claimed it has committed).
    pub fn clear_pending(&self) -> Result<()> {
        self.conn.execute_batch(
            "DELETE FROM pending_inode; DELETE FROM pending_window; DELETE FROM pending_dirent;",
        )?;
        Ok(())
    }

    /// Forgets every recorded change (after a restore wrote the tree).
    pub fn clear_all_changes(&self) -> Result<()> {
        self.clear_pending()?;
        self.conn.execute_batch(
            "DELETE FROM changed; DELETE FROM dirty_window; DELETE FROM changed_dirent;",
        )?;
        Ok(())
    }

    // What a checkpoint's snapshot takes: the claimed set and whatever was recorded since
    // the claim, as one read view sees them. The claim is its own transaction and the
    // filesystem keeps writing until the view is taken, so the claimed set alone is not
    // closed: a claimed entry may name an inode created after the claim, a claimed
    // directory may count a subdirectory whose entry came after it. Changes recorded since
    // the claim stay recorded and go into the next snapshot again (re-stating an inode or an
    // entry as it is then is harmless).

    /// Inodes changed (claimed or since), in inode order.
    pub fn snapshot_inodes(&self) -> Result<Vec<InodeNo>> {
        let mut st = self
            .conn
            .counted("SELECT ino FROM pending_inode UNION SELECT ino FROM changed ORDER BY 1")?;
        let rows = st.query_map([], |r| r.get::<_, i64>(0))?;
        Ok(rows
            .map(|r| r.map(|i| InodeNo(i as u64)))
            .collect::<rusqlite::Result<_>>()?)
    }

    /// Dirty windows (claimed or since), in (ino, window) order.
    pub fn snapshot_windows(&self) -> Result<Vec<(InodeNo, u64)>> {
        let mut st = self.conn.counted(
            "SELECT ino, idx FROM pending_window UNION SELECT ino, idx FROM dirty_window
             ORDER BY 1, 2",
        )?;
        window_rows(&mut st)
    }

    /// Changed entries (claimed or since), in (parent, name) order.
    pub fn snapshot_dirents(&self) -> Result<Vec<(InodeNo, Vec<u8>)>> {
        let mut st = self.conn.counted(
            "SELECT parent, name FROM pending_dirent UNION SELECT parent, name FROM changed_dirent
             ORDER BY 1, 2",
        )?;
        let rows = st.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))?;
        let mut out = Vec::new();
        for r in rows {
            let (p, n) = r?;
            out.push((InodeNo(p as u64), n));
        }
        Ok(out)
    }

    /// Every changed or dirty window, claimed or not: (ino, idx), for backlog reports.
    pub fn backlog_windows(&self) -> Result<Vec<(InodeNo, u64)>> {
        let mut st = self.conn.counted(
            "SELECT ino, idx FROM pending_window UNION SELECT ino, idx FROM dirty_window",
        )?;
        window_rows(&mut st)
    }

    /// Every inode changed since the last checkpoint, claimed or not.
    pub fn backlog_inodes(&self) -> Result<Vec<InodeNo>> {
        let mut st = self
            .conn
            .counted("SELECT ino FROM pending_inode UNION SELECT ino FROM changed")?;
        let rows = st.query_map([], |r| r.get::<_, i64>(0))?;
        Ok(rows
            .map(|r| r.map(|i| InodeNo(i as u64)))
            .collect::<rusqlite::Result<_>>()?)
    }

    /// Entries changed since the last checkpoint, claimed by one or not.
    pub fn backlog_dirents(&self) -> Result<Vec<(InodeNo, Vec<u8>)>> {
        let mut st = self.conn.counted(
            "SELECT parent, name FROM pending_dirent UNION SELECT parent, name FROM changed_dirent",
        )?;
        let rows = st.query_map([], |r| {
            Ok((InodeNo(r.get::<_, i64>(0)? as u64), r.get::<_, Vec<u8>>(1)?))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Marks windows `0..count` of a file dirty and the inode changed (a body that may have
    /// been written without the writes being recorded, e.g. before a crash).
    pub fn mark_whole_file_dirty(&self, ino: InodeNo, count: u64) -> Result<()> {
        self.mark_dirty_windows(ino, 0..count)?;
        self.mark_changed(ino)
    }

    /// The windows of one file written since the last checkpoint: recorded, or claimed by
    /// a checkpoint not committed yet.
    pub fn unsettled_windows(&self, ino: InodeNo) -> Result<Vec<u64>> {
        let mut st = self.conn.counted(
            "SELECT idx FROM dirty_window WHERE ino = ?1
             UNION SELECT idx FROM pending_window WHERE ino = ?1",
        )?;
        let rows = st.query_map([ino.0 as i64], |r| Ok(r.get::<_, i64>(0)? as u64))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The chunk map of a file as of the last checkpoint, in window order.
    pub fn file_chunks(&self, ino: InodeNo) -> Result<Vec<ChunkRow>> {
        let mut st = self
            .conn
            .counted("SELECT idx, id FROM file_chunk WHERE ino = ?1 ORDER BY idx")?;
        let rows = st.query_map([ino.0 as i64], |r| {
            Ok((
                r.get::<_, i64>(0)? as u64,
                blob32(r.get::<_, Option<Vec<u8>>>(1)?),
            ))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Every file's chunk map (for full snapshots, fsck and gc).
    pub fn all_file_chunks(&self) -> Result<HashMap<InodeNo, Vec<ChunkRow>>> {
        let mut st = self
            .conn
            .counted("SELECT ino, idx, id FROM file_chunk ORDER BY ino, idx")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)? as u64,
                r.get::<_, i64>(1)? as u64,
                blob32(r.get::<_, Option<Vec<u8>>>(2)?),
            ))
        })?;
        let mut out: HashMap<InodeNo, Vec<ChunkRow>> = HashMap::new();
        for r in rows {
            let (ino, idx, id) = r?;
            out.entry(InodeNo(ino)).or_default().push((idx, id));
        }
        Ok(out)
    }

    /// Sets windows of a file's chunk map.
    pub fn set_file_chunks(&self, ino: InodeNo, rows: &[ChunkRow]) -> Result<()> {
        let mut st = self
            .conn
            .counted("INSERT OR REPLACE INTO file_chunk (ino, idx, id) VALUES (?1, ?2, ?3)")?;
        for (idx, id) in rows {
            st.execute(params![
                ino.0 as i64,
                *idx as i64,
                id.as_ref().map(|b| &b[..])
            ])?;
        }
        Ok(())
    }

    /// Drops windows `count..` of a file's chunk map (the file got shorter).
    pub fn truncate_file_chunks(&self, ino: InodeNo, count: u64) -> Result<()> {
        self.conn
            .counted("DELETE FROM file_chunk WHERE ino = ?1 AND idx >= ?2")?
            .execute(params![ino.0 as i64, count as i64])?;
        Ok(())
    }

    /// The inodes that have a chunk map.
    pub fn inodes_with_chunks(&self) -> Result<Vec<InodeNo>> {
        let mut st = self
            .conn
            .counted("SELECT DISTINCT ino FROM file_chunk ORDER BY ino")?;
        let rows = st.query_map([], |r| Ok(InodeNo(r.get::<_, i64>(0)? as u64)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Drops the chunk maps of files that are inline now: a snapshot recorded them, or will,
    /// without a map (a map kept from before would let a later delta patch only part of
    /// one). Safe whatever the last snapshot holds: a file without a map gets a whole one.
    pub fn drop_inline_chunk_maps(&self) -> Result<usize> {
        Ok(self
            .conn
            .counted(
                "DELETE FROM file_chunk WHERE ino IN (SELECT DISTINCT c.ino FROM file_chunk c
                 JOIN inode i ON i.ino = c.ino WHERE i.storage = 0)",
            )?
            .execute([])?)
    }

    /// Drops every chunk map (the chunk size changed: everything is re-hashed).
    pub fn clear_file_chunks(&self) -> Result<()> {
        self.conn.execute_batch("DELETE FROM file_chunk")?;
        Ok(())
    }

    /// Is a chunk referenced by the chunk map of a file that is still linked, so that the
    /// last snapshot names it and the remote keeps it? (An unlinked file still open keeps
    /// its map, but the last snapshot need not name it any more.)
    pub fn has_chunk(&self, id: &[u8; 32]) -> Result<bool> {
        Ok(self
            .conn
            .counted(
                "SELECT 1 FROM file_chunk c JOIN inode i ON i.ino = c.ino
                 WHERE c.id = ?1 AND i.nlink > 0 LIMIT 1",
            )?
            .query_row([&id[..]], |_| Ok(()))
            .optional()?
            .is_some())
    }

    /// Every xattr of every inode, grouped by inode (for full snapshots).
    pub fn all_xattrs(&self) -> Result<HashMap<InodeNo, Xattrs>> {
        let mut st = self
            .conn
            .counted("SELECT ino, name, value FROM xattr ORDER BY ino, name")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, Vec<u8>>(2)?,
            ))
        })?;
        let mut out: HashMap<InodeNo, Xattrs> = HashMap::new();
        for r in rows {
            let (i, n, v) = r?;
            out.entry(InodeNo(i as u64)).or_default().push((n, v));
        }
        Ok(out)
    }

    /// Every xattr of one inode, in name order.
    pub fn xattrs_of(&self, ino: InodeNo) -> Result<Xattrs> {
        let mut st = self
            .conn
            .counted("SELECT name, value FROM xattr WHERE ino = ?1 ORDER BY name")?;
        let rows = st.query_map([ino.0 as i64], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Every inline file's bytes (for full snapshots).
    pub fn all_inline_data(&self) -> Result<HashMap<InodeNo, Vec<u8>>> {
        let mut st = self.conn.counted("SELECT ino, data FROM inline_data")?;
        let rows = st.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))?;
        let mut out = HashMap::new();
        for r in rows {
            let (i, d) = r?;
            out.insert(InodeNo(i as u64), d);
        }
        Ok(out)
    }

    /// Every symlink target (for full snapshots).
    pub fn all_symlinks(&self) -> Result<HashMap<InodeNo, Vec<u8>>> {
        let mut st = self.conn.counted("SELECT ino, target FROM symlink")?;
        let rows = st.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))?;
        let mut out = HashMap::new();
        for r in rows {
            let (i, d) = r?;
            out.insert(InodeNo(i as u64), d);
        }
        Ok(out)
    }

    /// Inserts or replaces an inode under its own number, without recording a change
    /// (restore writes a tree that is already on the remote).
    pub fn put_inode_exact(&self, inode: &Inode) -> Result<()> {
        self.conn
            .counted(concat!(
                "INSERT INTO inode (",
                inode_cols!(),
                ") VALUES (",
                inode_params!(),
                // An upsert, not OR REPLACE: the replacing delete would not fire the
                // triggers that keep `inode_totals`.
                ") ON CONFLICT(ino) DO UPDATE SET mode=excluded.mode, uid=excluded.uid,
                 gid=excluded.gid, nlink=excluded.nlink, size=excluded.size,
                 atime=excluded.atime, mtime=excluded.mtime, ctime=excluded.ctime,
                 rdev=excluded.rdev, parent=excluded.parent, storage=excluded.storage"
            ))?
            .execute(params_from_iter(inode_row(Some(inode.ino), inode)))?;
        self.wrote(inode.ino, Some(inode));
        Ok(())
    }

    /// Every inode, streamed in inode order (for snapshots of large trees).
    pub fn for_each_inode(&self, mut f: impl FnMut(Inode) -> Result<()>) -> Result<()> {
        let mut st = self.conn.counted(concat!(
            "SELECT ",
            inode_cols!(),
            " FROM inode ORDER BY ino"
        ))?;
        let mut rows = st.query([])?;
        while let Some(r) = rows.next()? {
            f(finish_inode(row_to_inode(r)?)?)?;
        }
        Ok(())
    }

    /// The body renames of a rollback whose transaction committed but which was stopped
    /// before it renamed them all (`ROLLBACK_RENAMES`): pairs of (inode the body goes to,
    /// name of the built body under `ROLLBACK_TMP`). `Err(text)`: the record is unreadable.
    pub fn rollback_renames(&self) -> Result<std::result::Result<Vec<(u64, u64)>, String>> {
        Ok(match self.persist_get(ROLLBACK_RENAMES)? {
            None => Ok(Vec::new()),
            Some(v) => serde_json::from_str(&v)
                .map_err(|e| format!("state dir: {ROLLBACK_RENAMES} is not a list of pairs: {e}")),
        })
    }

    pub fn persist_get(&self, key: &str) -> Result<Option<String>> {
        Ok(self
            .conn
            .counted("SELECT value FROM persist_state WHERE key = ?1")?
            .query_row([key], |r| r.get::<_, String>(0))
            .optional()?)
    }

    pub fn persist_set(&self, key: &str, value: &str) -> Result<()> {
        self.conn
            .counted("INSERT OR REPLACE INTO persist_state (key, value) VALUES (?1, ?2)")?
            .execute(params![key, value])?;
        Ok(())
    }

    pub fn persist_remove(&self, key: &str) -> Result<()> {
        self.conn
            .counted("DELETE FROM persist_state WHERE key = ?1")?
            .execute([key])?;
        Ok(())
    }

    /// (rows, live inodes, bytes of live regular files) counted from the inode table itself,
    /// and as the running totals say (fsck compares them).
    pub fn inode_totals_both(&self) -> Result<([u64; 3], [u64; 3])> {
        let q = |sql: &str| -> Result<[u64; 3]> {
            Ok(self.conn.counted(sql)?.query_row([], |r| {
                Ok([
                    r.get::<_, i64>(0)?.max(0) as u64,
                    r.get::<_, i64>(1)?.max(0) as u64,
                    r.get::<_, i64>(2)?.max(0) as u64,
                ])
            })?)
        };
        Ok((
            q("SELECT count(*), coalesce(sum(nlink > 0), 0),
                coalesce(sum(CASE WHEN nlink > 0 AND (mode & 61440) = 32768 THEN size ELSE 0 END), 0)
               FROM inode")?,
            q("SELECT rows, live, bytes FROM inode_totals")?,
        ))
    }

    /// Sets the running totals to what the inode table holds (fsck repair).
    pub fn recount_inode_totals(&self) -> Result<()> {
        let (counted, _) = self.inode_totals_both()?;
        self.conn
            .counted("UPDATE inode_totals SET rows = ?1, live = ?2, bytes = ?3")?
            .execute(params![
                counted[0] as i64,
                counted[1] as i64,
                counted[2] as i64
            ])?;
        Ok(())
    }

    /// Sets an inode's link count (fsck repair).
    pub fn set_nlink(&self, ino: InodeNo, nlink: u32) -> Result<()> {
        self.conn
            .counted("UPDATE inode SET nlink = ?2 WHERE ino = ?1")?
            .execute(params![ino.0 as i64, nlink])?;
        self.wrote(ino, None);
        self.mark_changed(ino)
    }
}

//! Bulk restore: writes a whole tree into a NEW database file in one pass, for a restore
//! into an empty state dir. The file is not the workspace until the caller renames it into
//! place, so it is built the fast way: no rollback journal and no syncs (a crash leaves a
//! file the caller throws away), one transaction, each statement prepared once, the
//! triggers and secondary indexes dropped while the rows go in and recreated from their own
//! SQL afterwards (an index built once from sorted rows instead of row by row; no change
//! rows for a tree that is already on the remote), and the running `inode_totals` set once
//! from what was written. The file is left in WAL mode, like every state database, with
//! nothing in its WAL; the caller makes it durable (syncfs) before renaming it.

use std::path::Path;

use rusqlite::{params, Connection, Statement};

use super::{inode_cols, inode_params, inode_row, Inode, InodeNo, Kind, MetaError, Nanos, Result};

/// Page cache of the bulk connection (KiB): rows go in key order, so this only batches
/// writes; it does not need to hold the tree.
const BULK_CACHE_KIB: u32 = 65536;

/// The rows of one tree, written through statements prepared once (see [`create_bulk`]).
pub struct BulkWriter<'c> {
    inode: Statement<'c>,
    xattr: Statement<'c>,
    inline: Statement<'c>,
    symlink: Statement<'c>,
    chunk: Statement<'c>,
    missing: Statement<'c>,
    dirent: Statement<'c>,
    persist: Statement<'c>,
    /// (rows, live inodes, bytes of live regular files), as `inode_totals` keeps them.
    totals: [i64; 3],
}

impl BulkWriter<'_> {
    /// An inode under its own number. Each number at most once.
    pub fn inode(&mut self, inode: &Inode) -> Result<()> {
        self.inode.execute(rusqlite::params_from_iter(inode_row(
            Some(inode.ino),
            inode,
        )))?;
        let live = inode.nlink > 0;
        self.totals[0] += 1;
        self.totals[1] += i64::from(live);
        if live && inode.kind == Kind::File {
            self.totals[2] += inode.size as i64;
        }
        Ok(())
    }

    pub fn xattr(&mut self, ino: InodeNo, name: &[u8], value: &[u8]) -> Result<()> {
        self.xattr.execute(params![ino.0 as i64, name, value])?;
        Ok(())
    }

    /// An inline file's bytes (nothing is written for an empty one).
    pub fn inline_data(&mut self, ino: InodeNo, data: &[u8]) -> Result<()> {
        if !data.is_empty() {
            self.inline.execute(params![ino.0 as i64, data])?;
        }
        Ok(())
    }

    pub fn symlink(&mut self, ino: InodeNo, target: &[u8]) -> Result<()> {
        self.symlink.execute(params![ino.0 as i64, target])?;
        Ok(())
    }

    /// Window `idx` of a file's chunk map (`None`: all zeros).
    pub fn chunk(&mut self, ino: InodeNo, idx: u64, id: Option<&[u8; 32]>) -> Result<()> {
        self.chunk
            .execute(params![ino.0 as i64, idx as i64, id.map(|b| &b[..])])?;
        Ok(())
    }

    /// Window `idx` of a file is not fetched yet (lazy restore).
    pub fn missing(&mut self, ino: InodeNo, idx: u64, id: &[u8; 32]) -> Result<()> {
        self.missing
            .execute(params![ino.0 as i64, idx as i64, &id[..]])?;
        Ok(())
    }

    pub fn dirent(&mut self, parent: InodeNo, name: &[u8], ino: InodeNo, kind: Kind) -> Result<()> {
        self.dirent.execute(params![
            parent.0 as i64,
            name,
            ino.0 as i64,
            kind.mode_bits()
        ])?;
        Ok(())
    }

    /// A checkpoint bookkeeping value (`Tx::persist_set`).
    pub fn persist_set(&mut self, key: &str, value: &str) -> Result<()> {
        self.persist.execute(params![key, value])?;
        Ok(())
    }
}

/// Creates the database at `path` (which must not exist) and fills it with `fill`'s rows:
/// the tree replaces the root a new database starts with, so `fill` must write inode 1.
/// On any error the half-written file is left for the caller to remove.
pub fn create_bulk<E: From<MetaError>>(
    path: &Path,
    now: Nanos,
    fill: impl FnOnce(&mut BulkWriter<'_>) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let p = path.display().to_string();
    if path.exists() {
        return Err(MetaError::Bulk {
            path: p,
            reason: "it exists (a bulk restore writes only a new database)".into(),
        }
        .into());
    }
    super::make_private(path).map_err(|source| MetaError::Private {
        path: p.clone(),
        source,
    })?;
    let conn = Connection::open(path).map_err(|source| MetaError::Open {
        path: p.clone(),
        source,
    })?;
    prepare(&conn, now)?;
    let dropped = drop_derived(&conn)?;
    conn.execute_batch("BEGIN; DELETE FROM inode;")
        .map_err(MetaError::from)?;
    let totals = {
        let mut w = writer(&conn)?;
        fill(&mut w)?;
        w.totals
    };
    finish(&conn, totals, &dropped)?;
    conn.close().map_err(|(_, e)| MetaError::from(e))?;
    Ok(())
}

/// The schema, as `Store::open` makes it, on a connection with no journal and no syncs.
fn prepare(conn: &Connection, now: Nanos) -> Result<()> {
    conn.execute_batch(&format!(
        "PRAGMA journal_mode=OFF;
         PRAGMA synchronous=OFF;
         PRAGMA foreign_keys=OFF;
         PRAGMA temp_store=MEMORY;
         PRAGMA cache_size=-{BULK_CACHE_KIB};"
    ))?;
    super::schema::create(conn, now)?;
    super::lazy::ensure_schema(conn)?;
    super::schema::ensure_totals(conn)?;
    Ok(())
}

/// Drops every trigger and secondary index; returns their SQL, indexes first.
fn drop_derived(conn: &Connection) -> Result<Vec<(String, String, String)>> {
    let mut st = conn.prepare(
        "SELECT type, name, sql FROM sqlite_master
         WHERE type IN ('index', 'trigger') AND sql IS NOT NULL ORDER BY type, name",
    )?;
    let derived: Vec<(String, String, String)> = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    for (ty, name, _) in &derived {
        let kind = if ty == "index" { "INDEX" } else { "TRIGGER" };
        conn.execute_batch(&format!("DROP {kind} \"{name}\""))?;
    }
    Ok(derived)
}

fn writer(conn: &Connection) -> Result<BulkWriter<'_>> {
    Ok(BulkWriter {
        inode: conn.prepare(concat!(
            "INSERT INTO inode (",
            inode_cols!(),
            ") VALUES (",
            inode_params!(),
            ")"
        ))?,
        xattr: conn
            .prepare("INSERT OR REPLACE INTO xattr (ino, name, value) VALUES (?1, ?2, ?3)")?,
        inline: conn.prepare("INSERT INTO inline_data (ino, data) VALUES (?1, ?2)")?,
        symlink: conn.prepare("INSERT INTO symlink (ino, target) VALUES (?1, ?2)")?,
        chunk: conn.prepare("INSERT INTO file_chunk (ino, idx, id) VALUES (?1, ?2, ?3)")?,
        missing: conn.prepare("INSERT INTO missing_window (ino, idx, id) VALUES (?1, ?2, ?3)")?,
        dirent: conn
            .prepare("INSERT INTO dirent (parent, name, ino, kind) VALUES (?1, ?2, ?3, ?4)")?,
        persist: conn
            .prepare("INSERT OR REPLACE INTO persist_state (key, value) VALUES (?1, ?2)")?,
        totals: [0; 3],
    })
}

/// Sets the totals, recreates what `drop_derived` dropped, commits and switches the file
/// to WAL mode (left empty: the connection closes right after).
fn finish(conn: &Connection, totals: [i64; 3], derived: &[(String, String, String)]) -> Result<()> {
    conn.execute(
        "UPDATE inode_totals SET rows = ?1, live = ?2, bytes = ?3",
        params![totals[0], totals[1], totals[2]],
    )?;
    for (_, _, sql) in derived {
        conn.execute_batch(sql)?;
    }
    conn.execute_batch("COMMIT")?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(MetaError::Bulk {
            path: conn.path().unwrap_or("?").to_string(),
            reason: format!("could not switch it to WAL (journal mode is {mode})"),
        });
    }
    Ok(())
}

//! Bulk restore: writes a whole tree into a NEW database file in one pass, for a restore
//! into an empty state dir. The file is not the workspace until the caller renames it into
//! place, so it is built the fast way: no rollback journal and no syncs (a crash leaves a
//! file the caller throws away), one transaction, rows inserted 64 to a statement prepared once, the
//! triggers and secondary indexes dropped while the rows go in and recreated from their own
//! SQL afterwards (an index built once from sorted rows instead of row by row; no change
//! rows for a tree that is already on the remote), and the running `inode_totals` set once
//! from what was written. The file is left in WAL mode, like every state database, with
//! nothing in its WAL; the caller makes it durable (syncfs) before renaming it.

use std::path::Path;

use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, Connection, Statement};

use super::{inode_cols, inode_row, Inode, InodeNo, Kind, MetaError, Nanos, Result};

/// Page cache of the bulk connection (KiB): rows go in key order, so this only batches
/// writes; it does not need to hold the tree.
const BULK_CACHE_KIB: u32 = 65536;

/// Rows per INSERT statement: one statement per row spent most of its time starting and
/// ending the statement (and updating `sqlite_sequence` for the inode table).
const BATCH: usize = 64;

/// Rows of one table, buffered and inserted `BATCH` at a time.
struct Batch<'c> {
    one: Statement<'c>,
    many: Statement<'c>,
    cols: usize,
    buf: Vec<Value>,
}

impl<'c> Batch<'c> {
    /// `head`: `INSERT INTO table (columns)`.
    fn new(conn: &'c Connection, head: &str, cols: usize) -> Result<Batch<'c>> {
        let row = |k: usize| {
            let ps: Vec<String> = (1..=cols).map(|i| format!("?{}", k * cols + i)).collect();
            format!("({})", ps.join(", "))
        };
        let all: Vec<String> = (0..BATCH).map(row).collect();
        Ok(Batch {
            one: conn.prepare(&format!("{head} VALUES {}", row(0)))?,
            many: conn.prepare(&format!("{head} VALUES {}", all.join(", ")))?,
            cols,
            buf: Vec::with_capacity(BATCH * cols),
        })
    }

    fn push<const N: usize>(&mut self, row: [Value; N]) -> Result<()> {
        debug_assert_eq!(N, self.cols);
        self.buf.extend(row);
        if self.buf.len() == BATCH * self.cols {
            self.many.execute(params_from_iter(self.buf.iter()))?;
            self.buf.clear();
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        for row in self.buf.chunks(self.cols) {
            self.one.execute(params_from_iter(row.iter()))?;
        }
        self.buf.clear();
        Ok(())
    }
}

fn int(v: u64) -> Value {
    Value::Integer(v as i64)
}

fn blob(v: &[u8]) -> Value {
    Value::Blob(v.to_vec())
}

/// The rows of one tree, written in batches through statements prepared once (see
/// [`create_bulk`]).
pub struct BulkWriter<'c> {
    inode: Batch<'c>,
    xattr: Batch<'c>,
    inline: Batch<'c>,
    symlink: Batch<'c>,
    chunk: Batch<'c>,
    missing: Batch<'c>,
    dirent: Batch<'c>,
    persist: Statement<'c>,
    /// (rows, live inodes, bytes of live regular files), as `inode_totals` keeps them.
    totals: [i64; 3],
}

impl BulkWriter<'_> {
    /// An inode under its own number. Each number at most once.
    pub fn inode(&mut self, inode: &Inode) -> Result<()> {
        self.inode.push(inode_row(Some(inode.ino), inode))?;
        let live = inode.nlink > 0;
        self.totals[0] += 1;
        self.totals[1] += i64::from(live);
        if live && inode.kind == Kind::File {
            self.totals[2] += inode.size as i64;
        }
        Ok(())
    }

    pub fn xattr(&mut self, ino: InodeNo, name: &[u8], value: &[u8]) -> Result<()> {
        self.xattr.push([int(ino.0), blob(name), blob(value)])
    }

    /// An inline file's bytes (nothing is written for an empty one).
    pub fn inline_data(&mut self, ino: InodeNo, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.inline.push([int(ino.0), blob(data)])
    }

    pub fn symlink(&mut self, ino: InodeNo, target: &[u8]) -> Result<()> {
        self.symlink.push([int(ino.0), blob(target)])
    }

    /// Window `idx` of a file's chunk map (`None`: all zeros).
    pub fn chunk(&mut self, ino: InodeNo, idx: u64, id: Option<&[u8; 32]>) -> Result<()> {
        let id = id.map_or(Value::Null, |b| blob(b));
        self.chunk.push([int(ino.0), int(idx), id])
    }

    /// Window `idx` of a file is not fetched yet (lazy restore).
    pub fn missing(&mut self, ino: InodeNo, idx: u64, id: &[u8; 32]) -> Result<()> {
        self.missing.push([int(ino.0), int(idx), blob(id)])
    }

    pub fn dirent(&mut self, parent: InodeNo, name: &[u8], ino: InodeNo, kind: Kind) -> Result<()> {
        self.dirent.push([
            int(parent.0),
            blob(name),
            int(ino.0),
            int(u64::from(kind.mode_bits())),
        ])
    }

    /// A checkpoint bookkeeping value (`Tx::persist_set`).
    pub fn persist_set(&mut self, key: &str, value: &str) -> Result<()> {
        self.persist.execute(params![key, value])?;
        Ok(())
    }

    /// Inserts what the batches still hold.
    fn flush(&mut self) -> Result<()> {
        for b in [
            &mut self.inode,
            &mut self.xattr,
            &mut self.inline,
            &mut self.symlink,
            &mut self.chunk,
            &mut self.missing,
            &mut self.dirent,
        ] {
            b.flush()?;
        }
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
        w.flush()?;
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
        inode: Batch::new(conn, concat!("INSERT INTO inode (", inode_cols!(), ")"), 12)?,
        xattr: Batch::new(conn, "INSERT OR REPLACE INTO xattr (ino, name, value)", 3)?,
        inline: Batch::new(conn, "INSERT INTO inline_data (ino, data)", 2)?,
        symlink: Batch::new(conn, "INSERT INTO symlink (ino, target)", 2)?,
        chunk: Batch::new(conn, "INSERT INTO file_chunk (ino, idx, id)", 3)?,
        missing: Batch::new(conn, "INSERT INTO missing_window (ino, idx, id)", 3)?,
        dirent: Batch::new(conn, "INSERT INTO dirent (parent, name, ino, kind)", 4)?,
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

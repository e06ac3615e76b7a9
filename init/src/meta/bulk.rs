//! Bulk restore: writes a whole tree into a NEW database file in one pass, for a restore
//! into an empty state dir. The file is not the workspace until the caller renames it into
//! place, so it is built the fast way: no rollback journal and no syncs (a crash leaves a
//! file the caller throws away), one transaction, rows inserted 64 to a statement prepared once, the
//! triggers and secondary indexes dropped while the rows go in and recreated from their own
//! SQL afterwards (an index built once from sorted rows instead of row by row; no change
//! rows for a tree that is already on the remote), and the running `inode_totals` set once
//! from what was written. The file is left in WAL mode, like every state database, with
//! nothing in its WAL; the caller makes it durable (syncfs) before renaming it.
//!
//! [`amend_bulk`] changes such a database before it is renamed into place (a restore from a
//! metadata image replays the delta snapshots after the image onto it): the same fast
//! connection, set-based: rows inserted through the same batches, removals as one `DELETE`
//! a table over a temporary table of keys, every trigger dropped while it runs (what they
//! do is done once for the whole set: the cleanup of an inode's rows by the removal itself,
//! the running totals from what was inserted and removed).

use std::path::Path;

use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, Connection, Statement};

use super::{inode_cols, inode_row, Counted, Inode, InodeNo, Kind, MetaError, Nanos, Result};

/// Page cache of the bulk connection (KiB): rows go in key order, so this only batches
/// writes; it does not need to hold the tree. It counts in the daemon's peak while a full
/// snapshot builds its metadata image (64 MiB made 66 of a 1M-file peak); with 16 MiB the
/// 1M-file image built in 2.7 s.
/// Page cache of a bulk writer's connection, KiB: the memory budget's `bulk_cache` share.
fn bulk_cache_kib() -> u64 {
    crate::budget::shares().bulk_cache / 1024
}

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
    pub fn flush(&mut self) -> Result<()> {
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
         PRAGMA cache_size=-{};",
        bulk_cache_kib()
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

impl super::Store {
    /// A scratch file next to this store's database (`<db>.<suffix>`), e.g. where a metadata
    /// image is built.
    pub fn scratch_path(&self, suffix: &str) -> Option<std::path::PathBuf> {
        let db = self.conn.path().filter(|p| !p.is_empty())?;
        Some(std::path::PathBuf::from(format!("{db}.{suffix}")))
    }
}

impl super::Tx<'_> {
    /// Every live inode (`nlink > 0`) in inode order, with its inline data or symlink
    /// target when it has one: one pass over the tables, for a full snapshot that streams
    /// its records instead of loading the tree.
    pub fn for_each_live_inode_with_data<E: From<MetaError>>(
        &self,
        mut f: impl FnMut(Inode, Option<Vec<u8>>) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let mut st = self
            .conn
            .counted(concat!(
                "SELECT ",
                "i.ino, i.mode, i.uid, i.gid, i.nlink, i.size, i.atime, i.mtime, i.ctime, ",
                "i.rdev, i.parent, i.storage, coalesce(d.data, s.target) ",
                "FROM inode i LEFT JOIN inline_data d ON d.ino = i.ino ",
                "LEFT JOIN symlink s ON s.ino = i.ino WHERE i.nlink > 0 ORDER BY i.ino"
            ))
            .map_err(MetaError::from)?;
        let mut rows = st.query([]).map_err(MetaError::from)?;
        while let Some(r) = rows.next().map_err(MetaError::from)? {
            let inode = super::finish_inode(super::row_to_inode(r).map_err(MetaError::from)?)?;
            let data: Option<Vec<u8>> = r.get(12).map_err(MetaError::from)?;
            f(inode, data)?;
        }
        Ok(())
    }

    /// Every directory entry as (parent, name, ino, kind), streamed in (parent, name) order.
    pub fn for_each_dirent<E: From<MetaError>>(
        &self,
        mut f: impl FnMut(InodeNo, Vec<u8>, InodeNo, Kind) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let mut st = self
            .conn
            .counted("SELECT parent, name, ino, kind FROM dirent ORDER BY parent, name")
            .map_err(MetaError::from)?;
        let mut rows = st.query([]).map_err(MetaError::from)?;
        while let Some(r) = rows.next().map_err(MetaError::from)? {
            let (p, name, ino, kind) = (|| {
                Ok::<_, rusqlite::Error>((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Vec<u8>>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, u32>(3)?,
                ))
            })()
            .map_err(MetaError::from)?;
            let kind = Kind::from_mode(kind)
                .ok_or_else(|| MetaError::Corrupt(ino as u64, "bad dirent kind".into()))?;
            f(InodeNo(p as u64), name, InodeNo(ino as u64), kind)?;
        }
        Ok(())
    }
}

impl super::Tx<'_> {
    /// The dirty windows (claimed or since, see `snapshot_windows`) of body files
    /// (`storage = 1`) as (ino, window), in that order: what a full snapshot needs of
    /// `snapshot_windows` (an inline file's windows name nothing it hashes, and after
    /// creating 1M small files there are 1M of them).
    pub fn snapshot_body_windows(&self) -> Result<Vec<(InodeNo, u64)>> {
        let mut st = self.conn.counted(
            "SELECT w.ino, w.idx FROM
               (SELECT ino, idx FROM pending_window UNION SELECT ino, idx FROM dirty_window) w
             JOIN inode i ON i.ino = w.ino WHERE i.storage = 1 ORDER BY w.ino, w.idx",
        )?;
        super::persist::window_rows(&mut st)
    }

    /// Every inode with changes not on the remote yet (claimed by a checkpoint or not), in
    /// inode order: (ino, whether its metadata or entries changed, the body windows written
    /// since, in order). Two sorted streams merged as they are read, so memory does not grow
    /// with the backlog (a first checkpoint after creating 1M files has 1M of each).
    pub fn for_each_backlog_inode<E: From<MetaError>>(
        &self,
        mut f: impl FnMut(InodeNo, bool, &[u64]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let e = MetaError::from;
        let mut ch = self
            .conn
            .counted("SELECT ino FROM pending_inode UNION SELECT ino FROM changed ORDER BY ino")
            .map_err(e)?;
        let mut win = self
            .conn
            .counted(
                "SELECT ino, idx FROM pending_window UNION SELECT ino, idx FROM dirty_window
                 ORDER BY ino, idx",
            )
            .map_err(e)?;
        let mut ch = ch.query([]).map_err(e)?;
        let mut win = win.query([]).map_err(e)?;
        let next_ch = |r: &mut rusqlite::Rows<'_>| -> Result<Option<u64>> {
            Ok(match r.next()? {
                Some(row) => Some(row.get::<_, i64>(0)? as u64),
                None => None,
            })
        };
        let next_win = |r: &mut rusqlite::Rows<'_>| -> Result<Option<(u64, u64)>> {
            Ok(match r.next()? {
                Some(row) => Some((row.get::<_, i64>(0)? as u64, row.get::<_, i64>(1)? as u64)),
                None => None,
            })
        };
        let mut c = next_ch(&mut ch)?;
        let mut w = next_win(&mut win)?;
        let mut idxs = Vec::new();
        loop {
            let ino = match (c, w) {
                (None, None) => return Ok(()),
                (Some(a), None) => a,
                (None, Some((b, _))) => b,
                (Some(a), Some((b, _))) => a.min(b),
            };
            let changed = c == Some(ino);
            if changed {
                c = next_ch(&mut ch)?;
            }
            idxs.clear();
            while let Some((i, x)) = w.filter(|(i, _)| *i == ino) {
                debug_assert_eq!(i, ino);
                idxs.push(x);
                w = next_win(&mut win)?;
            }
            f(InodeNo(ino), changed, &idxs)?;
        }
    }
}

/// Changes to a database built by [`create_bulk`], before it becomes a workspace (see
/// [`amend_bulk`]). New rows go through the writer's batches (and [`Amender::put_dirent`]'s);
/// every method that deletes or reads first inserts what the batches still hold, so
/// operations apply in the order they are called. Removals are set-based: the keys go into
/// a temporary table, then one `DELETE` a table removes them.
pub struct Amender<'c> {
    conn: &'c Connection,
    w: BulkWriter<'c>,
    /// `INSERT OR REPLACE` of directory entries.
    put: Batch<'c>,
    /// Keys into `temp.amend_gone` / `temp.amend_unlinked`.
    gone: Batch<'c>,
    unlinked: Batch<'c>,
    /// (rows, live inodes, bytes of live regular files) of the inode rows removed, for
    /// `inode_totals` (its triggers are dropped while the amender runs).
    removed: [i64; 3],
}

/// The tables keyed by inode that hold an inode's rows.
const INODE_TABLES: [&str; 6] = [
    "inode",
    "xattr",
    "inline_data",
    "symlink",
    "file_chunk",
    "missing_window",
];

impl<'c> Amender<'c> {
    /// The writer for new rows (inodes, their xattrs and data, missing windows).
    pub fn writer(&mut self) -> &mut BulkWriter<'c> {
        &mut self.w
    }

    /// Inserts what the batches hold.
    fn flush(&mut self) -> Result<()> {
        self.w.flush()?;
        self.put.flush()
    }

    /// The highest inode number in the database (0 when it has none): a number above it
    /// has no row in any table yet, so there is nothing to remove or read for it.
    pub fn max_ino(&mut self) -> Result<InodeNo> {
        self.flush()?;
        let n: i64 = self
            .conn
            .prepare_cached("SELECT coalesce(max(ino), 0) FROM inode")?
            .query_row([], |r| r.get(0))?;
        Ok(InodeNo(n as u64))
    }

    /// Removes these inodes with their xattrs, data, chunk maps and missing windows (the
    /// numbers that do not exist are skipped): one statement a table.
    pub fn delete_inodes(&mut self, inos: &[InodeNo]) -> Result<()> {
        self.flush()?;
        if inos.is_empty() {
            return Ok(());
        }
        self.conn
            .prepare_cached("DELETE FROM temp.amend_gone")?
            .execute([])?;
        for ino in inos {
            self.gone.push([int(ino.0)])?;
        }
        self.gone.flush()?;
        let (rows, live, bytes): (i64, i64, i64) = self
            .conn
            .prepare_cached(
                "SELECT count(*), coalesce(sum(nlink > 0), 0),
                    coalesce(sum(CASE WHEN nlink > 0 AND (mode & 61440) = 32768
                                 THEN size ELSE 0 END), 0)
                 FROM inode WHERE ino IN (SELECT ino FROM temp.amend_gone)",
            )?
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        self.removed[0] += rows;
        self.removed[1] += live;
        self.removed[2] += bytes;
        for t in INODE_TABLES {
            self.conn
                .prepare_cached(&format!(
                    "DELETE FROM {t} WHERE ino IN (SELECT ino FROM temp.amend_gone)"
                ))?
                .execute([])?;
        }
        Ok(())
    }

    /// A file's chunk map, window by window (`None`: all zeros); empty when it has none.
    pub fn chunk_map(&mut self, ino: InodeNo) -> Result<Vec<Option<[u8; 32]>>> {
        self.flush()?;
        let mut st = self
            .conn
            .prepare_cached("SELECT idx, id FROM file_chunk WHERE ino = ?1 ORDER BY idx")?;
        let rows = st.query_map([ino.0 as i64], |r| {
            Ok((
                r.get::<_, i64>(0)? as usize,
                r.get::<_, Option<Vec<u8>>>(1)?,
            ))
        })?;
        let mut map = Vec::new();
        for r in rows {
            let (idx, id) = r?;
            if map.len() <= idx {
                map.resize(idx + 1, None);
            }
            map[idx] = id.and_then(|v| v.try_into().ok());
        }
        Ok(map)
    }

    /// Adds or repoints a directory entry (batched: inserted by the next flush).
    pub fn put_dirent(
        &mut self,
        parent: InodeNo,
        name: &[u8],
        ino: InodeNo,
        kind: Kind,
    ) -> Result<()> {
        self.put.push([
            int(parent.0),
            blob(name),
            int(ino.0),
            int(u64::from(kind.mode_bits())),
        ])
    }

    /// Removes these directory entries (those that do not exist are skipped) with one
    /// statement.
    pub fn remove_dirents<'n>(
        &mut self,
        keys: impl IntoIterator<Item = (InodeNo, &'n [u8])>,
    ) -> Result<()> {
        self.flush()?;
        self.conn
            .prepare_cached("DELETE FROM temp.amend_unlinked")?
            .execute([])?;
        let mut any = false;
        for (p, n) in keys {
            self.unlinked.push([int(p.0), blob(n)])?;
            any = true;
        }
        if !any {
            return Ok(());
        }
        self.unlinked.flush()?;
        self.conn
            .prepare_cached(
                "DELETE FROM dirent WHERE (parent, name) IN
                 (SELECT parent, name FROM temp.amend_unlinked)",
            )?
            .execute([])?;
        Ok(())
    }

    /// A checkpoint bookkeeping value (`Tx::persist_set`).
    pub fn persist_set(&mut self, key: &str, value: &str) -> Result<()> {
        self.w.persist_set(key, value)
    }

    /// (files with windows left to fetch, their bytes, windows left to fetch), from the
    /// missing windows and those files' inodes alone: no pass over every inode (a body file
    /// with nothing to fetch is all holes; the filesystem creates its body sparse at its
    /// first open).
    pub fn missing_counts(&mut self) -> Result<[u64; 3]> {
        self.flush()?;
        let (files, bytes): (i64, i64) = self.conn.query_row(
            "SELECT count(*), coalesce(sum(size), 0) FROM inode
             WHERE ino IN (SELECT ino FROM missing_window)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let windows: i64 = self
            .conn
            .query_row("SELECT count(*) FROM missing_window", [], |r| r.get(0))?;
        Ok([files as u64, bytes as u64, windows as u64])
    }

    /// Inserts what is left and adds what was inserted and removed to `inode_totals`.
    fn finish(mut self) -> Result<()> {
        self.flush()?;
        let t = self.w.totals;
        let r = self.removed;
        self.conn.execute(
            "UPDATE inode_totals SET rows = rows + ?1, live = live + ?2, bytes = bytes + ?3",
            params![t[0] - r[0], t[1] - r[1], t[2] - r[2]],
        )?;
        Ok(())
    }
}

/// Opens the database at `path`, built by [`create_bulk`] and not yet a workspace, and lets
/// `change` amend it in one transaction, with no journal and no syncs (a crash leaves a file
/// the caller throws away). Every trigger is dropped meanwhile and recreated from its own SQL
/// afterwards: those on `dirent` record changes for the next checkpoint (the amended tree
/// is already on the remote), the cleanup ones on `inode` are what [`Amender::delete_inodes`]
/// does table by table, and `inode_totals` gets what was inserted and removed once at the
/// end, instead of a trigger run per row. The file is left in WAL mode with nothing in its
/// WAL; the caller makes it durable before renaming it.
pub fn amend_bulk<E: From<MetaError>>(
    path: &Path,
    change: impl FnOnce(&mut Amender<'_>) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let p = path.display().to_string();
    let conn = Connection::open_with_flags(
        path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|source| MetaError::Open {
        path: p.clone(),
        source,
    })?;
    super::schema::check(&conn, &p)?;
    conn.execute_batch(&format!(
        "PRAGMA journal_mode=OFF;
         PRAGMA synchronous=OFF;
         PRAGMA foreign_keys=OFF;
         PRAGMA temp_store=MEMORY;
         PRAGMA cache_size=-{};",
        bulk_cache_kib()
    ))
    .map_err(MetaError::from)?;
    let dropped: Vec<(String, String)> = {
        let mut st = conn
            .prepare(
                "SELECT name, sql FROM sqlite_master
                 WHERE type = 'trigger' AND sql IS NOT NULL ORDER BY name",
            )
            .map_err(MetaError::from)?;
        let v = st
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(MetaError::from)?
            .collect::<rusqlite::Result<_>>()
            .map_err(MetaError::from)?;
        v
    };
    conn.execute_batch("BEGIN").map_err(MetaError::from)?;
    for (name, _) in &dropped {
        conn.execute_batch(&format!("DROP TRIGGER \"{name}\""))
            .map_err(MetaError::from)?;
    }
    conn.execute_batch(
        "CREATE TEMP TABLE amend_gone (ino INTEGER PRIMARY KEY);
         CREATE TEMP TABLE amend_unlinked (parent INTEGER NOT NULL, name BLOB NOT NULL,
            PRIMARY KEY (parent, name)) WITHOUT ROWID;",
    )
    .map_err(MetaError::from)?;
    {
        let mut a = Amender {
            conn: &conn,
            w: writer(&conn)?,
            put: Batch::new(
                &conn,
                "INSERT OR REPLACE INTO dirent (parent, name, ino, kind)",
                4,
            )?,
            gone: Batch::new(&conn, "INSERT OR IGNORE INTO temp.amend_gone (ino)", 1)?,
            unlinked: Batch::new(
                &conn,
                "INSERT OR IGNORE INTO temp.amend_unlinked (parent, name)",
                2,
            )?,
            removed: [0; 3],
        };
        change(&mut a)?;
        a.finish()?;
    }
    for (_, sql) in &dropped {
        conn.execute_batch(sql).map_err(MetaError::from)?;
    }
    conn.execute_batch("COMMIT").map_err(MetaError::from)?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .map_err(MetaError::from)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(MetaError::Bulk {
            path: p,
            reason: format!("could not switch it to WAL (journal mode is {mode})"),
        }
        .into());
    }
    conn.close().map_err(|(_, e)| MetaError::from(e))?;
    Ok(())
}

//! Inode generations, for file handles (`open_by_handle_at`): a handle names an inode number
//! and a generation, and a number given to another inode must come with another generation.
//!
//! Numbers come from SQLite's AUTOINCREMENT, never one used before in this database, with
//! one exception: a crash loses the open group commit, and with it the inodes it inserted and
//! the sequence's advance, so after the restart the same numbers go to new inodes, while a
//! process may still hold a handle of a lost one. So every start of the filesystem that
//! follows anything but a clean shutdown begins a new *range* of numbers (from the next
//! number the store would give) with a new random generation; an inode's generation is that
//! of the range its number falls in (0 below the first range: the root, and every inode of a
//! store from before ranges, or restored into a new state dir, where handles of another
//! state dir are meant to go stale anyway). A range no committed inode has a number in yet
//! (it begins past the sequence) just gets a new generation: numbers a lost group gave in
//! it were handed out with the old one. A clean shutdown records the sequence it ended at
//! (`mark_clean`): a start that finds it unchanged continues the last range. So the table
//! grows by one row per unclean stop after which files were made.

use rusqlite::OptionalExtension;

use super::{Result, Store};

/// An inode number's generation (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Generations {
    /// (first number, generation), by first number.
    ranges: Vec<(u64, u32)>,
}

impl Generations {
    pub fn of(&self, ino: u64) -> u32 {
        match self.ranges.partition_point(|&(first, _)| first <= ino) {
            0 => 0,
            i => self.ranges[i - 1].1,
        }
    }

    /// How many ranges there are (one per start after an unclean stop).
    pub fn ranges(&self) -> usize {
        self.ranges.len()
    }
}

/// The largest inode number this store ever gave (the AUTOINCREMENT sequence; explicit
/// numbers a restore inserted count too).
fn sequence(conn: &rusqlite::Connection) -> rusqlite::Result<u64> {
    let seq: Option<i64> = conn
        .query_row(
            "SELECT seq FROM sqlite_sequence WHERE name = 'inode'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    let max: Option<i64> = conn.query_row("SELECT max(ino) FROM inode", [], |r| r.get(0))?;
    Ok(seq.unwrap_or(0).max(max.unwrap_or(0)).max(0) as u64)
}

/// A random generation that is neither 0 nor `not`.
fn fresh_generation(not: u32) -> u32 {
    loop {
        let g = crate::random::u64() as u32;
        if g != 0 && g != not {
            return g;
        }
    }
}

impl Store {
    /// For the filesystem's start (before it hands out any number): begins a new range of
    /// generations unless the store was shut down cleanly since the last one began, and
    /// returns every range.
    pub fn begin_generation(&self) -> Result<Generations> {
        let conn = &self.conn;
        conn.execute_batch(
            "BEGIN IMMEDIATE;
             CREATE TABLE IF NOT EXISTS ino_generation (
                first INTEGER PRIMARY KEY, gen INTEGER NOT NULL);",
        )?;
        let r = (|| -> Result<()> {
            let seq = sequence(conn)?;
            let clean: Option<i64> = conn
                .query_row("SELECT value FROM meta WHERE key = 'ino_clean'", [], |r| {
                    r.get(0)
                })
                .optional()?;
            conn.execute("DELETE FROM meta WHERE key = 'ino_clean'", [])?;
            if clean == Some(seq as i64) {
                return Ok(());
            }
            // A range past the sequence is the last one, begun at seq + 1: replaced.
            let last: Option<i64> = conn
                .query_row(
                    "SELECT gen FROM ino_generation ORDER BY first DESC LIMIT 1",
                    [],
                    |r| r.get(0),
                )
                .optional()?;
            let gen = fresh_generation(last.map_or(0, |g| g as u32));
            conn.execute(
                "INSERT OR REPLACE INTO ino_generation (first, gen) VALUES (?1, ?2)",
                rusqlite::params![(seq + 1) as i64, i64::from(gen)],
            )?;
            Ok(())
        })();
        match r {
            Ok(()) => conn.execute_batch("COMMIT")?,
            Err(e) => {
                let _ = conn.execute_batch("ROLLBACK");
                return Err(e);
            }
        }
        let mut st = conn.prepare("SELECT first, gen FROM ino_generation ORDER BY first")?;
        let rows = st.query_map([], |r| {
            Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u32))
        })?;
        Ok(Generations {
            ranges: rows.collect::<rusqlite::Result<_>>()?,
        })
    }

    /// At a clean shutdown, after the last commit: no number was given that the store does
    /// not hold, so the next start may continue the current range.
    pub fn mark_clean(&self) -> Result<()> {
        self.commit_group()?;
        let seq = sequence(&self.conn)?;
        self.conn.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES ('ino_clean', ?1)",
            [seq as i64],
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::{Inode, InodeNo, Nanos, Storage};

    fn insert(s: &Store) -> InodeNo {
        let tx = s.write().unwrap();
        let mut i = Inode::test_file(0, Storage::Inline);
        i.ino = InodeNo(0);
        let ino = tx.insert(&i).unwrap();
        tx.commit().unwrap();
        ino
    }

    #[test]
    fn a_number_given_again_after_a_crash_has_another_generation() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("test.db");
        let s = Store::open(&db, Nanos(0)).unwrap();
        let g1 = s.begin_generation().unwrap();
        assert_eq!(g1.of(1), 0, "the root's generation is the kernel's: 0");
        let a = insert(&s);
        let lost = insert(&s);
        let gen_lost = g1.of(lost.0);
        assert_ne!(gen_lost, 0);
        assert_eq!(g1.of(a.0), gen_lost);
        // The crash lost `lost`: its row and the sequence's advance roll back.
        s.conn
            .execute_batch(&format!(
                "DELETE FROM inode WHERE ino = {0};
                 UPDATE sqlite_sequence SET seq = {1} WHERE name = 'inode';",
                lost.0, a.0
            ))
            .unwrap();
        drop(s);
        let s = Store::open(&db, Nanos(0)).unwrap();
        let g2 = s.begin_generation().unwrap();
        assert_eq!(g2.of(a.0), gen_lost, "a kept inode keeps its generation");
        let again = insert(&s);
        assert_eq!(again, lost, "the number is given again");
        assert_ne!(g2.of(again.0), gen_lost, "with another generation");
        assert_eq!(g2.ranges(), 2);

        // A clean shutdown continues the range.
        s.mark_clean().unwrap();
        drop(s);
        let s = Store::open(&db, Nanos(0)).unwrap();
        assert_eq!(s.begin_generation().unwrap(), g2);
        // An unclean stop begins a range at the next number...
        let past = insert(&s);
        drop(s);
        let s = Store::open(&db, Nanos(0)).unwrap();
        let g3 = s.begin_generation().unwrap();
        assert_eq!((g3.ranges(), g3.of(past.0)), (3, g2.of(past.0)));
        // ... and when that number was handed out but lost again, it gets yet another
        // generation (the range is replaced, not added).
        let lost = insert(&s);
        s.conn
            .execute_batch(&format!(
                "DELETE FROM inode WHERE ino = {0};
                 UPDATE sqlite_sequence SET seq = {1} WHERE name = 'inode';",
                lost.0, past.0
            ))
            .unwrap();
        drop(s);
        let s = Store::open(&db, Nanos(0)).unwrap();
        let g4 = s.begin_generation().unwrap();
        assert_eq!(g4.ranges(), 3);
        assert_ne!(g4.of(lost.0), g3.of(lost.0));
        assert_eq!(g4.of(past.0), g3.of(past.0));
    }
}

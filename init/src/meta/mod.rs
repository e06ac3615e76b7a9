//! SQLite inode store.

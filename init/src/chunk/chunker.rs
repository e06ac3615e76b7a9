//! Fixed-size windowing of file bodies: which chunk windows a file of a given size has, the
//! byte range of each, and which windows a write touches. Pure arithmetic, no I/O.

use std::ops::Range;

/// Number of windows a file of `size` bytes has (the last one may be short).
pub fn window_count(size: u64, chunk_size: u64) -> u64 {
    size.div_ceil(chunk_size)
}

/// Byte range of window `idx` in a file of `size` bytes (empty past the end).
pub fn window_range(idx: u64, size: u64, chunk_size: u64) -> Range<u64> {
    let start = idx.saturating_mul(chunk_size).min(size);
    let end = start.saturating_add(chunk_size).min(size);
    start..end
}

/// Windows that bytes `[from, to)` fall in (at least the window of `from`).
pub fn windows_touched(from: u64, to: u64, chunk_size: u64) -> Range<u64> {
    from / chunk_size..to.max(from + 1).div_ceil(chunk_size)
}

/// True when every byte is zero (a hole: stored as no chunk at all).
pub fn is_zero(bytes: &[u8]) -> bool {
    // Compare 16 bytes at a time; the compiler vectorises this loop.
    let n = bytes.len() / 16 * 16;
    let (mid, post) = bytes.split_at(n);
    mid.chunks_exact(16)
        .all(|c| u128::from_ne_bytes(c.try_into().expect("16 bytes")) == 0)
        && post.iter().all(|b| *b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows() {
        let cs = 512 * 1024;
        assert_eq!(window_count(0, cs), 0);
        assert_eq!(window_count(1, cs), 1);
        assert_eq!(window_count(cs, cs), 1);
        assert_eq!(window_count(cs + 1, cs), 2);
        assert_eq!(window_range(1, cs + 10, cs), cs..cs + 10);
        assert_eq!(window_range(5, cs + 10, cs), cs + 10..cs + 10);
        assert_eq!(windows_touched(0, 1, cs), 0..1);
        assert_eq!(windows_touched(cs - 1, cs + 1, cs), 0..2);
        assert_eq!(windows_touched(cs, cs, cs), 1..2);
    }

    #[test]
    fn zero_detection() {
        assert!(is_zero(&[]));
        assert!(is_zero(&[0; 100]));
        let mut v = vec![0u8; 100];
        v[99] = 1;
        assert!(!is_zero(&v));
        v[99] = 0;
        v[3] = 1;
        assert!(!is_zero(&v));
    }
}

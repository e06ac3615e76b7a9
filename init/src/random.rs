//! keel's one source of random numbers: ids that must not collide across hosts and runs
//! (workspace ids, lease holders, gc markers), retry jitter, sample picks, the change
//! feed's run id and inode generations. SipHash keyed with the standard library's
//! per-process random keys (read from the kernel once) over a process-wide counter, so
//! every call differs from every other, in this process and in any other, without a
//! dependency. Not for secrets: nothing keel draws here needs to resist an attacker.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// 64 random bits.
pub fn u64() -> u64 {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = KEYS.get_or_init(RandomState::new).build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// A random number in `0..n` (`n` > 0), uniform enough for sampling.
pub fn below(n: u64) -> u64 {
    u64() % n
}

/// A random 128-bit id in lowercase hex (32 characters).
pub fn id() -> String {
    format!("{:016x}{:016x}", u64(), u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_hex_of_the_same_length_and_differ() {
        let ids: std::collections::BTreeSet<String> = (0..1000).map(|_| id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids.iter().all(|i| i.len() == 32
            && i.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())));
    }

    #[test]
    fn below_stays_below() {
        assert!((0..1000).all(|_| below(7) < 7));
        assert_eq!(below(1), 0);
    }
}

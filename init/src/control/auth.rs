//! Bearer-token checks for the TCP listener. The comparison takes the same time whatever the
//! presented token contains: it always walks the whole configured token and folds every
//! difference (length included) into one accumulator, so only the presented token's own
//! length (which its sender knows anyway) can influence timing.

use crate::config::control::Secret;

/// True when `authorization` is `Bearer <token>` (scheme case-insensitive) with the right token.
pub fn authorized(authorization: Option<&str>, token: &Secret) -> bool {
    let presented = authorization
        .and_then(|h| h.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim_start())
        .unwrap_or("");
    // An absent header still runs the full comparison against an empty string.
    constant_time_eq(presented.as_bytes(), token.expose().as_bytes()) && !presented.is_empty()
}

/// Compares `given` with `expected` in time that depends only on `expected.len()` (and on
/// whether each index is inside `given`, i.e. on `given.len()`), never on where they differ.
pub fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = given.len() ^ expected.len();
    for (i, &e) in expected.iter().enumerate() {
        let g = given.get(i).copied().unwrap_or(!e);
        diff |= usize::from(g ^ e);
        // Keep the optimiser from turning the fold into an early exit.
        diff = std::hint::black_box(diff);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equality() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secreT", b"secret"));
        assert!(!constant_time_eq(b"secre", b"secret"));
        assert!(!constant_time_eq(b"secret!", b"secret"));
        assert!(!constant_time_eq(b"", b"secret"));
        // Length differences that are multiples of a byte still count.
        assert!(!constant_time_eq(&[0u8; 256], &[0u8; 0]));
        assert!(!constant_time_eq(&[0u8; 0], &[0u8; 256]));
    }

    #[test]
    fn header_forms() {
        let t = Secret::new("s3cr3t");
        assert!(authorized(Some("Bearer s3cr3t"), &t));
        assert!(authorized(Some("bearer s3cr3t"), &t));
        assert!(authorized(Some("BEARER   s3cr3t "), &t));
        assert!(!authorized(Some("Basic s3cr3t"), &t));
        assert!(!authorized(Some("Bearer s3cr3"), &t));
        assert!(!authorized(Some("Bearers3cr3t"), &t));
        assert!(!authorized(Some("s3cr3t"), &t));
        assert!(!authorized(Some("Bearer "), &t));
        assert!(!authorized(None, &t));
    }
}

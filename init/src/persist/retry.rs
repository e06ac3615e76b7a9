//! Retrying remote operations that failed for a temporary reason: the policy (bounded
//! attempts, exponential backoff with full jitter), the deadline of the work in progress
//! (a thread-local set by whoever has a budget, e.g. the final checkpoint at shutdown, so
//! no retry and no request outlives it), and `redact`, which keeps credentials and signed
//! URLs out of error strings before they reach logs or `/status`.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// How often and how patiently a temporary failure is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in all (the first one included).
    pub attempts: u32,
    /// Upper bound of the first backoff; doubles every retry.
    pub base: Duration,
    /// Largest backoff.
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 8,
            base: Duration::from_millis(200),
            cap: Duration::from_secs(10),
        }
    }
}

impl RetryPolicy {
    /// The sleep before retry number `retry` (0 = the first retry): uniformly random in
    /// `[0, min(cap, base * 2^retry)]` ("full jitter").
    pub fn backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << retry.min(20))
            .min(self.cap);
        let nanos = ceiling.as_nanos() as u64;
        if nanos == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(crate::random::below(nanos + 1))
    }
}

thread_local! {
    static DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Restores the previous deadline of this thread when dropped.
pub struct DeadlineScope {
    prev: Option<Instant>,
}

impl Drop for DeadlineScope {
    fn drop(&mut self) {
        DEADLINE.with(|d| d.set(self.prev));
    }
}

/// Until the returned scope drops, remote operations on this thread give up (no further
/// retries, requests in flight cut short) at `deadline`, or at an earlier one already set.
pub fn deadline_scope(deadline: Option<Instant>) -> DeadlineScope {
    DEADLINE.with(|d| {
        let prev = d.get();
        let new = match (prev, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        d.set(new);
        DeadlineScope { prev }
    })
}

/// The deadline of the work this thread is doing, if it has one.
pub fn current_deadline() -> Option<Instant> {
    DEADLINE.with(|d| d.get())
}

/// Environment variables whose values are secrets; they never appear in error strings.
const SECRET_VARS: &[&str] = &[
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_TOKEN",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
];

/// `text` without anything secret: query strings of URLs (presigned URLs and SAS tokens
/// carry signatures there), the values of the credential environment variables and every
/// value of the `[persist] credentials_file` this process read. Long
/// texts (error bodies) are cut to 400 characters.
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, word) in text.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        match word.find('?') {
            Some(q) if word.contains("://") => {
                out.push_str(&word[..q]);
                out.push_str("?[redacted]");
            }
            _ => out.push_str(word),
        }
    }
    let from_env = SECRET_VARS.iter().filter_map(|var| std::env::var(var).ok());
    let from_file = crate::config::credentials::secret_values().map(str::to_string);
    for v in from_env.chain(from_file) {
        // Very short values would blank out ordinary words; credentials are long.
        if v.len() >= 6 {
            out = out.replace(&v, "[redacted]");
        }
    }
    if out.chars().count() > 400 {
        out = out.chars().take(400).collect::<String>() + "...";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::credentials;

    /// The one test in this process that loads a credentials file (the load is process-wide):
    /// the values it holds are redacted from error strings.
    #[test]
    fn values_from_the_loaded_file_are_redacted_from_error_strings() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("creds");
        std::fs::write(
            &f,
            "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI-file-secret\nAWS_SESSION_TOKEN='tok/en+value=='\n",
        )
        .unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let c = credentials::load(&f).unwrap();
        assert_eq!(c.get("AWS_SESSION_TOKEN"), Some("tok/en+value=="));
        assert!(credentials::loaded().is_some());
        let msg = "put chunks/ab: Error performing PUT http://h/b/k in 3ms - Server returned non-2xx status code: 403: signature for wJalrXUtnFEMI-file-secret with token tok/en+value== does not match";
        let r = redact(msg);
        assert!(!r.contains("wJalrXUtnFEMI-file-secret"), "{r}");
        assert!(!r.contains("tok/en+value=="), "{r}");
        assert!(
            r.contains("[redacted]") && r.contains("status code: 403"),
            "{r}"
        );
        assert_eq!(
            credentials::value("AWS_SESSION_TOKEN").as_deref(),
            Some("tok/en+value==")
        );
    }

    #[test]
    fn backoff_is_bounded_and_jittered() {
        let p = RetryPolicy {
            attempts: 5,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
        };
        let mut distinct = std::collections::HashSet::new();
        for retry in 0..10 {
            let ceiling = Duration::from_millis(100 * (1 << retry)).min(Duration::from_secs(1));
            for _ in 0..50 {
                let d = p.backoff(retry);
                assert!(d <= ceiling, "retry {retry}: {d:?} > {ceiling:?}");
                distinct.insert(d);
            }
        }
        assert!(
            distinct.len() > 100,
            "no jitter: {} distinct",
            distinct.len()
        );
    }

    #[test]
    fn deadline_scopes_nest_and_restore() {
        assert_eq!(current_deadline(), None);
        let late = Instant::now() + Duration::from_secs(10);
        let early = Instant::now() + Duration::from_secs(1);
        {
            let _a = deadline_scope(Some(late));
            assert_eq!(current_deadline(), Some(late));
            {
                let _b = deadline_scope(Some(early));
                assert_eq!(current_deadline(), Some(early));
                let _c = deadline_scope(Some(late));
                assert_eq!(current_deadline(), Some(early), "never extended");
            }
            assert_eq!(current_deadline(), Some(late));
        }
        assert_eq!(current_deadline(), None);
    }

    #[test]
    fn redact_removes_signed_urls_and_secrets() {
        std::env::set_var("AZURE_STORAGE_SAS_KEY", "sv=2020&sig=TOPSECRETSIG");
        let msg = "Error performing GET https://acct.blob.core.windows.net/c/k?sv=2020&sig=TOPSECRETSIG in 3ms - key sv=2020&sig=TOPSECRETSIG";
        let r = redact(msg);
        assert!(!r.contains("TOPSECRETSIG"), "{r}");
        assert!(
            r.contains("https://acct.blob.core.windows.net/c/k?[redacted]"),
            "{r}"
        );
        assert_eq!(redact("plain words? yes"), "plain words? yes");
        assert!(redact(&"x".repeat(1000)).len() < 410);
    }
}

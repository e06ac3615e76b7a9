//! Live markers: small objects that say "work that others must wait for or respect is under
//! way here", kept alive by their writer and void once it stops renewing them. A checkpoint
//! uploading to a chunk store shared with forks leaves one (`<ws>/checkpoint-in-flight`: a
//! sharing gc keeps the chunks written since it began), and so does every gc of a chunk store
//! (`<owner>/gc-running/<id>`: a fork being made waits for it to end, see `fork`).
//!
//! The object carries when the work began and when the marker runs out (`expires_ns`, wall
//! clock); a background thread renews it every ttl/3 and the writer removes it when done.
//! A writer that dies leaves it behind, and readers ignore it once it has run out: a dead
//! checkpoint or gc holds nobody back for longer than the ttl. The writer judges its own
//! marker by its monotonic clock, counting from when the last renewal that got through was
//! sent, minus a margin of ttl/5 (as the lease does): once a renewal could not be proved in
//! time, readers may already have given up on it, and `check` fails for good, so the work
//! it covers stops before it relies on it. Hosts' clocks must agree to well within the ttl.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::remote::{PutMode, Remote, RemoteError, RemoteResult};
use crate::time::now_ns;

/// How long a marker lives without a renewal.
pub const MARKER_TTL: Duration = Duration::from_secs(60);

/// A marker without an expiry (written by an older keel) counts for this long after it
/// began.
const UNRENEWED_MAX: Duration = Duration::from_secs(24 * 3600);

/// A marker as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkerRecord {
    /// When the work began (wall clock).
    pub started_ns: i64,
    /// When the marker runs out unless renewed (absent in markers of older keels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ns: Option<i64>,
}

/// What a reader makes of a marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    Live,
    /// Not renewed in time: its writer is gone.
    RanOut,
    /// An older keel's marker (no expiry) more than a day old.
    TooOld,
}

impl MarkerRecord {
    pub fn liveness(&self, now_ns: i64) -> Liveness {
        match self.expires_ns {
            Some(e) if e > now_ns => Liveness::Live,
            Some(_) => Liveness::RanOut,
            None if now_ns.saturating_sub(self.started_ns) > UNRENEWED_MAX.as_nanos() as i64 => {
                Liveness::TooOld
            }
            None => Liveness::Live,
        }
    }
}

/// Reads the marker at `key`; `Ok(None)` when there is none, or what is there does not
/// parse (reported in the second value).
pub fn read(remote: &dyn Remote, key: &str) -> RemoteResult<(Option<MarkerRecord>, bool)> {
    let b = match remote.get(key) {
        Ok(b) => b,
        Err(e) if e.is_not_found() => return Ok((None, false)),
        Err(e) => return Err(e),
    };
    Ok(match serde_json::from_slice(&b) {
        Ok(m) => (Some(m), false),
        Err(_) => (None, true),
    })
}

#[derive(Debug, thiserror::Error)]
#[error("the marker {key} could not be renewed in time (last error: {last}); others may have given up on it")]
pub struct Lapsed {
    pub key: String,
    pub last: String,
}

struct St {
    valid_until: Instant,
    lapsed: Option<String>,
    stop: bool,
}

struct Shared {
    remote: Arc<dyn Remote>,
    key: String,
    ttl: Duration,
    started_ns: i64,
    st: Mutex<St>,
    wake: Condvar,
}

fn lock(m: &Mutex<St>) -> MutexGuard<'_, St> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn margin(&self) -> Duration {
        self.ttl / 5
    }

    /// Writes the marker with a fresh expiry. A renewal keeps the earliest start it finds
    /// there (a marker is never made younger than what readers have seen of it).
    fn write(&self, renewal: bool) -> RemoteResult<()> {
        let mut started_ns = self.started_ns;
        if renewal {
            if let Ok((Some(m), _)) = read(self.remote.as_ref(), &self.key) {
                started_ns = started_ns.min(m.started_ns);
            }
        }
        let r = MarkerRecord {
            started_ns,
            expires_ns: Some(now_ns() + self.ttl.as_nanos() as i64),
        };
        let data = Bytes::from(serde_json::to_vec(&r).expect("marker serialises"));
        self.remote
            .put(&self.key, data, PutMode::Overwrite)
            .map(|_| ())
    }

    fn renew_loop(&self) {
        let every = self.ttl / 3;
        let soon = (self.ttl / 10).min(Duration::from_secs(1));
        let mut next = Instant::now() + every;
        let mut last = String::from("none");
        loop {
            {
                let mut st = lock(&self.st);
                loop {
                    if st.stop || st.lapsed.is_some() {
                        return;
                    }
                    let now = Instant::now();
                    if now + self.margin() >= st.valid_until {
                        st.lapsed = Some(last);
                        return;
                    }
                    if now >= next {
                        break;
                    }
                    let until = next.min(st.valid_until - self.margin());
                    st = self
                        .wake
                        .wait_timeout(st, until.saturating_duration_since(now))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            let sent = Instant::now();
            match self.write(true) {
                Ok(()) => {
                    let mut st = lock(&self.st);
                    if st.lapsed.is_none() && sent + self.margin() < st.valid_until {
                        st.valid_until = sent + self.ttl;
                    }
                    next = Instant::now() + every;
                }
                Err(e) => {
                    tracing::warn!(marker = %self.key, error = %e, "marker renewal failed; retrying");
                    last = e.to_string();
                    next = Instant::now() + soon;
                }
            }
        }
    }
}

/// A marker this process keeps alive (see the module doc). Dropping it stops the renewals
/// and removes it.
pub struct LiveMarker {
    shared: Arc<Shared>,
    renewer: Option<JoinHandle<()>>,
}

impl LiveMarker {
    /// Writes the marker at `key` (the work begins now) and renews it every `ttl`/3 on a
    /// background thread.
    pub fn start(remote: Arc<dyn Remote>, key: &str, ttl: Duration) -> RemoteResult<LiveMarker> {
        let sent = Instant::now();
        let shared = Arc::new(Shared {
            remote,
            key: key.to_string(),
            ttl,
            started_ns: now_ns(),
            st: Mutex::new(St {
                valid_until: sent + ttl,
                lapsed: None,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        shared.write(false)?;
        let s = shared.clone();
        let renewer = std::thread::Builder::new()
            .name("keel-marker".into())
            .spawn(move || s.renew_loop())
            .map_err(|e| RemoteError::Temporary {
                op: "renew",
                key: key.to_string(),
                reason: format!("start the renewal thread: {e}"),
            })?;
        Ok(LiveMarker {
            shared,
            renewer: Some(renewer),
        })
    }

    /// When the work began, as written in the marker.
    pub fn started_ns(&self) -> i64 {
        self.shared.started_ns
    }

    /// Ok while the marker is provably alive for readers (by this process's clock, with the
    /// margin); once not, never again.
    pub fn check(&self) -> Result<(), Lapsed> {
        let mut st = lock(&self.shared.st);
        if st.lapsed.is_none() && Instant::now() + self.shared.margin() >= st.valid_until {
            st.lapsed = Some("no renewal got through in time".into());
        }
        match &st.lapsed {
            None => Ok(()),
            Some(last) => Err(Lapsed {
                key: self.shared.key.clone(),
                last: last.clone(),
            }),
        }
    }

    fn stop_renewal(&mut self) {
        lock(&self.shared.st).stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.renewer.take() {
            let _ = t.join();
        }
    }

    /// Stops renewing and removes the marker (the work is over).
    pub fn finish(mut self) -> RemoteResult<()> {
        self.stop_renewal();
        self.shared.remote.delete(&self.shared.key)
    }
}

impl Drop for LiveMarker {
    fn drop(&mut self) {
        if self.renewer.is_some() {
            self.stop_renewal();
            if let Err(e) = self.shared.remote.delete(&self.shared.key) {
                tracing::warn!(marker = %self.shared.key, error = %e, "cannot remove a marker; it runs out by itself");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::MemRemote;

    /// Polls `f` until it returns Some; a hang guard only (no outcome depends on it).
    fn eventually<T>(mut f: impl FnMut() -> Option<T>) -> Option<T> {
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until {
            if let Some(v) = f() {
                return Some(v);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    #[test]
    fn a_marker_is_renewed_and_removed_and_readers_judge_it_by_its_expiry() {
        let remote = Arc::new(MemRemote::new());
        let m = LiveMarker::start(remote.clone(), "k", Duration::from_millis(300)).unwrap();
        let (r, _) = read(remote.as_ref(), "k").unwrap();
        let r = r.expect("written at start");
        assert_eq!(r.started_ns, m.started_ns());
        let e0 = r.expires_ns.unwrap();
        assert_eq!(r.liveness(e0 - 1), Liveness::Live);
        assert_eq!(r.liveness(e0), Liveness::RanOut);
        // Renewed: a later expiry, the same start.
        let later = eventually(|| {
            read(remote.as_ref(), "k")
                .ok()
                .and_then(|(r, _)| r)
                .filter(|r| r.expires_ns.is_some_and(|e| e > e0))
        });
        assert_eq!(later.expect("never renewed").started_ns, m.started_ns());
        m.finish().unwrap();
        assert_eq!(read(remote.as_ref(), "k").unwrap(), (None, false));
        // An older keel's marker: a day of life from its start.
        let old = MarkerRecord {
            started_ns: 0,
            expires_ns: None,
        };
        assert_eq!(old.liveness(1), Liveness::Live);
        assert_eq!(old.liveness(i64::MAX), Liveness::TooOld);
        remote
            .put("bad", Bytes::from_static(b"not json"), PutMode::Overwrite)
            .unwrap();
        assert_eq!(read(remote.as_ref(), "bad").unwrap(), (None, true));
    }

    #[test]
    fn a_marker_whose_renewals_fail_lapses_for_good_and_dropping_removes_it() {
        let remote = Arc::new(MemRemote::new());
        let m = LiveMarker::start(remote.clone(), "k", Duration::from_millis(200)).unwrap();
        remote.fail_after(Some(0));
        let e = eventually(|| m.check().err()).expect("the marker never lapsed");
        assert!(e.to_string().contains("could not be renewed"), "{e}");
        remote.fail_after(None);
        assert!(m.check().is_err(), "a lapsed marker came back");
        drop(m);
        assert_eq!(read(remote.as_ref(), "k").unwrap(), (None, false));
    }
}

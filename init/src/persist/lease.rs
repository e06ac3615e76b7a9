//! The single-writer lease of a workspace: the object `<ws>/lease` (JSON: holder id, host,
//! pid, epoch, acquired/expires wall-clock ns, ttl, released) written only with conditional
//! PUTs. Acquiring creates it (If-None-Match) or replaces an expired or released one
//! (If-Match, epoch + 1); a live lease of another holder is refused, waited out or taken
//! over by force (`[persist] takeover`). A background thread renews it every ttl/3 with
//! If-Match on the version it last wrote. Another holder or epoch (a takeover), a lease
//! marked released or deleted means the lease is lost: checkpoints stop
//! (`LeaseHandle::check`) until keel restarts, the local workspace keeps working. A lease
//! that ran out because the remote did not answer (an outage longer than about the ttl)
//! has only lapsed: checkpoints stop too, and the renewal thread keeps asking the remote;
//! once it answers and the lease object is still the one we last wrote (nobody took it
//! meanwhile), it takes it again under a new epoch with If-Match on that version, and
//! checkpoints resume. A keel that starts on a state dir holding a workspace while the remote
//! does not answer starts with the lease pending (`Lease::pending`): the same thread takes
//! it as a start would (its own previous lease at once, another holder's once expired, or by
//! force) when the remote answers. A clean shutdown releases it so the next writer need not
//! wait.
//!
//! Expiry is judged twice: by other writers from the wall-clock `expires_ns` in the object
//! (hosts' clocks must roughly agree), and by the holder itself from its monotonic clock,
//! counting from when the renewal was sent, minus a safety margin of ttl/5.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::remote::{PutMode, Remote, RemoteError};
use super::retry::deadline_scope;
use crate::config::Takeover;
use crate::time::now_ns;

/// The lease object as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// Random per process.
    pub holder: String,
    pub host: String,
    pub pid: u32,
    /// Grows by one at every change of holder; every head the holder writes carries it.
    pub epoch: u64,
    pub acquired_ns: i64,
    pub expires_ns: i64,
    pub ttl_ms: u64,
    /// Given up on a clean shutdown: free to take at once.
    #[serde(default)]
    pub released: bool,
}

impl LeaseRecord {
    /// `holder 1a2b3c4d (host h, pid 7)`.
    pub fn who(&self) -> String {
        format!(
            "holder {} (host {}, pid {})",
            self.holder, self.host, self.pid
        )
    }

    fn live(&self, now: i64) -> bool {
        !self.released && self.expires_ns > now
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("workspace {remote} is in use by another writer: lease {who}, epoch {epoch}, expires {expires} (in {in_s} s); to take it over start with --takeover=wait (wait for it to expire) or --takeover=force (or [persist] takeover)")]
    Held {
        remote: String,
        who: String,
        epoch: u64,
        expires: String,
        in_s: u64,
    },
    #[error("workspace {remote}: lease {who} (epoch {epoch}) was still renewed after waiting {waited_s} s for it to expire; use --takeover=force to take it over")]
    StillHeld {
        remote: String,
        who: String,
        epoch: u64,
        waited_s: u64,
    },
    #[error("open remote {url}: {source}")]
    Open { url: String, source: RemoteError },
    #[error("read lease {key}: {source}")]
    Read { key: String, source: RemoteError },
    #[error("lease {key} is unreadable ({reason}); remove it to start over")]
    Parse { key: String, reason: String },
    #[error("write lease {key}: {source}")]
    Write { key: String, source: RemoteError },
    #[error("lease lost: {0}; checkpoints are stopped (the local workspace keeps working); restart keel to take the lease again")]
    Lost(String),
    #[error("lease lapsed: {0}; checkpoints wait until the remote answers again and keel takes it back (the local workspace keeps working)")]
    Lapsed(String),
}

/// Why the lease stopped being ours (its message becomes `LeaseError::Lost`'s).
#[derive(Debug, thiserror::Error)]
pub enum LostReason {
    #[error("the workspace was taken over by {who} with epoch {epoch} (ours was {ours})")]
    TakenOver { who: String, epoch: u64, ours: u64 },
    #[error("our lease was marked released")]
    Released,
    #[error("the lease object was deleted from the remote")]
    Deleted,
    /// Not lost for sure: the remote could not be asked.
    #[error("cannot read the lease: {0}")]
    Unreadable(#[source] Box<LeaseError>),
    #[error("could not renew the lease before it expired (last error: {0})")]
    RenewFailed(#[source] RemoteError),
    #[error("the lease expired before a renewal got through")]
    Expired,
    #[error("the lease ran out: no renewal got through in time")]
    RanOut,
    #[error("the remote head was written by epoch {head} (ours is {ours})")]
    NewerHead { head: u64, ours: u64 },
    /// Renewal asked of a lease no longer held: why it was not (or "not held").
    #[error("{0}")]
    NotHeld(String),
    /// A lease pending since the start found another writer's live lease.
    #[error("the workspace is in use by another writer: lease {who}, epoch {epoch} (restart with --takeover=wait or --takeover=force to take it)")]
    HeldBy { who: String, epoch: u64 },
}

impl LeaseError {
    /// The remote could not be asked (a retry later may work), as opposed to an answer that
    /// refuses the lease.
    pub fn is_temporary(&self) -> bool {
        match self {
            LeaseError::Read { source, .. } | LeaseError::Write { source, .. } => {
                source.is_temporary()
            }
            _ => false,
        }
    }
}

impl LostReason {
    /// The remote did not answer in time: nobody else is known to hold the lease, so it
    /// may be taken again once the remote answers and the object is still ours.
    fn is_lapse(&self) -> bool {
        matches!(
            self,
            LostReason::Unreadable(_)
                | LostReason::RenewFailed(_)
                | LostReason::Expired
                | LostReason::RanOut
        )
    }
}

/// Where the lease stands, for `/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    Held,
    Lost,
    Released,
}

impl LeaseState {
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Held => "held",
            LeaseState::Lost => "lost",
            LeaseState::Released => "released",
        }
    }
}

/// A copy of the lease's state (no credentials).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    pub state: LeaseState,
    /// Our holder id, host and pid.
    pub holder: String,
    pub epoch: u64,
    /// Wall-clock expiry of the last renewal that got through.
    pub expires_ns: i64,
    /// Why it was lost.
    pub error: Option<String>,
}

/// Called with the new state after every renewal and when the lease is lost.
pub type LeaseObserver = Box<dyn Fn(LeaseInfo) + Send + Sync>;

struct St {
    record: LeaseRecord,
    version: Option<String>,
    /// Our own clock's idea of when the lease runs out.
    valid_until: Instant,
    state: LeaseState,
    error: Option<String>,
    /// `state` is `Lost` by a lapse only (see `LostReason::is_lapse`): the renewal thread
    /// tries to take it back.
    lapsed: bool,
    /// Not acquired yet: the remote did not answer at start (see `Lease::pending`).
    pending: Option<Pending>,
    stop: bool,
}

/// How a lease pending since the start is to be taken.
#[derive(Clone)]
struct Pending {
    takeover: Takeover,
    /// This state dir's previous holder id (its keel is gone): taken at once, live or not.
    reclaim: Option<String>,
}

struct Shared {
    remote: Arc<dyn Remote>,
    key: String,
    ttl: Duration,
    st: Mutex<St>,
    wake: Condvar,
    observer: Mutex<Option<LeaseObserver>>,
}

fn lock(m: &Mutex<St>) -> MutexGuard<'_, St> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn margin(&self) -> Duration {
        self.ttl / 5
    }

    fn info(&self) -> LeaseInfo {
        let st = lock(&self.st);
        LeaseInfo {
            state: st.state,
            holder: st.record.who(),
            epoch: st.record.epoch,
            expires_ns: st.record.expires_ns,
            error: st.error.clone(),
        }
    }

    fn notify(&self) {
        let info = self.info();
        if let Some(f) = self
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            f(info);
        }
    }

    /// Marks the lease lost and says so loudly: lapsed (the remote did not answer) or lost
    /// for good (another writer). The first reason wins, except that a loss for good
    /// overrides a lapse.
    fn lose(&self, why: LostReason) {
        let lapse = why.is_lapse();
        let why = why.to_string();
        {
            let mut st = lock(&self.st);
            let first = st.state == LeaseState::Held;
            let worse = st.state == LeaseState::Lost && st.lapsed && !lapse;
            if !first && !worse {
                return;
            }
            st.state = LeaseState::Lost;
            st.error = Some(why.clone());
            st.lapsed = lapse;
        }
        if lapse {
            tracing::error!(lease = %self.key, "LEASE LAPSED: {why}; checkpoints to the remote wait until the remote answers again and keel takes the lease back (unless another writer took it meanwhile), the local workspace keeps working");
        } else {
            tracing::error!(lease = %self.key, "LEASE LOST: {why}; checkpoints to the remote are stopped, the local workspace keeps working");
        }
        self.wake.notify_all();
        self.notify();
    }

    /// After a lapse: takes the lease back if the object on the remote is still the one we
    /// last wrote (same holder and epoch, not released), as a new epoch with If-Match on
    /// its version. `Ok(false)`: the remote did not answer (or changed under us: look again
    /// later); `Err`: someone else holds it now, lost for good.
    fn regain(&self) -> Result<bool, LostReason> {
        let (holder, epoch, pending) = {
            let st = lock(&self.st);
            (
                st.record.holder.clone(),
                st.record.epoch,
                st.pending.clone(),
            )
        };
        if let Some(p) = pending {
            return self.acquire_pending(&p);
        }
        // One attempt at a time: no retry outlives a ttl.
        let _d = deadline_scope(Some(Instant::now() + self.ttl));
        let (current, version) = match self.read() {
            Ok(Some((r, Some(v)))) => (r, v),
            Ok(Some((_, None))) => {
                return Err(LostReason::NotHeld(
                    "the store gives no object versions (ETags)".into(),
                ))
            }
            Ok(None) => return Err(LostReason::Deleted),
            Err(_) => return Ok(false),
        };
        if current.holder != holder || current.epoch != epoch {
            return Err(LostReason::TakenOver {
                who: current.who(),
                epoch: current.epoch,
                ours: epoch,
            });
        }
        if current.released {
            return Err(LostReason::Released);
        }
        let now = now_ns();
        let record = LeaseRecord {
            epoch: epoch + 1,
            acquired_ns: now,
            expires_ns: now + self.ttl.as_nanos() as i64,
            released: false,
            ..current
        };
        let sent = Instant::now();
        let data = Bytes::from(serde_json::to_vec(&record).expect("lease serialises"));
        match self.remote.put(&self.key, data, PutMode::Update(version)) {
            Ok(v) => {
                let v = match v {
                    Some(v) => Some(v),
                    None => self.read().ok().flatten().and_then(|(_, v)| v),
                };
                {
                    let mut st = lock(&self.st);
                    if st.state != LeaseState::Lost || !st.lapsed || st.stop {
                        return Ok(false);
                    }
                    st.record = record;
                    st.version = v;
                    st.valid_until = sent + self.ttl;
                    st.state = LeaseState::Held;
                    st.error = None;
                    st.lapsed = false;
                }
                tracing::warn!(lease = %self.key, epoch = epoch + 1, "workspace lease taken back after the remote answered again; checkpoints resume");
                self.notify();
                Ok(true)
            }
            // Written meanwhile (maybe our own write with its reply lost): the next read says.
            Err(_) => Ok(false),
        }
    }

    /// A lease pending since the start: taken as `Lease::acquire` would, now that the
    /// remote may answer. `Ok(false)`: not yet (no answer, or a write raced us).
    fn acquire_pending(&self, p: &Pending) -> Result<bool, LostReason> {
        let _d = deadline_scope(Some(Instant::now() + self.ttl));
        let now = now_ns();
        let (epoch, mode, old) = match self.read() {
            Err(_) => return Ok(false),
            Ok(None) => (1, PutMode::Create, None),
            Ok(Some((_, None))) => {
                return Err(LostReason::NotHeld(
                    "the store gives no object versions (ETags)".into(),
                ))
            }
            Ok(Some((r, Some(v)))) => {
                let ours = p.reclaim.as_deref() == Some(r.holder.as_str());
                if r.live(now) && !ours {
                    match p.takeover {
                        Takeover::Force => {}
                        // Waits for it to run out: the next try looks again.
                        Takeover::Wait => return Ok(false),
                        Takeover::Refuse => {
                            return Err(LostReason::HeldBy {
                                who: r.who(),
                                epoch: r.epoch,
                            })
                        }
                    }
                }
                (r.epoch + 1, PutMode::Update(v), Some(r))
            }
        };
        let holder = lock(&self.st).record.holder.clone();
        let record = LeaseRecord {
            holder,
            host: host_name(),
            pid: std::process::id(),
            epoch,
            acquired_ns: now,
            expires_ns: now + self.ttl.as_nanos() as i64,
            ttl_ms: self.ttl.as_millis() as u64,
            released: false,
        };
        let sent = Instant::now();
        let data = Bytes::from(serde_json::to_vec(&record).expect("lease serialises"));
        let Ok(v) = self.remote.put(&self.key, data, mode) else {
            return Ok(false);
        };
        let v = match v {
            Some(v) => Some(v),
            None => self.read().ok().flatten().and_then(|(_, v)| v),
        };
        {
            let mut st = lock(&self.st);
            if st.stop {
                return Ok(false);
            }
            st.record = record;
            st.version = v;
            st.valid_until = sent + self.ttl;
            st.state = LeaseState::Held;
            st.error = None;
            st.lapsed = false;
            st.pending = None;
        }
        if let Some(o) = old.filter(|o| o.live(now)) {
            tracing::warn!("took over the workspace lease from {}", o.who());
        }
        tracing::warn!(lease = %self.key, epoch, "workspace lease acquired now that the remote answers; checkpoints start");
        self.notify();
        Ok(true)
    }

    /// Tries `regain` until it works, the lapse turns into a loss for good, or the lease
    /// is stopped; waits `soon`, doubling up to `every`, between tries.
    fn regain_loop(&self, soon: Duration, every: Duration) -> bool {
        let mut wait = soon;
        loop {
            {
                let st = lock(&self.st);
                if st.stop || st.state != LeaseState::Lost || !st.lapsed {
                    return st.state == LeaseState::Held && !st.stop;
                }
                let st = self
                    .wake
                    .wait_timeout(st, wait)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                if st.stop {
                    return false;
                }
            }
            match self.regain() {
                Ok(true) => return true,
                Ok(false) => wait = (wait * 2).min(every),
                Err(why) => {
                    self.lose(why);
                    return false;
                }
            }
        }
    }

    /// The lease object and its version; `None` when absent.
    fn read(&self) -> Result<Option<(LeaseRecord, Option<String>)>, LeaseError> {
        read_record(self.remote.as_ref(), &self.key)
    }

    /// Is the object on the remote still the one we wrote (a renewal whose reply was lost
    /// counts)? `Err(why)` names who holds it instead.
    fn still_ours(&self) -> Result<Option<String>, LostReason> {
        let (holder, epoch) = {
            let st = lock(&self.st);
            (st.record.holder.clone(), st.record.epoch)
        };
        match self.read() {
            Ok(Some((r, v))) if r.holder == holder && r.epoch == epoch && !r.released => Ok(v),
            Ok(Some((r, _))) if r.epoch > epoch || r.holder != holder => {
                Err(LostReason::TakenOver {
                    who: r.who(),
                    epoch: r.epoch,
                    ours: epoch,
                })
            }
            Ok(Some(_)) => Err(LostReason::Released),
            Ok(None) => Err(LostReason::Deleted),
            Err(e) => Err(LostReason::Unreadable(Box::new(e))),
        }
    }

    /// One renewal. `Ok(false)`: a temporary failure, try again soon.
    fn renew(&self) -> Result<bool, LostReason> {
        let (mut record, version, valid_until) = {
            let st = lock(&self.st);
            if st.state != LeaseState::Held {
                let why = st.error.clone().unwrap_or_else(|| "not held".into());
                return Err(LostReason::NotHeld(why));
            }
            (st.record.clone(), st.version.clone(), st.valid_until)
        };
        let sent = Instant::now();
        record.expires_ns = now_ns() + self.ttl.as_nanos() as i64;
        let data = Bytes::from(serde_json::to_vec(&record).expect("lease serialises"));
        let mode = match version {
            Some(v) => PutMode::Update(v),
            None => PutMode::Overwrite,
        };
        let r = {
            // No retry may run past the point where we could no longer prove we hold it.
            let _d = deadline_scope(Some(valid_until));
            self.remote.put(&self.key, data, mode)
        };
        match r {
            Ok(v) => {
                let v = match v {
                    Some(v) => Some(v),
                    None => self.read().ok().flatten().and_then(|(_, v)| v),
                };
                let mut st = lock(&self.st);
                if st.state == LeaseState::Held {
                    st.record = record;
                    st.version = v;
                    st.valid_until = sent + self.ttl;
                }
                drop(st);
                self.notify();
                Ok(true)
            }
            Err(RemoteError::Precondition { .. }) | Err(RemoteError::NotFound { .. }) => {
                // Our previous write may have landed with its reply lost: look.
                match self.still_ours() {
                    Ok(v) => {
                        lock(&self.st).version = v;
                        Ok(false)
                    }
                    Err(why) => Err(why),
                }
            }
            Err(e) => {
                tracing::warn!(lease = %self.key, error = %e, "lease renewal failed; retrying");
                if Instant::now() + self.margin() >= valid_until {
                    return Err(LostReason::RenewFailed(e));
                }
                Ok(false)
            }
        }
    }

    fn renew_loop(self: Arc<Self>) {
        let every = self.ttl / 3;
        let soon = (self.ttl / 10).min(Duration::from_secs(1));
        let mut next = Instant::now() + every;
        loop {
            let held = {
                let mut st = lock(&self.st);
                loop {
                    if st.stop {
                        return;
                    }
                    if st.state != LeaseState::Held {
                        break false;
                    }
                    let now = Instant::now();
                    if now >= next {
                        break true;
                    }
                    st = self
                        .wake
                        .wait_timeout(st, next - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            };
            if !held {
                // Lost for good: nothing more to do. Lapsed: take it back when we can.
                if !self.regain_loop(soon, every) {
                    return;
                }
                next = Instant::now() + every;
                continue;
            }
            match self.renew() {
                Ok(true) => next = Instant::now() + every,
                Ok(false) => next = Instant::now() + soon,
                Err(why) => {
                    self.lose(why);
                    continue;
                }
            }
            // Out of time without a renewal: we can no longer prove we hold it.
            let valid_until = lock(&self.st).valid_until;
            if Instant::now() + self.margin() >= valid_until {
                self.lose(LostReason::Expired);
            }
        }
    }
}

fn read_record(
    remote: &dyn Remote,
    key: &str,
) -> Result<Option<(LeaseRecord, Option<String>)>, LeaseError> {
    let read = |source| LeaseError::Read {
        key: key.to_string(),
        source,
    };
    let Some(info) = remote.head(key).map_err(read)? else {
        return Ok(None);
    };
    let b = match remote.get(key) {
        Ok(b) => b,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(read(e)),
    };
    let r: LeaseRecord = serde_json::from_slice(&b).map_err(|e| LeaseError::Parse {
        key: key.to_string(),
        reason: e.to_string(),
    })?;
    Ok(Some((r, info.version)))
}

/// A new lease holder id (16 hex digits).
pub fn new_holder_id() -> String {
    crate::random::id()[..16].to_string()
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// A held lease. Renewed in the background once `start_renewal` ran; `release` gives it
/// up. Dropping it only stops renewing (as a crash would): the lease runs out after ttl.
pub struct Lease {
    shared: Arc<Shared>,
    renewer: Option<JoinHandle<()>>,
}

/// What checkpoints use to check that the lease is still held. Cheap to clone.
#[derive(Clone)]
pub struct LeaseHandle(Arc<Shared>);

impl Lease {
    /// Takes the lease `<ws>/lease` (`key`) on `remote` for `ttl`, or fails with who holds
    /// it. `takeover` says what to do about a live lease of another holder.
    /// `reclaim`: the holder id of a previous keel on this same state dir that is known to
    /// be gone (it stopped without releasing, e.g. killed): its live lease is taken at once,
    /// whatever `takeover` says. `holder`: the id the new lease is written with (the caller
    /// records it where the next start finds it *before* calling, see `new_holder_id`).
    pub fn acquire(
        remote: Arc<dyn Remote>,
        key: &str,
        ttl: Duration,
        takeover: Takeover,
        reclaim: Option<&str>,
        holder: &str,
    ) -> Result<Lease, LeaseError> {
        let mut wait_until: Option<i64> = None;
        let t0 = Instant::now();
        loop {
            let now = now_ns();
            let current = read_record(remote.as_ref(), key)?;
            let (epoch, mode) = match &current {
                None => (1, PutMode::Create),
                Some((r, v)) => {
                    let version = v.clone().ok_or_else(|| LeaseError::Read {
                        key: key.to_string(),
                        source: RemoteError::Permanent {
                            op: "head",
                            key: key.to_string(),
                            reason: "the store gives no object versions (ETags)".into(),
                        },
                    })?;
                    if r.live(now) && reclaim == Some(r.holder.as_str()) {
                        tracing::info!(
                            "reclaiming the workspace lease this state dir's previous keel held ({}, epoch {}): it stopped without releasing it",
                            r.who(),
                            r.epoch
                        );
                    } else if r.live(now) {
                        match takeover {
                            Takeover::Refuse => {
                                return Err(LeaseError::Held {
                                    remote: remote.describe(),
                                    who: r.who(),
                                    epoch: r.epoch,
                                    expires: crate::time::fmt_ns(r.expires_ns),
                                    in_s: ((r.expires_ns - now).max(0) as u64)
                                        .div_ceil(1_000_000_000),
                                })
                            }
                            Takeover::Wait => {
                                let limit = *wait_until.get_or_insert(
                                    r.expires_ns + (r.ttl_ms as i64) * 1_000_000,
                                );
                                if now >= limit {
                                    return Err(LeaseError::StillHeld {
                                        remote: remote.describe(),
                                        who: r.who(),
                                        epoch: r.epoch,
                                        waited_s: t0.elapsed().as_secs(),
                                    });
                                }
                                let left = Duration::from_nanos(
                                    (r.expires_ns - now).max(0) as u64 + 50_000_000,
                                );
                                tracing::info!(
                                    "workspace lease held by {} (epoch {}): waiting {:.1}s for it to expire",
                                    r.who(),
                                    r.epoch,
                                    left.as_secs_f64()
                                );
                                std::thread::sleep(left.min(Duration::from_secs(1)));
                                continue;
                            }
                            Takeover::Force => tracing::warn!(
                                "taking the workspace lease over from {} (epoch {}), which has not expired",
                                r.who(),
                                r.epoch
                            ),
                        }
                    }
                    (r.epoch + 1, PutMode::Update(version))
                }
            };
            let record = LeaseRecord {
                holder: holder.to_string(),
                host: host_name(),
                pid: std::process::id(),
                epoch,
                acquired_ns: now,
                expires_ns: now + ttl.as_nanos() as i64,
                ttl_ms: ttl.as_millis() as u64,
                released: false,
            };
            let sent = Instant::now();
            let data = Bytes::from(serde_json::to_vec(&record).expect("lease serialises"));
            match remote.put(key, data, mode) {
                Ok(v) => {
                    let version = match v {
                        Some(v) => Some(v),
                        None => read_record(remote.as_ref(), key)?.and_then(|(_, v)| v),
                    };
                    if let Some((old, _)) = &current {
                        if old.live(now) {
                            tracing::warn!("took over the workspace lease from {}", old.who());
                        }
                    }
                    tracing::info!(
                        lease = key,
                        epoch,
                        ttl_s = ttl.as_secs_f64(),
                        "workspace lease acquired"
                    );
                    let shared = Arc::new(Shared {
                        remote,
                        key: key.to_string(),
                        ttl,
                        st: Mutex::new(St {
                            record,
                            version,
                            valid_until: sent + ttl,
                            state: LeaseState::Held,
                            error: None,
                            lapsed: false,
                            pending: None,
                            stop: false,
                        }),
                        wake: Condvar::new(),
                        observer: Mutex::new(None),
                    });
                    return Ok(Lease {
                        shared,
                        renewer: None,
                    });
                }
                // Someone else wrote it between our read and our write: look again.
                Err(RemoteError::AlreadyExists { .. }) | Err(RemoteError::Precondition { .. }) => {
                    continue
                }
                Err(source) => {
                    return Err(LeaseError::Write {
                        key: key.to_string(),
                        source,
                    })
                }
            }
        }
    }

    /// A lease not acquired yet because the remote did not answer at start (`why`): keel
    /// starts on its local workspace, and the renewal thread takes the lease as `acquire`
    /// would (`takeover`, `reclaim`) once the remote answers; until then every checkpoint
    /// is refused as with a lapsed lease. The holder id is `reclaim`'s when given (this
    /// state dir keeps its id), else a new one.
    pub fn pending(
        remote: Arc<dyn Remote>,
        key: &str,
        ttl: Duration,
        takeover: Takeover,
        reclaim: Option<&str>,
        why: &LeaseError,
    ) -> Lease {
        let now = now_ns();
        let record = LeaseRecord {
            holder: reclaim.map_or_else(new_holder_id, str::to_string),
            host: host_name(),
            pid: std::process::id(),
            epoch: 0,
            acquired_ns: now,
            expires_ns: now,
            ttl_ms: ttl.as_millis() as u64,
            released: false,
        };
        let error = format!("not acquired yet: the remote did not answer at start ({why})");
        tracing::warn!(lease = key, "{error}; keel starts on the local workspace and takes the lease when the remote answers");
        Lease {
            shared: Arc::new(Shared {
                remote,
                key: key.to_string(),
                ttl,
                st: Mutex::new(St {
                    record,
                    version: None,
                    valid_until: Instant::now(),
                    state: LeaseState::Lost,
                    error: Some(error),
                    lapsed: true,
                    pending: Some(Pending {
                        takeover,
                        reclaim: reclaim.map(str::to_string),
                    }),
                    stop: false,
                }),
                wake: Condvar::new(),
                observer: Mutex::new(None),
            }),
            renewer: None,
        }
    }

    /// Starts renewing every ttl/3 on a background thread.
    pub fn start_renewal(&mut self) -> std::io::Result<()> {
        if self.renewer.is_none() {
            let s = self.shared.clone();
            self.renewer = Some(
                std::thread::Builder::new()
                    .name("keel-lease".into())
                    .spawn(move || s.renew_loop())?,
            );
        }
        Ok(())
    }

    pub fn handle(&self) -> LeaseHandle {
        LeaseHandle(self.shared.clone())
    }

    pub fn info(&self) -> LeaseInfo {
        self.shared.info()
    }

    /// Our random holder id, as written in the lease object.
    pub fn holder_id(&self) -> String {
        lock(&self.shared.st).record.holder.clone()
    }

    /// Called with the new state after every renewal and when the lease is lost.
    pub fn set_observer(&self, f: LeaseObserver) {
        *self
            .shared
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    fn stop_renewal(&mut self) {
        lock(&self.shared.st).stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.renewer.take() {
            let _ = t.join();
        }
    }

    /// Gives the lease up (clean shutdown): marks the object released with a conditional
    /// write, so the next writer takes it at once. A lost lease is left alone.
    pub fn release(mut self) -> Result<(), LeaseError> {
        self.stop_renewal();
        let (mut record, version) = {
            let mut st = lock(&self.shared.st);
            if st.state != LeaseState::Held {
                return Ok(());
            }
            st.state = LeaseState::Released;
            (st.record.clone(), st.version.clone())
        };
        record.released = true;
        record.expires_ns = now_ns();
        let data = Bytes::from(serde_json::to_vec(&record).expect("lease serialises"));
        let mode = match version {
            Some(v) => PutMode::Update(v),
            None => PutMode::Overwrite,
        };
        let r = self.shared.remote.put(&self.shared.key, data, mode);
        self.shared.notify();
        match r {
            Ok(_) => {
                tracing::info!(lease = %self.shared.key, epoch = record.epoch, "workspace lease released");
                Ok(())
            }
            // Someone took it meanwhile: nothing of ours to release.
            Err(RemoteError::Precondition { .. }) => Ok(()),
            Err(source) => Err(LeaseError::Write {
                key: self.shared.key.clone(),
                source,
            }),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop_renewal();
    }
}

/// Holds a lease through a start-up that may still fail: releases it when dropped unless
/// `take` handed it on (a start that failed is a clean stop: the next writer need not wait).
pub struct ReleaseOnDrop(Option<Lease>);

impl ReleaseOnDrop {
    pub fn new(lease: Option<Lease>) -> Self {
        ReleaseOnDrop(lease)
    }

    pub fn take(&mut self) -> Option<Lease> {
        self.0.take()
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some(l) = self.0.take() {
            if let Err(e) = l.release() {
                tracing::warn!(error = %e, "could not release the workspace lease");
            }
        }
    }
}

impl LeaseHandle {
    /// Our epoch, if the lease is held by our own clock (with the safety margin).
    pub fn check(&self) -> Result<u64, LeaseError> {
        let s = &self.0;
        let (state, epoch, valid_until, error, lapsed) = {
            let st = lock(&s.st);
            (
                st.state,
                st.record.epoch,
                st.valid_until,
                st.error.clone(),
                st.lapsed,
            )
        };
        match state {
            LeaseState::Held if Instant::now() + s.margin() < valid_until => Ok(epoch),
            LeaseState::Held => {
                let why = LostReason::RanOut;
                let msg = why.to_string();
                s.lose(why);
                Err(LeaseError::Lapsed(msg))
            }
            LeaseState::Lost if lapsed => Err(LeaseError::Lapsed(error.unwrap_or_default())),
            LeaseState::Lost => Err(LeaseError::Lost(error.unwrap_or_default())),
            LeaseState::Released => Err(LeaseError::Lost("it was released".into())),
        }
    }

    /// `check`, then asks the remote whether the lease object is still ours (the fence
    /// before every head write: a writer that took over is noticed even before our next
    /// renewal). A remote that cannot be asked fails the check too.
    pub fn check_remote(&self) -> Result<u64, LeaseError> {
        let epoch = self.check()?;
        match self.0.still_ours() {
            Ok(_) => Ok(epoch),
            Err(why @ LostReason::Unreadable(_)) => Err(LeaseError::Lost(why.to_string())),
            Err(why) => {
                let msg = why.to_string();
                self.0.lose(why);
                Err(LeaseError::Lost(msg))
            }
        }
    }

    /// A head written by a later epoch than ours means someone else holds the workspace.
    pub fn check_head_epoch(&self, head_epoch: u64) -> Result<(), LeaseError> {
        let ours = lock(&self.0.st).record.epoch;
        if head_epoch > ours {
            let why = LostReason::NewerHead {
                head: head_epoch,
                ours,
            };
            let msg = why.to_string();
            self.0.lose(why);
            return Err(LeaseError::Lost(msg));
        }
        Ok(())
    }

    pub fn info(&self) -> LeaseInfo {
        self.0.info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persist::MemRemote;

    const KEY: &str = "ws/lease";

    fn take(r: &Arc<MemRemote>, ttl_ms: u64, t: Takeover) -> Result<Lease, LeaseError> {
        Lease::acquire(
            r.clone(),
            KEY,
            Duration::from_millis(ttl_ms),
            t,
            None,
            &new_holder_id(),
        )
    }

    #[test]
    fn second_writer_is_refused_until_release() {
        let r = Arc::new(MemRemote::new());
        let a = take(&r, 30_000, Takeover::Refuse).unwrap();
        assert_eq!(a.info().epoch, 1);
        let e = take(&r, 30_000, Takeover::Refuse)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(&a.info().holder), "{e}");
        assert!(e.contains("epoch 1") && e.contains("--takeover"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
        a.release().unwrap();
        let b = take(&r, 30_000, Takeover::Refuse).unwrap();
        assert_eq!(b.info().epoch, 2);
        assert_eq!(b.handle().check().unwrap(), 2);
    }

    #[test]
    fn a_crashed_holder_is_reclaimed_only_by_its_own_id() {
        let r = Arc::new(MemRemote::new());
        let a = take(&r, 30_000, Takeover::Refuse).unwrap();
        let id = a.holder_id();
        drop(a); // killed: never released, still live
        let other = Lease::acquire(
            r.clone(),
            KEY,
            Duration::from_secs(30),
            Takeover::Refuse,
            Some("not-the-holder"),
            "not-the-holder",
        );
        assert!(matches!(other, Err(LeaseError::Held { .. })));
        let b = Lease::acquire(
            r.clone(),
            KEY,
            Duration::from_secs(30),
            Takeover::Refuse,
            Some(&id),
            &id,
        )
        .unwrap();
        assert_eq!(b.info().epoch, 2, "a reclaim is a new epoch");
        assert_eq!(b.holder_id(), id, "the state dir keeps its id");
    }

    /// The stored record.
    fn stored(r: &MemRemote) -> LeaseRecord {
        read_record(r, KEY).unwrap().unwrap().0
    }

    /// Polls `f` until it returns Some: a hang guard (no outcome depends on it).
    fn eventually<T>(mut f: impl FnMut() -> Option<T>) -> T {
        let t0 = Instant::now();
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(t0.elapsed() < Duration::from_secs(120), "never happened");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn renewal_keeps_it_and_force_takeover_loses_it() {
        // A ttl no stall of a loaded machine outlasts (renewed every 5 s).
        let r = Arc::new(MemRemote::new());
        let mut a = take(&r, 15_000, Takeover::Refuse).unwrap();
        let first = stored(&r).expires_ns;
        a.start_renewal().unwrap();
        eventually(|| (stored(&r).expires_ns > first).then_some(()));
        assert_eq!(a.handle().check().unwrap(), 1, "renewed, same epoch");
        // Still live: refused.
        assert!(take(&r, 15_000, Takeover::Refuse).is_err());
        let b = take(&r, 15_000, Takeover::Force).unwrap();
        assert_eq!(b.info().epoch, 2);
        // The remote fence notices at once, before any renewal.
        let e = a.handle().check_remote().unwrap_err().to_string();
        assert!(e.contains("lease lost") && e.contains("epoch 2"), "{e}");
        assert_eq!(a.info().state, LeaseState::Lost);
        assert!(a.handle().check().is_err());
    }

    #[test]
    fn renewal_failing_until_expiry_loses_it() {
        // The renewal thread marks the lease lost on its own once renewals fail past its
        // expiry (the bound only catches a thread that never does: no speed asserted).
        let r = Arc::new(MemRemote::new());
        let mut a = take(&r, 1200, Takeover::Refuse).unwrap();
        a.start_renewal().unwrap();
        r.fail_after(Some(0));
        let t0 = Instant::now();
        while a.info().state == LeaseState::Held {
            assert!(t0.elapsed() < Duration::from_secs(60), "never lost");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(a.handle().check().is_err());
        r.fail_after(None);

        // Whatever the threads' scheduling, `check` refuses once the last good renewal's
        // send + ttl has passed (it was sent before `t0`), not when the thread gets to it:
        // an earlier version asserted the thread's promptness and failed on loaded cores.
        let r = Arc::new(MemRemote::new());
        let mut b = take(&r, 1200, Takeover::Refuse).unwrap();
        b.start_renewal().unwrap();
        r.fail_after(Some(0));
        std::thread::sleep(Duration::from_millis(1200));
        assert!(b.handle().check().is_err());
        r.fail_after(None);
    }

    /// The holder's own way to a shared remote, which a test can cut (an outage on its
    /// side only) while other writers still reach the remote.
    struct Gate {
        inner: Arc<MemRemote>,
        cut: std::sync::atomic::AtomicBool,
    }

    impl Gate {
        fn open(&self) -> RemoteResult<()> {
            if self.cut.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(RemoteError::Temporary {
                    op: "any",
                    key: KEY.into(),
                    reason: "injected outage".into(),
                });
            }
            Ok(())
        }
    }

    use crate::persist::remote::{ObjectInfo, RemoteResult};

    impl Remote for Gate {
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn get(&self, key: &str) -> RemoteResult<Bytes> {
            self.open()?;
            self.inner.get(key)
        }
        fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> RemoteResult<Bytes> {
            self.open()?;
            self.inner.get_range(key, range)
        }
        fn head(&self, key: &str) -> RemoteResult<Option<ObjectInfo>> {
            self.open()?;
            self.inner.head(key)
        }
        fn put(&self, key: &str, data: Bytes, mode: PutMode) -> RemoteResult<Option<String>> {
            self.open()?;
            self.inner.put(key, data, mode)
        }
        fn delete(&self, key: &str) -> RemoteResult<()> {
            self.open()?;
            self.inner.delete(key)
        }
        fn list(&self, prefix: &str) -> RemoteResult<Vec<ObjectInfo>> {
            self.open()?;
            self.inner.list(prefix)
        }
    }

    /// A lease on `r` through a gate the test can cut, renewing, cut until it has lapsed.
    /// (Tests use a ttl of seconds: a lease taken back must not lapse again because a
    /// loaded machine did not run the renewal thread for a moment.)
    fn lapsed(r: &Arc<MemRemote>, ttl_ms: u64) -> (Lease, Arc<Gate>) {
        let gate = Arc::new(Gate {
            inner: r.clone(),
            cut: Default::default(),
        });
        let mut a = Lease::acquire(
            gate.clone(),
            KEY,
            Duration::from_millis(ttl_ms),
            Takeover::Refuse,
            None,
            &new_holder_id(),
        )
        .unwrap();
        a.start_renewal().unwrap();
        gate.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        // (A hang guard only: how soon it lapses is the renewal thread's business.)
        let t0 = Instant::now();
        while a.info().state == LeaseState::Held {
            assert!(t0.elapsed() < Duration::from_secs(60), "never lapsed");
            std::thread::sleep(Duration::from_millis(20));
        }
        let e = a.handle().check().unwrap_err().to_string();
        assert!(e.starts_with("lease lapsed: "), "{e}");
        (a, gate)
    }

    #[test]
    fn a_lease_lapsed_in_an_outage_is_taken_back_once_the_remote_answers() {
        // An outage longer than the ttl used to leave the lease lost until keel restarted:
        // no checkpoint ever again after the remote came back.
        let r = Arc::new(MemRemote::new());
        let (a, gate) = lapsed(&r, 3000);
        assert_eq!(a.info().epoch, 1);
        gate.cut.store(false, std::sync::atomic::Ordering::SeqCst);
        let t0 = Instant::now();
        while a.info().state != LeaseState::Held {
            assert!(t0.elapsed() < Duration::from_secs(60), "never taken back");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(a.handle().check().unwrap(), 2, "taken back as a new epoch");
        assert_eq!(a.handle().check_remote().unwrap(), 2);
        // It is really held: another writer is refused.
        assert!(matches!(
            take(&r, 1200, Takeover::Refuse),
            Err(LeaseError::Held { epoch: 2, .. })
        ));
    }

    #[test]
    fn a_lease_taken_over_during_the_lapse_stays_lost() {
        let r = Arc::new(MemRemote::new());
        let (a, gate) = lapsed(&r, 3000);
        // Someone else took the workspace while we could not reach the remote.
        let b = take(&r, 30_000, Takeover::Force).unwrap();
        assert_eq!(b.info().epoch, 2);
        gate.cut.store(false, std::sync::atomic::Ordering::SeqCst);
        let t0 = Instant::now();
        loop {
            let e = a.handle().check().unwrap_err().to_string();
            if e.starts_with("lease lost: ") {
                assert!(e.contains("epoch 2"), "{e}");
                break;
            }
            assert!(e.starts_with("lease lapsed: "), "{e}");
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the takeover never noticed"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(a.info().state, LeaseState::Lost);
        assert_eq!(
            b.handle().check_remote().unwrap(),
            2,
            "the new holder keeps it"
        );
    }

    #[test]
    fn a_lease_pending_since_the_start_is_taken_when_the_remote_answers() {
        let r = Arc::new(MemRemote::new());
        let old = take(&r, 30_000, Takeover::Refuse).unwrap();
        let id = old.holder_id();
        drop(old); // killed: live, never released
        let gate = Arc::new(Gate {
            inner: r.clone(),
            cut: Default::default(),
        });
        gate.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        let e = Lease::acquire(
            gate.clone(),
            KEY,
            Duration::from_millis(3000),
            Takeover::Refuse,
            Some(&id),
            &id,
        )
        .err()
        .unwrap();
        assert!(e.is_temporary(), "{e}");
        let mut a = Lease::pending(
            gate.clone(),
            KEY,
            Duration::from_millis(3000),
            Takeover::Refuse,
            Some(&id),
            &e,
        );
        a.start_renewal().unwrap();
        let e = a.handle().check().unwrap_err().to_string();
        assert!(e.starts_with("lease lapsed: not acquired yet"), "{e}");
        gate.cut.store(false, std::sync::atomic::Ordering::SeqCst);
        let t0 = Instant::now();
        while a.info().state != LeaseState::Held {
            assert!(t0.elapsed() < Duration::from_secs(60), "never acquired");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Its own previous lease, taken back at once (live), as a new epoch, same holder.
        assert_eq!(a.handle().check_remote().unwrap(), 2);
        assert_eq!(a.holder_id(), id);

        // Another writer's live lease is not taken (refuse): lost for good, saying whose.
        let r = Arc::new(MemRemote::new());
        let _other = take(&r, 30_000, Takeover::Refuse).unwrap();
        let why = LeaseError::Read {
            key: KEY.into(),
            source: RemoteError::Temporary {
                op: "head",
                key: KEY.into(),
                reason: "test".into(),
            },
        };
        let mut b = Lease::pending(
            r.clone(),
            KEY,
            Duration::from_millis(1200),
            Takeover::Refuse,
            Some("someone-else"),
            &why,
        );
        b.start_renewal().unwrap();
        let t0 = Instant::now();
        loop {
            let e = b.handle().check().unwrap_err().to_string();
            if e.starts_with("lease lost: ") {
                assert!(e.contains("in use by another writer"), "{e}");
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "never decided");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn wait_takes_an_abandoned_lease_after_it_expires() {
        let r = Arc::new(MemRemote::new());
        let a = take(&r, 30_000, Takeover::Refuse).unwrap();
        drop(a); // killed: never released
        assert!(take(&r, 30_000, Takeover::Refuse).is_err());
        // Its last renewal left it one second (written here, as that renewal would have).
        let mut rec = stored(&r);
        let t0 = Instant::now();
        rec.expires_ns = now_ns() + 1_000_000_000;
        rec.ttl_ms = 1000;
        r.put(
            KEY,
            Bytes::from(serde_json::to_vec(&rec).unwrap()),
            PutMode::Overwrite,
        )
        .unwrap();
        let b = take(&r, 30_000, Takeover::Wait).unwrap();
        // Not before it expired (the slack is the wall clock's granularity).
        assert!(
            t0.elapsed() >= Duration::from_millis(980),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(b.info().epoch, 2);
    }

    #[test]
    fn head_epoch_fence() {
        let r = Arc::new(MemRemote::new());
        let a = take(&r, 30_000, Takeover::Refuse).unwrap();
        a.handle().check_head_epoch(1).unwrap();
        assert!(a.handle().check_head_epoch(2).is_err());
        assert_eq!(a.info().state, LeaseState::Lost);
    }
}

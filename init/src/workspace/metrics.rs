//! FUSE request metrics, kept in static atomics indexed by operation, with no allocation,
//! lock or map on the hot path: `begin` counts the request (one relaxed atomic add) and, for
//! one request in `SAMPLE` on each thread, returns a `Timer` that records its latency into
//! the operation's histogram when dropped (after the reply is sent). Reading the clock twice
//! costs more than everything else together (~40 ns each here), so only a sample is timed:
//! the histogram's quantiles and mean are those of the sample, its `_count` is the number of
//! timed requests; `keel_fuse_requests_total` counts them all. `failed` counts an error by
//! operation and errno and
//! logs it with the operation's name, warn for EIO-class errors and debug for expected ones,
//! at most `LOG_BURST` lines per `LOG_WINDOW` so a failing loop cannot flood the log.
//! `encode` writes it all for `/metrics`. The numbers are process-wide (one mount per keel).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

macro_rules! ops {
    ($($v:ident = $name:literal,)*) => {
        /// A FUSE operation keel serves.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Op { $($v,)* }
        impl Op {
            pub const ALL: &'static [Op] = &[$(Op::$v,)*];
            /// The lower-case FUSE name, as in the `op` label.
            pub fn name(self) -> &'static str {
                match self { $(Op::$v => $name,)* }
            }
        }
    };
}

ops! {
    Lookup = "lookup", Forget = "forget", Getattr = "getattr", Setattr = "setattr",
    Readlink = "readlink", Mknod = "mknod", Mkdir = "mkdir", Unlink = "unlink", Rmdir = "rmdir",
    Symlink = "symlink", Rename = "rename", Link = "link", Open = "open", Read = "read",
    Write = "write", Flush = "flush", Release = "release", Fsync = "fsync",
    Opendir = "opendir", Readdir = "readdir", Readdirplus = "readdirplus",
    Releasedir = "releasedir", Fsyncdir = "fsyncdir", Statfs = "statfs",
    Setxattr = "setxattr", Getxattr = "getxattr", Listxattr = "listxattr",
    Removexattr = "removexattr", Access = "access", Create = "create", Ioctl = "ioctl",
    Fallocate = "fallocate", Lseek = "lseek", CopyFileRange = "copy_file_range",
}

const OPS: usize = Op::ALL.len();
/// Upper bounds of the latency buckets in nanoseconds (10 µs .. 1 s; +Inf follows).
const BOUNDS_NS: [u64; 12] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    10_000_000,
    50_000_000,
    250_000_000,
    1_000_000_000,
];
const BUCKETS: usize = BOUNDS_NS.len() + 1;
/// Errno values with a slot of their own; larger ones share slot 0.
const ERRNOS: usize = 134;

/// One request in this many (per thread, its first one included) is timed.
pub const SAMPLE: u32 = 8;

struct OpStats {
    /// Every request.
    count: AtomicU64,
    /// The timed ones, per bucket (not cumulative), and their total time.
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)] // Only ever used to fill the statics.
const ZERO: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const OP_ZERO: OpStats = OpStats {
    count: ZERO,
    buckets: [ZERO; BUCKETS],
    sum_ns: ZERO,
};
#[allow(clippy::declare_interior_mutable_const)]
const ERR_ZERO: [AtomicU64; ERRNOS] = [ZERO; ERRNOS];

static STATS: [OpStats; OPS] = [OP_ZERO; OPS];
static ERRORS: [[AtomicU64; ERRNOS]; OPS] = [ERR_ZERO; OPS];
static READ_BYTES: AtomicU64 = ZERO;
static WRITE_BYTES: AtomicU64 = ZERO;
static PASSTHROUGH_OPENS: AtomicU64 = ZERO;

thread_local! {
    /// The operation this thread is serving (so `failed` can name it), and how many
    /// requests it has begun (for the sample).
    static CURRENT: (Cell<Op>, Cell<u32>) = const { (Cell::new(Op::Lookup), Cell::new(0)) };
}

/// Times one sampled request; records it when dropped. Hold it until the reply is sent.
#[must_use]
pub struct Timer {
    op: Op,
    start: Option<Instant>,
}

/// A request of kind `op` begins on this thread.
#[inline]
pub fn begin(op: Op) -> Timer {
    STATS[op as usize].count.fetch_add(1, Relaxed);
    let n = CURRENT.with(|(cur, n)| {
        cur.set(op);
        let v = n.get();
        n.set(v.wrapping_add(1));
        v
    });
    Timer {
        op,
        start: (n % SAMPLE == 0).then(Instant::now),
    }
}

impl Timer {
    /// The request goes on on this thread (a fetch thread answers it): failures are
    /// counted against its operation.
    pub fn moved_here(&self) {
        CURRENT.with(|(cur, _)| cur.set(self.op));
    }
}

impl Drop for Timer {
    #[inline]
    fn drop(&mut self) {
        let Some(start) = self.start else { return };
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let s = &STATS[self.op as usize];
        let b = BOUNDS_NS
            .iter()
            .position(|&b| ns <= b)
            .unwrap_or(BOUNDS_NS.len());
        s.buckets[b].fetch_add(1, Relaxed);
        s.sum_ns.fetch_add(ns, Relaxed);
    }
}

/// Bytes returned by READ and taken by WRITE through keel (not through passthrough).
pub fn read_bytes(n: usize) {
    READ_BYTES.fetch_add(n as u64, Relaxed);
}
pub fn write_bytes(n: usize) {
    WRITE_BYTES.fetch_add(n as u64, Relaxed);
}
/// An open the kernel serves by passthrough from now on (its bytes never reach keel).
pub fn passthrough_open() {
    PASSTHROUGH_OPENS.fetch_add(1, Relaxed);
}

/// Errors that mean something is wrong (the store, the disk), not a caller's mistake.
fn alarming(errno: i32) -> bool {
    matches!(
        errno,
        libc::EIO | libc::ENOSPC | libc::EDQUOT | libc::ENOMEM | libc::EFAULT | libc::EROFS
    )
}

/// Log lines per window, whatever the level, before the rest are only counted.
const LOG_BURST: u64 = 20;
const LOG_WINDOW: Duration = Duration::from_secs(10);

/// Counts the current request's failure with `errno` and logs it (rate-limited).
#[cold]
pub fn failed(errno: i32, why: &dyn std::fmt::Display) {
    let op = CURRENT.with(|(cur, _)| cur.get());
    let slot = usize::try_from(errno)
        .ok()
        .filter(|&e| e < ERRNOS)
        .unwrap_or(0);
    ERRORS[op as usize][slot].fetch_add(1, Relaxed);
    let warn = alarming(errno);
    let wanted = if warn {
        tracing::enabled!(tracing::Level::WARN)
    } else {
        tracing::enabled!(tracing::Level::DEBUG)
    };
    if !wanted {
        return;
    }
    let Some(dropped) = LIMIT.admit() else { return };
    let (op, errno) = (op.name(), errno_name(errno));
    match (warn, dropped) {
        (true, 0) => tracing::warn!(op, errno, error = %why, "FUSE request failed"),
        (true, n) => tracing::warn!(op, errno, error = %why, suppressed = n, "FUSE request failed"),
        (false, 0) => tracing::debug!(op, errno, error = %why, "FUSE request failed"),
        (false, n) => {
            tracing::debug!(op, errno, error = %why, suppressed = n, "FUSE request failed")
        }
    }
}

/// At most `LOG_BURST` admissions per `LOG_WINDOW`; says how many were refused since the
/// last admission. A mutex is fine here: only failures that would be logged come this far.
struct Limiter(std::sync::Mutex<(Instant, u64, u64)>);

static LIMIT: LazyLock<Limiter> =
    LazyLock::new(|| Limiter(std::sync::Mutex::new((Instant::now(), 0, 0))));

impl Limiter {
    fn admit(&self) -> Option<u64> {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (start, used, dropped) = &mut *g;
        if start.elapsed() >= LOG_WINDOW {
            (*start, *used) = (Instant::now(), 0);
        }
        if *used >= LOG_BURST {
            *dropped += 1;
            return None;
        }
        *used += 1;
        Some(std::mem::take(dropped))
    }
}

/// `ENOENT` for 2; the number itself for values without a name.
pub fn errno_name(errno: i32) -> String {
    let e = nix::errno::Errno::from_raw(errno);
    if e == nix::errno::Errno::UnknownErrno {
        errno.to_string()
    } else {
        format!("{e:?}")
    }
}

/// Requests served of kind `op` so far.
pub fn requests(op: Op) -> u64 {
    STATS[op as usize].count.load(Relaxed)
}

/// Requests served so far per operation, those seen only, as `op:count` words (for the
/// counters line `keel mount` logs on SIGUSR1).
pub fn requests_by_op() -> String {
    let seen = Op::ALL
        .iter()
        .map(|&op| (op, requests(op)))
        .filter(|&(_, n)| n > 0);
    seen.map(|(op, n)| format!("{}:{n}", op.name()))
        .collect::<Vec<_>>()
        .join(",")
}

/// Writes the FUSE metrics: requests and latency by operation (latency only for operations
/// seen), errors by operation and errno (only those seen), bytes and passthrough opens.
pub fn encode(enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(
        "keel_fuse_requests",
        "FUSE requests served, by operation.",
        None,
        MetricType::Counter,
    )?;
    for &op in Op::ALL {
        ConstCounter::new(requests(op)).encode(m.encode_family(&[("op", op.name())])?)?;
    }
    let mut m = enc.encode_descriptor(
        "keel_fuse_request_duration_seconds",
        "Time from receiving a FUSE request to sending its reply, by operation; one request in 8 per thread is timed.",
        None,
        MetricType::Histogram,
    )?;
    for &op in Op::ALL {
        let s = &STATS[op as usize];
        // Per bucket: the encoder makes them cumulative.
        let mut count = 0;
        let mut buckets = [(0.0, 0); BUCKETS];
        for (i, b) in s.buckets.iter().enumerate() {
            let n = b.load(Relaxed);
            count += n;
            let bound = BOUNDS_NS
                .get(i)
                .map_or(f64::INFINITY, |&ns| ns as f64 / 1e9);
            buckets[i] = (bound, n);
        }
        if count == 0 {
            continue;
        }
        let sum = s.sum_ns.load(Relaxed) as f64 / 1e9;
        m.encode_family(&[("op", op.name())])?
            .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
    }
    let mut m = enc.encode_descriptor(
        "keel_fuse_errors",
        "FUSE requests answered with an error, by operation and errno.",
        None,
        MetricType::Counter,
    )?;
    for &op in Op::ALL {
        for (errno, n) in ERRORS[op as usize].iter().enumerate() {
            let n = n.load(Relaxed);
            if n > 0 {
                let name = if errno == 0 {
                    "other".to_string()
                } else {
                    errno_name(errno as i32)
                };
                let labels = [("op", op.name()), ("errno", name.as_str())];
                ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
            }
        }
    }
    for (name, help, v) in [
        (
            "keel_fuse_read_bytes",
            "Bytes returned by FUSE READ requests keel served (passthrough reads excluded).",
            &READ_BYTES,
        ),
        (
            "keel_fuse_write_bytes",
            "Bytes taken by FUSE WRITE requests keel served (passthrough writes excluded).",
            &WRITE_BYTES,
        ),
        (
            "keel_fuse_passthrough_opens",
            "Opens handed to kernel passthrough; their reads and writes bypass keel.",
            &PASSTHROUGH_OPENS,
        ),
    ] {
        let m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
        ConstCounter::new(v.load(Relaxed)).encode(m)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_counts_and_errors_name_the_op() {
        let before = requests(Op::Statfs);
        drop(begin(Op::Statfs));
        {
            let _t = begin(Op::Statfs);
            failed(libc::ENOENT, &"nope");
        }
        assert_eq!(requests(Op::Statfs), before + 2);
        assert!(ERRORS[Op::Statfs as usize][libc::ENOENT as usize].load(Relaxed) >= 1);
        assert_eq!(errno_name(libc::ENOENT), "ENOENT");
        assert_eq!(errno_name(9999), "9999");
    }

    /// Prints what timing and counting one request costs (no assertion on time: the
    /// machine is shared). `cargo test --release --lib fuse::tests::cost -- --nocapture`.
    #[test]
    fn cost_per_request_is_printed() {
        let n = 1_000_000u32;
        let t0 = Instant::now();
        for i in 0..n {
            let op = Op::ALL[(i as usize) % 4];
            drop(std::hint::black_box(begin(op)));
        }
        let ns = t0.elapsed().as_nanos() as f64 / f64::from(n);
        println!("fuse metrics: {ns:.1} ns per request (count, and time 1 in {SAMPLE})");
    }

    #[test]
    fn limiter_admits_a_burst_then_counts() {
        let l = Limiter(std::sync::Mutex::new((Instant::now(), 0, 0)));
        for _ in 0..LOG_BURST {
            assert_eq!(l.admit(), Some(0));
        }
        assert_eq!(l.admit(), None);
        assert_eq!(l.admit(), None);
        *l.0.lock().unwrap() = (Instant::now() - LOG_WINDOW, LOG_BURST, 2);
        assert_eq!(l.admit(), Some(2));
    }
}

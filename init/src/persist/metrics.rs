//! Persistence metrics: checkpoints (count by result, duration, chunks and bytes uploaded),
//! remote errors by kind and operation and their retries, restore and lazy-hydration
//! progress. They are process-wide prometheus-client metrics (cheap `Arc`s of atomics; a
//! checkpoint or a remote request is rare next to a FUSE request), registered into every
//! status model's registry.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::remote::RemoteError;

type Labels1 = [(&'static str, &'static str); 1];
type Labels2 = [(&'static str, &'static str); 2];

struct Persist {
    checkpoints: Family<Labels1, Counter>,
    checkpoint_seconds: Histogram,
    uploaded_bytes: Counter,
    uploaded_chunks: Counter,
    remote_errors: Family<Labels2, Counter>,
    remote_retries: Family<Labels1, Counter>,
    restore_chunks_wanted: Gauge,
    restore_chunks_fetched: Gauge,
    restore_bytes_fetched: Gauge,
    hydrated_windows: Counter,
    hydrated_bytes: Counter,
    image_failures: Counter,
}

static M: LazyLock<Persist> = LazyLock::new(|| Persist {
    checkpoints: Family::default(),
    // 10 ms .. ~5.5 min.
    checkpoint_seconds: Histogram::new(exponential_buckets(0.01, 4.0, 9)),
    uploaded_bytes: Counter::default(),
    uploaded_chunks: Counter::default(),
    remote_errors: Family::default(),
    remote_retries: Family::default(),
    restore_chunks_wanted: Gauge::default(),
    restore_chunks_fetched: Gauge::default(),
    restore_bytes_fetched: Gauge::default(),
    hydrated_windows: Counter::default(),
    hydrated_bytes: Counter::default(),
    image_failures: Counter::default(),
});

/// Adds the persistence metrics to `r` (names without `_total`: the encoder adds it).
pub fn register(r: &mut Registry) {
    let m = &*M;
    r.register(
        "keel_checkpoints",
        "Checkpoints taken, by result (ok, empty: nothing to do, failed)",
        m.checkpoints.clone(),
    );
    r.register(
        "keel_checkpoint_duration_seconds",
        "Time each checkpoint took, successful or not",
        m.checkpoint_seconds.clone(),
    );
    r.register(
        "keel_checkpoint_uploaded_bytes",
        "Chunk bytes checkpoints sent to the remote",
        m.uploaded_bytes.clone(),
    );
    r.register(
        "keel_checkpoint_uploaded_chunks",
        "Chunks checkpoints sent to the remote",
        m.uploaded_chunks.clone(),
    );
    r.register(
        "keel_remote_errors",
        "Failed object-store requests (each attempt), by operation and kind",
        m.remote_errors.clone(),
    );
    r.register(
        "keel_remote_retries",
        "Object-store requests retried after a temporary error, by operation",
        m.remote_retries.clone(),
    );
    r.register(
        "keel_restore_chunks_wanted",
        "Chunks the running or last restore fetches in all",
        m.restore_chunks_wanted.clone(),
    );
    r.register(
        "keel_restore_chunks_fetched",
        "Chunks the running or last restore has fetched so far",
        m.restore_chunks_fetched.clone(),
    );
    r.register(
        "keel_restore_fetched_bytes",
        "Bytes the running or last restore has fetched so far",
        m.restore_bytes_fetched.clone(),
    );
    r.register(
        "keel_hydration_windows",
        "File windows fetched from the remote on first access (lazy restore)",
        m.hydrated_windows.clone(),
    );
    r.register(
        "keel_hydration_bytes",
        "Bytes written into file bodies on first access (lazy restore)",
        m.hydrated_bytes.clone(),
    );
    r.register(
        "keel_checkpoint_image_failures",
        "Full snapshots written without their metadata image because building or uploading it failed (retried by a later checkpoint)",
        m.image_failures.clone(),
    );
}

/// One checkpoint ended after `took`: `Some((seq_taken, chunks, bytes))` when it succeeded.
pub fn checkpoint(outcome: Option<(bool, u64, u64)>, took: Duration) {
    let m = &*M;
    let result = match outcome {
        Some((true, ..)) => "ok",
        Some((false, ..)) => "empty",
        None => "failed",
    };
    m.checkpoints.get_or_create(&[("result", result)]).inc();
    m.checkpoint_seconds.observe(took.as_secs_f64());
    if let Some((_, chunks, bytes)) = outcome {
        m.uploaded_chunks.inc_by(chunks);
        m.uploaded_bytes.inc_by(bytes);
    }
}

/// One object-store request `op` failed with `e`; `retrying` when it will be tried again.
pub fn remote_error(op: &'static str, e: &RemoteError, retrying: bool) {
    let kind = match e {
        RemoteError::NotFound { .. } => "not_found",
        RemoteError::AlreadyExists { .. } => "already_exists",
        RemoteError::Precondition { .. } => "precondition",
        RemoteError::Temporary { .. } => "temporary",
        RemoteError::Permanent { .. } => "permanent",
        RemoteError::Open { .. } => "open",
    };
    M.remote_errors
        .get_or_create(&[("op", op), ("kind", kind)])
        .inc();
    if retrying {
        M.remote_retries.get_or_create(&[("op", op)]).inc();
    }
}

/// A restore has fetched `chunks` of `wanted` chunks, `bytes` bytes, so far.
pub fn restore_progress(chunks: u64, bytes: u64, wanted: usize) {
    let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    M.restore_chunks_wanted.set(g(wanted as u64));
    M.restore_chunks_fetched.set(g(chunks));
    M.restore_bytes_fetched.set(g(bytes));
}

/// Lazy restore fetched `windows` windows and wrote `bytes` bytes for one access.
pub fn hydrated(windows: usize, bytes: u64) {
    M.hydrated_windows.inc_by(windows as u64);
    M.hydrated_bytes.inc_by(bytes);
}

/// A full snapshot's metadata image could not be built or uploaded.
pub fn image_failed() {
    M.image_failures.inc();
}

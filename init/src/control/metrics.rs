//! `GET /metrics`: every metric through prometheus-client, in the Prometheus text format
//! (version 0.0.4), from one registry built once per status model. Three sources feed it:
//! the status model itself (read at scrape time by `StatusCollector`), the FUSE adapter's
//! per-operation atomics (`fuse`), and persistence's counters and histograms (`persist`).
//! Every state of `keel_services` is always present (0 when empty) so dashboards see stable
//! series; the persistence gauges published through the status model appear only once
//! persistence has published them. Units are in the names (`_seconds`, `_bytes`).

use crate::persist::metrics as persist;
use crate::workspace::metrics as fuse;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::status::{ServiceState, StatusHandle, WeakStatus};

pub use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The exposition for `status`'s registry.
pub fn render(status: &StatusHandle) -> String {
    let mut out = String::new();
    if let Err(e) =
        prometheus_client::encoding::prometheus_text::encode(&mut out, status.registry())
    {
        tracing::warn!("metrics: encode: {e}");
    }
    out
}

/// The registry for one status model: built once, when the model is.
pub(crate) fn registry(status: WeakStatus) -> Registry {
    let mut r = Registry::default();
    persist::register(&mut r);
    r.register_collector(Box::new(StatusCollector(status)));
    r.register_collector(Box::new(FuseCollector));
    r
}

#[derive(Debug)]
struct FuseCollector;

impl Collector for FuseCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        fuse::encode(&mut enc)
    }
}

/// Reads the status model at scrape time (weakly: the model owns the registry).
#[derive(Debug)]
struct StatusCollector(WeakStatus);

/// A gauge without labels; `v` is `i64` or `f64`.
fn gauge<V>(enc: &mut DescriptorEncoder, name: &str, help: &str, v: V) -> std::fmt::Result
where
    ConstGauge<V>: EncodeMetric,
{
    ConstGauge::new(v).encode(enc.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for StatusCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some(status) = self.0.upgrade() else {
            return Ok(());
        };
        let r = status.report();
        let mut m = enc.encode_descriptor(
            "keel_info",
            "keel version and workspace cache mode.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(1)
            .encode(m.encode_family(&[("version", r.version), ("cache", r.mount.cache)])?)?;
        let flag = |b: bool| i64::from(b);
        gauge(&mut enc, "keel_up", "1 while keel runs.", 1_i64)?;
        gauge(
            &mut enc,
            "keel_uptime_seconds",
            "Seconds since keel started.",
            r.uptime_seconds,
        )?;
        gauge(
            &mut enc,
            "keel_healthy",
            "1 when GET /health answers 200.",
            flag(r.healthy),
        )?;
        gauge(
            &mut enc,
            "keel_stopping",
            "1 once keel has begun to stop.",
            flag(r.stopping.is_some()),
        )?;
        gauge(
            &mut enc,
            "keel_workspace_mounted",
            "1 while the FUSE workspace is mounted.",
            flag(r.mount.mounted),
        )?;
        let mem = &r.memory;
        if let Some(rss) = mem.rss_bytes {
            gauge(
                &mut enc,
                "keel_memory_rss_bytes",
                "keel's resident memory now.",
                int(rss),
            )?;
        }
        gauge(
            &mut enc,
            "keel_memory_peak_bytes",
            "keel's peak resident memory since it started.",
            int(mem.peak_bytes),
        )?;
        gauge(
            &mut enc,
            "keel_memory_budget_bytes",
            "keel's memory budget ([workspace] memory_budget, or from the cgroup's memory.max).",
            int(mem.budget_bytes),
        )?;
        if let Some(p) = mem.last_checkpoint_peak_bytes {
            gauge(
                &mut enc,
                "keel_memory_last_checkpoint_peak_bytes",
                "keel's peak resident memory during the last checkpoint.",
                int(p),
            )?;
        }
        if let (Some(op), Some(p)) = (&mem.last_operation, mem.last_operation_peak_bytes) {
            let mut m = enc.encode_descriptor(
                "keel_memory_last_operation_peak_bytes",
                "keel's peak resident memory during the last operation (checkpoint, snapshot_create, diff, rollback, gc, fsck, restore, fork).",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(int(p)).encode(m.encode_family(&[("operation", op.as_str())])?)?;
        }
        if let Some(on) = r.mount.passthrough {
            gauge(
                &mut enc,
                "keel_fuse_passthrough_enabled",
                "1 when the kernel accepted FUSE passthrough for this mount.",
                flag(on),
            )?;
        }

        let mut m = enc.encode_descriptor(
            "keel_services",
            "Supervised processes (services and the main command) by state.",
            None,
            MetricType::Gauge,
        )?;
        for st in ServiceState::ALL {
            let n = r.services.iter().filter(|s| s.state == st).count();
            ConstGauge::new(n as i64).encode(m.encode_family(&[("state", st.as_str())])?)?;
        }
        let mut m = enc.encode_descriptor(
            "keel_service_restarts",
            "Restarts of each service since keel started.",
            None,
            MetricType::Counter,
        )?;
        for s in &r.services {
            ConstCounter::new(s.restarts)
                .encode(m.encode_family(&[("service", s.name.as_str())])?)?;
        }
        let mut m = enc.encode_descriptor(
            "keel_service_up",
            "1 while the service's process runs.",
            None,
            MetricType::Gauge,
        )?;
        for s in &r.services {
            ConstGauge::new(i64::from(s.pid.is_some()))
                .encode(m.encode_family(&[("service", s.name.as_str())])?)?;
        }

        let p = &r.persist;
        if let Some(t) = p.last_checkpoint_unix {
            gauge(
                &mut enc,
                "keel_last_checkpoint_timestamp_seconds",
                "Unix time of the last committed checkpoint.",
                t,
            )?;
        }
        let known: [(&str, &str, Option<i64>); 5] = [
            (
                "keel_workspace_dirty_bytes",
                "Bytes changed since the last checkpoint.",
                p.dirty_bytes.map(int),
            ),
            (
                "keel_workspace_dirty_files",
                "Files changed since the last checkpoint.",
                p.dirty_files.map(int),
            ),
            (
                "keel_remote_backlog_bytes",
                "Bytes committed locally but not yet on the remote.",
                p.remote_backlog_bytes.map(int),
            ),
            (
                "keel_remote_backlog_chunks",
                "Chunks committed locally but not yet on the remote.",
                p.remote_backlog_chunks.map(int),
            ),
            (
                "keel_lease_held",
                "1 while this keel holds the workspace's writer lease.",
                p.lease.as_ref().map(|l| flag(l.held)),
            ),
        ];
        for (name, help, v) in known {
            if let Some(v) = v {
                gauge(&mut enc, name, help, v)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::control::status::{MountState, ServiceStatus, StatusHandle};

    #[test]
    fn exposition_lines() {
        let h = StatusHandle::new(&Config::default());
        h.set_mount(MountState::Disabled);
        h.set_services(
            vec![ServiceStatus {
                name: "we\"ird\\name".into(),
                main: false,
                pid: Some(7),
                state: ServiceState::Running,
                probed: false,
                restarts: 3,
                last_exit: None,
            }],
            None,
        );
        // The first request on a thread is always timed.
        std::thread::spawn(|| drop(fuse::begin(fuse::Op::Mknod)))
            .join()
            .unwrap();
        let text = render(&h);
        // The encoder's buckets are cumulative: +Inf is the count.
        let sample = |prefix: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(prefix)?
                        .strip_prefix(' ')?
                        .parse::<f64>()
                        .ok()
                })
                .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
        };
        let h_ = "keel_fuse_request_duration_seconds";
        let count = sample(&format!("{h_}_count{{op=\"mknod\"}}"));
        assert!(count >= 1.0);
        assert_eq!(
            sample(&format!("{h_}_bucket{{op=\"mknod\",le=\"+Inf\"}}")),
            count
        );
        assert!(sample(&format!("{h_}_bucket{{op=\"mknod\",le=\"1e-05\"}}")) <= count);
        assert!(sample("keel_fuse_requests_total{op=\"mknod\"}") >= count);
        for want in [
            "keel_up 1\n",
            "keel_healthy 1\n",
            "keel_workspace_mounted 0\n",
            "keel_services{state=\"running\"} 1\n",
            "keel_services{state=\"restarting\"} 0\n",
            "keel_service_restarts_total{service=\"we\\\"ird\\\\name\"} 3\n",
            "# TYPE keel_service_restarts_total counter\n",
            "# TYPE keel_fuse_requests_total counter\n",
            "keel_fuse_requests_total{op=\"getattr\"} ",
            "# TYPE keel_checkpoint_duration_seconds histogram\n",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        assert!(!text.contains("keel_workspace_dirty_bytes"), "{text}");
        h.update_persist(|p| p.dirty_bytes = Some(10));
        assert!(render(&h).contains("keel_workspace_dirty_bytes 10\n"));
        // Every sample line is `name{labels} value` or `name value`.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = l.rsplit_once(' ').unwrap();
            v.parse::<f64>()
                .unwrap_or_else(|_| panic!("bad sample {l:?}"));
        }
    }
}

//! `GET /metrics`: the status model in the Prometheus text exposition format (version 0.0.4).
//! Every state of `keel_services` is always present (0 when empty) so dashboards see stable
//! series; persistence gauges appear only once persistence has published them.

use std::fmt::Write;

use super::status::{Report, ServiceState};

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Escapes a label value: backslash, double quote and newline.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn gauge(out: &mut String, name: &str, help: &str, v: impl std::fmt::Display) {
    head(out, name, "gauge", help);
    let _ = writeln!(out, "{name} {v}");
}

/// Renders the whole exposition.
pub fn render(r: &Report) -> String {
    let mut out = String::new();
    head(
        &mut out,
        "keel_info",
        "gauge",
        "keel version and workspace cache mode.",
    );
    let _ = writeln!(
        out,
        "keel_info{{version=\"{}\",cache=\"{}\"}} 1",
        label(r.version),
        label(r.mount.cache)
    );
    gauge(&mut out, "keel_up", "1 while keel runs.", 1);
    gauge(
        &mut out,
        "keel_uptime_seconds",
        "Seconds since keel started.",
        r.uptime_seconds,
    );
    gauge(
        &mut out,
        "keel_healthy",
        "1 when GET /health answers 200.",
        u8::from(r.healthy),
    );
    gauge(
        &mut out,
        "keel_stopping",
        "1 once keel has begun to stop.",
        u8::from(r.stopping.is_some()),
    );
    gauge(
        &mut out,
        "keel_workspace_mounted",
        "1 while the FUSE workspace is mounted.",
        u8::from(r.mount.mounted),
    );

    head(
        &mut out,
        "keel_services",
        "gauge",
        "Supervised processes (services and the main command) by state.",
    );
    for st in ServiceState::ALL {
        let n = r.services.iter().filter(|s| s.state == st).count();
        let _ = writeln!(out, "keel_services{{state=\"{}\"}} {n}", st.as_str());
    }
    head(
        &mut out,
        "keel_service_restarts_total",
        "counter",
        "Restarts of each service since keel started.",
    );
    for s in &r.services {
        let _ = writeln!(
            out,
            "keel_service_restarts_total{{service=\"{}\"}} {}",
            label(&s.name),
            s.restarts
        );
    }
    head(
        &mut out,
        "keel_service_up",
        "gauge",
        "1 while the service's process runs.",
    );
    for s in &r.services {
        let _ = writeln!(
            out,
            "keel_service_up{{service=\"{}\"}} {}",
            label(&s.name),
            u8::from(s.pid.is_some())
        );
    }

    let p = &r.persist;
    let known: [(&str, &str, Option<f64>); 6] = [
        (
            "keel_workspace_dirty_bytes",
            "Bytes changed since the last checkpoint.",
            p.dirty_bytes.map(|v| v as f64),
        ),
        (
            "keel_workspace_dirty_files",
            "Files changed since the last checkpoint.",
            p.dirty_files.map(|v| v as f64),
        ),
        (
            "keel_last_checkpoint_timestamp_seconds",
            "Unix time of the last committed checkpoint.",
            p.last_checkpoint_unix,
        ),
        (
            "keel_remote_backlog_bytes",
            "Bytes committed locally but not yet on the remote.",
            p.remote_backlog_bytes.map(|v| v as f64),
        ),
        (
            "keel_remote_backlog_chunks",
            "Chunks committed locally but not yet on the remote.",
            p.remote_backlog_chunks.map(|v| v as f64),
        ),
        (
            "keel_lease_held",
            "1 while this keel holds the workspace's writer lease.",
            p.lease.as_ref().map(|l| f64::from(u8::from(l.held))),
        ),
    ];
    for (name, help, v) in known {
        if let Some(v) = v {
            gauge(&mut out, name, help, v);
        }
    }
    out
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
        let text = render(&h.report());
        for want in [
            "keel_up 1\n",
            "keel_healthy 1\n",
            "keel_workspace_mounted 0\n",
            "keel_services{state=\"running\"} 1\n",
            "keel_services{state=\"restarting\"} 0\n",
            "keel_service_restarts_total{service=\"we\\\"ird\\\\name\"} 3\n",
            "# TYPE keel_service_restarts_total counter\n",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        assert!(!text.contains("keel_workspace_dirty_bytes"), "{text}");
        h.update_persist(|p| p.dirty_bytes = Some(10));
        assert!(render(&h.report()).contains("keel_workspace_dirty_bytes 10\n"));
        // Every sample line is `name{labels} value` or `name value`.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = l.rsplit_once(' ').unwrap();
            v.parse::<f64>()
                .unwrap_or_else(|_| panic!("bad sample {l:?}"));
        }
    }
}

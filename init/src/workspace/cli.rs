//! `keel mount`: mounts the workspace in the foreground until SIGTERM/SIGINT/SIGHUP, then
//! syncs and unmounts; SIGUSR1 logs the count of FUSE requests served.

use crate::config::Config;
use crate::sys::fgsig::{Stop, StopSignals};

/// Mounts `cfg`'s workspace and serves it until a stop signal or an unmount from outside;
/// the error is one line for `keel: mount: `.
pub fn mount_foreground(cfg: &Config) -> Result<(), String> {
    let signals = StopSignals::block().map_err(|e| format!("block signals: {e}"))?;
    let mounted = mount(cfg)?;
    loop {
        match signals.wait_or(mounted.ended().fd()) {
            // SIGUSR1: the counters (benchmarks divide keel's CPU time by the requests).
            Ok(Stop::Signal("SIGUSR1")) => {
                let h = mounted.handle();
                tracing::info!(
                    fuse_requests = h.fuse_requests(),
                    fuse_requests_unwaited = h.fuse_requests_unwaited(),
                    sql_statements = crate::meta::statements_run(),
                    by_op = %crate::workspace::metrics::requests_by_op(),
                    "counters"
                );
                continue;
            }
            Ok(Stop::Signal(sig)) => tracing::info!(signal = sig, "stopping"),
            Ok(Stop::Ended) => tracing::warn!(
                mount_point = %mounted.mount_point().display(),
                "the workspace was unmounted from outside (or its connection aborted); saving and stopping"
            ),
            Err(e) => tracing::warn!(error = %e, "waiting for signals failed; unmounting"),
        }
        break;
    }
    mounted.unmount().map_err(|e| e.to_string())
}

/// Mounts like `keel run` does: an empty state dir with a configured remote that holds a
/// snapshot gets it back first (lazily by default), under the lease, so a fresh state dir
/// never starts empty and checkpoints an empty tree over the workspace.
fn mount(cfg: &Config) -> Result<crate::workspace::Mounted, String> {
    if !crate::persist::cli::restore_wanted(cfg) {
        return crate::workspace::mount_persistent(&cfg.workspace, &cfg.persist)
            .map_err(|e| e.to_string());
    }
    let mut lease = crate::persist::cli::lease_and_restore(cfg).map_err(|e| e.to_string())?;
    crate::workspace::session::mount_persistent_leased(&cfg.workspace, &cfg.persist, lease.take())
        .map_err(|e| e.to_string())
}

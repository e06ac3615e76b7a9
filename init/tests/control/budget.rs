//! keel keeps its memory budget (root and /dev/fuse; panics when they are missing while CI
//! is set). Under `memory_budget = "40MiB"`, 150 MB written since the last checkpoint (2,000
//! small files, packed, and six 16 MiB files) are checkpointed in passes of the budget's
//! hash batch (the report says how many) and keel's peak through it stays under the budget:
//! the kernel's measure (VmHWM, reset through `clear_refs` before it) and keel's own
//! (`/status` `memory.last_checkpoint_peak_bytes`). keel says its budget at start, and
//! `/status` and `/metrics` show it with the RSS and the peaks. Before the budget a
//! checkpoint hashed 32 MiB per batch, held the packs built from it beside, and kept a
//! delta's records in memory several times over: about 100 MiB here.

use crate::support;

use support::control::*;
use support::mount::pattern;
use support::pid1::*;

const BUDGET_MIB: u64 = 40;

fn status_kib(pid: i32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
}

#[test]
fn a_small_budget_checkpoints_a_large_write_in_passes_and_stays_under_it() {
    if !require_root_and_fuse("memory budget test") {
        return;
    }
    let cfg = format!(
        "{}interval = \"0s\"\n[control]\nsocket = \"$D/c.sock\"\n[shutdown]\ngrace = \"1s\"\n",
        support::keel::workspace_config(&format!("memory_budget = \"{BUDGET_MIB}MiB\""))
    );
    let mut k = start(&cfg, &["sh", "-c", "exec sleep 100000"]);
    k.wait_log("ready after");
    assert!(
        k.log_text().contains(&format!(
            "memory budget: {BUDGET_MIB} MiB ([workspace] memory_budget)"
        )),
        "{}",
        k.log_text()
    );
    let sock = k.path("c.sock");
    let ws = k.path("ws");
    for d in 0..20u64 {
        let dir = ws.join(format!("pkg{d}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..100u64 {
            std::fs::write(
                dir.join(format!("f{f}.js")),
                pattern(24 * 1024 + 7 * f as usize, d * 1000 + f + 1),
            )
            .unwrap();
        }
    }
    for big in 0..6u64 {
        std::fs::write(
            ws.join(format!("big{big}.bin")),
            pattern(16 << 20, 100_000 + big),
        )
        .unwrap();
    }

    let pid = k.pid();
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset VmHWM");
    let r = unix_request(&sock, "POST", "/checkpoint");
    assert_eq!(r.code, 200, "{r:?}");
    let peak = status_kib(pid, "VmHWM:") * 1024;
    let report = r.json();
    assert!(
        report["bytes_uploaded"].as_u64().unwrap() > 140_000_000,
        "{report}"
    );
    // "snapshot N (delta): ..., 1.234s in 61 batches"
    let done = report["done"].as_str().unwrap();
    let batches: u64 = done
        .rsplit(" in ")
        .next()
        .and_then(|t| t.strip_suffix(" batches"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a checkpoint in batches: {done}"));

    let v = unix_get(&sock, "/status").json();
    let m = &v["memory"];
    let budget = BUDGET_MIB << 20;
    assert_eq!(m["budget_bytes"], budget, "{m}");
    assert!(
        m["budget"].as_str().unwrap().contains("memory_budget"),
        "{m}"
    );
    assert!(m["rss_bytes"].as_u64().unwrap() > 0, "{m}");
    let own = m["last_checkpoint_peak_bytes"].as_u64().unwrap();
    assert!(own > 0, "{m}");
    assert!(m["peak_bytes"].as_u64().unwrap() >= own, "{m}");
    eprintln!(
        "budget: checkpoint of {} bytes in {batches} batches; keel peaked at {} MiB (VmHWM), {} MiB (its own measure); budget {BUDGET_MIB} MiB",
        report["bytes_uploaded"],
        peak >> 20,
        own >> 20
    );
    assert!(peak <= budget, "keel peaked at {} MiB", peak >> 20);
    // 150 MB in passes of B/16 = 2.5 MiB at most (fewer bytes each once near the budget).
    assert!(batches >= 50, "{batches} batches");
    assert!(own <= budget, "keel says it peaked at {} MiB", own >> 20);

    let metrics = unix_get(&sock, "/metrics").body;
    assert_eq!(
        metric(&metrics, "keel_memory_budget_bytes"),
        Some(budget as f64)
    );
    assert!(metric(&metrics, "keel_memory_rss_bytes").is_some_and(|v| v > 0.0));
    assert!(metric(&metrics, "keel_memory_last_checkpoint_peak_bytes").is_some());
    assert!(metrics.contains("keel_memory_last_operation_peak_bytes{operation="));
    k.signal(nix::sys::signal::Signal::SIGTERM);
    k.wait();
}

//! A panic in keel is one line through its logger, as every other line: in text form
//! `keel: error: thread 'NAME' panicked at FILE:LINE:COL: MESSAGE`, and under
//! `KEEL_LOG_FORMAT=json` a JSON object, so a log pipeline that parses keel's lines does not
//! lose the one that matters most. The panic is asked for with `KEEL_DIE_AT=OP/STEP:panic`
//! at the start's lock step, before anything is mounted. Nothing here needs root.

use std::process::Command;

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// `keel mount` panicking at its lock step: its exit code and stderr. Nothing is mounted.
fn panic_at_lock(json: bool) -> (Option<i32>, String) {
    let d = tempfile::tempdir().unwrap();
    let mnt = d.path().join("mnt");
    let mut c = Command::new(KEEL);
    c.arg("mount")
        .arg("--state")
        .arg(d.path().join("state"))
        .arg(&mnt)
        .env("KEEL_DIE_AT", "start/lock:panic")
        .env_remove("RUST_BACKTRACE")
        .env_remove("KEEL_CONFIG")
        .env_remove("KEEL_LOG");
    if json {
        c.env("KEEL_LOG_FORMAT", "json");
    } else {
        c.env_remove("KEEL_LOG_FORMAT");
    }
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        !mnt.exists() || std::fs::read_dir(&mnt).unwrap().next().is_none(),
        "{err}"
    );
    (o.status.code(), err)
}

#[test]
fn a_panic_is_one_line_of_keels_log_in_text_and_in_json() {
    let (code, err) = panic_at_lock(false);
    assert_eq!(code, Some(101), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.is_empty()).collect();
    assert!(lines.iter().all(|l| l.starts_with("keel: ")), "{err}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("keel: error: thread 'main' panicked at ")
                && l.contains("init/src/logging.rs:")
                && l.ends_with("KEEL_DIE_AT: panicking at start/lock, as asked")),
        "{err}"
    );

    let (code, err) = panic_at_lock(true);
    assert_eq!(code, Some(101), "{err}");
    let mut panics = 0;
    for l in err.lines().filter(|l| !l.is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}\n{err}"));
        let msg = v["fields"]["message"].as_str().unwrap_or_default();
        if msg.contains("panicked at") {
            assert_eq!(v["level"], "ERROR", "{l}");
            assert!(msg.contains("panicking at start/lock"), "{l}");
            panics += 1;
        }
    }
    assert_eq!(panics, 1, "{err}");
}

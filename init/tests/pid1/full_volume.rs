//! A state volume the sandbox fills never stops the next start (issue 43): `keel run` with
//! its state dir (and so its default `file://` remote) on a 64 MiB tmpfs the test mounts,
//! the main command filling the workspace until ENOSPC, three times over; then the volume
//! filled to its last byte from outside while keel is stopped. Every stop folds its metadata
//! cleanly, every start says how full the volume is, serves the workspace (what the first
//! round wrote reads back, a new file can be written) and leaves `keel fsck` clean. The same
//! with the `dir` provider, whose tree is on the volume itself: every stop's final walk
//! records what filled it (the space reserves give its commit room), every start opens.

use crate::support;

use std::path::{Path, PathBuf};
use support::pid1::*;

/// Unmounts the tmpfs volume when the test ends (after every keel has stopped).
struct Volume(PathBuf);
impl Drop for Volume {
    fn drop(&mut self) {
        support::mount::lazy_unmount(&self.0);
    }
}

/// The stop's flush budget is a hang guard here (the default 3 s can pass on a loaded
/// machine: keel then detaches the mount without recording a clean stop, which is what the
/// test must not confuse with a full volume).
fn config(state: &Path) -> String {
    format!(
        "[workspace]\nmount_point = \"$D/ws\"\nstate_dir = \"{}\"\n[shutdown]\ngrace = \"5s\"\nflush_timeout = \"120s\"\n",
        state.display()
    )
}

/// Fills the workspace the way an untrusted workload would: directories of one 300 KB
/// file and ten small ones (data and metadata) until a write fails, then prints where.
const FILL: &str = "cd $D/ws; mkdir -p fill$ROUND; cd fill$ROUND; i=0; \
    while :; do mkdir d$i 2>>$D/fill.err || break; \
    head -c 300000 /dev/urandom 2>>$D/fill.err > d$i/f || break; \
    for j in 1 2 3 4 5 6 7 8 9 10; do echo $j 2>>$D/fill.err > d$i/s$j || break 2; done; \
    i=$((i+1)); done; echo \"filled at $i: $(tail -n 1 $D/fill.err)\"";

/// Checks one finished run: exit 0, the start's volume line, a clean fold at the stop (a
/// final checkpoint that found no room on the volume for the remote is allowed: it says so
/// and the workspace is safe in the state dir), then `keel fsck`. Returns the volume line.
fn check_run(k: &mut Keel, state: &Path, what: &str) -> String {
    let (code, _) = k.wait();
    let log = k.log_text();
    assert_eq!(code, 0, "{what}: keel run exited {code}; log:\n{log}");
    let line = log
        .lines()
        .find(|l| l.contains("state volume: ") && l.contains("MiB used"))
        .unwrap_or_else(|| panic!("{what}: the start did not say how full the volume is:\n{log}"))
        .to_string();
    assert!(
        log.contains("workspace flushed"),
        "{what}: the stop did not flush:\n{log}"
    );
    for bad in [
        "workspace unmount: flush",
        "keel stopped without flushing",
        "cannot commit metadata",
        "could not record the clean stop",
        "did not finish within",
    ] {
        assert!(!log.contains(bad), "{what}: {bad:?} in the log:\n{log}");
    }
    let out = std::process::Command::new(KEEL)
        .args(["fsck", "--state"])
        .arg(state)
        .output()
        .expect("run keel fsck");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("0 errors, 0 warnings"),
        "{what}: keel fsck is not clean:\n{text}"
    );
    eprintln!("{what}: {}", line.trim_start_matches("keel: "));
    for l in log
        .lines()
        .filter(|l| l.starts_with("keel: warn") || l.starts_with("keel: error"))
    {
        eprintln!("    {}", l.chars().take(200).collect::<String>());
    }
    line
}

#[test]
fn a_full_state_volume_never_stops_the_next_start() {
    if !require_root_and_fuse("full state volume test") {
        return;
    }
    full_volume_rounds(false);
}

#[test]
fn a_full_state_volume_never_stops_the_next_start_with_dir() {
    if !require_root("full state volume test (dir provider)") {
        return;
    }
    full_volume_rounds(true);
}

fn full_volume_rounds(dir: bool) {
    let vol_dir = tempfile::tempdir().unwrap();
    let vol = vol_dir.path().join("volume");
    std::fs::create_dir(&vol).unwrap();
    support::sys::mount_tmpfs(&vol, "size=64m,mode=755").expect("mount a 64 MiB tmpfs");
    let _vol = Volume(vol.clone());
    let state = vol.join("state");
    let mut cfg = config(&state);
    if dir {
        cfg = cfg.replace("[workspace]\n", "[workspace]\nprovider = \"dir\"\n");
    }

    // Rounds 1-3: the main command fills the volume through the workspace until ENOSPC;
    // keel stops when it ends (the ordered stop: flush, final checkpoint, unmount). With
    // `dir` one round: the workload writes the volume itself, so what keel gives back at
    // a stop is the next round's to fill, and no reserve can be retaken under it.
    for round in 1..=if dir { 1 } else { 3 } {
        let script = format!(
            "ROUND={round}; test $ROUND = 1 && {{ echo kept > $D/ws/keep && sync $D/ws/keep; }}; \
             test \"$(cat $D/ws/keep)\" = kept || exit 3; {FILL}"
        );
        let mut k = start(&cfg, &["sh", "-c", &script]);
        check_run(&mut k, &state, &format!("round {round}"));
        let out = k.stdout();
        // ENOSPC, or EIO for a write through a handle whose create was in a metadata group
        // the full volume could not commit (the group is lost and says so in the log).
        assert!(
            out.contains("filled at")
                && (out.contains("No space left on device") || out.contains("I/O error")),
            "round {round}: the workspace never refused a write: {out}"
        );
        eprintln!("round {round}: {}", out.trim());
    }

    // Round 4: something else takes the volume's last byte while keel is stopped.
    let hog = vol.join("hog");
    let mut f = std::fs::File::create(&hog).unwrap();
    let block = vec![0u8; 64 << 10];
    while std::io::Write::write_all(&mut f, &block).is_ok() {}
    let _ = std::io::Write::write_all(&mut f, &[0u8]);
    drop(f);
    let s = support::sys::statvfs(&vol).unwrap();
    assert_eq!(s.f_bavail, 0, "the hog left room on the volume");
    // With `dir` the tree is on the full volume: a new file has no room, reads work.
    let script = if dir {
        "test \"$(cat $D/ws/keep)\" = kept && ls $D/ws/fill1 | wc -l && echo served"
    } else {
        "test \"$(cat $D/ws/keep)\" = kept && ls $D/ws/fill1 | wc -l && echo served > $D/ws/after && cat $D/ws/after"
    };
    let mut k = start(&cfg, &["sh", "-c", script]);
    let line = check_run(&mut k, &state, "round 4 (volume full at the start)");
    assert!(line.contains("100% full"), "{line}");
    assert!(
        k.stdout().ends_with("served\n"),
        "round 4: the workspace was not served: {}",
        k.stdout()
    );
    if dir {
        assert!(
            k.log_text().contains("provider dir"),
            "round 4: not the dir provider:\n{}",
            k.log_text()
        );
    }
}

//! A state dir and `file://` remote left with loose modes: `keel fsck` warns about every
//! group- or world-accessible file or directory (one line each, then a summary line past
//! ten) and `--repair` makes them 0600/0700; a start tightens a loose state dir and remote
//! with one log line each, and a start on a private one walks nothing. Also prints what the
//! tightening walk costs per entry, and what the check costs on a private root.

use crate::support;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use keel::persist::{open_remote, Persister};
use keel::state::private::{loose_paths, secure_dir};
use support::persist::*;

fn chmod(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

fn mode_of(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// A checkpointed state dir at `state` with its remote at `remote`.
fn make_state(state: &Path, remote: &Path) {
    let url = format!("file://{}", remote.display());
    keel::state::private::create_dir_all(state).unwrap();
    let fs = open_fs(state);
    mkdir(&fs, "d");
    write_file(&fs, "d/small", b"small");
    write_file(&fs, "d/big", &noise(5, 2 * CHUNK as usize));
    let repo = open_remote(&url, &Default::default()).unwrap();
    let mut p = Persister::open(state, repo, params()).unwrap();
    checkpoint(&mut p);
    drop(p);
    drop(fs);
}

/// Every entry below `root` (and `root`), chmod-ed the way keel did before it kept them
/// private under umask 022.
fn loosen_all(root: &Path) {
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = std::fs::symlink_metadata(&p).unwrap();
        if m.is_dir() {
            chmod(&p, 0o755);
            for e in std::fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        } else if m.is_file() {
            chmod(&p, 0o644);
        }
    }
}

fn keel(args: &[&str]) -> (i32, String) {
    let out = Command::new(support::mount::keel_bin())
        .args(args)
        .output()
        .expect("run keel");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn mode_lines(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| l.contains("group- or world-accessible"))
        .collect()
}

#[test]
fn fsck_warns_about_loose_modes_and_repair_fixes_them() {
    let tmp = tempfile::tempdir().unwrap();
    let (state, remote) = (tmp.path().join("state"), tmp.path().join("remote"));
    make_state(&state, &remote);
    assert!(loose_paths(&state).unwrap().is_empty());
    assert!(loose_paths(&remote).unwrap().is_empty());

    // Under private roots: a loose database, body, shard dir and chunk.
    let body = std::fs::read_dir(state.join(keel::state::BODIES))
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
        .map(|e| e.unwrap().path())
        .find(|p| !p.to_string_lossy().contains("/pool/"))
        .expect("a body file");
    let chunk_dir = std::fs::read_dir(remote.join("chunks"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let chunk = std::fs::read_dir(&chunk_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    chmod(&state.join(keel::state::META_DB), 0o644);
    chmod(&body, 0o640);
    chmod(&state.join("bodies/00"), 0o755);
    chmod(&chunk, 0o604);
    chmod(&remote.join("snapshots"), 0o701);

    let s = state.to_str().unwrap();
    let url = format!("file://{}", remote.display());
    let (code, out) = keel(&["fsck", "--state", s, "--remote", &url]);
    println!("{out}");
    assert_eq!(code, 0, "loose modes are warnings, not errors:\n{out}");
    let lines = mode_lines(&out);
    assert_eq!(lines.len(), 5, "{out}");
    for (path, mode) in [
        (state.join(keel::state::META_DB), "0644"),
        (body.clone(), "0640"),
        (state.join("bodies/00"), "0755"),
        (chunk.clone(), "0604"),
        (remote.join("snapshots"), "0701"),
    ] {
        let p = path.display().to_string();
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("warning: ") && l.contains(&p) && l.contains(mode)),
            "no warning names {p} with mode {mode}:\n{out}"
        );
    }
    assert!(out.contains("0 errors, 5 warnings"), "{out}");
    // Reporting changed nothing, except that opening the database makes it private.
    assert_eq!(mode_of(&body), 0o640);
    assert_eq!(mode_of(&chunk), 0o604);

    // Many loose entries: ten lines, then one summary line.
    for shard in 1..=20 {
        chmod(&state.join(format!("bodies/{shard:02x}")), 0o777);
    }
    let (_, out) = keel(&["fsck", "--state", s, "--remote", &url, "--quick"]);
    let lines = mode_lines(&out);
    assert!(
        lines
            .iter()
            .any(|l| l.contains("more group- or world-accessible files/dirs")),
        "no summary line:\n{out}"
    );
    assert_eq!(
        lines.len(),
        10 + 1 + 2,
        "10 + summary (state), 2 (remote):\n{out}"
    );

    let (code, out) = keel(&["fsck", "--state", s, "--remote", &url, "--repair"]);
    println!("{out}");
    assert_eq!(code, 0, "{out}");
    assert!(
        mode_lines(&out).iter().all(|l| l.ends_with("[repaired]")),
        "{out}"
    );
    assert_eq!(mode_of(&body), 0o600);
    assert_eq!(mode_of(&chunk), 0o600);
    assert_eq!(mode_of(&state.join("bodies/14")), 0o700);
    assert_eq!(mode_of(&remote.join("snapshots")), 0o700);
    assert!(loose_paths(&state).unwrap().is_empty());
    assert!(loose_paths(&remote).unwrap().is_empty());
    let (code, out) = keel(&["fsck", "--state", s, "--remote", &url]);
    assert_eq!(code, 0, "{out}");
    assert!(mode_lines(&out).is_empty(), "{out}");
    assert!(out.contains("0 errors, 0 warnings"), "{out}");
}

#[test]
fn a_start_tightens_what_an_older_keel_left_once() {
    if !support::mount::fuse_available() {
        return;
    }
    let tmp = tempfile::Builder::new()
        .prefix("keel-private.")
        .tempdir()
        .unwrap();
    let (state, remote) = (tmp.path().join("state"), tmp.path().join("remote"));
    make_state(&state, &remote);
    loosen_all(&state);
    loosen_all(&remote);
    let loose_state = loose_paths(&state).unwrap().len();
    let loose_remote = loose_paths(&remote).unwrap().len();
    assert!(loose_state > 256 && loose_remote > 3);
    let cfg = tmp.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nchunk_size = \"64KiB\"\n[persist]\nremote = \"file://{}\"\ninterval = \"0s\"\n",
            remote.display()
        ),
    )
    .unwrap();
    let c = cfg.to_str().unwrap().to_string();
    let mut k = support::mount::Keel::start_in(tmp, state.clone(), &["--config", &c]);
    assert_eq!(std::fs::read(k.p("d/small")).unwrap(), b"small");
    let log = k.log_text();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("tightened")).collect();
    println!("{}", lines.join("\n"));
    let want_state = format!(
        "state dir {}: tightened {loose_state} files/dirs to 0600/0700",
        state.display()
    );
    let want_remote = format!(
        "file:// remote {}: tightened {loose_remote} files/dirs to 0600/0700",
        remote.display()
    );
    assert!(
        lines.iter().filter(|l| l.contains(&want_state)).count() == 1,
        "want one `{want_state}`:\n{log}"
    );
    assert!(
        lines.iter().filter(|l| l.contains(&want_remote)).count() == 1,
        "want one `{want_remote}`:\n{log}"
    );
    assert_eq!(lines.len(), 2, "{log}");
    assert!(loose_paths(&state).unwrap().is_empty());
    assert!(loose_paths(&remote).unwrap().is_empty());

    // Private now: the next start walks nothing and says nothing.
    k.remount();
    let tightened = k.log_text().matches("tightened").count();
    assert_eq!(
        tightened, 2,
        "a start on a private state dir tightened again"
    );
    k.stop();
}

/// What the tightening walk costs per entry on a loose tree, and what a start on a private
/// root costs (numbers printed, not asserted: the machine is shared). `KEEL_TIGHTEN_FILES`
/// sets the size (default 20000).
#[test]
fn tightening_cost() {
    let n: usize = std::env::var("KEEL_TIGHTEN_FILES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("state");
    for shard in 0..256 {
        std::fs::create_dir_all(root.join(format!("bodies/{shard:02x}"))).unwrap();
    }
    for i in 0..n {
        std::fs::write(root.join(format!("bodies/{:02x}/{i:x}", i & 0xff)), b"").unwrap();
    }
    loosen_all(&root);
    let entries = loose_paths(&root).unwrap().len();
    let t = Instant::now();
    let r = secure_dir(&root, "state dir").unwrap().expect("walked");
    let walk = t.elapsed();
    assert_eq!(r.changed as usize, entries);
    assert!(loose_paths(&root).unwrap().is_empty());
    let t = Instant::now();
    assert_eq!(secure_dir(&root, "state dir").unwrap(), None);
    let check = t.elapsed();
    println!(
        "tighten {entries} entries: {:.1} ms ({:.2} µs each); start on the private root: {:.1} µs",
        walk.as_secs_f64() * 1e3,
        walk.as_secs_f64() * 1e6 / entries as f64,
        check.as_secs_f64() * 1e6
    );
}

/// A state dir or remote that holds someone else's files (pointed at a home directory by
/// mistake) is not tightened: the mount refuses such a state dir and leaves it untouched.
#[test]
fn someone_elses_directory_is_left_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let (home, other) = (tmp.path().join("home"), tmp.path().join("other"));
    for d in [&home, &other] {
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join(".bashrc"), b"x").unwrap();
        std::fs::write(d.join("sub/notes"), b"y").unwrap();
        loosen_all(d);
    }
    let cfg = keel::config::PersistConfig {
        remote: format!("file://{}", other.display()),
        ..Default::default()
    };
    keel::persist::secure_at_start(&home, Some(&cfg)).unwrap();
    for d in [&home, &other] {
        assert_eq!(mode_of(d), 0o755);
        assert_eq!(mode_of(&d.join(".bashrc")), 0o644);
        assert_eq!(mode_of(&d.join("sub/notes")), 0o644);
    }
    if support::mount::fuse_available() {
        let log = tmp.path().join("keel.log");
        match support::mount::spawn_mount(&home, &tmp.path().join("mnt"), &[], &log) {
            support::mount::MountOutcome::Exited { status, stderr } => {
                assert!(!status.success());
                assert!(stderr.contains("not a keel state dir"), "{stderr}");
            }
            support::mount::MountOutcome::Mounted(_) => panic!("mounted someone else's directory"),
        }
        assert_eq!(mode_of(&home), 0o755);
        assert_eq!(mode_of(&home.join(".bashrc")), 0o644);
    }
}

//! Every subcommand finds its config the same way: `--config`, else `KEEL_CONFIG` (the
//! fallback to /etc/keel/config.toml is `config::config_file`'s unit test: tests cannot write
//! /etc/keel). A bad file stops each one with the file named, exit 2; a good file's values are
//! the ones each subcommand uses. Nothing here mounts or needs root.

use std::path::Path;
use std::process::{Command, Output};

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// Each subcommand with arguments that reach its config (none mounts or starts anything
/// before it has one).
const SUBCOMMANDS: &[&[&str]] = &[
    &["run", "--", "true"],
    &["mount", "/nonexistent/keel-mnt"],
    &["status"],
    &["checkpoint"],
    &["gc"],
    &["fsck", "--state", "/nonexistent/keel-state"],
    &["snapshot", "list"],
    &[
        "snapshot",
        "restore",
        "latest",
        "--state",
        "/nonexistent/keel-state",
    ],
    &["fork", "--to", "file:///nonexistent/keel-fork"],
];

fn keel(args: &[&str], env: Option<&Path>) -> Output {
    let mut c = Command::new(KEEL);
    c.args(args).env_remove("KEEL_CONFIG");
    if let Some(p) = env {
        c.env("KEEL_CONFIG", p);
    }
    c.output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn a_bad_config_stops_every_subcommand_by_flag_and_by_env() {
    let d = tempfile::tempdir().unwrap();
    let bad = d.path().join("bad.toml");
    std::fs::write(&bad, "[workspace]\nno_such_key = 1\n").unwrap();
    for sub in SUBCOMMANDS {
        let by_env = keel(sub, Some(&bad));
        let mut flagged = vec![sub[0], "--config", bad.to_str().unwrap()];
        flagged.extend(&sub[1..]);
        // `snapshot` takes the flag after its own subcommand too (a global option).
        let by_flag = keel(&flagged, None);
        for (how, o) in [("KEEL_CONFIG", &by_env), ("--config", &by_flag)] {
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{sub:?} {how}: {}", text(o));
            assert!(
                err.contains(bad.to_str().unwrap()) && err.contains("no_such_key"),
                "{sub:?} {how}: {}",
                text(o)
            );
        }
    }
}

#[test]
fn the_flag_wins_over_the_env() {
    let d = tempfile::tempdir().unwrap();
    let bad = d.path().join("bad.toml");
    std::fs::write(&bad, "bogus = 1\n").unwrap();
    let good = d.path().join("good.toml");
    std::fs::write(
        &good,
        format!("[workspace]\nstate_dir = \"{}/s\"\n", d.path().display()),
    )
    .unwrap();
    let o = keel(&["status", "--config", good.to_str().unwrap()], Some(&bad));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        err.contains(&format!("{}/s/control.sock", d.path().display())),
        "{}",
        text(&o)
    );
}

#[test]
fn every_subcommand_uses_the_configured_values() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let remote = d.path().join("remote-nothing-here");
    let cfg = d.path().join("keel.toml");
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nstate_dir = \"{}\"\n[persist]\nremote = \"file://{}\"\n",
            state.display(),
            remote.display()
        ),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let o = keel(args, Some(&cfg));
        (String::from_utf8_lossy(&o.stderr).into_owned(), text(&o), o)
    };
    // status: the control socket in the configured state dir.
    let (err, all, _) = run(&["status"]);
    assert!(
        err.contains(&format!("{}/control.sock", state.display())),
        "{all}"
    );
    // snapshot list opens the configured remote (a `file://` remote is made on open).
    assert!(!remote.exists());
    let (_, all, o) = run(&["snapshot", "list"]);
    assert!(o.status.success(), "{all}");
    assert!(remote.is_dir(), "{all}");
    // gc and checkpoint lock the configured state dir.
    for sub in [&["gc"][..], &["checkpoint"]] {
        let (_, all, _) = run(sub);
        assert!(state.join(keel::state::LOCK).exists(), "{sub:?}: {all}");
        std::fs::remove_dir_all(&state).unwrap();
    }
    // fork reads the configured remote (which holds no workspace).
    let fork_to = format!("file://{}/fork", d.path().display());
    let (err, all, o) = run(&["fork", "--to", &fork_to]);
    assert_eq!(o.status.code(), Some(1), "{all}");
    assert!(err.contains(remote.to_str().unwrap()), "{all}");
    // snapshot restore: the configured remote, into the state dir named.
    let target = d.path().join("target");
    let (err, all, o) = run(&[
        "snapshot",
        "restore",
        "latest",
        "--state",
        target.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{all}");
    assert!(err.contains(remote.to_str().unwrap()), "{all}");
}

/// A mistyped subcommand on a host (keel not PID 1) is refused before keel sets anything up:
/// a bare `keel WORD` is `keel run WORD`, which would make the state dir and the mount point
/// first. (That a word on PATH or a path still runs: `cli::run`'s unit test.)
#[test]
fn a_mistyped_subcommand_is_refused_before_anything_is_made() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let mnt = d.path().join("mnt");
    let cfg = d.path().join("keel.toml");
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nstate_dir = \"{}\"\nmount_point = \"{}\"\n",
            state.display(),
            mnt.display()
        ),
    )
    .unwrap();
    let o = keel(&["restor", "--state", "/nonexistent"], Some(&cfg));
    let all = text(&o);
    assert_eq!(o.status.code(), Some(2), "{all}");
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("'restor' is not a keel subcommand and no command of that name is on PATH"),
        "{all}"
    );
    assert!(!state.exists() && !mnt.exists(), "{all}");
}

/// A command that prints and exits (`keel completions`, `keel status | head`) whose reader
/// has gone ends quietly by SIGPIPE, like any Unix filter, not with a panic from `println!`.
#[test]
fn a_closed_stdout_ends_a_printing_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let (r, w) = nix::unistd::pipe().unwrap();
    drop(r); // nobody reads: the first write fails with EPIPE
    let out = Command::new(KEEL)
        .args(["completions", "bash"])
        .env_remove("KEEL_CONFIG")
        .stdout(std::process::Stdio::from(w))
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {err}",
        out.status
    );
}

//! `keel run` black-box: exit codes, missing/non-executable commands, working directories,
//! the inherited signal mask and ignored set, [init] settings, and config errors.

use crate::support;

use nix::sys::signal::Signal;
use support::pid1::*;

#[test]
fn exit_codes_0_to_255_pass_through() {
    // Several keels at once keeps this fast on 2 cores.
    let codes: Vec<i32> = (0..=255).collect();
    for chunk in codes.chunks(16) {
        let mut ks: Vec<_> = chunk
            .iter()
            .map(|c| {
                (
                    c,
                    start(&config("", ""), &["sh", "-c", &format!("exit {c}")]),
                )
            })
            .collect();
        for (c, k) in ks.iter_mut() {
            assert_eq!(k.wait().0, **c, "log:\n{}", k.log_text());
        }
    }
}

#[test]
fn option_parsing_stops_at_first_non_option() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, config("", "")).unwrap();
    for args in [vec!["run", "--config"], vec!["--config"]] {
        let out = std::process::Command::new(KEEL)
            .args(&args)
            .arg(&cfg)
            .args(["sh", "-c", "exit 3"])
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(3),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn missing_command_is_127_and_not_executable_is_126() {
    let mut k = start(&config("", ""), &["/nonexistent/cmd"]);
    assert_eq!(k.wait().0, 127);
    assert!(
        k.log_text().contains("/nonexistent/cmd"),
        "{}",
        k.log_text()
    );
    let mut k = start(&config("", ""), &["no-such-command-on-path"]);
    assert_eq!(k.wait().0, 127);
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain");
    std::fs::write(&plain, "echo hi\n").unwrap();
    let mut k = start(&config("", ""), &[plain.to_str().unwrap()]);
    assert_eq!(k.wait().0, 126, "{}", k.log_text());
    let mut k = start(&config("", ""), &["/"]);
    assert_eq!(k.wait().0, 126, "{}", k.log_text());
}

#[test]
fn killed_child_gives_128_plus_n() {
    for (sig, n) in [("KILL", 9), ("SEGV", 11), ("ABRT", 6)] {
        let mut k = start(&config("", ""), &["sh", "-c", &format!("kill -{sig} $$")]);
        assert_eq!(k.wait().0, 128 + n, "SIG{sig}: {}", k.log_text());
    }
}

#[test]
fn signals_to_keel_end_main_with_128_plus_n() {
    for sig in [
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGINT,
        Signal::SIGUSR1,
    ] {
        let mut k = start(&config("", "[shutdown]\ngrace = \"5s\""), &["sleep", "30"]);
        k.wait_log("started main command");
        k.signal(sig);
        let (code, took) = k.wait();
        assert_eq!(code, 128 + sig as i32, "{sig}: {}", k.log_text());
        assert!(took.as_secs_f64() < 4.0, "{sig} took {took:?}");
    }
}

#[test]
fn child_keeps_callers_cwd_while_keel_sits_in_root() {
    let cwd = tempfile::tempdir().unwrap();
    let mut k = start_with(
        &config("", ""),
        &["sh", "-c", "pwd; readlink /proc/$PPID/cwd"],
        Opts {
            cwd: Some(cwd.path()),
            ..Default::default()
        },
    );
    assert_eq!(k.wait().0, 0);
    let out = k.stdout();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        vec![cwd.path().canonicalize().unwrap().to_str().unwrap(), "/"],
        "{out}"
    );
}

#[test]
fn child_gets_the_inherited_mask_and_ignored_set() {
    // Read directly by cat: dash clears the signal mask when it starts.
    let status = ["cat", "/proc/self/status"];
    // Nothing inherited: keel's own all-blocked mask must not leak into the child.
    let mut k = start(&config("", ""), &status);
    assert_eq!(k.wait().0, 0);
    let s = k.stdout();
    // What the test process itself ignores is inherited by keel and so by the child.
    // (Minus SIGPIPE: std's Command resets it to default when the test starts keel.)
    let base_ign = status_mask(&read(std::path::Path::new("/proc/self/status")), "SigIgn:")
        & !(1 << (libc::SIGPIPE - 1));
    assert_eq!(status_mask(&s, "SigBlk:"), 0, "{s}");
    assert_eq!(status_mask(&s, "SigIgn:"), base_ign, "{s}");

    let block = [Signal::SIGUSR1, Signal::SIGWINCH];
    let ignore = [Signal::SIGUSR2, Signal::SIGHUP, Signal::SIGPIPE];
    let mut k = start_with(
        &config("", ""),
        &status,
        Opts {
            block: &block,
            ignore: &ignore,
            ..Default::default()
        },
    );
    assert_eq!(k.wait().0, 0);
    let s = k.stdout();
    let bits = |sigs: &[Signal]| sigs.iter().fold(0u64, |m, s| m | 1 << (*s as i32 - 1));
    assert_eq!(status_mask(&s, "SigBlk:"), bits(&block), "{s}");
    // SIGPIPE included: std's runtime ignores it in keel, keel must hand on what it inherited.
    assert_eq!(status_mask(&s, "SigIgn:"), base_ign | bits(&ignore), "{s}");
}

#[test]
fn init_table_sets_limits_umask_and_env() {
    let init = "rlimits = { nofile = 1234 }\numask = \"027\"\nenv = { KEEL_TEST_VAR = \"hello\" }";
    let mut k = start(
        &config(init, ""),
        &["sh", "-c", "ulimit -n; umask; echo $KEEL_TEST_VAR"],
    );
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert_eq!(k.stdout(), "1234\n0027\nhello\n");
}

#[test]
fn services_lose_cap_sys_admin_and_dac_read_search_and_can_run_as_a_user() {
    if !require_root("capability bounding set test") {
        return;
    }
    let mut k = start(
        &config("", ""),
        &["sh", "-c", "grep -E '^Cap(Eff|Bnd)' /proc/self/status"],
    );
    assert_eq!(k.wait().0, 0);
    let s = k.stdout();
    let sys_admin = 1u64 << 21;
    assert_eq!(status_mask(&s, "CapBnd:") & sys_admin, 0, "{s}");
    assert_eq!(status_mask(&s, "CapEff:") & sys_admin, 0, "{s}");
    // Nor CAP_DAC_READ_SEARCH: open_by_handle_at would reach the state volume's files past
    // the covers over the state dir.
    let dac_read_search = 1u64 << 2;
    assert_eq!(status_mask(&s, "CapBnd:") & dac_read_search, 0, "{s}");
    assert_eq!(status_mask(&s, "CapEff:") & dac_read_search, 0, "{s}");
    assert_ne!(
        status_mask(&s, "CapEff:"),
        0,
        "root keeps its other capabilities: {s}"
    );

    let init = "user = \"nobody\"\nno_new_privs = true";
    let mut k = start(
        &config(init, ""),
        &[
            "sh",
            "-c",
            "id -u; grep -E '^(NoNewPrivs|CapEff)' /proc/self/status",
        ],
    );
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    let s = k.stdout();
    assert!(s.starts_with("65534\n"), "{s}");
    assert!(s.contains("NoNewPrivs:\t1"), "{s}");
    assert_eq!(status_mask(&s, "CapEff:"), 0, "{s}");
}

#[test]
fn bad_config_is_rejected_naming_file_and_key_and_nothing_starts() {
    let cases = [
        ("[init]\nworkspace = false\nbogus = 1\n", "init.bogus"),
        ("[init]\nworkspace = false\n[shutdown]\ngrace = \"soon\"\n", "shutdown.grace"),
        ("[init]\nworkspace = false\n[[service]]\nname = \"a\"\ncommand = \"true\"\nrestart = \"sometimes\"\n", "service.restart"),
        ("[init]\nworkspace = false\n[[service]]\nname = \"a\"\ncommand = \"true\"\ndepends_on = [\"b\"]\n", "service[0].depends_on"),
        ("[init]\nworkspace = \"no\"\n", "init.workspace"),
    ];
    for (text, key) in cases {
        let mut k = start(text, &["touch", "$D/started"]);
        let (code, _) = k.wait();
        let log = k.log_text();
        assert_eq!(code, 2, "{key}: {log}");
        assert!(
            log.contains(key) && log.contains("config.toml"),
            "{key}: {log}"
        );
        assert_eq!(log.lines().count(), 1, "one line: {log}");
        assert!(
            !k.path("started").exists(),
            "{key}: main started despite a bad config"
        );
    }
}

#[test]
fn missing_config_user_and_service_binary_are_one_line_errors() {
    let out = std::process::Command::new(KEEL)
        .args(["run", "--config", "/nonexistent/config.toml", "--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        err.contains("/nonexistent/config.toml") && err.contains("cannot read"),
        "{err}"
    );

    let mut k = start(
        &config("user = \"no-such-user-keel\"", ""),
        &["touch", "$D/started"],
    );
    assert_eq!(k.wait().0, 1);
    assert!(
        k.log_text()
            .contains("user `no-such-user-keel` does not exist"),
        "{}",
        k.log_text()
    );
    assert!(!k.path("started").exists());

    // A service that already runs is stopped when the next one cannot start.
    let svcs = "[shutdown]\ngrace = \"5s\"\n\
        [[service]]\nname = \"a\"\ncommand = \"echo $$ > $D/a.pid; exec sleep 30\"\n\
        ready = { file = \"$D/a.pid\" }\n\
        [[service]]\nname = \"b\"\ncommand = [\"/nonexistent/b\"]\ndepends_on = [\"a\"]\n";
    let mut k = start(&config("", svcs), &["touch", "$D/started"]);
    let (code, took) = k.wait();
    assert_eq!(code, 127, "{}", k.log_text());
    assert!(
        k.log_text()
            .contains("service b: cannot run /nonexistent/b"),
        "{}",
        k.log_text()
    );
    assert!(!k.path("started").exists());
    let a: i32 = read(&k.path("a.pid")).trim().parse().unwrap();
    assert!(!alive(a), "service a still runs");
    assert!(took.as_secs_f64() < 4.0, "{took:?}");
}

#[test]
fn workspace_checks_name_the_problem() {
    // A mount point that is a file: one line, nothing started.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    let text = format!(
        "[workspace]\nmount_point = \"{}\"\nstate_dir = \"{}\"\n",
        file.display(),
        dir.path().join("state").display()
    );
    let mut k = start(&text, &["touch", "$D/started"]);
    assert_eq!(k.wait().0, 1);
    assert!(
        k.log_text().contains("is not a directory"),
        "{}",
        k.log_text()
    );
    assert!(!k.path("started").exists());
}

#[test]
fn main_command_gets_the_terminal_as_foreground_group() {
    // `script` gives keel a pseudo-terminal as its controlling terminal.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, config("", "")).unwrap();
    let inner = format!(
        "{KEEL} run --config {} -- cat /proc/self/stat",
        cfg.display()
    );
    let out = std::process::Command::new("script")
        .args(["-qec", &inner, "/dev/null"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("script(1) from util-linux");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains(" (cat) "))
        .unwrap_or_else(|| panic!("{text}"));
    let f: Vec<&str> = line
        .split(") ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .collect();
    // state ppid pgrp session tty_nr tpgid
    let (pid, pgrp, tpgid): (&str, &str, &str) = (line.split(' ').next().unwrap(), f[2], f[5]);
    assert_eq!(pgrp, pid, "main runs in its own process group: {line}");
    assert_eq!(
        tpgid, pgrp,
        "and that group is the terminal's foreground group: {line}"
    );
}

#[test]
fn services_get_their_user_workdir_and_env_and_output_passes_through() {
    if !require_root("service user test") {
        return;
    }
    // A directory the service user can write to, so main can wait for it.
    let shared = tempfile::Builder::new()
        .prefix("keel-svc")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(
        shared.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let s = shared.path().display();
    let rest = format!(
        "[[service]]\nname = \"who\"\nuser = \"nobody\"\nworkdir = \"{s}\"\nenv = {{ WHO_VAR = \"svc\" }}\n\
         command = \"echo svc $(id -u) $(pwd) $WHO_VAR $USER; echo to-stderr >&2; touch done\"\n"
    );
    let main = format!("while [ ! -e {s}/done ]; do sleep 0.01; done");
    let mut k = start(&config("", &rest), &["sh", "-c", &main]);
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert_eq!(k.stdout(), format!("svc 65534 {s} svc nobody\n"));
    assert!(
        k.log_text().lines().any(|l| l == "to-stderr"),
        "{}",
        k.log_text()
    );
}

/// Runs keel without CAP_SYS_ADMIN (dropped from the bounding set by setpriv, so root's exec
/// does not regain it) with the workspace enabled.
fn without_sys_admin(rest: &str) -> (i32, String, bool) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    let text = format!(
        "[workspace]\nmount_point = \"{}/ws\"\nstate_dir = \"{}/state\"\n{rest}\n",
        dir.path().display(),
        dir.path().display()
    );
    std::fs::write(&cfg, text).unwrap();
    let marker = dir.path().join("started");
    let out = std::process::Command::new("setpriv")
        .args([
            "--bounding-set",
            "-sys_admin",
            "--inh-caps",
            "-sys_admin",
            KEEL,
            "run",
            "--config",
        ])
        .arg(&cfg)
        .args(["--", "touch"])
        .arg(&marker)
        .output()
        .expect("setpriv(1) from util-linux");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        marker.exists(),
    )
}

#[test]
fn missing_cap_sys_admin_names_the_flag() {
    if !require_root("CAP_SYS_ADMIN check") {
        return;
    }
    for refuse in [
        "on_fuse_unavailable = \"fail\"",
        "provider = \"fuse\"\non_fuse_unavailable = \"dir\"",
    ] {
        let (code, err, started) = without_sys_admin(refuse);
        assert_eq!(code, 1, "{refuse}: {err}");
        assert!(err.contains("--cap-add SYS_ADMIN"), "{err}");
        assert!(
            !started,
            "nothing may start when the workspace cannot be mounted ({refuse})"
        );
    }

    // The default (`provider = "auto"`): the `dir` provider, saying which and why in one
    // line, and what is protected in it.
    let (code, err, started) = without_sys_admin("");
    assert_eq!(code, 0, "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("workspace: provider dir"))
        .unwrap_or_else(|| panic!("no provider line: {err}"));
    assert!(line.contains("--cap-add SYS_ADMIN"), "{line}");
    assert!(line.contains("NOT PROTECTED"), "{line}");
    assert!(started);
}

#[test]
fn missing_dev_fuse_names_the_flag() {
    if !require_root("/dev/fuse check") {
        return;
    }
    // In a private mount namespace, /dev/fuse is covered by a regular file.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nmount_point = \"{0}/ws\"\nstate_dir = \"{0}/state\"\non_fuse_unavailable = \"fail\"\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let fake = dir.path().join("fake-fuse");
    std::fs::write(&fake, "").unwrap();
    let script = format!(
        "mount --make-rprivate / && mount --bind {} /dev/fuse && exec {KEEL} run --config {} -- true",
        fake.display(),
        cfg.display()
    );
    let out = std::process::Command::new("unshare")
        .args(["--mount", "sh", "-c", &script])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--device /dev/fuse"), "{err}");
}

#[test]
fn exit_status_survives_an_inherited_ignored_sigchld() {
    // With SIGCHLD ignored the kernel would reap children itself and keel would never see the
    // main command's status; keel resets it for itself and hands it on to the child.
    let ignore = [Signal::SIGCHLD];
    let opts = || Opts {
        ignore: &ignore,
        ..Default::default()
    };
    let mut k = start_with(&config("", ""), &["sh", "-c", "exit 7"], opts());
    assert_eq!(k.wait().0, 7, "{}", k.log_text());
    let mut k = start_with(&config("", ""), &["cat", "/proc/self/status"], opts());
    assert_eq!(k.wait().0, 0);
    let s = k.stdout();
    assert_ne!(
        status_mask(&s, "SigIgn:") & (1 << (libc::SIGCHLD - 1)),
        0,
        "{s}"
    );
}

#[test]
fn logs_are_prefixed_lines_or_json_and_service_output_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, config("", "")).unwrap();
    let run = |format: Option<&str>| {
        let mut c = std::process::Command::new(KEEL);
        c.args(["run", "--config"])
            .arg(&cfg)
            .args(["--", "sh", "-c", "echo out; echo err >&2"]);
        c.env_remove("KEEL_LOG").env_remove("KEEL_LOG_FORMAT");
        if let Some(f) = format {
            c.env("KEEL_LOG_FORMAT", f);
        }
        let o = c.output().unwrap();
        assert_eq!(o.status.code(), Some(0));
        assert_eq!(String::from_utf8_lossy(&o.stdout), "out\n");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let text = run(None);
    for l in text.lines().filter(|l| *l != "err") {
        assert!(l.starts_with("keel: "), "{l:?} in\n{text}");
    }
    assert!(text.lines().any(|l| l == "err"), "{text}");
    let json = run(Some("json"));
    for l in json.lines().filter(|l| *l != "err") {
        assert!(
            l.starts_with('{') && l.ends_with('}') && l.contains("\"level\""),
            "{l:?} in\n{json}"
        );
    }
    assert!(json.contains("main command"), "{json}");
}

#[test]
fn the_main_command_gets_the_descriptors_keel_was_started_with() {
    // `make -j` runs `keel run -- ...` with its jobserver pipe on fds without close-on-exec;
    // a plain init passes them on. keel's own descriptors it never passes on.
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, config("", "")).unwrap();
    let (mut r, w) = std::io::pipe().unwrap();
    let w_fd = std::os::fd::AsRawFd::as_raw_fd(&w);
    let mut cmd = std::process::Command::new(KEEL);
    cmd.arg("run")
        .arg("--config")
        .arg(&cfg)
        .args(["--", "sh", "-c", "echo jobserver >&7"]);
    // SAFETY: dup2 is async-signal-safe; the new fd 7 has no close-on-exec, as make's.
    unsafe {
        cmd.pre_exec(move || match libc::dup2(w_fd, 7) {
            -1 => Err(std::io::Error::last_os_error()),
            _ => Ok(()),
        })
    };
    let out = cmd.output().unwrap();
    drop(w);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut got = String::new();
    r.read_to_string(&mut got).unwrap();
    assert_eq!(got, "jobserver\n");
}

//! The one harness for a running keel: `keel mount` on a temp state dir and mount point
//! ([`Keel::start`], [`Keel::start_in`]) or `keel run` with a config in a temp dir
//! ([`Keel::run`], as a subreaper or a true PID 1). Both write keel's output to files in that
//! temp dir, so a test reads the log the same way whichever it started and the log survives a
//! restart. Whatever happens to the test, dropping a `Keel` stops keel (SIGTERM, then SIGKILL
//! of its whole process tree) and `umount -l`s every FUSE mount left under its temp dir.
//! Timeouts here only bound how long a hung keel is waited for; no outcome depends on them.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::mount::{
    fuse_available, is_fuse_mount, keel_bin, lazy_unmount, poll_for, spawn_mount_env, wait_timeout,
    MountOutcome, READY_TIMEOUT, STOP_TIMEOUT,
};
use super::sys;

/// Every wait of a `keel run` test gives up after this long: a hang guard, far beyond what
/// any wait needs on a loaded machine (no outcome depends on it).
pub const LIMIT: Duration = Duration::from_secs(120);

/// How a `keel run` is started (see [`Keel::run`]).
#[derive(Default)]
pub struct Opts<'a> {
    pub cwd: Option<&'a Path>,
    /// Run inside `unshare --pid --fork --mount-proc` so keel is a real PID 1.
    pub pid1: bool,
    /// Signals blocked / ignored when keel starts.
    pub block: &'a [nix::sys::signal::Signal],
    pub ignore: &'a [nix::sys::signal::Signal],
    /// Extra environment for keel.
    pub env: &'a [(&'a str, &'a str)],
    /// Extra environment for keel whose values need not be UTF-8.
    pub env_bytes: &'a [(&'a str, &'a [u8])],
}

enum Launch {
    /// `keel mount --state STATE MNT ARGS...`; can be stopped and started again.
    Mount {
        args: Vec<String>,
        env: Vec<(String, String)>,
    },
    /// `keel run`: started once.
    Run,
}

/// A running keel on temp dirs.
pub struct Keel {
    /// `keel mount`'s state dir and mount point; for `keel run`, `DIR/state` and `DIR/ws`
    /// (what [`workspace_config`] puts in the config).
    pub state: PathBuf,
    pub mnt: PathBuf,
    /// keel's stderr (for `keel mount` also its stdout), appended across restarts.
    pub log: PathBuf,
    out: PathBuf,
    launch: Launch,
    child: Option<Child>,
    started: Instant,
    status: Option<ExitStatus>,
    // Last field: removed only after Drop has unmounted.
    tmp: tempfile::TempDir,
}

/// The `[workspace]` and `[persist]` tables of a `keel run` with a real workspace: mounted at
/// `$D/ws`, state in `$D/state`, checkpoints to `file://$D/remote`, plus `extra` lines for
/// `[workspace]`.
pub fn workspace_config(extra: &str) -> String {
    format!(
        "[workspace]\nmount_point = \"$D/ws\"\nstate_dir = \"$D/state\"\n{extra}\n[persist]\nremote = \"file://$D/remote\"\n"
    )
}

impl Keel {
    /// `keel mount` of a fresh workspace (state dir `TMP/state` does not exist yet: keel
    /// creates it). None = skipped (see `fuse_available`).
    pub fn start(args: &[&str]) -> Option<Keel> {
        if !fuse_available() {
            return None;
        }
        let tmp = tempdir("keel-mount-test.");
        let state = tmp.path().join("state");
        Some(Self::start_in(tmp, state, args))
    }

    /// `keel mount` with the state dir at `state` (which may live on another filesystem).
    pub fn start_in(tmp: tempfile::TempDir, state: PathBuf, args: &[&str]) -> Keel {
        let mut k = Keel {
            state,
            mnt: tmp.path().join("mnt"),
            log: tmp.path().join("keel.log"),
            out: tmp.path().join("keel.log"),
            launch: Launch::Mount {
                args: args.iter().map(|s| s.to_string()).collect(),
                env: Vec::new(),
            },
            child: None,
            started: Instant::now(),
            status: None,
            tmp,
        };
        k.mount();
        k
    }

    /// `keel run --config DIR/config.toml -- ARGV...` with `config_text` written there; `$D`
    /// in the config, argv and `opts.env` is replaced by the temp dir DIR.
    pub fn run(config_text: &str, argv: &[&str], opts: Opts) -> Keel {
        let tmp = tempdir("keel-run-test.");
        let dir = tmp.path().to_path_buf();
        let d = dir.to_str().expect("utf-8 temp dir").to_string();
        let cfg = dir.join("config.toml");
        fs::write(&cfg, config_text.replace("$D", &d)).expect("write config");
        let mut cmd = if opts.pid1 {
            let mut c = Command::new("unshare");
            c.args(["--pid", "--fork", "--mount-proc", "--uts", "--kill-child"])
                .arg(keel_bin());
            c
        } else {
            Command::new(keel_bin())
        };
        cmd.arg("run").arg("--config").arg(&cfg).arg("--");
        cmd.args(argv.iter().map(|a| a.replace("$D", &d)));
        cmd.current_dir(opts.cwd.unwrap_or(&dir));
        cmd.env("D", &d)
            .env_remove("KEEL_LOG_FORMAT")
            .env("KEEL_LOG", "debug");
        for (k, v) in opts.env {
            cmd.env(k, v.replace("$D", &d));
        }
        for (k, v) in opts.env_bytes {
            cmd.env(
                k,
                std::os::unix::ffi::OsStrExt::from_bytes(v) as &std::ffi::OsStr,
            );
        }
        let (log, out) = (dir.join("keel.stderr"), dir.join("keel.stdout"));
        cmd.stdin(Stdio::null())
            .stdout(fs::File::create(&out).expect("create stdout file"))
            .stderr(fs::File::create(&log).expect("create stderr file"));
        let block: Vec<_> = opts.block.to_vec();
        let ignore: Vec<_> = opts.ignore.to_vec();
        // SAFETY: the closure only changes the signal mask and dispositions of the forked
        // child (async-signal-safe syscalls on data prepared before fork).
        unsafe {
            cmd.pre_exec(move || {
                use nix::sys::signal::{pthread_sigmask, signal, SigHandler, SigSet, SigmaskHow};
                let mut set = SigSet::empty();
                for s in &block {
                    set.add(*s);
                }
                pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&set), None)?;
                for s in &ignore {
                    signal(*s, SigHandler::SigIgn)?;
                }
                Ok(())
            })
        };
        let child = cmd.spawn().expect("spawn keel run");
        Keel {
            state: dir.join("state"),
            mnt: dir.join("ws"),
            log,
            out,
            launch: Launch::Run,
            child: Some(child),
            started: Instant::now(),
            status: None,
            tmp,
        }
    }

    fn mount(&mut self) {
        assert!(self.child.is_none(), "already running");
        let Launch::Mount { args, env } = &self.launch else {
            panic!("a `keel run` cannot be started again")
        };
        match spawn_mount_env(&self.state, &self.mnt, args, env, &self.log) {
            MountOutcome::Mounted(child) => {
                self.child = Some(child);
                self.status = None;
            }
            MountOutcome::Exited { status, stderr } => {
                panic!("keel mount exited with {status} before mounting:\n{stderr}")
            }
        }
    }

    /// A path inside the mount.
    pub fn p(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// The temp dir (for `keel run` it is `$D`), on the host filesystem.
    pub fn scratch(&self) -> &Path {
        self.tmp.path()
    }

    /// A path in the temp dir.
    pub fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("keel running").id() as i32
    }

    /// Everything keel wrote to stderr so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What `keel run`'s main command (and keel) wrote to stdout.
    pub fn stdout(&self) -> String {
        fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Waits until keel's log contains `text` (at most `READY_TIMEOUT`).
    pub fn wait_log(&self, text: &str) {
        let found = poll_for(READY_TIMEOUT, || {
            self.log_text().contains(text).then_some(())
        });
        assert!(
            found.is_some(),
            "keel never logged {text:?}; log:\n{}",
            self.log_text()
        );
    }

    /// Waits until the file DIR/name exists (at most `READY_TIMEOUT`).
    pub fn wait_file(&self, name: &str) {
        let p = self.path(name);
        let found = poll_for(READY_TIMEOUT, || p.exists().then_some(()));
        assert!(
            found.is_some(),
            "no file {} after {READY_TIMEOUT:?}; log:\n{}",
            p.display(),
            self.log_text()
        );
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig).unwrap();
    }

    /// Sends `sig` and waits for keel to exit (at most `STOP_TIMEOUT`); asserts it exited
    /// and left its mount point unmounted. Returns how it exited.
    pub fn terminate(&mut self, sig: libc::c_int) -> ExitStatus {
        let mut child = self.child.take().expect("keel running");
        sys::kill(child.id(), sig);
        let status = wait_timeout(&mut child, STOP_TIMEOUT);
        self.status = status;
        let mounted = is_fuse_mount(&self.mnt);
        if mounted {
            lazy_unmount(&self.mnt);
        }
        let Some(st) = status else {
            panic!(
                "keel did not exit within {STOP_TIMEOUT:?} of signal {sig}; log:\n{}",
                self.log_text()
            )
        };
        assert!(
            !mounted,
            "keel exited on signal {sig} but left {} mounted",
            self.mnt.display()
        );
        st
    }

    /// Sends `sig` (SIGTERM or SIGINT) and asserts: exit status 0, mount point unmounted.
    pub fn stop_with(&mut self, sig: libc::c_int) {
        let st = self.terminate(sig);
        assert!(
            st.success(),
            "keel exited with {st} on signal {sig} (expected 0); log:\n{}",
            self.log_text()
        );
    }

    /// SIGTERM: flush, unmount, exit 0 (asserted).
    pub fn stop(&mut self) {
        self.stop_with(libc::SIGTERM)
    }

    /// SIGKILL keel and detach the dead mount (ENOTCONN) so the mount point can be reused.
    pub fn kill9(&mut self) {
        self.kill9_leave_mount();
        lazy_unmount(&self.mnt);
    }

    /// SIGKILL keel and leave its mount as it is (the next `start_again` must clear it).
    pub fn kill9_leave_mount(&mut self) {
        let mut child = self.child.take().expect("keel running");
        let _ = child.kill();
        self.status = child.wait().ok();
    }

    /// Clean unmount (asserted) and mount again on the same state dir.
    pub fn remount(&mut self) {
        self.stop();
        self.mount();
    }

    /// `kill -9` and mount again on the same state dir.
    pub fn crash_remount(&mut self) {
        self.kill9();
        self.mount();
    }

    /// Waits (at most `STOP_TIMEOUT`) for keel to exit on its own; None if it had to be
    /// killed.
    pub fn wait_exit(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take().expect("keel running");
        self.status = wait_timeout(&mut child, STOP_TIMEOUT);
        self.status
    }

    /// Waits for keel to exit; returns (exit code, time since start). Panics after `LIMIT`
    /// (killing keel's whole tree first), or if keel itself died of a signal.
    pub fn wait(&mut self) -> (i32, Duration) {
        let child = self.child.as_mut().expect("keel running");
        let done = poll_for(LIMIT, || child.try_wait().expect("try_wait"));
        let Some(st) = done else {
            let log = self.log_text();
            self.kill_tree();
            panic!("keel did not exit within {LIMIT:?}; log:\n{log}");
        };
        self.child = None;
        self.status = Some(st);
        let code = st.code().unwrap_or_else(|| {
            panic!(
                "keel itself died of a signal: {st:?}; log:\n{}",
                self.log_text()
            )
        });
        (code, self.started.elapsed())
    }

    /// Sets keel's added environment for the next `start_again` (a `keel mount` only).
    pub fn set_env(&mut self, vars: &[(&str, &str)]) {
        let Launch::Mount { env, .. } = &mut self.launch else {
            panic!("only a `keel mount` is started again")
        };
        *env = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    }

    /// Mounts again after `stop`/`kill9`/`wait_exit`.
    pub fn start_again(&mut self) {
        self.mount();
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGKILLs keel and everything below it (what is left after a failed test).
    pub fn kill_tree(&mut self) {
        if let Some(child) = &self.child {
            for p in super::procs::descendants(child.id() as i32) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            self.status = child.wait().ok();
        }
    }

    /// Every FUSE mount under the temp dir, deepest first.
    fn mounts_below(&self) -> Vec<PathBuf> {
        let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let top = fs::canonicalize(self.tmp.path()).unwrap_or_else(|_| self.tmp.path().into());
        let mut out: Vec<PathBuf> = text
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(super::mount::unescape_mountinfo)
            .map(PathBuf::from)
            .filter(|p| p.starts_with(&top) && is_fuse_mount(p))
            .collect();
        out.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        out
    }
}

impl Drop for Keel {
    fn drop(&mut self) {
        match self.launch {
            // A mount ends the way a user ends it, so its state stays usable for the log.
            Launch::Mount { .. } => {
                if let Some(mut child) = self.child.take() {
                    sys::kill(child.id(), libc::SIGTERM);
                    if wait_timeout(&mut child, STOP_TIMEOUT).is_none() {
                        eprintln!("keel did not stop on SIGTERM; killed it");
                    }
                }
            }
            // A `keel run` still running here belongs to a test that failed or never waited.
            Launch::Run => self.kill_tree(),
        }
        for m in self.mounts_below() {
            lazy_unmount(&m);
        }
    }
}

fn tempdir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("tempdir")
}

//! Shared helpers for the PID-1 integration tests: start the built `keel` binary with a config
//! in a temp dir, capture its stderr, poll for outcomes with deadlines, and never leave a
//! process behind (a failed test kills keel's whole tree).

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// Every wait in these tests gives up after this long.
pub const LIMIT: Duration = Duration::from_secs(20);

/// A config with the workspace disabled (no FUSE in these tests), a short grace, plus `init`
/// extra lines for `[init]` and `rest` appended (other tables).
pub fn config(init: &str, rest: &str) -> String {
    format!("[init]\nworkspace = false\n{init}\n{rest}\n")
}

/// True when running as root. Without root: panics when `CI` is set, else the test is skipped.
pub fn require_root(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{what} needs root, and CI is set: refusing to skip");
    }
    eprintln!("skipping {what}: needs root");
    false
}

/// True when running as root with /dev/fuse. Without either: panics when `CI` is set, else the
/// test is skipped.
pub fn require_root_and_fuse(what: &str) -> bool {
    if !require_root(what) {
        return false;
    }
    if !std::path::Path::new("/dev/fuse").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{what}: /dev/fuse is missing and CI is set: refusing to skip"
        );
        eprintln!("skipping {what}: no /dev/fuse");
        return false;
    }
    true
}

pub struct Keel {
    pub child: Child,
    pub dir: tempfile::TempDir,
    stderr: Arc<Mutex<String>>,
    stdout: Arc<Mutex<String>>,
    pub started: Instant,
    pub status: Option<std::process::ExitStatus>,
}

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
}

/// Starts keel with `config_text` (written to DIR/config.toml) and `argv` after `--`.
/// `$D` in argv and config is replaced by the temp dir path.
pub fn start(config_text: &str, argv: &[&str]) -> Keel {
    start_with(config_text, argv, Opts::default())
}

pub fn start_with(config_text: &str, argv: &[&str], opts: Opts) -> Keel {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().to_str().unwrap().to_string();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text.replace("$D", &d)).unwrap();
    let mut cmd = if opts.pid1 {
        let mut c = Command::new("unshare");
        c.args([
            "--pid",
            "--fork",
            "--mount-proc",
            "--uts",
            "--kill-child",
            KEEL,
        ]);
        c
    } else {
        Command::new(KEEL)
    };
    cmd.arg("run").arg("--config").arg(&cfg).arg("--");
    cmd.args(argv.iter().map(|a| a.replace("$D", &d)));
    cmd.current_dir(opts.cwd.unwrap_or(dir.path()));
    cmd.env("D", &d)
        .env_remove("KEEL_LOG_FORMAT")
        .env("KEEL_LOG", "debug");
    for (k, v) in opts.env {
        cmd.env(k, v.replace("$D", &d));
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let block: Vec<_> = opts.block.to_vec();
    let ignore: Vec<_> = opts.ignore.to_vec();
    // SAFETY: the closure only changes the signal mask and dispositions of the forked child
    // (async-signal-safe syscalls on data prepared before fork).
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
    let mut child = cmd.spawn().expect("spawn keel");
    let stderr = Arc::new(Mutex::new(String::new()));
    let stdout = Arc::new(Mutex::new(String::new()));
    let e = child.stderr.take().unwrap();
    let se = stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(e).lines().map_while(Result::ok) {
            se.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let mut o = child.stdout.take().unwrap();
    let so = stdout.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = o.read(&mut buf) {
            if n == 0 {
                break;
            }
            so.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    Keel {
        child,
        dir,
        stderr,
        stdout,
        started: Instant::now(),
        status: None,
    }
}

/// Polls `f` until it returns Some; panics naming `what` after `LIMIT`.
pub fn poll<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    super::mount::poll_for(LIMIT, f).unwrap_or_else(|| panic!("timed out waiting for {what}"))
}

impl Keel {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }
    /// Waits until keel's log contains `text`.
    pub fn wait_log(&self, text: &str) {
        let end = Instant::now() + LIMIT;
        while !self.stderr().contains(text) {
            assert!(
                Instant::now() < end,
                "keel never logged {text:?}; log:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    /// Waits until the file DIR/name exists.
    pub fn wait_file(&self, name: &str) {
        let p = self.path(name);
        poll(
            &format!("file {}; log:\n{}", p.display(), self.stderr()),
            || p.exists().then_some(()),
        );
    }
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig).unwrap();
    }
    /// Waits for keel to exit; returns (exit code, time since start). Panics after `LIMIT`.
    pub fn wait(&mut self) -> (i32, Duration) {
        let end = Instant::now() + LIMIT;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                self.status = Some(st);
                let code = st.code().unwrap_or_else(|| {
                    panic!(
                        "keel itself died of a signal: {st:?}; log:\n{}",
                        self.stderr()
                    )
                });
                // Let the reader threads catch up with the last lines.
                std::thread::sleep(Duration::from_millis(20));
                return (code, self.started.elapsed());
            }
            if Instant::now() > end {
                let log = self.stderr();
                self.kill_tree();
                panic!("keel did not exit within {LIMIT:?}; log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    /// Kills keel and everything below it (used when a test fails).
    pub fn kill_tree(&mut self) {
        for p in descendants(self.pid()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Keel {
    fn drop(&mut self) {
        if self.status.is_none() && matches!(self.child.try_wait(), Ok(None)) {
            self.kill_tree();
        }
    }
}

/// (pid, ppid, state) of every process, from /proc.
pub fn processes() -> Vec<(i32, i32, char)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let state = f.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let ppid = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        out.push((pid, ppid, state));
    }
    out
}

/// Every descendant of `root`, zombies included.
pub fn descendants(root: i32) -> Vec<i32> {
    let all = processes();
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(c, pp, _) in &all {
            if pp == p && !out.contains(&c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}

/// True while `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rfind(')')
                .map(|i| !s[i + 1..].trim_start().starts_with('Z'))
                .unwrap_or(false)
        })
        .unwrap_or(false)
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// A hex mask line (`SigBlk:` etc.) from /proc status text.
pub fn status_mask(status: &str, key: &str) -> u64 {
    let line = status
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("no {key} in {status}"));
    u64::from_str_radix(line[key.len()..].trim(), 16).unwrap()
}

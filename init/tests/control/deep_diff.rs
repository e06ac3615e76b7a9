//! A diff of a pathological tree costs keel one path, not the sum of them (root and
//! /dev/fuse; panics when they are missing while CI is set). The sandbox user makes a chain
//! of 30,000 directories of one-character names (900 MB of paths in all, 60 KB the deepest);
//! `keel diff` (text, through the CLI) and `GET /diff` (JSON, over the control socket)
//! list all of it, and keel's peak RSS (VmHWM, reset through `clear_refs` before each) stays
//! under `BOUND`, where an answer held whole needs its 900 MB at least once.

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{mkdirat, Mode};
use support::control::*;
use support::pid1::*;

const DEPTH: u64 = 30_000;
/// keel's peak during either diff, MiB: what one path, the changed entries' records and the
/// trees of 30,000 directories need, with room; far below the 858 MiB of the paths alone.
const BOUND_MIB: u64 = 160;

/// Counts what it is given, keeping the first and last bytes.
#[derive(Default)]
struct Tally {
    bytes: u64,
    lines: u64,
    head: Vec<u8>,
    tail: Vec<u8>,
}

impl Write for Tally {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.bytes += b.len() as u64;
        self.lines += b.iter().filter(|c| **c == b'\n').count() as u64;
        if self.head.len() < 256 {
            let n = (256 - self.head.len()).min(b.len());
            self.head.extend_from_slice(&b[..n]);
        }
        self.tail.extend_from_slice(b);
        if self.tail.len() > 512 {
            self.tail.drain(..self.tail.len() - 256);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Tally {
    fn last_line(&self) -> String {
        let t = String::from_utf8_lossy(&self.tail);
        t.trim_end().rsplit('\n').next().unwrap_or("").to_string()
    }
}

fn status_kib(pid: i32, key: &str) -> u64 {
    let s = read(std::path::Path::new(&format!("/proc/{pid}/status")));
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
}

/// Resets keel's peak RSS to its RSS now.
fn reset_peak(pid: i32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset VmHWM");
}

/// `GET route` over the Unix socket, the body (chunked or not) counted as it arrives.
fn get_counted(sock: &std::path::Path, route: &str) -> (u16, Tally) {
    let mut s = UnixStream::connect(sock).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    write!(
        s,
        "GET {route} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = BufReader::with_capacity(1 << 16, s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let code: u16 = line[9..12].parse().unwrap();
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line.trim_end().is_empty() {
            break;
        }
        chunked |= line
            .to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked");
    }
    let mut t = Tally::default();
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            let n = u64::from_str_radix(line.trim_end(), 16).unwrap();
            if n == 0 {
                break;
            }
            assert_eq!(std::io::copy(&mut (&mut r).take(n), &mut t).unwrap(), n);
            line.clear();
            r.read_line(&mut line).unwrap();
        }
    } else {
        std::io::copy(&mut r, &mut t).unwrap();
    }
    (code, t)
}

#[test]
fn a_30000_level_chain_is_diffed_with_keel_holding_one_path() {
    if !require_root_and_fuse("deep diff test") {
        return;
    }
    let cfg = format!(
        "{}[control]\nsocket = \"$D/c.sock\"\n[shutdown]\ngrace = \"1s\"\n",
        support::keel::workspace_config("")
    );
    let mut k = start(&cfg, &["sh", "-c", "exec sleep 100000"]);
    k.wait_log("ready after");
    let sock = k.path("c.sock");
    let snap = |name: &str| {
        let r = unix_request(&sock, "POST", &format!("/snapshots?name={name}"));
        assert!(r.code == 200 || r.code == 201, "{r:?}");
    };
    snap("before");
    // The chain, one directory at a time, each made relative to the one above.
    let mut dir = std::fs::File::open(k.path("ws"))
        .unwrap()
        .as_fd()
        .try_clone_to_owned()
        .unwrap();
    for _ in 0..DEPTH {
        mkdirat(&dir, "d", Mode::from_bits_truncate(0o755)).expect("mkdir");
        dir = openat(
            &dir,
            "d",
            OFlag::O_DIRECTORY | OFlag::O_RDONLY,
            Mode::empty(),
        )
        .expect("open");
    }
    drop(dir);
    snap("deep");
    let pid = k.pid();
    let rss = status_kib(pid, "VmRSS:");

    // keel diff, text, over the control socket: line k is "A " and 2k bytes of path.
    reset_peak(pid);
    let mut child = Command::new(KEEL)
        .args(["diff", "--config"])
        .arg(k.path("config.toml"))
        .args(["before", "deep"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut cli = Tally::default();
    std::io::copy(child.stdout.as_mut().unwrap(), &mut cli).unwrap();
    assert!(child.wait().unwrap().success(), "keel diff failed");
    let peak_cli = status_kib(pid, "VmHWM:");
    eprintln!(
        "deep diff: keel RSS before {} MiB; peak during keel diff {} MiB ({} MB out)",
        rss / 1024,
        peak_cli / 1024,
        cli.bytes / 1_000_000
    );
    assert_eq!(cli.lines, DEPTH + 1);
    let paths: u64 = (1..=DEPTH).map(|k| 2 * k + 3).sum();
    let summary = cli.last_line();
    assert_eq!(cli.bytes, paths + summary.len() as u64 + 1, "{summary}");
    assert!(
        summary.ends_with(": 30000 added, 0 removed, 0 modified, 0 renamed"),
        "{summary}"
    );
    assert!(
        cli.head.starts_with(b"A /d\nA /d/d\n"),
        "{:?}",
        String::from_utf8_lossy(&cli.head)
    );

    // GET /diff, JSON, over the control socket.
    reset_peak(pid);
    let (code, api) = get_counted(&sock, "/diff?from=before&to=deep");
    let peak_api = status_kib(pid, "VmHWM:");
    eprintln!(
        "deep diff: peak during GET /diff {} MiB ({} MB out)",
        peak_api / 1024,
        api.bytes / 1_000_000
    );
    if code != 200 {
        let log = k.log_text();
        panic!(
            "GET /diff: {code} {}\nkeel's log ends:\n{}",
            String::from_utf8_lossy(&api.head),
            &log[log.len().saturating_sub(4000)..]
        );
    }
    assert!(api.bytes > paths, "{} bytes", api.bytes);
    let head = String::from_utf8_lossy(&api.head).into_owned();
    assert!(head.contains("\"changes\":["), "{head}");
    assert!(head.contains(r#""path":"/d""#), "{head}");
    assert!(api.last_line().contains("\"trees\""), "{}", api.last_line());

    assert!(
        peak_cli / 1024 <= BOUND_MIB,
        "keel diff: keel peaked at {} MiB",
        peak_cli / 1024
    );
    assert!(
        peak_api / 1024 <= BOUND_MIB,
        "GET /diff: keel peaked at {} MiB",
        peak_api / 1024
    );
    k.signal(nix::sys::signal::Signal::SIGTERM);
    k.wait();
}

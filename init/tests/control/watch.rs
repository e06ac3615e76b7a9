//! `GET /watch` against a real FUSE workspace under `keel run` (root and /dev/fuse; panics
//! when they are missing while CI is set): every writer's changes (a process started
//! through the API, the host writing into the mount) stream in order with their paths; a
//! reconnect with `from=` resumes exactly after its cursor; a cursor older than the window
//! or of another run is 410; a path filter sees only its directory; the stream ends with
//! `end` when keel stops; a tokenless TCP listener and a `[control] group` member get 403.
//! Reads wait for the events a step caused, with a hang guard; nothing depends on timing.

use crate::support;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use support::control::*;
use support::pid1::*;

fn keel(extra_control: &str, window: usize) -> Keel {
    let cfg = format!(
        "{}[control]\nsocket = \"$D/c.sock\"\n{extra_control}\n[shutdown]\ngrace = \"1s\"\n",
        support::keel::workspace_config(&format!("watch_window = {window}"))
    );
    let k = start(&cfg, &["sleep", "100000"]);
    k.wait_log("ready after");
    k
}

fn sock(k: &Keel) -> PathBuf {
    k.path("c.sock")
}

/// One open watch stream, read event by event.
struct Watch {
    r: BufReader<UnixStream>,
    /// De-chunked bytes not yet split into lines.
    pending: Vec<u8>,
    pub code: u16,
    pub error: String,
}

impl Watch {
    fn open(k: &Keel, query: &str) -> Watch {
        let mut s = UnixStream::connect(sock(k)).expect("connect");
        // A hang guard only: every read waits for an event a step already caused.
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(s, "GET /watch?{query} HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
        let mut r = BufReader::new(s);
        let mut status = String::new();
        r.read_line(&mut status).unwrap();
        let code: u16 = status.split(' ').nth(1).unwrap().parse().unwrap();
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            r.read_line(&mut h).unwrap();
            if h == "\r\n" {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut w = Watch {
            r,
            pending: Vec::new(),
            code,
            error: String::new(),
        };
        if code != 200 {
            let mut b = vec![0; len];
            w.r.read_exact(&mut b).unwrap();
            w.error = String::from_utf8_lossy(&b).into_owned();
        }
        w
    }

    /// The next event; None when the stream ended.
    fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(i) = self.pending.iter().position(|b| *b == b'\n') {
                let l: Vec<u8> = self.pending.drain(..=i).collect();
                return Some(serde_json::from_slice(&l).expect("a JSON line"));
            }
            let mut size = String::new();
            if self.r.read_line(&mut size).unwrap() == 0 {
                return None;
            }
            let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
            if n == 0 {
                return None;
            }
            let mut b = vec![0; n + 2];
            self.r.read_exact(&mut b).unwrap();
            self.pending.extend_from_slice(&b[..n]);
        }
    }

    /// Events up to and including the first that `last` accepts.
    fn until(&mut self, last: impl Fn(&Value) -> bool) -> Vec<Value> {
        let mut out = Vec::new();
        loop {
            let e = self
                .next()
                .unwrap_or_else(|| panic!("the stream ended; got {out:#?}"));
            let done = last(&e);
            out.push(e);
            if done {
                return out;
            }
        }
    }
}

fn is(e: &Value, ty: &str, path: &str) -> bool {
    e["type"] == ty && e["path"] == path
}

/// (type, path) of the events, without `attrib` (utimes and chmods that tools add).
fn brief(evs: &[Value]) -> Vec<(String, String)> {
    evs.iter()
        .filter(|e| e["type"] != "attrib")
        .map(|e| {
            let p = match e["from"].as_str() {
                Some(f) => format!("{f} -> {}", e["path"].as_str().unwrap()),
                None => e["path"].as_str().unwrap().to_string(),
            };
            (e["type"].as_str().unwrap().to_string(), p)
        })
        .collect()
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

fn exec(k: &Keel, shell: &str) {
    let r = unix_send(
        &sock(k),
        "POST",
        "/exec",
        json!({ "shell": shell }).to_string().as_bytes(),
    );
    assert_eq!(r.code, 200, "{r:?}");
    let evs = events(&r.body);
    assert_eq!(evs.last().unwrap()["code"], 0, "{evs:?}");
}

#[test]
fn every_writer_streams_in_order_and_a_reconnect_resumes_at_its_cursor() {
    if !require_root_and_fuse("watch test") {
        return;
    }
    let mut k = keel("", 65536);
    let ws = k.path("ws");
    let mut w = Watch::open(&k, "path=/&recursive=1");
    assert_eq!(w.code, 200, "{}", w.error);
    let head = w.next().unwrap();
    assert_eq!(head["type"], "watching", "{head}");
    // A process started through the API.
    exec(&k, "mkdir d && echo hi > d/f && mv d/f d/g && rm d/g");
    let evs = w.until(|e| is(e, "delete", "/d/g"));
    let mut want = pairs(&[("create", "/d"), ("create", "/d/f"), ("modify", "/d/f")]);
    let got = brief(&evs);
    // `echo >` may write in one or two steps (one or two modify events); then the rest.
    let tail = pairs(&[("rename", "/d/f -> /d/g"), ("delete", "/d/g")]);
    assert_eq!(got[..3], want[..], "{evs:#?}");
    assert_eq!(got[got.len() - 2..], tail[..], "{evs:#?}");
    assert!(got[3..got.len() - 2]
        .iter()
        .all(|(t, p)| t == "modify" && p == "/d/f"));
    let f = evs.iter().find(|e| is(e, "modify", "/d/f")).unwrap();
    assert_eq!(f["kind"], "file");
    let last_modify = evs.iter().rev().find(|e| is(e, "modify", "/d/f")).unwrap();
    assert_eq!(last_modify["size"], 3, "the last modify has the final size");
    // Cursors grow, one per event.
    let seqs: Vec<u64> = evs
        .iter()
        .map(|e| {
            let c = e["cursor"].as_str().unwrap();
            u64::from_str_radix(c.split_once('-').unwrap().1, 16).unwrap()
        })
        .collect();
    assert!(seqs.windows(2).all(|p| p[1] == p[0] + 1), "{seqs:?}");
    // The host writing into the mount is a writer too.
    std::fs::write(ws.join("host.txt"), b"from the host").unwrap();
    let evs = w.until(|e| e["type"] == "modify" && e["path"] == "/host.txt");
    assert_eq!(
        brief(&evs)[..2],
        pairs(&[("create", "/host.txt"), ("modify", "/host.txt")])[..]
    );
    let resume = evs[0]["cursor"].as_str().unwrap().to_string();
    drop(w);
    // Changes while nobody is connected, then a reconnect from the create's cursor:
    // everything after it, nothing before it, no gap.
    std::fs::rename(ws.join("host.txt"), ws.join("moved.txt")).unwrap();
    std::fs::create_dir(ws.join("e")).unwrap();
    let mut w = Watch::open(&k, &format!("recursive=1&from={resume}"));
    assert_eq!(w.code, 200, "{}", w.error);
    assert_eq!(w.next().unwrap()["cursor"], resume.as_str());
    let evs = w.until(|e| is(e, "create", "/e"));
    want = pairs(&[
        ("modify", "/host.txt"),
        ("rename", "/host.txt -> /moved.txt"),
        ("create", "/e"),
    ]);
    let got = brief(&evs);
    assert_eq!(got[got.len() - 2..], want[1..], "{evs:#?}");
    assert!(
        got[..got.len() - 2].iter().all(|p| *p == want[0]),
        "{evs:#?}"
    );
    // A path filter: /e and its direct entries, not deeper ones, not elsewhere.
    let mut flat = Watch::open(&k, "path=e&recursive=0");
    assert_eq!(flat.next().unwrap()["path"], "/e");
    std::fs::create_dir(ws.join("e/sub")).unwrap();
    std::fs::write(ws.join("e/sub/deep"), b"").unwrap();
    std::fs::write(ws.join("other"), b"").unwrap();
    std::fs::write(ws.join("e/top"), b"").unwrap();
    let evs = flat.until(|e| is(e, "create", "/e/top"));
    assert_eq!(
        brief(&evs),
        pairs(&[("create", "/e/sub"), ("create", "/e/top")]),
        "{evs:#?}"
    );
    // keel stops: the open stream gets what is left, then its end.
    k.signal(nix::sys::signal::Signal::SIGTERM);
    let evs = w.until(|e| e["type"] == "end");
    assert!(evs.iter().any(|e| is(e, "create", "/e/top")), "{evs:#?}");
    assert!(w.next().is_none(), "the stream goes on after its end");
    k.wait();
}

#[test]
fn an_old_or_foreign_cursor_is_refused_and_only_the_agents_rights_may_watch() {
    if !require_root_and_fuse("watch test") {
        return;
    }
    let mut k = keel("listen = \"127.0.0.1:0\"\ngroup = \"nogroup\"", 8);
    let ws = k.path("ws");
    let mut w = Watch::open(&k, "");
    let c0 = w.next().unwrap()["cursor"].as_str().unwrap().to_string();
    for i in 0..20 {
        std::fs::create_dir(ws.join(format!("d{i}"))).unwrap();
    }
    // 20 events through a window of 8: a reader slower than the mkdirs is told it lost
    // some (either ending is right; each mkdir's event is in the journal before it returns).
    let seen = w.until(|e| is(e, "create", "/d19") || e["type"] == "lost");
    let last = seen.last().unwrap();
    if last["type"] == "lost" {
        assert!(
            last["error"]
                .as_str()
                .unwrap()
                .contains("older than the feed's window"),
            "{last}"
        );
    }
    drop(w);
    let old = Watch::open(&k, &format!("from={c0}"));
    assert_eq!(old.code, 410, "{}", old.error);
    assert!(
        old.error.contains("older than the feed's window"),
        "{}",
        old.error
    );
    let run = c0.split_once('-').unwrap().0;
    let other = format!("{}-0", if run == "1" { "2" } else { "1" });
    let foreign = Watch::open(&k, &format!("from={other}"));
    assert_eq!(foreign.code, 410, "{}", foreign.error);
    assert!(
        foreign.error.contains("another keel run"),
        "{}",
        foreign.error
    );
    assert_eq!(Watch::open(&k, "from=nonsense").code, 400);
    assert_eq!(Watch::open(&k, "path=../etc").code, 400);
    // A tokenless TCP listener and a [control] group member may not watch.
    k.wait_log("control API on http://");
    let log = k.log_text();
    let rest = &log[log.find("control API on http://").unwrap() + 22..];
    let addr: std::net::SocketAddr = rest
        .split(char::is_whitespace)
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(get(addr, "/watch", None).code, 403);
    assert_eq!(get(addr, "/status", None).code, 200);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(k.scratch(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = |url: &str| support::control::status_as_nobody(&sock(&k), &[url]);
    assert_eq!(as_nobody("http://k/status"), "200");
    assert_eq!(as_nobody("http://k/watch"), "403");
    k.signal(nix::sys::signal::Signal::SIGTERM);
    k.wait();
}

//! The files API (`/files`) against `keel run` with the real FUSE workspace (root and
//! /dev/fuse; panics when they are missing while CI is set): uploads are streamed and
//! atomic (an interrupted one leaves the old file and no temporary one), `ETag` is the
//! content hash and `If-Match` refuses a stale one with 412, `Range` answers 206, listings,
//! mkdir, move and delete do what they say; every operation runs as the asked-for user
//! inside the sandbox, so another user's 0600 file, keel's state dir, `..`, a symlink out of
//! the workspace and `/proc/1/root` are all refused; a `[control] group` member and a
//! tokenless TCP caller get 403; `keel files get|put|ls` round-trips.

use crate::support;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use support::control::*;
use support::pid1::*;

fn keel(control: &str) -> Keel {
    let cfg = format!(
        "{}[control]\nsocket = \"$D/c.sock\"\n{control}\n[shutdown]\ngrace = \"1s\"\n\
         [files]\nmax_upload = \"8MiB\"\n",
        support::keel::workspace_config("")
    );
    let k = start(&cfg, &["sleep", "100000"]);
    k.wait_log("ready after");
    // The API takes processes (and so files helpers) once the supervisor runs.
    poll("the files API ready", || {
        (get(&k, "/files?path=.&list=1").code != 503).then_some(())
    });
    k
}

fn stop(k: &mut Keel) {
    k.signal(nix::sys::signal::Signal::SIGTERM);
    k.wait();
}

fn sock(k: &Keel) -> PathBuf {
    k.path("c.sock")
}

/// One answer, its body as bytes.
struct Ans {
    code: u16,
    head: String,
    body: Vec<u8>,
}

impl std::fmt::Debug for Ans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = String::from_utf8_lossy(&self.body[..self.body.len().min(400)]);
        write!(f, "{} {}", self.head, b)
    }
}

impl Ans {
    fn header(&self, name: &str) -> Option<String> {
        parse(format!("{}\r\n\r\n", self.head).as_bytes()).header(name)
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

fn exchange(s: &mut UnixStream) -> Ans {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // keel refused a request before reading its whole body (413) and closed: the
            // kernel then ends the stream with a reset instead of EOF once the answer is
            // read, as any HTTP client sees it (a fixed-length answer is checked whole
            // below).
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset && !out.is_empty() => break,
            Err(e) => panic!("read response: {e}"),
        }
    }
    let end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no header end")
        + 4;
    let r = parse(&out[..end]);
    let chunked = r
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(&out[end..])
    } else {
        out[end..].to_vec()
    };
    if let Some(n) = r.header("content-length") {
        assert_eq!(
            n.parse::<usize>().ok(),
            Some(body.len()),
            "a cut answer: {}",
            r.head
        );
    }
    Ans {
        code: r.code,
        head: r.head,
        body,
    }
}

/// `method target` with `headers` and `body` (Content-Length) over the control socket.
fn call(k: &Keel, method: &str, target: &str, headers: &[(&str, &str)], body: &[u8]) -> Ans {
    let mut s = UnixStream::connect(sock(k)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!(
        "{method} {target} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // A refusal may come before the body (413 by Content-Length) and close the connection.
    let _ = s.write_all(body);
    exchange(&mut s)
}

/// A PUT sent in chunks (Transfer-Encoding: chunked), the way a streaming client sends.
fn put_chunked(k: &Keel, target: &str, headers: &[(&str, &str)], body: &[u8]) -> Ans {
    let mut s = UnixStream::connect(sock(k)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!("PUT {target} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n");
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let _ = (|| -> std::io::Result<()> {
        for c in body.chunks(100_000) {
            s.write_all(format!("{:x}\r\n", c.len()).as_bytes())?;
            s.write_all(c)?;
            s.write_all(b"\r\n")?;
        }
        s.write_all(b"0\r\n\r\n")
    })();
    exchange(&mut s)
}

fn get(k: &Keel, target: &str) -> Ans {
    call(k, "GET", target, &[], b"")
}

fn post_json(k: &Keel, target: &str, v: Value) -> Ans {
    call(k, "POST", target, &[], v.to_string().as_bytes())
}

fn bytes(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn mode_of(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn files_round_trip_with_etags_ranges_listings_and_moves() {
    if !require_root_and_fuse("files test") {
        return;
    }
    let mut k = keel("");
    let ws = k.path("ws");
    // A streamed upload of 3 MiB of binary bytes, into a directory made first.
    let r = post_json(&k, "/files/mkdir", json!({"path": "a/b", "parents": true}));
    assert_eq!(r.code, 201, "{r:?}");
    assert!(ws.join("a/b").is_dir());
    let data = bytes(3 << 20, 1);
    let r = put_chunked(&k, "/files?path=a/b/blob.bin&mode=0640", &[], &data);
    assert_eq!(r.code, 201, "{r:?}");
    let etag = r.header("etag").expect("an ETag");
    assert_eq!(r.json()["etag"], etag.as_str());
    assert_eq!(r.json()["size"], data.len());
    assert!(std::fs::read(ws.join("a/b/blob.bin")).unwrap() == data);
    assert_eq!(mode_of(&ws.join("a/b/blob.bin")), 0o640);
    // Read back byte-exact, with the same ETag; an absolute path inside the workspace too.
    let r = get(&k, "/files?path=a/b/blob.bin");
    assert_eq!(r.code, 200, "{}", r.head);
    assert!(r.body == data, "the bytes differ");
    assert_eq!(r.header("etag").as_deref(), Some(etag.as_str()));
    let abs = format!("/files?path={}/a/b/blob.bin", ws.display());
    assert!(get(&k, &abs).body == data);
    // Ranges.
    let r = call(
        &k,
        "GET",
        "/files?path=a/b/blob.bin",
        &[("Range", "bytes=10-19")],
        b"",
    );
    assert_eq!(r.code, 206);
    assert_eq!(r.body, &data[10..20]);
    let total = data.len();
    assert_eq!(
        r.header("content-range").unwrap(),
        format!("bytes 10-19/{total}")
    );
    let r = call(
        &k,
        "GET",
        "/files?path=a/b/blob.bin",
        &[("Range", "bytes=-5")],
        b"",
    );
    assert_eq!((r.code, &r.body[..]), (206, &data[total - 5..]));
    let r = call(
        &k,
        "GET",
        "/files?path=a/b/blob.bin",
        &[("Range", &format!("bytes={total}-"))],
        b"",
    );
    assert_eq!(r.code, 416, "{r:?}");
    // If-Match: the current ETag replaces (the mode is kept), a stale one gets 412.
    let r = call(
        &k,
        "PUT",
        "/files?path=a/b/blob.bin",
        &[("If-Match", &etag)],
        b"second",
    );
    assert_eq!(r.code, 200, "{r:?}");
    let etag2 = r.header("etag").unwrap();
    assert_ne!(etag2, etag);
    assert_eq!(
        mode_of(&ws.join("a/b/blob.bin")),
        0o640,
        "the mode was not kept"
    );
    let r = call(
        &k,
        "PUT",
        "/files?path=a/b/blob.bin",
        &[("If-Match", &etag)],
        b"third",
    );
    assert_eq!(r.code, 412, "{r:?}");
    assert_eq!(std::fs::read(ws.join("a/b/blob.bin")).unwrap(), b"second");
    let r = call(
        &k,
        "PUT",
        "/files?path=a/b/blob.bin",
        &[("If-None-Match", "*")],
        b"x",
    );
    assert_eq!(r.code, 412, "{r:?}");
    let r = call(
        &k,
        "PUT",
        "/files?path=a/new.txt",
        &[("If-None-Match", "*")],
        b"new\n",
    );
    assert_eq!(r.code, 201, "{r:?}");
    // A directory is listed, not read; listings descend to depth.
    assert_eq!(get(&k, "/files?path=a").code, 400);
    std::os::unix::fs::symlink("b/blob.bin", ws.join("a/link")).unwrap();
    let l = get(&k, "/files?path=a&list=1").json();
    let names: Vec<&str> = l["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a/b", "a/link", "a/new.txt"], "{l}");
    assert_eq!(l["entries"][0]["type"], "dir");
    assert_eq!(l["entries"][1]["type"], "symlink");
    assert_eq!(l["entries"][1]["target"], "b/blob.bin");
    assert_eq!(l["entries"][2]["size"], 4);
    let l = get(&k, "/files?path=.&list=1&depth=3").json();
    let names: Vec<&str> = l["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"a/b/blob.bin"), "{names:?}");
    assert_eq!(get(&k, "/files?path=a/new.txt&list=1").code, 400);
    // Move: no overwrite unless asked.
    let r = post_json(
        &k,
        "/files/move",
        json!({"from": "a/new.txt", "to": "a/b/blob.bin"}),
    );
    assert_eq!(r.code, 409, "{r:?}");
    let r = post_json(
        &k,
        "/files/move",
        json!({"from": "a/new.txt", "to": "moved.txt"}),
    );
    assert_eq!(r.code, 200, "{r:?}");
    assert_eq!(std::fs::read(ws.join("moved.txt")).unwrap(), b"new\n");
    assert!(!ws.join("a/new.txt").exists());
    // Delete: a non-empty directory only with recursive=1.
    assert_eq!(call(&k, "DELETE", "/files?path=a", &[], b"").code, 409);
    let r = call(&k, "DELETE", "/files?path=a&recursive=1", &[], b"");
    assert_eq!(r.code, 200, "{r:?}");
    assert!(!ws.join("a").exists());
    assert_eq!(call(&k, "DELETE", "/files?path=a", &[], b"").code, 404);
    assert_eq!(call(&k, "DELETE", "/files?path=.", &[], b"").code, 400);
    // Bad requests say what is wrong.
    assert_eq!(get(&k, "/files?path=nope").code, 404);
    assert_eq!(get(&k, "/files").code, 400);
    let r = post_json(&k, "/files/mkdir", json!({"path": "x", "bogus": 1}));
    assert_eq!(r.code, 400);
    assert!(r.error().contains("bogus"), "{r:?}");
    stop(&mut k);
}

#[test]
fn an_upload_is_atomic_and_one_cut_short_or_too_large_changes_nothing() {
    if !require_root_and_fuse("files test") {
        return;
    }
    let mut k = keel("");
    let ws = k.path("ws");
    std::fs::write(ws.join("f"), b"old content\n").unwrap();
    // Half an upload: the file is still the old one while it arrives.
    let mut s = UnixStream::connect(sock(&k)).unwrap();
    s.write_all(b"PUT /files?path=f HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        .unwrap();
    let half = bytes(1 << 20, 2);
    s.write_all(format!("{:x}\r\n", half.len()).as_bytes())
        .unwrap();
    s.write_all(&half).unwrap();
    s.write_all(b"\r\n").unwrap();
    s.flush().unwrap();
    // The temporary file appears with the bytes sent so far; the file itself is unchanged.
    let tmp = poll("the upload's temporary file", || {
        std::fs::read_dir(&ws)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().contains(".keel-put-"))
    });
    assert_eq!(std::fs::read(ws.join("f")).unwrap(), b"old content\n");
    // The client goes away: the old file stays, the temporary one is removed.
    drop(s);
    poll("the temporary file removed", || {
        (!tmp.exists()).then_some(())
    });
    assert_eq!(std::fs::read(ws.join("f")).unwrap(), b"old content\n");
    // Larger than [files] max_upload (8 MiB): 413, by Content-Length at once, or counted.
    let big = bytes(9 << 20, 3);
    let r = call(&k, "PUT", "/files?path=f", &[], &big);
    assert_eq!(r.code, 413, "{r:?}");
    let r = put_chunked(&k, "/files?path=f", &[], &big);
    assert_eq!(r.code, 413, "{r:?}");
    assert_eq!(std::fs::read(ws.join("f")).unwrap(), b"old content\n");
    let left: Vec<_> = std::fs::read_dir(&ws)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".keel-put-"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    stop(&mut k);
}

#[test]
fn files_run_as_the_user_inside_the_sandbox_and_cannot_leave_the_workspace() {
    if !require_root_and_fuse("files security test") {
        return;
    }
    let mut k = keel("listen = \"127.0.0.1:0\"\ngroup = \"nogroup\"");
    let ws = k.path("ws");
    let state = k.path("state");
    std::fs::write(ws.join("secret"), b"root only\n").unwrap();
    std::fs::set_permissions(ws.join("secret"), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::create_dir(ws.join("rootdir")).unwrap();
    std::fs::set_permissions(ws.join("rootdir"), std::fs::Permissions::from_mode(0o755)).unwrap();
    // Symlinks out of the workspace: absolute and relative to keel's state dir, and to
    // /proc/1/root (keel's root, with the state dir in it).
    std::os::unix::fs::symlink(&state, ws.join("abs-out")).unwrap();
    std::os::unix::fs::symlink("../state", ws.join("rel-out")).unwrap();
    std::os::unix::fs::symlink("/proc/1/root", ws.join("proc-out")).unwrap();
    let st = state.display();
    let refused: Vec<String> = vec![
        // keel's state dir, by absolute path and through `..`.
        format!("/files?path={st}/meta.db"),
        "/files?path=../state/meta.db".into(),
        "/files?path=rootdir/../../state/meta.db".into(),
        "/files?path=abs-out/meta.db".into(),
        "/files?path=rel-out/meta.db".into(),
        "/files?path=proc-out/etc/hostname".into(),
        "/files?path=/proc/1/root/etc/hostname".into(),
        format!("/files?path=../state&list=1"),
        "/files?path=abs-out&list=1".into(),
        "/files?path=/etc/passwd".into(),
    ];
    for t in &refused {
        let r = get(&k, t);
        assert_eq!(r.code, 403, "{t}: {r:?}");
        assert!(!r.error().is_empty(), "{t}: no reason");
    }
    // Writes through the same ways out create nothing outside.
    for p in [
        "../state/pwned",
        "rel-out/pwned",
        "abs-out/pwned",
        "proc-out/tmp/pwned",
    ] {
        let r = call(&k, "PUT", &format!("/files?path={p}"), &[], b"x");
        assert_eq!(r.code, 403, "{p}: {r:?}");
    }
    assert!(!state.join("pwned").exists());
    let r = post_json(
        &k,
        "/files/move",
        json!({"from": "secret", "to": "../secret"}),
    );
    assert_eq!(r.code, 403, "{r:?}");
    let r = post_json(&k, "/files/mkdir", json!({"path": "rel-out/x"}));
    assert_eq!(r.code, 403, "{r:?}");
    assert_eq!(
        call(&k, "DELETE", "/files?path=rel-out/meta.db", &[], b"").code,
        403
    );
    assert!(
        state.join(keel::state::META_DB).exists() || state.read_dir().unwrap().next().is_some()
    );
    // Another user's 0600 file, as nobody: the kernel says no; root (the sandbox's user
    // here) reads it.
    let r = get(&k, "/files?path=secret&user=nobody");
    assert_eq!(r.code, 403, "{r:?}");
    assert_eq!(get(&k, "/files?path=secret").body, b"root only\n");
    let r = call(&k, "PUT", "/files?path=secret&user=nobody", &[], b"mine");
    assert_eq!(r.code, 403, "{r:?}");
    let r = call(&k, "PUT", "/files?path=rootdir/f&user=nobody", &[], b"mine");
    assert_eq!(r.code, 403, "{r:?}");
    assert_eq!(
        call(&k, "DELETE", "/files?path=secret&user=nobody", &[], b"").code,
        403
    );
    assert_eq!(std::fs::read(ws.join("secret")).unwrap(), b"root only\n");
    // What nobody writes is nobody's.
    let r = post_json(&k, "/files/mkdir", json!({"path": "nb", "mode": "0777"}));
    assert_eq!(r.code, 201);
    std::fs::set_permissions(ws.join("nb"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let r = call(&k, "PUT", "/files?path=nb/f&user=nobody", &[], b"n");
    assert_eq!(r.code, 201, "{r:?}");
    use std::os::unix::fs::MetadataExt;
    let nobody = nix::unistd::User::from_name("nobody")
        .unwrap()
        .unwrap()
        .uid
        .as_raw();
    assert_eq!(std::fs::metadata(ws.join("nb/f")).unwrap().uid(), nobody);
    assert_eq!(get(&k, "/files?path=x&user=no-such-user").code, 400);
    // A tokenless TCP listener observes only; so does a member of [control] group.
    k.wait_log("control API on http://");
    let log = k.log_text();
    let rest = &log[log.find("control API on http://").unwrap() + 22..];
    let addr: std::net::SocketAddr = rest
        .split(char::is_whitespace)
        .next()
        .unwrap()
        .parse()
        .unwrap();
    for (m, p) in [
        ("GET", "/files?path=secret"),
        ("PUT", "/files?path=tcp"),
        ("DELETE", "/files?path=secret"),
    ] {
        let r = request(addr, m, p, None);
        assert_eq!(r.code, 403, "{m} {p}: {r:?}");
    }
    let r = raw(
        addr,
        b"POST /files/mkdir HTTP/1.1\r\nHost: t\r\nContent-Length: 14\r\n\r\n{\"path\":\"tcp\"}",
    );
    assert_eq!(r.code, 403, "{r:?}");
    std::fs::set_permissions(k.scratch(), std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(
        support::control::status_as_nobody(&sock(&k), &["http://k/files?path=secret"]),
        "403"
    );
    assert!(!ws.join("tcp").exists());
    stop(&mut k);
}

#[test]
fn keel_files_get_put_and_ls() {
    if !require_root_and_fuse("keel files test") {
        return;
    }
    let mut k = keel("");
    let ws = k.path("ws");
    let src = k.path("src.bin");
    let data = bytes(200_000, 4);
    std::fs::write(&src, &data).unwrap();
    let keel_files = |args: &[&str]| {
        std::process::Command::new(KEEL)
            .args(["files", "--socket"])
            .arg(sock(&k))
            .args(args)
            .output()
            .unwrap()
    };
    let out = keel_files(&[
        "put",
        "up.bin",
        "--input",
        src.to_str().unwrap(),
        "--mode",
        "0600",
    ]);
    assert!(out.status.success(), "{out:?}");
    let etag = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(etag.starts_with('"') && etag.len() == 66, "{etag}");
    assert!(std::fs::read(ws.join("up.bin")).unwrap() == data);
    assert_eq!(mode_of(&ws.join("up.bin")), 0o600);
    let out = keel_files(&["get", "up.bin"]);
    assert!(
        out.status.success() && out.stdout == data,
        "{:?}",
        out.status
    );
    let out = keel_files(&["ls"]);
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["entries"][0]["name"], "up.bin", "{v}");
    // A stale If-Match: exit 1, the answer's reason, nothing changed.
    let out = keel_files(&[
        "put",
        "up.bin",
        "--input",
        "/dev/null",
        "--if-match",
        "\"00\"",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("412"),
        "{out:?}"
    );
    assert!(std::fs::read(ws.join("up.bin")).unwrap() == data);
    let out = keel_files(&["get", "../state/meta.db"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("403"),
        "{out:?}"
    );
    stop(&mut k);
}

#[test]
fn a_directory_comes_as_a_tar_stream_that_tar_extracts() {
    if !require_root_and_fuse("files tar test") {
        return;
    }
    let mut k = keel("");
    let ws = k.path("ws");
    std::fs::create_dir_all(ws.join("d/sub")).unwrap();
    std::fs::write(ws.join("d/a.txt"), b"alpha\n").unwrap();
    std::fs::set_permissions(ws.join("d/a.txt"), std::fs::Permissions::from_mode(0o640)).unwrap();
    let blob = bytes(300_000, 5);
    std::fs::write(ws.join("d/sub/b.bin"), &blob).unwrap();
    std::os::unix::fs::symlink("a.txt", ws.join("d/link")).unwrap();
    let long = "n".repeat(120);
    std::fs::write(ws.join("d/sub").join(&long), b"long name\n").unwrap();
    let r = get(&k, "/files?path=d&tar=1");
    assert_eq!(r.code, 200, "{r:?}");
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/x-tar")
    );
    let out = k.path("untar");
    std::fs::create_dir(&out).unwrap();
    let mut tar = std::process::Command::new("tar")
        .args(["-x", "-p", "-f", "-", "-C"])
        .arg(&out)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("tar");
    tar.stdin.take().unwrap().write_all(&r.body).unwrap();
    assert!(
        tar.wait().unwrap().success(),
        "tar could not extract the stream"
    );
    assert_eq!(std::fs::read(out.join("a.txt")).unwrap(), b"alpha\n");
    assert_eq!(mode_of(&out.join("a.txt")), 0o640);
    assert!(std::fs::read(out.join("sub/b.bin")).unwrap() == blob);
    assert_eq!(
        std::fs::read_link(out.join("link")).unwrap(),
        Path::new("a.txt")
    );
    assert_eq!(
        std::fs::read(out.join("sub").join(&long)).unwrap(),
        b"long name\n"
    );
    // As a user who cannot read everything in it: 403 before a byte of the archive.
    let r = get(&k, "/files?path=d&tar=1&user=nobody");
    assert_eq!(r.code, 403, "{r:?}");
    assert!(r.error().contains("d/a.txt"), "{r:?}");
    std::fs::set_permissions(ws.join("d/a.txt"), std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::create_dir(ws.join("d/locked")).unwrap();
    std::fs::set_permissions(ws.join("d/locked"), std::fs::Permissions::from_mode(0o700)).unwrap();
    let r = get(&k, "/files?path=d&tar=1&user=nobody");
    assert_eq!(r.code, 403, "{r:?}");
    assert!(r.error().contains("d/locked"), "{r:?}");
    std::fs::set_permissions(ws.join("d/locked"), std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(get(&k, "/files?path=d&tar=1&user=nobody").code, 200);
    // And never out of the workspace.
    assert_eq!(get(&k, "/files?path=..&tar=1").code, 403);
    assert_eq!(get(&k, "/files?path=d/a.txt&tar=1").code, 400);
    stop(&mut k);
}

/// A tar archive made by Python's tarfile from `members` (name, type, data or link
/// target), so the test can craft what `tar` itself would refuse to make.
fn crafted_tar(k: &Keel, members: &[(&str, &str, &str)]) -> Vec<u8> {
    let spec = serde_json::to_string(members).unwrap();
    let script = "import io,json,sys,tarfile\n\
        b=io.BytesIO(); t=tarfile.open(fileobj=b,mode='w',format=tarfile.GNU_FORMAT)\n\
        for n,ty,d in json.loads(sys.argv[1]):\n\
        \x20   i=tarfile.TarInfo(n)\n\
        \x20   if ty=='dir': i.type=tarfile.DIRTYPE; i.mode=0o755; t.addfile(i)\n\
        \x20   elif ty=='sym': i.type=tarfile.SYMTYPE; i.linkname=d; t.addfile(i)\n\
        \x20   elif ty=='hard': i.type=tarfile.LNKTYPE; i.linkname=d; t.addfile(i)\n\
        \x20   else: i.size=len(d); i.mode=0o600; t.addfile(i,io.BytesIO(d.encode()))\n\
        t.close(); sys.stdout.buffer.write(b.getvalue())\n";
    let out = std::process::Command::new("python3")
        .args(["-c", script, &spec])
        .current_dir(k.scratch())
        .output()
        .expect("python3");
    assert!(out.status.success(), "{out:?}");
    out.stdout
}

#[test]
fn a_tar_stream_is_extracted_as_the_user_and_never_out_of_its_directory() {
    if !require_root_and_fuse("files untar test") {
        return;
    }
    let mut k = keel("");
    let ws = k.path("ws");
    let state = k.path("state");
    let archive = crafted_tar(
        &k,
        &[
            ("top", "dir", ""),
            ("top/f.txt", "file", "hello\n"),
            ("top/sub/g.txt", "file", "deeper\n"),
            ("top/link", "sym", "f.txt"),
        ],
    );
    let r = put_chunked(&k, "/files?path=up&tar=1", &[], &archive);
    assert_eq!(r.code, 200, "{r:?}");
    assert_eq!(r.json()["entries"], 4);
    assert_eq!(std::fs::read(ws.join("up/top/f.txt")).unwrap(), b"hello\n");
    assert_eq!(mode_of(&ws.join("up/top/f.txt")), 0o600);
    assert_eq!(
        std::fs::read(ws.join("up/top/sub/g.txt")).unwrap(),
        b"deeper\n"
    );
    assert_eq!(
        std::fs::read_link(ws.join("up/top/link")).unwrap(),
        Path::new("f.txt")
    );
    // Round trip: what GET tar=1 sends, PUT tar=1 puts back.
    let back = get(&k, "/files?path=up&tar=1").body;
    let r = put_chunked(&k, "/files?path=copy&tar=1", &[], &back);
    assert_eq!(r.code, 200, "{r:?}");
    assert_eq!(
        std::fs::read(ws.join("copy/top/sub/g.txt")).unwrap(),
        b"deeper\n"
    );
    // Ways out: `..`, an absolute name, a symlink out and then through it, a hard link.
    let outside = k.path("outside");
    std::fs::create_dir(&outside).unwrap();
    let out_s = outside.to_str().unwrap();
    let evil = format!("{out_s}/evil");
    let cases: Vec<Vec<(&str, &str, &str)>> = vec![
        vec![("../../outside/evil", "file", "x")],
        vec![(evil.as_str(), "file", "x")],
        vec![("esc", "sym", out_s), ("esc/evil", "file", "x")],
        vec![("esc2", "sym", "../../outside"), ("esc2/evil", "file", "x")],
        vec![("p", "sym", "/proc/1/root"), ("p/tmp/evil", "file", "x")],
        vec![("h", "hard", "/etc/passwd")],
    ];
    for (i, c) in cases.iter().enumerate() {
        let r = put_chunked(
            &k,
            &format!("/files?path=atk{i}&tar=1"),
            &[],
            &crafted_tar(&k, c),
        );
        assert!(matches!(r.code, 400 | 403), "case {i} {c:?}: {r:?}");
    }
    assert!(
        !outside.join("evil").exists(),
        "a tar member landed outside"
    );
    assert!(std::fs::read_dir(&outside).unwrap().next().is_none());
    assert!(!state.join("evil").exists());
    // As nobody into root's directory: the kernel refuses.
    std::fs::create_dir(ws.join("rootonly")).unwrap();
    let r = put_chunked(&k, "/files?path=rootonly&tar=1&user=nobody", &[], &archive);
    assert_eq!(r.code, 403, "{r:?}");
    assert!(std::fs::read_dir(ws.join("rootonly"))
        .unwrap()
        .next()
        .is_none());
    stop(&mut k);
}

/// The names in the workspace's root that an upload in progress uses.
fn uploads_in_progress(ws: &Path, name: &str) -> Vec<String> {
    std::fs::read_dir(ws)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!(".{name}.keel-put-")))
        .collect()
}

#[test]
fn if_match_holds_until_the_replace_so_a_writer_that_slips_in_meanwhile_is_kept() {
    if !require_root_and_fuse("files test") {
        return;
    }
    let mut k = keel("");
    let ws = k.path("ws");
    for how in ["write in place", "rename over", "nothing"] {
        std::fs::write(ws.join("f"), b"v1").unwrap();
        std::fs::set_permissions(ws.join("f"), std::fs::Permissions::from_mode(0o666)).unwrap();
        let etag = get(&k, "/files?path=f").header("etag").unwrap();
        let mut s = UnixStream::connect(sock(&k)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        write!(
            s,
            "PUT /files?path=f HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\
             If-Match: {etag}\r\n\r\n6\r\nupload\r\n"
        )
        .unwrap();
        // The helper makes its temporary file only after it checked the ETag: once it is
        // there, the check is behind us.
        poll("the upload's temporary file", || {
            (!uploads_in_progress(&ws, "f").is_empty()).then_some(())
        });
        match how {
            "write in place" => std::fs::write(ws.join("f"), b"writer").unwrap(),
            "rename over" => {
                std::fs::write(ws.join("g"), b"writer").unwrap();
                std::fs::rename(ws.join("g"), ws.join("f")).unwrap();
            }
            _ => {}
        }
        s.write_all(b"1\r\n!\r\n0\r\n\r\n").unwrap();
        let r = exchange(&mut s);
        let now = std::fs::read(ws.join("f")).unwrap();
        if how == "nothing" {
            assert_eq!(r.code, 200, "{how}: {r:?}");
            assert_eq!(now, b"upload!", "{how}");
        } else {
            assert_eq!(
                r.code, 412,
                "{how}: the writer's change was overwritten: {r:?}"
            );
            assert_eq!(now, b"writer", "{how}");
        }
        assert!(
            uploads_in_progress(&ws, "f").is_empty(),
            "{how}: a temporary file stayed"
        );
    }
    stop(&mut k);
}

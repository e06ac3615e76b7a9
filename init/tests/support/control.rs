//! Shared helpers for the control API tests: a deliberately independent, minimal HTTP client
//! over real TCP and Unix sockets (so the server is checked against bytes, not against its
//! own parser), and JSON access.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Resp {
    pub code: u16,
    pub head: String,
    pub body: String,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

/// Parses a raw HTTP/1.1 response.
pub fn parse(raw: &[u8]) -> Resp {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {text:?}"));
    let code = head
        .strip_prefix("HTTP/1.1 ")
        // An HTTP/1.0 request is answered in HTTP/1.0.
        .or_else(|| head.strip_prefix("HTTP/1.0 "))
        .and_then(|r| r[..3].parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    Resp {
        code,
        head: head.to_string(),
        body: body.to_string(),
    }
}

fn exchange<S: Read + Write>(mut s: S, raw: &[u8]) -> Resp {
    s.write_all(raw).expect("send request");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read response");
    parse(&out)
}

/// Sends raw bytes to `addr` and reads the whole response.
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> Resp {
    // Hang guards only: every answer these tests wait for comes.
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(60)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    exchange(s, bytes)
}

pub fn request(addr: SocketAddr, method: &str, path: &str, token: Option<&str>) -> Resp {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    raw(
        addr,
        format!("{method} {path} HTTP/1.1\r\nHost: test\r\n{auth}Content-Length: 0\r\n\r\n")
            .as_bytes(),
    )
}

pub fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> Resp {
    request(addr, "GET", path, token)
}

pub fn post(addr: SocketAddr, path: &str, token: Option<&str>) -> Resp {
    request(addr, "POST", path, token)
}

/// `GET path` over a Unix socket.
pub fn unix_get(socket: &Path, path: &str) -> Resp {
    unix_request(socket, "GET", path)
}

/// `method path` over a Unix socket.
pub fn unix_request(socket: &Path, method: &str, path: &str) -> Resp {
    let s = UnixStream::connect(socket).expect("connect to the control socket");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    exchange(
        s,
        format!("{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n").as_bytes(),
    )
}

/// The value of the Prometheus sample `line_prefix` (e.g. `keel_services{state="ready"}`).
/// The HTTP status `curl ARGS...` gets over the Unix socket `socket` when run as `nobody`
/// (primary group `nogroup`, no others): the socket's rights as a stranger or a `[control]
/// group` member sees them. The socket's directories must be searchable by others.
pub fn status_as_nobody(socket: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--unix-socket",
        ])
        .arg(socket)
        .args(args)
        .output()
        .expect("setpriv + curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn metric(text: &str, line_prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix)?.strip_prefix(' ')?.parse().ok())
}

/// The body of a `Transfer-Encoding: chunked` answer, de-chunked (an independent reading of
/// the framing, for streamed answers).
pub fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = String::from_utf8_lossy(&raw[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16)
            .unwrap_or_else(|_| panic!("bad chunk size {size_text:?}"));
        raw = &raw[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// `method path` with `body` over a Unix socket; a chunked answer is de-chunked.
pub fn unix_send(socket: &Path, method: &str, path: &str, body: &[u8]) -> Resp {
    let mut s = UnixStream::connect(socket).expect("connect to the control socket");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("send request");
    s.write_all(body).expect("send body");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read response");
    let end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no header end")
        + 4;
    let mut r = parse(&out[..end]);
    let chunked = r
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(&out[end..])
    } else {
        out[end..].to_vec()
    };
    r.body = String::from_utf8_lossy(&body).into_owned();
    r
}

/// The NDJSON events of a streamed answer.
pub fn events(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect()
}

//! Just enough HTTP/1.1 for the control API, over any byte stream: read one request head (at
//! most 16 KiB, within a deadline), discard a small `Content-Length` body, and write one
//! response with `Connection: close`. Anything unusual (chunked bodies, folded headers,
//! HTTP/2, oversized heads) is answered with the matching 4xx/5xx instead of guessed at.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

/// Largest request head (request line + headers) accepted.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest request body accepted (and discarded); the API takes no input.
pub const MAX_BODY: usize = 16 * 1024;
const MAX_HEADERS: usize = 100;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("read request: {0}")]
    Read(io::Error),
    #[error("request not received in time")]
    Timeout,
    #[error("connection closed before a full request")]
    Closed,
    #[error("request head is larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("request body is larger than {MAX_BODY} bytes")]
    BodyTooLarge,
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    #[error("unsupported HTTP version")]
    Version,
    #[error("unsupported: {0}")]
    Unsupported(&'static str),
}

impl HttpError {
    /// The answer for this failure, if the client is still there to read one.
    pub fn response(&self) -> Option<Response> {
        let (code, msg) = match self {
            HttpError::Read(_) | HttpError::Closed => return None,
            HttpError::Timeout => (408, "request timeout"),
            HttpError::HeadTooLarge => (431, "request header fields too large"),
            HttpError::BodyTooLarge => (413, "payload too large"),
            HttpError::Malformed(_) => (400, "bad request"),
            HttpError::Version => (505, "HTTP version not supported"),
            HttpError::Unsupported(_) => (501, "not implemented"),
        };
        Some(Response::text(code, &format!("{msg}\n")))
    }
}

/// A stream whose reads and writes can time out (TCP and Unix sockets).
pub trait Conn: Read + Write {
    fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()>;
    fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()>;
    fn shutdown_write(&self) -> io::Result<()>;
}

/// After answering a request that was not read to its end: half-close and read (and drop)
/// what the client is still sending, for at most `limit` bytes or until `deadline`. Closing
/// with unread input would make the kernel reset the connection and could destroy the reply
/// before the client reads it.
pub fn linger<C: Conn>(c: &mut C, limit: usize, deadline: Instant) {
    if c.shutdown_write().is_err() {
        return;
    }
    let mut buf = [0u8; 4096];
    let mut seen = 0;
    while seen < limit {
        match read_some(c, &mut buf, deadline) {
            Ok(0) | Err(_) => return,
            Ok(n) => seen += n,
        }
    }
}

impl Conn for std::net::TcpStream {
    fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, d)
    }
    fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_write_timeout(self, d)
    }
    fn shutdown_write(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

impl Conn for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, d)
    }
    fn set_write_timeout(&self, d: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_write_timeout(self, d)
    }
    fn shutdown_write(&self) -> io::Result<()> {
        self.shutdown(std::net::Shutdown::Write)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The query string (after `?`, without it; empty when there is none).
    pub query: String,
    pub headers: Vec<(String, String)>,
}

impl Request {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads at most `buf.len()` bytes, giving up at `deadline`.
fn read_some<C: Conn>(c: &mut C, buf: &mut [u8], deadline: Instant) -> Result<usize, HttpError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(HttpError::Timeout);
    }
    c.set_read_timeout(Some(left)).map_err(HttpError::Read)?;
    loop {
        match c.read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(HttpError::Timeout)
            }
            Err(e) => return Err(HttpError::Read(e)),
        }
    }
}

/// End of the head: index just past the blank line (`\r\n\r\n`, or a bare `\n\n`).
fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let start = from.saturating_sub(3);
    (start..buf.len()).find_map(|i| {
        if buf[i..].starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else if buf[i..].starts_with(b"\n\n") {
            Some(i + 2)
        } else {
            None
        }
    })
}

/// Reads one request (head and any small body) before `deadline`.
pub fn read_request<C: Conn>(c: &mut C, deadline: Instant) -> Result<Request, HttpError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    let end = loop {
        let room = (MAX_HEAD + 1 - buf.len()).min(chunk.len());
        let n = read_some(c, &mut chunk[..room], deadline)?;
        if n == 0 {
            return Err(HttpError::Closed);
        }
        let before = buf.len();
        buf.extend_from_slice(&chunk[..n]);
        if let Some(e) = head_end(&buf, before) {
            if e > MAX_HEAD {
                return Err(HttpError::HeadTooLarge);
            }
            break e;
        }
        if buf.len() > MAX_HEAD {
            return Err(HttpError::HeadTooLarge);
        }
    };
    let req = parse_head(&buf[..end])?;
    // Discard the body so closing the socket does not reset the connection under the reply.
    if req.header("transfer-encoding").is_some() {
        return Err(HttpError::Unsupported("Transfer-Encoding"));
    }
    let mut lengths = req
        .headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .map(|(_, v)| v.parse::<u64>());
    let len = match (lengths.next(), lengths.next()) {
        (None, _) => 0,
        (Some(Ok(n)), None) => n,
        _ => return Err(HttpError::Malformed("Content-Length")),
    };
    if len > MAX_BODY as u64 {
        return Err(HttpError::BodyTooLarge);
    }
    let mut have = buf.len() - end;
    while (have as u64) < len {
        let want = (len as usize - have).min(chunk.len());
        let n = read_some(c, &mut chunk[..want], deadline)?;
        if n == 0 {
            return Err(HttpError::Closed);
        }
        have += n;
    }
    Ok(req)
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn parse_head(head: &[u8]) -> Result<Request, HttpError> {
    let text = std::str::from_utf8(head).map_err(|_| HttpError::Malformed("not UTF-8"))?;
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let line = lines.next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::Malformed("request line"));
    };
    if !is_token(method) {
        return Err(HttpError::Malformed("method"));
    }
    if !version.starts_with("HTTP/") {
        return Err(HttpError::Malformed("request line"));
    }
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(HttpError::Version);
    }
    if !target.starts_with('/') || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(HttpError::Malformed("request target"));
    }
    let path = target.split(['?', '#']).next().unwrap_or("").to_string();
    let query = target
        .split('#')
        .next()
        .and_then(|t| t.split_once('?'))
        .map(|(_, q)| q.to_string())
        .unwrap_or_default();
    let mut headers = Vec::new();
    for l in lines {
        if l.is_empty() {
            break;
        }
        if l.starts_with([' ', '\t']) {
            return Err(HttpError::Malformed("folded header"));
        }
        let (k, v) = l.split_once(':').ok_or(HttpError::Malformed("header"))?;
        if !is_token(k) {
            return Err(HttpError::Malformed("header name"));
        }
        if headers.len() == MAX_HEADERS {
            return Err(HttpError::HeadTooLarge);
        }
        headers.push((k.to_string(), v.trim_matches([' ', '\t']).to_string()));
    }
    Ok(Request {
        method: method.to_string(),
        path,
        query,
        headers,
    })
}

/// One response; always sent with `Connection: close`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(status: u16, body: &str) -> Self {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
        }
    }
    pub fn json(status: u16, body: String) -> Self {
        Response {
            status,
            content_type: "application/json",
            headers: Vec::new(),
            body: body.into_bytes(),
        }
    }
    pub fn with_header(mut self, k: &'static str, v: impl Into<String>) -> Self {
        self.headers.push((k, v.into()));
        self
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Writes `r` (without its body for HEAD requests) and flushes.
pub fn write_response<W: Write>(w: &mut W, r: &Response, head_only: bool) -> io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n",
        r.status,
        reason(r.status),
        r.content_type,
        r.body.len()
    )
    .into_bytes();
    for (k, v) in &r.headers {
        out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    if !head_only {
        out.extend_from_slice(&r.body);
    }
    w.write_all(&out)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<Request, HttpError> {
        parse_head(raw.as_bytes())
    }

    #[test]
    fn request_line_and_headers() {
        let r = parse("GET /status?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization:  Bearer t \r\n\r\n")
            .unwrap();
        assert_eq!(r.method, "GET");
        assert_eq!(r.path, "/status");
        assert_eq!(r.header("authorization"), Some("Bearer t"));
        assert_eq!(r.header("x-missing"), None);
        assert!(parse("GET /x HTTP/1.0\n\n").is_ok());
    }

    #[test]
    fn bad_requests_are_rejected() {
        for raw in [
            "GET /x\r\n\r\n",
            "GET  /x HTTP/1.1\r\n\r\n",
            "GET x HTTP/1.1\r\n\r\n",
            "G(T /x HTTP/1.1\r\n\r\n",
            "GET /x HTTP/1.1\r\nno colon\r\n\r\n",
            "GET /x HTTP/1.1\r\nA: b\r\n  folded\r\n\r\n",
            "GET /x HTTP/1.1\r\nBad Name: v\r\n\r\n",
            "GET /x JUNK\r\n\r\n",
        ] {
            assert!(
                matches!(parse(raw), Err(HttpError::Malformed(_))),
                "{raw:?}: {:?}",
                parse(raw)
            );
        }
        assert!(matches!(
            parse("PRI * HTTP/2.0\r\n\r\n"),
            Err(HttpError::Version)
        ));
        assert!(matches!(
            parse("GET /x HTTP/2.0\r\n\r\n"),
            Err(HttpError::Version)
        ));
    }

    #[test]
    fn head_end_spans_reads() {
        let b = b"GET / HTTP/1.1\r\nA: b\r\n\r\nrest";
        assert_eq!(head_end(b, 0), Some(b.len() - 4));
        // The blank line was split across two reads: search from 3 bytes back.
        assert_eq!(head_end(b, b.len() - 5), Some(b.len() - 4));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n", 0), None);
    }

    #[test]
    fn response_bytes() {
        let mut out = Vec::new();
        let r = Response::text(401, "unauthorized\n").with_header("WWW-Authenticate", "Bearer");
        write_response(&mut out, &r, false).unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(s.starts_with("HTTP/1.1 401 Unauthorized\r\n"), "{s}");
        assert!(s.contains("Content-Length: 13\r\n"), "{s}");
        assert!(s.contains("WWW-Authenticate: Bearer\r\n"), "{s}");
        assert!(s.ends_with("\r\n\r\nunauthorized\n"), "{s}");
        let mut out = Vec::new();
        write_response(&mut out, &r, true).unwrap();
        assert!(String::from_utf8(out).unwrap().ends_with("\r\n\r\n"));
    }
}

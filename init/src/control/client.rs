//! The client of the control API over its Unix socket (`keel status`, `keel checkpoint`):
//! `GET /status` returns the JSON exactly as keel sends it. Nothing listening is one clear
//! line.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long `keel status` waits for an answer.
const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("nothing is listening on {} (is `keel run` or `keel mount` running with this state dir?)", path.display())]
    NotListening { path: PathBuf },
    #[error("{}: permission denied (the control socket is for root / keel's user only)", path.display())]
    Denied { path: PathBuf },
    #[error("{}: connect: {source}", path.display())]
    Connect { path: PathBuf, source: io::Error },
    #[error("{}: send request: {source}", path.display())]
    Send { path: PathBuf, source: io::Error },
    #[error("{}: read response: {source}", path.display())]
    Receive { path: PathBuf, source: io::Error },
    #[error("{}: unexpected response: {what}", path.display())]
    BadResponse { path: PathBuf, what: String },
    #[error("{}: keel answered {code}: {body}", path.display())]
    Status {
        path: PathBuf,
        code: u16,
        body: String,
    },
}

/// Sends `METHOD route` over the Unix socket at `path`; returns the status code and body.
pub fn request(path: &Path, method: &str, route: &str) -> Result<(u16, String), ClientError> {
    request_within(path, method, route, TIMEOUT)
}

/// `request` with its own read and write timeout (a rollback with `restart=1` waits for the
/// main command to stop).
pub fn request_within(
    path: &Path,
    method: &str,
    route: &str,
    timeout: Duration,
) -> Result<(u16, String), ClientError> {
    let p = || path.to_path_buf();
    let mut s = connect(path, timeout)?;
    let req = format!(
        "{method} {route} HTTP/1.1\r\nHost: keel\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    );
    s.write_all(req.as_bytes())
        .map_err(|source| ClientError::Send { path: p(), source })?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|source| ClientError::Receive { path: p(), source })?;
    let bad = |what: &str| ClientError::BadResponse {
        path: p(),
        what: what.to_string(),
    };
    let text = String::from_utf8(raw).map_err(|_| bad("not UTF-8"))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("no header end"))?;
    let code = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| bad("no status line"))?;
    Ok((code, body.to_string()))
}

/// `request_within`, with the body of a 200 copied to `out` as it arrives (chunked, or up to
/// the end of the connection): an answer keel streams is never held here either. Any other
/// status: `Some((code, body))`, the body read whole (an error answer is one line).
pub fn request_to(
    path: &Path,
    method: &str,
    route: &str,
    timeout: Duration,
    out: &mut dyn Write,
) -> Result<Option<(u16, String)>, ClientError> {
    use std::io::BufRead;
    let p = || path.to_path_buf();
    let s = connect(path, timeout)?;
    let req = format!(
        "{method} {route} HTTP/1.1\r\nHost: keel\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    );
    (&s).write_all(req.as_bytes())
        .map_err(|source| ClientError::Send { path: p(), source })?;
    let recv = |source| ClientError::Receive { path: p(), source };
    let bad = |what: &str| ClientError::BadResponse {
        path: p(),
        what: what.to_string(),
    };
    let mut r = io::BufReader::with_capacity(64 * 1024, &s);
    let mut line = String::new();
    r.read_line(&mut line).map_err(recv)?;
    let code = line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| bad("no status line"))?;
    let mut chunked = false;
    loop {
        line.clear();
        if r.read_line(&mut line).map_err(recv)? == 0 {
            return Err(bad("no header end"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            if k.trim().eq_ignore_ascii_case("transfer-encoding")
                && v.trim().eq_ignore_ascii_case("chunked")
            {
                chunked = true;
            }
        }
    }
    let mut error_body = Vec::new();
    let sink: &mut dyn Write = if code == 200 { out } else { &mut error_body };
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line).map_err(recv)?;
            let size = line.trim_end().split(';').next().unwrap_or("");
            let n = u64::from_str_radix(size.trim(), 16).map_err(|_| bad("bad chunk size"))?;
            if n == 0 {
                break;
            }
            let copied = io::copy(&mut (&mut r).take(n), sink).map_err(recv)?;
            if copied != n {
                return Err(bad("the answer ended in a chunk"));
            }
            line.clear();
            r.read_line(&mut line).map_err(recv)?;
        }
    } else {
        io::copy(&mut r, sink).map_err(recv)?;
    }
    sink.flush().map_err(recv)?;
    Ok((code != 200).then(|| (code, String::from_utf8_lossy(&error_body).into_owned())))
}

/// `GET /status` from the keel listening at `path`: the JSON body.
pub fn status(path: &Path) -> Result<String, ClientError> {
    match request(path, "GET", "/status")? {
        (200, body) => Ok(body),
        (code, body) => Err(ClientError::Status {
            path: path.to_path_buf(),
            code,
            body: body.trim().to_string(),
        }),
    }
}

/// Connects to the socket at `path` with `timeout` for each read and write; a socket nobody
/// listens on, or one this user may not use, gets its own error.
fn connect(path: &Path, timeout: Duration) -> Result<UnixStream, ClientError> {
    let p = || path.to_path_buf();
    let s = UnixStream::connect(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
            ClientError::NotListening { path: p() }
        }
        io::ErrorKind::PermissionDenied => ClientError::Denied { path: p() },
        _ => ClientError::Connect { path: p(), source },
    })?;
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_listening_is_one_clear_line() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(crate::state::CONTROL_SOCK);
        let e = request(&path, "GET", "/status").unwrap_err();
        assert!(matches!(e, ClientError::NotListening { .. }), "{e:?}");
        // A stale socket file nobody listens on reads the same.
        crate::sys::socket::dead_socket(&path).unwrap();
        let e = request(&path, "GET", "/status").unwrap_err();
        assert!(matches!(e, ClientError::NotListening { .. }), "{e:?}");
        assert!(!e.to_string().contains('\n'));
    }
}

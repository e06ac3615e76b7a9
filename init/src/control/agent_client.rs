//! The agent commands (`keel snapshot create|list|delete`, `keel diff`, `keel rollback`)
//! from wherever they are typed: through the running keel's `persist.sock` when the state
//! dir is visible (`persist::agent_cmd`, which also works on a stopped state dir), and
//! otherwise through the control API's Unix socket. Inside the sandbox the state dir is
//! covered by an empty tmpfs, so there the control socket (`/run/keel/control.sock`, root
//! and keel's user only) is the way in: the same routes, the same checks as `GET /snapshots`
//! and `POST /rollback` over HTTP. `keel checkpoint` goes the same ways: `persist.sock`,
//! the control API's `POST /checkpoint` (a `keel run` without checkpoints to a remote),
//! else the stopped state dir directly.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::client::{request_within, ClientError};
use crate::config::Config;
use crate::persist::agent::{Rollback, SnapshotCreate};
use crate::persist::agent_cmd::{self, AgentCmdError, DiffOptions};
use crate::persist::ops::{self, OpsError};
use crate::persist::snapshots::{self, SnapshotsError};

/// Why an agent command or `keel checkpoint` failed, by the way it went: `persist.sock`
/// and the stopped state dir (`Ops`, `AgentCmd`), or the control socket. The messages are
/// the command line's.
#[derive(Debug, thiserror::Error)]
pub enum AgentClientError {
    /// Boxed, as `AgentCmd`: the steps' errors are large.
    #[error(transparent)]
    Ops(Box<OpsError>),
    #[error(transparent)]
    AgentCmd(Box<AgentCmdError>),
    #[error("{0}")]
    CheckName(#[source] SnapshotsError),
    #[error("{0} (the control socket admits root, keel's user and [control] group only)")]
    Denied(#[source] ClientError),
    #[error("{0}")]
    Request(#[source] ClientError),
    /// The API answered with an error: its `error` (or the body).
    #[error("{0}")]
    Refused(String),
    #[error("unexpected answer from keel: {0}")]
    Answer(#[source] serde_json::Error),
    #[error("write the answer: {0}")]
    Output(#[source] std::io::Error),
}

impl From<OpsError> for AgentClientError {
    fn from(e: OpsError) -> Self {
        AgentClientError::Ops(Box::new(e))
    }
}

impl From<AgentCmdError> for AgentClientError {
    fn from(e: AgentCmdError) -> Self {
        AgentClientError::AgentCmd(Box::new(e))
    }
}

/// A rollback with `restart` waits for the main command to stop: allow for it.
const API_TIMEOUT: Duration = Duration::from_secs(3600);

/// The control socket to use, when the state dir's `persist.sock` is not visible and the
/// control API's socket is.
fn api_socket(cfg: &Config) -> Option<PathBuf> {
    let persist_sock = cfg.workspace.state_dir.join(crate::state::PERSIST_SOCK);
    if persist_sock.exists() {
        return None;
    }
    let s = super::default_socket(cfg);
    s.exists().then_some(s)
}

/// `keel checkpoint [--full]`: by the running keel over `persist.sock` if there is one,
/// else over its control API (`POST /checkpoint`: a flush when no remote is configured),
/// else offline on the stopped state dir.
pub fn checkpoint(cfg: &Config, full: bool) -> Result<ops::Answer, AgentClientError> {
    if let Some(a) = ops::checkpoint_running(cfg, full)? {
        return Ok(a);
    }
    let http = super::default_socket(cfg);
    if http.exists() {
        // A checkpoint lasts as long as its upload (minutes for a large first one): wait as
        // for the other agent commands. Only a socket nobody listens on (a keel that is
        // gone) sends this to the stopped state dir; a keel that is there answers, or its
        // failure is the answer.
        let route = if full {
            "/checkpoint?full=1"
        } else {
            "/checkpoint"
        };
        match request_within(&http, "POST", route, API_TIMEOUT) {
            Ok((code, body)) => {
                return Ok(ops::Answer {
                    text: body.trim().to_string(),
                    ok: code == 200,
                })
            }
            Err(ClientError::NotListening { .. }) => {}
            Err(e @ ClientError::Denied { .. }) => return Err(AgentClientError::Denied(e)),
            Err(e) => return Err(AgentClientError::Request(e)),
        }
    }
    Ok(ops::checkpoint_offline(cfg, full)?)
}

/// Percent-encodes a query value (everything but RFC 3986's unreserved characters).
fn enc(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One request; the body on 200, else the API's `error` (or the body) as the error.
fn call(sock: &Path, method: &str, route: &str) -> Result<String, AgentClientError> {
    let (code, body) = request_within(sock, method, route, API_TIMEOUT).map_err(|e| match e {
        ClientError::Denied { .. } => AgentClientError::Denied(e),
        e => AgentClientError::Request(e),
    })?;
    if code == 200 {
        return Ok(body);
    }
    Err(AgentClientError::Refused(refusal(&body)))
}

/// The API's `error` in an error answer (or the body).
fn refusal(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.trim().to_string())
}

fn json(body: &str) -> Result<serde_json::Value, AgentClientError> {
    serde_json::from_str(body).map_err(AgentClientError::Answer)
}

pub fn snapshot_create(
    cfg: &Config,
    c: &SnapshotCreate,
) -> Result<serde_json::Value, AgentClientError> {
    let Some(sock) = api_socket(cfg) else {
        return Ok(agent_cmd::snapshot_create(cfg, c)?);
    };
    if let Some(n) = &c.name {
        snapshots::check_name(n).map_err(AgentClientError::CheckName)?;
    }
    let mut route = format!("/snapshots?message={}", enc(&c.message));
    if let Some(n) = &c.name {
        route.push_str(&format!("&name={}", enc(n)));
    }
    json(&call(&sock, "POST", &route)?)
}

/// The listing, as JSON or as the text table.
pub fn snapshot_list(cfg: &Config, as_json: bool) -> Result<String, AgentClientError> {
    let Some(sock) = api_socket(cfg) else {
        let l = agent_cmd::snapshot_list(cfg)?;
        return Ok(if as_json {
            serde_json::to_string_pretty(&l).expect("listing serialises")
        } else {
            snapshots::render(&l)
        });
    };
    let route = if as_json {
        "/snapshots"
    } else {
        "/snapshots?format=text"
    };
    Ok(call(&sock, "GET", route)?.trim_end().to_string())
}

/// The names removed.
pub fn snapshot_delete(cfg: &Config, what: &str) -> Result<Vec<String>, AgentClientError> {
    let Some(sock) = api_socket(cfg) else {
        return Ok(agent_cmd::snapshot_delete(cfg, what)?);
    };
    let v = json(&call(
        &sock,
        "DELETE",
        &format!("/snapshots/{}", enc(what)),
    )?)?;
    Ok(v["deleted"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default())
}

/// `keel diff`, written to `out` as it arrives.
pub fn diff(
    cfg: &Config,
    o: &DiffOptions,
    out: &mut dyn std::io::Write,
) -> Result<(), AgentClientError> {
    let Some(sock) = api_socket(cfg) else {
        return Ok(agent_cmd::diff(cfg, o, out)?);
    };
    let mut route = format!("/diff?from={}", enc(&o.from));
    if let Some(t) = &o.to {
        route.push_str(&format!("&to={}", enc(t)));
    }
    if let Some(p) = &o.path {
        route.push_str(&format!("&path={}", enc(p)));
    } else if !o.json {
        route.push_str("&format=text");
    }
    if o.path.is_some() {
        let mut text = call(&sock, "GET", &route)?;
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        return out
            .write_all(text.as_bytes())
            .map_err(AgentClientError::Output);
    }
    let refused =
        super::client::request_to(&sock, "GET", &route, API_TIMEOUT, out).map_err(|e| match e {
            ClientError::Denied { .. } => AgentClientError::Denied(e),
            e => AgentClientError::Request(e),
        })?;
    match refused {
        None => Ok(()),
        Some((_, body)) => Err(AgentClientError::Refused(refusal(&body))),
    }
}

pub fn rollback(cfg: &Config, r: &Rollback) -> Result<serde_json::Value, AgentClientError> {
    let Some(sock) = api_socket(cfg) else {
        return Ok(agent_cmd::rollback(cfg, r)?);
    };
    let mut route = format!("/rollback?to={}", enc(&r.to));
    match r.restart {
        Some(true) => route.push_str("&restart=1"),
        Some(false) => route.push_str("&restart=0"),
        None => {}
    }
    json(&call(&sock, "POST", &route)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    /// `keel checkpoint` through the control socket (inside the sandbox): a slow answer is
    /// waited for (a 1 GiB checkpoint to S3 took longer than the 10 s a status call gets,
    /// and the command then tried the state dir it cannot see: "Read-only file system");
    /// a keel that fails is the answer; only a socket nobody listens on sends the command
    /// to the stopped state dir.
    #[test]
    fn a_checkpoint_over_the_control_socket_waits_and_goes_offline_only_when_nobody_listens() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.workspace.state_dir = dir.path().join("state");
        let sock = dir.path().join(crate::state::CONTROL_SOCK);
        cfg.control.socket = Some(sock.clone());
        let l = UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            // The whole request is read before the connection is closed (a close with unread
            // bytes resets the connection: the client would read ECONNRESET, not the answer).
            let (mut s, _) = l.accept().unwrap();
            let req = read_request(&mut s);
            // Longer than the 10 s a status call waits; the checkpoint waits an hour.
            std::thread::sleep(Duration::from_secs(11));
            s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{\"ok\":true}\n")
                .unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            // Until the client has read the answer and closed.
            let _ = s.read_to_end(&mut Vec::new());
            // A keel that hangs up without answering.
            let (mut s, _) = l.accept().unwrap();
            read_request(&mut s);
            drop(s);
            req
        });
        let a = checkpoint(&cfg, true).unwrap();
        assert_eq!(a.text, "{\"ok\":true}");
        assert!(a.ok);
        let e = checkpoint(&cfg, false).unwrap_err();
        assert!(matches!(e, AgentClientError::Request(_)), "{e}");
        let req = server.join().unwrap();
        assert!(req.starts_with("POST /checkpoint?full=1 "), "{req}");
        // A socket nobody listens on (a keel that is gone): the stopped state dir's way. Made
        // with mknod, not by closing the listener above: a process forked by another test
        // may still hold a copy of that fd and accept the connection.
        let dead = dir.path().join("dead.sock");
        crate::sys::socket::dead_socket(&dead).unwrap();
        cfg.control.socket = Some(dead);
        let e = checkpoint(&cfg, false).unwrap_err();
        assert!(matches!(e, AgentClientError::Ops(_)), "{e}");
    }

    /// Reads one request head (the client sends no body).
    fn read_request(s: &mut std::os::unix::net::UnixStream) -> String {
        let mut req = Vec::new();
        let mut b = [0u8; 1024];
        while !req.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut b).unwrap();
            assert!(n > 0, "the client closed before its request ended");
            req.extend_from_slice(&b[..n]);
        }
        String::from_utf8_lossy(&req).into_owned()
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(enc("before-step_3.x~"), "before-step_3.x~");
        assert_eq!(enc("tests pass & more=1"), "tests%20pass%20%26%20more%3D1");
        assert_eq!(enc("é/"), "%C3%A9%2F");
    }
}

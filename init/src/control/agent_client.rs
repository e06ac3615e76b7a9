//! The command line's one way to a running keel: `keel checkpoint [--full]`, `keel gc`, the
//! checkpoint `keel fork` takes first, and the agent commands (`keel snapshot
//! create|list|delete`, `keel diff`, `keel rollback`). A running keel (`keel run` or `keel
//! mount`) is reached only through its control API's Unix socket (`default_socket`:
//! `[control] socket`, else the state dir's `control.sock`, else inside a keel container
//! `/run/keel/control.sock`), with the routes and the rights checks the API has over HTTP; a
//! stopped state dir is worked on directly (`persist::ops`, `persist::agent_cmd`). `find`
//! tells the two apart: a socket that answers is a running keel; no socket, or one nobody
//! listens on, is a stopped state dir, unless the state dir is locked (a keel still
//! starting: asked again for a few seconds, then one line saying it does not answer).
//! Before a checkpoint or an operation on the live workspace the mount is synced from this
//! process, so what the kernel still caches reaches keel first (from here, so that a keel
//! killed meanwhile cannot deadlock on its own mount).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::client::{request_within, ClientError};
use crate::config::Config;
use crate::persist::agent::{Rollback, SnapshotCreate};
use crate::persist::agent_cmd::{self, AgentCmdError, DiffOptions};
use crate::persist::ops::{self, OpsError};
use crate::persist::snapshots::{self, SnapshotsError};

/// Why `keel checkpoint`, `keel gc`, `keel fork` or an agent command failed: on the stopped
/// state dir (`Ops`, `AgentCmd`), or on the way to the running keel. The messages are the
/// command line's, one line each.
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
    #[error("keel answered without saying what it did (no `done`): {0}")]
    NoDone(String),
    #[error("write the answer: {0}")]
    Output(#[source] std::io::Error),
    #[error("state dir {} is in use by a keel that does not answer on its control socket {} (still starting, or its socket is elsewhere: see [control] socket)", state.display(), socket.display())]
    NotAnswering { state: PathBuf, socket: PathBuf },
    #[error("state dir {} is in use, but the keel on its control socket {} serves {serves} (set [control] socket to this state dir's keel's)", state.display(), socket.display())]
    OtherKeel {
        state: PathBuf,
        socket: PathBuf,
        serves: String,
    },
    #[error("no keel runs on {}: rollback works on a mounted workspace (a stopped one is restored with keel snapshot restore)", .0.display())]
    NotRunning(PathBuf),
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

/// A checkpoint lasts as long as its upload (minutes for a large first one), a rollback with
/// `restart` waits for the main command to stop: allow for it.
const API_TIMEOUT: Duration = Duration::from_secs(3600);

/// How long the first question (`GET /status`) may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a locked state dir whose socket is not up yet (a keel starting) is asked again.
const START_WAIT: Duration = Duration::from_secs(5);

/// Where the state dir's workspace is served, as `find` saw it.
enum Keel {
    /// A keel answers on this control socket; `mount`: its FUSE mount point.
    Running {
        socket: PathBuf,
        mount: Option<PathBuf>,
    },
    /// No keel runs on the state dir: work on it directly.
    Stopped,
}

/// Which keel serves `cfg`'s state dir, if any (see the module's doc).
fn find(cfg: &Config) -> Result<Keel, AgentClientError> {
    let socket = super::default_socket(cfg);
    let state = &cfg.workspace.state_dir;
    let t0 = Instant::now();
    let mut other = None;
    loop {
        match request_within(&socket, "GET", "/status", PROBE_TIMEOUT) {
            Ok((200, body)) => {
                let v: serde_json::Value = json(&body)?;
                match serves(&v, state) {
                    Ok(()) => {
                        let mount = (v["mount"]["mounted"] == true)
                            .then(|| v["mount"]["mount_point"].as_str().map(PathBuf::from))
                            .flatten();
                        return Ok(Keel::Running { socket, mount });
                    }
                    // Another keel's socket (a shared `[control] socket`, or the one at
                    // /run/keel): not this state dir's keel, which is then stopped, or
                    // elsewhere.
                    Err(theirs) => other = Some(theirs),
                }
            }
            Ok((_, body)) => return Err(AgentClientError::Refused(refusal(&body))),
            Err(ClientError::NotListening { .. }) => {}
            Err(e @ ClientError::Denied { .. }) => return Err(AgentClientError::Denied(e)),
            Err(e) => return Err(AgentClientError::Request(e)),
        }
        if !crate::state::locked(state) {
            return Ok(Keel::Stopped);
        }
        if t0.elapsed() > START_WAIT {
            return Err(match other {
                Some(serves) => AgentClientError::OtherKeel {
                    state: state.clone(),
                    socket,
                    serves,
                },
                None => AgentClientError::NotAnswering {
                    state: state.clone(),
                    socket,
                },
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether the keel whose `GET /status` is `v` serves the state dir `state`; else the one it
/// serves. Both sides resolve symlinks (`status::canonical_state_dir`); a keel too old to say
/// is taken at its word, as before.
fn serves(v: &serde_json::Value, state: &Path) -> Result<(), String> {
    let Some(theirs) = v["state_dir"].as_str() else {
        return Ok(());
    };
    let ours = super::status::canonical_state_dir(state);
    if theirs == ours || Path::new(theirs) == state {
        return Ok(());
    }
    Err(theirs.to_string())
}

/// Pushes what the kernel caches for the running keel's mount into keel, from this process.
fn sync_mount(mount: Option<&Path>, what: &str) {
    if let Some(mp) = mount {
        if let Err(e) = crate::sys::file::syncfs(mp) {
            eprintln!(
                "keel: {what}: syncfs {}: {e} (going on with what keel has)",
                mp.display()
            );
        }
    }
}

/// `keel checkpoint [--full]`: by the running keel (`POST /checkpoint`: a flush when no
/// remote is configured), else as the stopped state dir's one writer. The line it prints.
pub fn checkpoint(cfg: &Config, full: bool) -> Result<String, AgentClientError> {
    let Keel::Running { socket, mount } = find(cfg)? else {
        return Ok(ops::checkpoint_offline(cfg, full)?.text);
    };
    sync_mount(mount.as_deref(), "checkpoint");
    let route = if full {
        "/checkpoint?full=1"
    } else {
        "/checkpoint"
    };
    done(&json(&call(&socket, "POST", route)?)?)
}

/// The report's one line (`done`) of an answer; an answer without one is not a report.
fn done(v: &serde_json::Value) -> Result<String, AgentClientError> {
    match v["done"].as_str() {
        Some(line) if !line.trim().is_empty() => Ok(line.to_string()),
        _ => Err(AgentClientError::NoDone(v.to_string())),
    }
}

/// `keel gc`: by the running keel (`POST /gc`), else offline.
pub fn gc(cfg: &Config) -> Result<String, AgentClientError> {
    let Keel::Running { socket, .. } = find(cfg)? else {
        return Ok(ops::gc(cfg)?);
    };
    done(&json(&call(&socket, "POST", "/gc")?)?)
}

/// `keel fork --to URL [--from URL] [--seq N]`: a keel serving the source here (the
/// configured remote) checkpoints first, so the fork holds the latest state.
pub fn fork(
    cfg: &Config,
    to: &str,
    from: Option<&str>,
    seq: Option<u64>,
) -> Result<crate::persist::fork::ForkReport, AgentClientError> {
    let configured = cfg.persist.remote_url(&cfg.workspace.state_dir);
    let of_this = from.is_none() || configured.as_deref() == from;
    if seq.is_none() && configured.is_some() && of_this {
        if let Keel::Running { socket, mount } = find(cfg)? {
            sync_mount(mount.as_deref(), "fork");
            let line = done(&json(&call(&socket, "POST", "/checkpoint")?)?)?;
            eprintln!("keel: fork: checkpointed the running workspace first: {line}");
        }
    }
    Ok(ops::fork(cfg, to, from, seq)?)
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
    if let Some(n) = &c.name {
        snapshots::check_name(n).map_err(AgentClientError::CheckName)?;
    }
    let Keel::Running { socket, mount } = find(cfg)? else {
        return Ok(agent_cmd::snapshot_create(cfg, c)?);
    };
    sync_mount(mount.as_deref(), "snapshot create");
    let mut route = format!("/snapshots?message={}", enc(&c.message));
    if let Some(n) = &c.name {
        route.push_str(&format!("&name={}", enc(n)));
    }
    json(&call(&socket, "POST", &route)?)
}

/// The listing, as JSON or as the text table.
pub fn snapshot_list(cfg: &Config, as_json: bool) -> Result<String, AgentClientError> {
    let Keel::Running { socket, .. } = find(cfg)? else {
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
    Ok(call(&socket, "GET", route)?.trim_end().to_string())
}

/// The names removed.
pub fn snapshot_delete(cfg: &Config, what: &str) -> Result<Vec<String>, AgentClientError> {
    let Keel::Running { socket, .. } = find(cfg)? else {
        return Ok(agent_cmd::snapshot_delete(cfg, what)?);
    };
    let v = json(&call(
        &socket,
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
    let Keel::Running { socket, mount } = find(cfg)? else {
        return Ok(agent_cmd::diff(cfg, o, out)?);
    };
    if o.to.is_none() {
        // Against the live workspace, which the keel checkpoints first.
        sync_mount(mount.as_deref(), "diff");
    }
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
        let mut text = call(&socket, "GET", &route)?;
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        return out
            .write_all(text.as_bytes())
            .map_err(AgentClientError::Output);
    }
    let refused = super::client::request_to(&socket, "GET", &route, API_TIMEOUT, out).map_err(
        |e| match e {
            ClientError::Denied { .. } => AgentClientError::Denied(e),
            e => AgentClientError::Request(e),
        },
    )?;
    match refused {
        None => Ok(()),
        Some((_, body)) => Err(AgentClientError::Refused(refusal(&body))),
    }
}

/// `keel rollback`: only of a running keel (a stopped workspace is restored with `keel
/// snapshot restore`).
pub fn rollback(cfg: &Config, r: &Rollback) -> Result<serde_json::Value, AgentClientError> {
    let Keel::Running { socket, mount } = find(cfg)? else {
        return Err(AgentClientError::NotRunning(
            cfg.workspace.state_dir.clone(),
        ));
    };
    sync_mount(mount.as_deref(), "rollback");
    let mut route = format!("/rollback?to={}", enc(&r.to));
    match r.restart {
        Some(true) => route.push_str("&restart=1"),
        Some(false) => route.push_str("&restart=0"),
        None => {}
    }
    json(&call(&socket, "POST", &route)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    /// `keel checkpoint` through the control socket (inside the sandbox, as everywhere): a
    /// slow answer is waited for (a 1 GiB checkpoint to S3 took longer than the 10 s a status
    /// call gets, and the command then tried the state dir it cannot see: "Read-only file
    /// system"); a keel that fails is the answer; only a socket nobody listens on sends the
    /// command to the stopped state dir.
    #[test]
    fn a_checkpoint_over_the_control_socket_waits_and_goes_offline_only_when_nobody_listens() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.workspace.state_dir = dir.path().join("state");
        let sock = dir.path().join(crate::state::CONTROL_SOCK);
        cfg.control.socket = Some(sock.clone());
        let l = UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            let mut asked = Vec::new();
            for (answer, wait) in [
                (STATUS, 0),
                // Longer than the 10 s a status call waits; the checkpoint waits an hour.
                ("{\"ok\":true,\"done\":\"snapshot 7\"}\n", 11),
                (STATUS, 0),
                // A keel that hangs up without answering.
                ("", 0),
            ] {
                // The whole request is read before the connection is closed (a close with
                // unread bytes resets the connection: the client would read ECONNRESET,
                // not the answer).
                let (mut s, _) = l.accept().unwrap();
                let req = read_request(&mut s);
                asked.push(req.lines().next().unwrap_or_default().to_string());
                std::thread::sleep(Duration::from_secs(wait));
                if answer.is_empty() {
                    continue;
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
                    answer.len()
                );
                s.write_all(head.as_bytes()).unwrap();
                s.write_all(answer.as_bytes()).unwrap();
                s.shutdown(std::net::Shutdown::Write).unwrap();
                // Until the client has read the answer and closed.
                let _ = s.read_to_end(&mut Vec::new());
            }
            asked
        });
        assert_eq!(checkpoint(&cfg, true).unwrap(), "snapshot 7");
        let e = checkpoint(&cfg, false).unwrap_err();
        assert!(matches!(e, AgentClientError::Request(_)), "{e}");
        let asked = server.join().unwrap();
        assert_eq!(
            asked,
            [
                "GET /status HTTP/1.1",
                "POST /checkpoint?full=1 HTTP/1.1",
                "GET /status HTTP/1.1",
                "POST /checkpoint HTTP/1.1"
            ]
        );
        // A socket nobody listens on (a keel that is gone): the stopped state dir's way. Made
        // with mknod, not by closing the listener above: a process forked by another test
        // may still hold a copy of that fd and accept the connection.
        let dead = dir.path().join("dead.sock");
        crate::sys::socket::dead_socket(&dead).unwrap();
        cfg.control.socket = Some(dead);
        let e = checkpoint(&cfg, false).unwrap_err();
        assert!(matches!(e, AgentClientError::Ops(_)), "{e}");
    }

    /// A keel serving another state dir answers on the socket (a `[control] socket` shared by
    /// two configs, or /run/keel's): `keel checkpoint --state B` must not checkpoint keel A's
    /// workspace. B is not locked (stopped), so the command goes to B's state dir offline;
    /// the same keel answering for its own state dir (symlinks resolved) is used.
    #[test]
    fn a_keel_serving_another_state_dir_is_not_this_state_dirs_keel() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        std::fs::create_dir(dir.path().join("b")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("b"), dir.path().join("b-link")).unwrap();
        cfg.workspace.state_dir = dir.path().join("b-link");
        let sock = dir.path().join("shared.sock");
        cfg.control.socket = Some(sock.clone());
        let l = UnixListener::bind(&sock).unwrap();
        let ours = std::fs::canonicalize(dir.path().join("b")).unwrap();
        let answers = [
            format!(
                "{{\"state_dir\":\"{}\",\"mount\":{{\"mounted\":false}}}}\n",
                dir.path().join("a").display()
            ),
            format!(
                "{{\"state_dir\":\"{}\",\"mount\":{{\"mounted\":false}}}}\n",
                ours.display()
            ),
            "{\"ok\":true,\"done\":\"snapshot 3\"}\n".to_string(),
        ];
        let server = std::thread::spawn(move || {
            let mut asked = Vec::new();
            for answer in answers {
                let (mut s, _) = l.accept().unwrap();
                let req = read_request(&mut s);
                asked.push(req.lines().next().unwrap_or_default().to_string());
                answer_with(&mut s, &answer);
            }
            asked
        });
        let e = checkpoint(&cfg, false).unwrap_err();
        assert!(matches!(e, AgentClientError::Ops(_)), "{e}");
        assert_eq!(checkpoint(&cfg, false).unwrap(), "snapshot 3");
        let asked = server.join().unwrap();
        assert_eq!(
            asked,
            [
                "GET /status HTTP/1.1",
                "GET /status HTTP/1.1",
                "POST /checkpoint HTTP/1.1"
            ]
        );
    }

    /// A checkpoint answered 200 without its `done` line is not a checkpoint the command can
    /// report: it fails rather than print an empty line and exit 0.
    #[test]
    fn a_checkpoint_answer_without_done_fails() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.workspace.state_dir = dir.path().join("state");
        let sock = dir.path().join("control.sock");
        cfg.control.socket = Some(sock.clone());
        let l = UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            for answer in [STATUS, "{\"ok\":true}\n"] {
                let (mut s, _) = l.accept().unwrap();
                read_request(&mut s);
                answer_with(&mut s, answer);
            }
        });
        let e = checkpoint(&cfg, false).unwrap_err();
        server.join().unwrap();
        assert!(matches!(e, AgentClientError::NoDone(_)), "{e}");
    }

    /// Writes a 200 answer with `body` and waits for the client to close.
    fn answer_with(s: &mut std::os::unix::net::UnixStream, body: &str) {
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let _ = s.read_to_end(&mut Vec::new());
    }

    /// A running keel's `GET /status`, with its workspace not mounted (nothing to sync).
    const STATUS: &str = "{\"mount\":{\"mounted\":false}}\n";

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

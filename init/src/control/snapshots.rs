//! The agent routes of the control API: `GET /snapshots` (the listing with the `file://`
//! remote's disk use), `POST /snapshots?name=N&message=T` (a snapshot of the live workspace
//! now, kept until deleted), `DELETE /snapshots/ID|NAME`, `GET /diff?from=A&to=B` (`to`
//! defaults to the live workspace, checkpointed first; `&path=P`: a unified diff of one
//! file) and `POST /rollback?to=ID|NAME`. Answers are JSON (the file diff is text); errors
//! are `{"ok": false, "error": "..."}` with 400 (bad request), 404 (no such snapshot), 409
//! (refused: a checkpoint or rollback runs) or 503 (no checkpoint service).

use std::convert::Infallible;

use futures::future::Either;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame};

use super::api::{Request, Response};
use super::routes::{Body, Call, StreamFuture};
use super::server::{to_hyper, WRITE_TIMEOUT};
use super::status::{CheckpointOutcome, StatusHandle};
use crate::persist::agent::{AgentError, Diff as AgentDiff, Op, Rollback, SnapshotCreate};
use crate::persist::diff::Format;
use crate::persist::diff::{self, DiffError};
use crate::persist::service::ServiceError;
use crate::persist::snapshots::{self, SnapshotsError};

/// Why an agent route failed: the body's `error` is its message, the status code comes from
/// its variant (never from the message's wording).
#[derive(Debug, thiserror::Error)]
enum RouteError {
    #[error(transparent)]
    Service(#[from] ServiceError),
    #[error(transparent)]
    Snapshots(#[from] SnapshotsError),
    #[error(transparent)]
    Diff(#[from] DiffError),
}

impl RouteError {
    /// 409: refused while a checkpoint or rollback runs; 404: no such snapshot, or no such
    /// file in one; 400: a bad snapshot name; 413: a diff over `[control] diff_max_entries`;
    /// 500: anything else.
    fn http_status(&self) -> u16 {
        match self {
            RouteError::Service(e) => service_status(e),
            RouteError::Snapshots(e) => snapshots_status(e),
            RouteError::Diff(DiffError::NoPath { .. }) => 404,
            RouteError::Diff(DiffError::TooMany { .. }) => 413,
            RouteError::Diff(_) => 500,
        }
    }
}

pub(super) fn service_status(e: &ServiceError) -> u16 {
    match e {
        ServiceError::RollbackRunning | ServiceError::CheckpointRunning => 409,
        ServiceError::Agent(a) => agent_status(a),
        _ => 500,
    }
}

fn agent_status(e: &AgentError) -> u16 {
    match e {
        AgentError::ResolveSnapshot(s)
        | AgentError::CheckName(s)
        | AgentError::RecordSnapshot(s) => snapshots_status(s),
        AgentError::Checkpoint(s) => service_status(s),
        AgentError::Unfinished { source, .. } => agent_status(source),
        AgentError::Diff(DiffError::TooMany { .. }) => 413,
        _ => 500,
    }
}

fn snapshots_status(e: &SnapshotsError) -> u16 {
    match e {
        SnapshotsError::BadName(_) => 400,
        SnapshotsError::Unknown(_) => 404,
        _ => 500,
    }
}

/// A JSON answer, written out only up to the memory budget's share for one answer
/// (`budget::Shares::answer_bytes`): past it the writing stops and the answer is a 413 that
/// says so (the diffs, which can be far larger, stream instead).
pub(super) fn json(code: u16, v: &serde_json::Value) -> Response {
    json_capped(code, v, crate::budget::shares().answer_bytes as usize)
}

fn json_capped(code: u16, v: &serde_json::Value, cap: usize) -> Response {
    /// A buffer that refuses to grow past `cap`.
    struct Capped(Vec<u8>, usize);
    impl std::io::Write for Capped {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.0.len() + b.len() > self.1 {
                return Err(std::io::Error::other("over the cap"));
            }
            self.0.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut out = Capped(Vec::new(), cap);
    if serde_json::to_writer_pretty(&mut out, v).is_err() {
        let why = format!(
            "the answer would be more than {cap} bytes, keel's memory budget's share for one answer ([workspace] memory_budget)"
        );
        let body = serde_json::json!({ "ok": false, "error": why });
        return Response::json(413, format!("{body:#}\n"));
    }
    out.0.push(b'\n');
    Response::json(code, String::from_utf8(out.0).unwrap_or_default())
}

pub(super) fn error(code: u16, why: &str) -> Response {
    json(code, &serde_json::json!({ "ok": false, "error": why }))
}

/// The error answer for a failed route.
fn error_for(e: impl Into<RouteError>) -> Response {
    let e = e.into();
    error(e.http_status(), &e.to_string())
}

/// `%XX` and `+` decoded.
pub(super) fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16)
                {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The value of `key` in the query string.
pub fn param(query: &str, key: &str) -> Option<String> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| decode(v))
}

/// `GET /diff`: the list of changes is written as the worker finds them (`diff_to`, through
/// a channel of a few 64 KiB parts: the client's pace holds the worker back, for at most
/// `WRITE_TIMEOUT` a part), so keel never holds the answer; a failure before the first
/// change is the usual error answer. One file's diff (`path=`), and a bad request, are
/// answered whole by `handle`.
pub fn diff(c: Call) -> StreamFuture {
    Box::pin(diff_async(c))
}

async fn diff_async(c: Call) -> hyper::Response<Body> {
    let Call { req, status, .. } = c;
    let q = req.query.clone();
    let agent = status.agent();
    let (Some(agent), Some(from), None) = (agent, param(&q, "from"), param(&q, "path")) else {
        let r = tokio::task::spawn_blocking(move || handle(&req, &status)).await;
        return to_hyper(r.unwrap_or_else(|_| error(500, "internal error")));
    };
    let to = param(&q, "to").filter(|t| !t.is_empty() && t != "live");
    let (format, content_type) = if param(&q, "format").as_deref() == Some("text") {
        (Format::Text, "text/plain; charset=utf-8")
    } else {
        (Format::Json, "application/json")
    };
    let limit = status.diff_max_entries();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let out = Parts {
        tx,
        buf: Vec::new(),
        handle: tokio::runtime::Handle::current(),
    };
    tokio::task::spawn_blocking(move || {
        let r = agent.diff_to(AgentDiff { from, to }, format, limit, Box::new(out));
        let _ = done_tx.send(r);
    });
    // The first part says it worked; the end without one says how it failed.
    let first = {
        let first = std::pin::pin!(rx.recv());
        match futures::future::select(first, done_rx).await {
            Either::Left((Some(b), _)) => Some(b),
            Either::Left((None, done)) => match done.await {
                Ok(Err(e)) => return to_hyper(error_for(e)),
                _ => None,
            },
            Either::Right((Ok(Err(e)), _)) => return to_hyper(error_for(e)),
            Either::Right(_) => None,
        }
    };
    let frames = futures::stream::iter(first.map(|b| Ok::<_, Infallible>(Frame::data(b)))).chain(
        futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
        }),
    );
    hyper::Response::builder()
        .status(200)
        .header(hyper::header::CONTENT_TYPE, content_type)
        .header(hyper::header::CACHE_CONTROL, "no-store")
        .body(BodyExt::boxed(StreamBody::new(frames)))
        .unwrap_or_else(|_| hyper::Response::new(Full::new(Bytes::new()).boxed()))
}

/// A writer that sends what it is given in parts of `PART` bytes over a bounded channel,
/// waiting at most `WRITE_TIMEOUT` for the client to take the one before.
struct Parts {
    tx: tokio::sync::mpsc::Sender<Bytes>,
    buf: Vec<u8>,
    handle: tokio::runtime::Handle,
}

const PART: usize = 64 * 1024;

impl Parts {
    fn send(&mut self) -> std::io::Result<()> {
        let b = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(PART)));
        // The worker is no runtime thread: the timer is made inside `block_on`, where the
        // runtime is entered.
        let tx = &self.tx;
        let sent = self
            .handle
            .block_on(async move { tokio::time::timeout(WRITE_TIMEOUT, tx.send(b)).await });
        match sent {
            Ok(Ok(())) => Ok(()),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                "the client is gone or did not take the answer in time",
            )),
        }
    }
}

impl std::io::Write for Parts {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= PART {
            self.send()?;
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.send()
    }
}

/// The route table's entry point for these routes (they share one handler).
pub fn route(req: &Request, _: &super::routes::Params, status: &StatusHandle) -> Response {
    handle(req, status)
}

pub fn handle(req: &Request, status: &StatusHandle) -> Response {
    let Some(agent) = status.agent() else {
        return error(
            503,
            "no checkpoint service (no workspace mounted, or [persist] remote = \"none\")",
        );
    };
    let q = req.query.as_str();
    let get = matches!(req.method.as_str(), "GET" | "HEAD");
    let repo = || agent.repo().map_err(RouteError::from);
    match (req.method.as_str(), req.path.as_str()) {
        (_, "/snapshots") if get => {
            match repo().and_then(|r| snapshots::list(&r).map_err(RouteError::from)) {
                Ok(l) if param(q, "format").as_deref() == Some("text") => {
                    Response::text(200, &format!("{}\n", snapshots::render(&l)))
                }
                Ok(l) => json(200, &serde_json::to_value(&l).unwrap_or_default()),
                Err(e) => error_for(e),
            }
        }
        ("POST", "/snapshots") => {
            let c = SnapshotCreate {
                name: param(q, "name").filter(|n| !n.is_empty()),
                message: param(q, "message").unwrap_or_default(),
            };
            match agent.agent(Op::SnapshotCreate(c)) {
                Ok(v) => json(200, &v),
                Err(e) => error_for(e),
            }
        }
        ("DELETE", p) if p.starts_with("/snapshots/") => {
            let what = decode(&p["/snapshots/".len()..]);
            match repo().and_then(|r| snapshots::delete(&r, &what).map_err(RouteError::from)) {
                Ok(names) => json(200, &serde_json::json!({ "ok": true, "deleted": names })),
                Err(e) => error_for(e),
            }
        }
        (_, "/diff") if get => {
            let Some(from) = param(q, "from") else {
                return error(400, "from=ID|NAME is required");
            };
            let to = param(q, "to").filter(|t| !t.is_empty() && t != "live");
            // The list of changes comes from the worker's history; one file's unified diff
            // from the remote.
            if param(q, "path").is_none() {
                let op = Op::Diff(AgentDiff {
                    from,
                    to: to.clone(),
                });
                return match agent.agent(op) {
                    Ok(v) if param(q, "format").as_deref() == Some("text") => {
                        Response::text(200, v["text"].as_str().unwrap_or_default())
                    }
                    Ok(v) => json(200, &v["diff"]),
                    Err(e) => error_for(e),
                };
            }
            let to = match to {
                Some(t) => t,
                None => match status.checkpoint() {
                    CheckpointOutcome::Done(..) => "head".to_string(),
                    CheckpointOutcome::Unavailable(w) => return error(503, &w),
                    CheckpointOutcome::Failed(w) => return error(500, &w),
                },
            };
            let r = repo().and_then(|repo| {
                let from = snapshots::resolve(&repo, &from)?;
                let to = snapshots::resolve(&repo, &to)?;
                let path = param(q, "path").unwrap_or_default();
                Ok(Response::text(
                    200,
                    &diff::file_diff(&repo, from, to, &path)?,
                ))
            });
            r.unwrap_or_else(error_for)
        }
        ("POST", "/rollback") => {
            let Some(to) = param(q, "to").filter(|t| !t.is_empty()) else {
                return error(400, "to=ID|NAME is required");
            };
            let restart = param(q, "restart").map(|v| v == "1" || v == "true");
            match agent.agent(Op::Rollback(Rollback { to, restart })) {
                Ok(v) => json(200, &v),
                Err(e) => error_for(e),
            }
        }
        (_, "/snapshots") => {
            Response::text(405, "method not allowed\n").with_header("Allow", "GET, HEAD, POST")
        }
        (_, "/diff") => {
            Response::text(405, "method not allowed\n").with_header("Allow", "GET, HEAD")
        }
        (_, "/rollback") => {
            Response::text(405, "method not allowed\n").with_header("Allow", "POST")
        }
        _ => Response::text(405, "method not allowed\n").with_header("Allow", "DELETE"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_answer_past_the_budget_share_is_a_413_that_says_so() {
        let v = serde_json::json!({ "names": vec!["a-long-snapshot-name"; 100] });
        let ok = super::json_capped(200, &v, 1 << 20);
        assert_eq!(ok.status, 200);
        let refused = super::json_capped(200, &v, 1000);
        assert_eq!(refused.status, 413);
        let body = String::from_utf8_lossy(&refused.body).into_owned();
        assert!(
            body.contains("more than 1000 bytes") && body.contains("memory_budget"),
            "{body}"
        );
    }

    use super::*;

    #[test]
    fn query_parameters_are_decoded() {
        assert_eq!(param("to=good&x=1", "to").as_deref(), Some("good"));
        assert_eq!(
            param("message=all+tests%20pass", "message").as_deref(),
            Some("all tests pass")
        );
        assert_eq!(param("a=1", "b"), None);
        assert_eq!(decode("100%"), "100%");
    }

    /// The status code follows the error's variant, the body keeps its message.
    #[test]
    fn route_errors_map_to_status_codes_by_variant() {
        let unknown = || SnapshotsError::Unknown("x".into());
        let cases: Vec<(RouteError, u16, &str)> = vec![
            (
                ServiceError::CheckpointRunning.into(),
                409,
                "refused: a checkpoint is running",
            ),
            (
                ServiceError::RollbackRunning.into(),
                409,
                "refused: another rollback is running",
            ),
            (
                ServiceError::Stopped.into(),
                500,
                "checkpoint service stopped",
            ),
            (unknown().into(), 404, "no snapshot `x`"),
            (
                SnapshotsError::BadName("-a".into()).into(),
                400,
                "snapshot name `-a`",
            ),
            (
                SnapshotsError::NoHead.into(),
                500,
                "the remote has no snapshot yet",
            ),
            (
                ServiceError::Agent(AgentError::ResolveSnapshot(unknown())).into(),
                404,
                "no snapshot `x`",
            ),
            (
                ServiceError::Agent(AgentError::CheckName(SnapshotsError::BadName("-a".into())))
                    .into(),
                400,
                "snapshot name `-a`",
            ),
            (
                ServiceError::Agent(AgentError::Checkpoint(Box::new(
                    ServiceError::CheckpointRunning,
                )))
                .into(),
                409,
                "refused: a checkpoint is running",
            ),
            (
                ServiceError::Agent(AgentError::NoSnapshot("the workspace has no snapshot yet"))
                    .into(),
                500,
                "the workspace has no snapshot yet",
            ),
            (
                DiffError::NoPath {
                    path: "a/b".into(),
                    seq: 3,
                }
                .into(),
                404,
                "a/b: no such file in snapshot 3",
            ),
            (
                ServiceError::Agent(AgentError::Diff(DiffError::TooMany {
                    entries: 30001,
                    limit: 30000,
                }))
                .into(),
                413,
                "the diff has 30001 changed entries, more than [control] diff_max_entries = 30000",
            ),
            (
                DiffError::NotFile {
                    path: "a".into(),
                    seq: 3,
                }
                .into(),
                500,
                "a: not a regular file in snapshot 3",
            ),
        ];
        for (e, code, text) in cases {
            let (got, msg) = (e.http_status(), e.to_string());
            assert_eq!(got, code, "{msg}");
            assert!(msg.starts_with(text), "{msg}");
            let r = error_for(e);
            assert_eq!(r.status, code);
            let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(body["error"].as_str(), Some(msg.as_str()));
        }
    }
}

//! The process routes: `POST /exec` (start a process, or attach to the one a retried
//! `request_id` started, and stream its events as NDJSON; `detach` answers with the record
//! at once), `GET /processes`, `GET /processes/{id}`, `GET /processes/{id}/output`
//! (`stream=stdout|stderr&from=BYTE[&follow=1][&format=raw]`), `POST
//! /processes/{id}/stdin[?close=1]` (the body, streamed, to its stdin), `POST
//! /processes/{id}/signal?sig=NAME`, `POST /processes/{id}/resize?rows=R&cols=C` and
//! `DELETE /processes/{id}`. They parse, authorise (the route table) and stream; the
//! processes themselves are `exec`'s. Errors are `{"ok": false, "error": "..."}` with the
//! status code of the error's variant.

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Bytes, Frame};

use super::api::{Request, Response};
use super::routes::{param, Body, Call, Params, StreamFuture};
use super::server::{READ_DEADLINE, WRITE_TIMEOUT};
use super::snapshots::{error, json};
use super::status::StatusHandle;
use crate::exec::{self, ExecError, ProcessId, Processes};

const NO_EXEC: &str = "processes are started by `keel run` (this keel supervises none)";

/// The status code of an error, by its variant.
fn status_of(e: &ExecError) -> u16 {
    match e {
        ExecError::NotReady | ExecError::Stopping | ExecError::NoCheckpoints => 503,
        ExecError::TooMany(_) => 429,
        ExecError::NoSuchProcess(_) => 404,
        ExecError::User(_) => 400,
        ExecError::Before(s) => super::snapshots::service_status(s),
        ExecError::NoStdin(_) | ExecError::NoTerminal(_) => 409,
        ExecError::Write { source, .. } if source.kind() == std::io::ErrorKind::BrokenPipe => 409,
        ExecError::Output { .. }
        | ExecError::Pty(_)
        | ExecError::Write { .. }
        | ExecError::Resize(_) => 500,
    }
}

fn fail(e: &ExecError) -> Response {
    error(status_of(e), &e.to_string())
}

pub(super) fn to_hyper(r: Response) -> hyper::Response<Body> {
    let mut b = hyper::Response::builder()
        .status(r.status)
        .header(hyper::header::CONTENT_TYPE, r.content_type)
        .header(hyper::header::CACHE_CONTROL, "no-store");
    for (k, v) in &r.headers {
        b = b.header(*k, v.as_str());
    }
    b.body(Full::new(Bytes::from(r.body)).boxed())
        .unwrap_or_else(|_| hyper::Response::new(Full::new(Bytes::new()).boxed()))
}

fn table(status: &StatusHandle) -> Result<Arc<Processes>, Response> {
    status.exec().ok_or_else(|| error(503, NO_EXEC))
}

fn id_of(params: &Params) -> Result<ProcessId, Response> {
    param(params, "id")
        .parse::<u64>()
        .map(ProcessId)
        .map_err(|_| error(404, "no such process (ids are numbers)"))
}

fn query_pairs(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (super::snapshots::decode(k), super::snapshots::decode(v))
        })
        .collect()
}

/// A response whose body `produce` writes on the blocking pool: each `send` waits at most
/// `WRITE_TIMEOUT` for the client to take the previous bytes (false: it is gone or stuck,
/// and the stream ends; it resumes with `from=`); `alive` says whether it is still there.
pub(super) type Producer =
    Box<dyn FnOnce(&mut dyn FnMut(Vec<u8>) -> bool, &dyn Fn() -> bool) + Send>;

pub(super) fn streamed(
    content_type: &'static str,
    headers: Vec<(&'static str, String)>,
    produce: Producer,
) -> hyper::Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let handle = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let mut send = |b: Vec<u8>| {
            let r = handle.block_on(tokio::time::timeout(WRITE_TIMEOUT, tx.send(Bytes::from(b))));
            matches!(r, Ok(Ok(())))
        };
        let probe = send_probe(&tx);
        produce(&mut send, &probe);
    });
    let frames = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    let mut b = hyper::Response::builder()
        .status(200)
        .header(hyper::header::CONTENT_TYPE, content_type)
        .header(hyper::header::CACHE_CONTROL, "no-store");
    for (k, v) in headers {
        b = b.header(k, v);
    }
    b.body(StreamBody::new(frames).boxed())
        .unwrap_or_else(|_| hyper::Response::new(Full::new(Bytes::new()).boxed()))
}

fn send_probe(tx: &tokio::sync::mpsc::Sender<Bytes>) -> impl Fn() -> bool + '_ {
    move || !tx.is_closed()
}

const NDJSON: &str = "application/x-ndjson";

/// `POST /exec`.
pub fn exec(c: Call) -> StreamFuture {
    Box::pin(exec_async(c))
}

async fn exec_async(c: Call) -> hyper::Response<Body> {
    let t = match table(&c.status) {
        Ok(t) => t,
        Err(r) => return to_hyper(r),
    };
    let limit = t.config().max_request_body as usize;
    let collected =
        tokio::time::timeout(READ_DEADLINE, Limited::new(c.body, limit).collect()).await;
    let body = match collected {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return to_hyper(error(
                413,
                &format!("the request is larger than [exec] max_request_body ({limit} bytes)"),
            ))
        }
        Ok(Err(_)) => return to_hyper(error(400, "the request body could not be read")),
        Err(_) => return to_hyper(error(408, "the request body did not arrive in time")),
    };
    let plan = match exec::request::parse(&body, &query_pairs(&c.req.query)) {
        Ok(p) => p,
        Err(e) => return to_hyper(error(400, &e.to_string())),
    };
    let detach = plan.detach;
    let agent = c.status.agent();
    let started = tokio::task::spawn_blocking(move || t.start(plan, agent)).await;
    let started = match started {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return to_hyper(fail(&e)),
        Err(_) => return to_hyper(error(500, "internal error")),
    };
    let attached = matches!(started, exec::Started::Attached(_));
    let rec = started.record().clone();
    if detach {
        let mut v = rec.to_json();
        v["attached"] = attached.into();
        return to_hyper(json(200, &v));
    }
    streamed(
        NDJSON,
        vec![("Keel-Process-Id", rec.id.to_string())],
        Box::new(move |send, alive| {
            if !send(exec::stream::start_event(&rec, attached)) {
                return;
            }
            let f = exec::stream::Follow {
                stdout: Some(0),
                stderr: Some(0),
                follow: true,
                exit: true,
            };
            exec::stream::ndjson(&rec, f, send, alive);
        }),
    )
}

/// `GET /processes`.
pub fn list(_: &Request, _: &Params, status: &StatusHandle) -> Response {
    match table(status) {
        Ok(t) => {
            let all: Vec<serde_json::Value> = t.list().iter().map(|r| r.to_json()).collect();
            json(200, &serde_json::json!({ "processes": all }))
        }
        Err(r) => r,
    }
}

fn with_record(
    params: &Params,
    status: &StatusHandle,
    f: impl FnOnce(&Processes, ProcessId) -> Result<serde_json::Value, ExecError>,
) -> Response {
    let t = match table(status) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let id = match id_of(params) {
        Ok(id) => id,
        Err(r) => return r,
    };
    match f(&t, id) {
        Ok(v) => json(200, &v),
        Err(e) => fail(&e),
    }
}

/// `GET /processes/{id}`.
pub fn get(_: &Request, params: &Params, status: &StatusHandle) -> Response {
    with_record(params, status, |t, id| Ok(t.get(id)?.to_json()))
}

/// `DELETE /processes/{id}`: answers once nothing of its tree is left.
pub fn delete(_: &Request, params: &Params, status: &StatusHandle) -> Response {
    with_record(params, status, |t, id| Ok(t.kill(id)?.to_json()))
}

/// `POST /processes/{id}/signal?sig=NAME|NUMBER` (to its process group).
pub fn signal(req: &Request, params: &Params, status: &StatusHandle) -> Response {
    let sig = super::snapshots::param(&req.query, "sig").unwrap_or_default();
    let Some(n) = crate::config::signal_name(&sig) else {
        return error(
            400,
            &format!("sig=`{sig}`: not a signal (e.g. TERM, SIGINT, 9)"),
        );
    };
    with_record(params, status, |t, id| {
        let r = t.signal(id, n)?;
        Ok(serde_json::json!({ "ok": true, "id": r.id.0, "signal": crate::sys::signal::name(n) }))
    })
}

/// `POST /processes/{id}/resize?rows=R&cols=C`.
pub fn resize(req: &Request, params: &Params, status: &StatusHandle) -> Response {
    let dim = |k: &str| {
        super::snapshots::param(&req.query, k)
            .and_then(|v| v.parse::<u16>().ok())
            .filter(|v| (1..=10000).contains(v))
    };
    let (Some(rows), Some(cols)) = (dim("rows"), dim("cols")) else {
        return error(400, "rows= and cols= are required, 1 to 10000");
    };
    with_record(params, status, |t, id| {
        t.resize(id, rows, cols)?;
        Ok(serde_json::json!({ "ok": true, "rows": rows, "cols": cols }))
    })
}

/// `GET /processes/{id}/output`.
pub fn output(c: Call) -> StreamFuture {
    Box::pin(async move { to_hyper_or_stream(output_now(&c)) })
}

enum Answer {
    Now(Response),
    Stream(hyper::Response<Body>),
}

fn to_hyper_or_stream(a: Answer) -> hyper::Response<Body> {
    match a {
        Answer::Now(r) => to_hyper(r),
        Answer::Stream(s) => s,
    }
}

fn output_now(c: &Call) -> Answer {
    let t = match table(&c.status) {
        Ok(t) => t,
        Err(r) => return Answer::Now(r),
    };
    let id = match id_of(&c.params) {
        Ok(id) => id,
        Err(r) => return Answer::Now(r),
    };
    let rec = match t.get(id) {
        Ok(r) => r,
        Err(e) => return Answer::Now(fail(&e)),
    };
    let q = |k: &str| super::snapshots::param(&c.req.query, k);
    let stderr = match q("stream").as_deref() {
        None | Some("stdout") => false,
        Some("stderr") => true,
        Some(s) => return Answer::Now(error(400, &format!("stream=`{s}`: use stdout or stderr"))),
    };
    let from = match q("from").map(|v| v.parse::<u64>()) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => return Answer::Now(error(400, "from= must be a byte offset")),
    };
    let follow = q("follow").is_some_and(|v| v == "1" || v == "true");
    match q("format").as_deref() {
        None | Some("ndjson") => Answer::Stream(streamed(
            NDJSON,
            Vec::new(),
            Box::new(move |send, alive| {
                let f = exec::stream::Follow {
                    stdout: (!stderr).then_some(from),
                    stderr: stderr.then_some(from),
                    follow,
                    exit: true,
                };
                exec::stream::ndjson(&rec, f, send, alive);
            }),
        )),
        Some("raw") => {
            let start = exec::stream::first_kept(&rec, stderr, from);
            Answer::Stream(streamed(
                "application/octet-stream",
                vec![("Keel-Output-Start", start.to_string())],
                Box::new(move |send, alive| {
                    exec::stream::raw(&rec, stderr, start, follow, send, alive);
                }),
            ))
        }
        Some(f) => Answer::Now(error(400, &format!("format=`{f}`: use ndjson or raw"))),
    }
}

/// `POST /processes/{id}/stdin[?close=1]`: the body, as it arrives, to the process's
/// stdin; `close=1` closes it after the body.
pub fn stdin(c: Call) -> StreamFuture {
    Box::pin(stdin_async(c))
}

async fn stdin_async(c: Call) -> hyper::Response<Body> {
    let t = match table(&c.status) {
        Ok(t) => t,
        Err(r) => return to_hyper(r),
    };
    let id = match id_of(&c.params) {
        Ok(id) => id,
        Err(r) => return to_hyper(r),
    };
    if let Err(e) = t.get(id) {
        return to_hyper(fail(&e));
    }
    let close = super::snapshots::param(&c.req.query, "close").is_some_and(|v| v != "0");
    let mut body = c.body;
    let mut written = 0u64;
    loop {
        let frame = match tokio::time::timeout(READ_DEADLINE, body.frame()).await {
            Ok(Some(Ok(f))) => f,
            Ok(None) => break,
            Ok(Some(Err(_))) => return to_hyper(error(400, "the request body could not be read")),
            Err(_) => return to_hyper(error(408, "the request body stalled")),
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        let n = data.len() as u64;
        let t2 = t.clone();
        match tokio::task::spawn_blocking(move || t2.write_stdin(id, &data)).await {
            Ok(Ok(())) => written += n,
            Ok(Err(e)) => return to_hyper(fail(&e)),
            Err(_) => return to_hyper(error(500, "internal error")),
        }
    }
    if close {
        if let Err(e) = t.close_stdin(id) {
            return to_hyper(fail(&e));
        }
    }
    to_hyper(json(
        200,
        &serde_json::json!({ "ok": true, "id": id.0, "bytes": written, "closed": close }),
    ))
}

//! Who may call what: `GET /health` is public (platform port probes and the image's
//! HEALTHCHECK carry no token); every other path first needs the bearer token when one is
//! configured, so a caller without it learns nothing about which routes exist — only then
//! come 404 and 405 (`routes`, the table) and 403 (a route that needs `Rights::All`). Also
//! here: keel's own `Request`/`Response` and the plain handlers of `/status`, `/metrics` and
//! `/checkpoint`.

use std::time::Duration;

use super::auth;
use super::metrics;
use super::status::{CheckpointOutcome, StatusHandle};
use crate::config::control::Secret;

/// One request as the routes see it; the transport (`server`) converts to and from hyper's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// What followed `?` in the target, without the `?` ("" when none).
    pub query: String,
    pub headers: Vec<(String, String)>,
    /// The whole body, at most `server::MAX_BODY` bytes.
    pub body: Vec<u8>,
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

/// One response; the transport adds `Content-Length`, `Cache-Control: no-store` and
/// `Connection: close` (and drops the body for HEAD).
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

/// Who may call what on one connection.
#[derive(Debug, Clone)]
pub enum Access {
    /// A TCP listener. With a token, a caller presenting it may call every route and any
    /// other gets 401 (but for /health); without one (`None`), everyone may observe.
    Token(Option<Secret>),
    /// A Unix socket peer, checked when its connection was accepted (`server`).
    Peer(Rights),
}

/// Which routes a caller may use besides /health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rights {
    /// /status, /metrics and POST /checkpoint: how the workspace is doing, nothing of what it
    /// holds. A member of `[control] group`, or anyone on a TCP listener without a token.
    Observe,
    /// Also the agent routes (`/snapshots`, `/diff`, `/rollback`), which show the names and
    /// bytes of any file whatever its permissions, and roll every file back: root and keel's
    /// own user on the socket, the token's holder over TCP.
    All,
}

/// The answer to an agent route called with `Rights::Observe`.
const AGENT_ROUTES_FORBIDDEN: &str = "forbidden: snapshots, diffs and rollbacks show and change \
    every file; they are for root and keel's own user on the control socket, or for the \
    holder of the control token over TCP";

/// The answer to a full checkpoint asked for with `Rights::Observe`.
const FULL_CHECKPOINT_FORBIDDEN: &str = "forbidden: a full checkpoint uploads the whole \
    workspace again; it is for root and keel's own user on the control socket, or for the \
    holder of the control token over TCP (a plain POST /checkpoint is open to observers)";

/// The answer to `/exec` and `/processes` called with `Rights::Observe`.
const PROCESS_ROUTES_FORBIDDEN: &str = "forbidden: processes run with the sandbox's rights as \
    any user; they are for root and keel's own user on the control socket, or for the \
    holder of the control token over TCP";

/// The answer to `/files` called with `Rights::Observe`.
const FILES_ROUTES_FORBIDDEN: &str = "forbidden: the files API reads and writes files as any \
    user; it is for root and keel's own user on the control socket, or for the holder of the \
    control token over TCP";

fn method_not_allowed(allow: &str) -> Response {
    Response::text(405, "method not allowed\n").with_header("Allow", allow.to_string())
}

/// How a request is to be answered (`server` runs it).
pub enum Dispatch {
    /// This answer, now (`/health`, 401, 403, 404, 405).
    Answer(Response),
    /// The route's handler.
    Route(super::routes::Route, super::routes::Params),
}

/// `/health` (public), then the token, then the route table, then the rights.
pub fn dispatch(req: &Request, status: &StatusHandle, access: &Access) -> Dispatch {
    use super::routes::{find, Found};
    let get = matches!(req.method.as_str(), "GET" | "HEAD");
    if req.path == "/health" {
        if !get {
            return Dispatch::Answer(method_not_allowed("GET, HEAD"));
        }
        return Dispatch::Answer(match status.health() {
            Ok(()) => Response::text(200, "ok\n"),
            Err(nr) => Response::text(503, &format!("not ready: {}\n", nr.0)),
        });
    }
    let rights = match access {
        Access::Token(Some(token)) => {
            if !auth::authorized(req.header("authorization"), token) {
                return Dispatch::Answer(
                    Response::text(401, "unauthorized\n")
                        .with_header("WWW-Authenticate", "Bearer realm=\"keel\""),
                );
            }
            Rights::All
        }
        Access::Token(None) => Rights::Observe,
        Access::Peer(rights) => *rights,
    };
    match find(&req.method, &req.path) {
        Found::NotFound => Dispatch::Answer(Response::text(404, "not found\n")),
        Found::OtherMethods(allow) => Dispatch::Answer(method_not_allowed(&allow)),
        Found::Route(route, params) => {
            if needed_rights(&route, req) == Rights::All && rights != Rights::All {
                let why = if route.path == "/checkpoint" {
                    FULL_CHECKPOINT_FORBIDDEN
                } else if route.path.starts_with("/exec") || route.path.starts_with("/processes") {
                    PROCESS_ROUTES_FORBIDDEN
                } else if route.path.starts_with("/files") {
                    FILES_ROUTES_FORBIDDEN
                } else {
                    AGENT_ROUTES_FORBIDDEN
                };
                return Dispatch::Answer(super::snapshots::error(403, why));
            }
            Dispatch::Route(route, params)
        }
    }
}

/// The rights `req` needs: its route's, and every right for a full checkpoint, which an
/// observer must not be able to set off (it uploads the whole workspace again).
fn needed_rights(route: &super::routes::Route, req: &Request) -> Rights {
    if route.path == "/checkpoint" && full_asked(&req.query) {
        return Rights::All;
    }
    route.rights
}

/// Answers one request whose body has been read (a plain route, or an answer of
/// `dispatch`); a streaming route gets 500 here (the server calls those itself).
pub fn handle(req: &Request, status: &StatusHandle, access: &Access) -> Response {
    match dispatch(req, status, access) {
        Dispatch::Answer(r) => r,
        Dispatch::Route(route, params) => match route.handler {
            super::routes::Handler::Plain(f) => f(req, &params, status),
            super::routes::Handler::Stream(_) => Response::text(500, "internal error\n"),
        },
    }
}

/// `GET /status`.
pub fn status(_: &Request, _: &super::routes::Params, status: &StatusHandle) -> Response {
    Response::json(200, status.status_json())
}

/// `GET /metrics`.
pub fn metrics(_: &Request, _: &super::routes::Params, status: &StatusHandle) -> Response {
    let mut r = Response::text(200, &metrics::render(status));
    r.content_type = metrics::CONTENT_TYPE;
    r
}

/// `POST /checkpoint` (`?full=1`: a full snapshot, not a delta, which only a caller with
/// every right may ask for: see `needed_rights`).
pub fn checkpoint(req: &Request, _: &super::routes::Params, status: &StatusHandle) -> Response {
    if full_asked(&req.query) {
        return answer_checkpoint(status.checkpoint_full());
    }
    answer_checkpoint(status.checkpoint())
}

/// `?full=` set to anything but `0` or `false`.
fn full_asked(query: &str) -> bool {
    super::snapshots::param(query, "full").is_some_and(|v| v != "0" && v != "false")
}

/// `POST /gc`: old snapshots and the chunks no kept snapshot uses go, under the configured
/// retention, by the checkpoint service (`keel gc`).
pub fn gc(_: &Request, _: &super::routes::Params, status: &StatusHandle) -> Response {
    let Some(agent) = status.agent() else {
        return super::snapshots::error(503, super::status::NO_SERVICE);
    };
    let t0 = std::time::Instant::now();
    match agent.gc() {
        Ok(r) => super::snapshots::json(
            200,
            &serde_json::json!({
                "ok": true,
                "done": r.to_string(),
                "duration_ms": ms(t0.elapsed()),
            }),
        ),
        Err(e) => super::snapshots::error(super::snapshots::service_status(&e), &e.to_string()),
    }
}

fn ms(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

fn answer_checkpoint(outcome: CheckpointOutcome) -> Response {
    let (code, body) = match outcome {
        CheckpointOutcome::Done(report, took) => {
            let mut v = serde_json::to_value(&report).unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("ok".into(), true.into());
                o.insert("duration_ms".into(), ms(took).into());
            }
            (200, v)
        }
        CheckpointOutcome::Unavailable(why) => {
            (503, serde_json::json!({ "ok": false, "error": why }))
        }
        CheckpointOutcome::Failed(why) => (500, serde_json::json!({ "ok": false, "error": why })),
    };
    super::snapshots::json(code, &body)
}

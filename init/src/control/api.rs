//! The routes: `GET /health` is public (platform port probes and the image's HEALTHCHECK
//! carry no token); every other path first needs the bearer token when one is configured, so
//! a caller without it learns nothing about which routes exist — only then come 404 and 405.

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

fn method_not_allowed(allow: &'static str) -> Response {
    Response::text(405, "method not allowed\n").with_header("Allow", allow)
}

/// Answers one request.
pub fn handle(req: &Request, status: &StatusHandle, access: &Access) -> Response {
    let get = matches!(req.method.as_str(), "GET" | "HEAD");
    if req.path == "/health" {
        if !get {
            return method_not_allowed("GET, HEAD");
        }
        return match status.health() {
            Ok(()) => Response::text(200, "ok\n"),
            Err(nr) => Response::text(503, &format!("not ready: {}\n", nr.0)),
        };
    }
    let rights = match access {
        Access::Token(Some(token)) => {
            if !auth::authorized(req.header("authorization"), token) {
                return Response::text(401, "unauthorized\n")
                    .with_header("WWW-Authenticate", "Bearer realm=\"keel\"");
            }
            Rights::All
        }
        Access::Token(None) => Rights::Observe,
        Access::Peer(rights) => *rights,
    };
    match req.path.as_str() {
        "/status" if get => Response::json(200, status.status_json()),
        "/metrics" if get => {
            let mut r = Response::text(200, &metrics::render(status));
            r.content_type = metrics::CONTENT_TYPE;
            r
        }
        "/checkpoint" if req.method == "POST" => {
            // A full snapshot is written where the state dir is visible (`keel checkpoint
            // --full` there); here it would quietly be a delta.
            let full = super::snapshots::param(&req.query, "full");
            if full.is_some_and(|v| v != "0" && v != "false") {
                return super::snapshots::error(
                    400,
                    "a full snapshot is not offered over the control API: \
                     run `keel checkpoint --full` where the state dir is visible",
                );
            }
            checkpoint(status)
        }
        p if super::snapshots::is_route(p) => match rights {
            Rights::All => super::snapshots::handle(req, status),
            Rights::Observe => super::snapshots::error(403, AGENT_ROUTES_FORBIDDEN),
        },
        "/status" | "/metrics" => method_not_allowed("GET, HEAD"),
        "/checkpoint" => method_not_allowed("POST"),
        _ => Response::text(404, "not found\n"),
    }
}

fn ms(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

fn checkpoint(status: &StatusHandle) -> Response {
    let (code, body) = match status.checkpoint() {
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

//! The route table of the control API: every route once, with its method, its path (a
//! `{name}` segment matches one path segment and is handed to the handler), the rights it
//! needs and how it is served:
//!
//! - `Plain`: the body is read whole (at most `server::MAX_BODY` bytes) and the handler runs
//!   on the blocking pool, answering with one `Response`;
//! - `Stream`: the handler gets the request head and the body as it arrives, and answers
//!   with a body that may stream (`/exec`'s events, a process's output, its stdin).
//!
//! `/health` is answered before the table (it is public); `api::dispatch` checks the token,
//! then finds the route here (404 for no path, 405 with `Allow` for another method), then
//! the rights (403). A new route is one line here and its handler.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;

use http_body_util::combinators::BoxBody;
use hyper::body::{Bytes, Incoming};

use super::api::{Request, Response, Rights};
use super::status::StatusHandle;

/// The body type of every answer.
pub type Body = BoxBody<Bytes, Infallible>;

/// The `{name}` segments of the matched path, in order.
pub type Params = Vec<(&'static str, String)>;

/// A streaming handler's request.
pub struct Call {
    pub req: Request,
    pub params: Params,
    pub body: Incoming,
    pub status: StatusHandle,
}

impl Call {
    /// The value of the `{name}` segment.
    pub fn param(&self, name: &str) -> &str {
        param(&self.params, name)
    }
}

/// The value of the `{name}` segment in `params` ("" when absent).
pub fn param<'a>(params: &'a Params, name: &str) -> &'a str {
    params
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or("")
}

pub type StreamFuture = Pin<Box<dyn Future<Output = hyper::Response<Body>> + Send>>;

#[derive(Clone, Copy)]
pub enum Handler {
    Plain(fn(&Request, &Params, &StatusHandle) -> Response),
    Stream(fn(Call) -> StreamFuture),
}

#[derive(Clone, Copy)]
pub struct Route {
    /// `GET` also answers `HEAD`.
    pub method: &'static str,
    pub path: &'static str,
    pub rights: Rights,
    pub handler: Handler,
}

use super::{api, files, processes, snapshots, watch};
use Handler::{Plain, Stream};
use Rights::{All, Observe};

/// Every route but `/health`.
pub static ROUTES: &[Route] = &[
    r("GET", "/status", Observe, Plain(api::status)),
    r("GET", "/metrics", Observe, Plain(api::metrics)),
    // `?full=1` needs `All` (`api::needed_rights`).
    r("POST", "/checkpoint", Observe, Plain(api::checkpoint)),
    r("POST", "/gc", All, Plain(api::gc)),
    r("GET", "/snapshots", All, Plain(snapshots::route)),
    r("POST", "/snapshots", All, Plain(snapshots::route)),
    r("DELETE", "/snapshots/{name}", All, Plain(snapshots::route)),
    r("GET", "/diff", All, Stream(snapshots::diff)),
    r("POST", "/rollback", All, Plain(snapshots::route)),
    r("POST", "/exec", All, Stream(processes::exec)),
    r("GET", "/processes", All, Plain(processes::list)),
    r("GET", "/processes/{id}", All, Plain(processes::get)),
    r("DELETE", "/processes/{id}", All, Plain(processes::delete)),
    r(
        "GET",
        "/processes/{id}/output",
        All,
        Stream(processes::output),
    ),
    r(
        "POST",
        "/processes/{id}/stdin",
        All,
        Stream(processes::stdin),
    ),
    r(
        "POST",
        "/processes/{id}/signal",
        All,
        Plain(processes::signal),
    ),
    r(
        "POST",
        "/processes/{id}/resize",
        All,
        Plain(processes::resize),
    ),
    r("GET", "/files", All, Stream(files::get)),
    r("PUT", "/files", All, Stream(files::put)),
    r("DELETE", "/files", All, Plain(files::delete)),
    r("POST", "/files/move", All, Plain(files::mv)),
    r("POST", "/files/mkdir", All, Plain(files::mkdir)),
    r("GET", "/watch", All, Stream(watch::watch)),
];

const fn r(method: &'static str, path: &'static str, rights: Rights, handler: Handler) -> Route {
    Route {
        method,
        path,
        rights,
        handler,
    }
}

/// What the table says about a request.
pub enum Found {
    Route(Route, Params),
    /// The path exists with other methods: these (for `Allow`).
    OtherMethods(String),
    NotFound,
}

fn matches(pattern: &'static str, path: &str) -> Option<Params> {
    let mut params = Vec::new();
    let mut p = pattern.split('/');
    let mut q = path.split('/');
    loop {
        match (p.next(), q.next()) {
            (None, None) => return Some(params),
            (Some(a), Some(b)) if a.starts_with('{') && a.ends_with('}') && !b.is_empty() => {
                params.push((&a[1..a.len() - 1], super::snapshots::decode(b)));
            }
            (Some(a), Some(b)) if a == b => {}
            _ => return None,
        }
    }
}

/// The route for `method` and `path`.
pub fn find(method: &str, path: &str) -> Found {
    let mut allow: Vec<&str> = Vec::new();
    for route in ROUTES {
        let Some(params) = matches(route.path, path) else {
            continue;
        };
        let get = route.method == "GET";
        if route.method == method || (get && method == "HEAD") {
            return Found::Route(*route, params);
        }
        allow.push(route.method);
        if get {
            allow.push("HEAD");
        }
    }
    if allow.is_empty() {
        Found::NotFound
    } else {
        Found::OtherMethods(allow.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_methods_and_parameters() {
        match find("GET", "/processes/17/output") {
            Found::Route(r, p) => {
                assert_eq!(r.path, "/processes/{id}/output");
                assert_eq!(param(&p, "id"), "17");
            }
            _ => panic!("no route"),
        }
        match find("HEAD", "/status") {
            Found::Route(r, _) => assert_eq!(r.path, "/status"),
            _ => panic!("HEAD is GET"),
        }
        match find("PUT", "/processes/1") {
            Found::OtherMethods(a) => assert_eq!(a, "GET, HEAD, DELETE"),
            _ => panic!("405"),
        }
        match find("GET", "/snapshots/a%20b") {
            Found::OtherMethods(a) => assert_eq!(a, "DELETE"),
            _ => panic!("405"),
        }
        assert!(matches!(find("GET", "/processes/"), Found::NotFound));
        assert!(matches!(find("GET", "/nope"), Found::NotFound));
        assert!(matches!(find("GET", "/"), Found::NotFound));
    }

    #[test]
    fn every_route_is_listed_once() {
        let mut seen = std::collections::BTreeSet::new();
        for r in ROUTES {
            assert!(seen.insert((r.method, r.path)), "{} {}", r.method, r.path);
        }
    }
}

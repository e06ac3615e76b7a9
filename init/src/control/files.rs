//! The files routes: `GET /files?path=P[&user=U]` (the bytes, `Range`, `ETag`),
//! `GET /files?path=P&list=1[&depth=N]` (JSON entries), `GET /files?path=P&tar=1` (a
//! directory as a tar stream), `PUT /files?path=DIR&tar=1` (a tar stream extracted into
//! it), `PUT /files?path=P[&mode=0644]
//! [&user=U]` (the body, streamed to a temporary file renamed into place; `If-Match`,
//! `If-None-Match: *`), `DELETE /files?path=P[&recursive=1]`, `POST /files/move` (`{"from",
//! "to", "overwrite", "user"}`) and `POST /files/mkdir` (`{"path", "mode", "parents",
//! "user"}`). They parse and stream; every operation is `files`'s helper's, which runs as
//! the user inside the sandbox. Errors are `{"ok": false, "error": "..."}`.

use http_body_util::BodyExt;

use super::api::{Request, Response};
use super::processes::{streamed, to_hyper};
use super::routes::{Body, Call, Params, StreamFuture};
use super::server::READ_DEADLINE;
use super::snapshots::{error, json, param};
use super::status::StatusHandle;
use crate::files::{self, FilesError, Op};

const NO_FILES: &str = "the files API is offered by `keel run` with a workspace";

fn fail(e: &FilesError) -> Response {
    error(e.status(), &e.to_string())
}

/// The helper's refusal (`{"ok": false, "status": N, "error": ...}`) as an answer.
fn refused(v: &serde_json::Value) -> Response {
    let status = v["status"].as_u64().unwrap_or(500) as u16;
    error(
        status,
        v["error"].as_str().unwrap_or("the files helper failed"),
    )
}

fn table(status: &StatusHandle) -> Result<std::sync::Arc<crate::exec::Processes>, Response> {
    status.exec().ok_or_else(|| error(503, NO_FILES))
}

fn workspace(
    t: &crate::exec::Processes,
    user: Option<&str>,
) -> Result<std::path::PathBuf, Response> {
    t.helper_spec(user)
        .map_err(|e| fail(&FilesError::Exec(e)))?
        .workspace
        .ok_or_else(|| fail(&FilesError::NoWorkspace))
}

fn flag(query: &str, k: &str) -> bool {
    param(query, k).is_some_and(|v| v == "1" || v == "true")
}

/// Runs `op` (no upload) and answers with the helper's JSON line.
fn simple(
    status: &StatusHandle,
    user: Option<&str>,
    op: impl FnOnce(&std::path::Path) -> Result<Op, FilesError>,
) -> Response {
    let t = match table(status) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let ws = match workspace(&t, user) {
        Ok(w) => w,
        Err(r) => return r,
    };
    let op = match op(&ws) {
        Ok(op) => op,
        Err(e) => return fail(&e),
    };
    let answer = files::start(&t, user, &op).and_then(|mut h| h.answer());
    match answer {
        Ok(v) if v["ok"] == true => json(v["status"].as_u64().unwrap_or(200) as u16, &v),
        Ok(v) => refused(&v),
        Err(e) => fail(&e),
    }
}

/// `GET /files`: the bytes of a file, or (`list=1`) a directory's entries.
pub fn get(c: Call) -> StreamFuture {
    Box::pin(async move {
        match tokio::task::spawn_blocking(move || get_now(&c.req, &c.status)).await {
            Ok(r) => r,
            Err(_) => to_hyper(error(500, "internal error")),
        }
    })
}

fn get_now(req: &Request, status: &StatusHandle) -> hyper::Response<Body> {
    let q = &req.query;
    let user = param(q, "user");
    let path = param(q, "path").unwrap_or_default();
    if flag(q, "list") {
        let depth = match param(q, "depth").map(|d| d.parse::<u32>()) {
            None => 1,
            Some(Ok(d)) if (1..=64).contains(&d) => d,
            _ => return to_hyper(error(400, "depth= must be 1 to 64")),
        };
        return to_hyper(simple(status, user.as_deref(), |ws| {
            let max = status
                .exec()
                .map(|t| t.files_config().max_list_entries)
                .unwrap_or(1);
            Ok(Op::List {
                path: files::relative(ws, &path)?,
                depth,
                max,
            })
        }));
    }
    let t = match table(status) {
        Ok(t) => t,
        Err(r) => return to_hyper(r),
    };
    let ws = match workspace(&t, user.as_deref()) {
        Ok(w) => w,
        Err(r) => return to_hyper(r),
    };
    let tar = flag(q, "tar");
    let op = match files::relative(&ws, &path) {
        Ok(p) if tar => Op::Tar { path: p },
        Ok(p) => Op::Get {
            path: p,
            range: req.header("range").map(str::to_string),
        },
        Err(e) => return to_hyper(fail(&e)),
    };
    let mut h = match files::start(&t, user.as_deref(), &op) {
        Ok(h) => h,
        Err(e) => return to_hyper(fail(&e)),
    };
    let v = match h.answer() {
        Ok(v) if v["ok"] == true => v,
        Ok(v) => return to_hyper(refused(&v)),
        Err(e) => return to_hyper(fail(&e)),
    };
    if tar {
        // Until the helper's end of file: the archive's length is not known before.
        return streamed(
            "application/x-tar",
            Vec::new(),
            Box::new(move |send, _alive| {
                use std::io::Read;
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    match h.stdout.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(k) => {
                            if !send(buf[..k].to_vec()) {
                                return;
                            }
                        }
                    }
                }
            }),
        );
    }
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let (size, start, len) = (n("size"), n("start"), n("len"));
    let mut headers = vec![
        ("Content-Length", len.to_string()),
        ("ETag", v["etag"].as_str().unwrap_or_default().to_string()),
        ("Accept-Ranges", "bytes".to_string()),
        ("Keel-Mode", format!("{:04o}", n("mode"))),
    ];
    if n("status") == 206 {
        headers.push((
            "Content-Range",
            format!("bytes {start}-{}/{size}", start + len - 1),
        ));
    }
    let mut r = streamed(
        "application/octet-stream",
        headers,
        Box::new(move |send, _alive| {
            use std::io::Read;
            let mut left = len;
            let mut buf = vec![0u8; 1 << 16];
            while left > 0 {
                let want = buf.len().min(left as usize);
                match h.stdout.read(&mut buf[..want]) {
                    Ok(0) | Err(_) => return,
                    Ok(k) => {
                        left -= k as u64;
                        if !send(buf[..k].to_vec()) {
                            return;
                        }
                    }
                }
            }
        }),
    );
    *r.status_mut() =
        hyper::StatusCode::from_u16(n("status") as u16).unwrap_or(hyper::StatusCode::OK);
    r
}

/// `PUT /files`: the body, as it arrives, through the helper into a temporary file that
/// replaces the file once the whole body arrived.
pub fn put(c: Call) -> StreamFuture {
    Box::pin(put_async(c))
}

async fn put_async(c: Call) -> hyper::Response<Body> {
    let t = match table(&c.status) {
        Ok(t) => t,
        Err(r) => return to_hyper(r),
    };
    let q = c.req.query.clone();
    let user = param(&q, "user");
    let limit = t.files_config().max_upload;
    let too_big = || {
        to_hyper(error(
            413,
            &format!(
                "the upload is larger than [files] max_upload ({limit} bytes); nothing changed"
            ),
        ))
    };
    if c.req
        .header("content-length")
        .and_then(|l| l.parse::<u64>().ok())
        .is_some_and(|l| l > limit)
    {
        return too_big();
    }
    let cond = match (c.req.header("if-match"), c.req.header("if-none-match")) {
        (Some(m), _) => Some(m.to_string()),
        (None, Some("*")) => Some("none:*".to_string()),
        (None, Some(_)) => return to_hyper(error(400, "If-None-Match: only `*` is offered")),
        (None, None) => None,
    };
    let mode = param(&q, "mode");
    if let Some(m) = &mode {
        if u32::from_str_radix(m, 8).map_or(true, |m| m > 0o7777) {
            return to_hyper(error(400, &format!("mode={m}: use octal, e.g. 0644")));
        }
    }
    let path = param(&q, "path").unwrap_or_default();
    let tar = flag(&q, "tar");
    if tar && (cond.is_some() || mode.is_some()) {
        return to_hyper(error(
            400,
            "tar=1 takes neither mode= nor If-Match / If-None-Match",
        ));
    }
    let t2 = t.clone();
    let started = tokio::task::spawn_blocking(move || {
        let ws = workspace(&t2, user.as_deref())?;
        let path = files::relative(&ws, &path).map_err(|e| fail(&e))?;
        let op = if tar {
            Op::Untar { path }
        } else {
            Op::Put { path, mode, cond }
        };
        files::start(&t2, user.as_deref(), &op).map_err(|e| fail(&e))
    })
    .await;
    let mut h = match started {
        Ok(Ok(h)) => h,
        Ok(Err(r)) => return to_hyper(r),
        Err(_) => return to_hyper(error(500, "internal error")),
    };
    let mut body = c.body;
    let mut total = 0u64;
    let mut complete = true;
    let mut outcome: Option<Response> = None;
    loop {
        let frame = match tokio::time::timeout(READ_DEADLINE, body.frame()).await {
            Ok(Some(Ok(f))) => f,
            Ok(None) => break,
            Ok(Some(Err(_))) => {
                outcome = Some(error(
                    400,
                    "the request body could not be read; nothing changed",
                ));
                complete = false;
                break;
            }
            Err(_) => {
                outcome = Some(error(408, "the request body stalled; nothing changed"));
                complete = false;
                break;
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        if total > limit {
            outcome = Some(error(
                413,
                &format!(
                    "the upload is larger than [files] max_upload ({limit} bytes); nothing changed"
                ),
            ));
            complete = false;
            break;
        }
        let sent = tokio::task::spawn_blocking(move || {
            let r = h.send(&data);
            (h, r)
        })
        .await;
        match sent {
            Ok((back, r)) => {
                h = back;
                if r.is_err() {
                    // The helper refused early (it says why in its answer).
                    complete = false;
                    break;
                }
            }
            Err(_) => return to_hyper(error(500, "internal error")),
        }
    }
    let answer = tokio::task::spawn_blocking(move || {
        h.finish(complete);
        h.answer()
    })
    .await;
    let r = match (answer, outcome) {
        (_, Some(o)) => o,
        (Ok(Ok(v)), None) if v["ok"] == true => {
            let r = json(v["status"].as_u64().unwrap_or(200) as u16, &v);
            match v["etag"].as_str() {
                Some(etag) => r.with_header("ETag", etag.to_string()),
                None => r,
            }
        }
        (Ok(Ok(v)), None) => refused(&v),
        (Ok(Err(e)), None) => fail(&e),
        (Err(_), None) => error(500, "internal error"),
    };
    to_hyper(r)
}

/// `DELETE /files?path=P[&recursive=1]`.
pub fn delete(req: &Request, _: &Params, status: &StatusHandle) -> Response {
    let q = &req.query;
    let path = param(q, "path").unwrap_or_default();
    let recursive = flag(q, "recursive");
    simple(status, param(q, "user").as_deref(), |ws| {
        Ok(Op::Delete {
            path: files::relative(ws, &path)?,
            recursive,
        })
    })
}

fn body_json(req: &Request) -> Result<serde_json::Map<String, serde_json::Value>, Response> {
    match serde_json::from_slice::<serde_json::Value>(&req.body) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        _ => Err(error(400, "the body must be a JSON object")),
    }
}

fn text(
    m: &serde_json::Map<String, serde_json::Value>,
    k: &str,
) -> Result<Option<String>, Response> {
    match m.get(k) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(error(400, &format!("\"{k}\" must be a string"))),
    }
}

fn boolean(m: &serde_json::Map<String, serde_json::Value>, k: &str) -> Result<bool, Response> {
    match m.get(k) {
        None | Some(serde_json::Value::Null) => Ok(false),
        Some(serde_json::Value::Bool(b)) => Ok(*b),
        Some(_) => Err(error(400, &format!("\"{k}\" must be true or false"))),
    }
}

fn known(m: &serde_json::Map<String, serde_json::Value>, keys: &[&str]) -> Result<(), Response> {
    match m.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(error(
            400,
            &format!("unknown field \"{k}\" (known: {})", keys.join(", ")),
        )),
        None => Ok(()),
    }
}

/// `POST /files/move` with `{"from": P, "to": Q, "overwrite": false, "user": U}`.
pub fn mv(req: &Request, _: &Params, status: &StatusHandle) -> Response {
    let parsed = (|| {
        let m = body_json(req)?;
        known(&m, &["from", "to", "overwrite", "user"])?;
        let need = |k| text(&m, k)?.ok_or_else(|| error(400, &format!("\"{k}\" is required")));
        Ok::<_, Response>((
            need("from")?,
            need("to")?,
            boolean(&m, "overwrite")?,
            text(&m, "user")?,
        ))
    })();
    let (from, to, overwrite, user) = match parsed {
        Ok(p) => p,
        Err(r) => return r,
    };
    simple(status, user.as_deref(), |ws| {
        Ok(Op::Move {
            from: files::relative(ws, &from)?,
            to: files::relative(ws, &to)?,
            overwrite,
        })
    })
}

/// `POST /files/mkdir` with `{"path": P, "mode": "0755", "parents": false, "user": U}`.
pub fn mkdir(req: &Request, _: &Params, status: &StatusHandle) -> Response {
    let parsed = (|| {
        let m = body_json(req)?;
        known(&m, &["path", "mode", "parents", "user"])?;
        let path = text(&m, "path")?.ok_or_else(|| error(400, "\"path\" is required"))?;
        let mode = text(&m, "mode")?;
        if let Some(md) = &mode {
            if u32::from_str_radix(md, 8).map_or(true, |v| v > 0o7777) {
                return Err(error(400, &format!("mode {md}: use octal, e.g. \"0755\"")));
            }
        }
        Ok::<_, Response>((path, mode, boolean(&m, "parents")?, text(&m, "user")?))
    })();
    let (path, mode, parents, user) = match parsed {
        Ok(p) => p,
        Err(r) => return r,
    };
    simple(status, user.as_deref(), |ws| {
        Ok(Op::Mkdir {
            path: files::relative(ws, &path)?,
            mode,
            parents,
        })
    })
}

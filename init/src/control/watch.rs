//! `GET /watch?path=P&recursive=1&from=CURSOR`: the workspace's change feed as NDJSON, the
//! same framing as `/exec`, over the socket and TCP. It parses, authorises (the route
//! table) and streams; the events come from `workspace::feed`, which the filesystem fills.
//!
//! ```text
//! {"type":"watching","cursor":"1f2e-0","path":"/src","recursive":true}
//! {"type":"create","cursor":"1f2e-1","path":"/src/a.rs","kind":"file","size":0,"time":...}
//! {"type":"modify","cursor":"1f2e-2","path":"/src/a.rs","kind":"file","size":120,...}
//! {"type":"rename","cursor":"1f2e-3","path":"/src/b.rs","from":"/src/a.rs","kind":"file",...}
//! {"type":"delete","cursor":"1f2e-4","path":"/src/b.rs","kind":"file",...}
//! {"type":"rescan","cursor":"1f2e-5","path":"/","reason":"rollback",...}
//! {"type":"end","cursor":"1f2e-5","reason":"the workspace is unmounting"}
//! ```
//!
//! Without `from` the stream starts at the newest event (and recording starts, if it had
//! not); with it, right after that cursor. A cursor older than the window, or of another
//! keel run, is answered 410 before the stream (rescan, then watch from now); a reader that
//! falls so far behind while streaming that the window passes it gets a `lost` event and the
//! stream ends. Every event carries its cursor; the first line carries the starting one,
//! so a reader that saw no event still resumes without a gap.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{json, Value};

use super::processes::{streamed, to_hyper};
use super::routes::{Call, StreamFuture};
use super::snapshots::{decode, error};
use crate::workspace::feed::{kind_name, Cursor, Event, FeedError, Filter};

const NDJSON: &str = "application/x-ndjson";
/// Watch streams at once (each holds a blocking thread while it waits).
const MAX_WATCHERS: usize = 64;
/// Events read per wake-up.
const BATCH: usize = 1024;
/// How long a waiting stream sleeps before it checks that its client is still there.
const ALIVE_CHECK: Duration = Duration::from_secs(1);

static WATCHERS: AtomicUsize = AtomicUsize::new(0);

/// One stream's place in `WATCHERS`, given back when it ends.
struct Slot;

impl Slot {
    fn take() -> Option<Slot> {
        let n = WATCHERS.fetch_add(1, Ordering::SeqCst);
        if n >= MAX_WATCHERS {
            WATCHERS.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        WATCHERS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An event as one NDJSON line.
pub fn event_line(e: &Event, run: u64) -> Vec<u8> {
    let mut v = json!({
        "type": e.op.as_str(),
        "cursor": Cursor { run, seq: e.seq }.to_string(),
        "path": e.path,
        "kind": kind_name(e.kind),
        "time": e.time.0 as f64 / 1e9,
    });
    if let Some(f) = &e.from {
        v["from"] = f.clone().into();
    }
    if let Some(s) = e.size {
        v["size"] = s.into();
    }
    if e.replaced {
        v["replaced"] = true.into();
    }
    if let Some(r) = e.reason {
        v["reason"] = r.into();
    }
    line(&v)
}

fn line(v: &Value) -> Vec<u8> {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    b
}

fn status_of(e: &FeedError) -> u16 {
    match e {
        FeedError::BadCursor(_) | FeedError::Ahead { .. } => 400,
        FeedError::OtherRun { .. } | FeedError::Gone { .. } => 410,
        FeedError::Closed => 503,
    }
}

/// `GET /watch`.
pub fn watch(c: Call) -> StreamFuture {
    Box::pin(async move {
        tokio::task::spawn_blocking(move || start(c))
            .await
            .unwrap_or_else(|_| to_hyper(error(500, "internal error")))
    })
}

fn start(c: Call) -> hyper::Response<super::routes::Body> {
    let (mut path, mut recursive, mut from) = (String::from("/"), false, None);
    for kv in c.req.query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let v = decode(v);
        match decode(k).as_str() {
            "path" => path = v,
            "recursive" => {
                recursive = match v.as_str() {
                    "1" | "true" | "" => true,
                    "0" | "false" => false,
                    _ => return to_hyper(error(400, &format!("recursive={v:?}: use 1 or 0"))),
                }
            }
            "from" => from = Some(v),
            other => {
                return to_hyper(error(
                    400,
                    &format!("unknown parameter {other:?} (path, recursive, from)"),
                ))
            }
        }
    }
    let filter = match Filter::new(&path, recursive) {
        Ok(f) => f,
        Err(why) => return to_hyper(error(400, &why)),
    };
    let Some(ws) = c.status.workspace() else {
        return to_hyper(error(
            503,
            "no FUSE workspace is mounted (the change feed comes from keel's filesystem)",
        ));
    };
    let Some(slot) = Slot::take() else {
        return to_hyper(error(
            429,
            &format!("{MAX_WATCHERS} watch streams are open already"),
        ));
    };
    let (feed, now) = match ws.watch() {
        Ok(x) => x,
        Err(e) => return to_hyper(error(500, &format!("cannot start the change feed: {e}"))),
    };
    let at = match from {
        None => now,
        Some(s) => match s.parse::<Cursor>().and_then(|c| feed.check(c).map(|()| c)) {
            Ok(c) => c,
            Err(e) => return to_hyper(error(status_of(&e), &e.to_string())),
        },
    };
    let run = at.run;
    streamed(
        NDJSON,
        vec![("Keel-Cursor", at.to_string())],
        Box::new(move |send, alive| {
            let _slot = slot;
            let head = json!({
                "type": "watching",
                "cursor": at.to_string(),
                "path": filter.path(),
                "recursive": filter.recursive(),
            });
            if !send(line(&head)) {
                return;
            }
            let mut at = at;
            loop {
                match feed.read(at, BATCH, ALIVE_CHECK) {
                    Ok(evs) if evs.is_empty() => {
                        if !alive() {
                            return;
                        }
                    }
                    Ok(evs) => {
                        let mut out = Vec::new();
                        for e in &evs {
                            if filter.wants(e) {
                                out.extend(event_line(e, run));
                            }
                        }
                        at.seq = evs.last().map_or(at.seq, |e| e.seq);
                        if !out.is_empty() && !send(out) {
                            return;
                        }
                    }
                    Err(FeedError::Closed) => {
                        let end = json!({"type": "end", "cursor": at.to_string(),
                                         "reason": "the workspace is unmounting"});
                        send(line(&end));
                        return;
                    }
                    Err(e) => {
                        let lost = json!({"type": "lost", "cursor": at.to_string(),
                                          "error": e.to_string()});
                        send(line(&lost));
                        return;
                    }
                }
            }
        }),
    )
}

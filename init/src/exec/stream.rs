//! A process's events as the API streams them: NDJSON, one JSON object per line, the same on
//! the TCP listener and the Unix socket. Output is binary-safe: each `stdout`/`stderr` event
//! carries its bytes in base64 (`data`) and the offset of its first byte in the stream
//! (`offset`), so a client that lost its connection resumes with `from=` the offset plus the
//! bytes it decoded. Events:
//!
//! ```text
//! {"type":"start","id":7,"pid":1234,"attached":false}
//! {"type":"stdout","offset":0,"data":"aGVsbG8K"}
//! {"type":"gap","stream":"stdout","offset":16777216,"bytes":1048576}   (dropped: not kept)
//! {"type":"exit","id":7,"code":0,"signal":null,"status":0,"timed_out":false,...}
//! ```
//!
//! `raw` is the other form: one stream's bytes as they are (`format=raw`).

use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use super::output::{Chunk, Output};
use super::record::{Phase, Record};

/// Which streams, from where, and whether to wait for more.
#[derive(Debug, Clone, Copy)]
pub struct Follow {
    pub stdout: Option<u64>,
    pub stderr: Option<u64>,
    /// Wait for output (and the exit) until the process is done.
    pub follow: bool,
    /// End with the exit event (once the process is done).
    pub exit: bool,
}

/// Bytes per output event.
const CHUNK: usize = 256 << 10;
/// Bytes per write of a raw stream.
const RAW_CHUNK: usize = 1 << 20;
/// How often a waiting stream checks that its client is still there.
const ALIVE_CHECK: Duration = Duration::from_secs(1);

fn line(v: &Value) -> Vec<u8> {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    b
}

/// `{"type":NAME,"offset":N,"data":"BASE64"}` and a newline, written directly: base64 needs
/// no JSON escaping, and the event carries up to `CHUNK` bytes.
fn data_line(engine: &impl Engine, name: &str, offset: u64, data: &[u8]) -> Vec<u8> {
    let head = format!("{{\"type\":\"{name}\",\"offset\":{offset},\"data\":\"");
    let mut out = Vec::with_capacity(head.len() + data.len().div_ceil(3) * 4 + 3);
    out.extend_from_slice(head.as_bytes());
    let at = out.len();
    out.resize(at + data.len().div_ceil(3) * 4, 0);
    let n = engine
        .encode_slice(data, &mut out[at..])
        .expect("room for the base64 of the data");
    out.truncate(at + n);
    out.extend_from_slice(b"\"}\n");
    out
}

/// The `start` event.
pub fn start_event(r: &Record, attached: bool) -> Vec<u8> {
    line(&json!({
        "type": "start",
        "id": r.id.0,
        "pid": r.pid(),
        "request_id": r.request_id,
        "attached": attached,
    }))
}

/// Sends `r`'s events to `send` (false: the client is gone) until the process is done
/// (`follow`) or what is there now has been sent. `alive` says, while nothing happens,
/// whether the client is still there.
pub fn ndjson(
    r: &Record,
    f: Follow,
    send: &mut dyn FnMut(Vec<u8>) -> bool,
    alive: &dyn Fn() -> bool,
) {
    let mut buf = vec![0u8; CHUNK];
    let mut at = [f.stdout, f.stderr];
    let engine = base64::engine::general_purpose::STANDARD;
    loop {
        // Done before the read: a process marked done has all its output in.
        let seen = r.version();
        let done = r.phase() == Phase::Done;
        let mut sent = false;
        for (i, name) in ["stdout", "stderr"].into_iter().enumerate() {
            let Some(from) = at[i] else { continue };
            let out: &Output = if i == 0 { &r.stdout } else { &r.stderr };
            match out.read(from, &mut buf) {
                Ok(Chunk::Data(n)) => {
                    if !send(data_line(&engine, name, from, &buf[..n])) {
                        return;
                    }
                    at[i] = Some(from + n as u64);
                    sent = true;
                }
                Ok(Chunk::Gap { to }) => {
                    let ev = json!({
                        "type": "gap",
                        "stream": name,
                        "offset": from,
                        "bytes": to - from,
                    });
                    if !send(line(&ev)) {
                        return;
                    }
                    at[i] = Some(to);
                    sent = true;
                }
                Ok(Chunk::Nothing) => {}
                Err(e) => {
                    let ev = json!({"type": "error", "error": format!("read {name}: {e}")});
                    let _ = send(line(&ev));
                    return;
                }
            }
        }
        if sent {
            continue;
        }
        if done {
            if f.exit {
                let _ = send(line(&r.exit_json()));
            }
            return;
        }
        if !f.follow {
            return;
        }
        if r.wait_change(seen, ALIVE_CHECK) == seen && !alive() {
            return;
        }
    }
}

/// One stream's bytes from `from` as they are; with `follow`, until the process is done. A
/// gap (bytes no longer kept) ends the stream early: the client asks again from its offset
/// and learns where the bytes resume (`first_kept`).
pub fn raw(
    r: &Record,
    stderr: bool,
    from: u64,
    follow: bool,
    send: &mut dyn FnMut(Vec<u8>) -> bool,
    alive: &dyn Fn() -> bool,
) {
    let out = if stderr { &r.stderr } else { &r.stdout };
    let mut at = from;
    loop {
        let seen = r.version();
        let done = r.phase() == Phase::Done;
        // Read into the buffer that is sent: one copy from the file, none more; sized to
        // what is there (a wake-up for a few bytes allocates a few), none when nothing is.
        let there = out.len().saturating_sub(at);
        if there > 0 {
            let mut buf = vec![0u8; usize::try_from(there).map_or(RAW_CHUNK, |n| n.min(RAW_CHUNK))];
            match out.read(at, &mut buf) {
                Ok(Chunk::Data(n)) => {
                    buf.truncate(n);
                    if !send(buf) {
                        return;
                    }
                    at += n as u64;
                    continue;
                }
                Ok(Chunk::Gap { .. }) | Err(_) => return,
                Ok(Chunk::Nothing) => {}
            }
        }
        if done || !follow {
            return;
        }
        if r.wait_change(seen, ALIVE_CHECK) == seen && !alive() {
            return;
        }
    }
}

/// Where a raw read from `from` really starts: `from`, or the first byte kept after a gap.
pub fn first_kept(r: &Record, stderr: bool, from: u64) -> u64 {
    let out = if stderr { &r.stderr } else { &r.stdout };
    let mut b = [0u8; 1];
    match out.read(from, &mut b) {
        Ok(Chunk::Gap { to }) => to,
        _ => from,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_line_is_the_json_a_parser_reads() {
        let engine = base64::engine::general_purpose::STANDARD;
        for data in [&b""[..], b"a", b"ab", b"abc", &[0u8, 255, 10, 34, 92]] {
            let l = data_line(&engine, "stdout", 7, data);
            assert_eq!(l.last(), Some(&b'\n'));
            let v: Value = serde_json::from_slice(&l).unwrap();
            assert_eq!(
                (v["type"].as_str(), v["offset"].as_u64()),
                (Some("stdout"), Some(7))
            );
            assert_eq!(engine.decode(v["data"].as_str().unwrap()).unwrap(), data);
        }
    }
}

//! The persist socket `<state>/persist.sock` (next to the HTTP control API's
//! `control.sock`, which serves `POST /checkpoint` through `CheckpointHandle` under `keel
//! run`): a running keel answers one-line commands
//! (`checkpoint`, `checkpoint full`, `gc`, `status`, `mount-point`, `agent <JSON>`: a named
//! snapshot or a rollback, see `agent`) with one line, `ok <text>` or
//! `error <text>`. `keel checkpoint` and `keel gc` use it to reach a mounted workspace.
//! `diff <JSON of DiffRequest>` (`keel diff`) is answered `ok` and a newline, then the diff
//! as the worker writes it (`agent::diff_to`) to the end of the connection, or with the
//! one line `error <text>`.

use std::fs::Permissions;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::service::Cmd;

/// `diff <JSON>` on the socket.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiffRequest {
    pub diff: super::agent::Diff,
    pub format: super::diff::Format,
    /// Changed entries the answer may list (0: any).
    pub limit: u64,
}

/// How long the worker waits for the client to take a part of a streamed answer.
const STREAM_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Answers `diff <JSON>` on `conn`: `ok`, then the diff as it is produced.
fn stream_diff(json: &str, agent: &super::CheckpointHandle, conn: &UnixStream) {
    let req: DiffRequest = match serde_json::from_str(json) {
        Ok(r) => r,
        Err(e) => {
            let _ = writeln!(&*conn, "error bad diff request: {e}");
            return;
        }
    };
    let Ok(w) = conn.try_clone() else { return };
    let _ = w.set_write_timeout(Some(STREAM_WRITE_TIMEOUT));
    let started = Arc::new(AtomicBool::new(false));
    let out = OkFirst {
        w: std::io::BufWriter::with_capacity(64 * 1024, w),
        started: started.clone(),
    };
    if let Err(e) = agent.diff_to(req.diff, req.format, req.limit, Box::new(out)) {
        if !started.load(Ordering::SeqCst) {
            let _ = writeln!(&*conn, "error {}", e.to_string().replace('\n', " "));
        }
    }
}

/// A writer that says `ok` before its first byte.
struct OkFirst<W: Write> {
    w: W,
    started: Arc<AtomicBool>,
}

impl<W: Write> Write for OkFirst<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if !self.started.swap(true, Ordering::SeqCst) {
            self.w.write_all(b"ok\n")?;
        }
        self.w.write(b)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

pub struct Server {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
}

fn answer(cmd: &str, tx: &Sender<Cmd>, agent: &super::CheckpointHandle) -> String {
    let gone = || "error checkpoint service stopped".to_string();
    match cmd.trim() {
        c @ ("checkpoint" | "checkpoint full") => {
            let (reply, rx) = mpsc::channel();
            if tx
                .send(Cmd::Checkpoint {
                    full: c.ends_with("full"),
                    reply,
                })
                .is_err()
            {
                return gone();
            }
            match rx.recv() {
                Ok(Ok(r)) => format!("ok {r}"),
                Ok(Err(e)) => format!("error {e}"),
                Err(_) => gone(),
            }
        }
        "gc" => {
            let (reply, rx) = mpsc::channel();
            if tx.send(Cmd::Gc { reply }).is_err() {
                return gone();
            }
            match rx.recv() {
                Ok(Ok(r)) => format!("ok {r}"),
                Ok(Err(e)) => format!("error {e}"),
                Err(_) => gone(),
            }
        }
        "status" => {
            let (reply, rx) = mpsc::channel();
            if tx.send(Cmd::Status { reply }).is_err() {
                return gone();
            }
            rx.recv()
                .map(|s| format!("ok {s}"))
                .unwrap_or_else(|_| gone())
        }
        "mount-point" => {
            let (reply, rx) = mpsc::channel();
            if tx.send(Cmd::MountPoint { reply }).is_err() {
                return gone();
            }
            rx.recv()
                .map(|p| format!("ok {}", p.display()))
                .unwrap_or_else(|_| gone())
        }
        c if c.starts_with("agent ") => {
            // `agent <JSON of agent::Op>`: a named snapshot or a rollback; answers JSON.
            let op: super::agent::Op = match serde_json::from_str(&c["agent ".len()..]) {
                Ok(op) => op,
                Err(e) => return format!("error bad agent request: {e}"),
            };
            match agent.agent(op) {
                Ok(v) => format!("ok {v}"),
                Err(e) => format!("error {e}"),
            }
        }
        other => format!("error unknown command `{other}`"),
    }
}

impl Server {
    pub(crate) fn start(
        path: &Path,
        tx: Sender<Cmd>,
        agent: super::CheckpointHandle,
    ) -> std::io::Result<Server> {
        // A socket left by a keel that was killed: nobody answers on it.
        if path.exists() && UnixStream::connect(path).is_err() {
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        // Private like everything in the state dir (bind leaves 0777 minus the umask).
        std::fs::set_permissions(
            path,
            Permissions::from_mode(crate::state::private::FILE_MODE),
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let t = std::thread::Builder::new()
            .name("keel-control".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s2.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut conn) = conn else { continue };
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut line = String::new();
                    if BufReader::new(&conn).read_line(&mut line).is_err() {
                        continue;
                    }
                    if let Some(json) = line.trim().strip_prefix("diff ") {
                        stream_diff(json, &agent, &conn);
                        continue;
                    }
                    let out = answer(&line, &tx, &agent);
                    let _ = writeln!(conn, "{}", out.replace('\n', " "));
                }
            })?;
        Ok(Server {
            path: path.to_path_buf(),
            stop,
            thread: std::sync::Mutex::new(Some(t)),
        })
    }

    /// Stops accepting commands and removes the socket.
    pub fn stop(&self) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the accept loop.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Why a request to the keel running on a state dir failed.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{source}")]
    SetTimeout {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("send to {}: {source}", path.display())]
    Send {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no answer on {}: {source}", path.display())]
    NoAnswer {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The running keel's own `error ...` answer.
    #[error("{0}")]
    Refused(String),
    #[error("write the answer: {0}")]
    Output(#[source] std::io::Error),
    #[error("unexpected answer `{0}`")]
    Unexpected(String),
}

/// Sends a command to the keel running on `state_dir`. `Ok(None)`: nobody is listening.
pub fn request(
    state_dir: &Path,
    cmd: &str,
    timeout: Duration,
) -> Result<Option<String>, RequestError> {
    let path = state_dir.join(crate::state::PERSIST_SOCK);
    let Ok(mut s) = UnixStream::connect(&path) else {
        return Ok(None);
    };
    if let Err(source) = s.set_read_timeout(Some(timeout)) {
        return Err(RequestError::SetTimeout { path, source });
    }
    if let Err(source) = writeln!(s, "{cmd}") {
        return Err(RequestError::Send { path, source });
    }
    let mut line = String::new();
    if let Err(source) = BufReader::new(&s).read_line(&mut line) {
        return Err(RequestError::NoAnswer { path, source });
    }
    let line = line.trim_end();
    match line.split_once(' ') {
        Some(("ok", rest)) => Ok(Some(rest.to_string())),
        Some(("error", rest)) => Err(RequestError::Refused(rest.to_string())),
        _ if line == "ok" => Ok(Some(String::new())),
        _ => Err(RequestError::Unexpected(line.to_string())),
    }
}

/// Sends a command whose answer is streamed (`diff`) to the keel running on `state_dir`, and
/// copies the answer to `out` as it comes. `Ok(false)`: nobody is listening.
pub fn request_stream(
    state_dir: &Path,
    cmd: &str,
    timeout: Duration,
    out: &mut dyn Write,
) -> Result<bool, RequestError> {
    let path = state_dir.join(crate::state::PERSIST_SOCK);
    let Ok(mut s) = UnixStream::connect(&path) else {
        return Ok(false);
    };
    if let Err(source) = s.set_read_timeout(Some(timeout)) {
        return Err(RequestError::SetTimeout { path, source });
    }
    if let Err(source) = writeln!(s, "{cmd}") {
        return Err(RequestError::Send { path, source });
    }
    let mut r = BufReader::with_capacity(64 * 1024, &s);
    let mut line = String::new();
    if let Err(source) = r.read_line(&mut line) {
        return Err(RequestError::NoAnswer { path, source });
    }
    let line = line.trim_end();
    if let Some(why) = line.strip_prefix("error ") {
        return Err(RequestError::Refused(why.to_string()));
    }
    if line != "ok" {
        return Err(RequestError::Unexpected(line.to_string()));
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match std::io::Read::read(&mut r, &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => return Err(RequestError::NoAnswer { path, source }),
        };
        out.write_all(&buf[..n]).map_err(RequestError::Output)?;
    }
    out.flush().map_err(RequestError::Output)?;
    Ok(true)
}

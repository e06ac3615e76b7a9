//! The listeners: one accept thread per listener (TCP for the HTTP API, a Unix socket for
//! `keel status`), one short-lived thread per connection, at most `MAX_CONNECTIONS` at a time
//! (the rest get a quick 503 from a single busy-responder thread, or are closed when even its
//! queue is full), one request per connection, a deadline for reading the request and a
//! timeout for writing the reply. The Unix socket is mode 0600 (0660 and group-owned with
//! `[control] group`) and every peer is checked with `SO_PEERCRED` as well: root, keel's
//! own user, or a member of that group. Stopping shuts the listening socket down, which
//! wakes the accept thread at once, then joins it and removes the socket file.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::api::{self, Access};
use super::http::{self, Conn};
use super::status::StatusHandle;
use crate::sys;

/// Connections served at once per listener; more are refused with 503 right away.
pub const MAX_CONNECTIONS: usize = 32;
/// Time a client has to send its whole request.
pub const READ_DEADLINE: Duration = Duration::from_secs(10);
/// Time a client has to take each part of the reply.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// After an error reply to a request not read to its end: how much more input to swallow,
/// and for how long, so the close does not reset the connection under the reply.
const LINGER_BYTES: usize = 256 * 1024;
const LINGER_TIME: Duration = Duration::from_secs(1);
/// Connections over the limit waiting for their 503, and the time each may take.
const BUSY_QUEUE: usize = 64;
const BUSY_TIME: Duration = Duration::from_millis(200);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("listen on {addr}: {source}")]
    Bind { addr: String, source: io::Error },
    #[error("{}: create directory: {source}", path.display())]
    CreateDir { path: PathBuf, source: io::Error },
    #[error("{}: another keel is already listening there", path.display())]
    InUse { path: PathBuf },
    #[error("{}: exists and is not a socket", path.display())]
    NotASocket { path: PathBuf },
    #[error("{}: remove stale socket: {source}", path.display())]
    RemoveStale { path: PathBuf, source: io::Error },
    #[error("{}: bind: {source}", path.display())]
    BindSocket { path: PathBuf, source: io::Error },
    #[error("{}: chmod {mode:04o}: {source}", path.display())]
    Chmod {
        path: PathBuf,
        mode: u32,
        source: io::Error,
    },
    #[error("start the listener thread: {0}")]
    SpawnThread(io::Error),
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// A running listener. Dropping it stops it too.
pub struct Server {
    listener: Arc<Listener>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    addr: Option<SocketAddr>,
    /// The socket file and its inode, removed on stop if it is still ours.
    socket: Option<(PathBuf, u64)>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.addr)
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

/// Serves the HTTP API on `addr` (`host:port`).
pub fn serve_tcp(addr: &str, status: StatusHandle, access: Access) -> Result<Server, ServerError> {
    let l = TcpListener::bind(addr).map_err(|source| ServerError::Bind {
        addr: addr.to_string(),
        source,
    })?;
    let local = l.local_addr().ok();
    start(Listener::Tcp(l), status, access, local, None)
}

/// Serves the API without a token on a Unix socket at `path` that only root and keel's own
/// user may use (mode 0600, its directory 0700 when keel creates it), or with `group` the
/// members of that group too (0660 and 0750, group-owned). A stale socket left by a killed
/// keel is replaced; a live one is an error.
pub fn serve_unix(
    path: &Path,
    status: StatusHandle,
    group: Option<u32>,
) -> Result<Server, ServerError> {
    let p = || path.to_path_buf();
    let (dir_mode, sock_mode) = if group.is_some() {
        (0o750, 0o660)
    } else {
        (0o700, 0o600)
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(dir_mode)
                .create(dir)
                .map_err(|source| ServerError::CreateDir { path: p(), source })?;
            // Only a directory keel made is keel's to set up (the umask may have cut the mode).
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(dir_mode))
                .and_then(|()| std::os::unix::fs::chown(dir, None, group))
                .map_err(|source| ServerError::CreateDir { path: p(), source })?;
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(ServerError::InUse { path: p() });
            }
            std::fs::remove_file(path)
                .map_err(|source| ServerError::RemoveStale { path: p(), source })?;
        }
        Ok(_) => return Err(ServerError::NotASocket { path: p() }),
        Err(_) => {}
    }
    let l =
        UnixListener::bind(path).map_err(|source| ServerError::BindSocket { path: p(), source })?;
    // The peer check below is what keeps others out; the mode says the same to `ls`.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(sock_mode))
        .and_then(|()| std::os::unix::fs::chown(path, None, group))
        .map_err(|source| ServerError::Chmod {
            path: p(),
            mode: sock_mode,
            source,
        })?;
    let ino = std::fs::symlink_metadata(path)
        .map(|m| m.ino())
        .unwrap_or(0);
    start(
        Listener::Unix(l),
        status,
        Access::Trusted { group },
        None,
        Some((p(), ino)),
    )
}

fn start(
    listener: Listener,
    status: StatusHandle,
    access: Access,
    addr: Option<SocketAddr>,
    socket: Option<(PathBuf, u64)>,
) -> Result<Server, ServerError> {
    let listener = Arc::new(listener);
    let stop = Arc::new(AtomicBool::new(false));
    let (l, s) = (listener.clone(), stop.clone());
    let thread = std::thread::Builder::new()
        .name("keel-control".into())
        .spawn(move || accept_loop(&l, &s, &status, &access))
        .map_err(ServerError::SpawnThread)?;
    Ok(Server {
        listener,
        stop,
        thread: Some(thread),
        addr,
        socket,
    })
}

impl Server {
    /// The bound TCP address (with the real port when `:0` was asked for).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// Stops accepting, waits for the accept thread, removes the socket file. Connections
    /// already accepted finish on their own threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(t) = self.thread.take() else { return };
        self.stop.store(true, Ordering::SeqCst);
        let woke = match &*self.listener {
            Listener::Tcp(l) => sys::socket::stop_accepting(l),
            Listener::Unix(l) => sys::socket::stop_accepting(l),
        };
        match woke {
            Ok(()) => {
                let _ = t.join();
            }
            Err(e) => warn!("control: cannot stop the listener: {e}"),
        }
        if let Some((path, ino)) = &self.socket {
            let ours = std::fs::symlink_metadata(path).is_ok_and(|m| m.ino() == *ino);
            if ours {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One thread that answers connections over the limit with 503, one after the other, each
/// within `BUSY_TIME`; at most `BUSY_QUEUE` wait. `None` if the thread cannot start.
fn busy_responder() -> Option<SyncSender<Stream>> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Stream>(BUSY_QUEUE);
    std::thread::Builder::new()
        .name("keel-control-busy".into())
        .stack_size(256 * 1024)
        .spawn(move || {
            for s in rx {
                s.refuse_busy();
            }
        })
        .ok()
        .map(|_| tx)
}

/// Decrements the connection count when a connection ends (or its thread never started).
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(l: &Listener, stop: &AtomicBool, status: &StatusHandle, access: &Access) {
    let active = Arc::new(AtomicUsize::new(0));
    let mut busy: Option<Option<SyncSender<Stream>>> = None;
    let mut last_warn: Option<Instant> = None;
    loop {
        let accepted = match l {
            Listener::Tcp(l) => l.accept().map(|(s, _)| Stream::Tcp(s)),
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
        };
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let stream = match accepted {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Out of file descriptors or memory: say so now and then, and back off.
                if last_warn.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                    warn!("control: accept: {e}");
                    last_warn = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            // Past the queue's capacity a connection is simply closed.
            if let Some(tx) = busy.get_or_insert_with(busy_responder) {
                let _ = tx.try_send(stream);
            }
            continue;
        }
        let slot = Slot(active.clone());
        let (status, access) = (status.clone(), access.clone());
        let spawned = std::thread::Builder::new()
            .name("keel-control-conn".into())
            .stack_size(512 * 1024)
            .spawn(move || {
                let _slot = slot;
                stream.serve(&status, &access);
            });
        if let Err(e) = spawned {
            debug!("control: cannot start a connection thread: {e}");
        }
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Reads the request (briefly) so the close is clean, then answers 503 busy.
    fn refuse_busy(self) {
        fn refuse<C: Conn>(mut c: C) {
            let _ = c.set_write_timeout(Some(BUSY_TIME));
            let read = http::read_request(&mut c, Instant::now() + BUSY_TIME);
            let _ = http::write_response(&mut c, &http::Response::text(503, "busy\n"), false);
            if read.is_err() {
                http::linger(&mut c, LINGER_BYTES, Instant::now() + BUSY_TIME);
            }
        }
        match self {
            Stream::Tcp(s) => refuse(s),
            Stream::Unix(s) => refuse(s),
        }
    }

    fn serve(self, status: &StatusHandle, access: &Access) {
        match self {
            Stream::Tcp(s) => serve_conn(s, status, access),
            Stream::Unix(s) => {
                let me = sys::socket::euid();
                let group = match access {
                    Access::Trusted { group } => *group,
                    Access::Token(_) => None,
                };
                let member = |s: &UnixStream| {
                    group.is_some_and(|g| sys::socket::peer_in_group(s, g).unwrap_or(false))
                };
                match sys::socket::peer_uid(&s) {
                    Ok(uid) if uid == me || uid == 0 || member(&s) => serve_conn(s, status, access),
                    Ok(uid) => {
                        debug!("control: refused a socket peer with uid {uid}");
                        let r = http::Response::text(403, "forbidden\n");
                        let mut s = s;
                        let _ = s.set_write_timeout(Some(WRITE_TIMEOUT));
                        let _ = http::write_response(&mut s, &r, false);
                    }
                    Err(e) => debug!("control: peer credentials: {e}"),
                }
            }
        }
    }
}

/// Reads one request from `c`, answers it, closes.
fn serve_conn<C: Conn>(mut c: C, status: &StatusHandle, access: &Access) {
    let _ = c.set_write_timeout(Some(WRITE_TIMEOUT));
    let (resp, head_only, unread) = match http::read_request(&mut c, Instant::now() + READ_DEADLINE)
    {
        Ok(req) => (
            api::handle(&req, status, access),
            req.method == "HEAD",
            false,
        ),
        Err(e) => {
            debug!("control: {e}");
            match e.response() {
                Some(r) => (r, false, true),
                None => return,
            }
        }
    };
    if let Err(e) = http::write_response(&mut c, &resp, head_only) {
        debug!("control: write response: {e}");
        return;
    }
    if unread {
        http::linger(&mut c, LINGER_BYTES, Instant::now() + LINGER_TIME);
    }
}

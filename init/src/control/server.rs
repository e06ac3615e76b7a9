//! The listeners, on hyper 1.x: one thread per listener runs a current-thread tokio runtime
//! that accepts on the TCP port or the Unix socket and serves each connection as one HTTP/1.1
//! request (`Connection: close`). The bounds: a request head of at most `MAX_HEAD` bytes
//! (else 431) read within `Limits::head_timeout`, a body of at most `MAX_BODY` (else 413)
//! read within `READ_DEADLINE`, and `WRITE_TIMEOUT` for the reply once it is ready. The
//! sandbox shares the network namespace, so nobody may starve the API by holding half-sent
//! requests: connections still sending their head are bounded per peer and in all
//! (`Pending`: a new one always gets in, the oldest of that peer, else of all, is closed),
//! and only once its head is read does a request take a slot, from its class's own pool
//! (`Slots`: the token's holder never waits for anyone else); `/health` and the answers
//! given at once take none. Routing is `api::handle` on keel's own `Request`/`Response`;
//! it runs on the blocking pool, so a long `POST /checkpoint` holds nobody else up. The
//! Unix socket is mode 0600 (0660 and group-owned with `[control] group`) and every peer
//! is checked with `SO_PEERCRED` as well: root, keel's own user, or a member of that
//! group; anyone else gets 403. Stopping ends the accept loop at once, gives requests in
//! flight `STOP_GRACE`, and removes the socket file.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use futures::future::Either;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};
use tracing::debug;

use super::api::{self, Access, Request, Response, Rights};
use super::routes::{Body, Call, Handler};
use super::status::StatusHandle;
use crate::sys;

/// Largest request head (request line and headers) accepted.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest request body accepted.
pub const MAX_BODY: usize = 16 * 1024;
/// Time a client has to send its request body once its head is read.
pub const READ_DEADLINE: Duration = Duration::from_secs(10);
/// Time a client has to take the reply once it is ready.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long stopping waits for requests in flight (and then for their handlers).
const STOP_GRACE: Duration = Duration::from_secs(1);

/// The bounds of one listener (`[control]` head_timeout, max_pending, max_pending_per_peer,
/// max_connections).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub head_timeout: Duration,
    pub max_pending: usize,
    pub max_pending_per_peer: usize,
    /// Per class: privileged callers, and everyone else.
    pub max_connections: usize,
}

impl Limits {
    pub fn of(c: &crate::config::control::ControlConfig) -> Self {
        Limits {
            head_timeout: c.head_timeout,
            max_pending: c.max_pending,
            max_pending_per_peer: c.max_pending_per_peer,
            max_connections: c.max_connections,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::of(&Default::default())
    }
}

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
    #[error("start the listener's runtime: {0}")]
    Runtime(io::Error),
    #[error("start the listener thread: {0}")]
    SpawnThread(io::Error),
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// A running listener. Dropping it stops it too.
pub struct Server {
    stop: Option<oneshot::Sender<()>>,
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
pub fn serve_tcp(
    addr: &str,
    status: StatusHandle,
    access: Access,
    limits: Limits,
) -> Result<Server, ServerError> {
    let bind_err = |source| ServerError::Bind {
        addr: addr.to_string(),
        source,
    };
    let l = std::net::TcpListener::bind(addr).map_err(bind_err)?;
    l.set_nonblocking(true).map_err(bind_err)?;
    let local = l.local_addr().ok();
    start(
        StdListener::Tcp(l),
        status,
        Gate::Tcp(access),
        local,
        None,
        limits,
    )
}

/// Serves the API without a token on a Unix socket at `path` that only root and keel's own
/// user may use (mode 0600, its directory 0700 when keel creates it), or with `group` the
/// members of that group too (0660 and 0750, group-owned). A stale socket left by a killed
/// keel is replaced; a live one is an error.
pub fn serve_unix(
    path: &Path,
    status: StatusHandle,
    group: Option<u32>,
    limits: Limits,
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
            if StdUnixStream::connect(path).is_ok() {
                return Err(ServerError::InUse { path: p() });
            }
            std::fs::remove_file(path)
                .map_err(|source| ServerError::RemoveStale { path: p(), source })?;
        }
        Ok(_) => return Err(ServerError::NotASocket { path: p() }),
        Err(_) => {}
    }
    let l = std::os::unix::net::UnixListener::bind(path)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|source| ServerError::BindSocket { path: p(), source })?;
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
        StdListener::Unix(l),
        status,
        Gate::Unix { group },
        None,
        Some((p(), ino)),
        limits,
    )
}

enum StdListener {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

/// Who a listener serves, and with what rights.
#[derive(Debug, Clone)]
enum Gate {
    /// Every connection; the token, if any, is checked per request (`api::handle`).
    Tcp(Access),
    /// Root and keel's own user with every right, the members of `group` as observers;
    /// any other peer gets 403.
    Unix { group: Option<u32> },
}

fn start(
    listener: StdListener,
    status: StatusHandle,
    gate: Gate,
    addr: Option<SocketAddr>,
    socket: Option<(PathBuf, u64)>,
    limits: Limits,
) -> Result<Server, ServerError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(ServerError::Runtime)?;
    let listener = {
        let _in_rt = rt.enter();
        match listener {
            StdListener::Tcp(l) => TcpListener::from_std(l).map(Listener::Tcp),
            StdListener::Unix(l) => UnixListener::from_std(l).map(Listener::Unix),
        }
        .map_err(ServerError::Runtime)?
    };
    let (stop, stopped) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("keel-control".into())
        .spawn(move || {
            rt.block_on(accept_loop(listener, stopped, status, gate, limits));
            rt.shutdown_timeout(STOP_GRACE);
        })
        .map_err(ServerError::SpawnThread)?;
    Ok(Server {
        stop: Some(stop),
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

    /// Stops accepting, waits up to `STOP_GRACE` for requests in flight, removes the socket
    /// file.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(t) = self.thread.take() else { return };
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = t.join();
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

/// What a connection gets, decided when it is accepted.
#[derive(Clone)]
enum Verdict {
    Serve(StatusHandle, Access),
    /// A fixed answer: 403 for a socket peer that may not call.
    Refuse(u16, &'static str),
}

/// Who is on the other end, for the bound on connections whose head is still coming: the
/// address over TCP, the uid on the Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum PeerKey {
    Ip(IpAddr),
    Uid(u32),
    Unknown,
}

/// Connections whose request head is still coming, oldest first. A new one always gets in:
/// when its peer holds `max_pending_per_peer` of them, that peer's oldest is closed if it
/// has had `HEAD_GRACE` to send its head (a burst of clients that send theirs at once is not
/// cut short before keel has read them), and at twice that many whatever its age; else when
/// `max_pending` are held, the oldest of all likewise. So a client that sends its head at
/// once (a probe, the token's holder) is read however many half-sent requests others hold.
#[derive(Default)]
struct Pending {
    next: u64,
    conns: BTreeMap<u64, (PeerKey, Arc<Notify>, tokio::time::Instant)>,
    per_peer: HashMap<PeerKey, usize>,
}

/// How long a connection may hold back its head before a newer one may push it out.
const HEAD_GRACE: Duration = Duration::from_secs(1);

impl Pending {
    /// Registers a connection of `peer` (closing another as above); returns its id and what
    /// tells it it was closed.
    fn admit(&mut self, peer: PeerKey, limits: &Limits) -> (u64, Arc<Notify>) {
        let now = tokio::time::Instant::now();
        let held = self.per_peer.get(&peer).copied().unwrap_or(0);
        let (mine, cap) = if held >= limits.max_pending_per_peer {
            (true, limits.max_pending_per_peer)
        } else {
            (false, limits.max_pending)
        };
        let count = if mine { held } else { self.conns.len() };
        if count >= cap {
            let victim = self
                .conns
                .iter()
                .filter(|(_, (p, _, _))| !mine || *p == peer)
                .take(1)
                .find(|(_, (_, _, since))| count >= 2 * cap || now - *since >= HEAD_GRACE)
                .map(|(id, _)| *id);
            if let Some((_, evicted)) = victim.and_then(|id| self.remove(id)) {
                evicted.notify_one();
            }
        }
        let id = self.next;
        self.next += 1;
        let evicted = Arc::new(Notify::new());
        self.conns.insert(id, (peer, evicted.clone(), now));
        *self.per_peer.entry(peer).or_default() += 1;
        (id, evicted)
    }

    fn remove(&mut self, id: u64) -> Option<(PeerKey, Arc<Notify>)> {
        let (peer, n, _) = self.conns.remove(&id)?;
        if let Some(c) = self.per_peer.get_mut(&peer) {
            *c -= 1;
            if *c == 0 {
                self.per_peer.remove(&peer);
            }
        }
        Some((peer, n))
    }
}

/// A connection's place in `Pending`, given up when its head has been read or it ends.
struct PendingEntry {
    pending: Arc<Mutex<Pending>>,
    id: u64,
}

impl PendingEntry {
    fn done(&self) {
        if let Ok(mut p) = self.pending.lock() {
            p.remove(self.id);
        }
    }
}

impl Drop for PendingEntry {
    fn drop(&mut self) {
        self.done();
    }
}

/// The slots of requests being served, one pool per class: a request that needs a handler
/// takes one once its head is read (privileged callers never wait for anyone else's);
/// `/health` and the answers given at once (401, 403, 404, 405) take none.
#[derive(Clone)]
struct Slots {
    privileged: Arc<Semaphore>,
    others: Arc<Semaphore>,
}

/// What serving one connection needs.
struct ConnCtx {
    verdict: Verdict,
    head_timeout: Duration,
    entry: PendingEntry,
    evicted: Arc<Notify>,
    slots: Slots,
}

async fn accept_loop(
    l: Listener,
    mut stop: oneshot::Receiver<()>,
    status: StatusHandle,
    gate: Gate,
    limits: Limits,
) {
    let slots = Slots {
        privileged: Arc::new(Semaphore::new(limits.max_connections)),
        others: Arc::new(Semaphore::new(limits.max_connections)),
    };
    let pending = Arc::new(Mutex::new(Pending::default()));
    let mut warned = None::<tokio::time::Instant>;
    loop {
        let accept = std::pin::pin!(l.accept());
        let (conn, peer) = match futures::future::select(&mut stop, accept).await {
            Either::Left(_) => {
                // Requests in flight get a moment to finish.
                let n = limits.max_connections as u32;
                let all = futures::future::join(
                    slots.privileged.acquire_many(n),
                    slots.others.acquire_many(n),
                );
                let _ = tokio::time::timeout(STOP_GRACE, all).await;
                return;
            }
            Either::Right((Ok(c), _)) => c,
            Either::Right((Err(e), _)) => {
                // Out of file descriptors or memory: say so now and then, and back off.
                if warned.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                    tracing::warn!("control: accept: {e}");
                    warned = Some(tokio::time::Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let verdict = match (&conn, &gate) {
            (Conn::Unix(s), Gate::Unix { group }) => match peer_rights(s, *group) {
                Some(rights) => Verdict::Serve(status.clone(), Access::Peer(rights)),
                None => Verdict::Refuse(403, "forbidden\n"),
            },
            (Conn::Tcp(_), Gate::Tcp(access)) => Verdict::Serve(status.clone(), access.clone()),
            // A listener accepts only its own kind of connection.
            _ => Verdict::Refuse(403, "forbidden\n"),
        };
        let (id, evicted) = match pending.lock() {
            Ok(mut p) => p.admit(peer, &limits),
            Err(_) => return,
        };
        let ctx = ConnCtx {
            verdict,
            head_timeout: limits.head_timeout,
            entry: PendingEntry {
                pending: pending.clone(),
                id,
            },
            evicted,
            slots: slots.clone(),
        };
        tokio::spawn(conn.serve(ctx));
        // Let it read a head that is already there before the next connection is counted.
        tokio::task::yield_now().await;
    }
}

impl Listener {
    async fn accept(&self) -> io::Result<(Conn, PeerKey)> {
        match self {
            Listener::Tcp(l) => l
                .accept()
                .await
                .map(|(s, a)| (Conn::Tcp(s), PeerKey::Ip(a.ip().to_canonical()))),
            Listener::Unix(l) => l.accept().await.map(|(s, _)| {
                let key = sys::socket::peer_uid(&s)
                    .map(PeerKey::Uid)
                    .unwrap_or(PeerKey::Unknown);
                (Conn::Unix(s), key)
            }),
        }
    }
}

/// Every right for root and keel's own user, observing for (with `[control] group`) a member
/// of that group, `None` for anyone else.
fn peer_rights(s: &tokio::net::UnixStream, group: Option<u32>) -> Option<Rights> {
    match sys::socket::peer_uid(s) {
        Ok(uid) if uid == 0 || uid == sys::socket::euid() => Some(Rights::All),
        Ok(uid) => {
            let member = group.is_some_and(|g| sys::socket::peer_in_group(s, g).unwrap_or(false));
            if !member {
                debug!("control: refused a socket peer with uid {uid}");
            }
            member.then_some(Rights::Observe)
        }
        Err(e) => {
            debug!("control: peer credentials: {e}");
            None
        }
    }
}

enum Conn {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Conn {
    async fn serve(self, ctx: ConnCtx) {
        match self {
            Conn::Tcp(s) => serve_conn(s, ctx).await,
            Conn::Unix(s) => serve_conn(s, ctx).await,
        }
    }
}

/// Serves one request on `io`: its head within `head_timeout` (unless another connection
/// pushes this one out of `Pending` first), then a slot of its class; a whole reply, once
/// ready, has `WRITE_TIMEOUT` to go out (a streamed one has it for each part:
/// `processes::streamed`).
async fn serve_conn<S>(io: S, ctx: ConnCtx)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let ConnCtx {
        verdict,
        head_timeout,
        entry,
        evicted,
        slots,
    } = ctx;
    let replied = Arc::new(Notify::new());
    let r = replied.clone();
    let entry = Arc::new(entry);
    // The slot the request holds, for as long as the connection lasts.
    let held: Arc<Mutex<Option<OwnedSemaphorePermit>>> = Arc::default();
    let h = held.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        entry.done();
        let (verdict, replied, slots, held) =
            (verdict.clone(), r.clone(), slots.clone(), h.clone());
        async move {
            let (resp, whole) = match verdict {
                Verdict::Serve(status, access) => answer(req, status, access, &slots, &held).await,
                Verdict::Refuse(code, text) => (to_hyper(Response::text(code, text)), true),
            };
            if whole {
                replied.notify_one();
            }
            Ok::<_, Infallible>(resp)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .keep_alive(false)
        .max_buf_size(MAX_HEAD)
        .header_read_timeout(head_timeout)
        .serve_connection(TokioIo::new(io), service);
    let write_limit = async move {
        replied.notified().await;
        tokio::time::sleep(WRITE_TIMEOUT).await;
    };
    let write_limit = std::pin::pin!(write_limit);
    let pushed_out = std::pin::pin!(evicted.notified());
    let ended = futures::future::select(write_limit, pushed_out);
    match futures::future::select(std::pin::pin!(conn), std::pin::pin!(ended)).await {
        Either::Left((Err(e), _)) => debug!("control: {e}"),
        Either::Left((Ok(()), _)) => {}
        Either::Right((Either::Left(_), _)) => {
            debug!("control: the client did not take its reply in time")
        }
        Either::Right((Either::Right(_), _)) => {
            debug!("control: closed a connection still sending its head to make room")
        }
    }
    drop(held);
}

/// Dispatches (`api::dispatch`); a plain route's body is read (bounded in size and time) and
/// its handler runs on the blocking pool, a streaming route gets the body as it comes.
/// Returns the answer and whether it is whole (not streamed).
async fn answer(
    req: hyper::Request<Incoming>,
    status: StatusHandle,
    access: Access,
    slots: &Slots,
    held: &Mutex<Option<OwnedSemaphorePermit>>,
) -> (hyper::Response<Body>, bool) {
    let (parts, body) = req.into_parts();
    let mut req = Request {
        method: parts.method.as_str().to_string(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().unwrap_or("").to_string(),
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| {
                let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
                (k.as_str().to_string(), v)
            })
            .collect(),
        body: Vec::new(),
    };
    let (route, params) = match api::dispatch(&req, &status, &access) {
        api::Dispatch::Answer(r) => return (to_hyper(r), true),
        api::Dispatch::Route(route, params) => (route, params),
    };
    // Past the token check: the token's holder (or a privileged socket peer) has slots of
    // its own, never taken by anyone else.
    let privileged = match &access {
        Access::Token(t) => t.is_some(),
        Access::Peer(r) => *r == Rights::All,
    };
    let pool = if privileged {
        &slots.privileged
    } else {
        &slots.others
    };
    match pool.clone().try_acquire_owned() {
        Ok(slot) => {
            if let Ok(mut h) = held.lock() {
                *h = Some(slot);
            }
        }
        Err(_) => return (to_hyper(Response::text(503, "busy\n")), true),
    }
    let f = match route.handler {
        Handler::Stream(f) => {
            let call = Call {
                req,
                params,
                body,
                status,
            };
            return (f(call).await, false);
        }
        Handler::Plain(f) => f,
    };
    let declared = parts
        .headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return (to_hyper(Response::text(413, "payload too large\n")), true);
    }
    req.body =
        match tokio::time::timeout(READ_DEADLINE, Limited::new(body, MAX_BODY).collect()).await {
            Ok(Ok(b)) => b.to_bytes().to_vec(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return (to_hyper(Response::text(413, "payload too large\n")), true)
            }
            Ok(Err(e)) => {
                debug!("control: read the request body: {e}");
                return (to_hyper(Response::text(400, "bad request\n")), true);
            }
            Err(_) => return (to_hyper(Response::text(408, "request timeout\n")), true),
        };
    let r = match tokio::task::spawn_blocking(move || f(&req, &params, &status)).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("control: request handler failed: {e}");
            Response::text(500, "internal error\n")
        }
    };
    (to_hyper(r), true)
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
        .unwrap_or_else(|e| {
            debug!("control: build the response: {e}");
            let mut r =
                hyper::Response::new(Full::new(Bytes::from_static(b"internal error\n")).boxed());
            *r.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
            r
        })
}

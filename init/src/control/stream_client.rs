//! The client side of the streaming routes (`keel exec`): one HTTP/1.1 request on hyper's
//! client, over the control socket (inside the sandbox) or TCP (from outside, with the
//! token), whose answer is handed to the caller part by part as it arrives.

use std::path::PathBuf;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper_util::rt::TokioIo;

/// Where the control API is.
#[derive(Debug, Clone)]
pub enum Target {
    Socket(PathBuf),
    /// `host:port`, and the bearer token.
    Tcp {
        addr: String,
        token: Option<String>,
    },
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Socket(p) => write!(f, "{}", p.display()),
            Target::Tcp { addr, .. } => write!(f, "http://{addr}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StreamClientError {
    #[error("{target}: nothing is listening (is `keel run` running?)")]
    NotListening { target: String },
    #[error("{target}: permission denied (the control socket admits root and keel's user)")]
    Denied { target: String },
    #[error("{target}: connect: {source}")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    #[error("{target}: {what}: {source}")]
    Http {
        target: String,
        what: &'static str,
        source: hyper::Error,
    },
    #[error("start a runtime: {0}")]
    Runtime(std::io::Error),
    #[error("bad request: {0}")]
    Request(#[source] hyper::http::Error),
}

/// Sends `method path` with `body` (JSON) and hands the status code once, then every part
/// of the answer to `part` until it ends or `part` returns false.
pub fn request(
    target: &Target,
    method: &str,
    path: &str,
    body: Vec<u8>,
    status: &mut dyn FnMut(u16),
    part: &mut dyn FnMut(&[u8]) -> bool,
) -> Result<(), StreamClientError> {
    let body = Full::new(Bytes::from(body))
        .map_err(|never| match never {})
        .boxed();
    request_with(target, method, path, &[], body, status, part)
}

/// The request body of `request_with`.
pub type ReqBody = BoxBody<Bytes, std::io::Error>;

/// A request body read from `r` on a thread of its own, piece by piece (an upload).
pub fn body_from(r: impl std::io::Read + Send + 'static) -> ReqBody {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    std::thread::spawn(move || {
        let mut r = r;
        loop {
            let mut buf = vec![0u8; 1 << 16];
            match r.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    });
    let frames = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (b.map(Frame::data), rx))
    });
    StreamBody::new(frames).boxed()
}

/// `request` with extra headers and any body (`body_from` streams one).
pub fn request_with(
    target: &Target,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: ReqBody,
    status: &mut dyn FnMut(u16),
    part: &mut dyn FnMut(&[u8]) -> bool,
) -> Result<(), StreamClientError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(StreamClientError::Runtime)?;
    rt.block_on(run(target, method, path, headers, body, status, part))
}

async fn run(
    target: &Target,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: ReqBody,
    status: &mut dyn FnMut(u16),
    part: &mut dyn FnMut(&[u8]) -> bool,
) -> Result<(), StreamClientError> {
    let t = target.to_string();
    let connect_err = |source: std::io::Error| match source.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
            StreamClientError::NotListening { target: t.clone() }
        }
        std::io::ErrorKind::PermissionDenied => StreamClientError::Denied { target: t.clone() },
        _ => StreamClientError::Connect {
            target: t.clone(),
            source,
        },
    };
    let http = |what| {
        let t = t.clone();
        move |source| StreamClientError::Http {
            target: t,
            what,
            source,
        }
    };
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "keel")
        .header(hyper::header::CONTENT_TYPE, "application/json");
    if let Target::Tcp {
        token: Some(tok), ..
    } = target
    {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {tok}"));
    }
    for (k, v) in headers {
        req = req.header(*k, v.as_str());
    }
    let req = req.body(body).map_err(StreamClientError::Request)?;
    let resp = match target {
        Target::Socket(p) => {
            let s = tokio::net::UnixStream::connect(p)
                .await
                .map_err(connect_err)?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                .await
                .map_err(http("handshake"))?;
            tokio::spawn(conn);
            send.send_request(req).await.map_err(http("send"))?
        }
        Target::Tcp { addr, .. } => {
            let s = tokio::net::TcpStream::connect(addr.as_str())
                .await
                .map_err(connect_err)?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                .await
                .map_err(http("handshake"))?;
            tokio::spawn(conn);
            send.send_request(req).await.map_err(http("send"))?
        }
    };
    status(resp.status().as_u16());
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(http("read the answer"))?;
        if let Ok(data) = frame.into_data() {
            if !part(&data) {
                break;
            }
        }
    }
    Ok(())
}

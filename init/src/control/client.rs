//! `keel status [--socket PATH] [--config FILE]`: asks a running `keel run` for `/status`
//! over its Unix socket (default `<state_dir>/control.sock` from the config) and prints the
//! JSON exactly as `GET /status` returns it. Nothing listening is one clear line and exit 1.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

const USAGE: &str = "usage: keel status [--socket PATH] [--config FILE]";

/// How long `keel status` waits for an answer.
const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0}\n{USAGE}")]
    Usage(String),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("nothing is listening on {} (is `keel run` running with this state dir?)", path.display())]
    NotListening { path: PathBuf },
    #[error("{}: permission denied (the control socket is for root / keel's user only)", path.display())]
    Denied { path: PathBuf },
    #[error("{}: connect: {source}", path.display())]
    Connect { path: PathBuf, source: io::Error },
    #[error("{}: send request: {source}", path.display())]
    Send { path: PathBuf, source: io::Error },
    #[error("{}: read response: {source}", path.display())]
    Receive { path: PathBuf, source: io::Error },
    #[error("{}: unexpected response: {what}", path.display())]
    BadResponse { path: PathBuf, what: String },
    #[error("{}: keel answered {code}: {body}", path.display())]
    Status {
        path: PathBuf,
        code: u16,
        body: String,
    },
}

impl ClientError {
    pub fn exit_code(&self) -> i32 {
        match self {
            ClientError::Usage(_) | ClientError::Config(_) => crate::run::EXIT_USAGE,
            _ => 1,
        }
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Args {
    socket: Option<PathBuf>,
    config: Option<PathBuf>,
}

fn parse(args: Vec<OsString>) -> Result<Args, ClientError> {
    let mut out = Args::default();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy().into_owned();
        let (flag, inline) = match s.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(PathBuf::from(v))),
            _ => (s.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next().map(PathBuf::from))
                .ok_or_else(|| ClientError::Usage(format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--socket" => out.socket = Some(value()?),
            "--config" | "-c" => out.config = Some(value()?),
            "-h" | "--help" => return Err(ClientError::Usage("keel status".into())),
            _ => return Err(ClientError::Usage(format!("unexpected argument `{s}`"))),
        }
    }
    Ok(out)
}

/// Sends `METHOD route` over the Unix socket at `path`; returns the status code and body.
pub fn request(path: &Path, method: &str, route: &str) -> Result<(u16, String), ClientError> {
    let p = || path.to_path_buf();
    let mut s = UnixStream::connect(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
            ClientError::NotListening { path: p() }
        }
        io::ErrorKind::PermissionDenied => ClientError::Denied { path: p() },
        _ => ClientError::Connect { path: p(), source },
    })?;
    let _ = s.set_read_timeout(Some(TIMEOUT));
    let _ = s.set_write_timeout(Some(TIMEOUT));
    let req = format!(
        "{method} {route} HTTP/1.1\r\nHost: keel\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    );
    s.write_all(req.as_bytes())
        .map_err(|source| ClientError::Send { path: p(), source })?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|source| ClientError::Receive { path: p(), source })?;
    let bad = |what: &str| ClientError::BadResponse {
        path: p(),
        what: what.to_string(),
    };
    let text = String::from_utf8(raw).map_err(|_| bad("not UTF-8"))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("no header end"))?;
    let code = head
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| bad("no status line"))?;
    Ok((code, body.to_string()))
}

fn status(args: Vec<OsString>) -> Result<String, ClientError> {
    let a = parse(args)?;
    let path = match a.socket {
        Some(p) => p,
        None => super::default_socket(&crate::run::load_config(a.config)?),
    };
    match request(&path, "GET", "/status")? {
        (200, body) => Ok(body),
        (code, body) => Err(ClientError::Status {
            path,
            code,
            body: body.trim().to_string(),
        }),
    }
}

/// Entry point of `keel status`; returns the process exit code.
pub fn status_main(args: Vec<OsString>) -> i32 {
    match status(args) {
        Ok(body) => {
            let mut out = io::stdout().lock();
            match out.write_all(body.as_bytes()).and_then(|()| out.flush()) {
                Ok(()) => 0,
                Err(_) => 1,
            }
        }
        Err(e) => {
            eprintln!("keel status: {e}");
            e.exit_code()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn args() {
        assert_eq!(parse(a(&[])).unwrap(), Args::default());
        let p = parse(a(&["--socket", "/s", "--config=/c"])).unwrap();
        assert_eq!(p.socket, Some(PathBuf::from("/s")));
        assert_eq!(p.config, Some(PathBuf::from("/c")));
        assert!(parse(a(&["--socket"])).is_err());
        assert!(parse(a(&["extra"])).is_err());
    }

    #[test]
    fn nothing_listening_is_one_clear_line() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("control.sock");
        let e = request(&path, "GET", "/status").unwrap_err();
        assert!(matches!(e, ClientError::NotListening { .. }), "{e:?}");
        assert_eq!(e.exit_code(), 1);
        // A stale socket file nobody listens on reads the same.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let e = request(&path, "GET", "/status").unwrap_err();
        assert!(matches!(e, ClientError::NotListening { .. }), "{e:?}");
        assert!(!e.to_string().contains('\n'));
    }
}

//! Readiness probes that need no child process: a file that exists, an HTTP GET answering
//! 2xx. (Command probes are children and go through the one reaper.)

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

/// True when `path` exists.
pub fn file(path: &Path) -> bool {
    path.exists()
}

/// True when `GET url` answers with a 2xx status within a short timeout.
pub fn http(url: &str) -> bool {
    let Some((hostport, path)) = crate::config::parse_http_url(url) else {
        return false;
    };
    let Some(addr) = hostport.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return false;
    };
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
    let host = hostport
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or(&hostport);
    let req = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nUser-Agent: keel\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = [0u8; 32];
    let mut n = 0;
    while n < 12 {
        match s.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    head.starts_with("HTTP/") && head.split(' ').nth(1).is_some_and(|c| c.starts_with('2'))
}

//! A real S3 endpoint for tests: `moto_server` on a free 127.0.0.1 port with a bucket
//! `keel`, killed when the guard drops, and a `[persist]` config that points at it.
//! Without `moto_server` `start_moto` prints a skip line and returns `None`, or panics
//! when `KEEL_REQUIRE_S3` is set (CI sets it).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use keel::config::PersistConfig;

pub struct Moto(pub Child);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn start_moto() -> Option<(Moto, u16)> {
    let have = Command::new("moto_server")
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !have {
        if std::env::var_os("KEEL_REQUIRE_S3").is_some() {
            panic!("moto_server not found and KEEL_REQUIRE_S3 is set");
        }
        println!("SKIP: moto_server not installed (pip install \"moto[server]\")");
        return None;
    }
    // moto picks its own port (`-p 0`) and says which: no other process can take it
    // between our choice and its bind. Its log is drained for as long as it runs (a full
    // pipe would block it).
    let mut child = Command::new("moto_server")
        .args(["-H", "127.0.0.1", "-p", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(log).lines() {
            let Ok(line) = line else { break };
            if let Some(p) = line
                .split("http://127.0.0.1:")
                .nth(1)
                .and_then(|rest| rest.trim().parse::<u16>().ok())
            {
                let _ = tx.send(p);
            }
        }
    });
    let moto = Moto(child);
    // A hang guard only: moto's start takes seconds on a loaded machine.
    let port = rx
        .recv_timeout(Duration::from_secs(180))
        .expect("moto_server did not say where it listens");
    let t0 = Instant::now();
    loop {
        let ok = Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import boto3; boto3.client('s3', endpoint_url='http://127.0.0.1:{port}', aws_access_key_id='k', aws_secret_access_key='s', region_name='us-east-1').create_bucket(Bucket='keel')"
            ))
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            return Some((moto, port));
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "moto_server did not come up"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The credentials every S3 test uses (moto takes any); distinctive, so a test can look for
/// them in keel's output.
pub const ACCESS_KEY_ID: &str = "KEELTESTACCESSKEYID42";
pub const SECRET_ACCESS_KEY: &str = "KeelTestSecretKey0123456789abcdefXYZ";

/// Puts the credentials in this process's environment, where object_store reads them
/// (`from_env`) and the keel processes a test starts inherit them. Once per process, with
/// the same values for every test of the binary.
pub fn credentials() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::env::set_var("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY);
    });
}

pub fn s3_config(port: u16) -> PersistConfig {
    credentials();
    PersistConfig {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        region: Some("us-east-1".into()),
        allow_http: true,
        ..Default::default()
    }
}

/// A TCP proxy between keel and the endpoint that a test can cut (every open connection
/// dropped, new ones accepted and closed at once) and restore: a remote that goes away in
/// the middle of a checkpoint and comes back, while moto keeps its data.
pub struct Proxy {
    port: u16,
    state: std::sync::Arc<ProxyState>,
}

#[derive(Default)]
struct ProxyState {
    cut: std::sync::atomic::AtomicBool,
    stop: std::sync::atomic::AtomicBool,
    conns: std::sync::Mutex<Vec<std::net::TcpStream>>,
    bytes_up: std::sync::atomic::AtomicU64,
    refused: std::sync::atomic::AtomicU64,
}

fn pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    count: Option<std::sync::Arc<ProxyState>>,
) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
                if let Some(s) = &count {
                    s.bytes_up
                        .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

impl Proxy {
    /// Listens on a free 127.0.0.1 port and forwards to `127.0.0.1:upstream`.
    pub fn start(upstream: u16) -> Proxy {
        use std::sync::atomic::Ordering::Relaxed;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = std::sync::Arc::new(ProxyState::default());
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stop.load(Relaxed) {
                    break;
                }
                let Ok(client) = conn else { continue };
                if st.cut.load(Relaxed) {
                    st.refused.fetch_add(1, Relaxed);
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                {
                    let mut c = st.conns.lock().unwrap();
                    c.push(client.try_clone().unwrap());
                    c.push(server.try_clone().unwrap());
                }
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let count = st.clone();
                std::thread::spawn(move || pump(client, server, Some(count)));
                std::thread::spawn(move || pump(s2, c2, None));
            }
        });
        Proxy { port, state }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Drops every connection and refuses new ones until `restore`.
    pub fn cut(&self) {
        self.state
            .cut
            .store(true, std::sync::atomic::Ordering::Relaxed);
        for c in self.state.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn restore(&self) {
        self.state
            .cut
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes sent from keel towards the endpoint so far.
    pub fn bytes_up(&self) -> u64 {
        self.state
            .bytes_up
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Connections turned away while cut.
    pub fn refused(&self) -> u64 {
        self.state
            .refused
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state
            .stop
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.cut();
        // Wake the accept loop so it sees `stop`.
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}

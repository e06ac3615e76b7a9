//! The control API cannot be starved from inside the sandbox, which shares keel's network
//! namespace: half-sent requests held open (slowloris), from the same address as the probe
//! and from another, leave `/health` answered and the token's holder served. The head
//! deadline is set to an hour here, so what keeps the API up is the bound on connections
//! still sending their head (per peer, oldest closed first), not a timeout racing the test.

use crate::support;

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use keel::config::Config;
use keel::control::{self, MountState};
use support::control::*;

const TOKEN: &str = "st4rve-Token_0123456789";

/// A request head that never ends: the request line and one header, no blank line.
fn half_sent(from: Ipv4Addr, to: SocketAddr) -> TcpStream {
    let SocketAddr::V4(to) = to else {
        panic!("the listener is IPv4")
    };
    let mut s = support::sys::connect_from(from, to).expect("connect");
    s.write_all(b"GET /status HTTP/1.1\r\nHost: keel\r\n")
        .expect("send half a head");
    s
}

#[test]
fn slowloris_leaves_health_and_the_token_holder_served() {
    let text = format!(
        "[init]\nworkspace = false\n[control]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"\nhead_timeout = \"1h\"\n"
    );
    let cfg = Config::parse(&text, Path::new("test.toml")).expect("config");
    let per_peer = cfg.control.max_pending_per_peer;
    let c = control::start(&cfg).expect("start control");
    let addr = c.tcp_addr().expect("tcp address");
    c.status().set_mount(MountState::Mounted);
    c.status().set_services(vec![], None);
    assert_eq!(get(addr, "/health", None).code, 200, "healthy before");

    // 300 from the probe's own address, 100 from another loopback address: more than every
    // bound keel had (256 connections at once, 64 more told "busy").
    let me = Ipv4Addr::LOCALHOST;
    let other = Ipv4Addr::new(127, 0, 0, 2);
    let mine: Vec<TcpStream> = (0..300).map(|_| half_sent(me, addr)).collect();
    let others: Vec<TcpStream> = (0..100).map(|_| half_sent(other, addr)).collect();

    // Accepted in order before these: all 400 are still held by the client side.
    let r = get(addr, "/health", None);
    assert_eq!(
        (r.code, r.body.as_str()),
        (200, "ok\n"),
        "health under slowloris"
    );
    let r = get(addr, "/status", Some(TOKEN));
    assert_eq!(r.code, 200, "the token's holder under slowloris: {r:?}");
    assert!(r.json()["uptime_seconds"].is_number(), "{r:?}");
    assert_eq!(get(addr, "/status", Some("wrong")).code, 401);

    // keel closed the oldest of the peer's half-sent heads to make room (EOF at once), and
    // kept the newest (nothing to read, not closed).
    let closed = |s: &TcpStream| {
        let mut s = s.try_clone().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(n) => n == 0,
            Err(e) => e.kind() == ErrorKind::ConnectionReset,
        }
    };
    let open = |s: &TcpStream| {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 64];
        let r = (&*s).read(&mut b);
        matches!(r, Err(e) if e.kind() == ErrorKind::WouldBlock)
    };
    // Held past twice the bound, a peer's oldest go whatever their age (more may have gone,
    // once a second old); the newest (less the three the requests above pushed out) stay.
    assert!(
        mine[..300 - 2 * per_peer].iter().all(closed),
        "the oldest were not closed"
    );
    assert!(
        mine[300 - (per_peer - 3)..].iter().all(open),
        "the newest were closed"
    );
    assert!(
        others[100 - per_peer..].iter().all(open),
        "the other peer's were closed"
    );
    drop(mine);
    drop(others);
    c.stop();
}

//! A real S3 endpoint for tests: `moto_server` on a free 127.0.0.1 port with a bucket
//! `keel`, killed when the guard drops, and a `[persist]` config that points at it.
//! Without `moto_server` `start_moto` prints a skip line and returns `None`, or panics
//! when `KEEL_REQUIRE_S3` is set (CI sets it).
#![allow(dead_code)]

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
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("moto_server")
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let moto = Moto(child);
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
            t0.elapsed() < Duration::from_secs(30),
            "moto_server did not come up"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn s3_config(port: u16) -> PersistConfig {
    // object_store reads credentials from the environment (from_env).
    std::env::set_var("AWS_ACCESS_KEY_ID", "k");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "s");
    PersistConfig {
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        region: Some("us-east-1".into()),
        allow_http: true,
        ..Default::default()
    }
}

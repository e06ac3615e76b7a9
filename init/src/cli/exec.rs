//! `keel exec [--detach] [--user U] [--timeout T] [-i] -- CMD...`: runs a command in the
//! sandbox through the running keel's control API (`POST /exec`): over the control socket
//! from inside the sandbox (root and keel's user), or over TCP with `--url` and the token
//! from outside. Its stdout and stderr come out on ours, byte for byte, and we exit with its
//! status (128+N for a signal, 127/126 when it cannot run).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use base64::Engine;
use keel::config::Config;
use keel::control::stream_client::{self, Target};

/// Run a command in the sandbox through the running keel (its control API)
#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    /// Start it and print its id (the API's /processes/ID) instead of waiting for it
    #[arg(long, short = 'd')]
    detach: bool,
    /// Run it as this user (name or uid) [default: the main command's user]
    #[arg(long, short = 'u', value_name = "USER")]
    user: Option<String>,
    /// Kill its whole process tree after this long ("30s", "5m"; TERM, then KILL after
    /// [shutdown] grace)
    #[arg(long, value_name = "DURATION")]
    timeout: Option<String>,
    /// Its working directory [default: the workspace]
    #[arg(long, short = 'w', value_name = "DIR")]
    workdir: Option<String>,
    /// KEY=VALUE added to its environment (repeatable)
    #[arg(long, short = 'e', value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Pass our stdin on to it (until end of file)
    #[arg(long, short = 'i')]
    interactive: bool,
    /// The control API over TCP, from outside the sandbox (http://HOST:PORT); the token
    /// from --token or KEEL_CONTROL_TOKEN
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// The bearer token for --url
    #[arg(long, env = "KEEL_CONTROL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The control socket [default: the config's]
    #[arg(long, value_name = "PATH", conflicts_with = "url")]
    socket: Option<PathBuf>,
    /// The command and its arguments
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

/// Where a streaming command (`keel exec`, `keel files`) talks to keel: `--url` (with
/// `--token`), else `--socket`, else the configured control socket.
pub(super) fn target(
    config: Option<&Path>,
    url: Option<&String>,
    token: Option<&String>,
    socket: Option<&PathBuf>,
) -> Result<Target, super::Failed> {
    if let Some(u) = url {
        let Some((hostport, _)) = keel::config::parse_http_url(u) else {
            return Err(super::Failed::usage(format!(
                "--url {u}: use http://HOST:PORT"
            )));
        };
        return Ok(Target::Tcp {
            addr: hostport,
            token: token.cloned(),
        });
    }
    if let Some(s) = socket {
        return Ok(Target::Socket(s.clone()));
    }
    let cfg = Config::resolve(config).map_err(super::Failed::usage)?;
    Ok(Target::Socket(keel::control::default_socket(&cfg)))
}

fn body(a: &ExecArgs) -> Result<Vec<u8>, super::Failed> {
    let mut env = serde_json::Map::new();
    for kv in &a.env {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(super::Failed::usage(format!("--env {kv}: use KEY=VALUE")));
        };
        env.insert(k.into(), v.into());
    }
    let mut v = serde_json::json!({ "argv": a.command, "env": env, "detach": a.detach });
    if let Some(u) = &a.user {
        v["user"] = u.clone().into();
    }
    if let Some(t) = &a.timeout {
        v["timeout"] = t.clone().into();
    }
    if let Some(w) = &a.workdir {
        v["cwd"] = w.clone().into();
    }
    if a.interactive {
        v["stdin"] = "stream".into();
    }
    Ok(serde_json::to_vec(&v).expect("serialises"))
}

/// The API's `error`, else the body.
fn why(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string())
}

pub fn main(config: Option<&Path>, a: ExecArgs) -> i32 {
    super::report("exec", || {
        let t = target(config, a.url.as_ref(), a.token.as_ref(), a.socket.as_ref())?;
        let req = body(&a)?;
        let code = std::cell::Cell::new(0u16);
        let mut seen = Vec::new();
        let mut out = Events::new(t.clone());
        let r = stream_client::request(
            &t,
            "POST",
            "/exec",
            req,
            &mut |c| code.set(c),
            &mut |part| {
                if code.get() != 200 || a.detach {
                    seen.extend_from_slice(part);
                    return true;
                }
                out.feed(part, a.interactive)
            },
        );
        r.map_err(|e| super::Failed::from(e.to_string()))?;
        if code.get() != 200 {
            return Err(format!("keel answered {}: {}", code.get(), why(&seen)).into());
        }
        if a.detach {
            let v: serde_json::Value =
                serde_json::from_slice(&seen).map_err(|e| format!("unexpected answer: {e}"))?;
            println!("{}", v["id"]);
            return Ok(0);
        }
        out.finish()
    })
}

/// The NDJSON events of one run, as they arrive.
struct Events {
    target: Target,
    line: Vec<u8>,
    exit: Option<serde_json::Value>,
    error: Option<String>,
}

impl Events {
    fn new(target: Target) -> Self {
        Events {
            target,
            line: Vec::new(),
            exit: None,
            error: None,
        }
    }

    fn feed(&mut self, part: &[u8], interactive: bool) -> bool {
        for &b in part {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            let line = std::mem::take(&mut self.line);
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&line) else {
                self.error = Some(format!(
                    "unexpected event: {}",
                    String::from_utf8_lossy(&line)
                ));
                return false;
            };
            self.event(&v, interactive);
        }
        true
    }

    fn event(&mut self, v: &serde_json::Value, interactive: bool) {
        let b64 = base64::engine::general_purpose::STANDARD;
        match v["type"].as_str().unwrap_or("") {
            "start" if interactive => {
                if let Some(id) = v["id"].as_u64() {
                    pass_stdin(self.target.clone(), id);
                }
            }
            "stdout" | "stderr" => {
                let data = b64
                    .decode(v["data"].as_str().unwrap_or(""))
                    .unwrap_or_default();
                let _ = if v["type"] == "stdout" {
                    let mut o = std::io::stdout().lock();
                    o.write_all(&data).and_then(|()| o.flush())
                } else {
                    let mut e = std::io::stderr().lock();
                    e.write_all(&data).and_then(|()| e.flush())
                };
            }
            "gap" => eprintln!(
                "keel: exec: {} bytes of its {} were not kept ([exec] output_limit)",
                v["bytes"],
                v["stream"].as_str().unwrap_or("output")
            ),
            "exit" => self.exit = Some(v.clone()),
            "error" => self.error = v["error"].as_str().map(str::to_string),
            _ => {}
        }
    }

    fn finish(self) -> Result<i32, super::Failed> {
        let Some(x) = self.exit else {
            let why = self
                .error
                .unwrap_or_else(|| "the stream ended before the exit".into());
            return Err(why.into());
        };
        if let Some(e) = x["error"].as_str() {
            eprintln!("keel: exec: {e}");
        }
        if x["timed_out"] == true {
            eprintln!("keel: exec: timed out; its process tree was killed");
        }
        if let Some(errs) = x["errors"].as_array() {
            for e in errs {
                eprintln!("keel: exec: {}", e.as_str().unwrap_or_default());
            }
        }
        Ok(x["status"].as_i64().map(|s| s as i32).unwrap_or(1))
    }
}

/// Passes our stdin to process `id` (`POST /processes/{id}/stdin`, then `?close=1`).
fn pass_stdin(target: Target, id: u64) {
    let _ = std::thread::Builder::new()
        .name("keel-exec-stdin".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            let mut stdin = std::io::stdin().lock();
            loop {
                let n = match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let path = format!("/processes/{id}/stdin");
                let r = stream_client::request(
                    &target,
                    "POST",
                    &path,
                    buf[..n].to_vec(),
                    &mut |_| {},
                    &mut |_| true,
                );
                if r.is_err() {
                    return;
                }
            }
            let path = format!("/processes/{id}/stdin?close=1");
            let _ = stream_client::request(
                &target,
                "POST",
                &path,
                Vec::new(),
                &mut |_| {},
                &mut |_| true,
            );
        });
}

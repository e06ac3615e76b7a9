//! `keel files get|put|ls`: files of the sandbox's workspace through the running keel's
//! control API (`/files`), as the sandbox's user or `--user`: over the control socket from
//! inside the sandbox (root and keel's user), or over TCP with `--url` and the token from
//! outside. Also the hidden `keel files-helper`, the process the API runs each operation in
//! (`keel::files::helper`).

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use keel::control::stream_client;

/// Read, write and list workspace files through the running keel (its control API)
#[derive(clap::Args, Debug)]
pub struct FilesArgs {
    #[command(subcommand)]
    command: FilesCommand,
    /// As this user (name or uid) [default: the sandbox's user]
    #[arg(long, short = 'u', value_name = "USER", global = true)]
    user: Option<String>,
    /// The control API over TCP, from outside the sandbox (http://HOST:PORT); the token
    /// from --token or KEEL_CONTROL_TOKEN
    #[arg(long, value_name = "URL", global = true)]
    url: Option<String>,
    /// The bearer token for --url
    #[arg(
        long,
        env = "KEEL_CONTROL_TOKEN",
        hide_env_values = true,
        global = true
    )]
    token: Option<String>,
    /// The control socket [default: the config's]
    #[arg(long, value_name = "PATH", global = true)]
    socket: Option<PathBuf>,
}

#[derive(clap::Subcommand, Debug)]
enum FilesCommand {
    /// Write a workspace file's bytes to stdout (or to --output)
    Get {
        /// The file, relative to the workspace (or absolute inside it)
        path: String,
        /// Write here instead of stdout
        #[arg(long, short = 'o', value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// Replace a workspace file with stdin (or --input), atomically
    Put {
        /// The file, relative to the workspace (or absolute inside it)
        path: String,
        /// Read the content from here instead of stdin
        #[arg(long, short = 'i', value_name = "FILE")]
        input: Option<PathBuf>,
        /// Its mode, in octal (e.g. 0644) [default: the replaced file's, else 0666 less the umask]
        #[arg(long, value_name = "MODE")]
        mode: Option<String>,
        /// Only if its content is still this ETag (else nothing changes; exit 1)
        #[arg(long, value_name = "ETAG")]
        if_match: Option<String>,
    },
    /// List a workspace directory (JSON)
    Ls {
        /// The directory [default: the workspace]
        #[arg(default_value = ".")]
        path: String,
        /// Levels to descend (1: its entries only)
        #[arg(long, default_value_t = 1)]
        depth: u32,
    },
}

/// The process each files API operation runs in (internal).
#[derive(clap::Args, Debug)]
pub struct HelperArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<OsString>,
}

pub fn helper(a: HelperArgs) -> i32 {
    keel::files::helper::main(&a.args)
}

/// Percent-encodes a query value.
fn enc(v: &str) -> String {
    let mut out = String::new();
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn why(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string())
}

pub fn main(config: Option<&Path>, a: FilesArgs) -> i32 {
    super::report("files", || {
        let t = super::exec::target(config, a.url.as_ref(), a.token.as_ref(), a.socket.as_ref())?;
        let user = a
            .user
            .as_ref()
            .map(|u| format!("&user={}", enc(u)))
            .unwrap_or_default();
        let code = std::cell::Cell::new(0u16);
        let mut seen = Vec::new();
        match &a.command {
            FilesCommand::Get { path, output } => {
                let mut sink: Box<dyn Write> = match output {
                    Some(p) => Box::new(
                        std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?,
                    ),
                    None => Box::new(std::io::stdout().lock()),
                };
                let mut werr = None;
                stream_client::request(
                    &t,
                    "GET",
                    &format!("/files?path={}{user}", enc(path)),
                    Vec::new(),
                    &mut |c| code.set(c),
                    &mut |part| {
                        if code.get() != 200 {
                            seen.extend_from_slice(part);
                            return true;
                        }
                        match sink.write_all(part) {
                            Ok(()) => true,
                            Err(e) => {
                                werr = Some(e);
                                false
                            }
                        }
                    },
                )
                .map_err(|e| super::Failed::from(e.to_string()))?;
                if let Some(e) = werr {
                    return Err(format!("write: {e}").into());
                }
                sink.flush().map_err(|e| format!("write: {e}"))?;
            }
            FilesCommand::Put {
                path,
                input,
                mode,
                if_match,
            } => {
                let body = match input {
                    Some(p) => stream_client::body_from(
                        std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?,
                    ),
                    None => stream_client::body_from(std::io::stdin()),
                };
                let mode = mode
                    .as_ref()
                    .map(|m| format!("&mode={}", enc(m)))
                    .unwrap_or_default();
                let headers: Vec<(&str, String)> =
                    if_match.iter().map(|m| ("If-Match", m.clone())).collect();
                stream_client::request_with(
                    &t,
                    "PUT",
                    &format!("/files?path={}{mode}{user}", enc(path)),
                    &headers,
                    body,
                    &mut |c| code.set(c),
                    &mut |part| {
                        seen.extend_from_slice(part);
                        true
                    },
                )
                .map_err(|e| super::Failed::from(e.to_string()))?;
                if code.get() / 100 == 2 {
                    let v: serde_json::Value = serde_json::from_slice(&seen)
                        .map_err(|e| format!("unexpected answer: {e}"))?;
                    println!("{}", v["etag"].as_str().unwrap_or_default());
                }
            }
            FilesCommand::Ls { path, depth } => {
                stream_client::request(
                    &t,
                    "GET",
                    &format!("/files?path={}&list=1&depth={depth}{user}", enc(path)),
                    Vec::new(),
                    &mut |c| code.set(c),
                    &mut |part| {
                        seen.extend_from_slice(part);
                        true
                    },
                )
                .map_err(|e| super::Failed::from(e.to_string()))?;
                if code.get() == 200 {
                    let v: serde_json::Value = serde_json::from_slice(&seen)
                        .map_err(|e| format!("unexpected answer: {e}"))?;
                    super::print_json(&v);
                }
            }
        }
        if code.get() / 100 != 2 {
            return Err(format!("keel answered {}: {}", code.get(), why(&seen)).into());
        }
        Ok(0)
    })
}

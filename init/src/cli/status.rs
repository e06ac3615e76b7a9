//! `keel status [--socket PATH]`: the running keel's `/status` JSON, exactly as sent.

use std::io::Write;
use std::path::{Path, PathBuf};

use keel::config::Config;

/// Print the running keel's status (JSON from its control socket)
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The control socket [default: <state_dir>/control.sock of the config]
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
}

pub fn main(config: Option<&Path>, a: StatusArgs) -> i32 {
    let path = match a.socket {
        Some(p) => p,
        None => match Config::resolve(config) {
            Ok(cfg) => keel::control::default_socket(&cfg),
            Err(e) => {
                eprintln!("keel status: {e}");
                return super::EXIT_USAGE;
            }
        },
    };
    match keel::control::client::status(&path) {
        Ok(body) => {
            let mut out = std::io::stdout().lock();
            match out.write_all(body.as_bytes()).and_then(|()| out.flush()) {
                Ok(()) => 0,
                Err(_) => super::EXIT_FAILED,
            }
        }
        Err(e) => {
            eprintln!("keel status: {e}");
            super::EXIT_FAILED
        }
    }
}

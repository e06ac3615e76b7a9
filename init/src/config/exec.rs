//! The `[exec]` table: limits of the processes started through the control API (`POST
//! /exec`): how many run at once, how many output bytes keel keeps of each stream, how long a
//! record stays after its process ended, and the largest `POST /exec` body.

use super::BadKey;
use serde::Deserialize;
use std::time::Duration;

use super::units::{duration_str, size_str};

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExecConfig {
    /// Processes started through the API that may run at once; more get 429.
    pub max_processes: u32,
    /// Bytes kept of each output stream (stdout, stderr) of one process: the first quarter
    /// and the last three quarters; what is between is dropped and marked as a gap.
    #[serde(with = "size_str")]
    pub output_limit: u64,
    /// How long a record (exit, output) is kept after its process ended.
    #[serde(with = "duration_str")]
    pub retention: Duration,
    /// Largest `POST /exec` body (the JSON request, stdin bytes included).
    #[serde(with = "size_str")]
    pub max_request_body: u64,
}

impl Default for ExecConfig {
    fn default() -> Self {
        ExecConfig {
            max_processes: 64,
            output_limit: 16 << 20,
            retention: Duration::from_secs(600),
            max_request_body: 1 << 20,
        }
    }
}

impl ExecConfig {
    pub fn validate(&self) -> Result<(), BadKey> {
        let bad = |k: &str, why: &str| Err(BadKey::new(format!("exec.{k}"), why.to_string()));
        if self.max_processes == 0 {
            return bad("max_processes", "must be at least 1");
        }
        if self.output_limit < 4096 {
            return bad("output_limit", "must be at least 4096 bytes");
        }
        if self.max_request_body < 1024 {
            return bad("max_request_body", "must be at least 1024 bytes");
        }
        if self.max_request_body > 1 << 30 {
            return bad("max_request_body", "must be at most 1GiB");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use std::path::Path;

    #[test]
    fn defaults_and_bad_values() {
        let c = Config::parse("", Path::new("c.toml")).unwrap();
        assert_eq!(c.exec.max_processes, 64);
        assert_eq!(c.exec.output_limit, 16 << 20);
        assert_eq!(c.exec.retention.as_secs(), 600);
        let c = Config::parse(
            "[exec]\nmax_processes = 3\noutput_limit = \"1MiB\"\nretention = \"1s\"\n",
            Path::new("c.toml"),
        )
        .unwrap();
        assert_eq!((c.exec.max_processes, c.exec.output_limit), (3, 1 << 20));
        for (t, key) in [
            ("[exec]\nmax_processes = 0\n", "exec.max_processes"),
            ("[exec]\noutput_limit = \"100\"\n", "exec.output_limit"),
            (
                "[exec]\nmax_request_body = \"10\"\n",
                "exec.max_request_body",
            ),
            ("[exec]\nlimit = 1\n", "exec.limit"),
        ] {
            let e = Config::parse(t, Path::new("c.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{t:?}: {e}");
        }
    }
}

//! `[[service]]` tables: long-running processes keel starts before the main command, in
//! dependency order, with restart policies, readiness probes and their own stop signal.

use super::BadKey;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use super::init::check_signal;
use super::units::duration_str;

/// A command: an argv array, or a string run with `/bin/sh -c`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Command {
    Argv(Vec<String>),
    Shell(String),
}

impl Command {
    pub fn argv(&self) -> Vec<String> {
        match self {
            Command::Argv(v) => v.clone(),
            Command::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        }
    }
    fn is_empty(&self) -> bool {
        match self {
            Command::Argv(v) => v.is_empty() || v[0].is_empty(),
            Command::Shell(s) => s.trim().is_empty(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Restart {
    Never,
    OnFailure,
    Always,
}

/// How keel decides a service is ready (dependents and the main command wait for it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Ready when this command exits 0 (run as the service's user, every `interval`).
    Command(Command),
    /// Ready when `GET` on this `http://host:port/path` URL answers 2xx.
    Http(String),
    /// Ready when this path exists.
    File(PathBuf),
}

/// `ready = { command = [...] | http = "http://..." | file = "/path", interval, timeout }`;
/// exactly one of command, http, file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Readiness {
    #[serde(default)]
    command: Option<Command>,
    #[serde(default)]
    http: Option<String>,
    #[serde(default)]
    file: Option<PathBuf>,
    /// Time between probes.
    #[serde(default = "default_interval", with = "duration_str")]
    pub interval: Duration,
    /// Give up (and stop everything) if not ready by then.
    #[serde(default = "default_ready_timeout", with = "duration_str")]
    pub timeout: Duration,
}

impl Readiness {
    /// The configured probe; `None` when not exactly one kind was given.
    pub fn probe(&self) -> Option<Probe> {
        match (&self.command, &self.http, &self.file) {
            (Some(c), None, None) => Some(Probe::Command(c.clone())),
            (None, Some(h), None) => Some(Probe::Http(h.clone())),
            (None, None, Some(f)) => Some(Probe::File(f.clone())),
            _ => None,
        }
    }
}

fn default_interval() -> Duration {
    Duration::from_millis(100)
}
fn default_ready_timeout() -> Duration {
    Duration::from_secs(30)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServiceConfig {
    pub name: String,
    pub command: Command,
    /// User name or uid; default: keel's own user.
    pub user: Option<String>,
    /// Group name or gid; default: the user's primary group.
    pub group: Option<String>,
    /// Working directory; default: the directory keel was started in.
    pub workdir: Option<PathBuf>,
    pub env: BTreeMap<String, String>,
    pub restart: Restart,
    /// First restart delay; doubles after each consecutive failure.
    #[serde(with = "duration_str")]
    pub restart_delay: Duration,
    /// Upper bound for the doubling delay.
    #[serde(with = "duration_str")]
    pub restart_max_delay: Duration,
    /// Restarts before giving up (0 = no limit).
    pub max_restarts: u32,
    /// A run longer than this resets the delay and the restart count.
    #[serde(with = "duration_str")]
    pub restart_reset: Duration,
    pub stop_signal: String,
    pub depends_on: Vec<String>,
    pub ready: Option<Readiness>,
    pub no_new_privs: bool,
    /// Secret variables (`AWS_*`, ..., see `[init] secret_env`) this service gets anyway, by
    /// exact name, from keel's environment or its credentials file.
    pub pass_env: Vec<String>,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            command: Command::Argv(Vec::new()),
            user: None,
            group: None,
            workdir: None,
            env: BTreeMap::new(),
            restart: Restart::Never,
            restart_delay: Duration::from_millis(100),
            restart_max_delay: Duration::from_secs(10),
            max_restarts: 0,
            restart_reset: Duration::from_secs(10),
            stop_signal: "SIGTERM".into(),
            depends_on: Vec::new(),
            ready: None,
            no_new_privs: false,
            pass_env: Vec::new(),
        }
    }
}

/// Validates all services together: names, commands, signals, dependencies (no unknown names,
/// no cycles). Keys are named `service[i].key`.
pub fn validate(services: &[ServiceConfig]) -> Result<(), BadKey> {
    let mut names = BTreeMap::new();
    for (i, s) in services.iter().enumerate() {
        let key = |k: &str| format!("service[{i}].{k}");
        if s.name.is_empty()
            || s.name == "main"
            || !s
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(BadKey::new(
                key("name"),
                format!(
                    "`{}` must be non-empty, [A-Za-z0-9._-], and not \"main\"",
                    s.name
                ),
            ));
        }
        if names.insert(s.name.as_str(), i).is_some() {
            return Err(BadKey::new(
                key("name"),
                format!("`{}` is used twice", s.name),
            ));
        }
        if s.command.is_empty() {
            return Err(BadKey::new(key("command"), "is missing or empty".into()));
        }
        check_signal(&key("stop_signal"), &s.stop_signal)?;
        super::init::check_pass_env(&key("pass_env"), &s.pass_env)?;
        if let Some(w) = &s.workdir {
            if !w.is_absolute() {
                return Err(BadKey::new(
                    key("workdir"),
                    format!("`{}` must be an absolute path", w.display()),
                ));
            }
        }
        if let Some(r) = &s.ready {
            match r.probe() {
                None => {
                    return Err(BadKey::new(
                        key("ready"),
                        "needs exactly one of command, http, file".into(),
                    ))
                }
                Some(Probe::Command(c)) if c.is_empty() => {
                    return Err(BadKey::new(key("ready.command"), "is empty".into()))
                }
                Some(Probe::Http(u)) if crate::config::parse_http_url(&u).is_none() => {
                    return Err(BadKey::new(
                        key("ready.http"),
                        format!("`{u}` is not an http://host:port/path URL"),
                    ))
                }
                Some(Probe::File(p)) if !p.is_absolute() => {
                    return Err(BadKey::new(
                        key("ready.file"),
                        format!("`{}` must be an absolute path", p.display()),
                    ))
                }
                _ => {}
            }
        }
        if s.restart_delay > s.restart_max_delay {
            return Err(BadKey::new(
                key("restart_delay"),
                "is longer than restart_max_delay".into(),
            ));
        }
    }
    for (i, s) in services.iter().enumerate() {
        for d in &s.depends_on {
            if !names.contains_key(d.as_str()) {
                return Err(BadKey::new(
                    format!("service[{i}].depends_on"),
                    format!("`{d}` is not a service name"),
                ));
            }
        }
    }
    // Cycle check: repeatedly remove services whose dependencies are all removed.
    order(services).map(|_| ()).map_err(|i| {
        BadKey::new(
            format!("service[{i}].depends_on"),
            format!(
                "service `{}` is part of a dependency cycle",
                services[i].name
            ),
        )
    })
}

/// Services in start order (dependencies first). Err(index) of a service on a cycle.
pub fn order(services: &[ServiceConfig]) -> Result<Vec<usize>, usize> {
    let mut done = vec![false; services.len()];
    let mut out = Vec::with_capacity(services.len());
    while out.len() < services.len() {
        let before = out.len();
        for (i, s) in services.iter().enumerate() {
            if done[i] {
                continue;
            }
            let ready = s.depends_on.iter().all(|d| {
                services
                    .iter()
                    .position(|t| &t.name == d)
                    .is_some_and(|j| done[j])
            });
            if ready {
                done[i] = true;
                out.push(i);
            }
        }
        if out.len() == before {
            return Err(done.iter().position(|d| !d).unwrap_or(0));
        }
    }
    Ok(out)
}

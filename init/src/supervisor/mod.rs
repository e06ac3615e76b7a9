//! The supervisor: one loop on the signalfd that starts services in dependency order (waiting
//! for readiness), forwards signals to the main service, runs the one and only
//! `waitpid(-1, WNOHANG)` reaper, restarts services with backoff, and drives the ordered stop
//! (reverse dependency order, grace deadline, SIGKILL, never returning while descendants run).

mod hold;
mod plan;
mod probe;

pub use hold::MainHold;

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::{debug, error, info, warn};

use crate::boot::Booted;
use crate::config::{init::capability_name, Config, ForwardTo, Probe, Readiness, Restart};
use crate::control::status::{ExitInfo, ServiceState, ServiceStatus, StatusHandle};
use crate::shutdown::{secs, Reason, Stop};
use crate::sys::caps;
use crate::sys::process::{self, Exit, Ids, SpawnSpec};
use crate::sys::signal::{self, Signals};
use plan::Plan;

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("{unit}: {source}")]
    User {
        unit: String,
        source: process::ProcessError,
    },
    #[error("{unit}: workdir {path} is not a directory")]
    Workdir { unit: String, path: PathBuf },
    #[error(
        "nothing to run: give a command (keel run -- CMD ...) or configure [[service]] tables"
    )]
    NothingToRun,
    #[error(transparent)]
    Signal(#[from] signal::SignalError),
}

#[derive(Debug)]
struct ProbeState {
    readiness: Readiness,
    probe: Probe,
    next_at: Instant,
    deadline: Instant,
    pid: Option<i32>,
    spec: SpawnSpec,
}

#[derive(Debug)]
struct Unit {
    name: String,
    spec: SpawnSpec,
    is_main: bool,
    /// Indices of units this one waits for (main waits for every service).
    deps: Vec<usize>,
    restart: Restart,
    restart_delay: Duration,
    restart_max_delay: Duration,
    restart_reset: Duration,
    max_restarts: u32,
    stop_signal: i32,
    readiness: Option<Readiness>,

    pid: Option<i32>,
    pgid: Option<i32>,
    started_once: bool,
    started_at: Instant,
    ready: bool,
    probe: Option<ProbeState>,
    restarts: u32,
    delay: Duration,
    next_start: Option<Instant>,
    /// Ended and will not run again.
    finished: bool,
    /// The stop signal went to the whole group.
    stop_sent: bool,
    /// A forwarded stop signal went to the process only (`forward_to = "process"`).
    process_signalled: bool,
    /// For the control API: how it last ended, and restarts since keel started.
    last_exit: Option<Exit>,
    restarts_total: u64,
}

impl Unit {
    /// A unit that has not run yet and never restarts (`Plan::service_unit` sets how a
    /// service restarts).
    fn idle(name: String, spec: SpawnSpec, is_main: bool, stop_signal: i32, now: Instant) -> Self {
        Unit {
            name,
            spec,
            is_main,
            deps: Vec::new(),
            restart: Restart::Never,
            restart_delay: Duration::ZERO,
            restart_max_delay: Duration::ZERO,
            restart_reset: Duration::ZERO,
            max_restarts: 0,
            stop_signal,
            readiness: None,
            pid: None,
            pgid: None,
            started_once: false,
            started_at: now,
            ready: false,
            probe: None,
            restarts: 0,
            delay: Duration::ZERO,
            next_start: None,
            finished: false,
            stop_sent: false,
            process_signalled: false,
            last_exit: None,
            restarts_total: 0,
        }
    }

    fn label(&self) -> String {
        if self.is_main {
            "main command".to_string()
        } else {
            format!("service {}", self.name)
        }
    }
}

/// Runs everything until the stop completes; returns keel's exit code.
#[derive(Debug)]
pub struct Supervisor {
    units: Vec<Unit>,
    /// Start order: services by dependencies, then main.
    order: Vec<usize>,
    main: Option<usize>,
    signals: Signals,
    forward_to: ForwardTo,
    stop_on: Vec<i32>,
    main_stop_signal: i32,
    grace: Duration,
    pid1: bool,
    stop: Option<Stop>,
    stop_signals_seen: u32,
    code: Option<i32>,
    /// Where unit states are published for the control API.
    status: Option<StatusHandle>,
    /// The mount namespace children join; closed when the supervisor ends (before the
    /// workspace is unmounted, so no copy of the mount outlives the stop).
    sandbox_ns: Option<crate::sys::ns::SandboxNs>,
    /// `keel rollback --restart` stops and starts the main command through it (`hold`).
    hold: std::sync::Arc<MainHold>,
    /// Processes started through the API: the reaper hands their exits over, the stop
    /// stops them with the main command.
    exec: Option<std::sync::Arc<crate::exec::Processes>>,
    /// What they start from, handed to `exec` when the loop starts.
    exec_template: Option<crate::exec::Template>,
}

fn base_env(cfg: &Config) -> Vec<(OsString, OsString)> {
    let mut env = keel_env(cfg);
    for (k, v) in &cfg.init.env {
        set_env(&mut env, k, v);
    }
    env
}

/// keel's own environment minus what only keel may see: the remote's credentials (`AWS_*`,
/// `GOOGLE_*`, `AZURE_*`), the control API token and `[init] secret_env`.
fn keel_env(cfg: &Config) -> Vec<(OsString, OsString)> {
    scrub(std::env::vars_os(), cfg)
}

fn scrub(
    vars: impl Iterator<Item = (OsString, OsString)>,
    cfg: &Config,
) -> Vec<(OsString, OsString)> {
    vars.filter(|(k, _)| !k.to_str().is_some_and(|k| cfg.init.is_secret_var(k)))
        .collect()
}

/// Adds the secret variables a unit's config passes by name: the value keel uses (its
/// credentials file first, then its environment); a name set nowhere is left out.
fn pass_env(env: &mut Vec<(OsString, OsString)>, names: &[String]) {
    for k in names {
        let v = crate::config::credentials::value(k).map(OsString::from);
        if let Some(v) = v {
            env.retain(|(ek, _)| ek != k.as_str());
            env.push((k.into(), v));
        }
    }
}

fn set_env(env: &mut Vec<(OsString, OsString)>, k: &str, v: &str) {
    env.retain(|(ek, _)| ek != k);
    env.push((k.into(), v.into()));
}

fn user_env(
    env: &mut Vec<(OsString, OsString)>,
    ids: &Ids,
    explicit: &std::collections::BTreeMap<String, String>,
) {
    for (k, v) in [("USER", ids.name.clone()), ("LOGNAME", ids.name.clone())]
        .into_iter()
        .chain(ids.home.as_ref().map(|h| ("HOME", h.display().to_string())))
    {
        if !explicit.contains_key(k) {
            set_env(env, k, &v);
        }
    }
}

impl Supervisor {
    /// Resolves users, environments and dependency order. Nothing is started yet.
    pub fn new(
        cfg: &Config,
        main_argv: Vec<OsString>,
        booted: &Booted,
        signals: Signals,
    ) -> Result<Self, SupervisorError> {
        if main_argv.is_empty() && cfg.service.is_empty() {
            return Err(SupervisorError::NothingToRun);
        }
        let mut plan = Plan::new(cfg, booted);
        plan.add_services()?;
        plan.add_main(main_argv)?;
        let exec = plan.exec_template()?;
        Ok(plan.into_supervisor(signals, Some(exec)))
    }

    /// Hands the exits of processes started through the API to `p`, opens it once the loop
    /// runs, and stops them with the main command.
    pub fn set_exec(&mut self, p: std::sync::Arc<crate::exec::Processes>) {
        self.exec = Some(p);
    }

    /// Lets processes start through the API (once; `run` does it if nobody did). `keel run`
    /// calls it before it says it is ready, so a caller that waited for that is never told
    /// 503 "keel is starting".
    pub fn open_exec(&mut self) {
        if let (Some(p), Some(mut t)) = (&self.exec, self.exec_template.take()) {
            if let Some(ns) = &self.sandbox_ns {
                match ns.try_clone() {
                    Ok(ns) => {
                        t.spec.mnt_ns = Some(ns.fd());
                        t.ns = Some(std::sync::Arc::new(ns));
                    }
                    Err(e) => error!("exec: keep the sandbox namespace: {e}"),
                }
            }
            // Without the sandbox's namespace nothing may start through the API.
            if self.sandbox_ns.is_none() || t.ns.is_some() {
                p.open(t);
                info!("exec: processes may start through the API");
            }
        }
    }

    /// The loop. Returns keel's exit code once the stop is complete and no descendant is left.
    pub fn run(mut self) -> i32 {
        self.open_exec();
        loop {
            let reaped = process::reap_all();
            for e in reaped.exited {
                self.on_exit(e);
            }
            if self.stop.is_none() {
                self.advance_start();
                self.restart_due();
                self.advance_hold();
            }
            if self.stop.is_some() {
                // Reap again so "nothing left" reflects everything that ended so far.
                let reaped = process::reap_all();
                for e in reaped.exited {
                    self.on_exit(e);
                }
                if self.advance_stop(reaped.none_left) {
                    break;
                }
            }
            self.publish();
            let timeout = self
                .next_deadline()
                .map(|d| d.saturating_duration_since(Instant::now()));
            if let Err(e) = self.signals.wait(timeout) {
                error!("{e}");
            }
            match self.signals.drain() {
                Ok(sigs) => {
                    for (sig, from) in sigs {
                        self.on_signal(sig, from);
                    }
                }
                Err(e) => error!("{e}"),
            }
        }
        self.publish();
        let stop = self.stop.as_ref().expect("stopped");
        info!("all processes ended after {}", stop.elapsed());
        match (self.code, &stop.reason, self.main) {
            (Some(c), _, _) => c,
            // A stop signal before the main command could start: report it like a kill.
            (None, Reason::Signal(s), Some(_)) => 128 + s,
            _ => 0,
        }
    }

    /// Starts every unit (and its probes) in this mount namespace.
    pub fn set_sandbox_ns(&mut self, ns: crate::sys::ns::SandboxNs) {
        for u in &mut self.units {
            u.spec.mnt_ns = Some(ns.fd());
        }
        self.sandbox_ns = Some(ns);
    }

    /// Publishes every unit's state to the control API from now on.
    pub fn set_status(&mut self, status: StatusHandle) {
        self.status = Some(status);
        self.publish();
    }

    fn publish(&self) {
        let Some(status) = &self.status else { return };
        let stopping = self.stop.is_some();
        let units = self
            .units
            .iter()
            .map(|u| ServiceStatus {
                name: u.name.clone(),
                main: u.is_main,
                pid: u.pid,
                state: unit_state(u, stopping),
                probed: u.readiness.as_ref().is_some_and(|r| r.probe().is_some()),
                restarts: u.restarts_total,
                last_exit: u.last_exit.map(|e| match e {
                    Exit::Code(c) => ExitInfo::Code(c),
                    Exit::Signal(s) => ExitInfo::Signal(s),
                }),
            })
            .collect();
        status.set_services(units, self.stop.as_ref().map(|s| s.reason.to_string()));
    }

    fn on_signal(&mut self, sig: i32, from: i32) {
        if sig == libc::SIGCHLD {
            return;
        }
        if self.stop_on.contains(&sig) {
            self.stop_signals_seen += 1;
            if self.stop_signals_seen >= 2 {
                if let Some(stop) = &self.stop {
                    if !stop.killed {
                        info!(
                            "second stop signal ({}) after {}: killing everything now",
                            signal::name(sig),
                            stop.elapsed()
                        );
                        self.kill_everything();
                    }
                    return;
                }
            }
            if self.stop.is_none() {
                self.begin_stop(Reason::Signal(sig));
                return;
            }
        }
        debug!("forwarding {} (from pid {from})", signal::name(sig));
        self.forward(sig);
    }

    /// Sends `sig` to the main service (its group, or only its process). Returns whether it
    /// reached the whole group.
    fn forward(&mut self, sig: i32) -> bool {
        let Some(m) = self.main else { return false };
        let u = &mut self.units[m];
        let (Some(pid), Some(pgid)) = (u.pid, u.pgid) else {
            if let Some(pgid) = u.pgid {
                let _ = signal::send_group(pgid, sig);
                return true;
            }
            return false;
        };
        match self.forward_to {
            ForwardTo::Group => {
                if let Err(e) = signal::send_group(pgid, sig) {
                    warn!("forward {} to group {pgid}: {e}", signal::name(sig));
                }
                true
            }
            ForwardTo::Process => {
                if let Err(e) = signal::send(pid, sig) {
                    warn!("forward {} to pid {pid}: {e}", signal::name(sig));
                }
                false
            }
        }
    }

    fn begin_stop(&mut self, reason: Reason) {
        let sig = match &reason {
            Reason::Signal(s) => Some(*s),
            _ => None,
        };
        self.stop = Some(Stop::begin(reason, self.grace));
        self.hold.set(hold::HoldState::Closed);
        if let Some(p) = &self.exec {
            // Like the main command: TERM to each one's tree, KILL after the grace.
            p.close("keel is stopping");
        }
        for u in &mut self.units {
            u.next_start = None;
            u.finished = true;
            if let Some(p) = u.probe.as_mut().and_then(|p| p.pid) {
                let _ = signal::send_group(p, libc::SIGKILL);
            }
        }
        if let (Some(sig), Some(m)) = (sig, self.main) {
            if self.units[m].pid.is_some() {
                let whole_group = self.forward(sig);
                let elapsed = self.stop.as_ref().map(|s| s.elapsed()).unwrap_or_default();
                let u = &mut self.units[m];
                info!(
                    "stop: forwarded {} to main command (pid {}) after {elapsed}",
                    signal::name(sig),
                    u.pid.unwrap_or(0)
                );
                if whole_group {
                    u.stop_sent = true;
                } else {
                    u.process_signalled = true;
                }
            }
        }
    }

    /// True while the unit's process or anything in its group runs.
    fn active(&mut self, i: usize) -> bool {
        let u = &mut self.units[i];
        if u.pid.is_some() {
            return true;
        }
        if let Some(g) = u.pgid {
            if signal::group_alive(g) {
                return true;
            }
            u.pgid = None;
        }
        false
    }

    /// One step of the ordered stop. Returns true when it is complete.
    fn advance_stop(&mut self, none_left: bool) -> bool {
        let now = Instant::now();
        let rev: Vec<usize> = self.order.iter().rev().copied().collect();
        let mut any_active = false;
        for &i in &rev {
            if !self.active(i) {
                continue;
            }
            any_active = true;
            let u = &self.units[i];
            if u.stop_sent || (u.process_signalled && u.pid.is_some()) {
                continue;
            }
            // A dependent is down once its own process has ended; stragglers left in its
            // group were signalled with it and must not hold up the rest of the stop.
            let dependents_down = self
                .units
                .iter()
                .filter(|v| v.deps.contains(&i))
                .all(|v| v.pid.is_none());
            if !dependents_down {
                continue;
            }
            let u = &mut self.units[i];
            u.stop_sent = true;
            let sig = u.stop_signal;
            if let Some(g) = u.pgid {
                let _ = signal::send_group(g, sig);
            }
            let elapsed = self.stop.as_ref().map(|s| s.elapsed()).unwrap_or_default();
            info!(
                "stop: sent {} to {} (group {}) after {elapsed}",
                signal::name(sig),
                u.label(),
                u.pgid.unwrap_or(0)
            );
        }
        if none_left {
            return true;
        }
        let stop = self.stop.as_mut().expect("stopping");
        if !any_active && !stop.leftovers_signalled && !stop.killed {
            stop.leftovers_signalled = true;
            let n = signal_descendants(self.pid1, self.main_stop_signal);
            info!(
                "stop: sent {} to {n} leftover processes after {}",
                signal::name(self.main_stop_signal),
                stop.elapsed()
            );
        }
        let stop = self.stop.as_ref().expect("stopping");
        if stop.grace_expired(now) && !stop.killed {
            info!("stop: grace {} expired", secs(self.grace));
            self.kill_everything();
        } else if stop.killed {
            // A process forked just before the SIGKILL: get it too.
            signal_descendants(self.pid1, libc::SIGKILL);
        }
        false
    }

    fn kill_everything(&mut self) {
        if let Some(p) = &self.exec {
            p.kill_all();
        }
        for u in &self.units {
            if let Some(g) = u.pgid {
                let _ = signal::send_group(g, libc::SIGKILL);
            }
        }
        let n = signal_descendants(self.pid1, libc::SIGKILL);
        if let Some(stop) = self.stop.as_mut() {
            stop.killed = true;
            info!(
                "stop: sent SIGKILL to {n} processes after {}",
                stop.elapsed()
            );
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        if let Some(stop) = &self.stop {
            return Some(if stop.killed {
                Instant::now() + Duration::from_millis(100)
            } else {
                stop.grace_deadline
            });
        }
        let mut next: Option<Instant> = None;
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        if let Some(t) = self.hold_deadline() {
            consider(t);
        }
        for u in &self.units {
            if let Some(t) = u.next_start {
                consider(t);
            }
            if let Some(p) = &u.probe {
                if !u.ready && u.started_once {
                    consider(p.deadline);
                    if p.pid.is_none() {
                        consider(p.next_at);
                    }
                }
            }
        }
        next
    }

    fn on_exit(&mut self, ended: process::Ended) {
        let (pid, exit) = (ended.pid, ended.exit);
        let now = Instant::now();
        // A command probe?
        if let Some(i) = self
            .units
            .iter()
            .position(|u| u.probe.as_ref().is_some_and(|p| p.pid == Some(pid)))
        {
            let u = &mut self.units[i];
            let p = u.probe.as_mut().expect("probe");
            p.pid = None;
            p.next_at = now + p.readiness.interval;
            if exit.success() && u.pid.is_some() && !u.ready {
                u.ready = true;
                info!("{} ready after {}", u.label(), secs(u.started_at.elapsed()));
            }
            return;
        }
        let Some(i) = self.units.iter().position(|u| u.pid == Some(pid)) else {
            if self.exec.as_ref().is_some_and(|p| p.reaped(ended)) {
                return;
            }
            debug!("reaped pid {pid} ({exit})");
            return;
        };
        let stopping = self.stop.is_some();
        let u = &mut self.units[i];
        u.pid = None;
        u.last_exit = Some(exit);
        let ran = u.started_at.elapsed();
        if u.is_main && !stopping && self.hold.holding() {
            info!("main command (pid {pid}) ended for rollback --restart: {exit}");
            return;
        }
        if u.is_main {
            info!("main command (pid {pid}) ended: {exit} after {}", secs(ran));
            self.code = Some(exit.code());
            if !stopping {
                self.begin_stop(Reason::MainExited(exit));
            }
            return;
        }
        if stopping {
            info!("service {} (pid {pid}) ended: {exit}", u.name);
            return;
        }
        if ran >= u.restart_reset {
            u.restarts = 0;
            u.delay = u.restart_delay;
        }
        let wanted = match u.restart {
            Restart::Never => false,
            Restart::OnFailure => !exit.success(),
            Restart::Always => true,
        };
        if wanted && (u.max_restarts == 0 || u.restarts < u.max_restarts) {
            u.restarts += 1;
            u.restarts_total += 1;
            u.next_start = Some(now + u.delay);
            let limit = if u.max_restarts == 0 {
                "no limit".to_string()
            } else {
                format!("of {}", u.max_restarts)
            };
            info!(
                "service {} (pid {pid}) ended: {exit}; restart {} {limit} in {}",
                u.name,
                u.restarts,
                secs(u.delay)
            );
            u.delay = (u.delay * 2).min(u.restart_max_delay);
            return;
        }
        if wanted {
            warn!(
                "service {} (pid {pid}) ended: {exit}; gave up after {} restarts",
                u.name, u.restarts
            );
        } else {
            info!("service {} (pid {pid}) ended: {exit}", u.name);
        }
        u.finished = true;
        if !u.ready {
            let msg = format!("service {} ended before it was ready ({exit})", u.name);
            error!("{msg}");
            self.code.get_or_insert(1);
            self.begin_stop(Reason::StartFailed(msg));
            return;
        }
        if self.main.is_none() && self.units.iter().all(|u| u.finished && u.pid.is_none()) {
            self.begin_stop(Reason::ServicesEnded);
        }
    }

    fn start(&mut self, i: usize) -> Result<(), (i32, String)> {
        let u = &mut self.units[i];
        match process::spawn(&u.spec) {
            Ok(pid) => {
                let now = Instant::now();
                u.pid = Some(pid);
                u.pgid = Some(pid);
                u.started_at = now;
                u.stop_sent = false;
                if !u.started_once {
                    u.started_once = true;
                    u.probe = u.readiness.as_ref().and_then(|r| {
                        r.probe().map(|probe| {
                            let mut spec = u.spec.clone();
                            if let Probe::Command(c) = &probe {
                                spec.argv = c.argv().into_iter().map(OsString::from).collect();
                            }
                            ProbeState {
                                readiness: r.clone(),
                                probe,
                                next_at: now,
                                deadline: now + r.timeout,
                                pid: None,
                                spec,
                            }
                        })
                    });
                    u.ready = u.probe.is_none();
                }
                info!(
                    "started {} (pid {pid}): {}",
                    u.label(),
                    show_argv(&u.spec.argv)
                );
                Ok(())
            }
            Err(e) => {
                let code = match e.raw_os_error() {
                    Some(libc::ENOENT) => 127,
                    Some(libc::EACCES) | Some(libc::ENOEXEC) | Some(libc::EISDIR) => 126,
                    _ => 1,
                };
                Err((
                    code,
                    format!(
                        "{}: cannot run {}: {e}",
                        u.label(),
                        show_argv(&u.spec.argv[..1])
                    ),
                ))
            }
        }
    }

    /// Starts what can start and runs due probes, until nothing changes.
    fn advance_start(&mut self) {
        loop {
            let progress = |s: &Self| {
                s.units
                    .iter()
                    .map(|u| u.ready as usize + u.started_once as usize)
                    .sum::<usize>()
            };
            let ready_before = progress(self);
            self.advance_start_once();
            let ready_after = progress(self);
            if self.stop.is_some() || ready_after == ready_before {
                return;
            }
        }
    }

    fn advance_start_once(&mut self) {
        let now = Instant::now();
        for k in 0..self.order.len() {
            let i = self.order[k];
            if self.units[i].started_once {
                continue;
            }
            if !self.units[i].deps.iter().all(|&d| self.units[d].ready) {
                continue;
            }
            if let Err((code, msg)) = self.start(i) {
                error!("{msg}");
                self.code = Some(code);
                self.begin_stop(Reason::StartFailed(msg));
                return;
            }
        }
        for i in 0..self.units.len() {
            let u = &mut self.units[i];
            if u.ready || !u.started_once {
                continue;
            }
            let label = u.label();
            let running = u.pid.is_some();
            let Some(p) = u.probe.as_mut() else { continue };
            // Checked even while the service waits for a restart: a service that keeps
            // crashing must not hold up the start forever.
            if now >= p.deadline {
                let msg = format!("{label} not ready after {}", secs(p.readiness.timeout));
                error!("{msg}");
                self.code.get_or_insert(1);
                self.begin_stop(Reason::StartFailed(msg));
                return;
            }
            if !running || p.pid.is_some() || now < p.next_at {
                continue;
            }
            p.next_at = now + p.readiness.interval;
            let ok = match &p.probe {
                Probe::File(path) => probe::file(path),
                Probe::Http(url) => probe::http(url),
                Probe::Command(_) => {
                    match process::spawn(&p.spec) {
                        Ok(pid) => p.pid = Some(pid),
                        Err(e) => warn!("{}: readiness command: {e}", u.name),
                    }
                    false
                }
            };
            if ok {
                u.ready = true;
                info!("{} ready after {}", u.label(), secs(u.started_at.elapsed()));
            }
        }
    }

    fn restart_due(&mut self) {
        let now = Instant::now();
        for i in 0..self.units.len() {
            if self.units[i].next_start.is_some_and(|t| t <= now) {
                self.units[i].next_start = None;
                if let Err((_, msg)) = self.start(i) {
                    error!("{msg}");
                    self.units[i].finished = true;
                }
            }
        }
    }
}

/// A unit's state as the control API reports it.
fn unit_state(u: &Unit, stopping: bool) -> ServiceState {
    match u.pid {
        Some(_) if stopping && (u.stop_sent || u.process_signalled) => ServiceState::Stopping,
        Some(_) if !u.ready => ServiceState::Starting,
        Some(_) if u.probe.is_some() => ServiceState::Ready,
        Some(_) => ServiceState::Running,
        None if stopping => ServiceState::Stopped,
        None if u.next_start.is_some() => ServiceState::Restarting,
        None if !u.started_once => ServiceState::Starting,
        None => ServiceState::Exited,
    }
}

/// Capability numbers to drop in children: the configured ones still in keel's bounding set.
/// Without CAP_SETPCAP keel cannot shrink a bounding set; it says so once and drops nothing.
fn caps_to_drop(names: &[String]) -> Vec<u32> {
    let wanted: Vec<u32> = names
        .iter()
        .filter_map(|c| capability_name(c).and_then(|n| caps::number(&n)))
        .filter(|&n| caps::in_bounding_set(n))
        .collect();
    if !wanted.is_empty() && !caps::can_drop_bounding() {
        warn!(
            "cannot drop {} from services' bounding set: keel lacks CAP_SETPCAP",
            names.join(", ")
        );
        return Vec::new();
    }
    wanted
}

/// Sends `sig` to every descendant of keel; returns how many were signalled.
fn signal_descendants(pid1: bool, sig: i32) -> usize {
    let pids = process::descendants(std::process::id() as i32);
    if pid1 {
        let _ = signal::send_all(sig);
    } else {
        for &p in &pids {
            let _ = signal::send(p, sig);
        }
    }
    pids.len()
}

fn show_argv(argv: &[OsString]) -> String {
    argv.iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

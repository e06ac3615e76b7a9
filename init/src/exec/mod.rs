//! Processes started through the control API (`POST /exec`): each is a record with an id,
//! started with exactly what the main command gets (the `Template` the supervisor hands over:
//! the sandbox's mount namespace, user, dropped capabilities, scrubbed environment; rlimits
//! and umask are keel's, inherited) through the one launch path, `sys::process::spawn_io`.
//! Each runs in its own session and process group and, where cgroup v2 can be written, its
//! own cgroup, so a kill reaches everything it started. Its stdout and stderr go to bounded
//! files in keel's private state dir (`output`), read by any number of clients from any
//! offset; a thread per process (`pump`) drains them, keeps its timeout and carries out
//! kills; the supervisor's reaper (the one `waitpid(-1)`) hands its exit over (`reaped`).
//! The workspace options (`around`) take a snapshot before the spawn and diff, roll back or
//! checkpoint after it. Records stay `[exec] retention` after their process ended.
//!
//! Locks: the table's, then a record's; never the other way round. The table's lock is held
//! across a fork, so the reaper can never see an exit before its record knows the pid.

pub mod around;
pub mod output;
pub mod record;
pub mod request;
pub mod stream;

mod pump;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use tracing::{info, warn};

use crate::config::ExecConfig;
use crate::persist::CheckpointHandle;
use crate::sys::cgroup;
use crate::sys::eventfd::EventFd;
use crate::sys::ns::SandboxNs;
use crate::sys::process::{self, Exit, Session, SpawnSpec, Stdio, Usage};
pub use record::{Phase, ProcessId, Record};
pub use request::{ExecPlan, RequestError, Stdin};

/// Why a process operation failed; the API's status code follows the variant.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("keel is starting: processes can be started once the workspace is mounted and the supervisor runs")]
    NotReady,
    #[error("keel is stopping: no new processes")]
    Stopping,
    #[error("{0} processes run already ([exec] max_processes)")]
    TooMany(u32),
    #[error("no process {0}")]
    NoSuchProcess(ProcessId),
    #[error("user: {0}")]
    User(#[source] process::ProcessError),
    #[error("diff, snapshot, rollback_on and checkpoint need the checkpoint service (a mounted workspace with [persist] remote)")]
    NoCheckpoints,
    #[error("before the command: {0}")]
    Before(#[source] Box<crate::persist::service::ServiceError>),
    #[error("{}: {source}", path.display())]
    Output {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("open a terminal: {0}")]
    Pty(#[source] std::io::Error),
    #[error(
        "process {0} has no stdin stream (start it with \"stdin\": \"stream\"), or it was closed"
    )]
    NoStdin(ProcessId),
    #[error("process {0} has no terminal (start it with \"pty\")")]
    NoTerminal(ProcessId),
    #[error("write to the stdin of process {id}: {source}")]
    Write {
        id: ProcessId,
        source: std::io::Error,
    },
    #[error("resize the terminal: {0}")]
    Resize(#[source] std::io::Error),
}

/// What every process started through the API starts from: the main command's spec (its
/// environment, user, capabilities, namespace) without its command line.
#[derive(Debug, Clone)]
pub struct Template {
    pub spec: SpawnSpec,
    /// The name of the user `spec` runs as (keel's own when `spec.ids` is `None`).
    pub user: String,
    /// Where a process runs unless it asks for a `cwd`: the workspace once it is a
    /// directory (`open`), else the main command's directory.
    pub cwd: PathBuf,
    pub workspace: Option<PathBuf>,
    /// Between the TERM and the KILL of a timeout or a DELETE (`[shutdown] grace`).
    pub grace: Duration,
    /// Keeps the namespace `spec.mnt_ns` names open as long as the template lives.
    pub ns: Option<Arc<SandboxNs>>,
}

/// A helper's launch (`Processes::helper_spec`).
#[derive(Debug)]
pub struct Helper {
    pub spec: SpawnSpec,
    pub workspace: Option<PathBuf>,
    /// Keeps `spec.mnt_ns` open until the helper has been spawned.
    pub ns: Option<Arc<SandboxNs>>,
}

/// A request's outcome: a new process, or the one a retried `request_id` started.
#[derive(Debug)]
pub enum Started {
    New(Arc<Record>),
    Attached(Arc<Record>),
}

impl Started {
    pub fn record(&self) -> &Arc<Record> {
        match self {
            Started::New(r) | Started::Attached(r) => r,
        }
    }
}

#[derive(Debug, Default)]
struct Table {
    template: Option<Template>,
    /// Why no process may start any more (keel stops).
    closed: Option<String>,
    records: BTreeMap<ProcessId, Arc<Record>>,
    /// Records not done yet (admission compares it with `max_processes`).
    running: usize,
    /// Done records, oldest first, with when they were done: what `prune` looks at, so a
    /// start costs the same with 10 or 10,000 records kept.
    finished: VecDeque<(Instant, ProcessId)>,
    by_pid: HashMap<i32, Arc<Record>>,
    by_request: HashMap<String, ProcessId>,
    next: u64,
}

/// Every process started through the API. Shared (an `Arc`) by the control API, which
/// starts and reads them, and the supervisor, which hands over their exits and stops them.
#[derive(Debug)]
pub struct Processes {
    cfg: ExecConfig,
    /// The files API's limits (its helpers start from this table's template).
    files: crate::config::FilesConfig,
    /// Output files: `<state_dir>/exec/`.
    dir: PathBuf,
    cgroups: Option<cgroup::Root>,
    table: Mutex<Table>,
    /// The mounted FUSE workspace, for `diff=true`'s change tracker.
    workspace: Mutex<Option<crate::workspace::MountedHandle>>,
}

impl Processes {
    /// The table for `keel run`: output files in `<state_dir>/exec` (emptied of a previous
    /// run's), cgroups below keel's own where cgroup v2 can be written (else it says that a
    /// process that leaves its session and group cannot be reached).
    pub fn new(cfg: &crate::config::Config) -> Arc<Processes> {
        let dir = cfg.workspace.state_dir.join(crate::state::EXEC);
        if dir.exists() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let cgroups = match cgroup::Root::find() {
            Ok(r) => Some(r),
            Err(e) => {
                info!(
                    "exec: no cgroup for processes started through the API ({e}): a kill \
                     reaches their session, group and descendants, not a double-forked \
                     process that left them"
                );
                None
            }
        };
        Arc::new(Processes {
            cfg: cfg.exec.clone(),
            files: cfg.files.clone(),
            dir,
            cgroups,
            table: Mutex::new(Table {
                next: 1,
                ..Default::default()
            }),
            workspace: Mutex::new(None),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The FUSE workspace once mounted (`diff=true` tracks its changes).
    pub fn set_workspace(&self, w: Option<crate::workspace::MountedHandle>) {
        *self.workspace.lock().unwrap_or_else(|p| p.into_inner()) = w;
    }

    pub fn config(&self) -> &ExecConfig {
        &self.cfg
    }

    pub fn files_config(&self) -> &crate::config::FilesConfig {
        &self.files
    }

    /// Whether processes get their own cgroup.
    pub fn has_cgroups(&self) -> bool {
        self.cgroups.is_some()
    }

    /// From now on processes may start, from `t` (the supervisor, once everything before
    /// the main command runs).
    pub fn open(&self, mut t: Template) {
        if let Some(ws) = t.workspace.as_ref().filter(|w| w.is_dir()) {
            t.cwd = ws.clone();
        }
        self.lock().template = Some(t);
    }

    /// No new process from now on; every running one gets TERM, then KILL after the grace
    /// (keel's stop).
    pub fn close(&self, why: &str) {
        let running: Vec<Arc<Record>> = {
            let mut t = self.lock();
            t.closed = Some(why.to_string());
            // Its reference to the sandbox's mount namespace goes now: a namespace kept
            // open would keep a copy of the workspace mount past the unmount.
            t.template = None;
            t.records.values().cloned().collect()
        };
        for r in running.iter().filter(|r| r.phase() != Phase::Done) {
            r.update(|s| {
                s.kill_asked = true;
                s.killed = true;
            });
            r.wake();
        }
    }

    fn closed(&self) -> bool {
        self.lock().closed.is_some()
    }

    /// SIGKILL to every process of every record (keel's grace is over).
    pub fn kill_all(&self) {
        let all: Vec<Arc<Record>> = self.lock().records.values().cloned().collect();
        for r in all {
            kill_tree(&r);
        }
    }

    /// The reaper collected `e`: true when it was a process started through the API.
    pub fn reaped(&self, e: process::Ended) -> bool {
        let Some(r) = self.lock().by_pid.remove(&e.pid) else {
            return false;
        };
        r.update(|s| {
            s.exit = Some((e.exit, e.usage));
            s.ended = Some(Instant::now());
        });
        r.wake();
        true
    }

    pub fn get(&self, id: ProcessId) -> Result<Arc<Record>, ExecError> {
        let mut t = self.lock();
        self.prune(&mut t);
        t.records
            .get(&id)
            .cloned()
            .ok_or(ExecError::NoSuchProcess(id))
    }

    /// Every record, oldest first.
    pub fn list(&self) -> Vec<Arc<Record>> {
        let mut t = self.lock();
        self.prune(&mut t);
        t.records.values().cloned().collect()
    }

    /// Forgets records whose process ended more than `retention` ago and left nothing
    /// running, with their output files and cgroup (one whose leftovers still run is looked
    /// at again a retention later).
    fn prune(&self, t: &mut Table) {
        let now = Instant::now();
        let mut again = Vec::new();
        while let Some(&(done, id)) = t.finished.front() {
            if now.saturating_duration_since(done) < self.cfg.retention {
                break;
            }
            t.finished.pop_front();
            let Some(r) = t.records.get(&id) else {
                continue;
            };
            if tree_alive(r) {
                again.push((now, id));
                continue;
            }
            if let Some(r) = t.records.remove(&id) {
                forget_files(&r);
                if let Some(q) = &r.request_id {
                    t.by_request.remove(q);
                }
            }
        }
        t.finished.extend(again);
    }

    /// `rec` is done (its pump thread finished it): marked done (which wakes its waiters and
    /// sends its exit event), no longer counted against `max_processes`, and queued for
    /// `prune`, all under the table's lock, so whoever sees it done (a client that got the
    /// exit event and starts the next process, a `DELETE` that forgets the record) sees its
    /// place free. The table's lock is taken before the record's, as `start` does.
    fn finished(&self, rec: &Record) {
        let mut t = self.lock();
        let now = Instant::now();
        rec.update(|s| {
            s.phase = Phase::Done;
            s.done = Some(now);
        });
        t.running = t.running.saturating_sub(1);
        if t.records.contains_key(&rec.id) {
            t.finished.push_back((now, rec.id));
        }
    }

    /// Starts `plan` (or attaches to the process its `request_id` started). `agent` is the
    /// checkpoint service, which the workspace options need.
    pub fn start(
        self: &Arc<Self>,
        plan: ExecPlan,
        agent: Option<CheckpointHandle>,
    ) -> Result<Started, ExecError> {
        // 1. Admission, under the table's lock: a record in state "starting".
        let (rec, tpl, ids) = {
            let mut t = self.lock();
            self.prune(&mut t);
            if t.closed.is_some() {
                return Err(ExecError::Stopping);
            }
            let Some(tpl) = t.template.clone() else {
                return Err(ExecError::NotReady);
            };
            if let Some(r) = plan.request_id.as_ref().and_then(|q| t.by_request.get(q)) {
                let rec = t.records.get(r).cloned().expect("request ids name records");
                return Ok(Started::Attached(rec));
            }
            if t.running >= self.cfg.max_processes as usize {
                return Err(ExecError::TooMany(self.cfg.max_processes));
            }
            if plan.around.any() && agent.is_none() {
                return Err(ExecError::NoCheckpoints);
            }
            let ids = match &plan.user {
                Some(u) => Some(process::resolve_ids(u, None).map_err(ExecError::User)?),
                None => tpl.spec.ids.clone(),
            };
            let id = ProcessId(t.next);
            t.next += 1;
            let rec = Arc::new(self.new_record(id, &plan, &tpl, ids.as_ref())?);
            t.records.insert(id, rec.clone());
            t.running += 1;
            if let Some(q) = &plan.request_id {
                t.by_request.insert(q.clone(), id);
            }
            (rec, tpl, ids)
        };
        // 2. The workspace options before the spawn (a snapshot, a change tracker), without
        // the lock.
        let ws = self
            .workspace
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let before = match agent.as_ref().filter(|_| plan.around.any()) {
            Some(a) => match around::before(&plan.around, rec.id, a, ws.as_ref()) {
                Ok(b) => b,
                Err(e) => {
                    self.forget(&rec);
                    return Err(ExecError::Before(Box::new(e)));
                }
            },
            None => around::Before::default(),
        };
        // 3. The process.
        let io = match self.spawn(&rec, &plan, &tpl, ids) {
            Ok(io) => io,
            Err(e) => {
                for e in around::abandon(&before, agent.as_ref()) {
                    warn!("exec {}: {e}", rec.id);
                }
                self.forget(&rec);
                return Err(e);
            }
        };
        info!(
            "exec {}: started {} (pid {}) as {}",
            rec.id,
            rec.argv.join(" "),
            rec.pid()
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
            rec.user
        );
        let me = self.clone();
        let r = rec.clone();
        let grace = tpl.grace;
        // The options after the exit, should the thread not start.
        let (agent2, before2) = (agent.clone(), before.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("keel-exec-{}", rec.id))
            .spawn(move || pump::run(&me, &r, io, grace, agent, before));
        if let Err(e) = spawned {
            // Without its thread nobody reads its output or finishes the record: end both
            // now (the reaper still collects the process).
            warn!("exec {}: no thread for it: {e}", rec.id);
            kill_tree(&rec);
            let mut errors = around::abandon(&before2, agent2.as_ref());
            errors.insert(0, format!("no thread for the process: {e}"));
            drop(agent2);
            rec.drop_wake();
            rec.update(|s| {
                s.killed = true;
                s.workspace.insert("errors".into(), errors.into());
                s.phase = Phase::Done;
                s.done = Some(Instant::now());
            });
            self.finished(&rec);
        }
        Ok(Started::New(rec))
    }

    fn new_record(
        &self,
        id: ProcessId,
        plan: &ExecPlan,
        tpl: &Template,
        ids: Option<&process::Ids>,
    ) -> Result<Record, ExecError> {
        crate::state::private::create_dir_all(&self.dir).map_err(|source| ExecError::Output {
            path: self.dir.clone(),
            source,
        })?;
        let out = |name: &str| {
            output::Output::create(
                &self.dir.join(format!("{id}.{name}")),
                self.cfg.output_limit,
            )
        };
        Ok(Record {
            id,
            request_id: plan.request_id.clone(),
            argv: plan
                .argv
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect(),
            user: ids
                .map(|i| i.name.clone())
                .unwrap_or_else(|| tpl.user.clone()),
            cwd: plan.cwd.clone().unwrap_or_else(|| tpl.cwd.clone()),
            pty: plan.pty.is_some(),
            timeout: plan.timeout,
            around: plan.around.clone(),
            started_wall: SystemTime::now(),
            started: Instant::now(),
            stdout: out("stdout"),
            stderr: out("stderr"),
            state: Mutex::new(record::State {
                phase: Phase::Starting,
                pid: None,
                exit: None,
                ended: None,
                done: None,
                error: None,
                output_error: None,
                timed_out: false,
                killed: false,
                kill_asked: false,
                workspace: Default::default(),
                tree_cpu: None,
                tree_peak_kib: None,
                version: 0,
            }),
            cv: Default::default(),
            wake: Mutex::new(Some(Arc::new(EventFd::new().map_err(|source| {
                ExecError::Output {
                    path: "eventfd".into(),
                    source,
                }
            })?))),
            input: Default::default(),
            master: OnceLock::new(),
            cgroup: OnceLock::new(),
        })
    }

    /// Drops a record that never ran (its options before the spawn failed).
    fn forget(&self, rec: &Record) {
        let mut t = self.lock();
        if t.records.remove(&rec.id).is_some() {
            t.running = t.running.saturating_sub(1);
        }
        if let Some(q) = &rec.request_id {
            t.by_request.remove(q);
        }
        forget_files(rec);
    }

    /// Its terminal or pipes, its cgroup, and the fork (under the table's lock).
    fn spawn(
        &self,
        rec: &Arc<Record>,
        plan: &ExecPlan,
        tpl: &Template,
        ids: Option<process::Ids>,
    ) -> Result<pump::Io, ExecError> {
        let mut spec = tpl.spec.clone();
        spec.argv = plan.argv.clone();
        spec.cwd = rec.cwd.clone();
        spec.session = Session::New;
        let mut env = std::mem::take(&mut spec.env);
        let mut set = |k: &str, v: OsString| {
            env.retain(|(ek, _)| ek != k);
            env.push((k.into(), v));
        };
        if let (Some(i), Some(_)) = (&ids, &plan.user) {
            set("USER", i.name.clone().into());
            set("LOGNAME", i.name.clone().into());
            if let Some(h) = &i.home {
                set("HOME", h.clone().into_os_string());
            }
        }
        for (k, v) in &plan.env {
            set(k, v.into());
        }
        if plan.pty.is_some() && !env.iter().any(|(k, _)| k == "TERM") {
            env.push(("TERM".into(), "xterm-256color".into()));
        }
        spec.env = env;
        spec.ids = ids;
        let pty = match plan.pty {
            Some(p) => Some(crate::sys::pty::open(p.rows, p.cols).map_err(ExecError::Pty)?),
            None => None,
        };
        spec.stdio = match &pty {
            Some(p) => Stdio::Terminal(std::os::fd::AsRawFd::as_raw_fd(&p.slave)),
            None => Stdio::Pipes {
                stdin: plan.stdin != Stdin::None,
            },
        };
        // Its group's descriptors stay open only until the spawn.
        let mut join = None;
        if let Some(root) = &self.cgroups {
            let name = format!("keel-exec-{}-{}", std::process::id(), rec.id);
            match root.create(&name) {
                Ok((cg, j)) => {
                    let _ = rec.cgroup.set(cg);
                    join = Some(j);
                }
                Err(e) => warn!("exec {}: cgroup {name}: {e}", rec.id),
            }
        }
        spec.cgroup = join.as_ref().map(|j| j.fds());
        let spawned = {
            let mut t = self.lock();
            if t.closed.is_some() {
                return Err(ExecError::Stopping);
            }
            let s = process::spawn_io(&spec);
            if let Ok(s) = &s {
                t.by_pid.insert(s.pid, rec.clone());
                rec.update(|st| {
                    st.pid = Some(s.pid);
                    st.phase = Phase::Running;
                });
            }
            s
        };
        let mut io = pump::Io::default();
        match spawned {
            Ok(s) => {
                if let Some(p) = pty {
                    drop(p.slave);
                    let writer = p.master.try_clone().map(std::fs::File::from).ok();
                    io.outputs
                        .push((p.master.try_clone().map_err(ExecError::Pty)?, 1));
                    let _ = rec.master.set(p.master);
                    let mut input = rec.input.lock().unwrap_or_else(|e| e.into_inner());
                    input.terminal = true;
                    if plan.stdin == Stdin::Stream {
                        input.writer = writer;
                    } else if let Stdin::Bytes(b) = &plan.stdin {
                        io.stdin_bytes = Some((writer, b.clone()));
                    }
                } else {
                    if let Some(fd) = s.stdout {
                        io.outputs.push((fd, 1));
                    }
                    if let Some(fd) = s.stderr {
                        io.outputs.push((fd, 2));
                    }
                    let writer = s.stdin.map(std::fs::File::from);
                    match &plan.stdin {
                        Stdin::Stream => {
                            rec.input.lock().unwrap_or_else(|e| e.into_inner()).writer = writer
                        }
                        Stdin::Bytes(b) => io.stdin_bytes = Some((writer, b.clone())),
                        Stdin::None => {}
                    }
                }
            }
            Err(e) => {
                let code = match e.raw_os_error() {
                    Some(libc::ENOENT) => 127,
                    Some(libc::EACCES) | Some(libc::ENOEXEC) | Some(libc::EISDIR) => 126,
                    _ => 1,
                };
                let msg = format!("cannot run {}: {e}", rec.argv[0]);
                warn!("exec {}: {msg}", rec.id);
                rec.update(|st| {
                    st.error = Some(msg);
                    st.exit = Some((Exit::Code(code), Usage::default()));
                    st.ended = Some(Instant::now());
                    st.phase = Phase::Running;
                });
            }
        }
        Ok(io)
    }

    /// What a short-lived helper of the files API starts from: the template's spec (the
    /// sandbox's mount namespace, capabilities, environment) as `user` (default the main
    /// command's), in a session of its own with pipes, no cgroup; the workspace it works
    /// in; and the namespace reference to keep until it has been spawned.
    pub fn helper_spec(&self, user: Option<&str>) -> Result<Helper, ExecError> {
        let t = self.lock();
        if t.closed.is_some() {
            return Err(ExecError::Stopping);
        }
        let Some(tpl) = t.template.clone() else {
            return Err(ExecError::NotReady);
        };
        drop(t);
        let mut spec = tpl.spec;
        if let Some(u) = user {
            spec.ids = Some(process::resolve_ids(u, None).map_err(ExecError::User)?);
        }
        spec.session = Session::New;
        spec.cgroup = None;
        spec.stdio = Stdio::Pipes { stdin: true };
        Ok(Helper {
            spec,
            workspace: tpl.workspace.filter(|w| w.is_dir()),
            ns: tpl.ns,
        })
    }

    /// `DELETE /processes/{id}`: a running process's whole tree gets TERM, KILL after the
    /// grace, and the answer comes once nothing of it is left; a record whose process ended
    /// is forgotten (its output files too), after its leftovers (processes it started that
    /// outlived it) are killed the same way.
    pub fn kill(&self, id: ProcessId) -> Result<Arc<Record>, ExecError> {
        let rec = self.get(id)?;
        let grace = self
            .lock()
            .template
            .as_ref()
            .map(|t| t.grace)
            .unwrap_or(Duration::from_secs(5));
        if rec.phase() != Phase::Done {
            rec.update(|s| {
                s.kill_asked = true;
                s.killed = true;
            });
            rec.wake();
            // The pump thread sends TERM, KILL after the grace, and ends once the tree is
            // gone; the wait only bounds a thread that never answers.
            rec.wait_done(grace + Duration::from_secs(60));
            return Ok(rec);
        }
        if tree_alive(&rec) {
            signal_tree(&rec, libc::SIGTERM);
            let t0 = Instant::now();
            while tree_alive(&rec) && t0.elapsed() < grace {
                std::thread::sleep(Duration::from_millis(20));
            }
            while tree_alive(&rec) && t0.elapsed() < grace + Duration::from_secs(10) {
                kill_tree(&rec);
                std::thread::sleep(Duration::from_millis(20));
            }
            rec.update(|s| s.killed = true);
            return Ok(rec);
        }
        let mut t = self.lock();
        t.records.remove(&id);
        if let Some(q) = &rec.request_id {
            t.by_request.remove(q);
        }
        forget_files(&rec);
        Ok(rec)
    }

    /// Sends `sig` to the process's group.
    pub fn signal(&self, id: ProcessId, sig: i32) -> Result<Arc<Record>, ExecError> {
        let rec = self.get(id)?;
        if let Some(pid) = rec.pid() {
            let _ = crate::sys::signal::send_group(pid, sig);
        }
        Ok(rec)
    }

    /// Writes `data` to the process's stdin stream (blocks while its pipe is full).
    pub fn write_stdin(&self, id: ProcessId, data: &[u8]) -> Result<(), ExecError> {
        use std::io::Write;
        let rec = self.get(id)?;
        let w = {
            let i = rec.input.lock().unwrap_or_else(|e| e.into_inner());
            match &i.writer {
                Some(w) => w
                    .try_clone()
                    .map_err(|source| ExecError::Write { id, source })?,
                None => return Err(ExecError::NoStdin(id)),
            }
        };
        (&w).write_all(data)
            .map_err(|source| ExecError::Write { id, source })
    }

    /// Closes the process's stdin stream (on a terminal: sends end-of-file, ^D).
    pub fn close_stdin(&self, id: ProcessId) -> Result<(), ExecError> {
        use std::io::Write;
        let rec = self.get(id)?;
        let mut i = rec.input.lock().unwrap_or_else(|e| e.into_inner());
        let Some(w) = i.writer.take() else {
            return Err(ExecError::NoStdin(id));
        };
        if i.terminal {
            (&w).write_all(&[4])
                .map_err(|source| ExecError::Write { id, source })?;
        }
        Ok(())
    }

    /// Sets the size of the process's terminal.
    pub fn resize(&self, id: ProcessId, rows: u16, cols: u16) -> Result<(), ExecError> {
        let rec = self.get(id)?;
        let m = rec.master.get().ok_or(ExecError::NoTerminal(id))?;
        crate::sys::pty::resize(m, rows, cols).map_err(ExecError::Resize)
    }

    /// Waits (at most `limit`) until every record is done: after keel's stop, so that each
    /// stream gets its exit before the workspace is finished and the API stops.
    pub fn wait_all_done(&self, limit: Duration) {
        let all: Vec<Arc<Record>> = self.lock().records.values().cloned().collect();
        let t0 = Instant::now();
        for r in all {
            r.wait_done(limit.saturating_sub(t0.elapsed()));
        }
    }

    /// Running processes and kept records, for `/status`.
    pub fn counts(&self) -> (usize, usize) {
        let t = self.lock();
        (t.running, t.records.len())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn forget_files(r: &Record) {
    let _ = std::fs::remove_file(r.stdout.path());
    let _ = std::fs::remove_file(r.stderr.path());
    if let Some(cg) = r.cgroup.get() {
        if !cg.populated() {
            let _ = cg.remove();
        }
    }
}

/// True while anything of the process's tree runs (its cgroup, else its session, group and
/// their descendants).
pub(crate) fn tree_alive(r: &Record) -> bool {
    if let Some(cg) = r.cgroup.get() {
        return cg.populated();
    }
    match r.pid() {
        Some(pid) => !process::tree_of(pid).is_empty(),
        None => false,
    }
}

/// Sends `sig` to everything of the process's tree.
pub(crate) fn signal_tree(r: &Record, sig: i32) {
    let Some(pid) = r.pid() else { return };
    if let Some(cg) = r.cgroup.get() {
        cg.signal(sig);
    }
    let _ = crate::sys::signal::send_group(pid, sig);
    for p in process::tree_of(pid) {
        let _ = crate::sys::signal::send(p, sig);
    }
}

/// SIGKILL to everything of the process's tree.
pub(crate) fn kill_tree(r: &Record) {
    if let Some(cg) = r.cgroup.get() {
        cg.kill();
    }
    signal_tree(r, libc::SIGKILL);
}

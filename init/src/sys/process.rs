//! Processes: starting a child (`sys::spawn`, re-exported here), the
//! one `wait4(-1, WNOHANG)` reaper (with each child's CPU time and peak memory),
//! subreaper status, finding descendants, and process-wide settings (cwd, rlimits, umask,
//! hostname, user lookup).

use std::ffi::CString;
use std::path::PathBuf;

use nix::errno::Errno;

use super::spawn::SPAWNING;
pub use super::spawn::{note_inherited_fds, spawn, spawn_io, Session, SpawnSpec, Spawned, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("become child subreaper: {0}")]
    Subreaper(Errno),
    #[error("chdir /: {0}")]
    Chdir(Errno),
    #[error("setrlimit {name}: {source}")]
    Rlimit { name: String, source: Errno },
    #[error("sethostname: {0}")]
    Hostname(Errno),
    #[error("user `{0}` does not exist")]
    NoSuchUser(String),
    #[error("group `{0}` does not exist")]
    NoSuchGroup(String),
    #[error("look up user `{name}`: {source}")]
    Lookup { name: String, source: Errno },
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    /// Shell convention: the code, or 128+N for signal N.
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
        }
    }
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exit code {c}"),
            Exit::Signal(s) => write!(f, "killed by {}", super::signal::name(*s)),
        }
    }
}

/// What the kernel counted for a child that ended (`wait4`'s rusage: the child and the
/// descendants it waited for).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// User plus system CPU time.
    pub cpu: std::time::Duration,
    /// Peak resident memory, KiB.
    pub max_rss_kib: u64,
}

/// One child the reaper collected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    pub pid: i32,
    pub exit: Exit,
    pub usage: Usage,
}

/// The result of one reaper pass.
#[derive(Debug, Default)]
pub struct Reaped {
    /// Every child that ended during this pass.
    pub exited: Vec<Ended>,
    /// No children at all remain (waitpid said ECHILD).
    pub none_left: bool,
}

/// The one reaper: `wait4(-1, WNOHANG)` until nothing more has ended.
pub fn reap_all() -> Reaped {
    let _spawns_done = SPAWNING.write().unwrap_or_else(|p| p.into_inner());
    let mut r = Reaped::default();
    loop {
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value of this plain C struct.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: wait4 writes the status and the rusage into the two locals.
        let pid = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, &mut ru) };
        if pid == 0 {
            return r;
        }
        if pid < 0 {
            match Errno::last() {
                Errno::EINTR => continue,
                Errno::ECHILD => r.none_left = true,
                _ => {}
            }
            return r;
        }
        let exit = if libc::WIFEXITED(status) {
            Exit::Code(libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            Exit::Signal(libc::WTERMSIG(status))
        } else {
            continue;
        };
        let tv = |t: libc::timeval| {
            std::time::Duration::from_secs(t.tv_sec.max(0) as u64)
                + std::time::Duration::from_micros(t.tv_usec.max(0) as u64)
        };
        r.exited.push(Ended {
            pid,
            exit,
            usage: Usage {
                cpu: tv(ru.ru_utime) + tv(ru.ru_stime),
                max_rss_kib: ru.ru_maxrss.max(0) as u64,
            },
        });
    }
}

/// User, primary group and supplementary groups a child switches to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub home: Option<PathBuf>,
    pub name: String,
}

/// Resolves `user` (name or number) and optional `group` (name or number).
pub fn resolve_ids(user: &str, group: Option<&str>) -> Result<Ids, ProcessError> {
    use nix::unistd::{Gid, Group, Uid, User};
    let lookup = |e| ProcessError::Lookup {
        name: user.to_string(),
        source: e,
    };
    let found = match user.parse::<u32>() {
        Ok(n) => User::from_uid(Uid::from_raw(n)).map_err(lookup)?,
        Err(_) => User::from_name(user).map_err(lookup)?,
    };
    let (uid, mut gid, name, home) = match (found, user.parse::<u32>()) {
        (Some(u), _) => (u.uid.as_raw(), u.gid.as_raw(), u.name, Some(u.dir)),
        (None, Ok(n)) => (n, n, user.to_string(), None),
        (None, Err(_)) => return Err(ProcessError::NoSuchUser(user.to_string())),
    };
    if let Some(g) = group {
        gid = match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => Group::from_name(g)
                .map_err(|e| ProcessError::Lookup {
                    name: g.to_string(),
                    source: e,
                })?
                .ok_or_else(|| ProcessError::NoSuchGroup(g.to_string()))?
                .gid
                .as_raw(),
        };
    }
    let groups = CString::new(name.clone())
        .ok()
        .and_then(|c| nix::unistd::getgrouplist(&c, Gid::from_raw(gid)).ok())
        .map(|v| v.into_iter().map(|g| g.as_raw()).collect())
        .unwrap_or_else(|| vec![gid]);
    Ok(Ids {
        uid,
        gid,
        groups,
        home,
        name,
    })
}

/// Resolves a group name or number to its gid.
pub fn resolve_group(group: &str) -> Result<u32, ProcessError> {
    if let Ok(n) = group.parse::<u32>() {
        return Ok(n);
    }
    nix::unistd::Group::from_name(group)
        .map_err(|e| ProcessError::Lookup {
            name: group.to_string(),
            source: e,
        })?
        .map(|g| g.gid.as_raw())
        .ok_or_else(|| ProcessError::NoSuchGroup(group.to_string()))
}

/// Every live process that belongs to the tree of a process started in its own session
/// `sid` (= its process group and pid): the members of that session or group, and every
/// descendant of theirs, from /proc. A process that left with `setsid` after its parent
/// died (re-parented to keel) is not found: only a cgroup holds those (`sys::cgroup`).
pub fn tree_of(sid: i32) -> Vec<i32> {
    let table = proc_table();
    let mut out: Vec<i32> = table
        .iter()
        .filter(|p| p.pid == sid || p.sid == sid || p.pgid == sid)
        .map(|p| p.pid)
        .collect();
    let mut frontier = out.clone();
    while let Some(p) = frontier.pop() {
        for c in table.iter().filter(|c| c.ppid == p) {
            if !out.contains(&c.pid) {
                out.push(c.pid);
                frontier.push(c.pid);
            }
        }
    }
    out
}

struct ProcRow {
    pid: i32,
    ppid: i32,
    pgid: i32,
    sid: i32,
}

/// Every live (not zombie) process in /proc with its parent, group and session.
fn proc_table() -> Vec<ProcRow> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid pgrp session ...": comm may contain ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().take(4).collect();
        if f.len() < 4 || f[0] == "Z" {
            continue;
        }
        let n = |s: &str| s.parse::<i32>().unwrap_or(0);
        out.push(ProcRow {
            pid,
            ppid: n(f[1]),
            pgid: n(f[2]),
            sid: n(f[3]),
        });
    }
    out
}

/// PR_SET_CHILD_SUBREAPER: orphans below keel are re-parented to keel, not to the real init.
pub fn become_subreaper() -> Result<(), ProcessError> {
    nix::sys::prctl::set_child_subreaper(true).map_err(ProcessError::Subreaper)
}

pub fn is_pid1() -> bool {
    std::process::id() == 1
}

/// PID 1 and root: the keel that owns `/run` in its container.
pub fn is_root_pid1() -> bool {
    is_pid1() && nix::unistd::geteuid().is_root()
}

pub fn chdir_root() -> Result<(), ProcessError> {
    nix::unistd::chdir("/").map_err(ProcessError::Chdir)
}

/// True when stdin is a terminal keel can hand to the main service.
pub fn has_tty() -> bool {
    nix::unistd::isatty(std::io::stdin()).unwrap_or(false)
        && nix::unistd::tcgetpgrp(std::io::stdin()).is_ok()
}

/// Sets one resource limit (name as in `[init.rlimits]`) for keel; children inherit it.
pub fn set_rlimit(name: &str, soft: u64, hard: u64) -> Result<(), ProcessError> {
    use nix::sys::resource::{setrlimit, Resource};
    let res = match name {
        "as" => Resource::RLIMIT_AS,
        "core" => Resource::RLIMIT_CORE,
        "cpu" => Resource::RLIMIT_CPU,
        "data" => Resource::RLIMIT_DATA,
        "fsize" => Resource::RLIMIT_FSIZE,
        "locks" => Resource::RLIMIT_LOCKS,
        "memlock" => Resource::RLIMIT_MEMLOCK,
        "msgqueue" => Resource::RLIMIT_MSGQUEUE,
        "nice" => Resource::RLIMIT_NICE,
        "nofile" => Resource::RLIMIT_NOFILE,
        "nproc" => Resource::RLIMIT_NPROC,
        "rss" => Resource::RLIMIT_RSS,
        "rtprio" => Resource::RLIMIT_RTPRIO,
        "rttime" => Resource::RLIMIT_RTTIME,
        "sigpending" => Resource::RLIMIT_SIGPENDING,
        "stack" => Resource::RLIMIT_STACK,
        _ => {
            return Err(ProcessError::Rlimit {
                name: name.into(),
                source: Errno::EINVAL,
            })
        }
    };
    let conv = |v: u64| {
        if v == u64::MAX {
            libc::RLIM_INFINITY
        } else {
            v
        }
    };
    setrlimit(res, conv(soft), conv(hard)).map_err(|source| ProcessError::Rlimit {
        name: name.into(),
        source,
    })
}

pub fn set_umask(bits: u32) {
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(
        bits as libc::mode_t,
    ));
}

pub fn set_hostname(name: &str) -> Result<(), ProcessError> {
    nix::unistd::sethostname(name).map_err(ProcessError::Hostname)
}

/// Every live descendant of `root` (children, grandchildren, ...), from /proc.
pub fn descendants(root: i32) -> Vec<i32> {
    let mut parent = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // "pid (comm) state ppid ...": comm may contain ')' so split at the last one.
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                continue;
            };
            let mut f = rest.split_whitespace();
            let state = f.next().unwrap_or("");
            let ppid = f.next().and_then(|p| p.parse::<i32>().ok()).unwrap_or(0);
            if state != "Z" {
                parent.push((pid, ppid));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(c, pp) in &parent {
            if pp == p && c != root && !out.contains(&c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}

extern "C" {
    static mut environ: *mut *mut libc::c_char;
}

/// Takes the variables for which `secret(name)` holds out of keel's environment and returns
/// them: they are removed, and their `NAME=value` bytes overwritten with NULs where the kernel
/// shows them (`/proc/<pid>/environ` reads the initial environment block). A value that is
/// not UTF-8 is removed and wiped too, but not returned (no credential is such a value).
/// Call while keel still has a single thread.
pub fn take_env(secret: impl Fn(&str) -> bool) -> Vec<(String, String)> {
    let mut taken = Vec::new();
    let mut dropped = Vec::new();
    let mut wipe: Vec<(*mut libc::c_char, usize)> = Vec::new();
    // SAFETY: keel is single-threaded here (documented precondition), so nothing reads or
    // changes the environment concurrently; `environ` is a NULL-terminated array of
    // NUL-terminated strings owned by the C runtime.
    unsafe {
        let mut at = environ;
        while !at.is_null() && !(*at).is_null() {
            let entry = *at;
            let bytes = std::ffi::CStr::from_ptr(entry).to_bytes();
            if let Some(eq) = bytes.iter().position(|&b| b == b'=') {
                if let Ok(name) = std::str::from_utf8(&bytes[..eq]) {
                    if secret(name) {
                        match std::str::from_utf8(&bytes[eq + 1..]) {
                            Ok(value) => taken.push((name.to_string(), value.to_string())),
                            Err(_) => dropped.push(name.to_string()),
                        }
                        wipe.push((entry, bytes.len()));
                    }
                }
            }
            at = at.add(1);
        }
    }
    for k in taken.iter().map(|(k, _)| k).chain(&dropped) {
        std::env::remove_var(k);
    }
    for (entry, len) in wipe {
        // SAFETY: `entry` points at `len` bytes of a string the C runtime no longer lists
        // (removed above) and never frees; its terminating NUL is left alone.
        unsafe { std::ptr::write_bytes(entry, 0, len) };
    }
    taken
}

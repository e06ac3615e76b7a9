//! Starting a child: the one way keel starts a process (the main command, services, probes,
//! processes started through the API and the files API's helpers). Everything the child needs
//! is prepared here, in keel; then `clone(CLONE_VM | CLONE_VFORK)` starts it, as `posix_spawn`
//! does: the child runs on a small stack of its own in keel's memory (no copy of keel's page
//! tables, no copy-on-write faults after), makes only raw async-signal-safe syscalls on what
//! was prepared (cgroup, mount namespace, session and terminal, seccomp filter, capabilities,
//! user, no_new_privs, working directory, stdio, signal dispositions and mask) and execs. The
//! calling thread resumes when the child has exec'd or exited; a failed step is reported
//! through a word the child writes in the caller's memory.

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

use super::process::Ids;

/// Held (shared) while a child is started, and (exclusively) by the reaper: when a setup step
/// or exec fails, `spawn_io` waits for that child itself, and a reaper on another thread must
/// not collect it first (processes started through the API are started on the control API's
/// threads, not the supervisor's).
pub(super) static SPAWNING: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Which session/process group a child gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Session {
    /// A new session (and group) without a controlling terminal.
    New,
    /// A new process group in keel's session, made the terminal's foreground group.
    ForegroundGroup,
}

/// Where a child's stdin, stdout and stderr go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stdio {
    /// stdin from /dev/null; stdout and stderr are keel's (services, probes).
    Null,
    /// keel's own stdin, stdout and stderr (the main command).
    Inherit,
    /// stdout and stderr to pipes keel reads; stdin from a pipe keel writes (`true`) or from
    /// /dev/null (processes started through the API).
    Pipes { stdin: bool },
    /// All three on this terminal (a pty's slave side), which becomes the child's
    /// controlling terminal in its new session.
    Terminal(RawFd),
}

/// Everything a child is started with.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub argv: Vec<OsString>,
    /// The complete environment.
    pub env: Vec<(OsString, OsString)>,
    /// Entered last, as the child's user (and in its mount namespace).
    pub cwd: PathBuf,
    pub ids: Option<Ids>,
    pub session: Session,
    /// Capability numbers to drop from the bounding, inheritable and ambient sets.
    pub drop_caps: Vec<u32>,
    pub no_new_privs: bool,
    pub stdio: Stdio,
    /// The sandbox mount namespace to join (an fd keel keeps open), if any.
    pub mnt_ns: Option<RawFd>,
    /// The cgroup the child starts in (`clone3` with `CLONE_INTO_CGROUP`), or moves itself
    /// into first where clone3 cannot be used, so nothing it runs starts outside it
    /// (`sys::cgroup`).
    pub cgroup: Option<super::cgroup::JoinFds>,
    /// The seccomp filter the child gets before its capabilities drop (`sys::seccomp`).
    pub seccomp: Option<std::sync::Arc<super::seccomp::Filter>>,
    /// Pass on the descriptors keel itself was started with open and not close-on-exec (a
    /// make jobserver's pipe, systemd's `LISTEN_FDS`), as a plain init does for its one
    /// command: the main command only. Every other descriptor above stdio is closed at exec.
    pub inherit_fds: bool,
}

/// The descriptors above stdio keel was started with, open and not close-on-exec
/// (`note_inherited_fds`), ascending.
static INHERITED_FDS: std::sync::OnceLock<Vec<RawFd>> = std::sync::OnceLock::new();

/// Remember which descriptors above stdio keel was started with (open, not close-on-exec),
/// for `SpawnSpec::inherit_fds`, and make them close-on-exec in keel, so that nothing else
/// keel runs (a `Command` of its own) inherits them. Called first thing in `main`, before
/// keel opens anything; later calls change nothing. Without it no descriptor is passed on.
pub fn note_inherited_fds() {
    INHERITED_FDS.get_or_init(|| {
        // The directory's own descriptor is close-on-exec (std opens everything so): it is
        // not counted.
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
            return Vec::new();
        };
        let mut fds: Vec<RawFd> = dir
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter(|&fd: &RawFd| {
                // SAFETY: F_GETFD reads a flag of a descriptor number; a closed one is EBADF.
                fd > 2 && unsafe { libc::fcntl(fd, libc::F_GETFD) } == 0
            })
            .collect();
        fds.sort_unstable();
        for &fd in &fds {
            // SAFETY: F_SETFD sets a flag of a descriptor number keel was started with.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        fds
    });
}

/// Mark descriptors `lo..=hi` close-on-exec. Async-signal-safe (the child calls it).
fn close_range_cloexec(lo: u32, hi: u32) {
    // SAFETY: close_range takes plain integers and only changes this child's fd table
    // (CLONE_FILES is not set: the table is the child's own copy).
    unsafe { libc::syscall(libc::SYS_close_range, lo, hi, libc::CLOSE_RANGE_CLOEXEC) };
}

/// The shell a script without `#!` runs under, as execvp does.
const SH_PATH: &std::ffi::CStr = c"/bin/sh";
const SH_NAME: &std::ffi::CStr = c"sh";

/// A started child and keel's ends of its pipes (`Stdio::Pipes`).
#[derive(Debug)]
pub struct Spawned {
    pub pid: i32,
    pub stdin: Option<OwnedFd>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
}

/// The child's steps, in the order it takes them; a failure names its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Step {
    None = 0,
    Stdio,
    Cgroup,
    Namespace,
    Session,
    Terminal,
    Seccomp,
    Caps,
    Groups,
    Gid,
    Uid,
    NoNewPrivs,
    Chdir,
    Signals,
    Exec,
}

impl Step {
    fn from_u32(n: u32) -> Step {
        use Step::*;
        [
            None, Stdio, Cgroup, Namespace, Session, Terminal, Seccomp, Caps, Groups, Gid, Uid,
            NoNewPrivs, Chdir, Signals, Exec,
        ]
        .get(n as usize)
        .copied()
        .unwrap_or(Exec)
    }

    fn what(self) -> &'static str {
        match self {
            Step::None | Step::Exec => "exec",
            Step::Stdio => "set up stdin/stdout/stderr",
            Step::Cgroup => "join its cgroup",
            Step::Namespace => "enter the sandbox's mount namespace",
            Step::Session => "start its session or process group",
            Step::Terminal => "take its controlling terminal",
            Step::Seccomp => "install the seccomp filter",
            Step::Caps => "drop capabilities",
            Step::Groups => "set its supplementary groups",
            Step::Gid => "set its group",
            Step::Uid => "set its user",
            Step::NoNewPrivs => "set no_new_privs",
            Step::Chdir => "enter its working directory as its user",
            Step::Signals => "reset signal dispositions and mask",
        }
    }
}

/// A setup step of the child failed (exec failures are returned as their plain errno, so
/// callers map ENOENT to 127 and EACCES to 126 as a shell does).
#[derive(Debug, thiserror::Error)]
#[error("{what} {detail}: {source}", what = step.what())]
struct StepFailed {
    step: Step,
    detail: String,
    source: io::Error,
}

/// What the child reads (all prepared by the parent, alive until the child has exec'd or
/// exited) and the words it writes when a step fails.
struct Child {
    /// Where stdin, stdout, stderr come from (-1: keep keel's).
    stdio: [RawFd; 3],
    ctty: bool,
    session: Session,
    cgroup_procs: RawFd,
    mnt_ns: RawFd,
    seccomp: Option<std::sync::Arc<super::seccomp::Filter>>,
    drop_caps: Vec<u32>,
    ids: Option<(u32, u32, Vec<libc::gid_t>)>,
    /// keel is not dumpable (`ns::set_not_dumpable`): a child that switches user puts that
    /// back on the memory it shares with keel (below).
    not_dumpable: bool,
    no_new_privs: bool,
    cwd: CString,
    mask: libc::sigset_t,
    ignored: u64,
    /// Paths to try in order (argv[0] itself, or each `PATH` entry joined with it).
    paths: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    /// Per entry of `paths`: `sh PATH ARGS...`, run as execvp does when the file is not an
    /// executable format (a script without `#!`: ENOEXEC).
    sh_argv: Vec<Vec<*const libc::c_char>>,
    /// Descriptors above stdio left open across exec (`SpawnSpec::inherit_fds`), ascending.
    keep_fds: Vec<RawFd>,
    failed_step: AtomicU32,
    failed_errno: AtomicI32,
}

/// The child's stack: a private anonymous mapping with a guard page below it.
struct Stack {
    base: *mut libc::c_void,
    len: usize,
}

/// Generous for the setup steps (a few KiB in a debug build); only touched pages are real.
const STACK_LEN: usize = 256 << 10;
const GUARD_LEN: usize = 4 << 10;

impl Stack {
    fn new() -> io::Result<Stack> {
        let len = STACK_LEN + GUARD_LEN;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Stack { base, len };
        // SAFETY: the lowest page of the mapping just made; the stack grows down toward it.
        if unsafe { libc::mprotect(base, GUARD_LEN, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// The initial stack pointer: the top of the mapping (page aligned, so 16-byte aligned).
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping, computed inside its allocation.
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; the child that used it has exec'd or exited.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_encoded_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// The paths `execvp` would try for `prog` with this environment's `PATH` (its default when
/// unset: `/bin:/usr/bin`): `prog` itself when it holds a `/`.
fn exec_paths(prog: &OsStr, env: &[(OsString, OsString)]) -> io::Result<Vec<CString>> {
    let bytes = prog.as_encoded_bytes();
    if bytes.is_empty() {
        return Err(io::Error::from_raw_os_error(libc::ENOENT));
    }
    if bytes.contains(&b'/') {
        return Ok(vec![cstring(prog)?]);
    }
    let path = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_encoded_bytes())
        .unwrap_or(b"/bin:/usr/bin");
    let mut out = Vec::new();
    for dir in path.split(|&b| b == b':') {
        let dir: &[u8] = if dir.is_empty() { b"." } else { dir };
        let mut p = dir.to_vec();
        if !p.ends_with(b"/") {
            p.push(b'/');
        }
        p.extend_from_slice(bytes);
        out.push(CString::new(p).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?);
    }
    Ok(out)
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1; 2];
    // SAFETY: pipe2 writes two descriptors into the local array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn dev_null() -> io::Result<OwnedFd> {
    Ok(std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?
        .into())
}

/// A descriptor the child dup2s onto 0, 1 or 2 must not be one of those itself (a later dup2
/// would overwrite it): keel's stdio is always open, but if it was not, move it up.
fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor; `fd` stays valid and is dropped after.
    let n = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 3) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `n` was just created and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// Starts a child; its pid is also its process group id. Errors are those of exec (ENOENT,
/// EACCES, ...) or of a setup step in the child (named in the message).
pub fn spawn(spec: &SpawnSpec) -> io::Result<i32> {
    spawn_io(spec).map(|s| s.pid)
}

/// `spawn`, returning keel's ends of the child's pipes too.
pub fn spawn_io(spec: &SpawnSpec) -> io::Result<Spawned> {
    let Some(prog) = spec.argv.first() else {
        return Err(io::Error::from_raw_os_error(libc::ENOENT));
    };
    let paths = exec_paths(prog, &spec.env)?;
    let argv_c = spec
        .argv
        .iter()
        .map(|a| cstring(a))
        .collect::<io::Result<Vec<_>>>()?;
    let envp_c = spec
        .env
        .iter()
        .map(|(k, v)| {
            let mut b = k.as_encoded_bytes().to_vec();
            b.push(b'=');
            b.extend_from_slice(v.as_encoded_bytes());
            CString::new(b).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
        })
        .collect::<io::Result<Vec<_>>>()?;
    let null_terminated = |v: &[CString]| {
        v.iter()
            .map(|c| c.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect::<Vec<_>>()
    };

    // The child's ends (closed here once it has exec'd) and keel's ends.
    let mut theirs: [Option<OwnedFd>; 3] = [None, None, None];
    let mut ours: [Option<OwnedFd>; 3] = [None, None, None];
    let mut terminal = -1;
    match spec.stdio {
        Stdio::Null => theirs[0] = Some(dev_null()?),
        Stdio::Inherit => {}
        Stdio::Pipes { stdin } => {
            if stdin {
                let (r, w) = pipe()?;
                theirs[0] = Some(r);
                ours[0] = Some(w);
            } else {
                theirs[0] = Some(dev_null()?);
            }
            for i in 1..3 {
                let (r, w) = pipe()?;
                theirs[i] = Some(w);
                ours[i] = Some(r);
            }
        }
        Stdio::Terminal(fd) => terminal = fd,
    }
    let mut stdio = [-1; 3];
    for (i, t) in theirs.iter_mut().enumerate() {
        if let Some(fd) = t.take() {
            let fd = above_stdio(fd)?;
            stdio[i] = fd.as_raw_fd();
            *t = Some(fd);
        }
    }
    let _terminal_copy = if terminal >= 0 {
        // SAFETY: `terminal` is the caller's open pty slave for the duration of the call; it
        // is only borrowed to be duplicated.
        let b = unsafe { std::os::fd::BorrowedFd::borrow_raw(terminal) };
        let fd = above_stdio(b.try_clone_to_owned()?)?;
        stdio = [fd.as_raw_fd(); 3];
        Some(fd)
    } else {
        None
    };

    let mut child = Child {
        stdio,
        ctty: terminal >= 0,
        session: spec.session,
        cgroup_procs: -1,
        mnt_ns: spec.mnt_ns.unwrap_or(-1),
        seccomp: spec.seccomp.clone(),
        drop_caps: spec.drop_caps.clone(),
        ids: spec.ids.as_ref().map(|i| (i.uid, i.gid, i.groups.clone())),
        // SAFETY: PR_GET_DUMPABLE takes no pointer and returns the flag.
        not_dumpable: unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) } == 0,
        no_new_privs: spec.no_new_privs,
        cwd: cstring(spec.cwd.as_os_str())?,
        mask: super::signal::inherited_sigset(),
        ignored: super::signal::inherited_ignored(),
        sh_argv: paths
            .iter()
            .map(|p| {
                [SH_NAME.as_ptr(), p.as_ptr()]
                    .into_iter()
                    .chain(argv_c.iter().skip(1).map(|a| a.as_ptr()))
                    .chain(std::iter::once(std::ptr::null()))
                    .collect()
            })
            .collect(),
        paths,
        argv: null_terminated(&argv_c),
        envp: null_terminated(&envp_c),
        keep_fds: if spec.inherit_fds {
            INHERITED_FDS.get().cloned().unwrap_or_default()
        } else {
            Vec::new()
        },
        failed_step: AtomicU32::new(Step::None as u32),
        failed_errno: AtomicI32::new(0),
    };
    let stack = Stack::new()?;

    // No signal handler may run in the child (it shares keel's memory) before it has reset
    // every disposition: block everything in this thread around the clone; the child starts
    // with this mask and sets the one it should have last.
    // SAFETY: sigset_t is plain data; sigfillset initialises it.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `all` is a valid, writable sigset_t.
    unsafe { libc::sigfillset(&mut all) };
    // SAFETY: sigset_t is plain data, written by pthread_sigmask below.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) };
    let (pid, clone_err) = {
        let _reaper_waits = SPAWNING.read().unwrap_or_else(|p| p.into_inner());
        let mut r = match spec.cgroup {
            Some(cg) if CLONE3.load(Ordering::Relaxed) != CLONE3_NO => {
                // SAFETY: as for `clone` below; `child`, `stack` and the cgroup directory
                // outlive the call, which returns once the child has exec'd or exited.
                let r = unsafe { clone3_into(cg.dir, &stack, (&mut child as *mut Child).cast()) };
                match r {
                    Ok(pid) => {
                        CLONE3.store(CLONE3_YES, Ordering::Relaxed);
                        Ok(pid)
                    }
                    // Refused by a seccomp profile, or a kernel before 5.7: the child joins
                    // through cgroup.procs (from now on, unless clone3 worked here before).
                    Err(e)
                        if CLONE3.load(Ordering::Relaxed) == CLONE3_UNKNOWN
                            && matches!(
                                e.raw_os_error(),
                                Some(libc::ENOSYS | libc::EPERM | libc::E2BIG | libc::EINVAL)
                            ) =>
                    {
                        CLONE3.store(CLONE3_NO, Ordering::Relaxed);
                        Err(None)
                    }
                    Err(e) => Err(Some(e)),
                }
            }
            _ => Err(None),
        };
        if matches!(r, Err(None)) {
            child.cgroup_procs = spec.cgroup.map_or(-1, |cg| cg.procs);
            // SAFETY: CLONE_VM|CLONE_VFORK: this thread is suspended until the child execs
            // or exits, so `child` and `stack` (locals of this frame) outlive every use the
            // child makes of them; `child_main` only makes async-signal-safe syscalls on
            // `child`'s prepared data and writes nothing of keel's but `child`'s two
            // atomics, the calling thread's errno and its own stack. SIGCHLD as the exit
            // signal lets the one reaper (`wait4(-1)`) collect it.
            let pid = unsafe {
                libc::clone(
                    child_main,
                    stack.top(),
                    libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                    (&mut child as *mut Child).cast(),
                )
            };
            r = if pid < 0 {
                Err(Some(io::Error::last_os_error()))
            } else {
                Ok(pid)
            };
        }
        let (pid, clone_err) = match r {
            Ok(pid) => (pid, None),
            Err(e) => (
                -1,
                Some(e.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EIO))),
            ),
        };
        if pid > 0 && child.failed_step.load(Ordering::Acquire) != Step::None as u32 {
            // The child exited without exec: collect it here, before the reaper may.
            let mut status = 0;
            // SAFETY: waits for our own child; `status` is a local.
            while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
                && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
            {}
        }
        (pid, clone_err)
    };
    if child.not_dumpable && child.ids.is_some() {
        // The child put keel's flag back after its id switch; again here, in case its prctl
        // failed (it then exited and keel would stay dumpable).
        // SAFETY: PR_SET_DUMPABLE takes plain integers.
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    }
    // SAFETY: restores this thread's mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    drop(stack);
    if let Some(e) = clone_err {
        return Err(e);
    }
    let step = Step::from_u32(child.failed_step.load(Ordering::Acquire));
    if step != Step::None {
        let errno = io::Error::from_raw_os_error(child.failed_errno.load(Ordering::Acquire));
        if step == Step::Exec {
            return Err(errno);
        }
        let detail = match step {
            Step::Chdir => spec.cwd.display().to_string(),
            _ => String::new(),
        };
        let detail = if detail.is_empty() {
            String::new()
        } else {
            format!("`{detail}`")
        };
        return Err(io::Error::new(
            errno.kind(),
            StepFailed {
                step,
                detail,
                source: errno,
            },
        ));
    }
    let [stdin, stdout, stderr] = ours;
    Ok(Spawned {
        pid,
        stdin,
        stdout,
        stderr,
    })
}

/// Whether `clone3` with `CLONE_INTO_CGROUP` works here: not tried yet, yes, no.
static CLONE3: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(CLONE3_UNKNOWN);
const CLONE3_UNKNOWN: u8 = 0;
const CLONE3_YES: u8 = 1;
const CLONE3_NO: u8 = 2;

/// `struct clone_args` (Linux 5.7+: up to `cgroup`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// `clone3(CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP)`: the child starts in the cgroup whose
/// directory is open as `cgroup` (no migration afterwards, so none of the cgroup.procs
/// write's global lock) and runs `child_main(arg)` on `stack`. The pid, or the error.
///
/// # Safety
/// As for `libc::clone` with `CLONE_VM | CLONE_VFORK`: `arg` must point at a `Child` that,
/// like `stack`, stays alive and unchanged until the call returns.
#[cfg(target_arch = "x86_64")]
unsafe fn clone3_into(cgroup: RawFd, stack: &Stack, arg: *mut libc::c_void) -> io::Result<i32> {
    let args = CloneArgs {
        flags: (libc::CLONE_VM | libc::CLONE_VFORK) as u64 | CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        stack: stack.base as u64,
        stack_size: stack.len as u64,
        cgroup: cgroup as u64,
        ..CloneArgs::default()
    };
    let entry: extern "C" fn(*mut libc::c_void) -> libc::c_int = child_main;
    let ret: i64;
    // SAFETY: the raw syscall with `args` (alive for the call) in rdi and its size in rsi.
    // In keel, only rax (the result), rcx and r11 change, nothing is pushed (nostack). The
    // child resumes at the same instruction with rax = 0 on the new stack (its top, page
    // aligned, so 16-byte aligned at the call as the ABI asks) and calls `child_main(arg)`
    // (r12, r13 survive the syscall); `child_main` execs or `_exit`s, and the exit after it
    // is only a backstop. The child never returns into keel's code, so nothing the compiler
    // assumed about this frame is used by it.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r13",
            "call r12",
            "mov edi, eax",
            "mov eax, 60",
            "syscall",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") &args as *const CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") entry,
            in("r13") arg,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if ret < 0 {
        return Err(io::Error::from_raw_os_error(-ret as i32));
    }
    Ok(ret as i32)
}

/// Elsewhere: not available (the caller falls back to `clone` and cgroup.procs).
///
/// # Safety
/// Nothing is done.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone3_into(_cgroup: RawFd, _stack: &Stack, _arg: *mut libc::c_void) -> io::Result<i32> {
    Err(io::Error::from_raw_os_error(libc::ENOSYS))
}

/// `CLONE_INTO_CGROUP` (include/uapi/linux/sched.h).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// The child: runs on its own stack in keel's memory, with every signal blocked, until it
/// execs or `_exit`s. Allocates nothing, takes no lock, calls nothing that could (glibc's
/// set*id wrappers would signal keel's threads: raw syscalls instead).
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's `Child`, alive and not mutated (the calling thread is
    // suspended) until this process execs or exits.
    let c = unsafe { &*(arg as *const Child) };
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    };
    let fail = |step: Step, e: i32| -> ! {
        c.failed_errno.store(e, Ordering::Release);
        c.failed_step.store(step as u32, Ordering::Release);
        // SAFETY: ends this child at once, running nothing of keel's (no atexit, no
        // destructors); the parent resumes and reads the two words above.
        unsafe { libc::_exit(127) }
    };
    let check = |step: Step, r: libc::c_long| {
        if r < 0 {
            fail(step, errno());
        }
    };
    let io = |step: Step, r: io::Result<()>| {
        if let Err(e) = r {
            fail(step, e.raw_os_error().unwrap_or(libc::EIO));
        }
    };

    // Stdio first: dup2 clears close-on-exec on the copy; a descriptor already in place
    // (keel's own stdio) keeps its flags.
    for (target, &src) in c.stdio.iter().enumerate() {
        if src >= 0 {
            // SAFETY: `src` is a descriptor the parent keeps open until we exec.
            check(Step::Stdio, unsafe { libc::dup2(src, target as i32) } as _);
        }
    }
    // Into its cgroup before anything it runs can start outside it.
    if c.cgroup_procs >= 0 {
        io(Step::Cgroup, super::cgroup::enter_in_child(c.cgroup_procs));
    }
    // While it still has CAP_SYS_ADMIN and CAP_SYS_CHROOT (not CLONE_FS: the child has its
    // own root and cwd, as setns(CLONE_NEWNS) requires).
    if c.mnt_ns >= 0 {
        io(Step::Namespace, super::ns::enter_in_child(c.mnt_ns));
    }
    match c.session {
        Session::New => {
            // SAFETY: setsid has no arguments; a new child is not a group leader.
            check(Step::Session, unsafe { libc::setsid() } as _);
            if c.ctty {
                // SAFETY: stdin is the pty slave (dup2'd above); a session leader without a
                // terminal may take it as its controlling one.
                check(
                    Step::Terminal,
                    unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } as _,
                );
            }
        }
        Session::ForegroundGroup => {
            // SAFETY: setpgid(0, 0) puts the calling process in a new group of its own.
            check(Step::Session, unsafe { libc::setpgid(0, 0) } as _);
            // SAFETY: getpid is a plain syscall.
            let me: libc::pid_t = unsafe { libc::getpid() };
            // SAFETY: TIOCSPGRP reads one pid_t from a live local; signals are blocked, so
            // SIGTTOU from a background group cannot stop us. Failure (no terminal) is
            // harmless.
            unsafe { libc::ioctl(0, libc::TIOCSPGRP, &me as *const libc::pid_t) };
        }
    }
    // While the child may still hold CAP_SYS_ADMIN: then it needs no no_new_privs.
    if let Some(f) = &c.seccomp {
        io(Step::Seccomp, super::seccomp::install_in_child(f));
    }
    io(Step::Caps, super::caps::drop_in_child(&c.drop_caps));
    if let Some((uid, gid, groups)) = &c.ids {
        // SAFETY: raw syscalls (not glibc's wrappers, which would broadcast the change to
        // every thread of keel, whose memory this child shares); `groups` is a live slice
        // of gid_t of the given length; the ids are plain integers.
        unsafe {
            check(
                Step::Groups,
                libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()),
            );
            check(
                Step::Gid,
                libc::syscall(libc::SYS_setresgid, *gid, *gid, *gid),
            );
            check(
                Step::Uid,
                libc::syscall(libc::SYS_setresuid, *uid, *uid, *uid),
            );
        }
        // A change of ids resets the dumpable flag of this child's memory, which is keel's
        // (CLONE_VM), to `fs.suid_dumpable`: where a host sets 1, keel would become
        // dumpable (ptrace-able by a same-uid process without CAP_SYS_PTRACE) until the
        // child execs. Put keel's flag back at once; exec gives the child its own.
        if c.not_dumpable {
            // SAFETY: PR_SET_DUMPABLE takes plain integers.
            check(
                Step::Uid,
                unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } as _,
            );
        }
    }
    if c.no_new_privs {
        // SAFETY: PR_SET_NO_NEW_PRIVS takes plain integers.
        check(
            Step::NoNewPrivs,
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } as _,
        );
    }
    // As the user it runs as: a directory that user may not enter is refused, even where
    // keel (root) could enter it.
    // SAFETY: `cwd` is a live NUL-terminated string.
    check(Step::Chdir, unsafe { libc::chdir(c.cwd.as_ptr()) } as _);
    // Whatever keel holds open without close-on-exec is not the child's; what keel was
    // started with (close-on-exec in keel since `note_inherited_fds`) is, when it is passed
    // on (`keep_fds`): mark every other descriptor above stdio close-on-exec (Linux 5.11+;
    // where the call is missing, keel's own descriptors are close-on-exec already).
    let mut lo = 3u32;
    for &fd in &c.keep_fds {
        // SAFETY: F_SETFD clears a flag of a descriptor in this child's own fd table.
        unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
        let fd = fd as u32;
        if fd > lo {
            close_range_cloexec(lo, fd - 1);
        }
        lo = lo.max(fd + 1);
    }
    close_range_cloexec(lo, u32::MAX);
    io(
        Step::Signals,
        super::signal::restore_in_child(&c.mask, c.ignored),
    );
    let mut denied = false;
    let mut last = libc::ENOENT;
    for (p, sh_argv) in c.paths.iter().zip(&c.sh_argv) {
        // SAFETY: `p`, `argv` and `envp` are live NUL-terminated strings and NULL-terminated
        // arrays of them, prepared by the parent.
        unsafe { libc::execve(p.as_ptr(), c.argv.as_ptr(), c.envp.as_ptr()) };
        // As execvp: keep looking after a miss, remember a refusal, stop at anything else.
        match errno() {
            // Not an executable format (a script without `#!`): the shell runs it.
            libc::ENOEXEC => {
                // SAFETY: as above; `sh_argv` is `sh PATH ARGS... NULL`, prepared by the
                // parent from live strings.
                unsafe { libc::execve(SH_PATH.as_ptr(), sh_argv.as_ptr(), c.envp.as_ptr()) };
                fail(Step::Exec, libc::ENOEXEC)
            }
            libc::EACCES => denied = true,
            e @ (libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT) => {
                last = e
            }
            e => fail(Step::Exec, e),
        }
    }
    fail(Step::Exec, if denied { libc::EACCES } else { last })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_lookup_is_execvps() {
        let env = |p: &str| vec![(OsString::from("PATH"), OsString::from(p))];
        let strs = |v: Vec<CString>| {
            v.into_iter()
                .map(|c| c.into_string().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            strs(exec_paths(OsStr::new("ls"), &env("/a:/b/::/c")).unwrap()),
            ["/a/ls", "/b/ls", "./ls", "/c/ls"]
        );
        assert_eq!(
            strs(exec_paths(OsStr::new("./x"), &env("/a")).unwrap()),
            ["./x"]
        );
        assert_eq!(
            strs(exec_paths(OsStr::new("sh"), &[]).unwrap()),
            ["/bin/sh", "/usr/bin/sh"]
        );
        assert!(exec_paths(OsStr::new(""), &[]).is_err());
    }

    fn spec(argv: &[&str], stdio: Stdio) -> SpawnSpec {
        SpawnSpec {
            argv: argv.iter().map(OsString::from).collect(),
            env: vec![
                ("PATH".into(), "/usr/bin:/bin".into()),
                ("K".into(), "v".into()),
            ],
            cwd: "/".into(),
            ids: None,
            session: Session::New,
            drop_caps: vec![],
            no_new_privs: false,
            stdio,
            mnt_ns: None,
            cgroup: None,
            seccomp: None,
            inherit_fds: false,
        }
    }

    fn wait(pid: i32) -> i32 {
        let mut status = 0;
        // SAFETY: waits for the test's own child; `status` is a local.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        status
    }

    #[test]
    fn a_script_without_an_interpreter_line_runs_under_sh_as_execvp_runs_it() {
        let d = tempfile::tempdir().unwrap();
        let script = d.path().join("plain-script");
        std::fs::write(&script, "echo \"ran $1 $2\"\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let s = spec(
            &[script.to_str().unwrap(), "a", "b"],
            Stdio::Pipes { stdin: false },
        );
        assert_eq!(output(&s), "ran a b\n");
    }

    #[test]
    fn a_child_gets_its_pipes_environment_session_and_directory() {
        use std::io::{Read, Write};
        let mut s = spec(
            &[
                "sh",
                "-c",
                "cat; echo \"$K $(pwd) $$ $(cut -d' ' -f6 /proc/$$/stat)\"; echo e >&2",
            ],
            Stdio::Pipes { stdin: true },
        );
        s.cwd = "/tmp".into();
        let c = spawn_io(&s).unwrap();
        let mut w = std::fs::File::from(c.stdin.unwrap());
        w.write_all(b"in\n").unwrap();
        drop(w);
        let mut out = String::new();
        std::fs::File::from(c.stdout.unwrap())
            .read_to_string(&mut out)
            .unwrap();
        let mut err = String::new();
        std::fs::File::from(c.stderr.unwrap())
            .read_to_string(&mut err)
            .unwrap();
        assert_eq!(wait(c.pid), 0);
        let pid = c.pid.to_string();
        // Its session is its own (stat's sixth field: the session id).
        assert_eq!(out, format!("in\nv /tmp {pid} {pid}\n"));
        assert_eq!(err, "e\n");
    }

    fn root() -> bool {
        if nix::unistd::geteuid().is_root() {
            return true;
        }
        assert!(
            std::env::var_os("CI").is_none(),
            "the spawn tests need root, and CI is set"
        );
        eprintln!("skipping: needs root");
        false
    }

    fn output(s: &SpawnSpec) -> String {
        use std::io::Read;
        let c = spawn_io(s).unwrap();
        let mut out = String::new();
        std::fs::File::from(c.stdout.unwrap())
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(wait(c.pid), 0, "{out}");
        out
    }

    /// Started by clone3 into its cgroup, and by clone joining it through cgroup.procs
    /// (where clone3 is refused): either way the child runs in its group, as its user, with
    /// its groups and without the capabilities dropped.
    #[test]
    fn a_child_starts_in_its_cgroup_as_its_user_without_the_dropped_capabilities() {
        if !root() {
            return;
        }
        let root = crate::sys::cgroup::Root::find().expect("a writable cgroup v2 hierarchy");
        for path in [CLONE3_UNKNOWN, CLONE3_NO] {
            let name = format!("keel-spawn-test-{}-{path}", std::process::id());
            let (cg, join) = root.create(&name).unwrap();
            let mut s = spec(
                &[
                    "sh",
                    "-c",
                    "cat /proc/self/cgroup; id -u; id -g; id -G; grep CapBnd /proc/self/status",
                ],
                Stdio::Pipes { stdin: false },
            );
            s.cgroup = Some(join.fds());
            s.ids = Some(crate::sys::process::Ids {
                uid: 65534,
                gid: 65534,
                groups: vec![65534, 100],
                home: None,
                name: "nobody".into(),
            });
            s.drop_caps = vec![21];
            if path == CLONE3_NO {
                CLONE3.store(CLONE3_NO, Ordering::Relaxed);
            }
            let out = output(&s);
            CLONE3.store(CLONE3_UNKNOWN, Ordering::Relaxed);
            drop(join);
            let _ = cg.remove();
            let line = out
                .lines()
                .find(|l| l.starts_with("0::"))
                .unwrap_or_else(|| panic!("no cgroup v2 line: {out}"));
            assert!(line.ends_with(&format!("/{name}")), "path {path}: {out}");
            let rest: Vec<&str> = out.lines().filter(|l| !l.contains("::")).collect();
            assert!(
                rest.len() >= 4
                    && rest[rest.len() - 4] == "65534"
                    && rest[rest.len() - 3] == "65534"
                    && rest[rest.len() - 2] == "65534 100",
                "path {path}: {out}"
            );
            let bnd =
                u64::from_str_radix(rest[rest.len() - 1].split_whitespace().nth(1).unwrap(), 16)
                    .unwrap();
            assert_eq!(bnd & (1 << 21), 0, "CAP_SYS_ADMIN kept, path {path}: {out}");
        }
    }

    #[test]
    fn exec_failures_are_their_errno_and_setup_failures_name_their_step() {
        let e = spawn(&spec(&["keel-no-such-command"], Stdio::Null)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}");
        let e = spawn(&spec(&["/etc/passwd"], Stdio::Null)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");
        let mut s = spec(&["true"], Stdio::Null);
        s.cwd = "/keel/no/such/dir".into();
        let e = spawn(&s).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(
            e.to_string()
                .starts_with("enter its working directory as its user `/keel/no/such/dir`"),
            "{e}"
        );
    }
}

//! Signals: what keel inherited (blocked mask and ignored set, captured before `main`), blocking
//! everything behind a signalfd, and sending signals to processes and process groups.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::Pid;

#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("block signals: {0}")]
    Block(Errno),
    #[error("signalfd: {0}")]
    SignalFd(Errno),
    #[error("read signalfd: {0}")]
    Read(Errno),
    #[error("poll signalfd: {0}")]
    Poll(Errno),
}

/// Bit `n-1` set: signal `n` was blocked / ignored when the process started (signals 1..=64).
static INHERITED_BLOCKED: AtomicU64 = AtomicU64::new(0);
static INHERITED_IGNORED: AtomicU64 = AtomicU64::new(0);

/// Runs from `.init_array`, before Rust's runtime sets SIGPIPE to SIG_IGN and installs its
/// SIGSEGV/SIGBUS handlers, so what keel itself inherited is still visible.
extern "C" fn capture_inherited() {
    let mut blocked = 0u64;
    let mut ignored = 0u64;
    // SAFETY: sigset_t is plain data; zeroed is a valid (empty) value.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a null `set` only queries the current mask into `set`, a valid pointer.
    let ok = unsafe { libc::sigprocmask(libc::SIG_BLOCK, std::ptr::null(), &mut set) } == 0;
    for sig in 1..=64 {
        if ok {
            // SAFETY: `set` is initialised above; sigismember only reads it.
            if unsafe { libc::sigismember(&set, sig) } == 1 {
                blocked |= 1 << (sig - 1);
            }
        }
        // SAFETY: sigaction is plain data; zeroed is valid to receive the old action.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a null new action only queries the disposition of `sig` into `old`.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } == 0
            && old.sa_sigaction == libc::SIG_IGN
        {
            ignored |= 1 << (sig - 1);
        }
    }
    INHERITED_BLOCKED.store(blocked, Ordering::Relaxed);
    INHERITED_IGNORED.store(ignored, Ordering::Relaxed);
}

#[used]
#[link_section = ".init_array"]
static CAPTURE_INHERITED: extern "C" fn() = capture_inherited;

/// Signals (1..=64) that were blocked when keel started, as a bit mask (bit n-1 = signal n).
pub fn inherited_blocked() -> u64 {
    INHERITED_BLOCKED.load(Ordering::Relaxed)
}

/// Signals (1..=64) that were ignored (SIG_IGN) when keel started.
pub fn inherited_ignored() -> u64 {
    INHERITED_IGNORED.load(Ordering::Relaxed)
}

/// The inherited blocked mask as a `sigset_t`, prepared before fork so the child only copies it.
pub fn inherited_sigset() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    let bits = inherited_blocked();
    for sig in 1..=64 {
        if bits & (1 << (sig - 1)) != 0 {
            // SAFETY: `set` is initialised; out-of-range signals only return EINVAL.
            unsafe { libc::sigaddset(&mut set, sig) };
        }
    }
    set
}

fn bit(sig: i32) -> u64 {
    1 << (sig - 1)
}

/// For the commands that print and exit (`keel status | head`): a closed stdout ends the
/// process quietly by SIGPIPE, as it ends any Unix filter, instead of a panic in `println!`
/// (std ignores SIGPIPE). Call before any thread exists; never in `keel run` or `keel mount`.
pub fn default_sigpipe() -> std::io::Result<()> {
    // SAFETY: setting SIGPIPE's disposition to SIG_DFL is always valid.
    if unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) } == libc::SIG_ERR {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// In the child, before exec (every signal still blocked): each disposition back to what keel
/// inherited (SIG_IGN where it was ignored, so SIGPIPE and SIGCHLD come back ignored when they
/// were; SIG_DFL everywhere else, so no handler of keel's, such as Rust's SIGSEGV one, can
/// run in a child that shares keel's memory), then the inherited mask. `ignored` is
/// `inherited_ignored()`, read before the clone. Async-signal-safe.
pub fn restore_in_child(mask: &libc::sigset_t, ignored: u64) -> std::io::Result<()> {
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: sigaction is plain data; zeroed is valid to receive the old action.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a null new action only queries the disposition of `sig` into `old`. glibc
        // refuses its own two (32, 33), which it never sends to another process.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            continue;
        }
        let want = if ignored & bit(sig) != 0 {
            libc::SIG_IGN
        } else {
            libc::SIG_DFL
        };
        if old.sa_sigaction != want {
            // SAFETY: setting a disposition to SIG_IGN or SIG_DFL is always valid.
            if unsafe { libc::signal(sig, want) } == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    // SAFETY: `mask` points to a valid sigset_t; no old mask is requested.
    if unsafe { libc::sigprocmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Blocks every signal in the calling thread (call before any other thread exists) and returns
/// a non-blocking signalfd that receives them all.
pub fn block_all() -> Result<Signals, SignalError> {
    if inherited_ignored() & bit(libc::SIGCHLD) != 0 {
        // An ignored SIGCHLD makes the kernel reap children itself: keel would never learn
        // any exit status. Children get the ignored disposition back in `restore_in_child`.
        // SAFETY: setting SIGCHLD to its default disposition is always valid.
        if unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) } == libc::SIG_ERR {
            return Err(SignalError::Block(Errno::last()));
        }
    }
    let all = SigSet::all();
    nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&all), None)
        .map_err(SignalError::Block)?;
    let fd = SignalFd::with_flags(&all, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(SignalError::SignalFd)?;
    Ok(Signals { fd })
}

/// A stop signal (TERM, INT or QUIT) is waiting for keel, blocked and not read yet from the
/// signalfd: a step before the supervisor reads signals (a start that waits for the remote)
/// gives up early for it.
pub fn stop_pending() -> bool {
    let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: `set` is valid writable memory for one sigset_t, which sigpending fills.
    if unsafe { libc::sigpending(set.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: sigpending returned 0, so it initialised the set.
    let set = unsafe { set.assume_init() };
    [libc::SIGTERM, libc::SIGINT, libc::SIGQUIT]
        .into_iter()
        // SAFETY: `set` is an initialised sigset_t and each signal number is valid.
        .any(|sig| unsafe { libc::sigismember(&set, sig) } == 1)
}

/// The signalfd every signal to keel arrives on.
pub struct Signals {
    fd: SignalFd,
}

impl std::fmt::Debug for Signals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signals(fd {})", self.raw_fd())
    }
}

impl Signals {
    fn raw_fd(&self) -> RawFd {
        self.fd.as_fd().as_raw_fd()
    }

    /// Waits until a signal is pending or `timeout` passes (None: forever).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), SignalError> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let t = match timeout {
            None => PollTimeout::NONE,
            Some(d) => {
                // Round up so a deadline 0.4 ms away does not spin.
                let ms = d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, t) {
            Ok(_) | Err(Errno::EINTR) => Ok(()),
            Err(e) => Err(SignalError::Poll(e)),
        }
    }

    /// Every signal currently pending, as (signal number, sending pid).
    pub fn drain(&mut self) -> Result<Vec<(i32, i32)>, SignalError> {
        let mut out = Vec::new();
        loop {
            match self.fd.read_signal() {
                Ok(Some(info)) => out.push((info.ssi_signo as i32, info.ssi_pid as i32)),
                Ok(None) | Err(Errno::EAGAIN) => return Ok(out),
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(SignalError::Read(e)),
            }
        }
    }
}

/// Sends `sig` to one process. ESRCH (already gone) is not an error.
pub fn send(pid: i32, sig: i32) -> Result<(), Errno> {
    raw_kill(pid, sig)
}

/// Sends `sig` to every process of group `pgid`. ESRCH (empty group) is not an error.
pub fn send_group(pgid: i32, sig: i32) -> Result<(), Errno> {
    raw_kill(-pgid, sig)
}

/// Sends `sig` to every process keel may signal except itself (only meaningful as PID 1 of a
/// PID namespace, where that is exactly the container).
pub fn send_all(sig: i32) -> Result<(), Errno> {
    raw_kill(-1, sig)
}

fn raw_kill(target: i32, sig: i32) -> Result<(), Errno> {
    if target == 0 || target == -1 && std::process::id() != 1 {
        // Never signal our own group or the whole host by accident.
        return Err(Errno::EINVAL);
    }
    // SAFETY: kill(2) takes plain integers; real-time signals are passed through unchanged
    // (nix's Signal enum cannot name them).
    let r = unsafe { libc::kill(target, sig) };
    match Errno::result(r) {
        Ok(_) | Err(Errno::ESRCH) => Ok(()),
        Err(e) => Err(e),
    }
}

/// True while at least one process is in group `pgid`.
pub fn group_alive(pgid: i32) -> bool {
    pgid > 0 && nix::sys::signal::kill(Pid::from_raw(-pgid), None) != Err(Errno::ESRCH)
}

/// "SIGTERM" for 15.
pub fn name(sig: i32) -> String {
    Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("SIGRT{sig}"))
}

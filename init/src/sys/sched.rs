//! Threads and the scheduler: a thread's id, its scheduling class (normal or idle), and the
//! CPUs this process may run on.

use std::io;

/// The calling thread's id (what `sched_setscheduler` takes to name one thread).
pub fn thread_id() -> i32 {
    nix::unistd::gettid().as_raw()
}

/// Puts thread `tid` (0: the calling thread) in the idle scheduling class (`SCHED_IDLE`:
/// it runs only when nothing else wants its CPU, and its CPU counts as idle when the
/// scheduler places a task it wakes) or back in the normal one (`SCHED_OTHER`). Leaving
/// the idle class needs CAP_SYS_NICE (or an RLIMIT_NICE of 20): EPERM without it.
pub fn set_idle_class(tid: i32, idle: bool) -> io::Result<()> {
    let policy = if idle {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads one `sched_param` through the pointer, which points at
    // a live local for the duration of the call; it writes nothing back.
    let r = unsafe { libc::sched_setscheduler(tid, policy, &param) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the nice value of thread `tid` (0: the calling thread). Raising it (a lower
/// priority) needs no privilege.
pub fn set_nice(tid: i32, nice: i32) -> io::Result<()> {
    // SAFETY: setpriority takes plain integers and touches no memory of ours.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether thread `tid` (0: the calling thread) is in the idle scheduling class.
pub fn is_idle_class(tid: i32) -> io::Result<bool> {
    // SAFETY: sched_getscheduler takes a thread id and returns a policy or -1; no pointers.
    let p = unsafe { libc::sched_getscheduler(tid) };
    if p < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(p == libc::SCHED_IDLE)
}

/// The CPUs this process may run on (its affinity mask: a container's cpuset).
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    Ok((0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect())
}

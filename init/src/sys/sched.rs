//! Thread priority: lowering a background thread's nice value.

use std::io;

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

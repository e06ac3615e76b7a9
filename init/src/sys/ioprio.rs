//! I/O priority of the calling thread (`ioprio_set(2)`): background work such as a periodic
//! checkpoint's body reads yields the disk to the workspace's own I/O.

use std::io;

/// `IOPRIO_WHO_PROCESS`: with id 0, the calling thread.
const WHO_PROCESS: libc::c_int = 1;
/// `IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT` (level 0; the idle class has no levels).
const CLASS_IDLE: libc::c_int = 3 << 13;

/// Puts the calling thread (and threads it spawns from now on) in the idle I/O class: the
/// block layer's schedulers that know classes (mq-deadline, bfq) serve its requests after
/// everyone else's, with their own bound on how long they wait (`prio_aging_expire`, 10 s by
/// default in mq-deadline). Without such a scheduler it changes nothing. Needs no privilege.
pub fn set_idle_io() -> io::Result<()> {
    // SAFETY: ioprio_set takes three integers and reads no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_set, WHO_PROCESS, 0, CLASS_IDLE) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's raw I/O priority (`ioprio_get(2)`): class in bits 13.., level below.
pub fn io_priority() -> io::Result<i32> {
    // SAFETY: ioprio_get takes two integers and reads no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_get, WHO_PROCESS, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_io_holds_for_the_thread_that_asked_and_threads_it_spawns_only() {
        let before = io_priority().unwrap();
        std::thread::spawn(|| {
            set_idle_io().unwrap();
            assert_eq!(
                io_priority().unwrap() >> 13,
                3,
                "the thread is in the idle class"
            );
            let child = std::thread::spawn(|| io_priority().unwrap())
                .join()
                .unwrap();
            assert_eq!(child >> 13, 3, "a thread spawned after inherits it");
        })
        .join()
        .unwrap();
        assert_eq!(io_priority().unwrap(), before, "other threads keep theirs");
    }
}

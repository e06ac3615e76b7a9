//! Unix socket credentials: who is on the other end of a connection (`SO_PEERCRED`), so the
//! control socket can refuse everyone but keel's own user whatever the file mode says.

use std::io;
use std::os::fd::AsFd;

/// The effective uid of the process that connected `stream`.
pub fn peer_uid(stream: &impl AsFd) -> io::Result<u32> {
    nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map(|c| c.uid())
        .map_err(|e| io::Error::from_raw_os_error(e as i32))
}

/// Whether the process that connected `stream` is in group `gid`: its effective gid at
/// connect time (`SO_PEERCRED`) or one of its supplementary groups (`/proc/<pid>/status`).
pub fn peer_in_group(stream: &impl AsFd, gid: u32) -> io::Result<bool> {
    let c = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    if c.gid() == gid {
        return Ok(true);
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", c.pid()))?;
    Ok(status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid))))
}

/// keel's own effective uid.
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Test helper: a socket file at `path` that nothing ever listened on (`mknod S_IFSOCK`),
/// what a keel that died leaves behind. Binding a listener and dropping it is not the same
/// under a parallel test run: a process another test forks meanwhile holds a copy of the
/// listening fd until it execs, and a connect in that window succeeds, then is reset.
#[cfg(test)]
pub fn dead_socket(path: &std::path::Path) -> io::Result<()> {
    use nix::sys::stat::{mknod, Mode, SFlag};
    mknod(path, SFlag::S_IFSOCK, Mode::from_bits_truncate(0o600), 0)
        .map_err(|e| io::Error::from_raw_os_error(e as i32))
}

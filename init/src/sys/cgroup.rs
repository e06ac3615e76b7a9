//! cgroup v2 groups for processes started through the API: one group per process, below the
//! cgroup keel runs in, so that everything the process starts (a `setsid` or double-forked
//! grandchild included) can be found, signalled and killed (`cgroup.kill`, Linux 5.14+; else
//! every pid of `cgroup.procs`, until none is left) and its CPU time read (`cpu.stat`). The
//! child starts in its group (`clone3` with `CLONE_INTO_CGROUP`), or joins it itself before
//! it execs (`enter_in_child`), so nothing it runs starts outside. Where cgroup v2 is not mounted or not writable (a read-only
//! `/sys/fs/cgroup` in a container), `Root::find` says so and the caller falls back to the
//! process group and session.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};

/// Where keel may create its groups: the directory of keel's own cgroup.
#[derive(Debug, Clone)]
pub struct Root {
    dir: PathBuf,
}

/// Why no group can be made (said once at start).
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup v2 hierarchy is mounted")]
    NotMounted,
    #[error("keel's cgroup v2 path is unknown (/proc/self/cgroup has no 0:: line)")]
    NoPath,
    #[error("{}: {source}", dir.display())]
    Io { dir: PathBuf, source: io::Error },
}

impl Root {
    /// keel's cgroup v2 directory, when keel may create groups in it.
    pub fn find() -> Result<Root, CgroupError> {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let rel = own
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .ok_or(CgroupError::NoPath)?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mnt = mounts
            .lines()
            .find(|l| {
                l.split(" - ")
                    .nth(1)
                    .is_some_and(|t| t.starts_with("cgroup2 "))
            })
            .and_then(|l| l.split(' ').nth(4))
            .ok_or(CgroupError::NotMounted)?;
        let dir = Path::new(mnt).join(rel.trim_start_matches('/'));
        // A probe group says whether groups can be made and entered here.
        let probe = dir.join(format!(".keel-probe-{}", std::process::id()));
        let io = |source| CgroupError::Io {
            dir: dir.clone(),
            source,
        };
        std::fs::create_dir(&probe).map_err(io)?;
        let r = std::fs::metadata(probe.join("cgroup.procs"))
            .map(|_| ())
            .map_err(io);
        let _ = std::fs::remove_dir(&probe);
        r?;
        Ok(Root { dir })
    }

    /// The directory groups are made in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Makes the group `name` (a leftover of that name, empty, is replaced), with the
    /// descriptors a child joins it through (`Join`), to close once the child is spawned.
    pub fn create(&self, name: &str) -> io::Result<(Cgroup, Join)> {
        let dir = self.dir.join(name);
        if dir.exists() {
            std::fs::remove_dir(&dir)?;
        }
        std::fs::create_dir(&dir)?;
        let join = (|| {
            use std::os::unix::fs::OpenOptionsExt;
            let fd = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY)
                .open(&dir)?;
            let procs = std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("cgroup.procs"))?;
            Ok(Join { dir: fd, procs })
        })();
        match join {
            Ok(join) => Ok((Cgroup { dir }, join)),
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                Err(e)
            }
        }
    }
}

/// A new group's directory and its `cgroup.procs`, open: a child starts in the group
/// (`clone3` with `CLONE_INTO_CGROUP` and the directory), or, where clone3 cannot be used (a
/// seccomp profile that refuses it, a kernel before 5.7), writes itself into `cgroup.procs`
/// before it execs (`enter_in_child`).
#[derive(Debug)]
pub struct Join {
    pub dir: File,
    pub procs: File,
}

impl Join {
    /// The raw descriptors a `SpawnSpec` carries (valid while `self` lives).
    pub fn fds(&self) -> JoinFds {
        use std::os::fd::AsRawFd;
        JoinFds {
            dir: self.dir.as_raw_fd(),
            procs: self.procs.as_raw_fd(),
        }
    }
}

/// `Join`'s descriptors, borrowed for a spawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinFds {
    pub dir: RawFd,
    pub procs: RawFd,
}

/// One group; removing it is `remove` (it must be empty).
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
}

impl Cgroup {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The pids in the group now.
    pub fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// True while a process is in the group (`cgroup.events`: `populated 1`). Processes
    /// that have exited (zombies not reaped yet) no longer count.
    pub fn populated(&self) -> bool {
        match std::fs::read_to_string(self.dir.join("cgroup.events")) {
            Ok(t) => t.lines().any(|l| l.trim() == "populated 1"),
            Err(_) => !self.pids().is_empty(),
        }
    }

    /// Sends `sig` to every process in the group.
    pub fn signal(&self, sig: i32) {
        for pid in self.pids() {
            let _ = super::signal::send(pid, sig);
        }
    }

    /// SIGKILL to everything in the group, forks racing with it included: `cgroup.kill`
    /// where the kernel has it (5.14+), else every listed pid until the group is empty.
    pub fn kill(&self) {
        let killed = std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.kill"))
            .and_then(|mut f| f.write_all(b"1"));
        if killed.is_ok() {
            return;
        }
        for _ in 0..1000 {
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            for pid in pids {
                let _ = super::signal::send(pid, libc::SIGKILL);
            }
        }
    }

    /// CPU time of everything that ran in the group (`cpu.stat` `usage_usec`).
    pub fn cpu(&self) -> Option<std::time::Duration> {
        let t = std::fs::read_to_string(self.dir.join("cpu.stat")).ok()?;
        let us: u64 = t
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))?
            .trim()
            .parse()
            .ok()?;
        Some(std::time::Duration::from_micros(us))
    }

    /// Peak memory of the group, KiB (`memory.peak`, only with the memory controller).
    pub fn memory_peak_kib(&self) -> Option<u64> {
        let t = std::fs::read_to_string(self.dir.join("memory.peak")).ok()?;
        t.trim().parse::<u64>().ok().map(|b| b / 1024)
    }

    /// Removes the (empty) group.
    pub fn remove(&self) -> io::Result<()> {
        std::fs::remove_dir(&self.dir)
    }
}

/// In the child before exec (where it could not start in its group): moves the calling
/// process into the group whose `cgroup.procs` is open as `procs` ("0" names the writer).
/// Async-signal-safe.
pub fn enter_in_child(procs: RawFd) -> io::Result<()> {
    // SAFETY: writes one byte from a static buffer to an fd the parent opened for us.
    if unsafe { libc::write(procs, b"0".as_ptr().cast(), 1) } != 1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

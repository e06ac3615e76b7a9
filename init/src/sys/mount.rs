//! Mounts: which paths are mount points, mounting /proc and tmpfs where the runtime did not,
//! probing /dev/fuse, and the last-resort lazy unmount.

use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("mount {fstype} on {path}: {source}")]
    Mount {
        fstype: String,
        path: PathBuf,
        source: Errno,
    },
    #[error("unmount {path}: {source}")]
    Unmount { path: PathBuf, source: Errno },
}

/// True when /proc holds a mounted procfs.
pub fn proc_mounted() -> bool {
    nix::sys::statfs::statfs("/proc")
        .map(|s| s.filesystem_type() == nix::sys::statfs::PROC_SUPER_MAGIC)
        .unwrap_or(false)
}

/// Mount points from /proc/self/mountinfo (unescaped), in mount order.
pub fn mount_points() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .collect()
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn mount_proc() -> Result<(), MountError> {
    std::fs::create_dir_all("/proc").ok();
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("proc"), "/proc", Some("proc"), flags, None::<&str>).map_err(|source| {
        MountError::Mount {
            fstype: "proc".into(),
            path: "/proc".into(),
            source,
        }
    })
}

/// Mounts a tmpfs on `path` (created if missing) with `mode` and extra flags.
pub fn mount_tmpfs(path: &Path, mode: u32, noexec: bool) -> Result<(), MountError> {
    let err = |source| MountError::Mount {
        fstype: "tmpfs".into(),
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(path)
        .map_err(|e| err(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))))?;
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if noexec {
        flags |= MsFlags::MS_NOEXEC;
    }
    let data = format!("mode={mode:o}");
    mount(
        Some("tmpfs"),
        path,
        Some("tmpfs"),
        flags,
        Some(data.as_str()),
    )
    .map_err(err)
}

/// Detaches a mount even while busy (used when a flush did not finish in time).
pub fn unmount_lazy(path: &Path) -> Result<(), MountError> {
    umount2(path, MntFlags::MNT_DETACH).map_err(|source| MountError::Unmount {
        path: path.to_path_buf(),
        source,
    })
}

/// Why /dev/fuse cannot be used, or Ok when it is the FUSE device (char 10:229) and opens
/// read-write.
pub fn probe_dev_fuse() -> Result<(), std::io::Error> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::metadata("/dev/fuse")?;
    let rdev = m.rdev();
    if !m.file_type().is_char_device() || (libc::major(rdev), libc::minor(rdev)) != (10, 229) {
        return Err(std::io::Error::other(
            "not the FUSE character device 10:229",
        ));
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map(|_| ())
}

/// Mounts the FUSE connection open on `dev` at `target` (mount(2); needs CAP_SYS_ADMIN):
/// type `fuse`, source `source`, with suid and device files allowed, `allow_other` and
/// `default_permissions` (the kernel checks permissions; keel serves every user).
pub fn mount_fuse(
    dev: std::os::fd::BorrowedFd<'_>,
    target: &Path,
    source: &str,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::PermissionsExt;
    let rootmode = std::fs::metadata(target)?.permissions().mode() & libc::S_IFMT;
    let data = format!(
        "fd={},rootmode={:o},user_id={},group_id={},default_permissions,allow_other",
        dev.as_raw_fd(),
        rootmode,
        nix::unistd::getuid(),
        nix::unistd::getgid()
    );
    mount(
        Some(source),
        target,
        Some("fuse"),
        MsFlags::empty(),
        Some(data.as_str()),
    )
    .map_err(|e| std::io::Error::from_raw_os_error(e as i32))
}

/// `umount2(target, 0)`: fails with EBUSY while something still uses the mount.
pub fn unmount(target: &Path) -> std::io::Result<()> {
    umount2(target, MntFlags::empty()).map_err(|e| std::io::Error::from_raw_os_error(e as i32))
}

/// A FUSE mount as /proc/self/mountinfo shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FuseMount {
    /// The minor of its device number: the name of its connection's directory under
    /// /sys/fs/fuse/connections.
    pub minor: u32,
    /// The mount's source (keel's is `keel:<state dir>` unless set; older keels' `keel`).
    pub source: String,
}

/// The FUSE mount at `path` (the topmost mount there), read from /proc/self/mountinfo
/// without touching the path itself. None when the topmost mount there is not FUSE.
pub fn fuse_connection_at(path: &Path) -> Option<FuseMount> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    fuse_connection_in(&text, path)
}

fn fuse_connection_in(mountinfo: &str, path: &Path) -> Option<FuseMount> {
    let want = path.to_string_lossy();
    let mut found = None;
    for l in mountinfo.lines() {
        let f: Vec<&str> = l.split(' ').collect();
        let Some(sep) = f.iter().position(|x| *x == "-") else {
            continue;
        };
        if f.len() < 5 || unescape(f[4]) != want {
            continue;
        }
        let fstype = f.get(sep + 1).copied().unwrap_or("");
        // Later lines are mounted on top of earlier ones: the last one at the path wins.
        found = if fstype == "fuse" || fstype.starts_with("fuse.") {
            f[2].split_once(':')
                .and_then(|(_, minor)| minor.parse().ok())
                .map(|minor| FuseMount {
                    minor,
                    source: unescape(f.get(sep + 2).copied().unwrap_or("")),
                })
        } else {
            None
        };
    }
    found
}

/// Aborts FUSE connection `minor` (`/sys/fs/fuse/connections/<minor>/abort`): every request
/// waiting on it, and every later one, fails with ENOTCONN instead of waiting for a daemon
/// that is gone. Needs the fusectl filesystem; mounts it at /sys/fs/fuse/connections when
/// it is not there yet.
pub fn abort_fuse_connection(minor: u32) -> std::io::Result<()> {
    let dir = Path::new("/sys/fs/fuse/connections");
    let abort = dir.join(minor.to_string()).join("abort");
    if !abort.exists() && dir.is_dir() {
        let _ = mount(
            Some("fusectl"),
            dir,
            Some("fusectl"),
            MsFlags::empty(),
            None::<&str>,
        );
    }
    std::fs::write(&abort, b"1")
}

#[cfg(test)]
mod fuse_tests {
    use super::*;

    #[test]
    fn finds_the_topmost_fuse_mount_at_a_path() {
        let mi = "22 1 0:21 / /work rw - ext4 /dev/sda rw\n\
                  90 22 0:77 / /work/m rw,nosuid - fuse keel rw,user_id=0\n\
                  91 90 0:78 / /work/m rw - tmpfs t rw\n\
                  92 22 0:79 / /work/a\\040b rw - fuse.sshfs x rw\n";
        assert_eq!(fuse_connection_in(mi, Path::new("/work/m")), None);
        let sshfs = FuseMount {
            minor: 79,
            source: "x".into(),
        };
        assert_eq!(fuse_connection_in(mi, Path::new("/work/a b")), Some(sshfs));
        let below = &mi[..mi.find("91 ").unwrap()];
        let keel = FuseMount {
            minor: 77,
            source: "keel".into(),
        };
        assert_eq!(fuse_connection_in(below, Path::new("/work/m")), Some(keel));
        assert_eq!(fuse_connection_in(mi, Path::new("/work")), None);
    }
}

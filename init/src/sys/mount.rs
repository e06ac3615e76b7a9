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

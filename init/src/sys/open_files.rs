//! The files processes hold open now, read from /proc: each descriptor's target
//! (`/proc/PID/fd`) and each shared mapping's file (`/proc/PID/maps`; a mapping keeps its
//! file open after the descriptor is closed). The `dir` provider's change notification asks
//! this for the opens it cannot have seen as events (made before a directory was watched).
//! The paths are as this process sees them (the kernel prints a path relative to the
//! reader's root); a process whose entries this one may not read (another user's, without
//! root) is left out, as is one that exits while it is read.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The paths below `root` (absolute, as `root` is spelled: canonicalize it first) of the
/// files open in any process readable here: descriptors of any kind, shared mappings only
/// (a private mapping never writes its file). A path may end in " (deleted)" for a file
/// removed since it was opened. Fails only when /proc itself cannot be listed.
pub fn open_below(root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc")?.flatten() {
        let name = e.file_name();
        if !name.as_bytes().iter().all(u8::is_ascii_digit) {
            continue;
        }
        let dir = e.path();
        if let Ok(fds) = std::fs::read_dir(dir.join("fd")) {
            for fd in fds.flatten() {
                if let Ok(target) = std::fs::read_link(fd.path()) {
                    if target.starts_with(root) {
                        out.push(target);
                    }
                }
            }
        }
        if let Ok(maps) = std::fs::read(dir.join("maps")) {
            out.extend(
                maps.split(|b| *b == b'\n')
                    .filter_map(shared_mapping_path)
                    .filter(|p| p.starts_with(root)),
            );
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The file of one `/proc/PID/maps` line when the mapping is shared: "start-end perms
/// offset dev inode" separated by single spaces, then padding and the path (none for an
/// anonymous mapping).
fn shared_mapping_path(line: &[u8]) -> Option<PathBuf> {
    let mut f = line.splitn(6, |b| *b == b' ');
    let perms = f.nth(1)?;
    if perms.get(3) != Some(&b's') {
        return None;
    }
    let rest = f.nth(3)?;
    let start = rest.iter().position(|b| *b != b' ')?;
    let path = &rest[start..];
    (path.first() == Some(&b'/')).then(|| PathBuf::from(OsStr::from_bytes(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_mapping_line_names_its_file_and_others_do_not() {
        let shared = b"7f00-7f10 rw-s 00000000 08:01 1234                       /w/a b/c";
        assert_eq!(shared_mapping_path(shared), Some(PathBuf::from("/w/a b/c")));
        let private = b"7f00-7f10 rw-p 00000000 08:01 1234                       /w/lib.so";
        assert_eq!(shared_mapping_path(private), None);
        let anon = b"7f00-7f10 rw-s 00000000 00:01 99 ";
        assert_eq!(shared_mapping_path(anon), None);
        assert_eq!(shared_mapping_path(b""), None);
    }

    #[test]
    fn a_file_this_process_maps_shared_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        let path = root.join("sub").join("mapped");
        std::fs::create_dir(root.join("sub")).unwrap();
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        assert_eq!(open_below(&root).unwrap(), vec![path.clone()]);
        // SAFETY: a new shared mapping of the first page of the open file, at an address
        // the kernel picks; it is never read or written, only unmapped below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        drop(file);
        // Closed: only the mapping holds it now.
        assert_eq!(open_below(&root).unwrap(), vec![path.clone()]);
        // SAFETY: unmaps exactly the mapping made above, not used after this.
        assert_eq!(unsafe { libc::munmap(addr, 4096) }, 0);
        assert_eq!(open_below(&root).unwrap(), Vec::<PathBuf>::new());
    }
}

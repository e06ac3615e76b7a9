//! The files processes hold open now, read from /proc: each descriptor's target
//! (`/proc/PID/fd`) and each shared mapping's file (`/proc/PID/maps`; a mapping keeps its
//! file open after the descriptor is closed). The `dir` provider's change notification asks
//! this for the opens it cannot have seen as events (made before a directory was watched).
//! The paths are as this process sees them (the kernel prints a path relative to the
//! reader's root). Only the parent directories of the files below the tree are kept, in a
//! set filled while reading, and the entries read are capped per process and in all: a
//! sandboxed process can hold one file open a million times in many processes, which costs
//! the kernel a few bytes each and must not cost keel a path each.
//!
//! Reading another process's `fd` and `maps` takes ptrace access to it: the same uid (and
//! a dumpable process), or `CAP_SYS_PTRACE`, which container runtimes drop by default. So
//! a keel that is not root, and equally a root keel without that capability whose `[init]
//! user` is not root, may see none of the sandbox's processes. Such a process is counted
//! ([`Scan::denied`]) rather than skipped silently, so the caller knows the scan cannot
//! vouch for every open; one that exits while it is read is left out (its opens are gone).

use std::collections::HashSet;
use std::ffi::OsStr;
use std::io::{self, BufRead};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// How many entries (descriptors plus `maps` lines) a scan reads, per process and in all,
/// before it stops and says it could not finish ([`Scan::capped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub per_process: usize,
    pub total: usize,
}

impl Default for Caps {
    /// Far above what real programs hold (a browser or a JVM has a few thousand of each;
    /// `vm.max_map_count` is 65,530 by default), low enough that a pass stays a few
    /// seconds of system time.
    fn default() -> Caps {
        Caps {
            per_process: 1 << 17,
            total: 1 << 21,
        }
    }
}

/// What one pass over /proc found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Scan {
    /// The directories (absolute, as `root` is spelled) holding a file open in a process
    /// readable here.
    pub dirs: HashSet<PathBuf>,
    /// Processes whose `fd` or `maps` this one may not read (their opens are unknown).
    pub denied: usize,
    /// A cap of [`Caps`] was reached: some entries were not read.
    pub capped: bool,
}

/// The parent directories of the files below `root` (absolute, as `root` is spelled:
/// canonicalize it first) open in any process readable here: descriptors of any kind,
/// shared mappings only (a private mapping never writes its file). A file removed since it
/// was opened still names its directory. Fails only when /proc itself cannot be listed.
pub fn open_dirs_below(root: &Path, caps: Caps) -> io::Result<Scan> {
    let mut scan = Scan::default();
    let mut left = caps.total;
    for e in std::fs::read_dir("/proc")?.flatten() {
        let name = e.file_name();
        if !name.as_bytes().iter().all(u8::is_ascii_digit) {
            continue;
        }
        let mut budget = caps.per_process.min(left);
        let before = budget;
        let dir = e.path();
        let fds = read_fds(&dir.join("fd"), root, &mut budget, &mut scan.dirs);
        let maps = read_maps(&dir.join("maps"), root, &mut budget, &mut scan.dirs);
        left -= before - budget;
        match (fds, maps) {
            (Read::Capped, _) | (_, Read::Capped) => {
                scan.capped = true;
                return Ok(scan);
            }
            (Read::Denied, _) | (_, Read::Denied) => scan.denied += 1,
            _ => {}
        }
    }
    Ok(scan)
}

/// How reading one process's `fd` or `maps` ended.
#[derive(Debug, PartialEq, Eq)]
enum Read {
    /// Read whole, or the process was gone.
    Done,
    /// This process may not read it.
    Denied,
    /// The budget ran out first.
    Capped,
}

/// Whether `e` says this process may not read another's entries, as opposed to the
/// process having exited (`ENOENT`, `ESRCH`) since /proc was listed.
fn is_denied(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM))
}

fn keep_parent(path: &Path, root: &Path, dirs: &mut HashSet<PathBuf>) {
    if path.starts_with(root) {
        if let Some(d) = path.parent() {
            if !dirs.contains(d) {
                dirs.insert(d.to_path_buf());
            }
        }
    }
}

fn read_fds(fd_dir: &Path, root: &Path, budget: &mut usize, dirs: &mut HashSet<PathBuf>) -> Read {
    let list = match std::fs::read_dir(fd_dir) {
        Ok(l) => l,
        Err(e) if is_denied(&e) => return Read::Denied,
        Err(_) => return Read::Done,
    };
    for fd in list {
        let fd = match fd {
            Ok(fd) => fd,
            Err(e) if is_denied(&e) => return Read::Denied,
            // The process exited while its descriptors were listed.
            Err(_) => return Read::Done,
        };
        if *budget == 0 {
            return Read::Capped;
        }
        *budget -= 1;
        match std::fs::read_link(fd.path()) {
            Ok(target) => keep_parent(&target, root, dirs),
            Err(e) if is_denied(&e) => return Read::Denied,
            // Closed since it was listed.
            Err(_) => {}
        }
    }
    Read::Done
}

fn read_maps(maps: &Path, root: &Path, budget: &mut usize, dirs: &mut HashSet<PathBuf>) -> Read {
    // The permission check is made when the file is opened (and again when read).
    let file = match std::fs::File::open(maps) {
        Ok(f) => f,
        Err(e) if is_denied(&e) => return Read::Denied,
        Err(_) => return Read::Done,
    };
    let mut r = io::BufReader::new(file);
    let mut line = Vec::new();
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) => return Read::Done,
            Ok(_) => {}
            Err(e) if is_denied(&e) => return Read::Denied,
            Err(_) => return Read::Done,
        }
        if *budget == 0 {
            return Read::Capped;
        }
        *budget -= 1;
        let l = line.strip_suffix(b"\n").unwrap_or(&line);
        if let Some(p) = shared_mapping_path(l) {
            keep_parent(&p, root, dirs);
        }
    }
}

/// The file of one `/proc/PID/maps` line when the mapping is shared: "start-end perms
/// offset dev inode" separated by single spaces, then padding and the path (none for an
/// anonymous mapping). The kernel writes a newline in the path as `\012` (and nothing else
/// escaped, not even a backslash), so a backslash and three octal digits are one byte.
fn shared_mapping_path(line: &[u8]) -> Option<PathBuf> {
    let mut f = line.splitn(6, |b| *b == b' ');
    let perms = f.nth(1)?;
    if perms.get(3) != Some(&b's') {
        return None;
    }
    let rest = f.nth(3)?;
    let start = rest.iter().position(|b| *b != b' ')?;
    let path = &rest[start..];
    (path.first() == Some(&b'/')).then(|| PathBuf::from(OsStr::from_bytes(&unescape(path))))
}

/// `path` with each `\` followed by three octal digits (at most `\377`) made the byte they
/// spell.
fn unescape(path: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < path.len() {
        if path[i] == b'\\' {
            if let Some(&[a, b, c]) = path.get(i + 1..i + 4) {
                let octal = |d: u8| (b'0'..=b'7').contains(&d);
                if octal(a) && octal(b) && octal(c) && a <= b'3' {
                    out.push((a - b'0') << 6 | (b - b'0') << 3 | (c - b'0'));
                    i += 4;
                    continue;
                }
            }
        }
        out.push(path[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dirs(v: &[&Path]) -> HashSet<PathBuf> {
        v.iter().map(|p| p.to_path_buf()).collect()
    }

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
    fn a_newline_escaped_in_a_mapping_path_is_unescaped() {
        let line = b"7f00-7f10 rw-s 00000000 08:01 1234      /w/a\\012b/c (deleted)";
        assert_eq!(
            shared_mapping_path(line),
            Some(PathBuf::from("/w/a\nb/c (deleted)"))
        );
        // Not an octal escape: kept as written.
        assert_eq!(unescape(b"/w/a\\0x\\9\\400\\01"), b"/w/a\\0x\\9\\400\\01");
        assert_eq!(unescape(b"\\134\\011"), b"\\\t");
    }

    #[test]
    fn permission_errors_count_as_denied_and_an_exit_does_not() {
        assert!(is_denied(&io::Error::from_raw_os_error(libc::EACCES)));
        assert!(is_denied(&io::Error::from_raw_os_error(libc::EPERM)));
        assert!(!is_denied(&io::Error::from_raw_os_error(libc::ENOENT)));
        assert!(!is_denied(&io::Error::from_raw_os_error(libc::ESRCH)));
    }

    #[test]
    fn many_descriptors_of_one_file_are_one_directory_and_a_cap_stops_the_scan() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::create_dir(root.join("sub")).unwrap();
        let path = root.join("sub").join("f");
        std::fs::write(&path, b"x").unwrap();
        let files: Vec<_> = (0..64)
            .map(|_| std::fs::File::open(&path).unwrap())
            .collect();
        let all = open_dirs_below(&root, Caps::default()).unwrap();
        assert!(!all.capped);
        assert_eq!(all.dirs, dirs(&[&root.join("sub")]));
        // This process alone holds more than 64 descriptors and lines of maps.
        let per = open_dirs_below(
            &root,
            Caps {
                per_process: 64,
                total: usize::MAX,
            },
        )
        .unwrap();
        assert!(per.capped);
        let total = open_dirs_below(
            &root,
            Caps {
                per_process: usize::MAX,
                total: 64,
            },
        )
        .unwrap();
        assert!(total.capped);
        drop(files);
    }

    #[test]
    fn a_file_this_process_maps_shared_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        let sub = root.join("sub");
        let path = sub.join("mapped");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let found = || open_dirs_below(&root, Caps::default()).unwrap().dirs;
        assert_eq!(found(), dirs(&[&sub]));
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
        assert_eq!(found(), dirs(&[&sub]));
        // SAFETY: unmaps exactly the mapping made above, not used after this.
        assert_eq!(unsafe { libc::munmap(addr, 4096) }, 0);
        assert_eq!(found(), HashSet::new());
    }
}

//! The sandbox's mount namespace: one namespace, made once, that every process keel starts
//! joins (`setns`) between fork and exec. In it the state dir, a local `file://` remote and the
//! credentials file are covered by empty read-only mounts, and the control socket's directory
//! is read-only (a control socket inside a covered directory, as a keel that is not PID 1
//! keeps it in the state dir, is bound into the cover at the same path, read-only);
//! children have no CAP_SYS_ADMIN, so they cannot uncover or replace anything. Its mounts
//! are slaves of keel's: a mount keel makes or removes later (the workspace) reaches the
//! sandbox when the parent mount is shared, nothing the sandbox does reaches keel. Also here:
//! `PR_SET_DUMPABLE`, which keeps ptrace and keel's `/proc/<pid>/{mem,root,cwd,fd}` links
//! away from processes without CAP_SYS_PTRACE, root included.
//!
//! unshare(CLONE_NEWNS) is refused to a multi-threaded process, and keel has threads by the
//! time it starts children, so a forked helper (single-threaded, async-signal-safe calls only)
//! makes the namespace, keel keeps an fd to it, and the helper exits.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum NsError {
    #[error("sandbox namespace: {} contains a NUL byte", path.display())]
    Nul { path: PathBuf },
    #[error("sandbox namespace: pipe: {0}")]
    Pipe(std::io::Error),
    #[error("sandbox namespace: fork: {0}")]
    Fork(std::io::Error),
    #[error("sandbox namespace: {step}: {source}")]
    Setup {
        step: String,
        source: std::io::Error,
    },
    #[error("sandbox namespace: the helper process ended without a word")]
    HelperGone,
    #[error("sandbox namespace: open {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("make {} a shared mount: {source}", path.display())]
    Share {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How one path looks inside the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cover {
    /// A directory: covered by an empty read-only tmpfs.
    EmptyDir,
    /// A file: covered by a read-only bind of `/dev/null` (reads as empty).
    EmptyFile,
    /// A directory bound onto itself read-only (sockets in it still connect).
    ReadOnly,
    /// A socket inside a directory covered (`EmptyDir`) before it: bound into that cover
    /// at the same path, read-only (it still connects; it cannot be replaced or chmod'ed).
    Socket,
}

/// A mount namespace for children; dropping it closes keel's reference (the namespace ends
/// with its last process).
#[derive(Debug)]
pub struct SandboxNs {
    fd: OwnedFd,
}

impl SandboxNs {
    /// The fd children `setns` into.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// A second reference to the namespace (for processes started later, elsewhere).
    pub fn try_clone(&self) -> std::io::Result<SandboxNs> {
        Ok(SandboxNs {
            fd: self.fd.try_clone()?,
        })
    }
}

/// One cover, prepared before the fork (the helper may not allocate).
struct Prep {
    path: CString,
    cover: Cover,
    /// `Socket`: its slot among the sockets (the helper opens it, in the new namespace,
    /// before the cover hides the path), the index of its cover, and the directories to
    /// make inside the cover on the way to it.
    slot: usize,
    under: usize,
    dirs: Vec<CString>,
}

/// Sockets bound into covers, at most (keel has one control socket).
const MAX_SOCKETS: usize = 4;

fn cstring(p: &Path) -> Result<CString, NsError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| NsError::Nul {
        path: p.to_path_buf(),
    })
}

/// Makes the namespace: a copy of keel's, every mount a slave, then `covers` applied in
/// order. A path that does not exist, or lies under a directory covered before it, is skipped
/// (the caller creates what must be covered), except a `Socket`, which only counts under such
/// a directory. A file is covered by a read-only bind of an empty file in a tmpfs hidden
/// under the first covered directory, so writes fail too.
pub fn make_sandbox_ns(covers: &[(PathBuf, Cover)]) -> Result<SandboxNs, NsError> {
    let mut prepared: Vec<Prep> = Vec::new();
    let mut dirs: Vec<(&Path, usize)> = Vec::new();
    let mut sockets = 0;
    for (p, c) in covers {
        if std::fs::symlink_metadata(p).is_err() {
            continue;
        }
        let inside = dirs
            .iter()
            .find(|(d, _)| p.starts_with(d))
            .map(|(d, i)| (*d, *i));
        let mut prep = Prep {
            path: cstring(p)?,
            cover: *c,
            slot: 0,
            under: 0,
            dirs: Vec::new(),
        };
        match (c, inside) {
            (Cover::Socket, None)
            | (Cover::EmptyDir | Cover::EmptyFile | Cover::ReadOnly, Some(_)) => continue,
            (Cover::Socket, Some(_)) if sockets == MAX_SOCKETS => continue,
            (Cover::Socket, Some((d, i))) => {
                prep.slot = sockets;
                sockets += 1;
                prep.under = i;
                let mut between: Vec<&Path> = p
                    .ancestors()
                    .skip(1)
                    .take_while(|a| *a != d && a.starts_with(d))
                    .collect();
                between.reverse();
                prep.dirs = between.into_iter().map(cstring).collect::<Result<_, _>>()?;
            }
            (Cover::EmptyDir, None) => dirs.push((p, prepared.len())),
            _ => {}
        }
        prepared.push(prep);
    }
    let scratch = match dirs.first() {
        Some((d, _)) => cstring(&d.join(".keel-empty"))?,
        None => c"/dev/null".to_owned(),
    };
    let make_scratch = !dirs.is_empty();
    let (ready_r, ready_w) = pipe()?;
    let (hold_r, hold_w) = pipe()?;
    // SAFETY: the child only makes async-signal-safe syscalls on memory prepared above and
    // never returns into Rust code (it ends with _exit).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(NsError::Fork(std::io::Error::last_os_error()));
    }
    if pid == 0 {
        drop(ready_r);
        drop(hold_w);
        let (step, err) = match build_in_child(&prepared, &scratch, make_scratch) {
            Ok(()) => (0u32, 0i32),
            Err(e) => e,
        };
        let mut b = [0u8; 8];
        b[..4].copy_from_slice(&step.to_ne_bytes());
        b[4..].copy_from_slice(&err.to_ne_bytes());
        // SAFETY: writes a local buffer to our pipe, then (on success) blocks until keel closes
        // the other pipe, then exits without running any destructor or atexit handler.
        unsafe {
            // A fork of a non-dumpable keel is not dumpable either, and then keel could not
            // open its /proc/<pid>/ns/mnt without CAP_SYS_PTRACE (containers lack it). No
            // process keel starts exists yet while the helper lives.
            libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0);
            libc::write(ready_w.as_raw_fd(), b.as_ptr().cast(), 8);
            if step == 0 {
                let mut c = [0u8; 1];
                while libc::read(hold_r.as_raw_fd(), c.as_mut_ptr().cast(), 1) < 0
                    && *libc::__errno_location() == libc::EINTR
                {}
            }
            libc::_exit(if step == 0 { 0 } else { 1 });
        }
    }
    drop(ready_w);
    drop(hold_r);
    let mut buf = [0u8; 8];
    let n = read_full(&ready_r, &mut buf);
    let result = if n == 8 {
        let step = u32::from_ne_bytes(buf[..4].try_into().expect("4 bytes"));
        let err = i32::from_ne_bytes(buf[4..].try_into().expect("4 bytes"));
        if step == 0 {
            let path = format!("/proc/{pid}/ns/mnt");
            std::fs::File::open(&path)
                .map(|f| SandboxNs { fd: f.into() })
                .map_err(|source| NsError::Open { path, source })
        } else {
            Err(NsError::Setup {
                step: step_name(step, &prepared, &scratch),
                source: std::io::Error::from_raw_os_error(err),
            })
        }
    } else {
        Err(NsError::HelperGone)
    };
    drop(hold_w);
    let mut status = 0;
    // SAFETY: waits for our own helper child by pid; `status` is a local.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
    {}
    result
}

/// `/proc/self/fd/<fd>` into `buf`, NUL-terminated, without allocating (for the helper).
fn fd_path(fd: libc::c_int, buf: &mut [u8; 32]) -> *const libc::c_char {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    buf[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 10];
    let (mut n, mut len) = (fd.max(0) as u32, 0);
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..len {
        buf[PREFIX.len() + i] = digits[len - 1 - i];
    }
    buf[PREFIX.len() + len] = 0;
    buf.as_ptr().cast()
}

/// Step numbers reported by the helper: 1 unshare, 2 slave, 3 the empty file's tmpfs and file,
/// `10 + 4*i + k` for cover `i` (k = 0 mount, 1 make read-only, 2 make the socket's mount
/// point inside its cover, 3 open the socket).
fn step_name(step: u32, prepared: &[Prep], scratch: &CString) -> String {
    match step {
        1 => "unshare(CLONE_NEWNS)".into(),
        2 => "make every mount a slave of keel's".into(),
        3 => format!("create {}", scratch.to_string_lossy()),
        s => {
            let i = ((s - 10) / 4) as usize;
            let Some(p) = prepared.get(i) else {
                return format!("step {s}");
            };
            let verb = match (p.cover, (s - 10) % 4) {
                (Cover::EmptyDir, 0) => "cover with an empty tmpfs",
                (Cover::EmptyFile, 0) => "cover with an empty file",
                (Cover::ReadOnly, 0) => "bind onto itself",
                (Cover::Socket, 0) => "bind into its cover",
                (Cover::Socket, 2) => "make a mount point in its cover for",
                (Cover::Socket, 3) => "open",
                _ => "make read-only",
            };
            format!("{verb} {}", p.path.to_string_lossy())
        }
    }
}

/// The helper's work, in the forked child: only syscalls on prepared memory (no allocation).
fn build_in_child(
    prepared: &[Prep],
    scratch: &CString,
    make_scratch: bool,
) -> Result<(), (u32, i32)> {
    let null = std::ptr::null::<libc::c_char>();
    // SAFETY: errno is thread-local and always valid to read.
    let errno = || unsafe { *libc::__errno_location() };
    let ok = |r: libc::c_int, step: u32| if r == 0 { Ok(()) } else { Err((step, errno())) };
    let hidden = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    let ro_bind = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | hidden;
    // SAFETY: every pointer passed below is a live NUL-terminated string or null where the
    // syscall allows it; the calls are async-signal-safe.
    unsafe {
        ok(libc::unshare(libc::CLONE_NEWNS), 1)?;
        ok(
            libc::mount(
                null,
                c"/".as_ptr(),
                null,
                libc::MS_REC | libc::MS_SLAVE,
                null.cast(),
            ),
            2,
        )?;
        // The sockets to bind into covers, opened here (a mount of keel's namespace cannot be
        // the source of a bind in this one) while their paths are not covered yet.
        let mut fds: [libc::c_int; MAX_SOCKETS] = [-1; MAX_SOCKETS];
        for (j, sock) in prepared.iter().enumerate() {
            if sock.cover == Cover::Socket {
                let fd = libc::open(
                    sock.path.as_ptr(),
                    libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                );
                if fd < 0 {
                    return Err((10 + j as u32 * 4 + 3, errno()));
                }
                fds[sock.slot] = fd;
            }
        }
        // The empty file for file covers lives in a tmpfs that ends up under the first
        // directory cover (hidden below it; never unlinked, which would keep it busy).
        if make_scratch && prepared.iter().any(|p| p.cover == Cover::EmptyFile) {
            let dir = prepared.iter().find(|p| p.cover == Cover::EmptyDir);
            if let Some(d) = dir {
                ok(
                    libc::mount(
                        c"tmpfs".as_ptr(),
                        d.path.as_ptr(),
                        c"tmpfs".as_ptr(),
                        hidden,
                        c"mode=0700,size=4k".as_ptr().cast(),
                    ),
                    3,
                )?;
            }
            let fd = libc::open(
                scratch.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                0o444,
            );
            if fd < 0 {
                return Err((3, errno()));
            }
            libc::close(fd);
        }
        for (i, p) in prepared.iter().enumerate() {
            let step = 10 + i as u32 * 4;
            let src = match p.cover {
                Cover::EmptyDir | Cover::Socket => continue,
                Cover::ReadOnly => p.path.as_ptr(),
                Cover::EmptyFile => scratch.as_ptr(),
            };
            ok(
                libc::mount(src, p.path.as_ptr(), null, libc::MS_BIND, null.cast()),
                step,
            )?;
            ok(
                libc::mount(null, p.path.as_ptr(), null, ro_bind, null.cast()),
                step + 1,
            )?;
        }
        for (i, d) in prepared.iter().enumerate() {
            if d.cover != Cover::EmptyDir {
                continue;
            }
            let step = 10 + i as u32 * 4;
            let sockets = || {
                prepared
                    .iter()
                    .enumerate()
                    .filter(move |(_, s)| s.cover == Cover::Socket && s.under == i)
            };
            if sockets().next().is_none() {
                ok(
                    libc::mount(
                        c"tmpfs".as_ptr(),
                        d.path.as_ptr(),
                        c"tmpfs".as_ptr(),
                        libc::MS_RDONLY | hidden,
                        c"mode=0755,size=4k".as_ptr().cast(),
                    ),
                    step,
                )?;
                continue;
            }
            // Writable until the sockets are in place, then read-only like the others.
            ok(
                libc::mount(
                    c"tmpfs".as_ptr(),
                    d.path.as_ptr(),
                    c"tmpfs".as_ptr(),
                    hidden,
                    c"mode=0755,size=4k".as_ptr().cast(),
                ),
                step,
            )?;
            for (j, s) in sockets() {
                let sstep = 10 + j as u32 * 4;
                for dir in &s.dirs {
                    if libc::mkdir(dir.as_ptr(), 0o755) != 0 && errno() != libc::EEXIST {
                        return Err((sstep + 2, errno()));
                    }
                }
                let fd = libc::open(
                    s.path.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                    0o600,
                );
                if fd < 0 {
                    return Err((sstep + 2, errno()));
                }
                libc::close(fd);
                let mut buf = [0u8; 32];
                let src = fd_path(fds[s.slot], &mut buf);
                ok(
                    libc::mount(src, s.path.as_ptr(), null, libc::MS_BIND, null.cast()),
                    sstep,
                )?;
                ok(
                    libc::mount(null, s.path.as_ptr(), null, ro_bind, null.cast()),
                    sstep + 1,
                )?;
            }
            ok(
                libc::mount(
                    null,
                    d.path.as_ptr(),
                    null,
                    libc::MS_REMOUNT | libc::MS_RDONLY | hidden,
                    null.cast(),
                ),
                step + 1,
            )?;
        }
    }
    Ok(())
}

fn pipe() -> Result<(OwnedFd, OwnedFd), NsError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the local array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(NsError::Pipe(std::io::Error::last_os_error()));
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn read_full(fd: &OwnedFd, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        // SAFETY: reads into the unfilled tail of a live buffer.
        let r = unsafe { libc::read(fd.as_raw_fd(), buf[n..].as_mut_ptr().cast(), buf.len() - n) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if r <= 0 {
            break;
        }
        n += r as usize;
    }
    n
}

/// In the child before exec: joins `ns` (setns moves the cwd to the namespace's root; the
/// child enters its working directory later, as its user). Async-signal-safe.
pub fn enter_in_child(ns: RawFd) -> std::io::Result<()> {
    // SAFETY: setns takes an fd and a flag; the child has its own fs_struct (no CLONE_FS).
    if unsafe { libc::setns(ns, libc::CLONE_NEWNS) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the mount that holds `path` a shared mount (non-recursively), so mounts made on or
/// under it later propagate into slave copies such as the sandbox namespace. Only for a
/// mount namespace keel owns (PID 1): on a host it would change the host's mounts.
pub fn share_mount_of(path: &Path) -> Result<(), NsError> {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let m = super::mount::mount_points()
        .into_iter()
        .filter(|m| path.starts_with(m))
        .max_by_key(|m| m.as_os_str().len())
        .unwrap_or_else(|| PathBuf::from("/"));
    nix::mount::mount(
        None::<&str>,
        &m,
        None::<&str>,
        nix::mount::MsFlags::MS_SHARED,
        None::<&str>,
    )
    .map_err(|e| NsError::Share {
        path: m.clone(),
        source: std::io::Error::from_raw_os_error(e as i32),
    })
}

/// PR_SET_DUMPABLE 0 on keel: its `/proc/<pid>` files become root's, and only a process with
/// CAP_SYS_PTRACE may ptrace it, open its `mem` or follow its `root`, `cwd` and `fd` links.
/// (Kernel 6.18 still lets same-uid root read `environ`: keel wipes its secrets from it, see
/// `process::take_env`.)
pub fn set_not_dumpable() -> std::io::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes plain integers.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::process::{spawn, Session, SpawnSpec};
    use std::time::Instant;

    fn root() -> bool {
        if nix::unistd::geteuid().is_root() {
            return true;
        }
        assert!(
            std::env::var_os("CI").is_none(),
            "the namespace tests need root, and CI is set"
        );
        eprintln!("skipping: needs root");
        false
    }

    fn run(spec: &SpawnSpec) -> i32 {
        let pid = spawn(spec).expect("spawn");
        let mut status = 0;
        // SAFETY: waits for the child just started; `status` is a local.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        status
    }

    fn spec(argv: &[&str], ns: Option<RawFd>) -> SpawnSpec {
        SpawnSpec {
            argv: argv.iter().map(Into::into).collect(),
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            cwd: PathBuf::from("/"),
            ids: None,
            session: Session::New,
            drop_caps: Vec::new(),
            no_new_privs: false,
            stdio: crate::sys::process::Stdio::Null,
            mnt_ns: ns,
            cgroup: None,
            seccomp: None,
            inherit_fds: false,
        }
    }

    /// A child in the namespace sees the covered dir empty and read-only and the covered file
    /// empty; keel still sees both. Prints what a start costs with and without the namespace.
    #[test]
    fn children_see_covers_and_the_start_cost_is_printed() {
        if !root() {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        std::fs::create_dir(&state).unwrap();
        std::fs::write(state.join("store.db"), "secret-bytes").unwrap();
        let creds = d.path().join("creds");
        std::fs::write(&creds, "AWS_SECRET_ACCESS_KEY=abc").unwrap();
        let t0 = Instant::now();
        let ns = make_sandbox_ns(&[
            (state.clone(), Cover::EmptyDir),
            (creds.clone(), Cover::EmptyFile),
        ])
        .unwrap();
        let made = t0.elapsed();
        let check = format!(
            "test -z \"$(ls -A {s})\" && ! touch {s}/x 2>/dev/null && test ! -s {c} && ! sh -c 'echo x > {c}' 2>/dev/null",
            s = state.display(),
            c = creds.display()
        );
        assert_eq!(run(&spec(&["/bin/sh", "-c", &check], Some(ns.fd()))), 0);
        assert_eq!(
            run(&spec(&["/bin/sh", "-c", &check], None)),
            256,
            "keel's view is untouched"
        );
        assert_eq!(
            std::fs::read_to_string(state.join("store.db")).unwrap(),
            "secret-bytes"
        );
        assert!(std::fs::read_dir(&state).unwrap().count() == 1);

        // Interleaved, medians: the machine is shared and noisy.
        let n = 300;
        let mut took: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        let specs = [
            spec(&["/bin/true"], None),
            spec(&["/bin/true"], Some(ns.fd())),
        ];
        for _ in 0..n {
            for (i, s) in specs.iter().enumerate() {
                let t = Instant::now();
                assert_eq!(run(s), 0);
                took[i].push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        let (without, with) = (median(&mut took[0]), median(&mut took[1]));
        println!(
            "sandbox namespace: made in {:.2} ms; start+exit of /bin/true (median of {n}): {without:.3} ms without, {with:.3} ms with setns ({:+.3} ms per start)",
            made.as_secs_f64() * 1000.0,
            with - without
        );
    }
}

//! The seccomp filter keel puts on everything it starts (main command, services, probes,
//! processes started through the API), `[sandbox] seccomp`: no new user namespaces
//! (`unshare`/`clone` with `CLONE_NEWUSER`; `clone3`, whose flags sit in a struct the filter
//! cannot read, gets ENOSYS so libc falls back to `clone`, as container runtimes do) and no
//! call of the mount family, each refused with EPERM. Inside a user namespace of its own an
//! unprivileged process holds every capability over the mounts it makes there, which is how
//! the sandbox could otherwise work at the covers over keel's state dir.
//!
//! The BPF program is compiled once at start by `seccompiler` (firecracker's pure-Rust
//! filter compiler) and installed in the child between fork and exec ([`install_in_child`]):
//! while the child still holds CAP_SYS_ADMIN (before its capabilities drop) it needs no
//! `no_new_privs`, so set-ID programs in the sandbox keep working; a keel without
//! CAP_SYS_ADMIN sets `no_new_privs` first, as the kernel requires.
//!
//! On x86_64 the filter also covers the x32 numbers and the i386 entry points (a 32-bit
//! program's `int 0x80`): the i386 table has its own numbers, checked by a second program
//! that the first one's architecture check falls through to.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("no seccomp filter for this architecture ({0})")]
    Arch(String),
    #[error("compile the seccomp filter: {0}")]
    Compile(#[source] seccompiler::BackendError),
}

/// What `[sandbox] seccomp` may allow by name: new user namespaces, or one call of the
/// mount family.
pub const USERNS: &str = "userns";
pub const MOUNT_FAMILY: &[&str] = &[
    "mount",
    "umount2",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "pivot_root",
];

const CLONE_NEWUSER: u64 = libc::CLONE_NEWUSER as u64;

/// A syscall table: the number of each call the filter knows.
struct Table {
    mount: i64,
    /// `umount2`, and on i386 the old one-argument `umount` too.
    umount: &'static [i64],
    move_mount: i64,
    open_tree: i64,
    fsopen: i64,
    fsmount: i64,
    fsconfig: i64,
    fspick: i64,
    mount_setattr: i64,
    pivot_root: i64,
    unshare: i64,
    clone: i64,
    clone3: i64,
}

impl Table {
    fn numbers_of(&self, name: &str) -> Vec<i64> {
        match name {
            "mount" => vec![self.mount],
            "umount2" => self.umount.to_vec(),
            "move_mount" => vec![self.move_mount],
            "open_tree" => vec![self.open_tree],
            "fsopen" => vec![self.fsopen],
            "fsmount" => vec![self.fsmount],
            "fsconfig" => vec![self.fsconfig],
            "fspick" => vec![self.fspick],
            "mount_setattr" => vec![self.mount_setattr],
            "pivot_root" => vec![self.pivot_root],
            _ => Vec::new(),
        }
    }
}

const NATIVE: Table = Table {
    mount: libc::SYS_mount,
    umount: &[libc::SYS_umount2],
    move_mount: libc::SYS_move_mount,
    open_tree: libc::SYS_open_tree,
    fsopen: libc::SYS_fsopen,
    fsmount: libc::SYS_fsmount,
    fsconfig: libc::SYS_fsconfig,
    fspick: libc::SYS_fspick,
    mount_setattr: libc::SYS_mount_setattr,
    pivot_root: libc::SYS_pivot_root,
    unshare: libc::SYS_unshare,
    clone: libc::SYS_clone,
    clone3: libc::SYS_clone3,
};

/// arch/x86/entry/syscalls/syscall_32.tbl.
#[cfg(target_arch = "x86_64")]
const I386: Table = Table {
    mount: 21,
    umount: &[22, 52],
    move_mount: 429,
    open_tree: 428,
    fsopen: 430,
    fsmount: 432,
    fsconfig: 431,
    fspick: 433,
    mount_setattr: 442,
    pivot_root: 217,
    unshare: 310,
    clone: 120,
    clone3: 435,
};
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH_I386: u32 = 0x4000_0003;
/// x32 calls enter with the x86_64 architecture and this bit in the number.
#[cfg(target_arch = "x86_64")]
const X32_SYSCALL_BIT: i64 = 0x4000_0000;

/// A compiled filter, ready to install in a child: one program per action (EPERM for the
/// refused calls, ENOSYS for `clone3`), which the kernel combines (the strictest answer wins).
#[derive(Debug, Clone)]
pub struct Filter {
    progs: Vec<BpfProgram>,
}

/// The rules for one table: every call refused unless `allow` names it.
fn rules(t: &Table, allow: &[String]) -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let err = SeccompError::Compile;
    let mut r: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let allowed = |n: &str| allow.iter().any(|a| a == n);
    if !allowed(USERNS) {
        // Argument 0 of unshare and of clone (on every architecture keel builds for) holds
        // the flags; the rule matches when CLONE_NEWUSER is among them.
        for nr in [t.unshare, t.clone] {
            let newuser = SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(CLONE_NEWUSER),
                CLONE_NEWUSER,
            )
            .map_err(err)?;
            r.insert(nr, vec![SeccompRule::new(vec![newuser]).map_err(err)?]);
        }
    }
    for name in MOUNT_FAMILY {
        if !allowed(name) {
            for nr in t.numbers_of(name) {
                // No condition: the call is refused whatever its arguments.
                r.insert(nr, Vec::new());
            }
        }
    }
    Ok(r)
}

/// Compiles one table's program: a call `rules` names gets `errno`, anything else is allowed.
fn program(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    errno: i32,
    arch: TargetArch,
) -> Result<BpfProgram, SeccompError> {
    let f = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        arch,
    )
    .map_err(SeccompError::Compile)?;
    f.try_into().map_err(SeccompError::Compile)
}

impl Filter {
    /// The filter refusing everything above except what `allow` names ([`USERNS`], or a
    /// name in [`MOUNT_FAMILY`]). None when `allow` names all of it (nothing to refuse).
    pub fn compile(allow: &[String]) -> Result<Option<Filter>, SeccompError> {
        let arch = TargetArch::try_from(std::env::consts::ARCH)
            .map_err(|_| SeccompError::Arch(std::env::consts::ARCH.to_string()))?;
        let userns = allow.iter().any(|a| a == USERNS);
        let mut progs = Vec::new();
        let refused = rules(&NATIVE, allow)?;
        if !refused.is_empty() {
            #[allow(unused_mut)]
            let mut refused = refused;
            #[cfg(target_arch = "x86_64")]
            let refused = {
                let x32: Vec<_> = refused
                    .iter()
                    .map(|(nr, r)| (nr | X32_SYSCALL_BIT, r.clone()))
                    .collect();
                refused.extend(x32);
                let i386 = program(rules(&I386, allow)?, libc::EPERM, arch)?;
                chain(program(refused, libc::EPERM, arch)?, i386)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let refused = program(refused, libc::EPERM, arch)?;
            progs.push(refused);
        }
        if !userns {
            let clone3 = |t: &Table| BTreeMap::from([(t.clone3, Vec::new())]);
            #[cfg(target_arch = "x86_64")]
            let p = chain(
                program(clone3(&NATIVE), libc::ENOSYS, arch)?,
                program(clone3(&I386), libc::ENOSYS, arch)?,
            );
            #[cfg(not(target_arch = "x86_64"))]
            let p = program(clone3(&NATIVE), libc::ENOSYS, arch)?;
            progs.push(p);
        }
        Ok((!progs.is_empty()).then_some(Filter { progs }))
    }

    /// Instructions in the programs.
    pub fn len(&self) -> usize {
        self.progs.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.progs.is_empty()
    }
}

/// seccompiler begins every program with the same three instructions: load the
/// architecture, skip the next one if it matches, else kill the process. On x86_64 the
/// native program's kill becomes a jump to a second program for the i386 table, compiled
/// the same way with its architecture constant (the second instruction's operand) set to
/// i386; that one's kill stays, for an architecture neither knows.
#[cfg(target_arch = "x86_64")]
const ARCH_CHECK: usize = 3;

#[cfg(target_arch = "x86_64")]
fn chain(mut native: BpfProgram, mut i386: BpfProgram) -> BpfProgram {
    let kill = (libc::BPF_RET | libc::BPF_K) as u16;
    assert!(
        native[ARCH_CHECK - 1].code == kill && i386[ARCH_CHECK - 1].code == kill,
        "seccompiler's programs no longer begin with the architecture check"
    );
    native[ARCH_CHECK - 1] = seccompiler::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JA) as u16,
        jt: 0,
        jf: 0,
        k: (native.len() - ARCH_CHECK) as u32,
    };
    i386[1].k = AUDIT_ARCH_I386;
    native.extend(i386);
    native
}

/// Installs `filter` on the calling thread, in a child between fork and exec: no
/// allocation, plain syscalls. Without CAP_SYS_ADMIN the kernel requires `no_new_privs`
/// first; it is set only then.
pub fn install_in_child(filter: &Filter) -> std::io::Result<()> {
    for (i, p) in filter.progs.iter().enumerate() {
        let prog = libc::sock_fprog {
            len: p.len() as u16,
            filter: p.as_ptr().cast::<libc::sock_filter>().cast_mut(),
        };
        let set = || {
            // SAFETY: `prog` points at the program's instructions, alive for the call; the
            // kernel copies them.
            unsafe {
                libc::syscall(
                    libc::SYS_seccomp,
                    libc::SECCOMP_SET_MODE_FILTER,
                    0,
                    &prog as *const libc::sock_fprog,
                )
            }
        };
        if set() == 0 {
            continue;
        }
        let e = std::io::Error::last_os_error();
        if i > 0 || e.raw_os_error() != Some(libc::EACCES) {
            return Err(e);
        }
        // SAFETY: PR_SET_NO_NEW_PRIVS takes plain integers.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if set() != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` in a forked child with the filter installed; returns its exit code.
    fn in_child(filter: &Filter, f: fn() -> i32) -> i32 {
        // SAFETY: the child only installs the filter, makes plain syscalls and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = match install_in_child(filter) {
                Ok(()) => f(),
                Err(_) => 99,
            };
            // SAFETY: ends the forked child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked; `status` is a local.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child died: {status}");
        libc::WEXITSTATUS(status)
    }

    /// Makes syscall `nr` with up to five integer arguments; returns 0 or the errno.
    fn call(nr: libc::c_long, a: [usize; 5]) -> i32 {
        // SAFETY: every argument is an integer or a null pointer; the calls probed either
        // fail before touching memory (the filter, a null pointer: EFAULT) or take none.
        let r = unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3], a[4]) };
        if r == 0 {
            0
        } else {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
        }
    }

    const NEWUSER: usize = libc::CLONE_NEWUSER as usize;
    const NEWNS: usize = libc::CLONE_NEWNS as usize;

    #[test]
    fn refuses_new_user_namespaces_and_mounts_and_clone3() {
        let f = Filter::compile(&[]).unwrap().unwrap();
        let unshare_user = || call(libc::SYS_unshare, [NEWUSER, 0, 0, 0, 0]);
        assert_eq!(in_child(&f, unshare_user), libc::EPERM);
        let unshare_both = || call(libc::SYS_unshare, [NEWUSER | NEWNS, 0, 0, 0, 0]);
        assert_eq!(in_child(&f, unshare_both), libc::EPERM);
        assert_eq!(
            in_child(&f, || call(libc::SYS_clone3, [0; 5])),
            libc::ENOSYS
        );
        assert_eq!(in_child(&f, || call(libc::SYS_mount, [0; 5])), libc::EPERM);
        assert_eq!(in_child(&f, || call(libc::SYS_fsopen, [0; 5])), libc::EPERM);
        // Other calls, and unshare without CLONE_NEWUSER, reach the kernel.
        assert_eq!(in_child(&f, || call(libc::SYS_unshare, [0; 5])), 0);
        assert_eq!(in_child(&f, || call(libc::SYS_sched_yield, [0; 5])), 0);
    }

    #[test]
    fn what_the_config_allows_passes() {
        let allow = vec![USERNS.to_string(), "mount".to_string()];
        let f = Filter::compile(&allow).unwrap().unwrap();
        // pivot_root is still refused (mount with null arguments would reach the kernel and
        // fail there, which says less).
        assert_eq!(
            in_child(&f, || call(libc::SYS_pivot_root, [0; 5])),
            libc::EPERM
        );
        // clone3 with a null struct reaches the kernel: EFAULT/EINVAL, not ENOSYS.
        assert_ne!(
            in_child(&f, || call(libc::SYS_clone3, [0; 5])),
            libc::ENOSYS
        );
        let mut all: Vec<String> = MOUNT_FAMILY.iter().map(|s| s.to_string()).collect();
        all.push(USERNS.into());
        assert!(Filter::compile(&all).unwrap().is_none());
    }
}

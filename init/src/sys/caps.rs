//! Capabilities: whether keel holds CAP_SYS_ADMIN (needed to mount), and dropping capabilities
//! from a child's bounding, inheritable and ambient sets between fork and exec.

use caps::{CapSet, Capability};

/// True when keel's effective set holds CAP_SYS_ADMIN.
pub fn has_sys_admin() -> bool {
    caps::has_cap(None, CapSet::Effective, Capability::CAP_SYS_ADMIN).unwrap_or(false)
}

/// True when capability `n` is in keel's bounding set.
pub fn in_bounding_set(n: u32) -> bool {
    caps::all()
        .into_iter()
        .find(|c| c.index() as u32 == n)
        .is_some_and(|c| caps::has_cap(None, CapSet::Bounding, c).unwrap_or(false))
}

/// True when keel may remove capabilities from a bounding set (CAP_SETPCAP).
pub fn can_drop_bounding() -> bool {
    caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP).unwrap_or(false)
}

/// Capability number for a name such as "CAP_SYS_ADMIN".
pub fn number(name: &str) -> Option<u32> {
    name.parse::<Capability>().ok().map(|c| c.index() as u32)
}

/// In a forked child, before exec and before dropping root: removes every capability in `drop`
/// from the bounding set (so exec cannot regain it), the inheritable set and the ambient set.
/// Async-signal-safe: only prctl/capget/capset on caller-provided data.
pub fn drop_in_child(drop: &[u32]) -> std::io::Result<()> {
    if drop.is_empty() {
        return Ok(());
    }
    for &cap in drop {
        // SAFETY: PR_CAPBSET_DROP takes a capability number; EINVAL for unknown numbers.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
        // SAFETY: lowering an ambient capability only takes plain integers.
        unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_LOWER as libc::c_ulong,
                cap as libc::c_ulong,
                0,
                0,
            )
        };
    }
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut hdr = Header {
        version: 0x2008_0522,
        pid: 0,
    }; // _LINUX_CAPABILITY_VERSION_3
    let mut data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capget with a v3 header writes exactly two Data records into `data`.
    if unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut Header, data.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    for &cap in drop {
        let (i, bit) = ((cap / 32) as usize, 1u32 << (cap % 32));
        if i < 2 {
            data[i].inheritable &= !bit;
        }
    }
    // SAFETY: capset reads the header and two Data records we own; lowering inheritable
    // capabilities is always permitted.
    if unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut Header, data.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

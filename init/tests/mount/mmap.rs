//! A shared mapping of a file on keel outlives the file's close, its deletion and its return
//! to inline storage: with FUSE passthrough the kernel maps keel's body file itself. Such a
//! body must never become another file's body, or the mapping would show and change that
//! file's bytes, whoever owns it (a sandbox user reading and rewriting root's files). Needs
//! root and /dev/fuse: fails when CI is set, skips otherwise.

use crate::support;

use std::fs::{self, OpenOptions};

use support::mount::Keel;

/// The bytes mapped at `addr`, read without touching the mapping (a page past the end of
/// the file it maps would raise SIGBUS): `process_vm_readv` on this process answers EFAULT
/// instead. `None` when nothing could be read.
fn read_mapped(addr: usize, len: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `local` is a writable buffer of `len` bytes owned here; the kernel reads the
    // remote range itself and reports a fault as an error instead of a signal.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    (n > 0).then(|| {
        buf.truncate(n as usize);
        buf
    })
}

#[test]
fn a_body_a_mapping_holds_never_becomes_another_files_body() {
    let Some(k) = Keel::start(&[]) else {
        return;
    };
    // A small file (back inline at its last close) and a large one (then deleted), each
    // mapped shared and closed.
    let mut maps = Vec::new();
    for (name, len) in [("small", 100usize), ("large", 64 << 10)] {
        let p = k.p(name);
        fs::write(&p, vec![b'A'; len]).unwrap();
        let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
        // Never read or written here, only unmapped at the end.
        let addr = support::sys::map_shared(&f, len).unwrap_or_else(|e| panic!("mmap {name}: {e}"));
        drop(f);
        maps.push((addr as usize, len));
    }
    fs::remove_file(k.p("large")).unwrap();
    // Files made later, by anyone: bodies of their own (over inline_max), from the pool.
    std::thread::sleep(std::time::Duration::from_millis(300));
    for i in 0..64 {
        fs::write(k.p(&format!("later{i}")), vec![b'S'; 8 << 10]).unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    for &(addr, len) in &maps {
        let seen = read_mapped(addr, len.min(8 << 10));
        assert!(
            !seen.as_ref().is_some_and(|b| b.contains(&b'S')),
            "a mapping of a closed file shows a later file's bytes: {:?}",
            seen.map(|b| String::from_utf8_lossy(&b[..b.len().min(64)]).into_owned())
        );
    }
    for (addr, len) in maps {
        // SAFETY: unmaps exactly the mappings made above.
        assert_eq!(unsafe { libc::munmap(addr as *mut libc::c_void, len) }, 0);
    }
}

/// An old, exact timestamp set before a write, so any change shows without the clock.
const SENTINEL_S: i64 = 1_000_000_000;

/// (mtime, ctime) in ns, as `stat -c %Y` asks for them: statx of the two times alone,
/// which the kernel answers from its cache unless it knows them stale (a mapping's
/// `mmap` makes it drop only its cached atime, which `fs::metadata` would ask for).
fn times(p: &std::path::Path) -> (i128, i128) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: statx reads the NUL-terminated path `c` and writes only into `st`, a zeroed
    // statx struct owned here; both outlive the call.
    let st = unsafe {
        let mut st: libc::statx = std::mem::zeroed();
        let r = libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            0,
            libc::STATX_MTIME | libc::STATX_CTIME,
            &mut st,
        );
        assert_eq!(r, 0, "statx {p:?}: {}", std::io::Error::last_os_error());
        st
    };
    let ns =
        |t: libc::statx_timestamp| i128::from(t.tv_sec) * 1_000_000_000 + i128::from(t.tv_nsec);
    (ns(st.stx_mtime), ns(st.stx_ctime))
}

/// Writes `byte` over `[at, at + n)` of a mapping.
fn poke(map: *mut u8, at: usize, n: usize, byte: u8) {
    // SAFETY: the callers' mappings are longer than `at + n` bytes and stay mapped.
    unsafe { std::ptr::write_bytes(map.add(at), byte, n) };
}

fn unmap(map: *mut u8, len: usize) {
    // SAFETY: unmaps exactly a mapping made by `map_shared` with this length.
    assert_eq!(unsafe { libc::munmap(map.cast(), len) }, 0);
}

/// keel with passthrough, asserting the kernel took it (what the tests below are about).
fn keel_with_passthrough() -> Option<Keel> {
    let k = Keel::start(&["--passthrough", "on"])?;
    // Logged once the mount is served, which may be after the mount point shows it.
    k.wait_log("workspace mounted");
    assert!(
        k.log_text().contains("passthrough=true"),
        "the kernel did not take FUSE passthrough:\n{}",
        k.log_text()
    );
    Some(k)
}

/// A write through a shared mapping of a passthrough file moves its mtime and ctime, as on
/// ext4 (xfstests generic/080 and 215): the kernel writes keel's body file and tells keel
/// nothing, neither at the write nor at munmap or close. `stat` right after must show it,
/// though the kernel cached the attributes before the file was opened; and when the mapping
/// outlives the close and is written after it, `stat` must show that too, and the bytes must
/// reach the next snapshot.
#[test]
fn a_write_through_a_shared_mapping_moves_mtime_and_ctime() {
    let Some(k) = keel_with_passthrough() else {
        return;
    };
    let len = 64 << 10;
    let p = k.p("mapped");
    fs::write(&p, vec![b'a'; len]).unwrap();
    let sentinel = i128::from(SENTINEL_S) * 1_000_000_000;
    let set_sentinel = || {
        support::sys::utimens(
            &p,
            support::sys::Ts::At(SENTINEL_S, 0),
            support::sys::Ts::At(SENTINEL_S, 0),
            false,
        )
        .unwrap();
        // The kernel caches these attributes now (60 s by default).
        let (m, c) = times(&p);
        assert_eq!(m, sentinel);
        c
    };

    // Mapped, written, unmapped, closed; then stat.
    let ctime = set_sentinel();
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let map = support::sys::map_shared(&f, len).expect("mmap");
    poke(map, 100, 100, b'b');
    unmap(map, len);
    drop(f);
    let (m, c) = times(&p);
    assert_ne!(m, sentinel, "mtime after a write through a mapping");
    assert!(
        c > ctime,
        "ctime after a write through a mapping: {c} <= {ctime}"
    );

    // Mapped, closed, then written through the mapping, which outlives the close.
    let state = k.state.to_str().unwrap().to_string();
    let snapshot = |name: &str| {
        let out = std::process::Command::new(support::mount::keel_bin())
            .args(["snapshot", "create", "--state", &state, "--name", name])
            .output()
            .unwrap();
        assert!(out.status.success(), "snapshot {name}: {out:?}");
    };
    snapshot("before");
    let ctime = set_sentinel();
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let map = support::sys::map_shared(&f, len).expect("mmap");
    drop(f);
    let _ = times(&p);
    poke(map, 40_000, 1000, b'c');
    let (m, c) = times(&p);
    assert_ne!(
        m, sentinel,
        "mtime after a write through a mapping, after close"
    );
    assert!(
        c > ctime,
        "ctime after a write through a mapping after close"
    );
    snapshot("after");
    unmap(map, len);

    // The snapshot holds what the mapping wrote: restored into a new state dir and mounted
    // there (once the workspace stopped, so that mount can take the remote's lease).
    let restored = k.scratch().join("restored");
    let remote = format!("file://{}", k.state.join("remote").display());
    let out = std::process::Command::new(support::mount::keel_bin())
        .args(["snapshot", "restore", "latest", "--state"])
        .arg(&restored)
        .args(["--remote", &remote])
        .output()
        .unwrap();
    assert!(out.status.success(), "restore: {out:?}");
    let mut k = k;
    k.stop();
    let config = k.scratch().join("restored.toml");
    fs::write(&config, format!("[persist]\nremote = \"{remote}\"\n")).unwrap();
    let tmp = tempfile::Builder::new()
        .prefix("keel-mount-test.")
        .tempdir()
        .unwrap();
    let k2 = Keel::start_in(tmp, restored, &["--config", config.to_str().unwrap()]);
    let got = fs::read(k2.p("mapped")).unwrap();
    let mut want = vec![b'a'; len];
    want[100..200].fill(b'b');
    want[40_000..41_000].fill(b'c');
    assert!(
        got == want,
        "the restored snapshot lacks what the mapping wrote after the close"
    );
}

//! A shared mapping of a file on keel outlives the file's close, its deletion and its return
//! to inline storage: with FUSE passthrough the kernel maps keel's body file itself. Such a
//! body must never become another file's body, or the mapping would show and change that
//! file's bytes, whoever owns it (a sandbox user reading and rewriting root's files). Needs
//! root and /dev/fuse: fails when CI is set, skips otherwise.

mod support;

use std::fs::{self, OpenOptions};
use std::os::unix::io::AsRawFd;

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
        // SAFETY: a new shared mapping of `len` bytes of an open file, at an address the
        // kernel picks; it is never read or written here, only unmapped at the end.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED, "mmap {name}");
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

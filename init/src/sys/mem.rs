//! The process heap: handing memory that glibc's allocator keeps after large, short-lived
//! work (a checkpoint's hashing batches and snapshot trees) back to the kernel.

/// Returns free heap memory at the top of every malloc arena to the kernel
/// (`malloc_trim(0)`). Cheap when there is nothing to return.
pub fn release_free_heap() {
    // SAFETY: malloc_trim only walks glibc's own arenas under their locks; it takes no
    // pointers from us and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// This process's resident memory now and its peak so far (`VmRSS`, `VmHWM` of
/// `/proc/self/status`), in MiB; `None` where the kernel does not say.
pub fn rss_mib() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let l = s.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = l[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib / 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

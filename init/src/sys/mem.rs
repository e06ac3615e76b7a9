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

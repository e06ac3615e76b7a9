//! Real-mount tests: large and sparse files, SEEK_DATA/SEEK_HOLE, fallocate, copy_file_range.

use crate::support;

use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use support::mount::{assert_errno, pattern};
use support::sys;

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;

/// Bytes the state dir occupies on disk (allocated blocks, not apparent sizes).
fn disk_usage(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(md) = e.metadata() else { continue };
            total += md.blocks() * 512;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}

#[test]
fn sparse_file_larger_than_4gib() {
    let mut k = keel_or_skip!();
    let p = k.p("huge.bin");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let head = pattern(4096, 1);
    let tail = pattern(100_000, 2);
    let tail_off = 5 * GIB + 12_345;
    f.write_all_at(&head, 0).unwrap();
    f.write_all_at(&tail, tail_off).unwrap();
    f.write_all_at(b"across-4GiB", 4 * GIB - 5).unwrap();
    f.sync_all().unwrap();
    let size = tail_off + tail.len() as u64;
    assert_eq!(f.metadata().unwrap().len(), size);

    let check = |f: &fs::File| {
        let mut b = vec![0u8; tail.len()];
        f.read_exact_at(&mut b, tail_off).unwrap();
        assert_eq!(b, tail, "tail beyond 4 GiB");
        let mut b = [0u8; 11];
        f.read_exact_at(&mut b, 4 * GIB - 5).unwrap();
        assert_eq!(&b, b"across-4GiB", "write straddling the 4 GiB boundary");
        let mut z = vec![1u8; 1 << 20];
        f.read_exact_at(&mut z, 3 * GIB).unwrap();
        assert!(z.iter().all(|&x| x == 0), "hole reads as zeros");
        let mut h = vec![0u8; 4096];
        f.read_exact_at(&mut h, 0).unwrap();
        assert_eq!(h, head);
    };
    check(&f);
    drop(f);
    let md = fs::metadata(&p).unwrap();
    assert!(
        md.blocks() * 512 < 64 * MIB,
        "st_blocks {} for a sparse file",
        md.blocks()
    );
    assert!(
        disk_usage(&k.state) < 256 * MIB,
        "state dir holds the holes: {} bytes",
        disk_usage(&k.state)
    );

    k.remount();
    assert_eq!(fs::metadata(&p).unwrap().len(), size);
    check(&fs::File::open(&p).unwrap());

    // Truncate down below 4 GiB and back up: the old tail must not reappear.
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    f.set_len(GIB).unwrap();
    f.set_len(6 * GIB).unwrap();
    let mut b = vec![1u8; tail.len()];
    f.read_exact_at(&mut b, tail_off).unwrap();
    assert!(b.iter().all(|&x| x == 0), "truncated data reappeared");
}

#[test]
fn seek_data_and_seek_hole() {
    let k = keel_or_skip!();
    let p = k.p("holes.bin");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    f.write_all_at(&pattern(4096, 3), 0).unwrap();
    f.write_all_at(&pattern(4096, 4), 8 * MIB).unwrap();
    let size = 8 * MIB + 4096;
    f.set_len(size + 16 * MIB).unwrap(); // trailing hole
    let size = size + 16 * MIB;

    assert_eq!(sys::lseek(&f, 0, libc::SEEK_DATA).unwrap(), 0);
    let hole = sys::lseek(&f, 0, libc::SEEK_HOLE).unwrap() as u64;
    assert!(
        (4096..8 * MIB).contains(&hole),
        "first hole at {hole}: the 8 MiB gap is a hole"
    );
    assert_eq!(
        sys::lseek(&f, 4 * MIB as i64, libc::SEEK_DATA).unwrap() as u64,
        8 * MIB
    );
    let hole2 = sys::lseek(&f, 8 * MIB as i64, libc::SEEK_HOLE).unwrap() as u64;
    assert!(
        (8 * MIB + 4096..size).contains(&hole2),
        "hole after second extent at {hole2}"
    );
    assert_errno(
        sys::lseek(&f, 9 * MIB as i64, libc::SEEK_DATA),
        libc::ENXIO,
        "SEEK_DATA in trailing hole",
    );
    assert_errno(
        sys::lseek(&f, size as i64, libc::SEEK_DATA),
        libc::ENXIO,
        "SEEK_DATA at EOF",
    );
    assert_errno(
        sys::lseek(&f, size as i64 + 1, libc::SEEK_HOLE),
        libc::ENXIO,
        "SEEK_HOLE past EOF",
    );
    assert_eq!(
        sys::lseek(&f, 20 * MIB as i64, libc::SEEK_HOLE).unwrap() as u64,
        20 * MIB
    );

    // Same answers after the data reached the store and the page cache is gone.
    f.sync_all().unwrap();
    drop(f);
    let f = fs::File::open(&p).unwrap();
    assert_eq!(
        sys::lseek(&f, 4 * MIB as i64, libc::SEEK_DATA).unwrap() as u64,
        8 * MIB
    );
}

#[test]
fn fallocate_modes() {
    let k = keel_or_skip!();
    let p = k.p("alloc.bin");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let data = pattern(3 * MIB as usize, 9);
    f.write_all_at(&data, 0).unwrap();

    // Mode 0 beyond EOF extends the size with zeros.
    sys::fallocate(&f, 0, 3 * MIB as i64, MIB as i64).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 4 * MIB);
    let mut b = vec![1u8; 4096];
    f.read_exact_at(&mut b, 3 * MIB + 100).unwrap();
    assert!(b.iter().all(|&x| x == 0));

    // KEEP_SIZE beyond EOF: size unchanged, space reserved.
    let blocks = f.metadata().unwrap().blocks();
    sys::fallocate(
        &f,
        libc::FALLOC_FL_KEEP_SIZE,
        4 * MIB as i64,
        4 * MIB as i64,
    )
    .unwrap();
    assert_eq!(
        f.metadata().unwrap().len(),
        4 * MIB,
        "KEEP_SIZE keeps the size"
    );
    assert!(f.metadata().unwrap().blocks() >= blocks);

    // PUNCH_HOLE|KEEP_SIZE zeroes the range in place (unaligned edges too), size unchanged.
    let (off, len) = (MIB + 1234, MIB + 4321);
    sys::fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        off as i64,
        len as i64,
    )
    .unwrap();
    assert_eq!(f.metadata().unwrap().len(), 4 * MIB);
    let mut all = vec![0u8; 3 * MIB as usize];
    f.read_exact_at(&mut all, 0).unwrap();
    let mut want = data.clone();
    want[off as usize..(off + len) as usize].fill(0);
    assert!(all == want, "punched range is zero, everything else intact");
    // After the page cache is dropped (new open, fsync) the store agrees.
    f.sync_all().unwrap();
    drop(f);
    assert!(
        fs::read(&p).unwrap()[..3 * MIB as usize] == want[..],
        "after fsync"
    );
    // PUNCH_HOLE without KEEP_SIZE is invalid on Linux.
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    let e = sys::fallocate(&f, libc::FALLOC_FL_PUNCH_HOLE, 0, 4096).unwrap_err();
    assert!(
        matches!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP) | Some(libc::EINVAL)
        ),
        "{e}"
    );
    // On a read-only fd: EBADF.
    let ro = fs::File::open(&p).unwrap();
    assert_errno(
        sys::fallocate(&ro, 0, 0, 4096),
        libc::EBADF,
        "fallocate on O_RDONLY fd",
    );
}

#[test]
fn copy_file_range_within_the_mount() {
    let k = keel_or_skip!();
    let src = k.p("src.bin");
    let dst = k.p("dst.bin");
    let data = pattern(3 * MIB as usize + 777, 12);
    fs::write(&src, &data).unwrap();
    fs::write(&dst, b"prefix").unwrap();
    let fi = fs::File::open(&src).unwrap();
    let fo = OpenOptions::new().write(true).open(&dst).unwrap();
    let mut copied = 0usize;
    while copied < data.len() - 1000 {
        let n = sys::copy_file_range(
            &fi,
            1000 + copied as i64,
            &fo,
            6 + copied as i64,
            data.len() - 1000 - copied,
        )
        .unwrap();
        assert!(n > 0, "copy_file_range made no progress");
        copied += n;
    }
    drop(fo);
    let mut want = b"prefix".to_vec();
    want.extend_from_slice(&data[1000..]);
    assert!(fs::read(&dst).unwrap() == want, "copied bytes differ");
    // Copy within the same file to an overlapping-free region.
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&src)
        .unwrap();
    let n = sys::copy_file_range(&f, 0, &f, 4 * MIB as i64, 1000).unwrap();
    assert_eq!(n, 1000);
    let mut b = vec![0u8; 1000];
    f.read_exact_at(&mut b, 4 * MIB).unwrap();
    assert_eq!(&b[..], &data[..1000]);
    // Past EOF of the source: 0 bytes.
    let src_len = fi.metadata().unwrap().len() as i64;
    assert_eq!(src_len, 4 * MIB as i64 + 1000);
    assert_eq!(
        sys::copy_file_range(&fi, src_len + 10, &f, 0, 100).unwrap(),
        0
    );
}

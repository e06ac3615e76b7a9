//! The two ways FUSE requests reach keel, each under the same real workload: FUSE over
//! io_uring (per-CPU queues served on their CPU) and the classic `/dev/fuse` loop. The log
//! line "workspace mounted ... transport=..." says which one a mount uses.
//!
//! io_uring needs the host to have set `/sys/module/fuse/parameters/enable_uring` to Y
//! (`script/test` does, as root). Without it the io_uring test skips, or fails when `CI` is
//! set, so a CI machine that lost the setting does not silently test only one transport.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use common::{pattern, sys};

fn uring_enabled() -> bool {
    let on = fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|s| s.trim() == "Y");
    if !on && std::env::var_os("CI").is_some() {
        panic!("CI is set but /sys/module/fuse/parameters/enable_uring is not Y: refusing to skip the io_uring transport");
    }
    if !on {
        eprintln!("skipping: FUSE over io_uring is not enabled on this host");
    }
    on
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Every kind of request, from threads pinned to each CPU in turn, with cross-CPU checks:
/// what one CPU wrote, another reads back.
fn workload(root: &Path) {
    let n = cpus().max(2);
    let handles: Vec<_> = (0..n * 2)
        .map(|t| {
            let root = root.to_path_buf();
            std::thread::spawn(move || {
                let _ = sys::pin_to_cpu(t % cpus());
                let d = root.join(format!("w{t}"));
                fs::create_dir(&d).unwrap();
                for i in 0..60 {
                    let data = pattern(10 + i * 997, (t * 100 + i) as u64);
                    fs::write(d.join(format!("f{i}")), &data).unwrap();
                    assert_eq!(fs::read(d.join(format!("f{i}"))).unwrap(), data);
                }
                for i in (0..60).step_by(3) {
                    fs::rename(d.join(format!("f{i}")), d.join(format!("r{i}"))).unwrap();
                }
                for i in (1..60).step_by(3) {
                    fs::remove_file(d.join(format!("f{i}"))).unwrap();
                }
                std::os::unix::fs::symlink("r0", d.join("link")).unwrap();
                assert_eq!(fs::read_link(d.join("link")).unwrap(), Path::new("r0"));
                sys::set_xattr(&d.join("r0"), "user.k", b"v", 0).unwrap();
                assert_eq!(sys::get_xattr(&d.join("r0"), "user.k").unwrap(), b"v");
                // 60 made, 20 renamed, 20 removed, plus the link.
                assert_eq!(fs::read_dir(&d).unwrap().count(), 41);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    // A large file written in 1 MiB pieces on one CPU, read back and patched on another.
    let big = root.join("big");
    let data = pattern(5 << 20, 7);
    let (b2, d2) = (big.clone(), data.clone());
    std::thread::spawn(move || {
        let _ = sys::pin_to_cpu(0);
        let mut f = fs::File::create(&b2).unwrap();
        for c in d2.chunks(1 << 20) {
            f.write_all(c).unwrap();
        }
        f.sync_all().unwrap();
    })
    .join()
    .unwrap();
    let b3 = big.clone();
    std::thread::spawn(move || {
        let _ = sys::pin_to_cpu(cpus() - 1);
        let mut f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&b3)
            .unwrap();
        let mut got = Vec::new();
        f.read_to_end(&mut got).unwrap();
        assert!(got == data, "big file read back differs");
        f.seek(SeekFrom::Start(4095)).unwrap();
        f.write_all(b"xyz").unwrap();
    })
    .join()
    .unwrap();
    let mut f = fs::File::open(&big).unwrap();
    f.seek(SeekFrom::Start(4094)).unwrap();
    let mut five = [0u8; 5];
    f.read_exact(&mut five).unwrap();
    assert_eq!(&five[1..4], b"xyz");
}

fn transport_in(log: &str) -> Option<String> {
    let l = log.lines().find(|l| l.contains("workspace mounted"))?;
    let t = l.split("transport=").nth(1)?;
    Some(t.trim_matches('"').split(['"', ' ']).next()?.to_string())
}

/// The transport keel's log names. The kernel shows the mount before keel has answered INIT
/// and registered its rings, and keel logs the line after that: wait for it (bounded).
fn transport_of(k: &common::Keel) -> Option<String> {
    let deadline = std::time::Instant::now() + common::READY_TIMEOUT;
    loop {
        let t = transport_in(&k.log_text());
        if t.is_some() || std::time::Instant::now() > deadline {
            return t;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn io_uring_serves_every_request_kind_from_every_cpu() {
    if !common::fuse_available() || !uring_enabled() {
        return;
    }
    let mut k = keel_or_skip!("--io-uring", "on");
    assert_eq!(
        transport_of(&k).as_deref(),
        Some("io_uring"),
        "{}",
        k.log_text()
    );
    workload(&k.mnt);
    let before = common::snapshot(&k.mnt, false);
    // A clean stop ends every ring entry and unmounts; the tree survives a remount.
    k.remount();
    assert_eq!(transport_of(&k).as_deref(), Some("io_uring"));
    common::assert_same_tree(&before, &common::snapshot(&k.mnt, false), "after remount");
}

#[test]
fn classic_dev_fuse_serves_the_same_workload() {
    let mut k = keel_or_skip!("--io-uring", "off");
    assert_eq!(
        transport_of(&k).as_deref(),
        Some("classic"),
        "{}",
        k.log_text()
    );
    workload(&k.mnt);
    let before = common::snapshot(&k.mnt, false);
    k.remount();
    common::assert_same_tree(&before, &common::snapshot(&k.mnt, false), "after remount");
}

/// keel killed with requests in its rings: the mount is dead (ENOTCONN), and the next keel
/// clears it and serves the state dir again.
#[test]
fn killed_with_rings_registered_then_remounted() {
    if !common::fuse_available() || !uring_enabled() {
        return;
    }
    let mut k = keel_or_skip!("--io-uring", "on");
    fs::write(k.p("a"), b"one").unwrap();
    fs::File::open(k.p("a")).unwrap().sync_all().unwrap();
    k.crash_remount();
    assert_eq!(fs::read(k.p("a")).unwrap(), b"one");
    assert_eq!(transport_of(&k).as_deref(), Some("io_uring"));
}

//! The two ways FUSE requests reach keel, each under the same real workload: FUSE over
//! io_uring (per-CPU queues served on their CPU) and the classic `/dev/fuse` loop. The log
//! line "workspace mounted ... transport=..." says which one a mount uses. Either notices
//! the end of its connection: unmounted from outside or aborted, `keel mount` saves and exits.
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
    common::poll_for(common::READY_TIMEOUT, || transport_in(&k.log_text()))
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

/// The fusectl directory of the connection serving `mnt` (fusectl mounted if it is not).
fn fusectl_dir(mnt: &Path) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let root = Path::new("/sys/fs/fuse/connections");
    if fs::read_dir(root).map_or(true, |mut d| d.next().is_none()) {
        let _ = std::process::Command::new("mount")
            .args(["-t", "fusectl", "fusectl"])
            .arg(root)
            .status();
    }
    // The directory is named for the kernel's dev_t of the mount: major 0, so its minor.
    let dev = fs::metadata(mnt).ok()?.dev();
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let dir = root.join(minor.to_string());
    dir.join("abort").exists().then_some(dir)
}

/// Something outside ended the mount while a file was written and closed but never synced:
/// keel exits 0 on its own, says why, and the next mount has the file.
fn ends_cleanly_when_the_connection_ends(io_uring: &str, end: impl FnOnce(&Path)) {
    let mut k = keel_or_skip!("--io-uring", io_uring);
    let _ = transport_of(&k);
    let data = pattern(300_000, 11);
    fs::write(k.p("a"), &data).unwrap();
    fs::write(k.p("small"), b"tiny").unwrap();
    end(&k.mnt);
    let st = k.wait_exit();
    let log = k.log_text();
    assert!(
        st.is_some_and(|s| s.success()),
        "keel did not exit 0 after its connection ended ({st:?}); log:\n{log}"
    );
    assert!(log.contains("unmounted from outside"), "{log}");
    assert!(!common::is_fuse_mount(&k.mnt), "mount left behind:\n{log}");
    k.start_again();
    assert!(
        fs::read(k.p("a")).unwrap() == data,
        "a differs after remount"
    );
    assert_eq!(fs::read(k.p("small")).unwrap(), b"tiny");
}

fn umount(mnt: &Path) {
    let st = std::process::Command::new("umount")
        .arg(mnt)
        .status()
        .unwrap();
    assert!(st.success(), "umount {} failed", mnt.display());
}

fn abort(mnt: &Path) {
    let dir = fusectl_dir(mnt);
    if dir.is_none() && std::env::var_os("CI").is_some() {
        panic!(
            "CI is set but fusectl has no abort file for {}",
            mnt.display()
        );
    }
    let Some(dir) = dir else {
        eprintln!("skipping the abort: no fusectl here");
        return umount(mnt);
    };
    fs::write(dir.join("abort"), b"1").unwrap();
}

#[test]
fn umount_from_outside_ends_keel_mount_classic() {
    ends_cleanly_when_the_connection_ends("off", umount);
}

#[test]
fn umount_from_outside_ends_keel_mount_io_uring() {
    if !common::fuse_available() || !uring_enabled() {
        return;
    }
    ends_cleanly_when_the_connection_ends("on", umount);
}

#[test]
fn aborted_connection_ends_keel_mount_and_is_unmounted() {
    ends_cleanly_when_the_connection_ends("auto", abort);
}

/// Scheduling policies (`SCHED_*`) of keel's ring threads, read from /proc.
fn ring_policies(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for t in fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let ring = comm
            .trim()
            .strip_prefix("keel-ring-")
            .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()));
        if !ring {
            continue;
        }
        let stat = fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Field 41 is the policy; fields after the `(comm)` start at 3.
        let after = stat.rsplit(')').next().unwrap_or_default();
        if let Some(p) = after.split_whitespace().nth(41 - 3) {
            out.push(p.parse().unwrap());
        }
    }
    out
}

/// Runs `load` over and over on `threads` threads until the ring threads of `k` are all in
/// the normal class (at most 10 s), then `meanwhile`, then stops the load; returns whether
/// they got there.
fn ring_threads_go_normal_under(
    k: &common::Keel,
    threads: usize,
    load: fn(),
    meanwhile: impl FnOnce(),
) -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    load();
                }
            })
        })
        .collect();
    let reached = ring_threads_reach(
        k,
        libc::SCHED_OTHER as u32,
        std::time::Duration::from_secs(10),
    );
    meanwhile();
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    reached
}

/// Waits (bounded) until every ring thread of `k` has `policy`; false if they never did.
fn ring_threads_reach(k: &common::Keel, policy: u32, within: std::time::Duration) -> bool {
    let reached = common::poll_for(within, || {
        let p = ring_policies(k.pid());
        (!p.is_empty() && p.iter().all(|&x| x == policy)).then_some(())
    });
    if reached.is_none() {
        eprintln!("ring thread policies: {:?}", ring_policies(k.pid()));
    }
    reached.is_some()
}

/// `ring_sched = "auto"`: the ring threads are in the idle class while the CPUs have idle
/// time (so the scheduler keeps a process on the CPU that serves its requests), go to the
/// normal class while every CPU is busy, and come back once the load is gone. `normal`
/// keeps them in the normal class on an idle machine.
#[test]
fn ring_threads_leave_the_idle_class_while_the_cpus_are_busy() {
    if !common::fuse_available() || !uring_enabled() {
        return;
    }
    let secs = std::time::Duration::from_secs;
    let k = keel_or_skip!("--io-uring", "on");
    assert_eq!(transport_of(&k).as_deref(), Some("io_uring"));
    // Other tests of this binary may load the CPUs for a while: generous bounds.
    assert!(
        ring_threads_reach(&k, libc::SCHED_IDLE as u32, secs(30)),
        "idle CPUs, but the ring threads are not in the idle class"
    );
    let went_normal = ring_threads_go_normal_under(&k, cpus() + 1, std::hint::spin_loop, || {
        // The workspace keeps serving while they switch.
        fs::write(k.p("busy"), b"served").unwrap();
        assert_eq!(fs::read(k.p("busy")).unwrap(), b"served");
    });
    assert!(
        went_normal,
        "every CPU busy, but the ring threads stayed idle-class"
    );
    assert!(
        ring_threads_reach(&k, libc::SCHED_IDLE as u32, secs(30)),
        "the load is gone, but the ring threads did not go back to the idle class"
    );

    // Programs started in quick succession (a shell loop) count as busy too, while the
    // CPUs keep most of their idle time: one at a time, with a pause after each.
    fn start_true() {
        let _ = std::process::Command::new("true").status();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let went_normal = ring_threads_go_normal_under(&k, 1, start_true, || {});
    assert!(
        went_normal,
        "hundreds of processes a second, but the ring threads stayed idle-class"
    );
    assert!(
        ring_threads_reach(&k, libc::SCHED_IDLE as u32, secs(30)),
        "the spawning stopped, but the ring threads did not go back to the idle class"
    );

    let k = keel_or_skip!("--io-uring", "on", "--ring-sched", "normal");
    assert_eq!(transport_of(&k).as_deref(), Some("io_uring"));
    assert!(ring_threads_reach(&k, libc::SCHED_OTHER as u32, secs(5)));
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(ring_policies(k.pid())
        .iter()
        .all(|&p| p == libc::SCHED_OTHER as u32));
}

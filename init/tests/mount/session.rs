//! The FUSE session over `/dev/fuse` (fuser's workers, each on its own clone of the fd):
//! every request kind from threads on every CPU at once; the end of the connection noticed
//! (unmounted from outside or aborted: `keel mount` saves and exits 0); and a keel killed
//! while its connection stays alive (someone else holds the fd), whose dead mount the next
//! `keel mount` aborts and detaches before anything can wait on it.

use crate::support;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Duration;

use support::mount::pattern;
use support::sys;

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

/// keel's open `/dev/fuse` fds (the connection's first and its clones).
fn fuse_fds(pid: i32) -> Vec<i32> {
    let mut fds: Vec<i32> = fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| fs::read_link(e.path()).is_ok_and(|l| l == Path::new("/dev/fuse")))
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort();
    fds
}

/// Names of keel's threads that serve FUSE requests (fuser's `fuser-N`).
fn fuse_workers(pid: i32) -> usize {
    fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter(|t| {
            fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("fuser-"))
        })
        .count()
}

#[test]
fn dev_fuse_workers_serve_every_request_kind_from_every_cpu() {
    let mut k = keel_or_skip!("--threads", "4");
    // Four workers, each reading its own fd: the connection's and three clones. fuser starts
    // its workers after the mount is up, so the count is polled (bounded), not read once.
    let pid = k.pid();
    let seen = support::mount::poll_for(support::mount::READY_TIMEOUT, || {
        (fuse_workers(pid) == 4 && fuse_fds(pid).len() == 4).then_some(())
    });
    assert!(
        seen.is_some(),
        "workers {}, /dev/fuse fds {:?}: {}",
        fuse_workers(pid),
        fuse_fds(pid),
        k.log_text()
    );
    workload(&k.mnt);
    let before = support::mount::snapshot(&k.mnt, false);
    k.remount();
    support::mount::assert_same_tree(
        &before,
        &support::mount::snapshot(&k.mnt, false),
        "after remount",
    );
    assert!(k.log_text().contains("fuse_requests="), "{}", k.log_text());
    assert!(
        k.log_text().contains("fuse_requests_unwaited="),
        "{}",
        k.log_text()
    );
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
fn ends_cleanly_when_the_connection_ends(end: impl FnOnce(&Path)) {
    let mut k = keel_or_skip!();
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
    assert!(
        !support::mount::is_fuse_mount(&k.mnt),
        "mount left behind:\n{log}"
    );
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
fn umount_from_outside_ends_keel_mount() {
    ends_cleanly_when_the_connection_ends(umount);
}

#[test]
fn aborted_connection_ends_keel_mount_and_is_unmounted() {
    ends_cleanly_when_the_connection_ends(abort);
}

/// A config whose final checkpoint has no time at all at a stop (`[persist] flush_timeout =
/// "0s"`) and whose periodic ones are an hour apart: whether a stop leaves a file written
/// just before it on the remote then depends only on how keel was stopped, never on the
/// machine's load.
fn no_final_budget(dir: &Path) -> String {
    let cfg = dir.join("no-final-budget.toml");
    fs::write(
        &cfg,
        "[persist]\nflush_timeout = \"0s\"\ninterval = \"1h\"\n",
    )
    .unwrap();
    cfg.to_str().unwrap().to_string()
}

/// Unmounted from outside, keel has no grace period running out (nobody is about to kill
/// it): its final checkpoint runs to its end whatever `[persist] flush_timeout` says (here
/// 0 s, which no save meets), so the outcome cannot depend on the load: exit 0, and the
/// remote has the file (restored from it into a fresh state dir).
#[test]
fn an_unmount_from_outside_saves_everything_to_the_remote_whatever_the_final_budget() {
    let cfgdir = tempfile::tempdir().unwrap();
    let cfg = no_final_budget(cfgdir.path());
    let mut k = keel_or_skip!("--config", cfg.as_str());
    let data = pattern(4 << 20, 5);
    fs::write(k.p("big"), &data).unwrap();
    umount(&k.mnt);
    let st = k.wait_exit();
    let log = k.log_text();
    assert!(
        st.is_some_and(|s| s.success()),
        "keel exited {st:?} after an unmount from outside; log:\n{log}"
    );
    assert!(!log.contains("did not reach the remote"), "{log}");
    let fresh = tempfile::Builder::new()
        .prefix("keel-mount-test.")
        .tempdir()
        .unwrap();
    let restored = fresh.path().join("state");
    let out = std::process::Command::new(support::mount::keel_bin())
        .args(["snapshot", "restore", "latest", "--state"])
        .arg(&restored)
        .arg("--remote")
        .arg(format!("file://{}/remote", k.state.display()))
        .env_remove("KEEL_CONFIG")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let k2 = support::keel::Keel::start_in(fresh, restored, &[]);
    assert!(
        fs::read(k2.p("big")).unwrap() == data,
        "the remote's copy of the file differs"
    );
}

/// Stopped by a signal, keel's final checkpoint gets `[persist] flush_timeout` (a grace
/// period is running out), here none: it exits 75, not 0 nor 1, and its last line says
/// exactly where the file is: safe in the state dir, not on the remote, uploaded first at
/// the next start (lost if the state dir is discarded). The next start has it.
#[test]
fn a_stop_whose_final_checkpoint_runs_out_of_time_exits_75_and_says_what_is_only_local() {
    let cfgdir = tempfile::tempdir().unwrap();
    let cfg = no_final_budget(cfgdir.path());
    let mut k = keel_or_skip!("--config", cfg.as_str());
    let data = pattern(4 << 20, 6);
    fs::write(k.p("big"), &data).unwrap();
    let st = k.terminate(libc::SIGTERM);
    let log = k.log_text();
    assert_eq!(st.code(), Some(75), "{st}; log:\n{log}");
    let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap();
    for want in [
        "keel: ",
        "final checkpoint failed",
        "did not reach the remote",
        "safe in the state dir",
        "uploaded first at the next start",
        "lost if the state dir is discarded",
    ] {
        assert!(last.contains(want), "`{want}` not in the last line: {last}");
    }
    k.start_again();
    assert!(fs::read(k.p("big")).unwrap() == data, "the file differs");
}

/// How long the remount over a dead keel's mount may take before the test calls it hung.
const REMOUNT_TIMEOUT: Duration = Duration::from_secs(90);

/// keel is killed while its connection stays alive: this test holds a duplicate of keel's
/// `/dev/fuse` fd, so the kernel does not end the connection, and nobody answers it. Any
/// stat of the mount point would now wait forever. The next `keel mount` (under a timeout)
/// must abort that connection and detach the mount before it touches the path, then serve
/// the state dir again.
#[test]
fn dead_keel_with_a_live_connection_is_aborted_by_the_next_mount() {
    dead_keel_is_aborted_by_the_next_mount(&[]);
}

/// The same with a source that does not say keel: the next mount knows its own fsname.
#[test]
fn dead_keel_mounted_with_its_own_fsname_is_aborted_by_the_next_mount() {
    let name = format!("scratch-{}", std::process::id());
    dead_keel_is_aborted_by_the_next_mount(&["--fsname", &name]);
}

fn dead_keel_is_aborted_by_the_next_mount(args: &[&str]) {
    let Some(mut k) = support::mount::Keel::start(args) else {
        return;
    };
    fs::write(k.p("a"), b"one").unwrap();
    fs::File::open(k.p("a")).unwrap().sync_all().unwrap();
    let fd = *fuse_fds(k.pid()).first().expect("keel has /dev/fuse open");
    let held = sys::steal_fd(k.pid(), fd).expect("pidfd_getfd of keel's /dev/fuse");
    k.kill9_leave_mount();
    assert!(
        support::mount::is_fuse_mount(&k.mnt),
        "the dead mount is still there"
    );

    // The remount runs in a thread: if keel (or this test) hangs on the dead mount, the test
    // fails after REMOUNT_TIMEOUT instead of hanging too.
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        k.start_again();
        let got = fs::read(k.p("a")).unwrap();
        let _ = tx.send(());
        (k, got)
    });
    if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(REMOUNT_TIMEOUT) {
        panic!("keel mount over a dead keel's live connection hung for {REMOUNT_TIMEOUT:?}");
    }
    let (k, got) = t.join().expect("remount over the dead mount failed");
    assert_eq!(got, b"one");
    let log = k.log_text();
    assert!(
        log.contains("aborted and detached the FUSE mount a dead keel left behind"),
        "{log}"
    );
    // The old connection was aborted: reading it now fails instead of blocking.
    let mut buf = vec![0u8; 1 << 20 | 4096];
    let r = nix::unistd::read(&held, &mut buf);
    assert!(
        matches!(
            r,
            Err(nix::errno::Errno::ENODEV | nix::errno::Errno::ECONNABORTED)
        ),
        "old connection still alive: read gave {r:?}"
    );
}

/// Each mount has its own source (`keel:<state dir>` unless `--fsname` names it), so tools
/// that tell mounts apart by their source can: `umount SOURCE` (how xfstests unmounts its
/// TEST_DEV and SCRATCH_DEV) ends that keel, which saves and exits 0, and leaves the other
/// mounted and serving.
#[test]
fn each_mount_has_its_own_source_and_umount_by_source_ends_only_that_one() {
    let a = keel_or_skip!();
    let name = format!("keel:session-test-{}", std::process::id());
    let mut b = keel_or_skip!("--fsname", name.as_str());
    let source = |m: &Path| support::mount::fuse_mount_source(m);
    assert_eq!(
        source(&a.mnt),
        Some(format!("keel:{}", a.state.display())),
        "default source"
    );
    assert_eq!(source(&b.mnt).as_deref(), Some(name.as_str()));
    fs::write(b.p("f"), b"b's").unwrap();
    let st = std::process::Command::new("umount")
        .arg(&name)
        .status()
        .unwrap();
    assert!(st.success(), "umount {name} failed");
    let st = b.wait_exit();
    assert!(
        st.is_some_and(|s| s.success()),
        "keel did not exit 0 after umount of its source ({st:?}); log:\n{}",
        b.log_text()
    );
    assert!(!support::mount::is_fuse_mount(&b.mnt));
    assert!(
        support::mount::is_fuse_mount(&a.mnt),
        "the other mount went too"
    );
    fs::write(a.p("g"), b"still here").unwrap();
    assert_eq!(fs::read(a.p("g")).unwrap(), b"still here");
    b.start_again();
    assert_eq!(source(&b.mnt).as_deref(), Some(name.as_str()));
    assert_eq!(fs::read(b.p("f")).unwrap(), b"b's");
}

//! `keel rollback --restart` when the main command's process group outlives its SIGKILL: a
//! process asleep on a FUSE request that its server has read but not answered cannot be
//! killed until the answer comes. This test serves such a filesystem itself (`HangFs`, on
//! fuser, the crate keel serves its workspace with): the main command looks up `hang` there
//! and sleeps uninterruptibly until the test answers. The rollback must then fail without
//! rolling anything back, and the main command must start again by itself once its group is
//! gone, so the sandbox is not left without it.

use crate::support;

use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, SystemTime};

use fuser::{Errno, FileAttr, FileHandle, FileType, INodeNo, ReplyAttr, ReplyEntry, Request};
use support::mount::{keel_bin, poll_for};

/// Lookups of `hang` held unanswered, and a wake-up for whoever waits for one to arrive.
#[derive(Default)]
struct Held {
    replies: Mutex<Vec<ReplyEntry>>,
    arrived: Condvar,
}

impl Held {
    /// Answers every held lookup with ENOENT: their callers wake up (and die, if killed).
    fn release(&self) {
        for r in self.replies.lock().unwrap().drain(..) {
            r.error(Errno::ENOENT);
        }
    }
}

/// An empty root directory whose lookup of `hang` is answered only by `Held::release`.
struct HangFs(Arc<Held>);

fn root_attr() -> FileAttr {
    let t = SystemTime::UNIX_EPOCH;
    FileAttr {
        ino: INodeNo::ROOT,
        size: 0,
        blocks: 0,
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        kind: FileType::Directory,
        perm: 0o755,
        nlink: 2,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl fuser::Filesystem for HangFs {
    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino == INodeNo::ROOT {
            reply.attr(&Duration::ZERO, &root_attr());
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn lookup(&self, _req: &Request, _parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if name == "hang" {
            self.0.replies.lock().unwrap().push(reply);
            self.0.arrived.notify_all();
        } else {
            reply.error(Errno::ENOENT);
        }
    }
}

/// `HangFs` mounted at a path; dropping it answers what is held, aborts the connection and
/// detaches the mount (also when the test panics).
struct HangMount {
    mnt: PathBuf,
    held: Arc<Held>,
    server: Option<std::thread::JoinHandle<()>>,
}

impl HangMount {
    fn start(mnt: &Path) -> HangMount {
        std::fs::create_dir_all(mnt).unwrap();
        let dev: OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .expect("open /dev/fuse")
            .into();
        keel::sys::mount::mount_fuse(dev.as_fd(), mnt, "keel-test-hang").expect("mount HangFs");
        let held = Arc::new(Held::default());
        let session = fuser::Session::from_fd(
            HangFs(held.clone()),
            dev,
            fuser::SessionACL::All,
            fuser::Config::default(),
        )
        .expect("serve HangFs");
        let server = std::thread::spawn(move || {
            let _ = session.run();
        });
        HangMount {
            mnt: mnt.to_path_buf(),
            held,
            server: Some(server),
        }
    }

    /// Waits until a lookup of `hang` is held: its caller now sleeps uninterruptibly.
    fn wait_for_a_caller(&self) -> bool {
        let g = self.held.replies.lock().unwrap();
        let (g, _) = self
            .held
            .arrived
            .wait_timeout_while(g, support::pid1::LIMIT, |r| r.is_empty())
            .unwrap();
        !g.is_empty()
    }
}

impl Drop for HangMount {
    fn drop(&mut self) {
        self.held.release();
        if let Some(c) = keel::sys::mount::fuse_connection_at(&self.mnt) {
            let _ = keel::sys::mount::abort_fuse_connection(c.minor);
        }
        let _ = keel::sys::mount::unmount_lazy(&self.mnt);
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
    }
}

fn keel(args: &[&str]) -> std::process::Output {
    Command::new(keel_bin())
        .args(args)
        .output()
        .expect("run keel")
}

#[test]
fn rollback_restart_starts_the_main_command_again_when_its_stop_timed_out() {
    if !support::pid1::require_root_and_fuse(
        "rollback --restart with a main command that outlives SIGKILL",
    ) {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("keel-hold-test.")
        .tempdir()
        .unwrap();
    let hang = HangMount::start(&dir.path().join("hangfs"));
    // The first run looks `hang` up (and sleeps until the test answers); later runs wait.
    let script = format!(
        "echo $$ >> $D/starts; if [ ! -e $D/hung ]; then touch $D/hung; exec cat {}/hang; fi; exec sleep 600",
        hang.mnt.display()
    );
    let config = format!(
        "{}[shutdown]\ngrace = \"1s\"\n",
        support::keel::workspace_config("")
    );
    let mut k = support::pid1::start_with(&config, &["sh", "-c", &script], Default::default());
    let starts = k.path("starts");
    let runs = || {
        std::fs::read_to_string(&starts)
            .unwrap_or_default()
            .lines()
            .count()
    };
    assert!(
        hang.wait_for_a_caller(),
        "the main command never looked up `hang`; log:\n{}",
        k.log_text()
    );
    let cfg = k.path("config.toml");
    let cfg = cfg.to_str().unwrap();
    let out = keel(&["snapshot", "create", "--config", cfg, "--name", "s1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(k.mnt.join("extra"), b"after s1").unwrap();

    // The stop signal, SIGKILL after the 1 s grace, and the group is still there 10 s later.
    let out = keel(&["rollback", "--config", cfg, "--restart", "s1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the rollback went through: {err}");
    assert!(
        err.contains("nothing was rolled back")
            && err.contains("starts again once the group is gone"),
        "{err}"
    );
    assert!(
        k.mnt.join("extra").exists(),
        "the refused rollback rolled back"
    );
    assert_eq!(runs(), 1, "started again while the old one still runs");

    // The stuck process gets its answer and dies of its SIGKILL: the command starts again.
    hang.held.release();
    let again = poll_for(support::pid1::LIMIT, || (runs() == 2).then_some(()));
    assert!(
        again.is_some(),
        "the main command was not started again once its group was gone; log:\n{}",
        k.log_text()
    );
    // The hold is free again: the next rollback --restart goes through.
    let out = keel(&["rollback", "--config", cfg, "--restart", "s1", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["restarted"], true, "{v}");
    assert!(
        !k.mnt.join("extra").exists(),
        "the rollback left a later file"
    );
    let third = poll_for(support::pid1::LIMIT, || (runs() == 3).then_some(()));
    assert!(third.is_some(), "log:\n{}", k.log_text());
    k.terminate(libc::SIGTERM);
}

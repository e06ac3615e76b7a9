//! Helpers for the real-mount integration tests (`init/tests/mount_*.rs`): start the built
//! `keel mount` binary on a temp state dir + temp mount point, wait until the kernel shows the
//! FUSE mount, and always clean up (a Drop guard SIGTERMs keel and `umount -l`s the mount point,
//! even when the test panics).
//!
//! Gate: these tests need root and `/dev/fuse`. Without them a test returns early after
//! printing "skipping: needs root and /dev/fuse" — unless `CI` is set, where it panics, so a
//! CI machine that lost its FUSE device fails instead of silently testing nothing.
//!
//! `KEEL_TEST_BIN` overrides the binary (e.g. `ci/dev/fake-keel` to develop the harness).
//! Timeouts here only bound how long a hung daemon is waited for; no outcome depends on them.

use super::sys;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Hang guards (no outcome depends on them): a mount, a file or a log line keel makes
/// comes well within them even on a loaded machine.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);
pub const STOP_TIMEOUT: Duration = Duration::from_secs(120);

/// True when real-mount tests can run. See the module docs for the CI rule.
pub fn fuse_available() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let fuse = Path::new("/dev/fuse").exists();
    if root && fuse {
        return true;
    }
    let why = match (root, fuse) {
        (false, false) => "not root, no /dev/fuse",
        (false, true) => "not root",
        _ => "no /dev/fuse",
    };
    if std::env::var_os("CI").is_some() {
        panic!("real-mount tests need root and /dev/fuse ({why}), and CI is set: refusing to skip");
    }
    eprintln!("skipping: needs root and /dev/fuse ({why})");
    false
}

/// Starts keel on fresh temp dirs, or returns from the test when mounts are unavailable.
#[macro_export]
macro_rules! keel_or_skip {
    () => {
        match $crate::support::mount::Keel::start(&[]) {
            Some(k) => k,
            None => return,
        }
    };
    ($($arg:expr),+ $(,)?) => {
        match $crate::support::mount::Keel::start(&[$($arg),+]) {
            Some(k) => k,
            None => return,
        }
    };
}

pub fn keel_bin() -> OsString {
    std::env::var_os("KEEL_TEST_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_keel").into())
}

/// Is `mnt` currently a FUSE mount point (fstype `fuse` or `fuse.*` in /proc/self/mountinfo)?
pub fn is_fuse_mount(mnt: &Path) -> bool {
    fuse_mount_id(mnt).is_some()
}

/// The mount ID of the last FUSE mount at `mnt` in /proc/self/mountinfo,
/// without touching `mnt` itself.
pub fn fuse_mount_id(mnt: &Path) -> Option<String> {
    fuse_mount_fields(mnt).map(|(id, _)| id)
}

/// The source (unescaped) of the last FUSE mount at `mnt`, as /proc/self/mountinfo shows it.
pub fn fuse_mount_source(mnt: &Path) -> Option<String> {
    fuse_mount_fields(mnt).map(|(_, source)| source)
}

/// (mount ID, source) of the last FUSE mount at `mnt`, without touching `mnt` itself.
fn fuse_mount_fields(mnt: &Path) -> Option<(String, String)> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    // Canonicalize the parent only: a stat of a dead mount may wait forever.
    let want = match (mnt.parent().map(fs::canonicalize), mnt.file_name()) {
        (Some(Ok(parent)), Some(name)) => parent.join(name),
        _ => mnt.to_path_buf(),
    };
    let want = want.to_string_lossy().into_owned();
    info.lines().rev().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let sep = fields.iter().position(|f| *f == "-")?;
        let fstype = fields.get(sep + 1).copied().unwrap_or("");
        let source = unescape_mountinfo(fields.get(sep + 2).copied().unwrap_or(""));
        (fields.get(4).map(|m| unescape_mountinfo(m)) == Some(want.clone())
            && (fstype == "fuse" || fstype.starts_with("fuse.") || any_fstype()))
        .then(|| (fields[0].to_string(), source))
    })
}

/// KEEL_TEST_ANY_FSTYPE=1: accept a non-FUSE mount (ci/dev/bind-keel, to validate the tests).
fn any_fstype() -> bool {
    std::env::var_os("KEEL_TEST_ANY_FSTYPE").is_some()
}

pub fn unescape_mountinfo(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// `umount -l`: detach even a mount whose daemon died (ENOTCONN).
pub fn lazy_unmount(mnt: &Path) {
    let _ = sys::umount_detach(mnt);
}

/// How a `keel mount` attempt ended.
#[derive(Debug)]
pub enum MountOutcome {
    Mounted(Child),
    Exited { status: ExitStatus, stderr: String },
}

/// Spawns `keel mount --state STATE MNT ARGS...` with output appended to `log`, and waits until
/// the mount appears or the process exits.
pub fn spawn_mount(state: &Path, mnt: &Path, args: &[String], log: &Path) -> MountOutcome {
    spawn_mount_env(state, mnt, args, &[], log)
}

/// [`spawn_mount`] with `env` added to keel's environment.
pub fn spawn_mount_env(
    state: &Path,
    mnt: &Path,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
) -> MountOutcome {
    // Not through a mount a dead keel left (a stat of it may wait forever): that one is the
    // new keel's to clear.
    let dead = fuse_mount_id(mnt);
    if dead.is_none() {
        fs::create_dir_all(mnt).expect("create mount point");
    }
    let out = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("open log");
    let start_len = out.metadata().map(|m| m.len()).unwrap_or(0);
    let mut child = Command::new(keel_bin())
        .arg("mount")
        .arg("--state")
        .arg(state)
        .arg(mnt)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("dup log"))
        .stderr(out)
        .spawn()
        .expect("spawn keel");
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let stderr = read_from(log, start_len);
            return MountOutcome::Exited { status, stderr };
        }
        // A new mount, not the one a dead keel left there (the kernel reuses mount ids and
        // device numbers at once, so keel's log line says it).
        if is_fuse_mount(mnt)
            && (dead.is_none() || read_from(log, start_len).contains("workspace mounted"))
        {
            return MountOutcome::Mounted(child);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            lazy_unmount(mnt);
            panic!(
                "keel mount {} not ready after {READY_TIMEOUT:?} (FUSE mount there: {:?}, before: {dead:?}); log:\n{}",
                mnt.display(),
                fuse_mount_id(mnt),
                read_from(log, start_len)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_from(log: &Path, offset: u64) -> String {
    let mut s = String::new();
    if let Ok(mut f) = fs::File::open(log) {
        use std::io::Seek;
        let _ = f.seek(std::io::SeekFrom::Start(offset));
        let _ = f.read_to_string(&mut s);
    }
    s
}

/// Polls `f` every 20 ms until it gives something or `within` has passed.
pub fn poll_for<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        let t = f();
        if t.is_some() || Instant::now() > deadline {
            return t;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to exit, SIGKILLing it after `timeout`. Returns None if it had to be killed.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[allow(unused_imports)] // not every test crate starts a keel
pub use super::keel::Keel;

// ---------------------------------------------------------------------------------------------
// Tree snapshots: everything "identical bytes and metadata" means across remounts and crashes.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: &'static str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u64,
    pub size: u64,
    pub ino: u64,
    pub rdev: u64,
    pub mtime_ns: i128,
    pub ctime_ns: i128,
    /// Only when asked: reads may legitimately update atime (relatime).
    pub atime_ns: Option<i128>,
    pub target: Option<PathBuf>,
    pub xattrs: BTreeMap<String, Vec<u8>>,
    pub content: Option<blake3::Hash>,
}

pub fn kind_of(ft: fs::FileType) -> &'static str {
    if ft.is_file() {
        "file"
    } else if ft.is_dir() {
        "dir"
    } else if ft.is_symlink() {
        "symlink"
    } else if ft.is_fifo() {
        "fifo"
    } else if ft.is_char_device() {
        "chr"
    } else if ft.is_block_device() {
        "blk"
    } else if ft.is_socket() {
        "sock"
    } else {
        "unknown"
    }
}

pub fn ns(sec: i64, nsec: i64) -> i128 {
    sec as i128 * 1_000_000_000 + nsec as i128
}

/// Metadata of one path (not following symlinks), without reading file contents.
pub fn stat_entry(path: &Path, with_atime: bool) -> Entry {
    let md = fs::symlink_metadata(path).unwrap_or_else(|e| panic!("lstat {}: {e}", path.display()));
    let kind = kind_of(md.file_type());
    let xattrs = if kind == "symlink" {
        BTreeMap::new()
    } else {
        sys::list_xattrs(path)
            .unwrap_or_else(|e| panic!("listxattr {}: {e}", path.display()))
            .into_iter()
            .map(|n| {
                let v = sys::get_xattr(path, &n).unwrap_or_else(|e| panic!("getxattr {n}: {e}"));
                (n, v)
            })
            .collect()
    };
    Entry {
        kind,
        mode: md.mode(),
        uid: md.uid(),
        gid: md.gid(),
        nlink: md.nlink(),
        size: if kind == "dir" { 0 } else { md.size() },
        ino: md.ino(),
        rdev: md.rdev(),
        mtime_ns: ns(md.mtime(), md.mtime_nsec()),
        ctime_ns: ns(md.ctime(), md.ctime_nsec()),
        atime_ns: with_atime.then(|| ns(md.atime(), md.atime_nsec())),
        target: (kind == "symlink").then(|| fs::read_link(path).expect("readlink")),
        xattrs,
        content: None,
    }
}

/// Relative paths of `root` ("" for root itself) and everything below it, without reading files.
pub fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let full = root.join(&rel);
        if fs::symlink_metadata(&full).expect("lstat").is_dir() {
            for de in fs::read_dir(&full).expect("readdir") {
                stack.push(rel.join(de.expect("dirent").file_name()));
            }
        }
        out.push(rel);
    }
    out.sort();
    out
}

/// Every entry below `root` (relative path → Entry), stat taken before contents are read.
pub fn snapshot(root: &Path, with_atime: bool) -> BTreeMap<PathBuf, Entry> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let full = root.join(&rel);
        let mut e = stat_entry(&full, with_atime);
        if e.kind == "dir" {
            for de in fs::read_dir(&full).expect("readdir") {
                stack.push(rel.join(de.expect("dirent").file_name()));
            }
        }
        if e.kind == "file" {
            e.content = Some(hash_file(&full));
        }
        out.insert(rel, e);
    }
    out
}

pub fn hash_file(path: &Path) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    let mut f = fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    h.finalize()
}

/// Panics with a readable per-field diff when the two snapshots differ.
pub fn assert_same_tree(
    before: &BTreeMap<PathBuf, Entry>,
    after: &BTreeMap<PathBuf, Entry>,
    what: &str,
) {
    let mut diffs = Vec::new();
    for (p, a) in before {
        match after.get(p) {
            None => diffs.push(format!("{}: missing after {what}", p.display())),
            Some(b) if a != b => diffs.push(format!(
                "{}:\n    before {a:?}\n    after  {b:?}",
                p.display()
            )),
            _ => {}
        }
    }
    for p in after.keys().filter(|p| !before.contains_key(*p)) {
        diffs.push(format!("{}: appeared after {what}", p.display()));
    }
    assert!(
        diffs.is_empty(),
        "tree changed across {what}:\n  {}",
        diffs.join("\n  ")
    );
}

/// Deterministic pseudo-random bytes (xorshift), so content mismatches are reproducible.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// The errno of an io::Error (panics if it has none).
pub fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error()
        .unwrap_or_else(|| panic!("no errno in {e}"))
}

/// Asserts `r` failed with `want` (an errno), with a readable message.
#[track_caller]
pub fn assert_errno<T: std::fmt::Debug>(r: std::io::Result<T>, want: i32, what: &str) {
    match r {
        Ok(v) => panic!(
            "{what}: expected errno {want} ({}), got Ok({v:?})",
            errname(want)
        ),
        Err(e) => assert_eq!(
            errno(&e),
            want,
            "{what}: expected {} got {e}",
            errname(want)
        ),
    }
}

pub fn errname(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

//! kill -9 crash loop on a real mount: a random workload with fsyncs runs while periodic
//! checkpoints are taken every 100 ms; keel is killed with SIGKILL at a random moment;
//! `keel fsck` (local state and remote) must be clean; after remounting, every file whose
//! fsync returned is byte-identical. At the end a clean stop takes a final checkpoint, and a
//! restore of the remote into a fresh state dir shows the same files.
//!
//! Needs root and /dev/fuse: without them the test prints a skip line, or panics when the
//! `CI` environment variable is set.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const KEEL: &str = env!("CARGO_BIN_EXE_keel");
/// Every wait here gives up after this long: a hang guard (no outcome depends on it).
const HANG_GUARD: Duration = Duration::from_secs(120);

fn can_mount() -> bool {
    let root = nix_is_root();
    let fuse = Path::new("/dev/fuse").exists();
    if root && fuse {
        return true;
    }
    let why = format!("needs root ({root}) and /dev/fuse ({fuse})");
    if std::env::var_os("CI").is_some() {
        panic!("persist_crash: {why}, and CI is set: refusing to skip");
    }
    println!("SKIP persist_crash: {why}");
    false
}

fn nix_is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

fn mounted(mp: &Path) -> bool {
    let want = mp.to_string_lossy().into_owned();
    fs::read_to_string("/proc/self/mountinfo")
        .map(|s| {
            s.lines()
                .any(|l| l.split(' ').nth(4) == Some(want.as_str()) && l.contains("fuse"))
        })
        .unwrap_or(false)
}

/// A running `keel mount`, killed and its mount point detached if the test panics.
struct Mount(Option<Child>, PathBuf);

impl Mount {
    fn take(mut self) -> Child {
        self.0.take().expect("running")
    }

    /// Stops keel the way the platform does (SIGTERM) and waits for it to exit.
    fn stop(self) -> ExitStatus {
        let mut child = self.take();
        Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status()
            .unwrap();
        child.wait().unwrap()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
            // A killed FUSE daemon leaves its mount behind ("transport endpoint is not
            // connected") for every later test run to trip over.
            detach(&self.1);
        }
    }
}

struct Rig {
    state: PathBuf,
    mnt: PathBuf,
    config: PathBuf,
    _dir: tempfile::TempDir,
}

impl Rig {
    fn new() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let mnt = dir.path().join("mnt");
        let config = dir.path().join("config.toml");
        fs::write(
            &config,
            "[workspace]\nchunk_size = \"64KiB\"\n[persist]\ninterval = \"100ms\"\nflush_timeout = \"20s\"\ngc_every = 5\ngc_grace = \"0s\"\nkeep = 3\n",
        )
        .unwrap();
        Rig {
            state,
            mnt,
            config,
            _dir: dir,
        }
    }

    fn mount(&self) -> Mount {
        let child = Command::new(KEEL)
            .arg("mount")
            .arg("--state")
            .arg(&self.state)
            .arg(&self.mnt)
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let m = Mount(Some(child), self.mnt.clone());
        let t0 = Instant::now();
        while !mounted(&self.mnt) {
            assert!(t0.elapsed() < HANG_GUARD, "keel mount did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    fn keel(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(KEEL)
            .args(args)
            .arg("--state")
            .arg(&self.state)
            .arg("--config")
            .arg(&self.config)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }
}

/// A tmpfs state volume, lazily unmounted when dropped.
struct TmpfsVolume(PathBuf);

impl Drop for TmpfsVolume {
    fn drop(&mut self) {
        detach(&self.0);
    }
}

/// A rig whose state dir is on a fresh tmpfs of `size` (`24m`) in a scratch dir; `config`
/// writes its config.toml, given the scratch dir. Bind all three: they drop in reverse
/// (the rig's mount first, then the volume, then the scratch dir).
fn rig_on_tmpfs(
    size: &str,
    config: impl FnOnce(&Path) -> String,
) -> (tempfile::TempDir, TmpfsVolume, Rig) {
    let dir = tempfile::tempdir().unwrap();
    let vol = dir.path().join("vol");
    fs::create_dir_all(&vol).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(&vol)
        .status()
        .unwrap();
    assert!(ok.success(), "mount tmpfs");
    let guard = TmpfsVolume(vol.clone());
    let path = dir.path().join("config.toml");
    fs::write(&path, config(dir.path())).unwrap();
    let rig = Rig {
        state: vol.join("state"),
        mnt: dir.path().join("mnt"),
        config: path,
        _dir: tempfile::tempdir().unwrap(),
    };
    (dir, guard, rig)
}

fn detach(mp: &Path) {
    let _ = Command::new("umount").arg("-l").arg(mp).status();
}

/// Tiny deterministic PRNG.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes_upto(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max) as usize;
        self.bytes(n)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let fill = self.next() as u8;
        let mut v = vec![fill; n];
        // Mostly compressible runs with random bytes sprinkled in; some all-zero windows.
        for i in (0..n).step_by(97) {
            v[i] = self.next() as u8;
        }
        v
    }
}

/// What a file must contain after a crash: known bytes (fsync returned) or unknown.
type Model = Arc<Mutex<BTreeMap<String, Option<Vec<u8>>>>>;

fn workload(mnt: PathBuf, model: Model, stop: Arc<AtomicBool>, seed: u64) {
    let mut rng = Rng(seed | 1);
    let _ = fs::create_dir_all(mnt.join("d"));
    while !stop.load(Ordering::Relaxed) {
        let name = format!(
            "{}f{}",
            if rng.below(2) == 0 { "d/" } else { "" },
            rng.below(12)
        );
        let path = mnt.join(&name);
        model.lock().unwrap().insert(name.clone(), None);
        let r: std::io::Result<Option<Vec<u8>>> = (|| match rng.below(5) {
            0 | 1 => {
                // Rewrite whole, fsync.
                let data = rng.bytes_upto(400_000);
                let mut f = File::create(&path)?;
                f.write_all(&data)?;
                f.sync_all()?;
                Ok(Some(data))
            }
            2 => {
                // Overwrite a range and fsync: the file is known if we knew it before.
                let mut cur = fs::read(&path)?;
                let off = rng.below(cur.len() as u64 + 1) as usize;
                let data = rng.bytes_upto(150_000);
                let f = OpenOptions::new().write(true).open(&path)?;
                f.write_all_at(&data, off as u64)?;
                f.sync_data()?;
                if cur.len() < off + data.len() {
                    cur.resize(off + data.len(), 0);
                }
                cur[off..off + data.len()].copy_from_slice(&data);
                Ok(Some(cur))
            }
            3 => {
                // Write without fsync: unknown afterwards.
                let f = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)?;
                f.write_all_at(&rng.bytes(70_000), rng.below(300_000))?;
                Ok(None)
            }
            _ => {
                // Atomic replace: write a temp file, fsync, rename, fsync the directory.
                let tmp = mnt.join(format!("tmp{}", rng.below(1000)));
                let data = rng.bytes_upto(200_000);
                let mut f = File::create(&tmp)?;
                f.write_all(&data)?;
                f.sync_all()?;
                fs::rename(&tmp, &path)?;
                File::open(path.parent().unwrap())?.sync_all()?;
                Ok(Some(data))
            }
        })();
        match r {
            Ok(state) => {
                model.lock().unwrap().insert(name, state);
            }
            // The daemon died under us: stop (the entry stays unknown).
            Err(_) if stop.load(Ordering::Relaxed) => break,
            Err(e)
                if e.raw_os_error() == Some(libc::ENOTCONN)
                    || e.raw_os_error() == Some(libc::ECONNABORTED) =>
            {
                break
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("workload op on {name}: {e}"),
        }
    }
}

fn verify(mnt: &Path, model: &BTreeMap<String, Option<Vec<u8>>>, iteration: u32) -> usize {
    let mut checked = 0;
    for (name, want) in model {
        if let Some(want) = want {
            let got = fs::read(mnt.join(name)).unwrap_or_else(|e| {
                panic!("iteration {iteration}: {name} acknowledged by fsync but unreadable: {e}")
            });
            assert!(
                got == *want,
                "iteration {iteration}: {name} differs after crash ({} vs {} bytes)",
                got.len(),
                want.len()
            );
            checked += 1;
        }
    }
    checked
}

#[test]
fn kill9_crash_loop_keeps_fsynced_files_and_fsck_clean() {
    if !can_mount() {
        return;
    }
    let iterations: u32 = std::env::var("KEEL_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let rig = Rig::new();
    let model: Model = Arc::new(Mutex::new(BTreeMap::new()));
    let mut rng = Rng(0x5eed_1234);
    let mut verified = 0;
    for it in 0..iterations {
        let m = rig.mount();
        verified += verify(&rig.mnt, &model.lock().unwrap(), it);
        let stop = Arc::new(AtomicBool::new(false));
        let w = {
            let (m, s, mnt) = (model.clone(), stop.clone(), rig.mnt.clone());
            let seed = rng.next();
            std::thread::spawn(move || workload(mnt, m, s, seed))
        };
        std::thread::sleep(Duration::from_millis(50 + rng.below(600)));
        let mut child = m.take();
        child.kill().unwrap();
        stop.store(true, Ordering::Relaxed);
        let t0 = Instant::now();
        while child.try_wait().unwrap().is_none() {
            // A daemon thread blocked on its own mount keeps a killed keel alive forever.
            assert!(
                t0.elapsed() < HANG_GUARD,
                "iteration {it}: keel did not exit after SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        w.join().expect("workload thread");
        detach(&rig.mnt);
        let (ok, out) = rig.keel(&["fsck"]);
        assert!(
            ok,
            "iteration {it}: fsck after kill -9 is not clean:\n{out}"
        );
        assert!(!out.contains("error:"), "iteration {it}:\n{out}");
    }
    // Clean stop: the final checkpoint carries everything to the remote.
    let m = rig.mount();
    verified += verify(&rig.mnt, &model.lock().unwrap(), iterations);
    let mut local: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for name in model.lock().unwrap().keys() {
        if let Ok(b) = fs::read(rig.mnt.join(name)) {
            local.insert(name.clone(), b);
        }
    }
    let st = m.stop();
    assert!(st.success(), "clean stop failed: {st}");
    let (ok, out) = rig.keel(&["fsck"]);
    assert!(ok, "{out}");
    let restored = rig._dir.path().join("restored");
    let remote = format!("file://{}", rig.state.join("remote").display());
    let out = Command::new(KEEL)
        .args(["snapshot", "restore", "latest", "--state"])
        .arg(&restored)
        .arg("--remote")
        .arg(&remote)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rig2 = Rig {
        state: restored,
        mnt: rig._dir.path().join("mnt2"),
        config: rig.config.clone(),
        _dir: tempfile::tempdir().unwrap(),
    };
    let m = rig2.mount();
    for (name, want) in &local {
        let got = fs::read(rig2.mnt.join(name)).unwrap();
        assert!(got == *want, "{name} differs in the restored workspace");
    }
    assert!(m.stop().success());
    println!("crash loop: {iterations} kills, {verified} fsync-acknowledged files verified, {} files restored", local.len());
}

/// A state volume that fills up: writers get ENOSPC (not EIO, not a hang), keel stops
/// cleanly, and fsck of the state dir stays clean.
#[test]
fn enospc_on_a_tiny_state_volume_keeps_fsck_clean() {
    if !can_mount() {
        return;
    }
    // The remote lives outside the small volume.
    let (_dir, _vol, rig) = rig_on_tmpfs("24m", |dir| {
        format!(
            "[persist]\ninterval = \"0s\"\nremote = \"file://{}\"\n",
            dir.join("remote").display()
        )
    });
    let m = rig.mount();
    let mut got_enospc = false;
    let mut written = 0u64;
    'outer: for i in 0..100 {
        let mut f = match File::create(rig.mnt.join(format!("f{i}"))) {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                got_enospc = true;
                break;
            }
            Err(e) => panic!("create: {e}"),
        };
        let chunk = vec![0xabu8; 1 << 20];
        for _ in 0..4 {
            match f.write_all(&chunk).and_then(|_| f.sync_all()) {
                Ok(()) => written += chunk.len() as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    got_enospc = true;
                    break 'outer;
                }
                Err(e) => panic!("write after {written} bytes: {e} (expected ENOSPC)"),
            }
        }
    }
    assert!(
        got_enospc,
        "wrote {written} bytes to a 24 MiB volume without ENOSPC"
    );
    // Make room and stop cleanly: the final checkpoint goes to the remote outside.
    for i in 0..4 {
        let _ = fs::remove_file(rig.mnt.join(format!("f{i}")));
    }
    let st = m.stop();
    let (ok, out) = rig.keel(&["fsck"]);
    assert!(
        ok && !out.contains("error:"),
        "fsck after ENOSPC (keel exit {st}):\n{out}"
    );
    println!(
        "enospc: {written} bytes written before ENOSPC; keel exit {st}; {}",
        out.lines().last().unwrap_or("")
    );
}

/// The default remote (`file://<state>/remote`) is on the state volume and holds history
/// only: a checkpoint that would not leave a tenth of the volume free is skipped with an
/// error that says so, and the workspace keeps the room it needs. Without this, a copy of
/// a large file per checkpoint filled the volume and the workspace's own writes failed.
#[test]
fn checkpoints_to_a_remote_on_the_state_volume_leave_the_workspace_room() {
    if !can_mount() {
        return;
    }
    // No remote named: the default one, under the state dir on the 64 MiB volume.
    let (_dir, _vol, rig) = rig_on_tmpfs("64m", |_| {
        "[persist]\ninterval = \"0s\"\nflush_timeout = \"20s\"\n".into()
    });
    let m = rig.mount();
    let mut rng = Rng(0x5eed_cafe);
    fs::write(rig.mnt.join("small"), rng.bytes(1 << 20)).unwrap();
    let (ok, out) = rig.keel(&["checkpoint"]);
    assert!(ok && out.contains("snapshot"), "a small checkpoint: {out}");

    // A second copy of 36 MiB (incompressible) would leave less than 6.4 MiB free.
    fs::write(rig.mnt.join("big"), rng.bytes(36 << 20)).unwrap();
    let (ok, out) = rig.keel(&["checkpoint"]);
    assert!(
        !ok && out.contains("checkpoint skipped") && out.contains("state volume"),
        "a checkpoint that would fill the state volume: ok={ok} {out}"
    );
    // The workspace still has its room.
    let mut f = File::create(rig.mnt.join("more")).unwrap();
    f.write_all(&rng.bytes(8 << 20)).unwrap();
    f.sync_all().unwrap();
    drop(f);

    // Once the big file is gone, checkpoints fit again (its body leaves the volume
    // shortly after the unlink).
    fs::remove_file(rig.mnt.join("big")).unwrap();
    let t0 = Instant::now();
    loop {
        let (ok, out) = rig.keel(&["checkpoint"]);
        if ok {
            assert!(out.contains("snapshot"), "{out}");
            break;
        }
        assert!(
            t0.elapsed() < HANG_GUARD,
            "checkpoint after freeing the space: {out}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(m.stop().success(), "keel stops cleanly");
    let (ok, out) = rig.keel(&["fsck"]);
    assert!(ok && !out.contains("error:"), "fsck: {out}");
}

/// `keel checkpoint`, `keel snapshot list` and `keel gc` against a mounted workspace over its
/// socket; then SIGTERM while a process still holds a file open with written, unflushed
/// data: the final checkpoint carries it, and a restore of the remote shows it.
#[test]
fn cli_over_socket_and_sigterm_with_open_files() {
    if !can_mount() {
        return;
    }
    let rig = Rig::new();
    fs::write(
        &rig.config,
        "[persist]\ninterval = \"0s\"\nflush_timeout = \"20s\"\n",
    )
    .unwrap();
    let m = rig.mount();
    fs::create_dir_all(rig.mnt.join("d")).unwrap();
    fs::write(rig.mnt.join("d/a"), vec![7u8; 3 << 20]).unwrap();
    let (ok, out) = rig.keel(&["checkpoint"]);
    assert!(ok && out.contains("snapshot"), "{out}");
    let (ok, out) = rig.keel(&["snapshot", "list"]);
    assert!(ok && out.contains("(head)"), "{out}");
    let (ok, out) = rig.keel(&["gc"]);
    assert!(ok && out.contains("kept"), "{out}");
    // A writer that never closes or fsyncs.
    let mut open = File::create(rig.mnt.join("d/open")).unwrap();
    open.write_all(b"written but never flushed by the writer")
        .unwrap();
    let st = m.stop();
    drop(open);
    detach(&rig.mnt);
    // The writer kept the mount busy, but the final checkpoint ran before the unmount.
    let restored = rig._dir.path().join("restored");
    let remote = format!("file://{}", rig.state.join("remote").display());
    let out = Command::new(KEEL)
        .args(["snapshot", "restore", "latest", "--state"])
        .arg(&restored)
        .arg("--remote")
        .arg(&remote)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rig2 = Rig {
        state: restored,
        mnt: rig._dir.path().join("mnt2"),
        config: rig.config.clone(),
        _dir: tempfile::tempdir().unwrap(),
    };
    let m2 = rig2.mount();
    assert_eq!(
        fs::read(rig2.mnt.join("d/open")).unwrap(),
        b"written but never flushed by the writer",
        "keel exit {st}"
    );
    assert_eq!(fs::read(rig2.mnt.join("d/a")).unwrap(), vec![7u8; 3 << 20]);
    assert!(m2.stop().success());
    // The restored state dir checkpointed to its own (new) remote: complete there too.
    let (ok, out) = rig2.keel(&["fsck"]);
    assert!(ok && out.contains(" 0 errors"), "{out}");
    let again = rig._dir.path().join("again");
    let out = Command::new(KEEL)
        .args(["snapshot", "restore", "latest", "--state"])
        .arg(&again)
        .arg("--remote")
        .arg(format!("file://{}", rig2.state.join("remote").display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "restore from the second remote: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

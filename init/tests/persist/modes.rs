//! Private state on disk: every directory keel creates in a state dir and in a `file://`
//! remote is 0700 and every file 0600, under umask 000 and under umask 022, whoever made the
//! state dir. Two passes per umask: the library (workspace writes and fsync, lease,
//! checkpoints, fork, gc, eager and lazy restore, a restore that died midway (its
//! `restore.unfinished` marker), the body pool, the space reserves) and,
//! with root and /dev/fuse, the `keel` binary (mount, writes through the kernel, `keel
//! checkpoint` over its control socket, stop, `keel gc`, `keel fork`, `keel snapshot
//! restore`, and `keel run` with its control socket). Each tree is walked while keel has it
//! open (so the WAL, SHM and sockets are seen) and after; every entry's mode is asserted,
//! and the kinds of entry seen are printed.
//!
//! The umask is per process and the tests of this binary are threads of one process, so the
//! test starts this binary again with only itself selected and [`CHILD`] set, and the child
//! sets the umask for each pass: no other test runs under it.

use crate::support;

use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::stat::{umask, Mode};

use keel::chunk::{BodyPool, BodyStore};
use keel::config::PersistConfig;
use keel::persist::hydrate::RemoteChunks;
use keel::persist::restore::{restore, restore_with, RestoreMode};
use keel::persist::{acquire_lease, fork::fork, gc, open_remote, Persister, Repo};
use support::persist::*;

/// What a walk saw: entries by kind and name pattern, and every mode that is not private.
#[derive(Default)]
struct Walk {
    /// "kind pattern" (hex names collapsed) -> count.
    seen: BTreeMap<String, usize>,
    bad: Vec<String>,
    /// Entries that were gone by the time they were looked at (a live tree).
    vanished: usize,
}

impl Walk {
    /// Walks `root` (included), not following symlinks.
    fn tree(&mut self, label: &str, root: &Path) {
        self.entry(label, root, root);
    }

    fn entry(&mut self, label: &str, root: &Path, p: &Path) {
        // A tree keel has open changes under the walk (a checkpoint's metadata image, the
        // remote's `.tmp.*` of a lease renewal): an entry gone between its directory's read
        // and this look was private or not for a moment nobody can see any more; skipped.
        let m = match std::fs::symlink_metadata(p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && p != root => {
                self.vanished += 1;
                return;
            }
            Err(e) => panic!("{}: {e}", p.display()),
        };
        let ft = m.file_type();
        let perm = m.mode() & 0o7777;
        let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        let (kind, want) = if ft.is_dir() {
            ("dir", Some(0o700))
        } else if ft.is_file() {
            ("file", Some(0o600))
        } else if ft.is_socket() {
            // A socket is private when it is 0600, or reachable only through 0700
            // directories (asserted for every directory here anyway).
            ("socket", None)
        } else {
            ("other", Some(0))
        };
        *self
            .seen
            .entry(format!("{label} {kind:6} {:04o} /{}", perm, pattern(&rel)))
            .or_default() += 1;
        if let Some(w) = want {
            if perm != w {
                self.bad.push(format!(
                    "{label}: {kind} {} has mode {perm:04o}, want {w:04o}",
                    p.display()
                ));
            }
        }
        if ft.is_dir() {
            let list = match std::fs::read_dir(p) {
                Ok(l) => l,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && p != root => {
                    self.vanished += 1;
                    return;
                }
                Err(e) => panic!("{}: {e}", p.display()),
            };
            let mut names: Vec<_> = list.filter_map(|e| e.ok().map(|e| e.path())).collect();
            names.sort();
            for c in names {
                self.entry(label, root, &c);
            }
        }
    }

    fn has(&self, needle: &str) -> bool {
        self.seen.keys().any(|k| k.contains(needle))
    }

    /// Asserts that some entry seen so far matches `needle` (the pass exercised it).
    fn expect(&self, needle: &str) {
        assert!(
            self.has(needle),
            "no entry matches `{needle}`; seen:\n{}",
            self.seen.keys().cloned().collect::<Vec<_>>().join("\n")
        );
    }

    fn assert_private(&self, what: &str) {
        for (k, n) in &self.seen {
            println!("  {k}  x{n}");
        }
        println!(
            "  ({} entries gone before they were looked at)",
            self.vanished
        );
        assert!(
            self.bad.is_empty(),
            "{what}: {} entries are not private:\n{}",
            self.bad.len(),
            self.bad.join("\n")
        );
    }
}

/// A path with hex-looking components collapsed, so bodies, chunks and snapshots group.
fn pattern(rel: &str) -> String {
    rel.split('/')
        .map(|c| {
            let hexish = !c.is_empty() && c.chars().all(|ch| ch.is_ascii_hexdigit());
            let tmp = c.starts_with(".tmp.");
            if tmp {
                ".tmp.*".to_string()
            } else if hexish {
                "<hex>".to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

fn mode_of(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().mode() & 0o7777
}

/// A state dir made by someone else (a volume driver, a hand-made directory) with the
/// loosest mode the umask lets through.
fn premade_dir(p: &Path) {
    std::fs::DirBuilder::new().mode(0o777).create(p).unwrap();
}

fn cfg_for(url: &str) -> PersistConfig {
    PersistConfig {
        remote: url.to_string(),
        lease_ttl: Duration::from_secs(30),
        ..PersistConfig::default()
    }
}

/// The library pass: everything that creates files, without a kernel mount.
fn library_pass(tmp: &Path, walk: &mut Walk) {
    let state = tmp.join("state");
    premade_dir(&state);
    let remote_dir = tmp.join("remote");
    let url = format!("file://{}", remote_dir.display());
    let cfg = cfg_for(&url);

    keel::persist::secure_at_start(&state, Some(&cfg)).unwrap();
    assert_eq!(
        mode_of(&state),
        0o700,
        "the premade state dir was not tightened"
    );
    let lease = acquire_lease(&state, &cfg, true)
        .expect("lease")
        .expect("lease on");
    let fs = open_fs(&state);
    mkdir(&fs, "d");
    write_file(&fs, "d/small", b"inline bytes");
    let big = write_file(&fs, "d/big", &noise(1, 3 * CHUNK as usize + 17));
    fs.fsync(big, false).unwrap();
    fs.sync_all().unwrap();
    let repo = open_remote(&url, &cfg).unwrap();
    let mut p = Persister::open(&state, repo.clone(), params()).unwrap();
    p.set_lease(Some(lease.handle()));
    checkpoint(&mut p);
    write_file(&fs, "d/big2", &noise(2, 2 * CHUNK as usize));
    checkpoint(&mut p);
    gc::gc(&mut repo.clone(), Some(p.store()), 1, Duration::ZERO).expect("gc");

    // A fork into a second store root, and restores of it (eager, then lazy + hydrate).
    let fork_dir = tmp.join("fork");
    let fork_url = format!("file://{}", fork_dir.display());
    let mut fork_repo = open_remote(&fork_url, &cfg).unwrap();
    fork(&mut repo.clone(), &mut fork_repo, None).expect("fork");
    let eager = tmp.join("restored");
    restore(&mut fork_repo.clone(), None, &eager).expect("restore");
    let lazy = tmp.join("lazy");
    premade_dir(&lazy);
    restore_with(&mut fork_repo.clone(), None, &lazy, RestoreMode::Lazy).expect("lazy");
    let fs_lazy = open_fs(&lazy);
    // Where the chunks live: the fork's manifest points at the origin's store.
    let mut source = open_remote(&fork_url, &cfg).unwrap();
    source.manifest().unwrap();
    fs_lazy.set_chunk_source(Arc::new(RemoteChunks::new(source)));
    assert_eq!(
        read_all(&fs_lazy, resolve(&fs_lazy, "d/big")).unwrap(),
        noise(1, 3 * CHUNK as usize + 17)
    );

    // A restore that dies midway (a panic: nothing cleans up, as after SIGKILL) leaves its
    // marker and the bodies it wrote so far, for the next restore to start over from.
    let dying = tmp.join("dying");
    premade_dir(&dying);
    let tap = Tap::new(repo.remote.clone(), |op, key| {
        if op == "get_many" && (key.starts_with("chunks/") || key.contains("/chunks/")) {
            panic!("killed while fetching chunks (on purpose)");
        }
    });
    let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        restore(&mut Repo::new(tap, repo.ws()), None, &dying)
    }));
    assert!(died.is_err(), "the tap did not fire");

    // The body pool makes files off the request path.
    let pool_root = tmp.join("pool-state");
    let store = BodyStore::open(&pool_root.join(keel::state::BODIES)).unwrap();
    let pool = BodyPool::open(&store).unwrap();
    assert!(pool.fill(3).unwrap() > 0);

    // While everything is open: the WAL and SHM files exist.
    walk.tree("lib-state", &state);
    walk.tree("lib-lazy", &lazy);
    walk.expect("/meta.db-wal");
    walk.expect("/meta.db-shm");
    drop(fs_lazy);
    drop(p);
    drop(fs);
    lease.release().expect("release the lease");
    walk.tree("lib-state", &state);
    walk.tree("lib-remote", &remote_dir);
    walk.tree("lib-fork", &fork_dir);
    walk.tree("lib-restored", &eager);
    walk.tree("lib-dying", &dying);
    walk.tree("lib-pool", &pool_root);
    for want in [
        "lib-state file   0600 /meta.db",
        "/reserve",
        "/reserve.boot",
        "/lease.holder",
        "lib-state file   0600 /bodies/<hex>/<hex>",
        "lib-pool file   0600 /bodies/pool/",
        "lib-remote file   0600 /chunks/<hex>/<hex>",
        "lib-remote file   0600 /snapshots/<hex>",
        "lib-remote file   0600 /head",
        "lib-remote file   0600 /keel-workspace.json",
        "lib-remote file   0600 /forks/",
        "lib-remote file   0600 /lease",
        "lib-fork file   0600 /head",
        "lib-dying file   0600 /restore.unfinished",
    ] {
        walk.expect(want);
    }
}

fn keel(args: &[&str]) -> std::process::Output {
    let out = Command::new(support::mount::keel_bin())
        .args(args)
        .output()
        .expect("run keel");
    assert!(
        out.status.success(),
        "keel {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The binary: `keel mount` on a premade (or missing) state dir with a `file://` remote,
/// writes and fsync through the kernel, `keel checkpoint`, stop, gc, fork, snapshot restore.
fn mount_pass(premade: bool, walk: &mut Walk) {
    let tmp = tempfile::Builder::new()
        .prefix("keel-modes.")
        .tempdir()
        .unwrap();
    let base = tmp.path().to_path_buf();
    let state = base.join("state");
    if premade {
        premade_dir(&state);
    }
    let remote_dir = base.join("remote");
    let cfg = base.join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[workspace]\nchunk_size = \"64KiB\"\n[persist]\nremote = \"file://{}\"\ninterval = \"0s\"\nlease_ttl = \"30s\"\n",
            remote_dir.display()
        ),
    )
    .unwrap();
    let c = cfg.to_str().unwrap().to_string();
    let s = state.to_str().unwrap().to_string();
    let mut k = support::mount::Keel::start_in(tmp, state.clone(), &["--config", &c]);
    std::fs::create_dir(k.p("d")).unwrap();
    std::fs::write(k.p("d/small"), b"small").unwrap();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(k.p("d/big"))
        .unwrap();
    std::io::Write::write_all(&mut f, &noise(3, 5 * CHUNK as usize)).unwrap();
    f.sync_all().unwrap();
    drop(f);
    keel(&["checkpoint", "--state", &s, "--config", &c]);
    walk.tree("mnt-state", &state);
    walk.tree("mnt-remote", &remote_dir);
    walk.expect("mnt-state socket");
    walk.expect("mnt-state file   0600 /lock");
    k.stop();
    keel(&["gc", "--state", &s, "--config", &c]);
    let fork_url = format!("file://{}", base.join("fork").display());
    keel(&["fork", "--to", &fork_url, "--state", &s, "--config", &c]);
    let restored = base.join("restored");
    let r = restored.to_str().unwrap();
    keel(&[
        "snapshot", "restore", "latest", "--state", r, "--remote", &fork_url,
    ]);
    walk.tree("mnt-state", &state);
    walk.tree("mnt-remote", &remote_dir);
    walk.tree("mnt-fork", &base.join("fork"));
    walk.tree("mnt-restored", &restored);
    walk.expect("mnt-remote file   0600 /chunks/<hex>/<hex>");
    walk.expect("mnt-remote file   0600 /lease");
    walk.expect("mnt-fork file   0600 /head");
    walk.expect("mnt-restored file   0600 /bodies/<hex>/<hex>");
    // `k` (and with it the temp dir) goes last.
    drop(k);
}

/// `keel run` (as a subreaper here): lease, restore-on-start check, the control socket, the
/// mount; walked from outside while the main command waits, then after the stop.
fn run_pass(walk: &mut Walk) {
    // No periodic checkpoint while the tree is walked (the final one at stop still runs).
    let config = format!(
        "{}interval = \"0s\"\n[shutdown]\ngrace = \"2s\"\n",
        support::keel::workspace_config("")
    );
    let script = "head -c 300000 /dev/urandom > $D/ws/big && echo small > $D/ws/small && sync $D/ws/big && touch $D/ready && exec sleep 60";
    let mut k = support::pid1::start_with(&config, &["sh", "-c", script], Default::default());
    k.wait_file("ready");
    let (state, remote) = (k.state.clone(), k.path("remote"));
    walk.tree("run-state", &state);
    walk.tree("run-remote", &remote);
    k.terminate(libc::SIGTERM);
    walk.tree("run-state", &state);
    walk.tree("run-remote", &remote);
    walk.expect("run-state socket");
    walk.expect("run-state file   0600 /lease.holder");
    walk.expect("run-remote file   0600 /chunks/<hex>/<hex>");
}

/// Set in the child process that runs the passes (see the module's paragraph).
const CHILD: &str = "KEEL_TEST_UMASK_CHILD";

#[test]
fn state_and_remote_are_private_under_umask_000_and_022() {
    if std::env::var_os(CHILD).is_none() {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "modes::state_and_remote_are_private_under_umask_000_and_022",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        println!("{stdout}{stderr}");
        assert!(out.status.success(), "the child's passes failed");
        assert!(
            stdout.contains("1 passed"),
            "the child ran no test: is the name in the --exact filter right?"
        );
        return;
    }
    // Checked first: without root and /dev/fuse the binary pass is skipped (it panics when
    // CI is set, see `support::mount::fuse_available`).
    let fuse = support::mount::fuse_available();
    for mask in [0o000, 0o022] {
        let old = umask(Mode::from_bits_truncate(mask));
        println!("umask {mask:03o}:");
        let tmp = tempfile::tempdir().unwrap();
        let mut walk = Walk::default();
        library_pass(tmp.path(), &mut walk);
        if fuse {
            mount_pass(mask == 0, &mut walk);
            run_pass(&mut walk);
        }
        umask(old);
        walk.assert_private(&format!("umask {mask:03o}"));
    }
    // Sanity: under umask 000 an ordinary create is world-readable, so the passes above
    // really ran under a permissive umask.
    let old = umask(Mode::empty());
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("plain");
    std::fs::write(&p, b"").unwrap();
    umask(old);
    assert_eq!(
        std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
        0o666
    );
}

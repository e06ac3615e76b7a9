//! Real-mount tests: a full state volume (issue 43). The state dir is on a small tmpfs the
//! test mounts; the workspace fills it, then every write-path call is made once more and
//! must fail with ENOSPC, as on ext4, or succeed where it needs no room: never EIO, which
//! tools take for a broken disk. (On keel even a chmod commits metadata, and a metadata log
//! with no room to grow answers ENOSPC.) A write with room for part of it is short and what
//! went in is recorded. Deleting a file always works (the metadata reserve is kept for
//! deletes), makes room, and the same calls succeed again; keel stops and starts on the
//! still nearly full volume with the tree intact and `keel fsck` clean. Once per way the
//! kernel hands writes to keel: passthrough, the write-back cache, and direct I/O
//! (`--cache none`).

use crate::support;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

use support::mount::{errname, pattern, Keel};
use support::sys;

/// Unmounts the tmpfs state volume when the test ends (after keel has unmounted).
struct Volume(PathBuf);
impl Drop for Volume {
    fn drop(&mut self) {
        support::mount::lazy_unmount(&self.0);
    }
}

const MIB: usize = 1 << 20;
/// What each call that needs room asks for: more than the metadata reserves keel gives
/// back on a full volume (1 MiB each), so that none of it fits in what they freed.
const BIG: usize = 4 * MIB;

/// A shared read-write mapping of the first `len` bytes of `f`, written with `byte` over
/// `[0, len)`, then `msync(MS_SYNC)`: the msync's result (where a write-back error shows).
fn write_through_mapping(f: &fs::File, len: usize, byte: u8) -> io::Result<()> {
    // Written only inside those bytes and unmapped below.
    let addr = sys::map_shared(f, len)?;
    // SAFETY: the mapping is `len` bytes long; the file has at least `len` allocated bytes,
    // so no page of it needs new room on the volume (which would raise SIGBUS).
    unsafe { std::ptr::write_bytes(addr, byte, len) };
    // SAFETY: `addr` and `len` are exactly the mapping made above.
    let r = unsafe { libc::msync(addr.cast(), len, libc::MS_SYNC) };
    let synced = if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    };
    // SAFETY: unmaps exactly the mapping made above.
    assert_eq!(unsafe { libc::munmap(addr.cast(), len) }, 0, "munmap");
    synced
}

/// Writes `data` at `at` through a new descriptor, then fsyncs it: the first error of the
/// two (with the write-back cache the write lands in the page cache, and only the fsync can
/// say that there was no room for it).
fn write_at_synced(p: &Path, at: Option<u64>, data: &[u8]) -> io::Result<()> {
    let f = match at {
        Some(_) => OpenOptions::new().write(true).open(p)?,
        None => OpenOptions::new().append(true).open(p)?,
    };
    match at {
        Some(at) => f.write_all_at(data, at)?,
        None => (&f).write_all(data)?,
    }
    f.sync_all()
}

/// Every write-path call of the test, each on files made before the volume filled (`prepare`):
/// its name, whether it needs new room on the volume (then it must say ENOSPC on a full
/// one), and the call. `round` makes names new for a second pass.
type Probe = (
    &'static str,
    bool,
    Box<dyn Fn(&Path, u32) -> io::Result<()>>,
);

/// `passthrough`: the kernel maps keel's body file itself, where a write into a hole on a
/// full volume raises SIGBUS (as on ext4): that probe is left out.
fn probes(passthrough: bool) -> Vec<Probe> {
    let mut all: Vec<Probe> = vec![
        (
            "write (append to a body file)",
            true,
            Box::new(|m, _| write_at_synced(&m.join("append.bin"), None, &pattern(BIG, 11))),
        ),
        (
            "write (append to an inline file)",
            false,
            Box::new(|m, _| write_at_synced(&m.join("small.txt"), None, b"more bytes\n")),
        ),
        (
            "write (overwrite inside a hole)",
            true,
            Box::new(|m, r| {
                write_at_synced(
                    &m.join("hole.bin"),
                    Some(u64::from(r) * BIG as u64),
                    &pattern(BIG, 12),
                )
            }),
        ),
        (
            "write (extend past the end)",
            true,
            Box::new(|m, _| {
                let p = m.join("extend.bin");
                let end = fs::metadata(&p)?.len();
                write_at_synced(&p, Some(end + MIB as u64), &pattern(BIG, 13))
            }),
        ),
        (
            "write (overwrite allocated bytes)",
            false,
            Box::new(|m, _| write_at_synced(&m.join("alloc.bin"), Some(0), &pattern(64 << 10, 14))),
        ),
        (
            "create",
            false,
            Box::new(|m, r| fs::File::create(m.join(format!("new{r}"))).map(drop)),
        ),
        (
            "mkdir",
            false,
            Box::new(|m, r| fs::create_dir(m.join(format!("newdir{r}")))),
        ),
        (
            "symlink",
            false,
            Box::new(|m, r| std::os::unix::fs::symlink("alloc.bin", m.join(format!("newlink{r}")))),
        ),
        (
            "link",
            false,
            Box::new(|m, r| fs::hard_link(m.join("src"), m.join(format!("hard{r}")))),
        ),
        (
            "rename",
            false,
            Box::new(|m, r| {
                // What the last round's rename left, if it could make one.
                let last = m.join(format!("d/moved{}", r.wrapping_sub(1)));
                let from = if r > 0 && last.exists() {
                    last
                } else {
                    m.join("src2")
                };
                fs::rename(from, m.join(format!("d/moved{r}")))
            }),
        ),
        (
            "setxattr",
            false,
            Box::new(|m, r| sys::set_xattr(&m.join("src"), &format!("user.x{r}"), &[7u8; 2048], 0)),
        ),
        (
            "truncate up",
            false,
            Box::new(|m, _| {
                let f = OpenOptions::new().write(true).open(m.join("grow.bin"))?;
                let len = f.metadata()?.len();
                f.set_len(len + 16 * MIB as u64)?;
                f.sync_all()
            }),
        ),
        (
            "fallocate",
            true,
            Box::new(|m, _| {
                let f = OpenOptions::new()
                    .write(true)
                    .open(m.join("prealloc.bin"))?;
                let len = f.metadata()?.len() as i64;
                sys::fallocate(&f, 0, len, BIG as i64)?;
                f.sync_all()
            }),
        ),
        (
            "fsync",
            false,
            Box::new(|m, _| fs::File::open(m.join("alloc.bin"))?.sync_all()),
        ),
        (
            "utimens",
            false,
            Box::new(|m, r| {
                let t = sys::Ts::At(1_000_000 + i64::from(r), 0);
                sys::utimens(&m.join("alloc.bin"), t, t, false)
            }),
        ),
        (
            "chmod",
            false,
            Box::new(|m, r| {
                let mode = if r % 2 == 0 { 0o600 } else { 0o644 };
                fs::set_permissions(m.join("alloc.bin"), fs::Permissions::from_mode(mode))
            }),
        ),
        (
            "write through a shared mapping + msync",
            false,
            Box::new(|m, r| {
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(m.join("map.bin"))?;
                write_through_mapping(&f, 64 << 10, b'a' + r as u8)
            }),
        ),
        (
            "copy_file_range",
            true,
            Box::new(|m, r| {
                let src = fs::File::open(m.join("copy.bin"))?;
                let dst = OpenOptions::new().write(true).open(m.join("hole.bin"))?;
                let at = (2 + i64::from(r)) * BIG as i64;
                let n = sys::copy_file_range(&src, 0, &dst, at, BIG)?;
                assert_eq!(n, BIG, "a short copy_file_range");
                dst.sync_all()
            }),
        ),
    ];
    if !passthrough {
        all.push((
            "write through a shared mapping of a hole + msync",
            true,
            Box::new(|m, r| {
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(m.join("maphole.bin"))?;
                write_through_mapping(&f, BIG, b'h' + r as u8)
            }),
        ));
    }
    all
}

/// The files the probes work on, made while there is room.
fn prepare(m: &Path) {
    fs::write(m.join("append.bin"), pattern(256 << 10, 1)).unwrap();
    fs::write(m.join("small.txt"), b"a small inline file\n").unwrap();
    let hole = fs::File::create(m.join("hole.bin")).unwrap();
    hole.set_len(16 * MIB as u64).unwrap();
    drop(hole);
    fs::write(m.join("extend.bin"), pattern(256 << 10, 2)).unwrap();
    fs::write(m.join("alloc.bin"), pattern(256 << 10, 3)).unwrap();
    fs::write(m.join("src"), b"linked and renamed").unwrap();
    fs::write(m.join("src2"), b"renamed").unwrap();
    fs::create_dir(m.join("d")).unwrap();
    fs::write(m.join("grow.bin"), pattern(256 << 10, 4)).unwrap();
    fs::write(m.join("prealloc.bin"), pattern(256 << 10, 5)).unwrap();
    fs::write(m.join("map.bin"), pattern(64 << 10, 6)).unwrap();
    let maphole = fs::File::create(m.join("maphole.bin")).unwrap();
    maphole.set_len(BIG as u64).unwrap();
    fs::write(m.join("copy.bin"), pattern(BIG, 10)).unwrap();
    drop(maphole);
    fs::write(m.join("spare.bin"), pattern(512 << 10, 7)).unwrap();
    let short = fs::File::create(m.join("short.bin")).unwrap();
    short.set_len(8 * MIB as u64).unwrap();
    drop(short);
    for name in [
        "append.bin",
        "hole.bin",
        "extend.bin",
        "alloc.bin",
        "map.bin",
    ] {
        fs::File::open(m.join(name)).unwrap().sync_all().unwrap();
    }
}

/// Fills the volume through the mount: data into `name` until a write or fsync fails, then
/// empty files with long names (metadata rows) until a create fails. Returns both errors.
fn fill(m: &Path, name: &str) -> (io::Error, Option<io::Error>) {
    let dir = m.join(format!("{name}.meta"));
    fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(m.join(name))
        .unwrap();
    let block = pattern(MIB, 9);
    let mut data_err = None;
    for i in 0..1024 {
        if let Err(e) = f.write_all(&block) {
            data_err = Some(e);
            break;
        }
        if i % 4 == 3 {
            if let Err(e) = f.sync_all() {
                data_err = Some(e);
                break;
            }
        }
    }
    // What is left below a MiB.
    if data_err.is_none() {
        data_err = f.sync_all().err();
    }
    for _ in 0..1024 {
        if let Err(e) = f.write_all(&block[..4096]).and_then(|()| f.sync_all()) {
            data_err = Some(e);
            break;
        }
    }
    drop(f);
    let data_err = data_err.expect("wrote 1 GiB into a small state volume without an error");
    let long = "n".repeat(200);
    let meta_err =
        (0..20_000).find_map(|i| fs::File::create(dir.join(format!("{i:06}{long}"))).err());
    (data_err, meta_err)
}

/// Runs every probe; returns (name, needs room, result) of each.
fn run_probes(
    m: &Path,
    round: u32,
    passthrough: bool,
) -> Vec<(&'static str, bool, Result<(), i32>)> {
    probes(passthrough)
        .into_iter()
        .map(|(name, needs_room, call)| {
            let r = call(m, round).map_err(|e| e.raw_os_error().unwrap_or(-1));
            (name, needs_room, r)
        })
        .collect()
}

fn show(results: &[(&'static str, bool, Result<(), i32>)]) -> String {
    results
        .iter()
        .map(|(name, _, r)| match r {
            Ok(()) => format!("  {name}: ok"),
            Err(e) => format!("  {name}: {}", errname(*e)),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits (a hang guard only) until the volume has `bytes` free: a deleted file's body goes
/// once the delete is committed, off the request path.
fn wait_for_room(m: &Path, bytes: u64) {
    support::mount::poll_for(support::mount::READY_TIMEOUT, || {
        let s = sys::statvfs(m).unwrap();
        (s.f_bavail * s.f_frsize >= bytes).then_some(())
    })
    .unwrap_or_else(|| panic!("a delete did not free {bytes} bytes"));
}

fn fsck(state: &Path, remote: &Path) -> String {
    let out = std::process::Command::new(support::mount::keel_bin())
        .args(["fsck", "--state"])
        .arg(state)
        .arg("--remote")
        .arg(format!("file://{}", remote.display()))
        .output()
        .expect("run keel fsck");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("0 errors"),
        "keel fsck is not clean:\n{text}"
    );
    text
}

/// The whole tree but the fillers, whose last writes found no room: with the write-back
/// cache the kernel took them (their size and times) before keel could refuse them.
fn tree(m: &Path) -> BTreeMap<PathBuf, support::mount::Entry> {
    let mut out = BTreeMap::new();
    for rel in support::mount::walk(m) {
        let full = m.join(&rel);
        let mut e = support::mount::stat_entry(&full, false);
        if rel.to_string_lossy().starts_with("filler") && e.kind == "file" {
            (e.size, e.mtime_ns, e.ctime_ns) = (0, 0, 0);
        } else if e.kind == "file" {
            e.content = Some(support::mount::hash_file(&full));
        }
        out.insert(rel, e);
    }
    out
}

fn every_write_path_says_enospc(args: &[&str]) {
    if !support::mount::fuse_available() {
        return;
    }
    let what = format!("keel mount {}", args.join(" "));
    let passthrough = args.windows(2).any(|w| w == ["--passthrough", "on"]);
    // Drop order: keel unmounts, then the tmpfs volume, then its (empty) directory.
    let vol_dir = tempfile::tempdir().unwrap();
    let vol = vol_dir.path().join("volume");
    fs::create_dir(&vol).unwrap();
    sys::mount_tmpfs(&vol, "size=48m,mode=755").expect("mount a 48 MiB tmpfs state volume");
    let _vol = Volume(vol.clone());
    // Checkpoints go elsewhere, as to a bucket: a remote on the full volume itself fails the
    // final one, and `keel mount` then exits 75 (`pid1::full_volume` has that case).
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("config.toml");
    let remote = tmp.path().join("remote");
    fs::write(
        &cfg,
        format!("[persist]\nremote = \"file://{}\"\n", remote.display()),
    )
    .unwrap();
    let mut args = args.to_vec();
    args.extend(["--config", cfg.to_str().unwrap()]);
    let mut k = Keel::start_in(tmp, vol.join("state"), &args);
    let m = k.mnt.clone();
    prepare(&m);

    let (data_err, meta_err) = fill(&m, "filler1");
    eprintln!("{what}: filled: data {data_err}; metadata {meta_err:?}");
    assert_eq!(
        data_err.raw_os_error(),
        Some(libc::ENOSPC),
        "{what}: filling the volume with data: {data_err}"
    );
    if let Some(e) = &meta_err {
        assert_eq!(
            e.raw_os_error(),
            Some(libc::ENOSPC),
            "{what}: filling the volume with files: {e}"
        );
    }

    let full = run_probes(&m, 0, passthrough);
    eprintln!("{what}: on the full volume:\n{}", show(&full));
    let bad: Vec<_> = full
        .iter()
        .filter(|(_, needs_room, r)| match r {
            Ok(()) => *needs_room,
            Err(e) => *e != libc::ENOSPC,
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: on a full volume every call must say ENOSPC or, needing no room, succeed:\n{}\nlog:\n{}",
        show(&full),
        k.log_text()
    );

    // Room for part of a write (direct I/O: keel's answer is the write(2)'s): what went in
    // is said (a short write, as from ext4), and nothing past it changed.
    if args.contains(&"none") {
        fs::remove_file(m.join("spare.bin")).unwrap();
        wait_for_room(&m, 256 << 10);
        let f = OpenOptions::new()
            .write(true)
            .open(m.join("short.bin"))
            .unwrap();
        let data = pattern(4 * MIB, 21);
        let n = f
            .write_at(&data, 0)
            .unwrap_or_else(|e| panic!("{what}: a write with room for its first part: {e}"));
        drop(f);
        eprintln!("{what}: a 4 MiB write with room for part of it wrote {n} bytes");
        assert!(n > 0 && n < data.len(), "{what}: wrote {n} bytes");
        let back = fs::read(m.join("short.bin")).unwrap();
        assert!(back[..n] == data[..n], "{what}: the bytes written differ");
        let past = back[n..].iter().position(|b| *b != 0);
        assert_eq!(
            past.map(|p| p + n),
            None,
            "{what}: bytes past the {n} the write said it wrote changed"
        );
    }

    // The same with the write-back cache: the write lands in the page cache and reaches
    // keel at write-back, where room for part of it is a short answer the kernel's
    // write-back would take as whole (it looks only at the error). The fsync says ENOSPC
    // and the file then reads as keel has it, not as the cache had it (the restart below
    // compares it again).
    if args.contains(&"--writeback-cache") {
        fs::remove_file(m.join("spare.bin")).unwrap();
        wait_for_room(&m, 256 << 10);
        let f = OpenOptions::new()
            .write(true)
            .open(m.join("short.bin"))
            .unwrap();
        let data = pattern(4 * MIB, 21);
        f.write_all_at(&data, 0)
            .unwrap_or_else(|e| panic!("{what}: a cached write: {e}"));
        let synced = f.sync_all();
        drop(f);
        assert_eq!(
            synced.as_ref().map_err(|e| e.raw_os_error()),
            Err(Some(libc::ENOSPC)),
            "{what}: the fsync of a write-back with room for part of it"
        );
        let back = fs::read(m.join("short.bin")).unwrap();
        assert!(
            back[..4 * MIB] != data[..],
            "{what}: the file reads as the page cache had it, bytes keel never stored"
        );
    }

    // Room again: every call succeeds.
    fs::remove_file(m.join("filler1")).unwrap_or_else(|e| panic!("{what}: delete: {e}"));
    wait_for_room(&m, 32 * MIB as u64);
    // With the write-back cache a write that found no room failed in the kernel's
    // write-back, and the kernel reports that once, to the next fsync or fallocate of the
    // file, whatever room there is now: one fsync of each takes it.
    if args.contains(&"--writeback-cache") {
        for name in [
            "append.bin",
            "small.txt",
            "hole.bin",
            "extend.bin",
            "alloc.bin",
        ] {
            let _ = fs::File::open(m.join(name)).and_then(|f| f.sync_all());
        }
        for name in ["grow.bin", "prealloc.bin", "map.bin", "maphole.bin"] {
            let _ = fs::File::open(m.join(name)).and_then(|f| f.sync_all());
        }
    }
    let freed = run_probes(&m, 1, passthrough);
    eprintln!("{what}: after a delete:\n{}", show(&freed));
    assert!(
        freed.iter().all(|(_, _, r)| r.is_ok()),
        "{what}: after a delete made room every call must succeed:\n{}\nlog:\n{}",
        show(&freed),
        k.log_text()
    );

    // Nearly full again, then a stop and a start on that volume: the tree is intact.
    let (e, _) = fill(&m, "filler2");
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{what}: refill: {e}");
    let before = tree(&m);
    k.stop();
    let checked = fsck(&k.state, &remote);
    k.start_again();
    let after = tree(&m);
    support::mount::assert_same_tree(&before, &after, "a restart on the full volume");
    // The start found room to write its own rows and serves writes where a delete made room.
    fs::remove_file(m.join("filler2")).unwrap();
    // The body of a removed file goes after the reply (as after filler1 above).
    wait_for_room(&m, 8 * MIB as u64);
    fs::write(m.join("after-restart"), pattern(2 * MIB, 20)).unwrap();
    assert_eq!(
        fs::read(m.join("after-restart")).unwrap(),
        pattern(2 * MIB, 20)
    );
    k.stop();
    fsck(&k.state, &remote);
    let log = k.log_text();
    assert!(
        !log.contains("operations since the last commit are lost"),
        "{what}: a metadata group was lost:\n{log}"
    );
    eprintln!("{what}: fsck: {}", checked.lines().last().unwrap_or(""));
}

#[test]
fn every_write_path_says_enospc_on_a_full_volume_with_passthrough() {
    every_write_path_says_enospc(&["--passthrough", "on"]);
}

#[test]
fn every_write_path_says_enospc_on_a_full_volume_with_the_writeback_cache() {
    every_write_path_says_enospc(&["--passthrough", "off", "--writeback-cache", "on"]);
}

#[test]
fn every_write_path_says_enospc_on_a_full_volume_with_direct_io() {
    every_write_path_says_enospc(&["--passthrough", "off", "--cache", "none"]);
}

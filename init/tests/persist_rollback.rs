//! Named snapshots, diff and live rollback on a real mount, against a model: random
//! operations, `keel snapshot create` (the model remembers the tree), `keel rollback` to a
//! random earlier snapshot (the tree must then equal the model's snapshot: types, modes,
//! bytes, symlink targets), a file held open across a rollback keeps its old bytes, and
//! `keel fsck` is clean at the end. `keel diff` is compared with `diff -r` of the two
//! snapshots restored side by side.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use support::mount::{keel_bin, Keel};

/// What the model compares: kind, permission bits, bytes or target.
type Tree = BTreeMap<String, (String, u32, Vec<u8>)>;

fn read_tree(root: &Path) -> Tree {
    let mut out = Tree::new();
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        for de in fs::read_dir(root.join(&rel)).expect("readdir") {
            let de = de.expect("dirent");
            let name = de.file_name().to_string_lossy().into_owned();
            let r = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let full = root.join(&r);
            let md = fs::symlink_metadata(&full).expect("lstat");
            let perm = md.mode() & 0o7777;
            let (kind, data) = if md.is_dir() {
                stack.push(r.clone());
                ("dir", Vec::new())
            } else if md.file_type().is_symlink() {
                (
                    "symlink",
                    fs::read_link(&full)
                        .expect("readlink")
                        .into_os_string()
                        .into_encoded_bytes(),
                )
            } else {
                ("file", fs::read(&full).expect("read"))
            };
            out.insert(r, (kind.to_string(), perm, data));
        }
    }
    out
}

fn keel(args: &[&str]) -> String {
    let out = Command::new(keel_bin())
        .args(args)
        .output()
        .expect("run keel");
    assert!(
        out.status.success(),
        "keel {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_op(rng: &mut Rng, root: &Path) {
    let files: Vec<String> = read_tree(root)
        .into_iter()
        .filter(|(_, (k, _, _))| k == "file")
        .map(|(p, _)| p)
        .collect();
    let dirs = ["", "d1", "d1/d2", "d3"];
    let dir = dirs[rng.below(dirs.len() as u64) as usize];
    let _ = fs::create_dir_all(root.join(dir));
    let name = format!("{dir}/f{}", rng.below(12));
    match rng.below(7) {
        // New or rewritten file: small (inline), or across several windows.
        0 | 1 => {
            let len = if rng.below(3) == 0 {
                700_000 + rng.below(400_000)
            } else {
                rng.below(3000)
            };
            let seed = rng.next() as u8;
            let data: Vec<u8> = (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect();
            fs::write(root.join(&name), data).unwrap();
        }
        2 if !files.is_empty() => {
            let f = &files[rng.below(files.len() as u64) as usize];
            fs::remove_file(root.join(f)).unwrap();
        }
        3 if !files.is_empty() => {
            let f = &files[rng.below(files.len() as u64) as usize];
            let to = format!("{dir}/r{}", rng.below(12));
            let _ = fs::rename(root.join(f), root.join(to));
        }
        4 if !files.is_empty() => {
            let f = &files[rng.below(files.len() as u64) as usize];
            let mode = [0o600, 0o644, 0o755, 0o640][rng.below(4) as usize];
            fs::set_permissions(root.join(f), fs::Permissions::from_mode(mode)).unwrap();
        }
        5 => {
            let _ = fs::remove_file(root.join(format!("{dir}/l")));
            std::os::unix::fs::symlink(
                format!("t{}", rng.below(100)),
                root.join(format!("{dir}/l")),
            )
            .unwrap();
        }
        _ if !files.is_empty() => {
            // Append.
            let f = &files[rng.below(files.len() as u64) as usize];
            let mut h = fs::OpenOptions::new()
                .append(true)
                .open(root.join(f))
                .unwrap();
            std::io::Write::write_all(&mut h, b"appended\n").unwrap();
        }
        _ => fs::write(root.join(&name), b"x").unwrap(),
    }
}

#[test]
fn rollback_matches_the_model_and_open_files_keep_their_bytes() {
    let Some(mut k) = Keel::start(&[]) else {
        return;
    };
    let state = k.state.to_str().unwrap().to_string();
    let seed = std::env::var("KEEL_ROLLBACK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_2026_u64);
    let rounds: u64 = std::env::var("KEEL_ROLLBACK_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let mut rng = Rng(seed);
    let mut model: Vec<(String, Tree)> = Vec::new();
    let (mut ops, mut rollbacks, mut kept_open) = (0u64, 0u64, 0u64);
    for round in 0..rounds {
        for _ in 0..(3 + rng.below(10)) {
            random_op(&mut rng, &k.mnt);
            ops += 1;
        }
        let name = format!("s{round}");
        keel(&[
            "snapshot", "create", "--state", &state, "--name", &name, "-m", "model",
        ]);
        model.push((name, read_tree(&k.mnt)));
        for _ in 0..rng.below(6) {
            random_op(&mut rng, &k.mnt);
            ops += 1;
        }
        if rng.below(2) == 0 {
            let (to, want) = model[rng.below(model.len() as u64) as usize].clone();
            // Hold a file open across the rollback: it keeps the bytes it had.
            let held = read_tree(&k.mnt)
                .into_iter()
                .find(|(_, (kind, _, _))| kind == "file");
            let mut open = held.map(|(p, (_, _, data))| (fs::File::open(k.p(&p)).unwrap(), data));
            keel(&["rollback", "--state", &state, &to]);
            rollbacks += 1;
            let got = read_tree(&k.mnt);
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "paths after rollback to {to} (seed {seed:#x}, round {round})"
            );
            for (p, w) in &want {
                assert!(
                    got[p] == *w,
                    "{p} after rollback to {to} (seed {seed:#x}, round {round})"
                );
            }
            if let Some((mut f, before)) = open.take() {
                let mut now = Vec::new();
                f.read_to_end(&mut now).unwrap();
                assert!(now == before, "an open file changed under its handle");
                kept_open += 1;
            }
        }
    }
    // Undo the last rollback through its recorded name, when there was one.
    let names = keel(&["snapshot", "list", "--state", &state, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&names).unwrap();
    let undo: BTreeSet<String> = v["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| {
            s["names"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().to_string())
        })
        .filter(|n| n.starts_with("before-rollback-"))
        .collect();
    assert_eq!(undo.len() as u64, rollbacks, "one undo name per rollback");
    k.stop();
    let out = Command::new(keel_bin())
        .args(["fsck", "--state", &state])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fsck after rollbacks:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "rollback model: seed {seed:#x}, {rounds} cases (snapshots), {ops} operations, {rollbacks} rollbacks, {kept_open} files held open across one"
    );
}

#[test]
fn diff_lists_what_diff_r_of_the_restored_trees_finds() {
    let Some(mut k) = Keel::start(&[]) else {
        return;
    };
    let state = k.state.to_str().unwrap().to_string();
    let mut rng = Rng(7);
    for _ in 0..30 {
        random_op(&mut rng, &k.mnt);
    }
    keel(&["snapshot", "create", "--state", &state, "--name", "a"]);
    for _ in 0..30 {
        random_op(&mut rng, &k.mnt);
    }
    keel(&["snapshot", "create", "--state", &state, "--name", "b"]);
    let d: serde_json::Value =
        serde_json::from_str(&keel(&["diff", "a", "b", "--json", "--state", &state])).unwrap();
    let ours: BTreeSet<String> = d["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["kind"] != "dir" || c["change"] != "modified")
        .flat_map(|c| {
            let mut v = vec![c["path"]
                .as_str()
                .unwrap()
                .trim_start_matches('/')
                .to_string()];
            if let Some(f) = c["from"].as_str() {
                v.push(f.trim_start_matches('/').to_string());
            }
            v
        })
        .collect();
    let remote = format!("file://{state}/remote");
    let mut roots = Vec::new();
    for id in ["a", "b"] {
        let listing: serde_json::Value =
            serde_json::from_str(&keel(&["snapshot", "list", "--state", &state, "--json"]))
                .unwrap();
        let seq = listing["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["names"].as_array().unwrap().iter().any(|n| n == id))
            .unwrap()["id"]
            .to_string();
        let st = k.scratch().join(format!("restore-{id}"));
        keel(&[
            "snapshot",
            "restore",
            &seq,
            "--state",
            st.to_str().unwrap(),
            "--remote",
            &remote,
        ]);
        let mnt = k.scratch().join(format!("mnt-{id}"));
        let child = match support::mount::spawn_mount(
            &st,
            &mnt,
            &[],
            &k.scratch().join(format!("{id}.log")),
        ) {
            support::mount::MountOutcome::Mounted(c) => c,
            support::mount::MountOutcome::Exited { status, stderr } => {
                panic!("mount of restored snapshot {id}: {status}\n{stderr}")
            }
        };
        roots.push((mnt, child));
    }
    let out = Command::new("diff")
        .args(["-r", "--no-dereference"])
        .arg(&roots[0].0)
        .arg(&roots[1].0)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (a, b) = (
        roots[0].0.to_str().unwrap().to_string(),
        roots[1].0.to_str().unwrap().to_string(),
    );
    let mut theirs = BTreeSet::new();
    for line in text.lines() {
        let rel = |p: &str| {
            p.strip_prefix(&a)
                .or_else(|| p.strip_prefix(&b))
                .unwrap_or(p)
                .trim_start_matches('/')
                .to_string()
        };
        if let Some(rest) = line.strip_prefix("Only in ") {
            let (dir, name) = rest.split_once(": ").unwrap();
            let d = rel(dir);
            theirs.insert(if d.is_empty() {
                name.to_string()
            } else {
                format!("{d}/{name}")
            });
        } else if let Some(rest) = line.strip_prefix("Files ") {
            theirs.insert(rel(rest.split(" and ").next().unwrap()));
        } else if let Some(rest) = line.strip_prefix("Symbolic links ") {
            theirs.insert(rel(rest.split(" and ").next().unwrap()));
        }
    }
    for (mnt, mut child) in roots {
        // SIGTERM to our own child: it unmounts and exits.
        let _ = Command::new("kill").arg(child.id().to_string()).status();
        let _ = child.wait();
        support::mount::lazy_unmount(&mnt);
    }
    k.stop();
    // diff -r sees bytes and names, not modes: every path it reports is in ours, and ours
    // adds only mode changes and paths below directories that diff -r reports whole.
    for p in &theirs {
        assert!(
            ours.contains(p),
            "diff -r reports {p}, keel diff does not:\n{text}\n{d:#}"
        );
    }
    println!(
        "diff: {} paths in keel diff, {} in diff -r",
        ours.len(),
        theirs.len()
    );
}

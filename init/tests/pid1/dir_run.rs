//! `keel run` with the `dir` provider, end to end on the built binary: the workspace
//! survives a stop and a start on the same state dir (found at once, nothing restored) and
//! restores on a fresh one from the remote before the main command starts, equal by
//! `ci/tree-manifest.py`; SIGTERM with a file still open and dirty keeps its bytes; a
//! kill -9 loses nothing the last checkpoint had (on a fresh state dir) and nothing the
//! kernel kept (on the same one); `keel snapshot create`, `keel diff` and `keel rollback`
//! work, the rollback stopping the main command first and naming its undo snapshot; the
//! sandbox's user reads nothing of keel's state. Needs root (the sandbox user, owners).

use crate::support;

use std::path::Path;
use std::process::Command;

use support::keel::{Keel, Opts};
use support::pid1::{require_root, KEEL};

/// A `keel run` config with the `dir` provider: workspace `$D/ws`, state `$D/state`,
/// remote `remote` (default `file://$D/remote`).
fn config(remote: Option<&Path>, init: &str) -> String {
    let remote = match remote {
        Some(p) => format!("file://{}", p.display()),
        None => "file://$D/remote".into(),
    };
    format!(
        "[workspace]\nmount_point = \"$D/ws\"\nstate_dir = \"$D/state\"\nprovider = \"dir\"\n\
         [persist]\nremote = \"{remote}\"\ninterval = \"1h\"\n[init]\n{init}\n"
    )
}

/// `ci/tree-manifest.py` of the tree behind `ws` (the symlink's target).
fn manifest(ws: &Path) -> String {
    let root = std::fs::canonicalize(ws).expect("the workspace link resolves");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ci/tree-manifest.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(&root)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Writes a tree with every kind of entry, as the main command.
const WRITE: &str = r#"set -e
cd "$D/ws"
mkdir -p d/e
echo small > d/small
head -c 3000000 /dev/urandom > d/e/big
truncate -s 20M sparse && printf tail >> sparse
ln d/e/big hard
ln -s d/e/big sym
mkfifo fifo
chmod 4750 d/small
chown 1000:2000 d/small
setfattr -n user.k -v v1 d/small
touch -d '2001-02-03 04:05:06.789' d/e
"#;

#[test]
fn a_dir_workspace_survives_restarts_and_restores_on_a_fresh_state_dir() {
    if !require_root("dir provider keel run") {
        return;
    }
    let mut k = Keel::run(&config(None, ""), &["sh", "-c", WRITE], Opts::default());
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    let want = manifest(&k.path("ws"));
    assert!(want.contains("sym l") && want.contains("fifo p"), "{want}");
    let state = k.path("state");
    let remote = k.path("remote");

    // Started again on the same state dir: the tree is there at once, nothing restored.
    let again = format!(
        "[workspace]\nmount_point = \"$D/ws\"\nstate_dir = \"{}\"\nprovider = \"dir\"\n\
         [persist]\nremote = \"file://{}\"\n",
        state.display(),
        remote.display()
    );
    let mut k2 = Keel::run(&again, &["cat", "$D/ws/d/small"], Opts::default());
    assert_eq!(k2.wait().0, 0, "{}", k2.log_text());
    assert_eq!(k2.stdout(), "small\n");
    assert!(
        !k2.log_text().contains("restored snapshot"),
        "{}",
        k2.log_text()
    );
    assert_eq!(manifest(&k2.path("ws")), want);

    // A fresh state dir: restored from the remote, eagerly, before the main command.
    let mut k3 = Keel::run(
        &config(Some(&remote), ""),
        &[
            "sh",
            "-c",
            "cat $D/ws/d/small; getfattr -n user.k --only-values $D/ws/d/small",
        ],
        Opts::default(),
    );
    assert_eq!(k3.wait().0, 0, "{}", k3.log_text());
    assert_eq!(k3.stdout(), "small\nv1");
    let log = k3.log_text();
    let restored = log.find("restored snapshot").expect(&log);
    let started = log.find("started main command").expect(&log);
    assert!(restored < started, "{log}");
    assert!(
        log.contains("(eager)") && log.contains("built from the store"),
        "{log}"
    );
    assert_eq!(manifest(&k3.path("ws")), want);
}

#[test]
fn sigterm_keeps_a_file_still_open_and_dirty() {
    if !require_root("dir provider keel run") {
        return;
    }
    let main = "exec 3>$D/ws/open; echo first >&3; printf 'still open, never closed' >&3; \
                touch $D/ready; exec sleep 1000";
    let mut k = Keel::run(&config(None, ""), &["sh", "-c", main], Opts::default());
    k.wait_file("ready");
    // The main command dies of the SIGTERM keel forwards: keel exits with its status.
    let st = k.terminate(libc::SIGTERM);
    assert_eq!(st.code(), Some(128 + libc::SIGTERM), "{}", k.log_text());
    assert!(
        k.log_text().contains("final checkpoint report=snapshot"),
        "{}",
        k.log_text()
    );
    let mut k2 = Keel::run(
        &config(Some(&k.path("remote")), ""),
        &["cat", "$D/ws/open"],
        Opts::default(),
    );
    assert_eq!(k2.wait().0, 0, "{}", k2.log_text());
    assert_eq!(k2.stdout(), "first\nstill open, never closed");
}

#[test]
fn kill_9_loses_nothing_the_last_checkpoint_had() {
    if !require_root("dir provider keel run") {
        return;
    }
    let main = format!(
        "set -e; echo checkpointed > $D/ws/a; {KEEL} checkpoint --config $D/config.toml; \
         echo after > $D/ws/b; sync; touch $D/ready; exec sleep 1000"
    );
    let opts = Opts {
        pid1: true,
        ..Default::default()
    };
    let mut k = Keel::run(&config(None, ""), &["sh", "-c", &main], opts);
    k.wait_file("ready");
    k.kill9();
    // A fresh state dir has what the last checkpoint had (the dead keel's lease is taken
    // over).
    let fresh = config(Some(&k.path("remote")), "")
        .replace("[persist]\n", "[persist]\ntakeover = \"force\"\n");
    let mut k2 = Keel::run(
        &fresh,
        &["sh", "-c", "cat $D/ws/a; ls $D/ws"],
        Opts::default(),
    );
    assert_eq!(k2.wait().0, 0, "{}", k2.log_text());
    assert_eq!(k2.stdout(), "checkpointed\na\n");
    // The same state dir has what the kernel kept, and checkpoints it.
    let same = format!(
        "[workspace]\nmount_point = \"$D/ws\"\nstate_dir = \"{}\"\nprovider = \"dir\"\n\
         [persist]\nremote = \"file://{}\"\ntakeover = \"force\"\n",
        k.path("state").display(),
        k.path("remote").display()
    );
    let mut k3 = Keel::run(&same, &["cat", "$D/ws/a", "$D/ws/b"], Opts::default());
    assert_eq!(k3.wait().0, 0, "{}", k3.log_text());
    assert_eq!(k3.stdout(), "checkpointed\nafter\n");
    let mut k4 = Keel::run(&fresh, &["cat", "$D/ws/b"], Opts::default());
    assert_eq!(k4.wait().0, 0, "{}", k4.log_text());
    assert_eq!(k4.stdout(), "after\n");
}

#[test]
fn snapshot_diff_and_rollback_work_and_the_rollback_stops_the_main_command() {
    if !require_root("dir provider keel run") {
        return;
    }
    // The main command: on its first start it makes snapshot `first`, changes the tree and
    // rolls back (which stops it: the rollback restarts it); on the second it reports.
    let main = format!(
        r#"set -e
cd $D/ws
if [ -e $D/second ]; then cat f; ls; cmp big $D/big.orig && echo same; {KEEL} snapshot list --config $D/config.toml > $D/list; exit 0; fi
echo one > f; mkdir d; echo keep > d/k; head -c 2000000 /dev/urandom > big; cp big $D/big.orig
{KEEL} snapshot create --config $D/config.toml --name first > $D/created
echo two > f; rm d/k; echo new > n; printf X | dd of=big bs=1 seek=1000000 conv=notrunc 2>/dev/null
{KEEL} diff --config $D/config.toml first > $D/diff
touch $D/second
{KEEL} rollback --config $D/config.toml first > $D/rolled
sleep 1000
"#
    );
    let mut k = Keel::run(&config(None, ""), &["sh", "-c", &main], Opts::default());
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert_eq!(k.stdout(), "one\nbig\nd\nf\nsame\n", "{}", k.log_text());
    let diff = std::fs::read_to_string(k.path("diff")).unwrap();
    for line in ["M /big", "D /d/k", "M /f", "A /n"] {
        assert!(diff.contains(line), "{line}: {diff}");
    }
    let log = k.log_text();
    assert!(
        log.contains("rollback --restart: the main command has stopped"),
        "{log}"
    );
    assert!(std::fs::read_to_string(k.path("state/workspace/d/k")).unwrap() == "keep\n");
    // The undo snapshot is named and kept.
    let list = std::fs::read_to_string(k.path("list")).unwrap();
    assert!(list.contains("before-rollback-"), "{list}");
}

#[test]
fn the_sandbox_user_reads_nothing_of_keels_state() {
    if !require_root("dir provider keel run") {
        return;
    }
    // As `nobody`: the workspace is usable; the store, the state dir's listing, the
    // checkpoint socket and a remote on the state volume are not. (The workspace and state
    // live in a directory everyone may search, as /var/lib does.)
    let shared = tempfile::Builder::new()
        .prefix("keel-dir-shared.")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(
        shared.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let s = shared.path().display().to_string();
    let cfg = format!(
        "[workspace]\nmount_point = \"{s}/ws\"\nstate_dir = \"{s}/state\"\nprovider = \"dir\"\n\
         [init]\nuser = \"nobody\"\n"
    );
    let main = r#"echo mine > $S/ws/f && cat $S/ws/f
for p in $S/state/meta.db $S/state/lock $S/state/remote/head; do cat $p >/dev/null 2>&1 && echo "READ $p"; done
ls $S/state >/dev/null 2>&1 && echo "LISTED state"
ls $S/state/bodies >/dev/null 2>&1 && echo "LISTED bodies"
ls $S/state/remote >/dev/null 2>&1 && echo "LISTED remote"
touch $S/state/x 2>/dev/null && echo "WROTE state"
$KEEL checkpoint --config $D/config.toml >/dev/null 2>&1 && echo "CHECKPOINTED"
exit 0"#;
    let mut k = Keel::run(
        &cfg,
        &["sh", "-c", main],
        Opts {
            env: &[("KEEL", KEEL), ("S", &s)],
            ..Default::default()
        },
    );
    assert_eq!(k.wait().0, 0, "{}", k.log_text());
    assert_eq!(k.stdout(), "mine\n", "{}", k.log_text());
    let log = k.log_text();
    assert!(log.contains("protected from user nobody"), "{log}");
}

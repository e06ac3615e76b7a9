//! The sandbox cannot reach keel's state or secrets (root and /dev/fuse; CI fails loudly
//! without them): everything keel starts runs in a mount namespace where the state dir and the
//! credentials file are empty and read-only (a Secret volume's whole directory, across a
//! rotation), without the remote's credentials, the control token or `[init] secret_env` in
//! its environment (unless `pass_env` names them), cannot read a workspace file an ACL entry
//! denies it (as an unprivileged user, nor remove that entry), and cannot read keel's
//! `/proc/<pid>/{environ,root}` (keel is not dumpable); `keel status` and `keel checkpoint`
//! still work from inside over the control socket, for whom `[control] group` allows, and
//! snapshots, diffs and rollbacks only for root; a mount keel makes after the start still
//! reaches the sandbox (PID 1).

use crate::support;

use std::path::Path;
use support::pid1::*;

const FILE_SECRET: &str = "file-secret-Zq8Xw2";
const ENV_SECRET: &str = "env-secret-Pk4Rt7";
const CONTENT: &str = "only-root-may-read-this-7f3a";

/// Workspace at $D/ws, state in `state`, control socket at $D/run/control.sock, a credentials
/// file at $D/creds, and a service that records its environment.
fn config(state: &Path, extra_init: &str, extra: &str) -> String {
    format!(
        r#"[init]
secret_env = ["MY_SECRET", "VAULT_*"]
drop_capabilities = ["SYS_ADMIN", "SYS_PTRACE"]
{extra_init}
[workspace]
mount_point = "$D/ws"
state_dir = "{}"
[shutdown]
grace = "2s"
[persist]
credentials_file = "$D/creds"
[control]
socket = "$D/run/control.sock"
{extra}
[[service]]
name = "recorder"
command = ["sh", "-c", "env > $D/svc.env; exec sleep 1000"]
pass_env = ["AWS_REGION"]
"#,
        state.display()
    )
}

fn write_creds(d: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let f = d.join("creds");
    std::fs::write(
        &f,
        format!("# test\nexport AWS_SECRET_ACCESS_KEY={FILE_SECRET}\nAWS_REGION=eu-file-1\n"),
    )
    .unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Starts keel with the credentials file written first (the config is written by `start`).
fn start_keel(state: &Path, script: &str, extra_init: &str, extra: &str, pid1: bool) -> Keel {
    // The credentials file lives outside keel's temp dir ($CREDS in the script).
    let dir = tempfile::tempdir().unwrap();
    write_creds(dir.path());
    let creds = dir.path().join("creds");
    let script = script.replace("$CREDS", creds.to_str().unwrap());
    let text = config(state, extra_init, extra).replace("$D/creds", creds.to_str().unwrap());
    let k = start_with(
        &text,
        &["sh", "-c", &script],
        Opts {
            pid1,
            env: &[
                ("AWS_SECRET_ACCESS_KEY", ENV_SECRET),
                ("AWS_REGION", "eu-env-1"),
                ("GOOGLE_SERVICE_ACCOUNT_KEY", "g-secret-1234"),
                ("KEEL_CONTROL_TOKEN", "control-token-1234"),
                ("MY_SECRET", "my-secret-1234"),
                ("VAULT_TOKEN", "vault-secret-1234"),
                ("PLAIN_VAR", "visible"),
            ],
            // A secret whose value is not UTF-8 leaves keel's environment all the same.
            env_bytes: &[("AWS_SESSION_TOKEN", b"session-\xff-secret")],
            ..Default::default()
        },
    );
    // Keep the credentials' dir alive as long as keel.
    std::mem::forget(dir);
    k
}

#[test]
fn the_sandbox_sees_no_state_no_credentials_and_cannot_read_keel() {
    if !require_root_and_fuse("isolation test") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let st = state.path().display().to_string();
    // Root without SYS_PTRACE/SYS_ADMIN in the sandbox: every line is an attempt that must fail.
    let script = format!(
        r#"
        printf '%s' {CONTENT} > $D/ws/secret && chmod 600 $D/ws/secret && sync -f $D/ws/secret
        head -c 20000 /dev/urandom > $D/ws/big; printf '%s' {CONTENT} >> $D/ws/big; sync -f $D/ws/big
        sleep 0.2
        echo "state-entries=$(ls -A {st} | wc -l)"
        touch {st}/planted 2>/dev/null && echo "ATTEMPT wrote into the state dir"
        grep -rl {CONTENT} {st} 2>/dev/null && echo "ATTEMPT found the content in the state dir"
        test -s $CREDS && echo "ATTEMPT read the credentials file"
        echo x > $CREDS 2>/dev/null && echo "ATTEMPT wrote the credentials file"
        tr '\0' '\n' < /proc/$PPID/environ 2>/dev/null | grep -E 'secret|AWS_|KEEL_CONTROL' && echo "ATTEMPT found a secret in keel's environ"
        ls /proc/$PPID/root/ >/dev/null 2>&1 && echo "ATTEMPT listed keel's root"
        for f in /proc/$PPID/fd/*; do readlink $f 2>/dev/null | grep -q . && echo "ATTEMPT resolved keel's fd $f" && break; done
        head -c 1 /proc/$PPID/mem >/dev/null 2>&1 && echo "ATTEMPT opened keel's mem"
        perl -e 'exit(syscall(101, 16, $ARGV[0], 0, 0) == 0 ? 0 : 1)' $PPID && echo "ATTEMPT ptrace-attached keel"
        umount -l {st} 2>/dev/null && echo "ATTEMPT uncovered the state dir"
        # An unprivileged user denied by an ACL entry on a file it could otherwise read.
        chmod 755 $D $D/ws
        printf '%s' {CONTENT} > $D/ws/acl-denied && chmod 644 $D/ws/acl-denied
        setfacl -m u:65534:--- $D/ws/acl-denied || echo "ATTEMPT-FAILED setfacl"
        printf readable > $D/ws/acl-control && chmod 644 $D/ws/acl-control
        U="setpriv --reuid=65534 --regid=65534 --clear-groups"
        $U cat $D/ws/acl-control >/dev/null && echo "acl-control-read"
        $U cat $D/ws/acl-denied 2>/dev/null && echo "ATTEMPT nobody read a file an ACL entry denies"
        $U setfacl -b $D/ws/acl-denied 2>/dev/null && echo "ATTEMPT nobody removed the ACL"
        $U chmod 666 $D/ws/acl-denied 2>/dev/null && echo "ATTEMPT nobody changed the mode"
        $U setfattr -x system.posix_acl_access $D/ws/acl-denied 2>/dev/null && echo "ATTEMPT nobody removed the ACL xattr"
        $U cat $D/ws/acl-denied 2>/dev/null && echo "ATTEMPT nobody read the file after all"
        env > $D/main.env
        while [ ! -s $D/svc.env ]; do sleep 0.05; done
        cat $D/ws/secret; echo
        "#
    );
    let mut k = start_keel(state.path(), &script, "", "", false);
    let (code, _) = k.wait();
    let out = k.stdout();
    let log = k.log_text();
    assert_eq!(code, 0, "stdout:\n{out}\nlog:\n{log}");
    assert!(out.contains("state-entries=0\n"), "{out}");
    assert!(out.contains("acl-control-read\n"), "{out}");
    assert!(!out.contains("ATTEMPT"), "an attempt succeeded:\n{out}");
    assert!(
        out.contains(CONTENT),
        "the workspace still works in the sandbox: {out}"
    );
    assert!(log.contains("sandbox namespace in"), "{log}");

    let main_env = read(&k.path("main.env"));
    let svc_env = read(&k.path("svc.env"));
    for secret in [
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "GOOGLE_SERVICE_ACCOUNT_KEY",
        "KEEL_CONTROL_TOKEN",
        "MY_SECRET",
        "VAULT_TOKEN",
        "AWS_REGION",
        ENV_SECRET,
        FILE_SECRET,
    ] {
        assert!(!main_env.contains(secret), "main command got {secret}");
    }
    assert!(main_env.contains("PLAIN_VAR=visible"), "{main_env}");
    // pass_env hands over the value keel uses: the credentials file wins over the environment.
    assert!(svc_env.contains("AWS_REGION=eu-file-1\n"), "{svc_env}");
    for secret in ["AWS_SECRET_ACCESS_KEY", "KEEL_CONTROL_TOKEN", "MY_SECRET"] {
        assert!(!svc_env.contains(secret), "service got {secret}");
    }
    for secret in [ENV_SECRET, FILE_SECRET] {
        assert!(!log.contains(secret), "keel logged a secret:\n{log}");
    }
    // keel itself kept writing its state: the planted file is not there, the database is.
    assert!(!state.path().join("planted").exists());
    assert!(state.path().join(keel::state::META_DB).exists());
}

#[test]
fn keel_status_and_checkpoint_work_from_inside_for_root_and_the_configured_group() {
    if !require_root_and_fuse("isolation test") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    // gid 65533 is the control group; `nobody` with it as a supplementary group may use the
    // socket, `nobody` without it may not.
    let script = format!(
        r#"
        chmod 755 $D; cp {KEEL} $D/keel; chmod 755 $D/keel   # the build dir may be root's only
        $D/keel status --config $D/config.toml >/dev/null && echo "root-status-ok"
        $D/keel checkpoint --config $D/config.toml && echo "root-checkpoint-ok"
        setpriv --reuid=65534 --regid=65534 --groups=65533 $D/keel status --config $D/config.toml >/dev/null && echo "group-status-ok"
        setpriv --reuid=65534 --regid=65534 --clear-groups $D/keel status --config $D/config.toml >/dev/null 2>&1 && echo "ATTEMPT other user got the status"
        stat -c '%a %g' $D/run $D/run/control.sock
        # The agent routes show and change every file: root's, not the group's.
        printf '%s' {CONTENT} > $D/ws/rootonly; chmod 600 $D/ws/rootonly
        $D/keel snapshot create --name s1 --config $D/config.toml >/dev/null && echo "root-snapshot-ok"
        echo changed > $D/ws/rootonly; touch $D/ws/added
        G="setpriv --reuid=65534 --regid=65534 --groups=65533"
        $G cat $D/ws/rootonly 2>/dev/null && echo "ATTEMPT group member read the file"
        $G $D/keel diff s1 --config $D/config.toml -- rootonly 2>$D/g.err && echo "ATTEMPT group member read the file through diff"
        grep -q forbidden $D/g.err && echo "group-diff-forbidden"
        $G $D/keel diff s1 --config $D/config.toml >/dev/null 2>&1 && echo "ATTEMPT group member listed the changes"
        $G $D/keel snapshot list --config $D/config.toml >/dev/null 2>&1 && echo "ATTEMPT group member listed snapshots"
        $G $D/keel snapshot create --name g --config $D/config.toml >/dev/null 2>&1 && echo "ATTEMPT group member made a snapshot"
        $G $D/keel rollback s1 --config $D/config.toml >/dev/null 2>&1 && echo "ATTEMPT group member rolled back"
        $G $D/keel snapshot delete s1 --config $D/config.toml >/dev/null 2>&1 && echo "ATTEMPT group member deleted a snapshot"
        $G $D/keel checkpoint --config $D/config.toml >/dev/null && echo "group-checkpoint-ok"
        cat $D/ws/rootonly
        $D/keel diff s1 --config $D/config.toml | grep -q added && echo "root-diff-ok"
        "#
    );
    let mut k = start_keel(state.path(), &script, "", "group = \"65533\"", false);
    let (code, _) = k.wait();
    let out = k.stdout();
    assert_eq!(code, 0, "stdout:\n{out}\nlog:\n{}", k.log_text());
    for want in [
        "root-status-ok",
        "root-checkpoint-ok",
        "group-status-ok",
        "root-snapshot-ok",
        "group-diff-forbidden",
        "group-checkpoint-ok",
        "changed\n",
        "root-diff-ok",
    ] {
        assert!(
            out.contains(want),
            "{want} missing:\n{out}\nlog:\n{}",
            k.log_text()
        );
    }
    assert!(!out.contains("ATTEMPT"), "{out}");
    assert!(out.contains("750 65533\n660 65533\n"), "{out}");
    assert!(!out.contains(FILE_SECRET) && !out.contains(ENV_SECRET));
}

/// A keel that is not PID 1 keeps its control socket in the state dir (no `[control]
/// socket`): the sandbox, which sees the state dir empty, still finds it there (bound into
/// the cover, read-only), for root and the configured group; it cannot remove, move, chmod
/// or unmount it, or write beside it.
#[test]
fn the_default_control_socket_of_a_keel_that_is_not_pid_1_is_reachable_from_inside() {
    if !require_root_and_fuse("isolation test") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let st = state.path().display().to_string();
    let script = format!(
        r#"
        chmod 755 $D; cp {KEEL} $D/keel; chmod 755 $D/keel   # the build dir may be root's only
        echo "state-entries=$(ls -A {st} | tr '\n' ' ')"
        $D/keel status --config $D/config.toml >/dev/null && echo "root-status-ok"
        $D/keel checkpoint --config $D/config.toml >/dev/null && echo "root-checkpoint-ok"
        $D/keel snapshot create --name s1 --config $D/config.toml >/dev/null && echo "root-snapshot-ok"
        setpriv --reuid=65534 --regid=65534 --groups=65533 $D/keel status --config $D/config.toml >/dev/null && echo "group-status-ok"
        setpriv --reuid=65534 --regid=65534 --clear-groups $D/keel status --config $D/config.toml >/dev/null 2>&1 && echo "ATTEMPT other user got the status"
        rm -f {st}/control.sock 2>/dev/null && echo "ATTEMPT removed the control socket"
        mv {st}/control.sock {st}/moved 2>/dev/null && echo "ATTEMPT moved the control socket"
        chmod 666 {st}/control.sock 2>/dev/null && echo "ATTEMPT changed the control socket's mode"
        umount {st}/control.sock 2>/dev/null && echo "ATTEMPT unmounted the control socket"
        touch {st}/planted 2>/dev/null && echo "ATTEMPT wrote into the state dir"
        stat -c 'socket %a %g' {st}/control.sock
        $D/keel status --config $D/config.toml >/dev/null && echo "root-status-still-ok"
        "#
    );
    let text = config(state.path(), "", "group = \"65533\"")
        .replace("socket = \"$D/run/control.sock\"\n", "")
        .replace("credentials_file = \"$D/creds\"\n", "");
    assert!(!text.contains("socket ="), "{text}");
    let mut k = start_with(&text, &["sh", "-c", &script], Opts::default());
    let (code, _) = k.wait();
    let out = k.stdout();
    assert_eq!(code, 0, "stdout:\n{out}\nlog:\n{}", k.log_text());
    for want in [
        "state-entries=control.sock \n",
        "root-status-ok",
        "root-checkpoint-ok",
        "root-snapshot-ok",
        "group-status-ok",
        "socket 660 65533\n",
        "root-status-still-ok",
    ] {
        assert!(
            out.contains(want),
            "{want} missing:\n{out}\nlog:\n{}",
            k.log_text()
        );
    }
    assert!(!out.contains("ATTEMPT"), "an attempt succeeded:\n{out}");
    assert!(!state.path().join("planted").exists());
    assert!(
        k.log_text()
            .contains("the control socket stays reachable there"),
        "{}",
        k.log_text()
    );
}

#[test]
fn a_mount_keel_makes_later_reaches_the_sandbox_as_pid_1() {
    if !require_root_and_fuse("isolation test") {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    // The main command waits for a mount that appears in keel's namespace after it started.
    let script = r#"
        touch $D/started
        i=0; while [ ! -e $D/late/marker ]; do i=$((i+1)); [ $i -gt 400 ] && exit 9; sleep 0.05; done
        echo "saw-late-mount"
        "#;
    let mut k = start_keel(state.path(), script, "", "", true);
    k.wait_file("started");
    std::fs::create_dir_all(k.path("late")).unwrap();
    let keel = poll("keel under unshare", || {
        descendants(k.pid()).into_iter().find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "keel")
        })
    });
    let late = k.path("late");
    let st = std::process::Command::new("nsenter")
        .args(["--target", &keel.to_string(), "--mount", "--"])
        .args([
            "sh",
            "-c",
            &format!(
                "mount -t tmpfs late {0} && touch {0}/marker",
                late.display()
            ),
        ])
        .status()
        .unwrap();
    assert!(st.success());
    let (code, _) = k.wait();
    assert_eq!(code, 0, "stdout:\n{}\nlog:\n{}", k.stdout(), k.log_text());
    assert!(k.stdout().contains("saw-late-mount"));
}

/// The credentials file as Kubernetes mounts a Secret: a tmpfs of its own, `credentials` a
/// symlink through `..data` into a timestamped directory. Neither another key of the Secret
/// nor the new credentials after a rotation (a new directory, `..data` swapped, the old one
/// removed, as the kubelet does) reach the sandbox.
#[test]
fn a_secret_volume_stays_hidden_across_a_rotation() {
    use std::os::unix::fs::symlink;
    if !require_root_and_fuse("isolation test") {
        return;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let state = tempfile::tempdir().unwrap();
    let outer = tempfile::tempdir().unwrap();
    let dir = outer.path().join("keel");
    std::fs::create_dir(&dir).unwrap();
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "mode=0755", "secret"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success(), "mount a tmpfs for the secret");
    let _unmount = Unmount(dir.clone());
    let version = |name: &str, secret: &str| {
        let v = dir.join(name);
        std::fs::create_dir(&v).unwrap();
        std::fs::write(
            v.join("credentials"),
            format!("AWS_SECRET_ACCESS_KEY={secret}\nAWS_REGION=eu-file-1\n"),
        )
        .unwrap();
        std::fs::write(v.join("other-key"), format!("other-{secret}\n")).unwrap();
    };
    version("..2026_a", FILE_SECRET);
    symlink("..2026_a", dir.join("..data")).unwrap();
    symlink("..data/credentials", dir.join("credentials")).unwrap();
    symlink("..data/other-key", dir.join("other-key")).unwrap();
    let d = dir.display();
    let script = format!(
        r#"
        echo "secret-entries=$(ls -A {d} | wc -l)"
        cat {d}/other-key 2>/dev/null && echo "ATTEMPT read another key of the secret"
        touch $D/ready-to-rotate
        while [ ! -e $D/rotated ]; do sleep 0.05; done
        grep -q ROTATED {d}/credentials 2>/dev/null && echo "ATTEMPT read the rotated credentials"
        grep -rq ROTATED {d} 2>/dev/null && echo "ATTEMPT found the rotated secret"
        echo "looked"
        "#
    );
    let creds = dir.join("credentials");
    let text = config(state.path(), "", "").replace("$D/creds", creds.to_str().unwrap());
    let mut k = start_with(&text, &["sh", "-c", &script], Opts::default());
    k.wait_file("ready-to-rotate");
    version("..2026_b", "ROTATED-secret-9c1");
    symlink("..2026_b", dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    std::fs::remove_dir_all(dir.join("..2026_a")).unwrap();
    assert!(std::fs::read_to_string(&creds).unwrap().contains("ROTATED"));
    std::fs::write(k.path("rotated"), "").unwrap();
    let (code, _) = k.wait();
    let out = k.stdout();
    let log = k.log_text();
    assert_eq!(code, 0, "stdout:\n{out}\nlog:\n{log}");
    assert!(out.contains("looked"), "{out}");
    assert!(out.contains("secret-entries=0\n"), "{out}");
    assert!(!out.contains("ATTEMPT"), "an attempt succeeded:\n{out}");
    assert!(
        log.contains(&format!("{d},")) || log.contains(&format!("{d} ")),
        "{log}"
    );
}

#[test]
fn a_malformed_credentials_file_stops_the_start_before_anything_is_mounted() {
    let state = tempfile::tempdir().unwrap();
    let creds = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        creds.path(),
        "# ok\nAWS_ACCESS_KEY_ID=abc\nthis line is wrong\n",
    )
    .unwrap();
    let text = config(state.path(), "", "").replace("$D/creds", creds.path().to_str().unwrap());
    let mut k = start(&text, &["sh", "-c", "touch $D/ran"]);
    let (code, _) = k.wait();
    let log = k.log_text();
    assert_eq!(code, 2, "{log}");
    let want = format!(
        "credentials file {}: line 3: not KEY=VALUE",
        creds.path().display()
    );
    assert!(log.contains(&want), "{log}");
    assert!(!k.path("ran").exists(), "the main command ran");
    assert!(!log.contains("workspace mounted"), "{log}");
    assert!(!log.contains("abc"), "{log}");
}

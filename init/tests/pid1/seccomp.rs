//! The seccomp filter on everything keel starts (`[sandbox] seccomp`, issue 43): by default
//! the main command, a service and a process started through the API all carry it; as
//! root without CAP_SYS_ADMIN and as an unprivileged user, new user namespaces (`unshare
//! -U`, `unshare(CLONE_NEWUSER)`), `unshare -m` and `mount -t tmpfs` fail with EPERM and
//! `clone3` with ENOSYS, while a shell, git and node (whose threads start through glibc's
//! clone3 fallback) work as before. Off, the same user makes a user namespace and mounts a
//! tmpfs inside it (the surface the filter removes); with `["userns"]` allowed the namespace
//! is made but a mount inside it is still refused.

use crate::support;

use support::pid1::*;

/// Probes each call directly and prints `name=errno` (0: it worked).
const PROBE: &str = r#"
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def t(name, nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    print(f"{name}={0 if r == 0 else ctypes.get_errno()}")
t("unshare_user", 272, 0x10000000)
t("unshare_user_ns", 272, 0x10000000 | 0x00020000)
t("clone3", 435, 0, 0)
"#;

/// The sandbox's attempts, each printed `name: ok` or `name: failed: <message>`.
const ATTEMPTS: &str = r#"
try() { n=$1; shift; if out=$("$@" 2>&1); then echo "$n: ok"; else echo "$n: failed: $out" | head -n 1; fi; }
mkdir -p $D/m
try userns unshare -U true
try mountns unshare -m true
try tmpfs mount -t tmpfs none $D/m
try userns-tmpfs unshare -Urm sh -c "mount -t tmpfs none $D/m && umount $D/m"
try shell sh -c 'echo hi | tr h H | grep -qx Hi'
try git sh -c "r=$D/w/repo-\$(id -u) && rm -rf \$r && git init -q \$r && cd \$r && echo a > f && git add f && git -c user.name=t -c user.email=t@t commit -qm x && git log --oneline | grep -q x"
try node node -e "const w = new (require('worker_threads').Worker)('process.exit(0)', {eval: true}); w.on('exit', c => process.exit(c))"
grep '^Seccomp:' /proc/self/status
python3 $D/probe.py
"#;

fn config(extra: &str) -> String {
    format!(
        "[init]\nworkspace = false\n[workspace]\nstate_dir = \"$D/state\"\n\
         [control]\nsocket = \"$D/sock/c.sock\"\n[shutdown]\ngrace = \"2s\"\n{extra}\n"
    )
}

/// Runs the attempts as the main command (root, CAP_SYS_ADMIN dropped as by default), then
/// as `nobody`; returns keel's stdout.
fn run(extra: &str) -> String {
    let script = format!(
        "cat > $D/probe.py <<'EOF'\n{PROBE}\nEOF\ncat > $D/attempts.sh <<'EOF'\n{ATTEMPTS}\nEOF\n\
         chmod 755 $D; mkdir -p $D/w; chmod 1777 $D/w; chmod 644 $D/probe.py $D/attempts.sh; \
         echo '== root'; D=$D sh $D/attempts.sh; \
         echo '== nobody'; setpriv --reuid=65534 --regid=65534 --clear-groups env D=$D HOME=/tmp sh $D/attempts.sh; \
         echo '== exec'; {keel} exec --socket $D/sock/c.sock -- grep '^Seccomp:' /proc/self/status; \
         echo '== service'; cat $D/svc.status",
        keel = KEEL
    );
    let text = format!(
        "{}\n[[service]]\nname = \"rec\"\ncommand = [\"sh\", \"-c\", \"grep '^Seccomp:' /proc/self/status > $D/svc.tmp; mv $D/svc.tmp $D/svc.status; exec sleep 1000\"]\n",
        config(extra)
    );
    let mut k = start(
        &text,
        &[
            "sh",
            "-c",
            &format!("while [ ! -e $D/svc.status ]; do sleep 0.05; done; {script}"),
        ],
    );
    let (code, _) = k.wait();
    assert_eq!(
        code,
        0,
        "keel run exited {code}:\n{}\n{}",
        k.stdout(),
        k.log_text()
    );
    k.stdout()
}

/// The lines of the section `== who` of `out`.
fn section<'a>(out: &'a str, who: &str) -> Vec<&'a str> {
    out.split("== ")
        .find(|s| s.starts_with(&format!("{who}\n")))
        .unwrap_or_else(|| panic!("no section {who} in:\n{out}"))
        .lines()
        .skip(1)
        .collect()
}

fn line<'a>(lines: &[&'a str], prefix: &str) -> &'a str {
    lines
        .iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in {lines:#?}"))
}

fn refused(lines: &[&str], name: &str) {
    let l = line(lines, &format!("{name}: "));
    assert!(
        l.contains("failed")
            && (l.contains("ermission denied")
                || l.contains("Operation not permitted")
                // util-linux's own refusal for a non-root caller outside a user namespace
                || l.contains("must be superuser")),
        "{name} was not refused with EPERM: {l}"
    );
}

fn works(lines: &[&str], name: &str) {
    assert_eq!(
        line(lines, &format!("{name}: ")),
        format!("{name}: ok"),
        "{lines:#?}"
    );
}

#[test]
fn the_filter_refuses_user_namespaces_and_mounts_and_leaves_workloads_alone() {
    if !require_root("seccomp test") {
        return;
    }
    let out = run("");
    eprintln!("{out}");
    for who in ["root", "nobody"] {
        let l = section(&out, who);
        for name in ["userns", "mountns", "tmpfs", "userns-tmpfs"] {
            refused(&l, name);
        }
        for name in ["shell", "git", "node"] {
            works(&l, name);
        }
        assert_eq!(line(&l, "unshare_user="), "unshare_user=1", "{who}: EPERM");
        assert_eq!(
            line(&l, "unshare_user_ns="),
            "unshare_user_ns=1",
            "{who}: EPERM"
        );
        assert_eq!(line(&l, "clone3="), "clone3=38", "{who}: ENOSYS");
        assert_eq!(line(&l, "Seccomp:"), "Seccomp:\t2", "{who}: filter mode");
    }
    for who in ["exec", "service"] {
        assert_eq!(
            line(&section(&out, who), "Seccomp:"),
            "Seccomp:\t2",
            "{who} has no filter"
        );
    }
}

#[test]
fn off_the_sandbox_makes_user_namespaces_and_mounts_in_them_and_a_list_allows_some() {
    if !require_root("seccomp test") {
        return;
    }
    // Where the kernel refuses unprivileged user namespaces (a sysctl, an LSM) there is
    // nothing to show with the filter off.
    let host = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "unshare",
            "-U",
            "true",
        ])
        .status()
        .expect("run setpriv");
    assert!(
        host.success(),
        "this kernel refuses unprivileged user namespaces: the test cannot show the filter's effect"
    );
    let out = run("[sandbox]\nseccomp = false\n");
    for who in ["root", "nobody"] {
        let l = section(&out, who);
        works(&l, "userns");
        works(&l, "userns-tmpfs");
        assert_eq!(line(&l, "unshare_user="), "unshare_user=0", "{who}");
        assert_eq!(line(&l, "Seccomp:"), "Seccomp:\t0", "{who}");
        for name in ["shell", "git", "node"] {
            works(&l, name);
        }
    }

    let out = run("[sandbox]\nseccomp = [\"userns\"]\n");
    for who in ["root", "nobody"] {
        let l = section(&out, who);
        works(&l, "userns");
        // The namespace is made; the mount inside it is still refused.
        refused(&l, "userns-tmpfs");
        assert_ne!(
            line(&l, "clone3="),
            "clone3=38",
            "{who}: clone3 allowed with userns"
        );
        works(&l, "node");
    }
}

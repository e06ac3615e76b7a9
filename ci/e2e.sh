#!/usr/bin/env bash
# End-to-end tests of the keel image in a real container runtime (podman + runc, as root).
# Builds the image (script/build-image), then runs each case in fresh containers and prints
# one line per case and a closing `N passed, M failed` line. Exits non-zero when any case
# failed. No case is ever skipped: a missing tool or feature is a failure naming it.
#
# usage: ci/e2e.sh [CASE...]        (default: all; `ci/e2e.sh --list` names them)
# env:   KEEL_IMAGE (default localhost/keel:e2e), KEEL_E2E_NO_BUILD=1 to reuse the image,
#        KEEL_E2E_BIN=PATH to put an already built keel in the image (script/build-image --bin).
# Commands for the containers are single-quoted on purpose: they expand inside them.
# shellcheck disable=SC2016
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=script/lib.sh
. "$repo/script/lib.sh"
set +e   # lib.sh is errexit-friendly; the cases check every status themselves

CASES=(exit_code default_cmd pid1_reaps tty_session script_run workspace_is_fuse
       persist_across_stop stop_waits_for_trap stop_kills_at_grace missing_cap missing_fuse bad_config profiles_load
       nonroot_cannot_umount nonroot_can_write health_after_mount remote_checkpoint_restore
       remote_restore transport attacker agent_rollback dir_without_sys_admin dir_without_device)

if [ "${1:-}" = --list ]; then printf '%s\n' "${CASES[@]}"; exit 0; fi
selected=("$@")
[ ${#selected[@]} -gt 0 ] || selected=("${CASES[@]}")

image="${KEEL_IMAGE:-localhost/keel:e2e}"
prefix="keel-e2e-$$"
tmp="$(mktemp -d /tmp/keel-e2e.XXXXXX)"
passed=0 failed=0
MOTO_PID=""
failed_names=()

need_tools podman
setup_podman_env

cleanup() {
    local c v
    for c in $(pm ps -a --filter "name=^$prefix-" --format '{{.Names}}' 2>/dev/null); do
        pm rm -f -t 0 "$c" >/dev/null 2>&1
    done
    for v in $(pm volume ls --filter "name=^$prefix-" --format '{{.Name}}' 2>/dev/null); do
        pm volume rm -f "$v" >/dev/null 2>&1
    done
    [ -z "${MOTO_PID:-}" ] || kill "$MOTO_PID" 2>/dev/null
    ! mountpoint -q "$tmp/fullvol" 2>/dev/null || umount -l "$tmp/fullvol"
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "${KEEL_E2E_NO_BUILD:-0}" != 1 ]; then
    e2e_build_image "$image" "$tmp/build.log" || exit 1
fi

base_flags=(--device /dev/fuse --cap-add SYS_ADMIN)
if [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)" = Y ]; then
    base_flags+=(--security-opt apparmor=unconfined)
fi
keel_flags=("${base_flags[@]}")
# Without systemd podman cannot schedule the image's HEALTHCHECK and logs errors for every
# container; only health_after_mount needs it (and runs it by hand).
[ -d /run/systemd/system ] || keel_flags+=(--no-healthcheck)

# --- helpers ------------------------------------------------------------------------------------
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
# float comparison: fle A B  →  A <= B
fle() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }

CASE_ERR=""
fail() { CASE_ERR="${CASE_ERR:+$CASE_ERR; }$*"; }
show() {   # show FILE LABEL: a container's output (and FILE.err when there is one)
    [ -s "$1" ] || [ -s "$1.err" ] || return 0
    echo "    --- $2"
    all "$1" | sed -e 's/^/    | /' | head -n 40
}

# run_c OUT ARGS...: `podman run --rm ARGS`; stdout to OUT, stderr (keel's log) to OUT.err;
# returns the container's status.
run_c() {
    local out="$1"; shift
    timeout 120 podman ${KEEL_STORAGE_DRIVER:+--storage-driver "$KEEL_STORAGE_DRIVER"} \
        run --rm "$@" >"$out" 2>"$out.err" </dev/null
}
all() { cat "$1" "$1.err" 2>/dev/null; }   # stdout and stderr of a run_c

# wait_ready NAME [SECS]: waits until the container's log has a READY line.
wait_ready() {
    local name="$1" secs="${2:-60}" i
    for ((i = 0; i < secs * 10; i++)); do
        pm logs "$name" 2>&1 | grep -q '^READY$' && return 0
        [ "$(pm inspect -f '{{.State.Running}}' "$name" 2>/dev/null)" = true ] || {
            pm logs "$name" >"$tmp/$name.early.log" 2>&1
            fail "$name exited before READY (status $(pm inspect -f '{{.State.ExitCode}}' "$name" 2>/dev/null))"
            show "$tmp/$name.early.log" "$name"
            return 1
        }
        sleep 0.1
    done
    fail "$name not READY after ${secs}s"
    return 1
}

# --- cases --------------------------------------------------------------------------------------

# The image's CMD status becomes the container's: 0..255, 128+N for a signal, 127, 126.
case_exit_code() {
    local want cmd out="$tmp/exit.out" rc
    while IFS='|' read -r want cmd; do
        run_c "$out" "${keel_flags[@]}" "$image" sh -c "$cmd"; rc=$?
        [ "$rc" = "$want" ] || { fail "sh -c '$cmd' → $rc, want $want"; show "$out" "$cmd"; }
    done <<'EOF'
0|true
3|exit 3
255|exit 255
137|kill -KILL $$
143|kill -TERM $$
EOF
    # keel's own statuses: the command is missing (127) or not executable (126).
    run_c "$out" "${keel_flags[@]}" "$image" /nonexistent/command; rc=$?
    [ "$rc" = 127 ] || { fail "missing command → $rc, want 127"; show "$out" missing; }
    run_c "$out" "${keel_flags[@]}" "$image" /etc/keel/ci.toml; rc=$?
    [ "$rc" = 126 ] || { fail "non-executable command → $rc, want 126"; show "$out" not-executable; }
}

# `podman run IMAGE` runs the default CMD (a login shell): with no terminal it reads stdin.
case_default_cmd() {
    local out="$tmp/default.out" rc
    timeout 60 podman ${KEEL_STORAGE_DRIVER:+--storage-driver "$KEEL_STORAGE_DRIVER"} \
        run --rm -i "${keel_flags[@]}" "$image" >"$out" 2>&1 <<'EOF'
echo "cwd=$(pwd)"
exit 4
EOF
    rc=$?
    [ "$rc" = 4 ] || fail "shell fed 'exit 4' → $rc"
    grep -qx 'cwd=/workspace' "$out" || fail "default shell does not start in /workspace"
    [ -z "$CASE_ERR" ] || show "$out" "podman run -i IMAGE"
}

# keel is PID 1 and reaps orphans re-parented to it.
case_pid1_reaps() {
    local out="$tmp/pid1.out"
    run_c "$out" "${keel_flags[@]}" "$image" sh -c '
        echo "pid1=$(cat /proc/1/comm)"
        i=0; while [ $i -lt 20 ]; do (sleep 0.2 &); i=$((i + 1)); done
        # Until the orphans have ended and nothing is left unreaped (a hang guard of 120 s).
        i=0; while [ $i -lt 1200 ]; do
            [ "$(ps -eo comm=,stat= | grep -c "^sleep\|Z")" = 0 ] && break
            sleep 0.1; i=$((i + 1))
        done
        echo "zombies=$(ps -eo stat= | grep -c "^Z")"' || fail "container failed"
    grep -qx 'pid1=keel' "$out" || fail "PID 1 is not keel"
    grep -qx 'zombies=0' "$out" || fail "orphans were not reaped"
    [ -z "$CASE_ERR" ] || show "$out" out
}

# With a terminal (podman run -it) the main service gets it as its controlling TTY.
case_tty_session() {
    local out="$tmp/tty.out" rc
    command -v script >/dev/null 2>&1 || { fail "script(1) from bsdutils is missing on the host"; return; }
    timeout 60 script -qec "podman ${KEEL_STORAGE_DRIVER:+--storage-driver $KEEL_STORAGE_DRIVER} run --rm -it ${keel_flags[*]} $image sh -c 'tty; test -t 0 && echo STDIN-IS-TTY; ps -o stat= -p \$\$; exit 5'" /dev/null \
        >"$out" 2>&1 </dev/null; rc=$?
    [ "$rc" = 5 ] || fail "exit status $rc through the TTY, want 5"
    grep -q '^/dev/pts/' "$out" || fail "the service has no TTY"
    grep -q 'STDIN-IS-TTY' "$out" || fail "stdin is not the TTY"
    grep -q '^S.*+' "$out" || fail "the service is not the TTY's foreground process group"
    [ -z "$CASE_ERR" ] || show "$out" "podman run -it"
}

# The README's first command: script/run CMD runs CMD in a keel container, status passed through.
case_script_run() {
    local out="$tmp/run.out" rc
    KEEL_IMAGE="$image" timeout 120 "$repo/script/run" --no-build --volume "$prefix-run" \
        sh -c 'echo "cwd=$(pwd) type=$(stat -f -c %t .)"; exit 7' >"$out" 2>&1 </dev/null; rc=$?
    [ "$rc" = 7 ] || fail "script/run sh -c 'exit 7' → $rc"
    grep -q '^cwd=/workspace type=65735546' "$out" || fail "not run in the FUSE /workspace"
    [ -z "$CASE_ERR" ] || show "$out" "script/run"
}

# /workspace is a FUSE mount, and the command's working directory is on it (not the
# directory underneath that was the runtime's cwd before keel mounted).
case_workspace_is_fuse() {
    local out="$tmp/fuse.out"
    run_c "$out" "${keel_flags[@]}" "$image" sh -c '
        echo "type=$(awk "\$2 == \"/workspace\" { print \$3 }" /proc/mounts | tail -n1)"
        echo "cwd=$(pwd) dev_cwd=$(stat -c %d .) dev_ws=$(stat -c %d /workspace) fs_cwd=$(stat -f -c %t .)"
        echo hello > /workspace/probe && cat probe' || fail "container failed ($?)"
    grep -q '^type=fuse' "$out" || fail "/workspace is not a FUSE mount"
    grep -q 'fs_cwd=65735546' "$out" || fail "the command's cwd is not on the FUSE mount"
    awk '/^cwd=/ { split($2, a, "="); split($3, b, "="); exit !(a[2] == b[2]) }' "$out" \
        || fail "cwd and /workspace are on different devices"
    grep -qx hello "$out" || fail "write+read through /workspace failed"
    # The image's /var/lib/keel (the anonymous volume here) is already private.
    grep -q 'tightened' "$out.err" && fail "a fresh container tightened modes: $(grep tightened "$out.err")"
    [ -z "$CASE_ERR" ] || show "$out" "mounts"
}

# The way keel is used: `--device /dev/fuse` under the runtime's default seccomp profile
# (which blocks io_uring; keel never asks for it). The workspace is served over /dev/fuse by
# fuser's worker threads; unconfined changes nothing. keel logs the requests it served.
case_transport() {
    local out="$tmp/transport.out" opt
    for opt in default unconfined; do
        local sec=()
        [ "$opt" = default ] || sec=(--security-opt seccomp=unconfined)
        run_c "$out" "${keel_flags[@]}" "${sec[@]}" "$image" \
            sh -c 'mkdir /workspace/d && for i in $(seq 50); do echo $i > /workspace/d/$i; done;
                   cat /workspace/d/50' || fail "$opt seccomp: container failed ($?)"
        grep -q 'workspace mounted' "$out.err" || fail "$opt seccomp: no 'workspace mounted' line"
        grep -q 'io_uring\|transport=' "$out.err" && fail "$opt seccomp: keel still speaks of io_uring"
        grep -qx 50 "$out" || fail "$opt seccomp: write+read failed"
        grep -q 'workspace unmounted.*fuse_requests=[1-9]' "$out.err" ||
            fail "$opt seccomp: no count of FUSE requests served at the unmount"
        [ -z "$CASE_ERR" ] || { show "$out" "$opt seccomp"; return; }
    done
}

# Files written in one container (one of them still open for writing) survive `podman stop`
# and are identical in a new container on the same state volume.
case_persist_across_stop() {
    local vol="$prefix-state" c1="$prefix-writer" st
    local manifest='cd /workspace && find . -path ./lost+found -prune -o -printf "%y %m %s %p %l\n" | LC_ALL=C sort &&
        find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum && stat -c "mtime %Y %n" tree/hello.txt'
    pm volume create "$vol" >/dev/null || { fail "volume create"; return; }
    pm run -d --name "$c1" "${keel_flags[@]}" -v "$vol:/var/lib/keel" "$image" sh -c '
        set -e
        mkdir -p tree/a/b/c many
        echo hello > tree/hello.txt
        touch -d "2020-01-02 03:04:05" tree/hello.txt
        head -c 5242880 /dev/urandom > tree/a/big.bin
        head -c 100000 /dev/urandom > tree/a/b/c/odd-size.bin
        ln -s ../../hello.txt tree/a/b/link
        chmod 0750 tree/a/b; chmod 0600 tree/a/b/c/odd-size.bin; chmod 0755 tree/hello.txt
        i=0; while [ $i -lt 300 ]; do echo "file $i" > many/f$i; i=$((i + 1)); done
        rm many/f7; mv many/f8 many/renamed
        exec 3> open-at-stop.log
        i=0; while [ $i -lt 1000 ]; do echo "line $i" >&3; i=$((i + 1)); done
        echo READY
        exec sleep infinity' >/dev/null || { fail "writer did not start"; return; }
    wait_ready "$c1" || return
    pm exec "$c1" sh -c "$manifest" >"$tmp/before" 2>&1 || { fail "manifest (before) failed"; show "$tmp/before" before; return; }
    pm stop -t 20 "$c1" >/dev/null 2>&1
    st=$(pm inspect -f '{{.State.ExitCode}}' "$c1")
    pm logs "$c1" >"$tmp/writer.log" 2>&1
    # A fresh named volume takes the image's 0700 /var/lib/keel: nothing to tighten.
    grep -q 'tightened' "$tmp/writer.log" && fail "a fresh volume was tightened: $(grep tightened "$tmp/writer.log")"
    case "$st" in 0|143) ;; *) fail "writer exit status after stop: $st" ;; esac
    run_c "$tmp/after" "${keel_flags[@]}" -v "$vol:/var/lib/keel" "$image" sh -c "$manifest" \
        || fail "reader container failed"
    if ! diff -u "$tmp/before" "$tmp/after" >"$tmp/diff"; then
        show "$tmp/after" "reader"
        fail "workspace differs after stop + new container"
        show "$tmp/diff" "diff before/after"
        show "$tmp/writer.log" "writer log"
    fi
    grep -q 'open-at-stop.log' "$tmp/after" || fail "the file open at stop is missing"
}

# `podman stop` of a service that traps SIGTERM and needs 1 s takes about 1 s, not the grace:
# with a grace of an hour, keel's exit with the service's status 0 (not podman's SIGKILL after
# its own 120 s) shows that keel stopped when the service did.
case_stop_waits_for_trap() {
    local c="$prefix-trap" t0 t1 e
    printf '[shutdown]\ngrace = "1h"\n' >"$tmp/long-grace.toml"
    pm run -d --name "$c" "${keel_flags[@]}" -v "$tmp/long-grace.toml:/etc/keel/config.toml:ro" "$image" sh -c '
        trap "sleep 1; echo BYE; exit 0" TERM
        echo READY
        while :; do sleep 0.2; done' >/dev/null || { fail "container did not start"; return; }
    wait_ready "$c" || return
    t0=$(now); pm stop -t 120 "$c" >/dev/null 2>&1; t1=$(now)
    e=$(elapsed "$t0" "$t1")
    pm logs "$c" >"$tmp/trap.log" 2>&1
    grep -qx BYE "$tmp/trap.log" || fail "the service's TERM trap did not run"
    fle 0.9 "$e" || fail "stop took ${e}s: keel did not wait for the service"
    grep -q 'keel: exit 0 after' "$tmp/trap.log" || fail "keel did not end the stop itself (waited for the grace period?)"
    [ "$(pm inspect -f '{{.State.ExitCode}}' "$c")" = 0 ] \
        || fail "exit status $(pm inspect -f '{{.State.ExitCode}}' "$c"), want the service's 0"
    [ -z "$CASE_ERR" ] || show "$tmp/trap.log" log
    echo "    stop took ${e}s"
}

# A service that ignores SIGTERM is SIGKILLed when the configured grace (ci.toml: 2 s) ends,
# long before podman's own timeout.
case_stop_kills_at_grace() {
    local c="$prefix-ignore" t0 t1 e st
    pm run -d --name "$c" "${keel_flags[@]}" -e KEEL_CONFIG=/etc/keel/ci.toml "$image" sh -c '
        trap "" TERM
        echo READY
        while :; do sleep 0.2; done' >/dev/null || { fail "container did not start"; return; }
    wait_ready "$c" || return
    t0=$(now); pm stop -t 30 "$c" >/dev/null 2>&1; t1=$(now)
    e=$(elapsed "$t0" "$t1")
    st=$(pm inspect -f '{{.State.ExitCode}}' "$c")
    pm logs "$c" >"$tmp/ignore.log" 2>&1
    fle 1.9 "$e" || fail "stop took ${e}s: killed before the 2s grace"
    # keel's SIGKILL at its grace, not podman's after 30 s: keel logged both and exited.
    grep -q 'grace 2.000s expired' "$tmp/ignore.log" || fail "keel did not kill at its grace"
    grep -q 'keel: exit 137 after' "$tmp/ignore.log" || fail "keel did not exit by itself"
    [ "$st" = 137 ] || fail "exit status $st, want 137 (main command SIGKILLed)"
    [ -z "$CASE_ERR" ] || show "$tmp/ignore.log" log
    echo "    stop took ${e}s"
}

# Without one of the two flags and with on_fuse_unavailable = "fail" (ci.toml), keel exits
# at once, non-zero, naming the missing flag, and runs nothing. (By default it uses the dir
# provider instead: the dir_* cases.)
check_missing() {   # check_missing FLAG-NAMED-IN-MESSAGE PODMAN-FLAGS...
    local want="$1"; shift
    local out="$tmp/missing.out" rc
    run_c "$out" "$@" -e KEEL_CONFIG=/etc/keel/ci.toml "$image" sh -c 'echo COMMAND-RAN'; rc=$?
    [ "$rc" != 0 ] || fail "exit status 0 without $want"
    all "$out" | grep -qF -- "$want" || fail "message does not name $want"
    ! grep -qx COMMAND-RAN "$out" || fail "the command ran without $want"
    [ -z "$CASE_ERR" ] || show "$out" "without $want"
}
case_missing_cap() { check_missing "--cap-add SYS_ADMIN" --device /dev/fuse; }
case_missing_fuse() { check_missing "--device /dev/fuse" --cap-add SYS_ADMIN; }

# A broken config.toml mounted into the image: exits at once, naming file, key and reason.
case_bad_config() {
    local out="$tmp/bad.out" rc key reason
    while IFS='|' read -r key reason body; do
        printf '%b' "$body" >"$tmp/config.toml"
        run_c "$out" "${keel_flags[@]}" -v "$tmp/config.toml:/etc/keel/config.toml:ro" \
            "$image" sh -c 'echo COMMAND-RAN'; rc=$?
        [ "$rc" != 0 ] || fail "$key: exit status 0"
        all "$out" | grep -qF "$key" || fail "$key: key not named"
        all "$out" | grep -qiF "$reason" || fail "$key: reason ($reason) not given"
        all "$out" | grep -qF config.toml || fail "$key: file not named"
        ! grep -qx COMMAND-RAN "$out" || fail "$key: the command ran anyway"
        [ -z "$CASE_ERR" ] || { show "$out" "$key"; return; }
    done <<'EOF'
workspace.cache|fast|[workspace]\ncache = "fast"\n
workspace.bogus|bogus|[workspace]\nbogus = 1\n
workspace.chunk_size|power of two|[workspace]\nchunk_size = "3MiB"\n
workspace.state_dir|absolute|[workspace]\nstate_dir = "relative/dir"\n
EOF
    # KEEL_CONFIG selects another file; a missing one is an error, not the defaults.
    run_c "$out" "${keel_flags[@]}" -e KEEL_CONFIG=/etc/keel/nope.toml "$image" true; rc=$?
    [ "$rc" != 0 ] || fail "KEEL_CONFIG=/etc/keel/nope.toml: exit status 0"
    all "$out" | grep -qF nope.toml || { fail "missing KEEL_CONFIG file not named"; show "$out" nope; }
}

# Every config file the image ships starts a working container.
case_profiles_load() {
    local f out="$tmp/profile.out" files
    files=$(cd "$repo/config" && ls -- *.toml 2>/dev/null)
    [ -n "$files" ] || { fail "no config/*.toml"; return; }
    for f in $files; do
        if [ "$f" = cloudflare.toml ]; then
            # Needs the platform's variables (ci/platform-e2e.sh runs it against moto);
            # without them keel must stop at once, naming the key and the variable.
            run_c "$out" "${keel_flags[@]}" -e "KEEL_CONFIG=/etc/keel/$f" "$image" \
                sh -c 'echo COMMAND-RAN' && fail "$f without KEEL_WORKSPACE_ID: exit status 0"
            all "$out" | grep -q 'persist.remote.*KEEL_WORKSPACE_ID' \
                || { fail "$f: no line naming persist.remote and KEEL_WORKSPACE_ID"; show "$out" "$f"; }
            ! grep -qx COMMAND-RAN "$out" || fail "$f: the command ran without KEEL_WORKSPACE_ID"
            continue
        fi
        run_c "$out" "${keel_flags[@]}" -e "KEEL_CONFIG=/etc/keel/$f" "$image" \
            sh -c 'awk "\$2 == \"/workspace\" { print \$3 }" /proc/mounts' \
            || { fail "$f: container failed"; show "$out" "$f"; continue; }
        grep -q '^fuse' "$out" || { fail "$f: /workspace not mounted"; show "$out" "$f"; }
    done
}

# A main command run as a non-root user ([init] user) can work in its workspace: the
# workspace root must belong to that user (on a fresh state dir), as a home directory would.
case_nonroot_can_write() {
    local out="$tmp/write.out"
    printf '[init]\nuser = "sandbox"\n' >"$tmp/user.toml"
    run_c "$out" "${keel_flags[@]}" -v "$tmp/user.toml:/etc/keel/config.toml:ro" "$image" \
        sh -c 'ls -ldn /workspace; mkdir -p /workspace/src && echo hi > /workspace/src/a && echo WRITE-OK' \
        || fail "container failed"
    grep -qx WRITE-OK "$out" || fail "uid 1000 cannot write /workspace"
    [ -z "$CASE_ERR" ] || show "$out" "sandbox user"
}

# Sandboxed code cannot unmount /workspace: services run without CAP_SYS_ADMIN (even as root,
# by default), and as a non-root user with `[init] user`.
case_nonroot_cannot_umount() {
    local out="$tmp/umount.out" probe
    probe='echo "uid=$(id -u)"
        bnd=$(awk "/^CapBnd/ { print \$2 }" /proc/self/status)
        if [ $(( 0x$bnd >> 21 & 1 )) = 1 ]; then echo "SYS_ADMIN in bounding set"; fi
        umount /workspace 2>&1 && echo "UMOUNT-SUCCEEDED"
        umount -l /workspace 2>&1 && echo "UMOUNT-SUCCEEDED"
        mount -o remount,ro /workspace 2>&1 && echo "REMOUNT-SUCCEEDED"
        echo "after=$(awk "\$2 == \"/workspace\" { print \$3 }" /proc/mounts | tail -n1)"'
    run_c "$out" "${keel_flags[@]}" "$image" sh -c "$probe" || fail "root service: container failed"
    grep -qxE '(UMOUNT|REMOUNT)-SUCCEEDED|SYS_ADMIN in bounding set' "$out" && fail "root service could unmount/remount or holds SYS_ADMIN"
    grep -q '^after=fuse' "$out" || fail "root service: /workspace not mounted afterwards"
    [ -z "$CASE_ERR" ] || { show "$out" "root service"; return; }

    printf '[init]\nuser = "sandbox"\n' >"$tmp/user.toml"
    run_c "$out" "${keel_flags[@]}" -v "$tmp/user.toml:/etc/keel/config.toml:ro" "$image" \
        sh -c "$probe" || fail "sandbox user: container failed"
    grep -qx 'uid=1000' "$out" || fail "[init] user = \"sandbox\" did not run the service as uid 1000"
    grep -qxE '(UMOUNT|REMOUNT)-SUCCEEDED|SYS_ADMIN in bounding set' "$out" && fail "sandbox user could unmount/remount or holds SYS_ADMIN"
    grep -q '^after=fuse' "$out" || fail "sandbox user: /workspace not mounted afterwards"
    [ -z "$CASE_ERR" ] || show "$out" "sandbox user"
}
# The control API: /health is 503 until the workspace is mounted and every service with a
# readiness probe is ready, then 200; the image's HEALTHCHECK agrees; /status needs the
# bearer token (401 without it, naming no routes) and reports the mounted workspace.
case_health_after_mount() {
    local c="$prefix-health" code i body logs
    cat >"$tmp/control.toml" <<'EOF'
[control]
listen = "127.0.0.1:8787"

[[service]]
name = "gate"
command = ["sh", "-c", "exec sleep infinity"]
ready = { file = "/tmp/gate-open", interval = "100ms", timeout = "120s" }
EOF
    pm run -d --name "$c" "${base_flags[@]}" -e KEEL_CONTROL_TOKEN=e2e-secret-token \
        -v "$tmp/control.toml:/etc/keel/config.toml:ro" "$image" sh -c 'echo READY; exec sleep infinity' \
        >/dev/null 2>"$tmp/health-run.err" || { fail "container did not start"; show "$tmp/health-run.err" run; return; }
    http() {   # http PATH [CURL ARGS...] → prints the status code; body in $tmp/body
        local path="$1"; shift
        pm exec "$c" curl -s -m 60 -o /dev/stdout -w '\n%{http_code}' "$@" "http://127.0.0.1:8787$path" \
            2>/dev/null >"$tmp/http.out"
        tail -n1 "$tmp/http.out"; sed '$d' "$tmp/http.out" >"$tmp/body"
    }
    # Polls until it answers, and below until it says 200: hang guards of 120 s.
    for ((i = 0; i < 1200; i++)); do
        code=$(http /health); [ "$code" = 000 ] || [ -z "$code" ] || break; sleep 0.1
    done
    [ "$code" = 503 ] || fail "/health before the service is ready: $code, want 503"
    sleep 0.5
    code=$(http /health)
    [ "$code" = 503 ] || fail "/health while the service is not ready: $code, want 503"
    # Captured first: under pipefail, `grep -q` exiting at the first match can fail the pipe.
    logs=$(pm logs "$c" 2>/dev/null)
    grep -qx READY <<<"$logs" && fail "the main command started before the service was ready"
    pm exec "$c" touch /tmp/gate-open
    for ((i = 0; i < 1200; i++)); do code=$(http /health); [ "$code" = 200 ] && break; sleep 0.1; done
    [ "$code" = 200 ] || fail "/health after the service became ready: $code, want 200"
    wait_ready "$c" 10 || true
    if [ "$(pm inspect -f '{{if .Config.Healthcheck}}yes{{end}}' "$c" 2>/dev/null)" = yes ]; then
        pm healthcheck run "$c" >"$tmp/hc.out" 2>&1 || { fail "podman healthcheck run: unhealthy"; show "$tmp/hc.out" healthcheck; }
    else
        fail "the image has no HEALTHCHECK"
    fi
    code=$(http /status)
    [ "$code" = 401 ] || fail "/status without a token: $code, want 401"
    grep -qE 'checkpoint|metrics|/status' "$tmp/body" && fail "the 401 body names routes: $(head -c 200 "$tmp/body")"
    code=$(http /status -H 'Authorization: Bearer wrong-token')
    [ "$code" = 401 ] || fail "/status with a wrong token: $code, want 401"
    code=$(http /status -H 'Authorization: Bearer e2e-secret-token')
    [ "$code" = 200 ] || fail "/status with the token: $code, want 200"
    body=$(cat "$tmp/body")
    grep -q '/workspace' <<<"$body" || fail "/status does not show the mount: ${body:0:300}"
    grep -qE '"healthy": *true' <<<"$body" || fail "/status does not say healthy: ${body:0:300}"
    if [ -n "$CASE_ERR" ]; then pm logs "$c" >"$tmp/health.log" 2>&1; show "$tmp/health.log" log; fi
    pm rm -f -t 0 "$c" >/dev/null 2>&1
    return 0
}
# Issue 26's agent loop through the control API in the real image: the host names a snapshot
# of a good git repo, an "agent" breaks the repo (objects deleted, a file garbled, one removed,
# junk added), the host rolls the live /workspace back with POST /rollback while the container
# runs, and git fsck, the files and `git status` are clean again; the rollback can be undone.
# Then the sandboxed command itself runs keel snapshot create / diff / rollback / list (the
# state dir is covered there: they go through the control socket).
case_agent_rollback() {
    local c="$prefix-agent" code logs undo i
    cat >"$tmp/agent.toml" <<'EOF'
[control]
listen = "127.0.0.1:8788"
EOF
    pm run -d --name "$c" "${keel_flags[@]}" -e KEEL_CONTROL_TOKEN=agent-token \
        -v "$tmp/agent.toml:/etc/keel/config.toml:ro" "$image" sh -c '
        set -e
        mkdir /workspace/repo && cd /workspace/repo
        git init -q && git config user.email a@e2e && git config user.name agent
        for i in $(seq 1 50); do echo "line $i of file $i" > "f$i.txt"; done
        mkdir -p src && seq 1 2000 > src/main.txt
        git add -A && git commit -q -m good
        echo READY
        # The same commands from inside the sandbox (the state dir is covered here, so they
        # go through the control socket): once the host touches /tmp/go.
        while [ ! -e /tmp/go ]; do sleep 0.1; done
        (set -e; cd /workspace; test ! -e /var/lib/keel/meta.db
         keel snapshot create --name inside -m "from the sandbox"
         echo new > inside.txt
         keel diff inside | tee /dev/stderr | grep -q "^A /inside.txt"
         keel rollback inside; test ! -e inside.txt
         keel snapshot list | grep -q "inside") >/tmp/inside.out 2>&1
        echo $? >/tmp/inside.rc
        exec sleep infinity' >/dev/null 2>"$tmp/agent-run.err" || { fail "container did not start"; show "$tmp/agent-run.err" run; return; }
    api() {   # api METHOD PATH → prints the status code; body in $tmp/api-body
        pm exec "$c" curl -s -m 60 -o /dev/stdout -w '\n%{http_code}' -X "$1" \
            -H 'Authorization: Bearer agent-token' "http://127.0.0.1:8788$2" 2>/dev/null >"$tmp/api.out"
        tail -n1 "$tmp/api.out"; sed '$d' "$tmp/api.out" >"$tmp/api-body"
    }
    if wait_ready "$c"; then
        code=$(api POST '/snapshots?name=good&message=tests%20pass')
        [ "$code" = 200 ] || fail "POST /snapshots: $code $(head -c 300 "$tmp/api-body")"
        pm exec "$c" sh -c 'cd /workspace/repo && rm -rf .git/objects/?? && echo garbage > src/main.txt &&
            rm f7.txt && head -c 100000 /dev/urandom > junk.bin' || fail "the agent could not break the repo"
        pm exec "$c" sh -c 'cd /workspace/repo && git fsck' >/dev/null 2>&1 \
            && fail "git fsck passes on the broken repo: the test breaks nothing"
        code=$(api GET '/diff?from=good')
        [ "$code" = 200 ] || fail "GET /diff: $code $(head -c 300 "$tmp/api-body")"
        grep -q 'junk.bin' "$tmp/api-body" || fail "the diff does not name junk.bin: $(head -c 300 "$tmp/api-body")"
        code=$(api POST '/rollback?to=good')
        [ "$code" = 200 ] || fail "POST /rollback: $code $(head -c 300 "$tmp/api-body")"
        undo=$(jq -r '.undo // empty' "$tmp/api-body" 2>/dev/null)
        pm exec "$c" sh -c 'cd /workspace/repo && git fsck --full && test -z "$(git status --porcelain)" &&
            seq 1 2000 | cmp - src/main.txt && test -f f7.txt && ! test -e junk.bin' >"$tmp/agent-check" 2>&1 \
            || { fail "after the rollback the repo is not the good one"; show "$tmp/agent-check" check; }
        # The rollback recorded the state before it: rolling back to that brings the broken tree back.
        if [ -n "$undo" ]; then
            code=$(api POST "/rollback?to=$undo")
            [ "$code" = 200 ] || fail "POST /rollback?to=$undo (undo): $code $(head -c 300 "$tmp/api-body")"
            pm exec "$c" test -e /workspace/repo/junk.bin || fail "undoing the rollback did not bring junk.bin back"
        else
            fail "the rollback's answer names no undo snapshot: $(head -c 300 "$tmp/api-body")"
        fi
        pm exec "$c" touch /tmp/go
        for ((i = 0; i < 300; i++)); do pm exec "$c" test -e /tmp/inside.rc && break; sleep 0.2; done
        pm exec "$c" cat /tmp/inside.out >"$tmp/inside.out" 2>&1
        [ "$(pm exec "$c" cat /tmp/inside.rc 2>/dev/null)" = 0 ] \
            || { fail "keel snapshot create / diff / rollback / list from inside the sandbox"; show "$tmp/inside.out" inside; }
    else
        fail "the agent's repo was not made"
    fi
    if [ -n "$CASE_ERR" ]; then logs=$(pm logs "$c" 2>&1); printf '%s\n' "$logs" >"$tmp/agent.log"; show "$tmp/agent.log" log; fi
    pm rm -f -t 0 "$c" >/dev/null 2>&1
    return 0
}

# S3 remote (moto on the host's loopback; containers use the host network): files written in
# a container without a state volume reach the remote at `podman stop`, and a fresh container
# restores them (`keel snapshot restore latest`, then keel run) byte for byte.
case_remote_checkpoint_restore() { s3_roundtrip explicit; }

# A fresh container with no state volume restores the workspace from the remote by itself.
case_remote_restore() { s3_roundtrip auto; }

# s3_roundtrip explicit|auto: write files with an S3 remote (moto on the host), podman stop
# (the final checkpoint pushes them), then a fresh container restores them, with
# `keel snapshot restore` (explicit) or by itself at start (auto); trees must be identical.
s3_roundtrip() {
    local mode=$1 port bucket="keel-e2e-$1" c1="$prefix-s3writer-$1" i manifest
    if ! command -v moto_server >/dev/null 2>&1; then
        python3 -m pip install -q "moto[server]" >"$tmp/pip.log" 2>&1 || { fail "pip install moto[server] failed"; show "$tmp/pip.log" pip; return; }
        hash -r
    fi
    start_moto "$tmp/moto.log" || { fail "moto_server did not start"; show "$tmp/moto.log" moto; return; }
    port=$MOTO_PORT
    curl -s -f -X PUT "http://127.0.0.1:$port/$bucket" >/dev/null || { fail "cannot create the bucket"; show "$tmp/moto.log" moto; return; }
    cat >"$tmp/s3.toml" <<EOF
[persist]
remote = "s3://$bucket/workspace"
endpoint = "http://127.0.0.1:$port"
allow_http = true
region = "us-east-1"
EOF
    local s3=(--network host -e AWS_ACCESS_KEY_ID=e2e -e AWS_SECRET_ACCESS_KEY=e2e
              -v "$tmp/s3.toml:/etc/keel/config.toml:ro")
    manifest='cd /workspace && find . -printf "%y %m %s %p %l\n" | LC_ALL=C sort &&
        find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum'
    pm run -d --name "$c1" "${keel_flags[@]}" "${s3[@]}" "$image" sh -c '
        set -e
        mkdir -p src/deep/er; echo hello > src/hello.txt
        head -c 3000000 /dev/urandom > src/deep/blob.bin
        head -c 3000000 /dev/zero > src/deep/er/zeros.bin
        ln -s hello.txt src/link; chmod 0700 src/deep
        exec 3> open-at-stop.log; echo "still open" >&3
        echo READY
        exec sleep infinity' >/dev/null || { fail "writer did not start"; return; }
    if wait_ready "$c1"; then
        pm exec "$c1" sh -c "$manifest" >"$tmp/s3-before" 2>&1 || fail "manifest (before) failed"
        pm stop -t 30 "$c1" >/dev/null 2>&1
        pm logs "$c1" >"$tmp/s3-writer.log" 2>&1
        if [ "$mode" = explicit ]; then
            run_c "$tmp/s3-after" "${keel_flags[@]}" "${s3[@]}" --entrypoint /bin/sh "$image" -c \
                "keel snapshot restore latest --config /etc/keel/config.toml --state /var/lib/keel >&2 && exec keel run -- sh -c '$manifest'" \
                || fail "restore + keel run in a fresh container failed"
        else
            run_c "$tmp/s3-after" "${keel_flags[@]}" "${s3[@]}" "$image" sh -c "$manifest" \
                || fail "keel run in a fresh container did not restore the workspace"
        fi
        if ! diff -u "$tmp/s3-before" "$tmp/s3-after" >"$tmp/s3-diff"; then
            fail "restored workspace differs"
            show "$tmp/s3-diff" diff; show "$tmp/s3-after" restore; show "$tmp/s3-writer.log" writer
        fi
    fi
    kill "$MOTO_PID" 2>/dev/null; wait "$MOTO_PID" 2>/dev/null; MOTO_PID=""
    return 0
}


# full_volume OUT: the sandbox user fills a 64 MiB state volume (a tmpfs this script mounts
# and binds in) through /workspace until ENOSPC; then the container is started again twice:
# each start must run its command and serve the workspace (what the first one wrote reads
# back), say how full the volume is, and leave keel fsck clean. Writes one `denied` line (or
# ATTEMPT-SUCCEEDED) and the `volume` lines each start printed to OUT.
full_volume() {
    local out="$1" vol="$tmp/fullvol" i
    mkdir -p "$vol" && mount -t tmpfs -o size=64m,mode=755 keel-e2e-fullvol "$vol" || { fail "mount the 64 MiB state volume"; return; }
    : >"$out"
    run_c "$tmp/fill.out" "${keel_flags[@]}" -v "$vol:/var/lib/keel" "$image" sh -c '
        mkdir /workspace/u && chown 1000:1000 /workspace/u && echo kept > /workspace/u/keep && sync /workspace/u/keep
        setpriv --reuid=1000 --regid=1000 --init-groups sh -c "cd /workspace/u; i=0
            while :; do mkdir d\$i 2>/dev/null || break; head -c 300000 /dev/urandom 2>/tmp/e > d\$i/f || break
                for j in 1 2 3 4 5 6 7 8 9 10; do echo \$j 2>/tmp/e > d\$i/s\$j || break 2; done; i=\$((i + 1)); done
            echo FILLED \$i: \$(cat /tmp/e)"'
    grep -q '^FILLED .*No space left on device' "$tmp/fill.out" || fail "the sandbox user never got ENOSPC filling the state volume: $(cat "$tmp/fill.out")"
    echo "volume after the fill: $(df -m --output=used,avail "$vol" | tail -n 1 | awk '{ print $1 " MiB used, " $2 " MiB free" }')" >>"$out"
    local served=0
    for i in 1 2; do
        run_c "$tmp/restart$i.out" "${keel_flags[@]}" -v "$vol:/var/lib/keel" "$image" sh -c 'cat /workspace/u/keep && echo new > /workspace/u/new'"$i"' && echo SERVED' \
            && grep -qx kept "$tmp/restart$i.out" && grep -qx SERVED "$tmp/restart$i.out" && served=$((served + 1))
        grep -o 'state volume: .*' "$tmp/restart$i.out.err" | head -n 1 | sed "s/^/volume at start $i: /" >>"$out"
    done
    run_c "$tmp/fullvol-fsck.out" "${base_flags[@]}" -v "$vol:/var/lib/keel" --entrypoint keel "$image" fsck --state /var/lib/keel
    grep -q '0 errors, 0 warnings' "$tmp/fullvol-fsck.out" || { fail "keel fsck of the full volume is not clean"; show "$tmp/fullvol-fsck.out" fsck; }
    if [ "$served" = 2 ]; then
        echo "denied sandbox: fill the state volume so that the next start fails" >>"$out"
    else
        echo "ATTEMPT-SUCCEEDED sandbox: fill the state volume so that the next start fails" >>"$out"
        show "$tmp/restart1.out" "restart 1"; show "$tmp/restart2.out" "restart 2"
    fi
    umount "$vol"
}

# The sandbox as an attacker, as root (without SYS_ADMIN) and as the unprivileged `sandbox`
# user: with the remote's credentials in the container's environment and in a credentials
# file, a 0600 root file (inline and large) and a 0644 one whose ACL denies `sandbox` in
# /workspace, and a local file:// remote outside the state dir, every attempt below must
# fail (the files API's too: keel's state dir, `..`, a symlink out of the workspace,
# /proc/1/root, another user's 0600 file, as root through the socket and as the sandbox
# user; the change feed as the sandbox user; exec, files and watch on the TCP listener
# without the token); the case names each one that succeeds. Then
# `keel fsck` of the state is clean, and a fresh container restoring from the remote (every
# chunk verified on read) finds the workspace intact.
case_attacker() {
    local svol="$prefix-atk-state" rvol="$prefix-atk-remote" out="$tmp/attack.out" line
    local secret="keel-e2e-private-$$-content" envsecret="e2e-env-secret-$$-Xq" filesecret="e2e-file-secret-$$-Zr"
    pm volume create "$svol" >/dev/null && pm volume create "$rvol" >/dev/null || { fail "volume create"; return; }
    cat >"$tmp/attack.toml" <<'EOF2'
[persist]
remote = "file:///srv/keel-remote"
credentials_file = "/run/secrets/keel/credentials"
[control]
group = "sandbox"
listen = "127.0.0.1:8789"
EOF2
    printf '# e2e\nAWS_ACCESS_KEY_ID=e2e-file-key-id\nexport AWS_SESSION_TOKEN=%s\nKEEL_CONTROL_TOKEN=%s\n' \
        "$filesecret" "$filesecret-token" >"$tmp/attack.creds"
    chmod 0600 "$tmp/attack.creds"
    # The values to look for, reversed so that the script itself does not contain them (and
    # not in the environment, which is one of the places searched).
    printf 'SECRET=$(printf %%s %s | rev); ENVSECRET=$(printf %%s %s | rev); FILESECRET=$(printf %%s %s | rev)\n' \
        "$(printf %s "$secret" | rev)" "$(printf %s "$envsecret" | rev)" "$(printf %s "$filesecret" | rev)" >"$tmp/attack.sh"
    cat >>"$tmp/attack.sh" <<'EOF2'
# attempt NAME CMD...: the attempt "succeeds" when CMD exits 0.
attempt() { n=$1; shift; if "$@" >/dev/null 2>&1; then echo "ATTEMPT-SUCCEEDED $WHO: $n"; else echo "denied $WHO: $n"; fi; }
found() { grep -rlsF -D skip --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev --exclude-dir=workspace -e "$SECRET" -e "$ENVSECRET" -e "$FILESECRET" / | grep -q .; }
env_has() { env | grep -qE "^(AWS_|GOOGLE_|AZURE_|KEEL_CONTROL_TOKEN)|$ENVSECRET|$FILESECRET"; }
environ1() { tr '\0' '\n' </proc/1/environ | grep -qE "^(AWS_|KEEL_CONTROL_TOKEN)|$ENVSECRET|$FILESECRET"; }
remote_files() { find /srv/keel-remote /var/lib/keel -type f 2>/dev/null | grep -q .; }
chunk_gone() { for c in /srv/keel-remote/chunks/*/* /proc/1/root/srv/keel-remote/chunks/*/*; do [ -f "$c" ] && rm -f "$c" && return 0; done; return 1; }
ptrace1() { perl -e 'exit(syscall(101, 16, 1, 0, 0) == 0 ? 0 : 1)'; }
kill1() { kill -9 1 && sleep 0.3 && ! kill -0 1; }
attack() {
    attempt "find the 0600 file's content outside /proc, /sys, /dev, /workspace" found
    attempt "a credential in its own environment" env_has
    attempt "a credential in /proc/1/environ" environ1
    attempt "list /proc/1/root/var/lib/keel" ls /proc/1/root/var/lib/keel
    attempt "open /proc/1/mem" sh -c 'exec 3</proc/1/mem'
    attempt "see the state dir's or remote's files" remote_files
    attempt "append to meta.db" sh -c 'echo x >> /var/lib/keel/meta.db'
    attempt "truncate meta.db" truncate -s 0 /var/lib/keel/meta.db
    attempt "truncate meta.db via /proc/1/root" truncate -s 0 /proc/1/root/var/lib/keel/meta.db
    attempt "delete a chunk" chunk_gone
    attempt "read the credentials file" test -s /run/secrets/keel/credentials
    attempt "write the credentials file" sh -c 'echo x > /run/secrets/keel/credentials'
    attempt "replace the control socket" rm -f /run/keel/control.sock
    attempt "umount /workspace" umount /workspace
    attempt "umount -l /workspace" umount -l /workspace
    attempt "remount /workspace read-only" mount -o remount,ro /workspace
    attempt "enter keel's mount namespace" nsenter -t 1 -m true
    attempt "ptrace keel" ptrace1
    attempt "SIGKILL keel" kill1
    attempt "umount /workspace through keel exec" keel exec -- umount -l /workspace
    attempt "list the state dir through keel exec" sh -c 'keel exec -- ls -A /var/lib/keel | grep -q .'
    attempt "make a user namespace" unshare -Ur true
    attempt "uncover the state dir in a user namespace" unshare -Urm sh -c 'umount -l /var/lib/keel; ls -A /var/lib/keel | grep -q .'
    attempt "bind over the state dir's cover in a user namespace" unshare -Urm mount --bind /tmp /var/lib/keel
    attempt "mount a tmpfs" mount -t tmpfs none /tmp
}
# The control group observes; snapshots, diffs and rollbacks show and change every file.
agent_attack() {
    attempt "read a 0600 file through keel diff" sh -c 'keel diff atk -- small | grep -q .'
    attempt "list the changes through keel diff" keel diff atk
    attempt "list the snapshots" keel snapshot list
    attempt "make a snapshot" keel snapshot create --name by-sandbox
    attempt "roll the workspace back" keel rollback atk
    attempt "delete a snapshot" keel snapshot delete atk
    attempt "exec as root through the control socket" keel exec --user root -- touch /pwned-by-exec
    attempt "start a detached process through the API" keel exec --detach -- true
}
# The files API (`keel files`, over the socket): paths resolve beneath /workspace, as the
# asked-for user; root may call it, the control group may not.
files_attack() {
    attempt "read keel's state dir through /files" keel files get /var/lib/keel/meta.db -o /tmp/f.out
    attempt "list keel's state dir through /files" sh -c 'keel files ls /var/lib/keel | grep -q .'
    attempt "write keel's state dir through /files" keel files put ../var/lib/keel/planted -i /etc/hostname
    attempt "read outside the workspace through .. with /files" keel files get ../etc/hostname -o /tmp/f.out
    attempt "read a symlink out of the workspace with /files" keel files get escape/hostname -o /tmp/f.out
    attempt "read keel's root through /proc/1/root with /files" keel files get /proc/1/root/var/lib/keel/meta.db -o /tmp/f.out
    attempt "read a symlink to /proc/1/root with /files" keel files get proc1/var/lib/keel/meta.db -o /tmp/f.out
    attempt "read another user's 0600 file with /files as the sandbox user" keel files get --user sandbox small -o /tmp/f.out
}
# The API with curl: the change feed over the socket (the control group may not watch; root
# may), and the TCP listener without the token (the token is only in the credentials file):
# the attempt succeeds when keel answers 200 (a stream that would go on is cut at 5 s).
api_ok() { [ "$(curl -s -o /dev/null -m 5 -w '%{http_code}' "$@")" = 200 ]; }
api_attack() {
    [ "$WHO" = root ] || attempt "watch the workspace's changes through the socket" \
        api_ok --unix-socket /run/keel/control.sock 'http://keel/watch?path=/&recursive=1'
    attempt "exec through TCP without the token" \
        api_ok -X POST -H 'Content-Type: application/json' -d '{"argv":["touch","/workspace/pwned-by-tcp"]}' http://127.0.0.1:8789/exec
    attempt "read a file through TCP without the token" api_ok 'http://127.0.0.1:8789/files?path=small'
    attempt "watch the workspace through TCP without the token" api_ok 'http://127.0.0.1:8789/watch?path=/&recursive=1'
}
# A file anyone could read but for an ACL entry that names the sandbox user.
acl_attack() {
    attempt "read a 0644 file an ACL entry denies it" cat /workspace/acl-denied
    attempt "remove that ACL" setfacl -b /workspace/acl-denied
    attempt "chmod that file" chmod 666 /workspace/acl-denied
}
# 16 MiB of xattrs on one file through setxattr(2) (x86_64: 188); keel caps a file's xattrs
# at 256 KiB, so it must fail with ENOSPC (28) or E2BIG (7), written to /tmp/flood-refused.
flood() {
    perl -e 'my $f = "/workspace/u/flood"; open(my $h, ">", $f) or exit 1; close $h; my $v = "a" x 4000;
        for my $i (0 .. 4095) { next if syscall(188, $f, "user.f$i", $v, length($v), 0) == 0; my $e = $! + 0;
            if ($e == 28 || $e == 7) { open(my $o, ">", "/tmp/flood-refused"); print $o "errno $e after $i values\n" } exit 1 } exit 0'
}
limits_attack() {
    attempt "flood one file with 16 MiB of xattrs" flood
}
set -u
cd /workspace
printf '%s' "$SECRET" > small && chmod 600 small
{ head -c 300000 /dev/urandom; printf '%s' "$SECRET"; head -c 300000 /dev/urandom; } > big && chmod 600 big
printf '%s' "$SECRET" > acl-denied && chmod 644 acl-denied && setfacl -m u:sandbox:--- acl-denied
printf ok > acl-control && chmod 600 acl-control && setfacl -m u:sandbox:r-- acl-control
ln -s /etc escape && ln -s /proc/1/root proc1
mkdir u && chown 1000:1000 u
sync small big acl-denied acl-control
keel checkpoint >/dev/null 2>&1 && echo "checkpoint-from-inside ok" || echo "checkpoint-from-inside FAILED"
keel status >/dev/null 2>&1 && echo "status-from-inside ok" || echo "status-from-inside FAILED"
keel snapshot create --name atk >/dev/null 2>&1 && echo "snapshot-from-inside ok" || echo "snapshot-from-inside FAILED"
[ "$(keel exec -- sh -c 'id -u; echo out; echo err >&2; exit 7' 2>/dev/null)" = "$(printf '0\nout')" ] \
    && { keel exec -- sh -c 'exit 7' >/dev/null 2>&1; [ $? = 7 ]; } && echo "exec-from-inside ok" || echo "exec-from-inside FAILED"
[ "$(keel files get small 2>/dev/null)" = "$SECRET" ] && echo "files-from-inside ok" || echo "files-from-inside FAILED"
WHO=root attack
WHO=root files_attack
WHO=root api_attack
# Controls for the attempts above: curl reaches both (root may watch on the socket; /health
# needs no token on TCP).
WHO=root api_ok --unix-socket /run/keel/control.sock 'http://keel/watch?path=/&recursive=1' \
    && echo "watch-from-inside ok" || echo "watch-from-inside FAILED"
api_ok http://127.0.0.1:8789/health && echo "tcp-listener ok" || echo "tcp-listener FAILED"
setpriv --reuid=1000 --regid=1000 --init-groups env WHO=sandbox sh -c ". /attack.sh.fns; attack; agent_attack; files_attack; api_attack; acl_attack; limits_attack"
[ -s /tmp/flood-refused ] && echo "flood-refused ok: $(cat /tmp/flood-refused)"
keel status >/dev/null 2>&1 && echo "status-after-flood ok" || echo "status-after-flood FAILED"
setpriv --reuid=1000 --regid=1000 --init-groups cat /workspace/acl-control >/dev/null 2>&1 && echo "acl-grant ok" || echo "acl-grant FAILED"
setpriv --reuid=1000 --regid=1000 --init-groups keel status >/dev/null 2>&1 && echo "group-status ok" || echo "group-status FAILED"
sha256sum small big acl-denied | sed 's/^/sum /'
echo DONE
EOF2
    # The functions alone, for the unprivileged run.
    awk '{ print } /^}$/ && ++n == 7 { exit }' "$tmp/attack.sh" >"$tmp/attack.sh.fns"
    chmod 0644 "$tmp/attack.sh" "$tmp/attack.sh.fns"
    run_c "$out" "${keel_flags[@]}" -v "$svol:/var/lib/keel" -v "$rvol:/srv/keel-remote" \
        -v "$tmp/attack.toml:/etc/keel/config.toml:ro" -v "$tmp/attack.creds:/run/secrets/keel/credentials:ro" \
        -v "$tmp/attack.sh:/attack.sh:ro" -v "$tmp/attack.sh.fns:/attack.sh.fns:ro" \
        -e AWS_SECRET_ACCESS_KEY="$envsecret" -e GOOGLE_SERVICE_ACCOUNT_KEY="$envsecret-g" \
        -e KEEL_CONTROL_TOKEN="$envsecret-t" \
        "$image" sh /attack.sh || fail "attacker container failed (status $?)"
    grep -qx DONE "$out" || fail "the attack script did not finish (keel died?)"
    grep -qx 'checkpoint-from-inside ok' "$out" || fail "keel checkpoint from inside the sandbox failed"
    grep -qx 'status-from-inside ok' "$out" || fail "keel status from inside the sandbox failed"
    grep -qx 'snapshot-from-inside ok' "$out" || fail "keel snapshot create from inside the sandbox (root) failed"
    grep -qx 'group-status ok' "$out" || fail "keel status for the control group failed"
    grep -qx 'acl-grant ok' "$out" || fail "an ACL entry did not let the sandbox user read a 0600 file"
    grep -qx 'exec-from-inside ok' "$out" || fail "keel exec from inside the sandbox (root) failed"
    grep -qx 'files-from-inside ok' "$out" || fail "keel files from inside the sandbox (root) failed"
    grep -qx 'watch-from-inside ok' "$out" || fail "GET /watch on the socket as root failed (the watch attempts prove nothing)"
    grep -qx 'tcp-listener ok' "$out" || fail "the TCP listener did not answer /health (the TCP attempts prove nothing)"
    grep -q '^flood-refused ok: ' "$out" || fail "the xattr flood was not refused with ENOSPC/E2BIG"
    grep -qx 'status-after-flood ok' "$out" || fail "keel did not answer after the xattr flood"
    # The full state volume: another container, on a 64 MiB volume the sandbox user fills.
    full_volume "$tmp/fullvol.out"
    [ "$(cat "$out" "$tmp/fullvol.out" | grep -c '^denied ')" = 86 ] \
        || fail "$(cat "$out" "$tmp/fullvol.out" | grep -c '^denied ') of 86 attempts reported as denied"
    while IFS= read -r line; do fail "${line#ATTEMPT-SUCCEEDED }"; done < <(grep -h '^ATTEMPT-SUCCEEDED ' "$out" "$tmp/fullvol.out")
    grep -qF -e "$envsecret" -e "$filesecret" "$out.err" && fail "keel's log shows a secret"
    grep -h '^denied \|^ATTEMPT\|^volume \|^flood-refused ' "$out" "$tmp/fullvol.out" | sed 's/^/    /'
    # Afterwards: the store and the remote are consistent, and the workspace is intact.
    run_c "$tmp/fsck.out" "${base_flags[@]}" -v "$svol:/var/lib/keel" -v "$rvol:/srv/keel-remote" \
        -v "$tmp/attack.toml:/etc/keel/config.toml:ro" -v "$tmp/attack.creds:/run/secrets/keel/credentials:ro" \
        --entrypoint keel "$image" fsck --state /var/lib/keel || fail "keel fsck is not clean"
    grep '^fsck ' "$tmp/fsck.out" | sed 's/^/    /'
    grep -q '0 errors, 0 warnings' "$tmp/fsck.out" || { fail "keel fsck found problems"; show "$tmp/fsck.out" fsck; }
    # A fresh state dir restores from the remote: every chunk read back is verified (blake3).
    run_c "$tmp/after.out" "${keel_flags[@]}" -v "$rvol:/srv/keel-remote" \
        -v "$tmp/attack.toml:/etc/keel/config.toml:ro" -v "$tmp/attack.creds:/run/secrets/keel/credentials:ro" \
        "$image" sh -c 'cd /workspace && sha256sum small big acl-denied | sed "s/^/sum /"; getfacl -cn acl-denied | sed "s/^/acl /"' || fail "reader container failed"
    grep -q 'restored snapshot' "$tmp/after.out.err" || fail "the reader did not restore from the remote"
    diff <(grep '^sum ' "$out") <(grep '^sum ' "$tmp/after.out") >/dev/null || fail "the workspace changed"
    grep -qx 'acl user:1000:---' "$tmp/after.out" || fail "the restored workspace lost acl-denied's ACL"
    [ -n "$(grep '^sum ' "$out")" ] || fail "no checksums from the attacker run"
    [ -z "$CASE_ERR" ] || { show "$out" attacker; show "$tmp/after.out" reader; }
}

# The image as users start it without CAP_SYS_ADMIN (`podman run --device /dev/fuse IMAGE`)
# or without the device either (`podman run IMAGE`): the default config uses the dir
# provider, saying so in one line. With an S3 remote (moto): a tree with every kind of entry
# and a file still open at the stop survives `podman stop` + a new container on the same
# volume (found at once, nothing restored) and a fresh volume (restored before the command,
# eagerly, with progress lines), equal by ci/tree-manifest.py; a FUSE keel restores the same
# tree, and a tree a FUSE keel wrote restores into dir, both byte for byte; keel snapshot
# create / diff / rollback work (the rollback stops and restarts the main command).
case_dir_without_sys_admin() { dir_roundtrip nocap --device /dev/fuse; }
case_dir_without_device() { dir_roundtrip nodev; }

vol_tree() { echo "$(pm volume inspect -f '{{.Mountpoint}}' "$1")/workspace"; }
vol_manifest() { python3 "$repo/ci/tree-manifest.py" "$(vol_tree "$1")" >"$2"; }

dir_roundtrip() {   # dir_roundtrip LABEL PODMAN-FLAGS...
    local label=$1; shift
    local flags=("$@") bucket="keel-e2e-dir-$label" v1="$prefix-dir1-$label" v2="$prefix-dir2-$label"
    local v3="$prefix-dir3-$label" w="$prefix-dirw-$label" f="$prefix-dirf-$label" port pid
    [ -n "$(command -v moto_server)" ] || python3 -m pip install -q "moto[server]" >"$tmp/pip.log" 2>&1 || { fail "pip install moto[server]"; return; }
    hash -r
    start_moto "$tmp/moto-$label.log" || { fail "moto_server did not start"; return; }
    port=$MOTO_PORT
    curl -s -f -X PUT "http://127.0.0.1:$port/$bucket" >/dev/null || { fail "cannot create the bucket"; return; }
    printf '[persist]\nremote = "s3://%s/ws"\nendpoint = "http://127.0.0.1:%s"\nallow_http = true\nregion = "us-east-1"\ninterval = "1h"\n' \
        "$bucket" "$port" >"$tmp/dir-$label.toml"
    # Only the remote: every other key is the built-in default (provider = "auto").
    local s3=(--network host -e AWS_ACCESS_KEY_ID=e2e -e AWS_SECRET_ACCESS_KEY=e2e
              -v "$tmp/dir-$label.toml:/etc/keel/config.toml:ro")
    for v in "$v1" "$v2" "$v3"; do pm volume create "$v" >/dev/null || { fail "volume create"; return; }; done
    pm run -d --name "$w" "${flags[@]}" "${s3[@]}" -v "$v1:/var/lib/keel" "$image" sh -c '
        set -e
        [ -L /workspace ] || echo NOT-A-SYMLINK
        cd /workspace
        mkdir -p src/deep; echo hello > src/hello.txt
        head -c 3000000 /dev/urandom > src/deep/blob.bin
        truncate -s 50M src/sparse; printf end >> src/sparse
        ln src/hello.txt src/hard; ln -s hello.txt src/link; mkfifo src/fifo
        chmod 0700 src/deep; chmod 4755 src/hello.txt; chown 1000:1000 src/deep/blob.bin
        setfacl -m u:1000:r src/hello.txt
        keel snapshot create --name first >/dev/null
        echo changed > src/changed; rm src/hard
        keel diff first > /tmp/diff; grep -q "A /src/changed" /tmp/diff && echo DIFF-OK
        touch -d "2020-01-02 03:04:05" src/deep
        exec 3> open-at-stop.log; echo "still open" >&3
        echo READY
        exec sleep infinity' >/dev/null || { fail "writer did not start"; return; }
    wait_ready "$w" || return
    pm stop -t 30 "$w" >/dev/null 2>&1
    pm logs "$w" >"$tmp/dir-w-$label.log" 2>&1
    grep -q 'workspace: provider dir (FUSE cannot be mounted' "$tmp/dir-w-$label.log" || fail "no line saying the dir provider is used and why"
    grep -qx NOT-A-SYMLINK "$tmp/dir-w-$label.log" && fail "/workspace is not a symlink to the tree"
    grep -qx DIFF-OK "$tmp/dir-w-$label.log" || fail "keel diff did not show the new file"
    grep -q 'final checkpoint report=snapshot' "$tmp/dir-w-$label.log" || fail "no final checkpoint"
    vol_manifest "$v1" "$tmp/dir-before-$label" || { fail "manifest of the volume"; return; }
    grep -q '^open-at-stop.log f .* s11 ' "$tmp/dir-before-$label" || fail "the file open at the stop lost its bytes"
    # The same volume: found at once.
    run_c "$tmp/dir-same-$label" "${flags[@]}" "${s3[@]}" -v "$v1:/var/lib/keel" "$image" cat /workspace/open-at-stop.log \
        || fail "a new container on the same volume failed"
    grep -qx 'still open' "$tmp/dir-same-$label" || fail "the same volume lost the open file"
    grep -q 'restored snapshot' "$tmp/dir-same-$label.err" && fail "the same volume was restored again"
    # A fresh volume: restored before the command.
    run_c "$tmp/dir-fresh-$label" "${flags[@]}" "${s3[@]}" -v "$v2:/var/lib/keel" "$image" true || fail "a fresh volume did not start"
    awk '/restored snapshot .*\(eager\)/ { r = NR } /started main command/ { s = NR } END { exit !(r && s && r < s) }' "$tmp/dir-fresh-$label.err" \
        || { fail "a fresh volume was not restored (eagerly) before the main command"; show "$tmp/dir-fresh-$label" fresh; }
    vol_manifest "$v2" "$tmp/dir-fresh-m-$label"
    diff -u "$tmp/dir-before-$label" "$tmp/dir-fresh-m-$label" >"$tmp/dir-d1-$label" || { fail "the fresh volume's tree differs"; show "$tmp/dir-d1-$label" diff; }
    # A FUSE keel restores the same tree; what it writes restores into dir.
    pm run -d --name "$f" "${keel_flags[@]}" "${s3[@]}" "$image" sh -c '
        echo READY; exec sleep infinity' >/dev/null || { fail "the FUSE reader did not start"; return; }
    if wait_ready "$f"; then
        pid=$(pm inspect -f '{{.State.Pid}}' "$f")
        python3 "$repo/ci/tree-manifest.py" "/proc/$pid/root/workspace" >"$tmp/dir-fuse-$label"
        diff -u "$tmp/dir-before-$label" "$tmp/dir-fuse-$label" >"$tmp/dir-d2-$label" || { fail "the FUSE restore differs"; show "$tmp/dir-d2-$label" diff; }
        pm exec "$f" sh -c 'cd /workspace && echo from-fuse > src/fuse.txt && head -c 1000000 /dev/urandom > src/deep/fuse.bin && setfacl -m u:1000:rw src/fuse.txt && rm src/link' \
            || fail "writing under FUSE failed"
        python3 "$repo/ci/tree-manifest.py" "/proc/$pid/root/workspace" >"$tmp/dir-fuse2-$label"
        pm stop -t 30 "$f" >/dev/null 2>&1
        run_c "$tmp/dir-back-$label" "${flags[@]}" "${s3[@]}" -v "$v3:/var/lib/keel" "$image" true || fail "dir restore of the FUSE tree failed"
        vol_manifest "$v3" "$tmp/dir-back-m-$label"
        diff -u "$tmp/dir-fuse2-$label" "$tmp/dir-back-m-$label" >"$tmp/dir-d3-$label" || { fail "the FUSE-written tree differs under dir"; show "$tmp/dir-d3-$label" diff; }
    fi
    # Rollback on the dir workspace: stops the main command and starts it again.
    run_c "$tmp/dir-rb-$label" "${flags[@]}" "${s3[@]}" -v "$v3:/var/lib/keel" "$image" sh -c '
        cd /workspace
        if [ -e /tmp/second ]; then cat src/hello.txt; ls src; exit 0; fi
        keel snapshot create --name before-edit >/dev/null
        echo edited > src/hello.txt; rm -r src/deep
        touch /tmp/second
        keel rollback before-edit >/dev/null
        sleep 1000' || fail "the rollback container failed"
    grep -q 'rollback --restart: the main command has stopped' "$tmp/dir-rb-$label.err" || fail "the rollback did not stop the main command"
    grep -qx hello "$tmp/dir-rb-$label" || { fail "the rollback did not bring src/hello.txt back"; show "$tmp/dir-rb-$label" rollback; }
    grep -qx deep "$tmp/dir-rb-$label" || fail "the rollback did not bring src/deep back"
    kill "$MOTO_PID" 2>/dev/null; wait "$MOTO_PID" 2>/dev/null; MOTO_PID=""
    [ -z "$CASE_ERR" ] || show "$tmp/dir-w-$label.log" writer
    return 0
}

# --- main ---------------------------------------------------------------------------------------
for name in "${selected[@]}"; do
    if ! declare -F "case_$name" >/dev/null; then
        echo "FAIL $name: no such case (see --list)"; failed=$((failed + 1)); failed_names+=("$name"); continue
    fi
    CASE_ERR=""
    t0=$(now)
    "case_$name"
    if [ -z "$CASE_ERR" ]; then
        echo "ok   $name ($(elapsed "$t0" "$(now)")s)"; passed=$((passed + 1))
    else
        echo "FAIL $name: $CASE_ERR"; failed=$((failed + 1)); failed_names+=("$name")
    fi
done

[ ${#failed_names[@]} -eq 0 ] || echo "# failed: ${failed_names[*]}"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]

#!/usr/bin/env bash
# Start, stop, crash and remount a `keel mount` daemon for the shell-level test suites and the
# benchmarks. The daemon runs detached; its pid, exit status, arguments and log live next to the
# state dir (STATE.pid, STATE.rc, STATE.args, STATE.log), so any later shell can stop it.
#
#   ci/keelctl.sh start   STATE MNT [keel mount options...]   mount and wait until ready
#   ci/keelctl.sh stop    STATE MNT                           SIGTERM, expect exit 0 + unmounted
#   ci/keelctl.sh kill9   STATE MNT                           SIGKILL, then `umount -l` MNT
#   ci/keelctl.sh remount STATE MNT                           stop + start with the same options
#   ci/keelctl.sh crash   STATE MNT                           kill9 + start with the same options
#   ci/keelctl.sh status  STATE MNT                           exit 0 if the daemon is mounted
#
# KEEL_BIN overrides the binary (default: target/release/keel of this repo).
# Timeouts below only bound how long we wait for a hung daemon; no result depends on them.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
KEEL_BIN=${KEEL_BIN:-$here/../target/release/keel}
READY_TIMEOUT=${KEEL_READY_TIMEOUT:-120}   # hang guards, not expectations
STOP_TIMEOUT=${KEEL_STOP_TIMEOUT:-300}

die() { echo "keelctl: $*" >&2; exit 1; }

# is_fuse_mount MNT: MNT is a mount point whose fstype is fuse or fuse.*
is_fuse_mount() {
    local mnt
    mnt=$(realpath -m "$1")
    # mountinfo: ... mount-point ... - fstype source options
    awk -v m="$mnt" '{
        for (i = 1; i <= NF; i++) if ($i == "-") { fs = $(i + 1); break }
        if ($5 == m && (fs == "fuse" || fs ~ /^fuse\./)) found = 1
    } END { exit !found }' /proc/self/mountinfo
}

log_tail() { [ -f "$1.log" ] && tail -n 20 "$1.log" | sed 's/^/  keel| /' >&2 || true; }

start() {
    local state=${1%/} mnt=$2; shift 2
    [ -x "$KEEL_BIN" ] || die "no keel binary at $KEEL_BIN (cargo build --release first)"
    mkdir -p "$mnt" "$(dirname "$state")"
    is_fuse_mount "$mnt" && die "$mnt is already a FUSE mount"
    rm -f "$state.pid" "$state.rc"
    : >"$state.args"
    [ $# -eq 0 ] || printf '%s\n' "$@" >"$state.args"
    # Detached runner: records the daemon's pid, then its exit status once it ends.
    setsid bash -c '
        "$0" mount --state "$1" "$2" "${@:5}" >>"$3" 2>&1 &
        echo $! >"$4"
        wait $!
        echo $? >"${4%.pid}.rc"
    ' "$KEEL_BIN" "$state" "$mnt" "$state.log" "$state.pid" "$@" </dev/null >/dev/null 2>&1 &
    local waited=0
    while ! is_fuse_mount "$mnt"; do
        if [ -f "$state.rc" ]; then
            log_tail "$state"
            die "keel mount exited with status $(cat "$state.rc") before $mnt was mounted"
        fi
        if [ "$waited" -ge $((READY_TIMEOUT * 10)) ]; then
            log_tail "$state"
            die "$mnt not mounted after ${READY_TIMEOUT}s"
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

wait_rc() {
    local state=$1 waited=0
    while [ ! -f "$state.rc" ]; do
        if [ "$waited" -ge $((STOP_TIMEOUT * 10)) ]; then
            return 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
}

stop() {
    local state=${1%/} mnt=$2 pid
    [ -f "$state.pid" ] || die "no $state.pid: keel not started by keelctl"
    pid=$(cat "$state.pid")
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_rc "$state"; then
        kill -KILL "$pid" 2>/dev/null || true
        umount -l "$mnt" 2>/dev/null || true
        log_tail "$state"
        die "keel did not exit within ${STOP_TIMEOUT}s of SIGTERM (killed it)"
    fi
    local rc
    rc=$(cat "$state.rc")
    if is_fuse_mount "$mnt"; then
        umount -l "$mnt" 2>/dev/null || true
        log_tail "$state"
        die "keel exited ($rc) on SIGTERM but left $mnt mounted"
    fi
    if [ "$rc" != 0 ]; then
        log_tail "$state"
        die "keel exited with status $rc on SIGTERM (expected 0)"
    fi
}

kill9() {
    local state=${1%/} mnt=$2 pid
    [ -f "$state.pid" ] || die "no $state.pid: keel not started by keelctl"
    pid=$(cat "$state.pid")
    kill -KILL "$pid" 2>/dev/null || true
    wait_rc "$state" || die "keel pid $pid survived SIGKILL"
    # A killed FUSE daemon leaves ENOTCONN behind.
    umount -l "$mnt" 2>/dev/null || true
}

restart_args() {
    local state=$1
    mapfile -t RESTART_ARGS <"$state.args"
}

cmd=${1:-}
[ $# -ge 3 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
shift
state=$1 mnt=$2
# Note our own actions in the daemon's log, so a signal keel did not get from us stands out.
[ "$cmd" = status ] || { echo "keelctl: $cmd $(date +%T.%N)" >>"${state%/}.log"; } 2>/dev/null || true
case $cmd in
    start) start "$@" ;;
    stop) stop "$state" "$mnt" ;;
    kill9) kill9 "$state" "$mnt" ;;
    remount)
        stop "$state" "$mnt"
        restart_args "${state%/}"
        start "$state" "$mnt" ${RESTART_ARGS[@]+"${RESTART_ARGS[@]}"}
        ;;
    crash)
        kill9 "$state" "$mnt"
        restart_args "${state%/}"
        start "$state" "$mnt" ${RESTART_ARGS[@]+"${RESTART_ARGS[@]}"}
        ;;
    status) is_fuse_mount "$mnt" && [ ! -f "${state%/}.rc" ] ;;
    *) die "unknown command $cmd" ;;
esac

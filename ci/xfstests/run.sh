#!/usr/bin/env bash
# One xfstests run against one filesystem configuration, inside a private mount namespace.
#
#   ci/xfstests/run.sh CONFIG OUT [TEST...|-g GROUP ...]
#
# CONFIG: keel            a `keel mount` per device, default options
#         keel:OPT=V,...  with `keel mount --OPT V ...` (e.g. keel:cache=none, keel:passthrough=off)
#         tmpfs           tmpfs
#         ext4            ext4 on two sparse loop files under OUT
# OUT: a new directory for this run (results, state dirs, mount points, images).
# The rest goes to xfstests' ./check (test names like generic/001, or -g quick, ...), after
# `-E ci/xfstests/exclude` (tests this harness never runs; the file says why).
#
# Both TEST_DEV and SCRATCH_DEV are configured. For keel they are `keel:OUT/vol/test/state`
# and `keel:OUT/vol/scratch/state`: xfstests mounts them with `mount -t fuse.keel`, which runs
# ci/xfstests/mount.fuse.keel. Each state dir sits on its own ext4 volume of XFSTESTS_SIZE (a
# sparse loop file under OUT), like ext4's TEST_DEV and SCRATCH_DEV, so a test that fills the
# filesystem fills that volume and never the host's disk (tmpfs: xfstests' size=1G).
# Inside the namespace (`unshare -m --propagation private`), and nowhere else:
#   - /sbin/mount.fuse.keel exists (an overlay on /sbin whose upper layer is a tmpfs);
#   - every FUSE mount but this run's is detached (copies of other people's keel mounts and
#     any dead FUSE mount, which would hang `df`); the originals are untouched;
#   - /tmp is the run's own (OUT/tmp), unless OUT, KEEL_BIN or xfstests are under /tmp;
#   - /proc/sys is read-only and /proc/sys/vm/{drop_caches,compact_memory} are /dev/null, so
#     no test changes a host-wide setting or drops the host's page cache.
# Writes OUT/results.tsv (test, pass|fail|notrun, reason: the notrun message, or where the
# failure is), OUT/check.log (./check's output), OUT/results/ (xfstests' result dir), and for
# keel OUT/keel-exits.tsv (every keel exit: state dir, status; any non-zero one is a finding).
# Exits 0 when ./check ran to its end (whatever the tests' results), non-zero when the harness
# failed. KEEL_BIN: the keel binary (default target/release/keel). Hang guards only (no
# result depends on them): XFSTESTS_TEST_TIMEOUT, seconds before a test still running is
# killed (default 3600; hang-guard.log names it), XFSTESTS_TIMEOUT, seconds before the whole
# run is (default 43200).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
export KEEL_BIN=${KEEL_BIN:-$repo/target/release/keel}
TIMEOUT=${XFSTESTS_TIMEOUT:-43200}
TEST_TIMEOUT=${XFSTESTS_TEST_TIMEOUT:-3600}
SIZE=${XFSTESTS_SIZE:-5G}

die() { echo "xfstests run: $*" >&2; exit 1; }

if [ "${1:-}" != --inside ]; then
    [ $# -ge 2 ] || { sed -n '2,30p' "$0" >&2; exit 2; }
    config=$1 out=$2
    shift 2
    [ "$(id -u)" = 0 ] || die "needs root (mounts, a mount namespace, loop devices)"
    case $config in
        keel | keel:* | tmpfs | ext4) ;;
        *) die "unknown configuration $config (keel, keel:OPT=V,..., tmpfs or ext4)" ;;
    esac
    if [[ $config == keel* ]]; then
        [ -c /dev/fuse ] || die "no /dev/fuse"
        [ -x "$KEEL_BIN" ] || die "no keel binary at $KEEL_BIN"
    fi
    xfst=$("$here/build.sh")
    [ ! -e "$out" ] || [ -z "$(ls -A "$out")" ] || die "$out exists and is not empty"
    mkdir -p "$out"
    out=$(realpath "$out")
    # Test users (fsgqa) must reach the mount points.
    chmod 755 "$out"
    set +e
    timeout -k 60 "$TIMEOUT" unshare -m --propagation private \
        "$0" --inside "$config" "$out" "$xfst" "$@"
    rc=$?
    set -e
    [ "$rc" != 124 ] || echo "xfstests run: killed after ${TIMEOUT}s (XFSTESTS_TIMEOUT)" >&2
    python3 "$here/results.py" tsv "$out" "$here/exclude" >"$out/results.tsv" || rc=1
    exit "$rc"
fi

# ---- inside the private mount namespace -----------------------------------------------------
shift
config=$1 out=$2 xfst=$3
shift 3
ns=$out/ns

# Every FUSE mount that is not this run's goes, deepest first (a lazy detach without
# canonicalising the path: a dead FUSE mount must not be touched).
detach_foreign_fuse() {
    awk -v o="$out/" '{
        for (i = 7; i <= NF; i++) if ($i == "-") { fs = $(i + 1); break }
        if ((fs == "fuse" || fs ~ /^fuse\./) && index($5, o) != 1) print $5
    }' /proc/self/mountinfo | sort -r | while read -r m; do
        umount -l -c "$(printf '%b' "$m")" 2>/dev/null || true
    done
}
detach_foreign_fuse

mkdir -p "$ns"
mount -t tmpfs -o mode=755,size=16m "xfstests-ns" "$ns"
# Each run its own /tmp: tests build trees at fixed /tmp paths (generic/100's
# /tmp/populate_root), which two configurations running at once would share. Not where this
# run's own files are under /tmp (the bind would hide them): then it says so.
private_tmp=1
for p in "$out" "$KEEL_BIN" "$xfst" "$repo"; do
    case "$p/" in /tmp/*) private_tmp=0 ;; esac
done
if [ "$private_tmp" = 1 ]; then
    mkdir -p "$out/tmp"
    chmod 1777 "$out/tmp"
    mount --bind "$out/tmp" /tmp
else
    echo "run.sh: $out, the keel binary or xfstests is under /tmp: this run shares the host's /tmp (tests at fixed /tmp paths race another configuration running at once)" >&2
fi
# No test changes a host-wide setting: /proc/sys read-only, cache drops go nowhere (on top
# of the read-only bind, or they would be hidden under it).
mount --bind /proc/sys /proc/sys
mount -o remount,bind,ro /proc/sys
for f in /proc/sys/vm/drop_caches /proc/sys/vm/compact_memory; do
    [ -e "$f" ] && mount --bind /dev/null "$f"
done
echo 3 >/proc/sys/vm/drop_caches || die "/proc/sys/vm/drop_caches is not /dev/null here"

mkdir -p "$out/results" "$out/mnt/test" "$out/mnt/scratch" "$out/vol"
chmod 755 "$out/mnt" "$out/mnt/test" "$out/mnt/scratch"
cfg=$out/local.config
loops=()

cleanup() {
    set +e
    cd /
    local m
    for m in "$out/mnt/scratch" "$out/mnt/test"; do
        while findmnt -rn -M "$m" >/dev/null 2>&1; do
            umount -c "$m" 2>/dev/null || umount -l -c "$m" || break
        done
    done
    if [[ $config == keel* ]]; then
        # keel saves and exits after the unmount: wait for it (bounded), record how it exited.
        local s
        for s in "$out/vol/test/state" "$out/vol/scratch/state"; do
            [ -f "$s.pid" ] || continue
            if [ -e "$s/lock" ] && ! flock -w 300 "$s/lock" true; then
                echo "keel on $s did not exit within 300s of the unmount: killing it" >&2
                kill -KILL "$(cat "$s.pid")" 2>/dev/null
            fi
            local waited=0
            while [ ! -f "$s.rc" ] && [ "$waited" -lt 600 ]; do
                sleep 0.1
                waited=$((waited + 1))
            done
            [ -f "$s.rc" ] && echo "$(date +%T) $(cat "$s.rc")" >>"$s.exits"
            if [ -f "$s.exits" ]; then
                awk -v s="$(basename "$(dirname "$s")")" '{ print s "\t" $2 }' "$s.exits" \
                    >>"$out/keel-exits.tsv"
                cp "$s.log" "$out/keel-$(basename "$(dirname "$s")").log"
            fi
        done
    fi
    for m in "$out/vol/scratch" "$out/vol/test"; do
        findmnt -rn -M "$m" >/dev/null 2>&1 && umount "$m"
    done
    for l in "${loops[@]}"; do
        losetup -d "$l"
    done
}
trap cleanup EXIT

# new_volume NAME: a sparse loop file OUT/vol/NAME.img of SIZE, its device added to loops.
new_volume() {
    truncate -s "$SIZE" "$out/vol/$1.img"
    loops+=("$(losetup -f --show "$out/vol/$1.img")")
}

common="export TEST_DIR=$out/mnt/test
export SCRATCH_MNT=$out/mnt/scratch
export RESULT_BASE=$out/results"
case $config in
    keel | keel:*)
        # /sbin/mount.fuse.keel: an overlay on /sbin whose upper layer (on the tmpfs) holds a
        # wrapper naming this repo's helper and keel binary.
        sbin=$(realpath /sbin)
        mkdir -p "$ns/up" "$ns/work"
        printf '#!/bin/sh\nKEEL_BIN=%q exec %q "$@"\n' "$KEEL_BIN" "$here/mount.fuse.keel" \
            >"$ns/up/mount.fuse.keel"
        chmod 755 "$ns/up/mount.fuse.keel"
        mount -t overlay xfstests-sbin -o "lowerdir=$sbin,upperdir=$ns/up,workdir=$ns/work" "$sbin"
        for d in test scratch; do
            new_volume "$d"
            mkfs.ext4 -q -F "${loops[-1]}" >/dev/null
            mkdir -p "$out/vol/$d"
            mount "${loops[-1]}" "$out/vol/$d"
        done
        [ -x /sbin/mount.fuse.keel ] || die "/sbin/mount.fuse.keel is not visible in the namespace"
        opts=
        if [[ $config == keel:* ]]; then
            IFS=, read -r -a kv <<<"${config#keel:}"
            for o in "${kv[@]}"; do
                opts=${opts:+$opts,}keel.$o
            done
        fi
        cat >"$cfg" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.keel
export TEST_DEV=keel:$out/vol/test/state
export SCRATCH_DEV=keel:$out/vol/scratch/state
export FUSE_MOUNT_OPTIONS="${opts:+-o $opts}"
$common
EOF
        ;;
    tmpfs)
        id=$(basename "$out")
        cat >"$cfg" <<EOF
export FSTYP=tmpfs
export TEST_DEV=xfstests-tmpfs-test-$id
export SCRATCH_DEV=xfstests-tmpfs-scratch-$id
$common
EOF
        ;;
    ext4)
        new_volume test
        new_volume scratch
        mkfs.ext4 -q -F "${loops[0]}" >/dev/null
        cat >"$cfg" <<EOF
export FSTYP=ext4
export TEST_DEV=${loops[0]}
export SCRATCH_DEV=${loops[1]}
$common
EOF
        ;;
esac

# The hang guard: a test running longer than TEST_TIMEOUT seconds is killed with everything
# it started (./check then records it as failed; hang-guard.log says which).
descendants() {
    local c
    for c in $(ps -o pid= --ppid "$1"); do
        echo "$c"
        descendants "$c"
    done
}
hang_guard() {
    local check=$1 seen= since=0 t
    while kill -0 "$check" 2>/dev/null; do
        sleep 10
        t=$(ps -o pid= --ppid "$check" | tr -d ' ' | head -n 1)
        if [ -z "$t" ] || [ "$t" != "$seen" ]; then
            seen=$t since=$SECONDS
        elif [ $((SECONDS - since)) -ge "$TEST_TIMEOUT" ]; then
            echo "$(date +%T) $(tr '\0' ' ' </proc/"$t"/cmdline 2>/dev/null) ran over ${TEST_TIMEOUT}s: killed" \
                >>"$out/hang-guard.log"
            kill -KILL $(descendants "$t") "$t" 2>/dev/null
            seen= since=$SECONDS
        fi
    done
}

cd "$xfst"
set +e
HOST_OPTIONS=$cfg ./check -R xunit -E "$here/exclude" "$@" >"$out/check.log" 2>&1 &
check=$!
hang_guard "$check" &
guard=$!
wait "$check"
rc=$?
kill "$guard" 2>/dev/null
set -e
# ./check exits 1 when a test failed; the harness judges by the results (results.py).
grep -qE '^(Passed all|Failures:|Not run:|Ran:)' "$out/check.log" ||
    { tail -n 30 "$out/check.log" >&2; die "./check did not finish (exit $rc)"; }
exit 0

#!/usr/bin/env bash
# scale-bench: keel with a very large number of small files (issue 25).
#
#   script/scale-bench.sh [--short] [--files N] [--size BYTES] [--out FILE.tsv]
#
# N files (default 1,000,000) of --size bytes (default 100) in directories of 1,000, on a
# `keel mount` (state on the local disk, remote file:// beside it, so a second state dir can
# play a fresh host), with ext4 (a directory under BENCH_DIR) and tmpfs beside it where the
# step exists there. Steps, in order, each timed on its own:
#   create         write the N files (one process, open/write/close each)
#   ckpt full      the first `keel checkpoint`: the full snapshot and its metadata image
#   stat-all       lstat every file (walk + stat)
#   find           `find DIR | wc -l` (readdir only)
#   ckpt 1         append to 1 file, `keel checkpoint` (wall time of the command)
#   ckpt 1000      append to 1,000 files, `keel checkpoint`
#   snapshot create  `keel snapshot create` (loads the history window), then ckpt after snap:
#                  a 1-file checkpoint after it
#   rollback       `keel rollback` of the mounted workspace to the first (full) snapshot: the
#                  1,000 files appended to since; then rollback undo: back to the snapshot it
#                  named (before-rollback-N), so the files are as before for read-all
#   ckpt full again  `keel checkpoint --full` (a compaction), then 1,000 more files appended
#                  to and checkpointed; rollback across full / across undo: the same two
#                  rollbacks with that full snapshot between (both chains read and merged)
#   stop           SIGTERM to exit, nothing dirty (after the checkpoint); keel's log splits it
#                  into 'to durable' (final checkpoint done) and 'umount2' (the kernel's
#                  teardown of what it cached; tmpfs's umount beside it)
#   warm restart   `keel mount` on the same state dir to a stat of one file
#   fsck --quick   `keel fsck --quick` of the stopped state dir; fsck: the full one
#   diff           `keel diff` of the stopped state dir, the first snapshot to the undo's
#                  (one chain); diff across full: the first snapshot to the head
#   gc             `keel gc` of the stopped state dir
#   fresh restore  `keel mount` on an EMPTY state dir (same remote) to a stat of one file
#                  (from the full snapshot's metadata image and the deltas after it)
#   fresh, no image  the same with the images moved away (the restore decodes the chain)
#   read-all       read every file once after that fresh restore
# keel's RSS (VmRSS) after each step and its peak (VmHWM) of that daemon so far; for the
# rollbacks the daemon's peak during the step alone (VmHWM restarted before it); for the
# offline commands (fsck, gc, diff) their own peak RSS. --short: 20,000 files (the test command
# runs it: it fails if a step fails, asserts nothing about time). --keel-only: skip ext4 and
# tmpfs. Needs root and /dev/fuse.
# Prints a markdown table (and '#' facts), raw rows to --out. Nothing on the host changes.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
export KEEL_BIN KEEL_READY_TIMEOUT=${KEEL_READY_TIMEOUT:-900}
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
FILES=1000000 SIZE=100 OUT= KEEL_ONLY=
while [ $# -gt 0 ]; do
    case $1 in
        --short) FILES=20000 ;;
        --files) FILES=$2; shift ;;
        --size) SIZE=$2; shift ;;
        --out) OUT=$2; shift ;;
        --keel-only) KEEL_ONLY=1 ;;
        -h|--help) sed -n '2,41p' "$0"; exit 0 ;;
        *) echo "scale-bench: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
case $FILES$SIZE in *[!0-9]*) echo "scale-bench: --files and --size take numbers" >&2; exit 2 ;; esac
[ "$FILES" -ge 1000 ] || { echo "scale-bench: --files must be at least 1000" >&2; exit 2; }
if [ "$(id -u)" != 0 ] || [ ! -e /dev/fuse ]; then echo "scale-bench: needs root and /dev/fuse" >&2; exit 1; fi
[ -x "$KEEL_BIN" ] || { echo "scale-bench: no keel at $KEEL_BIN (cargo build --release)" >&2; exit 1; }

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/scale.XXXXXX")
CUR=()
cleanup() {
    local s
    for s in "${CUR[@]}"; do
        "$REPO/ci/keelctl.sh" kill9 "$RUN/$s-state" "$RUN/$s" >/dev/null 2>&1
    done
    awk -v r="$RUN/" 'index($5, r) == 1 {print $5}' /proc/self/mountinfo | sort -r |
        while read -r m; do umount -l "$m"; done
    rm -rf "$RUN"
}
trap cleanup EXIT
die() { echo "scale-bench: $*" >&2; exit 1; }

now() { date +%s%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (b - a) / 1e9 }'; }
mib() { awk -v k="$2:" '$1 == k {printf "%d", $2 / 1024}' "/proc/$1/status"; }

cat >"$RUN/w.py" <<'EOF'
import os, sys
op, top, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
per = 1000
if op == "create":
    body = b"x" * size
    for i in range(n):
        d = os.path.join(top, "d%04d" % (i // per))
        if i % per == 0:
            os.mkdir(d)
        fd = os.open(os.path.join(d, "f%04d" % (i % per)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, body)
        os.close(fd)
elif op == "stat":
    count = 0
    for e in os.scandir(top):
        for f in os.scandir(e.path):
            os.lstat(f.path)
            count += 1
    if count != n:
        sys.exit(f"stat-all: {count} files, expected {n}")
elif op == "read":
    count = total = 0
    for e in os.scandir(top):
        for f in os.scandir(e.path):
            with open(f.path, "rb") as fh:
                total += len(fh.read())
            count += 1
    if count != n or total != n * size + int(sys.argv[5]):
        sys.exit(f"read-all: {count} files / {total} bytes, expected {n} / {n * size} + appended")
elif op == "touch":  # append a line to files 0, step, 2*step... (count of them)
    count = int(sys.argv[5])
    step = max(1, n // count)
    for i in range(0, step * count, step):
        with open(os.path.join(top, "d%04d" % (i // per), "f%04d" % (i % per)), "ab") as fh:
            fh.write(b"+\n")
EOF

# timed NAME CMD...: runs CMD, sets T to its wall time in seconds; a failure ends the bench.
timed() {
    local name=$1 t0 t1; shift
    t0=$(now)
    "$@" || die "$name failed: $*"
    t1=$(now)
    T=$(secs "$t0" "$t1")
}

declare -A R SEEN  # R[step,fs] = seconds; R[step,rss] = "RSS / peak"
STEPS=() FACTS=()
put() { # put STEP FS VALUE
    [ -n "${SEEN[$1]:-}" ] || { STEPS+=("$1"); SEEN[$1]=1; }
    R[$1,$2]=$3
}
rss_keel() { put "$1" rss "$(mib "$PID" VmRSS) / $(mib "$PID" VmHWM)"; }
# offline STEP CMD...: a keel subcommand run on its own; its own peak RSS
offline() {
    local step=$1 t0 t1; shift
    t0=$(now)
    /usr/bin/time -f '%M' -o "$RUN/time.out" "$@" >"$RUN/offline.log" 2>&1 ||
        { cat "$RUN/offline.log" >&2; die "$step failed: $*"; }
    t1=$(now)
    put "$step" keel "$(secs "$t0" "$t1")"
    put "$step" rss "$(($(tail -n 1 "$RUN/time.out") / 1024)) (own)"
    sed 's/^/  /' "$RUN/offline.log" | tail -n 3 >&2
}

cat >"$RUN/keel.toml" <<EOF
[persist]
remote = "file://$RUN/remote"
interval = "0s"
EOF
mkdir -p "$RUN/remote"

K=$RUN/keel
start_keel() { # start_keel STATE: mount, wait, set PID
    CUR+=(keel)
    "$REPO/ci/keelctl.sh" start "$1" "$K" --config "$RUN/keel.toml" >&2 || die "keel mount failed"
    PID=$(cat "$1.pid")
}
stop_keel() { # stop_keel STATE: SIGTERM, wait for exit, T = seconds
    local t0 t1
    t0=$(now)
    "$REPO/ci/keelctl.sh" stop "$1" "$K" >&2 || die "keel stop failed"
    t1=$(now)
    CUR=()
    T=$(secs "$t0" "$t1")
}
ckpt() { # ckpt [--full]
    "$KEEL_BIN" checkpoint "$@" --state "$RUN/keel-state" --config "$RUN/keel.toml" >"$RUN/ckpt.log" 2>&1 ||
        { cat "$RUN/ckpt.log" >&2; return 1; }
    sed 's/^/  /' "$RUN/ckpt.log" >&2
}
first_stat() { stat -c %s "$K/d0000/f0001" >/dev/null; }

echo "scale-bench: $FILES files of $SIZE B under $RUN" >&2
# --- keel -----------------------------------------------------------------------------------
start_keel "$RUN/keel-state"
put mounted rss "$(mib "$PID" VmRSS) / $(mib "$PID" VmHWM)"
echo "scale-bench: keel create..." >&2
timed create python3 "$RUN/w.py" create "$K" "$FILES" "$SIZE"; put create keel "$T"; rss_keel create
timed stat-all python3 "$RUN/w.py" stat "$K" "$FILES" "$SIZE"; put stat-all keel "$T"; rss_keel stat-all
timed find bash -c "[ \$(find '$K' | wc -l) = $((FILES + (FILES + 999) / 1000 + 1)) ]"; put find keel "$T"; rss_keel find
timed "ckpt full" ckpt; put "ckpt full" keel "$T"; rss_keel "ckpt full"
python3 "$RUN/w.py" touch "$K" "$FILES" "$SIZE" 1 || die "touch failed"
timed "ckpt 1" ckpt; put "ckpt 1" keel "$T"; rss_keel "ckpt 1"
python3 "$RUN/w.py" touch "$K" "$FILES" "$SIZE" 1000 || die "touch failed"
timed "ckpt 1000" ckpt; put "ckpt 1000" keel "$T"; rss_keel "ckpt 1000"
# A named snapshot loads the history window (persist/history.rs); one more checkpoint after it.
timed "snapshot create" "$KEEL_BIN" snapshot create --name scale --state "$RUN/keel-state" --config "$RUN/keel.toml" >&2  # it prints the new seq
put "snapshot create" keel "$T"; rss_keel "snapshot create"
python3 "$RUN/w.py" touch "$K" "$FILES" "$SIZE" 1 || die "touch failed"
timed "ckpt after snap" ckpt; put "ckpt after snap" keel "$T"; rss_keel "ckpt after snap"
# The rollbacks' own peaks: VmHWM restarted before each (clear_refs 5 touches only this
# process), the daemon's peak before them kept for the stop row.
PEAK=$(mib "$PID" VmHWM)
rollback_to() { "$KEEL_BIN" rollback "$1" --json --state "$RUN/keel-state" >"$RUN/rollback.json"; }
rollback_step() { # rollback_step STEP TO
    echo 5 >"/proc/$PID/clear_refs"
    timed "$1" rollback_to "$2"; put "$1" keel "$T"
    put "$1" rss "$(mib "$PID" VmRSS) / $(mib "$PID" VmHWM) (step)"
    local h; h=$(mib "$PID" VmHWM); [ "$h" -gt "$PEAK" ] && PEAK=$h
    FACTS+=("$1: $(python3 -c 'import json, sys
v = json.load(open(sys.argv[1]))
a = v["applied"]
print("snapshot %s to %s, trees %s (%s ms), %s inodes, %s entries, %s ms in keel" % (v["from"], v["to"],
      v["trees"], v["load_trees_ms"], a["inodes"], a["entries"], v["duration_ms"]))' "$RUN/rollback.json")")
}
undo_of() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["undo"])' "$RUN/rollback.json"; }
rollback_step rollback 1
rollback_step "rollback undo" "$(undo_of)"
# The same across a full snapshot: a compaction, 1,000 more files changed, back to the first
# snapshot (both chains read, the two full snapshots merged) and the undo of that.
ALONG=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["snapshot"])' "$RUN/rollback.json")
timed "ckpt full again" ckpt --full; put "ckpt full again" keel "$T"; rss_keel "ckpt full again"
python3 "$RUN/w.py" touch "$K" "$FILES" "$SIZE" 1000 || die "touch failed"
ckpt || die "checkpoint after the compaction failed"
rollback_step "rollback across full" 1
rollback_step "rollback across undo" "$(undo_of)"
h=$(mib "$PID" VmHWM); [ "$h" -gt "$PEAK" ] && PEAK=$h
put stop rss "$(mib "$PID" VmRSS) / $PEAK"
stop_keel "$RUN/keel-state"; put stop keel "$T"
# keel's log splits the stop: up to the final checkpoint (everything durable), then umount2,
# the kernel tearing down the inodes and names it cached (tmpfs's umount beside it).
ms_field() { grep 'workspace unmounted' "$RUN/keel-state.log" | tail -n 1 | grep -o "$1=[0-9]*" | cut -d= -f2; }
d=$(ms_field durable_ms) u=$(ms_field kernel_unmount_ms)
[ -n "$d" ] && put "stop: to durable" keel "$(awk -v m="$d" 'BEGIN { printf "%.3f", m / 1000 }')"
[ -n "$u" ] && put "stop: umount2" keel "$(awk -v m="$u" 'BEGIN { printf "%.3f", m / 1000 }')"
t0=$(now); start_keel "$RUN/keel-state"; first_stat || die "stat after warm restart failed"
put "warm restart" keel "$(secs "$t0" "$(now)")"; rss_keel "warm restart"
stop_keel "$RUN/keel-state"
offline "fsck --quick" "$KEEL_BIN" fsck --quick --state "$RUN/keel-state" --config "$RUN/keel.toml"
offline fsck "$KEEL_BIN" fsck --state "$RUN/keel-state" --config "$RUN/keel.toml"
offline diff "$KEEL_BIN" diff 1 "$ALONG" --state "$RUN/keel-state" --config "$RUN/keel.toml"
offline "diff across full" "$KEEL_BIN" diff 1 head --state "$RUN/keel-state" --config "$RUN/keel.toml"
offline gc "$KEEL_BIN" gc --state "$RUN/keel-state" --config "$RUN/keel.toml"
t0=$(now); start_keel "$RUN/fresh-state"; first_stat || die "stat after fresh restore failed"
put "fresh restore" keel "$(secs "$t0" "$(now)")"; rss_keel "fresh restore"
FACTS+=("metadata image: $(du -cb "$RUN"/remote/images/* 2>/dev/null | tail -n 1 | cut -f1) bytes compressed")
FACTS+=("fresh restore, keel's own log: $(grep -ho 'restore: .*' "$RUN/fresh-state.log" | grep -E 'metadata image|restored|snapshot' | tr '\n' ' ' | cut -c1-400)")
# every file has its 100 B; 1 + 1000 + 1 + 1000 appends of 2 B each (file 0 gets four)
appended=$((2 * 2002))
timed read-all python3 "$RUN/w.py" read "$K" "$FILES" "$SIZE" "$appended"; put read-all keel "$T"; rss_keel read-all
stop_keel "$RUN/fresh-state"
# The same fresh restore without the image: what it was before images (the chain decoded).
mv "$RUN/remote/images" "$RUN/images.aside"
t0=$(now); start_keel "$RUN/chain-state"; first_stat || die "stat after fresh restore (no image) failed"
put "fresh, no image" keel "$(secs "$t0" "$(now)")"; rss_keel "fresh, no image"
stop_keel "$RUN/chain-state"
mv "$RUN/images.aside" "$RUN/remote/images"
rm -rf "$RUN/keel-state" "$RUN/fresh-state" "$RUN/chain-state" "$RUN/remote"

# --- ext4 and tmpfs beside it -----------------------------------------------------------------
COMPARE=(ext4 tmpfs)
[ -n "$KEEL_ONLY" ] && COMPARE=()
mkdir -p "$RUN/ext4" "$RUN/tmpfs"
mount -t tmpfs -o size=50%,nr_inodes=0 keel-scale "$RUN/tmpfs" || die "tmpfs mount failed"
for fs in "${COMPARE[@]}"; do
    echo "scale-bench: $fs..." >&2
    D=$RUN/$fs
    timed create python3 "$RUN/w.py" create "$D" "$FILES" "$SIZE"; put create "$fs" "$T"
    timed stat-all python3 "$RUN/w.py" stat "$D" "$FILES" "$SIZE"; put stat-all "$fs" "$T"
    timed find bash -c "[ \$(find '$D' | wc -l) = $((FILES + (FILES + 999) / 1000 + 1)) ]"; put find "$fs" "$T"
    python3 "$RUN/w.py" touch "$D" "$FILES" "$SIZE" 1 && python3 "$RUN/w.py" touch "$D" "$FILES" "$SIZE" 1000 &&
        python3 "$RUN/w.py" touch "$D" "$FILES" "$SIZE" 1 && python3 "$RUN/w.py" touch "$D" "$FILES" "$SIZE" 1000
    timed read-all python3 "$RUN/w.py" read "$D" "$FILES" "$SIZE" "$appended"; put read-all "$fs" "$T"
done
# tmpfs's "stop": unmounting it with every file cached, as keel's umount2 above.
if [ -n "$KEEL_ONLY" ]; then umount -l "$RUN/tmpfs"; else timed "stop: umount2" umount "$RUN/tmpfs"; put "stop: umount2" tmpfs "$T"; fi

# --- report -------------------------------------------------------------------------------------
echo "# $FILES files of $SIZE B in directories of 1,000; keel mount with a file:// remote on the same disk, ext4 and tmpfs beside it; one run, seconds of wall time"
echo "# keel RSS: VmRSS after the step / the daemon's VmHWM so far, MiB ((step): its peak during that step alone; offline commands: their own peak)"
echo "# read-all on keel follows the fresh restore (every file's metadata and body fetched from the remote)"
for f in "${FACTS[@]}"; do echo "# $f"; done
echo "| step | keel s | ext4 s | tmpfs s | keel/ext4 | keel/tmpfs | keel RSS MiB |"
echo "|---|---:|---:|---:|---:|---:|---:|"
[ -n "$OUT" ] && printf 'files\tsize\tstep\tkeel_s\text4_s\ttmpfs_s\tkeel_rss\n' >"$OUT"
for s in "${STEPS[@]}"; do
    k=${R[$s,keel]:-} e=${R[$s,ext4]:-} t=${R[$s,tmpfs]:-}
    ratio() { [ -n "$1" ] && [ -n "$2" ] && awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.1fx", a / b; else print "-" }' || echo -; }
    echo "| $s | ${k:--} | ${e:--} | ${t:--} | $(ratio "$k" "$e") | $(ratio "$k" "$t") | ${R[$s,rss]:--} |"
    [ -n "$OUT" ] && printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$FILES" "$SIZE" "$s" "$k" "$e" "$t" "${R[$s,rss]:-}" >>"$OUT"
done
exit 0

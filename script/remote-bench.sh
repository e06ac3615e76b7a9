#!/usr/bin/env bash
# shellcheck disable=SC2016  # $MNT and $CFG expand in the main command's shell
# Remote (S3) benchmark of issue 5: what a fresh container with an empty state dir pays to get
# its workspace back from the object store, and what a checkpoint uploads after a small change.
#
#   script/remote-bench.sh [--short] [--reps N] [--files N] [--mib N]
#
# An S3 endpoint (moto_server, in memory) runs on 127.0.0.1 for the run. For each workspace
# size (a small one, and the full one: 10,000 files / 1 GiB including one 64 MiB file):
#   1. populate: `keel run` on an empty state dir writes the files, `keel checkpoint` uploads
#   2. start -> usable: `keel run` on an EMPTY state dir with the remote configured; the main
#      command stats a file and records the time. Measured from the spawn of keel to that
#      moment, median of --reps. Beside it, the same with the state dir already present (keel's
#      own start cost, no restore), so the difference is what restoring costs.
#   3. first read of the cold 64 MiB file right after such a start, and a re-read.
#   4. change 1 file of N (append a line), `keel checkpoint`: chunks / bytes uploaded.
# Prints one table. Needs root and /dev/fuse (keel mounts the workspace), python3 + moto.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$here/.." && pwd)
KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
SHORT=0 REPS=3 FILES=10000 MIB=1024
while [ $# -gt 0 ]; do
    case $1 in
        --short) SHORT=1 ;;
        --reps) REPS=$2; shift ;;
        --files) FILES=$2; shift ;;
        --mib) MIB=$2; shift ;;
        *) echo "remote-bench: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ "$SHORT" = 1 ]; then REPS=1 FILES=500 MIB=48; fi
BIG_MIB=$((MIB >= 256 ? 64 : 16))

[ -x "$KEEL_BIN" ] || { echo "remote-bench: no keel at $KEEL_BIN (cargo build --release)" >&2; exit 1; }
if [ "$(id -u)" != 0 ] || [ ! -e /dev/fuse ]; then echo "remote-bench: needs root and /dev/fuse" >&2; exit 1; fi
command -v moto_server >/dev/null || { echo "remote-bench: moto_server missing (pip install \"moto[server]\")" >&2; exit 1; }

RUN=$(mktemp -d /tmp/keel-remote-bench.XXXXXX)
MOTO_PID=
cleanup() {
    [ -n "$MOTO_PID" ] && kill "$MOTO_PID" 2>/dev/null && wait "$MOTO_PID" 2>/dev/null
    awk -v r="$RUN/" 'index($5, r) == 1 {print $5}' /proc/self/mountinfo | while read -r m; do umount -l "$m"; done
    rm -rf "$RUN"
}
trap cleanup EXIT

# moto picks its own port (-p 0) and says which: no other process can take it first.
moto_server -H 127.0.0.1 -p 0 >"$RUN/moto.log" 2>&1 &
MOTO_PID=$!
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1
PORT=""
for _ in $(seq 1800); do
    PORT=$(sed -n 's|.*Running on http://127\.0\.0\.1:\([0-9][0-9]*\).*|\1|p' "$RUN/moto.log" | head -n 1)
    [ -n "$PORT" ] && curl -s -f -X PUT "http://127.0.0.1:$PORT/keel" >/dev/null 2>&1 && break
    kill -0 "$MOTO_PID" 2>/dev/null || break
    sleep 0.1
done
curl -s -f "http://127.0.0.1:$PORT/keel" >/dev/null || { echo "remote-bench: moto did not come up" >&2; cat "$RUN/moto.log" >&2; exit 1; }

now() { date +%s%N; }
ms() { echo "scale=0; ($2 - $1) / 1000000" | bc; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : int((a[NR/2]+a[NR/2+1])/2)}'; }

# config NAME STATE PREFIX: writes $RUN/NAME.toml
config() {
    cat >"$RUN/$1.toml" <<EOF
[workspace]
mount_point = "$RUN/mnt-$1"
state_dir = "$2"
[persist]
remote = "s3://keel/$3"
endpoint = "http://127.0.0.1:$PORT"
region = "us-east-1"
allow_http = true
interval = "0s"
flush_timeout = "120s"
[shutdown]
grace = "5s"
flush_timeout = "120s"
# The main command runs keel checkpoint: the state dir is hidden from it (isolate_state), so
# the control socket lives beside the config, where the sandbox can reach it.
[control]
socket = "$RUN/$1.sock"
EOF
}

# krun NAME CMD...: keel run with config NAME; the command sees $MNT and $CFG
krun() {
    local name=$1; shift
    MNT="$RUN/mnt-$name" CFG="$RUN/$name.toml" KEEL_LOG=warn \
        "$KEEL_BIN" run --config "$RUN/$name.toml" -- "$@"
}

# populate NAME FILES MIB: FILES files of random bytes, one of them BIG_MIB MiB, MIB MiB in all
populate() {
    local name=$1 files=$2 mib=$3
    config "$name" "$RUN/$name-origin" "$name"
    krun "$name" sh -c 'python3 "'"$RUN/gen.py"'" "$MNT" '"$files $mib $BIG_MIB"' && "'"$KEEL_BIN"'" checkpoint --config "$CFG" >/dev/null'
}

# start_usable NAME STATE: ms from spawning keel until the main command has stat'ed a file
start_usable() {
    local name=$1 t0
    config "$name-s" "$2" "$name"
    t0=$(now)
    krun "$name-s" sh -c 'stat -c %s "$MNT/d000/f00000" >/dev/null && date +%s%N >"$MNT.t1"'
    ms "$t0" "$(cat "$RUN/mnt-$name-s.t1")"
}

cat >"$RUN/gen.py" <<'EOF'
import os, sys
mnt, files, mib, big = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rest = (mib - big) << 20
each = rest // (files - 1)
with open(os.path.join(mnt, "big"), "wb") as f:
    for _ in range(big):
        f.write(os.urandom(1 << 20))
for i in range(files - 1):
    d = os.path.join(mnt, "d%03d" % (i // 100))
    if i % 100 == 0:
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "f%05d" % i), "wb") as f:
        f.write(os.urandom(each))
EOF

declare -a ROWS
bench() {
    local name=$1 files=$2 mib=$3 fresh=() local_=() cold=() warm=()
    echo "remote-bench: populating $name ($files files, $mib MiB)..." >&2
    populate "$name" "$files" "$mib"
    for _ in $(seq "$REPS"); do
        rm -rf "$RUN/$name-fresh"
        fresh+=("$(start_usable "$name" "$RUN/$name-fresh")")
        local_+=("$(start_usable "$name" "$RUN/$name-origin")")
        # first read of the big file right after a fresh start, then a re-read
        rm -rf "$RUN/$name-cold"
        config "$name-c" "$RUN/$name-cold" "$name"
        krun "$name-c" sh -c 'a=$(date +%s%N); cat "$MNT/big" >/dev/null; b=$(date +%s%N); cat "$MNT/big" >/dev/null; c=$(date +%s%N); echo "$a $b $c" >"$MNT.t"'
        read -r a b c <"$RUN/mnt-$name-c.t"
        cold+=("$(ms "$a" "$b")")
        warm+=("$(ms "$b" "$c")")
    done
    # change one file, checkpoint, read what was uploaded
    local out
    out=$(krun "$name" sh -c 'echo one more line >>"$MNT/d000/f00042" && "'"$KEEL_BIN"'" checkpoint --config "$CFG"')
    local up
    up=$(echo "$out" | sed -n 's/.* \([0-9]*\) chunks \/ \([0-9]*\) bytes uploaded, snapshot \([0-9]*\) bytes.*/\1 chunks, \2 B + \3 B snapshot/p')
    [ -n "$up" ] || up="? ($out)"
    ROWS+=("| $name | $files | $mib MiB | $(printf '%s\n' "${fresh[@]}" | median) ms | $(printf '%s\n' "${local_[@]}" | median) ms | $(printf '%s\n' "${cold[@]}" | median) ms | $(printf '%s\n' "${warm[@]}" | median) ms | $up |")
}

[ "$SHORT" = 1 ] || bench small 100 $((BIG_MIB + 16))
bench full "$FILES" "$MIB"

echo
echo "# remote-bench: S3 = moto_server on 127.0.0.1; keel $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; medians of $REPS"
echo
echo "| workspace | files | bytes | start→usable, empty state dir | start→usable, state present | first read of ${BIG_MIB} MiB | re-read | checkpoint after changing 1 file |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"

#!/usr/bin/env bash
# budget-bench: keel's memory through a large install and the checkpoint after it (issue 43).
#
#   script/budget-bench.sh [--files N] [--bytes B] [--reps N] [--before BIN] [--budget SIZE]
#
# A tree shaped like a large node_modules (the `npm ci` of a monorepo: --files 30,606 and
# --bytes 866 MB by default; packages of 2-40 files, most under 12 KiB, some of 16-160 KiB, a
# few of 2-12 MiB; random bytes, fixed seed) is written by one python process into a fresh
# `keel mount` with the default config (30 s checkpoint interval: checkpoints run during the
# install, as in a real one), then `keel checkpoint` takes the rest. Printed per keel: the
# install's time and its ratio to ext4 in the same run (ext4: the same tree into a directory
# of BENCH_DIR), keel's peak RSS during the install (VmHWM, reset before it, and RSS sampled
# every 0.1 s: keel resets VmHWM itself at each checkpoint), and keel's peak through the
# checkpoint after it.
# --before BIN adds the same rows for another keel binary (e.g. the build before a change),
# interleaved per rep. --budget SIZE sets [workspace] memory_budget. Medians of --reps
# (default 3). Needs root, /dev/fuse, python3 and twice --bytes free under BENCH_DIR.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
FILES=30606 BYTES=866000000 REPS=3 BEFORE='' BUDGET=''
while [ $# -gt 0 ]; do
    case $1 in
        --files) FILES=$2; shift ;;
        --bytes) BYTES=$2; shift ;;
        --reps) REPS=$2; shift ;;
        --before) BEFORE=$2; shift ;;
        --budget) BUDGET=$2; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "budget-bench: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ "$(id -u)" != 0 ] || [ ! -e /dev/fuse ]; then echo "budget-bench: needs root and /dev/fuse" >&2; exit 1; fi
[ -x "$KEEL_BIN" ] || { echo "budget-bench: no keel at $KEEL_BIN" >&2; exit 1; }

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/budget.XXXXXX")
CUR='' SAMPLER=''
cleanup() {
    [ -z "$SAMPLER" ] || kill "$SAMPLER" 2>/dev/null
    [ -z "$CUR" ] || KEEL_BIN=$CURBIN "$REPO/ci/keelctl.sh" stop "$RUN/state" "$RUN/mnt" >/dev/null 2>&1
    rm -rf "$RUN"
}
trap cleanup EXIT

cat >"$RUN/shape.py" <<'EOF'
import os, random, sys
d, n, target = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = random.Random(43)
sizes = []
for _ in range(n):
    x = r.random()
    sizes.append(r.randint(2 << 20, 12 << 20) if x < 0.003 else
                 r.randint(16 << 10, 160 << 10) if x < 0.14 else r.randint(200, 12 << 10))
scale = target / sum(sizes)
sizes = [max(1, int(s * scale)) for s in sizes]
blob = os.urandom(16 << 20)
i = pkg = 0
while i < n:
    pkg += 1
    p = os.path.join(d, "node_modules", f"p{pkg:05d}", "lib", f"sub{pkg % 3}")
    os.makedirs(p, exist_ok=True)
    for j in range(min(r.randint(2, 40), n - i)):
        s, off = sizes[i], r.randrange(0, len(blob))
        with open(os.path.join(p, f"f{j}.js"), "wb") as f:
            while s > 0:
                k = min(s, len(blob) - off); f.write(blob[off:off + k]); s -= k; off = 0
        i += 1
EOF
if [ -n "$BUDGET" ]; then
    printf '[workspace]\nmemory_budget = "%s"\n' "$BUDGET" >"$RUN/config.toml"
else
    : >"$RUN/config.toml"
fi
export KEEL_CONFIG=$RUN/config.toml

kib() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status" 2>/dev/null; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
median() { sed '/^$/d' | sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }

declare -A T PW PC
one_ext4() {
    local t0 t1
    rm -rf "$RUN/ext4"; mkdir -p "$RUN/ext4"; sync
    t0=$(date +%s.%N); python3 "$RUN/shape.py" "$RUN/ext4" "$FILES" "$BYTES"; sync -f "$RUN/ext4"; t1=$(date +%s.%N)
    T[ext4]+="$(secs "$t0" "$t1") "
    rm -rf "$RUN/ext4"
}
one_keel() {   # one_keel LABEL BIN
    local label=$1 bin=$2 pid t0 t1 hwm sampled
    CURBIN=$bin CUR=$label
    rm -rf "$RUN/state" "$RUN/mnt"
    KEEL_BIN=$bin "$REPO/ci/keelctl.sh" start "$RUN/state" "$RUN/mnt" >&2 || exit 1
    pid=$(cat "$RUN/state.pid")
    echo 5 >"/proc/$pid/clear_refs"
    ( while kill -0 "$pid" 2>/dev/null; do kib "$pid" VmRSS; sleep 0.1; done ) >"$RUN/samples" &
    SAMPLER=$!
    t0=$(date +%s.%N); python3 "$RUN/shape.py" "$RUN/mnt" "$FILES" "$BYTES"; sync -f "$RUN/mnt"; t1=$(date +%s.%N)
    hwm=$(kib "$pid" VmHWM)
    kill "$SAMPLER"; wait "$SAMPLER" 2>/dev/null; SAMPLER=''
    sampled=$(sort -n "$RUN/samples" | tail -1)
    T[$label]+="$(secs "$t0" "$t1") "
    PW[$label]+="$(( (hwm > sampled ? hwm : sampled) / 1024 )) "
    echo 5 >"/proc/$pid/clear_refs"
    "$bin" checkpoint --state "$RUN/state" >/dev/null || exit 1
    PC[$label]+="$(( $(kib "$pid" VmHWM) / 1024 )) "
    KEEL_BIN=$bin "$REPO/ci/keelctl.sh" stop "$RUN/state" "$RUN/mnt" >&2 || exit 1
    CUR=''
    grep -o 'checkpoint report=.*' "$RUN/state.log" | sed 's/^/  /' >&2
    rm -rf "$RUN/state" "$RUN/state".*
}

LABELS=(keel)
[ -z "$BEFORE" ] || LABELS+=(before)
for rep in $(seq 1 "$REPS"); do
    echo "budget-bench: rep $rep of $REPS" >&2
    one_ext4
    one_keel keel "$KEEL_BIN"
    [ -z "$BEFORE" ] || one_keel before "$BEFORE"
done

e4=$(echo "${T[ext4]}" | tr ' ' '\n' | median)
echo "# budget-bench: $FILES files / $BYTES bytes written by one process into a fresh keel mount (default config${BUDGET:+, memory_budget $BUDGET}), then keel checkpoint; keel $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; medians of $REPS (each rep's value in brackets)"
echo
echo "| keel | install s | ×ext4 | peak during install MiB | peak through the checkpoint after MiB |"
echo "|---|---|---|---|---|"
for l in "${LABELS[@]}"; do
    t=$(echo "${T[$l]}" | tr ' ' '\n' | median)
    echo "| $l | $t [${T[$l]% }] | $(awk -v a="$t" -v b="$e4" 'BEGIN { printf "%.2f", a / b }') | $(echo "${PW[$l]}" | tr ' ' '\n' | median) [${PW[$l]% }] | $(echo "${PC[$l]}" | tr ' ' '\n' | median) [${PC[$l]% }] |"
done
echo "| ext4 | $e4 [${T[ext4]% }] | 1.00 | | |"

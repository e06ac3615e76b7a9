#!/usr/bin/env bash
# fio-bench: the four jobs of a published sandbox disk study, on several targets in one run.
#
#   script/fio-bench.sh [--short] [--reps N] [--out FILE] [TARGET...]
#
# Jobs (libaio, --direct=1, one file per target, time_based):
#   seqwrite  rw=write     bs=1M iodepth=8     MB/s
#   seqread   rw=read      bs=1M iodepth=8     MB/s
#   randwrite rw=randwrite bs=4k iodepth=32    IOPS
#   randread  rw=randread  bs=4k iodepth=32    IOPS
# Full: a 1 GiB file, 10 s each after a 2 s ramp, median of --reps (default 3).
# --short: a 64 MiB file, 2 s, no ramp, 1 rep (CI: only checks that the script works).
#
# TARGETs (default: keel ext4 tmpfs juicefs): see script/bench-lib.sh; `keel-wb` is keel with
# `--passthrough off` (writeback cache). The file is laid out once per target (untimed), then
# for every rep the jobs run in order and, within a job, the targets in a shuffled order
# (interleaved: drift from other load hits all targets alike). Before every read job the page
# cache of the benchmark's own files is dropped (script/evict-cache.sh: the target's file, and
# for keel the bodies in its state dir; no host setting is written). tmpfs: if it refuses O_DIRECT the tmpfs jobs run buffered (--direct=0), as
# the reference numbers did, and the table says so.
# Prints a markdown table (median MB/s or IOPS per target, keel/ext4 and keel/juicefs ratios).
# Exit status non-zero only if a target could not be set up or a job failed to run.
# Environment: BENCH_DIR (default REPO/.bench), KEEL_BIN, KEEL_ARGS. Needs root; installs fio.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NAME=fio-bench
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
# shellcheck source=script/bench-lib.sh
. "$REPO/script/bench-lib.sh"

SHORT=0 REPS=3 OUT='' TARGETS=()
REPS_SET=0
while [ $# -gt 0 ]; do
    case $1 in
        --short) SHORT=1; shift ;;
        --reps) REPS=$2; REPS_SET=1; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        -*) echo "$NAME: unknown option $1" >&2; exit 2 ;;
        *) TARGETS+=("$1"); shift ;;
    esac
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(keel ext4 tmpfs juicefs)
if [ "$SHORT" = 1 ]; then
    SIZE=64M RUNTIME=2 RAMP=0
    [ "$REPS_SET" = 1 ] || REPS=1
else
    SIZE=1G RUNTIME=10 RAMP=2
fi
[ "$(id -u)" = 0 ] || { echo "$NAME: needs root (mounts)" >&2; exit 1; }
if ! command -v fio >/dev/null; then
    echo "$NAME: installing fio with apt-get" >&2
    { apt-get install -y fio || { apt-get update && apt-get install -y fio; }; } >&2 ||
        { echo "$NAME: cannot install fio" >&2; exit 1; }
fi

JOBS=(seqwrite seqread randwrite randread)
declare -A RW=([seqwrite]=write [seqread]=read [randwrite]=randwrite [randread]=randread)
declare -A BS=([seqwrite]=1M [seqread]=1M [randwrite]=4k [randread]=4k)
declare -A QD=([seqwrite]=8 [seqread]=8 [randwrite]=32 [randread]=32)

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/fio.XXXXXX")
chmod 755 "$RUN"
FAILED=0
# shellcheck disable=SC2317  # (called from the EXIT trap)
cleanup() {
    local t
    for t in "${READY[@]}"; do teardown_target "$t"; done
    rm -rf "$RUN"
}
READY=()
trap cleanup EXIT

setup_targets "${TARGETS[@]}"
[ ${#READY[@]} -gt 0 ] || exit 1

# O_DIRECT per target: 1 unless the filesystem refuses it (tmpfs before Linux 6.6).
declare -A DIRECT
for t in "${READY[@]}"; do
    if python3 -c 'import os,sys; os.close(os.open(sys.argv[1], os.O_CREAT|os.O_WRONLY|os.O_DIRECT, 0o644))' \
        "${ROOT[$t]}/.direct-probe" 2>/dev/null; then
        DIRECT[$t]=1
    else
        DIRECT[$t]=0
        echo "$NAME: $t refuses O_DIRECT: its jobs run buffered (--direct=0)" >&2
    fi
    rm -f "${ROOT[$t]}/.direct-probe"
done

HEADER=$RUN/header
{
    echo "# fio-bench $(date -u +%FT%TZ) $(fio --version) size=$SIZE runtime=${RUNTIME}s ramp=${RAMP}s reps=$REPS short=$SHORT"
    describe_targets
    for t in "${READY[@]}"; do
        [ "${DIRECT[$t]}" = 1 ] || echo "# $t: refuses O_DIRECT, measured with --direct=0 (page cache)"
    done
} >"$HEADER"
cat "$HEADER"
echo

# Lay out the file once per target (untimed), so no read job measures a sparse file.
for t in "${READY[@]}"; do
    if ! fio --name=layout --filename="${ROOT[$t]}/fio.dat" --size=$SIZE --rw=write --bs=1M \
        --ioengine=libaio --iodepth=8 --direct="${DIRECT[$t]}" --end_fsync=1 \
        --output=/dev/null 2>"$RUN/layout.err"; then
        echo "$NAME: laying out the file on $t failed:" >&2
        tail -n 5 "$RUN/layout.err" >&2
        FAILED=1
    fi
done

# run_job JOB TARGET -> prints "MB/s<TAB>IOPS<TAB>mean clat us", or returns 1
run_job() {
    local j=$1 t=$2 json=$RUN/$1-$2.json
    target_alive "$t" || { echo "FAILED: $j on $t: its filesystem is gone" >&2; return 1; }
    sync
    case $j in
        *read)
            local dirs=("${ROOT[$t]}")
            case $t in
                keel|keel-wb) dirs+=("$(keel_state "$t")") ;;
                juicefs) dirs+=("$RUN/juicefs-data") ;;
            esac
            "$REPO/script/evict-cache.sh" "${dirs[@]}" ||
                { echo "FAILED: $j on $t: cannot drop its files' page cache" >&2; return 1; }
            ;;
    esac
    local ramp=()
    [ "$RAMP" = 0 ] || ramp=(--ramp_time="$RAMP")
    if ! fio --name="$j" --filename="${ROOT[$t]}/fio.dat" --size=$SIZE --rw="${RW[$j]}" \
        --bs="${BS[$j]}" --iodepth="${QD[$j]}" --ioengine=libaio --direct="${DIRECT[$t]}" \
        --time_based --runtime="$RUNTIME" "${ramp[@]}" --numjobs=1 --group_reporting \
        --output-format=json --output="$json" 2>"$RUN/fio.err"; then
        echo "FAILED: $j on $t:" >&2
        tail -n 5 "$RUN/fio.err" >&2
        return 1
    fi
    if ! target_alive "$t"; then
        echo "FAILED: $j on $t: its filesystem is gone (daemon stopped or killed)" >&2
        return 1
    fi
    python3 - "$json" "$j" <<'EOF'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
side = job["write" if "write" in sys.argv[2] else "read"]
if side.get("io_bytes", 0) == 0 or job.get("error", 0):
    sys.exit(1)
print(f'{side["bw_bytes"] / 1e6:.1f}\t{side["iops"]:.0f}\t{side["clat_ns"]["mean"] / 1e3:.1f}')
EOF
}

SAMPLES=$RUN/samples.tsv
: >"$SAMPLES"
for ((rep = 0; rep < REPS; rep++)); do
    echo "$NAME: repetition $((rep + 1))/$REPS" >&2
    for j in "${JOBS[@]}"; do
        for t in $(shuf -e "${READY[@]}"); do
            if r=$(run_job "$j" "$t"); then
                printf '%s\t%s\t%s\n' "$j" "$t" "$r" >>"$SAMPLES"
            else
                printf '%s\t%s\tFAILED\n' "$j" "$t" >>"$SAMPLES"
                FAILED=1
            fi
        done
    done
done

python3 - "$SAMPLES" "${READY[@]}" <<'EOF'
import statistics, sys
samples, targets = sys.argv[1], sys.argv[2:]
desc = {"seqwrite": ("seq write 1M, iodepth 8", "MB/s", 0),
        "seqread": ("seq read 1M, iodepth 8", "MB/s", 0),
        "randwrite": ("rand write 4k, iodepth 32", "IOPS", 1),
        "randread": ("rand read 4k, iodepth 32", "IOPS", 1)}
data, failed = {}, set()
for line in open(samples):
    f = line.rstrip("\n").split("\t")
    if f[2] == "FAILED":
        failed.add((f[0], f[1]))
    else:
        data.setdefault((f[0], f[1]), []).append([float(x) for x in f[2:]])
keels = [k for k in ("keel", "keel-wb") if k in targets]
bases = [b for b in ("ext4", "tmpfs", "juicefs") if b in targets]
pairs = [(k, b) for k in keels for b in bases] + (
    [("keel", "keel-wb")] if len(keels) == 2 else [])
head = ["job", "unit"] + targets + [f"{k}/{b}" for k, b in pairs]
print("| " + " | ".join(head) + " |")
print("|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|")
lat = {}
for j, (label, unit, col) in desc.items():
    med, cells = {}, [label, unit]
    for t in targets:
        if (j, t) in failed or (j, t) not in data:
            cells.append("FAILED")
            continue
        med[t] = statistics.median(r[col] for r in data[(j, t)])
        lat[(j, t)] = statistics.median(r[2] for r in data[(j, t)])
        cells.append(f"{med[t]:,.0f}")
    for k, b in pairs:
        cells.append(f"{med[k] / med[b]:.2f}x" if k in med and med.get(b) else "-")
    print("| " + " | ".join(cells) + " |")
print()
print("Median completion latency (mean clat per run, µs): " + "; ".join(
    f"{j} " + ", ".join(f"{t} {lat[(j, t)]:,.0f}" for t in targets if (j, t) in lat)
    for j in desc))
n = max((len(v) for v in data.values()), default=0)
print(f"\nSamples per cell: {n}. Spread (min–max of the runs) per cell:")
for j in desc:
    col = desc[j][2]
    print(f"- {j}: " + ", ".join(
        f"{t} {min(r[col] for r in data[(j, t)]):,.0f}–{max(r[col] for r in data[(j, t)]):,.0f}"
        for t in targets if (j, t) in data))
EOF
if [ -n "$OUT" ]; then
    { cat "$HEADER"; cat "$SAMPLES"; } >"$OUT"
fi
exit "$FAILED"

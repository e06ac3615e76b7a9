#!/usr/bin/env bash
# cache-bench: re-reads of an unchanged file under keel's cache modes, beside tmpfs and ext4
# (issue 7: "`kernel` reads match tmpfs on a re-read; `auto` within 10 % of `kernel`").
#
#   script/cache-bench.sh [--short] [--reps N] [--mib N]
#
# Targets, all in the same run: tmpfs, ext4 (a directory under BENCH_DIR), and one `keel mount`
# per variant: cache auto / kernel / none, each with passthrough on (the default on this kernel)
# and off (reads through keel and the FUSE page cache). In each, a file of --mib MiB (default
# 64) of random bytes is written, closed and synced; then it is opened and read to the end
# (`cat`) --reps times (default 31) after one untimed read; the median ms per target is printed
# with its ratio to tmpfs and to keel's `kernel` mode with the same passthrough setting.
# Every re-read is a new open(2), which is what `auto` must keep cheap. Needs root, /dev/fuse.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
export KEEL_BIN
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
SHORT=0 REPS=31 MIB=64
while [ $# -gt 0 ]; do
    case $1 in
        --short) SHORT=1 ;;
        --reps) REPS=$2; shift ;;
        --mib) MIB=$2; shift ;;
        *) echo "cache-bench: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
[ "$SHORT" = 1 ] && REPS=2 MIB=8
if [ "$(id -u)" != 0 ] || [ ! -e /dev/fuse ]; then echo "cache-bench: needs root and /dev/fuse" >&2; exit 1; fi
[ -x "$KEEL_BIN" ] || { echo "cache-bench: no keel at $KEEL_BIN" >&2; exit 1; }

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/cache.XXXXXX")
declare -A ROOT STATE
VARIANTS=()
cleanup() {
    local t
    for t in "${!STATE[@]}"; do "$REPO/ci/keelctl.sh" stop "${STATE[$t]}" "${ROOT[$t]}" >/dev/null 2>&1; done
    umount "$RUN/tmpfs" 2>/dev/null
    rm -rf "$RUN"
}
trap cleanup EXIT

mkdir -p "$RUN/tmpfs" "$RUN/ext4"
mount -t tmpfs -o size=1g keel-cache-bench "$RUN/tmpfs" || exit 1
ROOT[tmpfs]=$RUN/tmpfs ROOT[ext4]=$RUN/ext4
for cache in auto kernel none; do
    for pt in on off; do
        t="keel-$cache-pt$pt"
        mkdir -p "$RUN/$t"
        "$REPO/ci/keelctl.sh" start "$RUN/$t-state" "$RUN/$t" --cache "$cache" --passthrough "$pt" >&2 || exit 1
        ROOT[$t]=$RUN/$t STATE[$t]=$RUN/$t-state
        VARIANTS+=("$t")
    done
done
TARGETS=(tmpfs ext4 "${VARIANTS[@]}")

head -c $((MIB << 20)) /dev/urandom >"$RUN/src.bin"
for t in "${TARGETS[@]}"; do
    cp "$RUN/src.bin" "${ROOT[$t]}/f" && sync "${ROOT[$t]}/f"
    cat "${ROOT[$t]}/f" >/dev/null   # the untimed first read
    cmp -s "$RUN/src.bin" "${ROOT[$t]}/f" || { echo "cache-bench: $t returned other bytes" >&2; exit 1; }
done

declare -A SAMPLES
for _ in $(seq "$REPS"); do
    for t in $(printf '%s\n' "${TARGETS[@]}" | shuf); do
        a=$(date +%s%N)
        cat "${ROOT[$t]}/f" >/dev/null
        b=$(date +%s%N)
        SAMPLES[$t]+="$(( (b - a) / 1000 )) "
    done
done
median_us() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : int((a[NR/2]+a[NR/2+1])/2)}'; }
declare -A MED
for t in "${TARGETS[@]}"; do MED[$t]=$(echo "${SAMPLES[$t]}" | median_us); done
ratio() { echo "scale=2; $1 / $2" | bc | sed 's/^\./0./'; }

echo "# cache-bench: re-read of an unchanged ${MIB} MiB file (new open each time), median of $REPS; keel $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; load $(cut -d' ' -f1-3 /proc/loadavg)"

echo "| target | median ms | × tmpfs | × keel kernel (same passthrough) |"
echo "|---|---|---|---|"
for t in "${TARGETS[@]}"; do
    k=-
    case $t in keel-*) k=$(ratio "${MED[$t]}" "${MED[keel-kernel-pt${t##*-pt}]}") ;; esac
    printf '| %s | %s | %s | %s |\n' "$t" "$(echo "scale=1; ${MED[$t]} / 1000" | bc)" "$(ratio "${MED[$t]}" "${MED[tmpfs]}")" "$k"
done

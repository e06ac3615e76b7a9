#!/usr/bin/env bash
# rss-bench: keel's resident memory while one large file is written and read back
# (issue 7: "bounded however large the files: a 4 GiB file write must not grow RSS by more than
# a few chunks").
#
#   script/rss-bench.sh [--short] [--gib N]
#
# For keel with passthrough on (the default on this kernel: the kernel writes the body itself)
# and off (every byte goes through keel), a fresh `keel mount` gets a file of --gib GiB
# (default 4) written with dd (1 MiB blocks, then fsync) and read back. The daemon's VmRSS after
# mounting, its peak (VmHWM) over the write and read, and the growth in chunks of 512 KiB are
# printed. --short: 256 MiB. Needs root, /dev/fuse and twice the file size free under BENCH_DIR.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
export KEEL_BIN
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
MIB=4096
while [ $# -gt 0 ]; do
    case $1 in
        --short) MIB=256 ;;
        --gib) MIB=$(($2 * 1024)); shift ;;
        *) echo "rss-bench: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ "$(id -u)" != 0 ] || [ ! -e /dev/fuse ]; then echo "rss-bench: needs root and /dev/fuse" >&2; exit 1; fi
[ -x "$KEEL_BIN" ] || { echo "rss-bench: no keel at $KEEL_BIN" >&2; exit 1; }

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/rss.XXXXXX")
CUR=
cleanup() {
    [ -n "$CUR" ] && "$REPO/ci/keelctl.sh" stop "$RUN/$CUR-state" "$RUN/$CUR" >/dev/null 2>&1
    rm -rf "$RUN"
}
trap cleanup EXIT

kib() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status"; }

ROWS=()
for pt in on off; do
    CUR=pt$pt
    mkdir -p "$RUN/$CUR"
    "$REPO/ci/keelctl.sh" start "$RUN/$CUR-state" "$RUN/$CUR" --passthrough "$pt" >&2 || exit 1
    pid=$(cat "$RUN/$CUR-state.pid")
    base=$(kib "$pid" VmRSS)
    dd if=/dev/zero of="$RUN/$CUR/big" bs=1M count="$MIB" conv=fsync status=none || exit 1
    after_write=$(kib "$pid" VmHWM)
    cat "$RUN/$CUR/big" >/dev/null
    peak=$(kib "$pid" VmHWM)
    size=$(stat -c %s "$RUN/$CUR/big")
    [ "$size" = $((MIB << 20)) ] || { echo "rss-bench: file is $size bytes" >&2; exit 1; }
    "$REPO/ci/keelctl.sh" stop "$RUN/$CUR-state" "$RUN/$CUR" >&2 || exit 1
    CUR=
    rm -rf "$RUN/pt$pt-state"
    ROWS+=("| passthrough $pt | $((base / 1024)) MiB | $((after_write / 1024)) MiB | $((peak / 1024)) MiB | $(((peak - base) / 512)) |")
done

echo "# rss-bench: keel daemon memory around a ${MIB} MiB write (dd 1 MiB blocks, fsync) and read; keel $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs"
echo
echo "| keel | RSS after mount | peak after write | peak after read | growth in 512 KiB chunks |"
echo "|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"

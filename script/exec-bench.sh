#!/usr/bin/env bash
# exec-bench: processes started through keel's control API (issue 40), measured against a
# real `keel run` with the FUSE workspace on this machine:
#   - exec round trip of `true` (p50, p99) over the Unix socket and over TCP with a token,
#     beside `podman exec CONTAINER true` (a container of $KEEL_IMAGE when podman has it);
#   - output throughput of `head -c 1G /dev/zero` to a reading client (NDJSON and raw, three
#     rounds: on a shared machine one round says little);
#   - keel's RSS idle, with 100 concurrent processes, and while one process writes 10 GiB
#     that no client reads;
#   - the time diff=true adds to an exec changing 1,000 files of a 100,000-file workspace.
#
#   script/exec-bench.sh [--short] [--only SECTIONS]
#
# --only trips,output,rss,diff: run only these sections (comma-separated).
# --short: 100 round trips, 64 MiB of output, a 256 MiB writer, 10 processes, 10,000 files
# and 100 changed (checks that the benchmark works; the numbers mean little). Needs root,
# /dev/fuse and python3. Prints Markdown tables (BENCHMARKS.md keeps them).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
IMAGE=${KEEL_IMAGE:-localhost/keel:latest}
ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --short) ARGS+=(--runs 100 --podman-runs 10 --size $((64 << 20)) --big $((256 << 20)) --rounds 1
                       --concurrent 10 --files 10000 --changed 100) ;;
        --only) ARGS+=(--only "$2"); shift ;;
        *) echo "exec-bench: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ "$(id -u)" != 0 ] || [ ! -e /dev/fuse ]; then echo "exec-bench: needs root and /dev/fuse" >&2; exit 1; fi
[ -x "$KEEL_BIN" ] || { echo "exec-bench: no keel at $KEEL_BIN" >&2; exit 1; }

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/exec.XXXXXX")
CONTAINER="keel-exec-bench-$$"
KPID=
cleanup() {
    [ -n "$KPID" ] && kill -TERM "$KPID" 2>/dev/null && wait "$KPID" 2>/dev/null
    podman rm -f -t 0 "$CONTAINER" >/dev/null 2>&1
    mountpoint -q "$RUN/ws" && umount -l "$RUN/ws"
    rm -rf "$RUN"
}
trap cleanup EXIT

TOKEN="bench-$$-$RANDOM$RANDOM"
cat >"$RUN/config.toml" <<EOF2
[workspace]
mount_point = "$RUN/ws"
state_dir = "$RUN/state"
[persist]
remote = "file://$RUN/remote"
interval = "0s"
[control]
listen = "127.0.0.1:0"
token = "$TOKEN"
socket = "$RUN/c.sock"
[exec]
max_processes = 128
# The whole 1 GiB output fits: the throughput rows measure streaming, not a slow reader's gaps.
output_limit = "1GiB"
EOF2
"$KEEL_BIN" run --config "$RUN/config.toml" -- sleep 100000 >"$RUN/keel.out" 2>"$RUN/keel.log" &
KPID=$!
for _ in $(seq 600); do grep -qs 'ready after' "$RUN/keel.log" && break; sleep 0.1; done
grep -q 'ready after' "$RUN/keel.log" || { cat "$RUN/keel.log"; exit 1; }
ADDR=$(grep -o 'control API on http://[0-9.:]*' "$RUN/keel.log" | sed 's|.*http://||')

C=""
if command -v podman >/dev/null && podman image exists "$IMAGE" 2>/dev/null; then
    export CONTAINERS_CONF="${CONTAINERS_CONF:-$REPO/ci/containers.conf}"
    if podman run -d --name "$CONTAINER" --entrypoint sleep "$IMAGE" 100000 >/dev/null 2>&1; then
        C=$CONTAINER
    fi
fi
[ -n "$C" ] || echo "(no podman container of $IMAGE: the podman exec row is left out)"
echo "\`script/exec-bench.sh\` $(date -u +%F) on $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), keel $("$KEEL_BIN" --version)"
echo
python3 "$REPO/script/exec-bench.py" --socket "$RUN/c.sock" --tcp "$ADDR" --token "$TOKEN" \
    --keel-pid "$KPID" --workspace "$RUN/ws" --container "$C" "${ARGS[@]}"

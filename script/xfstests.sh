#!/usr/bin/env bash
# xfstests' generic group against keel (default options, --passthrough off, --cache none)
# beside tmpfs and ext4 in the same run, each with a TEST_DEV and a SCRATCH_DEV; writes the
# conformance report (docs/CONFORMANCE.md's generated part, docs/conformance/*.tsv).
#
#   script/xfstests.sh [--group auto|quick|NAME] [--configs "keel keel:cache=none ..."]
#                      [--no-scratch|--scratch] [--not-in GROUP] [-j N] [--out DIR]
#                      [--no-report] [TEST...]
#
#   --group    xfstests group within generic (default auto: every test of a normal full run;
#              the non-auto ones are broken, dangerous, soak or block-device-only)
#   --not-in G only the group's tests that are not in group G too (`--group auto --not-in
#              quick`: the long tests a full run adds to the quick ones)
#   --configs  the configurations (ci/xfstests/run.sh CONFIG; default: keel
#              keel:passthrough=off keel:cache=none tmpfs ext4)
#   --no-scratch  only the group's tests that need no scratch device (their source names
#              neither _require_scratch* nor _scratch_mkfs*, nor a block device, loop or dm
#              device): the short run, a fraction of the time
#   -j N       configurations run at once (default 1)
#   --out DIR  keep the runs there (default target/xfstests-runs/DATE)
#   TEST...    these tests instead of the group (no report)
#
# Each configuration runs inside its own private mount namespace (ci/xfstests/run.sh). Needs
# root, /dev/fuse, the packages script/test installs, and a release build of keel. It takes
# hours for the auto group: run it with nice, in the background. See docs/CONFORMANCE.md.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO=$PWD
export KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}

group=auto
configs="keel keel:passthrough=off keel:cache=none tmpfs ext4"
jobs=1
out=
report=1
noscratch=0
notin=
tests=()
while [ $# -gt 0 ]; do
    case $1 in
        --group) group=$2; shift 2 ;;
        --configs) configs=$2; shift 2 ;;
        -j) jobs=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --no-report) report=0; shift ;;
        --no-scratch) noscratch=1; shift ;;
        --scratch) noscratch=2; shift ;;
        --not-in) notin=$2; shift 2 ;;
        -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
        -*) echo "xfstests.sh: unknown option $1" >&2; exit 2 ;;
        *) tests+=("$1"); shift ;;
    esac
done
[ ${#tests[@]} -eq 0 ] || report=0
out=${out:-$REPO/target/xfstests-runs/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(realpath "$out")
xfst=$(ci/xfstests/build.sh)
subset=()
if [ -n "$notin" ] && [ ${#tests[@]} -eq 0 ]; then
    for t in $(awk -v g="$group" -v n="$notin" '!/^#/ { a = 0; b = 0
            for (i = 2; i <= NF; i++) { if ($i == g) a = 1; if ($i == n) b = 1 }
            if (a && !b) print $1 }' "$xfst/tests/generic/group.list"); do
        args+=("generic/$t")
    done
    subset=(--subset "not-$notin")
elif [ "$noscratch" != 0 ] && [ ${#tests[@]} -eq 0 ]; then
    for t in $(awk -v g="$group" '!/^#/ { for (i = 2; i <= NF; i++) if ($i == g) print $1 }' \
        "$xfst/tests/generic/group.list"); do
        if grep -qE '_require_scratch|_scratch_mkfs|_require_dm|_require_block_device|_require_loop|_require_logdev' \
            "$xfst/tests/generic/$t"; then
            [ "$noscratch" = 1 ] || args+=("generic/$t")
        else
            [ "$noscratch" = 2 ] || args+=("generic/$t")
        fi
    done
    subset=(--subset "$([ "$noscratch" = 1 ] && echo no-scratch || echo scratch)")
elif [ ${#tests[@]} -gt 0 ]; then
    args=("${tests[@]}")
else
    args=(-g "generic/$group")
fi

# The directory name of a configuration's run: keel:cache=none -> keel-cache-none.
dirname_of() { echo "$1" | tr ':=,' '---'; }

echo "xfstests: ${#args[@]} args (${args[*]:0:3} ...) on: $configs ($jobs at a time); runs in $out"
start=$(date +%s)
running=0
for c in $configs; do
    d=$out/$(dirname_of "$c")
    (
        t0=$(date +%s)
        if ci/xfstests/run.sh "$c" "$d" "${args[@]}" >"$d.log" 2>&1; then
            echo $(($(date +%s) - t0)) >"$d/elapsed"
            echo "$c: $(python3 ci/xfstests/results.py summary "$d") ($(($(date +%s) - t0))s)"
        else
            echo "$c: the run failed ($(($(date +%s) - t0))s); log $d.log:"
            tail -n 20 "$d.log"
        fi
    ) &
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
        wait -n || true
        running=$((running - 1))
    fi
done
wait
echo "xfstests: all configurations done in $(($(date +%s) - start))s"

if [ "$report" = 1 ]; then
    runs=()
    for c in $configs; do
        runs+=("$c=$out/$(dirname_of "$c")")
    done
    python3 ci/xfstests/report.py --group "generic/$group" ${subset[@]+"${subset[@]}"} \
        --doc docs/CONFORMANCE.md \
        --tsv "docs/conformance/generic-$group${subset:+-${subset[1]}}.tsv" --exclude ci/xfstests/exclude \
        --commit "${KEEL_COMMIT:-$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- init ||
            echo +changes)}" \
        "${runs[@]}"
    if [ "$group" = auto ] && [ "$noscratch" = 0 ] && [ -z "$notin" ]; then
        # The quick group's view of the same runs (its tests are auto tests too).
        python3 ci/xfstests/report.py --group "generic/$group" --only quick \
            --group-list "$(ci/xfstests/build.sh)/tests/generic/group.list" \
            --doc docs/CONFORMANCE.md --tsv docs/conformance/generic-auto-quick.tsv \
            --exclude ci/xfstests/exclude --commit "${KEEL_COMMIT:-$(git rev-parse --short HEAD)}" \
            "${runs[@]}"
    fi
    echo "report: docs/CONFORMANCE.md, docs/conformance/generic-$group*.tsv"
fi

#!/usr/bin/env bash
# npm-bench: `npm install` of a fixed package.json of popular tooling on several targets.
#
#   script/npm-bench.sh [--short] [--reps N] [--out FILE] [TARGET...]
#
# The package.json (below, exact versions) holds express, lodash, typescript, eslint, jest,
# webpack, react, react-dom (about 10,000 files installed). Its package-lock.json is resolved
# once and the npm cache (BENCH_DIR/npm-cache, on the ext4 disk, kept between runs) is warmed
# once by an untimed install; then every rep copies package.json + lock into a fresh directory
# of each target (targets shuffled per rep) and times
#   npm install --prefer-offline --ignore-scripts --no-audit --no-fund
# and reports the median of --reps (default 3), ratios keel/ext4, keel/tmpfs, keel/juicefs, the
# number of files installed, and keel's peak RSS during the install (VmHWM of the keel daemon,
# reset with clear_refs before each install; the max over reps).
# --short: one small package (ms), 1 rep (CI: only checks that the script works). Without
# network, --short falls back to a locally packed package.
# TARGETs (default keel ext4 tmpfs juicefs): see script/bench-lib.sh (`keel-wb` = keel with
# --passthrough off; `dir` = `keel run` with provider = "dir", checkpoints running, shown as
# dir/ext4). Exit status non-zero only if a target could not be set up or an install
# failed. Environment: BENCH_DIR (default REPO/.bench), KEEL_BIN, KEEL_ARGS. Needs root, npm.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NAME=npm-bench
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
# shellcheck source=script/bench-lib.sh
. "$REPO/script/bench-lib.sh"

SHORT=0 REPS=3 OUT='' TARGETS=() REPS_SET=0
while [ $# -gt 0 ]; do
    case $1 in
        --short) SHORT=1; shift ;;
        --reps) REPS=$2; REPS_SET=1; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        -*) echo "$NAME: unknown option $1" >&2; exit 2 ;;
        *) TARGETS+=("$1"); shift ;;
    esac
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(keel ext4 tmpfs juicefs)
[ "$SHORT" = 0 ] || [ "$REPS_SET" = 1 ] || REPS=1
[ "$(id -u)" = 0 ] || { echo "$NAME: needs root (mounts)" >&2; exit 1; }
for tool in npm node python3 shuf; do
    command -v "$tool" >/dev/null || { echo "$NAME: needs $tool" >&2; exit 1; }
done

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/npm.XXXXXX")
chmod 755 "$RUN"
FAILED=0
READY=()
# shellcheck disable=SC2317  # (called from the EXIT trap)
cleanup() {
    local t
    for t in "${READY[@]}"; do teardown_target "$t"; done
    rm -rf "$RUN"
}
trap cleanup EXIT

export npm_config_cache=$BENCH_DIR/npm-cache npm_config_update_notifier=false
export npm_config_fund=false npm_config_audit=false npm_config_loglevel=error
NPM_FLAGS=(--prefer-offline --ignore-scripts --no-audit --no-fund)

# --- the fixed project, resolved and cached once (untimed) ------------------------------------
PROJ=$RUN/project
mkdir -p "$PROJ"
if [ "$SHORT" = 1 ]; then
    printf '%s\n' '{ "name": "keel-npm-bench", "version": "1.0.0", "private": true,' \
        '  "dependencies": { "ms": "2.1.3" } }' >"$PROJ/package.json"
else
    cat >"$PROJ/package.json" <<'EOF'
{
  "name": "keel-npm-bench",
  "version": "1.0.0",
  "private": true,
  "dependencies": {
    "express": "4.21.2",
    "lodash": "4.17.21",
    "react": "18.3.1",
    "react-dom": "18.3.1"
  },
  "devDependencies": {
    "eslint": "9.17.0",
    "jest": "29.7.0",
    "typescript": "5.7.3",
    "webpack": "5.97.1"
  }
}
EOF
fi
echo "$NAME: resolving and warming the npm cache ($npm_config_cache)" >&2
if ! (cd "$PROJ" && npm install "${NPM_FLAGS[@]}" >"$RUN/warm.log" 2>&1); then
    if [ "$SHORT" = 1 ]; then
        echo "$NAME: registry unreachable; --short falls back to a locally packed package" >&2
        # shellcheck disable=SC2015  # any failing step of the chain ends in the error branch
        mkdir -p "$RUN/pkg" && (cd "$RUN/pkg" &&
            printf '{"name":"keel-npm-tiny","version":"1.0.0","main":"index.js"}\n' >package.json &&
            echo 'module.exports = 42;' >index.js && npm pack --silent >/dev/null) &&
            printf '{"name":"keel-npm-bench","version":"1.0.0","private":true,"dependencies":{"keel-npm-tiny":"file:%s"}}\n' \
                "$RUN/pkg/keel-npm-tiny-1.0.0.tgz" >"$PROJ/package.json" &&
            rm -rf "$PROJ/node_modules" "$PROJ/package-lock.json" &&
            (cd "$PROJ" && npm install --offline "${NPM_FLAGS[@]}" >"$RUN/warm.log" 2>&1) ||
            { tail -n 20 "$RUN/warm.log" >&2; exit 1; }
    else
        echo "$NAME: warming install failed:" >&2
        tail -n 20 "$RUN/warm.log" >&2
        exit 1
    fi
fi
NFILES=$(find "$PROJ/node_modules" -type f | wc -l)
NPKGS=$(node -e 'console.log(Object.keys(require(process.argv[1]).packages).length - 1)' \
    "$PROJ/package-lock.json")
NBYTES=$(du -sb "$PROJ/node_modules" | cut -f1)
rm -rf "$PROJ/node_modules"

setup_targets "${TARGETS[@]}"
[ ${#READY[@]} -gt 0 ] || exit 1
HEADER=$RUN/header
{
    echo "# npm-bench $(date -u +%FT%TZ) npm $(npm --version) node $(node --version) reps=$REPS short=$SHORT"
    echo "# project: $(tr -d '\n ' <"$PROJ/package.json" | grep -o '"dependencies.*' | tr -d '{}"')"
    echo "# installs ~$NPKGS packages, $NFILES files, $((NBYTES >> 20)) MiB"
    describe_targets
} >"$HEADER"
cat "$HEADER"
echo

# run_one TARGET REP -> prints "seconds<TAB>keel peak RSS KiB or -", or returns 1
run_one() {
    local t=$1 d=${ROOT[$1]}/r$2 pid=${KEEL_PID[$1]:-}
    rm -rf "$d" && mkdir "$d" && cp "$PROJ/package.json" "$PROJ/package-lock.json" "$d/" || return 1
    sync
    [ -z "$pid" ] || reset_hwm "$pid"
    local t0 t1 rc
    t0=$EPOCHREALTIME
    (cd "$d" && npm install "${NPM_FLAGS[@]}") >"$RUN/last.out" 2>&1
    rc=$?
    t1=$EPOCHREALTIME
    local hwm=-
    [ -z "$pid" ] || hwm=$(vmhwm "$pid")
    if [ "$rc" != 0 ]; then
        echo "FAILED: npm install on $t (exit $rc):" >&2
        tail -n 5 "$RUN/last.out" >&2
        return 1
    fi
    if ! target_alive "$t"; then
        echo "FAILED: npm install on $t: its filesystem is gone (daemon stopped or killed)" >&2
        return 1
    fi
    local n
    n=$(find "$d/node_modules" -type f | wc -l)
    if [ "$n" != "$NFILES" ]; then
        echo "FAILED: npm install on $t installed $n files, expected $NFILES" >&2
        return 1
    fi
    rm -rf "$d"
    awk -v a="$t0" -v b="$t1" -v h="$hwm" 'BEGIN { printf "%.2f\t%s\n", b - a, h }'
}

SAMPLES=$RUN/samples.tsv
: >"$SAMPLES"
for ((rep = 0; rep < REPS; rep++)); do
    echo "$NAME: repetition $((rep + 1))/$REPS" >&2
    for t in $(shuf -e "${READY[@]}"); do
        if r=$(run_one "$t" "$rep"); then
            printf '%s\t%s\n' "$t" "$r" >>"$SAMPLES"
        else
            printf '%s\tFAILED\t-\n' "$t" >>"$SAMPLES"
            FAILED=1
        fi
    done
done
for t in keel keel-wb; do
    [ -n "${KEEL_PID[$t]:-}" ] || continue
    echo "# $t daemon after the run: VmRSS $(($(vmrss "${KEEL_PID[$t]}") >> 10)) MiB" >>"$HEADER"
done

python3 - "$SAMPLES" "${READY[@]}" <<'EOF'
import statistics, sys
samples, targets = sys.argv[1], sys.argv[2:]
data, hwm, failed = {}, {}, set()
for line in open(samples):
    t, s, h = line.rstrip("\n").split("\t")
    if s == "FAILED":
        failed.add(t)
        continue
    data.setdefault(t, []).append(float(s))
    if h != "-":
        hwm.setdefault(t, []).append(int(h))
med = {t: statistics.median(v) for t, v in data.items() if t not in failed}
keels = [k for k in ("keel", "keel-wb", "dir") if k in targets]
bases = [b for b in ("ext4", "tmpfs", "juicefs") if b in targets]
pairs = [(k, b) for k in keels for b in bases if not (k == "dir" and b != "ext4")]
head = ["npm install"] + [f"{t} s" for t in targets] + [f"{k}/{b}" for k, b in pairs]
print("| " + " | ".join(head) + " |")
print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
cells = ["median"] + [f"{med[t]:.2f}" if t in med else "FAILED" for t in targets]
cells += [f"{med[k] / med[b]:.2f}x" if k in med and b in med else "-" for k, b in pairs]
print("| " + " | ".join(cells) + " |")
cells = ["min–max"] + [f"{min(data[t]):.2f}–{max(data[t]):.2f}" if t in data else "-"
                       for t in targets] + [""] * len(pairs)
print("| " + " | ".join(cells) + " |")
for k in keels:
    if k in hwm:
        print(f"\n{k} daemon peak RSS during an install (VmHWM, max over {len(hwm[k])} installs): "
              f"{max(hwm[k]) / 1024:.1f} MiB (per install: "
              + ", ".join(f"{h / 1024:.1f}" for h in hwm[k]) + " MiB)")
EOF
sed -n '/daemon after the run/p' "$HEADER"
if [ -n "$OUT" ]; then
    { cat "$HEADER"; cat "$SAMPLES"; } >"$OUT"
fi
exit "$FAILED"

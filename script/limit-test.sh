#!/usr/bin/env bash
# limit-test: the real image under a real memory limit (issue 43 item 6). For each --memory
# (default 256m and 512m, swap off so the limit binds), one container runs, as its main
# command, an install: a tarball shaped like a large node_modules (the `npm ci` of a
# monorepo: 30,606 files, 866 MB; npm's own work is extracting such tarballs) extracted into
# /workspace. Then, through `podman exec` (keel's CLI on its sockets, as an agent harness
# would): 100,000 files, a 30,000-level directory chain, snapshot create, diff (CLI, and
# GET /diff on the control socket), a rollback of 1,000 changed files, a full checkpoint, gc,
# fsck, stop; then a fresh state volume restores from the remote (a volume of its own) and
# the files are checked. Every step must succeed (or fail with its one-line error, which
# counts as a failure here: none is expected), the container's memory cgroup must report no
# OOM kill (`oom_kill` in memory.events, v2, or memory.oom_control, v1), and keel's budget
# must be the one derived from the limit. Prints one row per step with keel's peak RSS
# (VmHWM of keel, reset before the step from the host, and RSS sampled every 0.1 s: keel
# resets VmHWM itself at each operation it measures) and the container's cgroup peak where
# the kernel keeps one; exits non-zero when any step failed.
#
# usage: script/limit-test.sh [--ci] [--memory SIZE]...
#   --ci           the CI-sized form: an install of 6,000 files / 150 MB, 20,000 files, the
#                  30,000-level chain, 256m only (a few minutes)
#   --memory SIZE  a limit to run under (repeatable; default 256m 512m)
# env: KEEL_IMAGE (default localhost/keel:budget), KEEL_BIN (default target/release/keel),
#      KEEL_LIMIT_NO_BUILD=1 use the image as it is.
# Needs root, podman (runc), /dev/fuse, python3.
# shellcheck disable=SC2016  # commands for the containers expand inside them
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=script/lib.sh
. "$repo/script/lib.sh"
set +e

ci=0 memories=()
while [ $# -gt 0 ]; do
    case $1 in
        --ci) ci=1 ;;
        --memory) memories+=("$2"); shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "limit-test: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
if [ ${#memories[@]} -eq 0 ]; then
    if [ $ci = 1 ]; then memories=(256m); else memories=(256m 512m); fi
fi
if [ $ci = 1 ]; then
    install_files=6000 install_bytes=150000000 many=20000
else
    install_files=30606 install_bytes=866000000 many=100000
fi
depth=30000

[ "$(id -u)" = 0 ] || { echo "limit-test: needs root" >&2; exit 1; }
need_tools podman python3
setup_podman_env
image="${KEEL_IMAGE:-localhost/keel:budget}"
bin="${KEEL_BIN:-$repo/target/release/keel}"
prefix="keel-limit-$$"
tmp="$(mktemp -d /tmp/keel-limit.XXXXXX)"
chmod 755 "$tmp"
SAMPLER=""

cleanup() {
    local c v
    [ -z "$SAMPLER" ] || kill "$SAMPLER" 2>/dev/null
    for c in $(pm ps -a --filter "name=^$prefix-" --format '{{.Names}}' 2>/dev/null); do
        pm rm -f -v -t 0 "$c" >/dev/null 2>&1
    done
    for v in $(pm volume ls --filter "name=^$prefix-" --format '{{.Name}}' 2>/dev/null); do
        pm volume rm -f "$v" >/dev/null 2>&1
    done
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "${KEEL_LIMIT_NO_BUILD:-0}" != 1 ]; then
    t0=$(date +%s)
    "$repo/script/build-image" --quiet --tag "$image" --bin "$bin" >"$tmp/build.log" 2>&1 \
        || { cat "$tmp/build.log"; echo "limit-test: image build failed"; exit 1; }
    echo "# image $image built in $(( $(date +%s) - t0 ))s"
fi

# The install: a tarball of a node_modules-shaped tree (packages of 2-40 files, most under
# 12 KiB, some of 16-160 KiB, a few of 2-12 MiB; random bytes, fixed seed).
python3 - "$tmp/install.tar" "$install_files" "$install_bytes" <<'EOF'
import io, os, random, sys, tarfile
out, n, target = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = random.Random(43)
sizes = []
for _ in range(n):
    x = r.random()
    sizes.append(r.randint(2 << 20, 12 << 20) if x < 0.003 else
                 r.randint(16 << 10, 160 << 10) if x < 0.14 else r.randint(200, 12 << 10))
scale = target / sum(sizes)
sizes = [max(1, int(s * scale)) for s in sizes]
blob = os.urandom(16 << 20)
with tarfile.open(out, "w") as t:
    i = pkg = 0
    while i < n:
        pkg += 1
        base = f"node_modules/p{pkg:05d}/lib/sub{pkg % 3}"
        for j in range(min(r.randint(2, 40), n - i)):
            s = sizes[i]; off = r.randrange(0, len(blob) - min(s, len(blob)) + 1)
            data = (blob[off:] + blob)[:s] if s > len(blob) - off else blob[off:off + s]
            if len(data) < s:
                data = (data * (s // max(1, len(data)) + 1))[:s]
            ti = tarfile.TarInfo(f"{base}/f{j}.js"); ti.size = s; ti.mode = 0o644
            t.addfile(ti, io.BytesIO(data)); i += 1
EOF
[ -s "$tmp/install.tar" ] || { echo "limit-test: cannot build the install tarball"; exit 1; }

cat >"$tmp/limit.toml" <<'EOF'
# config/config.toml's defaults, with the remote on a volume of its own (so a fresh state
# volume restores from it) and stop budgets that fit a large final checkpoint.
[persist]
remote = "file:///remote"
flush_timeout = "5m"
[shutdown]
grace = "5s"
flush_timeout = "5m"
EOF

keel_flags=(--device /dev/fuse --cap-add SYS_ADMIN)
if [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)" = Y ]; then
    keel_flags+=(--security-opt apparmor=unconfined)
fi
[ -d /run/systemd/system ] || keel_flags+=(--no-healthcheck)

kib() { awk -v k="$2:" '$1 == k {print $2}' "/proc/$1/status" 2>/dev/null; }

# The memory cgroup of a host pid: "v2 DIR" or "v1 DIR".
memcg() {
    local l
    l=$(grep -E '^[0-9]+:([^:]*,)?memory(,[^:]*)?:' "/proc/$1/cgroup")
    if [ -n "$l" ]; then echo "v1 /sys/fs/cgroup/memory${l##*:}"; return; fi
    l=$(grep '^0::' "/proc/$1/cgroup")
    echo "v2 /sys/fs/cgroup${l#0::}"
}
oom_kills() {   # oom_kills "vN DIR"
    local v=${1%% *} d=${1#* }
    if [ "$v" = v2 ]; then awk '$1 == "oom_kill" {print $2}' "$d/memory.events" 2>/dev/null
    else awk '$1 == "oom_kill" {print $2}' "$d/memory.oom_control" 2>/dev/null; fi
}
cg_peak_mib() {
    local v=${1%% *} d=${1#* } f
    if [ "$v" = v2 ]; then f=$d/memory.peak; else f=$d/memory.max_usage_in_bytes; fi
    [ -r "$f" ] && echo $(( $(cat "$f") >> 20 )) || echo "-"
}
cg_reset_peak() {
    local v=${1%% *} d=${1#* }
    [ "$v" = v1 ] && [ -w "$d/memory.max_usage_in_bytes" ] && echo 0 >"$d/memory.max_usage_in_bytes"
}

ROWS=() FAILED=0
row() { ROWS+=("| $1 | $2 | $3 | $4 | $5 | $6 |"); echo "$1 $2: $3 (${4}s, keel peak $5 MiB, container $6 MiB)"; }

# step MEM NAME CMD...: runs CMD (on the host), measuring keel (host pid $KPID).
step() {
    local mem=$1 name=$2; shift 2
    local out="$tmp/$mem-${name//[^A-Za-z0-9]/_}.out" t0 t1 rc hwm sampled ok kills
    [ ! -e "/proc/$KPID" ] || echo 5 >"/proc/$KPID/clear_refs"
    cg_reset_peak "$CG"
    rm -f "$tmp/samples"
    ( while kill -0 "$KPID" 2>/dev/null; do kib "$KPID" VmRSS >>"$tmp/samples"; sleep 0.1; done ) &
    SAMPLER=$!
    t0=$(date +%s.%N)
    "$@" >"$out" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    hwm=$(kib "$KPID" VmHWM)
    kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null; SAMPLER=""
    sampled=$(sort -n "$tmp/samples" 2>/dev/null | tail -1)
    hwm=$(( ( ${hwm:-0} > ${sampled:-0} ? ${hwm:-0} : ${sampled:-0} ) >> 10 ))
    [ "$hwm" != 0 ] || hwm=-   # keel was not running (fsck runs in a container of its own)
    kills=$(oom_kills "$CG")
    ok=ok
    if [ "$rc" != 0 ]; then ok="FAILED (exit $rc: $(tail -n 1 "$out" | cut -c1-160))"; FAILED=$((FAILED + 1)); fi
    if [ "${kills:-0}" != 0 ]; then ok="$ok; OOM kills: $kills"; FAILED=$((FAILED + 1)); fi
    row "$mem" "$name" "$ok" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')" "$hwm" "$(cg_peak_mib "$CG")"
}

ex() { pm exec "$C" "$@"; }
wait_file() {   # wait_file PATH: until it exists in the container (the main command's mark)
    local i
    for i in $(seq 1 36000); do
        ex test -e "$1" && return 0
        pm container exists "$C" && [ "$(pm inspect -f '{{.State.Running}}' "$C")" = true ] || return 1
        sleep 0.1
    done
    return 1
}
run_container() {   # run_container NAME STATEVOL MEM CMD: podman run -d
    local name=$1 vol=$2 mem=$3; shift 3
    pm run -d --name "$name" --memory "$mem" --memory-swap "$mem" "${keel_flags[@]}" \
        -v "$vol:/var/lib/keel" -v "$prefix-$mem-remote:/remote" \
        -v "$tmp/install.tar:/data/install.tar:ro" -v "$tmp/limit.toml:/etc/keel/limit.toml:ro" \
        -e KEEL_CONFIG=/etc/keel/limit.toml "$image" "$@" >/dev/null
}
ready() {   # until keel answers on its socket
    local i
    for i in $(seq 1 3000); do
        ex keel status 2>/dev/null | grep -q '"mounted": true' && return 0
        sleep 0.1
    done
    return 1
}

for mem in "${memories[@]}"; do
    C="$prefix-$mem"
    echo "## --memory $mem"
    run_container "$C" "$prefix-$mem-state" "$mem" \
        sh -c 'mkdir -p /workspace/app && tar -xf /data/install.tar -C /workspace/app && touch /tmp/installed && exec sleep infinity' \
        || { echo "cannot start the container"; FAILED=$((FAILED + 1)); continue; }
    KPID=$(pm inspect -f '{{.State.Pid}}' "$C")
    CG=$(memcg "$KPID")
    step "$mem" "install ($install_files files, $((install_bytes / 1000000)) MB)" wait_file /tmp/installed
    budget=$(ex keel status | python3 -c 'import json,sys; print(json.load(sys.stdin)["memory"]["budget"])')
    echo "# keel's budget: $budget"
    want=$(( $(numfmt --from=iec "${mem^^}") / 4 ))
    [ $want -lt $((32 << 20)) ] && want=$((32 << 20))
    case "$budget" in
        "$((want >> 20)) MiB "*) ;;
        *) row "$mem" "budget from the limit" "FAILED (want $((want >> 20)) MiB: $budget)" 0 - -; FAILED=$((FAILED + 1)) ;;
    esac
    ex keel snapshot create --name installed >/dev/null
    step "$mem" "$many files" ex sh -c "mkdir /workspace/many && cd /workspace/many && seq 1 $many | split -l 1 -a 6 -d - f"
    # One directory at a time, each made relative to the one above (perl-base is in every
    # Debian image): what a sandbox user does to make one in seconds.
    step "$mem" "$depth-level chain" ex perl -e "chdir '/workspace' or die; for (1..$depth) { mkdir 'd' or die \"mkdir: \$!\"; chdir 'd' or die \"chdir: \$!\" }"
    step "$mem" "snapshot create" ex keel snapshot create --name after
    step "$mem" "diff (CLI)" ex sh -c 'keel diff installed after | tail -n 1 | grep -q " added, "'
    step "$mem" "diff (GET /diff)" ex sh -c 'code=$(curl -s -o /dev/null -w "%{http_code}" --unix-socket /run/keel/control.sock "http://keel/diff?from=installed&to=after"); [ "$code" = 200 ] || { echo "GET /diff: $code"; exit 1; }'
    ex sh -c 'keel snapshot create --name r0 >/dev/null && cd /workspace/many && for i in $(seq -w 0 999); do echo changed > f000$i; done'
    step "$mem" "rollback of 1,000 files" ex sh -c 'keel rollback r0 && [ "$(cat /workspace/many/f000000)" = 1 ] && [ "$(cat /workspace/many/f000999)" = 1000 ]'
    step "$mem" "full checkpoint" ex keel checkpoint --full
    step "$mem" "gc" ex keel gc
    step "$mem" "stop" pm stop -t 600 "$C"
    oom=$(pm inspect -f '{{.State.OOMKilled}}' "$C")
    [ "$oom" = false ] || { row "$mem" "container OOM-killed" "FAILED" 0 - -; FAILED=$((FAILED + 1)); }
    grep -q "final checkpoint" <(pm logs "$C" 2>&1) || { row "$mem" "final checkpoint" "FAILED (not in keel's log)" 0 - -; FAILED=$((FAILED + 1)); }
    pm logs "$C" >"$tmp/$mem.log" 2>&1
    pm rm -f "$C" >/dev/null
    # fsck checks a stopped state dir: in a container of its own under the same limit (its
    # peak is the container's; an OOM kill would be its exit status 137).
    step "$mem" "fsck (stopped state dir)" pm run --rm --name "$prefix-$mem-fsck" --memory "$mem" \
        --memory-swap "$mem" -v "$prefix-$mem-state:/var/lib/keel" -v "$prefix-$mem-remote:/remote" \
        -v "$tmp/limit.toml:/etc/keel/limit.toml:ro" -e KEEL_CONFIG=/etc/keel/limit.toml \
        --entrypoint /usr/local/bin/keel "$image" fsck --state /var/lib/keel

    # A new host: a fresh state volume, the same remote.
    C="$prefix-$mem-restored"
    run_container "$C" "$prefix-$mem-fresh" "$mem" sh -c 'exec sleep infinity' \
        || { echo "cannot start the restored container"; FAILED=$((FAILED + 1)); continue; }
    KPID=$(pm inspect -f '{{.State.Pid}}' "$C")
    CG=$(memcg "$KPID")
    step "$mem" "fresh-volume restore" ready
    step "$mem" "restored files checked" ex sh -c "[ \$(find /workspace/app -type f | wc -l) = $install_files ] && [ \$(ls /workspace/many | wc -l) = $many ] && [ \"\$(cat /workspace/many/f000500)\" = 501 ] && cat /workspace/app/node_modules/p00001/lib/sub1/f0.js | wc -c"
    step "$mem" "stop (restored)" pm stop -t 600 "$C"
    pm rm -f "$C" >/dev/null
    pm volume rm -f "$prefix-$mem-state" "$prefix-$mem-fresh" "$prefix-$mem-remote" >/dev/null 2>&1
done

echo
echo "# limit-test: keel $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?') in $image; $(nproc) CPUs; $([ $ci = 1 ] && echo 'CI size' || echo 'full size')"
echo
echo "| --memory | step | result | seconds | keel peak MiB | container peak MiB |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo
if [ "$FAILED" = 0 ]; then echo "limit-test: every step passed, no OOM kill"; else echo "limit-test: $FAILED failed"; exit 1; fi

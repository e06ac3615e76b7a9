#!/usr/bin/env bash
# The platform lifecycle, end to end: keel deployed as a Cloudflare Containers-style instance
# (config/cloudflare.toml) with moto as the S3 API that R2 speaks, and on Kubernetes
# (deploy/kubernetes/, through `podman kube play`). Like the platform, this script starts the
# image with an empty local disk every time (no state volume), waits for GET /health on the
# control port, sends SIGTERM to stop it (SIGKILL after the grace), and starts a new container
# for the same id, which must restore. Prints one line per case (with its figures) and a
# closing `N passed, M failed`; exits non-zero when any case failed. Nothing is skipped.
#
# usage: ci/platform-e2e.sh [CASE...]     (default: all; --list names them)
# env:   KEEL_IMAGE (default localhost/keel:e2e, the image ci/e2e.sh builds)
#        KEEL_PLATFORM_NO_BUILD=1 (or KEEL_E2E_NO_BUILD=1) reuse the image as it is
#        KEEL_E2E_BIN=PATH put this keel binary in the image when building it
#        KEEL_PLATFORM_SIZE=ci|full  workspace of time_to_usable: ci (default) 20,000 files and
#            256 MiB; full 100,000 files and 2 GiB (the issue's size, for BENCHMARKS.md)
# Needs root, podman (runc), /dev/fuse, python3 and moto_server (pip install "moto[server]").
#
# The profile is used as shipped except for what a test on one machine must change, printed
# at the start: allow_http (moto speaks http), a 5 s checkpoint interval (30 s shipped), and
# [shutdown] grace 5 s / flush_timeout 40 s (30 s / 10 m shipped), so that a stop and a
# failed final checkpoint fit into minutes.
# Commands for the containers are single-quoted on purpose: they expand inside them.
# shellcheck disable=SC2016
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=script/lib.sh
. "$repo/script/lib.sh"
set +e   # lib.sh is errexit-friendly; the cases check every status themselves

CASES=(lifecycle no_credentials_in_sandbox five_instances sigkill_restores_last_checkpoint
       same_id_waits_for_lease remote_down_at_stop time_to_usable kube_play kube_play_restricted
       memory_limit)

if [ "${1:-}" = --list ]; then printf '%s\n' "${CASES[@]}"; exit 0; fi
selected=("$@")
[ ${#selected[@]} -gt 0 ] || selected=("${CASES[@]}")

image="${KEEL_IMAGE:-localhost/keel:e2e}"
size="${KEEL_PLATFORM_SIZE:-ci}"
case "$size" in ci|full) ;; *) echo "KEEL_PLATFORM_SIZE=$size: not ci or full"; echo "0 passed, 1 failed"; exit 1 ;; esac
prefix="keel-plat-$$"
tmp="$(mktemp -d /tmp/keel-platform.XXXXXX)"
chmod 755 "$tmp"
bucket="keel-platform"
token="platform-e2e-control-token"
passed=0 failed=0
failed_names=()
MOTO_PID="" PROXY_PID=""

need_tools podman
setup_podman_env

cleanup() {
    local c v p
    for p in $(pm pod ps --filter "name=^$prefix-" --format '{{.Name}}' 2>/dev/null); do
        pm pod rm -f -t 0 "$p" >/dev/null 2>&1
    done
    for c in $(pm ps -a --filter "name=^$prefix-" --format '{{.Names}}' 2>/dev/null); do
        pm rm -f -v -t 0 "$c" >/dev/null 2>&1
    done
    for v in $(pm volume ls --filter "name=^$prefix-" --format '{{.Name}}' 2>/dev/null); do
        pm volume rm -f "$v" >/dev/null 2>&1
    done
    pm secret rm "$prefix-r2" >/dev/null 2>&1
    [ -z "$PROXY_PID" ] || kill "$PROXY_PID" 2>/dev/null
    [ -z "$MOTO_PID" ] || kill "$MOTO_PID" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "${KEEL_PLATFORM_NO_BUILD:-${KEEL_E2E_NO_BUILD:-0}}" != 1 ]; then
    e2e_build_image "$image" "$tmp/build.log" || exit 1
fi
if ! pm image exists "$image"; then
    echo "no image $image (build it with script/build-image, or run without KEEL_PLATFORM_NO_BUILD)"
    echo "0 passed, 1 failed"
    exit 1
fi

keel_flags=(--device /dev/fuse --cap-add SYS_ADMIN)
if [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)" = Y ]; then
    keel_flags+=(--security-opt apparmor=unconfined)
fi
[ -d /run/systemd/system ] || keel_flags+=(--no-healthcheck)

# --- helpers ------------------------------------------------------------------------------------
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

CASE_ERR=""
fail() { CASE_ERR="${CASE_ERR:+$CASE_ERR; }$*"; }
say() { echo "    $*"; }
show() {   # show FILE LABEL [LINES]
    [ -s "$1" ] || return 0
    echo "    --- $2"
    tail -n "${3:-30}" "$1" | sed -e 's/^/    | /'
}

# moto, the S3 API R2 speaks, with its request log (every GET counted by time_to_usable).
if ! command -v moto_server >/dev/null 2>&1; then
    echo "moto_server is missing (pip install \"moto[server]\")"; echo "0 passed, 1 failed"; exit 1
fi
if ! start_moto "$tmp/moto.log"; then
    echo "moto_server did not start"; cat "$tmp/moto.log"; echo "0 passed, 1 failed"; exit 1
fi
moto_port=$MOTO_PORT
if ! curl -s -f -X PUT "http://127.0.0.1:$moto_port/$bucket" >/dev/null; then
    echo "cannot create the bucket on moto"; cat "$tmp/moto.log"; echo "0 passed, 1 failed"; exit 1
fi

# The profile under test, with the changes a test on one machine needs (printed).
profile() {   # profile OUT [INTERVAL] [FLUSH_TIMEOUT]
    sed -e '/^\[persist\]/a allow_http = true' \
        -e "s/^interval = .*/interval = \"${2:-5s}\"/" \
        -e 's/^grace = .*/grace = "5s"/' \
        -e "s/^flush_timeout = .*/flush_timeout = \"${3:-40s}\"/" \
        "$repo/config/cloudflare.toml" >"$1"
}
profile "$tmp/platform.toml"
echo "# config/cloudflare.toml as shipped, except: $(diff "$repo/config/cloudflare.toml" "$tmp/platform.toml" | sed -n 's/^> //p' | paste -sd, - | sed 's/,/, /g')"
echo "# moto (as R2) on 127.0.0.1:$moto_port, bucket $bucket"

# A TCP relay in front of moto, which remote_down_at_stop kills to cut the remote off.
cat >"$tmp/relay.py" <<'EOF'
import socket, sys, threading
lport, tport = int(sys.argv[1]), int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", lport)); srv.listen(64)
def pipe(a, b):
    try:
        while (d := a.recv(65536)):
            b.sendall(d)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
while True:
    c, _ = srv.accept()
    u = socket.create_connection(("127.0.0.1", tport))
    threading.Thread(target=pipe, args=(c, u), daemon=True).start()
    threading.Thread(target=pipe, args=(u, c), daemon=True).start()
EOF

# The workloads, run by keel as the container's main command (mounted at /platform).
cat >"$tmp/workload.sh" <<'EOF'
#!/bin/sh
# workload.sh MODE [ARGS]: the main command of the test instances, in /workspace.
set -e
cd /workspace
# What the sandbox sees of keel's credentials: names only, never values.
env | sed -n 's/^\(AWS_[A-Z_]*\|GOOGLE_[A-Z_]*\|AZURE_[A-Z_]*\|KEEL_CONTROL_TOKEN\)=.*/LEAKED \1/p'
mode=$1; shift
case "$mode" in
idle)
    echo READY
    exec sleep infinity ;;
full)
    git clone -q /origin.git repo
    cd repo
    echo "a change on top" >> README
    git add -A
    git -c user.name=keel -c user.email=keel@example.invalid commit -qm "on top of the clone"
    cd ..
    mkdir small
    (cd small && seq 1 10000 | split -l 1 -a 5 -d - f)
    head -c 200M /dev/urandom > big.bin
    mkdir -p tree/a/b
    echo hello > tree/hello
    ln -s ../hello tree/a/link
    ln tree/hello tree/hardlink
    echo suid > tree/setuid; chmod 4755 tree/setuid
    echo secret > tree/private; chmod 0600 tree/private
    chown 1000:1000 tree/a/b; echo owned > tree/a/b/owned; chown 1000:1000 tree/a/b/owned
    mkfifo tree/fifo
    touch -h -d "2021-03-04 05:06:07" tree/a/link
    touch -d "2020-01-02 03:04:05" tree/hello tree/a/b/owned
    chmod 0750 tree/a
    # Held open and dirty at stop by the main command itself, which ignores SIGTERM: keel
    # SIGKILLs it when [shutdown] grace ends, then pushes what it wrote.
    trap '' TERM
    exec 3> held-open.log
    i=0; while [ $i -lt 2000 ]; do echo "line $i, written before the stop" >&3; i=$((i + 1)); done
    echo READY
    # The last 1000 lines come right before the stop (after /tmp/dirty): dirty at SIGTERM.
    while [ ! -e /tmp/dirty ]; do sleep 0.05; done
    while [ $i -lt 3000 ]; do echo "line $i, written before the stop" >&3; i=$((i + 1)); done
    echo DIRTY
    exec sleep infinity ;;
own)   # own ID: a tree that says whose it is
    mkdir own
    echo "$1" > own/id
    (cd own && seq 1 300 | sed "s/^/$1 /" | split -l 1 -a 3 -d - f)
    head -c 3M /dev/urandom > own/blob
    echo READY
    exec sleep infinity ;;
phases)   # phase 1, READY1, then (after /tmp/go) phase 2 and READY2
    mkdir -p p1; seq 1 200 | (cd p1 && split -l 1 -a 3 -d - f)
    head -c 2M /dev/urandom > p1/blob
    echo READY1
    while [ ! -e /tmp/go ]; do sleep 0.1; done
    mkdir p2; seq 1 100 | (cd p2 && split -l 1 -a 3 -d - f)
    head -c 1M /dev/urandom > p2/blob
    echo "changed after the checkpoint" >> p1/f000
    rm p1/f001
    echo READY2
    exec sleep infinity ;;
ticks)   # a line with the time every 0.1 s, each append closed (visible at once)
    echo READY
    while :; do echo "tick $(date +%s.%N)" >> ticks.log; sleep 0.1; done ;;
bulk)   # bulk FILES MIB: FILES small files in dirs of 1000, MIB MiB in 64 MiB files, probes
    n=$1 mib=$2 d=0
    mkdir many
    while [ $((d * 1000)) -lt "$n" ]; do
        mkdir many/d$d
        seq $((d * 1000 + 1)) $(((d + 1) * 1000)) | (cd many/d$d && split -l 1 -a 3 -d - f)
        d=$((d + 1))
    done
    mkdir data; i=0
    while [ $((i * 64)) -lt "$mib" ]; do head -c 64M /dev/urandom > data/part$i; i=$((i + 1)); done
    head -c 2M /dev/urandom > probe-4-chunks.bin
    head -c 100K /dev/urandom > probe-1-chunk.bin
    echo READY
    exec sleep infinity ;;
*) echo "workload.sh: unknown mode $mode" >&2; exit 2 ;;
esac
EOF
chmod 755 "$tmp/workload.sh"

# start NAME ID PORT [PODMAN ARGS...] -- WORKLOAD ARGS...: an instance as the platform starts
# it: the profile, the variables the Worker sets, no state volume (an anonymous one, dropped
# with the container), moto on the host network.
start() {
    local name=$1 id=$2 port=$3; shift 3
    local extra=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do extra+=("$1"); shift; done
    shift
    pm run -d --name "$name" --network host "${keel_flags[@]}" \
        -e KEEL_CONFIG=/etc/keel/platform.toml -v "${CONFIG:-$tmp/platform.toml}:/etc/keel/platform.toml:ro" \
        -e KEEL_WORKSPACE_ID="$id" -e R2_BUCKET="$bucket" \
        -e R2_ENDPOINT="http://127.0.0.1:${ENDPOINT_PORT:-$moto_port}" -e KEEL_CONTROL_PORT="$port" \
        -e KEEL_CONTROL_TOKEN="$token" -e AWS_ACCESS_KEY_ID=platform-e2e-key-id \
        -e AWS_SECRET_ACCESS_KEY=platform-e2e-secret-key -e AWS_REGION=auto \
        -v "$tmp/workload.sh:/platform/workload.sh:ro" -v "$tmp/origin.git:/origin.git:ro" \
        "${extra[@]}" "$image" /platform/workload.sh "$@" >/dev/null 2>"$tmp/$name.run.err"
}
# health PORT: the code of GET /health (000 when nothing listens).
health() { curl -s -o /dev/null -m 2 -w '%{http_code}' "http://127.0.0.1:$1/health"; }
# wait_health NAME PORT [SECS]: until /health is 200; prints the seconds it took.
wait_health() {
    local name=$1 port=$2 secs=${3:-90} t0 i
    t0=$(now)
    for ((i = 0; i < secs * 20; i++)); do
        [ "$(health "$port")" = 200 ] && { elapsed "$t0" "$(now)"; return 0; }
        if [ "$(pm inspect -f '{{.State.Running}}' "$name" 2>/dev/null)" != true ]; then
            fail "$name exited before /health was 200 (status $(pm inspect -f '{{.State.ExitCode}}' "$name" 2>/dev/null))"
            pm logs "$name" >"$tmp/$name.log" 2>&1; show "$tmp/$name.log" "$name"
            return 1
        fi
        sleep 0.05
    done
    fail "$name: /health not 200 after ${secs}s"
    return 1
}
# wait_line NAME LINE [SECS]: until the container's log has LINE.
wait_line() {
    local name=$1 line=$2 secs=${3:-120} i logs
    for ((i = 0; i < secs * 10; i++)); do
        logs=$(pm logs "$name" 2>&1)
        grep -qx -- "$line" <<<"$logs" && return 0
        if [ "$(pm inspect -f '{{.State.Running}}' "$name" 2>/dev/null)" != true ]; then
            fail "$name exited before $line"
            pm logs "$name" >"$tmp/$name.log" 2>&1; show "$tmp/$name.log" "$name"
            return 1
        fi
        sleep 0.1
    done
    fail "$name: no $line after ${secs}s"
    pm logs "$name" >"$tmp/$name.log" 2>&1; show "$tmp/$name.log" "$name"
    return 1
}
root_of() { echo "/proc/$(pm inspect -f '{{.State.Pid}}' "$1")/root/workspace"; }
# manifest NAME OUT: ci/tree-manifest.py of the container's /workspace, read on the host
# through /proc/PID/root (the image has no python or getfattr).
manifest() { python3 "$repo/ci/tree-manifest.py" "$(root_of "$1")" "${@:3}" >"$2"; }
checkpoint() {   # checkpoint PORT: POST /checkpoint; prints the answer
    curl -s -m 600 -X POST -H "Authorization: Bearer $token" "http://127.0.0.1:$1/checkpoint"
}
# stop NAME GRACE: the platform's stop: SIGTERM, SIGKILL after GRACE s; prints the seconds.
stop() {
    local t0; t0=$(now)
    pm stop -t "$2" "$1" >/dev/null 2>&1
    elapsed "$t0" "$(now)"
}
stop_all() {   # stop_all GRACE NAME...: the platform stops them all at once
    local g=$1 n pids=(); shift
    for n in "$@"; do pm stop -t "$g" "$n" >/dev/null 2>&1 & pids+=($!); done
    wait "${pids[@]}"
}
same() {   # same WANT GOT LABEL: trees identical, else fail with the first differences
    if ! diff "$1" "$2" >"$tmp/diff"; then
        fail "$3: trees differ ($(grep -c '^[<>]' "$tmp/diff") lines)"
        show "$tmp/diff" "diff $3 (< before, > after)" 20
        return 1
    fi
}
final_line() {   # the final checkpoint's report in a stopped container's log
    grep -E 'checkpoint|did not reach' "$1" | tail -n 1 | sed -e 's/^.*keel: *//' | cut -c1-220
}
gets() { grep -c "\"GET /$bucket/$1/chunks/" "$tmp/moto.log"; }
rm_c() { pm rm -f -v -t 0 "$@" >/dev/null 2>&1; }

# A local repository for `git clone`.
git init -q --bare "$tmp/origin.git"
(
    set -e
    w="$tmp/origin-work"; git init -q "$w"; cd "$w"
    echo "keel platform e2e" > README; mkdir src; seq 1 500 > src/numbers
    git add -A; git -c user.name=t -c user.email=t@example.invalid commit -qm first
    echo more >> README; git -c user.name=t -c user.email=t@example.invalid commit -qam second
    git push -q "$tmp/origin.git" HEAD:refs/heads/main
) || { echo "cannot create the origin repository"; echo "0 passed, 1 failed"; exit 1; }
git -C "$tmp/origin.git" symbolic-ref HEAD refs/heads/main

# --- cases --------------------------------------------------------------------------------------

# The whole lifecycle: empty disk, /health, workload, SIGTERM (SIGKILL after the grace for the
# main command that ignores it), a new container for the same id restores an identical tree.
case_lifecycle() {
    local id="life-$$" a="$prefix-life-a" b="$prefix-life-b" port t st e
    port=$(free_port)
    profile "$tmp/life.toml" 30s   # the shipped interval: the final checkpoint does the work
    CONFIG="$tmp/life.toml" start "$a" "$id" "$port" -- full || { fail "start"; show "$tmp/$a.run.err" podman; return; }
    t=$(wait_health "$a" "$port") || return
    say "first instance: /health 200 ${t}s after podman run -d returned"
    wait_line "$a" READY 300 || return
    python3 - "$(root_of "$a")" <<'EOF' || { fail "cannot set xattrs"; return; }
import os, sys
r = sys.argv[1]
os.setxattr(r + "/tree/hello", "user.keel.note", b"kept across instances")
os.setxattr(r + "/tree/a", "user.keel.dir", b"\x00\x01binary")
os.setxattr(r + "/big.bin", "user.big", b"x" * 3000)
EOF
    manifest "$a" "$tmp/life.before" held-open.log || { fail "manifest before"; return; }
    pm exec "$a" touch /tmp/dirty
    wait_line "$a" DIRTY 60 || return
    e=$(stop "$a" 120)
    st=$(pm inspect -f '{{.State.ExitCode}}' "$a")
    pm logs "$a" >"$tmp/life-a.log" 2>&1
    say "SIGTERM → exit $st after ${e}s (grace 5s, then SIGKILL of the main command); $(final_line "$tmp/life-a.log")"
    [ "$st" = 137 ] || fail "exit status $st, want 137 (the main command ignores SIGTERM, SIGKILLed at the grace)"
    grep -q 'did not reach' "$tmp/life-a.log" && fail "the final checkpoint did not push everything"
    rm_c "$a"
    CONFIG="$tmp/life.toml" start "$b" "$id" "$port" -- idle || { fail "start b"; return; }
    t=$(wait_health "$b" "$port") || return
    say "new instance, same id, empty disk: /health 200 after ${t}s; $(pm logs "$b" 2>&1 | grep -m1 -iE 'restor' | sed 's/^.*keel: *//' | cut -c1-160)"
    manifest "$b" "$tmp/life.after" held-open.log || { fail "manifest after"; return; }
    same "$tmp/life.before" "$tmp/life.after" "restored" &&
        say "byte-identical: $(wc -l <"$tmp/life.before") entries (modes, owners, links, xattrs, mtimes, sha256)"
    pm exec "$b" sh -c 'cd /workspace/repo && git fsck --no-progress --strict >&2 && git log --format=%s -1' >"$tmp/git.out" 2>&1 \
        || { fail "git fsck in the restored clone failed"; show "$tmp/git.out" git; }
    grep -qx "on top of the clone" "$tmp/git.out" || fail "the commit on top is missing"
    local want got
    want=$(seq 0 2999 | sed 's/.*/line &, written before the stop/' | sha256sum | cut -c1-64)
    got=$(sha256sum <"$(root_of "$b")/held-open.log" | cut -c1-64)
    [ "$want" = "$got" ] || fail "the file held open and dirty at stop differs: $(wc -l <"$(root_of "$b")/held-open.log") lines, want 3000"
    stop "$b" 60 >/dev/null
    rm_c "$b"
}

# The sandbox (the main command) gets none of keel's credentials.
case_no_credentials_in_sandbox() {
    local c="$prefix-creds" port leaked
    port=$(free_port)
    start "$c" "creds-$$" "$port" -- idle || { fail "start"; return; }
    wait_health "$c" "$port" >/dev/null || return
    wait_line "$c" READY 60 || return
    leaked=$(pm logs "$c" 2>/dev/null | sed -n 's/^LEAKED //p' | paste -sd' ' -)
    [ -z "$leaked" ] || fail "in the main command's environment: $leaked"
    stop "$c" 30 >/dev/null
    rm_c "$c"
}

# Five instances with different ids in one bucket at once: each restores its own tree.
case_five_instances() {
    local k ids=() ports=() t0
    for k in 1 2 3 4 5; do
        ids+=("five-$$-$k"); ports+=("$(free_port)")
        start "$prefix-five-$k" "${ids[-1]}" "${ports[-1]}" -- own "${ids[-1]}" || { fail "start $k"; return; }
    done
    for k in 0 1 2 3 4; do
        wait_health "$prefix-five-$((k + 1))" "${ports[$k]}" >/dev/null || return
        wait_line "$prefix-five-$((k + 1))" READY 120 || return
        manifest "$prefix-five-$((k + 1))" "$tmp/five-$k.before" || fail "manifest $k"
    done
    t0=$(now)
    stop_all 60 "$prefix-five-"{1..5}
    say "5 instances stopped together in $(elapsed "$t0" "$(now)")s"
    for k in 1 2 3 4 5; do rm_c "$prefix-five-$k"; done
    for k in 1 2 3 4 5; do
        start "$prefix-five-r$k" "${ids[$((k - 1))]}" "${ports[$((k - 1))]}" -- idle || { fail "restart $k"; return; }
    done
    for k in 0 1 2 3 4; do
        wait_health "$prefix-five-r$((k + 1))" "${ports[$k]}" >/dev/null || return
        manifest "$prefix-five-r$((k + 1))" "$tmp/five-$k.after" || fail "manifest after $k"
        same "$tmp/five-$k.before" "$tmp/five-$k.after" "instance ${ids[$k]}"
        [ "$(cat "$(root_of "$prefix-five-r$((k + 1))")/own/id")" = "${ids[$k]}" ] || fail "${ids[$k]} restored another's tree"
        [ "$(grep -c '' "$tmp/five-$k.after")" = "$(grep -c '' "$tmp/five-0.after")" ] || fail "${ids[$k]}: extra or missing entries"
    done
    [ -n "$CASE_ERR" ] || say "5 ids, 5 trees of $(wc -l <"$tmp/five-0.after") entries, each restored as its own"
    stop_all 30 "$prefix-five-r"{1..5}
    for k in 1 2 3 4 5; do rm_c "$prefix-five-r$k"; done
}

# SIGKILL without SIGTERM: the next instance sees exactly the last checkpoint. (a) with
# checkpoints on demand only: the tree of POST /checkpoint, not what came after it; (b) with
# the 5 s interval and a writer appending the time every 0.1 s: the loss window, printed.
case_sigkill_restores_last_checkpoint() {
    local id="kill-$$" a="$prefix-kill-a" b="$prefix-kill-b" port r t
    port=$(free_port)
    profile "$tmp/ondemand.toml" 0s
    CONFIG="$tmp/ondemand.toml" start "$a" "$id" "$port" -- phases || { fail "start"; return; }
    wait_health "$a" "$port" >/dev/null || return
    wait_line "$a" READY1 60 || return
    r=$(checkpoint "$port"); say "checkpoint: $(echo "$r" | tr -d '\n' | cut -c1-160)"
    manifest "$a" "$tmp/kill.checkpointed" || { fail "manifest"; return; }
    pm exec "$a" touch /tmp/go
    wait_line "$a" READY2 60 || return
    manifest "$a" "$tmp/kill.dirty"
    pm kill -s KILL "$a" >/dev/null 2>&1
    pm wait "$a" >/dev/null 2>&1
    rm_c "$a"
    CONFIG="$tmp/ondemand.toml" start "$b" "$id" "$port" -- idle || { fail "start b"; return; }
    t=$(wait_health "$b" "$port" 120) || return
    say "after SIGKILL: /health 200 after ${t}s ($(pm logs "$b" 2>&1 | grep -m1 'lease held by' | sed 's/^.*keel: *//' | cut -c1-120 || true))"
    manifest "$b" "$tmp/kill.after"
    same "$tmp/kill.checkpointed" "$tmp/kill.after" "after SIGKILL vs the last checkpoint" &&
        say "exactly the last checkpoint: $(wc -l <"$tmp/kill.after") entries; the $(diff "$tmp/kill.checkpointed" "$tmp/kill.dirty" | grep -c '^>') changed entries after it are gone"
    stop "$b" 30 >/dev/null; rm_c "$b"

    # (b) the loss window with interval checkpoints.
    id="rpo-$$"; a="$prefix-rpo-a"; b="$prefix-rpo-b"
    start "$a" "$id" "$port" -- ticks || { fail "start rpo"; return; }
    wait_health "$a" "$port" >/dev/null || return
    local i last_ck=""
    for ((i = 0; i < 600; i++)); do   # until two interval checkpoints happened
        [ "$(pm logs "$a" 2>&1 | grep -c 'checkpoint.*report')" -ge 2 ] && break
        sleep 0.1
    done
    sleep 2.5
    local tk; tk=$(now)
    pm kill -s KILL "$a" >/dev/null 2>&1
    pm wait "$a" >/dev/null 2>&1
    last_ck=$(pm logs "$a" 2>&1 | grep 'checkpoint.*report' | tail -n 1 | sed 's/^.*keel: *//' | cut -c1-160)
    rm_c "$a"
    start "$b" "$id" "$port" -- idle || { fail "start rpo b"; return; }
    wait_health "$b" "$port" 120 >/dev/null || return
    local f; f="$(root_of "$b")/ticks.log"
    if [ ! -s "$f" ]; then
        fail "no ticks restored after two interval checkpoints"
    else
        local n tl
        n=$(grep -c '' "$f"); tl=$(tail -n 1 "$f" | awk '{ print $2 }')
        grep -vqE '^tick [0-9]+\.[0-9]+$' "$f" && fail "torn or foreign lines in the restored ticks.log"
        say "SIGKILL with interval = 5s: $n ticks restored, loss window $(elapsed "$tl" "$tk")s (last checkpoint: $last_ck)"
    fi
    stop "$b" 30 >/dev/null; rm_c "$b"
}

# Two containers with one id: the second waits for the lease (one line naming the holder)
# and, once the first has stopped, restores everything the first wrote.
case_same_id_waits_for_lease() {
    local id="lease-$$" a="$prefix-lease-a" b="$prefix-lease-b" pa pb i line t
    pa=$(free_port); pb=$(free_port)
    start "$a" "$id" "$pa" -- own "$id" || { fail "start a"; return; }
    wait_health "$a" "$pa" >/dev/null || return
    wait_line "$a" READY 60 || return
    manifest "$a" "$tmp/lease.a"
    start "$b" "$id" "$pb" -- idle || { fail "start b"; return; }
    for ((i = 0; i < 200; i++)); do
        line=$(pm logs "$b" 2>&1 | grep -m1 'lease held by')
        [ -n "$line" ] && break
        sleep 0.1
    done
    if [ -z "$line" ]; then
        fail "the second container does not say who holds the lease"
        pm logs "$b" >"$tmp/lease-b.log" 2>&1; show "$tmp/lease-b.log" second
        return
    fi
    say "second: $(sed 's/^.*keel: *//' <<<"$line" | cut -c1-170)"
    [ "$(health "$pb")" = 200 ] && fail "the second container is healthy while the first holds the lease"
    t=$(stop "$a" 60)
    say "first stopped (SIGTERM) in ${t}s"
    t=$(wait_health "$b" "$pb" 60) || return
    say "second: /health 200 ${t}s after the first stopped"
    manifest "$b" "$tmp/lease.b"
    same "$tmp/lease.a" "$tmp/lease.b" "second vs first"
    stop "$b" 30 >/dev/null; rm_c "$a" "$b"
}

# The remote is unreachable at stop: keel retries within its budget and its last line says
# what was not pushed; the next start with the remote back has every checkpointed file.
case_remote_down_at_stop() {
    local id="down-$$" a="$prefix-down-a" b="$prefix-down-b" port rport r e last i
    port=$(free_port); rport=$(free_port)
    python3 "$tmp/relay.py" "$rport" "$moto_port" & PROXY_PID=$!
    for ((i = 0; i < 1200; i++)); do curl -s -o /dev/null "http://127.0.0.1:$rport/" && break; sleep 0.1; done
    # flush_timeout 40 s (final checkpoint budget 30 s): in front of the final checkpoint the
    # lease renewal retries for up to lease_ttl (15 s) against the dead remote; with a budget
    # shorter than that, keel's stop can run out of time before it reports what was not
    # pushed (seen with 12 s: the last line then only says the flush did not finish).
    profile "$tmp/down.toml" 0s 40s
    ENDPOINT_PORT=$rport CONFIG="$tmp/down.toml" start "$a" "$id" "$port" -- phases || { fail "start"; return; }
    wait_health "$a" "$port" >/dev/null || return
    wait_line "$a" READY1 60 || return
    r=$(checkpoint "$port")
    manifest "$a" "$tmp/down.checkpointed"
    pm exec "$a" touch /tmp/go
    wait_line "$a" READY2 60 || return
    kill "$PROXY_PID"; wait "$PROXY_PID" 2>/dev/null; PROXY_PID=""
    e=$(stop "$a" 120)
    pm logs "$a" >"$tmp/down-a.log" 2>&1
    last=$(grep -v '^$' "$tmp/down-a.log" | tail -n 1)
    say "remote down at stop: exit $(pm inspect -f '{{.State.ExitCode}}' "$a") after ${e}s (final checkpoint budget 30s of flush_timeout 40s)"
    say "last line: $(sed 's/^.*keel: *//' <<<"$last" | cut -c1-200)"
    say "retried: $(grep -oE 'gave up after [0-9]+ tries[^)]*' "$tmp/down-a.log" | sort | uniq -c | sed 's/^ *//' | paste -sd';' -)"
    grep -q 'did not reach the remote' <<<"$last" || fail "the last line does not say what was not pushed"
    rm_c "$a"
    python3 "$tmp/relay.py" "$rport" "$moto_port" & PROXY_PID=$!
    for ((i = 0; i < 1200; i++)); do curl -s -o /dev/null "http://127.0.0.1:$rport/" && break; sleep 0.1; done
    ENDPOINT_PORT=$rport CONFIG="$tmp/down.toml" start "$b" "$id" "$port" -- idle || { fail "start b"; return; }
    wait_health "$b" "$port" 120 >/dev/null || return
    manifest "$b" "$tmp/down.after"
    same "$tmp/down.checkpointed" "$tmp/down.after" "remote back vs the last checkpoint" &&
        say "remote back: the last checkpoint ($(wc -l <"$tmp/down.after") entries) restored, nothing lost"
    stop "$b" 30 >/dev/null; rm_c "$b"
    kill "$PROXY_PID"; wait "$PROXY_PID" 2>/dev/null; PROXY_PID=""
}

# A new instance of a big workspace answers /health 200 with /workspace usable in well under
# a second (lazy restore), and the first read of a file not yet local costs at most one GET
# per chunk it touches (moto's request log).
case_time_to_usable() {
    local id="ttu-$$" a="$prefix-ttu-a" b="$prefix-ttu-b" port files mib t0 th tu r g0 g1 g2 tready
    if [ "$size" = full ]; then files=100000 mib=2048; else files=20000 mib=256; fi
    port=$(free_port)
    profile "$tmp/ttu.toml" 0s 5m
    CONFIG="$tmp/ttu.toml" start "$a" "$id" "$port" -- bulk "$files" "$mib" || { fail "start"; return; }
    wait_health "$a" "$port" >/dev/null || return
    t0=$(now)
    wait_line "$a" READY 1800 || return
    say "wrote $files files + $mib MiB in $(elapsed "$t0" "$(now)")s"
    t0=$(now); r=$(checkpoint "$port")
    say "checkpoint of it: $(elapsed "$t0" "$(now)")s: $(echo "$r" | tr -d '\n' | cut -c1-150)"
    stop "$a" 600 >/dev/null; rm_c "$a"
    t0=$(now)
    CONFIG="$tmp/ttu.toml" start "$b" "$id" "$port" -- idle || { fail "start b"; return; }
    for ((;;)); do [ "$(health "$port")" = 200 ] && break; [ "$(elapsed "$t0" "$(now)" | cut -d. -f1)" -lt 120 ] || break; sleep 0.01; done
    th=$(elapsed "$t0" "$(now)")
    [ "$(health "$port")" = 200 ] || { fail "/health not 200 after 120s"; return; }
    local root; root=$(root_of "$b")
    [ "$(cat "$root/many/d0/f000")" = 1 ] && ls "$root/many/d$(( files / 1000 - 1 ))" >/dev/null || fail "workspace not usable"
    tu=$(elapsed "$t0" "$(now)")
    tready=$(pm logs "$b" 2>&1 | grep -m1 'ready after' | sed -E 's/.*ready after ([0-9.]+s).*/\1/')
    say "time to usable ($files files, $mib MiB): /health 200 ${th}s after podman run (keel: ready after $tready), a file read and a listing ${tu}s"
    say "$(pm logs "$b" 2>&1 | grep -m1 'restored snapshot' | sed 's/^.*keel: *//' | cut -c1-200)"
    g0=$(gets "$id")
    cat "$root/probe-4-chunks.bin" >/dev/null || fail "read probe-4-chunks.bin"
    g1=$(gets "$id")
    cat "$root/probe-1-chunk.bin" >/dev/null || fail "read probe-1-chunk.bin"
    g2=$(gets "$id")
    say "first read, 2 MiB file (4 chunks): $((g1 - g0)) GETs; 100 KiB file (1 chunk): $((g2 - g1)) GETs"
    [ $((g1 - g0)) -le 4 ] || fail "$((g1 - g0)) GETs for a file of 4 chunks"
    [ $((g2 - g1)) -le 1 ] || fail "$((g2 - g1)) GETs for a file of 1 chunk"
    [ $((g1 - g0)) -ge 1 ] || fail "no GET at all for a file that was not local (not restored lazily?)"
    stop "$b" 60 >/dev/null; rm_c "$b"
}

# deploy/kubernetes/keel.yaml through `podman kube play`: see ci/kube-e2e.sh.
case_kube_play() { kube_e2e keel.yaml kube; }

# deploy/kubernetes/keel-restricted.yaml (restricted Pod Security: no SYS_ADMIN, no
# /dev/fuse, a non-root user; keel runs the dir provider): the same checks.
case_kube_play_restricted() { kube_e2e keel-restricted.yaml kube-r; }

kube_e2e() {   # kube_e2e MANIFEST NAME
    KEEL_IMAGE="$image" MOTO_PORT="$moto_port" BUCKET="$bucket" PREFIX="$prefix-$2" \
        KEEL_KUBE_MANIFEST="$repo/deploy/kubernetes/$1" \
        bash "$repo/ci/kube-e2e.sh" >"$tmp/$2.out" 2>&1
    local rc=$?
    sed -n 's/^info: /    /p' "$tmp/$2.out"
    if [ "$rc" != 0 ]; then
        fail "$(grep '^error: ' "$tmp/$2.out" | sed 's/^error: //' | paste -sd';' - | cut -c1-400)"
        show "$tmp/$2.out" "kube-e2e ($1)" 40
    fi
}

# The image under `--memory 256m` (script/limit-test.sh --ci: an install of 6,000 files /
# 150 MB as the main command, 20,000 files, a 30,000-level chain, snapshot, diff by CLI and
# API, rollback of 1,000 files, full checkpoint, gc, fsck, stop, fresh-volume restore): every
# step passes and the container's memory cgroup counts no OOM kill.
case_memory_limit() {
    KEEL_IMAGE="$image" KEEL_LIMIT_NO_BUILD=1 bash "$repo/script/limit-test.sh" --ci \
        >"$tmp/limit.out" 2>&1
    local rc=$?
    grep '^| 256m' "$tmp/limit.out" | sed 's/^/    /'
    if [ "$rc" != 0 ]; then
        fail "$(grep -E 'FAILED|limit-test:' "$tmp/limit.out" | paste -sd';' - | cut -c1-400)"
        show "$tmp/limit.out" "limit-test --ci" 40
    fi
}

# --- main ---------------------------------------------------------------------------------------
T0=$(now)
for name in "${selected[@]}"; do
    if ! declare -F "case_$name" >/dev/null; then
        echo "FAIL $name: no such case (see --list)"; failed=$((failed + 1)); failed_names+=("$name"); continue
    fi
    CASE_ERR=""
    t0=$(now)
    echo "-- $name"
    "case_$name"
    if [ -z "$CASE_ERR" ]; then
        echo "ok   $name ($(elapsed "$t0" "$(now)")s)"; passed=$((passed + 1))
    else
        echo "FAIL $name: $CASE_ERR"; failed=$((failed + 1)); failed_names+=("$name")
    fi
done

echo "# total $(elapsed "$T0" "$(now)")s"
[ ${#failed_names[@]} -eq 0 ] || echo "# failed: ${failed_names[*]}"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]

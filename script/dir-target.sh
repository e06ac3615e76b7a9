# shellcheck shell=bash
# The `dir` benchmark target (issue 42), sourced by script/fs-bench.sh and script/bench-lib.sh:
# `keel run` (not PID 1: a child subreaper) with [workspace] provider = "dir" and a main
# command that only waits, so the workspace is a plain directory on the state volume (RUN,
# under BENCH_DIR: the same disk as the ext4 target) and periodic checkpoints (the default
# interval; inotify narrows their walk) run to a `file://` remote beside it while the
# scenarios run. RUN/dir is the symlink keel makes to the tree. Stopped by SIGTERM (final walk
# and checkpoint), which must exit 0. Caller sets REPO, RUN, NAME, KEEL_BIN.

DIR_PID=

# start_dir_target -> 0 once the main command runs (the workspace is ready)
start_dir_target() {
    [ -x "$KEEL_BIN" ] || { echo "$NAME: no keel at $KEEL_BIN" >&2; return 1; }
    mkdir -p "$RUN/dir-remote"
    cat >"$RUN/dir.toml" <<TOML
[workspace]
provider = "dir"
mount_point = "$RUN/dir"
state_dir = "$RUN/dir-state"
[persist]
remote = "file://$RUN/dir-remote"
TOML
    # It exits 0 on SIGTERM, so keel run's status (the main command's) says whether the stop
    # (final walk and checkpoint) worked.
    "$KEEL_BIN" run --config "$RUN/dir.toml" -- \
        sh -c "trap 'exit 0' TERM; touch '$RUN/dir.ready'; sleep infinity & wait" \
        >"$RUN/dir.log" 2>&1 &
    DIR_PID=$!
    local i
    for i in $(seq 1200); do
        [ -e "$RUN/dir.ready" ] && return 0
        kill -0 "$DIR_PID" 2>/dev/null || break
        sleep 0.1
    done
    echo "$NAME: keel run (dir) did not come up:" >&2
    tail -n 20 "$RUN/dir.log" >&2
    return 1
}

# stop_dir_target: SIGTERM, wait, say how many checkpoints ran; non-zero if keel failed
stop_dir_target() {
    [ -n "$DIR_PID" ] || return 0
    local rc=0
    kill -TERM "$DIR_PID" 2>/dev/null
    wait "$DIR_PID" || rc=$?
    DIR_PID=
    echo "$NAME: dir: $(grep -c 'checkpoint report=' "$RUN/dir.log") checkpoints while it ran (the last at the stop); keel run exited $rc" >&2
    [ "$rc" = 0 ] || { tail -n 20 "$RUN/dir.log" >&2; return 1; }
}

# dir_target_alive: keel run still runs
dir_target_alive() { [ -n "$DIR_PID" ] && kill -0 "$DIR_PID" 2>/dev/null; }

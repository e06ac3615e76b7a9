#!/usr/bin/env bash
# One differential run against a fresh keel mount, with remounts and kill -9 + remount:
#   ci/difftest-keel.sh WORKDIR SEED OPS [more ci/difftest.py options...]
# WORKDIR (created, must not exist or be empty) gets: state/, mnt/ (keel), ref/ (a tmpfs),
# ops.log (every operation), state.log (keel's log). KEEL_ARGS: extra `keel mount` options.
# Exit status: difftest's (0 identical, 1 diverged), or 3 if keel did not start/stop cleanly.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ $# -ge 3 ] || { sed -n '2,6p' "$0" >&2; exit 2; }
w=$1 seed=$2 ops=$3
shift 3
mkdir -p "$w/ref"
[ -z "$(ls -A "$w/ref")" ] || { echo "difftest-keel: $w/ref is not empty" >&2; exit 2; }
mount -t tmpfs -o size=2g,mode=755 keel-difftest-ref "$w/ref" || exit 3
trap 'umount "$w/ref" 2>/dev/null || umount -l "$w/ref"' EXIT
# shellcheck disable=SC2086
"$here/keelctl.sh" start "$w/state" "$w/mnt" ${KEEL_ARGS:-} || exit 3
q() { printf '%q' "$1"; }
python3 "$here/difftest.py" --seed "$seed" --ops "$ops" --log "$w/ops.log" \
    --remount-cmd "$(q "$here/keelctl.sh") remount $(q "$w/state") $(q "$w/mnt")" \
    --crash-cmd "$(q "$here/keelctl.sh") crash $(q "$w/state") $(q "$w/mnt")" \
    "$@" "$w/mnt/diff" "$w/ref/diff"
rc=$?
"$here/keelctl.sh" stop "$w/state" "$w/mnt" || rc=3
exit $rc

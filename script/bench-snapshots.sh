#!/bin/bash
# Named snapshot create, diff and live rollback on a workspace of N files (default 100,000):
# create after one file changed, diff of two snapshots 1,000 files apart, rollback of 1,000
# changed files. Prints the numbers; changes nothing outside its temp dir.
set -euo pipefail
N=${N:-100000}
KEEL=${KEEL:-$(dirname "$0")/../target/release/keel}
T=$(mktemp -d /tmp/keel-bench-snap.XXXXXX)
cleanup() { umount "$T/mnt" 2>/dev/null || umount -l "$T/mnt" 2>/dev/null || true; [ -n "${PID:-}" ] && wait "$PID" 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
mkdir -p "$T/mnt"
"$KEEL" mount --state "$T/state" "$T/mnt" >"$T/log" 2>&1 &
PID=$!
for _ in $(seq 100); do mountpoint -q "$T/mnt" && break; sleep 0.1; done
ms() { python3 -c 'import sys,json; v=json.load(sys.stdin); print(v["duration_ms"], "(full snapshot: compaction)" if "(full)" in v.get("checkpoint", "") else "")'; }
t0=$(date +%s.%N)
python3 - "$T/mnt" "$N" <<'P'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for d in range(n // 1000):
    os.makedirs(f"{root}/d{d}", exist_ok=True)
    for f in range(1000):
        with open(f"{root}/d{d}/f{f}.txt", "w") as h:
            h.write(f"file {d}/{f}\n" * 8)
P
echo "populate: $N files in $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s"
S="--state $T/state"
echo "first snapshot (full): $("$KEEL" snapshot create $S --name base --json | ms) ms"
echo changed >> "$T/mnt/d0/f0.txt"
for i in 1 2 3; do echo "create after 1 file changed: $("$KEEL" snapshot create $S --name one$i --json | ms) ms"; echo x$i >> "$T/mnt/d1/f$i.txt"; done
"$KEEL" snapshot create $S --name before --json >/dev/null
for f in $(seq 0 999); do echo "edit $f" >> "$T/mnt/d$((f % 100))/f$f.txt"; done
echo "create after 1,000 files changed: $("$KEEL" snapshot create $S --name after --json | ms) ms"
for i in 1 2 3; do
  s=$(date +%s%N); "$KEEL" diff before after $S --json > "$T/diff.json"; e=$(date +%s%N)
  python3 -c 'import sys,json; v=json.load(open(sys.argv[1])); print("diff before after: %d changes in %s ms in keel (%s), %s ms the whole CLI process" % (len(v["changes"]), v.get("duration_ms", "?"), v.get("trees", "?"), sys.argv[2]))' "$T/diff.json" $(( (e - s) / 1000000 ))
done
for i in 1 2; do
  "$KEEL" rollback before $S --json > "$T/rb.json"
  python3 -c 'import json; v=json.load(open("'"$T/rb.json"'")); a=v["applied"]; print("rollback of 1,000 changed files: %s ms total (checkpoint before %s, load trees %s, apply %s, checkpoint after %s; %s inodes, %s invalidations in %s ms)" % (v["duration_ms"], v["checkpoint_before_ms"], v["load_trees_ms"], v["apply_ms"], v["checkpoint_after_ms"], a["inodes"], a["invalidations"], a["invalidate_ms"]))'
  "$KEEL" rollback after $S --json >/dev/null
done
echo "keel RSS: $(ps -o rss= -p $PID) KiB; load average: $(cut -d' ' -f1-3 /proc/loadavg)"

#!/usr/bin/env bash
# The TypeScript client and the Worker's routes against a real `keel run` (FUSE workspace,
# control API on a loopback TCP port with a token): compiles test/client.test.ts with tsc
# (the packages `npm ci` installed) and runs it with node.
#
#   deploy/cloudflare/test/run.sh [KEEL_BIN]     (default: target/release/keel)
#
# Needs root and /dev/fuse (fails, never skips); `npm ci` first.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPO=$(cd "$HERE/../.." && pwd)
KEEL_BIN=${1:-${KEEL_BIN:-$REPO/target/release/keel}}
[ "$(id -u)" = 0 ] && [ -c /dev/fuse ] || { echo "client test: needs root and /dev/fuse" >&2; exit 1; }
[ -x "$KEEL_BIN" ] || { echo "client test: no keel at $KEEL_BIN" >&2; exit 1; }
command -v node >/dev/null || { echo "client test: node is missing" >&2; exit 1; }

D=$(mktemp -d /tmp/keel-client-test.XXXXXX)
KPID=
cleanup() {
    if [ -n "$KPID" ]; then kill -TERM "$KPID" 2>/dev/null; wait "$KPID" 2>/dev/null || true; fi
    mountpoint -q "$D/ws" && umount -l "$D/ws"
    rm -rf "$D"
}
trap cleanup EXIT
TOKEN="client-test-$$-$RANDOM$RANDOM"
cat >"$D/config.toml" <<EOF2
[workspace]
mount_point = "$D/ws"
state_dir = "$D/state"
[persist]
remote = "file://$D/remote"
[control]
listen = "127.0.0.1:0"
token = "$TOKEN"
socket = "$D/c.sock"
[shutdown]
grace = "2s"
EOF2
"$KEEL_BIN" run --config "$D/config.toml" -- sleep 100000 >"$D/keel.out" 2>"$D/keel.log" &
KPID=$!
for _ in $(seq 600); do grep -qs 'ready after' "$D/keel.log" && break; kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
grep -q 'ready after' "$D/keel.log" || { echo "client test: keel did not start:" >&2; cat "$D/keel.log" >&2; exit 1; }
ADDR=$(grep -o 'control API on http://[0-9.:]*' "$D/keel.log" | head -n1 | sed 's|.*http://||')

cd "$HERE"
rm -rf .test-build
npx --no-install tsc -p test
out=$(KEEL_URL="http://$ADDR" KEEL_TOKEN="$TOKEN" timeout 300 node .test-build/test/client.test.js 2>&1) || {
    echo "$out" >&2
    echo "--- keel's log" >&2; tail -n 30 "$D/keel.log" >&2
    exit 1
}
echo "$out"
echo "$out" | tail -n1 | grep -qE '^client test: [0-9]+ checks passed$'

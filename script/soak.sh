#!/usr/bin/env bash
# soak: the kill-anywhere soak (ci/soak.py). keel mount with an S3 remote (moto behind
# ci/faultproxy.py) under file writes, renames, appends, git commits and npm installs; keel
# SIGKILLed at random moments, inside checkpoints, gc, rollbacks, named snapshots, forks,
# lazy and eager restores, offline gc and restores, starts and stops; the remote answering
# 500, dropping connections, slow, or gone for up to a minute. After every kill: fsck
# clean, every fsync'd file intact, keel starts again, the remote restores equal to the
# last snapshot. Prints the kill points covered and the faults injected; exit 1 on any
# finding (its state dir and logs are kept under the work dir).
#
#   script/soak.sh --short                the test command's form: every scenario once (~5 min)
#   script/soak.sh [--kills 500] [--faults 100] [--minutes M] [--seed S] [--report FILE]
#                  [--keep-going] [--keep] [--scenarios a,b]   (ci/soak.py --help)
#
# Needs root, /dev/fuse, moto_server (pip install "moto[server]"), git, npm, python3, and a
# built keel (KEEL_BIN, default target/release/keel). Work dir: a new /tmp/soak-XXXXXX
# (removed when clean, unless --keep). Run the long form in the background at low priority:
#   nice -n 10 script/soak.sh --report /tmp/soak-report.md > /tmp/soak.log 2>&1 &
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export KEEL_BIN=${KEEL_BIN:-$REPO/target/release/keel}
exec python3 "$REPO/ci/soak.py" --keel "$KEEL_BIN" "$@"

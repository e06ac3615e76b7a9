#!/usr/bin/env bash
# run-fs-bench: script/fs-bench.sh inside the keel container image (podman): the workspace
# `/workspace` (served by keel as PID 1) against the container's own disk (its overlay root),
# plus a tmpfs in the container, in one interleaved run.
#
#   script/run-fs-bench.sh [--short] [--image IMAGE] [--build] [-- fs-bench options...]
#
#   --image IMAGE  keel image (default $KEEL_IMAGE or localhost/keel:latest, the tag
#                  script/build-image builds)
#   --build        run script/build-image first (--tag IMAGE --bin $KEEL_BIN when KEEL_BIN is set)
#   --short        fs-bench --short (CI)
#
# The keel image carries no npm/python3 (fs-bench needs them), so a bench image is derived from
# it (`FROM IMAGE` + apt-get install python3 npm, tagged localhost/keel-bench:<image id>, built
# once per keel image; containers here reach Debian's mirror). fs-bench and ci/keelctl.sh are
# mounted read-only from this checkout. fs-bench's `keel` target normally starts its own keel
# mount; here KEEL_BIN points at a shim that bind-mounts a fresh directory of /workspace on the
# target's mount point instead, so the `keel` column is the container's real /workspace (a bind
# mount adds no per-operation cost), the `ext4` column is the container's disk (BENCH_DIR under
# /var/tmp: overlayfs on the host's disk, fstype printed), `tmpfs` a tmpfs in the container.
# "cold read" drops the page cache of the scenario's own files (posix_fadvise, which works in
# the container too); the keel column's bind mount has no state dir here to evict.
# Output: fs-bench's table; exit status is fs-bench's (non-zero only if a scenario failed).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${KEEL_IMAGE:-localhost/keel:latest}
BUILD=0 FSARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --short) FSARGS+=(--short); shift ;;
        --image) IMAGE=$2; shift 2 ;;
        --build) BUILD=1; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        --) shift; FSARGS+=("$@"); break ;;
        *) FSARGS+=("$1"); shift ;;
    esac
done
repo=$REPO
# shellcheck source=script/lib.sh
. "$REPO/script/lib.sh"
need_tools podman || exit 1

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# podman settings for this machine (runc, ulimits within the hard limits): the image branch's
# ci/containers.conf when present, else the same two settings.
if [ -z "${CONTAINERS_CONF:-}" ]; then
    if [ -f "$REPO/ci/containers.conf" ]; then
        export CONTAINERS_CONF=$REPO/ci/containers.conf
    else
        printf '%s\n' '[containers]' 'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]' \
            '[engine]' 'runtime = "runc"' >"$TMP/containers.conf"
        export CONTAINERS_CONF=$TMP/containers.conf
    fi
fi

if [ "$BUILD" = 1 ]; then
    [ -x "$REPO/script/build-image" ] || { echo "run-fs-bench: no script/build-image" >&2; exit 1; }
    args=(--tag "$IMAGE" --quiet)
    [ -z "${KEEL_BIN:-}" ] || args+=(--bin "$KEEL_BIN")
    "$REPO/script/build-image" "${args[@]}" || exit 1
fi
ID=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null) ||
    { echo "run-fs-bench: no image $IMAGE (script/build-image builds it)" >&2; exit 1; }
BENCH_IMAGE=localhost/keel-bench:${ID:0:12}
if ! podman image exists "$BENCH_IMAGE"; then
    echo "run-fs-bench: building $BENCH_IMAGE from $IMAGE (python3, npm)" >&2
    printf '%s\n' "FROM $IMAGE" \
        'RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 npm && rm -rf /var/lib/apt/lists/*' \
        >"$TMP/Containerfile"
    podman build -q -t "$BENCH_IMAGE" -f "$TMP/Containerfile" "$TMP" >&2 ||
        { echo "run-fs-bench: cannot build $BENCH_IMAGE" >&2; exit 1; }
fi

# The image's config drops SYS_ADMIN from the main command; fs-bench needs it (tmpfs and bind
# mounts), so the image's own config.toml is used with drop_capabilities emptied.
CONFIG=()
if podman run --rm --entrypoint cat "$BENCH_IMAGE" /etc/keel/config.toml >"$TMP/config.toml" \
    2>/dev/null; then
    sed -i 's/^drop_capabilities *=.*/drop_capabilities = []/' "$TMP/config.toml"
    CONFIG=(-v "$TMP/config.toml:/etc/keel/config.toml:ro")
else
    echo "run-fs-bench: $IMAGE has no /etc/keel/config.toml (an older image?); using its defaults" >&2
fi

# The shim run by ci/keelctl.sh as "$KEEL_BIN mount --state STATE MNT": bind /workspace/DIR.
cat >"$TMP/workspace-shim" <<'EOF'
#!/bin/bash
# keelctl calls: SHIM mount --state STATE MNT [options]
mnt=$4
src=/workspace/.fs-bench/$(basename "$(dirname "$mnt")")
mkdir -p "$src" && mount --bind "$src" "$mnt" || exit 1
trap 'umount "$mnt"; rm -rf "$src"; exit 0' TERM INT
while :; do sleep 1 & wait $!; done
EOF
chmod 755 "$TMP/workspace-shim"

# The command inside the container (run as keel's main service, in /workspace).
cat >"$TMP/inside.sh" <<'EOF'
#!/bin/bash
set -u
echo "# container: $(findmnt -n -o SOURCE,FSTYPE,OPTIONS /workspace | cut -c1-160)"
echo "# container disk (/var/tmp): $(findmnt -n -o FSTYPE -T /var/tmp)"
cd /
export BENCH_DIR=/var/tmp/keel-bench KEEL_BIN=/bench/workspace-shim
/repo/script/fs-bench.sh "$@" keel ext4 tmpfs
EOF
chmod 755 "$TMP/inside.sh"

echo "# run-fs-bench: image $IMAGE ($ID), bench image $BENCH_IMAGE; keel = /workspace, ext4 = the container's disk"
# --shm-size: fs-bench keeps its sources (64 MiB of random data, a git repo) in /dev/shm,
# which podman limits to 64 MiB by default.
podman run --rm --device /dev/fuse --cap-add SYS_ADMIN --shm-size=1g \
    -v "$REPO/script:/repo/script:ro" -v "$REPO/ci:/repo/ci:ro" -v "$TMP:/bench:ro" \
    "${CONFIG[@]}" --no-healthcheck "$BENCH_IMAGE" /bench/inside.sh "${FSARGS[@]}"

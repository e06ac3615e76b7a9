#!/usr/bin/env bash
# Builds xfstests (fstests) from the project's source tarball into target/xfstests/, once per
# tarball: the build is keyed by the tarball's sha256 and reused while the tarball is unchanged.
# Prints the path of the built tree (where ./check lives) on stdout; build output goes to
# target/xfstests/build.log.
#
#   ci/xfstests/build.sh [TARBALL]     default: $XFSTESTS_TARBALL, else
#                                      ../shared/xfstests/xfstests-src.tar.gz (beside the
#                                      checkout or the main worktree), else /work/shared's
#
# Needs the Debian packages install_deps (script/test) installs; builds with make -j$(nproc).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
# From the project's root, ../shared/xfstests/; from a git worktree, the main checkout's.
tarball=${1:-${XFSTESTS_TARBALL:-}}
if [ -z "$tarball" ]; then
    tarball=$repo/../shared/xfstests/xfstests-src.tar.gz
    common=$(git -C "$repo" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
    if [ ! -f "$tarball" ] && [ -n "$common" ]; then
        tarball=$(dirname "$common")/../shared/xfstests/xfstests-src.tar.gz
    fi
    # A clone elsewhere (CI's clean checkout) on this kind of machine: the shared copy.
    [ -f "$tarball" ] || tarball=/work/shared/xfstests/xfstests-src.tar.gz
fi
[ -f "$tarball" ] || { echo "xfstests: no source tarball at $tarball" >&2; exit 1; }
tarball=$(realpath "$tarball")
out=$repo/target/xfstests
mkdir -p "$out"
sum=$(sha256sum "$tarball" | cut -c1-16)
dir=$out/$sum
if [ -f "$dir/.built" ]; then
    cat "$dir/.built"
    exit 0
fi
# Older builds (another tarball) and a half-finished one of this tarball go.
find "$out" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
mkdir -p "$dir"
log=$out/build.log
echo "xfstests: building $(basename "$tarball") ($sum) in $dir (log: $log)" >&2
tar -xzf "$tarball" -C "$dir"
top=$(find "$dir" -mindepth 1 -maxdepth 1 -type d | head -n 1)
[ -n "$top" ] && [ -f "$top/check" ] || { echo "xfstests: $tarball holds no ./check" >&2; exit 1; }
if ! (cd "$top" && make -j"$(nproc)") >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "xfstests: build failed (log: $log)" >&2
    exit 1
fi
[ -x "$top/src/fsstress" ] || [ -x "$top/ltp/fsstress" ] ||
    { echo "xfstests: the build left no fsstress binary" >&2; exit 1; }
echo "$top" >"$dir/.built"
echo "$top"

#!/usr/bin/env bash
# evict-cache: drop the page cache of the benchmarks' own files, and nothing else on the host.
#
#   script/evict-cache.sh DIR...
#
# `sync` (so no page is dirty), then posix_fadvise(POSIX_FADV_DONTNEED) on every regular file
# under each DIR (symlinks and other mounts' special files are skipped, files that vanish
# meanwhile are ignored). This replaces `echo 3 >/proc/sys/vm/drop_caches`, which empties
# every cache of the host: a benchmark writes no kernel setting. For keel pass its state dir
# too: with FUSE passthrough the pages of a read are the backing body file's, not the mount's.
set -euo pipefail
[ $# -gt 0 ] || { echo "evict-cache: usage: evict-cache.sh DIR..." >&2; exit 2; }
sync
exec python3 - "$@" <<'PYEOF'
import os, stat, sys
for top in sys.argv[1:]:
    if not os.path.isdir(top):
        sys.exit(f"evict-cache: {top}: not a directory")
    for d, _, files in os.walk(top):
        for f in files:
            p = os.path.join(d, f)
            try:
                if not stat.S_ISREG(os.lstat(p).st_mode):
                    continue
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except (FileNotFoundError, PermissionError):
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
PYEOF

#!/usr/bin/env python3
"""tree-manifest.py ROOT [SKIP...]: one line per entry of the tree under ROOT, sorted: path,
type, mode (set-ID bits included), owner, link count, size, mtime in ns, xattrs (hex values),
and the symlink target or the sha256 of the contents. Two trees are identical for the
platform tests (ci/platform-e2e.sh, ci/kube-e2e.sh) when their manifests are. SKIP: relative
paths left out (with everything below them). Directory link counts are left out (0)."""
import hashlib, os, stat, sys
root = sys.argv[1]
skip = set(sys.argv[2:])
out = []
def entry(rel, p):
    st = os.lstat(p)
    m = st.st_mode
    kind = "d" if stat.S_ISDIR(m) else "l" if stat.S_ISLNK(m) else "f" if stat.S_ISREG(m) else "p" if stat.S_ISFIFO(m) else "?"
    xs = []
    if kind != "l":
        for n in sorted(os.listxattr(p, follow_symlinks=False)):
            xs.append(n + "=" + os.getxattr(p, n, follow_symlinks=False).hex())
    extra = ""
    if kind == "l":
        extra = "-> " + os.readlink(p)
    elif kind == "f":
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while (b := f.read(1 << 20)):
                h.update(b)
        extra = h.hexdigest()
    size = st.st_size if kind in "fl" else 0
    out.append(f"{rel} {kind} {stat.S_IMODE(m):04o} {st.st_uid}:{st.st_gid} n{st.st_nlink if kind != 'd' else 0} s{size} t{st.st_mtime_ns} [{' '.join(xs)}] {extra}")
entry(".", root)
for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if os.path.relpath(os.path.join(d, x), root) not in skip)
    for n in sorted(dirs + files):
        p = os.path.join(d, n)
        rel = os.path.relpath(p, root)
        if rel in skip:
            continue
        entry(rel, p)
print("\n".join(sorted(out)))

#!/usr/bin/env python3
"""Differential filesystem test: one random operation sequence applied in lockstep to the
filesystem under test (A, e.g. a keel mount) and a reference (B, e.g. a tmpfs directory).

After every operation the results (return values, bytes read, errno names) must be equal; every
--check-every operations the whole trees are compared: names, file types, mode, uid, gid, nlink,
size, rdev, symlink targets, xattrs, file bytes, hard-link groups, and mtime. Timestamps are
compared without depending on timing: at each checkpoint every mtime is reset to a fixed old
sentinel, so afterwards an mtime is either an exact value an operation set explicitly (compared
exactly) or "changed since the checkpoint" (must have changed on both sides).

Optionally the tree under test is remounted (--remount-cmd, e.g. SIGTERM + mount again) or
crashed (--crash-cmd, e.g. kill -9 + mount again, after fsync of every file and directory); A is
then compared with itself before the restart, including exact mtime/ctime and inode numbers.

The sequence depends only on --seed and the reference's state, so a failure reproduces with the
same command line. Exit status 0 = identical, 1 = divergence (details on stderr), 2 = usage.

    ci/difftest.py --seed 1 --ops 3000 /mnt/keel/diff /mnt/tmpfs/diff
"""

import argparse
import ctypes
import ctypes.util
import errno
import hashlib
import os
import random
import shlex
import stat
import subprocess
import sys
import time

libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
XATTR_CREATE = os.XATTR_CREATE
XATTR_REPLACE = os.XATTR_REPLACE

# mtimes at or before this are explicit values set by the test; later ones mean "changed".
EXPLICIT_LIMIT_NS = 1_500_000_000 * 10**9
SENTINEL_NS = 1_000_000_000 * 10**9 + 123_456_789

NAMES = ["a", "b", "c", "d", "e", "f", "g", "h"]
XATTR_NAMES = ["user.a", "user.b", "user.c"]
MAX_FILE = 8 << 20
# Never block on a FIFO; special files are never opened (see Gen.special).
NB = os.O_NONBLOCK
FD_SLOTS = 4


OPS = ["create", "write", "read", "truncate", "mkdir", "rmdir", "unlink", "rename", "link",
       "symlink", "readlink", "chmod", "chown", "utimens", "setxattr", "removexattr", "getxattr",
       "fallocate", "copy_range", "mknod", "stat", "listdir", "open_keep", "fd_io", "fd_close",
       "fsync"]
OP_WEIGHTS = [8, 14, 6, 4, 5, 2, 4, 8, 3, 3, 1, 2, 2, 3, 3, 1, 1, 3, 2, 1, 2, 2, 3, 6, 2, 1]


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
libc.utimensat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(Timespec), ctypes.c_int]


def _check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def renameat2(src, dst, flags):
    _check(libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags),
           "renameat2")


def fallocate(fd, mode, off, length):
    _check(libc.fallocate(fd, mode, off, length), "fallocate")


def utimensat(path, atime_ns, mtime_ns, nofollow):
    """atime_ns/mtime_ns: an int, "now" or "omit"."""
    def ts(v):
        if v == "now":
            return Timespec(0, UTIME_NOW)
        if v == "omit":
            return Timespec(0, UTIME_OMIT)
        return Timespec(v // 10**9, v % 10**9)
    times = (Timespec * 2)(ts(atime_ns), ts(mtime_ns))
    _check(libc.utimensat(AT_FDCWD, os.fsencode(path), times,
                          AT_SYMLINK_NOFOLLOW if nofollow else 0), "utimensat")


def ename(e):
    return errno.errorcode.get(e, str(e))


class Divergence(Exception):
    pass


class Side:
    def __init__(self, name, root):
        self.name = name
        # Operations happen in TOP/root; snapshots cover TOP. A symlink "../x" moved to the top
        # of root resolves to TOP/x: the same place on both sides, and compared too.
        self.top = os.path.abspath(root)
        self.root = os.path.join(self.top, "root")
        self.fds = {}

    def p(self, rel):
        return os.path.join(self.root, rel) if rel else self.root

    def close_all(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def attempt(fn, side):
    try:
        return ("ok", fn(side))
    except OSError as e:
        return ("err", ename(e.errno))


# ---------------------------------------------------------------------------------------------
# Snapshots


def walk(root):
    """Sorted relative paths of every entry below root (not following symlinks)."""
    out = []
    stack = [""]
    while stack:
        rel = stack.pop()
        full = os.path.join(root, rel) if rel else root
        try:
            names = sorted(os.listdir(full))
        except OSError:
            continue
        for n in names:
            r = os.path.join(rel, n) if rel else n
            out.append(r)
            if stat.S_ISDIR(os.lstat(os.path.join(root, r)).st_mode):
                stack.append(r)
    return sorted(out)


def file_digest(path):
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            h.update(b)
    return h.hexdigest()[:16]


def mtime_class(ns):
    return ns if ns <= EXPLICIT_LIMIT_NS else "changed"


def snapshot(root, exact_times=False, with_ino=False):
    """path -> comparable metadata. Hard links are expressed as the group's first path."""
    snap = {}
    first_by_ino = {}
    for rel in [""] + walk(root):
        full = os.path.join(root, rel) if rel else root
        st = os.lstat(full)
        kind = stat.S_IFMT(st.st_mode)
        e = {
            "type": {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink",
                     stat.S_IFIFO: "fifo", stat.S_IFCHR: "chr", stat.S_IFBLK: "blk",
                     stat.S_IFSOCK: "sock"}.get(kind, kind),
            "mode": oct(stat.S_IMODE(st.st_mode)),
            "uid": st.st_uid,
            "gid": st.st_gid,
            "nlink": st.st_nlink,
        }
        if kind != stat.S_IFDIR:
            e["size"] = st.st_size
        if kind in (stat.S_IFCHR, stat.S_IFBLK):
            e["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if kind == stat.S_IFLNK:
            e["target"] = os.readlink(full)
        if kind == stat.S_IFREG:
            e["sha256"] = file_digest(full)
        if kind != stat.S_IFDIR:
            key = (st.st_dev, st.st_ino)
            e["linkgroup"] = first_by_ino.setdefault(key, rel)
        if exact_times:
            e["mtime"] = st.st_mtime_ns
            e["ctime"] = st.st_ctime_ns
        else:
            e["mtime"] = mtime_class(st.st_mtime_ns)
        if with_ino:
            e["ino"] = st.st_ino
        if kind in (stat.S_IFREG, stat.S_IFDIR):
            try:
                e["xattrs"] = {n: os.getxattr(full, n, follow_symlinks=False).hex()
                               for n in sorted(os.listxattr(full, follow_symlinks=False))
                               if n.startswith("user.")}
            except OSError as ex:
                e["xattrs"] = ename(ex.errno)
        snap[rel or "."] = e
    return snap


def diff_snapshots(sa, sb, la, lb):
    lines = []
    for path in sorted(set(sa) | set(sb)):
        ea, eb = sa.get(path), sb.get(path)
        if ea is None or eb is None:
            lines.append(f"  {path}: only in {la if eb is None else lb}")
            continue
        for k in sorted(set(ea) | set(eb)):
            if ea.get(k) != eb.get(k):
                lines.append(f"  {path}: {k}: {la}={ea.get(k)!r} {lb}={eb.get(k)!r}")
    return lines


def describe(desc, a, b):
    """lstat of every path named in an operation, on both sides, to help read a divergence."""
    lines = []
    for word in desc.split():
        rel = word.split("@")[0]
        if not rel or rel.startswith(("-", "(")) or "=" in rel or len(rel) > 300:
            continue
        for side in (a, b):
            try:
                st = os.lstat(side.p(rel))
                info = (f"{stat.filemode(st.st_mode)} nlink={st.st_nlink} size={st.st_size} "
                        f"ino={st.st_ino}")
            except OSError as e:
                info = ename(e.errno)
            lines.append(f"  now {side.name}: {rel}: {info}")
    return "\n".join(lines)


def reset_times(root):
    """Set every atime/mtime below root to the sentinel (timing-independent mtime checks)."""
    for rel in walk(root)[::-1] + [""]:
        utimensat(os.path.join(root, rel) if rel else root, SENTINEL_NS, SENTINEL_NS, True)


def fsync_tree(root):
    for rel in [""] + walk(root):
        full = os.path.join(root, rel) if rel else root
        st = os.lstat(full)
        if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
            fd = os.open(full, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------------------------------
# Operation generator: chooses from the reference side's current tree, so a seed reproduces.


class Gen:
    def __init__(self, rng, ref, disabled=()):
        self.rng = rng
        self.ref = ref
        self.disabled = set(disabled)

    def tree(self):
        entries = []
        for rel in walk(self.ref.root):
            entries.append((rel, stat.S_IFMT(os.lstat(self.ref.p(rel)).st_mode)))
        return entries

    def dirs(self, tree):
        return [""] + [r for r, k in tree if k == stat.S_IFDIR]

    def existing(self, tree, kinds=None):
        cand = [r for r, k in tree if kinds is None or k in kinds]
        return self.rng.choice(cand) if cand else None

    def new_path(self, tree):
        d = self.rng.choice(self.dirs(tree))
        return os.path.join(d, self.rng.choice(NAMES)) if d else self.rng.choice(NAMES)

    def path(self, tree, kinds=None):
        r = self.rng.random()
        if r < 0.02:
            return self.rng.choice(NAMES) + "x" * 255  # name > NAME_MAX
        if r < 0.05:
            f = self.existing(tree, (stat.S_IFREG,))
            if f:
                return f + "/" + self.rng.choice(NAMES)  # through a non-directory
        if r < 0.70:
            e = self.existing(tree, kinds)
            if e:
                return e
        return self.new_path(tree)

    def size_of(self, rel):
        try:
            return os.stat(self.ref.p(rel)).st_size
        except OSError:
            return 0

    def data(self):
        r = self.rng.random()
        n = (self.rng.randrange(0, 4097) if r < 0.7 else
             self.rng.randrange(0, 128 << 10) if r < 0.95 else self.rng.randrange(0, 1 << 20))
        return self.rng.randbytes(n)

    def offset(self, size):
        r = self.rng.random()
        if r < 0.3:
            return size
        if r < 0.7:
            return self.rng.randrange(0, size + 4097)
        return self.rng.randrange(0, 3 << 20)

    def special(self, rel):
        """True if opening rel would reach a FIFO, socket or device node (never opened)."""
        try:
            mode = os.stat(self.ref.p(rel)).st_mode
        except OSError:
            return False
        return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))

    def explicit_ns(self):
        return self.rng.randrange(10**18, EXPLICIT_LIMIT_NS)

    def op(self, tree):
        """Returns (description, fn(side) -> comparable result)."""
        desc, fn, opened = self._op(tree)
        if any(self.special(p) for p in opened):
            return f"(skipped: opens a special file) {desc}", lambda s: None
        return desc, fn

    def _op(self, tree):
        rng = self.rng
        kinds_file = (stat.S_IFREG,)
        ops, weights = zip(*[(o, w) for o, w in zip(OPS, OP_WEIGHTS) if o not in self.disabled])
        choice = rng.choices(ops, weights=weights)[0]

        if choice == "create":
            p = self.path(tree)
            flags = os.O_CREAT | os.O_WRONLY | rng.choice([0, os.O_EXCL, os.O_TRUNC])
            mode = rng.choice([0o644, 0o600, 0o755, 0o4755, 0o640])
            def f(s):
                fd = os.open(s.p(p), flags, mode)
                os.close(fd)
            return f"create {p} flags={flags:#o} mode={mode:#o}", f, [p]

        if choice == "write":
            p = self.path(tree, kinds_file)
            data = self.data()
            append = rng.random() < 0.15
            off = min(self.offset(self.size_of(p)), MAX_FILE - len(data))
            def f(s):
                fd = os.open(s.p(p), NB | os.O_WRONLY | (os.O_APPEND if append else 0))
                try:
                    n = os.write(fd, data) if append else os.pwrite(fd, data, off)
                    return n, os.fstat(fd).st_size
                finally:
                    os.close(fd)
            return f"write {p} off={off} len={len(data)} append={append}", f, [p]

        if choice == "read":
            p = self.path(tree, kinds_file)
            size = self.size_of(p)
            off = self.offset(size)
            n = rng.choice([1, 100, 4096, 65536, 1 << 20])
            def f(s):
                fd = os.open(s.p(p), NB | os.O_RDONLY)
                try:
                    return hashlib.sha256(os.pread(fd, n, off)).hexdigest()[:16]
                finally:
                    os.close(fd)
            return f"read {p} off={off} len={n}", f, [p]

        if choice == "truncate":
            p = self.path(tree, kinds_file)
            size = rng.choice([0, 1, 4095, 4096, 100000, self.rng.randrange(0, 4 << 20)])
            # Whether a truncate to the current size updates mtime is up to the filesystem
            # (POSIX: only "if the file size is changed"; ext4 does, tmpfs does not).
            if size == self.size_of(p):
                size += 1
            return f"truncate {p} {size}", lambda s: os.truncate(s.p(p), size), []

        if choice == "mkdir":
            p = self.path(tree)
            mode = rng.choice([0o755, 0o700, 0o1777, 0o2775])
            return f"mkdir {p} {mode:#o}", lambda s: os.mkdir(s.p(p), mode), []

        if choice == "rmdir":
            p = self.path(tree, (stat.S_IFDIR,))
            return f"rmdir {p}", lambda s: os.rmdir(s.p(p)), []

        if choice == "unlink":
            p = self.path(tree)
            return f"unlink {p}", lambda s: os.unlink(s.p(p)), []

        if choice == "rename":
            src = self.path(tree)
            dst = self.path(tree)
            flags = rng.choices([0, RENAME_NOREPLACE, RENAME_EXCHANGE], weights=[6, 2, 2])[0]
            return (f"rename {src} -> {dst} flags={flags}",
                    lambda s: renameat2(s.p(src), s.p(dst), flags), [])

        if choice == "link":
            src = self.path(tree)
            dst = self.path(tree)
            return (f"link {src} -> {dst}", lambda s: os.link(s.p(src), s.p(dst),
                                                             follow_symlinks=False), [])

        if choice == "symlink":
            p = self.path(tree)
            target = rng.choice([rng.choice(NAMES), "../" + rng.choice(NAMES),
                                 "/nonexistent/x", "t" * rng.randrange(1, 300),
                                 p.rsplit("/", 1)[-1]])
            return f"symlink {p} -> {target[:40]}", lambda s: os.symlink(target, s.p(p)), []

        if choice == "readlink":
            p = self.path(tree, (stat.S_IFLNK,))
            return f"readlink {p}", lambda s: os.readlink(s.p(p)), [p]

        if choice == "chmod":
            p = self.path(tree)
            mode = rng.randrange(0, 0o10000)
            return f"chmod {p} {mode:#o}", lambda s: os.chmod(s.p(p), mode), []

        if choice == "chown":
            p = self.path(tree)
            uid = rng.choice([-1, 0, 1000, 65534])
            gid = rng.choice([-1, 0, 1000, 65534])
            return (f"lchown {p} {uid}:{gid}",
                    lambda s: os.chown(s.p(p), uid, gid, follow_symlinks=False), [])

        if choice == "utimens":
            p = self.path(tree)
            at = rng.choice([self.explicit_ns(), "now", "omit"])
            mt = rng.choice([self.explicit_ns(), self.explicit_ns(), "now", "omit"])
            nofollow = rng.random() < 0.5
            return (f"utimensat {p} atime={at} mtime={mt} nofollow={nofollow}",
                    lambda s: utimensat(s.p(p), at, mt, nofollow), [])

        if choice == "setxattr":
            p = self.path(tree)
            name = rng.choice(XATTR_NAMES)
            value = rng.randbytes(rng.choice([0, 1, 20, 200, 3000]))
            flags = rng.choice([0, XATTR_CREATE, XATTR_REPLACE])
            return (f"lsetxattr {p} {name} len={len(value)} flags={flags}",
                    lambda s: os.setxattr(s.p(p), name, value, flags, follow_symlinks=False), [])

        if choice == "removexattr":
            p = self.path(tree)
            name = rng.choice(XATTR_NAMES)
            return (f"lremovexattr {p} {name}",
                    lambda s: os.removexattr(s.p(p), name, follow_symlinks=False), [])

        if choice == "getxattr":
            p = self.path(tree)
            name = rng.choice(XATTR_NAMES)
            def f(s):
                names = sorted(n for n in os.listxattr(s.p(p), follow_symlinks=False)
                               if n.startswith("user."))
                return names, os.getxattr(s.p(p), name, follow_symlinks=False).hex()
            return f"lgetxattr {p} {name}", f, []

        if choice == "fallocate":
            p = self.path(tree, kinds_file)
            size = self.size_of(p)
            mode = rng.choice([0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE])
            off = self.rng.randrange(0, size + 65537)
            length = min(rng.choice([1, 4096, 65536, 1 << 20]), MAX_FILE - off)
            length = max(length, 1)
            def f(s):
                fd = os.open(s.p(p), NB | os.O_RDWR)
                try:
                    fallocate(fd, mode, off, length)
                    return os.fstat(fd).st_size
                finally:
                    os.close(fd)
            return f"fallocate {p} mode={mode} off={off} len={length}", f, [p]

        if choice == "copy_range":
            src = self.path(tree, kinds_file)
            dst = self.path(tree, kinds_file)
            ssize = self.size_of(src)
            off_in = rng.randrange(0, ssize + 1)
            off_out = self.offset(self.size_of(dst))
            n = min(rng.choice([1, 4096, 100000, 1 << 20]), MAX_FILE - off_out)
            def f(s):
                fi = os.open(s.p(src), NB | os.O_RDONLY)
                try:
                    fo = os.open(s.p(dst), NB | os.O_WRONLY)
                    try:
                        done = os.copy_file_range(fi, fo, n, off_in, off_out)
                        return done, os.fstat(fo).st_size
                    finally:
                        os.close(fo)
                finally:
                    os.close(fi)
            return f"copy_file_range {src}@{off_in} -> {dst}@{off_out} len={n}", f, [src, dst]

        if choice == "mknod":
            p = self.path(tree)
            kind = rng.choice(["fifo", "chr", "blk"])
            mode = rng.choice([0o600, 0o666])
            def f(s):
                if kind == "fifo":
                    os.mkfifo(s.p(p), mode)
                else:
                    t = stat.S_IFCHR if kind == "chr" else stat.S_IFBLK
                    os.mknod(s.p(p), t | mode, os.makedev(rng_major, rng_minor))
            rng_major, rng_minor = rng.randrange(1, 300), rng.randrange(0, 300)
            return f"mknod {p} {kind} {mode:#o}", f, []

        if choice == "stat":
            p = self.path(tree)
            follow = rng.random() < 0.5
            def f(s):
                st = os.stat(s.p(p), follow_symlinks=follow)
                return (stat.S_IFMT(st.st_mode), oct(st.st_mode), st.st_nlink, st.st_uid,
                        st.st_gid, st.st_size if not stat.S_ISDIR(st.st_mode) else None)
            return f"stat {p} follow={follow}", f, []

        if choice == "listdir":
            p = self.path(tree, (stat.S_IFDIR,)) if rng.random() < 0.9 else ""
            return f"listdir {p or '.'}", lambda s: sorted(os.listdir(s.p(p))), []

        if choice == "open_keep":
            slot = rng.randrange(FD_SLOTS)
            p = self.path(tree, kinds_file)
            flags = os.O_RDWR | rng.choice([0, 0, os.O_CREAT, os.O_APPEND, os.O_TRUNC])
            def f(s):
                if slot in s.fds:
                    os.close(s.fds.pop(slot))
                s.fds[slot] = os.open(s.p(p), NB | flags, 0o644)
            return f"open[{slot}] {p} flags={flags:#o}", f, [p]

        if choice == "fd_io":
            slot = rng.randrange(FD_SLOTS)
            what = rng.choice(["pwrite", "pread", "fstat", "ftruncate", "fsync", "fchmod"])
            data = self.data()
            off = rng.randrange(0, 2 << 20)
            size = rng.randrange(0, 2 << 20)
            if slot in self.ref.fds and size == os.fstat(self.ref.fds[slot]).st_size:
                size += 1  # see "truncate"
            mode = rng.randrange(0, 0o10000)
            def f(s):
                if slot not in s.fds:
                    return "closed"
                fd = s.fds[slot]
                if what == "pwrite":
                    return os.pwrite(fd, data, off)
                if what == "pread":
                    return hashlib.sha256(os.pread(fd, 65536, off)).hexdigest()[:16]
                if what == "ftruncate":
                    return os.ftruncate(fd, size)
                if what == "fsync":
                    return os.fsync(fd)
                if what == "fchmod":
                    return os.fchmod(fd, mode)
                st = os.fstat(fd)
                return st.st_size, st.st_nlink, oct(st.st_mode), st.st_uid, st.st_gid
            return f"{what}[{slot}]", f, []

        if choice == "fd_close":
            slot = rng.randrange(FD_SLOTS)
            def f(s):
                if slot in s.fds:
                    os.close(s.fds.pop(slot))
            return f"close[{slot}]", f, []

        p = self.path(tree)
        def fsync(s):
            fd = os.open(s.p(p), NB | os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return f"fsync {p}", fsync, [p]


# ---------------------------------------------------------------------------------------------


def run(args):
    a = Side("test", args.test_dir)
    b = Side("ref", args.ref_dir)
    for s in (a, b):
        os.makedirs(s.top, exist_ok=True)
        if os.listdir(s.top):
            print(f"difftest: {s.top} is not empty", file=sys.stderr)
            return 2
        os.mkdir(s.root)
    log = open(args.log, "w", buffering=1) if args.log else None
    rng = random.Random(args.seed)
    gen = Gen(rng, b, [o for o in args.disable.split(",") if o])
    history = []

    def restart(cmd, label, crash):
        a.close_all()
        b.close_all()
        if crash:
            fsync_tree(a.top)
        before = snapshot(a.top, exact_times=True, with_ino=True)
        subprocess.run(cmd, shell=True, check=True)
        after = snapshot(a.top, exact_times=True, with_ino=True)
        lines = diff_snapshots(before, after, "before", "after")
        if lines:
            raise Divergence(f"tree under test changed across {label}:\n" + "\n".join(lines))

    def checkpoint(label):
        lines = diff_snapshots(snapshot(a.top), snapshot(b.top), a.name, b.name)
        if lines:
            for slot in sorted(set(a.fds) | set(b.fds)):
                for side in (a, b):
                    if slot in side.fds:
                        st = os.fstat(side.fds[slot])
                        lines.append(f"  open fd [{slot}] {side.name}: ino={st.st_ino} "
                                     f"size={st.st_size} nlink={st.st_nlink}")
            for rel in ["root/" + r for r in walk(b.root)]:
                sa, sb = os.lstat(a.p(rel[5:])), os.lstat(b.p(rel[5:]))
                lines.append(f"  ino {rel}: test={sa.st_ino} ref={sb.st_ino}")
            raise Divergence(f"trees differ at {label}:\n" + "\n".join(lines))
        reset_times(a.top)
        reset_times(b.top)

    try:
        checkpoint("start")
        for i in range(1, args.ops + 1):
            desc, fn = gen.op(gen.tree())
            history.append(f"{i}: {desc}")
            if log:
                log.write(f"{i}: {desc}\n")
            ra, rb = attempt(fn, a), attempt(fn, b)
            if ra != rb:
                raise Divergence(f"op {i} {desc}\n  {a.name}: {ra}\n  {b.name}: {rb}\n"
                                 + describe(desc, a, b))
            if i % args.check_every == 0 or i == args.ops:
                checkpoint(f"op {i}")
            if args.remount_cmd and i % args.remount_every == 0:
                history.append(f"{i}: remount")
                restart(args.remount_cmd, "remount", crash=False)
                checkpoint(f"after remount at op {i}")
            if args.crash_cmd and i % args.crash_every == 0:
                history.append(f"{i}: fsync all + crash")
                restart(args.crash_cmd, "crash", crash=True)
                checkpoint(f"after crash at op {i}")
    except Divergence as d:
        print(f"difftest seed {args.seed}: DIVERGED", file=sys.stderr)
        print("last operations:\n  " + "\n  ".join(history[-25:]), file=sys.stderr)
        print(str(d), file=sys.stderr)
        print(f"reproduce: {shlex.join(sys.argv)} (on empty directories)", file=sys.stderr)
        return 1
    finally:
        a.close_all()
        b.close_all()
    print(f"difftest seed {args.seed}: {args.ops} ops identical")
    return 0


CHECKPOINT = "(checkpoint: compare the trees, reset all times to the sentinel)"


def minimize(args):
    """Delta-debugging: the smallest subset of the first --ops operations (as generated for
    --seed) that still makes the two sides differ, each subset tried on fresh directories."""
    gen_side = Side("gen", os.path.join(args.ref_dir, "gen"))
    os.makedirs(gen_side.root)
    gen = Gen(random.Random(args.seed), gen_side, [o for o in args.disable.split(",") if o])
    ops = []
    for i in range(1, args.ops + 1):
        desc, fn = gen.op(gen.tree())
        attempt(fn, gen_side)
        ops.append((i, desc, fn))
        # A checkpoint is an operation too: its walk (readdir), reads and mtime reset can
        # matter; the minimizer keeps only the ones that do.
        ops.append((i, CHECKPOINT, None))
    gen_side.close_all()
    trials = [0]

    def fails(subset):
        trials[0] += 1
        k = trials[0]
        a = Side("test", os.path.join(args.test_dir, f"trial-{k}"))
        b = Side("ref", os.path.join(args.ref_dir, f"trial-{k}"))
        for side in (a, b):
            os.makedirs(side.root)
        try:
            for i, desc, fn in subset:
                if fn is None:  # a checkpoint: compare, then reset the times
                    if diff_snapshots(snapshot(a.top), snapshot(b.top), "test", "ref"):
                        return True
                    reset_times(a.top)
                    reset_times(b.top)
                elif attempt(fn, a) != attempt(fn, b):
                    return True
            # Compared while the fds are still open, as run() does at a checkpoint.
            return bool(diff_snapshots(snapshot(a.top), snapshot(b.top), "test", "ref"))
        finally:
            a.close_all()
            b.close_all()

    if not fails(ops):
        print(f"difftest seed {args.seed}: the first {args.ops} ops do not diverge "
              "(without checkpoints/remounts); nothing to minimize")
        return 1
    n = 2
    while len(ops) >= 2:
        chunk = max(1, len(ops) // n)
        parts = [ops[j:j + chunk] for j in range(0, len(ops), chunk)]
        for j in range(len(parts)):
            rest = [op for q, part in enumerate(parts) if q != j for op in part]
            if fails(rest):
                ops, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(ops):
                break
            n = min(len(ops), n * 2)
    print(f"difftest seed {args.seed}: minimal failing sequence ({trials[0]} trials):")
    for i, desc, fn in ops:
        print(f"  {i}: {desc}")
    a = Side("test", os.path.join(args.test_dir, "final"))
    b = Side("ref", os.path.join(args.ref_dir, "final"))
    for side in (a, b):
        os.makedirs(side.root)
    for i, desc, fn in ops:
        if fn is None:
            lines = diff_snapshots(snapshot(a.top), snapshot(b.top), "test", "ref")
            if lines:
                print("\n".join([f"  after op {i}, the trees differ:"] + lines))
                break
            reset_times(a.top)
            reset_times(b.top)
            continue
        ra, rb = attempt(fn, a), attempt(fn, b)
        if ra != rb:
            print(f"  op {i} result: test={ra} ref={rb}")
            break
    else:
        for line in diff_snapshots(snapshot(a.top), snapshot(b.top), "test", "ref"):
            print(line)
    a.close_all()
    b.close_all()
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--remount-cmd", help="shell command that remounts TEST_DIR's filesystem")
    ap.add_argument("--remount-every", type=int, default=500)
    ap.add_argument("--crash-cmd", help="shell command that kills -9 and remounts it")
    ap.add_argument("--crash-every", type=int, default=700)
    ap.add_argument("--log", help="write every operation to this file")
    ap.add_argument("--disable", default="", metavar="OP,OP",
                    help="operations not to generate: " + ",".join(OPS))
    ap.add_argument("test_dir")
    ap.add_argument("ref_dir")
    ap.add_argument("--minimize", action="store_true",
                    help="find a minimal failing subset of the first --ops operations")
    args = ap.parse_args()
    if os.path.lexists("/nonexistent"):
        # The generated symlinks point at /nonexistent/x on purpose (a dangling absolute
        # target); where that path exists, writes through them would reach the host and
        # both sides would share one file, so the comparison would mean nothing.
        sys.exit("difftest: /nonexistent exists on this host; the generated dangling "
                 "symlinks would write into it. Remove it and run again.")
    return minimize(args) if args.minimize else run(args)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""soak.py: the kill-anywhere soak. A `keel mount` with an S3 remote (moto, behind
ci/faultproxy.py) runs file writes, renames, appends, git commits and `npm install`s while
keel is SIGKILLed at random moments, also inside a checkpoint, a gc, a rollback, a named
snapshot, a fork, a lazy restore (metadata at start, windows on first read, the prefetch),
an eager restore at start, an offline `keel snapshot restore`, an offline `keel gc`, the start
sequence and the final checkpoint of a stop; and the remote fails too (500s, 500s after
the request was applied, dropped connections, a slow link, an outage of up to a minute).

After every kill:
  1. `keel fsck` of the stopped state dir and its remote is clean;
  2. the remote's head restores into a fresh state dir, and equals the tree that snapshot
     captured when the soak knows it;
  3. keel starts again on the state dir;
  4. every file the workload fsync'd (and did not touch since) is intact, with the bytes it
     recorded (sha256), logs keep their fsync'd prefix, the git repository passes `git fsck`
     and holds the last commit made, node_modules equals the last fsync'd install; after a
     kill inside a rollback the tree is the one before or the target, whole; after a kill
     inside a restore the restored tree;
  5. a checkpoint now restores into a fresh state dir (an offline `keel snapshot restore`,
     itself killed once at random first) equal to the live tree (ci/tree-manifest.py's
     fields).
Anything else is a finding: the soak stops (keeping the state dir, logs and manifests under
WORK/findings/N) unless --keep-going. Which operation and step keel was in at each kill comes
from its step lines (`KEEL_LOG=info,keel::step=debug`); the report lists the kill points
covered, the remote faults injected and the requests per method.

usage: ci/soak.py [--short] [--kills N] [--faults N] [--minutes M] [--seed S] [--work DIR]
                  [--keel BIN] [--report FILE] [--keep-going] [--keep]
       (script/soak.sh wraps it; `ci/soak.py workload ...` is the workload process itself)
Needs root, /dev/fuse, moto_server, git, npm, python3.
"""
import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "soak"
REMOTE = f"s3://{BUCKET}/ws"


# --------------------------------------------------------------------------------------------
# Small helpers

def now():
    return time.monotonic()


def sha(data):
    return hashlib.sha256(data).hexdigest()


def file_sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def mounted_at(path):
    """Mount points at `path` in /proc/self/mountinfo (a killed keel's dead one included)."""
    n = 0
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if line.split()[4] == path:
                n += 1
    return n


def umount_all(path):
    for _ in range(8):
        if not mounted_at(path):
            return
        subprocess.run(["umount", "-l", path], stderr=subprocess.DEVNULL)


# --------------------------------------------------------------------------------------------
# Tree manifests: ci/tree-manifest.py's fields, as a dict path -> line

def manifest(root, skip=()):
    out = {}

    def entry(rel, p):
        st = os.lstat(p)
        m = st.st_mode
        kind = ("d" if stat.S_ISDIR(m) else "l" if stat.S_ISLNK(m) else "f" if stat.S_ISREG(m)
                else "p" if stat.S_ISFIFO(m) else "?")
        xs = []
        if kind != "l":
            for n in sorted(os.listxattr(p, follow_symlinks=False)):
                xs.append(n + "=" + os.getxattr(p, n, follow_symlinks=False).hex())
        extra = ""
        if kind == "l":
            extra = "-> " + os.readlink(p)
        elif kind == "f":
            extra = file_sha(p)
        size = st.st_size if kind in "fl" else 0
        out[rel] = (f"{kind} {stat.S_IMODE(m):04o} {st.st_uid}:{st.st_gid} "
                    f"n{st.st_nlink if kind != 'd' else 0} s{size} t{st.st_mtime_ns} "
                    f"[{' '.join(xs)}] {extra}")

    entry(".", root)
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if os.path.relpath(os.path.join(d, x), root) not in skip)
        for n in sorted(dirs + files):
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            if rel in skip:
                continue
            entry(rel, p)
    return out


def manifest_diff(a, b, limit=12):
    """Lines telling how manifest b differs from a (empty: equal)."""
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k}: {a.get(k, '(absent)')}  !=  {b.get(k, '(absent)')}")
            if len(out) >= limit:
                out.append("...")
                break
    return out


def manifest_hash(m):
    return sha("\n".join(f"{k} {v}" for k, v in sorted(m.items())).encode())


def baseline_of(m):
    """What the workload's files are in a manifest: path -> sha256 ("L:target" for links),
    and logs path -> (size, sha256)."""
    files, logs = {}, {}
    for k, v in m.items():
        if not (k.startswith("w/") or k.startswith("big/")):
            continue
        if k.startswith("w/git/") or k.startswith("w/npm/"):
            continue
        kind = v[0]
        if kind == "f":
            h = v.rsplit(" ", 1)[1]
            if k.startswith("w/log/"):
                size = int(re.search(r" s(\d+) ", v).group(1))
                logs[k] = (size, h)
            else:
                files[k] = h
        elif kind == "l":
            files[k] = "L:" + v.split("] -> ", 1)[1]
    return files, logs


# --------------------------------------------------------------------------------------------
# The workload: a process of its own on the mount, journaling what it did before and after

class Workload:
    """Random file operations under ROOT/w (and ROOT/big when the driver writes its bulk),
    journaled: `b` (begin: the path may now also be H) before an operation, `d` (durable: the
    path is exactly H) once an fsync covering it returned. H: sha256, "L:target", None
    (absent), "*" (anything, e.g. a write not yet fsync'd)."""

    def __init__(self, mnt, journal, seed, baseline, pkgs=None, npm_cache=None, home=None):
        self.mnt = mnt
        self.rng = random.Random(seed)
        self.tag = f"{seed & 0xffffffff:08x}"
        self.j = open(journal, "a", buffering=1)
        self.files = dict(baseline.get("files", {}))
        self.logs = {k: tuple(v) for k, v in baseline.get("logs", {}).items()}
        self.pkgs = pkgs
        self.npm_cache = npm_cache
        self.home = home
        self.n = 0
        self.log_content = {}
        self.ops = {}

    # journal -----------------------------------------------------------------------------
    def rec(self, **kv):
        self.j.write(json.dumps(kv) + "\n")

    def begin(self, p, h):
        self.rec(k="f", p=p, h=h, s="b")

    def durable(self, p, h):
        self.rec(k="f", p=p, h=h, s="d")
        if h is None:
            self.files.pop(p, None)
        else:
            self.files[p] = h

    def path(self, rel):
        return os.path.join(self.mnt, rel)

    def rand_bytes(self, n):
        return self.rng.randbytes(n)

    def size(self):
        x = self.rng.random()
        if x < 0.55:
            return self.rng.randrange(0, 4096)
        if x < 0.9:
            return self.rng.randrange(4096, 256 << 10)
        return self.rng.randrange(256 << 10, 3 << 20)

    def dirs(self):
        return [f"w/files/d{i}" for i in range(12)]

    def setup(self):
        for d in ["w", "w/files", "w/log", "w/git", "w/npm"] + self.dirs():
            p = self.path(d)
            if not os.path.isdir(p):
                os.makedirs(p, exist_ok=True)
                fsync_path(p, True)
                fsync_path(os.path.dirname(p), True)

    def name(self):
        self.n += 1
        return f"f{self.tag}-{self.n}"

    def pick(self, prefix="w/files/"):
        c = [p for p in self.files if p.startswith(prefix) and not self.files[p].startswith("L:")]
        return self.rng.choice(c) if c else None

    # operations ----------------------------------------------------------------------------
    def write_new(self, rel, data, sync=True):
        self.begin(rel, "*")
        with open(self.path(rel), "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        if sync:
            fsync_path(os.path.dirname(self.path(rel)), True)
            self.durable(rel, sha(data))

    def op_create(self):
        d = self.rng.choice(self.dirs())
        self.write_new(f"{d}/{self.name()}", self.rand_bytes(self.size()), self.rng.random() < 0.75)

    def op_replace(self):
        p = self.pick()
        if not p:
            return self.op_create()
        data = self.rand_bytes(self.size())
        h = sha(data)
        tmp = p + ".tmp"
        self.write_new(tmp, data)
        self.begin(p, h)
        self.begin(tmp, None)
        os.rename(self.path(tmp), self.path(p))
        fsync_path(os.path.dirname(self.path(p)), True)
        self.durable(p, h)
        self.durable(tmp, None)

    def op_overwrite(self):
        p = self.pick()
        if not p:
            return self.op_create()
        self.begin(p, "*")
        with open(self.path(p), "r+b") as f:
            data = bytearray(f.read())
            off = self.rng.randrange(0, len(data) + 1)
            n = self.rng.randrange(1, 200 << 10)
            piece = self.rand_bytes(n)
            f.seek(off)
            f.write(piece)
            if len(data) < off + n:
                data.extend(b"\0" * (off + n - len(data)))
            data[off:off + n] = piece
            if self.rng.random() < 0.2:
                cut = self.rng.randrange(0, len(data) + 1)
                f.truncate(cut)
                del data[cut:]
            f.flush()
            os.fsync(f.fileno())
        self.durable(p, sha(bytes(data)))

    def op_rename(self):
        p = self.pick()
        if not p:
            return self.op_create()
        h = self.files[p]
        q = f"{self.rng.choice(self.dirs())}/{self.name()}"
        self.begin(q, h)
        self.begin(p, None)
        os.rename(self.path(p), self.path(q))
        fsync_path(os.path.dirname(self.path(q)), True)
        fsync_path(os.path.dirname(self.path(p)), True)
        self.durable(q, h)
        self.durable(p, None)

    def op_unlink(self):
        p = self.pick()
        if not p or len(self.files) < 40:
            return self.op_create()
        self.begin(p, None)
        os.unlink(self.path(p))
        fsync_path(os.path.dirname(self.path(p)), True)
        self.durable(p, None)

    def op_symlink(self):
        d = self.rng.choice(self.dirs())
        p = f"{d}/l{self.name()}"
        t = "../" + self.name()
        self.begin(p, "L:" + t)
        os.symlink(t, self.path(p))
        fsync_path(self.path(d), True)
        self.durable(p, "L:" + t)

    def op_xattr(self):
        p = self.pick()
        if not p:
            return
        # Not journaled: the remote comparison checks xattrs.
        os.setxattr(self.path(p), "user.soak", self.rand_bytes(self.rng.randrange(1, 64)))

    def op_append(self):
        logs = sorted(self.logs)
        if not logs or self.rng.random() < 0.05 or all(self.logs[l][0] > (256 << 10) for l in logs):
            p = f"w/log/log-{self.name()}"
            self.logs[p] = (0, sha(b""))
            self.log_content[p] = b""
            self.begin(p, "*")
            with open(self.path(p), "wb") as f:
                os.fsync(f.fileno())
            fsync_path(self.path("w/log"), True)
        else:
            p = self.rng.choice([l for l in logs if self.logs[l][0] <= (256 << 10)])
        if p not in self.log_content:
            with open(self.path(p), "rb") as f:
                self.log_content[p] = f.read()
        line = f"{time.time():.6f} {self.name()} {self.rand_bytes(self.rng.randrange(8, 300)).hex()}\n".encode()
        with open(self.path(p), "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        c = self.log_content[p] + line
        self.log_content[p] = c
        self.logs[p] = (len(c), sha(c))
        self.rec(k="log", p=p, n=len(c), h=sha(c))

    def git(self, *args, check=True):
        env = dict(os.environ, HOME=self.home, GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0")
        return subprocess.run(
            ["git", "-c", "core.fsync=all", "-c", "core.fsyncMethod=fsync", "-c", "user.name=soak",
             "-c", "user.email=soak@example.com", "-c", "init.defaultBranch=main",
             "-c", "gc.auto=0", "-C", self.path("w/git"), *args],
            env=env, check=check, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)

    def op_git(self):
        g = self.path("w/git")
        if not os.path.isdir(os.path.join(g, ".git")):
            self.git("init", "-q")
        src = os.path.join(g, "src")
        os.makedirs(src, exist_ok=True)
        for _ in range(self.rng.randrange(1, 5)):
            name = f"m{self.rng.randrange(0, 40)}.txt"
            with open(os.path.join(src, name), "ab") as f:
                f.write(f"{self.name()} {self.rand_bytes(self.rng.randrange(10, 2000)).hex()}\n".encode())
        if self.rng.random() < 0.1:
            victims = sorted(os.listdir(src))
            if victims:
                os.unlink(os.path.join(src, self.rng.choice(victims)))
        self.git("add", "-A")
        r = self.git("commit", "-q", "-m", f"soak {self.name()}", check=False)
        if r.returncode == 0:
            head = self.git("rev-parse", "HEAD").stdout.decode().strip()
            self.rec(k="git", c=head)
        elif b"nothing to commit" not in r.stdout + r.stderr:
            raise OSError(f"git commit failed: {(r.stdout + r.stderr).decode(errors='replace')[-300:]}")

    def op_npm(self):
        if not self.pkgs:
            return
        proj = self.path("w/npm")
        pj = os.path.join(proj, "package.json")
        want = json.dumps(npm_project(self.pkgs), indent=1) + "\n"
        if not os.path.exists(pj) or open(pj).read() != want:
            self.write_new("w/npm/package.json", want.encode())
        self.rec(k="npm", s="b")
        nm = os.path.join(proj, "node_modules")
        if os.path.exists(nm):
            shutil.rmtree(nm)
        env = dict(os.environ, HOME=self.home, npm_config_cache=self.npm_cache,
                   npm_config_update_notifier="false", npm_config_fund="false",
                   npm_config_audit="false", npm_config_loglevel="error")
        r = subprocess.run(["npm", "install", "--offline", "--ignore-scripts", "--no-audit",
                            "--no-fund"], cwd=proj, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=300)
        if r.returncode != 0:
            raise OSError(f"npm install failed: {r.stdout.decode(errors='replace')[-400:]}")
        # What npm wrote, made durable file by file (npm itself never fsyncs).
        for d, dirs, files in os.walk(nm):
            for n in files:
                p = os.path.join(d, n)
                if not os.path.islink(p):
                    fsync_path(p)
            fsync_path(d, True)
        fsync_path(proj, True)
        self.rec(k="npm", s="d", m=npm_manifest(nm))

    OPS = [("create", 26), ("replace", 10), ("overwrite", 9), ("rename", 9), ("unlink", 7),
           ("symlink", 3), ("xattr", 3), ("append", 14), ("git", 7), ("npm", 1)]

    def run(self, stop_after=None):
        self.setup()
        names = [o for o, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        t0 = now()
        while stop_after is None or now() - t0 < stop_after:
            op = self.rng.choices(names, weights)[0]
            getattr(self, "op_" + op)()
            self.ops[op] = self.ops.get(op, 0) + 1


def npm_project(pkgs):
    deps = {name: "file:" + tgz for name, tgz in sorted(pkgs.items())}
    return {"name": "soak-app", "version": "1.0.0", "private": True, "dependencies": deps}


def npm_manifest(nm):
    h = hashlib.sha256()
    if not os.path.isdir(nm):
        return None
    for d, dirs, files in os.walk(nm):
        dirs.sort()
        for n in sorted(files + [x for x in dirs if os.path.islink(os.path.join(d, x))]):
            p = os.path.join(d, n)
            rel = os.path.relpath(p, nm)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                h.update(f"{rel} L {os.readlink(p)}\n".encode())
            elif stat.S_ISREG(st.st_mode):
                h.update(f"{rel} {stat.S_IMODE(st.st_mode):o} {file_sha(p)}\n".encode())
    return h.hexdigest()


def workload_main(args):
    with open(args.baseline) as f:
        baseline = json.load(f)
    pkgs = None
    if args.pkgs:
        with open(args.pkgs) as f:
            pkgs = json.load(f)
    w = Workload(args.mnt, args.journal, args.seed, baseline, pkgs, args.npm_cache, args.home)
    try:
        w.run(args.seconds)
    except (OSError, subprocess.SubprocessError) as e:
        # keel killed under us (ENOTCONN and friends): that is the point.
        print(f"workload: stopped: {e}", file=sys.stderr)
        return 0
    return 0


# --------------------------------------------------------------------------------------------
# Journal replay: what each path may be after a kill

class Expect:
    def __init__(self, files, logs):
        self.states = {p: {h} for p, h in files.items()}
        self.logs = dict(logs)  # path -> (n, sha of the first n bytes)
        self.git = None
        self.npm = None  # ("d", manifest) or ("b",)
        self.touched = set()

    def apply(self, lines):
        for r in lines:
            k = r.get("k")
            if k == "f":
                p = r["p"]
                self.touched.add(p)
                if r["s"] == "b":
                    self.states.setdefault(p, {None}).add(r["h"])
                else:
                    self.states[p] = {r["h"]}
            elif k == "log":
                self.logs[r["p"]] = (r["n"], r["h"])
            elif k == "git":
                self.git = r["c"]
            elif k == "npm":
                self.npm = ("d", r["m"]) if r["s"] == "d" else ("b",)


def read_journal(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by the kill
    except FileNotFoundError:
        pass
    return out


def actual_state(p):
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "L:" + os.readlink(p)
    if stat.S_ISREG(st.st_mode):
        return file_sha(p)
    return f"type {stat.S_IFMT(st.st_mode):o}"


# --------------------------------------------------------------------------------------------
# keel processes

STEP_RE = re.compile(r"^keel: debug: step (\w+) (\w+)")


class Tracker:
    """Which operations a keel process is inside, from its step lines."""

    def __init__(self):
        self.open = {}  # op -> [count, last step]
        self.seen = []  # (op, step) in order, for the log

    def feed(self, line):
        m = STEP_RE.match(line)
        if not m:
            return
        op, step = m.group(1), m.group(2)
        if op == "start":  # plain steps lock .. ready
            if step == "ready":
                self.open.pop("start", None)
            else:
                self.open["start"] = [1, step]
            return
        o = self.open.setdefault(op, [0, "start"])
        if step == "start":
            o[0] += 1
            o[1] = "start"
        elif step == "end":
            o[0] -= 1
            if o[0] <= 0:
                del self.open[op]
        else:
            o[1] = step

    def points(self):
        return sorted(f"{op}/{v[1]}" for op, v in self.open.items())


class Proc:
    """A keel process (the daemon or a CLI command) with its stderr read line by line into a
    log file and a step tracker."""

    def __init__(self, ctx, argv, name, env_extra=None):
        self.ctx = ctx
        self.name = name
        env = dict(ctx.env)
        env.update(env_extra or {})
        self.logpath = os.path.join(ctx.logs, f"{ctx.round:04d}-{name}.log")
        self.log = open(self.logpath, "a")
        self.log.write(f"# {' '.join(argv)}\n")
        self.log.flush()
        self.t0 = now()
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.tracker = Tracker()
        self.lines = []
        self.cond = threading.Condition()
        self.killed_at = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in self.p.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            t = now() - self.t0
            with self.cond:
                self.lines.append(line)
                self.tracker.feed(line)
                self.cond.notify_all()
            self.log.write(f"{t:8.3f} {line}\n")
        self.log.close()
        with self.cond:
            self.cond.notify_all()

    def wait_line(self, pattern, timeout):
        """True once a line matching `pattern` appeared; False at the timeout or when the
        process ended without it."""
        rx = re.compile(pattern)
        deadline = now() + timeout
        i = 0
        with self.cond:
            while True:
                while i < len(self.lines):
                    if rx.search(self.lines[i]):
                        return True
                    i += 1
                if self.p.poll() is not None and not self.reader.is_alive():
                    return False
                left = deadline - now()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.2))

    def alive(self):
        return self.p.poll() is None

    def kill(self):
        """SIGKILL; returns the kill points (operations and steps open at the kill), or None
        when the process had already exited."""
        if self.p.poll() is not None:
            self.reader.join(30)
            return None
        self.killed_at = now() - self.t0
        try:
            os.kill(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            raise Finding("hang", f"{self.name} (pid {self.p.pid}) still alive 60 s after SIGKILL: "
                          + stacks(self.p.pid))
        self.reader.join(30)  # everything it wrote came before the kill
        with open(self.logpath, "a") as f:
            f.write(f"# SIGKILL at {self.killed_at:.3f}s; open: {self.tracker.points()}\n")
        return self.tracker.points()

    def wait(self, timeout):
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.reader.join(30)
        return rc

    def output(self):
        with self.cond:
            return "\n".join(self.lines)


def stacks(pid):
    out = []
    try:
        for t in sorted(os.listdir(f"/proc/{pid}/task")):
            try:
                with open(f"/proc/{pid}/task/{t}/stack") as f:
                    s = f.read().strip().splitlines()[:4]
                with open(f"/proc/{pid}/task/{t}/comm") as f:
                    c = f.read().strip()
                out.append(f"[{t} {c}] " + " | ".join(s))
            except OSError:
                pass
    except OSError:
        pass
    return "; ".join(out[:12])


class Finding(Exception):
    def __init__(self, kind, detail):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


# --------------------------------------------------------------------------------------------
# The soak

SCENARIOS = ["work", "checkpoint", "gc", "rollback", "snapshot", "fork", "lazy", "eager",
             "offline_gc", "stop", "start"]
WEIGHTS = {"work": 20, "checkpoint": 14, "gc": 9, "rollback": 9, "snapshot": 5, "fork": 7,
           "lazy": 9, "eager": 5, "offline_gc": 4, "stop": 7, "start": 4}
FAULTS = ["err500", "err500_after", "drop", "slow", "outage"]


class Soak:
    def __init__(self, a):
        self.a = a
        self.keel = a.keel
        self.rng = random.Random(a.seed)
        self.work = a.work
        self.logs = os.path.join(self.work, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.round = 0
        self.env = dict(os.environ, AWS_ACCESS_KEY_ID="soak", AWS_SECRET_ACCESS_KEY="soak",
                        AWS_REGION="us-east-1", KEEL_LOG="info,keel::step=debug",
                        RUST_BACKTRACE="0")
        self.env.pop("KEEL_CONFIG", None)
        self.mnt = os.path.join(self.work, "mnt")
        self.rmnt = os.path.join(self.work, "rmnt")
        for d in (self.mnt, self.rmnt):
            os.makedirs(d, exist_ok=True)
        self.state_n = 0
        self.state = self.new_state_dir()
        self.daemon = None
        self.known = {}  # snapshot seq -> manifest of the tree it holds (when known)
        self.named = []  # (name, seq)
        self.forks = []  # (url, seq)
        self.fork_n = 0
        self.last_seq = None
        self.baseline = {"files": {}, "logs": {}}
        self.git_head = None
        self.npm = None
        self.kills = []  # dicts: round, scenario, process, points, fault
        self.faults = []  # dicts: round, type, params, injected
        self.findings = []
        self.est = {}  # op -> estimated seconds
        self.started = now()
        self.deadline = self.started + a.minutes * 60 if a.minutes else None
        self.timings = {}
        self.cli_failures = []  # (round, what, error) of commands that failed under a fault
        self.fault_active = None
        self.cur_fault = None

    # --- setup ------------------------------------------------------------------------------
    def new_state_dir(self):
        self.state_n += 1
        p = os.path.join(self.work, f"state-{self.state_n}")
        return p

    def say(self, msg):
        t = now() - self.started
        line = f"[{t:7.1f}s r{self.round}] {msg}"
        print(line, flush=True)
        with open(os.path.join(self.work, "soak.log"), "a") as f:
            f.write(line + "\n")

    def start_services(self):
        mp = free_port()
        self.moto_log = open(os.path.join(self.logs, "moto.log"), "w")
        self.moto = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(mp)],
                                     stdout=self.moto_log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.moto_port = mp
        t0 = now()
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{mp}/{BUCKET}", method="PUT")
                urllib.request.urlopen(req, timeout=5).read()
                break
            except OSError:
                if now() - t0 > 60 or self.moto.poll() is not None:
                    raise SystemExit("soak: moto_server did not come up (see logs/moto.log)")
                time.sleep(0.2)
        pf = os.path.join(self.work, "proxy.port")
        cf = os.path.join(self.work, "proxy.control")
        self.proxy_log = open(os.path.join(self.logs, "proxy.log"), "w")
        self.proxy = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "ci", "faultproxy.py"), "--upstream",
             f"127.0.0.1:{mp}", "--port-file", pf, "--control", "127.0.0.1:0",
             "--control-port-file", cf, "--stats", os.path.join(self.work, "proxy-stats.json"),
             "--seed", str(self.a.seed)],
            stdout=self.proxy_log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = now()
        while not (os.path.exists(pf) and os.path.exists(cf)):
            if now() - t0 > 30 or self.proxy.poll() is not None:
                raise SystemExit("soak: faultproxy did not come up (see logs/proxy.log)")
            time.sleep(0.05)
        self.proxy_port = int(open(pf).read())
        self.control_port = int(open(cf).read())
        # Configs: keel through the proxy; the checking tools straight to moto.
        base = {"interval": '"2s"', "keep": "5", "gc_every": "4", "gc_grace": '"0s"',
                "compact_every": "5", "flush_timeout": '"20s"', "concurrency": "16"}
        self.cfg = self.write_cfg("keel.toml", self.proxy_port, base)
        self.cfg_eager = self.write_cfg("keel-eager.toml", self.proxy_port, dict(base, restore='"eager"'))
        self.cfg_prefetch = self.write_cfg("keel-prefetch.toml", self.proxy_port, dict(base, prefetch="true"))
        self.cfg_direct = self.write_cfg("direct.toml", mp, base)
        self.cfg_none = os.path.join(self.work, "none.toml")
        with open(self.cfg_none, "w") as f:
            f.write('[persist]\nremote = "none"\n')

    def write_cfg(self, name, port, persist):
        p = os.path.join(self.work, name)
        with open(p, "w") as f:
            f.write("[workspace]\n")
            f.write("[shutdown]\nflush_timeout = \"30s\"\n")
            f.write(f'[persist]\nremote = "{REMOTE}"\nendpoint = "http://127.0.0.1:{port}"\n'
                    'region = "us-east-1"\nallow_http = true\n')
            for k, v in persist.items():
                f.write(f"{k} = {v}\n")
        return p

    def ctl(self, path, **q):
        qs = "&".join(f"{k}={v}" for k, v in q.items())
        url = f"http://127.0.0.1:{self.control_port}{path}" + (f"?{qs}" if qs else "")
        req = urllib.request.Request(url, method="GET" if path == "/stats" else "POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def make_packages(self):
        """A few local npm packages (tarballs), so `npm install` needs no registry."""
        d = os.path.join(self.work, "npm-src")
        out = {}
        rng = random.Random(7)
        names = ["soak-core", "soak-util", "soak-cli", "soak-data"]
        for i, n in enumerate(names):
            p = os.path.join(d, n)
            os.makedirs(os.path.join(p, "lib"), exist_ok=True)
            pj = {"name": n, "version": "1.0.0", "main": "lib/index.js"}
            with open(os.path.join(p, "package.json"), "w") as f:
                json.dump(pj, f)
            for k in range(60 + 40 * i):
                sub = os.path.join(p, "lib", f"m{k % 7}")
                os.makedirs(sub, exist_ok=True)
                with open(os.path.join(sub, f"f{k}.js"), "w") as f:
                    f.write(f"// {n} {k}\nmodule.exports = {json.dumps(rng.randbytes(rng.randrange(50, 3000)).hex())};\n")
            with open(os.path.join(p, "lib", "index.js"), "w") as f:
                f.write("module.exports = {};\n")
            r = subprocess.run(["npm", "pack", "--silent", "--pack-destination", d], cwd=p,
                               env=dict(self.env, HOME=self.home()), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
            if r.returncode != 0:
                raise SystemExit(f"soak: npm pack {n}: {r.stdout.decode()[-300:]}")
            out[n] = os.path.join(d, r.stdout.decode().strip().splitlines()[-1])
        self.pkgs_file = os.path.join(self.work, "pkgs.json")
        with open(self.pkgs_file, "w") as f:
            json.dump(out, f)
        self.pkgs = out

    def home(self):
        h = os.path.join(self.work, "home")
        os.makedirs(h, exist_ok=True)
        return h

    # --- keel -------------------------------------------------------------------------------
    def cli(self, args, name, timeout=300, cfg=None, check=True, steps=True):
        """Runs a keel command to its end; returns (rc, output). A command still running at
        the timeout is a hang."""
        p = Proc(self, [self.keel, *args[:1], "--config", cfg or self.cfg, *args[1:]], name,
                 None if steps else {"KEEL_LOG": "info"})
        rc = p.wait(timeout)
        if rc is None:
            pts = p.kill()
            raise Finding("hang", f"`keel {' '.join(args)}` still running after {timeout}s "
                          f"(inside {pts}); log {p.logpath}")
        if check and rc != 0:
            raise Finding("command failed", f"`keel {' '.join(args)}` exit {rc}: {p.output()[-600:]}")
        return rc, p.output()

    def start_keel(self, state=None, cfg=None, extra=(), timeout=180, expect_ready=True):
        state = state or self.state
        if getattr(self, "new_host", None) == state and not any(e.startswith("--takeover") for e in extra):
            # A new host killed before it ever came up may not hold the lease yet: the old
            # host's is still live, and taking it over is what the new host was started for.
            extra = [*extra, "--takeover=force"]
        d = Proc(self, [self.keel, "mount", "--config", cfg or self.cfg, "--state", state,
                        *extra, self.mnt], "keel")
        self.daemon = d
        if expect_ready:
            t0 = now()
            if not d.wait_line(r"step start ready", timeout):
                if d.alive():
                    pts = d.kill()
                    raise Finding("hang", f"keel mount not ready after {timeout}s (inside {pts}); log {d.logpath}")
                raise Finding("won't start", f"keel mount exited {d.p.returncode}: {d.output()[-800:]}")
            self.timing("ready", now() - t0)
            self.new_host = None
        return d

    def kill_keel(self, scenario, extra=None):
        d = self.daemon
        self.daemon = None
        pts = d.kill()
        self.record_kill(scenario, "keel mount", pts, extra)
        return pts

    def record_kill(self, scenario, process, pts, extra=None):
        k = {"round": self.round, "scenario": scenario, "process": process,
             "points": pts if pts is not None else ["(already exited)"],
             "fault": self.fault_active}
        if extra:
            k.update(extra)
        self.kills.append(k)
        self.say(f"KILL {process} in {scenario}: {', '.join(k['points']) or 'idle'}"
                 + (f" [fault {self.fault_active}]" if self.fault_active else ""))

    def stop_keel(self, timeout=120):
        d = self.daemon
        self.daemon = None
        os.kill(d.p.pid, signal.SIGTERM)
        rc = d.wait(timeout)
        if rc is None:
            pts = d.kill()
            raise Finding("hang", f"keel mount did not stop within {timeout}s of SIGTERM (inside {pts}); log {d.logpath}")
        return rc

    def timing(self, what, secs):
        self.timings.setdefault(what, []).append(secs)

    def est_of(self, op, default):
        return self.est.get(op, default)

    def learn(self, op, secs, hit):
        """Kill offsets follow each operation's duration: a kill that came after the end
        shortens the estimate, one that landed inside lengthens it a little."""
        e = self.est.get(op)
        if hit:
            self.est[op] = max(e or 0, secs * 1.1) if e is None else e * 1.03
        elif secs is not None:
            self.est[op] = secs if e is None else 0.6 * e + 0.4 * secs

    # --- faults -----------------------------------------------------------------------------
    def maybe_fault(self, scenario):
        want = self.fault_plan.pop(0) if self.fault_plan else None
        if want is None:
            p = self.a.fault_rate
            if self.rng.random() >= p:
                return None
            want = self.rng.choice(FAULTS)
        return self.start_fault(want)

    def start_fault(self, kind):
        r = self.rng
        params = {}
        secs = None
        if ":" in kind:
            kind, secs = kind.split(":")
            secs = float(secs)
        if kind == "err500":
            params = {"error_rate": round(r.uniform(0.1, 0.5), 2)}
        elif kind == "err500_after":
            params = {"error_after_rate": round(r.uniform(0.1, 0.4), 2)}
        elif kind == "drop":
            params = {"drop_rate": round(r.uniform(0.05, 0.3), 2)}
        elif kind == "slow":
            params = {"latency_ms": r.randrange(50, 600), "jitter_ms": 50,
                      "bandwidth": r.choice(["500k", "1M", "4M"])}
        stats = self.ctl("/stats")
        f = {"round": self.round, "type": kind, "params": params, "t0": now(),
             "before": stats["faults_total"], "requests_before": stats["requests_total"]}
        if kind == "outage":
            long_one = self.a.long_outage_every and self.rng.random() < 1 / self.a.long_outage_every
            if secs is None:
                secs = 60 if long_one else self.a.outage_short
            mode = r.choice(["refuse", "reset", "blackhole"])
            f["params"] = {"seconds": secs, "mode": mode}
            self.ctl("/outage", seconds=secs, mode=mode)
            f["until"] = now() + secs
        else:
            self.ctl("/set", **params)
        self.fault_active = f"{kind} {f['params']}"
        self.faults.append(f)
        self.say(f"FAULT {kind} {f['params']}")
        return f

    def end_fault(self, f):
        if f is None:
            return
        self.ctl("/clear")
        stats = self.ctl("/stats")
        f["injected"] = stats["faults_total"] - f["before"]
        f["requests"] = stats["requests_total"] - f["requests_before"]
        f["seconds"] = round(now() - f.pop("t0"), 1)
        f.pop("until", None)
        self.fault_active = None

    # --- the workload -----------------------------------------------------------------------
    def journal_path(self):
        return os.path.join(self.work, "journal", f"{self.round:04d}.jsonl")

    def start_workload(self, seconds=None):
        os.makedirs(os.path.dirname(self.journal_path()), exist_ok=True)
        bl = os.path.join(self.work, "baseline.json")
        with open(bl, "w") as f:
            json.dump(self.baseline, f)
        argv = [sys.executable, os.path.abspath(__file__), "workload", "--mnt", self.mnt,
                "--journal", self.journal_path(), "--seed", str(self.rng.randrange(1 << 30)),
                "--baseline", bl, "--pkgs", self.pkgs_file, "--npm-cache",
                os.path.join(self.work, "npm-cache"), "--home", self.home()]
        if seconds:
            argv += ["--seconds", str(seconds)]
        log = open(os.path.join(self.logs, f"{self.round:04d}-workload.log"), "a")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop_workload(self, w):
        if w is None:
            return
        try:
            os.killpg(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            w.wait(60)
        except subprocess.TimeoutExpired:
            raise Finding("hang", f"the workload (pid {w.pid}) does not die after SIGKILL: {stacks(w.pid)}")

    def driver_writes(self, fraction, new_files=0, delete=0.0):
        """The bulk the long operations work on (big/): rewrites a fraction of it, adds and
        deletes files; fsync'd and journaled like the workload's own."""
        wl = Workload(self.mnt, self.journal_path(), self.rng.randrange(1 << 30), self.baseline)
        os.makedirs(os.path.join(self.mnt, "big"), exist_ok=True)
        big = [p for p in wl.files if p.startswith("big/")]
        t0 = now()
        n = 0
        for p in big:
            x = self.rng.random()
            if x < delete:
                wl.begin(p, None)
                os.unlink(wl.path(p))
                wl.durable(p, None)
                n += 1
            elif x < delete + fraction:
                wl.write_new(p, wl.rand_bytes(self.big_size(wl)))
                n += 1
        for i in range(new_files):
            d = f"big/d{self.rng.randrange(0, 16)}"
            os.makedirs(wl.path(d), exist_ok=True)
            wl.write_new(f"{d}/{wl.name()}", wl.rand_bytes(self.big_size(wl)))
            n += 1
        for d in range(16):
            p = wl.path(f"big/d{d}")
            if os.path.isdir(p):
                fsync_path(p, True)
        self.baseline["files"] = wl.files
        self.timing("driver_writes", now() - t0)
        return n

    def big_size(self, wl):
        if wl.rng.random() < self.a.big_fraction:
            return wl.rng.randrange(1 << 20, self.a.big_max)
        return wl.rng.randrange(0, 48 << 10)

    # --- verification -----------------------------------------------------------------------
    def fsck(self, state, remote=True, label="fsck"):
        if not os.path.exists(state):
            # keel killed at start before it made its state dir: nothing to check.
            self.say(f"no state dir {state} (keel killed before it made it)")
            return ""
        args = ["fsck", "--state", state] + ([] if remote else ["--no-remote"])
        t0 = now()
        rc, out = self.cli(args, label, timeout=600, cfg=self.cfg_direct, check=False)
        self.timing(label, now() - t0)
        if rc != 0 or not re.search(r" 0 errors", out):
            raise Finding("fsck unclean", f"keel fsck --state {state}: exit {rc}: {out[-1500:]}")
        return out

    def remote_head(self, remote=REMOTE):
        rc, out = self.cli(["snapshot", "list", "--json", "--remote", remote], "list",
                           cfg=self.cfg_direct, check=False, steps=False)
        if rc != 0:
            return None, out
        js = out[out.index("{"):]
        js = js[: js.rindex("}") + 1]
        d = json.loads(js)
        heads = [s["id"] for s in d["snapshots"] if s.get("head")]
        return (heads[0] if heads else None), d

    def restore_compare(self, seq, want, remote=REMOTE, kill_first=False, label="restore"):
        """Restores `seq` of `remote` into a fresh state dir (offline, eager), mounts it
        without a remote and compares its tree with `want` (None: fsck only)."""
        r = os.path.join(self.work, "restore")
        umount_all(self.rmnt)
        shutil.rmtree(r, ignore_errors=True)
        args = ["snapshot", "restore", str(seq), "--state", r, "--remote", remote]
        if kill_first:
            p = Proc(self, [self.keel, "snapshot", "--config", self.cfg_direct, *args[1:]], "restore-killed")
            at = self.rng.uniform(0, self.est_of("bulk_restore", 1.0))
            rc = p.wait(at)
            if rc is None:
                pts = p.kill()
                self.record_kill("bulk_restore", "keel snapshot restore", pts)
                self.learn("bulk_restore", at, True)
            else:
                self.learn("bulk_restore", now() - p.t0, False)
                shutil.rmtree(r, ignore_errors=True)
        t0 = now()
        self.cli(args, label, timeout=900, cfg=self.cfg_direct)
        self.timing("restore", now() - t0)
        if not kill_first:
            self.learn("bulk_restore", now() - t0, False)
        self.fsck(r, remote=False, label="fsck-restored")
        if want is None:
            return
        d = Proc(self, [self.keel, "mount", "--config", self.cfg_none, "--state", r, self.rmnt], "keel-restored")
        try:
            if not d.wait_line(r"step start ready", 120):
                raise Finding("won't start", f"mount of the restored snapshot {seq}: {d.output()[-800:]}")
            got = manifest(self.rmnt)
        finally:
            if d.alive():
                os.kill(d.p.pid, signal.SIGTERM)
                if d.wait(120) is None:
                    d.kill()
            umount_all(self.rmnt)
        diff = manifest_diff(want, got)
        if diff:
            raise Finding("restore differs", f"snapshot {seq} of {remote} restored differs from the tree it captured:\n  "
                          + "\n  ".join(diff))
        shutil.rmtree(r, ignore_errors=True)

    def check_journal(self, lines):
        """Every path the journal (over the baseline) says is durable is as recorded."""
        files, logs = self.baseline["files"], self.baseline["logs"]
        e = Expect(files, {k: tuple(v) for k, v in logs.items()})
        e.git = self.git_head
        e.npm = self.npm
        e.apply(lines)
        bad = []
        for p, states in sorted(e.states.items()):
            if "*" in states:
                continue
            a = actual_state(os.path.join(self.mnt, p))
            if a not in states:
                bad.append(f"{p}: is {a}, fsync'd as {sorted(map(str, states))}")
        for p, (n, h) in sorted(e.logs.items()):
            try:
                with open(os.path.join(self.mnt, p), "rb") as f:
                    c = f.read(n)
            except FileNotFoundError:
                c = None
            if c is None or len(c) < n or sha(c) != h:
                bad.append(f"{p}: the first {n} fsync'd bytes are {'gone' if c is None else 'different'}"
                           + ("" if c is None else f" (have {len(c)} of them)"))
        # Nothing the journal does not know of appeared among the workload's files.
        known = set(e.states) | set(e.logs)
        for top in ("w/files", "w/log", "big"):
            root = os.path.join(self.mnt, top)
            for d, dirs, fs in os.walk(root):
                for n in fs:
                    rel = os.path.relpath(os.path.join(d, n), self.mnt)
                    if rel not in known:
                        bad.append(f"{rel}: present, but never written (or durably removed)")
        if bad:
            raise Finding("lost fsync'd data", f"{len(bad)} paths:\n  " + "\n  ".join(bad[:20]))
        self.check_git(e.git)
        self.check_npm(e.npm)

    def git(self, *args):
        env = dict(self.env, HOME=self.home(), GIT_CONFIG_NOSYSTEM="1")
        return subprocess.run(["git", "-C", os.path.join(self.mnt, "w/git"), *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)

    def check_git(self, want):
        g = os.path.join(self.mnt, "w/git/.git")
        if not os.path.isdir(g):
            if want:
                raise Finding("lost fsync'd data", f"w/git/.git is gone; commit {want} was made")
            return
        # Locks of a git killed with keel (the user's first step after a crash).
        for d, _, fs in os.walk(g):
            for n in fs:
                if n.endswith(".lock"):
                    os.unlink(os.path.join(d, n))
        r = self.git("fsck", "--no-progress", "--no-dangling")
        if r.returncode != 0:
            raise Finding("git fsck", f"git fsck in w/git: exit {r.returncode}: {r.stdout.decode(errors='replace')[-1200:]}")
        if want:
            r = self.git("merge-base", "--is-ancestor", want, "HEAD")
            if r.returncode != 0:
                h = self.git("rev-parse", "HEAD").stdout.decode().strip()
                raise Finding("lost fsync'd data", f"git: commit {want} made (and fsync'd) before the kill "
                              f"is not in HEAD {h}: {r.stdout.decode(errors='replace')[-300:]}")

    def check_npm(self, want):
        if not want or want[0] != "d":
            return
        got = npm_manifest(os.path.join(self.mnt, "w/npm/node_modules"))
        if got != want[1]:
            raise Finding("lost fsync'd data", "w/npm/node_modules differs from the install fsync'd before the kill")

    def settle(self, expect_trees=None, journal=True):
        """After a kill: the checks of the module doc, from fsck to a checkpoint that restores
        equal to the live tree. `expect_trees`: the live tree must be one of these (a kill
        inside a rollback or a restore) instead of the journal check."""
        umount_all(self.rmnt)
        self.end_fault_quiet(self.cur_fault)
        self.ctl("/clear")
        self.fsck(self.state)
        head, _ = self.remote_head()
        if head is not None and head != self.last_seq:
            want = self.known.get(head)
            if want is not None or self.rng.random() < self.a.unknown_head_checks:
                self.restore_compare(head, want, label="restore-head")
        # keel starts again (sometimes killed while starting, first).
        if self.rng.random() < self.a.start_kills:
            self.kill_while_starting()
        self.start_keel()
        if expect_trees is not None:
            live = manifest(self.mnt)
            if not any(not manifest_diff(t, live) for t in expect_trees):
                diffs = [manifest_diff(t, live, 6) for t in expect_trees]
                raise Finding("tree differs", "the live tree is none of the trees it may be:\n  "
                              + "\n  --\n  ".join("\n  ".join(d) for d in diffs))
        elif journal:
            self.check_journal(read_journal(self.journal_path()))
        else:
            # The tree is a restore's: the whole tree must equal the snapshot's.
            pass
        self.quiesced_checkpoint()

    def kill_while_starting(self):
        d = self.start_keel(expect_ready=False)
        at = self.rng.uniform(0, self.est_of("start", 0.5))
        t0 = now()
        ready = d.wait_line(r"step start ready", at)
        if ready:
            self.learn("start", now() - t0, False)
        self.kill_keel("start")
        if not ready:
            self.learn("start", at, True)

    def quiesced_checkpoint(self, check_restore=True):
        """With nothing running: a checkpoint, the live tree recorded as that snapshot's,
        and (offline, killed once at random first) its restore compared with it."""
        t0 = now()
        rc, out = self.cli(["checkpoint", "--state", self.state], "checkpoint-quiet", timeout=600)
        self.timing("checkpoint_quiet", now() - t0)
        live = manifest(self.mnt)
        m = re.search(r"snapshot (\d+) \(", out)
        seq = int(m.group(1)) if m else None
        if seq is None:
            head, _ = self.remote_head()
            seq = head
        if seq is None:
            raise Finding("no snapshot", f"a checkpoint reported none and the remote has no head: {out[-400:]}")
        prev = self.known.get(seq)
        if prev is not None and manifest_diff(prev, live):
            raise Finding("tree differs", f"snapshot {seq} was recorded with another tree:\n  "
                          + "\n  ".join(manifest_diff(prev, live)))
        self.known[seq] = live
        self.last_seq = seq
        self.baseline = dict(zip(("files", "logs"), baseline_of(live)))
        self.git_head = self.current_git_head()
        nm = os.path.join(self.mnt, "w/npm/node_modules")
        self.npm = ("d", npm_manifest(nm)) if os.path.isdir(nm) else None
        if check_restore and self.rng.random() < self.a.restore_checks:
            self.restore_compare(seq, live, kill_first=self.rng.random() < 0.5)
        self.trim_known()
        return seq

    def current_git_head(self):
        if not os.path.isdir(os.path.join(self.mnt, "w/git/.git")):
            return None
        r = self.git("rev-parse", "-q", "--verify", "HEAD")
        return r.stdout.decode().strip() if r.returncode == 0 else None

    def trim_known(self):
        keep = {self.last_seq} | {s for _, s in self.named} | {s for _, s in self.forks}
        for s in sorted(self.known)[:-8]:
            if s not in keep:
                del self.known[s]

    # --- scenarios ----------------------------------------------------------------------------
    def op_and_kill(self, scenario, op, argv, default_est, cfg=None, kill_cli=False):
        """Runs `keel ARGV` against the running keel and kills keel (or the command itself)
        at a random moment within the operation's estimated duration."""
        p = Proc(self, [self.keel, argv[0], "--config", cfg or self.cfg, *argv[1:]], scenario)
        at = self.rng.uniform(0, self.est_of(op, default_est))
        t0 = now()
        rc = p.wait(at)
        if rc is not None:
            self.learn(op, now() - t0, False)
            out = p.output()
            if rc != 0 and not self.fault_active and "refused: a checkpoint is running" not in out:
                raise Finding("command failed", f"`keel {' '.join(argv)}` exit {rc}: {out[-600:]}")
            if rc != 0:
                self.cli_failures.append((self.round, " ".join(argv[:1]), out[-200:]))
        else:
            self.learn(op, at, True)
        extra = {"op": op, "offset": round(at, 3), "op_done": rc is not None}
        if kill_cli:
            pts = p.kill()
            self.record_kill(scenario, f"keel {argv[0]}", pts, extra)
            if self.daemon and self.rng.random() < 0.3:
                self.kill_keel(scenario, extra)
        else:
            self.kill_keel(scenario, extra)
            if p.wait(120) is None:
                pts = p.kill()
                raise Finding("hang", f"`keel {' '.join(argv)}` did not end within 120 s of keel's death (inside {pts})")
        return rc, p.output()

    def sc_work(self, fault):
        if fault and fault.get("until") and fault["until"] - now() > 20 and self.rng.random() < self.a.restart_in_outage:
            return self.restart_in_outage(fault)
        w = self.start_workload()
        try:
            secs = self.rng.uniform(0.3, self.a.work_max)
            self.run_for(secs, fault, w)
            self.kill_keel("work", {"offset": round(secs, 3)})
        finally:
            self.stop_workload(w)
        self.settle()

    def restart_in_outage(self, fault):
        """keel killed while the remote is gone, started again before it is back: it starts
        on its local workspace (the lease pending), what was fsync'd is there, and once the
        remote is back checkpoints go through without a restart."""
        w = self.start_workload()
        try:
            secs = self.rng.uniform(0.3, max(0.5, min(self.a.work_max, fault["until"] - now() - 15)))
            time.sleep(secs)
            self.kill_keel("work", {"offset": round(secs, 3), "restart_in_outage": True})
        finally:
            self.stop_workload(w)
        if now() > fault["until"] - 5:
            self.say("outage over before the restart; settling normally")
            return self.settle()
        umount_all(self.rmnt)
        self.start_keel(timeout=60)
        self.check_journal(read_journal(self.journal_path()))
        if now() >= fault["until"]:
            self.say("note: the outage ended before the journal check finished")
        while now() < fault["until"]:
            time.sleep(0.2)
        self.end_fault(fault)
        self.recovers()
        self.kill_keel("work_after_outage")
        self.settle()

    def run_for(self, secs, fault, w=None):
        """Waits `secs`, and through an outage: until it ended and a checkpoint went
        through again (keel recovers), then a moment more."""
        t_end = now() + secs
        if fault and fault.get("until"):
            t_end = max(t_end, fault["until"] + self.rng.uniform(0, 2))
        while now() < t_end:
            if self.daemon and not self.daemon.alive():
                raise Finding("crash", f"keel mount exited by itself ({self.daemon.p.returncode}): {self.daemon.output()[-800:]}")
            time.sleep(0.05)
        if fault and fault.get("until"):
            self.end_fault(fault)
            self.recovers()

    def recovers(self, budget=120):
        """Once the remote is back, checkpoints go through again by themselves: `keel
        checkpoint` succeeds within `budget` seconds (the lease may need taking back first)."""
        t0 = now()
        while True:
            rc, out = self.cli(["checkpoint", "--state", self.state], "checkpoint-recover",
                               timeout=240, check=False)
            if rc == 0:
                break
            if now() - t0 > budget:
                raise Finding("no recovery", f"checkpoints still fail {now() - t0:.0f}s after the remote came back: {out[-600:]}")
            time.sleep(2)
        self.timing("recover_checkpoint", now() - t0)

    def sc_checkpoint(self, fault):
        self.driver_writes(self.rng.uniform(0.2, 0.6), new_files=self.rng.randrange(0, 20))
        w = self.start_workload() if self.rng.random() < 0.5 else None
        full = self.rng.random() < 0.3
        try:
            self.op_and_kill("checkpoint", "checkpoint_full" if full else "checkpoint",
                             ["checkpoint", "--state", self.state] + (["--full"] if full else []), 3.0)
        finally:
            self.stop_workload(w)
        self.settle()

    def sc_snapshot(self, fault):
        self.driver_writes(self.rng.uniform(0.1, 0.3), new_files=self.rng.randrange(0, 10))
        name = f"soak-{self.round}"
        rc, out = self.op_and_kill("snapshot", "snapshot", ["snapshot", "create", "--state", self.state,
                                                            "--name", name], 3.0)
        self.settle()
        # A named snapshot that was made is kept, with the tree it held (nothing ran meanwhile).
        _, listing = self.remote_head()
        for s in listing["snapshots"]:
            if name in s.get("names", []):
                self.named.append((name, s["id"]))
        while len(self.named) > 2:
            old, _ = self.named.pop(0)
            self.cli(["snapshot", "delete", "--state", self.state, old], "snapshot-delete")

    def sc_gc(self, fault):
        # Garbage: rewritten and deleted bulk, checkpointed a few times.
        for _ in range(3):
            self.driver_writes(self.rng.uniform(0.2, 0.5), new_files=self.rng.randrange(0, 8),
                               delete=0.1)
            self.cli(["checkpoint", "--state", self.state], "checkpoint-garbage", check=not fault)
        self.op_and_kill("gc", "gc", ["gc", "--state", self.state], 2.0)
        self.settle()
        self.check_kept()

    def check_kept(self):
        """Every snapshot the remote still lists whose tree the soak knows restores equal
        to it (at most two, at random), and the forks: gc kept what they need."""
        _, listing = self.remote_head()
        ids = [s["id"] for s in listing["snapshots"] if s["id"] in self.known and s["id"] != self.last_seq]
        for s in self.rng.sample(ids, min(2, len(ids))):
            self.restore_compare(s, self.known[s], label="restore-kept")
        for url, seq in list(self.forks):
            if seq in self.known and self.rng.random() < 0.5:
                self.restore_compare(seq, self.known[seq], remote=url, label="restore-fork")

    def sc_rollback(self, fault):
        targets = [(n, s) for n, s in self.named if s in self.known and s != self.last_seq]
        if not targets:
            # Make one: a named snapshot now, then change things.
            self.cli(["snapshot", "create", "--state", self.state, "--name", f"soak-{self.round}"], "snapshot-create")
            _, listing = self.remote_head()
            s = max(x["id"] for x in listing["snapshots"] if f"soak-{self.round}" in x.get("names", []))
            self.known[s] = manifest(self.mnt)
            self.named.append((f"soak-{self.round}", s))
            self.driver_writes(self.rng.uniform(0.3, 0.6), new_files=10, delete=0.1)
            w = self.start_workload(seconds=self.rng.uniform(1, 4))
            w.wait(120)
            self.cli(["checkpoint", "--state", self.state], "checkpoint-quiet")
            targets = [(f"soak-{self.round}", s)]
        name, seq = self.rng.choice(targets)
        pre = manifest(self.mnt)
        tgt = self.known[seq]
        rc, out = self.op_and_kill("rollback", "rollback", ["rollback", "--state", self.state, name], 2.0)
        if rc == 0:
            m = re.search(r'"snapshot": (\d+)', out)
            trees = [tgt]
        else:
            trees = [pre, tgt]
        self.settle(expect_trees=trees)

    def sc_fork(self, fault):
        self.fork_n += 1
        url = f"s3://{BUCKET}/fork-{self.fork_n}"
        src_seq = self.last_seq
        kill_cli = self.rng.random() < 0.75
        rc, out = self.op_and_kill("fork", "fork", ["fork", "--state", self.state, "--to", url], 1.5,
                                   kill_cli=kill_cli)
        if self.daemon is None:
            self.settle()
        else:
            # keel lives on: the fork's checks need no restart.
            self.ctl("/clear")
        head, _ = self.remote_head(url)
        if head is not None:
            if head != src_seq:
                raise Finding("fork", f"fork {url} has head {head}, forked from {src_seq}")
            self.restore_compare(head, self.known.get(head), remote=url, label="restore-fork")
            self.forks.append((url, head))
        else:
            # A fork killed half-way is deleted cleanly.
            rc, out = self.cli(["fork", "--delete", url], "fork-delete", cfg=self.cfg_direct, check=False)
            if rc != 0 and "holds no keel workspace" not in out:
                raise Finding("fork", f"keel fork --delete {url} of a fork killed half-way: exit {rc}: {out[-500:]}")
        while len(self.forks) > 2:
            old, _ = self.forks.pop(0)
            self.cli(["fork", "--delete", old], "fork-delete", cfg=self.cfg_direct)

    def switch_state(self, cfg, scenario):
        """A new host: the last keel dies, a fresh state dir restores the remote's head."""
        want = self.known[self.last_seq]
        if self.daemon:
            self.kill_keel(scenario + "_old_host")
        umount_all(self.mnt)
        old = self.state
        self.state = self.new_state_dir()
        self.new_host = self.state
        t0 = now()
        d = self.start_keel(cfg=cfg, extra=["--takeover=force"], expect_ready=False)
        return want, old, d, t0

    def sc_lazy(self, fault):
        cfg = self.cfg_prefetch if self.rng.random() < 0.4 else self.cfg
        want, old, d, t0 = self.switch_state(cfg, "lazy")
        where = self.rng.random()
        if where < 0.3:
            at = self.rng.uniform(0, self.est_of("lazy_start", 0.5))
            ready = d.wait_line(r"step start ready", at)
            self.learn("lazy_start", now() - t0, False) if ready else self.learn("lazy_start", at, True)
            self.kill_keel("lazy", {"op": "lazy_start", "offset": round(at, 3)})
        else:
            if not d.wait_line(r"step start ready", 180):
                if not self.fresh_start_refused_in_outage(d, fault):
                    raise Finding("won't start", f"lazy restore start: {d.output()[-800:]}")
                # The remote is back: the new host starts now.
                d = self.start_keel(cfg=cfg, extra=["--takeover=force"], expect_ready=False)
                t0 = now()
                if not d.wait_line(r"step start ready", 180):
                    raise Finding("won't start", f"lazy restore start after the outage: {d.output()[-800:]}")
            self.learn("lazy_start", now() - t0, False)
            # Cold reads: every file once (the prefetch may race them).
            reader = threading.Thread(target=lambda: self.swallow(manifest, self.mnt), daemon=True)
            t1 = now()
            reader.start()
            at = self.rng.uniform(0, self.est_of("lazy_read", 2.0))
            reader.join(at)
            if reader.is_alive():
                self.learn("lazy_read", at, True)
            else:
                self.learn("lazy_read", now() - t1, False)
            self.kill_keel("lazy", {"op": "lazy_read", "offset": round(at, 3),
                                    "prefetch": cfg == self.cfg_prefetch})
            reader.join(60)
        shutil.rmtree(old, ignore_errors=True)
        self.settle(expect_trees=[want])

    def swallow(self, f, *a):
        try:
            f(*a)
        except OSError:
            pass

    def fresh_start_refused_in_outage(self, d, fault):
        """A new host (an empty state dir) started while the remote is gone has nothing to
        serve: keel waits for the remote up to `[persist] start_wait` (60 s), then says it
        did not answer and exits (the designed behaviour, `boot::workspace::StartWait`); an
        outage shorter than that is waited out. True when keel gave up, after waiting for
        the outage to end."""
        if d.alive() or not (fault and fault.get("until")) or "gave up after" not in d.output():
            return False
        self.say("a fresh state dir started in the outage: keel exited (nothing to serve); "
                 "starting it again once the remote is back")
        while now() < fault["until"]:
            time.sleep(0.2)
        self.end_fault(fault)
        return True

    def sc_eager(self, fault):
        want, old, d, t0 = self.switch_state(self.cfg_eager, "eager")
        at = self.rng.uniform(0, self.est_of("eager_start", 2.0))
        ready = d.wait_line(r"step start ready", at)
        self.learn("eager_start", now() - t0, False) if ready else self.learn("eager_start", at, True)
        self.kill_keel("eager", {"op": "eager_start", "offset": round(at, 3)})
        shutil.rmtree(old, ignore_errors=True)
        # It starts again with the eager config too: the unfinished restore starts over.
        self.settle_with(self.cfg_eager, expect_trees=[want])

    def settle_with(self, cfg, **kw):
        saved = self.cfg
        self.cfg = cfg
        try:
            self.settle(**kw)
        finally:
            self.cfg = saved

    def sc_offline_gc(self, fault):
        w = self.start_workload(seconds=self.rng.uniform(0.5, 3))
        w.wait(120)
        self.driver_writes(0.3, delete=0.1)
        if self.rng.random() < 0.5:
            rc = self.stop_keel()
            if rc != 0 and not fault:
                raise Finding("stop", f"keel mount exit {rc} at SIGTERM")
        else:
            self.kill_keel("offline_gc_before")
        p = Proc(self, [self.keel, "gc", "--config", self.cfg, "--state", self.state], "offline-gc")
        at = self.rng.uniform(0, self.est_of("offline_gc", 2.0))
        t0 = now()
        rc = p.wait(at)
        if rc is not None:
            self.learn("offline_gc", now() - t0, False)
            if rc != 0 and not fault:
                raise Finding("command failed", f"offline keel gc exit {rc}: {p.output()[-600:]}")
        else:
            self.learn("offline_gc", at, True)
        pts = p.kill()
        self.record_kill("offline_gc", "keel gc", pts, {"offset": round(at, 3)})
        self.settle()

    def sc_stop(self, fault):
        self.driver_writes(self.rng.uniform(0.1, 0.4), new_files=self.rng.randrange(0, 10))
        w = self.start_workload()
        try:
            time.sleep(self.rng.uniform(0.2, 2))
            d = self.daemon
            os.kill(d.p.pid, signal.SIGTERM)
            at = self.rng.uniform(0, self.est_of("stop", 2.0))
            t0 = now()
            rc = d.wait(at)
            if rc is not None:
                self.learn("stop", now() - t0, False)
                self.daemon = None
                self.record_kill("stop", "keel mount", None, {"exit": rc})
                if rc != 0 and not fault:
                    raise Finding("stop", f"keel mount exit {rc} after SIGTERM: {d.output()[-600:]}")
            else:
                self.learn("stop", at, True)
                self.kill_keel("stop", {"offset": round(at, 3)})
        finally:
            self.stop_workload(w)
        self.settle()

    def sc_start(self, fault):
        self.kill_keel("start_old")
        self.kill_while_starting()
        self.settle()

    # --- rounds --------------------------------------------------------------------------------
    def setup_tree(self):
        self.say(f"state {self.state}, mount {self.mnt}, moto :{self.moto_port}, proxy :{self.proxy_port}")
        self.start_keel()
        os.makedirs(self.journal_dir(), exist_ok=True)
        wl = Workload(self.mnt, self.journal_path(), self.rng.randrange(1 << 30), self.baseline)
        wl.setup()
        t0 = now()
        for i in range(self.a.big_files):
            d = f"big/d{i % 16}"
            if not os.path.isdir(wl.path(d)):
                os.makedirs(wl.path(d))
            wl.write_new(f"{d}/{wl.name()}", wl.rand_bytes(self.big_size(wl)), sync=False)
        self.say(f"bulk tree: {self.a.big_files} files in {now() - t0:.1f}s")
        w = self.start_workload(seconds=3)
        w.wait(300)
        self.quiesced_checkpoint(check_restore=False)
        self.say(f"first snapshot {self.last_seq}: {len(self.known[self.last_seq])} entries")

    def journal_dir(self):
        return os.path.join(self.work, "journal")

    def choose(self):
        if self.plan:
            return self.plan.pop(0)
        names = list(WEIGHTS)
        return self.rng.choices(names, [WEIGHTS[n] for n in names])[0]

    def done(self):
        if self.deadline and now() > self.deadline:
            return True
        enough_kills = len(self.kills) >= self.a.kills
        enough_faults = sum(1 for f in self.faults if f.get("injected", 0) > 0) >= self.a.faults
        return enough_kills and enough_faults and not self.plan

    def run(self):
        self.start_services()
        self.make_packages()
        self.plan = list(self.a.plan) if self.a.plan else []
        self.fault_plan = list(self.a.fault_plan) if self.a.fault_plan else []
        self.setup_tree()
        while not self.done():
            self.round += 1
            sc = self.choose()
            fault = None
            t0 = now()
            self.say(f"round {self.round}: {sc}")
            try:
                if self.daemon is None:
                    self.start_keel()
                fault = self.cur_fault = self.maybe_fault(sc)
                getattr(self, "sc_" + sc)(fault)
            except Finding as f:
                self.end_fault_quiet(fault)
                self.finding(sc, f)
                if not self.a.keep_going:
                    break
                self.recover()
            except Exception as e:  # a soak bug, not keel's: stop and say where
                self.end_fault_quiet(fault)
                self.say(f"SOAK ERROR in round {self.round} ({sc}): {e}\n{traceback.format_exc()}")
                self.findings.append({"round": self.round, "scenario": sc, "kind": "soak error",
                                      "detail": f"{e}\n{traceback.format_exc()}"})
                break
            self.end_fault_quiet(fault)
            self.timing("round_" + sc, now() - t0)
            if self.round % 10 == 0:
                self.write_report()
        self.write_report()

    def end_fault_quiet(self, f):
        if f is not None and "injected" not in f:
            try:
                self.end_fault(f)
            except OSError:
                pass

    def finding(self, sc, f):
        n = len(self.findings) + 1
        d = os.path.join(self.work, "findings", str(n))
        os.makedirs(d, exist_ok=True)
        self.findings.append({"round": self.round, "scenario": sc, "kind": f.kind,
                              "detail": f.detail, "kept": d})
        self.say(f"FINDING {n} ({f.kind}) in round {self.round} ({sc}): {f.detail}")
        with open(os.path.join(d, "finding.txt"), "w") as fh:
            fh.write(f"round {self.round} scenario {sc}\n{f.kind}: {f.detail}\n")
        if self.daemon and self.daemon.alive():
            try:
                self.daemon.kill()
            except Finding:
                pass
            self.daemon = None
        umount_all(self.mnt)
        umount_all(self.rmnt)
        for src in (self.state, self.journal_path()):
            if os.path.exists(src):
                dst = os.path.join(d, os.path.basename(src))
                try:
                    if os.path.isdir(src):
                        shutil.copytree(src, dst, symlinks=True)
                    else:
                        shutil.copy(src, dst)
                except (OSError, shutil.Error):
                    pass
        for name in os.listdir(self.logs):
            if name.startswith(f"{self.round:04d}-") or name.startswith(f"{self.round - 1:04d}-"):
                shutil.copy(os.path.join(self.logs, name), d)

    def recover(self):
        """After a finding with --keep-going: whatever the tree is now becomes the baseline."""
        try:
            self.start_keel()
            self.quiesced_checkpoint(check_restore=False)
        except Finding as f:
            self.say(f"cannot continue after the finding: {f}")
            raise SystemExit(1)

    # --- the report ---------------------------------------------------------------------------
    def write_report(self):
        stats = {}
        try:
            stats = self.ctl("/stats")
        except OSError:
            pass
        points = {}
        for k in self.kills:
            label = " + ".join(k["points"]) if k["points"] else "idle"
            key = (k["process"], label)
            points[key] = points.get(key, 0) + 1
        inside = {}
        for k in self.kills:
            for p in k["points"]:
                op = p.split("/")[0]
                if not p.startswith("("):
                    inside[op] = inside.get(op, 0) + 1
        effective = [f for f in self.faults if f.get("injected", 0) > 0]
        by_type = {}
        for f in self.faults:
            t = by_type.setdefault(f["type"], {"episodes": 0, "effective": 0, "injected": 0})
            t["episodes"] += 1
            t["effective"] += 1 if f.get("injected", 0) > 0 else 0
            t["injected"] += f.get("injected", 0)
        rep = {
            "seed": self.a.seed, "rounds": self.round, "minutes": round((now() - self.started) / 60, 1),
            "kills": len(self.kills), "kills_inside_an_operation": sum(1 for k in self.kills if k["points"] and not k["points"][0].startswith("(")),
            "kill_points": [{"process": p, "points": l, "kills": n} for (p, l), n in sorted(points.items())],
            "kills_inside_by_operation": inside,
            "kills_by_scenario": self.count_by("scenario"),
            "faults": len(self.faults), "faults_effective": len(effective), "faults_by_type": by_type,
            "remote_requests": stats.get("requests"), "remote_faults_injected": stats.get("faults"),
            "findings": self.findings,
            "commands_failed_under_faults": len(self.cli_failures),
            "timings_s": {k: {"n": len(v), "median": round(sorted(v)[len(v) // 2], 2), "max": round(max(v), 2)}
                          for k, v in sorted(self.timings.items())},
            "estimates_s": {k: round(v, 2) for k, v in sorted(self.est.items())},
        }
        with open(os.path.join(self.work, "report.json"), "w") as f:
            json.dump(rep, f, indent=1)
        with open(os.path.join(self.work, "kills.jsonl"), "w") as f:
            for k in self.kills:
                f.write(json.dumps(k) + "\n")
        with open(os.path.join(self.work, "faults.jsonl"), "w") as f:
            for x in self.faults:
                f.write(json.dumps(x) + "\n")
        md = self.markdown(rep)
        with open(os.path.join(self.work, "report.md"), "w") as f:
            f.write(md)
        if self.a.report:
            with open(self.a.report, "w") as f:
                f.write(md)
        return rep

    def count_by(self, key):
        out = {}
        for k in self.kills:
            out[k[key]] = out.get(k[key], 0) + 1
        return dict(sorted(out.items()))

    def markdown(self, rep):
        L = [f"# keel kill-anywhere soak (seed {rep['seed']})", "",
             f"{rep['rounds']} rounds in {rep['minutes']} min: **{rep['kills']} kills** "
             f"({rep['kills_inside_an_operation']} inside an operation), **{rep['faults_effective']} remote faults** "
             f"(of {rep['faults']} episodes), **{len(rep['findings'])} findings**.", "",
             "## Kill points (operation/step open in the killed process at SIGKILL)", "",
             "| process | inside | kills |", "|---|---|---:|"]
        for kp in rep["kill_points"]:
            L.append(f"| {kp['process']} | {kp['points'] or 'idle'} | {kp['kills']} |")
        L += ["", "Kills inside each operation: " + ", ".join(f"{k} {v}" for k, v in sorted(rep["kills_inside_by_operation"].items())),
              "", "Kills by scenario: " + ", ".join(f"{k} {v}" for k, v in rep["kills_by_scenario"].items()),
              "", "## Remote faults", "", "| fault | episodes | effective | faulty answers |", "|---|---:|---:|---:|"]
        for t, v in sorted(rep["faults_by_type"].items()):
            L.append(f"| {t} | {v['episodes']} | {v['effective']} | {v['injected']} |")
        L += ["", f"Requests through the proxy by method: {rep['remote_requests']}; faults injected by kind: "
              f"{rep['remote_faults_injected']}; keel commands that failed during a fault (allowed): "
              f"{rep['commands_failed_under_faults']}.", "", "## Findings", ""]
        if not rep["findings"]:
            L.append("None.")
        for f in rep["findings"]:
            L.append(f"- round {f['round']} ({f['scenario']}): **{f['kind']}**: {f['detail'][:2000]}")
        L += ["", "## Timings (s)", "", "| what | n | median | max |", "|---|---:|---:|---:|"]
        for k, v in rep["timings_s"].items():
            L.append(f"| {k} | {v['n']} | {v['median']} | {v['max']} |")
        return "\n".join(L) + "\n"

    def cleanup(self):
        for d in (self.daemon,):
            if d is not None and d.alive():
                try:
                    d.kill()
                except Finding:
                    pass
        umount_all(self.mnt)
        umount_all(self.rmnt)
        for p in (getattr(self, "proxy", None), getattr(self, "moto", None)):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "workload":
        ap = argparse.ArgumentParser(prog="soak.py workload")
        ap.add_argument("cmd")
        ap.add_argument("--mnt", required=True)
        ap.add_argument("--journal", required=True)
        ap.add_argument("--seed", type=int, required=True)
        ap.add_argument("--baseline", required=True)
        ap.add_argument("--pkgs")
        ap.add_argument("--npm-cache")
        ap.add_argument("--home")
        ap.add_argument("--seconds", type=float)
        return workload_main(ap.parse_args())
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="the test command's form: every scenario once, a few minutes")
    ap.add_argument("--kills", type=int, default=500)
    ap.add_argument("--faults", type=int, default=100)
    ap.add_argument("--minutes", type=float, default=0, help="stop after this long whatever the counts")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--work", help="work dir (default: a new /tmp/soak-XXXX)")
    ap.add_argument("--keel", default=os.environ.get("KEEL_BIN", os.path.join(REPO, "target/release/keel")))
    ap.add_argument("--report", help="also write the markdown report here")
    ap.add_argument("--keep-going", action="store_true", help="go on after a finding")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--scenarios", help="only these (comma-separated) of " + ",".join(SCENARIOS))
    a = ap.parse_args()
    if a.seed is None:
        a.seed = random.randrange(1 << 31)
    a.plan = None
    a.fault_plan = None
    if a.short:
        a.kills, a.faults = 0, 0
        a.plan = ["work", "checkpoint", "gc", "rollback", "snapshot", "fork", "lazy", "eager",
                  "offline_gc", "stop", "start", "checkpoint", "work", "lazy"]
        a.fault_plan = [None, "err500", None, None, "drop", None, None, None, "err500_after",
                        "slow", None, "outage:6", "outage:30", None]
        a.big_files, a.big_max, a.big_fraction = 300, 3 << 20, 0.05
        a.work_max, a.fault_rate, a.outage_short, a.long_outage_every = 4.0, 0.0, 6, 0
        a.restore_checks, a.unknown_head_checks, a.start_kills = 1.0, 1.0, 0.1
        a.restart_in_outage = 1.0
    else:
        a.big_files, a.big_max, a.big_fraction = 1500, 6 << 20, 0.03
        a.work_max, a.fault_rate, a.outage_short, a.long_outage_every = 8.0, 0.3, 12, 8
        a.restore_checks, a.unknown_head_checks, a.start_kills = 0.5, 0.3, 0.08
        a.restart_in_outage = 0.5
    if a.scenarios:
        allowed = [s.strip() for s in a.scenarios.split(",")]
        for s in allowed:
            if s not in SCENARIOS:
                ap.error(f"--scenarios: no scenario {s!r} (one of {', '.join(SCENARIOS)})")
        if a.plan:
            keep = [i for i, s in enumerate(a.plan) if s in allowed]
            a.plan = [a.plan[i] for i in keep]
            a.fault_plan = [a.fault_plan[i] for i in keep]
        for s in list(WEIGHTS):
            if s not in allowed:
                del WEIGHTS[s]
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        print("soak: needs root and /dev/fuse", file=sys.stderr)
        return 2
    for tool in ("moto_server", "git", "npm"):
        if not shutil.which(tool):
            print(f"soak: needs {tool}", file=sys.stderr)
            return 2
    if not os.access(a.keel, os.X_OK):
        print(f"soak: no keel binary at {a.keel}", file=sys.stderr)
        return 2
    if not a.work:
        import tempfile
        a.work = tempfile.mkdtemp(prefix="soak-", dir="/tmp")
    os.makedirs(a.work, exist_ok=True)
    s = Soak(a)
    s.say(f"soak: seed {a.seed}, work dir {a.work}, keel {a.keel}"
          + (" (short)" if a.short else f", goal {a.kills} kills and {a.faults} remote faults"))
    rc = 1
    try:
        s.run()
        rep = s.write_report()
        print(open(os.path.join(a.work, "report.md")).read())
        rc = 0 if not rep["findings"] else 1
    except KeyboardInterrupt:
        s.write_report()
        rc = 130
    finally:
        s.cleanup()
        if rc == 0 and not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)
        else:
            print(f"soak: work dir kept: {a.work}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())

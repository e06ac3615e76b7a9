#!/usr/bin/env python3
"""cold-bench: cold starts of a keel workspace from S3 at real request latency.

    script/cold-bench.py [--short] [--reps N] [--latencies 0,30,100] [--bandwidth 100M]
                         [--prefetch-at 30] [--variants off,on] [--out FILE]
                         [--populate-extra 'pack_below = "0"']

The workspace is the npm-bench install (express, lodash, react, eslint, jest, typescript,
webpack; about 13,000 files) plus rxjs and the @types of the main packages, and a
TypeScript project (rxjs 7.8.1's 251 sources, typechecked against them) tracked by git
with node_modules ignored. It is copied into a `keel mount` checkpointing to moto (in
memory) through script/s3-proxy.py, then a previous session (a cold start that runs every
workload once, then stops cleanly: its last checkpoint records what it read) ends the
history. Each measured cold session then:

  1. starts `keel mount` on an empty state dir (lazy restore from the remote) with the
     proxy adding D ms to every request and capping the link at --bandwidth each way;
  2. "mount to usable": from the spawn until a stat of proj/tsconfig.json answers;
  3. runs one workload, timed: `git status`, reading every .js of node_modules once
     (`find | xargs cat`, one file after another), `tsc --noEmit` of the project;
  4. records the GETs the proxy saw (until usable, then during the workload), keel's peak
     RSS (VmHWM), and kills keel with SIGKILL, so no session changes the remote.

Beside them, in the same run: the workloads on the source tree on ext4 (page cache warm)
and on a warm keel (the populating state dir, every byte local, a fresh mount). Prints one
markdown table per variant (medians of --reps) and the ratios to warm keel. KEEL_BIN picks
the binary (default target/release/keel); --variants names config variants (`off`: the
defaults; `on`: prefetch = true, at the --prefetch-at latency only; more with KEEL_VARIANT_<name>
environment variables holding extra `[persist]` lines); --populate-extra adds `[persist]`
lines to the sessions that write the remote (the populating one and the previous session),
e.g. `pack_below = "0"` for the layout before packs. COLD_BENCH_KEEP=1 keeps the run
directory (keel's logs; KEEL_LOG=info,keel::step=debug times each checkpoint step). The first checkpoint's line says how
many objects the remote holds after it (and how many are chunks, packs and pack indexes).
Needs root, /dev/fuse, moto_server,
npm, git, curl. --short: a small generated workspace, D = 0 and 30, one rep (checks that
the script works).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.environ.get("BENCH_DIR", os.path.join(REPO, ".bench"))
KEEL = os.environ.get("KEEL_BIN", os.path.join(REPO, "target/release/keel"))

PACKAGE_JSON = {
    "name": "keel-cold-bench",
    "version": "1.0.0",
    "private": True,
    "dependencies": {
        "express": "4.21.2",
        "lodash": "4.17.21",
        "react": "18.3.1",
        "react-dom": "18.3.1",
        "rxjs": "7.8.1",
    },
    "devDependencies": {
        "eslint": "9.17.0",
        "jest": "29.7.0",
        "typescript": "5.7.3",
        "webpack": "5.97.1",
        "@types/node": "22.10.2",
        "@types/react": "18.3.18",
        "@types/express": "5.0.0",
        "@types/lodash": "4.17.13",
        "@types/jest": "29.5.14",
    },
}

TSCONFIG = {
    "compilerOptions": {
        "strict": True,
        "noImplicitReturns": True,
        "moduleResolution": "node",
        "noEmit": True,
        "lib": ["esnext", "dom"],
        "target": "esnext",
        "types": ["node", "jest", "react", "express", "lodash"],
        "baseUrl": ".",
        "paths": {"rxjs": ["./src/index"], "rxjs/*": ["./src/*"]},
    },
    "include": ["src/**/*.ts"],
}

WORKLOADS = {
    "status": ("`git status`", ["git", "status", "--porcelain"], "."),
    "js": (
        "read every .js of node_modules once",
        ["sh", "-c", "find node_modules -name '*.js' -type f -print0 | xargs -0 cat >/dev/null"],
        ".",
    ),
    "tsc": ("`tsc --noEmit` (rxjs sources)", ["node", "../node_modules/typescript/bin/tsc", "-p", "."], "proj"),
}


def log(*a):
    print("cold-bench:", *a, file=sys.stderr, flush=True)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def prepare_source(short):
    """The workspace's source tree on ext4 (built once, kept in BENCH_DIR)."""
    src = os.path.join(BENCH_DIR, "cold-src-short" if short else "cold-src")
    if os.path.exists(os.path.join(src, ".ready")):
        return src
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    if short:
        os.makedirs(os.path.join(src, "node_modules/gen"))
        for i in range(300):
            size = 1000 + (i * 7919) % 60000
            with open(os.path.join(src, f"node_modules/gen/m{i}.js"), "wb") as f:
                f.write(os.urandom(size // 2).hex().encode()[:size])
        os.makedirs(os.path.join(src, "proj/src"))
        for i in range(50):
            with open(os.path.join(src, f"proj/src/f{i}.ts"), "w") as f:
                f.write(f"export const v{i}: number = {i};\n" * 200)
    else:
        env = dict(os.environ, npm_config_cache=os.path.join(BENCH_DIR, "npm-cache"),
                   npm_config_update_notifier="false", npm_config_fund="false",
                   npm_config_audit="false", npm_config_loglevel="error")
        with open(os.path.join(src, "package.json"), "w") as f:
            json.dump(PACKAGE_JSON, f, indent=2)
        log("npm install of the workspace (once; cache in BENCH_DIR/npm-cache)")
        run(["npm", "install", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=src, env=env,
            stdout=subprocess.DEVNULL)
        shutil.copytree(os.path.join(src, "node_modules/rxjs/src"), os.path.join(src, "proj/src"))
        with open(os.path.join(src, "proj/tsconfig.json"), "w") as f:
            json.dump(TSCONFIG, f, indent=2)
        # The typecheck must pass on the source tree.
        run(["node", "../node_modules/typescript/bin/tsc", "-p", "."], cwd=os.path.join(src, "proj"))
    with open(os.path.join(src, ".gitignore"), "w") as f:
        f.write("node_modules/\n")
    with open(os.path.join(src, "proj/tsconfig.json"), "a"):
        pass
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@keel", "-c", "init.defaultBranch=main"]
    run(git + ["init", "-q"], cwd=src)
    run(git + ["add", "-A"], cwd=src)
    run(git + ["commit", "-qm", "bench"], cwd=src)
    open(os.path.join(src, ".ready"), "w").close()
    return src


def tree_stats(root):
    files = size = bodies = js = 0
    for d, dirs, fs in os.walk(root):
        if d == root and ".git" in dirs:
            pass
        for n in fs:
            p = os.path.join(d, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            files += 1
            size += st.st_size
            bodies += st.st_size > 4096
            js += n.endswith(".js") and "node_modules" in d
    return files, size, bodies, js


class Moto:
    def __init__(self, run_dir, bandwidth):
        self.procs = []
        port = free_port()
        self.procs.append(subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)],
                                           stdout=subprocess.DEVNULL,
                                           stderr=open(os.path.join(run_dir, "moto.log"), "w")))
        for _ in range(150):
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/keel", method="PUT")
                urllib.request.urlopen(req, timeout=2)
                break
            except Exception:
                time.sleep(0.2)
        else:
            raise SystemExit("cold-bench: moto did not come up")
        pf = os.path.join(run_dir, "proxy.port")
        self.procs.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "script/s3-proxy.py"), "--upstream", f"127.0.0.1:{port}",
             "--port-file", pf, "--bandwidth", bandwidth],
            stderr=open(os.path.join(run_dir, "proxy.log"), "w")))
        for _ in range(150):
            if os.path.exists(pf):
                break
            time.sleep(0.1)
        self.port = int(open(pf).read())

    def ctl(self, path, method="GET"):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/__proxy/{path}", method=method)
        return json.load(urllib.request.urlopen(req, timeout=10))

    def gets(self):
        s = self.ctl("stats")
        return s["by_method"].get("GET", 0) + s["by_method"].get("GET_RANGE", 0), s

    def objects(self):
        """Objects in the bucket: {"all": n, "chunks": loose chunks, "packs": .pack, "idx": .idx}."""
        import urllib.parse
        import xml.etree.ElementTree as ET
        ns = "{http://s3.amazonaws.com/doc/2006-03-01/}"
        out = {"all": 0, "chunks": 0, "packs": 0, "idx": 0, "bytes": 0}
        token = None
        while True:
            q = {"list-type": "2", "max-keys": "1000"}
            if token:
                q["continuation-token"] = token
            url = f"http://127.0.0.1:{self.port}/keel?" + urllib.parse.urlencode(q)
            root = ET.fromstring(urllib.request.urlopen(url, timeout=60).read())
            for c in root.iter(ns + "Contents"):
                key = c.find(ns + "Key").text
                out["all"] += 1
                out["bytes"] += int(c.find(ns + "Size").text)
                if "/chunks/packs/" in key:
                    out["packs" if key.endswith(".pack") else "idx"] += 1
                elif "/chunks/" in key:
                    out["chunks"] += 1
            if root.findtext(ns + "IsTruncated") != "true":
                return out
            token = root.findtext(ns + "NextContinuationToken")

    def close(self):
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def is_mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if line.split(" ")[4] == path:
                return True
    return False


def vm(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class Keel:
    """One `keel mount`, started detached, its output in LOG."""

    def __init__(self, cfg, state, mnt, log_path):
        os.makedirs(mnt, exist_ok=True)
        self.mnt, self.log = mnt, log_path
        self.t0 = time.monotonic()
        self.p = subprocess.Popen([KEEL, "mount", "--config", cfg, "--state", state, mnt],
                                  stdin=subprocess.DEVNULL, stdout=open(log_path, "a"),
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def wait_usable(self, probe, timeout=600):
        """Seconds from the spawn until `probe` (a path in the mount) can be stat'ed."""
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"keel exited {self.p.returncode}:\n" + open(self.log).read()[-3000:])
            if is_mounted(self.mnt):
                try:
                    os.stat(os.path.join(self.mnt, probe))
                    return time.monotonic() - self.t0
                except OSError:
                    pass
            if time.monotonic() - self.t0 > timeout:
                raise RuntimeError("keel not usable in time:\n" + open(self.log).read()[-3000:])
            time.sleep(0.002)

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        if self.p.wait(600) != 0:
            raise RuntimeError(f"keel exited {self.p.returncode}:\n" + open(self.log).read()[-3000:])

    def kill(self):
        self.p.kill()
        self.p.wait()
        subprocess.run(["umount", "-l", self.mnt], stderr=subprocess.DEVNULL)


def checkpoint_seconds(log_path):
    """The elapsed time keel's log gives for the last checkpoint that wrote a snapshot."""
    import re
    found = re.findall(r"snapshot \d+ \((?:full|delta)\): [^\n]*?, ([0-9.]+)s", open(log_path).read())
    return float(found[-1]) if found else None


def timed(cmd, cwd):
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{cmd} in {cwd} failed ({r.returncode}): {r.stderr.decode()[-2000:]}")
    return took


def config(path, moto, extra="", remote=True, flush="120s"):
    with open(path, "w") as f:
        f.write("[workspace]\n[persist]\n")
        if remote:
            f.write(f'remote = "s3://keel/ws"\nendpoint = "http://127.0.0.1:{moto.port}"\n'
                    f'region = "us-east-1"\nallow_http = true\ntakeover = "force"\n')
        else:
            f.write('remote = "none"\n')
        f.write(f'interval = "0s"\nflush_timeout = "{flush}"\n{extra}\n[shutdown]\nflush_timeout = "{flush}"\n')


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--latencies", default=None)
    ap.add_argument("--bandwidth", default="100M")
    ap.add_argument("--prefetch-at", type=float, default=30)
    ap.add_argument("--variants", default="off,on")
    ap.add_argument("--workloads", default="status,js,tsc")
    ap.add_argument("--out")
    ap.add_argument("--populate-extra", default="")
    a = ap.parse_args()
    lat = [float(x) for x in (a.latencies or ("0,30" if a.short else "0,30,100")).split(",")]
    workloads = a.workloads.split(",")
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        raise SystemExit("cold-bench: needs root and /dev/fuse")
    for tool in ["moto_server", "git", "node", "npm"]:
        if not shutil.which(tool):
            raise SystemExit(f"cold-bench: needs {tool}")
    if not os.access(KEEL, os.X_OK):
        raise SystemExit(f"cold-bench: no keel at {KEEL} (cargo build --release)")
    os.makedirs(BENCH_DIR, exist_ok=True)
    src = prepare_source(a.short)
    if a.short:
        workloads = [w for w in workloads if w != "tsc"]
    run_dir = tempfile.mkdtemp(prefix="cold.", dir=BENCH_DIR)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    moto = Moto(run_dir, a.bandwidth)
    mounts = []
    try:
        bench(a, lat, workloads, src, run_dir, moto, mounts)
    finally:
        for m in mounts:
            subprocess.run(["umount", "-l", m], stderr=subprocess.DEVNULL)
        moto.close()
        if os.environ.get("COLD_BENCH_KEEP"):
            log(f"kept {run_dir} (COLD_BENCH_KEEP)")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


def bench(a, lat, workloads, src, run_dir, moto, mounts):
    files, size, bodies, js = tree_stats(src)
    header = [f"# cold-bench {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} keel {KEEL}",
              f"# workspace: {files} files, {size >> 20} MiB, {bodies} over inline_max (4 KiB), "
              f"{js} .js files in node_modules; reps={a.reps} bandwidth={a.bandwidth}/s each way"]
    for h in header:
        log(h)
    mnt = os.path.join(run_dir, "mnt")
    mounts.append(mnt)
    # Populate: copy the tree in, stop cleanly (the final checkpoint uploads it).
    cfg_pop = os.path.join(run_dir, "populate.toml")
    config(cfg_pop, moto, extra=a.populate_extra)
    warm_state = os.path.join(run_dir, "warm-state")
    k = Keel(cfg_pop, warm_state, mnt, os.path.join(run_dir, "populate.log"))
    k.wait_usable(".")
    log("populating the remote")
    run(["cp", "-a", src + "/.", mnt + "/"])
    moto.ctl("reset", "POST")
    t0 = time.monotonic()
    k.stop()
    pop = moto.ctl("stats")
    upload = {"objects_put": pop["by_method"].get("PUT", 0), "seconds": time.monotonic() - t0,
              "objects": moto.objects(), "checkpoint": checkpoint_seconds(os.path.join(run_dir, "populate.log"))}
    log(f"first checkpoint (at the stop) in {upload['seconds']:.1f} s: {json.dumps(pop['by_method'])}; "
        f"remote: {json.dumps(upload['objects'])}")
    if a.populate_extra:
        header.append(f"# sessions that wrote the remote: [persist] {a.populate_extra}")
    # The previous session: a cold start that runs every workload, then stops cleanly.
    log("previous session (cold start, every workload, clean stop)")
    prev = os.path.join(run_dir, "prev-state")
    k = Keel(cfg_pop, prev, mnt, os.path.join(run_dir, "prev.log"))
    k.wait_usable("proj/tsconfig.json")
    for w in workloads:
        timed(WORKLOADS[w][1], os.path.join(mnt, WORKLOADS[w][2]))
    k.stop()
    shutil.rmtree(prev, ignore_errors=True)

    res = {}  # (column, row) -> [values]

    def add(col, row, v):
        res.setdefault((col, row), []).append(v)

    variants = a.variants.split(",")
    cols = ["ext4", "warm keel"]
    for d in lat:
        for v in variants:
            if v == "on" and d != a.prefetch_at:
                continue
            cols.append((d, v))
    for rep in range(a.reps):
        log(f"repetition {rep + 1}/{a.reps}")
        for w in workloads:
            add("ext4", w, timed(WORKLOADS[w][1], os.path.join(src, WORKLOADS[w][2])))
        cfg_warm = os.path.join(run_dir, "warm.toml")
        config(cfg_warm, moto, remote=False)
        for w in workloads:
            k = Keel(cfg_warm, warm_state, mnt, os.path.join(run_dir, "warm.log"))
            add("warm keel", "usable", k.wait_usable("proj/tsconfig.json"))
            add("warm keel", w, timed(WORKLOADS[w][1], os.path.join(mnt, WORKLOADS[w][2])))
            add("warm keel", w + " rss", vm(k.p.pid, "VmHWM"))
            k.stop()
        for col in cols[2:]:
            d, v = col
            extra = {"off": "", "on": "prefetch = true"}.get(v, os.environ.get(f"KEEL_VARIANT_{v}", ""))
            cfg = os.path.join(run_dir, f"cold-{v}.toml")
            config(cfg, moto, extra=extra.replace("\\n", "\n"))
            moto.ctl(f"set?latency_ms={d}", "POST")
            for w in workloads:
                state = os.path.join(run_dir, "cold-state")
                shutil.rmtree(state, ignore_errors=True)
                g0, _ = moto.gets()
                k = Keel(cfg, state, mnt, os.path.join(run_dir, f"cold-{d}-{v}.log"))
                try:
                    add(col, "usable", k.wait_usable("proj/tsconfig.json"))
                    g1, _ = moto.gets()
                    add(col, "usable gets", g1 - g0)
                    add(col, w, timed(WORKLOADS[w][1], os.path.join(mnt, WORKLOADS[w][2])))
                    g2, _ = moto.gets()
                    add(col, w + " gets", g2 - g1)
                    add(col, w + " rss", vm(k.p.pid, "VmHWM"))
                    log(f"  D={d:g} ms {v}: usable in {res[(col, 'usable')][-1]:.2f} s ({g1 - g0} GETs), "
                        f"{w} {res[(col, w)][-1]:.2f} s, {g2 - g1} GETs")
                except RuntimeError as e:
                    # A failed session is reported in the table, not retried.
                    add(col, w + " failed", 1)
                    log(f"  D={d:g} ms {v}: {w} FAILED: {str(e)[:300]}")
                finally:
                    k.kill()
            moto.ctl("set?latency_ms=0", "POST")
    report(a, header, cols, workloads, res, upload)


def report(a, header, cols, workloads, res, upload):
    def med(col, row):
        v = [x for x in res.get((col, row), []) if x is not None]
        return statistics.median(v) if v else None

    def work(col, row):
        f = len(res.get((col, row + " failed"), []))
        m = med(col, row)
        t = "–" if m is None else f"{m:.2f} s"
        return t if not f else f"{t} ({f} failed)"

    def name(c):
        return c if isinstance(c, str) else f"cold, {c[0]:g} ms" + ("" if c[1] == "off" else f", {'prefetch' if c[1] == 'on' else c[1]}")

    out = list(header)
    out.append("")
    out.append("| workload | " + " | ".join(name(c) for c in cols) + " |")
    out.append("|---|" + "---:|" * len(cols))
    cell = lambda x, f="{:.2f} s": "–" if x is None else f.format(x)
    out.append("| mount to usable | " + " | ".join(cell(med(c, "usable")) for c in cols) + " |")
    for w in workloads:
        out.append(f"| {WORKLOADS[w][0]} | " + " | ".join(work(c, w) for c in cols) + " |")
    out.append("| GETs until usable | " + " | ".join(cell(med(c, "usable gets"), "{:.0f}") for c in cols) + " |")
    for w in workloads:
        out.append(f"| GETs, {w} | " + " | ".join(cell(med(c, w + " gets"), "{:.0f}") for c in cols) + " |")
    rss = lambda c: max([x for w in workloads for x in res.get((c, w + " rss"), []) if x] or [0]) / 1024 or None
    out.append("| keel peak RSS | " + " | ".join(cell(rss(c), "{:.0f} MiB") for c in cols) + " |")
    out.append("")
    out.append("Ratios to warm keel (workload time):")
    out.append("")
    out.append("| workload | " + " | ".join(name(c) for c in cols[2:]) + " |")
    out.append("|---|" + "---:|" * len(cols[2:]))
    for w in workloads:
        warm = med("warm keel", w)
        out.append(f"| {w} | " + " | ".join(
            "–" if med(c, w) is None or not warm else f"{med(c, w) / warm:.2f}x" for c in cols[2:]) + " |")
    out.append("")
    o = upload["objects"]
    cp = upload["checkpoint"]
    out.append(f"First checkpoint of the workspace (the stop after copying it in, at 0 ms): "
               f"{upload['seconds']:.1f} s from SIGTERM to exit, the checkpoint itself "
               f"{'?' if cp is None else f'{cp:.2f}'} s (keel's log), "
               f"{upload['objects_put']} PUTs; then {o['all']} objects "
               f"on the remote ({o['bytes'] >> 20} MiB): {o['chunks']} chunks, {o['packs']} packs, "
               f"{o['idx']} pack indexes.")
    text = "\n".join(out)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

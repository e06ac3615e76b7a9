#!/usr/bin/env python3
"""Measures processes started through keel's control API against a running `keel run`
(started by script/exec-bench.sh): exec round trips of `true` over the Unix socket and TCP
(p50/p99), beside `podman exec CONTAINER true`; output throughput of `head -c SIZE
/dev/zero` to a reading client (the NDJSON stream of POST /exec, and the raw output route);
keel's RSS idle, with N concurrent processes, and with one process writing a lot while no
client reads; the time diff=true adds to an exec that changes F files of a W-file workspace.
Prints Markdown tables. Timing only: nothing here is asserted."""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import time


class UnixConn(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("keel", timeout=600)
        self.unix_path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.unix_path)
        self.sock = s


def conn(target):
    if target.startswith("/"):
        return UnixConn(target)
    return http.client.HTTPConnection(target, timeout=600)


def call(target, method, path, body=None, token=None):
    c = conn(target)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    data = json.dumps(body).encode() if body is not None else b""
    c.request(method, path, body=data, headers=headers)
    r = c.getresponse()
    return c, r


def exec_events(target, body, token=None):
    c, r = call(target, "POST", "/exec", body, token)
    data = r.read()
    c.close()
    if r.status != 200:
        raise SystemExit(f"POST /exec: {r.status} {data[:200]!r}")
    return [json.loads(l) for l in data.splitlines() if l]


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for l in f:
            if l.startswith("VmRSS:"):
                return int(l.split()[1])
    return 0


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])


def round_trips(target, n, token=None):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        evs = exec_events(target, {"argv": ["true"]}, token)
        out.append((time.perf_counter() - t0) * 1000)
        assert evs[-1]["type"] == "exit" and evs[-1]["code"] == 0, evs[-1]
    return out


def podman_trips(container, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["podman", "exec", container, "true"], check=True)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def throughput_ndjson(target, size):
    c, r = call(target, "POST", "/exec", {"shell": f"head -c {size} /dev/zero"})
    t0 = time.perf_counter()
    wire = 0
    gaps = 0
    rest = b""
    ex = None
    while True:
        b = r.read(1 << 20)
        if not b:
            break
        wire += len(b)
        lines = (rest + b).split(b"\n")
        rest = lines.pop()
        for l in lines:
            if not l.startswith(b'{"type":"stdout"'):
                v = json.loads(l)
                if v["type"] == "gap":
                    gaps += v["bytes"]
                elif v["type"] == "exit":
                    ex = v
    dt = time.perf_counter() - t0
    c.close()
    assert ex and ex["stdout_bytes"] == size, ex
    return (size - gaps) / dt, wire / dt, gaps


def throughput_raw(target, size):
    c, r = call(target, "POST", "/exec", {"shell": f"head -c {size} /dev/zero", "detach": True})
    pid = json.loads(r.read())["id"]
    c.close()
    c, r = call(target, "GET", f"/processes/{pid}/output?format=raw&follow=1")
    t0 = time.perf_counter()
    got = 0
    while True:
        b = r.read(1 << 20)
        if not b:
            break
        got += len(b)
    dt = time.perf_counter() - t0
    c.close()
    return got, got / dt


def wait_done(target, pid):
    while True:
        c, r = call(target, "GET", f"/processes/{pid}")
        v = json.loads(r.read())
        c.close()
        if v["state"] == "done":
            return v
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--tcp", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--keel-pid", type=int, required=True)
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--container", default="")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--podman-runs", type=int, default=50)
    ap.add_argument("--size", type=int, default=1 << 30)
    ap.add_argument("--big", type=int, default=10 << 30)
    ap.add_argument("--concurrent", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="output throughput rounds")
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--changed", type=int, default=1000)
    ap.add_argument("--only", default="trips,output,rss,diff",
                    help="the sections to run, comma-separated: trips, output, rss, diff")
    a = ap.parse_args()
    sock, tcp, tok = a.socket, a.tcp, a.token
    only = set(a.only.split(","))
    if "trips" in only:
        section_trips(a, sock, tcp, tok)
    if "output" in only:
        section_output(a, sock)
    if "rss" in only:
        section_rss(a, sock)
    if "diff" in only:
        section_diff(a, sock)


def section_trips(a, sock, tcp, tok):
    print("#### Exec round trip of `true`\n")
    round_trips(sock, 20)
    rows = []
    hz = os.sysconf("SC_CLK_TCK")
    for name, t, tk in (("keel, Unix socket", sock, None), ("keel, TCP (token)", tcp, tok)):
        c0 = cpu_ticks(a.keel_pid)
        xs = round_trips(t, a.runs, tk)
        cpu_us = (cpu_ticks(a.keel_pid) - c0) / hz * 1e6 / len(xs)
        rows.append((name, len(xs), statistics.median(xs), pct(xs, 99), cpu_us))
    if a.container:
        podman_trips(a.container, 3)
        xs = podman_trips(a.container, a.podman_runs)
        rows.append(("podman exec", len(xs), statistics.median(xs), pct(xs, 99), None))
    print("| path | runs | p50 ms | p99 ms | keel CPU per exec, µs |\n|---|---:|---:|---:|---:|")
    for r in rows:
        cpu = "" if r[4] is None else f"{r[4]:.0f}"
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {cpu} |")
    if a.container:
        print(f"\npodman exec p50 / keel socket p50: {rows[-1][2] / rows[0][2]:.0f}x")



def section_output(a, sock):
    print(f"\n#### Output throughput of `head -c {a.size >> 20}M /dev/zero` to a reading client\n")
    tck = os.sysconf("SC_CLK_TCK")
    rows = {"ndjson": [], "raw": []}
    gaps_total, lost_total = 0, 0
    for _ in range(a.rounds):
        c0 = cpu_ticks(a.keel_pid)
        dec, wire, gaps = throughput_ndjson(sock, a.size)
        rows["ndjson"].append((dec, wire, (cpu_ticks(a.keel_pid) - c0) / tck))
        c0 = cpu_ticks(a.keel_pid)
        got, raw = throughput_raw(sock, a.size)
        rows["raw"].append((raw, raw, (cpu_ticks(a.keel_pid) - c0) / tck))
        gaps_total += gaps
        lost_total += a.size - got
    gib = a.size / (1 << 30)
    fmt = lambda xs: ", ".join(f"{x:.0f}" for x in xs)
    print(f"{a.rounds} round(s), NDJSON then raw in each; keel's CPU per GiB (median in bold)\n")
    print("| route | output delivered MB/s | on the wire MB/s | keel CPU s/GiB |\n|---|---|---|---|")
    for name, label in (("ndjson", "POST /exec (NDJSON, base64)"),
                        ("raw", "GET /processes/ID/output?format=raw&follow=1")):
        r = rows[name]
        cpus = [c / gib for _, _, c in r]
        print(f"| {label} | {fmt(x / 1e6 for x, _, _ in r)} | {fmt(w / 1e6 for _, w, _ in r)} | "
              f"{', '.join(f'{c:.2f}' for c in cpus)} (**{statistics.median(cpus):.2f}**) |")
    print(f"\nbytes not delivered: {gaps_total} through NDJSON (gaps), {lost_total} raw")


def section_rss(a, sock):
    print("\n#### keel's RSS\n")
    time.sleep(1)
    idle = rss_kib(a.keel_pid)
    ids = []
    for _ in range(a.concurrent):
        c, r = call(sock, "POST", "/exec", {"argv": ["sleep", "600"], "detach": True})
        ids.append(json.loads(r.read())["id"])
        c.close()
    time.sleep(1)
    many = rss_kib(a.keel_pid)
    for i in ids:
        c, r = call(sock, "DELETE", f"/processes/{i}")
        r.read()
        c.close()
    c, r = call(sock, "POST", "/exec", {"shell": f"head -c {a.big} /dev/zero", "detach": True})
    big = json.loads(r.read())["id"]
    c.close()
    peak = idle
    while True:
        peak = max(peak, rss_kib(a.keel_pid))
        c, r = call(sock, "GET", f"/processes/{big}")
        v = json.loads(r.read())
        c.close()
        if v["state"] == "done":
            break
        time.sleep(0.2)
    print("| state | RSS MiB | above idle MiB |\n|---|---:|---:|")
    print(f"| idle (after the runs above) | {idle / 1024:.1f} | 0 |")
    print(f"| {a.concurrent} processes running | {many / 1024:.1f} | {(many - idle) / 1024:.1f} |")
    print(f"| one process writing {a.big >> 30} GiB, nobody reading (peak) | {peak / 1024:.1f} | {(peak - idle) / 1024:.1f} |")
    print(f"\nthe writer's stdout: {v['stdout_bytes']} bytes written, {v['exit']['stdout_dropped']} dropped between the head and the tail kept")



def section_diff(a, sock):
    print(f"\n#### diff=true on an exec that changes {a.changed} files of a {a.files}-file workspace\n")
    ws = a.workspace
    os.makedirs(f"{ws}/tree", exist_ok=True)
    per = 1000
    t0 = time.perf_counter()
    for d in range(a.files // per):
        os.makedirs(f"{ws}/tree/d{d}", exist_ok=True)
        for f in range(per):
            with open(f"{ws}/tree/d{d}/f{f}", "w") as fh:
                fh.write("x")
    print(f"(made the {a.files} files in {time.perf_counter() - t0:.0f} s)\n")
    c, r = call(sock, "POST", "/checkpoint")
    r.read()
    c.close()
    cmd = "for f in tree/d{d}/f*; do echo y >> $f; done"
    plain, withdiff, keel_diff = [], [], []
    # The command's own duration too: a tracker's pre-images are taken while it runs.
    run_plain, run_diff = [], []
    cpu_plain, cpu_diff = [], []
    hz = os.sysconf("SC_CLK_TCK")
    for rep in range(3):
        for diff in (False, True):
            d = rep * 2 + (1 if diff else 0)
            body = {"shell": cmd.format(d=d), "diff": diff}
            c0 = cpu_ticks(a.keel_pid)
            t0 = time.perf_counter()
            evs = exec_events(sock, body)
            total = (time.perf_counter() - t0) * 1000
            (cpu_diff if diff else cpu_plain).append((cpu_ticks(a.keel_pid) - c0) * 1000 / hz)
            ex = evs[-1]
            assert ex["code"] == 0, ex
            overhead = total - ex["duration_ms"]
            if diff:
                n = len(ex["diff"]["changes"])
                assert n >= a.changed, n
                withdiff.append(overhead)
                run_diff.append(ex["duration_ms"])
                keel_diff.append(ex["diff"]["duration_ms"])
                how = {"tracked": "change tracker: pre-images, no snapshot"}.get(
                    ex["diff"].get("trees"), "snapshot before, checkpoint + diff after")
            else:
                plain.append(overhead)
                run_plain.append(ex["duration_ms"])
    added = statistics.median(withdiff) - statistics.median(plain)
    print("| | request time beyond the command itself, ms (median of 3) |\n|---|---:|")
    print(f"| diff=false | {statistics.median(plain):.1f} |")
    print(f"| diff=true ({how}) | {statistics.median(withdiff):.1f} |")
    print(f"| time diff=true adds | {added:.1f} |")
    print(f"| of which the diff after the exit (keel's duration_ms) | {statistics.median(keel_diff):.1f} |")
    print(f"\nthe command's own duration, median: {statistics.median(run_plain):.1f} ms without diff, "
          f"{statistics.median(run_diff):.1f} ms with (the pre-images are taken while it runs); "
          f"keel's CPU per exec, whole request: {statistics.median(cpu_plain):.0f} ms without, "
          f"{statistics.median(cpu_diff):.0f} ms with")


if __name__ == "__main__":
    main()

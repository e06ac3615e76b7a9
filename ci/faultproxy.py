#!/usr/bin/env python3
"""faultproxy.py: an HTTP/1.1 proxy in front of an S3 endpoint (moto) that makes the remote
slow, wrong or gone on purpose, and counts the requests it forwards.

    ci/faultproxy.py --upstream 127.0.0.1:MOTO_PORT [--listen 127.0.0.1:0] [--port-file F]
        [--control 127.0.0.1:0] [--control-port-file F] [--stats FILE]
        [--latency-ms D] [--jitter-ms J] [--bandwidth RATE] [--error-rate P]
        [--error-after-rate P] [--drop-rate P] [--methods GET,PUT,...] [--seed N]
        [--outage START:SECONDS[:MODE]]...

Point the client at the proxy instead of the endpoint (keel: `[persist] endpoint`). Every
request is parsed (request line, headers, a body by Content-Length or chunked) and answered
from the endpoint, one connection upstream per client connection (keep-alive kept), with:

  --latency-ms D      D ms added to every request before its answer goes back (R2 from a
                      container is ~30 ms away; moto on localhost ~0); --jitter-ms J adds
                      0..J more, uniformly
  --bandwidth RATE    bytes per second across all connections and both directions together
                      (a token bucket; suffixes k, M, G = 1000^n; 0 = unlimited)
  --error-rate P      a request is answered `500 InternalError` without reaching the endpoint
  --error-after-rate P  a request is applied by the endpoint, then answered 500 anyway (a PUT
                      that happened although the client was told it failed)
  --drop-rate P       the connection is cut: before the request is forwarded, after it was
                      applied with the answer lost, or half-way through the answer (each a
                      third of the drops)
  --methods M,...     the methods the three rates apply to (default all)
  --outage S:D[:MODE] from S seconds after the start, for D seconds, the endpoint is gone:
                      MODE `refuse` (nothing listens: connection refused, the default),
                      `reset` (accepted and reset at once) or `blackhole` (accepted, read,
                      never answered until the outage ends); connections open when it starts
                      are cut (refuse, reset) or stall (blackhole). Repeatable.

Counts (requests per method, bytes each way, faults injected by kind) go to --stats as JSON
when the proxy exits (SIGTERM, SIGINT) and every second while it runs, and answer
`GET /stats` on the control port. The control port (--control; a tiny HTTP API, no auth:
bind it to localhost) changes the knobs while the proxy runs:

  GET  /stats                          the counts and the current settings (JSON)
  POST /set?latency_ms=30&error_rate=0.2&...   any of latency_ms, jitter_ms, bandwidth,
                                       error_rate, error_after_rate, drop_rate, methods
  POST /outage?seconds=60&mode=blackhole   the endpoint is gone now, for that long
  POST /clear                          no faults, no latency, no bandwidth cap, no outage
  POST /reset-stats                    counts back to zero

Python standard library only. Used by ci/soak.py (the kill-anywhere soak) and by the
cold-start benchmarks (a fixed latency per request: `--latency-ms 30`).
"""
import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import urllib.parse

RATE_SUFFIX = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}


def parse_rate(v):
    v = str(v).strip()
    suffix = v[-1] if v and v[-1] in "kKMG" else ""
    num = v[: -1] if suffix else v
    try:
        r = float(num) * RATE_SUFFIX[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bandwidth {v!r}: not a number of bytes per second (e.g. 20M)")
    if r < 0:
        raise argparse.ArgumentTypeError(f"bandwidth {v!r}: negative")
    return r


def parse_prob(v):
    try:
        p = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: not a probability")
    if not 0 <= p <= 1:
        raise argparse.ArgumentTypeError(f"{v!r}: a probability is between 0 and 1")
    return p


def parse_outage(v):
    parts = v.split(":")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"outage {v!r}: expected START:SECONDS[:MODE]")
    try:
        start, dur = float(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"outage {v!r}: START and SECONDS are numbers")
    mode = parts[2] if len(parts) == 3 else "refuse"
    if mode not in MODES or start < 0 or dur <= 0:
        raise argparse.ArgumentTypeError(f"outage {v!r}: MODE is one of {', '.join(MODES)}; times >= 0")
    return (start, dur, mode)


def parse_hostport(v):
    host, _, port = v.rpartition(":")
    try:
        return (host or "127.0.0.1", int(port))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: expected HOST:PORT")


MODES = ("refuse", "reset", "blackhole")


class Closed(Exception):
    """The peer closed the connection (or it broke) before a whole message arrived."""


class Reader:
    """Buffered reads from a socket: lines and exact byte counts."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self):
        d = self.sock.recv(65536)
        if not d:
            raise Closed()
        self.buf += d

    def head(self, limit=1 << 20):
        """Bytes up to and including the blank line ending a message head; None at a clean
        end of stream before any byte of a new message."""
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i >= 0:
                out = bytes(self.buf[: i + 4])
                del self.buf[: i + 4]
                return out
            if len(self.buf) > limit:
                raise Closed()
            try:
                d = self.sock.recv(65536)
            except OSError:
                raise Closed()
            if not d:
                if not self.buf:
                    return None
                raise Closed()
            self.buf += d

    def exact(self, n):
        while len(self.buf) < n:
            try:
                self._fill()
            except OSError:
                raise Closed()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def line(self):
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[: i + 2])
                del self.buf[: i + 2]
                return out
            try:
                self._fill()
            except OSError:
                raise Closed()

    def rest(self):
        """Everything until the peer closes (a response without a length)."""
        out = bytearray(self.buf)
        self.buf.clear()
        while True:
            try:
                d = self.sock.recv(65536)
            except OSError:
                break
            if not d:
                break
            out += d
        return bytes(out)


def parse_head(raw):
    lines = raw[:-4].split(b"\r\n")
    first = lines[0].decode("latin-1")
    headers = []
    for l in lines[1:]:
        k, _, v = l.decode("latin-1").partition(":")
        headers.append((k.strip(), v.strip()))
    return first, headers


def header(headers, name):
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def read_body(r, headers, no_body=False):
    """The raw body bytes of a message (chunked bodies kept chunked), and whether the
    stream ends with it (no length: read until close)."""
    if no_body:
        return b"", False
    te = header(headers, "transfer-encoding")
    if te and "chunked" in te.lower():
        out = bytearray()
        while True:
            l = r.line()
            out += l
            size = int(l.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers up to the blank line
                    t = r.line()
                    out += t
                    if t == b"\r\n":
                        return bytes(out), False
            out += r.exact(size + 2)
    cl = header(headers, "content-length")
    if cl is not None:
        return r.exact(int(cl)), False
    return None, True


class Bucket:
    """A token bucket shared by every connection: `rate` bytes per second, both ways."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rate = 0.0
        self.tokens = 0.0
        self.at = time.monotonic()

    def set_rate(self, rate):
        with self.lock:
            self.rate = float(rate)
            self.tokens = 0.0
            self.at = time.monotonic()

    def take(self, n):
        """Blocks until n bytes may pass."""
        while n > 0:
            with self.lock:
                rate = self.rate
                if rate <= 0:
                    return
                now = time.monotonic()
                self.tokens = min(self.tokens + (now - self.at) * rate, max(rate / 10, 65536))
                self.at = now
                step = min(n, 65536)
                if self.tokens >= step:
                    self.tokens -= step
                    n -= step
                    continue
                wait = (step - self.tokens) / rate
            time.sleep(wait)


class Proxy:
    def __init__(self, args):
        self.upstream = args.upstream
        self.lock = threading.Lock()
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.settings = {
            "latency_ms": args.latency_ms,
            "jitter_ms": args.jitter_ms,
            "bandwidth": args.bandwidth,
            "error_rate": args.error_rate,
            "error_after_rate": args.error_after_rate,
            "drop_rate": args.drop_rate,
            "methods": sorted(args.methods) if args.methods else None,
        }
        self.bucket = Bucket()
        self.bucket.set_rate(args.bandwidth)
        self.scheduled = [(self.t0 + s, self.t0 + s + d, m) for s, d, m in args.outage]
        self.manual = None  # (until, mode)
        self.conns = set()  # client sockets open now
        self.stats_file = args.stats
        self.reset_stats()
        self.listen_addr = args.listen
        self.listener = None
        self.listener_lock = threading.Lock()
        self.stopping = False

    # --- settings and counts ---------------------------------------------------------------
    def reset_stats(self):
        with self.lock:
            self.stats = {
                "requests": {},
                "requests_total": 0,
                "bytes_up": 0,
                "bytes_down": 0,
                "faults": {k: 0 for k in ("error", "error_after", "drop_before", "drop_after",
                                            "drop_mid", "refused", "reset", "blackholed")},
                "connections": 0,
            }

    def count(self, key, n=1, sub=None):
        with self.lock:
            if sub is None:
                self.stats[key] += n
            else:
                self.stats[key][sub] = self.stats[key].get(sub, 0) + n

    def snapshot(self):
        with self.lock:
            s = json.loads(json.dumps(self.stats))
            s["settings"] = dict(self.settings)
            o = self.outage()
            s["outage"] = None if o is None else {"mode": o[1], "left_s": round(o[0] - time.monotonic(), 3)}
            s["faults_total"] = sum(s["faults"].values())
            s["uptime_s"] = round(time.monotonic() - self.t0, 3)
            return s

    def set(self, **kv):
        with self.lock:
            for k, v in kv.items():
                if k == "methods":
                    self.settings[k] = sorted(m.strip().upper() for m in v.split(",") if m.strip()) or None
                elif k in ("latency_ms", "jitter_ms"):
                    self.settings[k] = max(0.0, float(v))
                elif k in ("error_rate", "error_after_rate", "drop_rate"):
                    self.settings[k] = parse_prob(v)
                elif k == "bandwidth":
                    self.settings[k] = parse_rate(v)
                else:
                    raise ValueError(f"unknown setting {k}")
            bw = self.settings["bandwidth"]
        self.bucket.set_rate(bw)

    def clear(self):
        with self.lock:
            self.settings.update(latency_ms=0.0, jitter_ms=0.0, bandwidth=0.0, error_rate=0.0,
                                 error_after_rate=0.0, drop_rate=0.0, methods=None)
            self.manual = None
            self.scheduled = []
        self.bucket.set_rate(0)

    def outage(self):
        """(until, mode) of the outage in force now, if any (caller may hold the lock)."""
        now = time.monotonic()
        if self.manual and now < self.manual[0]:
            return self.manual
        for s, e, m in self.scheduled:
            if s <= now < e:
                return (e, m)
        return None

    def start_outage(self, seconds, mode):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        with self.lock:
            self.manual = (time.monotonic() + float(seconds), mode)
        self.cut_open_connections(mode)

    def cut_open_connections(self, mode):
        if mode == "blackhole":
            return  # they stall: every request waits for the outage's end
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            rst(c)

    def fault_for(self, method):
        """None, or which fault this request gets."""
        with self.lock:
            s = self.settings
            if s["methods"] and method not in s["methods"]:
                return None
            x = self.rng.random()
            if x < s["error_rate"]:
                return "error"
            x -= s["error_rate"]
            if x < s["error_after_rate"]:
                return "error_after"
            x -= s["error_after_rate"]
            if x < s["drop_rate"]:
                return self.rng.choice(("drop_before", "drop_after", "drop_mid"))
            return None

    def delay(self):
        with self.lock:
            d = self.settings["latency_ms"] + self.rng.random() * self.settings["jitter_ms"]
        if d > 0:
            time.sleep(d / 1000.0)

    # --- the data path -------------------------------------------------------------------------
    def send(self, sock, data, direction):
        view = memoryview(data)
        while view:
            n = min(len(view), 65536)
            self.bucket.take(n)
            sock.sendall(view[:n])
            view = view[n:]
        self.count("bytes_up" if direction == "up" else "bytes_down", len(data))

    def wait_blackhole(self, c):
        """Holds the connection without answering until the outage ends, then cuts it."""
        self.count("faults", 1, "blackholed")
        while not self.stopping:
            o = self.outage()
            if o is None or o[1] != "blackhole":
                break
            time.sleep(0.05)
        rst(c)

    def serve(self, c):
        with self.lock:
            self.conns.add(c)
            self.stats["connections"] += 1
        up = None
        try:
            r = Reader(c)
            ur = None
            while True:
                raw = r.head()
                if raw is None:
                    return
                first, headers = parse_head(raw)
                method = first.split(" ", 1)[0].upper()
                if header(headers, "expect") and "100-continue" in header(headers, "expect").lower():
                    c.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                    raw = (first + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode("latin-1")
                body, _ = read_body(r, headers)
                if body is None:
                    body = b""
                self.count("requests", 1, method)
                self.count("requests_total")
                o = self.outage()
                if o is not None:
                    if o[1] == "blackhole":
                        self.wait_blackhole(c)
                    else:
                        self.count("faults", 1, "reset")
                        rst(c)
                    return
                fault = self.fault_for(method)
                if fault == "error":
                    self.count("faults", 1, "error")
                    self.delay()
                    self.send(c, error_response(), "down")
                    continue
                if fault == "drop_before":
                    self.count("faults", 1, "drop_before")
                    rst(c)
                    return
                if up is None:
                    up = socket.create_connection(self.upstream, timeout=300)
                    up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    ur = Reader(up)
                self.send(up, raw + body, "up")
                resp_head = ur.head()
                if resp_head is None:
                    raise Closed()
                status_line, rh = parse_head(resp_head)
                code = int(status_line.split(" ")[1])
                while 100 <= code < 200:  # an interim answer: pass it on, read the real one
                    c.sendall(resp_head)
                    resp_head = ur.head()
                    status_line, rh = parse_head(resp_head)
                    code = int(status_line.split(" ")[1])
                no_body = method == "HEAD" or code in (204, 304)
                resp_body, until_close = read_body(ur, rh, no_body)
                if until_close:
                    resp_body = ur.rest()
                    up.close()
                    up = None
                elif (header(rh, "connection") or "").lower() == "close":
                    up.close()
                    up = None
                if fault == "error_after":
                    self.count("faults", 1, "error_after")
                    self.delay()
                    self.send(c, error_response(), "down")
                    continue
                if fault == "drop_after":
                    self.count("faults", 1, "drop_after")
                    rst(c)
                    return
                self.delay()
                o = self.outage()
                if o is not None:  # it started while this request was out
                    if o[1] == "blackhole":
                        self.wait_blackhole(c)
                    else:
                        self.count("faults", 1, "reset")
                        rst(c)
                    return
                if fault == "drop_mid":
                    self.count("faults", 1, "drop_mid")
                    whole = resp_head + resp_body
                    self.send(c, whole[: max(1, len(whole) // 2)], "down")
                    rst(c)
                    return
                self.send(c, resp_head + resp_body, "down")
                if until_close:
                    return
        except (Closed, OSError, ValueError, IndexError):
            return
        finally:
            with self.lock:
                self.conns.discard(c)
            for s in (c, up):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass

    # --- listening -----------------------------------------------------------------------------
    def bind(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(self.listen_addr)
        s.listen(256)
        s.settimeout(0.1)
        return s

    def write_stats(self):
        if not self.stats_file:
            return
        tmp = self.stats_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f, indent=1, sort_keys=True)
        os.replace(tmp, self.stats_file)


def rst(sock):
    """Cuts a connection with a reset (SO_LINGER 0), not an orderly close."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def error_response():
    body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
            b"<Message>We encountered an internal error. Please try again.</Message>"
            b"<RequestId>faultproxy</RequestId></Error>")
    return (b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def control_loop(proxy, sock):
    """The control API: one short request per connection."""
    while True:
        try:
            c, _ = sock.accept()
        except OSError:
            return
        threading.Thread(target=control_one, args=(proxy, c), daemon=True).start()


def control_one(proxy, c):
    try:
        c.settimeout(10)
        r = Reader(c)
        raw = r.head()
        if raw is None:
            return
        first, headers = parse_head(raw)
        read_body(r, headers)
        method, target = first.split(" ")[:2]
        u = urllib.parse.urlsplit(target)
        q = dict(urllib.parse.parse_qsl(u.query))
        code, out = 200, None
        try:
            if method == "GET" and u.path == "/stats":
                out = proxy.snapshot()
            elif method == "POST" and u.path == "/set":
                proxy.set(**q)
                out = proxy.snapshot()["settings"]
            elif method == "POST" and u.path == "/outage":
                proxy.start_outage(float(q.get("seconds", "60")), q.get("mode", "refuse"))
                out = {"outage": q}
            elif method == "POST" and u.path == "/clear":
                proxy.clear()
                out = proxy.snapshot()["settings"]
            elif method == "POST" and u.path == "/reset-stats":
                proxy.reset_stats()
                out = {"ok": True}
            else:
                code, out = 404, {"error": f"no route {method} {u.path}"}
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            code, out = 400, {"error": str(e)}
        body = (json.dumps(out, sort_keys=True) + "\n").encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[code]
        c.sendall(f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    except (Closed, OSError, ValueError):
        pass
    finally:
        c.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", type=parse_hostport, required=True, help="HOST:PORT of the endpoint")
    ap.add_argument("--listen", type=parse_hostport, default=("127.0.0.1", 0), help="HOST:PORT (port 0: any free one)")
    ap.add_argument("--port-file", help="write the listening port here once ready")
    ap.add_argument("--control", type=parse_hostport, help="HOST:PORT of the control API")
    ap.add_argument("--control-port-file", help="write the control port here once ready")
    ap.add_argument("--stats", help="write the counts here (JSON), every second and at exit")
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--bandwidth", type=parse_rate, default=0.0)
    ap.add_argument("--error-rate", type=parse_prob, default=0.0)
    ap.add_argument("--error-after-rate", type=parse_prob, default=0.0)
    ap.add_argument("--drop-rate", type=parse_prob, default=0.0)
    ap.add_argument("--methods", type=lambda v: {m.strip().upper() for m in v.split(",") if m.strip()})
    ap.add_argument("--outage", type=parse_outage, action="append", default=[])
    ap.add_argument("--seed", type=int)
    args = ap.parse_args()
    if args.error_rate + args.error_after_rate + args.drop_rate > 1:
        ap.error("--error-rate + --error-after-rate + --drop-rate exceed 1")

    proxy = Proxy(args)
    try:
        proxy.listener = proxy.bind()
    except OSError as e:
        print(f"faultproxy: listen on {args.listen[0]}:{args.listen[1]}: {e}", file=sys.stderr)
        return 1
    proxy.listen_addr = proxy.listener.getsockname()
    ctl = None
    if args.control:
        ctl = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ctl.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            ctl.bind(args.control)
        except OSError as e:
            print(f"faultproxy: control on {args.control[0]}:{args.control[1]}: {e}", file=sys.stderr)
            return 1
        ctl.listen(16)
        threading.Thread(target=control_loop, args=(proxy, ctl), daemon=True).start()

    def stop(*_):
        proxy.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def loop():
        try:
            accept_with(proxy)
        except Exception as e:  # keep the failure visible; the main thread exits
            print(f"faultproxy: accept loop: {e}", file=sys.stderr)
            proxy.stopping = True

    threading.Thread(target=loop, daemon=True).start()
    for path, port in ((args.port_file, proxy.listen_addr[1]),
                       (args.control_port_file, ctl.getsockname()[1] if ctl else None)):
        if path and port is not None:
            with open(path + ".tmp", "w") as f:
                f.write(f"{port}\n")
            os.replace(path + ".tmp", path)
    print(f"faultproxy: 127.0.0.1:{proxy.listen_addr[1]} -> {args.upstream[0]}:{args.upstream[1]}"
          + (f", control on {ctl.getsockname()[1]}" if ctl else ""), file=sys.stderr, flush=True)
    while not proxy.stopping:
        time.sleep(1 if proxy.stats_file else 0.2)
        proxy.write_stats()
    proxy.write_stats()
    return 0


def accept_with(proxy):
    """The accept loop on the listener bound in main (so the port is known before it runs)."""
    while not proxy.stopping:
        o = proxy.outage()
        if o is not None and o[1] == "refuse":
            if proxy.listener is not None:
                proxy.listener.close()
                proxy.listener = None
                proxy.cut_open_connections("refuse")
                proxy.count("faults", 1, "refused")
            time.sleep(0.02)
            continue
        if proxy.listener is None:
            try:
                proxy.listener = proxy.bind()
            except OSError:
                time.sleep(0.05)
                continue
        try:
            c, _ = proxy.listener.accept()
        except socket.timeout:
            continue
        except OSError:
            continue
        c.settimeout(None)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if o is not None and o[1] == "reset":
            proxy.count("faults", 1, "reset")
            rst(c)
            continue
        threading.Thread(target=proxy.serve, args=(c,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())

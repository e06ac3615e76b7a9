#!/usr/bin/env python3
"""A fault-injecting HTTP proxy in front of an S3 endpoint (moto) for benchmarks and soaks.

    script/s3-proxy.py --upstream 127.0.0.1:PORT [--listen PORT] [--port-file FILE]
                       [--latency-ms D] [--bandwidth RATE] [--error-rate P] [--outage]

Every request keel sends waits D ms before it is passed on (one round trip of a remote
endpoint; requests in flight at once each wait their own D, as over a real link), and the
bytes of request and response bodies pass at most RATE bytes a second in each direction
(`100M`, `12.5MiB`, `0` = no cap; one link shared by every connection). With an error rate
a request is answered `503 SlowDown` without reaching the endpoint; in an outage every
connection is cut at once and new ones are closed as soon as they are accepted.

Requests to `/__proxy/...` are the proxy's own (never forwarded, never delayed):
    GET  /__proxy/stats   counts as JSON: requests by method and kind, bytes each way,
                          errors injected, connections refused
    POST /__proxy/reset   zero the counts
    POST /__proxy/set?latency_ms=30&bandwidth=100M&error_rate=0.01&outage=1
                          change any of the settings while running

A request's kind is what it names in keel's remote layout: `chunks`, `packs`, `snapshots`,
`images`, `readsets` (a path segment), else its last segment (`head`, `lease`,
`keel-workspace.json`, ...); a GET with `list-type` is `list`; a GET with a Range header
counts as `get_range`. Python standard library only; one process, asyncio.
"""

import argparse
import asyncio
import json
import random
import re
import signal
import sys
import time
import urllib.parse

KINDS = ("chunks", "packs", "snapshots", "images", "readsets")


def parse_rate(s):
    """`100M` (bytes, SI), `12.5MiB`, `800k`, `0` -> bytes per second (0: no cap)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]?)(i?)[bB]?\s*", str(s))
    if not m:
        raise ValueError(f"bad rate {s!r}")
    n, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    base = 1024 if binary else 1000
    return int(n * {"": 1, "k": base, "m": base**2, "g": base**3}[unit])


class Link:
    """A token bucket: `rate` bytes a second (0: unlimited), shared by every connection."""

    def __init__(self, rate):
        self.rate = rate
        self.free_at = time.monotonic()
        self.lock = asyncio.Lock()

    async def pass_bytes(self, n):
        if self.rate <= 0 or n <= 0:
            return
        async with self.lock:
            now = time.monotonic()
            start = max(now, self.free_at)
            self.free_at = start + n / self.rate
            wait = self.free_at - now
        if wait > 0:
            await asyncio.sleep(wait)


class Proxy:
    def __init__(self, args):
        self.upstream = args.upstream
        self.latency = args.latency_ms / 1000.0
        self.up = Link(parse_rate(args.bandwidth))
        self.down = Link(parse_rate(args.bandwidth))
        self.error_rate = args.error_rate
        self.outage = args.outage
        self.conns = set()
        self.reset()

    def reset(self):
        self.stats = {
            "requests": 0,
            "by_method": {},
            "by_kind": {},
            "bytes_up": 0,
            "bytes_down": 0,
            "errors_injected": 0,
            "refused": 0,
        }

    def settings(self):
        return {
            "latency_ms": self.latency * 1000,
            "bandwidth": self.up.rate,
            "error_rate": self.error_rate,
            "outage": self.outage,
        }

    def count(self, method, path, headers):
        s = self.stats
        s["requests"] += 1
        query = urllib.parse.urlsplit(path).query
        segs = [x for x in urllib.parse.urlsplit(path).path.split("/") if x]
        if method == "GET" and "list-type" in query:
            kind = "list"
        else:
            kind = next((k for k in KINDS if k in segs), segs[-1] if segs else "/")
        m = method
        if method == "GET" and "range" in headers:
            m = "GET_RANGE"
        s["by_method"][m] = s["by_method"].get(m, 0) + 1
        key = f"{m} {kind}"
        s["by_kind"][key] = s["by_kind"].get(key, 0) + 1

    async def control(self, method, path, writer):
        u = urllib.parse.urlsplit(path)
        if u.path == "/__proxy/stats":
            body = dict(self.stats, settings=self.settings())
        elif u.path == "/__proxy/reset" and method == "POST":
            self.reset()
            body = {"ok": True}
        elif u.path == "/__proxy/set" and method == "POST":
            q = dict(urllib.parse.parse_qsl(u.query))
            if "latency_ms" in q:
                self.latency = float(q["latency_ms"]) / 1000.0
            if "bandwidth" in q:
                self.up.rate = self.down.rate = parse_rate(q["bandwidth"])
            if "error_rate" in q:
                self.error_rate = float(q["error_rate"])
            if "outage" in q:
                self.outage = q["outage"] not in ("0", "false", "")
                if self.outage:
                    for w in list(self.conns):
                        w.transport.abort()
            body = dict(ok=True, settings=self.settings())
        else:
            data = b"unknown proxy control path\n"
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            return
        data = json.dumps(body).encode() + b"\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(data)
            + data
        )
        await writer.drain()

    async def handle(self, creader, cwriter):
        if self.outage:
            self.stats["refused"] += 1
            cwriter.transport.abort()
            return
        self.conns.add(cwriter)
        uwriter = None
        try:
            host, port = self.upstream.rsplit(":", 1)
            while True:
                head = await read_head(creader)
                if head is None:
                    return
                line, headers, raw = head
                method, path, _ = line.split(" ", 2)
                if path.startswith("/__proxy/"):
                    await self.control(method, path, cwriter)
                    continue
                self.count(method, path, headers)
                body_len = int(headers.get("content-length", "0") or 0)
                chunked = "chunked" in headers.get("transfer-encoding", "").lower()
                if self.latency > 0:
                    await asyncio.sleep(self.latency)
                if self.outage:
                    cwriter.transport.abort()
                    return
                if self.error_rate > 0 and random.random() < self.error_rate:
                    # The request's body is read and dropped, so the connection stays usable.
                    await relay_body(creader, None, body_len, chunked, None)
                    self.stats["errors_injected"] += 1
                    err = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
                           b"<Message>injected by s3-proxy</Message></Error>")
                    cwriter.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(err), err)
                    )
                    await cwriter.drain()
                    continue
                if uwriter is None:
                    ureader, uwriter = await asyncio.open_connection(host, int(port))
                uwriter.write(raw)
                n = await relay_body(creader, uwriter, body_len, chunked, self.up)
                self.stats["bytes_up"] += n
                await uwriter.drain()
                rhead = await read_head(ureader)
                if rhead is None:
                    return
                rline, rheaders, rraw = rhead
                cwriter.write(rraw)
                status = int(rline.split(" ", 2)[1])
                no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
                if no_body:
                    n = 0
                elif "content-length" in rheaders:
                    n = await relay_body(ureader, cwriter, int(rheaders["content-length"]), False, self.down)
                elif "chunked" in rheaders.get("transfer-encoding", "").lower():
                    n = await relay_body(ureader, cwriter, 0, True, self.down)
                else:
                    n = await relay_to_eof(ureader, cwriter, self.down)
                    self.stats["bytes_down"] += n
                    return
                self.stats["bytes_down"] += n
                await cwriter.drain()
                if rheaders.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, OSError):
            return
        finally:
            self.conns.discard(cwriter)
            for w in (cwriter, uwriter):
                if w is not None:
                    try:
                        w.close()
                    except Exception:
                        pass


async def read_head(reader):
    """One request or response head: (first line, lower-cased headers, raw bytes); None at EOF."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise
        return None
    lines = raw.decode("latin-1").split("\r\n")
    headers = {}
    for h in lines[1:]:
        if ":" in h:
            k, v = h.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return lines[0], headers, raw


async def relay_body(reader, writer, length, chunked, link):
    """Copies a body of `length` bytes (or a chunked one) to `writer` (None: drops it)."""
    total = 0
    if not chunked:
        left = length
        while left > 0:
            data = await reader.read(min(left, 256 << 10))
            if not data:
                raise ConnectionError("body cut short")
            left -= len(data)
            total += len(data)
            if link is not None:
                await link.pass_bytes(len(data))
            if writer is not None:
                writer.write(data)
                await writer.drain()
        return total
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";")[0].strip(), 16)
        data = await reader.readexactly(size + 2) if size else b""
        if writer is not None:
            writer.write(size_line + data)
        total += size
        if link is not None:
            await link.pass_bytes(size)
        if size == 0:
            trailer = await reader.readuntil(b"\r\n")
            if writer is not None:
                writer.write(trailer)
                await writer.drain()
            # Trailers end with an empty line; an empty line right away ends the body.
            while trailer != b"\r\n":
                trailer = await reader.readuntil(b"\r\n")
                if writer is not None:
                    writer.write(trailer)
            return total
        if writer is not None:
            await writer.drain()


async def relay_to_eof(reader, writer, link):
    total = 0
    while True:
        data = await reader.read(256 << 10)
        if not data:
            await writer.drain()
            return total
        total += len(data)
        await link.pass_bytes(len(data))
        writer.write(data)
        await writer.drain()


async def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="HOST:PORT of the S3 endpoint")
    ap.add_argument("--listen", type=int, default=0, help="port on 127.0.0.1 (0: any free one)")
    ap.add_argument("--port-file", help="write the port listened on here once ready")
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--bandwidth", default="0", help="bytes/s each way, e.g. 100M, 12.5MiB; 0: no cap")
    ap.add_argument("--error-rate", type=float, default=0.0)
    ap.add_argument("--outage", action="store_true")
    args = ap.parse_args()
    proxy = Proxy(args)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", args.listen)
    port = server.sockets[0].getsockname()[1]
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(f"{port}\n")
        import os
        os.replace(args.port_file + ".tmp", args.port_file)
    print(f"s3-proxy: 127.0.0.1:{port} -> {args.upstream} {json.dumps(proxy.settings())}",
          file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())

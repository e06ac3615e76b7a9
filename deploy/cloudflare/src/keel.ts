// A small typed client of keel's control API (docs/openapi.json) for what a Worker offers its
// callers: processes (POST /exec with its NDJSON events, /processes/*), files (/files) and the
// change feed (GET /watch). It speaks through any fetch-like function: a Container stub's
// `fetch` in the Worker, the global `fetch` with a base URL elsewhere (the deploy test runs it
// in node against a real `keel run`). Only web-standard APIs (fetch, ReadableStream,
// TextDecoder, atob/btoa), so it runs in Workers and node alike.

/** `POST /exec`'s request (see the README's "Processes" and docs/openapi.json). */
export interface ExecRequest {
  argv?: string[];
  shell?: string;
  cwd?: string;
  env?: Record<string, string>;
  user?: string | number;
  stdin?: "stream" | { text: string } | { base64: string };
  pty?: { rows: number; cols: number };
  /** Seconds, or a duration such as "30s"; kept by keel whatever the connection does. */
  timeout?: number | string;
  request_id?: string;
  diff?: boolean;
  snapshot?: string;
  rollback_on?: "failure" | "timeout";
  checkpoint?: "wait";
}

export interface StartEvent {
  type: "start";
  id: number;
  pid: number | null;
  request_id: string | null;
  attached: boolean;
}
/** Output bytes (`data`, base64) from byte `offset` of the stream. */
export interface OutputEvent {
  type: "stdout" | "stderr";
  offset: number;
  data: string;
}
/** Bytes no longer kept (between the head and the tail of a long output). */
export interface GapEvent {
  type: "gap";
  stream: "stdout" | "stderr";
  offset: number;
  bytes: number;
}
export interface ExitEvent {
  type: "exit";
  id: number;
  code: number | null;
  signal: string | null;
  status: number | null;
  timed_out: boolean;
  killed: boolean;
  duration_ms: number;
  cpu_ms: number;
  peak_rss_kib: number;
  stdout_bytes: number;
  stderr_bytes: number;
  stdout_dropped: number;
  stderr_dropped: number;
  error?: string;
  /** keel could not keep the output (no space, no descriptor): the first failure; the rest was dropped. */
  output_error?: string;
  /** With `diff: true`: the changes the command made, as `keel diff` shows them. */
  diff?: { changes: Change[] };
  rollback?: { rolled_back: boolean; on: string };
  checkpoint?: number;
  errors?: string[];
}
export interface Change {
  change: "added" | "removed" | "modified" | "renamed";
  path: string;
  from?: string;
  size?: number;
}
export interface ErrorEvent {
  type: "error";
  error: string;
}
export type ExecEvent = StartEvent | OutputEvent | GapEvent | ExitEvent | ErrorEvent;

/** A finished run, its output decoded. */
export interface ExecResult {
  id: number;
  stdout: Uint8Array;
  stderr: Uint8Array;
  exit: ExitEvent;
}

export interface ProcessRecord {
  id: number;
  request_id: string | null;
  argv: string[];
  user: string;
  cwd: string;
  state: "starting" | "running" | "finishing" | "done";
  pid: number | null;
  stdout_bytes: number;
  stderr_bytes: number;
  output_error?: string;
  exit?: Omit<ExitEvent, "type" | "id">;
}

export interface FileEntry {
  name: string;
  path: string;
  type: "file" | "dir" | "symlink" | "fifo" | "socket" | "char" | "block" | "other";
  size: number;
  mode: string;
  uid: number;
  gid: number;
  mtime_ns: string;
  target?: string;
}

export interface WatchEvent {
  type: "watching" | "create" | "modify" | "delete" | "rename" | "rescan" | "lost" | "end";
  cursor: string;
  path?: string;
  from?: string;
  kind?: string;
  size?: number;
  reason?: string;
}

/** A non-2xx answer of keel's API: its status and the error it named. */
export class KeelError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(`keel: ${status}: ${message}`);
  }
}

export type Fetcher = (request: Request) => Promise<Response>;

export class KeelClient {
  /**
   * `base`: the control API's URL (e.g. "http://localhost:8787"); `token`: keel's control
   * token (sent as a bearer token); `fetcher`: how requests go out (default: global fetch).
   */
  constructor(
    private readonly base: string,
    private readonly token?: string,
    private readonly fetcher: Fetcher = (r) => fetch(r),
  ) {}

  private async call(method: string, path: string, init: RequestInit = {}): Promise<Response> {
    const headers = new Headers(init.headers);
    if (this.token) headers.set("Authorization", `Bearer ${this.token}`);
    const r = await this.fetcher(new Request(new URL(path, this.base), { ...init, method, headers }));
    if (r.status >= 400) {
      const text = await r.text();
      let msg = text.trim();
      try {
        msg = (JSON.parse(text) as { error?: string }).error ?? msg;
      } catch {
        // Not JSON: the text as it is.
      }
      throw new KeelError(r.status, msg);
    }
    return r;
  }

  private async json<T>(method: string, path: string, body?: unknown): Promise<T> {
    const init: RequestInit =
      body === undefined ? {} : { body: JSON.stringify(body), headers: { "Content-Type": "application/json" } };
    return (await (await this.call(method, path, init)).json()) as T;
  }

  /** Runs a command; yields its events as they come (start, output, gaps, exit). */
  async *exec(req: ExecRequest): AsyncGenerator<ExecEvent> {
    const r = await this.call("POST", "/exec", {
      body: JSON.stringify(req),
      headers: { "Content-Type": "application/json" },
    });
    yield* ndjson<ExecEvent>(r);
  }

  /** Runs a command to its end and returns its decoded output and exit. */
  async run(req: ExecRequest): Promise<ExecResult> {
    const out: Uint8Array[] = [];
    const err: Uint8Array[] = [];
    let id = 0;
    for await (const ev of this.exec(req)) {
      if (ev.type === "start") id = ev.id;
      else if (ev.type === "stdout") out.push(fromBase64(ev.data));
      else if (ev.type === "stderr") err.push(fromBase64(ev.data));
      else if (ev.type === "error") throw new KeelError(500, ev.error);
      else if (ev.type === "exit") return { id, stdout: concat(out), stderr: concat(err), exit: ev };
    }
    throw new KeelError(502, "the event stream ended without an exit");
  }

  /** Starts a command and answers at once with its record (`detach`). */
  spawn(req: ExecRequest): Promise<ProcessRecord> {
    return this.json("POST", "/exec?detach=1", req);
  }

  async processes(): Promise<ProcessRecord[]> {
    return (await this.json<{ processes: ProcessRecord[] }>("GET", "/processes")).processes;
  }

  process(id: number): Promise<ProcessRecord> {
    return this.json("GET", `/processes/${id}`);
  }

  /** A process's events from byte `from` of one stream; with `follow`, up to its exit. */
  async *output(
    id: number,
    opts: { stream?: "stdout" | "stderr"; from?: number; follow?: boolean } = {},
  ): AsyncGenerator<ExecEvent> {
    const q = new URLSearchParams({ stream: opts.stream ?? "stdout", from: String(opts.from ?? 0) });
    if (opts.follow) q.set("follow", "1");
    yield* ndjson<ExecEvent>(await this.call("GET", `/processes/${id}/output?${q}`));
  }

  /** Writes to a process started with `stdin: "stream"`; `close` ends its input. */
  async stdin(id: number, data: string | Uint8Array, close = false): Promise<void> {
    await this.call("POST", `/processes/${id}/stdin${close ? "?close=1" : ""}`, { body: data });
  }

  async signal(id: number, sig: string): Promise<void> {
    await this.call("POST", `/processes/${id}/signal?sig=${encodeURIComponent(sig)}`);
  }

  /** Kills a process's whole tree (answers once nothing of it is left). */
  async kill(id: number): Promise<void> {
    await this.call("DELETE", `/processes/${id}`);
  }

  /** A file's bytes and ETag (`path` relative to /workspace). */
  async getFile(path: string, opts: { user?: string } = {}): Promise<{ bytes: Uint8Array; etag: string | null }> {
    const r = await this.call("GET", `/files?${files(path, opts.user)}`);
    return { bytes: new Uint8Array(await r.arrayBuffer()), etag: r.headers.get("ETag") };
  }

  /**
   * Creates or replaces a file atomically; `ifMatch`: only if its content is still that
   * ETag (else KeelError 412). Returns the new ETag.
   */
  async putFile(
    path: string,
    body: string | Uint8Array | ReadableStream<Uint8Array>,
    opts: { mode?: string; user?: string; ifMatch?: string } = {},
  ): Promise<string | null> {
    const q = files(path, opts.user);
    if (opts.mode) q.set("mode", opts.mode);
    const headers: Record<string, string> = { "Content-Type": "application/octet-stream" };
    if (opts.ifMatch) headers["If-Match"] = opts.ifMatch;
    const init: RequestInit & { duplex?: "half" } = { body, headers };
    if (body instanceof ReadableStream) init.duplex = "half";
    const r = await this.call("PUT", `/files?${q}`, init);
    const etag = r.headers.get("ETag") ?? ((await r.json()) as { etag?: string }).etag ?? null;
    return etag;
  }

  async listFiles(path: string, opts: { depth?: number; user?: string } = {}): Promise<FileEntry[]> {
    const q = files(path, opts.user);
    q.set("list", "1");
    if (opts.depth) q.set("depth", String(opts.depth));
    return (await this.json<{ entries: FileEntry[] }>("GET", `/files?${q}`)).entries;
  }

  async mkdir(path: string, opts: { mode?: string; parents?: boolean; user?: string } = {}): Promise<void> {
    await this.json("POST", "/files/mkdir", { path, ...opts });
  }

  async move(from: string, to: string, opts: { overwrite?: boolean; user?: string } = {}): Promise<void> {
    await this.json("POST", "/files/move", { from, to, ...opts });
  }

  async deleteFile(path: string, opts: { recursive?: boolean; user?: string } = {}): Promise<void> {
    const q = files(path, opts.user);
    if (opts.recursive) q.set("recursive", "1");
    await this.call("DELETE", `/files?${q}`);
  }

  /** The workspace's changes under `path` from now (or right after `from`), as they come. */
  async *watch(path = "/", opts: { recursive?: boolean; from?: string; signal?: AbortSignal } = {}): AsyncGenerator<WatchEvent> {
    const q = new URLSearchParams({ path, recursive: opts.recursive === false ? "0" : "1" });
    if (opts.from) q.set("from", opts.from);
    yield* ndjson<WatchEvent>(await this.call("GET", `/watch?${q}`, { signal: opts.signal }));
  }
}

function files(path: string, user?: string): URLSearchParams {
  const q = new URLSearchParams({ path });
  if (user) q.set("user", user);
  return q;
}

/** The JSON objects of an NDJSON body, one per line, as they arrive. */
async function* ndjson<T>(r: Response): AsyncGenerator<T> {
  if (!r.body) return;
  const reader = r.body.getReader();
  const text = new TextDecoder();
  let pending = "";
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      pending += text.decode(value, { stream: true });
      let nl: number;
      while ((nl = pending.indexOf("\n")) >= 0) {
        const line = pending.slice(0, nl);
        pending = pending.slice(nl + 1);
        if (line.trim()) yield JSON.parse(line) as T;
      }
    }
    if (pending.trim()) yield JSON.parse(pending) as T;
  } finally {
    reader.releaseLock();
    await r.body.cancel().catch(() => {});
  }
}

export function fromBase64(s: string): Uint8Array {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

export function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

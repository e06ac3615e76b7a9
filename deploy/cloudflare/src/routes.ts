// The Worker's request handling (index.ts calls `worker`) and its own routes for processes
// and files, on the typed client (keel.ts). They run with the caller's bearer token, passed on
// to keel, which checks it: the Worker adds no right of its own; every other path goes to
// keel's API as it is. Kept apart from index.ts (no Container types) so the deploy test runs
// the whole handler in node against a real `keel run`.
//
//   POST /run            body: an ExecRequest → {"id","exit","stdout","stderr"} (UTF-8 text;
//                        413 past RUN_OUTPUT_MAX bytes of output: use ?stream=1)
//                        ?stream=1 → keel's NDJSON events as they come
//   GET  /fs/<path>      the file's bytes (ETag)          ?list=1[&depth=N] → its entries
//   PUT  /fs/<path>      the body, streamed (atomic; If-Match passed on; ?mode=0644)
//   DELETE /fs/<path>    removes it (?recursive=1)
//   GET  /changes        the change feed as NDJSON (?path=&from=CURSOR)
//
// A refusal of keel's (400, 401, 403, 404, ...) is the answer's status, streamed routes too:
// they wait for keel's first event before answering.
import { KeelClient, KeelError, concat, fromBase64, type ExecEvent, type ExecRequest } from "./keel.js";

const NDJSON = { "Content-Type": "application/x-ndjson" };
/** The most output (stdout + stderr bytes) POST /run buffers; past it, 413. */
export const RUN_OUTPUT_MAX = 8 << 20;
/** How long a request waits for a starting instance's GET /health to answer 200. */
const HEALTH_WAIT_MS = 60_000;

/** What the Worker needs of a workspace's container: its fetch (to keel's control API). */
export interface Instance {
  fetch(request: Request): Promise<Response>;
}

/** Waits until the instance's GET /health is 200 (workspace mounted, services ready). */
async function healthy(container: Instance): Promise<boolean> {
  const until = Date.now() + HEALTH_WAIT_MS;
  while (Date.now() < until) {
    const r = await container.fetch(new Request("http://localhost/health"));
    if (r.status === 200) return true;
    await new Promise((done) => setTimeout(done, 200));
  }
  return false;
}

/**
 * The Worker's answer to `request`: /w/<name>/<path> goes to the container `instance(name)`
 * gives, by the routes below or as it is to keel's control API. The request's body is used
 * once: by the route that matched, or by the pass-through (workerd refuses a second use).
 */
export async function worker(request: Request, instance: (name: string) => Instance): Promise<Response> {
  const url = new URL(request.url);
  const m = url.pathname.match(/^\/w\/([A-Za-z0-9._-]{1,64})(\/.*)?$/);
  if (!m) {
    return new Response("usage: /w/<workspace>/{health,status,checkpoint,metrics,run,fs/<path>,changes}\n", {
      status: 404,
    });
  }
  const container = instance(m[1]);
  // The query goes with the path (?stream=1, /files?path=...).
  const inner = new URL((m[2] ?? "/status") + url.search, url);
  if (inner.pathname !== "/health" && !(await healthy(container))) {
    return new Response("workspace not ready\n", { status: 503 });
  }
  // The Worker's routes for processes and files, with the caller's token.
  const bearer = request.headers.get("Authorization")?.match(/^Bearer (.+)$/)?.[1];
  const client = new KeelClient("http://localhost", bearer, (r) => container.fetch(r));
  const answer = await route(client, inner, request);
  if (answer) return answer;
  // The control API checks the bearer token itself; pass the caller's header through.
  return container.fetch(new Request(inner, request));
}

/**
 * The answer to `url` (its path is the part after /w/<name>) for the method, headers and body
 * of `request`, or null when it is not one of these routes: then the body is untouched.
 */
export async function route(client: KeelClient, url: URL, request: Request): Promise<Response | null> {
  const path = url.pathname;
  const q = url.searchParams;
  try {
    if (path === "/run" && request.method === "POST") {
      const req = (await request.json()) as ExecRequest;
      const events = client.exec(req);
      // keel's refusal (bad request, token, path) throws here, before any answer is made.
      const first = await events.next();
      if (q.get("stream") === "1") return new Response(lines(events, first), { headers: NDJSON });
      return await buffered(events, first);
    }
    if (path === "/changes" && request.method === "GET") {
      const events = client.watch(q.get("path") ?? "/", { from: q.get("from") ?? undefined, signal: request.signal });
      const first = await events.next();
      return new Response(lines(events, first), { headers: NDJSON });
    }
    const m = path.match(/^\/fs(\/.*)?$/);
    if (!m) return null;
    // Relative to /workspace, as keel's /files takes it.
    let file: string;
    try {
      file = decodeURIComponent(m[1] ?? "").replace(/^\/+/, "") || ".";
    } catch (e) {
      if (e instanceof URIError) return Response.json({ error: `bad escape in the path ${m[1]}` }, { status: 400 });
      throw e;
    }
    switch (request.method) {
      case "GET": {
        if (q.get("list") === "1") {
          const depth = Number(q.get("depth") ?? "1");
          return Response.json({ path: file, entries: await client.listFiles(file, { depth }) });
        }
        const f = await client.getFile(file);
        const headers: Record<string, string> = { "Content-Type": "application/octet-stream" };
        if (f.etag) headers.ETag = f.etag;
        return new Response(f.bytes, { headers });
      }
      case "PUT": {
        const etag = await client.putFile(file, request.body ?? new Uint8Array(), {
          mode: q.get("mode") ?? undefined,
          ifMatch: request.headers.get("If-Match") ?? undefined,
        });
        return Response.json({ path: file, etag }, { headers: etag ? { ETag: etag } : {} });
      }
      case "DELETE":
        await client.deleteFile(file, { recursive: q.get("recursive") === "1" });
        return Response.json({ path: file, deleted: true });
      default:
        return new Response("GET, PUT or DELETE\n", { status: 405 });
    }
  } catch (e) {
    if (e instanceof KeelError) return Response.json({ error: e.message }, { status: e.status });
    if (e instanceof SyntaxError) return Response.json({ error: `bad JSON: ${e.message}` }, { status: 400 });
    throw e;
  }
}

/** POST /run's answer: the events to the exit, decoded, up to RUN_OUTPUT_MAX bytes of output. */
async function buffered(events: AsyncGenerator<ExecEvent>, first: IteratorResult<ExecEvent>): Promise<Response> {
  const out: Uint8Array[] = [];
  const err: Uint8Array[] = [];
  let id = 0;
  let size = 0;
  try {
    for (let n = first; !n.done; n = await events.next()) {
      const ev = n.value;
      if (ev.type === "start") id = ev.id;
      else if (ev.type === "stdout" || ev.type === "stderr") {
        const bytes = fromBase64(ev.data);
        size += bytes.length;
        if (size > RUN_OUTPUT_MAX) {
          return Response.json(
            {
              error: `process ${id}: its output passed ${RUN_OUTPUT_MAX} bytes: use POST /run?stream=1, or read it from /processes/${id}/output`,
              id,
            },
            { status: 413 },
          );
        }
        (ev.type === "stdout" ? out : err).push(bytes);
      } else if (ev.type === "error") throw new KeelError(500, ev.error);
      else if (ev.type === "exit") {
        const text = new TextDecoder();
        return Response.json({ id, exit: ev, stdout: text.decode(concat(out)), stderr: text.decode(concat(err)) });
      }
    }
    throw new KeelError(502, "the event stream ended without an exit");
  } finally {
    await events.return(undefined);
  }
}

/** Events as NDJSON lines, as they come, `first` the one already read. */
function lines<T>(events: AsyncGenerator<T>, first: IteratorResult<T>): ReadableStream<Uint8Array> {
  const enc = new TextEncoder();
  let next: IteratorResult<T> | undefined = first;
  return new ReadableStream({
    async pull(c) {
      const { done, value } = next ?? (await events.next());
      next = undefined;
      if (done) c.close();
      else c.enqueue(enc.encode(JSON.stringify(value) + "\n"));
    },
    async cancel() {
      await events.return(undefined);
    },
  });
}

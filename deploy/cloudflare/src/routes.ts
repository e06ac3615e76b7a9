// The Worker's own routes for processes and files, on the typed client (keel.ts). They run
// with the caller's bearer token, passed on to keel, which checks it: the Worker adds no right
// of its own; every other path goes to keel's API as it is (index.ts). Kept apart from
// index.ts (no Container types) so the deploy test runs them in node against a real
// `keel run`.
//
//   POST /run            body: an ExecRequest → {"id","exit","stdout","stderr"} (UTF-8 text)
//                        ?stream=1 → keel's NDJSON events as they come
//   GET  /fs/<path>      the file's bytes (ETag)          ?list=1[&depth=N] → its entries
//   PUT  /fs/<path>      the body, streamed (atomic; If-Match passed on; ?mode=0644)
//   DELETE /fs/<path>    removes it (?recursive=1)
//   GET  /changes        the change feed as NDJSON (?path=&from=CURSOR)
import { KeelClient, KeelError, type ExecRequest } from "./keel.js";

const NDJSON = { "Content-Type": "application/x-ndjson" };

/** The answer to `path` (the part after /w/<name>), or null when it is not one of these. */
export async function route(client: KeelClient, path: string, request: Request): Promise<Response | null> {
  const url = new URL(request.url);
  const q = url.searchParams;
  try {
    if (path === "/run" && request.method === "POST") {
      const req = (await request.json()) as ExecRequest;
      if (q.get("stream") === "1") return new Response(lines(client.exec(req)), { headers: NDJSON });
      const r = await client.run(req);
      const text = new TextDecoder();
      return Response.json({ id: r.id, exit: r.exit, stdout: text.decode(r.stdout), stderr: text.decode(r.stderr) });
    }
    if (path === "/changes" && request.method === "GET") {
      const events = client.watch(q.get("path") ?? "/", { from: q.get("from") ?? undefined, signal: request.signal });
      return new Response(lines(events), { headers: NDJSON });
    }
    const m = path.match(/^\/fs(\/.*)?$/);
    if (!m) return null;
    // Relative to /workspace, as keel's /files takes it.
    const file = decodeURIComponent(m[1] ?? "").replace(/^\/+/, "") || ".";
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

/** Events as NDJSON lines, as they come. */
function lines(events: AsyncGenerator<unknown>): ReadableStream<Uint8Array> {
  const enc = new TextEncoder();
  return new ReadableStream({
    async pull(c) {
      const { done, value } = await events.next();
      if (done) c.close();
      else c.enqueue(enc.encode(JSON.stringify(value) + "\n"));
    },
    async cancel() {
      await events.return(undefined);
    },
  });
}

// The typed client (src/keel.ts) and the Worker's routes (src/routes.ts) against a real
// `keel run` over TCP with a token (test/run.sh starts it and sets KEEL_URL, KEEL_TOKEN).
// Compiled by tsc with the Worker's own settings and run by node; any failed check throws,
// and run.sh fails unless the last line is "client test: N checks passed".
import { KeelClient, KeelError, type ExecEvent, type WatchEvent } from "../src/keel.js";
import { RUN_OUTPUT_MAX, route, worker, type Instance } from "../src/routes.js";

declare const process: { env: Record<string, string | undefined> };

const url = process.env.KEEL_URL ?? "";
const token = process.env.KEEL_TOKEN ?? "";
if (!url || !token) throw new Error("set KEEL_URL and KEEL_TOKEN (test/run.sh does)");

/** keel's answer to a path that leaves the workspace. */
const OUTSIDE = 403;
let checks = 0;
function check(ok: boolean, what: string, got?: unknown): void {
  if (!ok) throw new Error(`FAILED: ${what}${got === undefined ? "" : `: ${JSON.stringify(got)}`}`);
  checks++;
}
async function rejects(p: Promise<unknown>, status: number, what: string): Promise<void> {
  try {
    await p;
  } catch (e) {
    check(e instanceof KeelError && e.status === status, what, String(e));
    return;
  }
  check(false, `${what}: it succeeded`);
}
const text = (b: Uint8Array) => new TextDecoder().decode(b);
async function sha256(b: Uint8Array): Promise<string> {
  const d = new Uint8Array(await crypto.subtle.digest("SHA-256", b));
  return Array.from(d, (x) => x.toString(16).padStart(2, "0")).join("");
}

const keel = new KeelClient(url, token);

// Without the token (or with a wrong one) nothing runs.
await rejects(new KeelClient(url).run({ argv: ["true"] }), 401, "exec without a token");
await rejects(new KeelClient(url, "wrong").getFile("x"), 401, "files with a wrong token");

// A run: output decoded, exit code, the events in order.
const r = await keel.run({ shell: "echo out; echo err >&2; exit 3" });
check(text(r.stdout) === "out\n" && text(r.stderr) === "err\n", "run's output", [text(r.stdout), text(r.stderr)]);
check(r.exit.code === 3 && r.exit.timed_out === false, "run's exit", r.exit);
const events: ExecEvent[] = [];
for await (const ev of keel.exec({ shell: "for i in 1 2 3; do echo $i; done" })) events.push(ev);
check(events[0]?.type === "start" && events.at(-1)?.type === "exit", "exec's events start and exit", events);

// Files: a binary file put and read back byte for byte, seen by a command, listed; If-Match.
await keel.mkdir("client");
await rejects(keel.mkdir("client"), 409, "mkdir of a directory that exists");
const bytes = crypto.getRandomValues(new Uint8Array(60000));
const etag = await keel.putFile("client/bin.dat", bytes, { mode: "0640" });
check(typeof etag === "string" && etag.length > 0, "put answers an ETag", etag);
const back = await keel.getFile("client/bin.dat");
check((await sha256(back.bytes)) === (await sha256(bytes)) && back.etag === etag, "get reads the bytes put", back.etag);
const sum = await keel.run({ argv: ["sha256sum", "client/bin.dat"] });
check(text(sum.stdout).startsWith(await sha256(bytes)), "a command sees the file put", text(sum.stdout));
const listed = await keel.listFiles("client");
check(listed.some((e) => e.name === "bin.dat" && e.size === 60000 && e.mode === "0640"), "list", listed);
await rejects(keel.putFile("client/bin.dat", "other", { ifMatch: '"not-its-etag"' }), 412, "If-Match of another ETag");
const etag2 = await keel.putFile("client/bin.dat", "new", { ifMatch: etag ?? "" });
check(text((await keel.getFile("client/bin.dat")).bytes) === "new" && etag2 !== etag, "If-Match of its ETag");
await rejects(keel.getFile("../etc/hostname"), OUTSIDE, "a path out of the workspace");

// A process with streamed stdin, followed to its end; a kill takes its whole tree.
const cat = await keel.spawn({ argv: ["cat"], stdin: "stream" });
await keel.stdin(cat.id, "piped ");
await keel.stdin(cat.id, "in", true);
let piped = "";
let catExit: ExecEvent | undefined;
for await (const ev of keel.output(cat.id, { follow: true })) {
  if (ev.type === "stdout") piped += atob(ev.data);
  if (ev.type === "exit") catExit = ev;
}
check(piped === "piped in" && catExit?.type === "exit" && catExit.code === 0, "stdin streamed and closed", piped);
const sleeper = await keel.spawn({ shell: "sleep 1000 & sleep 1000" });
await keel.kill(sleeper.id);
const killed = await keel.process(sleeper.id);
check(killed.state === "done" && killed.exit?.killed === true, "a kill ends the process", killed);
check((await keel.processes()).some((p) => p.id === cat.id), "processes lists the records");

// The change feed: a file written after the stream started is seen.
const abort = new AbortController();
const feed = keel.watch("/", { signal: abort.signal });
const first = await feed.next();
check(!first.done && first.value.type === "watching", "watch starts with its cursor", first.value);
await keel.putFile("client/watched.txt", "w");
let seen: WatchEvent | undefined;
// A guard, not a race: a feed that never shows the write fails the test instead of hanging it.
const guard = setTimeout(() => abort.abort(), 120_000);
try {
  for (;;) {
    const n = await feed.next();
    if (n.done) break;
    if (n.value.path === "/client/watched.txt") {
      seen = n.value;
      break;
    }
  }
} catch (e) {
  check(false, "watch sees the write before its guard", String(e));
} finally {
  clearTimeout(guard);
}
check(seen !== undefined && ["create", "modify", "rename"].includes(seen.type), "watch sees the write", seen);
await feed.return(undefined);
abort.abort();

// The Worker's routes, on the same client.
const call = (path: string, init: RequestInit = {}) =>
  route(keel, new URL(path, "http://worker"), new Request(`http://worker${path}`, init)).then((a) => {
    if (!a) throw new Error(`no route for ${path}`);
    return a;
  });
const ran = await call("/run", { method: "POST", body: JSON.stringify({ argv: ["echo", "via", "worker"] }) });
const ranJson = (await ran.json()) as { stdout: string; exit: { code: number } };
check(ran.status === 200 && ranJson.stdout === "via worker\n" && ranJson.exit.code === 0, "POST /run", ranJson);
const put = await call("/fs/client/route.txt", { method: "PUT", body: "through the route" });
check(put.status === 200 && put.headers.get("ETag") !== null, "PUT /fs/...", put.status);
const got = await call("/fs/client/route.txt");
check((await got.text()) === "through the route", "GET /fs/...");
const missing = await call("/fs/client/nothing-here");
check(missing.status === 404, "GET /fs/ of a missing file is keel's 404", missing.status);
const stream = await call("/run?stream=1", { method: "POST", body: JSON.stringify({ argv: ["true"] }) });
const streamed = (await stream.text()).trim().split("\n").map((l) => JSON.parse(l) as ExecEvent);
check(streamed.at(-1)?.type === "exit", "POST /run?stream=1 streams the events", streamed);
check((await route(keel, new URL("http://worker/status"), new Request("http://worker/status"))) === null, "other paths are not the Worker's");

// The whole Worker (index.ts's fetch is `worker`), its container a fetch to this keel, with
// requests whose body can be used once, as in workerd ("Cannot reconstruct a Request with a
// used body"): a body-carrying request passed through to keel, or taken by a route.
class OnceRequest extends Request {
  #taken = false;
  #take(): void {
    if (this.#taken) throw new TypeError("Cannot reconstruct a Request with a used body");
    this.#taken = true;
  }
  override get body(): ReadableStream<Uint8Array> | null {
    this.#take();
    return super.body;
  }
  override json<T>(): Promise<T> {
    this.#take();
    return super.json();
  }
  override text(): Promise<string> {
    this.#take();
    return super.text();
  }
  override arrayBuffer(): Promise<ArrayBuffer> {
    this.#take();
    return super.arrayBuffer();
  }
}
const container: Instance = {
  fetch: (r) => {
    const to = new URL(r.url);
    const body = r.method === "GET" || r.method === "HEAD" ? undefined : r.body;
    return fetch(new URL(to.pathname + to.search, url), {
      method: r.method,
      headers: r.headers,
      body,
      signal: r.signal,
      ...(body ? { duplex: "half" } : {}),
    } as RequestInit);
  },
};
const auth = { Authorization: `Bearer ${token}` };
const viaWorker = (path: string, init: RequestInit = {}) =>
  worker(new OnceRequest(`http://worker/w/test${path}`, { ...init, ...(init.body ? { duplex: "half" } : {}) } as RequestInit), () => container);
const execd = await viaWorker("/exec", { method: "POST", headers: auth, body: JSON.stringify({ argv: ["echo", "passed"] }) });
const execLines = (await execd.text()).trim().split("\n").map((l) => JSON.parse(l) as ExecEvent);
check(execd.status === 200 && execLines.at(-1)?.type === "exit", "POST /exec passed through the Worker", [execd.status, execLines]);
const putW = await viaWorker("/fs/client/worker.txt", { method: "PUT", headers: auth, body: "through the worker" });
check(putW.status === 200, "PUT /fs/ through the Worker", putW.status);
check(text((await keel.getFile("client/worker.txt")).bytes) === "through the worker", "PUT /fs/ through the Worker wrote it");
const putFiles = await viaWorker("/files?path=client/passed.txt", {
  method: "PUT",
  headers: { ...auth, "Content-Type": "application/octet-stream" },
  body: "passed through" });
const putFilesBody = await putFiles.clone().text();
check(putFiles.status === 201 && text((await keel.getFile("client/passed.txt")).bytes) === "passed through", "PUT /files passed through the Worker", [putFiles.status, putFilesBody]);
const runW = await viaWorker("/run", { method: "POST", headers: auth, body: JSON.stringify({ argv: ["echo", "w"] }) });
check(runW.status === 200 && ((await runW.json()) as { stdout: string }).stdout === "w\n", "POST /run through the Worker");

// keel's refusals are the answer's status, streamed routes too; a bad escape is a 400.
const noToken = await viaWorker("/run?stream=1", { method: "POST", body: JSON.stringify({ argv: ["true"] }) });
check(noToken.status === 401, "POST /run?stream=1 without a token is keel's 401", noToken.status);
const badExec = await viaWorker("/run?stream=1", { method: "POST", headers: auth, body: JSON.stringify({ argv: [] }) });
check(badExec.status === 400, "POST /run?stream=1 of a bad request is keel's 400", badExec.status);
const feedNoToken = await viaWorker("/changes");
check(feedNoToken.status === 401, "GET /changes without a token is keel's 401", feedNoToken.status);
const badEscape = await viaWorker("/fs/%zz", { headers: auth });
check(badEscape.status === 400, "GET /fs/%zz is a 400", badEscape.status);

// POST /run buffers at most RUN_OUTPUT_MAX bytes of output; past it a 413 points to ?stream=1.
const big = await viaWorker("/run", { method: "POST", headers: auth, body: JSON.stringify({ argv: ["head", "-c", String(RUN_OUTPUT_MAX + 1), "/dev/zero"] }) });
const bigJson = (await big.json()) as { error: string };
check(big.status === 413 && bigJson.error.includes("?stream=1"), "POST /run past its output cap is a 413", [big.status, bigJson]);
const atCap = await viaWorker("/run", { method: "POST", headers: auth, body: JSON.stringify({ argv: ["head", "-c", String(RUN_OUTPUT_MAX), "/dev/zero"] }) });
check(atCap.status === 200 && ((await atCap.json()) as { stdout: string }).stdout.length === RUN_OUTPUT_MAX, "POST /run of exactly its cap", atCap.status);

console.log(`client test: ${checks} checks passed`);

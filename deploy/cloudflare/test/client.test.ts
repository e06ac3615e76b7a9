// The typed client (src/keel.ts) and the Worker's routes (src/routes.ts) against a real
// `keel run` over TCP with a token (test/run.sh starts it and sets KEEL_URL, KEEL_TOKEN).
// Compiled by tsc with the Worker's own settings and run by node; any failed check throws,
// and run.sh fails unless the last line is "client test: N checks passed".
import { KeelClient, KeelError, type ExecEvent, type WatchEvent } from "../src/keel.js";
import { route } from "../src/routes.js";

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
for (;;) {
  const n = await feed.next();
  if (n.done) break;
  if (n.value.path === "/client/watched.txt") {
    seen = n.value;
    break;
  }
}
check(seen !== undefined && ["create", "modify", "rename"].includes(seen.type), "watch sees the write", seen);
await feed.return(undefined);
abort.abort();

// The Worker's routes, on the same client.
const call = (path: string, init: RequestInit = {}) =>
  route(keel, new URL(path, "http://worker").pathname, new Request(`http://worker${path}`, init)).then((a) => {
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
check((await route(keel, "/status", new Request("http://worker/status"))) === null, "other paths are not the Worker's");

console.log(`client test: ${checks} checks passed`);

// A Worker that gives every workspace name its own keel container:
//   https://<worker>/w/<name>/<path>  →  keel's control API in the container for <name>
// The container's /workspace lives in R2 under <bucket>/<durable object id>/, restored lazily
// on start and checkpointed on SIGTERM (Cloudflare sends SIGTERM, then SIGKILL up to 15 min
// later), so an instance can be stopped and moved at any time without losing work.
import { Container, getContainer } from "@cloudflare/containers";

interface Env {
  KEEL: DurableObjectNamespace<KeelContainer>;
  R2_ACCOUNT_ID: string;
  R2_BUCKET: string;
  AWS_ACCESS_KEY_ID: string;
  AWS_SECRET_ACCESS_KEY: string;
  KEEL_CONTROL_TOKEN: string;
}

const CONTROL_PORT = 8787;

export class KeelContainer extends Container<Env> {
  // keel's control API (`[control] listen` in /etc/keel/cloudflare.toml). The platform waits
  // for this port, and GET /health answers 200 only once /workspace is mounted.
  defaultPort = CONTROL_PORT;
  sleepAfter = "30m";
  // The main service. Replace `sleep infinity` with your agent or dev server; it runs in
  // /workspace as keel's main service and receives the platform's SIGTERM.
  entrypoint = ["/usr/local/bin/keel", "run", "--", "sleep", "infinity"];

  constructor(ctx: DurableObjectState<{}>, env: Env) {
    super(ctx, env);
    this.envVars = {
      KEEL_CONFIG: "/etc/keel/cloudflare.toml",
      KEEL_CONTROL_PORT: String(CONTROL_PORT),
      KEEL_CONTROL_TOKEN: env.KEEL_CONTROL_TOKEN,
      KEEL_WORKSPACE_ID: ctx.id.toString(),
      R2_BUCKET: env.R2_BUCKET,
      // keel's S3 client (R2 speaks S3): endpoint, region and the R2 API token.
      AWS_ENDPOINT_URL: `https://${env.R2_ACCOUNT_ID}.r2.cloudflarestorage.com`,
      AWS_REGION: "auto",
      AWS_ACCESS_KEY_ID: env.AWS_ACCESS_KEY_ID,
      AWS_SECRET_ACCESS_KEY: env.AWS_SECRET_ACCESS_KEY,
    };
  }

  override onError(error: unknown): never {
    console.error("keel container error:", error);
    throw error;
  }
}

export default {
  async fetch(request: Request, env: Env): Promise<Response> {
    const url = new URL(request.url);
    const m = url.pathname.match(/^\/w\/([A-Za-z0-9._-]{1,64})(\/.*)?$/);
    if (!m) return new Response("usage: /w/<workspace>/{health,status,checkpoint,metrics}\n", { status: 404 });
    // The control API checks the bearer token itself; pass the caller's header through.
    const inner = new URL(m[2] ?? "/status", url);
    const container = getContainer(env.KEEL, m[1]);
    return container.fetch(new Request(inner, request));
  },
};

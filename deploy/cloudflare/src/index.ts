// A Worker that gives every workspace name its own keel container:
//   https://<worker>/w/<name>/<path>  →  keel's control API in the container for <name>
// The container's /workspace lives in R2 under <bucket>/<durable object id>/ (the profile's
// `remote = "s3://${R2_BUCKET}/${KEEL_WORKSPACE_ID}"`), restored lazily on start,
// checkpointed every 30 s while it changes and at SIGTERM (Cloudflare sends SIGTERM, then
// SIGKILL up to 15 min later), so an instance can be stopped and moved at any time.
import { Container, getContainer } from "@cloudflare/containers";
import { worker } from "./routes.js";

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
  // for this port; GET /health answers 200 only once /workspace is mounted.
  defaultPort = CONTROL_PORT;
  pingEndpoint = "localhost/health";
  sleepAfter = "30m";
  // The main service. Replace `sleep infinity` with your agent or dev server; it runs in
  // /workspace as keel's main service and receives the platform's SIGTERM.
  entrypoint = ["/usr/local/bin/keel", "run", "--", "sleep", "infinity"];

  constructor(ctx: DurableObjectState<{}>, env: Env) {
    super(ctx, env);
    if (!env.R2_ACCOUNT_ID) throw new Error("set R2_ACCOUNT_ID in wrangler.jsonc vars");
    this.envVars = {
      // The variables /etc/keel/cloudflare.toml expands (`${NAME}`); a missing one stops
      // keel at start with one line naming it.
      KEEL_CONFIG: "/etc/keel/cloudflare.toml",
      KEEL_WORKSPACE_ID: ctx.id.toString(),
      KEEL_CONTROL_PORT: String(CONTROL_PORT),
      R2_BUCKET: env.R2_BUCKET,
      R2_ENDPOINT: `https://${env.R2_ACCOUNT_ID}.r2.cloudflarestorage.com`,
      // Read by keel's remote client and the control API only: keel removes AWS_* and
      // KEEL_CONTROL_TOKEN from the environment of every process it starts.
      KEEL_CONTROL_TOKEN: env.KEEL_CONTROL_TOKEN,
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
  fetch(request: Request, env: Env): Promise<Response> {
    return worker(request, (name) => getContainer(env.KEEL, name));
  },
};

#!/usr/bin/env bash
# deploy/kubernetes/keel.yaml (or KEEL_KUBE_MANIFEST, e.g. keel-restricted.yaml) through
# `podman kube play` (podman runs real Kubernetes YAML): the StatefulSet's Pod (as the
# StatefulSet names it: <name>-0, its claim <claim>-<name>-0) starts, /health answers 200,
# /workspace is a FUSE mount (restricted: the dir provider's symlink, keel as the pod's
# non-root user), `keel status` works in the pod; `podman kube down` stops it with SIGTERM
# (the main command's TERM trap leaves a mark in /workspace); a second `kube play` on the same
# volume sees every file, and a third on a fresh volume restores them from the bucket. Run by
# ci/platform-e2e.sh (cases kube_play, kube_play_restricted), or alone.
#
# What the test changes in the YAML (podman has no StatefulSet, CI has no registry and no R2):
# the StatefulSet becomes its Pod plus a PersistentVolumeClaim, the image is $KEEL_IMAGE,
# names get a per-run prefix, the bucket/endpoint variables point at moto, the config gets
# `allow_http = true`, the Secret is created with `podman secret create` (how podman serves
# secret volumes), and the main command becomes a small workload. Everything else (the FUSE
# device, SYS_ADMIN, volumes, the credentials file, the grace period) is played as written.
#
# Prints `info: ...` lines (the figures) and `error: ...` lines; exits 1 on any error.
# env: KEEL_IMAGE (default localhost/keel:e2e), KEEL_KUBE_MANIFEST (default
#      deploy/kubernetes/keel.yaml), MOTO_PORT + BUCKET (a running moto and its bucket;
#      default: start one), PREFIX (name prefix, default keel-kube-$$).
# shellcheck disable=SC2016
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=script/lib.sh
. "$repo/script/lib.sh"
set +e

image="${KEEL_IMAGE:-localhost/keel:e2e}"
manifest_in="${KEEL_KUBE_MANIFEST:-$repo/deploy/kubernetes/keel.yaml}"
prefix="${PREFIX:-keel-kube-$$}-k"
bucket="${BUCKET:-keel-kube}"
tmp="$(mktemp -d /tmp/keel-kube.XXXXXX)"
errors=0
own_moto=""
need_tools podman
# The pod's infra container runs podman's catatonit.
dpkg-query -W -f='${Status}' catatonit 2>/dev/null | grep -q 'install ok installed' || apt_install catatonit
setup_podman_env

info() { echo "info: $*"; }
error() { echo "error: $*"; errors=$((errors + 1)); }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

cleanup() {
    [ -f "$tmp/play.yaml" ] && pm kube down "$tmp/play.yaml" >/dev/null 2>&1
    local v
    for v in $(pm volume ls --format '{{.Name}}' 2>/dev/null | grep -e "^$prefix-" -e "-$prefix-"); do
        pm volume rm -f "$v" >/dev/null 2>&1
    done
    pm secret rm "$prefix-keel-remote" "$prefix-keel-remote-env" >/dev/null 2>&1
    [ -z "$own_moto" ] || kill "$own_moto" 2>/dev/null
    [ -z "${LOGS_PID:-}" ] || kill "$LOGS_PID" 2>/dev/null
    [ -n "${KEEL_KUBE_KEEP:-}" ] || rm -rf "$tmp"
}
trap cleanup EXIT

python3 -c 'import yaml' 2>/dev/null || { error "python3 yaml (python3-yaml) is missing"; exit 1; }
if [ -z "${MOTO_PORT:-}" ]; then
    start_moto "$tmp/moto.log"; st=$?; own_moto=$MOTO_PID
    [ "$st" = 0 ] || { error "moto_server did not start"; exit 1; }
    curl -s -f -X PUT "http://127.0.0.1:$MOTO_PORT/$bucket" >/dev/null || { error "cannot create the bucket on moto"; exit 1; }
fi
port=$(free_port)

# The workload: first start writes a tree; every stop by SIGTERM leaves a mark.
workload='trap "echo stopped by SIGTERM > /workspace/marks/stopped-by-sigterm; exit 0" TERM
cd /workspace
if [ ! -d kube-tree ]; then
    mkdir marks
    mkdir -p kube-tree/a/b
    (cd kube-tree/a && seq 1 500 | split -l 1 -a 3 -d - f)
    head -c 5M /dev/urandom > kube-tree/blob
    echo hello > kube-tree/hello; ln -s hello kube-tree/link; chmod 0600 kube-tree/hello
    chown 1000:1000 kube-tree/a/b; touch -d "2020-01-02 03:04:05" kube-tree/hello
fi
echo READY
while :; do sleep 0.2; done'

python3 - "$manifest_in" "$tmp" "$prefix" "$image" "$bucket" "$MOTO_PORT" "$port" "$workload" <<'EOF' || { error "cannot convert $manifest_in"; exit 1; }
import base64, json, sys, yaml
src, tmp, prefix, image, bucket, moto, port, workload = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(src)) if d]
out, renamed = [], {}
for d in docs:
    if d["kind"] in ("Secret", "ConfigMap"):
        renamed[d["metadata"]["name"]] = f"{prefix}-{d['metadata']['name']}"
        d["metadata"]["name"] = renamed[d["metadata"]["name"]]
for d in docs:
    kind = d["kind"]
    if kind == "Secret":
        # podman 4.3 serves a secret volume from a podman secret holding the Secret, writing
        # its `data` values as they are (not base64-decoded), and a secretKeyRef from one
        # holding a flat JSON map of base64 values.
        plain = {k: base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
        plain.update(d.pop("stringData", {}))
        d["data"] = plain
        json.dump(d, open(f"{tmp}/secret.yaml", "w"))
        data = {k: base64.b64encode(v.encode()).decode() for k, v in plain.items()}
        json.dump(data, open(f"{tmp}/secret-env.json", "w"))
    elif kind == "ConfigMap":
        d["data"]["config.toml"] = d["data"]["config.toml"].replace("[persist]\n", "[persist]\nallow_http = true\n")
        import tomllib
        ws = tomllib.loads(d["data"]["config.toml"]).get("workspace", {}).get("mount_point", "/workspace")
        open(f"{tmp}/ws-path", "w").write(ws)
        workload = workload.replace("/workspace", ws)
        out.append(d)
    elif kind == "StatefulSet":
        name = f"{prefix}-{d['metadata']['name']}-0"
        spec = d["spec"]["template"]["spec"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "labels": d["spec"]["template"]["metadata"].get("labels", {})},
               "spec": spec}
        for vct in d["spec"].get("volumeClaimTemplates", []):
            claim = f"{vct['metadata']['name']}-{name}"
            out.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                        "metadata": {"name": claim}, "spec": vct["spec"]})
            spec.setdefault("volumes", []).append(
                {"name": vct["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim}})
        for v in spec.get("volumes", []):
            if "configMap" in v:
                v["configMap"]["name"] = renamed[v["configMap"]["name"]]
            if "secret" in v:
                v["secret"]["secretName"] = renamed[v["secret"]["secretName"]]
                v["secret"].setdefault("optional", False)   # podman 4.3 crashes without it
        c = spec["containers"][0]
        secret_vols = {v["name"] for v in spec.get("volumes", []) if "secret" in v}
        for m in c.get("volumeMounts", []):
            if m["name"] in secret_vols:
                open(f"{tmp}/secret-mount", "w").write(m["mountPath"])
        c.pop("ports", None)   # podman: no port mappings on the host network
        c["image"] = image
        c["args"] = ["/bin/sh", "-c", workload]
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                ref["name"] = renamed[ref["name"]] + "-env"
            e.update({"KEEL_BUCKET": {"value": bucket},
                      "KEEL_S3_ENDPOINT": {"value": f"http://127.0.0.1:{moto}"},
                      "KEEL_CONTROL_PORT": {"value": port}}.get(e["name"], {}))
        c["readinessProbe"]["httpGet"]["port"] = int(port)
        open(f"{tmp}/grace", "w").write(str(spec.get("terminationGracePeriodSeconds", "")))
        # What the kubelet does that podman does not: a pod's fsGroup owns its volumes.
        sc = spec.get("securityContext", {})
        if "fsGroup" in sc:
            open(f"{tmp}/fsgroup", "w").write(str(sc["fsGroup"]))
            open(f"{tmp}/claims", "w").write("\n".join(
                f"{v['metadata']['name']}-{name}" for v in d["spec"].get("volumeClaimTemplates", [])))
        open(f"{tmp}/run-as", "w").write(str(c.get("securityContext", {}).get("runAsUser", sc.get("runAsUser", ""))))
        # No FUSE device given to the pod: keel runs the dir provider.
        has_fuse = any(v.get("hostPath", {}).get("path") == "/dev/fuse" for v in spec.get("volumes", []))
        open(f"{tmp}/provider", "w").write("fuse" if has_fuse else "dir")
        open(f"{tmp}/pod", "w").write(name)
        open(f"{tmp}/container", "w").write(f"{name}-{c['name']}")
        out.append(pod)
    else:
        out.append(d)
yaml.safe_dump_all(out, open(f"{tmp}/play.yaml", "w"), sort_keys=False)
# The second play: the claim's volume exists (podman refuses to create it again).
yaml.safe_dump_all([d for d in out if d["kind"] != "PersistentVolumeClaim"],
                   open(f"{tmp}/play-again.yaml", "w"), sort_keys=False)
EOF
pod=$(cat "$tmp/pod"); ctr=$(cat "$tmp/container"); grace=$(cat "$tmp/grace")
provider=$(cat "$tmp/provider"); run_as=$(cat "$tmp/run-as"); ws_path=$(cat "$tmp/ws-path")
first_yaml="$tmp/play.yaml"
# prepare_claims: the kubelet gives a pod's volumes to its fsGroup (group-owned, setgid,
# group-writable); podman kube play does not: make each claim's volume that way (then the
# pod is played without its claims).
prepare_claims() {
    local claim mp fsgroup
    fsgroup=$(cat "$tmp/fsgroup")
    while read -r claim || [ -n "$claim" ]; do
        [ -n "$claim" ] || continue
        pm volume create "$claim" >/dev/null || { error "cannot create volume $claim"; return 1; }
        # podman gives a new volume, at its first mount, the owner and mode of the image's
        # directory there (/var/lib/keel: root's, 0700), which no kubelet does: that first
        # mount happens here, where the image has no directory.
        pm run --rm -v "$claim:/kube-volume" --entrypoint true "$image" >/dev/null 2>&1 \
            || { error "cannot mount volume $claim once"; return 1; }
        mp=$(pm volume inspect -f '{{.Mountpoint}}' "$claim")
        # A fresh ext4 PersistentVolume holds lost+found.
        mkdir -m 0700 "$mp/lost+found" &&
            chgrp "$fsgroup" "$mp" && chmod 2775 "$mp" || { error "cannot give $claim to group $fsgroup"; return 1; }
    done <"$tmp/claims"
}
if [ -s "$tmp/fsgroup" ]; then
    prepare_claims || exit 1
    first_yaml="$tmp/play-again.yaml"
    info "fsGroup $(cat "$tmp/fsgroup"): the claim's volume made group-writable as the kubelet would"
fi
[ -n "$grace" ] || error "the manifest sets no terminationGracePeriodSeconds"
if [ -s "$tmp/secret.yaml" ]; then
    secret=$(python3 -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' "$tmp/secret.yaml")
    pm secret create "$secret" "$tmp/secret.yaml" >/dev/null &&
        pm secret create "$secret-env" "$tmp/secret-env.json" >/dev/null || { error "podman secret create failed"; exit 1; }
else
    error "the manifest has no Secret for the credentials file"
fi

# play PHASE: kube play, then /health 200; prints the seconds.
play() {
    local t0 i code
    t0=$(now)
    local yml="$first_yaml"
    [ "$1" = second ] && yml="$tmp/play-again.yaml"
    pm kube play --network host "$yml" >"$tmp/play-$1.out" 2>&1 \
        || { error "kube play ($1): $(tail -n 3 "$tmp/play-$1.out" | paste -sd' ' -)"; return 1; }
    for ((i = 0; i < 1200; i++)); do
        code=$(curl -s -o /dev/null -m 2 -w '%{http_code}' "http://127.0.0.1:$port/health")
        [ "$code" = 200 ] && { info "kube play ($1): /health 200 after $(elapsed "$t0" "$(now)")s"; return 0; }
        [ "$(pm inspect -f '{{.State.Running}}' "$ctr" 2>/dev/null)" = true ] || break
        sleep 0.1
    done
    error "kube play ($1): /health not 200 (last $code)"
    pm logs "$ctr" 2>&1 | tail -n 15 | sed 's/^/info:   | /'
    return 1
}
ready() {
    local i
    for ((i = 0; i < 600; i++)); do pm logs "$ctr" 2>&1 | grep -qx READY && return 0; sleep 0.1; done
    error "the workload did not say READY"; return 1
}
# /workspace inside the container, from the host (with `dir` a symlink into the state volume,
# resolved inside the container's root, not the host's).
root_of() {
    local r ws
    r="/proc/$(pm inspect -f '{{.State.Pid}}' "$ctr")/root"
    ws=$(pm exec "$ctr" readlink -f "$ws_path")
    echo "$r${ws:-$ws_path}"
}
# podman before 4.4 stops the pods of `kube down` with a timeout of 0 (SIGTERM, then SIGKILL
# at once) whatever terminationGracePeriodSeconds says; there the pod is first stopped as the
# kubelet would (SIGTERM, SIGKILL after the grace period), then `kube down` removes it.
kube_down_kills=0
v=$(pm version -f '{{.Client.Version}}' 2>/dev/null)
[ "$(printf '%s\n' 4.4.0 "$v" | sort -V | head -n1)" = 4.4.0 ] || kube_down_kills=1
down() {   # down PHASE: kube down with keel's log captured; prints what the stop did
    local t0 st
    pm logs -f "$ctr" >"$tmp/logs-$1" 2>&1 & LOGS_PID=$!
    t0=$(now)
    if [ "$kube_down_kills" = 1 ]; then
        pm pod stop -t "${grace:-30}" "$pod" >"$tmp/down-$1.out" 2>&1 || error "pod stop ($1) failed"
        info "podman $v: pod stop -t $grace (SIGTERM) before kube down: $(elapsed "$t0" "$(now)")s"
        st=$(pm inspect -f '{{.State.ExitCode}}' "$ctr" 2>/dev/null)
        # The stopped container still exists: read its whole log now. A `logs -f` follower
        # can lose the last lines when the container ends right after it attached.
        kill "$LOGS_PID" 2>/dev/null; wait "$LOGS_PID" 2>/dev/null; LOGS_PID=""
        pm logs "$ctr" >"$tmp/logs-$1" 2>&1
    fi
    pm kube down "$tmp/play.yaml" >>"$tmp/down-$1.out" 2>&1 || error "kube down ($1) failed: $(tail -n 2 "$tmp/down-$1.out")"
    info "kube down ($1): $(elapsed "$t0" "$(now)")s${st:+, keel exited $st}"
    if [ -n "$LOGS_PID" ]; then
        sleep 0.5; kill "$LOGS_PID" 2>/dev/null; wait "$LOGS_PID" 2>/dev/null; LOGS_PID=""
    fi
    grep -q 'stopping: .*SIGTERM' "$tmp/logs-$1" || { error "kube down ($1): keel did not log a SIGTERM stop"; tail -n 10 "$tmp/logs-$1" | sed 's/^/info:   | /'; }
    info "keel: $(grep -E 'stopping:|workspace flush|checkpoint report|exit [0-9]' "$tmp/logs-$1" | sed 's/^.*keel: *//' | paste -sd'|' - | cut -c1-300)"
}

same_tree() {   # same_tree PHASE WHAT: the workspace now against the first play's manifest
    python3 "$repo/ci/tree-manifest.py" "$(root_of)" marks >"$tmp/$1" || error "manifest ($1)"
    if diff "$tmp/before" "$tmp/$1" >"$tmp/diff"; then
        info "$2: all $(wc -l <"$tmp/before") entries identical"
    else
        error "$2: trees differ ($(grep -c '^[<>]' "$tmp/diff") lines)"
        head -n 10 "$tmp/diff" | sed 's/^/info:   | /'
    fi
}

if play first && ready; then
    if [ "$provider" = fuse ]; then
        fs=$(pm exec "$ctr" awk -v p="$ws_path" '$2 == p { print $3 }' /proc/mounts | tail -n 1)
        [ "${fs%%.*}" = fuse ] || error "$ws_path is not a FUSE mount ($fs)"
    else
        # No device, no SYS_ADMIN: the dir provider, the mount point a symlink to a directory
        # on the volume.
        fs="dir provider, $ws_path -> $(pm exec "$ctr" readlink "$ws_path")"
        [ "$(pm exec "$ctr" readlink "$ws_path")" = /var/lib/keel/workspace ] \
            || error "$ws_path is not the dir provider's directory ($fs)"
        line=$(pm logs "$ctr" 2>&1 | grep -m1 'workspace: provider dir')
        [ -n "$line" ] || error "keel's log does not say it runs the dir provider"
        info "${line#*keel: }"
    fi
    # `kubectl exec POD -- keel status`: the control socket is where the CLI looks (a non-root
    # PID 1 cannot make /run/keel: it keeps the socket in the state dir).
    st=$(pm exec "$ctr" keel status 2>&1) || error "keel status in the pod failed: $(echo "$st" | tail -n 2 | paste -sd' ' -)"
    if [ -n "$run_as" ]; then
        uid=$(pm exec "$ctr" awk '/^Uid:/ { print $2 }' /proc/1/status)
        [ "$uid" = "$run_as" ] || error "keel (PID 1) runs as uid $uid, the manifest says $run_as"
        info "keel (PID 1) runs as uid $uid"
        # A volume keel's user does not own (fsGroup's) is not walked and chmod'ed at each start.
        n=$(pm logs "$ctr" 2>&1 | grep -c 'could not tighten\|cannot make the state dir private')
        [ "$n" = 0 ] || error "keel tried to tighten a state dir it does not own ($n warnings)"
    fi
    info "$ws_path: $fs; pod stop timeout $(pm inspect -f '{{.Config.StopTimeout}}' "$ctr")s (terminationGracePeriodSeconds $grace)"
    sm=$(cat "$tmp/secret-mount" 2>/dev/null)
    creds="/proc/$(pm inspect -f '{{.State.Pid}}' "$ctr")/root$sm/credentials"
    grep -q '^AWS_SECRET_ACCESS_KEY=' "$creds" 2>/dev/null \
        || { error "the Secret is not mounted as the credentials file ($sm/credentials)"; ls -la "$(dirname "$creds")" 2>&1 | sed 's/^/info:   | /'; }
    code=$(curl -s -o /dev/null -m 60 -w '%{http_code}' "http://127.0.0.1:$port/status")
    [ "$code" = 401 ] || error "/status without the Secret's control token: $code, want 401"
    python3 "$repo/ci/tree-manifest.py" "$(root_of)" marks >"$tmp/before" || error "manifest (first)"
    down first
    pm volume exists "state-$pod" || error "the state volume is gone after kube down"
    if play second && ready; then
        same_tree second "second kube play on the same volume"
        [ "$(cat "$(root_of)/marks/stopped-by-sigterm" 2>/dev/null)" = "stopped by SIGTERM" ] \
            || error "the main command did not get SIGTERM at kube down (no mark in /workspace)"
        down second
    fi
    # A rescheduled pod on a new node: a fresh volume, the workspace restored from the bucket.
    pm volume rm -f "state-$pod" >/dev/null 2>&1
    if [ -s "$tmp/fsgroup" ]; then prepare_claims || exit 1; fi
    if play third && ready; then
        same_tree third "third kube play on a fresh volume (restored from the bucket)"
        line=$(pm logs "$ctr" 2>&1 | grep -m1 '^keel: restored snapshot')
        [ -n "$line" ] && info "${line#keel: }" || error "third kube play: keel's log says nothing about a restore"
        down third
    fi
fi
[ "$errors" = 0 ]

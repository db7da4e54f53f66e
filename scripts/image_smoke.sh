#!/usr/bin/env bash
# make image-smoke: build the CPU image with buildah and serve the bundled model from inside it.
#
#   1. the base image (CPU_BASE_IMAGE, default python:3.11-slim-bookworm) is pulled; when no registry
#      answers (as on the project's machines), a Debian bookworm root with python3 is made with
#      debootstrap and committed under the base's name, so the Dockerfile is built unchanged;
#   2. `buildah bud --target cpu` builds the Dockerfile (the bundled SmolLM2-135M-Instruct included);
#   3. `buildah run` starts the image's own ENTRYPOINT + CMD as the image's user (port moved to a free
#      one), then the script waits for /health, runs the image's HEALTHCHECK command inside the
#      container, sends a /v1/completions request and checks /metrics for vLLM's and certvllm's series.
#
# Storage: buildah's vfs driver under $IMAGE_SMOKE_DIR (default /var/tmp/certvllm-image-smoke), chroot
# isolation: no daemon, no overlay or user namespaces needed. Reruns reuse the base image and build
# the rest again; `make image-smoke-clean` removes everything. Needs root (apt-get, debootstrap, chroot).
#
# Environment: IMAGE_SMOKE_DIR, CPU_BASE_IMAGE, IMAGE_TAG, DEBIAN_MIRROR, IMAGE_SMOKE_PORT,
# IMAGE_SMOKE_TIMEOUT (seconds to wait for /health, default 600), IMAGE_SMOKE_KEEP=1 (keep the built
# image in the store afterwards; by default it is removed, the base image is kept),
# IMAGE_SMOKE_SKIP_BUILD=1 (with IMAGE_SMOKE_KEEP=1 before: test the image already built).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${IMAGE_SMOKE_DIR:-/var/tmp/certvllm-image-smoke}
BASE=${CPU_BASE_IMAGE:-docker.io/library/python:3.11-slim-bookworm}
TAG=${IMAGE_TAG:-localhost/certvllm:cpu-smoke}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HEALTH_TIMEOUT=${IMAGE_SMOKE_TIMEOUT:-600}
export BUILDAH_ISOLATION=chroot
BUILDAH=(buildah --storage-driver vfs --root "$STATE/storage" --runroot "$STATE/run")

START=$(date +%s)
log() { printf '[image-smoke %4ds] %s\n' "$(($(date +%s) - START))" "$*"; }
die() { log "FAILED: $*"; exit 1; }

# ---- tools -----------------------------------------------------------------------------------------
need=()
command -v buildah >/dev/null || need+=(buildah)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v curl >/dev/null || need+=(curl)
if ((${#need[@]})); then
    [ "$(id -u)" = 0 ] || die "needs ${need[*]} (apt-get install ${need[*]}) or root to install them"
    log "installing ${need[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[ "$(id -u)" = 0 ] || die "run as root: debootstrap and buildah's chroot isolation need it"
mkdir -p "$STATE"
exec 9>"$STATE/lock"
flock -n 9 || die "another image smoke test holds $STATE/lock"

# ---- 1. base image -----------------------------------------------------------------------------------
if "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
    log "base $BASE: already in the store"
elif timeout 120 "${BUILDAH[@]}" pull --retry 0 --quiet "$BASE" >/dev/null 2>"$STATE/pull.log"; then
    log "base $BASE: pulled"
else
    log "base $BASE: cannot be pulled ($(tail -n1 "$STATE/pull.log" | cut -c1-160)); making it with debootstrap"
    rootfs="$STATE/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
        bookworm "$rootfs" "$MIRROR" >"$STATE/debootstrap.log" 2>&1 \
        || { tail -n 20 "$STATE/debootstrap.log"; die "debootstrap"; }
    # what python:3.11-slim-bookworm offers: python3 and python on PATH, the C headers, no apt lists
    ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python3"
    ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/*.log
    ctr=$("${BUILDAH[@]}" from scratch)
    mnt=$("${BUILDAH[@]}" mount "$ctr")
    tar -C "$rootfs" --numeric-owner -cf - . | tar -C "$mnt" --numeric-owner -xpf -
    "${BUILDAH[@]}" umount "$ctr" >/dev/null
    "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 --os linux --arch amd64 \
        --label org.opencontainers.image.description="debootstrap bookworm stand-in for $BASE" "$ctr"
    "${BUILDAH[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
    rm -rf "$rootfs"
    log "base $BASE: made ($("${BUILDAH[@]}" run --isolation chroot "$("${BUILDAH[@]}" from --pull=never -q "$BASE")" -- python3 --version 2>&1))"
    "${BUILDAH[@]}" rm --all >/dev/null
fi

# ---- 2. build ----------------------------------------------------------------------------------------
# This machine's pip settings (a local wheel store, extra indexes, a CA bundle for the egress proxy)
# become build arguments, and the local folders they name are bound read-only at the same paths.
pip_py=python3
[ -x "$ROOT/.venv/bin/python" ] && pip_py="$ROOT/.venv/bin/python"
pip_get() { "$pip_py" -m pip config get "global.$1" 2>/dev/null | tr '\n' ' ' | sed 's/ *$//' || true; }
find_links=${PIP_FIND_LINKS:-$(pip_get find-links)}
extra_index=${PIP_EXTRA_INDEX_URL:-$(pip_get extra-index-url)}
index_url=${PIP_INDEX_URL:-$(pip_get index-url)}
cert=${PIP_CERT:-$(pip_get cert)}
build_args=(--build-arg "CPU_BASE_IMAGE=$BASE" --build-arg BUNDLE_MODEL=1)
volumes=()
for item in $find_links $extra_index $index_url; do
    path=${item#file://}
    path=${path%/}
    [[ $path == */simple ]] && path=${path%/simple}  # a local index links to ../files beside simple/
    [[ $path == /* && -d $path ]] && volumes+=(-v "$path:$path:ro")
done
[ -n "$find_links" ] && build_args+=(--build-arg "PIP_FIND_LINKS=$find_links")
[ -n "$extra_index" ] && build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=$extra_index")
[ -n "$index_url" ] && build_args+=(--build-arg "PIP_INDEX_URL=$index_url")
if [ -n "$cert" ] && [ -f "$cert" ]; then
    volumes+=(-v "$cert:/run/certvllm-build-ca.crt:ro")
    build_args+=(--build-arg PIP_CERT=/run/certvllm-build-ca.crt)
fi
# No --layers: with the vfs driver every cached layer is a full copy of the file system (tens of GB
# for this image); without it each stage commits once. The previous smoke image goes first.
if [ "${IMAGE_SMOKE_SKIP_BUILD:-0}" = 1 ] && "${BUILDAH[@]}" inspect --type image "$TAG" >/dev/null 2>&1; then
    log "IMAGE_SMOKE_SKIP_BUILD=1: testing the $TAG already in the store"
else
    "${BUILDAH[@]}" rmi --force "$TAG" >/dev/null 2>&1 || true
    "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true
    log "building $TAG (target cpu; pip: find-links='${find_links}' extra-index='${extra_index}')"
    t0=$(date +%s)
    "${BUILDAH[@]}" bud --isolation chroot --format docker --pull=never --layers=false --force-rm --target cpu \
        "${build_args[@]}" "${volumes[@]}" -t "$TAG" -f "$ROOT/Dockerfile" "$ROOT" >"$STATE/build.log" 2>&1 \
        || { tail -n 40 "$STATE/build.log"; die "buildah bud (full log: $STATE/build.log)"; }
    log "built $TAG in $(($(date +%s) - t0)) s; size $("${BUILDAH[@]}" images --format '{{.Size}}' "$TAG" | head -n1)"
fi

# ---- 3. run ------------------------------------------------------------------------------------------
"${BUILDAH[@]}" inspect --type image "$TAG" >"$STATE/inspect.json"
config() {  # one field of the image's Docker config, as lines (lists) or a string
    python3 -c 'import json, sys
value = json.load(open(sys.argv[1]))["Docker"]["config"].get(sys.argv[2]) or ""
if isinstance(value, dict):  # Healthcheck: its Test, run as the engine would
    test = value.get("Test") or ["NONE"]
    value = ["/bin/sh", "-c", test[1]] if test[0] == "CMD-SHELL" else test[1:]
print(*(value if isinstance(value, list) else [value]), sep="\n")' "$STATE/inspect.json" "$1"
}
mapfile -t entry < <(config Entrypoint)
mapfile -t cmd < <(config Cmd)
mapfile -t health_cmd < <(config Healthcheck)
user=$(config User)
[ "${entry[*]}" = "certvllm serve" ] || die "ENTRYPOINT is '${entry[*]}', not 'certvllm serve'"
[ -n "$user" ] && [ "${user%%:*}" != root ] && [ "${user%%:*}" != 0 ] || die "the image runs as '$user', not a non-root user"
[[ ${health_cmd[*]} == *CERTVLLM_HEALTH_URL* ]] || die "no HEALTHCHECK on /health in the image config (${health_cmd[*]})"

port=${IMAGE_SMOKE_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
base_url="http://127.0.0.1:$port"
ctr=$("${BUILDAH[@]}" from --pull=never --quiet "$TAG")
server_pid=
cleanup() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill -TERM -- "-$server_pid" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    "${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT
# the image's own command line; only the listening address changes (vLLM takes the last --host/--port)
log "starting in the container as $user: ${entry[*]} ${cmd[*]} --host 127.0.0.1 --port $port"
setsid "${BUILDAH[@]}" run --isolation chroot --user "$user" \
    --env VLLM_CPU_KVCACHE_SPACE=1 --env "CERTVLLM_HEALTH_URL=$base_url/health" \
    "$ctr" -- "${entry[@]}" "${cmd[@]}" --host 127.0.0.1 --port "$port" >"$STATE/serve.log" 2>&1 &
server_pid=$!
t0=$(date +%s)
until curl -sf "$base_url/health" >/dev/null; do
    kill -0 "$server_pid" 2>/dev/null || { tail -n 40 "$STATE/serve.log"; die "the server exited"; }
    (($(date +%s) - t0 < HEALTH_TIMEOUT)) || { tail -n 40 "$STATE/serve.log"; die "no /health in ${HEALTH_TIMEOUT} s"; }
    sleep 2
done
log "healthy after $(($(date +%s) - t0)) s"
"${BUILDAH[@]}" run --isolation chroot --user "$user" --env "CERTVLLM_HEALTH_URL=$base_url/health" "$ctr" \
    -- "${health_cmd[@]}" || die "the image's HEALTHCHECK command failed"
log "HEALTHCHECK command passes inside the container"

model=$(curl -sf "$base_url/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
curl -sf "$base_url/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}" \
    >"$STATE/completion.json" || die "/v1/completions"
python3 - "$STATE/completion.json" <<'EOF' || die "bad /v1/completions answer"
import json, sys
body = json.load(open(sys.argv[1]))
text, usage = body["choices"][0]["text"], body["usage"]
assert usage["completion_tokens"] > 0, body
print(f"[image-smoke] completion: {text!r} ({usage['completion_tokens']} tokens)")
EOF
curl -sf "$base_url/metrics" >"$STATE/metrics.txt" || die "/metrics"
for series in 'vllm:cert_head_steps_total{' 'vllm:cert_host_tier_bytes{' 'vllm:cert_e_key_bucket{' \
              'vllm:generation_tokens_total{' 'vllm:kv_cache_usage_perc{'; do
    grep -qF "$series" "$STATE/metrics.txt" || die "/metrics lacks $series"
done
grep -q 'cache_dtype="certified"' "$STATE/metrics.txt" || die "the server does not run --kv-cache-dtype certified"
if grep -q "CPU kernel unavailable" "$STATE/serve.log"; then
    grep -m1 "CPU kernel unavailable" "$STATE/serve.log" | cut -c1-300
    die "the image's prebuilt certvllm CPU kernel did not load"
fi
log "/metrics: $(grep -c '^vllm:cert_' "$STATE/metrics.txt") vllm:cert_* samples, $(grep -c '^vllm:' "$STATE/metrics.txt") vllm:* in all"
cleanup
server_pid=
trap - EXIT
if [ "${IMAGE_SMOKE_KEEP:-0}" != 1 ]; then
    "${BUILDAH[@]}" rmi --force "$TAG" >/dev/null 2>&1 || true
    "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true
fi
log "PASSED in $(($(date +%s) - START)) s"

#!/usr/bin/env bash
# The container images: the CPU image builds with podman (rootful, runc, base from debootstrap,
# no registry) from this build's binaries and, run with --network none, serves a generation from
# the embedded tiny model (`k3serve up` inside it) that matches the in-process engine on the
# host, as a non-root user. Both Dockerfiles pass dockerfilelint.
#   tests/deploy/image_test.sh BUILD_DIR
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
build="$(cd "${1:-$src/build}" && pwd)"
export CONTAINERS_CONF="$src/deploy/docker/containers.conf"
fail() { echo "FAIL: $*" >&2; exit 1; }

cache="$("$src/deploy/tools/npm_tools.sh")"
for f in Dockerfile.cpu Dockerfile.cuda; do
  "$cache/node_modules/.bin/dockerfilelint" "$src/deploy/docker/$f" > /tmp/dockerfilelint.$$ ||
    { cat /tmp/dockerfilelint.$$; rm -f /tmp/dockerfilelint.$$; fail "dockerfilelint $f"; }
done
rm -f /tmp/dockerfilelint.$$
echo "ok: dockerfilelint passes Dockerfile.cpu and Dockerfile.cuda"

"$src/deploy/docker/base_image.sh" > /dev/null
work="$(mktemp -d)"
image="localhost/k3serve-test:$$"
name="k3serve-image-test-$$"
cleanup() {
  podman rm -f -t 0 "$name" > /dev/null 2>&1 || true
  podman rmi -f "$image" > /dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
"$src/deploy/docker/stage.sh" "$build" "$work" > /dev/null
start=$(date +%s)
# --layers=false: no intermediate images stay behind once the test removes its image.
podman build -q --layers=false -f "$work/Dockerfile.cpu" -t "$image" "$work" > "$work/build.log" 2>&1 ||
  { cat "$work/build.log"; fail "podman build"; }
echo "ok: podman build in $(( $(date +%s) - start )) s, $(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}')"

podman run -d --name "$name" --network none "$image" > /dev/null
serving() { podman logs "$name" > "$work/up.log" 2>&1; grep -q '^gateway ' "$work/up.log"; }  # no pipe: grep -q would cut it
for _ in $(seq 120); do
  serving && break
  [ "$(podman inspect --format '{{.State.Running}}' "$name")" = true ] || { podman logs "$name"; fail "the container exited"; }
  sleep 0.5
done
serving || { cat "$work/up.log"; fail "k3serve up did not start serving"; }
[ "$(podman exec "$name" id -u)" = 10001 ] || fail "the container does not run as user 10001"
[ "$(podman inspect --format '{{.HostConfig.NetworkMode}}' "$name")" = none ] || fail "the container has a network"

out="$(podman exec "$name" k3serve generate --addr 127.0.0.1:50051 --prompt-ids 1,2,3 --max-tokens 8 --timeout 60)" ||
  { echo "$out"; podman logs "$name"; fail "k3serve generate inside the container"; }
want="$(OPENBLAS_NUM_THREADS=1 "$build/bin/k3serve" local-generate --model "$src/tests/data/tiny-kimi-linear" \
          --prompt-ids 1,2,3 --max-tokens 8 | grep '^tokens:')"
got="$(echo "$out" | grep '^tokens:')"
[ -n "$want" ] && [ "$got" = "$want" ] || fail "the image generated '$got', the in-process engine '$want'"
grep -q '^finish: length' <<< "$out" || fail "no finish line: $out"
echo "ok: the image serves the tiny model with --network none: $got"

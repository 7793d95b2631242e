#!/usr/bin/env bash
# Sets up, builds and runs the main job: a local cluster (router, 2 expert nodes, 1 attention node,
# as separate processes talking gRPC and UCX) serving the embedded tiny model, answering a
# generation request, then shutting down cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
./scripts/build.sh
export OPENBLAS_NUM_THREADS=1
MODEL=${MODEL:-tests/data/tiny-kimi-linear}
PORT=${PORT:-50051}

log=$(mktemp)
./build/bin/k3serve up --model "$MODEL" --attention 1 --experts 2 --port "$PORT" > "$log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  grep -q '^gateway ' "$log" && break
  kill -0 $up 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
cat "$log"
./build/bin/k3serve generate --addr "127.0.0.1:$PORT" --prompt-ids 1,5,77,300,12,9,450 --max-tokens 32 --ignore-eos

#!/usr/bin/env bash
# Sets up, builds and runs the main job: the embedded tiny model answering a generation request.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
./scripts/build.sh
export OPENBLAS_NUM_THREADS=1
MODEL=${MODEL:-tests/data/tiny-kimi-linear}
./build/bin/k3serve local-generate --model "$MODEL" --prompt-ids 1,5,77,300,12,9,450 --max-tokens 32 --ignore-eos

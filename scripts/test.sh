#!/usr/bin/env bash
# Sets up, builds and runs every test (CI runs exactly this, on a machine without a GPU).
# GPU tests (label "gpu") run on the device machine instead: see kernels/cuda/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
./scripts/build.sh
export OPENBLAS_NUM_THREADS=1
(cd build && ctest -j"${JOBS:-2}" --output-on-failure --timeout 600 -LE gpu)
if [ -x scripts/fuzz.sh ]; then
  FUZZ_SECONDS=${FUZZ_SECONDS:-60} ./scripts/fuzz.sh
fi
echo "test.sh: all tests passed"

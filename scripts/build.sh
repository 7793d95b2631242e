#!/usr/bin/env bash
# Configures and builds k3serve with CMake + Ninja + ccache into ${BUILD_DIR:-build}.
# CUDA kernels are compiled whenever nvcc is present (no GPU is needed to compile them).
# Extra CMake arguments pass through: scripts/build.sh -DK3SERVE_SERVICES=OFF
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-2}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}

args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DK3SERVE_WERROR=ON)
if [ -x "$NVCC" ]; then
  args+=(-DK3SERVE_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC")
fi
mkdir -p "$BUILD_DIR"
cmake -S . -B "$BUILD_DIR" "${args[@]}" "$@" > "$BUILD_DIR/configure.log" 2>&1 || { cat "$BUILD_DIR/configure.log"; exit 1; }
ninja -C "$BUILD_DIR" -j"$JOBS"

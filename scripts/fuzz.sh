#!/usr/bin/env bash
# Fuzzes the data-plane decoder (router/wire.cc) with libFuzzer, ASan and UBSan.
#   scripts/fuzz.sh [libFuzzer flags...]
# FUZZ_SECONDS (default 60) bounds the run; FUZZ_JOBS the build's parallelism (default: all cores).
# The build lives in build-fuzz/ (clang, K3SERVE_FUZZ=ON), the corpus in build-fuzz/wire_corpus/,
# seeded with valid messages from k3serve-wire-seeds; crashing inputs land in build-fuzz/.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-fuzz"

CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DK3SERVE_FUZZ=ON -DK3SERVE_TESTS=OFF
ninja -C "$build" -j"${FUZZ_JOBS:-$(nproc)}" k3serve-wire-fuzz k3serve-wire-seeds

corpus="$build/wire_corpus"
mkdir -p "$corpus"
"$build/bin/k3serve-wire-seeds" "$corpus"

# Inputs up to 64 KiB; no single allocation above 64 MiB (the decoder may allocate at most what
# the input size justifies).
cd "$build"
exec "$build/bin/k3serve-wire-fuzz" -max_total_time="${FUZZ_SECONDS:-60}" -max_len=65536 \
  -malloc_limit_mb=64 -rss_limit_mb=2048 -print_final_stats=1 "$@" "$corpus"

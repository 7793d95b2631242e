#!/usr/bin/env bash
# The CPU engine's own formulas evaluated in fp64: how far each golden and the fp32 engine are from exact.
#
#   tools/fp64_check.sh [--build DIR] GOLDEN_DIR...
#
# Copies the engine's sources (engine/, kernels/cpu/, tools/conformance.cc, tools/golden.*) into a temporary
# folder and turns every `float` there into `double` (the libm float functions and float literals with it;
# common/ is used as it is, so files are still read as fp32; K3_PLAIN_KERNELS leaves out the fp32 vector
# kernels), builds k3serve-conformance from that copy with g++, and dumps every golden prompt's prefill logits from it and from the fp32 build (DIR/bin, default
# build/). tools/fp64_compare.py prints golden, fp32 and fp64 against each other, judged by golden.json's
# tolerance. Exit 1 if the fp32 engine is outside that tolerance of the fp64 logits on a prompt where the golden
# is within it (precision lost in the engine), 2 on a usage or build error.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$SRC/build
if [ "${1:-}" = --build ]; then
  BUILD=$(cd "$2" && pwd)
  shift 2
fi
if [ $# -lt 1 ]; then
  echo "usage: $0 [--build DIR] GOLDEN_DIR..." >&2
  exit 2
fi
CONF32=$BUILD/bin/k3serve-conformance
[ -x "$CONF32" ] || { echo "fp64_check: $CONF32 not built" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/k3_fp64.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/engine" "$WORK/kernels/cpu" "$WORK/tools"
cp "$SRC"/engine/*.h "$SRC"/engine/*.cc "$WORK/engine/"
cp "$SRC"/kernels/cpu/*.h "$SRC"/kernels/cpu/*.cc "$WORK/kernels/cpu/"
cp "$SRC"/tools/conformance.cc "$SRC"/tools/golden.cc "$SRC"/tools/golden.h "$WORK/tools/"
rm -f "$WORK"/engine/*_test.cc "$WORK"/kernels/cpu/*_test.cc
perl -pi -e 's/\bfloat\b/double/g;
             s/\b(exp|sqrt|tanh|log|fabs|fmax|fmin|log1p|expm1|pow|erf|ceil|floor|round)f\(/$1(/g;
             s/\b(\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)f\b/$1/g' \
  "$WORK"/engine/* "$WORK"/kernels/cpu/* "$WORK"/tools/*
sed -i 's/cblas_sgemm/cblas_dgemm/g' "$WORK/kernels/cpu/gemm.cc"

SOURCES=("$WORK"/tools/conformance.cc "$WORK"/tools/golden.cc "$SRC"/common/safetensors.cc)
for f in "$WORK"/engine/*.cc "$WORK"/kernels/cpu/*.cc; do SOURCES+=("$f"); done
# shellcheck disable=SC2046
g++ -std=c++20 -O2 -DK3_PLAIN_KERNELS -I"$WORK" -I"$SRC" $(pkg-config --cflags openblas) "${SOURCES[@]}" -o "$WORK/conformance64" \
  $(pkg-config --libs absl_flags absl_flags_parse absl_flags_usage absl_status absl_statusor absl_strings \
    absl_str_format openblas) -lpthread || { echo "fp64_check: the fp64 build failed" >&2; exit 2; }

for g in "$@"; do
  d="$WORK/dumps/$(basename "$g")"
  mkdir -p "$d/32" "$d/64"
  # Their own verdicts do not matter here (exit 1 on a tolerance miss): the dumps do.
  "$CONF32" --model "$g" --golden "$g" --dump "$d/32" > /dev/null || true
  "$WORK/conformance64" --model "$g" --golden "$g" --dump "$d/64" > /dev/null || true
done
python3 "$SRC/tools/fp64_compare.py" "$WORK/dumps" "$@"

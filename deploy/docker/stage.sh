#!/usr/bin/env bash
# Stages what the CPU image copies in: the binaries of BUILD_DIR (default build), the shared
# libraries they load that a minimal Debian 12 lacks (everything but glibc's), UCX's transport
# modules, and the embedded tiny model, under OUT/rootfs/opt/k3serve; then the Dockerfile.
#
#   deploy/docker/stage.sh [BUILD_DIR] OUT
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
if [ $# -eq 2 ]; then build="$1"; out="$2"; else build="$src/build"; out="$1"; fi
root="$out/rootfs/opt/k3serve"
rm -rf "$out/rootfs"
mkdir -p "$root/bin" "$root/lib/ucx" "$root/models"

bins=()
for b in k3serve k3serve-router k3serve-expert k3serve-attention k3serve-gateway k3serve-orchestrator \
         k3serve-mkmodel k3serve-conformance; do
  [ -x "$build/bin/$b" ] && bins+=("$build/bin/$b")
done
for b in k3serve k3serve-router k3serve-expert k3serve-attention; do
  [ -x "$build/bin/$b" ] || { echo "stage: $build/bin/$b is missing (build it first)" >&2; exit 1; }
done
cp "${bins[@]}" "$root/bin/"
strip --strip-debug "$root"/bin/*  # RelWithDebInfo's debug sections are most of their size

# UCX loads its transports from <libucs's folder>/ucx at run time (ldd cannot see them).
ucx_modules=(/usr/lib/x86_64-linux-gnu/ucx/*.so*)
cp -P "${ucx_modules[@]}" "$root/lib/ucx/"

# Every library these load, except glibc's own (the base image has the same Debian 12 glibc).
libs() { ldd "$@" 2>/dev/null | awk '/=> \// {print $3}' | sort -u; }
glibc='/(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64)\.so'
for lib in $(libs "${bins[@]}" "${ucx_modules[@]}"); do
  [[ "$lib" =~ $glibc ]] && continue
  cp -L "$lib" "$root/lib/"
done
missing=$(LD_LIBRARY_PATH="$root/lib" ldd "$root"/bin/* | grep -c "not found" || true)
[ "$missing" -eq 0 ] || { echo "stage: unresolved libraries" >&2; exit 1; }

cp -r "$src/tests/data/tiny-kimi-linear" "$root/models/"
rm -f "$root/models/tiny-kimi-linear/golden"*  # only what serving reads
cp "$src/deploy/docker/Dockerfile.cpu" "$out/"
echo "stage: $(du -sh "$out/rootfs" | cut -f1) in $out/rootfs"

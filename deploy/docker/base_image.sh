#!/usr/bin/env bash
# Makes the images' base, localhost/k3serve-base:bookworm, without a registry: a minimal Debian 12
# root filesystem from `debootstrap --variant=minbase bookworm` (from the machine's Debian
# mirror), imported into podman. The tarball is cached, so debootstrap runs once per machine.
#
#   K3SERVE_IMAGE_CACHE  where the tarball is kept (default ~/.cache/k3serve-image)
#   DEBIAN_MIRROR        default: the first deb.debian.org-style URI of /etc/apt/sources.list*
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"
cache="${K3SERVE_IMAGE_CACHE:-$HOME/.cache/k3serve-image}"
image=localhost/k3serve-base:bookworm
tarball="$cache/bookworm-minbase.tar"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9

if [ ! -s "$tarball" ]; then
  mirror="${DEBIAN_MIRROR:-}"
  if [ -z "$mirror" ]; then
    mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null |
              grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true)"
  fi
  mirror="${mirror:-http://deb.debian.org/debian}"
  root="$(mktemp -d "$cache/rootfs.XXXXXX")"
  trap 'rm -rf "$root"' EXIT
  echo "base_image: debootstrap --variant=minbase bookworm from $mirror" >&2
  debootstrap --variant=minbase bookworm "$root" "$mirror" > "$cache/debootstrap.log" 2>&1 ||
    { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi
if ! podman image exists "$image"; then
  podman import -q --change 'CMD ["/bin/bash"]' "$tarball" "$image" > /dev/null
fi
echo "$image"

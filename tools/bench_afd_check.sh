#!/usr/bin/env bash
# k3serve-bench-afd on this machine with no model to run: with fewer than two GPUs it must say that it needs
# two and exit 2 (CI, the one-GPU device machine); with two it measures the peer-to-peer bandwidth and exits 0.
set -u
out=$("$1" --configs= 2>&1)
rc=$?
echo "$out"
if [ $rc -eq 2 ]; then
  grep -q "needs two GPUs" <<<"$out"
elif [ $rc -eq 0 ]; then
  grep -q "peer-to-peer copy" <<<"$out"
else
  echo "unexpected exit status $rc"
  exit 1
fi

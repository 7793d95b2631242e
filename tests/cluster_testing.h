// Helpers of the integration tests that run a local cluster of real processes (their binaries in
// K3SERVE_BIN_DIR).
#pragma once

#include <string>

#include "tests/testing.h"
#include "tools/client.h"
#include "tools/local_cluster.h"

namespace k3::testing {

inline std::string TinyModel() { return SourceDir() + "/tests/data/tiny-kimi-linear"; }

// The tiny Kimi-Linear model on `attention` attention nodes and `experts` expert nodes.
inline ClusterOptions TinyCluster(int attention, int experts) {
  ClusterOptions o;
  o.bin_dir = K3SERVE_BIN_DIR;
  o.model = TinyModel();
  o.attention = attention;
  o.experts = experts;
  return o;
}

// n greedy tokens, past any end-of-sequence token.
inline SamplingParams Greedy(int n) {
  SamplingParams p;
  p.max_new_tokens = n;
  p.ignore_eos = true;
  return p;
}

}  // namespace k3::testing

// `k3serve bench`: decode throughput and inter-token latency of N concurrent streams, served
// disaggregated (a local cluster over UCX) and by the in-process engine, on the same model.
#pragma once

#include <string>

#include "common/status.h"

namespace k3 {

struct BenchOptions {
  std::string bin_dir;
  std::string model;
  int streams = 16;
  int prompt_len = 64;
  int max_tokens = 64;
  int attention = 1;
  int experts = 2;
  std::string data_plane = "shm";  // the expert nodes' --data-plane
  int repeats = 1;                 // in-process and disaggregated runs, alternating, in one cluster
  // Let the router rebalance (EPLB, redundant slots) on measured imbalance: after the first pass it
  // waits for the rebalance, runs a second pass, and prints per-layer and per-node load of both.
  bool skew = false;
  // Every expert node holds every expert (the router's --redundancy = experts - 1), so that a decode
  // dispatch goes whole to one node (the attention nodes' --dispatch-one-node-rows). Not with skew.
  bool replicate_experts = true;
  bool ping_pong_adaptive = false;  // the attention nodes' --ping-pong-adaptive
};

absl::Status RunClusterBench(const BenchOptions& options);

}  // namespace k3

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
};

absl::Status RunClusterBench(const BenchOptions& options);

}  // namespace k3

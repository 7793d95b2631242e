// An expert node's routed experts on the GPU: the bf16 weights of its slots on the device (each
// expert anywhere in memory, addressed through per-layer pointer tables) and the grouped GLU
// kernels of kernels/cuda/moe.cuh. Rows arrive and leave on the host, as the data plane delivers them.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "common/safetensors.h"
#include "engine/config.h"
#include "engine/expert_executor.h"

namespace k3 {

class GpuExperts {
 public:
  // Uploads the slots' w1, w3, w2: fp32 or bf16 in the checkpoint as bf16; MXFP4 (the release's) as
  // MXFP4, run by the kernels of kernels/cuda/mxfp4.cuh (4.25 bits a weight on the device).
  static absl::StatusOr<std::unique_ptr<GpuExperts>> Load(const ModelConfig& config, const Checkpoint& checkpoint,
                                                          const std::set<std::pair<int32_t, int32_t>>& slots,
                                                          int device = 0);
  ~GpuExperts();
  GpuExperts(const GpuExperts&) = delete;
  GpuExperts& operator=(const GpuExperts&) = delete;

  // out[n] = Σ_j w[n, j] · E_idx[n, j](x[n]) for the slots held here (idx −1: skipped); host fp32 in
  // and out, bf16 on the device. Not thread-safe (the node's one worker calls it).
  absl::Status Run(const ExpertRequest& request, float* out);

  struct Impl;

 private:
  explicit GpuExperts(std::unique_ptr<Impl> impl);
  static absl::StatusOr<std::unique_ptr<GpuExperts>> LoadMxfp4(std::unique_ptr<Impl> m, const Checkpoint& checkpoint,
                                                               const std::set<std::pair<int32_t, int32_t>>& slots);
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3

// The GPU model behind the engine's Backend interface, and the bridge that lets it reach routed
// experts behind a host ExpertExecutor (the router's dispatcher to expert nodes).
#pragma once

#include <vector>

#include "engine/backend.h"
#include "engine/cuda/cuda_model.h"
#include "engine/expert_executor.h"

namespace k3::cuda {

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(CudaModel& model) : model_(model) {}

  const ModelConfig& config() const override { return model_.config(); }
  absl::StatusOr<int32_t> NewSequence() override { return model_.AllocSlot(); }
  void FreeSequence(int32_t seq) override { model_.FreeSlot(seq).IgnoreError(); }
  // The slot's fp32 KDA + conv state and the bf16 MLA latent cache of the tokens it holds.
  int64_t SequenceBytes(int32_t seq) const override;
  absl::Status Forward(std::span<const BatchChunk> chunks, std::vector<float>* logits) override;

 private:
  CudaModel& model_;
};

// Routed experts reached through a host ExpertExecutor: the rows, ids and weights come to the host,
// go through the executor (UCX to expert nodes in the attention service), and the partial sums go
// back to the device. Synchronous on the stream.
class HostExpertBridge : public CudaExpertExecutor {
 public:
  explicit HostExpertBridge(ExpertExecutor& host) : host_(host) {}
  absl::Status Run(const CudaExpertRequest& request, float* out, cudaStream_t stream) override;

 private:
  ExpertExecutor& host_;
  std::vector<uint16_t> hi_, lo_;
  std::vector<float> x_, w_, sums_;
  std::vector<int32_t> idx_;
};

}  // namespace k3::cuda

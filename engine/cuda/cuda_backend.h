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
// The copies go through pinned staging buffers (grown on demand, never per call), one strided copy a plane.
class HostExpertBridge : public CudaExpertExecutor {
 public:
  explicit HostExpertBridge(ExpertExecutor& host) : host_(host) {}
  ~HostExpertBridge() override;
  HostExpertBridge(const HostExpertBridge&) = delete;
  HostExpertBridge& operator=(const HostExpertBridge&) = delete;
  absl::Status Run(const CudaExpertRequest& request, float* out, cudaStream_t stream) override;

 private:
  absl::Status Reserve(int64_t rows, int64_t width, int64_t top_k);

  ExpertExecutor& host_;
  int64_t rows_ = 0, width_ = 0, top_k_ = 0;  // staging capacity
  // Pinned: hi and lo planes [rows, width]; idx and w [rows, top_k]; sums [rows, width].
  uint16_t *hi_ = nullptr, *lo_ = nullptr;
  int32_t* idx_ = nullptr;
  float *w_ = nullptr, *sums_ = nullptr;
  std::vector<float> x_;
};

}  // namespace k3::cuda

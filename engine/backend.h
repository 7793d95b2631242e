// What the scheduler needs from a model implementation: per-sequence state and one forward over a
// ragged batch. The CPU model (CpuBackend, here) and the GPU model (engine/cuda) implement it, so
// the Engine and the services above it do not know where the model runs.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "engine/model.h"

namespace k3 {

// One sequence's tokens in a batch; its state is the sequence's (Backend::NewSequence).
struct BatchChunk {
  int32_t seq = -1;
  std::span<const int32_t> tokens;
  LogitsMode logits = LogitsMode::kLast;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const ModelConfig& config() const = 0;
  // State for a new sequence (position 0). RESOURCE_EXHAUSTED when the backend holds no more.
  virtual absl::StatusOr<int32_t> NewSequence() = 0;
  virtual void FreeSequence(int32_t seq) = 0;
  // Bytes of state the sequence holds now (accounting and metrics).
  virtual int64_t SequenceBytes(int32_t seq) const = 0;
  // Runs the batch; logits holds, chunk by chunk, 0, 1 or n rows of vocab_size (host fp32).
  virtual absl::Status Forward(std::span<const BatchChunk> chunks, std::vector<float>* logits) = 0;
};

// The CPU model, its routed experts behind an ExpertExecutor (in process or remote). With ping_pong
// a batch of two or more chunks runs as two micro-batches whose expert dispatches overlap.
class CpuBackend : public Backend {
 public:
  CpuBackend(const Model& model, ExpertExecutor& experts, bool ping_pong = false);

  const ModelConfig& config() const override { return model_.config(); }
  absl::StatusOr<int32_t> NewSequence() override;
  void FreeSequence(int32_t seq) override;
  int64_t SequenceBytes(int32_t seq) const override;
  absl::Status Forward(std::span<const BatchChunk> chunks, std::vector<float>* logits) override;

 private:
  const Model& model_;
  ExpertExecutor& experts_;
  const bool ping_pong_;
  int32_t next_ = 0;
  std::map<int32_t, std::unique_ptr<SequenceState>> states_;
};

}  // namespace k3

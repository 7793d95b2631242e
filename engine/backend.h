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
// a batch of two or more chunks runs as two micro-batches whose expert dispatches overlap. Each
// micro-batch reads all the non-expert weights, so where those outweigh the overlap (a large model,
// few tokens) splitting is slower; with adaptive, a step is split only while splitting measures
// faster than not at the step's token count.
class CpuBackend : public Backend {
 public:
  CpuBackend(const Model& model, ExpertExecutor& experts, bool ping_pong = false, bool adaptive = false);

  const ModelConfig& config() const override { return model_.config(); }
  absl::StatusOr<int32_t> NewSequence() override;
  void FreeSequence(int32_t seq) override;
  int64_t SequenceBytes(int32_t seq) const override;
  absl::Status Forward(std::span<const BatchChunk> chunks, std::vector<float>* logits) override;

 private:
  const Model& model_;
  ExpertExecutor& experts_;
  // Step time of each way (0: whole, 1: split) at one token count: an EMA, and how many steps.
  struct SplitTiming {
    double ema_s[2] = {0, 0};
    int64_t steps[2] = {0, 0};
  };
  bool ChooseSplit(int64_t tokens);
  absl::Status ForwardSplit(std::span<const SeqChunk> sc, std::vector<float>* logits);

  const bool ping_pong_;
  const bool adaptive_;
  std::map<int64_t, SplitTiming> timing_;
  int32_t next_ = 0;
  std::map<int32_t, std::unique_ptr<SequenceState>> states_;
};

}  // namespace k3

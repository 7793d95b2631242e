// The model's forward pass over a ragged batch of sequence chunks (CPU, fp32).
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/expert_executor.h"
#include "engine/state.h"
#include "engine/weights.h"
#include "kernels/cpu/attnres.h"

namespace k3 {

enum class LogitsMode { kNone, kLast, kAll };

// One sequence's tokens in a batch: a prefill chunk (n > 1), a decode token (n = 1), or anything
// between. The state advances by n tokens.
struct SeqChunk {
  SequenceState* state = nullptr;
  std::span<const int32_t> tokens;
  LogitsMode logits = LogitsMode::kLast;
};

class Model {
 public:
  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& dir,
                                                     const WeightFilter& filter = WeightFilter::All());
  Model(ModelConfig config, std::unique_ptr<ModelWeights> weights);

  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return *weights_; }

  // Runs the whole batch; logits holds, chunk by chunk, 0, 1 or n rows of vocab_size.
  absl::Status Forward(std::span<const SeqChunk> chunks, ExpertExecutor& experts, std::vector<float>* logits) const;

 private:
  ModelConfig config_;
  std::unique_ptr<ModelWeights> weights_;
};

// One micro-batch's pass through the model, advanced up to each MoE dispatch so that two passes
// can overlap: while one pass's rows are at the experts, the other computes (ping-pong).
class ForwardPass {
 public:
  ForwardPass(const Model& model, std::span<const SeqChunk> chunks);

  // Runs layers until the next MoE dispatch, returning the request, or to the end (nullptr).
  // After a request, write its result into expert_output() before calling again.
  absl::StatusOr<const ExpertRequest*> RunToDispatch();
  float* expert_output() { return moe_out_.data(); }
  bool done() const { return done_; }
  // Chunk by chunk, 0, 1 or n rows of vocab_size.
  std::vector<float>& logits() { return logits_; }

 private:
  void Mixer(int64_t l, const float* a, float* y);
  void Kda(int64_t l, const float* a, float* y);
  void Mla(int64_t l, const float* a, float* y);
  // The input of a sub-layer's norm: the residual stream, or Block AttnRes read number `read`
  // (2ℓ before layer ℓ's mixer, 2ℓ + 1 before its MLP, 2L before the final norm).
  const float* ResidualRead(int64_t read);
  // Block AttnRes phase 1 for reads first..last, the reads that see the current bank.
  void BuildBlockReads(int64_t first, int64_t last);
  void BeginLayer(int64_t l);
  void MoeFront(int64_t l);
  void MoeBack(int64_t l);
  void Finish();

  const ModelConfig& c_;
  const ModelWeights& w_;
  std::vector<SeqChunk> chunks_;
  std::vector<int64_t> offset_;  // token offset of each chunk; offset_.back() == N
  int64_t N_ = 0;

  std::vector<float> x_;                  // residual stream, or the live partial sum with AttnRes
  std::vector<std::vector<float>> bank_;  // Block AttnRes: completed blocks (bank[0] = embedding)
  cpu::BlockReads block_reads_;           // the bank's part of the current block's reads
  int64_t first_read_ = 0;                // the read number of block_reads_'s read 0
  std::vector<float> read_, a_, y_, m_;   // scratch [N, d]
  std::vector<float> router_logits_, z_, moe_out_;
  std::vector<int32_t> idx_;
  std::vector<float> wt_;
  ExpertRequest request_;

  int64_t layer_ = 0;
  bool awaiting_experts_ = false;
  bool done_ = false;
  std::vector<float> logits_;
};

// Drives passes to completion through one executor, interleaving their dispatches.
absl::Status RunPasses(std::span<ForwardPass* const> passes, ExpertExecutor& experts);

}  // namespace k3

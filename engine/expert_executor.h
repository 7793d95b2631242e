// The cut of every MoE layer (DESIGN §8): the engine computes the front (router, top-k, latent
// down-projection) and the back (sum of partials, latent norm, up-projection, shared experts);
// the routed experts in between run behind this interface — in process, or on expert nodes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include "common/status.h"
#include "engine/weights.h"

namespace k3 {

// Rows for one MoE layer: out[n] = Σ_j w[n, j] · E_{idx[n, j]}(x[n]).
// The pointers stay valid until Wait returns for this request.
struct ExpertRequest {
  int64_t layer = 0;
  int64_t rows = 0;
  int64_t width = 0;  // ℓ (latent) or d
  int64_t top_k = 0;
  const float* x = nullptr;      // [rows, width]
  const int32_t* idx = nullptr;  // [rows, top_k]
  const float* w = nullptr;      // [rows, top_k]
  // The gate's logits [rows, E] and correction bias [E] (null: none) for load statistics; valid
  // during Submit only. Null where the caller does not provide them.
  const float* logits = nullptr;
  const float* bias = nullptr;
  bool decode = false;  // every row is one sequence's single new token (not prefill): for the stage metrics
};

class ExpertExecutor {
 public:
  virtual ~ExpertExecutor() = default;
  // Starts a request; the result is collected with Wait. Several may be in flight (ping-pong).
  virtual absl::StatusOr<uint64_t> Submit(const ExpertRequest& request) = 0;
  // Blocks until the request is done and writes out [rows, width].
  virtual absl::Status Wait(uint64_t ticket, float* out) = 0;
};

// Runs the experts in this process from loaded weights (monolithic engine, tests, expert nodes).
class LocalExpertExecutor : public ExpertExecutor {
 public:
  LocalExpertExecutor(const ModelConfig& config, const ModelWeights& weights);
  absl::StatusOr<uint64_t> Submit(const ExpertRequest& request) override;
  absl::Status Wait(uint64_t ticket, float* out) override;

  // Synchronous form used by both of the above and by the expert service.
  absl::Status Run(const ExpertRequest& request, float* out) const;

 private:
  const ModelConfig& config_;
  const ModelWeights& weights_;
  uint64_t next_ticket_ = 1;
  std::map<uint64_t, ExpertRequest> pending_;  // computed at Wait
};

}  // namespace k3

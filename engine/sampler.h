// Token sampling: greedy, temperature, top-k, top-p, seeded.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "absl/time/time.h"

#include "common/status.h"

namespace k3 {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // 0: no top-k cut
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;         // used when has_seed
  bool has_seed = false;
  int32_t max_new_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // The request ends with DEADLINE_EXCEEDED once this passes, while waiting, prefilling or decoding.
  absl::Time deadline = absl::InfiniteFuture();
};

// Checks ranges; errors name the field.
absl::Status ValidateSampling(const SamplingParams& p, int64_t vocab_size);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  int32_t Sample(const float* logits, int64_t vocab);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

// Reference: probabilities after temperature, top-k and top-p (sorted by id), for tests.
std::vector<double> SamplingDistributionRef(const float* logits, int64_t vocab, const SamplingParams& p);

}  // namespace k3

// Golden data written by the reference implementation (DESIGN §6): prompts, logits, greedy ids.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace k3 {

struct GoldenPrompt {
  std::vector<int32_t> input_ids;
  int64_t split = 0;                       // incremental: prefill split tokens, then one at a time
  std::vector<float> prefill_logits;       // [T, V]
  std::vector<float> incremental_logits;   // [T, V] or empty
  std::vector<int32_t> greedy_ids;
};

struct Golden {
  std::vector<GoldenPrompt> prompts;
  int64_t vocab = 0;
  double atol = 0, rtol = 0;
};

absl::StatusOr<Golden> LoadGolden(const std::string& dir);

}  // namespace k3

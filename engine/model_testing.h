// Helpers of the engine's model tests: loading a checkpoint, random ids, logits step by step.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/expert_executor.h"
#include "engine/model.h"

namespace k3::testing {

inline std::unique_ptr<Model> Load(const std::string& dir) {
  auto m = Model::Load(dir);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

inline std::vector<int32_t> Ids(int64_t n, uint64_t seed, int64_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng() % vocab);
  return v;
}

// The logits of every position: a prefill of the first `prefill` ids, then one id per step.
inline std::vector<float> Logits(const Model& m, std::span<const int32_t> ids, int64_t prefill) {
  LocalExpertExecutor experts(m.config(), m.weights());
  SequenceState st(m.config());
  std::vector<float> all, out;
  for (int64_t t = 0; t < static_cast<int64_t>(ids.size());) {
    const int64_t n = t == 0 ? prefill : 1;
    SeqChunk ch{&st, ids.subspan(t, n), LogitsMode::kAll};
    EXPECT_TRUE(m.Forward({&ch, 1}, experts, &out).ok());
    all.insert(all.end(), out.begin(), out.end());
    t += n;
  }
  return all;
}

}  // namespace k3::testing

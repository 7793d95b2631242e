#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace k3 {

absl::Status ValidateSampling(const SamplingParams& p, int64_t vocab_size) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    return absl::InvalidArgumentError(absl::StrCat("temperature must be a finite number >= 0, got ", p.temperature));
  if (p.top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", p.top_p));
  if (p.max_new_tokens <= 0)
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be > 0, got ", p.max_new_tokens));
  for (int32_t id : p.stop_token_ids)
    if (id < 0 || id >= vocab_size)
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids: ", id, " is outside [0, ", vocab_size, ")"));
  return absl::OkStatus();
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.has_seed ? p.seed : std::random_device{}()) {}

int32_t Sampler::Sample(const float* logits, int64_t vocab) {
  if (p_.temperature == 0.0f) return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  // Candidates sorted by logit (descending, lower id first on ties), cut by top-k.
  scratch_.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) scratch_[i] = {logits[i], static_cast<int32_t>(i)};
  auto before = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  int64_t n = vocab;
  if (p_.top_k > 0 && p_.top_k < vocab) {
    n = p_.top_k;
    std::partial_sort(scratch_.begin(), scratch_.begin() + n, scratch_.end(), before);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), before);
  }
  const float inv_t = 1.0f / p_.temperature, mx = scratch_[0].first;
  double sum = 0;
  std::vector<double> prob(n);
  for (int64_t i = 0; i < n; ++i) sum += (prob[i] = std::exp((scratch_[i].first - mx) * inv_t));
  // Nucleus: the smallest prefix whose mass reaches top_p.
  if (p_.top_p < 1.0f) {
    double acc = 0;
    int64_t keep = n;
    for (int64_t i = 0; i < n; ++i) {
      acc += prob[i] / sum;
      if (acc >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
    sum = std::accumulate(prob.begin(), prob.begin() + n, 0.0);
  }
  double r = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  for (int64_t i = 0; i < n; ++i) {
    r -= prob[i];
    if (r < 0) return scratch_[i].second;
  }
  return scratch_[n - 1].second;
}

std::vector<double> SamplingDistributionRef(const float* logits, int64_t vocab, const SamplingParams& p) {
  std::vector<double> out(vocab, 0.0);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  if (p.temperature == 0.0f) {
    out[order[0]] = 1.0;
    return out;
  }
  int64_t n = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  std::vector<double> e(n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (e[i] = std::exp((static_cast<double>(logits[order[i]]) - logits[order[0]]) / p.temperature));
  if (p.top_p < 1.0f) {
    double acc = 0;
    for (int64_t i = 0; i < n; ++i) {
      acc += e[i] / sum;
      if (acc >= p.top_p) {
        n = i + 1;
        break;
      }
    }
    sum = std::accumulate(e.begin(), e.begin() + n, 0.0);
  }
  for (int64_t i = 0; i < n; ++i) out[order[i]] = e[i] / sum;
  return out;
}

}  // namespace k3

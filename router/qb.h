// Quantile Balancing (DESIGN §1.5): the bias that gives every expert k/E of the tokens, estimated
// from per-expert histograms of r = α − s' (the bias step expert j needs to enter token i's top-k;
// α = token i's (k+1)-th largest biased score s').
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace k3::router {

struct QbHistogram {
  int64_t bins = 0;
  int64_t experts = 0;
  float rmin = 0.0f, rmax = 0.0f;
  std::vector<int64_t> counts;  // [bins, experts], bin-major (the layout of the router kernels)

  float bin_width() const { return (rmax - rmin) / static_cast<float>(bins); }
  int64_t tokens() const;  // every token adds one count per expert
};

// The histogram range for the current bias b: [−(1 + spread), 1 + spread], spread = max(b) − min(b).
// r = α − s' lies in it (s ∈ [0, 1]); its width is that of the training ports' [min(b) − 1, max(b) + 1]
// over the unbiased r = α − s.
void QbRange(std::span<const float> bias, float* rmin, float* rmax);

// The bias step Δ_j = quantile(r_j, k/E), inverting each expert's histogram CDF with linear
// interpolation inside the bin, then Δ ← Δ − mean(Δ). The new bias is b + Δ. An empty histogram
// gives Δ = 0. Errors name the field.
absl::StatusOr<std::vector<float>> QbEstimate(const QbHistogram& h, int64_t top_k);

// The exact solution by sorting (selection): r [N, E] (token-major) → the k/E quantile of each
// column (the midpoint of the two order statistics that straddle N·k/E), mean-centred.
std::vector<float> QbExact(int64_t N, int64_t E, std::span<const float> r, int64_t top_k);
// One expert's exact quantile, for callers that produce r a column at a time (reorders `column`).
float QbExactQuantile(std::vector<float>& column, double q);

}  // namespace k3::router

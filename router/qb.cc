#include "router/qb.h"

#include <algorithm>

namespace k3::router {
namespace {

void MeanCentre(std::vector<float>& b) {
  if (b.empty()) return;
  double sum = 0;
  for (float v : b) sum += v;
  const float mean = static_cast<float>(sum / static_cast<double>(b.size()));
  for (float& v : b) v -= mean;
}

}  // namespace

int64_t QbHistogram::tokens() const {
  int64_t n = 0;
  if (experts <= 0) return 0;
  for (int64_t b = 0; b < bins; ++b) n += counts[b * experts];  // expert 0's column
  return n;
}

void QbRange(std::span<const float> bias, float* rmin, float* rmax) {
  float spread = 0.0f;
  if (!bias.empty()) {
    const auto [lo, hi] = std::minmax_element(bias.begin(), bias.end());
    spread = *hi - *lo;
  }
  *rmin = -(1.0f + spread);
  *rmax = 1.0f + spread;
}

absl::StatusOr<std::vector<float>> QbEstimate(const QbHistogram& h, int64_t top_k) {
  if (h.bins <= 0) return absl::InvalidArgumentError(absl::StrCat("qb_bins = ", h.bins, " must be > 0"));
  if (h.experts <= 0) return absl::InvalidArgumentError(absl::StrCat("experts = ", h.experts, " must be > 0"));
  if (!(h.rmax > h.rmin)) return absl::InvalidArgumentError(absl::StrCat("qb range [", h.rmin, ", ", h.rmax, "] is empty"));
  if (top_k <= 0 || top_k >= h.experts)
    return absl::InvalidArgumentError(absl::StrCat("top_k = ", top_k, " must be in [1, ", h.experts, ")"));
  if (static_cast<int64_t>(h.counts.size()) != h.bins * h.experts)
    return absl::InvalidArgumentError(
        absl::StrCat("qb_histogram has ", h.counts.size(), " counts, expected qb_bins x experts = ", h.bins * h.experts));
  const int64_t E = h.experts;
  const double q = static_cast<double>(top_k) / static_cast<double>(E);
  const double width = (static_cast<double>(h.rmax) - h.rmin) / static_cast<double>(h.bins);
  std::vector<float> delta(E, 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    int64_t total = 0;
    for (int64_t b = 0; b < h.bins; ++b) total += h.counts[b * E + e];
    if (total == 0) continue;
    // The r below which a fraction q of the tokens lie: walk the CDF to the bin that crosses
    // q·total, then interpolate linearly inside it.
    const double target = q * static_cast<double>(total);
    double cum = 0;
    int64_t b = 0;
    for (; b < h.bins; ++b) {
      const double c = static_cast<double>(h.counts[b * E + e]);
      if (c > 0 && cum + c >= target) break;
      cum += c;
    }
    b = std::min(b, h.bins - 1);
    const double c = static_cast<double>(h.counts[b * E + e]);
    const double frac = c > 0 ? (target - cum) / c : 0.0;
    delta[e] = static_cast<float>(h.rmin + (static_cast<double>(b) + frac) * width);
  }
  MeanCentre(delta);
  return delta;
}

float QbExactQuantile(std::vector<float>& column, double q) {
  const int64_t n = static_cast<int64_t>(column.size());
  if (n == 0) return 0.0f;
  // The two order statistics around position q·n, by selection (a partial sort).
  const int64_t target = std::clamp<int64_t>(static_cast<int64_t>(q * static_cast<double>(n) + 0.5), 0, n);
  if (target == 0) return *std::min_element(column.begin(), column.end());
  if (target == n) return *std::max_element(column.begin(), column.end());
  std::nth_element(column.begin(), column.begin() + target, column.end());
  const float above = column[target];
  const float below = *std::max_element(column.begin(), column.begin() + target);
  return 0.5f * (below + above);
}

std::vector<float> QbExact(int64_t N, int64_t E, std::span<const float> r, int64_t top_k) {
  std::vector<float> delta(E, 0.0f), column(N);
  const double q = static_cast<double>(top_k) / static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < N; ++i) column[i] = r[i * E + e];
    delta[e] = QbExactQuantile(column, q);
  }
  MeanCentre(delta);
  return delta;
}

}  // namespace k3::router

#include "router/qb.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace k3::router {
namespace {

QbHistogram Histogram(int64_t N, int64_t E, const std::vector<float>& r, int64_t bins, float rmin, float rmax) {
  QbHistogram h{bins, E, rmin, rmax, std::vector<int64_t>(bins * E, 0)};
  const float scale = static_cast<float>(bins) / (rmax - rmin);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < E; ++e) {
      const float pos = (r[i * E + e] - rmin) * scale;
      const int64_t b = pos < 0 ? 0 : std::min<int64_t>(bins - 1, static_cast<int64_t>(pos));
      h.counts[b * E + e]++;
    }
  return h;
}

TEST(Qb, InterpolatesInsideTheBinAndCentres) {
  // q = k/E = 1/4: each expert's 4 counts sit in one bin, so the quantile is a quarter into it.
  QbHistogram h{4, 4, 0.0f, 4.0f, std::vector<int64_t>(16, 0)};
  for (int e = 0; e < 4; ++e) h.counts[e * 4 + e] = 4;  // expert e: bin e
  auto d = QbEstimate(h, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_NEAR((*d)[0], 0.25f - 1.75f, 1e-6);
  EXPECT_NEAR((*d)[1], 1.25f - 1.75f, 1e-6);
  EXPECT_NEAR((*d)[2], 2.25f - 1.75f, 1e-6);
  EXPECT_NEAR((*d)[3], 3.25f - 1.75f, 1e-6);
  EXPECT_EQ(h.tokens(), 4);
}

TEST(Qb, WithinOneBinOfTheExactQuantiles) {
  for (int64_t bins : {56, 256, 1000}) {
    const int64_t N = 20000, E = 64, k = 4;
    std::mt19937 rng(static_cast<uint32_t>(bins));
    std::vector<float> r(N * E);
    for (int64_t e = 0; e < E; ++e) {
      std::normal_distribution<float> d(0.02f * static_cast<float>(e % 9) - 0.1f, 0.05f + 0.01f * static_cast<float>(e % 5));
      for (int64_t i = 0; i < N; ++i) r[i * E + e] = std::clamp(d(rng), -0.99f, 0.99f);
    }
    const QbHistogram h = Histogram(N, E, r, bins, -1.0f, 1.0f);
    auto est = QbEstimate(h, k);
    ASSERT_TRUE(est.ok());
    const std::vector<float> exact = QbExact(N, E, r, k);
    double sum = 0, worst = 0;
    for (int64_t e = 0; e < E; ++e) {
      worst = std::max(worst, static_cast<double>(std::fabs((*est)[e] - exact[e])));
      sum += (*est)[e];
    }
    EXPECT_LT(worst, h.bin_width()) << bins << " bins";
    EXPECT_NEAR(sum / E, 0.0, 1e-6);
  }
}

TEST(Qb, EmptyHistogramGivesNoStep) {
  QbHistogram h{10, 8, -1.0f, 1.0f, std::vector<int64_t>(80, 0)};
  auto d = QbEstimate(h, 2);
  ASSERT_TRUE(d.ok());
  for (float v : *d) EXPECT_EQ(v, 0.0f);
}

TEST(Qb, BadHistogramsNameTheField) {
  QbHistogram h{10, 8, -1.0f, 1.0f, std::vector<int64_t>(79, 0)};
  auto d = QbEstimate(h, 2);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("qb_histogram"), std::string::npos) << d.status();
  h.counts.resize(80);
  EXPECT_NE(QbEstimate(h, 8).status().message().find("top_k"), std::string::npos);
  h.bins = 0;
  EXPECT_NE(QbEstimate(h, 2).status().message().find("qb_bins"), std::string::npos);
  h.bins = 10;
  h.rmax = h.rmin;
  EXPECT_NE(QbEstimate(h, 2).status().message().find("range"), std::string::npos);
}

TEST(Qb, RangeCoversTheBiasSpread) {
  std::vector<float> b = {-0.2f, 0.1f, 0.3f};
  float lo = 0, hi = 0;
  QbRange(b, &lo, &hi);
  EXPECT_FLOAT_EQ(lo, -1.5f);
  EXPECT_FLOAT_EQ(hi, 1.5f);
}

// Skewed sigmoid scores: re-solving on the same tokens balances the top-k load.
TEST(Qb, BalancesSkewedTopK) {
  const int64_t N = 8000, E = 32, k = 2, bins = 1000;
  std::mt19937 rng(7);
  std::extreme_value_distribution<float> gumbel;
  std::vector<float> s(N * E);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < E; ++e)
      s[i * E + e] = 1.0f / (1.0f + std::exp(-(0.3f * (-1.2f * std::log(e + 1.0f) + gumbel(rng)))));
  std::vector<float> bias(E, 0.0f);
  auto max_over_mean = [&](QbHistogram* h) {
    std::vector<int64_t> load(E, 0);
    std::vector<float> r(N * E), sb(E);
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t e = 0; e < E; ++e) sb[e] = s[i * E + e] + bias[e];
      std::vector<float> sorted = sb;
      std::nth_element(sorted.begin(), sorted.begin() + k, sorted.end(), std::greater<float>());
      for (int64_t e = 0; e < E; ++e) {
        load[e] += sb[e] > sorted[k];
        r[i * E + e] = sorted[k] - sb[e];
      }
    }
    float lo, hi;
    QbRange(bias, &lo, &hi);
    *h = Histogram(N, E, r, bins, lo, hi);
    return *std::max_element(load.begin(), load.end()) / (static_cast<double>(N * k) / E);
  };
  QbHistogram h;
  const double before = max_over_mean(&h);
  double after = before;
  for (int step = 0; step < 4; ++step) {
    auto d = QbEstimate(h, k);
    ASSERT_TRUE(d.ok());
    for (int64_t e = 0; e < E; ++e) bias[e] += (*d)[e];
    after = max_over_mean(&h);
  }
  EXPECT_GT(before, 2.0);
  EXPECT_LT(after, 1.1) << "before " << before;
}

}  // namespace
}  // namespace k3::router

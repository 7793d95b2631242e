#include "kernels/cpu/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;

TEST(RouteTopK, MatchesReference) {
  const RouterParams cases[] = {
      {16, 4, 1, 1, true, 2.446f},   // Kimi-Linear tiny
      {256, 8, 1, 1, true, 2.446f},  // Kimi-Linear 48B
      {64, 6, 8, 3, true, 1.0f},     // group-limited
      {64, 6, 8, 3, false, 2.5f},    // no renormalization
      {896, 16, 1, 1, true, 1.0f},   // K3
      {12, 12, 4, 4, true, 1.0f},    // k == E
      {10, 1, 5, 2, false, 1.0f},    // odd group size 2
  };
  for (const auto& p : cases) {
    const int64_t N = 37;
    auto logits = Random(N * p.num_experts, 1, 2.0f), bias = Random(p.num_experts, 2, 0.1f);
    std::vector<int32_t> idx(N * p.top_k), ridx(N * p.top_k);
    std::vector<float> w(N * p.top_k), rw(N * p.top_k);
    RouteTopK(N, logits.data(), bias.data(), p, idx.data(), w.data());
    RouteTopKRef(N, logits.data(), bias.data(), p, ridx.data(), rw.data());
    EXPECT_EQ(idx, ridx) << "E=" << p.num_experts << " k=" << p.top_k << " G=" << p.num_groups;
    for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], rw[i], 1e-6 * p.scale);
  }
}

TEST(RouteTopK, BiasSelectsButDoesNotWeigh) {
  // Four experts, logits equal: the bias alone decides; the weights stay the unbiased sigmoid.
  RouterParams p{4, 2, 1, 1, false, 1.0f};
  std::vector<float> logits = {0.0f, 0.0f, 0.0f, 0.0f}, bias = {0.0f, 0.5f, 0.0f, 0.3f};
  std::vector<int32_t> idx(2);
  std::vector<float> w(2);
  RouteTopK(1, logits.data(), bias.data(), p, idx.data(), w.data());
  EXPECT_EQ(idx, (std::vector<int32_t>{1, 3}));
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_FLOAT_EQ(w[1], 0.5f);
}

TEST(RouteTopK, GroupLimitKeepsBestGroups) {
  // Two groups of 3; group 1 has the best top-2 sum although group 0 has the single best expert.
  RouterParams p{6, 2, 2, 1, true, 1.0f};
  std::vector<float> logits = {5.0f, -5.0f, -5.0f, 2.0f, 2.0f, 2.0f};
  std::vector<int32_t> idx(2);
  std::vector<float> w(2);
  RouteTopK(1, logits.data(), nullptr, p, idx.data(), w.data());
  EXPECT_EQ(idx, (std::vector<int32_t>{3, 4}));
  EXPECT_NEAR(w[0] + w[1], 1.0f, 1e-6);
}

TEST(RouteTopK, EmptyBatch) {
  RouterParams p{8, 2, 1, 1, true, 1.0f};
  RouteTopK(0, nullptr, nullptr, p, nullptr, nullptr);
}

TEST(QbHistogram, BinsTheMarginToTheTopK) {
  // s = 0.5 everywhere; the bias makes s' = {0.8, 0.6, 0.5, 0.3}. k = 1: α = 0.6, r = {−0.2, 0, 0.1, 0.3}.
  RouterParams p{4, 1, 1, 1, false, 1.0f};
  std::vector<float> logits(4, 0.0f), bias = {0.3f, 0.1f, 0.0f, -0.2f};
  std::vector<int32_t> hist(4 * 4, 0);
  QbHistogram(1, logits.data(), bias.data(), p, {4, -0.5f, 0.5f}, hist.data());  // bins of 0.25
  const int32_t bin_of[4] = {1, 2, 2, 3};
  for (int64_t e = 0; e < 4; ++e)
    for (int64_t b = 0; b < 4; ++b) EXPECT_EQ(hist[b * 4 + e], b == bin_of[e] ? 1 : 0) << "e=" << e << " b=" << b;
  // Outside [rmin, rmax]: the edge bins. The histogram accumulates.
  std::vector<int32_t> edge(2 * 4, 0);
  for (int rep = 0; rep < 2; ++rep) QbHistogram(1, logits.data(), bias.data(), p, {2, 0.0f, 0.1f}, edge.data());
  EXPECT_EQ(edge, (std::vector<int32_t>{2, 2, 0, 0, 0, 0, 2, 2}));
}

TEST(QbHistogram, EveryExpertCountsEveryToken) {
  RouterParams p{64, 6, 8, 3, true, 1.0f};
  const int64_t N = 50, bins = 16;
  auto logits = Random(N * p.num_experts, 3, 2.0f), bias = Random(p.num_experts, 4, 0.1f);
  std::vector<int32_t> hist(bins * p.num_experts, 0);
  QbHistogram(N, logits.data(), bias.data(), p, {bins, -1.0f, 1.0f}, hist.data());
  for (int64_t e = 0; e < p.num_experts; ++e) {
    int64_t total = 0;
    for (int64_t b = 0; b < bins; ++b) total += hist[b * p.num_experts + e];
    EXPECT_EQ(total, N);
  }
}

TEST(QbHistogram, MatchesReference) {
  // {E, k, groups, kept groups}: plain, group-limited (Kimi's 8 of 3), every group kept, k + 1 = the kept experts.
  const RouterParams shapes[] = {{16, 4, 1, 1, true, 1.0f}, {64, 6, 8, 3, true, 1.0f}, {64, 6, 8, 8, true, 1.0f},
                                 {12, 5, 4, 2, false, 1.0f}, {384, 8, 1, 1, true, 2.5f}};
  int seed = 20;
  for (const RouterParams& p : shapes)
    for (int64_t N : {0, 1, 7, 33}) {
      for (bool ties : {false, true}) {
        auto logits = Random(N * p.num_experts, ++seed, 3.0f), bias = Random(p.num_experts, ++seed, 0.2f);
        if (ties)  // a few values only: equal s' within and across groups
          for (float& v : logits) v = std::round(v);
        const int64_t bins = 37;
        const QbHistParams h{bins, -1.2f, 1.2f};
        std::vector<int32_t> want(bins * p.num_experts, 0), got(want.size(), 0);
        std::vector<int64_t> got64(want.size(), 0);
        QbHistogramRef(N, logits.data(), bias.data(), p, h, want.data());
        QbHistogram(N, logits.data(), bias.data(), p, h, got.data());
        QbHistogram(N, logits.data(), bias.data(), p, h, got64.data());
        EXPECT_EQ(got, want) << "E " << p.num_experts << " G " << p.num_groups << " N " << N << " ties " << ties;
        EXPECT_TRUE(std::equal(got64.begin(), got64.end(), want.begin())) << "int64 counts, N " << N;
      }
    }
}

}  // namespace
}  // namespace k3::cpu

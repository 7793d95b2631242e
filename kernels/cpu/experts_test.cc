#include "kernels/cpu/experts.h"

#include <gtest/gtest.h>

#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;
using testing::RelDiff;

const GluParams kSilu{GluAct::kSilu, 4.0f, 25.0f};
const GluParams kSitu{GluAct::kSitu, 4.0f, 25.0f};

TEST(GluActivate, MatchesReference) {
  auto g = Random(1000, 1, 8.0f), u = Random(1000, 2, 30.0f);
  for (const auto& p : {kSilu, kSitu}) {
    std::vector<float> h(1000), ref(1000);
    GluActivate(1000, g.data(), u.data(), h.data(), p);
    GluActivateRef(1000, g.data(), u.data(), ref.data(), p);
    EXPECT_LT(RelDiff(h, ref), 1e-6);
  }
}

TEST(GluActivate, SituIsBoundedAndNearSwigluAtZero) {
  std::vector<float> g = {1e4f, -1e4f, 50.0f, 1e-3f, -2e-3f}, u = {1e4f, 1e4f, -1e6f, 2e-3f, 1e-3f};
  std::vector<float> situ(5), silu(5);
  GluActivate(5, g.data(), u.data(), situ.data(), kSitu);
  GluActivate(5, g.data(), u.data(), silu.data(), kSilu);
  for (float v : situ) EXPECT_LE(std::fabs(v), 100.0f);
  EXPECT_NEAR(situ[0], 100.0f, 1e-3);
  // Near 0: β·tanh(x/β) ≈ x, so SiTU ≈ g·sigmoid(g)·u = SiLU(g)·u.
  EXPECT_NEAR(situ[3] / silu[3], 1.0, 1e-4);
  EXPECT_NEAR(situ[4] / silu[4], 1.0, 1e-4);
}

TEST(GluMlp, MatchesReference) {
  for (auto [M, D, I] : {std::tuple{1, 8, 4}, {7, 33, 19}, {64, 128, 256}}) {
    auto x = Random(M * D, 3), w1 = Random(I * D, 4, 0.2f), w3 = Random(I * D, 5, 0.2f), w2 = Random(D * I, 6, 0.2f);
    for (const auto& p : {kSilu, kSitu}) {
      std::vector<float> y(M * D), ref(M * D);
      GluMlp(M, D, I, x.data(), w1.data(), w3.data(), w2.data(), p, y.data());
      GluMlpRef(M, D, I, x.data(), w1.data(), w3.data(), w2.data(), p, ref.data());
      EXPECT_LT(RelDiff(y, ref), 1e-5);
    }
  }
}

TEST(MoeExperts, GroupedMatchesPerTokenReference) {
  const int64_t E = 9, D = 24, I = 13;
  std::vector<std::vector<float>> store;
  std::vector<ExpertWeights> experts(E);
  for (int64_t e = 0; e < E; ++e) {
    store.push_back(Random(I * D, 10 + 3 * e, 0.2f));
    store.push_back(Random(I * D, 11 + 3 * e, 0.2f));
    store.push_back(Random(D * I, 12 + 3 * e, 0.2f));
    experts[e] = {store[store.size() - 3].data(), store[store.size() - 2].data(), store.back().data()};
  }
  for (auto [N, k] : {std::pair{0, 2}, {1, 1}, {5, 3}, {40, 4}}) {
    auto x = Random(N * D, 7), w = Random(N * k, 8);
    std::vector<int32_t> idx(N * k);
    for (int64_t i = 0; i < N * k; ++i) idx[i] = static_cast<int32_t>((i * 7 + i / k) % E);
    if (N * k > 3) idx[2] = -1;  // a pair routed elsewhere
    for (const auto& p : {kSilu, kSitu}) {
      std::vector<float> out(N * D), ref(N * D);
      MoeExperts(N, D, I, k, x.data(), idx.data(), w.data(), E, experts.data(), p, out.data());
      MoeExpertsRef(N, D, I, k, x.data(), idx.data(), w.data(), experts.data(), p, ref.data());
      EXPECT_LT(RelDiff(out, ref), 1e-5) << "N=" << N << " k=" << k;
    }
  }
}

}  // namespace
}  // namespace k3::cpu

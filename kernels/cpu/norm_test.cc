#include "kernels/cpu/norm.h"

#include <gtest/gtest.h>

#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;
using testing::RelDiff;

TEST(RmsNorm, MatchesReference) {
  for (auto [M, D] : {std::pair{1, 1}, {1, 128}, {7, 33}, {64, 7168}, {3, 5}}) {
    auto x = Random(M * D, 1), w = Random(D, 2);
    std::vector<float> y(M * D), ref(M * D);
    RmsNorm(M, D, x.data(), w.data(), 1e-5f, y.data());
    RmsNormRef(M, D, x.data(), w.data(), 1e-5f, ref.data());
    EXPECT_LT(RelDiff(y, ref), 1e-5) << M << "x" << D;
    // In place and without a weight.
    std::vector<float> in = x;
    RmsNorm(M, D, in.data(), nullptr, 1e-5f, in.data());
    RmsNormRef(M, D, x.data(), nullptr, 1e-5f, ref.data());
    EXPECT_LT(RelDiff(in, ref), 1e-5);
  }
}

TEST(RmsNorm, ZeroRowIsZeroAndEpsMatters) {
  std::vector<float> x(8, 0.0f), w(8, 1.0f), y(8, 1.0f);
  RmsNorm(1, 8, x.data(), w.data(), 1e-5f, y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
  std::vector<float> small(8, 1e-3f), a(8), b(8);
  RmsNorm(1, 8, small.data(), w.data(), 1e-5f, a.data());
  RmsNorm(1, 8, small.data(), w.data(), 1e-6f, b.data());
  EXPECT_GT(std::fabs(a[0] - b[0]), 1e-3);
}

TEST(GatedRmsNorm, MatchesReferenceAndGates) {
  for (auto [M, D] : {std::pair{1, 32}, {9, 17}, {128, 128}}) {
    auto x = Random(M * D, 3), g = Random(M * D, 4, 3.0f), w = Random(D, 5);
    std::vector<float> y(M * D), ref(M * D);
    GatedRmsNorm(M, D, x.data(), g.data(), w.data(), 1e-5f, y.data());
    GatedRmsNormRef(M, D, x.data(), g.data(), w.data(), 1e-5f, ref.data());
    EXPECT_LT(RelDiff(y, ref), 1e-5);
  }
  // A very negative gate closes the output.
  std::vector<float> x(4, 1.0f), g(4, -100.0f), w(4, 1.0f), y(4);
  GatedRmsNorm(1, 4, x.data(), g.data(), w.data(), 1e-5f, y.data());
  for (float v : y) EXPECT_LT(std::fabs(v), 1e-30);
}

TEST(L2Norm, UnitRows) {
  auto x = Random(5 * 24, 6);
  L2Norm(5, 24, x.data(), 1e-6f);
  for (int m = 0; m < 5; ++m) {
    double ss = 0;
    for (int i = 0; i < 24; ++i) ss += x[m * 24 + i] * x[m * 24 + i];
    EXPECT_NEAR(ss, 1.0, 1e-5);
  }
}

}  // namespace
}  // namespace k3::cpu

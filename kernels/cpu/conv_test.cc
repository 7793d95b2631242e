#include "kernels/cpu/conv.h"

#include <gtest/gtest.h>

#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;
using testing::RelDiff;

TEST(CausalConv1dSilu, MatchesReferenceWithState) {
  for (auto [T, C, K] : {std::tuple{1, 1, 4}, {1, 16, 4}, {5, 7, 4}, {64, 33, 4}, {3, 8, 2}, {130, 96, 4}, {2, 5, 6}}) {
    auto x = Random(T * C, 1), w = Random(C * K, 2), s0 = Random((K - 1) * C, 3);
    std::vector<float> s = s0, sr = s0, y(T * C), ref(T * C);
    CausalConv1dSilu(T, C, K, x.data(), w.data(), s.data(), y.data());
    CausalConv1dSiluRef(T, C, K, x.data(), w.data(), sr.data(), ref.data());
    EXPECT_LT(RelDiff(y, ref), 1e-6) << T << " " << C << " " << K;
    EXPECT_EQ(s, sr);
  }
}

TEST(CausalConv1dSilu, SplitEqualsWhole) {
  // Prefill in pieces (state carried) equals one call: the decode path's contract.
  const int T = 23, C = 12, K = 4;
  auto x = Random(T * C, 4), w = Random(C * K, 5);
  std::vector<float> s_whole((K - 1) * C, 0.0f), y_whole(T * C);
  CausalConv1dSilu(T, C, K, x.data(), w.data(), s_whole.data(), y_whole.data());
  std::vector<float> s((K - 1) * C, 0.0f), y(T * C);
  int t = 0;
  for (int n : {1, 2, 1, 7, 1, 11}) {
    CausalConv1dSilu(n, C, K, x.data() + t * C, w.data(), s.data(), y.data() + t * C);
    t += n;
  }
  ASSERT_EQ(t, T);
  EXPECT_EQ(y, y_whole);
  EXPECT_EQ(s, s_whole);
}

TEST(CausalConv1dSilu, EmptyInputKeepsState) {
  auto s = Random(3 * 4, 6);
  auto before = s;
  auto w = Random(4 * 4, 7);
  CausalConv1dSilu(0, 4, 4, nullptr, w.data(), s.data(), nullptr);
  EXPECT_EQ(s, before);
}

}  // namespace
}  // namespace k3::cpu

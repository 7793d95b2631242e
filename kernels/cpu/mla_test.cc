#include "kernels/cpu/mla.h"

#include <gtest/gtest.h>

#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;
using testing::RelDiff;

struct Case {
  int64_t T, P;
  MlaShape s;
};

TEST(MlaAttention, ExpandedAndAbsorbedMatchNaive) {
  const Case cases[] = {
      {1, 0, {1, 8, 4, 8, 16}},      // first token alone
      {1, 37, {4, 32, 16, 32, 32}},  // decode after a prompt
      {5, 0, {3, 24, 8, 40, 20}},    // odd sizes, dv != dn
      {17, 9, {4, 32, 16, 32, 32}},  // a chunk after a cached prefix
      {64, 0, {2, 128, 64, 128, 64}},
      {3, 200, {2, 16, 0, 16, 8}},   // no rope part
  };
  for (const auto& c : cases) {
    const auto& s = c.s;
    const int64_t L = c.P + c.T;
    auto q = Random(c.T * s.nh * (s.dn + s.dr), 1), cache = Random(L * (s.r + s.dr), 2),
         kv_b = Random(s.nh * (s.dn + s.dv) * s.r, 3, 0.3f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.dn + s.dr));
    std::vector<float> ref(c.T * s.nh * s.dv), ex(ref.size()), ab(ref.size());
    MlaAttentionRef(c.T, c.P, s, q.data(), cache.data(), kv_b.data(), scale, ref.data());
    MlaAttentionExpanded(c.T, c.P, s, q.data(), cache.data(), kv_b.data(), scale, ex.data());
    MlaAttentionAbsorbed(c.T, c.P, s, q.data(), cache.data(), kv_b.data(), scale, ab.data());
    EXPECT_LT(RelDiff(ex, ref), 1e-5) << "expanded T=" << c.T << " P=" << c.P;
    EXPECT_LT(RelDiff(ab, ref), 1e-5) << "absorbed T=" << c.T << " P=" << c.P;
  }
}

TEST(MlaAttention, CausalMaskIgnoresFutureRows) {
  // Changing the cache rows after token t must not change token t's output.
  const MlaShape s{2, 8, 4, 8, 12};
  const int64_t T = 6, P = 3, L = P + T;
  auto q = Random(T * s.nh * (s.dn + s.dr), 4), cache = Random(L * (s.r + s.dr), 5), kv_b = Random(s.nh * (s.dn + s.dv) * s.r, 6);
  std::vector<float> a(T * s.nh * s.dv), b(a.size());
  MlaAttentionAbsorbed(T, P, s, q.data(), cache.data(), kv_b.data(), 0.3f, a.data());
  for (int64_t i = (P + 1) * (s.r + s.dr); i < L * (s.r + s.dr); ++i) cache[i] += 1.0f;  // rows after token 0
  MlaAttentionAbsorbed(T, P, s, q.data(), cache.data(), kv_b.data(), 0.3f, b.data());
  for (int64_t i = 0; i < s.nh * s.dv; ++i) EXPECT_EQ(a[i], b[i]);
  EXPECT_NE(a.back(), b.back());
}

TEST(MlaAttention, EmptyChunkIsANoOp) {
  const MlaShape s{2, 8, 4, 8, 12};
  MlaAttentionExpanded(0, 5, s, nullptr, nullptr, nullptr, 1.0f, nullptr);
  MlaAttentionAbsorbed(0, 5, s, nullptr, nullptr, nullptr, 1.0f, nullptr);
}

}  // namespace
}  // namespace k3::cpu

// Block AttnRes: the two-phase serving schedule equals the naive read; closed forms.
#include "kernels/cpu/attnres.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tests/testing.h"

namespace k3::cpu {
namespace {

using testing::Random;
using testing::RelDiff;

constexpr float kEps = 1e-5f;

struct Query {
  std::vector<float> w, n;
  AttnResQuery view() const { return {w.data(), n.data()}; }
};

Query RandomQuery(int64_t d, uint64_t seed) {
  Query q{Random(d, seed, 2.0f / std::sqrt(static_cast<float>(d))), Random(d, seed + 1, 0.1f)};
  for (float& x : q.n) x += 1.0f;
  return q;
}

// A model's sequence of reads (DESIGN §1.5) over N tokens, L layers, block size B, with a fixed
// nonlinear stand-in for each sub-layer. Returns the 2L + 1 reads' outputs in order: layer l's
// pre-mixer read, its pre-MLP read, ..., then the read before the final norm.
std::vector<std::vector<float>> ModelReads(int64_t N, int64_t d, int64_t L, int64_t B, bool two_phase) {
  std::vector<Query> queries;
  for (int64_t r = 0; r <= 2 * L; ++r) queries.push_back(RandomQuery(d, 1000 + 2 * r));
  std::vector<std::vector<float>> bank, reads;
  std::vector<float> partial = Random(N * d, 7);  // the embedding
  BlockReads block;
  int64_t first = 0;  // the global index of block's read 0
  auto build = [&](int64_t from, int64_t to) {
    std::vector<const float*> sources;
    for (const auto& b : bank) sources.push_back(b.data());
    std::vector<AttnResQuery> q;
    for (int64_t r = from; r <= to; ++r) q.push_back(queries[r].view());
    block.Build(N, d, sources.data(), static_cast<int64_t>(sources.size()), q.data(), static_cast<int64_t>(q.size()),
                kEps);
    first = from;
  };
  auto read = [&](int64_t r) {
    std::vector<float> out(N * d);
    if (two_phase) {
      ASSERT_LT(r - first, block.num_reads());
      block.Merge(r - first, partial.data(), out.data());
    } else {
      std::vector<const float*> sources;
      for (const auto& b : bank) sources.push_back(b.data());
      sources.push_back(partial.data());
      AttnResRead(N, d, sources.data(), static_cast<int64_t>(sources.size()), queries[r].w.data(),
                  queries[r].n.data(), kEps, out.data());
    }
    reads.push_back(out);
  };
  auto sublayer = [&](int64_t r) {  // partial += tanh(0.7 · read + bias_r)
    const std::vector<float> bias = Random(d, 5000 + r, 0.5f);
    for (int64_t i = 0; i < N * d; ++i) partial[i] += std::tanh(0.7f * reads.back()[i] + bias[i % d]);
  };

  if (two_phase) build(0, 0);
  for (int64_t l = 0; l < L; ++l) {
    read(2 * l);
    if (l % B == 0) {
      bank.push_back(partial);
      std::fill(partial.begin(), partial.end(), 0.0f);
      if (two_phase) build(2 * l + 1, std::min(2 * (l + B), 2 * L));
    }
    sublayer(2 * l);
    read(2 * l + 1);
    sublayer(2 * l + 1);
  }
  read(2 * L);
  return reads;
}

TEST(AttnRes, TwoPhaseEqualsNaive) {
  for (int64_t B : {1, 2, 3, 12}) {
    for (int64_t L : {1, 5, 7, 13, 26}) {
      for (int64_t d : {1, 7, 33}) {
        for (int64_t N : {0, 1, 3}) {
          SCOPED_TRACE(::testing::Message() << "block " << B << " layers " << L << " d " << d << " N " << N);
          const auto naive = ModelReads(N, d, L, B, false);
          const auto two = ModelReads(N, d, L, B, true);
          ASSERT_EQ(two.size(), naive.size());
          for (size_t r = 0; r < naive.size(); ++r) EXPECT_LT(RelDiff(two[r], naive[r]), 1e-6) << "read " << r;
        }
      }
    }
  }
}

// A zero pseudo-query gives every source the same logit: the read is the plain average.
TEST(AttnRes, ZeroQueryIsUniformAverage) {
  const int64_t N = 3, d = 17, m = 4;
  std::vector<std::vector<float>> src;
  for (int64_t j = 0; j < m; ++j) src.push_back(Random(N * d, 20 + j, 0.5f + j));  // different scales
  std::vector<const float*> ptr;
  for (const auto& s : src) ptr.push_back(s.data());
  std::vector<float> mean(N * d, 0.0f);
  for (const auto& s : src)
    for (int64_t i = 0; i < N * d; ++i) mean[i] += s[i] / m;
  const std::vector<float> w(d, 0.0f), n = Random(d, 3);

  std::vector<float> naive(N * d), two(N * d);
  AttnResRead(N, d, ptr.data(), m, w.data(), n.data(), kEps, naive.data());
  EXPECT_LT(RelDiff(naive, mean), 1e-6);

  BlockReads block;  // bank = the first m − 1 sources, the partial sum = the last
  const AttnResQuery q{w.data(), n.data()};
  block.Build(N, d, ptr.data(), m - 1, &q, 1, kEps);
  block.Merge(0, src.back().data(), two.data());
  EXPECT_LT(RelDiff(two, mean), 1e-6);
}

// One source is read back unchanged, whatever the query: softmax over one logit is 1.
TEST(AttnRes, SingleSourceIsIdentity) {
  const int64_t N = 4, d = 9;
  const std::vector<float> v = Random(N * d, 30, 3.0f);
  const Query q = RandomQuery(d, 31);
  const float* src = v.data();
  std::vector<float> naive(N * d), two(N * d);
  AttnResRead(N, d, &src, 1, q.w.data(), q.n.data(), kEps, naive.data());
  EXPECT_EQ(naive, v);

  BlockReads block;  // an empty bank: the read is the partial sum
  const AttnResQuery view = q.view();
  block.Build(N, d, nullptr, 0, &view, 1, kEps);
  block.Merge(0, v.data(), two.data());
  EXPECT_EQ(two, v);
}

}  // namespace
}  // namespace k3::cpu

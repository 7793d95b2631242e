// GPU MoE against the CPU references: the router (and its QB histogram) against k3::cpu::RouteTopKRef and
// k3::cpu::QbHistogram — identical expert ids and counts —, the permutation against a CPU counting sort, and
// the routed experts (both GEMM paths, SwiGLU and SiTU) against k3::cpu::MoeExperts on bf16-rounded inputs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "kernels/cpu/experts.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/router.h"
#include "kernels/cuda/moe.cuh"
#include "tests/testing.h"

#include "kernels/cuda/testing.cuh"

namespace k3::cuda {
namespace {

using testing::Random;
using testing::RelDiff;

// ---------------------------------------------------------------------------------------------- router

cpu::RouterParams Cpu(const RouterArgs& a) {
  return {a.num_experts, a.top_k, a.num_groups, a.topk_groups, a.renormalize, a.scale};
}

// Routes N tokens of `logits` on the GPU (with the QB histogram when bins > 0) and checks ids, weights
// and histogram against the CPU. parts > 0: the GPU reads them as a product's unfolded sums (rows of E + 5, each
// logit the fp32 sum of a hi row's value and a small lo row's; parts > 1: that many such pairs, K slices of the
// product, added in order; the reference the sums).
void CheckRouter(RouterArgs a, std::vector<float> logits, const std::vector<float>& bias, int64_t bins = 0,
                 int64_t parts = 0) {
  const int64_t N = a.N, E = a.num_experts, k = a.top_k;
  std::vector<float> dev = logits;
  int64_t ld = E, lo_rows = 0, stride = 0;
  if (parts > 0) {
    ld = E + 5, lo_rows = N, stride = 2 * N * ld + 3;
    dev.assign(parts * stride, NAN);
    for (int64_t p = 0; p < parts; ++p) {
      const auto hi = Random(N * E, 98 + 2 * p, 0.3f), lo = Random(N * E, 99 + 2 * p, 1e-3f);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t e = 0; e < E; ++e) {
          float* q = dev.data() + p * stride;
          q[n * ld + e] = p == 0 ? logits[n * E + e] : hi[n * E + e], q[(N + n) * ld + e] = lo[n * E + e];
          const float part = q[n * ld + e] + q[(N + n) * ld + e];
          logits[n * E + e] = p == 0 ? part : logits[n * E + e] + part;
        }
    }
  }
  DeviceBuffer<float> d_logits(dev), d_bias(bias), d_w(N * k);
  DeviceBuffer<int32_t> d_idx(N * k), d_hist(std::max<int64_t>(bins, 1) * E);
  a.logits = Sums{d_logits.get(), ld, lo_rows, std::max<int64_t>(parts, 1), stride};
  a.bias = bias.empty() ? nullptr : d_bias.get(), a.idx = d_idx.get(), a.w = d_w.get();
  const cpu::QbHistParams qb{bins, -0.5f, 1.0f};
  if (bins > 0) {
    CUDA_OK(cudaMemset(d_hist.get(), 0, bins * E * sizeof(int32_t)));
    a.qb_hist = d_hist.get(), a.qb_bins = bins, a.qb_rmin = qb.rmin, a.qb_rmax = qb.rmax;
  }
  CUDA_OK(RouteTopK(a, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<int32_t> ridx(N * k);
  std::vector<float> rw(N * k);
  cpu::RouteTopKRef(N, logits.data(), bias.empty() ? nullptr : bias.data(), Cpu(a), ridx.data(), rw.data());
  const auto idx = d_idx.ToHost();
  const auto w = d_w.ToHost();
  const std::string what = "E=" + std::to_string(E) + " k=" + std::to_string(k) + " G=" + std::to_string(a.num_groups);
  EXPECT_EQ(idx, ridx) << what;
  double max_err = 0;
  for (size_t i = 0; i < w.size(); ++i) max_err = std::max(max_err, std::fabs(double(w[i]) - rw[i]));
  EXPECT_LE(max_err, 1e-6 * a.scale) << what;
  if (bins > 0) {
    std::vector<int32_t> rhist(bins * E, 0);
    cpu::QbHistogram(N, logits.data(), bias.empty() ? nullptr : bias.data(), Cpu(a), qb, rhist.data());
    EXPECT_EQ(d_hist.ToHost(), rhist) << what;
  }
}

RouterArgs Router(int64_t N, int64_t E, int64_t k, int64_t G, int64_t topk_groups, bool renormalize, float scale) {
  RouterArgs a;
  a.N = N, a.num_experts = E, a.top_k = k, a.num_groups = G, a.topk_groups = topk_groups;
  a.renormalize = renormalize, a.scale = scale;
  return a;
}

// Batches of up to 256 tokens without a group limit take the block-per-token kernel, the rest a warp per token.
TEST(RouteTopKCuda, MatchesReference) {
  REQUIRE_GPU();
  const RouterArgs cases[] = {
      Router(37, 16, 4, 1, 1, true, 2.446f),    // Kimi-Linear tiny
      Router(300, 256, 8, 1, 1, true, 2.446f),  // Kimi-Linear 48B
      Router(64, 256, 8, 1, 1, true, 2.446f),   // ... its decode batch (a block per token)
      Router(1, 256, 8, 1, 1, true, 2.446f),    // ... one sequence
      Router(37, 64, 6, 8, 3, true, 1.0f),      // group-limited
      Router(37, 64, 6, 8, 3, false, 2.5f),     // no renormalization
      Router(2000, 896, 16, 1, 1, true, 1.0f),  // K3
      Router(37, 12, 12, 4, 4, true, 1.0f),     // k == E
      Router(37, 10, 1, 5, 2, false, 1.0f),     // group size 2
      Router(37, 1000, 32, 1, 1, true, 1.0f),   // widest: E > 896, k = 32
  };
  uint64_t seed = 1;
  for (const RouterArgs& a : cases) {
    const auto logits = Random(a.N * a.num_experts, seed++, 2.0f), bias = Random(a.num_experts, seed++, 0.1f);
    CheckRouter(a, logits, bias);
    CheckRouter(a, logits, {});
    CheckRouter(a, logits, bias, 0, /*parts=*/1);
    CheckRouter(a, logits, bias, 0, /*parts=*/3);
  }
}

TEST(RouteTopKCuda, TiesGoToTheLowerExpert) {
  REQUIRE_GPU();
  // Logits on a coarse grid and no bias: many exactly equal scores, also at the k-th place.
  for (const RouterArgs& a : {Router(300, 896, 16, 1, 1, true, 1.0f), Router(300, 64, 6, 8, 3, true, 1.0f),
                              Router(200, 896, 16, 1, 1, true, 1.0f), Router(64, 256, 8, 1, 1, true, 1.0f)}) {
    auto logits = Random(a.N * a.num_experts, 7, 1.0f);
    for (float& x : logits) x = std::round(x * 2.0f) / 2.0f;
    CheckRouter(a, logits, {});
  }
}

TEST(RouteTopKCuda, QbHistogramMatchesCpu) {
  REQUIRE_GPU();
  for (const RouterArgs& a : {Router(1000, 896, 16, 1, 1, true, 1.0f), Router(200, 64, 6, 8, 3, true, 1.0f),
                              Router(100, 16, 4, 1, 1, false, 1.0f), Router(200, 896, 16, 1, 1, true, 1.0f),
                              Router(64, 1000, 32, 1, 1, true, 1.0f)}) {
    const auto logits = Random(a.N * a.num_experts, 11, 2.0f), bias = Random(a.num_experts, 12, 0.1f);
    CheckRouter(a, logits, bias, 56);
  }
}

TEST(RouteTopKCuda, GateThenRoute) {
  REQUIRE_GPU();
  const int64_t N = 100, d = 256, E = 64;
  auto m = Random(N * d, 21), wg = Random(E * d, 22, 0.1f);
  const auto mb = ToBf16(m), wgb = ToBf16(wg);
  DeviceBuffer<uint16_t> d_m(mb), d_wg(wgb);
  DeviceBuffer<float> d_logits(N * E);
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  CUDA_OK(RouterLogits(blas, N, d, E, reinterpret_cast<const __nv_bfloat16*>(d_m.get()),
                       reinterpret_cast<const __nv_bfloat16*>(d_wg.get()), d_logits.get()));
  CUDA_OK(cudaDeviceSynchronize());
  cublasDestroy(blas);
  const auto logits = d_logits.ToHost();
  std::vector<float> ref(N * E);
  cpu::LinearRef(N, E, d, m.data(), wg.data(), ref.data());
  EXPECT_LT(RelDiff(logits, ref), 1e-5);
  CheckRouter(Router(N, E, 6, 8, 3, true, 2.5f), logits, Random(E, 23, 0.1f));
}

TEST(RouteTopKCuda, RejectsBadShapes) {
  REQUIRE_GPU();
  DeviceBuffer<float> buf(64);
  DeviceBuffer<int32_t> idx(64);
  RouterArgs a = Router(1, 64, 33, 1, 1, true, 1.0f);  // k > 32
  a.logits = Sums{buf.get(), 64}, a.idx = idx.get(), a.w = buf.get();
  EXPECT_EQ(RouteTopK(a, nullptr), cudaErrorInvalidValue);
  a.top_k = 4, a.logits.ld = 63;  // rows narrower than E
  EXPECT_EQ(RouteTopK(a, nullptr), cudaErrorInvalidValue);
  a.logits.ld = 64, a.num_groups = 6;  // 6 does not divide 64
  EXPECT_EQ(RouteTopK(a, nullptr), cudaErrorInvalidValue);
  a.num_groups = 8, a.topk_groups = 1, a.top_k = 8, a.qb_hist = idx.get(), a.qb_bins = 4, a.qb_rmax = 1.0f;
  EXPECT_EQ(RouteTopK(a, nullptr), cudaErrorInvalidValue);  // one group of 8 has no (k+1)-th expert
}

// --------------------------------------------------------------------------------------------- experts

TEST(MoePermuteCuda, StableCountingSort) {
  REQUIRE_GPU();
  for (const auto& [E, P] : {std::pair<int64_t, int64_t>{13, 0}, {13, 1}, {13, 999}, {13, 5000}, {300, 5000}}) {
    std::mt19937 rng(static_cast<uint32_t>(P + E));
    std::vector<int32_t> idx(P);
    for (auto& e : idx) e = static_cast<int32_t>(rng() % (E + 3)) - 1;  // −1 and some ids ≥ E: not routed
    for (auto& e : idx)
      if (e == 4) e = 5;  // expert 4 empty
    DeviceBuffer<int32_t> d_idx(idx), counts(E), offsets(E + 1), slot_pair(std::max<int64_t>(P, 1)),
        pair_slot(std::max<int64_t>(P, 1));
    CUDA_OK(MoePermute(P, d_idx.get(), E, counts.get(), offsets.get(), slot_pair.get(), pair_slot.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<int32_t> ref_offsets(E + 1, 0), ref_counts(E, 0), ref_slot_pair, ref_pair_slot(P, -1);
    for (int32_t e : idx)
      if (e >= 0 && e < E) ref_counts[e]++;
    for (int64_t e = 0; e < E; ++e) {
      ref_offsets[e] = static_cast<int32_t>(ref_slot_pair.size());
      for (int64_t p = 0; p < P; ++p)
        if (idx[p] == e) {
          ref_pair_slot[p] = static_cast<int32_t>(ref_slot_pair.size());
          ref_slot_pair.push_back(static_cast<int32_t>(p));
        }
    }
    ref_offsets[E] = static_cast<int32_t>(ref_slot_pair.size());
    EXPECT_EQ(offsets.ToHost(), ref_offsets) << "P=" << P;
    EXPECT_EQ(counts.ToHost(), ref_counts) << "P=" << P;
    auto sp = slot_pair.ToHost();
    sp.resize(ref_slot_pair.size());
    EXPECT_EQ(sp, ref_slot_pair) << "P=" << P;
    auto ps = pair_slot.ToHost();
    ps.resize(P);
    EXPECT_EQ(ps, ref_pair_slot) << "P=" << P;
  }
  DeviceBuffer<int32_t> one(std::vector<int32_t>{0}), big(8193 + 1);
  EXPECT_EQ(MoePermute(1, one.get(), 8193, big.get(), big.get(), big.get(), big.get(), nullptr), cudaErrorInvalidValue)
      << "more experts than the histogram holds";
}

// E experts of shape (D, I), each in its own allocation; bf16-rounded fp32 copies for the CPU.
struct Experts {
  int64_t E, D, I;
  std::vector<std::vector<float>> w1, w3, w2;
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> store;
  std::unique_ptr<DeviceBuffer<const __nv_bfloat16*>> p1, p3, p2;

  Experts(int64_t E_, int64_t D_, int64_t I_, uint64_t seed) : E(E_), D(D_), I(I_) {
    std::vector<const __nv_bfloat16*> h1, h3, h2;
    auto make = [&](std::vector<std::vector<float>>& dst, std::vector<const __nv_bfloat16*>& ptrs, int64_t n,
                    float scale) {
      dst.push_back(Random(n, seed++, scale));
      store.push_back(std::make_unique<DeviceBuffer<uint16_t>>(ToBf16(dst.back())));
      ptrs.push_back(reinterpret_cast<const __nv_bfloat16*>(store.back()->get()));
    };
    for (int64_t e = 0; e < E; ++e) {
      make(w1, h1, I * D, 1.0f / std::sqrt(float(D)));
      make(w3, h3, I * D, 1.0f / std::sqrt(float(D)));
      make(w2, h2, D * I, 1.0f / std::sqrt(float(I)));
    }
    p1 = std::make_unique<DeviceBuffer<const __nv_bfloat16*>>(h1);
    p3 = std::make_unique<DeviceBuffer<const __nv_bfloat16*>>(h3);
    p2 = std::make_unique<DeviceBuffer<const __nv_bfloat16*>>(h2);
  }
  std::vector<cpu::ExpertWeights> Cpu() const {
    std::vector<cpu::ExpertWeights> v(E);
    for (int64_t e = 0; e < E; ++e) v[e] = {w1[e].data(), w3[e].data(), w2[e].data()};
    return v;
  }
};

struct Routing {
  int64_t N, k;
  std::vector<int32_t> idx;
  std::vector<float> w;
};

// GPU out for (x, routing) with the given path and activation, as floats.
std::vector<float> RunGpu(const Experts& ex, const std::vector<uint16_t>& xb, const Routing& r, MoeGemm gemm,
                          GluAct act, MoeWorkspace& ws) {
  DeviceBuffer<uint16_t> x(xb), out(r.N * ex.D);
  DeviceBuffer<int32_t> idx(r.idx);
  DeviceBuffer<float> w(r.w);
  MoeExpertsArgs a;
  a.N = r.N, a.D = ex.D, a.I = ex.I, a.top_k = r.k, a.num_experts = ex.E;
  a.x = reinterpret_cast<const __nv_bfloat16*>(x.get()), a.idx = idx.get(), a.w = w.get();
  a.w1 = ex.p1->get(), a.w3 = ex.p3->get(), a.w2 = ex.p2->get();
  a.act = act, a.situ_beta = 4.0f, a.situ_linear_beta = 25.0f;
  a.out = reinterpret_cast<__nv_bfloat16*>(out.get());
  std::vector<float> res;
  EXPECT_EQ(ws.Reserve(r.N * r.k, ex.D, ex.I, ex.E), cudaSuccess);
  EXPECT_EQ(MoeExperts(a, gemm, ws, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (uint16_t v : out.ToHost()) res.push_back(Bf16ToFloat(v));
  return res;
}

// Routings that cover the edge cases: empty experts, one token, one expert for all, unrouted pairs.
std::vector<std::pair<std::string, Routing>> Routings(int64_t E) {
  std::vector<std::pair<std::string, Routing>> v;
  std::mt19937 rng(5);
  auto weights = [&](int64_t n) {
    std::vector<float> w(n);
    for (auto& x : w) x = 0.1f + (rng() % 1000) / 1000.0f;
    return w;
  };
  {  // random, with −1 pairs and experts 2 and E − 1 left empty
    Routing r{37, 4, {}, {}};
    for (int64_t i = 0; i < r.N * r.k; ++i) {
      int32_t e = static_cast<int32_t>(rng() % (E + 1)) - 1;
      if (e == 2 || e == E - 1) e = -1;
      r.idx.push_back(e);
    }
    r.w = weights(r.N * r.k);
    v.emplace_back("random", r);
  }
  v.emplace_back("one token", Routing{1, 1, {3}, weights(1)});
  {  // 150 tokens on one expert: three 64-token tiles, one cuBLAS expert
    Routing r{150, 1, std::vector<int32_t>(150, 1), weights(150)};
    v.emplace_back("all on one expert", r);
  }
  {  // 40 tokens on one expert: five 8-token tiles on the split path, two 32-token tiles on the plain one
    Routing r{40, 1, std::vector<int32_t>(40, 0), weights(40)};
    v.emplace_back("40 on one expert", r);
  }
  {  // decode-like on the split path (at most 8 pairs per expert on average): expert 0 with 20 pairs, expert 1 with
     // 12 (16-token wide tiles: 16 + 4 and 12), the rest 4–5 (8-token tiles)
    Routing r{24, 3, {}, {}};
    for (int64_t n = 0; n < r.N; ++n) {
      r.idx.push_back(n < 20 ? 0 : static_cast<int32_t>(2 + n % (E - 2)));
      r.idx.push_back(n < 12 ? 1 : static_cast<int32_t>(2 + (n + 3) % (E - 2)));
      r.idx.push_back(static_cast<int32_t>(2 + (n + 5) % (E - 2)));
    }
    r.w = weights(r.N * r.k);
    v.emplace_back("decode-like, wide tiles", r);
  }
  {  // a token with no pair here, and skewed counts
    Routing r{65, 3, {}, {}};
    for (int64_t n = 0; n < r.N; ++n)
      for (int64_t j = 0; j < r.k; ++j)
        r.idx.push_back(n == 7 ? -1 : static_cast<int32_t>((n * (j + 1)) % 3 == 0 ? 0 : (n + j) % E));
    r.w = weights(r.N * r.k);
    v.emplace_back("skewed, unrouted token", r);
  }
  return v;
}

// The fp32 CPU experts (SiTU with β 4 and 25) on x: the reference of the GPU paths.
std::vector<float> CpuExperts(const Experts& ex, const std::vector<cpu::ExpertWeights>& cpu_experts,
                              const std::vector<float>& x, const Routing& r, GluAct act) {
  const cpu::GluParams p{act == GluAct::kSilu ? cpu::GluAct::kSilu : cpu::GluAct::kSitu, 4.0f, 25.0f};
  std::vector<float> ref(r.N * ex.D);
  cpu::MoeExperts(r.N, ex.D, ex.I, r.k, x.data(), r.idx.data(), r.w.data(), ex.E, cpu_experts.data(), p, ref.data());
  return ref;
}

TEST(MoeExpertsCuda, MatchesCpu) {
  REQUIRE_GPU();
  MoeWorkspace ws;
  for (auto [E, D, I] : {std::tuple<int64_t, int64_t, int64_t>{9, 200, 72}, {6, 512, 384}}) {
    const Experts ex(E, D, I, 100);
    const auto cpu_experts = ex.Cpu();
    for (const auto& [name, r] : Routings(E)) {
      auto x = Random(r.N * D, 40, 1.0f);
      const auto xb = ToBf16(x);
      for (GluAct act : {GluAct::kSilu, GluAct::kSitu}) {
        const std::vector<float> ref = CpuExperts(ex, cpu_experts, x, r, act);
        for (MoeGemm gemm : {MoeGemm::kTiled, MoeGemm::kCublas, MoeGemm::kWgmma}) {
          const auto out = RunGpu(ex, xb, r, gemm, act, ws);
          EXPECT_LT(RelDiff(out, ref), 1e-2) << name << " D=" << D << " I=" << I << " situ=" << (act == GluAct::kSitu)
                                             << " gemm=" << static_cast<int>(gemm);
        }
      }
    }
  }
}

// The split path (the GPU engine's): x as hi + lo planes, h and the expert outputs in two planes, the sum in
// fp32 — as close to the fp32 CPU experts as fp32 accumulation order allows, on odd widths (I = 48: a partial
// k-block and a partial row tile), one token, unrouted pairs, and 150 tokens on one expert (five 32-slot tiles).
TEST(MoeExpertsCuda, SplitMatchesCpuInFp32) {
  REQUIRE_GPU();
  MoeWorkspace ws;
  for (auto [E, D, I] : {std::tuple<int64_t, int64_t, int64_t>{9, 200, 72}, {5, 128, 48}}) {
    const Experts ex(E, D, I, 300);
    const auto cpu_experts = ex.Cpu();
    for (const auto& [name, r] : Routings(E)) {
      std::vector<float> x = Random(r.N * D, 50, 1.0f);
      const std::vector<uint16_t> planes = ToSplitPlanes(x);
      for (GluAct act : {GluAct::kSilu, GluAct::kSitu}) {
        const std::vector<float> ref = CpuExperts(ex, cpu_experts, x, r, act);
        DeviceBuffer<uint16_t> dx(planes);
        DeviceBuffer<float> out(r.N * D);
        DeviceBuffer<int32_t> idx(r.idx);
        DeviceBuffer<float> w(r.w);
        DeviceBuffer<int32_t> hit(1);
        MoeExpertsArgs a;
        a.N = r.N, a.D = D, a.I = I, a.top_k = r.k, a.num_experts = E, a.experts_hit = hit.get();
        a.x = reinterpret_cast<const __nv_bfloat16*>(dx.get()), a.x_lo = r.N * D, a.idx = idx.get(), a.w = w.get();
        a.w1 = ex.p1->get(), a.w3 = ex.p3->get(), a.w2 = ex.p2->get();
        a.act = act, a.situ_beta = 4.0f, a.situ_linear_beta = 25.0f, a.out_f32 = out.get();
        ASSERT_EQ(ws.Reserve(r.N * r.k, D, I, E), cudaSuccess);
        EXPECT_EQ(MoeExperts(a, MoeGemm::kCublas, ws, nullptr), cudaErrorInvalidValue);  // tiled only
        EXPECT_EQ(MoeExperts(a, MoeGemm::kWgmma, ws, nullptr), cudaErrorInvalidValue);
        ASSERT_EQ(MoeExperts(a, MoeGemm::kAuto, ws, nullptr), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_LT(RelDiff(out.ToHost(), ref), 1e-4) << name << " D=" << D << " I=" << I << " situ=" << (act == GluAct::kSitu);
        std::vector<bool> used(E, false);
        for (int32_t e : r.idx)
          if (e >= 0) used[e] = true;
        EXPECT_EQ(hit.ToHost()[0], std::count(used.begin(), used.end(), true)) << name;
      }
    }
  }
}

// The split path picks 8- or 32-token tiles by pairs per expert; a token's output must not change with it:
// the first 30 tokens alone (60 pairs over 9 experts: small tiles) and inside 300 tokens (large tiles).
TEST(MoeExpertsCuda, SplitTileShapesAgreeBitForBit) {
  REQUIRE_GPU();
  const int64_t E = 9, D = 200, I = 72, k = 2, N = 300, n = 30;
  const Experts ex(E, D, I, 310);
  std::mt19937 rng(11);
  std::vector<int32_t> idx(N * k);
  std::vector<float> w(N * k), x = Random(N * D, 60, 1.0f);
  for (int64_t i = 0; i < N * k; ++i) idx[i] = static_cast<int32_t>(rng() % E), w[i] = 0.1f + (rng() % 100) / 100.0f;
  auto run = [&](int64_t rows) {
    std::vector<float> xr(x.begin(), x.begin() + rows * D);
    DeviceBuffer<uint16_t> dx(ToSplitPlanes(xr));
    DeviceBuffer<float> out(rows * D), dw(std::vector<float>(w.begin(), w.begin() + rows * k));
    DeviceBuffer<int32_t> didx(std::vector<int32_t>(idx.begin(), idx.begin() + rows * k));
    MoeWorkspace ws;
    MoeExpertsArgs a;
    a.N = rows, a.D = D, a.I = I, a.top_k = k, a.num_experts = E;
    a.x = reinterpret_cast<const __nv_bfloat16*>(dx.get()), a.x_lo = rows * D, a.idx = didx.get(), a.w = dw.get();
    a.w1 = ex.p1->get(), a.w3 = ex.p3->get(), a.w2 = ex.p2->get(), a.act = GluAct::kSitu, a.out_f32 = out.get();
    EXPECT_EQ(ws.Reserve(rows * k, D, I, E), cudaSuccess);
    EXPECT_EQ(MoeExperts(a, MoeGemm::kAuto, ws, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return out.ToHost();
  };
  const std::vector<float> alone = run(n), batched = run(N);
  ASSERT_EQ(alone.size(), static_cast<size_t>(n * D));
  EXPECT_EQ(std::memcmp(alone.data(), batched.data(), alone.size() * sizeof(float)), 0);
}

// MoePackGateUp against the layout written out on the host: tile (b, kt) of 128 rows × 64 columns, rows 16w..16w + 7
// W1's features 64b + 8w.., rows 16w + 8.. W3's same features, chunk c of row r at c ^ (r & 7), zeros past the
// matrices (I = 72, D = 200: a partial row tile and k-tile).
std::vector<uint16_t> PackGateUpRef(const std::vector<uint16_t>& w1, const std::vector<uint16_t>& w3, int64_t I,
                                    int64_t D) {
  const int64_t B = (I + 63) / 64, KT = (D + 63) / 64;
  std::vector<uint16_t> out(B * KT * 128 * 64, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kt = 0; kt < KT; ++kt)
      for (int64_t r = 0; r < 128; ++r) {
        const int64_t f = b * 64 + 8 * (r / 16) + r % 8;
        const std::vector<uint16_t>& w = r % 16 >= 8 ? w3 : w1;
        for (int64_t c = 0; c < 8; ++c)
          for (int64_t e = 0; e < 8; ++e) {
            const int64_t k = kt * 64 + c * 8 + e;
            if (f < I && k < D) out[((b * KT + kt) * 128 + r) * 64 + (c ^ (r & 7)) * 8 + e] = w[f * D + k];
          }
      }
  return out;
}

TEST(MoeExpertsCuda, PackMatchesHostLayout) {
  REQUIRE_GPU();
  for (auto [D, I] : {std::pair<int64_t, int64_t>{200, 72}, {128, 48}, {2304, 1024}, {8, 8}}) {
    std::vector<float> f1 = Random(I * D, 1), f3 = Random(I * D, 2);
    const auto w1 = ToBf16(f1), w3 = ToBf16(f3);
    DeviceBuffer<uint16_t> d1(w1), d3(w3), gu(MoePackedGateUpElems(D, I));
    ASSERT_EQ(MoePackGateUp(reinterpret_cast<const __nv_bfloat16*>(d1.get()),
                            reinterpret_cast<const __nv_bfloat16*>(d3.get()), D, I,
                            reinterpret_cast<__nv_bfloat16*>(gu.get()), nullptr),
              cudaSuccess);
    EXPECT_EQ(gu.ToHost(), PackGateUpRef(w1, w3, I, D)) << "D=" << D << " I=" << I;
  }
  DeviceBuffer<uint16_t> w(64 * 64);
  auto p = reinterpret_cast<__nv_bfloat16*>(w.get());
  EXPECT_EQ(MoePackGateUp(p, nullptr, 64, 64, p, nullptr), cudaErrorInvalidValue) << "no W3";
  EXPECT_EQ(MoePackGateUp(p, p, 60, 64, p, nullptr), cudaErrorInvalidValue) << "D not a multiple of 8";
}

// Packed W1 and W3 (the GPU engine's) give the plain layout's bits, split and plain x, every routing, on odd widths;
// packed weights refuse the cuBLAS and wgmma paths.
TEST(MoeExpertsCuda, PackedWeightsAgreeBitForBit) {
  REQUIRE_GPU();
  MoeWorkspace ws;
  for (auto [E, D, I] : {std::tuple<int64_t, int64_t, int64_t>{9, 200, 72}, {5, 128, 48}, {4, 512, 384}}) {
    const Experts ex(E, D, I, 400);
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> store;
    std::vector<const __nv_bfloat16*> gu;
    const std::vector<const __nv_bfloat16*> w1 = ex.p1->ToHost(), w3 = ex.p3->ToHost();
    for (int64_t e = 0; e < E; ++e) {
      store.push_back(std::make_unique<DeviceBuffer<uint16_t>>(MoePackedGateUpElems(D, I)));
      auto* packed = reinterpret_cast<__nv_bfloat16*>(store.back()->get());
      gu.push_back(packed);
      ASSERT_EQ(MoePackGateUp(w1[e], w3[e], D, I, packed, nullptr), cudaSuccess);
    }
    DeviceBuffer<const __nv_bfloat16*> pgu(gu);
    for (const auto& [name, r] : Routings(E))
      for (bool split : {false, true}) {
        std::vector<float> x = Random(r.N * D, 70, 1.0f);
        DeviceBuffer<uint16_t> dx(split ? ToSplitPlanes(x) : ToBf16(x));
        DeviceBuffer<int32_t> idx(r.idx);
        DeviceBuffer<float> w(r.w);
        auto run = [&](bool packed, MoeGemm gemm, cudaError_t* err) {
          DeviceBuffer<float> out32(r.N * D);
          DeviceBuffer<uint16_t> out(r.N * D);
          MoeExpertsArgs a;
          a.N = r.N, a.D = D, a.I = I, a.top_k = r.k, a.num_experts = E, a.idx = idx.get(), a.w = w.get();
          a.x = reinterpret_cast<const __nv_bfloat16*>(dx.get()), a.x_lo = split ? r.N * D : 0;
          a.w1 = packed ? pgu.get() : ex.p1->get(), a.w3 = packed ? nullptr : ex.p3->get(), a.w2 = ex.p2->get();
          a.packed = packed;
          a.act = GluAct::kSitu, a.situ_beta = 4.0f, a.situ_linear_beta = 25.0f;
          a.out_f32 = out32.get(), a.out = reinterpret_cast<__nv_bfloat16*>(out.get());
          EXPECT_EQ(ws.Reserve(r.N * r.k, D, I, E), cudaSuccess);
          *err = MoeExperts(a, gemm, ws, nullptr);
          EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          std::vector<float> res = out32.ToHost();
          if (!split) {
            res.clear();
            for (uint16_t v : out.ToHost()) res.push_back(Bf16ToFloat(v));
          }
          return res;
        };
        cudaError_t e1, e2, e3;
        const std::vector<float> plain = run(false, MoeGemm::kTiled, &e1), packed = run(true, MoeGemm::kAuto, &e2);
        ASSERT_EQ(e1, cudaSuccess);
        ASSERT_EQ(e2, cudaSuccess);
        EXPECT_EQ(std::memcmp(plain.data(), packed.data(), plain.size() * sizeof(float)), 0)
            << name << " D=" << D << " I=" << I << " split=" << split;
        run(true, MoeGemm::kWgmma, &e3);
        EXPECT_EQ(e3, cudaErrorInvalidValue) << "packed weights: tiled only";
      }
  }
}

TEST(MoeExpertsCuda, ReproducibleAndPathsAgree) {
  REQUIRE_GPU();
  MoeWorkspace ws;
  const Experts ex(8, 256, 128, 200);
  Routing r{300, 4, {}, {}};
  std::mt19937 rng(9);
  for (int64_t i = 0; i < r.N * r.k; ++i) {
    r.idx.push_back(static_cast<int32_t>(rng() % 8));
    r.w.push_back((rng() % 1000) / 1000.0f);
  }
  auto x = Random(r.N * ex.D, 41);
  const auto xb = ToBf16(x);
  for (MoeGemm gemm : {MoeGemm::kTiled, MoeGemm::kCublas, MoeGemm::kWgmma}) {
    const auto a = RunGpu(ex, xb, r, gemm, GluAct::kSitu, ws), b = RunGpu(ex, xb, r, gemm, GluAct::kSitu, ws);
    EXPECT_EQ(a, b) << "gemm=" << static_cast<int>(gemm);
  }
  EXPECT_LT(RelDiff(RunGpu(ex, xb, r, MoeGemm::kTiled, GluAct::kSitu, ws),
                    RunGpu(ex, xb, r, MoeGemm::kCublas, GluAct::kSitu, ws)),
            1e-2);
}

// The wgmma path's persistent grid with several items per CTA (the ring running on across items, which the small
// cases above never reach: they have fewer items than SMs): 4 experts with 1050 / 610 / 280 / 60 pairs (ragged
// last tiles of 26, 98, 24 and 60 slots: three with their second 64-slot half empty), D = I = 2048: 18 tiles,
// 288 gate/up and 144 down items; against cuBLAS, and run to run.
TEST(MoeExpertsCuda, WgmmaManyItemsPerCtaAgreesWithCublas) {
  REQUIRE_GPU();
  MoeWorkspace ws;
  const Experts ex(4, 2048, 2048, 300);
  const int64_t counts[4] = {1050, 610, 280, 60};
  Routing r{1000, 2, {}, {}};
  std::vector<int32_t> pairs;
  for (int32_t e = 0; e < 4; ++e) pairs.insert(pairs.end(), counts[e], e);
  std::mt19937 rng(11);
  std::shuffle(pairs.begin(), pairs.end(), rng);
  r.idx = pairs;
  for (int64_t i = 0; i < r.N * r.k; ++i) r.w.push_back(0.1f + (rng() % 1000) / 1000.0f);
  auto x = Random(r.N * ex.D, 42);
  const auto xb = ToBf16(x);
  for (GluAct act : {GluAct::kSilu, GluAct::kSitu}) {
    const auto ref = RunGpu(ex, xb, r, MoeGemm::kCublas, act, ws);
    const auto a = RunGpu(ex, xb, r, MoeGemm::kWgmma, act, ws), b = RunGpu(ex, xb, r, MoeGemm::kWgmma, act, ws);
    EXPECT_LT(RelDiff(a, ref), 1e-2) << "situ=" << (act == GluAct::kSitu);
    EXPECT_EQ(a, b) << "situ=" << (act == GluAct::kSitu);
  }
}

TEST(MoeExpertsCuda, EmptyBatchAndBadShapes) {
  REQUIRE_GPU();
  MoeWorkspace ws;
  MoeExpertsArgs a;
  a.N = 0, a.D = 64, a.I = 64, a.top_k = 2, a.num_experts = 4;
  EXPECT_EQ(MoeExperts(a, MoeGemm::kAuto, ws, nullptr), cudaSuccess);  // N = 0: nothing to do
  a.D = 60;                                                              // not a multiple of 8
  EXPECT_EQ(MoeExperts(a, MoeGemm::kAuto, ws, nullptr), cudaErrorInvalidValue);
  a.D = 64, a.N = 4;  // no workspace reserved
  EXPECT_EQ(MoeExperts(a, MoeGemm::kTiled, ws, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace k3::cuda

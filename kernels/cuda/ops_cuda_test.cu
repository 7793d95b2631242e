// The GPU engine's kernels against their CPU references (kernels/cpu), on the same bf16 weights. Activations
// are split bf16 (≈ fp32), so most products agree to fp32 accumulation order; where a kernel rounds to plain
// bf16 on the way (MLA keys and values, bf16 outputs) the tolerance says so.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "kernels/cpu/attnres.h"
#include "kernels/cpu/conv.h"
#include "kernels/cpu/experts.h"
#include "kernels/cpu/kda.h"
#include "kernels/cpu/mla.h"
#include "kernels/cpu/norm.h"
#include "kernels/cpu/router.h"
#include "kernels/cuda/attnres.cuh"
#include "kernels/cuda/conv.cuh"
#include "kernels/cuda/kda_small.cuh"
#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/mla.cuh"
#include "kernels/cuda/moe_grouped.cuh"
#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/sampling.cuh"

#include "kernels/cuda/testing.cuh"

namespace k3::cuda {
namespace {


std::vector<float> Randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Rounds to bf16 in place; returns the bf16 bits.
std::vector<uint16_t> ToBf16(std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    b[i] = FloatToBf16(x[i]);
    x[i] = Bf16ToFloat(b[i]);
  }
  return b;
}

// Split planes of x [rows, cols]; x becomes hi + lo (what the GPU sees).
std::vector<uint16_t> ToSplitPlanes(std::vector<float>& x) {
  std::vector<uint16_t> p(2 * x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    p[i] = FloatToBf16(x[i]);
    p[x.size() + i] = FloatToBf16(x[i] - Bf16ToFloat(p[i]));
    x[i] = Bf16ToFloat(p[i]) + Bf16ToFloat(p[x.size() + i]);
  }
  return p;
}

std::vector<float> FromSplit(const std::vector<uint16_t>& p, size_t n) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = Bf16ToFloat(p[i]) + Bf16ToFloat(p[n + i]);
  return x;
}

// max |a − b| / max |b|.
double Rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    d = std::max(d, std::fabs(double(a[i]) - b[i]));
    m = std::max(m, std::fabs(double(b[i])));
  }
  return m == 0 ? d : d / m;
}

// ------------------------------------------------------------------------------------------------ Linear

struct LinearCase {
  int64_t M, N, K;
  bool split;
  LinearOut out;
};

TEST(LinearCuda, DenseMatchesReference) {
  REQUIRE_GPU();
  for (const LinearCase c : {LinearCase{1, 64, 64, true, LinearOut::kF32}, LinearCase{70, 100, 80, true, LinearOut::kF32},
                             LinearCase{9, 37, 48, false, LinearOut::kF32}, LinearCase{130, 256, 384, true, LinearOut::kF32Add},
                             LinearCase{64, 192, 2304, true, LinearOut::kSplit}, LinearCase{5, 40, 32, true, LinearOut::kBf16}}) {
    std::vector<float> w = Randn(c.N * c.K, 1, 1.0f / std::sqrt(float(c.K))), x = Randn(c.M * c.K, 2);
    const std::vector<uint16_t> wb = ToBf16(w);
    const std::vector<uint16_t> xs = c.split ? ToSplitPlanes(x) : ToBf16(x);
    std::vector<float> y0 = Randn(c.M * c.N, 3), ref(c.M * c.N);
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t n = 0; n < c.N; ++n) {
        double acc = c.out == LinearOut::kF32Add ? y0[m * c.N + n] : 0.0;
        for (int64_t k = 0; k < c.K; ++k) acc += double(w[n * c.K + k]) * x[m * c.K + k];
        ref[m * c.N + n] = static_cast<float>(acc);
      }
    DeviceBuffer<uint16_t> dw(wb), dx(xs), dyb(2 * c.M * c.N);
    DeviceBuffer<float> dy(y0);
    LinearArgs a;
    a.N = c.N, a.K = c.K, a.w = dw.bf();
    a.x = Split{dx.bf(), c.K, c.split ? c.M * c.K : 0};
    const bool f32 = c.out == LinearOut::kF32 || c.out == LinearOut::kF32Add;
    a.y = f32 ? static_cast<void*>(dy.get()) : static_cast<void*>(dyb.get());
    a.ldy = c.N, a.y_lo = c.M * c.N, a.out = c.out, a.M = c.M;
    CUDA_OK(Linear(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got;
    if (f32) {
      got = dy.ToHost();
    } else if (c.out == LinearOut::kSplit) {
      got = FromSplit(dyb.ToHost(), c.M * c.N);
    } else {
      const auto h = dyb.ToHost();
      for (int64_t i = 0; i < c.M * c.N; ++i) got.push_back(Bf16ToFloat(h[i]));
    }
    const double tol = c.out == LinearOut::kBf16 ? 8e-3 : c.split ? 2e-5 : 2e-5;
    EXPECT_LT(Rel(got, ref), tol) << "M " << c.M << " N " << c.N << " K " << c.K;
  }
}

// The routed experts (pairs sorted by expert, GLU product, down product, weighted sum) against
// k3::cpu::MoeExperts on the same bf16 weights, SiLU and SiTU.
TEST(LinearCuda, GroupedExpertsMatchCpu) {
  REQUIRE_GPU();
  const int64_t N = 37, D = 128, I = 48, E = 16, k = 4;
  for (const auto act : {cpu::GluAct::kSilu, cpu::GluAct::kSitu}) {
    std::vector<float> w1 = Randn(E * I * D, 4, 0.09f), w3 = Randn(E * I * D, 5, 0.09f), w2 = Randn(E * D * I, 6, 0.15f);
    ToBf16(w1), ToBf16(w3), ToBf16(w2);
    std::vector<float> x = Randn(N * D, 7);
    const std::vector<uint16_t> xs = ToSplitPlanes(x);
    std::vector<int32_t> idx(N * k);
    std::vector<float> wt = Randn(N * k, 8, 0.5f);
    std::mt19937 rng(9);
    for (int64_t n = 0; n < N; ++n) {
      std::vector<int32_t> e(E);
      std::iota(e.begin(), e.end(), 0);
      std::shuffle(e.begin(), e.end(), rng);
      for (int64_t j = 0; j < k; ++j) idx[n * k + j] = (n + j) % 7 == 0 ? -1 : e[j];  // some pairs routed elsewhere
    }
    // Stacked device layout: w13 [E][2I][D], w2 [E][D][I].
    std::vector<float> w13(E * 2 * I * D);
    for (int64_t e = 0; e < E; ++e) {
      std::copy_n(w1.begin() + e * I * D, I * D, w13.begin() + e * 2 * I * D);
      std::copy_n(w3.begin() + e * I * D, I * D, w13.begin() + e * 2 * I * D + I * D);
    }
    DeviceBuffer<uint16_t> d13(ToBf16(w13)), d2(ToBf16(w2)), dx(xs);
    DeviceBuffer<int32_t> didx(idx), hits(1);
    DeviceBuffer<float> dw(wt), out(N * D);
    DeviceBuffer<char> ws(GroupedExpertsWorkspaceBytes(N, k, E, D, I));
    const cpu::GluParams gp{act, 4.0f, 25.0f};
    CUDA_OK(GroupedExperts(N, k, Split{dx.bf(), D, N * D}, didx.get(), dw.get(), ExpertStack{d13.bf(), d2.bf(), E, D, I},
                           act == cpu::GluAct::kSilu ? LinearAct::kSilu : LinearAct::kSitu, gp.situ_beta,
                           gp.situ_linear_beta, out.get(), hits.get(), ws.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<cpu::ExpertWeights> ew(E);
    for (int64_t e = 0; e < E; ++e) ew[e] = {w1.data() + e * I * D, w3.data() + e * I * D, w2.data() + e * D * I};
    std::vector<float> ref(N * D);
    cpu::MoeExperts(N, D, I, k, x.data(), idx.data(), wt.data(), E, ew.data(), gp, ref.data());
    EXPECT_LT(Rel(out.ToHost(), ref), 1e-4);
    std::vector<int> used(E, 0);
    for (int32_t e : idx)
      if (e >= 0) used[e] = 1;
    EXPECT_EQ(hits.ToHost()[0], std::accumulate(used.begin(), used.end(), 0));
  }
}

TEST(RouterCuda, SelectExpertsMatchesCpu) {
  REQUIRE_GPU();
  const int64_t N = 50;
  for (const cpu::RouterParams p : {cpu::RouterParams{16, 4, 1, 1, true, 2.446f}, cpu::RouterParams{256, 8, 8, 4, true, 1.0f},
                                    cpu::RouterParams{64, 6, 1, 1, false, 1.5f}}) {
    const std::vector<float> logits = Randn(N * p.num_experts, 10, 2.0f), bias = Randn(p.num_experts, 11, 0.1f);
    std::vector<int32_t> idx(N * p.top_k);
    std::vector<float> w(N * p.top_k);
    cpu::RouteTopK(N, logits.data(), bias.data(), p, idx.data(), w.data());
    DeviceBuffer<float> dl(logits), db(bias), dw(N * p.top_k);
    DeviceBuffer<int32_t> di(N * p.top_k);
    CUDA_OK(SelectExperts(N, RouterDims{p.num_experts, p.top_k, p.num_groups, p.topk_groups, p.renormalize, p.scale},
                          dl.get(), db.get(), di.get(), dw.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(di.ToHost(), idx);
    EXPECT_LT(Rel(dw.ToHost(), w), 1e-6);
  }
}

// ------------------------------------------------------------------------------------------------ norms

TEST(NormCuda, RmsNormAndGatedMatchCpu) {
  REQUIRE_GPU();
  const int64_t M = 33, D = 2304, H = 7, Dh = 128;
  const std::vector<float> x = Randn(M * D, 12, 3.0f), w = Randn(D, 13);
  std::vector<float> ref(M * D);
  cpu::RmsNormRef(M, D, x.data(), w.data(), 1e-5f, ref.data());
  DeviceBuffer<float> dx(x), dw(w);
  DeviceBuffer<uint16_t> dy(2 * M * D);
  CUDA_OK(RmsNorm(M, D, dx.get(), D, nullptr, dw.get(), 1e-5f, Split{dy.bf(), D, M * D}, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(Rel(FromSplit(dy.ToHost(), M * D), ref), 1e-5);

  std::vector<float> o = Randn(M * H * Dh, 14), gate = Randn(M * H * Dh, 15), gw = Randn(Dh, 16), gref(M * H * Dh);
  ToBf16(o);
  cpu::GatedRmsNormRef(M * H, Dh, o.data(), gate.data(), gw.data(), 1e-5f, gref.data());
  DeviceBuffer<uint16_t> dob(ToBf16(o)), dg2(2 * M * H * Dh);
  DeviceBuffer<float> dof(o), dg(gate), dgw(gw);
  DeviceBuffer<uint16_t> dgy(2 * M * H * Dh);
  CUDA_OK(GatedRmsNorm(M * H, Dh, dob.bf(), dg.get(), dgw.get(), 1e-5f, Split{dgy.bf(), Dh, M * H * Dh}, nullptr));
  CUDA_OK(GatedRmsNorm(M * H, Dh, dof.get(), dg.get(), dgw.get(), 1e-5f, Split{dg2.bf(), Dh, M * H * Dh}, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(Rel(FromSplit(dgy.ToHost(), M * H * Dh), gref), 1e-5);
  EXPECT_LT(Rel(FromSplit(dg2.ToHost(), M * H * Dh), gref), 1e-5);
}

// ------------------------------------------------------------------------------------------------- conv

// Three chunks (a prefill longer than the window, a decode token, a chunk shorter than the state) against
// the CPU conv with the same states.
TEST(ConvCuda, RaggedChunksWithStateMatchCpu) {
  REQUIRE_GPU();
  const int64_t C = 3 * 40, K = 4, S = K - 1;
  const std::vector<int32_t> len = {9, 1, 2}, slot = {2, 0, 3};
  const int64_t N = 12, slots = 4;
  std::vector<float> x = Randn(N * C, 17), w = Randn(C * K, 18, 0.5f), state = Randn(slots * S * C, 19);
  const std::vector<uint16_t> xs = ToSplitPlanes(x);
  std::vector<int32_t> start = {0, 9, 10}, tok_start, tok_slot;
  for (size_t c = 0; c < len.size(); ++c)
    for (int32_t t = 0; t < len[c]; ++t) tok_start.push_back(start[c]), tok_slot.push_back(slot[c]);
  DeviceBuffer<uint16_t> dx(xs);
  DeviceBuffer<float> dw(w), dstate(state), q(N * C / 3), k(N * C / 3), v(N * C / 3);
  DeviceBuffer<int32_t> dts(tok_start), dtslot(tok_slot), dcs(start), dcl(len), dcslot(slot);
  KdaConvArgs a;
  a.N = N, a.C = C, a.K = K, a.x = Split{dx.bf(), C, N * C}, a.w = dw.get(), a.state = dstate.get();
  a.tok_start = dts.get(), a.tok_slot = dtslot.get(), a.out[0] = q.get(), a.out[1] = k.get(), a.out[2] = v.get();
  a.out_bf16 = false;
  CUDA_OK(KdaConv(a, nullptr));
  CUDA_OK(KdaConvUpdateState(a, 3, dcs.get(), dcl.get(), dcslot.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> ref(N * C), ref_state = state;
  for (size_t c = 0; c < len.size(); ++c)
    cpu::CausalConv1dSiluRef(len[c], C, K, x.data() + start[c] * C, w.data(), ref_state.data() + slot[c] * S * C,
                             ref.data() + start[c] * C);
  const auto hq = q.ToHost(), hk = k.ToHost(), hv = v.ToHost();
  std::vector<float> got(N * C);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < C; ++c) {
      const auto& part = c < C / 3 ? hq : c < 2 * C / 3 ? hk : hv;
      got[t * C + c] = part[t * (C / 3) + c % (C / 3)];
    }
  EXPECT_LT(Rel(got, ref), 1e-5);
  EXPECT_LT(Rel(dstate.ToHost(), ref_state), 1e-6);
}

// ------------------------------------------------------------------------------------------------ KDA

TEST(KdaSmallCuda, RecurrenceMatchesCpu) {
  REQUIRE_GPU();
  const int64_t H = 3, D = 32, HD = H * D, slots = 4;
  const std::vector<int32_t> len = {70, 1, 5}, start = {0, 70, 71}, slot = {1, 3, 0};
  const int64_t N = 76;
  for (const KdaGate gate : {KdaGate::kSoftplus, KdaGate::kBounded}) {
    const std::vector<float> q = Randn(N * HD, 20), k = Randn(N * HD, 21), v = Randn(N * HD, 22), g = Randn(N * HD, 23),
                             b = Randn(N * H, 24), state = Randn(slots * H * D * D, 25, 0.3f);
    std::vector<float> A_log(H), dt_bias = Randn(HD, 26, 0.5f);
    for (int64_t h = 0; h < H; ++h) A_log[h] = std::log(1.0f + 3.0f * h);
    DeviceBuffer<float> dq(q), dk(k), dv(v), dg(g), db(b), dA(A_log), ddt(dt_bias), dstate(state), dout(N * HD);
    DeviceBuffer<int32_t> ds(start), dl(len), dslot(slot);
    KdaSmallArgs a;
    a.H = H, a.D = D, a.q = dq.get(), a.k = dk.get(), a.v = dv.get(), a.g_raw = dg.get(), a.b = db.get();
    a.A_log = dA.get(), a.dt_bias = ddt.get(), a.gate = gate, a.lower_bound = -5.0f, a.state = dstate.get();
    a.o = dout.get(), a.num_chunks = 3, a.ch_start = ds.get(), a.ch_len = dl.get(), a.ch_slot = dslot.get();
    CUDA_OK(KdaSmall(a, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> ref(N * HD), ref_state = state;
    for (int c = 0; c < 3; ++c) {
      const int64_t T = len[c], o0 = start[c];
      std::vector<float> qc(q.begin() + o0 * HD, q.begin() + (o0 + T) * HD), kc(k.begin() + o0 * HD, k.begin() + (o0 + T) * HD);
      std::vector<float> gc(T * HD), bc(b.begin() + o0 * H, b.begin() + (o0 + T) * H);
      if (gate == KdaGate::kSoftplus) {
        cpu::KdaGateSoftplus(T, H, D, g.data() + o0 * HD, A_log.data(), dt_bias.data(), gc.data());
      } else {
        cpu::KdaGateBounded(T, H, D, g.data() + o0 * HD, A_log.data(), dt_bias.data(), -5.0f, gc.data());
      }
      for (auto& x : bc) x = 1.0f / (1.0f + std::exp(-x));
      cpu::KdaNormalizeQK(T, H, D, qc.data(), kc.data());
      cpu::KdaRecurrent(T, H, D, D, qc.data(), kc.data(), v.data() + o0 * HD, gc.data(), bc.data(),
                        ref_state.data() + slot[c] * H * D * D, ref.data() + o0 * HD);
    }
    EXPECT_LT(Rel(dout.ToHost(), ref), 1e-5);
    EXPECT_LT(Rel(dstate.ToHost(), ref_state), 1e-5);
  }
}

// ------------------------------------------------------------------------------------------------- MLA

struct MlaProblem {
  MlaDims s;
  std::vector<float> q, cache, kv_b;  // q [T, nh·dqk] (split-exact), cache [L, cw] (bf16-exact), kv_b bf16-exact
  std::vector<uint16_t> qs, cache_b, kv_bb;
};

MlaProblem MakeMla(const MlaDims& s, int64_t T, int64_t L, uint32_t seed) {
  MlaProblem p;
  p.s = s;
  p.q = Randn(T * s.nh * s.dqk(), seed, 0.3f);
  p.cache = Randn(L * s.cw(), seed + 1);
  p.kv_b = Randn(s.nh * s.dkv() * s.r, seed + 2, 1.0f / std::sqrt(float(s.r)));
  p.qs = ToSplitPlanes(p.q);
  p.cache_b = ToBf16(p.cache);
  p.kv_bb = ToBf16(p.kv_b);
  return p;
}

// Prefill (expanded) of T tokens after P cached ones; decode (absorbed) of one token per sequence.
TEST(MlaCuda, PrefillAndDecodeMatchReference) {
  REQUIRE_GPU();
  for (const MlaDims s : {MlaDims{4, 32, 16, 32, 32}, MlaDims{32, 128, 64, 128, 512}}) {
    const int64_t P = 37, T = 90, L = P + T;
    const float scale = 1.0f / std::sqrt(float(s.dqk()));
    const cpu::MlaShape cs{s.nh, s.dn, s.dr, s.dv, s.r};
    MlaProblem p = MakeMla(s, T, L, 30);
    std::vector<float> ref(T * s.nh * s.dv);
    cpu::MlaAttentionRef(T, P, cs, p.q.data(), p.cache.data(), p.kv_b.data(), scale, ref.data());
    DeviceBuffer<uint16_t> dq(p.qs), dcache(p.cache_b), dkv(p.kv_bb), dout(2 * T * s.nh * s.dv);
    const int64_t Tq = 64;  // two query tiles
    DeviceBuffer<char> ws(MlaPrefillWorkspaceBytes(s, L, Tq));
    CUDA_OK(MlaPrefill(s, T, P, Split{dq.bf(), s.nh * s.dqk(), T * s.nh * s.dqk()}, dcache.bf(), dkv.bf(), scale,
                       Split{dout.bf(), s.nh * s.dv, T * s.nh * s.dv}, Tq, ws.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_LT(Rel(FromSplit(dout.ToHost(), T * s.nh * s.dv), ref), 1e-2) << "prefill nh " << s.nh;

    // Decode: three sequences in slots 1, 0, 2 of a pool of max_ctx rows, at positions 0, 20, L − 1.
    const int64_t max_ctx = L + 3, N = 3;
    const std::vector<int32_t> slot = {1, 0, 2}, pos = {0, 20, static_cast<int32_t>(L - 1)};
    std::vector<uint16_t> pool(3 * max_ctx * s.cw());
    for (int64_t sl = 0; sl < 3; ++sl) std::copy(p.cache_b.begin(), p.cache_b.end(), pool.begin() + sl * max_ctx * s.cw());
    MlaProblem d = MakeMla(s, N, 1, 40);
    std::vector<float> dref(N * s.nh * s.dv);
    for (int64_t n = 0; n < N; ++n)
      cpu::MlaAttentionRef(1, pos[n], cs, d.q.data() + n * s.nh * s.dqk(), p.cache.data(), p.kv_b.data(), scale,
                           dref.data() + n * s.nh * s.dv);
    DeviceBuffer<uint16_t> dqd(d.qs), dpool(pool), dukt(s.nh * s.r * s.dn), dod(2 * N * s.nh * s.dv);
    DeviceBuffer<int32_t> dslot(slot), dpos(pos);
    DeviceBuffer<char> wsd(MlaDecodeWorkspaceBytes(s, N));
    CUDA_OK(MlaTransposeUk(s, dkv.bf(), dukt.bf(), nullptr));
    CUDA_OK(MlaDecode(N, s, Split{dqd.bf(), s.nh * s.dqk(), N * s.nh * s.dqk()}, dpool.bf(), max_ctx, dslot.get(),
                      dpos.get(), dkv.bf(), dukt.bf(), scale, Split{dod.bf(), s.nh * s.dv, N * s.nh * s.dv}, wsd.get(),
                      nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_LT(Rel(FromSplit(dod.ToHost(), N * s.nh * s.dv), dref), 2e-3) << "decode nh " << s.nh;
  }
}

TEST(MlaCuda, CacheAppendNormalizes) {
  REQUIRE_GPU();
  const MlaDims s{4, 32, 16, 32, 64};
  const int64_t N = 3, max_ctx = 8;
  std::vector<float> c = Randn(N * s.cw(), 50, 2.0f), w = Randn(s.r, 51);
  const std::vector<uint16_t> cs = ToSplitPlanes(c);
  const std::vector<int32_t> slot = {1, 1, 0}, pos = {4, 5, 0};
  DeviceBuffer<uint16_t> dc(cs), cache(2 * max_ctx * s.cw());
  DeviceBuffer<float> dw(w);
  DeviceBuffer<int32_t> dslot(slot), dpos(pos);
  CUDA_OK(MlaCacheAppend(N, s, Split{dc.bf(), s.cw(), N * s.cw()}, dw.get(), 1e-6f, dslot.get(), dpos.get(), cache.bf(),
                         max_ctx, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto h = cache.ToHost();
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> ref(s.cw()), got(s.cw());
    cpu::RmsNormRef(1, s.r, c.data() + n * s.cw(), w.data(), 1e-6f, ref.data());
    std::copy_n(c.begin() + n * s.cw() + s.r, s.dr, ref.begin() + s.r);
    for (int64_t i = 0; i < s.cw(); ++i) got[i] = Bf16ToFloat(h[(slot[n] * max_ctx + pos[n]) * s.cw() + i]);
    EXPECT_LT(Rel(got, ref), 4e-3);
  }
}

// -------------------------------------------------------------------------------------------- AttnRes

TEST(AttnResCuda, NaiveReadMatchesCpu) {
  REQUIRE_GPU();
  const int64_t N = 5, d = 256;
  for (const int64_t m : {0, 1, 3}) {
    const std::vector<float> bank = Randn(m * N * d + 1, 60), partial = Randn(N * d, 61), w = Randn(d, 62, 0.05f),
                             n = Randn(d, 63);
    std::vector<const float*> src;
    for (int64_t j = 0; j < m; ++j) src.push_back(bank.data() + j * N * d);
    src.push_back(partial.data());
    std::vector<float> ref(N * d);
    cpu::AttnResRead(N, d, src.data(), m + 1, w.data(), n.data(), 1e-5f, ref.data());
    DeviceBuffer<float> db(bank), dp(partial), dw(w), dn(n), out(N * d);
    CUDA_OK(AttnResRead(N, d, db.get(), N * d, m, dp.get(), dw.get(), dn.get(), 1e-5f, out.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_LT(Rel(out.ToHost(), ref), 1e-5) << "m " << m;
  }
}

// ------------------------------------------------------------------------------------------- sampling

TEST(SamplingCuda, ArgmaxTakesLowestIdOnTies) {
  REQUIRE_GPU();
  const int64_t R = 3, V = 163840;
  std::vector<float> l = Randn(R * V, 70);
  l[5] = 50.0f, l[77] = 50.0f;                   // row 0: tie → 5
  l[V + V - 1] = 60.0f;                          // row 1: last id
  l[2 * V + 1000] = 9.0f, l[2 * V + 999] = 9.0f;  // row 2: tie → 999
  DeviceBuffer<float> dl(l);
  DeviceBuffer<int32_t> ids(R);
  CUDA_OK(Argmax(R, V, dl.get(), ids.get(), nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(ids.ToHost(), (std::vector<int32_t>{5, static_cast<int32_t>(V - 1), 999}));
}

}  // namespace
}  // namespace k3::cuda

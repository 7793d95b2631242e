// GPU KDA (decode and chunked prefill) against the CPU reference (kernels/cpu/kda.h) on the same
// bf16-rounded inputs. The reference is fp32 throughout; the GPU decode is fp32 too (bf16 only in o), the
// prefill runs its chunk products on bf16 tensor cores (state and accumulation fp32), hence the tolerances.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "kernels/cpu/kda.h"
#include "kernels/cuda/kda.cuh"

#include "kernels/cuda/testing.cuh"

namespace k3::cuda {
namespace {

constexpr uint16_t kPoison = 0x7fc1;  // a bf16 NaN: every o row the kernels own must be overwritten


enum class GateRange {
  kMild,    // the trained-model range: per-token decays e^g mostly in (0.2, 1)
  kStrong,  // g of −10 and below: factored diagonal blocks overflow, the elementwise fallback runs
};

struct Problem {
  int64_t H = 0, D = 0;
  KdaGate gate = KdaGate::kSoftplus;
  float lower_bound = -5.0f;
  std::vector<int32_t> cu;  // cu_seqlens
  std::vector<uint16_t> q, k, v, g, b;
  std::vector<float> A_log, dt_bias;
  std::vector<float> state;  // pool [slots][H][D][D]
  std::vector<int32_t> slot;
  std::vector<uint8_t> has_init;
  int64_t T() const { return cu.back(); }
  int64_t N() const { return static_cast<int64_t>(cu.size()) - 1; }
};

enum class Init { kNone, kAll, kMixed };

Problem MakeProblem(uint32_t seed, int64_t H, int64_t D, const std::vector<int32_t>& lens, KdaGate gate,
                    GateRange range, Init init) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  Problem p;
  p.H = H, p.D = D, p.gate = gate;
  p.cu.assign(1, 0);
  for (int32_t l : lens) p.cu.push_back(p.cu.back() + l);
  const int64_t T = p.T(), N = p.N();
  auto fill = [&](std::vector<uint16_t>& x, size_t n, float scale, float shift) {
    x.resize(n);
    for (auto& e : x) e = FloatToBf16(shift + scale * normal(rng));
  };
  fill(p.q, T * H * D, 1.0f, 0.0f);
  fill(p.k, T * H * D, 1.0f, 0.0f);
  fill(p.v, T * H * D, 1.0f, 0.0f);
  fill(p.b, T * H, 1.5f, 0.0f);
  const bool strong = range == GateRange::kStrong;
  fill(p.g, T * H * D, strong ? 2.0f : 1.0f, strong ? 2.0f : 0.0f);
  p.A_log.resize(H);
  for (auto& a : p.A_log) a = std::log(strong ? 8.0f + 8.0f * uni(rng) : 1.0f + 15.0f * uni(rng));
  p.dt_bias.resize(H * D);
  for (auto& d : p.dt_bias) {
    // Mamba-style init: softplus(dt_bias) = dt ∈ [1e-3, 1e-1], log-uniform.
    const float dt = std::exp(std::log(1e-3f) + uni(rng) * (std::log(1e-1f) - std::log(1e-3f)));
    d = strong ? 1.0f + 2.0f * uni(rng) : std::log(std::expm1(dt));
  }
  // Two spare slots that no sequence owns: they must come back untouched.
  const int64_t slots = N + 2;
  p.state.resize(slots * H * D * D);
  for (auto& s : p.state) s = 0.3f * normal(rng);
  p.slot.resize(N);
  std::iota(p.slot.begin(), p.slot.end(), 1);
  std::shuffle(p.slot.begin(), p.slot.end(), rng);
  p.has_init.resize(N);
  for (int64_t n = 0; n < N; ++n) p.has_init[n] = init == Init::kAll || (init == Init::kMixed && n % 2 == 0);
  return p;
}

std::vector<float> ToFloat(const std::vector<uint16_t>& x, size_t begin, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = Bf16ToFloat(x[begin + i]);
  return f;
}

// The reference: o [T][H][D] and the pool after every sequence's final state was written.
void Reference(const Problem& p, bool use_init, std::vector<float>* o, std::vector<float>* pool) {
  const int64_t H = p.H, D = p.D, hd = H * D;
  o->assign(p.T() * hd, 0.0f);
  *pool = p.state;
  for (int64_t n = 0; n < p.N(); ++n) {
    const int64_t bos = p.cu[n], T = p.cu[n + 1] - bos;
    std::vector<float> q = ToFloat(p.q, bos * hd, T * hd), k = ToFloat(p.k, bos * hd, T * hd);
    std::vector<float> v = ToFloat(p.v, bos * hd, T * hd), g = ToFloat(p.g, bos * hd, T * hd);
    std::vector<float> beta = ToFloat(p.b, bos * H, T * H);
    for (auto& x : beta) x = 1.0f / (1.0f + std::exp(-x));
    if (p.gate == KdaGate::kSoftplus)
      cpu::KdaGateSoftplus(T, H, D, g.data(), p.A_log.data(), p.dt_bias.data(), g.data());
    else
      cpu::KdaGateBounded(T, H, D, g.data(), p.A_log.data(), p.dt_bias.data(), p.lower_bound, g.data());
    cpu::KdaNormalizeQK(T, H, D, q.data(), k.data());
    float* S = pool->data() + p.slot[n] * H * D * D;
    if (!(use_init && p.has_init[n])) std::fill(S, S + H * D * D, 0.0f);
    cpu::KdaRecurrent(T, H, D, D, q.data(), k.data(), v.data(), g.data(), beta.data(), S, o->data() + bos * hd);
  }
}

struct Err {
  double rel = 0;      // ‖x − ref‖ / ‖ref‖
  bool finite = true;  // no NaN or inf anywhere in x
};

Err Compare(const std::vector<float>& x, const std::vector<float>& ref) {
  double num = 0, den = 0;
  Err e;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) e.finite = false;
    num += (double(x[i]) - ref[i]) * (double(x[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  e.rel = std::sqrt(num / std::max(den, 1e-30));
  return e;
}

KdaArgs Args(const Problem& p, const DeviceBuffer<uint16_t>& q, const DeviceBuffer<uint16_t>& k,
             const DeviceBuffer<uint16_t>& v, const DeviceBuffer<uint16_t>& g, const DeviceBuffer<uint16_t>& b,
             const DeviceBuffer<float>& A_log, const DeviceBuffer<float>& dt_bias, DeviceBuffer<float>& state,
             const DeviceBuffer<int32_t>& slot, DeviceBuffer<uint16_t>& o) {
  KdaArgs a;
  a.H = p.H, a.D = p.D, a.gate = p.gate, a.lower_bound = p.lower_bound;
  a.q = reinterpret_cast<const __nv_bfloat16*>(q.get());
  a.k = reinterpret_cast<const __nv_bfloat16*>(k.get());
  a.v = reinterpret_cast<const __nv_bfloat16*>(v.get());
  a.g_raw = reinterpret_cast<const __nv_bfloat16*>(g.get());
  a.b = reinterpret_cast<const __nv_bfloat16*>(b.get());
  a.A_log = A_log.get(), a.dt_bias = dt_bias.get(), a.state = state.get(), a.state_idx = slot.get();
  a.o = reinterpret_cast<__nv_bfloat16*>(o.get());
  return a;
}

// Runs the prefill (init: pass has_initial_state) and returns o (as float) and the pool.
void RunPrefill(const Problem& p, bool use_init, std::vector<float>* o, std::vector<float>* pool) {
  DeviceBuffer<uint16_t> q(p.q), k(p.k), v(p.v), g(p.g), b(p.b), out(std::vector<uint16_t>(p.q.size(), kPoison));
  DeviceBuffer<float> A_log(p.A_log), dt_bias(p.dt_bias), state(p.state);
  DeviceBuffer<int32_t> slot(p.slot), cu(p.cu);
  DeviceBuffer<uint8_t> has_init(p.has_init);
  KdaPrefillBatch batch;
  batch.num_seqs = p.N();
  batch.cu_seqlens = cu.get();
  batch.has_initial_state = use_init ? has_init.get() : nullptr;
  batch.num_chunks = KdaNumChunks(p.cu.data(), p.N());
  DeviceBuffer<unsigned char> ws(KdaPrefillWorkspaceBytes(batch.num_chunks, p.H, p.D));
  batch.workspace = ws.get();
  CUDA_OK(KdaPrefill(Args(p, q, k, v, g, b, A_log, dt_bias, state, slot, out), batch, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> ob = out.ToHost();
  *o = ToFloat(ob, 0, ob.size());
  *pool = state.ToHost();
}

struct PrefillCase {
  int64_t D;
  std::vector<int32_t> lens;
  KdaGate gate;
  GateRange range;
  Init init;
};

void CheckPrefill(const PrefillCase& c, uint32_t seed) {
  const Problem p = MakeProblem(seed, 3, c.D, c.lens, c.gate, c.range, c.init);
  std::vector<float> o, pool, o_ref, pool_ref;
  const bool use_init = c.init != Init::kNone;
  Reference(p, use_init, &o_ref, &pool_ref);
  RunPrefill(p, use_init, &o, &pool);
  if (::testing::Test::HasFatalFailure()) return;
  const Err eo = Compare(o, o_ref), es = Compare(pool, pool_ref);
  std::printf("  D=%ld T=%ld seqs=%ld: o rel %.2e, state rel %.2e\n", static_cast<long>(c.D), static_cast<long>(p.T()),
              static_cast<long>(p.N()), eo.rel, es.rel);
  EXPECT_TRUE(eo.finite) << "o has NaN/inf (a row left unwritten?)";
  EXPECT_TRUE(es.finite);
  EXPECT_LT(eo.rel, 1e-2);
  EXPECT_LT(es.rel, 1e-2);
  // The spare slots (0 and N + 1) are nobody's: bit-identical.
  const size_t per_slot = p.H * p.D * p.D;
  for (size_t i = 0; i < per_slot; ++i) {
    ASSERT_EQ(pool[i], p.state[i]);
    ASSERT_EQ(pool[(p.N() + 1) * per_slot + i], p.state[(p.N() + 1) * per_slot + i]);
  }
}

class KdaPrefillTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(KdaPrefillTest, SingleTokenAndChunkEdges) {
  REQUIRE_GPU();
  const int64_t D = GetParam();
  uint32_t seed = 1;
  for (int32_t T : {1, 17, 63, 64, 65, 128, 200}) {
    SCOPED_TRACE(T);
    CheckPrefill({D, {T}, KdaGate::kSoftplus, GateRange::kMild, Init::kNone}, seed++);
    CheckPrefill({D, {T}, KdaGate::kSoftplus, GateRange::kMild, Init::kAll}, seed++);
  }
}

TEST_P(KdaPrefillTest, RaggedBatchWithEmptySequences) {
  REQUIRE_GPU();
  const int64_t D = GetParam();
  CheckPrefill({D, {65, 130, 0, 1, 200, 64, 0, 7}, KdaGate::kSoftplus, GateRange::kMild, Init::kMixed}, 11);
  CheckPrefill({D, {0}, KdaGate::kSoftplus, GateRange::kMild, Init::kAll}, 12);
  CheckPrefill({D, {0, 0}, KdaGate::kSoftplus, GateRange::kMild, Init::kNone}, 13);
}

TEST_P(KdaPrefillTest, BoundedGate) {
  REQUIRE_GPU();
  const int64_t D = GetParam();
  CheckPrefill({D, {300, 33}, KdaGate::kBounded, GateRange::kMild, Init::kMixed}, 21);
  // Gate at its floor (−5 per token): the factored diagonal blocks reach 2^108 and must stay exact.
  CheckPrefill({D, {300, 33}, KdaGate::kBounded, GateRange::kStrong, Init::kMixed}, 22);
}

TEST_P(KdaPrefillTest, StrongGateTakesTheElementwiseFallback) {
  REQUIRE_GPU();
  const int64_t D = GetParam();
  CheckPrefill({D, {300, 100}, KdaGate::kSoftplus, GateRange::kStrong, Init::kAll}, 31);
}

TEST_P(KdaPrefillTest, LongSequence) {
  REQUIRE_GPU();
  CheckPrefill({GetParam(), {1000}, KdaGate::kSoftplus, GateRange::kMild, Init::kAll}, 41);
}

INSTANTIATE_TEST_SUITE_P(D, KdaPrefillTest, ::testing::Values(64, 128));

TEST(KdaPrefill, EmptyBatchIsANoOp) {
  REQUIRE_GPU();
  KdaArgs a;
  a.H = 1, a.D = 128;
  KdaPrefillBatch batch;  // num_seqs = 0
  EXPECT_EQ(KdaPrefill(a, batch, nullptr), cudaErrorInvalidValue);  // null tensors are still an error
  DeviceBuffer<uint16_t> x(1);
  DeviceBuffer<float> f(1);
  DeviceBuffer<int32_t> i(1);
  a.q = a.k = a.v = a.g_raw = a.b = reinterpret_cast<const __nv_bfloat16*>(x.get());
  a.o = reinterpret_cast<__nv_bfloat16*>(x.get());
  a.A_log = a.dt_bias = a.state = f.get();
  a.state_idx = i.get();
  EXPECT_EQ(KdaPrefill(a, batch, nullptr), cudaSuccess);
  EXPECT_EQ(KdaDecode(a, 0, nullptr), cudaSuccess);
  a.D = 96;
  EXPECT_EQ(KdaDecode(a, 1, nullptr), cudaErrorInvalidValue);
}

// Decode: one token per sequence; slot −1 rows are padding and must be left alone.
void CheckDecode(int64_t D, int64_t N, KdaGate gate, GateRange range, uint32_t seed) {
  Problem p = MakeProblem(seed, 3, D, std::vector<int32_t>(N, 1), gate, range, Init::kAll);
  std::vector<int32_t> gpu_slot = p.slot;
  for (int64_t n = 2; n < N; n += 5) gpu_slot[n] = -1;
  std::vector<float> o_ref, pool_ref;
  Reference(p, true, &o_ref, &pool_ref);

  DeviceBuffer<uint16_t> q(p.q), k(p.k), v(p.v), g(p.g), b(p.b), out(std::vector<uint16_t>(p.q.size(), kPoison));
  DeviceBuffer<float> A_log(p.A_log), dt_bias(p.dt_bias), state(p.state);
  DeviceBuffer<int32_t> slot(gpu_slot);
  CUDA_OK(KdaDecode(Args(p, q, k, v, g, b, A_log, dt_bias, state, slot, out), N, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> ob = out.ToHost();
  const std::vector<float> pool = state.ToHost();

  const int64_t hd = p.H * D, per_slot = p.H * D * D;
  std::vector<float> o, o_r, s, s_r;
  for (int64_t n = 0; n < N; ++n) {
    if (gpu_slot[n] < 0) {
      for (int64_t i = 0; i < hd; ++i) ASSERT_EQ(ob[n * hd + i], kPoison) << "padding row " << n << " written";
      for (int64_t i = 0; i < per_slot; ++i) ASSERT_EQ(pool[p.slot[n] * per_slot + i], p.state[p.slot[n] * per_slot + i]);
      continue;
    }
    for (int64_t i = 0; i < hd; ++i) o.push_back(Bf16ToFloat(ob[n * hd + i])), o_r.push_back(o_ref[n * hd + i]);
    for (int64_t i = 0; i < per_slot; ++i)
      s.push_back(pool[p.slot[n] * per_slot + i]), s_r.push_back(pool_ref[p.slot[n] * per_slot + i]);
  }
  const Err eo = Compare(o, o_r), es = Compare(s, s_r);
  std::printf("  decode D=%ld N=%ld: o rel %.2e, state rel %.2e\n", static_cast<long>(D), static_cast<long>(N), eo.rel,
              es.rel);
  EXPECT_TRUE(eo.finite && es.finite);
  EXPECT_LT(eo.rel, 5e-3);  // bf16 rounding of o
  EXPECT_LT(es.rel, 2e-5);  // fp32 state
}

TEST(KdaDecode, MatchesRecurrence) {
  REQUIRE_GPU();
  uint32_t seed = 100;
  for (int64_t D : {64, 128})
    for (int64_t N : {1, 37}) {
      SCOPED_TRACE(testing::Message() << "D=" << D << " N=" << N);
      CheckDecode(D, N, KdaGate::kSoftplus, GateRange::kMild, seed++);
      CheckDecode(D, N, KdaGate::kSoftplus, GateRange::kStrong, seed++);
      CheckDecode(D, N, KdaGate::kBounded, GateRange::kMild, seed++);
    }
}

// g_raw as a product's unfolded sums (hi rows, lo rows N further, rows padded to ld) gives the decode exactly what
// g_raw = bf16(hi + lo) gives it: the same o and state, bit for bit; padding rows stay untouched.
TEST(KdaDecode, GateSumsMatchTheFoldedGate) {
  REQUIRE_GPU();
  for (const int64_t D : {64, 128}) {
    const int64_t N = 37;
    Problem p = MakeProblem(200 + D, 3, D, std::vector<int32_t>(N, 1), KdaGate::kSoftplus, GateRange::kMild,
                            Init::kAll);
    std::vector<int32_t> gpu_slot = p.slot;
    for (int64_t n = 2; n < N; n += 5) gpu_slot[n] = -1;
    const int64_t hd = p.H * D, ld = hd + 8;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> sums(2 * N * ld, NAN);
    std::vector<uint16_t> folded(N * hd);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < hd; ++c) {
        const float hi = Bf16ToFloat(p.g[n * hd + c]) * (1.0f + 1e-3f * normal(rng));
        const float lo = 1e-3f * hi * normal(rng);
        sums[n * ld + c] = hi, sums[(N + n) * ld + c] = lo;
        folded[n * hd + c] = FloatToBf16(hi + lo);
      }
    DeviceBuffer<uint16_t> q(p.q), k(p.k), v(p.v), g(folded), b(p.b);
    DeviceBuffer<uint16_t> out1(std::vector<uint16_t>(p.q.size(), kPoison)), out2(out1.ToHost());
    DeviceBuffer<float> A_log(p.A_log), dt_bias(p.dt_bias), state1(p.state), state2(p.state), dsums(sums);
    DeviceBuffer<int32_t> slot(gpu_slot);
    CUDA_OK(KdaDecode(Args(p, q, k, v, g, b, A_log, dt_bias, state1, slot, out1), N, nullptr));
    KdaArgs a = Args(p, q, k, v, g, b, A_log, dt_bias, state2, slot, out2);
    a.g_raw = nullptr, a.g_sums = Sums{dsums.get(), ld, N};
    CUDA_OK(KdaDecode(a, N, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(out1.ToHost(), out2.ToHost()) << "D " << D;
    EXPECT_EQ(state1.ToHost(), state2.ToHost()) << "D " << D;
    EXPECT_EQ(KdaPrefill(a, KdaPrefillBatch{}, nullptr), cudaErrorInvalidValue);  // the prefill reads g_raw
  }
}

// A prompt through the prefill, then decode steps on the state it left: the same as one recurrence. beta's
// input b sits in a wider buffer (row stride ldb), as in the engine, where it is columns of the projection output.
TEST(KdaPrefillThenDecode, ContinuesTheRecurrence) {
  REQUIRE_GPU();
  const int64_t D = 128, T = 100, steps = 3;
  const Problem p = MakeProblem(7, 2, D, {int32_t(T + steps)}, KdaGate::kSoftplus, GateRange::kMild, Init::kNone);
  std::vector<float> o_ref, pool_ref;
  Reference(p, false, &o_ref, &pool_ref);

  const int64_t hd = p.H * D;
  const int64_t ldb = p.H + 5;
  std::vector<uint16_t> b_wide((T + steps) * ldb, kPoison);
  for (int64_t t = 0; t < T + steps; ++t) std::copy_n(p.b.begin() + t * p.H, p.H, b_wide.begin() + t * ldb);
  DeviceBuffer<uint16_t> q(p.q), k(p.k), v(p.v), g(p.g), b(b_wide), out(std::vector<uint16_t>(p.q.size(), kPoison));
  DeviceBuffer<float> A_log(p.A_log), dt_bias(p.dt_bias), state(p.state);
  DeviceBuffer<int32_t> slot(p.slot), cu(std::vector<int32_t>{0, int32_t(T)});
  KdaArgs a = Args(p, q, k, v, g, b, A_log, dt_bias, state, slot, out);
  a.ldb = ldb;
  KdaPrefillBatch batch;
  batch.num_seqs = 1;
  batch.cu_seqlens = cu.get();
  const int32_t cu_host[2] = {0, int32_t(T)};
  batch.num_chunks = KdaNumChunks(cu_host, 1);
  DeviceBuffer<unsigned char> ws(KdaPrefillWorkspaceBytes(batch.num_chunks, p.H, D));
  batch.workspace = ws.get();
  CUDA_OK(KdaPrefill(a, batch, nullptr));
  for (int64_t t = T; t < T + steps; ++t) {  // token t as a batch of one
    KdaArgs d = a;
    d.q += t * hd, d.k += t * hd, d.v += t * hd, d.g_raw += t * hd, d.b += t * ldb, d.o += t * hd;
    CUDA_OK(KdaDecode(d, 1, nullptr));
  }
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> ob = out.ToHost();
  const std::vector<float> o = ToFloat(ob, 0, ob.size()), pool = state.ToHost();
  const Err eo = Compare(o, o_ref), es = Compare(pool, pool_ref);
  std::printf("  prefill %ld + decode %ld: o rel %.2e, state rel %.2e\n", static_cast<long>(T), static_cast<long>(steps),
              eo.rel, es.rel);
  EXPECT_TRUE(eo.finite && es.finite);
  EXPECT_LT(eo.rel, 1e-2);
  EXPECT_LT(es.rel, 1e-2);
}

}  // namespace
}  // namespace k3::cuda

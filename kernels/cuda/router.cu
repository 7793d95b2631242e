// The sigmoid router after the gate GEMM (DESIGN §1.4) and the Quantile-Balancing histogram (§1.5).
// Reference: k3::cpu::RouteTopKRef and k3::cpu::QbHistogram (kernels/cpu/router.h).
//
// One warp per token; lane l holds experts l, l + 32, ... (V of them). Experts are ranked by a 64-bit key,
// the order-preserving bits of s' above the complement of the expert id, so one integer max picks the
// higher score and, among equal scores, the lower id. Each lane keeps its best four keys sorted; a step
// of the top-k takes the warp's max head and the owning lane pops it (rescanning its V keys only when its
// four are used up), so k steps cost k warp reductions rather than k passes over all E scores.
//
// Decode batches without a group limit take a block of 8 warps per token instead (RouteTopKWideKernel): each warp
// ranks an eighth of the experts the same way, warp 0 ranks the warps' best. A warp-per-token kernel is its
// latency — at decode, 16 blocks and one warp a scheduler: 1,880 instructions a warp, 7.4 cycles apart (7.8 µs in
// a kimi-linear-e2e step); most of them are the double-precision sigmoids, which the block spreads 8 ways.
#include <cmath>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/split.cuh"

namespace k3::cuda {
namespace {

constexpr int kRouterWarps = 4;  // tokens per block

__device__ __forceinline__ uint64_t MakeKey(float v, int e) {
  uint32_t u = __float_as_uint(v + 0.0f);  // −0 → +0: equal scores tie on the id
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | static_cast<uint32_t>(~e);
}
__device__ __forceinline__ float KeyScore(uint64_t key) {
  const uint32_t u = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}
__device__ __forceinline__ int KeyExpert(uint64_t key) { return static_cast<int>(~static_cast<uint32_t>(key)); }

// s = sigmoid(x) in double, as the reference computes it.
__device__ __forceinline__ double SigmoidD(float x) { return 1.0 / (1.0 + exp(-static_cast<double>(x))); }

// A lane's best four keys below `below`, sorted (0 = none; a real key is never 0), of its V keys.
template <int V>
struct BestFour {
  uint64_t c0, c1, c2, c3;
  __device__ void Fill(const uint64_t (&key)[V], uint64_t below) {
    c0 = c1 = c2 = c3 = 0;
#pragma unroll
    for (int t = 0; t < V; ++t) {
      const uint64_t v = key[t] < below ? key[t] : 0;
      const bool g0 = v > c0, g1 = v > c1, g2 = v > c2, g3 = v > c3;
      c3 = g2 ? c2 : (g3 ? v : c3);
      c2 = g1 ? c1 : (g2 ? v : c2);
      c1 = g0 ? c0 : (g1 ? v : c1);
      c0 = g0 ? v : c0;
    }
  }
  // One step of the warp's top-k: the warp's best remaining key; its lane moves past it.
  __device__ uint64_t Step(const uint64_t (&key)[V]) {
    uint64_t best = c0;
    for (int off = 16; off > 0; off >>= 1) {
      const uint64_t o = __shfl_xor_sync(0xffffffffu, best, off);
      best = o > best ? o : best;
    }
    if (best != 0 && c0 == best) {
      c0 = c1, c1 = c2, c2 = c3, c3 = 0;
      if (c0 == 0) Fill(key, best);
    }
    return best;
  }
};

// The warp's best `steps` keys in order: lane j < steps gets the j-th (*pick), every lane the one at place k
// (*alpha: the (k+1)-th best, the QB histogram's α when steps = k + 1).
template <int V>
__device__ __forceinline__ void RankKeys(const uint64_t (&key)[V], int steps, int k, int lane, uint64_t* pick,
                                         uint64_t* alpha) {
  BestFour<V> top;
  top.Fill(key, ~0ull);
  *pick = *alpha = 0;
  for (int j = 0; j < steps; ++j) {
    const uint64_t best = top.Step(key);
    if (lane == j) *pick = best;
    if (j == k) *alpha = best;
  }
}

// Lane j < k of the warp holds the token's j-th best key and that expert's unbiased score s_sel (0 past k): its
// expert id, and its weight from s_sel, in double like the reference (renormalized over the k, scaled).
__device__ __forceinline__ void WriteChoice(const RouterArgs& a, int64_t n, int lane, uint64_t key, double s_sel) {
  const int k = static_cast<int>(a.top_k);
  const int e_sel = lane < k ? KeyExpert(key) : 0;
  double sum = s_sel;
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane < k) {
    const double norm = a.renormalize ? 1.0 / (sum + 1e-20) : 1.0;
    a.idx[n * k + lane] = e_sel;
    a.w[n * k + lane] = static_cast<float>(s_sel * norm * static_cast<double>(a.scale));
  }
}

// The token's count for expert e (s' = sb) in the QB histogram: r = α − s', its bin clamped to the range.
__device__ __forceinline__ void QbCount(const RouterArgs& a, float qb_scale, float alpha, float sb, int e) {
  const int bins = static_cast<int>(a.qb_bins);
  const float r = alpha - sb;
  const float pos = (r - a.qb_rmin) * qb_scale;
  const int b = pos < 0.0f ? 0 : (pos >= static_cast<float>(bins) ? bins - 1 : static_cast<int>(pos));
  atomicAdd(a.qb_hist + static_cast<int64_t>(b) * a.num_experts + e, 1);
}

template <int V>
__global__ __launch_bounds__(kRouterWarps * 32) void RouteTopKKernel(RouterArgs a, float qb_scale) {
  PdlEnter();
  const int lane = threadIdx.x & 31;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kRouterWarps + (threadIdx.x >> 5);
  if (n >= a.N) return;  // the whole warp
  const int E = static_cast<int>(a.num_experts), k = static_cast<int>(a.top_k);
  const int G = static_cast<int>(a.num_groups), per_group = E / G;
  const Sums& logits = a.logits;

  float x[V];
#pragma unroll
  for (int t = 0; t < V; ++t) x[t] = t * 32 + lane < E ? logits.At(n, t * 32 + lane) : 0.0f;
  float sb[V];  // s' = float(s) + bias
#pragma unroll
  for (int t = 0; t < V; ++t) {
    const int e = t * 32 + lane;
    sb[t] = e < E ? static_cast<float>(SigmoidD(x[t])) + (a.bias ? a.bias[e] : 0.0f) : -INFINITY;
  }

  // Group limit: lane g scores group g by the sum of its two best s'; keep the topk_groups best groups.
  uint32_t kept = 0xffffffffu;
  if (G > 1 && a.topk_groups < G) {
    double my_score = -INFINITY;
    for (int g = 0; g < G; ++g) {
      float b1 = -INFINITY, b2 = -INFINITY;
#pragma unroll
      for (int t = 0; t < V; ++t) {
        const int e = t * 32 + lane;
        if (e < E && e / per_group == g) b2 = fmaxf(b2, fminf(b1, sb[t])), b1 = fmaxf(b1, sb[t]);
      }
      for (int off = 16; off > 0; off >>= 1) {
        const float o1 = __shfl_xor_sync(0xffffffffu, b1, off), o2 = __shfl_xor_sync(0xffffffffu, b2, off);
        b2 = fmaxf(fmaxf(b2, o2), fminf(b1, o1));
        b1 = fmaxf(b1, o1);
      }
      if (lane == g) my_score = static_cast<double>(b1) + (per_group > 1 ? static_cast<double>(b2) : 0.0);
    }
    kept = 0;
    for (int j = 0; j < a.topk_groups; ++j) {
      const bool open = lane < G && !((kept >> lane) & 1u);
      double best = open ? my_score : -INFINITY;
      int best_lane = open ? lane : 32;
      for (int off = 16; off > 0; off >>= 1) {
        const double o = __shfl_xor_sync(0xffffffffu, best, off);
        const int ol = __shfl_xor_sync(0xffffffffu, best_lane, off);
        if (o > best || (o == best && ol < best_lane)) best = o, best_lane = ol;
      }
      if (best_lane < 32) kept |= 1u << best_lane;
    }
  }

  uint64_t key[V];
#pragma unroll
  for (int t = 0; t < V; ++t) {
    const int e = t * 32 + lane;
    key[t] = e < E && ((kept >> (e / per_group)) & 1u) ? MakeKey(sb[t], e) : 0;
  }
  // Step j picks the j-th expert; lane j keeps it. With the histogram, step k finds α.
  uint64_t mine, alpha_key;
  RankKeys(key, k + (a.qb_hist ? 1 : 0), k, lane, &mine, &alpha_key);
  WriteChoice(a, n, lane, mine, lane < k ? SigmoidD(logits.At(n, KeyExpert(mine))) : 0.0);
  if (a.qb_hist) {
    const float alpha = KeyScore(alpha_key);
#pragma unroll
    for (int t = 0; t < V; ++t)
      if (t * 32 + lane < E) QbCount(a, qb_scale, alpha, sb[t], t * 32 + lane);
  }
}

constexpr int kWideWarps = 8;
constexpr int kMaxSteps = 33;                                       // k + 1 with the histogram
constexpr int kWideCands = (kWideWarps * kMaxSteps + 31) / 32;      // warp 0's keys a lane

// A block per token, no group limit: warp w ranks experts 32w + lane + 256t (t < V), keeping its best `steps`
// keys; warp 0 ranks those. The same keys, ids, weights and histogram as RouteTopKKernel.
template <int V>
__global__ __launch_bounds__(kWideWarps * 32) void RouteTopKWideKernel(RouterArgs a, float qb_scale) {
  PdlEnter();
  __shared__ uint64_t cand[kWideWarps][kMaxSteps];
  __shared__ uint64_t alpha_s;
  __shared__ double s_all[kWideWarps * 32 * V];  // the unbiased scores, for the chosen experts' weights
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = blockIdx.x;
  const int E = static_cast<int>(a.num_experts), k = static_cast<int>(a.top_k);
  const int steps = k + (a.qb_hist ? 1 : 0);
  const Sums& logits = a.logits;

  float sb[V];  // s' = float(s) + bias
  uint64_t key[V];
#pragma unroll
  for (int t = 0; t < V; ++t) {
    const int e = kWideWarps * 32 * t + 32 * warp + lane;
    const double sd = e < E ? SigmoidD(logits.At(n, e)) : 0.0;
    s_all[e] = sd;
    sb[t] = e < E ? static_cast<float>(sd) + (a.bias ? a.bias[e] : 0.0f) : -INFINITY;
    key[t] = e < E ? MakeKey(sb[t], e) : 0;
  }
  BestFour<V> mine;
  mine.Fill(key, ~0ull);
  for (int j = 0; j < steps; ++j) {
    const uint64_t best = mine.Step(key);
    if (lane == 0) cand[warp][j] = best;
  }
  __syncthreads();

  if (warp == 0) {
    uint64_t c[kWideCands];
#pragma unroll
    for (int i = 0; i < kWideCands; ++i) {
      const int q = 32 * i + lane;
      c[i] = q < kWideWarps * steps ? cand[q / steps][q % steps] : 0;
    }
    uint64_t sel, alpha_key;
    RankKeys(c, steps, k, lane, &sel, &alpha_key);
    WriteChoice(a, n, lane, sel, lane < k ? s_all[KeyExpert(sel)] : 0.0);
    if (lane == 0) alpha_s = alpha_key;
  }

  if (a.qb_hist) {
    __syncthreads();
    const float alpha = KeyScore(alpha_s);
#pragma unroll
    for (int t = 0; t < V; ++t) {
      const int e = kWideWarps * 32 * t + 32 * warp + lane;
      if (e < E) QbCount(a, qb_scale, alpha, sb[t], e);
    }
  }
}

// Decode batches (a block per token is worth its launch below this) without a group limit take the wide kernel.
constexpr int64_t kWideMaxTokens = 256;

template <int V>
cudaError_t LaunchWide(const RouterArgs& a, float qb_scale, cudaStream_t stream) {
  K3_CUDA_TRY(LaunchKernel(RouteTopKWideKernel<V>, static_cast<unsigned>(a.N), kWideWarps * 32, 0, stream, a,
                           qb_scale));
  return cudaGetLastError();
}

template <int V>
cudaError_t Launch(const RouterArgs& a, float qb_scale, cudaStream_t stream) {
  const int64_t blocks = (a.N + kRouterWarps - 1) / kRouterWarps;
  K3_CUDA_TRY(
      LaunchKernel(RouteTopKKernel<V>, static_cast<unsigned>(blocks), kRouterWarps * 32, 0, stream, a, qb_scale));
  return cudaGetLastError();
}

}  // namespace

cudaError_t RouteTopK(const RouterArgs& a, cudaStream_t stream) {
  const int64_t E = a.num_experts, k = a.top_k, G = a.num_groups;
  if (a.N < 0 || E < 1 || E > 1024 || k < 1 || k > 32 || G < 1 || G > 32 || E % G != 0 ||
      a.topk_groups < 1 || a.topk_groups * (E / G) < k + (a.qb_hist ? 1 : 0))
    return cudaErrorInvalidValue;
  if (a.qb_hist && (a.qb_bins < 1 || !(a.qb_rmax > a.qb_rmin))) return cudaErrorInvalidValue;
  if (a.N == 0) return cudaSuccess;
  if (!a.logits.p || !a.idx || !a.w || (a.N + kRouterWarps - 1) / kRouterWarps > 0x7fffffff || a.logits.ld < E ||
      a.logits.lo_rows < 0 || !a.logits.PartsOk())
    return cudaErrorInvalidValue;
  // The same float expression as the CPU reference.
  const float qb_scale = a.qb_hist ? static_cast<float>(a.qb_bins) / (a.qb_rmax - a.qb_rmin) : 0.0f;
  if (a.N <= kWideMaxTokens && (G == 1 || a.topk_groups >= G)) {
    const int64_t Vw = (E + kWideWarps * 32 - 1) / (kWideWarps * 32);
    if (Vw <= 1) return LaunchWide<1>(a, qb_scale, stream);
    if (Vw <= 2) return LaunchWide<2>(a, qb_scale, stream);
    return LaunchWide<4>(a, qb_scale, stream);
  }
  const int64_t V = (E + 31) / 32;
  if (V <= 1) return Launch<1>(a, qb_scale, stream);
  if (V <= 2) return Launch<2>(a, qb_scale, stream);
  if (V <= 4) return Launch<4>(a, qb_scale, stream);
  if (V <= 8) return Launch<8>(a, qb_scale, stream);
  if (V <= 16) return Launch<16>(a, qb_scale, stream);
  if (V <= 28) return Launch<28>(a, qb_scale, stream);  // K3: E = 896
  return Launch<32>(a, qb_scale, stream);
}

cudaError_t RouterLogits(cublasHandle_t blas, int64_t N, int64_t d, int64_t E, const __nv_bfloat16* m,
                         const __nv_bfloat16* w_gate, float* logits) {
  if (N < 0 || d < 1 || E < 1 || N > 0x7fffffff || d > 0x7fffffff || E > 0x7fffffff) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  // Column-major view: logitsᵀ [E, N] = W_gate ([d, E] col-major)ᵀ · mᵀ ([d, N] col-major).
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t st =
      cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(E), static_cast<int>(N), static_cast<int>(d), &one,
                   w_gate, CUDA_R_16BF, static_cast<int>(d), m, CUDA_R_16BF, static_cast<int>(d), &zero, logits,
                   CUDA_R_32F, static_cast<int>(E), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return st == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorUnknown;
}

}  // namespace k3::cuda

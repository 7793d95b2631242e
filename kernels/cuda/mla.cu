#include "kernels/cuda/mla.cuh"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/linear.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kQPerLane = 18;  // absorbed query width cw ≤ 32 · 18 = 576 (Kimi: 512 + 64)
constexpr int kColPairs = 2;   // latent context r ≤ 2 · 2 · 128 = 512 columns per thread block
constexpr int kTile = 128;     // cache rows per online-softmax step
constexpr float kNegInf = -INFINITY;

__device__ __forceinline__ float WarpSum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
__device__ __forceinline__ float WarpMax(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

size_t Round256(size_t n) { return (n + 255) / 256 * 256; }

// One CTA per token: RMSNorm of c_kv (fp32), then the cache row.
__global__ __launch_bounds__(kThreads) void AppendKernel(MlaDims s, Split c, const float* norm_w, float eps,
                                                          const int32_t* tok_slot, const int32_t* tok_pos,
                                                          __nv_bfloat16* cache, int64_t max_ctx) {
  const int64_t n = blockIdx.x, cw = s.cw();
  const __nv_bfloat16* src = c.p + n * c.ld;
  __shared__ float part[kThreads / 32];
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < s.r; i += kThreads) {
    const float v = LoadSplit(src + i, c.lo);
    ss += v * v;
  }
  ss = WarpSum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  ss = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) ss += part[w];
  const float rinv = rsqrtf(ss / static_cast<float>(s.r) + eps);
  __nv_bfloat16* dst = cache + (int64_t{tok_slot[n]} * max_ctx + tok_pos[n]) * cw;
  for (int64_t i = threadIdx.x; i < cw; i += kThreads) {
    const float v = LoadSplit(src + i, c.lo);
    dst[i] = __float2bfloat16_rn(i < s.r ? norm_w[i] * (v * rinv) : v);
  }
}

__global__ void TransposeUkKernel(MlaDims s, const __nv_bfloat16* kv_b, __nv_bfloat16* w_ukt) {
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (i >= s.nh * s.r * s.dn) return;
  const int64_t h = i / (s.r * s.dn), c = i / s.dn % s.r, d = i % s.dn;
  w_ukt[i] = kv_b[(h * s.dkv() + d) * s.r + c];
}

// qa[n][h][r + i] = q_r of token n, head h (the absorbed query is [q_nope·W_UK | q_r]).
__global__ void QrKernel(int64_t N, MlaDims s, Split q, float* qa) {
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (i >= N * s.nh * s.dr) return;
  const int64_t n = i / (s.nh * s.dr), h = i / s.dr % s.nh, d = i % s.dr;
  qa[(n * s.nh + h) * s.cw() + s.r + d] = LoadSplit(q.p + n * q.ld + h * s.dqk() + s.dn + d, q.lo);
}

// Absorbed attention: one CTA per (token, G heads). Scores: a warp per cache row, the G queries in registers
// (lane holds elements lane + 32i); context: thread owns column pairs 2·tid + 256u of the latent. Online
// softmax over tiles of kTile rows. ctx[n][h] = Σ_j p_j c_kv[j] (split, [N, nh·r]).
template <int G>
__global__ __launch_bounds__(kThreads) void DecodeKernel(MlaDims s, const float* qa, const __nv_bfloat16* cache,
                                                          int64_t max_ctx, const int32_t* tok_slot,
                                                          const int32_t* tok_pos, float scale, Split ctx) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t groups = s.nh / G, n = blockIdx.x / groups, h0 = blockIdx.x % groups * G, cw = s.cw();
  const int64_t L = int64_t{tok_pos[n]} + 1;
  const __nv_bfloat16* C = cache + int64_t{tok_slot[n]} * max_ctx * cw;
  __shared__ float p[G][kTile];
  __shared__ float run_max[G], run_sum[G], corr[G];

  float q[G][kQPerLane];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int i = 0; i < kQPerLane; ++i) {
      const int64_t c = lane + 32 * i;
      q[h][i] = c < cw ? qa[(n * s.nh + h0 + h) * cw + c] : 0.0f;
    }
  if (tid < G) run_max[tid] = kNegInf, run_sum[tid] = 0.0f;
  float acc[G][kColPairs][2] = {};

  for (int64_t j0 = 0; j0 < L; j0 += kTile) {
    const int rows = static_cast<int>(min(int64_t{kTile}, L - j0));
    for (int jj = warp; jj < rows; jj += kThreads / 32) {
      const __nv_bfloat16* row = C + (j0 + jj) * cw;
      float dot[G] = {};
#pragma unroll
      for (int i = 0; i < kQPerLane; ++i) {
        const int64_t c = lane + 32 * i;
        if (c < cw) {
          const float kv = __bfloat162float(row[c]);
#pragma unroll
          for (int h = 0; h < G; ++h) dot[h] += q[h][i] * kv;
        }
      }
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float d = WarpSum(dot[h]);
        if (lane == 0) p[h][jj] = d * scale;
      }
    }
    __syncthreads();
    if (warp < G) {
      float mx = kNegInf;
      for (int jj = lane; jj < rows; jj += 32) mx = fmaxf(mx, p[warp][jj]);
      const float m_new = fmaxf(run_max[warp], WarpMax(mx));
      float sum = 0.0f;
      for (int jj = lane; jj < rows; jj += 32) sum += (p[warp][jj] = expf(p[warp][jj] - m_new));
      sum = WarpSum(sum);
      __syncwarp();
      if (lane == 0) {
        const float c = expf(run_max[warp] - m_new);  // 0 on the first tile (run_max = −inf)
        corr[warp] = c;
        run_sum[warp] = run_sum[warp] * c + sum;
        run_max[warp] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int u = 0; u < kColPairs; ++u) acc[h][u][0] *= corr[h], acc[h][u][1] *= corr[h];
#pragma unroll 8  // eight rows' loads in flight: one at a time, this loop waits on L2 latency per row
    for (int jj = 0; jj < rows; ++jj) {
      const __nv_bfloat16* row = C + (j0 + jj) * cw;
#pragma unroll
      for (int u = 0; u < kColPairs; ++u) {
        const int64_t c = 2 * tid + 2 * kThreads * u;
        if (c < s.r) {
          const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + c));
#pragma unroll
          for (int h = 0; h < G; ++h) acc[h][u][0] += p[h][jj] * v.x, acc[h][u][1] += p[h][jj] * v.y;
        }
      }
    }
    __syncthreads();  // before the next tile overwrites p
  }
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const float inv = 1.0f / run_sum[h];
#pragma unroll
    for (int u = 0; u < kColPairs; ++u) {
      const int64_t c = 2 * tid + 2 * kThreads * u;
      if (c < s.r) {
        __nv_bfloat16* o = ctx.p + n * ctx.ld + (h0 + h) * s.r + c;
        StoreSplit(o, ctx.lo, acc[h][u][0] * inv);
        StoreSplit(o + 1, ctx.lo, acc[h][u][1] * inv);
      }
    }
  }
}

// Expanded keys and values of one sequence, zero-padded to Lp rows:
// Kh [nh][Lp][dqk] = [k_nope | k_r], Vt [nh][dv][Lp] (the value product's weight layout).
__global__ void ExpandKeysKernel(MlaDims s, int64_t L, int64_t Lp, const float* kvx, const __nv_bfloat16* cache,
                                 __nv_bfloat16* Kh) {
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x, dqk = s.dqk();
  if (i >= s.nh * Lp * dqk) return;
  const int64_t h = i / (Lp * dqk), j = i / dqk % Lp, c = i % dqk;
  float v = 0.0f;
  if (j < L) v = c < s.dn ? kvx[j * s.nh * s.dkv() + h * s.dkv() + c] : __bfloat162float(cache[j * s.cw() + s.r + c - s.dn]);
  Kh[i] = __float2bfloat16_rn(v);
}

__global__ void ExpandValuesKernel(MlaDims s, int64_t L, int64_t Lp, const float* kvx, __nv_bfloat16* Vt) {
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (i >= s.nh * s.dv * Lp) return;
  const int64_t h = i / (s.dv * Lp), c = i / Lp % s.dv, j = i % Lp;
  Vt[i] = __float2bfloat16_rn(j < L ? kvx[j * s.nh * s.dkv() + h * s.dkv() + s.dn + c] : 0.0f);
}

// One CTA per (query t, head h): causal softmax of scale · S over the visible rows j ≤ P + t, zeros after.
__global__ __launch_bounds__(kThreads) void SoftmaxKernel(int64_t nh, int64_t Lp, int64_t P, float scale,
                                                           const float* S, Split prob) {
  const int64_t row = blockIdx.x, t = row / nh, visible = P + t + 1;
  const float* sr = S + row * Lp;
  __nv_bfloat16* pr = prob.p + row * Lp;
  __shared__ float part[kThreads / 32];
  __shared__ float total;
  float mx = kNegInf;
  for (int64_t j = threadIdx.x; j < visible; j += kThreads) mx = fmaxf(mx, sr[j]);
  mx = WarpMax(mx);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = mx;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = kNegInf;
    for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, part[w]);
    total = m;
  }
  __syncthreads();
  mx = total;
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < visible; j += kThreads) sum += expf(scale * (sr[j] - mx));
  sum = WarpSum(sum);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) s += part[w];
    total = s;
  }
  __syncthreads();
  const float inv = 1.0f / total;
  for (int64_t j = threadIdx.x; j < Lp; j += kThreads)
    StoreSplit(pr + j, prob.lo, j < visible ? expf(scale * (sr[j] - mx)) * inv : 0.0f);
}

unsigned Blocks256(int64_t n) { return static_cast<unsigned>((n + 255) / 256); }

}  // namespace

cudaError_t MlaCacheAppend(int64_t N, const MlaDims& s, Split c, const float* norm_w, float eps,
                           const int32_t* tok_slot, const int32_t* tok_pos, __nv_bfloat16* cache, int64_t max_ctx,
                           cudaStream_t stream) {
  if (N < 0 || !c.p || !norm_w || !tok_slot || !tok_pos || !cache || s.r <= 0) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  AppendKernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(s, c, norm_w, eps, tok_slot, tok_pos, cache,
                                                                   max_ctx);
  return cudaGetLastError();
}

cudaError_t MlaTransposeUk(const MlaDims& s, const __nv_bfloat16* kv_b, __nv_bfloat16* w_ukt, cudaStream_t stream) {
  if (!kv_b || !w_ukt) return cudaErrorInvalidValue;
  TransposeUkKernel<<<Blocks256(s.nh * s.r * s.dn), 256, 0, stream>>>(s, kv_b, w_ukt);
  return cudaGetLastError();
}

size_t MlaDecodeWorkspaceBytes(const MlaDims& s, int64_t N) {
  return Round256(N * s.nh * s.cw() * sizeof(float)) + Round256(2 * N * s.nh * s.r * sizeof(__nv_bfloat16));
}

cudaError_t MlaDecode(int64_t N, const MlaDims& s, Split q, const __nv_bfloat16* cache, int64_t max_ctx,
                      const int32_t* tok_slot, const int32_t* tok_pos, const __nv_bfloat16* kv_b,
                      const __nv_bfloat16* w_ukt, float scale, Split out, void* workspace, cudaStream_t stream) {
  if (s.cw() > 32 * kQPerLane || s.r > 2 * kThreads * kColPairs || s.r % 2 != 0) return cudaErrorNotSupported;
  if (N < 0 || !workspace) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  float* qa = static_cast<float*>(workspace);
  __nv_bfloat16* ctx = reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(workspace) +
                                                        Round256(N * s.nh * s.cw() * sizeof(float)));
  const Split ctx_split{ctx, s.nh * s.r, N * s.nh * s.r};

  // qa[:, h, :r] = q_nope[h] · W_UK[h], one group per head.
  LinearArgs la;
  la.N = s.r, la.K = s.dn, la.w = w_ukt, la.w_group_stride = s.r * s.dn;
  la.x = q, la.x_group_stride = s.dqk();
  la.y = qa, la.ldy = s.nh * s.cw(), la.y_group_stride = s.cw(), la.out = LinearOut::kF32;
  la.groups = s.nh, la.M = N;
  K3_CUDA_TRY(Linear(la, stream));
  QrKernel<<<Blocks256(N * s.nh * s.dr), 256, 0, stream>>>(N, s, q, qa);
  K3_CUDA_TRY(cudaGetLastError());

  const int G = s.nh % 4 == 0 ? 4 : s.nh % 2 == 0 ? 2 : 1;
  const unsigned blocks = static_cast<unsigned>(N * (s.nh / G));
  if (G == 4) {
    DecodeKernel<4><<<blocks, kThreads, 0, stream>>>(s, qa, cache, max_ctx, tok_slot, tok_pos, scale, ctx_split);
  } else if (G == 2) {
    DecodeKernel<2><<<blocks, kThreads, 0, stream>>>(s, qa, cache, max_ctx, tok_slot, tok_pos, scale, ctx_split);
  } else {
    DecodeKernel<1><<<blocks, kThreads, 0, stream>>>(s, qa, cache, max_ctx, tok_slot, tok_pos, scale, ctx_split);
  }
  K3_CUDA_TRY(cudaGetLastError());

  // out[:, h] = ctx[h] · W_UV[h]ᵀ.
  LinearArgs lo;
  lo.N = s.dv, lo.K = s.r, lo.w = kv_b + s.dn * s.r, lo.w_group_stride = s.dkv() * s.r;
  lo.x = ctx_split, lo.x_group_stride = s.r;
  lo.y = out.p, lo.ldy = out.ld, lo.y_lo = out.lo, lo.y_group_stride = s.dv, lo.out = LinearOut::kSplit;
  lo.groups = s.nh, lo.M = N;
  return Linear(lo, stream);
}

size_t MlaPrefillWorkspaceBytes(const MlaDims& s, int64_t L, int64_t Tq) {
  const int64_t Lp = (L + 63) / 64 * 64;
  return Round256(L * s.nh * s.dkv() * sizeof(float)) + Round256(s.nh * Lp * s.dqk() * 2) +
         Round256(s.nh * s.dv * Lp * 2) + Round256(Tq * s.nh * Lp * sizeof(float)) + Round256(2 * Tq * s.nh * Lp * 2);
}

cudaError_t MlaPrefill(const MlaDims& s, int64_t T, int64_t P, Split q, const __nv_bfloat16* cache,
                       const __nv_bfloat16* kv_b, float scale, Split out, int64_t Tq, void* workspace,
                       cudaStream_t stream) {
  if (T < 0 || P < 0 || Tq <= 0 || !cache || !kv_b || !workspace) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const int64_t L = P + T, Lp = (L + 63) / 64 * 64;
  char* ws = static_cast<char*>(workspace);
  float* kvx = reinterpret_cast<float*>(ws);
  ws += Round256(L * s.nh * s.dkv() * sizeof(float));
  __nv_bfloat16* Kh = reinterpret_cast<__nv_bfloat16*>(ws);
  ws += Round256(s.nh * Lp * s.dqk() * 2);
  __nv_bfloat16* Vt = reinterpret_cast<__nv_bfloat16*>(ws);
  ws += Round256(s.nh * s.dv * Lp * 2);
  float* S = reinterpret_cast<float*>(ws);
  ws += Round256(Tq * s.nh * Lp * sizeof(float));
  __nv_bfloat16* prob = reinterpret_cast<__nv_bfloat16*>(ws);

  // kvx [L][nh·dkv] = c_kv · kv_bᵀ over the cache rows (plain bf16 input).
  LinearArgs le;
  le.N = s.nh * s.dkv(), le.K = s.r, le.w = kv_b;
  le.x = Split{const_cast<__nv_bfloat16*>(cache), s.cw(), 0};
  le.y = kvx, le.ldy = s.nh * s.dkv(), le.out = LinearOut::kF32, le.M = L;
  K3_CUDA_TRY(Linear(le, stream));
  ExpandKeysKernel<<<Blocks256(s.nh * Lp * s.dqk()), 256, 0, stream>>>(s, L, Lp, kvx, cache, Kh);
  ExpandValuesKernel<<<Blocks256(s.nh * s.dv * Lp), 256, 0, stream>>>(s, L, Lp, kvx, Vt);
  K3_CUDA_TRY(cudaGetLastError());

  for (int64_t t0 = 0; t0 < T; t0 += Tq) {
    const int64_t tq = std::min(Tq, T - t0);
    // S [tq][nh][Lp] = q_h · K_hᵀ, one group per head.
    LinearArgs ls;
    ls.N = Lp, ls.K = s.dqk(), ls.w = Kh, ls.w_group_stride = Lp * s.dqk();
    ls.x = q.Rows(t0), ls.x_group_stride = s.dqk();
    ls.y = S, ls.ldy = s.nh * Lp, ls.y_group_stride = Lp, ls.out = LinearOut::kF32;
    ls.groups = s.nh, ls.M = tq;
    K3_CUDA_TRY(Linear(ls, stream));
    const Split pr{prob, s.nh * Lp, tq * s.nh * Lp};
    SoftmaxKernel<<<static_cast<unsigned>(tq * s.nh), kThreads, 0, stream>>>(s.nh, Lp, P + t0, scale, S, pr);
    K3_CUDA_TRY(cudaGetLastError());
    // out [tq][nh·dv] = prob_h · V_h, one group per head.
    LinearArgs lv;
    lv.N = s.dv, lv.K = Lp, lv.w = Vt, lv.w_group_stride = s.dv * Lp;
    lv.x = pr, lv.x_group_stride = Lp;
    lv.y = out.Rows(t0).p, lv.ldy = out.ld, lv.y_lo = out.lo, lv.y_group_stride = s.dv, lv.out = LinearOut::kSplit;
    lv.groups = s.nh, lv.M = tq;
    K3_CUDA_TRY(Linear(lv, stream));
  }
  return cudaSuccess;
}

}  // namespace k3::cuda

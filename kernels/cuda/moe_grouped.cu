#include "kernels/cuda/moe_grouped.cuh"

#include <cmath>

#include "kernels/cuda/cuda_try.cuh"

namespace k3::cuda {
namespace {

constexpr int kRouteWarps = 8;
constexpr int kSortThreads = 1024;
constexpr int64_t kMaxExperts = 6144;  // the sort's two counters per expert in 48 KB of shared memory

size_t Round256(size_t n) { return (n + 255) / 256 * 256; }

// a ranks before b: higher score, then lower index.
__device__ __forceinline__ bool Before(float va, int a, float vb, int b) { return va > vb || (va == vb && a < b); }

// The warp's best (value, index) among each lane's candidate.
__device__ __forceinline__ void WarpBest(float& v, int& i) {
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (Before(ov, oi, v, i)) v = ov, i = oi;
  }
}

// One warp per token; shared per warp: biased scores [E], group scores [G], kept flags [G].
__global__ __launch_bounds__(32 * kRouteWarps) void TopKKernel(int64_t N, RouterDims r, const float* logits,
                                                                 const float* bias, int32_t* idx, float* w) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = int64_t{blockIdx.x} * kRouteWarps + warp;
  if (n >= N) return;
  const int E = static_cast<int>(r.num_experts), G = static_cast<int>(r.num_groups), per = E / G;
  float* sb = smem + warp * (E + 2 * G);
  float* gscore = sb + E;
  float* kept = gscore + G;
  const float* lg = logits + n * E;
  for (int e = lane; e < E; e += 32) sb[e] = 1.0f / (1.0f + expf(-lg[e])) + (bias ? bias[e] : 0.0f);
  __syncwarp();
  if (G > 1 && r.topk_groups < G) {
    for (int g = lane; g < G; g += 32) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        if (sb[e] > b1) {
          b2 = b1, b1 = sb[e];
        } else if (sb[e] > b2) {
          b2 = sb[e];
        }
      }
      gscore[g] = b1 + b2;
      kept[g] = 0.0f;
    }
    __syncwarp();
    for (int64_t it = 0; it < r.topk_groups; ++it) {
      float v = -INFINITY;
      int gi = G;
      for (int g = lane; g < G; g += 32)
        if (kept[g] == 0.0f && Before(gscore[g], g, v, gi)) v = gscore[g], gi = g;
      WarpBest(v, gi);
      if (lane == 0) kept[gi] = 1.0f;
      __syncwarp();
    }
    for (int e = lane; e < E; e += 32)
      if (kept[e / per] == 0.0f) sb[e] = -INFINITY;
    __syncwarp();
  }
  int mine = 0;  // lane j < k: the j-th expert
  for (int64_t j = 0; j < r.top_k; ++j) {
    float v = -INFINITY;
    int ei = E;
    for (int e = lane; e < E; e += 32)
      if (Before(sb[e], e, v, ei)) v = sb[e], ei = e;
    WarpBest(v, ei);
    if (lane == j) mine = ei;
    __syncwarp();
    if (lane == 0) sb[ei] = -INFINITY;
    __syncwarp();
  }
  const bool own = lane < r.top_k;
  const float s = own ? 1.0f / (1.0f + expf(-lg[mine])) : 0.0f;
  float sum = s;
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float norm = r.renormalize ? 1.0f / (sum + 1e-20f) : 1.0f;
  if (own) {
    idx[n * r.top_k + lane] = mine;
    w[n * r.top_k + lane] = s * norm * r.scale;
  }
}

// One CTA: pairs p (idx[p] = expert) grouped by expert; offsets [E + 1]; the order inside a group is free.
__global__ __launch_bounds__(kSortThreads) void SortKernel(int64_t P, int E, const int32_t* idx, int32_t* offsets,
                                                            int32_t* pairs, int32_t* hits) {
  extern __shared__ int32_t counts[];  // [E] counts, then [E] cursors
  int32_t* cursor = counts + E;
  for (int e = threadIdx.x; e < E; e += kSortThreads) counts[e] = 0;
  __syncthreads();
  for (int64_t p = threadIdx.x; p < P; p += kSortThreads) {
    const int e = idx[p];
    if (e >= 0 && e < E) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // exclusive scan: each lane a contiguous run of experts
    const int lane = threadIdx.x, per = (E + 31) / 32, e0 = min(E, lane * per), e1 = min(E, e0 + per);
    int run = 0, hit = 0;
    for (int e = e0; e < e1; ++e) run += counts[e], hit += counts[e] > 0;
    int incl = run;
    for (int off = 1; off < 32; off <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += o;
    }
    for (int off = 16; off > 0; off >>= 1) hit += __shfl_xor_sync(0xffffffffu, hit, off);
    int at = incl - run;
    for (int e = e0; e < e1; ++e) {
      offsets[e] = at;
      cursor[e] = at;
      at += counts[e];
    }
    if (lane == 31) offsets[E] = incl;
    if (lane == 0 && hits) *hits = hit;
  }
  __syncthreads();
  for (int64_t p = threadIdx.x; p < P; p += kSortThreads) {
    const int e = idx[p];
    if (e >= 0 && e < E) pairs[atomicAdd(&cursor[e], 1)] = static_cast<int32_t>(p);
  }
}

__global__ void CombineKernel(int64_t N, int64_t k, int64_t D, const int32_t* idx, const float* w, const float* y,
                              float* out) {
  const int64_t i = int64_t{blockIdx.x} * 256 + threadIdx.x;
  if (i >= N * D) return;
  const int64_t n = i / D, c = i % D;
  float acc = 0.0f;
  for (int64_t j = 0; j < k; ++j)
    if (idx[n * k + j] >= 0) acc += w[n * k + j] * y[(n * k + j) * D + c];
  out[i] = acc;
}

}  // namespace

cudaError_t SelectExperts(int64_t N, const RouterDims& r, const float* logits, const float* bias, int32_t* idx, float* w,
                      cudaStream_t stream) {
  if (N < 0 || r.num_experts <= 0 || r.num_experts > kMaxExperts || r.top_k <= 0 || r.top_k > 32 ||
      r.top_k > r.num_experts || r.num_groups < 1 || r.num_experts % r.num_groups != 0 || r.topk_groups < 1 ||
      !logits || !idx || !w)
    return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  const size_t smem = kRouteWarps * (r.num_experts + 2 * r.num_groups) * sizeof(float);
  static const cudaError_t attr =
      cudaFuncSetAttribute(TopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
  if (attr != cudaSuccess) return attr;
  TopKKernel<<<static_cast<unsigned>((N + kRouteWarps - 1) / kRouteWarps), 32 * kRouteWarps, smem, stream>>>(
      N, r, logits, bias, idx, w);
  return cudaGetLastError();
}

size_t GroupedExpertsWorkspaceBytes(int64_t N, int64_t k, int64_t E, int64_t D, int64_t I) {
  const int64_t P = N * k;
  return Round256((E + 1) * sizeof(int32_t)) + Round256(P * sizeof(int32_t)) + Round256(2 * P * I * 2) +
         Round256(P * D * sizeof(float));
}

cudaError_t GroupedExperts(int64_t N, int64_t k, Split x, const int32_t* idx, const float* w, const ExpertStack& e,
                       LinearAct act, float situ_beta, float situ_linear_beta, float* out, int32_t* hits,
                       void* workspace, cudaStream_t stream) {
  if (N < 0 || k <= 0 || e.E <= 0 || e.E > kMaxExperts || !e.w13 || !e.w2 || !idx || !w || !out || !workspace ||
      act == LinearAct::kNone)
    return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  const int64_t P = N * k;
  char* ws = static_cast<char*>(workspace);
  int32_t* offsets = reinterpret_cast<int32_t*>(ws);
  ws += Round256((e.E + 1) * sizeof(int32_t));
  int32_t* pairs = reinterpret_cast<int32_t*>(ws);
  ws += Round256(P * sizeof(int32_t));
  __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(ws);
  ws += Round256(2 * P * e.I * 2);
  float* y = reinterpret_cast<float*>(ws);

  SortKernel<<<1, kSortThreads, 2 * e.E * sizeof(int32_t), stream>>>(P, static_cast<int>(e.E), idx, offsets, pairs,
                                                                       hits);
  K3_CUDA_TRY(cudaGetLastError());
  // h [P, I] = act(x W1ᵀ) · (x W3ᵀ) for each pair's expert (x row = pair / k).
  LinearArgs up;
  up.N = 2 * e.I, up.K = e.D, up.w = e.w13, up.w_group_stride = 2 * e.I * e.D;
  up.x = x, up.x_row_div = static_cast<int32_t>(k);
  up.y = h, up.ldy = e.I, up.y_lo = P * e.I, up.out = LinearOut::kSplit;
  up.groups = e.E, up.offsets = offsets, up.rows = pairs;
  up.act = act, up.situ_beta = situ_beta, up.situ_linear_beta = situ_linear_beta;
  K3_CUDA_TRY(Linear(up, stream));
  // y [P, D] = h W2ᵀ.
  LinearArgs down;
  down.N = e.D, down.K = e.I, down.w = e.w2, down.w_group_stride = e.D * e.I;
  down.x = Split{h, e.I, P * e.I};
  down.y = y, down.ldy = e.D, down.out = LinearOut::kF32;
  down.groups = e.E, down.offsets = offsets, down.rows = pairs;
  K3_CUDA_TRY(Linear(down, stream));
  CombineKernel<<<static_cast<unsigned>((N * e.D + 255) / 256), 256, 0, stream>>>(N, k, e.D, idx, w, y, out);
  return cudaGetLastError();
}

}  // namespace k3::cuda

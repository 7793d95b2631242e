#include "kernels/cuda/sampling.cuh"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 16;  // logits a thread reads (four float4 when V allows)
constexpr int kSpan = kThreads * kPerThread;

// The best of the CTA's keys (every thread calling) folded into *key with one integer max.
__device__ __forceinline__ void FoldBlockKey(uint64_t best, uint64_t* key) {
  __shared__ uint64_t warp_best[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, off));
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) best = max(best, warp_best[w]);
    atomicMax(reinterpret_cast<unsigned long long*>(key), static_cast<unsigned long long>(best));
  }
}

// CTA (row r, span s): the best key of logits [s·kSpan, (s + 1)·kSpan) of row r, folded into keys[r].
__global__ __launch_bounds__(kThreads) void ArgmaxKernel(int64_t V, const float* logits, uint64_t* keys) {
  PdlEnter();
  const float* row = logits + int64_t{blockIdx.x} * V;
  const int64_t c0 = int64_t{blockIdx.y} * kSpan;
  uint64_t best = 0;
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
#pragma unroll
  for (int q = 0; q < kPerThread / 4; ++q) {
    const int64_t c = c0 + (int64_t{q} * kThreads + threadIdx.x) * 4;
    if (vec && c + 4 <= V) {
      const float4 v = *reinterpret_cast<const float4*>(row + c);
      best = max(best, max(max(ArgmaxKey(v.x, c), ArgmaxKey(v.y, c + 1)),
                           max(ArgmaxKey(v.z, c + 2), ArgmaxKey(v.w, c + 3))));
    } else {
      for (int e = 0; e < 4; ++e)
        if (c + e < V) best = max(best, ArgmaxKey(row[c + e], c + e));
    }
  }
  FoldBlockKey(best, keys + blockIdx.x);
}

__global__ void KeysToIdsKernel(int64_t R, uint64_t* keys, int32_t* ids) {
  PdlEnter();
  const int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (r >= R) return;
  ids[r] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(keys[r]));
  keys[r] = 0;
}

__global__ void FeedKernel(int64_t N, const int32_t* ids, int32_t* tok_id, int32_t* tok_pos) {
  PdlEnter();
  const int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (n < N) tok_id[n] = ids[n], tok_pos[n] += 1;
}

}  // namespace

cudaError_t Argmax(int64_t R, int64_t V, const float* logits, uint64_t* keys, int32_t* ids, cudaStream_t stream) {
  if (R < 0 || R > 0x7fffffff || V <= 0 || (V + kSpan - 1) / kSpan > 65535 || !logits || !keys || !ids)
    return cudaErrorInvalidValue;
  if (R == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(keys, 0, R * sizeof(uint64_t), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(R), static_cast<unsigned>((V + kSpan - 1) / kSpan));
  K3_CUDA_TRY(LaunchKernel(ArgmaxKernel, grid, kThreads, 0, stream, V, logits, keys));
  return ArgmaxIds(R, keys, ids, stream);
}

cudaError_t ArgmaxIds(int64_t R, uint64_t* keys, int32_t* ids, cudaStream_t stream) {
  if (R < 0 || R > 0x7fffffff || !keys || !ids) return cudaErrorInvalidValue;
  if (R == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(KeysToIdsKernel, static_cast<unsigned>((R + 255) / 256), 256, 0, stream, R, keys, ids));
  return cudaGetLastError();
}

cudaError_t FeedGreedyIds(int64_t N, const int32_t* ids, int32_t* tok_id, int32_t* tok_pos, cudaStream_t stream) {
  if (N < 0 || N > 0x7fffffff || (N > 0 && (!ids || !tok_id || !tok_pos))) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(FeedKernel, static_cast<unsigned>((N + 255) / 256), 256, 0, stream, N, ids, tok_id, tok_pos));
  return cudaGetLastError();
}

}  // namespace k3::cuda

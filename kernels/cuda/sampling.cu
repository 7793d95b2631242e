#include "kernels/cuda/sampling.cuh"

#include <cmath>

namespace k3::cuda {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ void Better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
}

// One CTA per row.
__global__ __launch_bounds__(kThreads) void ArgmaxKernel(int64_t V, const float* logits, int32_t* ids) {
  const float* row = logits + int64_t{blockIdx.x} * V;
  float v = -INFINITY;
  int i = static_cast<int>(V);
  for (int64_t c = threadIdx.x; c < V; c += kThreads) Better(v, i, row[c], static_cast<int>(c));
  for (int off = 16; off > 0; off >>= 1)
    Better(v, i, __shfl_xor_sync(0xffffffffu, v, off), __shfl_xor_sync(0xffffffffu, i, off));
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  if ((threadIdx.x & 31) == 0) sv[threadIdx.x >> 5] = v, si[threadIdx.x >> 5] = i;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) Better(v, i, sv[w], si[w]);
    ids[blockIdx.x] = i;
  }
}

}  // namespace

cudaError_t Argmax(int64_t R, int64_t V, const float* logits, int32_t* ids, cudaStream_t stream) {
  if (R < 0 || V <= 0 || V > 0x7fffffff || !logits || !ids) return cudaErrorInvalidValue;
  if (R == 0) return cudaSuccess;
  ArgmaxKernel<<<static_cast<unsigned>(R), kThreads, 0, stream>>>(V, logits, ids);
  return cudaGetLastError();
}

}  // namespace k3::cuda

#include "kernels/cuda/attnres.cuh"

#include <cmath>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxSources = 64;

__device__ float BlockSum(float v, float* part) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.0f;
  for (int i = 0; i < kThreads / 32; ++i) s += part[i];
  return s;
}

// One CTA per token.
__global__ __launch_bounds__(kThreads) void ReadKernel(int64_t d, const float* bank, int64_t bank_stride, int64_t m,
                                                        const float* partial, const float* w, const float* n,
                                                        float eps, float* out) {
  PdlEnter();
  const int64_t t = blockIdx.x;
  __shared__ float part[kThreads / 32];
  __shared__ float p[kMaxSources + 1];
  auto source = [&](int64_t j) { return (j < m ? bank + j * bank_stride : partial) + t * d; };
  for (int64_t j = 0; j <= m; ++j) {
    const float* v = source(j);
    float dot = 0.0f, ss = 0.0f;
    for (int64_t i = threadIdx.x; i < d; i += kThreads) {
      dot += n[i] * w[i] * v[i];
      ss += v[i] * v[i];
    }
    dot = BlockSum(dot, part);
    ss = BlockSum(ss, part);
    if (threadIdx.x == 0) p[j] = dot / sqrtf(ss / static_cast<float>(d) + eps);
  }
  __syncthreads();
  float mx = -INFINITY, sum = 0.0f;
  for (int64_t j = 0; j <= m; ++j) mx = fmaxf(mx, p[j]);
  for (int64_t j = 0; j <= m; ++j) sum += expf(p[j] - mx);
  for (int64_t i = threadIdx.x; i < d; i += kThreads) {
    float acc = 0.0f;
    for (int64_t j = 0; j <= m; ++j) acc += expf(p[j] - mx) / sum * source(j)[i];
    out[t * d + i] = acc;
  }
}

}  // namespace

cudaError_t AttnResRead(int64_t N, int64_t d, const float* bank, int64_t bank_stride, int64_t m, const float* partial,
                        const float* w, const float* n, float eps, float* out, cudaStream_t stream) {
  if (N < 0 || d <= 0 || m < 0 || m > kMaxSources || (m > 0 && !bank) || !partial || !w || !n || !out)
    return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(ReadKernel, static_cast<unsigned>(N), kThreads, 0, stream, d, bank, bank_stride, m, partial,
                           w, n, eps, out));
  return cudaGetLastError();
}

}  // namespace k3::cuda

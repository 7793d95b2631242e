#include "kernels/cuda/norm.cuh"

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 128;     // gated norm: many short rows (heads)
constexpr int kRowThreads = 512;  // RMSNorm: one CTA per (long) row, so more loads in flight per row

__device__ __forceinline__ float Get(const float* x, int64_t i, int64_t) { return x[i]; }
__device__ __forceinline__ float Get(const __nv_bfloat16* x, int64_t i, int64_t lo) { return LoadSplit(x + i, lo); }

// Σ over the block of kBlock threads; every thread gets the total.
template <int kBlock>
__device__ float BlockSum(float v) {
  __shared__ float part[kBlock / 32];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();  // part may still be read by a previous call
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < kBlock / 32; ++w) s += part[w];
  return s;
}

// One CTA per row. x_lo: the lo plane offset of a split x (ignored for fp32).
template <class T>
__global__ __launch_bounds__(kRowThreads) void RmsNormKernel(int64_t D, const T* x, int64_t ldx, int64_t x_lo,
                                                              const int32_t* rows, const float* w, float eps,
                                                              Split y) {
  PdlEnter();
  const int64_t i = blockIdx.x;
  const T* xr = x + (rows ? rows[i] : i) * ldx;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < D; c += kRowThreads) {
    const float v = Get(xr, c, x_lo);
    ss += v * v;
  }
  const float r = rsqrtf(BlockSum<kRowThreads>(ss) / static_cast<float>(D) + eps);
  __nv_bfloat16* yr = y.p + i * y.ld;
  for (int64_t c = threadIdx.x; c < D; c += kRowThreads) {
    const float v = Get(xr, c, x_lo) * r;
    StoreSplit(yr + c, y.lo, w ? w[c] * v : v);
  }
}

template <class T>
__global__ __launch_bounds__(kThreads) void GatedRmsNormKernel(int64_t D, const T* x, const float* gate,
                                                                const float* w, float eps, Split y) {
  PdlEnter();
  const int64_t i = blockIdx.x;
  const T* xr = x + i * D;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < D; c += kThreads) {
    const float v = Get(xr, c, 0);
    ss += v * v;
  }
  const float r = rsqrtf(BlockSum<kThreads>(ss) / static_cast<float>(D) + eps);
  for (int64_t c = threadIdx.x; c < D; c += kThreads) {
    const float g = gate[i * D + c];
    StoreSplit(y.p + i * D + c, y.lo, w[c] * (Get(xr, c, 0) * r) / (1.0f + expf(-g)));
  }
}

bool Bad(int64_t M, int64_t D, const void* x, Split y) { return M < 0 || D <= 0 || !x || !y.p || M > 0x7fffffff; }

}  // namespace

cudaError_t RmsNorm(int64_t M, int64_t D, const float* x, int64_t ldx, const int32_t* rows, const float* w,
                    float eps, Split y, cudaStream_t stream) {
  if (Bad(M, D, x, y)) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(RmsNormKernel<float>, static_cast<unsigned>(M), kRowThreads, 0, stream, D, x, ldx, 0, rows,
                           w, eps, y));
  return cudaGetLastError();
}

cudaError_t RmsNorm(int64_t M, int64_t D, Split x, const float* w, float eps, Split y, cudaStream_t stream) {
  if (Bad(M, D, x.p, y)) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(RmsNormKernel<__nv_bfloat16>, static_cast<unsigned>(M), kRowThreads, 0, stream, D, x.p, x.ld,
                           x.lo, nullptr, w, eps, y));
  return cudaGetLastError();
}

cudaError_t GatedRmsNorm(int64_t M, int64_t D, const __nv_bfloat16* x, const float* gate, const float* w, float eps,
                         Split y, cudaStream_t stream) {
  if (Bad(M, D, x, y) || !gate || !w || y.ld != D) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(GatedRmsNormKernel<__nv_bfloat16>, static_cast<unsigned>(M), kThreads, 0, stream, D, x, gate,
                           w, eps, y));
  return cudaGetLastError();
}

cudaError_t GatedRmsNorm(int64_t M, int64_t D, const float* x, const float* gate, const float* w, float eps, Split y,
                         cudaStream_t stream) {
  if (Bad(M, D, x, y) || !gate || !w || y.ld != D) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  K3_CUDA_TRY(
      LaunchKernel(GatedRmsNormKernel<float>, static_cast<unsigned>(M), kThreads, 0, stream, D, x, gate, w, eps, y));
  return cudaGetLastError();
}

}  // namespace k3::cuda

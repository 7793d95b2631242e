#include "kernels/cuda/elementwise.cuh"

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 256;

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void EmbedKernel(int64_t N, int64_t d, const int32_t* ids, const __nv_bfloat16* table, float* x) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= N * d) return;
  const int64_t n = i / d, c = i % d;
  x[i] = __bfloat162float(table[int64_t{ids[n]} * d + c]);
}

__global__ void AddKernel(int64_t n, const float* x, const float* x2, float* y) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= n) return;
  const float v = y[i] + x[i];
  y[i] = x2 ? v + x2[i] : v;
}

__global__ void ToSplitKernel(int64_t M, int64_t D, const float* x, int64_t ldx, Split y) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= M * D) return;
  const int64_t m = i / D, c = i % D;
  StoreSplit(y.p + m * y.ld + c, y.lo, x[m * ldx + c]);
}

__global__ void MulSigmoidKernel(int64_t M, int64_t D, Split o, const float* gate) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= M * D) return;
  const int64_t m = i / D, c = i % D;
  __nv_bfloat16* p = o.p + m * o.ld + c;
  StoreSplit(p, o.lo, LoadSplit(p, o.lo) / (1.0f + expf(-gate[i])));
}

__device__ __forceinline__ uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillRandomKernel(int64_t n, RandomKind kind, float a, float b, uint64_t seed, float* f32,
                                 __nv_bfloat16* bf16) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= n) return;
  const uint64_t r = SplitMix(seed ^ SplitMix(static_cast<uint64_t>(i)));
  const float u1 = ((r >> 40) + 0.5f) * (1.0f / 16777216.0f), u2 = ((r & 0xffffff) + 0.5f) * (1.0f / 16777216.0f);
  float v = 0.0f;
  switch (kind) {
    case RandomKind::kNormal:
      v = a + b * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
      break;
    case RandomKind::kUniform:
      v = a + (b - a) * u1;
      break;
    case RandomKind::kLogU:
      v = logf(a + (b - a) * u1);
      break;
    case RandomKind::kDtBias:
      v = logf(expm1f(expf(a + (b - a) * u1)));
      break;
  }
  if (f32) {
    f32[i] = v;
  } else {
    bf16[i] = __float2bfloat16_rn(v);
  }
}

__global__ void FillRandomBytesKernel(int64_t n, uint32_t lo, uint32_t span, uint64_t seed, uint8_t* dst) {
  PdlEnter();
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= n) return;
  dst[i] = static_cast<uint8_t>(lo + SplitMix(seed ^ SplitMix(static_cast<uint64_t>(i))) % span);
}

}  // namespace

cudaError_t FillRandomBytes(int64_t n, uint8_t lo, uint8_t hi, uint64_t seed, uint8_t* dst, cudaStream_t stream) {
  if (n < 0 || hi < lo || (n > 0 && dst == nullptr)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(FillRandomBytesKernel, Blocks(n), kThreads, 0, stream, n, uint32_t{lo},
                           uint32_t{hi} - lo + 1, seed, dst));
  return cudaGetLastError();
}

cudaError_t FillRandom(int64_t n, RandomKind kind, float a, float b, uint64_t seed, float* f32, __nv_bfloat16* bf16,
                       cudaStream_t stream) {
  if (n < 0 || (f32 == nullptr) == (bf16 == nullptr)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(FillRandomKernel, Blocks(n), kThreads, 0, stream, n, kind, a, b, seed, f32, bf16));
  return cudaGetLastError();
}

cudaError_t Embed(int64_t N, int64_t d, const int32_t* ids, const __nv_bfloat16* table, float* x,
                  cudaStream_t stream) {
  if (N < 0 || d <= 0 || !ids || !table || !x) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(EmbedKernel, Blocks(N * d), kThreads, 0, stream, N, d, ids, table, x));
  return cudaGetLastError();
}

cudaError_t AddInto2(int64_t n, const float* x, const float* x2, float* y, cudaStream_t stream) {
  if (n < 0 || !x || !y) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(AddKernel, Blocks(n), kThreads, 0, stream, n, x, x2, y));
  return cudaGetLastError();
}

cudaError_t AddInto(int64_t n, const float* x, float* y, cudaStream_t stream) {
  return AddInto2(n, x, nullptr, y, stream);
}

cudaError_t ToSplit(int64_t M, int64_t D, const float* x, int64_t ldx, Split y, cudaStream_t stream) {
  if (M < 0 || D <= 0 || !x || !y.p) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(ToSplitKernel, Blocks(M * D), kThreads, 0, stream, M, D, x, ldx, y));
  return cudaGetLastError();
}

cudaError_t MulSigmoid(int64_t M, int64_t D, Split o, const float* gate, cudaStream_t stream) {
  if (M < 0 || D <= 0 || !o.p || !gate) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(MulSigmoidKernel, Blocks(M * D), kThreads, 0, stream, M, D, o, gate));
  return cudaGetLastError();
}

}  // namespace k3::cuda

#include "kernels/cuda/norm.cuh"

#include <algorithm>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 128;     // gated norm: many short rows (heads)
constexpr int kMaxGatedD = 8 * kThreads;
constexpr int kRowThreads = 512;  // RMSNorm: one CTA per (long) row, so more loads in flight per row

__device__ __forceinline__ float Get(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float Get(const __nv_bfloat16* x, int64_t i) { return __bfloat162float(x[i]); }

// Σ over the block (a multiple of 32 threads up to 1024); every thread gets the total. Once per kernel.
__device__ float BlockSum(float v) {
  __shared__ float part[32];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += part[w];
  return s;
}

// One CTA per row of a split x.
__global__ __launch_bounds__(kRowThreads) void RmsNormKernel(int64_t D, Split x, const float* w, float eps, Split y) {
  PdlEnter();
  const int64_t i = blockIdx.x;
  const __nv_bfloat16* xr = x.p + i * x.ld;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < D; c += kRowThreads) {
    const float v = LoadSplit(xr + c, x.lo);
    ss += v * v;
  }
  const float r = rsqrtf(BlockSum(ss) / static_cast<float>(D) + eps);
  __nv_bfloat16* yr = y.p + i * y.ld;
  for (int64_t c = threadIdx.x; c < D; c += kRowThreads) {
    const float v = LoadSplit(xr + c, x.lo) * r;
    StoreSplit(yr + c, y.lo, w ? w[c] * v : v);
  }
}

__device__ __forceinline__ float4 Add4(float4 a, float4 b) { return {a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w}; }

// The row's 4-column group c4 of a: hi row (+ lo row), over a's parts in order (Sums::At four at a time); kParts
// ≥ a.parts at compile time, so that every load is issued before the first add.
template <int kParts>
__device__ __forceinline__ float4 Sum4(const Sums& a, int64_t r, int64_t c4) {
  float4 v = a.Part4(0, r, 4 * c4);
#pragma unroll
  for (int k = 1; k < kParts; ++k)
    if (k < a.parts) v = Add4(v, a.Part4(k, r, 4 * c4));
  return v;
}

// AddRmsNorm with 16-byte accesses, the row held in registers (kIt float4 a thread): every load of the row is
// issued before the first add, one memory round trip instead of one per column group, and one pass over x.
template <int kIt, int kParts>
__global__ __launch_bounds__(1024) void AddRmsNormVecKernel(int64_t D, float* x, int64_t ldx, Sums a, Sums b,
                                                            const int32_t* rows, const float* w, float eps, Split y,
                                                            bool write_x) {
  const int64_t D4 = D / 4;
  float4 g[kIt];  // the norm's weights before the wait (PDL): read at once after the reduction
#pragma unroll
  for (int t = 0; t < kIt; ++t) {
    const int64_t c4 = threadIdx.x + int64_t{t} * blockDim.x;
    g[t] = w && c4 < D4 ? reinterpret_cast<const float4*>(w)[c4] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
  }
  PdlEnter();
  const int64_t i = blockIdx.x, r = rows ? rows[i] : i;
  float4* xr = reinterpret_cast<float4*>(x + r * ldx);
  float4 v[kIt], va[kIt], vb[kIt];
#pragma unroll
  for (int t = 0; t < kIt; ++t) {
    const int64_t c4 = threadIdx.x + int64_t{t} * blockDim.x;
    if (c4 < D4) {
      v[t] = xr[c4];
      if (a.p) va[t] = Sum4<kParts>(a, r, c4);
      if (b.p) vb[t] = Sum4<kParts>(b, r, c4);
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int t = 0; t < kIt; ++t) {
    const int64_t c4 = threadIdx.x + int64_t{t} * blockDim.x;
    if (c4 < D4) {
      if (a.p) v[t] = Add4(v[t], va[t]);
      if (b.p) v[t] = Add4(v[t], vb[t]);
      if (write_x) xr[c4] = v[t];
      ss += v[t].x * v[t].x + v[t].y * v[t].y + v[t].z * v[t].z + v[t].w * v[t].w;
    }
  }
  const float rn = rsqrtf(BlockSum(ss) / static_cast<float>(D) + eps);
#pragma unroll
  for (int t = 0; t < kIt; ++t) {
    const int64_t c4 = threadIdx.x + int64_t{t} * blockDim.x;
    if (c4 >= D4) continue;
    const float4 wt = g[t];
    const float o[4] = {wt.x * (v[t].x * rn), wt.y * (v[t].y * rn), wt.z * (v[t].z * rn), wt.w * (v[t].w * rn)};
    StoreSplit4(y.p + i * y.ld + 4 * c4, y.lo, o);
  }
}

// The vector kernel's threads and registers for D, or false when the shapes and addresses do not allow 16-byte
// accesses (or the row needs more than 8 float4 a thread).
bool VecShape(int64_t D, const float* x, int64_t ldx, Sums a, Sums b, const float* w, Split y, int* threads, int* it) {
  auto aligned = [](const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  auto ok = [&](Sums s) { return !s.p || (aligned(s.p, 16) && s.ld % 4 == 0 && s.part_stride % 4 == 0); };
  if (D % 4 != 0 || ldx % 4 != 0 || !aligned(x, 16) || !ok(a) || !ok(b) || (w && !aligned(w, 16)) || y.ld % 4 != 0 ||
      y.lo % 4 != 0 || !aligned(y.p, 8))
    return false;
  const int64_t D4 = D / 4;
  for (const int k : {2, 4, 8}) {
    const int64_t t = (D4 + k - 1) / k;
    if (t <= 1024) {
      *it = k, *threads = static_cast<int>((t + 31) / 32 * 32);
      return true;
    }
  }
  return false;
}

__global__ __launch_bounds__(kRowThreads) void AddRmsNormKernel(int64_t D, float* x, int64_t ldx, Sums a, Sums b,
                                                                const int32_t* rows, const float* w, float eps, Split y,
                                                                bool write_x) {
  PdlEnter();
  const int64_t i = blockIdx.x, r = rows ? rows[i] : i;
  float* xr = x + r * ldx;
  auto h = [&](int64_t c) {
    float v = xr[c];
    if (a.p) v += a.At(r, c);
    if (b.p) v += b.At(r, c);
    return v;
  };
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < D; c += kRowThreads) {
    const float v = h(c);
    if (write_x) xr[c] = v;  // read back below by this thread
    ss += v * v;
  }
  const float rn = rsqrtf(BlockSum(ss) / static_cast<float>(D) + eps);
  __nv_bfloat16* yr = y.p + i * y.ld;
  for (int64_t c = threadIdx.x; c < D; c += kRowThreads) {
    const float v = (write_x ? xr[c] : h(c)) * rn;
    StoreSplit(yr + c, y.lo, w ? w[c] * v : v);
  }
}

template <int kIt>
cudaError_t LaunchVec(int parts, unsigned grid, int threads, cudaStream_t stream, int64_t D, float* x, int64_t ldx,
                      Sums a, Sums b, const int32_t* rows, const float* w, float eps, Split y, bool write_x) {
  switch (parts) {
    case 1:
      return LaunchKernel(AddRmsNormVecKernel<kIt, 1>, grid, threads, 0, stream, D, x, ldx, a, b, rows, w, eps, y,
                          write_x);
    case 2:
      return LaunchKernel(AddRmsNormVecKernel<kIt, 2>, grid, threads, 0, stream, D, x, ldx, a, b, rows, w, eps, y,
                          write_x);
    default:
      return LaunchKernel(AddRmsNormVecKernel<kIt, kMaxSumParts>, grid, threads, 0, stream, D, x, ldx, a, b, rows, w,
                          eps, y, write_x);
  }
}

cudaError_t LaunchAddRmsNorm(int64_t M, int64_t D, float* x, int64_t ldx, Sums a, Sums b, const int32_t* rows,
                             const float* w, float eps, Split y, cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(M);
  const bool write_x = !rows && (a.p || b.p);
  const int parts = static_cast<int>(std::max(a.p ? a.parts : 1, b.p ? b.parts : 1));
  int threads = 0, it = 0;
  if (!VecShape(D, x, ldx, a, b, w, y, &threads, &it)) {
    K3_CUDA_TRY(
        LaunchKernel(AddRmsNormKernel, grid, kRowThreads, 0, stream, D, x, ldx, a, b, rows, w, eps, y, write_x));
  } else if (it == 2) {
    K3_CUDA_TRY(LaunchVec<2>(parts, grid, threads, stream, D, x, ldx, a, b, rows, w, eps, y, write_x));
  } else if (it == 4) {
    K3_CUDA_TRY(LaunchVec<4>(parts, grid, threads, stream, D, x, ldx, a, b, rows, w, eps, y, write_x));
  } else {
    K3_CUDA_TRY(LaunchVec<8>(parts, grid, threads, stream, D, x, ldx, a, b, rows, w, eps, y, write_x));
  }
  return cudaGetLastError();
}

// The gate of row i, column c: a plain [M, D] fp32 gate, or a product's sums (row i / H, column (i % H)·D + c).
struct GateIn {
  const float* plain;
  Sums sums;
  int64_t H;
  __device__ __forceinline__ float At(int64_t i, int64_t D, int64_t c) const {
    return plain ? plain[i * D + c] : sums.At(i / H, (i % H) * D + c);
  }
};

// One CTA per row (head) of D ≤ kPer·kThreads, its values in registers: the norm's weights are read before the wait
// (PDL), x and the gate in one round trip after it, before the block's one reduction. (Reading the gate and the weights
// after the reduction, a second round trip, added 4.7 µs after the KDA decode in a kimi-linear decode step; a warp a
// row, 8 rows a CTA, added 6.3.)
template <class T, int kPer>
__global__ __launch_bounds__(kThreads) void GatedRmsNormKernel(int64_t D, const T* x, GateIn gate, const float* w,
                                                                float eps, Split y) {
  float wc[kPer], v[kPer], g[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t c = threadIdx.x + j * kThreads;
    wc[j] = c < D ? w[c] : 0.0f;
  }
  PdlEnter();
  const int64_t i = blockIdx.x;
  const T* xr = x + i * D;
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t c = threadIdx.x + j * kThreads;
    v[j] = c < D ? Get(xr, c) : 0.0f;
    g[j] = c < D ? gate.At(i, D, c) : 0.0f;
    ss += v[j] * v[j];
  }
  const float r = rsqrtf(BlockSum(ss) / static_cast<float>(D) + eps);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t c = threadIdx.x + j * kThreads;
    if (c < D) StoreSplit(y.p + i * D + c, y.lo, wc[j] * (v[j] * r) / (1.0f + expf(-g[j])));
  }
}

// After each overload's own checks: the rows' width, an empty batch, the kernel by width.
template <class T>
cudaError_t LaunchGated(int64_t M, int64_t D, const T* x, GateIn gate, const float* w, float eps, Split y,
                        cudaStream_t stream) {
  if (D > kMaxGatedD) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(M);
  if (D <= kThreads) {
    K3_CUDA_TRY(LaunchKernel(GatedRmsNormKernel<T, 1>, grid, kThreads, 0, stream, D, x, gate, w, eps, y));
  } else if (D <= 2 * kThreads) {
    K3_CUDA_TRY(LaunchKernel(GatedRmsNormKernel<T, 2>, grid, kThreads, 0, stream, D, x, gate, w, eps, y));
  } else {
    K3_CUDA_TRY(LaunchKernel(GatedRmsNormKernel<T, kMaxGatedD / kThreads>, grid, kThreads, 0, stream, D, x, gate, w,
                             eps, y));
  }
  return cudaGetLastError();
}

bool Bad(int64_t M, int64_t D, const void* x, Split y) { return M < 0 || D <= 0 || !x || !y.p || M > 0x7fffffff; }

}  // namespace

cudaError_t RmsNorm(int64_t M, int64_t D, const float* x, int64_t ldx, const int32_t* rows, const float* w,
                    float eps, Split y, cudaStream_t stream) {
  if (Bad(M, D, x, y)) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  return LaunchAddRmsNorm(M, D, const_cast<float*>(x), ldx, Sums{}, Sums{}, rows, w, eps, y, stream);  // x not written
}

cudaError_t RmsNorm(int64_t M, int64_t D, Split x, const float* w, float eps, Split y, cudaStream_t stream) {
  if (Bad(M, D, x.p, y)) return cudaErrorInvalidValue;
  if (M == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(RmsNormKernel, static_cast<unsigned>(M), kRowThreads, 0, stream, D, x, w, eps, y));
  return cudaGetLastError();
}

cudaError_t AddRmsNorm(int64_t M, int64_t D, float* x, int64_t ldx, Sums a, Sums b, const int32_t* rows, const float* w,
                       float eps, Split y, cudaStream_t stream) {
  auto bad = [&](const Sums& s) { return s.p && (s.ld < D || !s.PartsOk()); };
  if (Bad(M, D, x, y) || ldx < D || bad(a) || bad(b)) return cudaErrorInvalidValue;
  return LaunchAddRmsNorm(M, D, x, ldx, a, b, rows, w, eps, y, stream);
}

cudaError_t GatedRmsNorm(int64_t M, int64_t D, const __nv_bfloat16* x, const float* gate, const float* w, float eps,
                         Split y, cudaStream_t stream) {
  if (Bad(M, D, x, y) || !gate || !w || y.ld != D) return cudaErrorInvalidValue;
  return LaunchGated(M, D, x, GateIn{gate, Sums{}, 1}, w, eps, y, stream);
}

cudaError_t GatedRmsNorm(int64_t M, int64_t D, const float* x, const float* gate, const float* w, float eps, Split y,
                         cudaStream_t stream) {
  if (Bad(M, D, x, y) || !gate || !w || y.ld != D) return cudaErrorInvalidValue;
  return LaunchGated(M, D, x, GateIn{gate, Sums{}, 1}, w, eps, y, stream);
}

cudaError_t GatedRmsNorm(int64_t M, int64_t D, const __nv_bfloat16* x, Sums gate, int64_t H, const float* w,
                         float eps, Split y, cudaStream_t stream) {
  if (Bad(M, D, x, y) || !gate.p || !w || y.ld != D || H < 1 || M % H != 0 || gate.ld < H * D || !gate.PartsOk())
    return cudaErrorInvalidValue;
  return LaunchGated(M, D, x, GateIn{nullptr, gate, H}, w, eps, y, stream);
}

}  // namespace k3::cuda

#include "kernels/cuda/kda_small.cuh"

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"

namespace k3::cuda {
namespace {

__device__ __forceinline__ float WarpSum(float x) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Lane j owns column j of S (S[i][j], i < D) in registers; lanes ≥ D hold zeros and idle through the math.
__global__ __launch_bounds__(32) void KdaSmallKernel(KdaSmallArgs a) {
  PdlEnter();
  const int j = threadIdx.x;
  const int64_t ch = blockIdx.x / a.H, h = blockIdx.x % a.H, D = a.D, HD = a.H * D;
  const bool own = j < D;
  float* S = a.state + (int64_t{a.ch_slot[ch]} * a.H + h) * D * D;
  float s[kKdaSmallMaxD];
#pragma unroll
  for (int i = 0; i < kKdaSmallMaxD; ++i) s[i] = own && i < D ? S[i * D + j] : 0.0f;
  __shared__ float sq[kKdaSmallMaxD], sk[kKdaSmallMaxD], sdecay[kKdaSmallMaxD];
  const float A = expf(a.A_log[h]);
  const float scale = rsqrtf(static_cast<float>(D));
  for (int64_t t = a.ch_start[ch], end = t + a.ch_len[ch]; t < end; ++t) {
    const int64_t at = t * HD + h * D + j;
    const float q = own ? a.q[at] : 0.0f, k = own ? a.k[at] : 0.0f, v = own ? a.v[at] : 0.0f;
    const float qn = q * rsqrtf(WarpSum(q * q) + 1e-6f) * scale, kn = k * rsqrtf(WarpSum(k * k) + 1e-6f);
    if (own) {
      const float x = a.g_raw[at] + a.dt_bias[h * D + j];
      const float g = a.gate == KdaGate::kSoftplus ? -A * (x > 20.0f ? x : log1pf(expf(x)))
                                                   : a.lower_bound / (1.0f + expf(-A * x));
      sq[j] = qn, sk[j] = kn, sdecay[j] = expf(g);
    }
    __syncwarp();
    const float beta = 1.0f / (1.0f + expf(-a.b[t * a.H + h]));
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < kKdaSmallMaxD; ++i) {
      if (i < D) {
        s[i] *= sdecay[i];
        kv += s[i] * sk[i];
      }
    }
    const float u = beta * (v - kv);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < kKdaSmallMaxD; ++i) {
      if (i < D) {
        s[i] += sk[i] * u;
        o += s[i] * sq[i];
      }
    }
    if (own) a.o[at] = o;
    __syncwarp();  // before the next token overwrites sq, sk, sdecay
  }
#pragma unroll
  for (int i = 0; i < kKdaSmallMaxD; ++i)
    if (own && i < D) S[i * D + j] = s[i];
}

}  // namespace

cudaError_t KdaSmall(const KdaSmallArgs& a, cudaStream_t stream) {
  if (a.H <= 0 || a.D <= 0 || a.D > kKdaSmallMaxD || a.num_chunks < 0 || !a.q || !a.k || !a.v || !a.g_raw || !a.b ||
      !a.A_log || !a.dt_bias || !a.state || !a.o || !a.ch_start || !a.ch_len || !a.ch_slot ||
      (a.gate == KdaGate::kBounded && a.lower_bound > 0.0f))
    return cudaErrorInvalidValue;
  if (a.num_chunks == 0) return cudaSuccess;
  K3_CUDA_TRY(LaunchKernel(KdaSmallKernel, static_cast<unsigned>(a.num_chunks * a.H), 32, 0, stream, a));
  return cudaGetLastError();
}

}  // namespace k3::cuda

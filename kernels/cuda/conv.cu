#include "kernels/cuda/conv.cuh"

#include <cuda_bf16.h>

namespace k3::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void ConvKernel(KdaConvArgs a) {
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= a.N * a.C) return;
  const int64_t t = i / a.C, c = i % a.C, S = a.K - 1, start = a.tok_start[t];
  const float* state = a.state + int64_t{a.tok_slot[t]} * S * a.C + c;
  float acc = 0.0f;
  for (int64_t j = 0; j < a.K; ++j) {
    const int64_t src = t - S + j;  // input row; before the chunk: state row S + (src − start)
    const float in = src >= start ? LoadSplit(a.x.p + src * a.x.ld + c, a.x.lo) : state[(S + src - start) * a.C];
    acc += a.w[c * a.K + j] * in;
  }
  const float y = acc / (1.0f + expf(-acc));
  const int64_t part = c / (a.C / 3), col = t * (a.C / 3) + c % (a.C / 3);
  if (a.out_bf16) {
    static_cast<__nv_bfloat16*>(a.out[part])[col] = __float2bfloat16_rn(y);
  } else {
    static_cast<float*>(a.out[part])[col] = y;
  }
}

// One thread per (chunk, channel). New row r is old row r + T while that is a state row, else input row
// T + r − S of the chunk; ascending r reads only rows above r, so the update is in place.
__global__ void ConvStateKernel(KdaConvArgs a, int64_t num_chunks, const int32_t* ch_start, const int32_t* ch_len,
                                const int32_t* ch_slot) {
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= num_chunks * a.C) return;
  const int64_t ch = i / a.C, c = i % a.C, S = a.K - 1, T = ch_len[ch], start = ch_start[ch];
  float* state = a.state + int64_t{ch_slot[ch]} * S * a.C + c;
  for (int64_t r = 0; r < S; ++r) {
    const int64_t src = r + T;
    state[r * a.C] = src < S ? state[src * a.C] : LoadSplit(a.x.p + (start + src - S) * a.x.ld + c, a.x.lo);
  }
}

}  // namespace

cudaError_t KdaConv(const KdaConvArgs& a, cudaStream_t stream) {
  if (a.N < 0 || a.C <= 0 || a.C % 3 != 0 || a.K < 2 || !a.x.p || !a.w || !a.state || !a.tok_start || !a.tok_slot ||
      !a.out[0] || !a.out[1] || !a.out[2])
    return cudaErrorInvalidValue;
  if (a.N == 0) return cudaSuccess;
  ConvKernel<<<static_cast<unsigned>((a.N * a.C + kThreads - 1) / kThreads), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t KdaConvUpdateState(const KdaConvArgs& a, int64_t num_chunks, const int32_t* ch_start,
                               const int32_t* ch_len, const int32_t* ch_slot, cudaStream_t stream) {
  if (num_chunks < 0 || a.C <= 0 || a.K < 2 || !a.x.p || !a.state || !ch_start || !ch_len || !ch_slot)
    return cudaErrorInvalidValue;
  if (num_chunks == 0) return cudaSuccess;
  ConvStateKernel<<<static_cast<unsigned>((num_chunks * a.C + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      a, num_chunks, ch_start, ch_len, ch_slot);
  return cudaGetLastError();
}

}  // namespace k3::cuda

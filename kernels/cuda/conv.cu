#include "kernels/cuda/conv.cuh"

#include <cuda_bf16.h>

#include <algorithm>

namespace k3::cuda {
namespace {

constexpr int kThreads = 256;

constexpr int kMaxK = static_cast<int>(kKdaConvMaxK);  // unrolled (Kimi: K = 4): the K loads are in flight together

// One thread per (token, channel). Grid: (channel blocks, token stride); 32-bit channel math.
__global__ void ConvKernel(KdaConvArgs a) {
  const int c = blockIdx.x * kThreads + threadIdx.x, C = static_cast<int>(a.C), K = static_cast<int>(a.K);
  if (c >= C) return;
  const int S = K - 1, third = C / 3, part = c / third;
  for (int t = blockIdx.y; t < a.N; t += gridDim.y) {
    const int start = a.tok_start[t];
    float* state = a.state + int64_t{a.tok_slot[t]} * S * C + c;
    float in[kMaxK];
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      if (j >= K) break;
      const int src = t - S + j;  // input row; before the chunk: state row S + (src − start)
      in[j] = src >= start ? LoadSplit(a.x.p + int64_t{src} * a.x.ld + c, a.x.lo) : state[int64_t{S + src - start} * C];
    }
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      if (j >= K) break;
      acc += a.w[c * K + j] * in[j];
    }
    if (t < a.decode_tokens) {  // a one-token chunk: its state becomes its last K − 1 inputs
#pragma unroll
      for (int j = 1; j < kMaxK; ++j) {
        if (j >= K) break;
        state[int64_t{j - 1} * C] = in[j];
      }
    }
    const float y = acc / (1.0f + expf(-acc));
    const int64_t col = int64_t{t} * third + (c - part * third);
    if (a.out_bf16) {
      static_cast<__nv_bfloat16*>(a.out[part])[col] = __float2bfloat16_rn(y);
    } else {
      static_cast<float*>(a.out[part])[col] = y;
    }
  }
}

// One thread per (chunk, channel), grid as above. New row r is old row r + T while that is a state row, else
// input row T + r − S of the chunk; ascending r reads only rows above r, so the update is in place.
__global__ void ConvStateKernel(KdaConvArgs a, int num_chunks, const int32_t* ch_start, const int32_t* ch_len,
                                const int32_t* ch_slot) {
  const int c = blockIdx.x * kThreads + threadIdx.x, C = static_cast<int>(a.C);
  if (c >= C) return;
  const int S = static_cast<int>(a.K) - 1;
  for (int ch = blockIdx.y; ch < num_chunks; ch += gridDim.y) {
    const int T = ch_len[ch], start = ch_start[ch];
    float* state = a.state + int64_t{ch_slot[ch]} * S * C + c;
    for (int r = 0; r < S; ++r) {
      const int src = r + T;
      state[int64_t{r} * C] = src < S ? state[int64_t{src} * C]
                                      : LoadSplit(a.x.p + int64_t{start + src - S} * a.x.ld + c, a.x.lo);
    }
  }
}

}  // namespace

cudaError_t KdaConv(const KdaConvArgs& a, cudaStream_t stream) {
  if (a.N < 0 || a.C <= 0 || a.C % 3 != 0 || a.K < 2 || !a.x.p || !a.w || !a.state || !a.tok_start || !a.tok_slot ||
      !a.out[0] || !a.out[1] || !a.out[2])
    return cudaErrorInvalidValue;
  if (a.decode_tokens < 0 || a.decode_tokens > a.N || a.K > kMaxK) return cudaErrorInvalidValue;
  if (a.N == 0) return cudaSuccess;
  if (a.C > 0x7fffffff || a.N > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.C + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(a.N, 65535)));
  ConvKernel<<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t KdaConvUpdateState(const KdaConvArgs& a, int64_t num_chunks, const int32_t* ch_start,
                               const int32_t* ch_len, const int32_t* ch_slot, cudaStream_t stream) {
  if (num_chunks < 0 || a.C <= 0 || a.K < 2 || !a.x.p || !a.state || !ch_start || !ch_len || !ch_slot)
    return cudaErrorInvalidValue;
  if (num_chunks == 0) return cudaSuccess;
  if (a.C > 0x7fffffff || num_chunks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.C + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(num_chunks, 65535)));
  ConvStateKernel<<<grid, kThreads, 0, stream>>>(a, static_cast<int>(num_chunks), ch_start, ch_len, ch_slot);
  return cudaGetLastError();
}

}  // namespace k3::cuda

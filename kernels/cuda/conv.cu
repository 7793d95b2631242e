#include "kernels/cuda/conv.cuh"

#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"

namespace k3::cuda {
namespace {

constexpr int kThreads = 256;

constexpr int kMaxK = static_cast<int>(kKdaConvMaxK);  // unrolled (Kimi: K = 4): the K loads are in flight together

// Input row `row`, channel c: from the split x or the unfolded sums.
__device__ __forceinline__ float Input(const KdaConvArgs& a, int64_t row, int64_t c) {
  return a.x_sums.p ? RoundSplit(a.x_sums.At(row, c)) : LoadSplit(a.x.p + row * a.x.ld + c, a.x.lo);
}

// One thread per (token, channel), for any C and K (ConvKernel8 below takes the usual shapes). Grid: (channel
// blocks, token stride); 32-bit channel math.
__global__ void ConvKernel(KdaConvArgs a) {
  PdlEnter();
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
      in[j] = src >= start ? Input(a, src, c) : state[int64_t{S + src - start} * C];
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

// Eight channels per thread, kernel size K at compile time: the eight channels' K weights are 2K float4 loads,
// and x, state and output move in 16-byte accesses (the scalar kernel's 4-byte weight loads, 16 bytes apart
// across a warp, were most of its L1 traffic). The same sums as ConvKernel. Needs C / 3 % 8 == 0 and 16-byte
// aligned rows. At most 80 registers, three CTAs an SM: a decode batch of 64 (384 CTAs) is one wave instead of
// 1.45 at 86 registers (H200, kimi-linear-e2e: 12.6 → 9.6 µs a layer in place).
template <int K>
__global__ __launch_bounds__(kThreads, 3) void ConvKernel8(KdaConvArgs a) {
  const int c0 = 8 * (blockIdx.x * kThreads + threadIdx.x), C = static_cast<int>(a.C);
  const bool active = c0 < C;  // threads past C read channel 0's weights and leave after the wait
  const int S = K - 1, third = C / 3, part = c0 / third;
  float wf[8 * K];  // the weights before the wait (PDL): out of the round trip after it
  const float4* w4 = reinterpret_cast<const float4*>(a.w + (active ? c0 : 0) * K);
#pragma unroll
  for (int i = 0; i < 2 * K; ++i) {
    const float4 v = w4[i];
    wf[4 * i] = v.x, wf[4 * i + 1] = v.y, wf[4 * i + 2] = v.z, wf[4 * i + 3] = v.w;
  }
  PdlEnter();
  if (!active) return;
  for (int t = blockIdx.y; t < a.N; t += gridDim.y) {
    const int start = a.tok_start[t];
    float* state = a.state + int64_t{a.tok_slot[t]} * S * C + c0;
    float in[K][8];
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int src = t - S + j;
      if (src >= start && a.x_sums.p) {
        const float4 s0 = a.x_sums.Part4(0, src, c0), s1 = a.x_sums.Part4(0, src, c0 + 4);
        const float v[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int q = 0; q < 8; ++q) in[j][q] = RoundSplit(v[q]);
      } else if (src >= start) {
        const __nv_bfloat16* px = a.x.p + int64_t{src} * a.x.ld + c0;
        const int4 hi = *reinterpret_cast<const int4*>(px);
        const int4 lo = a.x.lo ? *reinterpret_cast<const int4*>(px + a.x.lo) : int4{0, 0, 0, 0};
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&hi);
        const __nv_bfloat162* l2 = reinterpret_cast<const __nv_bfloat162*>(&lo);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 h = __bfloat1622float2(h2[q]), l = __bfloat1622float2(l2[q]);
          in[j][2 * q] = h.x + l.x, in[j][2 * q + 1] = h.y + l.y;
        }
      } else {
        const float4* ps = reinterpret_cast<const float4*>(state + int64_t{S + src - start} * C);
        const float4 u = ps[0], v = ps[1];
        in[j][0] = u.x, in[j][1] = u.y, in[j][2] = u.z, in[j][3] = u.w;
        in[j][4] = v.x, in[j][5] = v.y, in[j][6] = v.z, in[j][7] = v.w;
      }
    }
    if (t < a.decode_tokens) {  // a one-token chunk: its state becomes its last K − 1 inputs
#pragma unroll
      for (int j = 1; j < K; ++j) {
        float4* ps = reinterpret_cast<float4*>(state + int64_t{j - 1} * C);
        ps[0] = make_float4(in[j][0], in[j][1], in[j][2], in[j][3]);
        ps[1] = make_float4(in[j][4], in[j][5], in[j][6], in[j][7]);
      }
    }
    float y[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < K; ++j) acc += wf[q * K + j] * in[j][q];
      y[q] = acc / (1.0f + expf(-acc));
    }
    const int64_t col = int64_t{t} * third + (c0 - part * third);
    if (a.out_bf16) {
      int4 o;
      __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int q = 0; q < 4; ++q) o2[q] = __floats2bfloat162_rn(y[2 * q], y[2 * q + 1]);
      *reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(a.out[part]) + col) = o;
    } else {
      float4* po = reinterpret_cast<float4*>(static_cast<float*>(a.out[part]) + col);
      po[0] = make_float4(y[0], y[1], y[2], y[3]);
      po[1] = make_float4(y[4], y[5], y[6], y[7]);
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// One thread per (chunk, channel), grid as above. New row r is old row r + T while that is a state row, else
// input row T + r − S of the chunk; ascending r reads only rows above r, so the update is in place.
__global__ void ConvStateKernel(KdaConvArgs a, int num_chunks, const int32_t* ch_start, const int32_t* ch_len,
                                const int32_t* ch_slot) {
  PdlEnter();
  const int c = blockIdx.x * kThreads + threadIdx.x, C = static_cast<int>(a.C);
  if (c >= C) return;
  const int S = static_cast<int>(a.K) - 1;
  for (int ch = blockIdx.y; ch < num_chunks; ch += gridDim.y) {
    const int T = ch_len[ch], start = ch_start[ch];
    float* state = a.state + int64_t{ch_slot[ch]} * S * C + c;
    for (int r = 0; r < S; ++r) {
      const int src = r + T;
      state[int64_t{r} * C] = src < S ? state[int64_t{src} * C] : Input(a, start + src - S, c);
    }
  }
}

}  // namespace

cudaError_t KdaConv(const KdaConvArgs& a, cudaStream_t stream) {
  if (a.N < 0 || a.C <= 0 || a.C % 3 != 0 || a.K < 2 || (!a.x.p && !a.x_sums.p) || !a.w || !a.state ||
      !a.tok_start || !a.tok_slot || !a.out[0] || !a.out[1] || !a.out[2] ||
      (a.x_sums.p && (a.x_sums.ld < a.C || a.x_sums.parts != 1)))
    return cudaErrorInvalidValue;
  if (a.decode_tokens < 0 || a.decode_tokens > a.N || a.K > kMaxK) return cudaErrorInvalidValue;
  if (a.N == 0) return cudaSuccess;
  if (a.C > 0x7fffffff || a.N > 0x7fffffff) return cudaErrorInvalidValue;
  const bool x_vec = a.x_sums.p ? a.x_sums.ld % 4 == 0 && Aligned16(a.x_sums.p)
                                : a.x.ld % 8 == 0 && a.x.lo % 8 == 0 && Aligned16(a.x.p);
  const bool vec = a.K <= 4 && (a.C / 3) % 8 == 0 && x_vec && Aligned16(a.w) && Aligned16(a.state) &&
                   Aligned16(a.out[0]) && Aligned16(a.out[1]) && Aligned16(a.out[2]);
  if (vec) {
    const dim3 grid(static_cast<unsigned>((a.C / 8 + kThreads - 1) / kThreads),
                    static_cast<unsigned>(std::min<int64_t>(a.N, 65535)));
    switch (a.K) {
      case 2:
        K3_CUDA_TRY(LaunchKernel(ConvKernel8<2>, grid, kThreads, 0, stream, a));
        break;
      case 3:
        K3_CUDA_TRY(LaunchKernel(ConvKernel8<3>, grid, kThreads, 0, stream, a));
        break;
      default:
        K3_CUDA_TRY(LaunchKernel(ConvKernel8<4>, grid, kThreads, 0, stream, a));
        break;
    }
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>((a.C + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(a.N, 65535)));
  K3_CUDA_TRY(LaunchKernel(ConvKernel, grid, kThreads, 0, stream, a));
  return cudaGetLastError();
}

cudaError_t KdaConvUpdateState(const KdaConvArgs& a, int64_t num_chunks, const int32_t* ch_start,
                               const int32_t* ch_len, const int32_t* ch_slot, cudaStream_t stream) {
  if (num_chunks < 0 || a.C <= 0 || a.K < 2 || (!a.x.p && !a.x_sums.p) || !a.state || !ch_start || !ch_len ||
      !ch_slot)
    return cudaErrorInvalidValue;
  if (num_chunks == 0) return cudaSuccess;
  if (a.C > 0x7fffffff || num_chunks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.C + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(num_chunks, 65535)));
  K3_CUDA_TRY(LaunchKernel(ConvStateKernel, grid, kThreads, 0, stream, a, static_cast<int>(num_chunks), ch_start,
                           ch_len, ch_slot));
  return cudaGetLastError();
}

}  // namespace k3::cuda

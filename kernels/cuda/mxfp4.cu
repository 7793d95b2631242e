#include "kernels/cuda/mxfp4.cuh"

#include <algorithm>

#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/split.cuh"

namespace k3::cuda {

using bf16 = __nv_bfloat16;

int64_t Mxfp4CodeBytes(int64_t rows, int64_t cols) { return rows * cols / 2; }
int64_t Mxfp4ScaleBytes(int64_t rows, int64_t cols) { return rows * cols / 32; }

// Per 16 rows × 32 columns (r16, kb): 32 lanes × 8 bytes, lane (g = l/4, t = l%4) holding the bytes of its A
// fragments (ptx.cuh): k16 step 0 a0..a3 = rows g, g+8, g, g+8 at bytes t, t, t+4, t+4; step 1 the same at
// bytes 8+t, 8+t, 12+t, 12+t. Scales: 8 pairs (row g, row g+8) per (r16, kb).
void Mxfp4ToFragments(const uint8_t* packed, const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* codes,
                      uint8_t* scales) {
  const int64_t KB = cols / 32, row_bytes = cols / 2;
  for (int64_t r16 = 0; r16 < rows / 16; ++r16) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      uint8_t* c = codes + (r16 * KB + kb) * 256;
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        const int64_t r0 = (r16 * 16 + g) * row_bytes + kb * 16, r1 = r0 + 8 * row_bytes;
        const int64_t src[8] = {r0 + t, r1 + t, r0 + t + 4, r1 + t + 4, r0 + 8 + t, r1 + 8 + t, r0 + 12 + t, r1 + 12 + t};
        for (int j = 0; j < 8; ++j) c[lane * 8 + j] = packed[src[j]];
      }
      uint8_t* s = scales + (r16 * KB + kb) * 16;
      for (int g = 0; g < 8; ++g) {
        s[2 * g] = scale[(r16 * 16 + g) * KB + kb];
        s[2 * g + 1] = scale[(r16 * 16 + g + 8) * KB + kb];
      }
    }
  }
}

struct Mxfp4Workspace::Buffers {
  int64_t max_pairs = 0, D = 0, I = 0, E = 0;
  int32_t *counts = nullptr, *offsets = nullptr, *slot_pair = nullptr, *pair_slot = nullptr;
  bf16* h = nullptr;  // [2, P, I]: hi plane, then (split x) the lo plane
  bf16* y = nullptr;  // [2, P, D]
  void Free() {
    for (void* p : {static_cast<void*>(counts), static_cast<void*>(offsets), static_cast<void*>(slot_pair),
                    static_cast<void*>(pair_slot), static_cast<void*>(h), static_cast<void*>(y)})
      cudaFree(p);
    counts = offsets = slot_pair = pair_slot = nullptr;
    h = y = nullptr;
  }
};

Mxfp4Workspace::Mxfp4Workspace() : b_(std::make_unique<Buffers>()) {}
Mxfp4Workspace::~Mxfp4Workspace() { b_->Free(); }

cudaError_t Mxfp4Workspace::Reserve(int64_t max_pairs, int64_t D, int64_t I, int64_t E) {
  Buffers& b = *b_;
  if (max_pairs <= b.max_pairs && D <= b.D && I <= b.I && E <= b.E) return cudaSuccess;
  b.Free();
  b.max_pairs = std::max(max_pairs, b.max_pairs), b.D = std::max(D, b.D), b.I = std::max(I, b.I), b.E = std::max(E, b.E);
  const int64_t P = std::max<int64_t>(b.max_pairs, 1);
  cudaError_t e;
  if ((e = cudaMalloc(&b.counts, b.E * 4)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.offsets, (b.E + 1) * 4)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.slot_pair, P * 4)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.pair_slot, P * 4)) != cudaSuccess) return e;
  if ((e = cudaMalloc(&b.h, 2 * P * b.I * 2)) != cudaSuccess) return e;
  return cudaMalloc(&b.y, 2 * P * b.D * 2);
}

namespace {

constexpr int kWarps = 4;  // 64 weight rows per CTA

struct KernelArgs {
  int64_t rows = 0, K = 0;  // weights [rows, K]
  const uint8_t* const* wa = nullptr;  // W1 (gate/up) or W2 (down)
  const uint8_t* const* sa = nullptr;
  const uint8_t* const* wb = nullptr;  // W3 (gate/up only)
  const uint8_t* const* sb = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* slot_pair = nullptr;
  int top_k = 1;
  const bf16* x = nullptr;  // gate/up: tokens' rows (slot_pair / top_k); down: h, one row per slot
  int64_t x_lo = 0;         // split x: the lo plane at x + x_lo (even); 0: plain bf16
  bf16* out = nullptr;      // [P, rows], one row per slot
  int64_t out_lo = 0;       // split out: the lo plane at out + out_lo; 0: plain bf16
  GluAct act = GluAct::kSilu;
  float b1 = 0, b2 = 0;
};

// Dequantization in bf16 pairs, ~3.5 instructions a weight (the decode kernels are bound by them, not by
// HBM). A code's magnitude bits e1 e0 m placed at bf16's bits 8..6 and its sign at bit 15 make the bf16
// 2^(e−127)·(1 + m/2) (e = 0: the subnormal m·2^−127), i.e. the E2M1 value times 2^−126; two bf16x2
// products, by 2^126 and by the block's 2^(s−127), are exact (the scale 255, NaN, never loads).
__device__ __forceinline__ __nv_bfloat162 Bf16x2(uint32_t bits) {
  __nv_bfloat162 v;
  *reinterpret_cast<uint32_t*>(&v) = bits;
  return v;
}
// 2^(s−127) in both halves (s = 0: the subnormal 2^−127).
__device__ __forceinline__ __nv_bfloat162 Scale2(uint32_t s) {
  const uint32_t b = s == 0 ? 0x0040u : s << 7;
  return Bf16x2(b | (b << 16));
}
// Byte j of q (codes 2j, 2j+1) as a bf16 pair times scale.
template <int j>
__device__ __forceinline__ uint32_t Dq(uint32_t q, uint32_t q4, __nv_bfloat162 scale) {
  constexpr uint32_t sel = j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12);
  const uint32_t x = __byte_perm(q, q4, sel);  // code 2j at bits 0..3, code 2j+1 at bits 16..19
  const uint32_t v = ((x << 6) & 0x01C001C0u) | ((x << 12) & 0x80008000u);
  const __nv_bfloat162 w = __hmul2(__hmul2(Bf16x2(v), Bf16x2(0x7E807E80u)), scale);  // · 2^126 · 2^(s−127)
  return *reinterpret_cast<const uint32_t*>(&w);
}
// Fragment-order bytes: rows g, g+8, g, g+8 (scales lo, hi) for each k16 step.
__device__ __forceinline__ void Dequant(uint2 q, uint32_t s, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
  const __nv_bfloat162 lo = Scale2(s & 255u), hi = Scale2(s >> 8);
  const uint32_t x4 = q.x >> 4, y4 = q.y >> 4;
  a0[0] = Dq<0>(q.x, x4, lo), a0[1] = Dq<1>(q.x, x4, hi), a0[2] = Dq<2>(q.x, x4, lo), a0[3] = Dq<3>(q.x, x4, hi);
  a1[0] = Dq<0>(q.y, y4, lo), a1[1] = Dq<1>(q.y, y4, hi), a1[2] = Dq<2>(q.y, y4, lo), a1[3] = Dq<3>(q.y, y4, hi);
}

// A warp: 16 weight rows of expert blockIdx.y against its tokens, NT n-tiles (8·NT tokens) per pass. A split x
// runs its hi and lo planes through the same weight fragments into the same fp32 accumulators (x·W = hi·W + lo·W).
template <int NT, bool kGlu, bool kSplit>
__global__ __launch_bounds__(kWarps * 32) void Mxfp4Kernel(KernelArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t r16 = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (r16 * 16 >= a.rows) return;
  const int e = blockIdx.y;
  const int begin = a.offsets[e], m = a.offsets[e + 1] - begin;
  if (m == 0) return;
  const int64_t KB = a.K / 32;
  const uint2* qa = reinterpret_cast<const uint2*>(a.wa[e]) + r16 * KB * 32 + lane;
  const uint16_t* sa = reinterpret_cast<const uint16_t*>(a.sa[e]) + r16 * KB * 8 + g;
  const uint2* qb = kGlu ? reinterpret_cast<const uint2*>(a.wb[e]) + r16 * KB * 32 + lane : nullptr;
  const uint16_t* sb = kGlu ? reinterpret_cast<const uint16_t*>(a.sb[e]) + r16 * KB * 8 + g : nullptr;
  // The expert's token passes are spread over blockIdx.z, so that a busy expert (Zipf's first) does not
  // stream its weights pass after pass in one warp while the others are done.
  for (int tok0 = blockIdx.z * 8 * NT; tok0 < m; tok0 += gridDim.z * 8 * NT) {
    float ca[NT][4] = {}, cb[NT][4] = {};
    const uint32_t* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tk = tok0 + nt * 8 + g;
      const int64_t row = tk < m ? (kGlu ? a.slot_pair[begin + tk] / a.top_k : begin + tk) : -1;
      xr[nt] = row >= 0 ? reinterpret_cast<const uint32_t*>(a.x + row * a.K) + t : nullptr;
    }
    // Deeper with one n-tile (more loads in flight), shallower with eight (registers): measured on the H200.
    constexpr int kUnroll = NT == 1 ? 8 : NT >= 8 ? 2 : 4;
#pragma unroll kUnroll
    for (int64_t kb = 0; kb < KB; ++kb) {
      uint32_t A0[4], A1[4], B0[4], B1[4];
      Dequant(__ldg(qa + kb * 32), __ldg(sa + kb * 8), A0, A1);
      if (kGlu) Dequant(__ldg(qb + kb * 32), __ldg(sb + kb * 8), B0, B1);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t x0 = 0, x1 = 0, x2 = 0, x3 = 0;  // k 2t.., 2t+8.., 2t+16.., 2t+24.. of token g
        uint32_t l0 = 0, l1 = 0, l2 = 0, l3 = 0;  // the same of its lo plane
        if (xr[nt] != nullptr) {
          const uint32_t* p = xr[nt] + kb * 16;
          x0 = p[0], x1 = p[4], x2 = p[8], x3 = p[12];
          if (kSplit) {
            const uint32_t* q = p + a.x_lo / 2;
            l0 = q[0], l1 = q[4], l2 = q[8], l3 = q[12];
          }
        }
        ptx::Mma(ca[nt], A0, x0, x1);
        ptx::Mma(ca[nt], A1, x2, x3);
        if (kSplit) {
          ptx::Mma(ca[nt], A0, l0, l1);
          ptx::Mma(ca[nt], A1, l2, l3);
        }
        if (kGlu) {
          ptx::Mma(cb[nt], B0, x0, x1);
          ptx::Mma(cb[nt], B1, x2, x3);
          if (kSplit) {
            ptx::Mma(cb[nt], B0, l0, l1);
            ptx::Mma(cb[nt], B1, l2, l3);
          }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // c_i: row g + 8·(i / 2), token 2t + i % 2
        const int tk = tok0 + nt * 8 + 2 * t + (i & 1);
        if (tk >= m) continue;
        const int64_t row = r16 * 16 + g + 8 * (i >> 1);
        const float v = kGlu ? Glu(a.act, ca[nt][i], cb[nt][i], a.b1, a.b2) : ca[nt][i];
        StoreSplit(a.out + static_cast<int64_t>(begin + tk) * a.rows + row, kSplit ? a.out_lo : 0, v);
      }
    }
  }
}

// out[n] = Σ_j w[n, j] · y[slot of pair (n, j)], in pair order: bf16 out, or fp32 out_f32 from a split y (the lo
// plane at y + y_lo). Block 0 also counts the experts hit (counts > 0).
__global__ void CombineKernel(int64_t D, int top_k, const int32_t* pair_slot, const float* w, const bf16* y,
                              int64_t y_lo, bf16* out, float* out_f32, int E, const int32_t* counts,
                              int32_t* experts_hit) {
  const int64_t n = blockIdx.x;
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      const int32_t s = pair_slot[n * top_k + j];
      if (s >= 0) acc += w[n * top_k + j] * LoadSplit(y + s * D + c, y_lo);
    }
    if (out_f32 != nullptr) {
      out_f32[n * D + c] = acc;
    } else {
      out[n * D + c] = __float2bfloat16(acc);
    }
  }
  if (experts_hit != nullptr && n == 0) {
    int hit = 0;
    for (int e0 = 0; e0 < E; e0 += blockDim.x) hit += __syncthreads_count(e0 + threadIdx.x < E && counts[e0 + threadIdx.x] > 0);
    if (threadIdx.x == 0) *experts_hit = hit;
  }
}

template <bool kGlu, bool kSplit>
cudaError_t Launch(const KernelArgs& k, int64_t num_experts, int64_t avg_pairs, cudaStream_t stream) {
  // Decode (a few tokens per expert): one n-tile keeps registers low and many warps streaming; more tokens
  // per pass reuse each dequantized fragment more often. Up to kPassSplit CTAs share an expert's passes.
  constexpr int64_t kPassSplit = 16;
  const int nt = avg_pairs <= 8 ? 1 : avg_pairs <= 16 ? 2 : avg_pairs <= 32 ? 4 : 8;
  const int64_t passes = (avg_pairs * num_experts + 8 * nt - 1) / (8 * nt);
  const dim3 grid(static_cast<unsigned>((k.rows / 16 + kWarps - 1) / kWarps), static_cast<unsigned>(num_experts),
                  static_cast<unsigned>(std::min(passes, kPassSplit)));
  if (nt == 1) {
    Mxfp4Kernel<1, kGlu, kSplit><<<grid, kWarps * 32, 0, stream>>>(k);
  } else if (nt == 2) {
    Mxfp4Kernel<2, kGlu, kSplit><<<grid, kWarps * 32, 0, stream>>>(k);
  } else if (nt == 4) {
    Mxfp4Kernel<4, kGlu, kSplit><<<grid, kWarps * 32, 0, stream>>>(k);
  } else {
    Mxfp4Kernel<8, kGlu, kSplit><<<grid, kWarps * 32, 0, stream>>>(k);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t Mxfp4Experts(const Mxfp4ExpertsArgs& a, Mxfp4Workspace& ws, cudaStream_t stream) {
  Mxfp4Workspace::Buffers& b = *ws.b_;
  const int64_t P = a.N * a.top_k;
  const bool split = a.x_lo != 0;
  if (a.N < 0 || a.D % 32 != 0 || a.I % 32 != 0 || a.D <= 0 || a.I <= 0 || a.top_k <= 0 || a.num_experts <= 0 ||
      a.num_experts > 8192 || a.x_lo % 2 != 0)
    return cudaErrorInvalidValue;
  if (P > b.max_pairs || a.D > b.D || a.I > b.I || a.num_experts > b.E) return cudaErrorInvalidValue;
  if (a.N == 0) return a.experts_hit ? cudaMemsetAsync(a.experts_hit, 0, sizeof(int32_t), stream) : cudaSuccess;
  if (!a.x || !a.idx || !a.w || !a.w1 || !a.s1 || !a.w3 || !a.s3 || !a.w2 || !a.s2 || (split ? !a.out_f32 : !a.out))
    return cudaErrorInvalidValue;
  cudaError_t e = MoePermute(P, a.idx, a.num_experts, b.counts, b.offsets, b.slot_pair, b.pair_slot, stream);
  if (e != cudaSuccess) return e;
  const int64_t avg = (P + a.num_experts - 1) / a.num_experts;
  KernelArgs k;
  k.offsets = b.offsets, k.slot_pair = b.slot_pair, k.top_k = static_cast<int>(a.top_k);
  k.act = a.act, k.b1 = a.situ_beta, k.b2 = a.situ_linear_beta;
  const int64_t h_lo = split ? b.max_pairs * b.I : 0, y_lo = split ? b.max_pairs * b.D : 0;
  k.rows = a.I, k.K = a.D, k.wa = a.w1, k.sa = a.s1, k.wb = a.w3, k.sb = a.s3;
  k.x = a.x, k.x_lo = a.x_lo, k.out = b.h, k.out_lo = h_lo;
  e = split ? Launch<true, true>(k, a.num_experts, avg, stream) : Launch<true, false>(k, a.num_experts, avg, stream);
  if (e != cudaSuccess) return e;
  k.rows = a.D, k.K = a.I, k.wa = a.w2, k.sa = a.s2, k.wb = k.sb = nullptr;
  k.x = b.h, k.x_lo = h_lo, k.out = b.y, k.out_lo = y_lo;
  e = split ? Launch<false, true>(k, a.num_experts, avg, stream) : Launch<false, false>(k, a.num_experts, avg, stream);
  if (e != cudaSuccess) return e;
  CombineKernel<<<static_cast<unsigned>(a.N), 256, 0, stream>>>(
      a.D, static_cast<int>(a.top_k), b.pair_slot, a.w, b.y, y_lo, split ? nullptr : a.out, split ? a.out_f32 : nullptr,
      static_cast<int>(a.num_experts), b.counts, a.experts_hit);
  return cudaGetLastError();
}

}  // namespace k3::cuda

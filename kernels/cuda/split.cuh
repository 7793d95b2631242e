// Split-bf16 activations: how the GPU engine stores what it feeds to matrix products.
//
// A value x is kept as two bf16, hi = bf16(x) and lo = bf16(x − hi): 16 significant bits instead of 8. The
// GEMMs multiply hi and lo against the same bf16 weight fragment (two tensor-core MMAs per weight load), so a
// product with an exact bf16 weight (a bf16 checkpoint) is as accurate as with fp32 activations, at the weight
// traffic of plain bf16 — which is what decode time is made of. The halves live in two planes of one buffer:
// hi at p[r·ld + c], lo at p[r·ld + c + lo]. lo = 0 marks plain bf16 (no lo plane).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace k3::cuda {

struct Split {
  __nv_bfloat16* p = nullptr;
  int64_t ld = 0;  // row stride (elements)
  int64_t lo = 0;  // offset of the lo plane from the hi plane (elements); 0: plain bf16

  Split Cols(int64_t c) const { return {p + c, ld, lo}; }
  Split Rows(int64_t r) const { return {p + r * ld, ld, lo}; }
};

// A product's fp32 sums for a split x as cuBLASLt leaves them (LinearBlas::RunUnfolded): row r of x · Wᵀ is
// p[r·ld + c] + p[(r + lo_rows)·ld + c], the hi rows' sums plus the lo rows'. lo_rows = 0: p alone (any fp32
// matrix). Kernels that read a product once add the halves themselves, and the product needs no fold pass.
// A product run as K slices (LinearArgs::k_parts) leaves one such pair per slice, part_stride floats apart: the
// value is part 0 + part 1 + … in that order. Only kernels that say so take parts > 1 (they use At or Sum4).
constexpr int64_t kMaxSumParts = 4;

struct Sums {
  const float* p = nullptr;
  int64_t ld = 0, lo_rows = 0;
  int64_t parts = 1, part_stride = 0;

  Sums Cols(int64_t c) const { return {p + c, ld, lo_rows, parts, part_stride}; }
  bool PartsOk() const { return parts >= 1 && parts <= kMaxSumParts; }  // for the kernels that take parts > 1
#ifdef __CUDACC__
  __device__ __forceinline__ float Part(int64_t k, int64_t r, int64_t c) const {
    const float* q = p + k * part_stride + r * ld + c;
    return lo_rows != 0 ? q[0] + q[lo_rows * ld] : q[0];
  }
  __device__ __forceinline__ float At(int64_t r, int64_t c) const {
    float v = Part(0, r, c);
    for (int64_t k = 1; k < parts; ++k) v += Part(k, r, c);
    return v;
  }
  // Part of columns c .. c + 3 in one 16-byte load a row (p, ld, part_stride and c multiples of 4 floats).
  __device__ __forceinline__ float4 Part4(int64_t k, int64_t r, int64_t c) const {
    const float4* q = reinterpret_cast<const float4*>(p + k * part_stride + r * ld + c);
    const float4 h = q[0];
    if (lo_rows == 0) return h;
    const float4 l = q[lo_rows * ld / 4];
    return {h.x + l.x, h.y + l.y, h.z + l.z, h.w + l.w};
  }
#endif
};

#ifdef __CUDACC__
__device__ __forceinline__ void StoreSplit(__nv_bfloat16* p, int64_t lo, float x) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(x);
  p[0] = hi;
  if (lo != 0) p[lo] = __float2bfloat16_rn(x - __bfloat162float(hi));
}

__device__ __forceinline__ float LoadSplit(const __nv_bfloat16* p, int64_t lo) {
  const float hi = __bfloat162float(p[0]);
  return lo != 0 ? hi + __bfloat162float(p[lo]) : hi;
}

// StoreSplit of four consecutive values in two 8-byte stores (p and p + lo on 8 bytes).
__device__ __forceinline__ void StoreSplit4(__nv_bfloat16* p, int64_t lo, const float (&x)[4]) {
  __nv_bfloat16 hi[4], lo4[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    hi[q] = __float2bfloat16_rn(x[q]);
    lo4[q] = __float2bfloat16_rn(x[q] - __bfloat162float(hi[q]));
  }
  *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(hi);
  if (lo != 0) *reinterpret_cast<uint2*>(p + lo) = *reinterpret_cast<const uint2*>(lo4);
}

// x as StoreSplit then LoadSplit leave it (16 significant bits): what a kernel reads from a product's folded split
// output, computed from its unfolded sums instead.
__device__ __forceinline__ float RoundSplit(float x) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(x);
  return __bfloat162float(hi) + __bfloat162float(__float2bfloat16_rn(x - __bfloat162float(hi)));
}
#endif

}  // namespace k3::cuda

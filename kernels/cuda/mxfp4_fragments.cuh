// The MXFP4 fragment order (Mxfp4ToFragments, mxfp4.cu) as the kernels decode it: a lane's 8 bytes of a
// 16-row × 32-input block into its bf16 A fragments. Shared by the direct kernels and the dequantizing copiers of
// the grouped wgmma experts (experts_wgmma.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace k3::cuda::mxfp4 {

// The code layout. Lane (g = l/4, t = l%4) of a warp owns, per 16 rows × 32 inputs, rows g and g + 8 at inputs
// 8t .. 8t + 7: the k order inside the block is permuted (A and B alike, so the products are unchanged) so that
// its x is one 16-byte load. Its eight A registers j (k16 step j/4, fragment register j%4: row g + 8·(j&1),
// inputs 8t + 4·(j/4) + 2·((j%4)/2) + {0, 1}) each hold two codes, whose checkpoint byte is D_j (low nibble =
// even input). Register j is placed by bits of the lane's 64 stored bits Z: out_j = kM & (F(o1_j) ^ F(o2_j)),
// F(o) the 32 bits of Z from bit o on (cyclic), kM the bits a code's sign and e1 e0 m take in a bf16
// (15, 8..6 in each half). Upload solves this linear system over GF(2) for Z. The eight (o1, o2): 17 SHF / LOP3
// a lane for 16 codes, found by search (no choice of plain rotations covers all 64 bits).
constexpr uint32_t kM = 0x81C081C0u;
constexpr int kO1[8] = {0, 32, 3, 6, 35, 10, 13, 38};
constexpr int kO2[8] = {-1, -1, -1, -1, -1, 36, 37, 42};
constexpr int kMBits[8] = {6, 7, 8, 15, 22, 23, 24, 31};
// Scales of a [rows, K] matrix (KB = K / 32 blocks a row): block (r16, kb)'s 16 bytes at (r16·KB + kb)·16, the
// pair (row g, row g + 8) at 2g, each u with 2^(u − 127) the block's scale over 2^R; then R of row r at rows·KB + r.

template <int o>
__device__ __forceinline__ uint32_t Window(uint32_t z0, uint32_t z1) {
  return o < 32 ? __funnelshift_r(z0, z1, o % 32) : __funnelshift_r(z1, z0, o % 32);
}
template <int j>
__device__ __forceinline__ uint32_t Place(uint32_t z0, uint32_t z1) {
  if constexpr (kO2[j] < 0) {
    return Window<kO1[j]>(z0, z1) & kM;
  } else {
    return (Window<kO1[j]>(z0, z1) ^ Window<kO2[j]>(z0, z1)) & kM;
  }
}
__device__ __forceinline__ uint32_t Mul(uint32_t v, uint32_t s) {
  __nv_bfloat162 a, b;
  *reinterpret_cast<uint32_t*>(&a) = v, *reinterpret_cast<uint32_t*>(&b) = s;
  const __nv_bfloat162 w = __hmul2(a, b);
  return *reinterpret_cast<const uint32_t*>(&w);
}
// A lane's 16 weights of a (r16, kb) block as its A fragments of the two k16 steps: each register one funnel
// shift and one LOP3 (a few two), one HMUL2 by the row's 2^(u − 127) (exact).
__device__ __forceinline__ void Dequant(uint2 q, uint32_t s, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
  const uint32_t lo = __byte_perm(s, 0, 0x0404) >> 1, hi = __byte_perm(s, 0, 0x1414) >> 1;  // bf16x2 2^(u−127)
  a0[0] = Mul(Place<0>(q.x, q.y), lo), a0[1] = Mul(Place<1>(q.x, q.y), hi);
  a0[2] = Mul(Place<2>(q.x, q.y), lo), a0[3] = Mul(Place<3>(q.x, q.y), hi);
  a1[0] = Mul(Place<4>(q.x, q.y), lo), a1[1] = Mul(Place<5>(q.x, q.y), hi);
  a1[2] = Mul(Place<6>(q.x, q.y), lo), a1[3] = Mul(Place<7>(q.x, q.y), hi);
}

}  // namespace k3::cuda::mxfp4

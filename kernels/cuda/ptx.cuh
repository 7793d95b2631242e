// Thin wrappers over the sm_80+ instructions the KDA kernels use: cp.async, ldmatrix and the
// m16n8k16 bf16 tensor-core MMA (fp32 accumulate).
//
// Fragment layouts (lane = 4·gid + tig):
//   A 16×16 (row-major):  a0 = (gid, 2tig..+1)  a1 = (gid+8, 2tig..+1)  a2 = (gid, 2tig+8..+9)  a3 = (gid+8, 2tig+8..+9)
//   B 16×8 (k × n):       b0 = (k 2tig..+1, n gid)  b1 = (k 2tig+8..+9, n gid)
//   C 16×8 fp32:          c0 = (gid, 2tig)  c1 = (gid, 2tig+1)  c2 = (gid+8, 2tig)  c3 = (gid+8, 2tig+1)
// Two bf16 of one register: the lower column (or k) index in the low half.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace k3::cuda::ptx {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared, bypassing L1; src_bytes = 0 writes zeros (src must still be a valid address). At: to a
// shared-memory address (SmemAddr) the caller computed once.
__device__ __forceinline__ void CpAsync16At(uint32_t smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, int src_bytes = 16) {
  CpAsync16At(SmemAddr(smem), gmem, src_bytes);
}
// An L2 policy for data read once (streamed weights): evict its lines first, so that what is read again stays.
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// CpAsync16 under an L2 cache policy (EvictFirstPolicy).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, int src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(SmemAddr(smem)), "l"(gmem),
               "r"(src_bytes), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWaitGroup() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p))
               : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p))
               : "memory");
}

// d += a · b
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Lane addresses for ldmatrix.x4 on a bf16 tile stored row-major with leading dimension ld (elements):
// A 16×16 at (r0, c0) of a [m][k] array.
__device__ __forceinline__ const __nv_bfloat16* FragA(const __nv_bfloat16* s, int ld, int r0, int c0, int lane) {
  return s + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8;
}
// A 16×16 (m0.., k0..) of a matrix stored transposed, as [k][m] (use with LdMatrixX4Trans).
__device__ __forceinline__ const __nv_bfloat16* FragAT(const __nv_bfloat16* s, int ld, int k0, int m0, int lane) {
  return s + (k0 + (lane & 7) + ((lane >> 4) << 3)) * ld + m0 + ((lane >> 3) & 1) * 8;
}
// B for two n-tiles (k0..k0+15, n0..n0+15) of a [k][n] array (use with LdMatrixX4Trans):
// r[0], r[1] = b0, b1 of columns n0..n0+7; r[2], r[3] = those of n0+8..n0+15.
__device__ __forceinline__ const __nv_bfloat16* FragBT(const __nv_bfloat16* s, int ld, int k0, int n0, int lane) {
  return s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8;
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace k3::cuda::ptx

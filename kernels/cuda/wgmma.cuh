// Thin wrappers over the Hopper (sm_90a) warpgroup MMA: D[64 × N] += A[64 × 16] · B[16 × N]ᵀ, bf16 in, fp32 out,
// both operands read by the tensor cores straight from shared memory through matrix descriptors.
//
// Operand tiles are K-major with the 128-byte swizzle: rows of 64 bf16 (128 bytes), the 16-byte chunk c of row r
// stored at chunk c ^ (r & 7), eight-row groups 1024 bytes apart, the tile 1024-byte aligned — the layout that
// cp.async writes with Swz() below. A k16 step within the 64-wide tile advances the descriptor by 32 bytes.
//
// Accumulator fragment of warp w (of the warpgroup), lane = 4·gid + tig, for n8 block j:
//   d[4j] = (row 16w + gid, col 8j + 2tig)   d[4j + 1] = (…, col + 1)   d[4j + 2], d[4j + 3]: row + 8
// i.e. mma.sync's C layout per 16 × 8 tile.
#pragma once

#include <cstdint>

#include "kernels/cuda/ptx.cuh"

// wgmma exists on sm_90a only; other targets compile these to a trap (the engine's GPU path is built for 90a).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define K3_WGMMA_ASM(...) __trap()
#else
#define K3_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#endif

namespace k3::cuda::wgmma {

constexpr int kRowBytes = 128;  // a swizzled row: 64 bf16 of k

// Element offset of (row, 16-byte chunk c) in a [rows][64] bf16 tile with the 128-byte swizzle.
__device__ __forceinline__ int Swz(int row, int c) { return row * 64 + ((c ^ (row & 7)) << 3); }

// Descriptor of a K-major, 128-byte-swizzled tile at shared address `addr` (1024-aligned; + 32 per k16 step):
// start address >> 4, leading offset unused (1), stride 1024 bytes between eight-row groups, swizzle mode 1.
// The same fields describe an MN-major operand of 64 M (or N) values a row (`imm-trans` set, Mma32<1>): rows are
// then k, the stride is between eight-k groups (+ 2048 bytes per k16 step), and the leading offset (to the next 64
// M values) is unused at m64.
__device__ __forceinline__ uint64_t Desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// Before the first MMA that reads registers written by other instructions (the zeroed accumulators).
__device__ __forceinline__ void Fence() { K3_WGMMA_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void Commit() { K3_WGMMA_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void Wait() {
  K3_WGMMA_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by threads (st.shared, cp.async) becomes visible to the MMAs' async proxy.
__device__ __forceinline__ void FenceProxyAsync() { K3_WGMMA_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving accumulator reads or writes across an asynchronous MMA.
template <int R>
__device__ __forceinline__ void FenceRegs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// mbarriers and register reallocation for warp-specialized kernels (a copier warpgroup feeding MMA warpgroups).
__device__ __forceinline__ void MbarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(ptx::SmemAddr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(ptx::SmemAddr(bar)) : "memory");
}
__device__ __forceinline__ bool MbarTryWait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(ptx::SmemAddr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits for the completion of the barrier's phase with this parity (the phase before the first: at once).
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  while (!MbarTryWait(bar, parity)) {
  }
}
// This thread's cp.asyncs issued so far arrive on bar when they complete (counted in the barrier's init count).
__device__ __forceinline__ void CpAsyncArrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(ptx::SmemAddr(bar)) : "memory");
}
template <int N>
__device__ __forceinline__ void RegsUpTo() {
  K3_WGMMA_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void RegsDownTo() {
  K3_WGMMA_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// A ring of kStages shared-memory buffers of kBytes for a producer feeding MMA warpgroups: the buffers at the
// 1024-aligned start of dynamic shared memory (the swizzle's period), a full and an empty mbarrier per buffer after
// them. The producer and the consumers each walk it with their own copy (stage, and the parity of the barriers'
// next phase).
template <int kStages, int kBytes>
struct Ring {
  static constexpr int kSmem = kStages * kBytes + 1024 + 2 * kStages * 8;  // buffers, alignment, barriers
  static_assert(kBytes % 1024 == 0, "buffers on 1024 bytes");

  unsigned char* base;
  uint64_t *full, *empty;
  int stage = 0;
  uint32_t phase = 0;
  int held = -1;  // a consumer's last stage, not yet released

  __device__ explicit Ring(unsigned char* smem_raw)
      : base(reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023})),
        full(reinterpret_cast<uint64_t*>(base + kStages * kBytes)),
        empty(full + kStages) {}
  // One thread, before a barrier of the whole CTA: arrivals that complete a full / an empty phase.
  __device__ void Init(int fill_arrivals, int free_arrivals) {
    for (int s = 0; s < kStages; ++s) MbarInit(full + s, fill_arrivals), MbarInit(empty + s, free_arrivals);
  }
  __device__ unsigned char* Buffer() const { return base + stage * kBytes; }
  __device__ void WaitFree() { MbarWait(empty + stage, phase ^ 1); }  // the producer: its last use is done
  __device__ void WaitFilled() { MbarWait(full + stage, phase); }     // a consumer: its bytes are in
  __device__ void Advance() {
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
  // A consumer, its MMAs on this stage issued: the stage before it is released (its MMAs are past MmaStage's
  // wait), this one held until the next Consumed or Release.
  __device__ void Consumed(bool leader) {
    Release(leader);
    held = stage;
    Advance();
  }
  // After the last stage's MMAs are waited for.
  __device__ void Release(bool leader) {
    if (held >= 0 && leader) MbarArrive(empty + held);
    held = -1;
  }
};

// d (N / 2 fp32 per thread) += A · Bᵀ, A and B given by descriptors (m64nNk16). N = 256 (the experts' tile), 128 or
// 104 (the LM head's); other widths: branch linear-stream.
template <int N>
__device__ void Mma(float (&d)[N / 2], uint64_t a, uint64_t b);

// d (16 fp32 per thread) += A · Bᵀ (m64n32k16); kTransA: A MN-major, else K-major. MLA's decode.
template <int kTransA>
__device__ __forceinline__ void Mma32(float (&d)[16], uint64_t a, uint64_t b) {
  K3_WGMMA_ASM(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7,"
      "%8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(1), "n"(kTransA)
      : "memory");
}

template <>
__device__ __forceinline__ void Mma<128>(float (&d)[64], uint64_t a, uint64_t b) {
  K3_WGMMA_ASM(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7,"
      "%8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23,"
      "%24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39,"
      "%40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55,"
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(1)
      : "memory");
}

template <>
__device__ __forceinline__ void Mma<104>(float (&d)[52], uint64_t a, uint64_t b) {
  K3_WGMMA_ASM(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %54, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n104k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7,"
      "%8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23,"
      "%24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39,"
      "%40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51"
      "}, %52, %53, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51])
      : "l"(a), "l"(b), "r"(1)
      : "memory");
}

template <>
__device__ __forceinline__ void Mma<256>(float (&d)[128], uint64_t a, uint64_t b) {
  K3_WGMMA_ASM(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7,"
      "%8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23,"
      "%24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39,"
      "%40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55,"
      "%56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71,"
      "%72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87,"
      "%88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103,"
      "%104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119,"
      "%120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(1)
      : "memory");
}

// One ring stage: d += A · Bᵀ over a 64-wide k tile (four k16 steps of swizzled tiles at shared addresses sa, sb),
// then wait until the MMAs of the stage before are done, so that its buffers can be freed (one stage in flight).
template <int N>
__device__ __forceinline__ void MmaStage(float (&d)[N / 2], uint32_t sa, uint32_t sb) {
  FenceRegs(d);
  Fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) Mma<N>(d, Desc(sa + 32 * kk), Desc(sb + 32 * kk));
  Commit();
  Wait<1>();
  FenceRegs(d);
}

}  // namespace k3::cuda::wgmma

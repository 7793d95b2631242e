// Grouped expert GEMMs on the Hopper tensor cores (sm_90a) for many tokens per expert: included by experts.cu
// (it uses that file's TileArgs-free helpers: GLU, the slot map, the tile list the permutation writes).
//
// A CTA takes 128 slots of one expert (its tile of the permutation) × 256 output columns — gate/up: 128 features
// of W1 and the same 128 of W3, so a thread holds a feature's gate and up sums and applies the GLU in registers;
// down: 256 features of W2 — over K in 64-wide steps. Warpgroup 0 copies: token rows through the slot map
// (gathered, so x is never copied out) and weight rows, by cp.async into a 4-stage ring in the 128-byte-swizzled
// layout wgmma reads; each copier's arrivals on a stage's barrier complete when its copies land. Warpgroups 1
// and 2 multiply 64 slots each with m64n256k16 (128 fp32 accumulators a thread) and free a stage once the MMAs
// that read it are done; a warpgroup whose 64 slots are past the expert's segment skips its MMAs. The grid is
// persistent: items (tile, column block) in turn, the ring running on across items, so the next item's copies
// overlap an item's epilogue. No host synchronization: graph-capturable.
#pragma once

#include "kernels/cuda/mxfp4_fragments.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace k3::cuda {
namespace {

namespace wg {
constexpr int kBM = 128, kBN = 256, kStages = 4;  // k steps of experts.cu's kBK = 64: one swizzled row
static_assert(kBK * 2 == wgmma::kRowBytes, "a k step is one 128-byte row");
constexpr int kABytes = kBM * wgmma::kRowBytes, kBBytes = kBN * wgmma::kRowBytes;  // 16 KB, 32 KB
constexpr int kStageBytes = kABytes + kBBytes;
using StageRing = wgmma::Ring<kStages, kStageBytes>;
constexpr int kSmem = StageRing::kSmem;
constexpr int kThreads = 384;
// 128·72 + 256·216 = 384·168, the registers the CTA starts with (setmaxnreg.inc waits for what .dec frees)
constexpr int kCopierRegs = 72, kMmaRegs = 216;
// MXFP4 weights: each stage's B tile also has its codes and scales (256 rows × 2 k32 blocks: 16 r16 groups × 2
// blocks × 256 + 16 bytes) staged after the ring's barriers, which the MMA warpgroups dequantize into the B tile
// while the stage before multiplies. Four stages fit only without the alignment slack the ring reserves (227 KB
// with 960 bytes to spare): the kernel traps should the dynamic shared memory start more than that off 1024 bytes.
constexpr int kStagedCodes = kBN / 16 * 2 * 256, kStagedBytes = kStagedCodes + kBN / 16 * 2 * 16;  // 8 KB + 512
constexpr int kSmemMx = 227 * 1024;
constexpr int kMxUsed = kStages * kStageBytes + 2 * kStages * 8 + kStages * kStagedBytes;
static_assert(kMxUsed <= kSmemMx, "four stages and their codes");
}  // namespace wg

// The gated activation in the epilogue is glu.cuh's GluApprox: with 64 outputs a thread and the tensor cores idle
// meanwhile, the library tanhf / expf / divisions cost ~8% of the whole experts at avg 512 (H200).

// 4 × 4 transpose of 32-bit words across the 4 lanes of a quad (lanes 4·gid + tig): on entry lane t holds
// x[j] = word (t, j), on exit x[i] = word (i, t). Two butterfly steps of two shuffles each.
__device__ __forceinline__ void QuadTranspose(uint32_t (&x)[4], int tig) {
  const bool odd = tig & 1, high = tig & 2;
#pragma unroll
  for (int p = 0; p < 4; p += 2) {  // step 1: swap the off-parity words of lane pairs (t, t ^ 1)
    const uint32_t r = __shfl_xor_sync(0xffffffffu, odd ? x[p] : x[p + 1], 1);
    if (odd) x[p] = r; else x[p + 1] = r;
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {  // step 2: swap the off-half word pairs of lanes (t, t ^ 2)
    const uint32_t r = __shfl_xor_sync(0xffffffffu, high ? x[p] : x[p + 2], 2);
    if (high) x[p] = r; else x[p + 2] = r;
  }
}

// The copiers' token rows of an item: the source row of slot s0 + r0 + 16·i (−1: past the segment, zeros).
__device__ __forceinline__ void TokenRows(const TileArgs& a, int s0, int s_end, int r0,
                                          int32_t (&src_row)[wg::kBM / 16]) {
#pragma unroll
  for (int i = 0; i < wg::kBM / 16; ++i) {
    const int s = s0 + r0 + 16 * i;
    src_row[i] = s >= s_end ? -1 : a.slot_pair ? a.slot_pair[s] / a.top_k : s;
  }
}
// Their cp.asyncs of a stage's A tile: 16-byte chunk c (inputs k .. k + 7) of rows r0 + 16·i.
__device__ __forceinline__ void CopyTokenRows(const TileArgs& a, bf16* ta, const int32_t (&src_row)[wg::kBM / 16],
                                              int r0, int c, int k) {
#pragma unroll
  for (int i = 0; i < wg::kBM / 16; ++i) {
    const bool ok = k < a.K && src_row[i] >= 0;
    ptx::CpAsync16(ta + wgmma::Swz(r0 + 16 * i, c), ok ? a.src + int64_t{src_row[i]} * a.K + k : a.src, ok ? 16 : 0);
  }
}

__device__ __forceinline__ float MxPow2(uint32_t r) { return __uint_as_float((r + 127) << 23); }

// The staged codes and scales of the ring's current stage (after its barriers).
template <class Ring>
__device__ __forceinline__ unsigned char* MxStaged(const Ring& ring) {
  return reinterpret_cast<unsigned char*>(ring.empty + wg::kStages) + ring.stage * wg::kStagedBytes;
}

// The copiers of an MXFP4 kernel (kMx): for each stage, the token rows into the A tile (as the bf16 copiers do) and
// the B tile's codes and scales (MxStaged), all by cp.async: thread tid copies 16-byte parts tid + 128·j of the
// 8 KB of codes (block (r16, kb) at (2·r16 + kb)·256), threads < 32 a block's 16 bytes of scales.
template <bool kGlu, class Ring>
__device__ __forceinline__ void MxCopier(const TileArgs& a, Ring& ring, int items, int col_blocks, int KT) {
  using namespace wg;
  constexpr int kCols = kGlu ? kBN / 2 : kBN;
  const int tid = threadIdx.x, c = tid & 7, r0 = tid >> 3, M = a.M, KB = a.K / 32;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int2 tile = a.tiles[item / col_blocks];
    const int e = tile.x, col0 = item % col_blocks * kCols;
    int32_t src_row[kBM / 16];
    TokenRows(a, tile.y, a.offsets[e + 1], r0, src_row);
    for (int kt = 0; kt < KT; ++kt) {
      ring.WaitFree();
      unsigned char* sa = ring.Buffer();
      unsigned char* st = MxStaged(ring);
      CopyTokenRows(a, reinterpret_cast<bf16*>(sa), src_row, r0, c, kt * kBK + c * 8);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int part = tid + 128 * j, r16 = part / 32, kb = 2 * kt + part / 16 % 2, n0 = 16 * r16;
        const int f = col0 + (kGlu ? n0 & (kBN / 2 - 1) : n0);
        const bool ok = f < M && kb < KB;
        const uint8_t* q = kGlu && n0 >= kBN / 2 ? a.qb[e] : a.qa[e];
        ptx::CpAsync16(st + part * 16, ok ? q + (int64_t{f / 16} * KB + kb) * 256 + part % 16 * 16 : q, ok ? 16 : 0);
      }
      if (tid < 32) {
        const int r16 = tid / 2, kb = 2 * kt + tid % 2, n0 = 16 * r16;
        const int f = col0 + (kGlu ? n0 & (kBN / 2 - 1) : n0);
        const bool ok = f < M && kb < KB;
        const uint8_t* sc = kGlu && n0 >= kBN / 2 ? a.sb[e] : a.sa[e];
        ptx::CpAsync16(st + kStagedCodes + tid * 16, ok ? sc + (int64_t{f / 16} * KB + kb) * 16 : sc, ok ? 16 : 0);
      }
      wgmma::CpAsyncArrive(ring.full + ring.stage);
      ring.Advance();
    }
  }
}

// An MMA thread's share (mt = tid − 128 of the two MMA warpgroups) of a stage's B tile from its staged codes: lane
// slots (r16, kb) = (mt / 64 + 4i, mt / 32 % 2) of lane mt % 32, each Dequant's 16 weights (times the block's scale;
// the row's 2^R is left for the epilogue) as two 16-byte chunks of the swizzled tile. The stores are made visible
// to the MMAs' async proxy, and both warpgroups' shares are in before either multiplies.
__device__ __forceinline__ void MxDequantStage(unsigned char* stage, const unsigned char* st, int mt) {
  using namespace wg;
  bf16* tb = reinterpret_cast<bf16*>(stage + kABytes);
  const int lane = mt & 31, g = lane / 4, t = lane % 4, kb = mt / 32 % 2;
#pragma unroll 2
  for (int i = 0; i < 4; ++i) {
    const int r16 = mt / 64 + 4 * i, blk = 2 * r16 + kb, n0 = 16 * r16 + g;
    uint32_t a0[4], a1[4];
    mxfp4::Dequant(*reinterpret_cast<const uint2*>(st + blk * 256 + lane * 8),
                   *reinterpret_cast<const uint16_t*>(st + kStagedCodes + blk * 16 + 2 * g), a0, a1);
    *reinterpret_cast<uint4*>(tb + wgmma::Swz(n0, 4 * kb + t)) = make_uint4(a0[0], a0[2], a1[0], a1[2]);
    *reinterpret_cast<uint4*>(tb + wgmma::Swz(n0 + 8, 4 * kb + t)) = make_uint4(a0[1], a0[3], a1[1], a1[3]);
  }
  wgmma::FenceProxyAsync();
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the MMA warpgroups only (barrier 0 is __syncthreads)
}

// Items in tile-major order, CTA b taking items b, b + grid, … Measured slower on the H200 at avg 512 (same run,
// ± 100 µs of noise): bands of 16 tiles walked column-major (L2 hit rate 48% → 60%, DRAM traffic −20%, yet
// +50..150 µs) and items claimed through an atomic counter (+350..450 µs).
// kMx: MXFP4 weights (qa, sa, qb, sb) in mxfp4.cuh's fragment order: the copiers stage each step's codes and
// scales (MxCopier), and the MMA warpgroups dequantize them into the B tile (MxDequantStage) while the wgmmas of the
// stage before run.
template <bool kGlu, bool kMx>
__global__ __launch_bounds__(wg::kThreads, 1) void ExpertWgmmaKernel(TileArgs a) {  // src_lo, dst_lo, tile_done: unused
  PdlEnter();
  using namespace wg;
  extern __shared__ unsigned char smem_raw[];
  StageRing ring(smem_raw);
  if (kMx && threadIdx.x == 0 && ring.base - smem_raw + kMxUsed > kSmemMx) __trap();
  // The role through a shuffle: ptxas then knows it is warp-uniform, so the MMA branch is not a divergent path,
  // where it serializes the wgmmas (warning C7518: each waits for the one before; ~7% slower at avg 512).
  const int tid = threadIdx.x, group = __shfl_sync(0xffffffffu, tid / 128, 0);
  if (tid == 0) ring.Init(128, 8);  // copiers; MMA warps
  __syncthreads();
  constexpr int kCols = kGlu ? kBN / 2 : kBN;  // output columns per item
  const int K = a.K, M = a.M, KT = (K + kBK - 1) / kBK, col_blocks = (M + kCols - 1) / kCols;
  const int items = *a.num_tiles * col_blocks;

  if (group == 0) {  // ------------------------------------------------------------------------------ copier
    wgmma::RegsDownTo<kCopierRegs>();
    if constexpr (kMx) {
      MxCopier<kGlu>(a, ring, items, col_blocks, KT);
    } else {
      const int c = tid & 7, r0 = tid >> 3;  // 16-byte chunk c of rows r0 + 16·i
      for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int2 t = a.tiles[item / col_blocks];
        const int e = t.x, col0 = item % col_blocks * kCols;
        int32_t src_row[kBM / 16];
        TokenRows(a, t.y, a.offsets[e + 1], r0, src_row);
        // B rows r0 + 16·i: gate/up i < 8 from W1, i ≥ 8 the same features of W3.
        const bf16* w_lo = a.wa[e];
        const bf16* w_hi = kGlu ? a.wb[e] : w_lo;
        for (int kt = 0; kt < KT; ++kt) {
          ring.WaitFree();
          unsigned char* sa = ring.Buffer();
          bf16* ta = reinterpret_cast<bf16*>(sa);
          bf16* tb = reinterpret_cast<bf16*>(sa + kABytes);
          const int k = kt * kBK + c * 8;
          const bool k_in = k < K;
          CopyTokenRows(a, ta, src_row, r0, c, k);
#pragma unroll 4  // not 16: sixteen hoisted row pointers would spill the copiers' 72 registers
          for (int i = 0; i < kBN / 16; ++i) {
            const int n = r0 + 16 * i, f = col0 + (kGlu ? n & (kBN / 2 - 1) : n);
            const bool ok = k_in && f < M;
            // 32-bit offsets within one expert's matrix (< 2^31 elements): fewer registers for the copiers.
            const bf16* w = kGlu && n >= kBN / 2 ? w_hi : w_lo;
            ptx::CpAsync16(tb + wgmma::Swz(n, c), w + (ok ? f * K + k : 0), ok ? 16 : 0);
          }
          wgmma::CpAsyncArrive(ring.full + ring.stage);
          ring.Advance();
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------------------ MMA warpgroups
  wgmma::RegsUpTo<kMmaRegs>();
  const int half = group - 1, warp = (tid >> 5) & 3, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
  const float inv_b1 = 1.0f / a.beta1, inv_b2 = 1.0f / a.beta2;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int2 t = a.tiles[item / col_blocks];
    const int s0 = t.y, s_end = a.offsets[t.x + 1], col0 = item % col_blocks * kCols;
    const bool live = s0 + 64 * half < s_end;  // any of this warpgroup's 64 slots in the segment
    float acc[kBN / 2];
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < KT; ++kt) {
      ring.WaitFilled();
      if constexpr (kMx) MxDequantStage(ring.Buffer(), MxStaged(ring), tid - 128);  // both warpgroups, live or not
      if (live) {
        wgmma::FenceProxyAsync();  // the copiers' cp.async writes, seen by the MMAs' async proxy
        const uint32_t st = ptx::SmemAddr(ring.Buffer());
        wgmma::MmaStage<kBN>(acc, st + half * 64 * wgmma::kRowBytes, st + kABytes);
      }
      ring.Consumed(lane == 0);
    }
    // Unconditional (a warpgroup that issued nothing returns at once): under `if (live)` ptxas adds a wait of its
    // own on the other path (C7517).
    wgmma::Wait<0>();
    wgmma::FenceRegs(acc);
    ring.Release(lane == 0);
    if (!live) continue;

    // Accumulator (row 16·warp + gid [+ 8], column 8j + 2tig [+ 1]) = acc[4j + (0, 1) (+ 2)]. Four n8 blocks of
    // a row at a time, one bf16 pair of each per lane: a quad transpose gives lane tig the 8 columns of block
    // 4q + tig, stored as 16 bytes (a quad writes 64 contiguous bytes of the row: whole 32-byte sectors, and a
    // quarter of the store instructions of one bf16 pair per lane).
    constexpr int kOutBlocks = kGlu ? kBN / 16 : kBN / 8;  // n8 blocks of output columns
#pragma unroll
    for (int h8 = 0; h8 < 2; ++h8) {
      const int s = s0 + 64 * half + 16 * warp + gid + 8 * h8;
      bf16* row = a.dst + int64_t{s} * M;
#pragma unroll
      for (int q = 0; q < kOutBlocks / 4; ++q) {
        uint32_t x[4];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int j = 4 * q + jj;
          float v0 = acc[4 * j + 2 * h8], v1 = acc[4 * j + 2 * h8 + 1];
          float u0 = kGlu ? acc[4 * (j + kBN / 16) + 2 * h8] : 0.0f;
          float u1 = kGlu ? acc[4 * (j + kBN / 16) + 2 * h8 + 1] : 0.0f;
          if (kMx) {  // the rows' 2^R (mxfp4_fragments.cuh)
            const int f = col0 + 8 * j + 2 * tig;
            if (f < M) {
              const uint8_t* ra = a.sa[t.x] + int64_t{M} * (K / 32) + f;
              v0 *= MxPow2(ra[0]), v1 *= MxPow2(ra[1]);
              if (kGlu) {
                const uint8_t* rb = a.sb[t.x] + int64_t{M} * (K / 32) + f;
                u0 *= MxPow2(rb[0]), u1 *= MxPow2(rb[1]);
              }
            }
          }
          if (kGlu) {
            v0 = GluApprox(a.act, v0, u0, a.beta1, inv_b1, a.beta2, inv_b2);
            v1 = GluApprox(a.act, v1, u1, a.beta1, inv_b1, a.beta2, inv_b2);
          }
          x[jj] = ptx::PackBf16(v0, v1);
        }
        QuadTranspose(x, tig);  // every lane takes part; only the store depends on the row and column
        const int col = col0 + 8 * (4 * q + tig);
        if (s < s_end && col < M)  // M % 8 == 0: a block is all in or all out
          *reinterpret_cast<uint4*>(row + col) = make_uint4(x[0], x[1], x[2], x[3]);
      }
    }
  }
}

}  // namespace
}  // namespace k3::cuda

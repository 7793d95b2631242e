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
constexpr int kCopierRegs = 72, kMmaRegs = 216;  // 128·72 + 256·216 ≤ 64K registers; no spills
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

// Items in tile-major order, CTA b taking items b, b + grid, … Measured slower on the H200 at avg 512 (same run,
// ± 100 µs of noise): bands of 16 tiles walked column-major (L2 hit rate 48% → 60%, DRAM traffic −20%, yet
// +50..150 µs) and items claimed through an atomic counter (+350..450 µs).
template <bool kGlu>
__global__ __launch_bounds__(wg::kThreads, 1) void ExpertWgmmaKernel(TileArgs a) {  // src_lo, dst_lo, tile_done: unused
  PdlEnter();
  using namespace wg;
  extern __shared__ unsigned char smem_raw[];
  StageRing ring(smem_raw);
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
    const int c = tid & 7, r0 = tid >> 3;  // 16-byte chunk c of rows r0 + 16·i
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const int2 t = a.tiles[item / col_blocks];
      const int e = t.x, s0 = t.y, s_end = a.offsets[e + 1], col0 = item % col_blocks * kCols;
      int32_t src_row[kBM / 16];  // −1: past the segment (zeros)
#pragma unroll
      for (int i = 0; i < kBM / 16; ++i) {
        const int s = s0 + r0 + 16 * i;
        src_row[i] = s >= s_end ? -1 : a.slot_pair ? a.slot_pair[s] / a.top_k : s;
      }
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
#pragma unroll
        for (int i = 0; i < kBM / 16; ++i) {
          const bool ok = k_in && src_row[i] >= 0;
          ptx::CpAsync16(ta + wgmma::Swz(r0 + 16 * i, c), ok ? a.src + int64_t{src_row[i]} * K + k : a.src,
                         ok ? 16 : 0);
        }
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
          if (kGlu) {
            v0 = GluApprox(a.act, v0, acc[4 * (j + kBN / 16) + 2 * h8], a.beta1, inv_b1, a.beta2, inv_b2);
            v1 = GluApprox(a.act, v1, acc[4 * (j + kBN / 16) + 2 * h8 + 1], a.beta1, inv_b1, a.beta2, inv_b2);
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

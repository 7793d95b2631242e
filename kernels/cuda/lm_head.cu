// The LM head (lm_head.cuh) on the Hopper tensor cores, warp-specialized like the experts' wgmma kernel
// (experts_wgmma.cuh) but fed by the TMA: a persistent CTA per SM takes items of 64 x rows × 208 vocabulary rows
// over all of K in 64-wide steps. One thread of warpgroup 0 loads each stage with two tensor copies (the W tile
// and the x tile, 128-byte swizzled as wgmma reads them, zeros past the edges) into a 6-stage ring; warpgroups 1
// and 2 each multiply the 64 x rows (A, m64) by 104 of the W rows (B, n104) and free a stage once their MMAs that
// read it are done. 208 rows an item: Kimi's 163,840-row vocabulary makes 788 items, 5.97 a CTA on 132 SMs, where
// 256-row items made 640, 4.85 a CTA, whose last round left 15% of the SMs idle. Epilogue in registers: each
// row's best over the item's columns into its key (a quad reduction, one 64-bit atomicMax per row and warpgroup),
// the logits when kept. With cp.async copies by a warpgroup instead, the head streamed 3.6 TB/s whatever the rows
// (copier-bound).
//
// The ring's first W tiles are requested before the wait for the kernel before (PDL): the head's first bytes
// stream while the final RMSNorm finishes.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>

#include "kernels/cuda/cuda_try.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/lm_head.cuh"
#include "kernels/cuda/ptx.cuh"
#include "kernels/cuda/sampling.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace k3::cuda {
namespace {

constexpr int kRows = 64;   // x rows per item: the MMA's m
constexpr int kWgN = 104;        // vocabulary rows per MMA warpgroup: the MMA's n
constexpr int kBN = 2 * kWgN;    // vocabulary rows per item
constexpr int kBK = 64;          // k per stage: one swizzled 128-byte row
constexpr int kStages = 6;
constexpr int kABytes = kRows * wgmma::kRowBytes, kBBytes = kBN * wgmma::kRowBytes;  // 8 KB, 26 KB
constexpr int kStageBytes = kABytes + kBBytes;
using StageRing = wgmma::Ring<kStages, kStageBytes>;
constexpr int kSmem = StageRing::kSmem;
constexpr int kThreads = 384;
static_assert(kABytes % 1024 == 0 && kWgN * wgmma::kRowBytes % 1024 == 0,
              "tiles on 1024 bytes (the swizzle's period)");
static_assert(kBK * 2 == wgmma::kRowBytes, "a stage is one swizzled row of k (wgmma::MmaStage)");

// The tile at (c0 inner, c1 outer) of a 2-D tensor map into shared memory; its bytes complete on bar.
__device__ __forceinline__ void TmaLoad(void* dst, const CUtensorMap& map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          ptx::SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(ptx::SmemAddr(bar))
      : "memory");
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(ptx::SmemAddr(bar)), "r"(bytes)
               : "memory");
}

__global__ __launch_bounds__(kThreads, 1) void LmHeadKernel(const LmHeadArgs a, const __grid_constant__ CUtensorMap w_map,
                                                             const __grid_constant__ CUtensorMap x_map,
                                                             int vocab_blocks, int passes) {
  extern __shared__ unsigned char smem_raw[];
  StageRing ring(smem_raw);
  // The role through a shuffle, so ptxas sees it warp-uniform (experts_wgmma.cuh: C7518).
  const int tid = threadIdx.x, group = __shfl_sync(0xffffffffu, tid / 128, 0);
  if (tid == 0) ring.Init(1, 8);  // loader; MMA warps
  __syncthreads();
  const int64_t V = a.V, K = a.K, M = a.M;
  const int KT = static_cast<int>((K + kBK - 1) / kBK), items = vocab_blocks * passes;

  if (group == 0) {  // ------------------------------------------------------------------------------ loader
    if (tid != 0) return;
    // The first item's first kStages W tiles fill the empty ring before the wait for the kernel before (x is its
    // output, W is not): they stream while the final norm and what precedes it finish.
    const int early = blockIdx.x < items ? min(KT, kStages) : 0;
    for (int kt = 0; kt < early; ++kt) {
      MbarExpectTx(ring.full + kt, kStageBytes);
      TmaLoad(ring.base + kt * kStageBytes + kABytes, w_map, kt * kBK, (blockIdx.x / passes) * kBN, ring.full + kt);
    }
    PdlEnter();
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      // Vocabulary-block-major: the CTAs working at once share W blocks across passes (prefill logits).
      const int m0 = (item % passes) * kRows, v0 = (item / passes) * kBN;
      for (int kt = 0; kt < KT; ++kt) {
        unsigned char* st = ring.Buffer();
        uint64_t* filled = ring.full + ring.stage;
        if (item == static_cast<int>(blockIdx.x) && kt < early) {
          TmaLoad(st, x_map, kt * kBK, m0, filled);  // its W tile is on its way (stage kt of a fresh ring)
        } else {
          ring.WaitFree();
          MbarExpectTx(filled, kStageBytes);
          TmaLoad(st + kABytes, w_map, kt * kBK, v0, filled);
          TmaLoad(st, x_map, kt * kBK, m0, filled);
        }
        ring.Advance();
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------------------ MMA warpgroups
  const int h = group - 1, warp = (tid >> 5) & 3, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t m0 = int64_t{item % passes} * kRows, v0 = int64_t{item / passes} * kBN + kWgN * h;
    float acc[kWgN / 2];
#pragma unroll
    for (int i = 0; i < kWgN / 2; ++i) acc[i] = 0.0f;
    for (int kt = 0; kt < KT; ++kt) {
      ring.WaitFilled();
      const uint32_t sa = ptx::SmemAddr(ring.Buffer());
      wgmma::MmaStage<kWgN>(acc, sa, sa + kABytes + h * kWgN * wgmma::kRowBytes);
      ring.Consumed(lane == 0);
    }
    wgmma::Wait<0>();
    wgmma::FenceRegs(acc);
    ring.Release(lane == 0);

    // acc[4j + 2r + e] = (x row m0 + 16·warp + gid + 8r, vocabulary row v0 + 8j + 2·tig + e).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t t = m0 + 16 * warp + gid + 8 * r;
      const bool t_ok = t < M;
      uint64_t best = 0;
#pragma unroll
      for (int j = 0; j < kWgN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t v = v0 + 8 * j + 2 * tig + e;
          if (v < V) {
            const float y = acc[4 * j + 2 * r + e];
            best = max(best, ArgmaxKey(y, v));
            if (a.logits && t_ok) a.logits[t * a.ldl + v] = y;
          }
        }
      if (a.argmax_keys) {
        best = max(best, __shfl_xor_sync(0xffffffffu, best, 1));
        best = max(best, __shfl_xor_sync(0xffffffffu, best, 2));
        if (tig == 0 && t_ok && best != 0)
          atomicMax(reinterpret_cast<unsigned long long*>(a.argmax_keys + t), static_cast<unsigned long long>(best));
      }
    }
  }
}

// A 2-D bf16 tensor map of rows × inner elements (row stride row_elems), 128-byte swizzled boxes of
// box_rows × 64; elements past the edges read as zeros. W's requests are widened to 256 bytes in L2 for a few rows,
// where each stage's MMAs are short and the next k step's bytes arriving with this one's help (H200, 1 row: 189.1
// against 199.8 µs without), but not from kPlainReadRows rows on, where the widening costs the stream bandwidth
// (64 rows: 188.6 against 192.0 µs with it).
constexpr int64_t kPlainReadRows = 32;
cudaError_t Map(CUtensorMap* map, const __nv_bfloat16* p, int64_t inner, int64_t rows, int64_t row_elems, int box_rows,
               CUtensorMapL2promotion promotion) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
    return e == cudaSuccess && q == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f)
                                                                 : nullptr;
  }();
  if (!encode) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_elems) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {kBK, static_cast<cuuint32_t>(box_rows)}, elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(p), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LmHead(const LmHeadArgs& a, cudaStream_t stream) {
  if (a.V <= 0 || a.K <= 0 || a.K % 8 != 0 || a.M < 0 || !a.w || !a.x.p || (!a.logits && !a.argmax_keys) ||
      (a.logits && a.ldl < a.V))
    return cudaErrorInvalidValue;
  // 16-byte cp.async of every row of W and x.
  if (reinterpret_cast<uintptr_t>(a.w) % 16 != 0 || reinterpret_cast<uintptr_t>(a.x.p) % 16 != 0 || a.x.ld % 8 != 0)
    return cudaErrorMisalignedAddress;
  if (a.M == 0) return cudaSuccess;
  static const cudaError_t attr = cudaFuncSetAttribute(LmHeadKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  K3_CUDA_TRY(attr);
  int sms = 0;
  K3_CUDA_TRY(SmCount(&sms));
  const int64_t passes = (a.M + kRows - 1) / kRows, vocab_blocks = (a.V + kBN - 1) / kBN;
  // Tensor map coordinates are 32-bit.
  if (passes * vocab_blocks > 0x7fffffff || a.V > 0x7fffffff || a.M > 0x7fffffff || a.K > 0x7fffffff)
    return cudaErrorInvalidValue;
  const int64_t items = passes * vocab_blocks;
  CUtensorMap w_map, x_map;
  K3_CUDA_TRY(Map(&w_map, a.w, a.K, a.V, a.K, kBN,
                  a.M >= kPlainReadRows ? CU_TENSOR_MAP_L2_PROMOTION_NONE : CU_TENSOR_MAP_L2_PROMOTION_L2_256B));
  K3_CUDA_TRY(Map(&x_map, a.x.p, a.K, a.M, a.x.ld, kRows, CU_TENSOR_MAP_L2_PROMOTION_L2_256B));
  K3_CUDA_TRY(LaunchKernel(LmHeadKernel, static_cast<unsigned>(std::min<int64_t>(items, sms)), kThreads, kSmem, stream,
                           a, w_map, x_map, static_cast<int>(vocab_blocks), static_cast<int>(passes)));
  return cudaGetLastError();
}

}  // namespace k3::cuda

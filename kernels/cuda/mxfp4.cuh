// Routed experts from MXFP4 weights on the GPU (DESIGN §2: E2M1 codes, one E8M0 scale per 32 inputs).
// SM90 has no FP4 tensor cores, so, as Marlin and triton_kernels do on Hopper, each warp dequantizes its
// weights to bf16 in registers (exact: an E2M1 value times a power of two) and feeds the m16n8k16 bf16
// tensor-core product; HBM carries 4.25 bits per weight instead of 16.
//
// Three paths (Mxfp4Gemm), by routed pairs per expert:
//   kDirect   (decode, few tokens per expert: bandwidth-bound) the weights stream from HBM once per 32 tokens of
//             an expert. Uploaded in a fragment order (Mxfp4ToFragments): for every 16 rows × 32 inputs, lane l of
//             a warp reads the 8 bytes (16 codes) of its A fragments of the two k16 steps, re-encoded so that each
//             bf16 pair takes one funnel shift and one LOP3 (a few: two shifts) plus one HMUL2 by the block's scale
//             (kernels/cuda/mxfp4_fragments.cuh says how), and 2 bytes of scales. A CTA of 8 warps owns 128 weight
//             rows of one pass of an expert (its tokens up to 16 in one pass, else passes of 32); weights and the
//             pass's x stream through the CTA's shared-memory ring (cp.async; stages of four k32 blocks for gate/up,
//             eight for down), and each warp dequantizes its 16 rows once for all the pass's n-tiles of 8 tokens;
//             the gate/up kernel fuses the activation. The four kernels (permutation with the pass list, gate/up,
//             down, combine) launch with PDL: the down kernel's CTAs start their weights while gate/up ends.
//   kWgmma    (prefill, plain x, from kMxfp4WgmmaMinPairsPerExpert pairs per expert on average: compute-bound) our
//             grouped wgmma experts (MoeExperts kWgmma, experts_wgmma.cuh) with MXFP4 weights: the copier
//             warpgroup stages each k step's codes and scales by cp.async with the step's tokens, and the MMA
//             warpgroups dequantize them into the bf16 tile the tensor cores read while the step before multiplies;
//             the weights cross HBM at 4.25 bits and no bf16 copy exists. Each 128-token tile dequantizes its
//             expert's weights again, which the bf16 copy does once: from kMxfp4PlainDequantMinPairsPerExpert the
//             copy path is ahead where it exists.
//   kDequant  (prefill, split x, from kMxfp4DequantMinPairsPerExpert pairs per expert: compute-bound) the hit
//             experts' weights are dequantized once into a bf16 copy in the workspace (a bandwidth-bound pass,
//             3·E·I·D·2 bytes of device memory: 3.7 GB at K3 latent widths with 56 experts), then our bf16 tiled
//             experts run on it (MoeExperts kTiled, the kernels that take a split x; a plain x: kAuto). The copy is
//             allocated only when Reserve is asked for it (dequant_copy) and max_pairs reaches that many pairs per
//             expert: the engine and the expert node, which keep MXFP4 experts to save memory, do not ask.
// Both keep h and each expert's output in bf16 (split x: both planes) and sum each token's k weighted outputs in
// pair order (deterministic), as MoeExperts (moe.cuh) does.
// Reference: k3::cpu::MoeExperts on the weights dequantized by k3::cpu::DequantizeMxfp4.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "kernels/cuda/glu.cuh"

namespace k3::cuda {

// Bytes of a [rows, cols] matrix in fragment order: codes rows·cols/2, scales rows·cols/32 + rows (rows a
// multiple of 16, cols of 32).
int64_t Mxfp4CodeBytes(int64_t rows, int64_t cols);
int64_t Mxfp4ScaleBytes(int64_t rows, int64_t cols);
// Host: packed [rows, cols/2] and scale [rows, cols/32] (the checkpoint's layout) into fragment order.
void Mxfp4ToFragments(const uint8_t* packed, const uint8_t* scale, int64_t rows, int64_t cols, uint8_t* codes,
                      uint8_t* scales);

enum class Mxfp4Gemm {
  kAuto,     // by pairs per expert on average: plain x kDirect, kWgmma from kMxfp4WgmmaMinPairsPerExpert, kDequant
             // from kMxfp4PlainDequantMinPairsPerExpert where the workspace holds the bf16 copy; split x kDirect,
             // kDequant from kMxfp4DequantMinPairsPerExpert where it holds the copy
  kDirect,
  kWgmma,    // plain x; needs a workspace reserved for kMxfp4WgmmaMinPairsPerExpert pairs per expert
  kDequant,  // needs a workspace reserved with the copy for kMxfp4DequantMinPairsPerExpert pairs per expert
};
// The crossovers at K3 shapes on the H200 (k3serve-bench-mxfp4, 56 experts, Zipf counts): direct / wgmma 1.23 / 1.28
// ms at 64, 2.29 / 1.74 at 128; wgmma / dequant 2.78 / 3.18 at 256, 4.97 / 4.51 at 512.
constexpr int64_t kMxfp4WgmmaMinPairsPerExpert = 80;
constexpr int64_t kMxfp4DequantMinPairsPerExpert = 192;
constexpr int64_t kMxfp4PlainDequantMinPairsPerExpert = 448;

struct Mxfp4ExpertsArgs {
  int64_t N = 0;            // tokens
  int64_t D = 0;            // model (latent) width ℓ, a multiple of 32
  int64_t I = 0;            // expert intermediate width, a multiple of 32
  int64_t top_k = 0;
  int64_t num_experts = 0;  // E ≤ 8192
  const __nv_bfloat16* x = nullptr;  // [N, D], 16-byte aligned
  // Split x (kernels/cuda/split.cuh: x ≈ hi + lo, the GPU engine's activations): the lo plane at x + x_lo. Then h
  // and each expert's output keep both planes too and the sum goes to out_f32, as MoeExpertsArgs::x_lo does.
  // 0: plain bf16 x, bf16 out. A multiple of 8.
  int64_t x_lo = 0;
  const int32_t* idx = nullptr;      // [N, k], in [−1, E); −1: not routed here
  const float* w = nullptr;          // [N, k]
  // Device arrays of E device pointers, 16-byte aligned, in fragment order (null where an expert is not held: its
  // pairs must not be routed here).
  const uint8_t* const* w1 = nullptr;  // W1_e [I, D] codes (gate)
  const uint8_t* const* s1 = nullptr;  //        scales
  const uint8_t* const* w3 = nullptr;  // W3_e [I, D] (up)
  const uint8_t* const* s3 = nullptr;
  const uint8_t* const* w2 = nullptr;  // W2_e [D, I] (down)
  const uint8_t* const* s2 = nullptr;
  GluAct act = GluAct::kSilu;
  float situ_beta = 4.0f;
  float situ_linear_beta = 25.0f;
  __nv_bfloat16* out = nullptr;    // [N, D]
  float* out_f32 = nullptr;        // [N, D], instead of out with a split x
  int32_t* experts_hit = nullptr;  // optional, device scalar: the experts that received a pair
  Mxfp4Gemm gemm = Mxfp4Gemm::kAuto;
};

// Scratch for up to max_pairs = N·k pairs; with wgmma (for a plain x), from kMxfp4WgmmaMinPairsPerExpert ·
// num_experts pairs, also the grouped experts' workspace (kWgmma: its own h and outputs, as large again); with
// dequant_copy, from kMxfp4DequantMinPairsPerExpert · num_experts pairs, also the bf16 copy of the experts' weights
// and that workspace (kDequant). Not thread-safe.
class Mxfp4Workspace {
 public:
  Mxfp4Workspace();
  ~Mxfp4Workspace();
  Mxfp4Workspace(const Mxfp4Workspace&) = delete;
  Mxfp4Workspace& operator=(const Mxfp4Workspace&) = delete;
  cudaError_t Reserve(int64_t max_pairs, int64_t D, int64_t I, int64_t num_experts, bool dequant_copy = false,
                      bool wgmma = false);

  struct Buffers;

 private:
  std::unique_ptr<Buffers> b_;
  friend cudaError_t Mxfp4Experts(const Mxfp4ExpertsArgs&, Mxfp4Workspace&, cudaStream_t);
};

// out[n] = Σ_j w[n, j] · W2_e · act(W1_e x[n], W3_e x[n]), e = idx[n, j] ≥ 0. No host synchronization.
cudaError_t Mxfp4Experts(const Mxfp4ExpertsArgs& a, Mxfp4Workspace& ws, cudaStream_t stream);

}  // namespace k3::cuda

// MoE on the GPU (DESIGN §1.4, §1.5): the sigmoid router fused after the gate GEMM, with the
// Quantile-Balancing histogram, and the routed experts over ragged tokens per expert.
// References: kernels/cpu/router.h (RouteTopKRef, QbHistogram) and kernels/cpu/experts.h (MoeExperts).
//
// Router (router.cu): one warp per token, or a block of 8 warps per token for decode batches (≤ 256 tokens) without a
// group limit. s = sigmoid(logit) is computed in double and rounded to fp32,
// exactly as RouteTopKRef does, so that the top-k decisions are the reference's (ties: lower expert id).
//
// Experts (experts.cu): the N·k (token, expert) pairs are counting-sorted by expert into contiguous
// slots (MoePermute), the experts run as GEMMs over their ragged slot segments, and each token gathers
// its k weighted results in pair order (deterministic: no atomics on the output). Two GEMM paths:
//   kTiled   our weight-streaming mma.sync kernels: gate/up with the activation fused (fp32), then down;
//            a CTA streams 128 weight rows once for up to 64 tokens (32 with a split x: hi and lo rows, their
//            accumulators added before the activation; 32 and 8 at few pairs per expert, with deeper rings).
//            The down CTAs of a token tile start when its gate/up CTAs are done. No host synchronization.
//   kCublas  per expert: its rows gathered, W1 and W3 as one two-problem batched cuBLAS GEMM, an
//            activation pass, W2; the experts' chains spread over 4 side streams. cuBLAS takes the shapes
//            on the host: the call copies the counts back and synchronizes the stream (no graph capture).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/cuda/glu.cuh"
#include "kernels/cuda/split.cuh"

namespace k3::cuda {

// ---------------------------------------------------------------------------------------------- router

struct RouterArgs {
  int64_t N = 0;
  int64_t num_experts = 0;  // E ≤ 1024
  int64_t top_k = 0;        // k ≤ 32 and ≤ the experts of the kept groups (k + 1 with qb_hist)
  int64_t num_groups = 1;   // num_expert_group: ≤ 32, divides E
  int64_t topk_groups = 1;  // topk_group
  bool renormalize = false;
  float scale = 1.0f;
  // [N, E] fp32, row n token n's: the gate GEMM's output (Sums{p, ld ≥ E}) or the gate product's unfolded sums
  // (LinearBlas::RunUnfolded: hi and lo rows, K slices), added as Sums::At adds them.
  Sums logits;
  const float* bias = nullptr;    // [E] e_score_correction_bias, or null
  int32_t* idx = nullptr;         // [N, k], descending s'
  float* w = nullptr;             // [N, k]
  // Quantile-Balancing histogram (optional, DESIGN §1.5): α_n = token n's (k+1)-th largest s' among the
  // experts of its kept groups; for every expert e, r = α_n − s'_e adds 1 to
  // qb_hist[b·E + e], b = clamp(floor((r − qb_rmin) · (qb_bins / (qb_rmax − qb_rmin))), 0, qb_bins − 1).
  // Accumulates: zero it before the first batch. Bit-identical to k3::cpu::QbHistogram.
  int32_t* qb_hist = nullptr;  // [qb_bins, E]
  int64_t qb_bins = 0;
  float qb_rmin = 0.0f;
  float qb_rmax = 0.0f;
};

// idx, w (and qb_hist) from the logits: s = sigmoid, s' = s + bias, groups by the sum of their top-2 s',
// top-k of s', w = s[idx] (renormalized: w /= Σw + 1e-20) · scale.
cudaError_t RouteTopK(const RouterArgs& a, cudaStream_t stream);

// The gate GEMM: logits [N, E] fp32 = m [N, d] · W_gateᵀ ([E, d]), bf16 operands, fp32 accumulate and
// output. Runs on the handle's stream. cuBLAS failures come back as cudaErrorUnknown.
cudaError_t RouterLogits(cublasHandle_t blas, int64_t N, int64_t d, int64_t E, const __nv_bfloat16* m,
                         const __nv_bfloat16* w_gate, float* logits);

// --------------------------------------------------------------------------------------------- experts

enum class MoeGemm {
  kAuto,   // split x: kTiled; plain x: kWgmma up to kMoeWgmmaMaxPairsPerExpert routed pairs per expert on average,
           // else kCublas
  kTiled,  // weight-streaming mma.sync tiles (decode sizes; the only kernels that take a split x)
  kCublas,
  kWgmma,  // sm_90a: grouped wgmma kernels (experts_wgmma.cuh), tokens through the slot map, GLU fused; plain x only;
           // bf16 weights, or MXFP4 ones (q1 … s2) dequantized on chip
};
// At K3 shapes on the H200 (56 experts, Zipf counts; k3serve-bench-kernels, the same run): kWgmma is the fastest
// from 8 pairs per expert (0.92 ms against kTiled's 0.95) to 128 (1.38–1.42 against kCublas's 1.54); they tie at
// 256 (2.06–2.16 / 2.08–2.09 ms); kCublas is ahead at 512 (3.34–3.51 against 4.00–4.05).
constexpr int64_t kMoeWgmmaMaxPairsPerExpert = 256;

struct MoeExpertsArgs {
  int64_t N = 0;            // tokens
  int64_t D = 0;            // model (latent) width ℓ, a multiple of 8
  int64_t I = 0;            // expert intermediate width, a multiple of 8
  int64_t top_k = 0;        // pairs per token
  int64_t num_experts = 0;  // E ≤ 8192: the slots this call serves
  const __nv_bfloat16* x = nullptr;  // [N, D]
  // Split x (kernels/cuda/split.cuh: x ≈ hi + lo, the GPU engine's activations): the lo plane at x + x_lo.
  // Then h and each expert's output keep 16 bits too (two planes), the sum goes to out_f32, and the tiled
  // path runs (kCublas is refused). 0: plain bf16 x, bf16 out.
  int64_t x_lo = 0;
  const int32_t* idx = nullptr;      // [N, k], in [−1, E); −1 = not routed here (skipped)
  const float* w = nullptr;          // [N, k]
  // Device arrays of E device pointers (each expert anywhere in memory), 16-byte aligned, PyTorch layout:
  const __nv_bfloat16* const* w1 = nullptr;  // W1_e [I, D] (gate)
  const __nv_bfloat16* const* w3 = nullptr;  // W3_e [I, D] (up)
  const __nv_bfloat16* const* w2 = nullptr;  // W2_e [D, I] (down)
  // W1 and W3 in the tiled kernels' packed layout (MoePackGateUp): w1[e] is expert e's packed W1 and W3 together
  // (w3 is not read); W2 stays as above. kTiled only (kAuto picks it).
  bool packed = false;
  // MXFP4 experts instead of w1, w3, w2 (kernels/cuda/mxfp4.cuh: codes and scales in its fragment order, device
  // arrays of E pointers each): kWgmma only (kAuto picks it), plain x; each stage's weights are dequantized on
  // chip into the tiles the tensor cores read.
  const uint8_t* const* q1 = nullptr;
  const uint8_t* const* s1 = nullptr;
  const uint8_t* const* q3 = nullptr;
  const uint8_t* const* s3 = nullptr;
  const uint8_t* const* q2 = nullptr;
  const uint8_t* const* s2 = nullptr;
  GluAct act = GluAct::kSilu;
  float situ_beta = 4.0f;          // β1
  float situ_linear_beta = 25.0f;  // β2
  __nv_bfloat16* out = nullptr;    // [N, D] = Σ_j w[n, j] · E_idx[n, j](x[n])
  float* out_f32 = nullptr;        // [N, D], instead of out with a split x
  int32_t* experts_hit = nullptr;  // optional, device scalar: the experts that received a pair
};

// Scratch for MoeExperts: device buffers for up to max_pairs = N·k pairs, and, once the cuBLAS path
// has run, its side streams and handles, pinned host counts and gathered activations. Not thread-safe.
class MoeWorkspace {
 public:
  MoeWorkspace();
  ~MoeWorkspace();
  MoeWorkspace(const MoeWorkspace&) = delete;
  MoeWorkspace& operator=(const MoeWorkspace&) = delete;
  // Grows the buffers to at least these sizes (never shrinks).
  cudaError_t Reserve(int64_t max_pairs, int64_t D, int64_t I, int64_t num_experts);

  struct Buffers;

 private:
  std::unique_ptr<Buffers> b_;
  friend cudaError_t MoeExperts(const MoeExpertsArgs&, MoeGemm, MoeWorkspace&, cudaStream_t);
};

// out[n] = Σ_j w[n, j] · W2_e · act(W1_e x[n], W3_e x[n]), e = idx[n, j] ≥ 0; bf16 in and out, fp32
// accumulation, the activation in fp32; the intermediate h and each expert's output are rounded to bf16
// (split x: kept as split, the sum in fp32).
// Reproducible run to run. kCublas synchronizes the stream (see above).
cudaError_t MoeExperts(const MoeExpertsArgs& a, MoeGemm gemm, MoeWorkspace& ws, cudaStream_t stream);

// The tiled gate/up kernel's packed weight layout (MoeExpertsArgs::packed). A tiled CTA streams 64 rows of W1 and the
// same 64 of W3 in 64-column tiles: in PyTorch's row-major layout a tile is 128 pieces of 128 bytes, one every D·2
// bytes; packed, it is one contiguous 16 KB block, already in the order the kernel keeps it in shared memory. The
// same products, bit for bit. Zeros pad I and D to whole tiles. W2 is not packed: in the GPU engine's decode the
// packed down kernel was slower (+9 and +16 µs a step, traces on two H200s) while the gate/up gained 15–27 µs.
int64_t MoePackedGateUpElems(int64_t D, int64_t I);  // elements per expert
cudaError_t MoePackGateUp(const __nv_bfloat16* w1, const __nv_bfloat16* w3, int64_t D, int64_t I,
                          __nv_bfloat16* out, cudaStream_t stream);

// Token permutation by slot: a counting sort of the num_pairs (token, expert) pairs by expert, stable
// (pair order inside an expert, as k3::cpu::MoeExperts buckets them). Expert e owns the slots
// [offsets[e], offsets[e + 1]); slot_pair[s] is the pair index n·k + j in slot s (the first offsets[E]
// entries are set) and pair_slot[p] the slot of pair p, −1 where idx[p] ∉ [0, E). counts [E] gets the tokens
// per expert. num_experts ≤ 8192. All device arrays.
cudaError_t MoePermute(int64_t num_pairs, const int32_t* idx, int64_t num_experts, int32_t* counts, int32_t* offsets,
                       int32_t* slot_pair, int32_t* pair_slot, cudaStream_t stream);

// MoePermute, and each expert's tiles of slots as (expert, first slot), experts in order: tile_tokens slots a tile,
// or wide_tokens where the expert has more than tile_tokens pairs (wide_tokens 0: tile_tokens always). *num_tiles
// gets their number (tiles needs room for min(P, E) + ⌈P / tile_tokens⌉), *experts_hit (optional) the experts that
// received a pair. One kernel, launched with PDL (launch.cuh).
cudaError_t MoePermuteTiles(int64_t num_pairs, const int32_t* idx, int64_t num_experts, int32_t* counts,
                            int32_t* offsets, int32_t* slot_pair, int32_t* pair_slot, int tile_tokens, int wide_tokens,
                            int2* tiles, int32_t* num_tiles, int32_t* experts_hit, cudaStream_t stream);

// out[n] = Σ_j w[n, j] · y[pair_slot[n·k + j]] for j in order (a slot < 0 adds nothing), in fp32: y [slots, D] bf16
// into bf16 out, or a split y (its lo plane y_lo elements on) into fp32 out_f32. D and y_lo multiples of 8. Launched
// with PDL.
cudaError_t MoeCombine(int64_t N, int64_t D, int64_t top_k, const int32_t* pair_slot, const float* w,
                       const __nv_bfloat16* y, int64_t y_lo, __nv_bfloat16* out, float* out_f32, cudaStream_t stream);

}  // namespace k3::cuda

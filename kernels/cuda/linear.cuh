// Linear layers on the GPU: y = x · Wᵀ with bf16 weights (PyTorch layout [N, K]), split-bf16 or bf16
// activations, fp32 accumulation, with an optional fused GLU (act(gate) · up) epilogue.
// Reference: k3::cpu::Linear / GluMlp. Two implementations of the same arguments:
//
//   Linear      our mma.sync kernel: any number of groups with column strides (the per-head products of MLA).
//               Each CTA streams a 64-row weight tile (cp.async, six k-blocks in flight per thread) once per pass
//               of 64 tokens (16 when the grid is small) (weights as the 16-row A operand, tokens as the 8-column
//               B operand).
//   LinearBlas  cuBLASLt, for the dense products: the engine's projections (the LM head has its own kernel,
//               lm_head.cuh), and groups as one strided batch (MLA's per-head decode products). A split x is stacked
//               as [hi; lo] rows so that one GEMM reads the weight once for both halves; a fold pass sums the halves
//               into the output mode (and applies the GLU).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "kernels/cuda/glu.cuh"
#include "kernels/cuda/split.cuh"

namespace k3::cuda {

enum class LinearOut {
  kF32,     // y = x·Wᵀ               (float)
  kF32Add,  // y += x·Wᵀ              (float: the residual stream)
  kBf16,    // y = bf16(x·Wᵀ)
  kSplit,   // y = split(x·Wᵀ)        (Split; y_lo is the plane offset)
};

struct LinearArgs {
  int64_t N = 0, K = 0;  // output features (weight rows), inner dim; K % 16 == 0
  const __nv_bfloat16* w = nullptr;
  int64_t w_group_stride = 0;  // elements between groups' weight matrices

  Split x;                     // activations; row r of group g at x.p + g·x_group_stride + r·x.ld
  int64_t x_group_stride = 0;

  void* y = nullptr;           // float or bf16 (see out); row r of group g at y + g·y_group_stride + r·ldy
  int64_t ldy = 0, y_lo = 0, y_group_stride = 0;
  LinearOut out = LinearOut::kF32;

  int64_t groups = 1;  // of M rows each
  int64_t M = 0;

  // LinearBlas, one group: K as this many equal slices, one strided batch whose slices' sums stay apart
  // (Sums::parts) and are added in slice order by the fold or by the consumer of RunUnfolded's sums — a skinny
  // product (N 2304, K 4096: 36 output tiles) fills the SMs without a split-K reduce kernel. 0: the fastest of
  // 1 … kMaxSumParts for the shape, timed once like the algorithms (K3SERVE_BLAS_PARTS=n picks n instead).
  int64_t k_parts = 1;

  // GLU: weight rows [0, N/2) are the gate, [N/2, N) the up projection; y gets N/2 columns act(gate)·up.
  bool glu = false;
  GluAct act = GluAct::kSilu;
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;
};

cudaError_t Linear(const LinearArgs& a, cudaStream_t stream);

// The dense products (groups == 1) through cuBLASLt. Batch invariant: the algorithm is chosen once per weight
// shape (for 128 stacked rows, a decode batch of 64) and kept for every row count, so a row's sums do not
// depend on the other rows of the batch (cuBLAS's own heuristic would pick other split-K schemes per M). The
// choice is the fastest of the heuristic's candidates (and their split-K variants; the near-best timed again in
// interleaved rounds), timed with the weight out of
// L2 at the shape's first use in the process (on that device; every LinearBlas then runs the shape alike);
// K3SERVE_BLAS_TUNE=0 keeps the heuristic's first choice, =verbose prints each choice. A first use inside a graph
// capture cannot time anything and keeps the first choice too.
// Rows go in chunks that fit the workspace. Not thread-safe: one per stream (the choices are shared safely).
class LinearBlas {
 public:
  LinearBlas();
  ~LinearBlas();
  LinearBlas(const LinearBlas&) = delete;
  LinearBlas& operator=(const LinearBlas&) = delete;

  // Whether K can run as `parts` slices (LinearArgs::k_parts): at most kMaxSumParts of 16-column multiples.
  static bool PartsFit(int64_t K, int64_t parts);
  // Bytes of workspace for chunks of `rows` rows of a product of N outputs and inner dim K (of `groups` of them).
  static size_t WorkspaceBytes(int64_t rows, int64_t N, int64_t K, int64_t groups = 1);
  // Creates the handle and a workspace of `bytes` (at least WorkspaceBytes(1, N, K) of the largest product).
  cudaError_t Init(size_t bytes);
  cudaError_t Run(const LinearArgs& a, cudaStream_t stream);
  // The product without its fold pass: *y = the sums (hi rows, then lo rows; K slices as parts), valid until the
  // next call on this LinearBlas; a.y and a.out are not used. For a consumer that reads the product once and adds
  // the halves as it reads (AddRmsNorm, RouteTopK): one kernel fewer. Needs one chunk (Unfoldable: with
  // k_parts = 0, room for kMaxSumParts of them) and no GLU.
  bool Unfoldable(const LinearArgs& a) const;
  cudaError_t RunUnfolded(const LinearArgs& a, cudaStream_t stream, Sums* y);
  // The fold pass alone: y (a's output mode, a.N columns, a.M rows, one group, no GLU) from sums — for the columns
  // of an unfolded product that a later kernel needs folded after all (s.p offset to the first of them).
  static cudaError_t Fold(const LinearArgs& a, Sums s, cudaStream_t stream);

  struct State;

 private:
  cudaError_t Product(const LinearArgs& a, cudaStream_t stream, Sums* unfolded);
  int64_t ChunkRows(const LinearArgs& a, int64_t parts) const;

  std::unique_ptr<State> s_;
};

}  // namespace k3::cuda

// Linear layers on the GPU: y = x · Wᵀ with bf16 weights (PyTorch layout [N, K]), split-bf16 or bf16
// activations, fp32 accumulation — one kernel for every product of the engine: dense projections, the LM head,
// per-head products (groups with column strides) and the routed experts (groups = experts, rows gathered by
// an index list), with an optional fused GLU (act(gate) · up) epilogue. Reference: k3::cpu::Linear / GluMlp.
//
// Built for decode, where a step is a stream of weights: each CTA streams a 64-row weight tile (cp.async,
// six k-blocks in flight per thread) once per 64 tokens, and the tensor cores multiply it against up to 64
// tokens (mma.sync m16n8k16, weights as the 16-row A operand, tokens as the 8-column B operand).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/split.cuh"

namespace k3::cuda {

enum class LinearOut {
  kF32,     // y = x·Wᵀ               (float)
  kF32Add,  // y += x·Wᵀ              (float: the residual stream)
  kBf16,    // y = bf16(x·Wᵀ)
  kSplit,   // y = split(x·Wᵀ)        (Split; y_lo is the plane offset)
};

enum class LinearAct { kNone, kSilu, kSitu };

struct LinearArgs {
  int64_t N = 0, K = 0;  // output features (weight rows), inner dim; K % 16 == 0
  const __nv_bfloat16* w = nullptr;
  int64_t w_group_stride = 0;  // elements between groups' weight matrices

  Split x;                     // activations; row r of group g at x.p + g·x_group_stride + r·x.ld
  int64_t x_group_stride = 0;

  void* y = nullptr;           // float or bf16 (see out); row r of group g at y + g·y_group_stride + r·ldy
  int64_t ldy = 0, y_lo = 0, y_group_stride = 0;
  LinearOut out = LinearOut::kF32;

  // Rows. Dense: groups of M rows each (offsets == nullptr). Gathered (experts): group g owns the entries
  // [offsets[g], offsets[g+1]) of rows; an entry i names y row i and x row i / x_row_div.
  int64_t groups = 1;
  int64_t M = 0;
  const int32_t* offsets = nullptr;  // [groups + 1], device
  const int32_t* rows = nullptr;     // device; with offsets
  int32_t x_row_div = 1;

  // GLU: weight rows [0, N/2) are the gate, [N/2, N) the up projection; y gets N/2 columns act(gate)·up.
  LinearAct act = LinearAct::kNone;
  float situ_beta = 4.0f, situ_linear_beta = 25.0f;
};

cudaError_t Linear(const LinearArgs& a, cudaStream_t stream);

}  // namespace k3::cuda

// RMSNorm and the KDA gated output norm on the GPU (DESIGN §1.1, §1.2): fp32 math, split-bf16 output (the
// input of the next product). References: k3::cpu::RmsNorm, k3::cpu::GatedRmsNorm.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/split.cuh"

namespace k3::cuda {

// y[i] = w ⊙ x_i / sqrt(mean(x_i²) + eps), x_i = row (rows ? rows[i] : i) of x (fp32, row stride ldx), for
// M rows of width D. w may be null (no weight).
cudaError_t RmsNorm(int64_t M, int64_t D, const float* x, int64_t ldx, const int32_t* rows, const float* w,
                    float eps, Split y, cudaStream_t stream);
// The same from a split input.
cudaError_t RmsNorm(int64_t M, int64_t D, Split x, const float* w, float eps, Split y, cudaStream_t stream);

// The residual adds of the products before a norm, folded into it: h_i = (x_i + a_i) + b_i (a, b: a product's
// unfolded sums, in parts or not, or plain fp32 rows, row i of the batch at row i of each; p == null: none),
// y_i = RMSNorm(h_i; w).
// The sums round as the fold and AddInto2 did them one after the other. Without rows, x_i = h_i in place; with
// rows (batch row i is rows[i], of x, a and b) x is left as it is — the final norm, after which x is not read.
cudaError_t AddRmsNorm(int64_t M, int64_t D, float* x, int64_t ldx, Sums a, Sums b, const int32_t* rows,
                       const float* w, float eps, Split y, cudaStream_t stream);

// y = RMSNorm(x; w) ⊙ sigmoid(gate) per row of D (one head): x and gate [M, D] contiguous (M = tokens · heads),
// x bf16 (the tuned KDA kernels' output) or fp32; y rows contiguous (y.ld == D); D ≤ 1024.
cudaError_t GatedRmsNorm(int64_t M, int64_t D, const __nv_bfloat16* x, const float* gate, const float* w, float eps,
                         Split y, cudaStream_t stream);
cudaError_t GatedRmsNorm(int64_t M, int64_t D, const float* x, const float* gate, const float* w, float eps, Split y,
                         cudaStream_t stream);
// The same with the gate as its product's unfolded sums: row i (token i / H, head i % H) at columns
// (i % H)·D + c of token row i / H — the same fp32 values as the folded gate.
cudaError_t GatedRmsNorm(int64_t M, int64_t D, const __nv_bfloat16* x, Sums gate, int64_t H, const float* w,
                         float eps, Split y, cudaStream_t stream);

}  // namespace k3::cuda

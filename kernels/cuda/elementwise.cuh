// Small element-wise pieces of the GPU forward pass: embedding gather, residual add, fp32 → split, the MLA
// output gate; and random fills for models built on the device without a checkpoint (benchmarks).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/split.cuh"

namespace k3::cuda {

// x[n] = table[ids[n]] (bf16 table [V, d] → fp32 rows).
cudaError_t Embed(int64_t N, int64_t d, const int32_t* ids, const __nv_bfloat16* table, float* x,
                  cudaStream_t stream);
// y += x, n floats; y = (y + x) + x2 (two residual adds in one pass, rounded as two).
cudaError_t AddInto(int64_t n, const float* x, float* y, cudaStream_t stream);
cudaError_t AddInto2(int64_t n, const float* x, const float* x2, float* y, cudaStream_t stream);
// y = split(x) for M rows of D (x row stride ldx).
cudaError_t ToSplit(int64_t M, int64_t D, const float* x, int64_t ldx, Split y, cudaStream_t stream);
// o ← o ⊙ sigmoid(gate) for M rows of D (gate fp32, row stride D): the K3 MLA output gate.
cudaError_t MulSigmoid(int64_t M, int64_t D, Split o, const float* gate, cudaStream_t stream);

// Random values: element i depends only on (seed, i).
enum class RandomKind {
  kNormal,    // N(a, b²)
  kUniform,   // U(a, b)
  kLogU,      // log U(a, b)                      (KDA A_log)
  kDtBias,    // softplus⁻¹(exp U(a, b))          (KDA dt_bias of the softplus gate: dt log-uniform)
};
cudaError_t FillRandom(int64_t n, RandomKind kind, float a, float b, uint64_t seed, float* f32, __nv_bfloat16* bf16,
                       cudaStream_t stream);  // writes f32 or bf16 (the other null)
// Bytes uniform in [lo, hi]: random MXFP4 codes (any byte) and scales (a band of E8M0 exponents).
cudaError_t FillRandomBytes(int64_t n, uint8_t lo, uint8_t hi, uint64_t seed, uint8_t* dst, cudaStream_t stream);

}  // namespace k3::cuda

// Block Attention Residuals read on the GPU (DESIGN §1.5), the naive form: every source at every read, fp32.
// Reference: k3::cpu::AttnResRead. (The serving schedule — one pass over the bank per block, online-softmax
// merge with the partial sum — comes later.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// Sources of token t: bank entries 0..m−1 (entry b at bank + b·bank_stride, rows of d) and then partial.
// out[t] = Σ_j p_j v_j,  p = softmax_j((n ⊙ w) · v_j / sqrt(mean(v_j²) + eps)).
cudaError_t AttnResRead(int64_t N, int64_t d, const float* bank, int64_t bank_stride, int64_t m, const float* partial,
                        const float* w, const float* n, float eps, float* out, cudaStream_t stream);

}  // namespace k3::cuda

// Block Attention Residuals read (DESIGN §1.5), fp32.
//
// For each of N tokens, over sources v_0..v_{m-1} (each [N, d]):
//   key_j = v_j / sqrt(mean(v_j²) + eps);  p = softmax_j((n ⊙ w) · key_j);  out = Σ_j p_j v_j
#pragma once

#include <cstdint>

namespace k3::cpu {

// The naive read: every source at every read.
void AttnResRead(int64_t N, int64_t d, const float* const* sources, int64_t m, const float* w, const float* n,
                 float eps, float* out);

}  // namespace k3::cpu

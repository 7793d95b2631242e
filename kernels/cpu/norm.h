// RMSNorm and gated RMSNorm, fp32.
#pragma once

#include <cstdint>

namespace k3::cpu {

// y[m] = w ⊙ x[m] / sqrt(mean(x[m]²) + eps), rows of width D. y may alias x. w may be null (no weight).
void RmsNorm(int64_t M, int64_t D, const float* x, const float* w, float eps, float* y);
void RmsNormRef(int64_t M, int64_t D, const float* x, const float* w, float eps, float* y);

// KDA output norm: y = RMSNorm(x; w) ⊙ sigmoid(gate), rows of width D (one head). y may alias x.
void GatedRmsNorm(int64_t M, int64_t D, const float* x, const float* gate, const float* w, float eps, float* y);
void GatedRmsNormRef(int64_t M, int64_t D, const float* x, const float* gate, const float* w, float eps, float* y);

// Per-row L2 normalization x / sqrt(|x|² + eps), in place, rows of width D.
void L2Norm(int64_t M, int64_t D, float* x, float eps);

}  // namespace k3::cpu

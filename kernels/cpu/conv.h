// Causal depthwise conv1d with SiLU and a decode state (the KDA short convolution).
#pragma once

#include <cstdint>

namespace k3::cpu {

// x, y [T, C] (y may not alias x); w [C, K] (hub layout [C, 1, K]);
// state [K-1, C]: the K-1 inputs before x[0], oldest first; on return the last K-1 inputs.
// y[t, c] = SiLU(Σ_j w[c, j] · in[t - (K-1) + j, c]), with in[<0] read from state.
void CausalConv1dSilu(int64_t T, int64_t C, int64_t K, const float* x, const float* w, float* state, float* y);
void CausalConv1dSiluRef(int64_t T, int64_t C, int64_t K, const float* x, const float* w, float* state, float* y);

}  // namespace k3::cpu

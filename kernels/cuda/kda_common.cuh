// Pieces shared by the KDA decode and prefill kernels: the gate, β, and the argument checks.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/kda.cuh"

namespace k3::cuda::kda {

constexpr float kLog2e = 1.4426950408889634f;

// Fast reciprocal: an IEEE division costs the prefill's gate loop more than the rest of the gate.
__device__ __forceinline__ float Sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// Forget gate (natural log of the decay) of one channel: x = g_raw + dt_bias, a = exp(A_log[h]).
// softplus written as max(x, 0) + log(1 + e^−|x|): no overflow; the fast log's absolute error on [1, 2]
// (< 4e-7) is far below what the bf16 input carries, and log1pf would cost the prefill ~20 instructions.
__device__ __forceinline__ float Gate(KdaGate gate, float x, float a, float lower_bound) {
  if (gate == KdaGate::kSoftplus) return -a * (fmaxf(x, 0.0f) + __logf(1.0f + __expf(-fabsf(x))));
  return lower_bound * Sigmoid(a * x);
}

inline bool ValidArgs(const KdaArgs& a) {
  return (a.D == 64 || a.D == 128) && a.H > 0 && (a.gate == KdaGate::kSoftplus || a.lower_bound <= 0.0f) && a.q &&
         a.k && a.v && (a.g_raw || a.g_sums.p) && a.b && a.A_log && a.dt_bias && a.state && a.state_idx && a.o &&
         (a.ldb == 0 || a.ldb >= a.H) && a.g_sums.parts == 1;
}

}  // namespace k3::cuda::kda

// KDA for the head dims the tuned kernels of kda.cuh (64, 128) do not take — D ≤ 32, the tiny test models:
// the recurrence token by token over each chunk of a ragged batch, fp32 in, out and state, one warp per
// (chunk, head), with the same fusions as kda.cuh (gate from its raw projection, q/k L2 norm, β sigmoid).
// Reference: k3::cpu::KdaRecurrent after KdaGate* / KdaNormalizeQK.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/kda.cuh"

namespace k3::cuda {

struct KdaSmallArgs {
  int64_t H = 0, D = 0;  // D ≤ 32
  const float *q = nullptr, *k = nullptr, *v = nullptr, *g_raw = nullptr;  // [N, H, D]
  const float* b = nullptr;                                              // [N, H] β logits
  const float *A_log = nullptr, *dt_bias = nullptr;                      // [H], [H·D]
  KdaGate gate = KdaGate::kSoftplus;
  float lower_bound = -5.0f;
  float* state = nullptr;  // pool [slots][H][D][D], S[i][j] with i the key dim
  float* o = nullptr;      // [N, H, D]
  int64_t num_chunks = 0;
  const int32_t *ch_start = nullptr, *ch_len = nullptr, *ch_slot = nullptr;  // [num_chunks]
};

constexpr int64_t kKdaSmallMaxD = 32;

cudaError_t KdaSmall(const KdaSmallArgs& a, cudaStream_t stream);

}  // namespace k3::cuda

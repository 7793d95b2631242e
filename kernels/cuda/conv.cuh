// The KDA short convolution on the GPU for a ragged batch (DESIGN §1.2): per sequence chunk, a causal
// depthwise conv (kernel K, no bias) over the q, k, v projections, then SiLU; the K−1 inputs before a chunk
// come from the sequence's conv state, which then holds the chunk's last K−1 inputs. fp32 math and state.
// Reference: k3::cpu::CausalConv1dSilu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/split.cuh"

namespace k3::cuda {

constexpr int64_t kKdaConvMaxK = 8;  // kernel sizes the GPU conv takes

struct KdaConvArgs {
  int64_t N = 0;      // tokens
  int64_t C = 0;      // channels: q | k | v, C / 3 each
  int64_t K = 0;      // kernel size (2 … kKdaConvMaxK)
  Split x;            // [N, C] projections
  // Instead of x: the projection product's unfolded sums (LinearBlas::RunUnfolded), each value rounded as its fold
  // would have stored it (RoundSplit) — the same inputs, one fold pass fewer.
  Sums x_sums;
  const float* w = nullptr;      // [C, K] (q, k, v conv weights stacked)
  float* state = nullptr;        // pool [slots][K − 1][C], oldest input first
  const int32_t* tok_start = nullptr;  // [N] the row where the token's chunk starts
  const int32_t* tok_slot = nullptr;   // [N] the chunk's state slot
  void* out[3] = {nullptr, nullptr, nullptr};  // q, k, v [N, C / 3]
  bool out_bf16 = true;                        // bf16 (the tuned KDA kernels) or fp32
  // Tokens 0 .. decode_tokens − 1 are one-token chunks (decode): KdaConv advances their states itself (the
  // thread that reads a (slot, channel) column is its only user), so KdaConvUpdateState takes only the rest.
  int64_t decode_tokens = 0;
};

// The outputs; reads the states of every chunk, writes those of the first decode_tokens tokens.
cudaError_t KdaConv(const KdaConvArgs& a, cudaStream_t stream);
// Then the states: for each chunk c (rows ch_start[c] .. + ch_len[c]), slot ch_slot[c] ← its last K − 1 inputs.
cudaError_t KdaConvUpdateState(const KdaConvArgs& a, int64_t num_chunks, const int32_t* ch_start,
                               const int32_t* ch_len, const int32_t* ch_slot, cudaStream_t stream);

}  // namespace k3::cuda

// Token sampling on the GPU: greedy argmax (lowest id on ties, as k3::Sampler with temperature 0).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// ids[r] = argmax_v logits[r, v] for R rows of V; NaN logits are never chosen. Each row is read by
// V / 4096 CTAs (a CTA per row left most SMs idle) that fold their best into keys[r] (R of them, the caller's
// workspace) with an integer max, so the result does not depend on their order.
cudaError_t Argmax(int64_t R, int64_t V, const float* logits, uint64_t* keys, int32_t* ids, cudaStream_t stream);

// ids[r] = the id in keys[r], for keys folded elsewhere (the LM head's epilogue: LmHeadArgs::argmax_keys); the
// keys are cleared to 0 on the way, ready for the next fold (a decode step then needs no memset node of its own).
cudaError_t ArgmaxIds(int64_t R, uint64_t* keys, int32_t* ids, cudaStream_t stream);

// The next decode step's inputs from this step's greedy ids, on the device: tok_id[n] = ids[n], tok_pos[n] += 1
// for N one-token sequences (CudaModel::NextGreedy: the host need not see the ids before the next step runs).
cudaError_t FeedGreedyIds(int64_t N, const int32_t* ids, int32_t* tok_id, int32_t* tok_pos, cudaStream_t stream);

#ifdef __CUDACC__
// Order-preserving key of (logit, id): a larger logit wins, then the lower id; NaN ranks as −inf (never chosen
// over a number). A real key is never 0, the value keys are cleared to.
__device__ __forceinline__ uint64_t ArgmaxKey(float v, int64_t c) {
  uint32_t u = __float_as_uint(v != v ? -INFINITY : v + 0.0f);  // −0 → +0
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t{u} << 32) | (0xffffffffu - static_cast<uint32_t>(c));
}
#endif

}  // namespace k3::cuda

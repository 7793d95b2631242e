// Token sampling on the GPU: greedy argmax (lowest id on ties, as k3::Sampler with temperature 0).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// ids[r] = argmax_v logits[r, v] for R rows of V; NaN logits are never chosen. Each row is read by
// V / 4096 CTAs (a CTA per row left most SMs idle) that fold their best into keys[r] (R of them, the caller's
// workspace) with an integer max, so the result does not depend on their order.
cudaError_t Argmax(int64_t R, int64_t V, const float* logits, uint64_t* keys, int32_t* ids, cudaStream_t stream);

}  // namespace k3::cuda

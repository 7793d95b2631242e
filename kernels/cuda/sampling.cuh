// Token sampling on the GPU: greedy argmax (lowest id on ties, as k3::Sampler with temperature 0).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace k3::cuda {

// ids[r] = argmax_v logits[r, v] for R rows of V.
cudaError_t Argmax(int64_t R, int64_t V, const float* logits, int32_t* ids, cudaStream_t stream);

}  // namespace k3::cuda

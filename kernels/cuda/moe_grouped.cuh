// The GPU engine's in-process MoE (DESIGN §1.4, §1.5): the sigmoid router's top-k, and the routed experts of a
// layer for a batch — (token, expert) pairs sorted by expert, one grouped GLU product and one grouped down
// product over all experts (linear.cuh, groups = experts), then the weighted sum per token. Split-bf16 input,
// fp32 output (the engine's formats); moe.cuh is the bf16-in/out MoE of the expert service.
// References: k3::cpu::RouteTopK, k3::cpu::MoeExperts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/split.cuh"

namespace k3::cuda {

struct RouterDims {
  int64_t num_experts = 0;  // E (≤ 6144)
  int64_t top_k = 0;        // k (≤ 32)
  int64_t num_groups = 1;
  int64_t topk_groups = 1;
  bool renormalize = false;
  float scale = 1.0f;
};

// logits [N, E] (fp32), bias [E] or null → idx, w [N, k] in descending biased-score order (ties: lower id).
cudaError_t SelectExperts(int64_t N, const RouterDims& r, const float* logits, const float* bias, int32_t* idx, float* w,
                      cudaStream_t stream);

// One layer's routed experts on the device, stacked: w13 [E][2I][D] (w1 rows, then w3 rows), w2 [E][D][I].
struct ExpertStack {
  const __nv_bfloat16* w13 = nullptr;
  const __nv_bfloat16* w2 = nullptr;
  int64_t E = 0, D = 0, I = 0;
};

size_t GroupedExpertsWorkspaceBytes(int64_t N, int64_t k, int64_t E, int64_t D, int64_t I);
// out [N, D] = Σ_j w[n, j] · E_idx[n, j](x[n]) over the pairs with idx ≥ 0 (fp32). hits (device, may be null):
// the number of experts that received a row.
cudaError_t GroupedExperts(int64_t N, int64_t k, Split x, const int32_t* idx, const float* w, const ExpertStack& e,
                       LinearAct act, float situ_beta, float situ_linear_beta, float* out, int32_t* hits,
                       void* workspace, cudaStream_t stream);

}  // namespace k3::cuda

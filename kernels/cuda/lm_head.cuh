// The LM head: logits = x · Wᵀ over a vocabulary-sized W, each row's greedy pick folded on the way.
// Reference: k3::cpu::Linear, then the first maximum of each row (ArgmaxIds over the keys).
//
// x is read as plain bf16: the hi plane of a split x. The head is the one product where that holds the goldens
// (tiny-kimi-linear-bf16: logits max|Δ| 0.0079 against 0.0045 with the split, greedy 24/24; the other products
// need the split, engine/cuda/README.md) and DESIGN §2 asks bf16 activations. At 64 rows instead of 128 stacked
// ones the tensor cores keep up with HBM, so the head streams W near the copy bandwidth, where cuBLASLt on the
// stacked split reached 3.1–3.6 TB/s.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/split.cuh"

namespace k3::cuda {

struct LmHeadArgs {
  int64_t V = 0, K = 0;              // vocabulary (rows of w), inner dim; K % 8 == 0
  const __nv_bfloat16* w = nullptr;  // [V, K], 16-byte aligned
  Split x;                           // M rows of K; only the hi plane x.p is read (16-byte rows)
  int64_t M = 0;
  float* logits = nullptr;           // [M, ldl] fp32, or null: the keys alone
  int64_t ldl = 0;
  // Row r's best (value, column) as an ArgmaxKey (sampling.cuh), folded in with an integer max: zero them before.
  // Null: none.
  uint64_t* argmax_keys = nullptr;
};

// sm_90a (wgmma). Graph-capturable. Reads W before waiting for the kernel before it (PDL): W is never written
// by the kernels of a forward.
cudaError_t LmHead(const LmHeadArgs& a, cudaStream_t stream);

}  // namespace k3::cuda

// A capacity plan: how many bytes each pool of a disaggregated deployment holds, and how many GPUs
// the expert pool needs, for a config and the routed experts' storage type.
#pragma once

#include <cstdint>
#include <string>

#include "engine/config.h"

namespace k3 {

enum class WeightType { kFp32, kBf16, kMxfp4 };
absl::StatusOr<WeightType> ParseWeightType(const std::string& name);  // "fp32", "bf16", "mxfp4"
const char* WeightTypeName(WeightType t);
// Bytes of `weights` values of this type (MXFP4: 4-bit codes plus one 8-bit scale per 32).
double WeightBytes(WeightType t, double weights);

struct CapacityPlan {
  WeightType experts = WeightType::kBf16;
  int64_t slots = 0;               // (MoE layer, expert) pairs
  double slot_bytes = 0;           // one slot's w1, w3, w2
  double expert_pool_bytes = 0;    // every slot once
  double attention_bytes = 0;      // everything else (embeddings, attention, dense, shared experts, router, latent
                                   // projections, LM head) in bf16: what one attention replica holds
  StateBytes state;                // per sequence on an attention node, bf16
  double gpu_bytes = 0;            // usable per GPU
  int64_t slots_per_gpu = 0;
  int64_t expert_gpus = 0;         // GPUs holding every slot once (slots are not split)
  int64_t attention_gpus = 0;      // GPUs one attention replica's weights need
};

// gpu_bytes: what one GPU offers to weights (its memory less workspaces and caches).
CapacityPlan PlanCapacity(const ModelConfig& config, WeightType experts, double gpu_bytes);
std::string FormatPlan(const CapacityPlan& plan);

}  // namespace k3

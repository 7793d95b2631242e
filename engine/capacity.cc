#include "engine/capacity.h"

#include <cmath>

#include "absl/strings/str_format.h"
#include "engine/weights.h"

namespace k3 {

absl::StatusOr<WeightType> ParseWeightType(const std::string& name) {
  if (name == "fp32") return WeightType::kFp32;
  if (name == "bf16") return WeightType::kBf16;
  if (name == "mxfp4") return WeightType::kMxfp4;
  return absl::InvalidArgumentError(absl::StrCat("weight type must be fp32, bf16 or mxfp4, got \"", name, "\""));
}

const char* WeightTypeName(WeightType t) {
  switch (t) {
    case WeightType::kFp32: return "fp32";
    case WeightType::kBf16: return "bf16";
    case WeightType::kMxfp4: return "mxfp4";
  }
  return "?";
}

double WeightBytes(WeightType t, double weights) {
  switch (t) {
    case WeightType::kFp32: return 4 * weights;
    case WeightType::kBf16: return 2 * weights;
    case WeightType::kMxfp4: return weights * (4 + 8.0 / 32) / 8;
  }
  return 0;
}

CapacityPlan PlanCapacity(const ModelConfig& c, WeightType experts, double gpu_bytes) {
  CapacityPlan p;
  p.experts = experts;
  ModelConfig plain = c;
  plain.expert_format = ExpertFormat::kFloat;  // count weights, whatever the checkpoint stores
  double other = 0;
  for (const TensorSpec& t : ExpectedTensors(plain)) {
    double n = 1;
    for (int64_t s : t.shape) n *= static_cast<double>(s);
    if (t.expert < 0) other += n;
  }
  for (int64_t l = 0; l < c.num_layers; ++l) p.slots += c.mlp[l] == Mlp::kMoe ? c.num_experts : 0;
  p.slot_bytes = WeightBytes(experts, 3.0 * static_cast<double>(c.moe_intermediate_size * c.expert_width()));
  p.expert_pool_bytes = p.slot_bytes * static_cast<double>(p.slots);
  p.attention_bytes = WeightBytes(WeightType::kBf16, other);
  p.state = SequenceStateBytes(c, 2);
  p.gpu_bytes = gpu_bytes;
  p.slots_per_gpu = static_cast<int64_t>(std::floor(gpu_bytes / p.slot_bytes));
  p.expert_gpus = p.slots_per_gpu > 0 ? (p.slots + p.slots_per_gpu - 1) / p.slots_per_gpu : 0;
  p.attention_gpus = static_cast<int64_t>(std::ceil(p.attention_bytes / gpu_bytes));
  return p;
}

std::string FormatPlan(const CapacityPlan& p) {
  constexpr double GiB = 1024.0 * 1024 * 1024;
  return absl::StrFormat(
      "  experts %-5s: %ld slots x %.2f MiB = %.1f GiB (%.3f TB); %ld slots per GPU of %.1f GiB -> %ld GPUs\n"
      "  attention  : %.1f GiB bf16 per replica (%ld GPU(s)); state per sequence %.1f MiB + %.1f KiB/token (bf16)\n",
      WeightTypeName(p.experts), static_cast<long>(p.slots), p.slot_bytes / (1024.0 * 1024), p.expert_pool_bytes / GiB,
      p.expert_pool_bytes / 1e12, static_cast<long>(p.slots_per_gpu), p.gpu_bytes / GiB, static_cast<long>(p.expert_gpus),
      p.attention_bytes / GiB, static_cast<long>(p.attention_gpus), p.state.fixed / (1024.0 * 1024),
      p.state.per_token / 1024.0);
}

}  // namespace k3

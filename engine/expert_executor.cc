#include "engine/expert_executor.h"

namespace k3 {

LocalExpertExecutor::LocalExpertExecutor(const ModelConfig& config, const ModelWeights& weights)
    : config_(config), weights_(weights) {}

absl::Status LocalExpertExecutor::Run(const ExpertRequest& r, float* out) const {
  if (r.layer < 0 || r.layer >= config_.num_layers || config_.mlp[r.layer] != Mlp::kMoe)
    return absl::InvalidArgumentError(absl::StrCat("layer ", r.layer, " has no routed experts"));
  if (r.width != config_.expert_width() || r.top_k != config_.top_k)
    return absl::InvalidArgumentError(absl::StrCat("expert request shape (width ", r.width, ", k ", r.top_k,
                                                   ") does not match the model"));
  const auto& experts = weights_.layers[r.layer].moe.experts;
  for (int64_t i = 0; i < r.rows * r.top_k; ++i) {
    const int32_t e = r.idx[i];
    if (e >= static_cast<int32_t>(experts.size()) || (e >= 0 && !experts[e].w1.loaded()))
      return absl::FailedPreconditionError(absl::StrCat("expert ", e, " of layer ", r.layer, " is not loaded here"));
  }
  cpu::GluParams p{config_.act == Activation::kSitu ? cpu::GluAct::kSitu : cpu::GluAct::kSilu, config_.situ_beta,
                   config_.situ_linear_beta};
  cpu::MoeExperts(r.rows, r.width, config_.moe_intermediate_size, r.top_k, r.x, r.idx, r.w,
                  static_cast<int64_t>(experts.size()), experts.data(), p, out);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> LocalExpertExecutor::Submit(const ExpertRequest& request) {
  const uint64_t ticket = next_ticket_++;
  pending_.emplace(ticket, request);
  return ticket;
}

absl::Status LocalExpertExecutor::Wait(uint64_t ticket, float* out) {
  auto it = pending_.find(ticket);
  if (it == pending_.end()) return absl::NotFoundError(absl::StrCat("unknown expert ticket ", ticket));
  const ExpertRequest r = it->second;
  pending_.erase(it);
  return Run(r, out);
}

}  // namespace k3

// Counts the tokens routed to each (layer, expert) on their way to the experts, for the router's
// load aggregation (and, later, the placement policy).
#pragma once

#include <mutex>
#include <vector>

#include "engine/expert_executor.h"
#include "k3serve/v1/control.pb.h"

namespace k3 {
namespace v1 = ::k3serve::v1;
}  // namespace k3

namespace k3::router {

class LoadCountingExecutor : public ExpertExecutor {
 public:
  LoadCountingExecutor(ExpertExecutor& inner, const ModelConfig& config)
      : inner_(inner), counts_(config.num_layers, std::vector<int64_t>(config.num_experts, 0)) {}

  absl::StatusOr<uint64_t> Submit(const ExpertRequest& r) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& row = counts_[r.layer];
      for (int64_t i = 0; i < r.rows * r.top_k; ++i)
        if (r.idx[i] >= 0) row[r.idx[i]]++;
    }
    return inner_.Submit(r);
  }
  absl::Status Wait(uint64_t ticket, float* out) override { return inner_.Wait(ticket, out); }

  // The counts since the last call (layers with no tokens left out).
  v1::LoadReport TakeReport(const std::string& node_id) {
    v1::LoadReport report;
    report.set_node_id(node_id);
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t l = 0; l < counts_.size(); ++l) {
      bool any = false;
      for (int64_t c : counts_[l]) any = any || c != 0;
      if (!any) continue;
      auto* pl = report.add_layers();
      pl->set_layer(static_cast<int32_t>(l));
      *pl->mutable_tokens_per_expert() = {counts_[l].begin(), counts_[l].end()};
      std::fill(counts_[l].begin(), counts_[l].end(), 0);
    }
    return report;
  }

 private:
  ExpertExecutor& inner_;
  std::mutex mu_;
  std::vector<std::vector<int64_t>> counts_;
};

}  // namespace k3::router

// Counts the tokens routed to each (layer, expert) on their way to the experts, and accumulates
// each MoE layer's quantile-balancing histogram of r = α − s' (DESIGN §1.5), for the router's load
// aggregation, placement and balancing bias. In adaptive routing mode it also re-routes each
// request's rows from the gate logits with the checkpoint's bias plus the router's QB bias.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/expert_executor.h"
#include "k3serve/v1/control.pb.h"
#include "kernels/cpu/router.h"
#include "router/qb.h"

namespace k3 {
namespace v1 = ::k3serve::v1;
}  // namespace k3

namespace k3::router {

class LoadCountingExecutor : public ExpertExecutor {
 public:
  // qb_bins: histogram bins per expert (0: no histograms).
  LoadCountingExecutor(ExpertExecutor& inner, const ModelConfig& config, int64_t qb_bins = 1000)
      : inner_(inner),
        config_(config),
        qb_bins_(qb_bins),
        counts_(config.num_layers, std::vector<int64_t>(config.num_experts, 0)),
        hist_(config.num_layers) {}

  // The routing of a placement message: adaptive biases (added to the checkpoint's), or frozen.
  absl::Status SetRouting(const v1::Placement& p) {
    auto next = std::make_shared<Routing>();
    next->version = p.bias_version();
    if (p.routing_mode() == v1::ROUTING_MODE_ADAPTIVE) {
      next->adaptive = true;
      next->bias.resize(config_.num_layers);
      for (const auto& lb : p.biases()) {
        if (lb.layer() < 0 || lb.layer() >= config_.num_layers || config_.mlp[lb.layer()] != Mlp::kMoe)
          return absl::InvalidArgumentError(absl::StrCat("placement: biases.layer = ", lb.layer(), " is not a MoE layer"));
        if (lb.bias_size() != config_.num_experts)
          return absl::InvalidArgumentError(absl::StrCat("placement: biases of layer ", lb.layer(), " has ", lb.bias_size(),
                                                         " entries, expected ", config_.num_experts));
        next->bias[lb.layer()] = {lb.bias().begin(), lb.bias().end()};
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    routing_ = std::move(next);
    return absl::OkStatus();
  }
  std::pair<std::string, uint64_t> routing() {
    std::lock_guard<std::mutex> lock(mu_);
    return {routing_->adaptive ? "adaptive" : "frozen", routing_->version};
  }

  absl::StatusOr<uint64_t> Submit(const ExpertRequest& request) override {
    ExpertRequest r = request;
    std::shared_ptr<const Routing> routing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      routing = routing_;
    }
    // Adaptive: the same router kernel as the engine's, with the bias moved by the QB estimate.
    Rerouted rerouted;
    const cpu::RouterParams rp{config_.num_experts, config_.top_k, config_.num_expert_group, config_.topk_group,
                               config_.moe_renormalize, config_.routed_scaling_factor};
    if (routing->adaptive && r.logits != nullptr && r.layer < static_cast<int64_t>(routing->bias.size()) &&
        !routing->bias[r.layer].empty() && r.top_k == config_.top_k) {
      rerouted.bias = routing->bias[r.layer];
      if (r.bias)
        for (int64_t e = 0; e < config_.num_experts; ++e) rerouted.bias[e] += r.bias[e];
      rerouted.idx.resize(r.rows * r.top_k);
      rerouted.w.resize(r.rows * r.top_k);
      cpu::RouteTopK(r.rows, r.logits, rerouted.bias.data(), rp, rerouted.idx.data(), rerouted.w.data());
      r.idx = rerouted.idx.data();
      r.w = rerouted.w.data();
      r.bias = rerouted.bias.data();
    }
    cpu::QbHistParams hp;
    // The histogram needs k + 1 candidates per token; the range follows the layer's bias.
    const bool qb = qb_bins_ > 0 && r.logits != nullptr && r.rows > 0 &&
                    config_.num_experts / std::max<int64_t>(config_.num_expert_group, 1) * config_.topk_group > config_.top_k;
    if (qb) {
      hp.bins = qb_bins_;
      QbRange(r.bias ? std::span<const float>(r.bias, config_.num_experts) : std::span<const float>(), &hp.rmin, &hp.rmax);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& row = counts_[r.layer];
      for (int64_t i = 0; i < r.rows * r.top_k; ++i)
        if (r.idx[i] >= 0) row[r.idx[i]]++;
      if (qb) {
        // Straight into the layer's histogram: rows·E increments, not a zeroed [bins, E] copy a dispatch.
        QbHistogram& acc = hist_[r.layer];
        if (acc.bins != hp.bins || acc.rmin != hp.rmin || acc.rmax != hp.rmax) {
          acc = {hp.bins, config_.num_experts, hp.rmin, hp.rmax,
                 std::vector<int64_t>(static_cast<size_t>(hp.bins * config_.num_experts), 0)};
        }
        cpu::QbHistogram(r.rows, r.logits, r.bias, rp, hp, acc.counts.data());
      }
    }
    auto ticket = inner_.Submit(r);
    if (ticket.ok() && !rerouted.idx.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      rerouted_[*ticket] = std::move(rerouted);  // the inner executor may read them until Wait
    }
    return ticket;
  }
  absl::Status Wait(uint64_t ticket, float* out) override {
    absl::Status s = inner_.Wait(ticket, out);
    std::lock_guard<std::mutex> lock(mu_);
    rerouted_.erase(ticket);
    return s;
  }

  // The counts and histograms since the last call (layers with no tokens left out).
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
      QbHistogram& h = hist_[l];
      if (h.bins > 0 && h.tokens() > 0) {
        pl->set_qb_bins(static_cast<int32_t>(h.bins));
        pl->set_qb_rmin(h.rmin);
        pl->set_qb_rmax(h.rmax);
        *pl->mutable_qb_histogram() = {h.counts.begin(), h.counts.end()};
        std::fill(h.counts.begin(), h.counts.end(), 0);
      }
    }
    return report;
  }

 private:
  struct Routing {
    bool adaptive = false;
    uint64_t version = 0;
    std::vector<std::vector<float>> bias;  // per layer (empty: none yet), added to the checkpoint's
  };
  struct Rerouted {
    std::vector<float> bias;
    std::vector<int32_t> idx;
    std::vector<float> w;
  };
  ExpertExecutor& inner_;
  const ModelConfig& config_;
  const int64_t qb_bins_;
  std::mutex mu_;
  std::vector<std::vector<int64_t>> counts_;
  std::vector<QbHistogram> hist_;  // per layer, since the last report
  std::shared_ptr<const Routing> routing_ = std::make_shared<Routing>();
  std::map<uint64_t, Rerouted> rerouted_;  // by ticket, until Wait
};

}  // namespace k3::router

#include "router/router_service.h"

#include <algorithm>
#include <cmath>
#include <future>
#include <numeric>

#include <nlohmann/json.hpp>

#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_server.h"
#include "common/tls.h"

namespace k3::router {
namespace {

// A node reported unreachable must answer its health probe within this (a hung node does not).
constexpr auto kProbeDeadline = std::chrono::milliseconds(500);

bool Hosts(const PlacementTable& t, const std::string& node_id) {
  for (const NodeInfo& n : t.nodes)
    if (n.node_id == node_id) return true;
  return false;
}

// The same nodes hosting the same slots.
bool SameAssignment(const PlacementTable& a, const PlacementTable& b) {
  if (a.nodes.size() != b.nodes.size() || a.complete() != b.complete()) return false;
  for (size_t i = 0; i < a.nodes.size(); ++i)
    if (a.nodes[i].node_id != b.nodes[i].node_id || a.nodes[i].ucx_address != b.nodes[i].ucx_address) return false;
  return a.replicas == b.replicas;
}

}  // namespace

RouterService::RouterService(ModelConfig config, metrics::Registry& reg, RouterOptions options)
    : config_(std::move(config)),
      options_(std::move(options)),
      next_version_(options_.first_version > 0 ? options_.first_version
                                               : static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))) {
  load_.assign(config_.num_layers, std::vector<int64_t>(config_.num_experts, 0));
  interval_ = load_;
  ema_.assign(config_.num_layers, std::vector<double>(config_.num_experts, 0.0));
  qb_.resize(config_.num_layers);
  qb_step_.resize(config_.num_layers);
  m_version_ = &metrics::Must(reg.AddGauge("k3serve_placement_version", "Version of the published expert placement."))->WithLabels();
  m_expert_nodes_ = &metrics::Must(reg.AddGauge("k3serve_router_expert_nodes", "Live registered expert nodes."))->WithLabels();
  m_attention_nodes_ = &metrics::Must(reg.AddGauge("k3serve_router_attention_nodes", "Attention nodes watching the placement."))->WithLabels();
  m_placements_ = &metrics::Must(reg.AddCounter("k3serve_placement_changes_total", "Placements published."))->WithLabels();
  m_imbalance_ = metrics::Must(reg.AddGauge("k3serve_expert_load_imbalance",
                                            "Per MoE layer: max over mean of the tokens routed to each expert since start.", {"layer"}));
  m_node_load_ = metrics::Must(reg.AddCounter("k3serve_expert_node_load_tokens_total",
                                              "Tokens routed to the slots of each expert node (all layers).", {"node"}));
  m_failures_ = metrics::Must(reg.AddCounter("k3serve_expert_node_failures_total", "Expert nodes dropped, by reason.", {"reason"}));
  m_rebalances_ = metrics::Must(reg.AddCounter("k3serve_rebalances_total",
                                               "Placement changes carried out, by outcome (completed, or abandoned: serving stayed on the old version).",
                                               {"outcome"}));
  m_rebalances_->WithLabels({"completed"});
  m_rebalances_->WithLabels({"abandoned"});
  m_moved_ = &metrics::Must(reg.AddCounter("k3serve_experts_moved_total", "Slots loaded on a node that did not hold them, over all completed changes."))->WithLabels();
  m_in_progress_ = &metrics::Must(reg.AddGauge("k3serve_rebalance_in_progress", "1 while a placement change is under way."))->WithLabels();
  auto* mode = metrics::Must(reg.AddGauge("k3serve_routing_mode",
                                          "1 for the routing mode in use (frozen: the checkpoint's bias; adaptive: plus the QB estimate).", {"mode"}));
  mode->WithLabels({"frozen"}).Set(options_.adaptive ? 0 : 1);
  mode->WithLabels({"adaptive"}).Set(options_.adaptive ? 1 : 0);
  m_bias_version_ = &metrics::Must(reg.AddGauge("k3serve_routing_bias_version",
                                                "Version of the routing bias pushed with the placement (0: the checkpoint's)."))->WithLabels();
  m_bias_max_abs_ = metrics::Must(reg.AddGauge("k3serve_routing_bias_max_abs",
                                               "Adaptive mode: largest |bias| the router adds to a layer's checkpoint bias.", {"layer"}));
  for (int64_t l = 0; l < config_.num_layers; ++l)  // 0 until adaptive routing moves a layer's bias
    if (config_.mlp[l] == Mlp::kMoe) m_bias_max_abs_->WithLabels({std::to_string(l)}).Set(0);
  bias_.resize(config_.num_layers);
  if (!options_.expert_metrics_layers.empty())
    m_expert_tokens_ = metrics::Must(reg.AddCounter("k3serve_expert_tokens_total",
                                                    "Tokens routed to each expert, for the layers named by --expert-metrics-layers.",
                                                    {"layer", "expert"}));
  placer_ = std::thread([this] { PlacerLoop(); });
}

RouterService::~RouterService() {
  Stop();
  placer_.join();
}

void RouterService::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

grpc::Status RouterService::BindIdentity(const std::string& node_id, const std::string& identity) {
  auto it = identities_.find(node_id);
  const bool live = experts_.count(node_id) > 0 || attention_.count(node_id) > 0;
  if (it != identities_.end() && live && it->second != identity)
    return {grpc::StatusCode::ALREADY_EXISTS, absl::StrCat("node_id \"", node_id, "\" is registered by another process")};
  identities_[node_id] = identity;
  return grpc::Status::OK;
}

void RouterService::RequestRebalance() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    rebalance_ = true;
  }
  cv_.notify_all();
}

grpc::Status RouterService::OwnNode(const grpc::ServerContext& ctx, const std::string& node_id) const {
  auto owner = identities_.find(node_id);
  if (owner != identities_.end() && owner->second != auth::IdentityOf(ctx))
    return {grpc::StatusCode::PERMISSION_DENIED, absl::StrCat("node_id \"", node_id, "\" belongs to another process")};
  return grpc::Status::OK;
}

grpc::Status RouterService::RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                                         v1::RegisterNodeResponse* resp) {
  if (auto s = auth::RequireNode(*ctx, "RegisterNode"); !s.ok()) return s;
  if (req->node_id().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "node_id must not be empty"};
  std::lock_guard<std::mutex> lock(mu_);
  if (req->role() == v1::NODE_ROLE_EXPERT || req->role() == v1::NODE_ROLE_ATTENTION)
    if (auto s = BindIdentity(req->node_id(), auth::IdentityOf(*ctx)); !s.ok()) return s;
  if (req->role() == v1::NODE_ROLE_EXPERT) {
    if (req->ucx_address().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "ucx_address must not be empty for an expert node"};
    if (req->grpc_address().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "grpc_address must not be empty for an expert node"};
    if (req->slot_capacity() < 0) return {grpc::StatusCode::INVALID_ARGUMENT, "slot_capacity must be >= 0"};
    ExpertNodeState& n = experts_[req->node_id()];
    n.info = {req->node_id(), req->ucx_address(), req->grpc_address()};
    n.capacity = req->slot_capacity();
    n.leaving = false;
    n.admin = v1::ExpertAdmin::NewStub(tls::NewChannel(req->grpc_address()));
    dirty_ = true;
    m_expert_nodes_->Set(static_cast<double>(experts_.size()));
    cv_.notify_all();
  } else if (req->role() == v1::NODE_ROLE_ATTENTION) {
    attention_.emplace(req->node_id(), 0);
  } else {
    return {grpc::StatusCode::INVALID_ARGUMENT, "role must be NODE_ROLE_ATTENTION or NODE_ROLE_EXPERT"};
  }
  resp->set_placement_version(placement_ ? placement_->version : 0);
  return grpc::Status::OK;
}

grpc::Status RouterService::WatchPlacement(grpc::ServerContext* ctx, const v1::WatchPlacementRequest* req,
                                           grpc::ServerWriter<v1::Placement>* writer) {
  if (auto s = auth::RequireNode(*ctx, "WatchPlacement"); !s.ok()) return s;
  const std::string id = req->node_id();
  uint64_t sent = 0, sent_bias = 0;
  std::unique_lock<std::mutex> lock(mu_);
  // Only the process that registered a node may hold (and so end) its watch.
  auto owner = identities_.find(id);
  if (owner == identities_.end())
    return {grpc::StatusCode::FAILED_PRECONDITION, absl::StrCat("node_id \"", id, "\" is not registered")};
  if (owner->second != auth::IdentityOf(*ctx))
    return {grpc::StatusCode::PERMISSION_DENIED, absl::StrCat("node_id \"", id, "\" belongs to another process")};
  const bool is_attention = attention_.count(id) > 0;
  const bool is_expert = experts_.count(id) > 0;
  m_attention_nodes_->Set(static_cast<double>(attention_.size()));
  while (!stopping_ && !ctx->IsCancelled()) {
    // Dropped meanwhile (e.g. it did not answer a probe): the node registers again when it can.
    if (is_expert && !experts_.count(id)) return {grpc::StatusCode::UNAVAILABLE, "dropped from the placement; register again"};
    if (placement_ && (placement_->version != sent || bias_version_ != sent_bias)) {
      v1::Placement p;
      PlacementProtoLocked(&p);
      sent = placement_->version;
      sent_bias = bias_version_;
      lock.unlock();
      const bool ok = writer->Write(p);
      lock.lock();
      if (!ok) break;
    }
    cv_.wait_for(lock, std::chrono::milliseconds(100));
  }
  // The stream is an expert node's liveness signal.
  if (!stopping_) {
    auto it = experts_.find(id);
    if (it != experts_.end()) {
      const bool left = it->second.leaving;
      lock.unlock();
      DropNode(id, left ? "left" : "watch stream closed");
    } else if (is_attention) {
      attention_.erase(id);
      identities_.erase(id);
      m_attention_nodes_->Set(static_cast<double>(attention_.size()));
      cv_.notify_all();  // a change may be waiting for its acknowledgement
    }
  }
  return grpc::Status::OK;
}

grpc::Status RouterService::ReportNodeFailure(grpc::ServerContext* ctx, const v1::ReportNodeFailureRequest* req,
                                              v1::ReportNodeFailureResponse* resp) {
  if (auto s = auth::RequireNode(*ctx, "ReportNodeFailure"); !s.ok()) return s;
  v1::ExpertAdmin::Stub* admin = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = experts_.find(req->node_id());
    if (it == experts_.end()) {
      resp->set_dropped(false);
      return grpc::Status::OK;
    }
    admin = it->second.admin.get();
  }
  // Believe the report only if the node does not answer us either.
  grpc::ClientContext probe;
  probe.set_deadline(std::chrono::system_clock::now() + kProbeDeadline);
  auth::AddAdminCredentials(&probe);
  v1::ExpertStatus status;
  const grpc::Status s = admin->Status(&probe, v1::StatusRequest(), &status);
  if (s.ok()) {
    resp->set_dropped(false);
    return grpc::Status::OK;
  }
  DropNode(req->node_id(), "reported unreachable");
  resp->set_dropped(true);
  return grpc::Status::OK;
}

grpc::Status RouterService::ReportLoad(grpc::ServerContext* ctx, const v1::LoadReport* req, v1::ReportLoadResponse*) {
  if (auto s = auth::RequireNode(*ctx, "ReportLoad"); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& l : req->layers()) {
    if (l.layer() < 0 || l.layer() >= config_.num_layers || config_.mlp[l.layer()] != Mlp::kMoe)
      return {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("layers.layer = ", l.layer(), " is not a MoE layer")};
    if (l.tokens_per_expert_size() != config_.num_experts)
      return {grpc::StatusCode::INVALID_ARGUMENT,
              absl::StrCat("layers.tokens_per_expert has ", l.tokens_per_expert_size(), " entries, expected ", config_.num_experts)};
    if (l.qb_bins() < 0 || (l.qb_bins() > 0 && l.qb_histogram_size() != int64_t{l.qb_bins()} * config_.num_experts))
      return {grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("layers.qb_histogram has ", l.qb_histogram_size(),
                                                               " counts, expected qb_bins x experts = ", int64_t{l.qb_bins()} * config_.num_experts)};
    if (l.qb_bins() > 0 && !(l.qb_rmax() > l.qb_rmin()))
      return {grpc::StatusCode::INVALID_ARGUMENT, "layers.qb_rmax must be > layers.qb_rmin"};
  }
  std::vector<std::vector<int64_t>> reported(load_.size());  // this report's tokens, by layer
  for (const auto& l : req->layers()) {
    auto& row = load_[l.layer()];
    auto& in = interval_[l.layer()];
    reported[l.layer()].assign(l.tokens_per_expert().begin(), l.tokens_per_expert().end());
    for (int e = 0; e < l.tokens_per_expert_size(); ++e) {
      row[e] += l.tokens_per_expert(e);
      in[e] += l.tokens_per_expert(e);
    }
    if (l.qb_bins() > 0) {
      // Nodes share the range (the same bias); a different one restarts the interval's sum.
      QbHistogram& h = qb_[l.layer()];
      if (h.bins != l.qb_bins() || h.rmin != l.qb_rmin() || h.rmax != l.qb_rmax())
        h = {l.qb_bins(), config_.num_experts, l.qb_rmin(), l.qb_rmax(), std::vector<int64_t>(l.qb_histogram_size(), 0)};
      for (int i = 0; i < l.qb_histogram_size(); ++i) h.counts[i] += l.qb_histogram(i);
    }
    if (m_expert_tokens_ && std::count(options_.expert_metrics_layers.begin(), options_.expert_metrics_layers.end(), l.layer()))
      for (int e = 0; e < l.tokens_per_expert_size(); ++e)
        if (l.tokens_per_expert(e) > 0)
          m_expert_tokens_->WithLabels({std::to_string(l.layer()), std::to_string(e)}).Inc(static_cast<double>(l.tokens_per_expert(e)));
    const int64_t total = std::accumulate(row.begin(), row.end(), int64_t{0});
    if (total > 0) {
      const double mean = static_cast<double>(total) / row.size();
      m_imbalance_->WithLabels({std::to_string(l.layer())}).Set(*std::max_element(row.begin(), row.end()) / mean);
    }
  }
  if (placement_) {
    for (size_t n = 0; n < placement_->nodes.size(); ++n) {
      int64_t tokens = 0;
      for (const Slot& s : placement_->SlotsOf(static_cast<int32_t>(n)))
        if (!reported[s.layer].empty())
          tokens += reported[s.layer][s.expert] / static_cast<int64_t>(placement_->replicas[s.layer][s.expert].size());
      m_node_load_->WithLabels({placement_->nodes[n].node_id}).Inc(static_cast<double>(tokens));
    }
  }
  return grpc::Status::OK;
}

grpc::Status RouterService::GetPlacement(grpc::ServerContext* ctx, const v1::GetPlacementRequest*, v1::Placement* resp) {
  if (auto s = auth::RequireNode(*ctx, "GetPlacement"); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  PlacementProtoLocked(resp);
  return grpc::Status::OK;
}

void RouterService::PlacementProtoLocked(v1::Placement* out) const {
  if (!placement_) return;
  placement_->ToProto(out);
  out->set_bias_version(bias_version_);
  if (!options_.adaptive) return;
  out->set_routing_mode(v1::ROUTING_MODE_ADAPTIVE);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (bias_[l].empty()) continue;
    auto* lb = out->add_biases();
    lb->set_layer(static_cast<int32_t>(l));
    *lb->mutable_bias() = {bias_[l].begin(), bias_[l].end()};
  }
}

grpc::Status RouterService::AckPlacement(grpc::ServerContext* ctx, const v1::AckPlacementRequest* req, v1::AckPlacementResponse*) {
  if (auto s = auth::RequireNode(*ctx, "AckPlacement"); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto s = OwnNode(*ctx, req->node_id()); !s.ok()) return s;
  auto it = attention_.find(req->node_id());
  if (it == attention_.end())
    return {grpc::StatusCode::FAILED_PRECONDITION, absl::StrCat("node_id \"", req->node_id(), "\" is not a registered attention node")};
  it->second = std::max(it->second, req->version());
  cv_.notify_all();
  return grpc::Status::OK;
}

grpc::Status RouterService::LeaveNode(grpc::ServerContext* ctx, const v1::LeaveNodeRequest* req, v1::LeaveNodeResponse* resp) {
  if (auto s = auth::RequireNode(*ctx, "LeaveNode"); !s.ok()) return s;
  std::unique_lock<std::mutex> lock(mu_);
  if (auto s = OwnNode(*ctx, req->node_id()); !s.ok()) return s;
  auto it = experts_.find(req->node_id());
  if (it == experts_.end()) {
    resp->set_placement_version(placement_ ? placement_->version : 0);
    return grpc::Status::OK;
  }
  it->second.leaving = true;
  dirty_ = true;
  cv_.notify_all();
  std::fprintf(stderr, "router: expert node %s is leaving\n", req->node_id().c_str());
  // Done once a placement without the node is published and no attention node uses an older one.
  const absl::Time end = absl::Now() + 2 * options_.placement_timeout + options_.settle;
  while (!stopping_ && !ctx->IsCancelled()) {
    if (!dirty_ && !in_progress_ && (!placement_ || !Hosts(*placement_, req->node_id()))) {
      resp->set_placement_version(placement_ ? placement_->version : 0);
      return grpc::Status::OK;
    }
    if (absl::Now() >= end)
      return {grpc::StatusCode::DEADLINE_EXCEEDED, "no placement without this node completed within the placement timeout"};
    cv_.wait_for(lock, std::chrono::milliseconds(50));
  }
  return {grpc::StatusCode::CANCELLED, "router stopping"};
}

nlohmann::json RouterService::ExpertLoadJson() const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json out;
  out["placement_version"] = placement_ ? placement_->version : 0;
  out["routing_mode"] = options_.adaptive ? "adaptive" : "frozen";
  out["bias_version"] = bias_version_;
  out["nodes"] = nlohmann::json::array();
  if (placement_)
    for (const NodeInfo& n : placement_->nodes) out["nodes"].push_back(n.node_id);
  // Node loads: the EMA of each expert's tokens split over its replicas, under the placement in use.
  if (placement_) {
    out["node_load_ema"] = NodeLoads(*placement_, ema_);
    out["node_load_max_over_mean"] = NodeImbalance(*placement_, ema_);
  }
  out["layers"] = nlohmann::json::array();
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (config_.mlp[l] != Mlp::kMoe) continue;
    nlohmann::json layer;
    layer["layer"] = l;
    layer["tokens"] = load_[l];
    layer["tokens_ema"] = ema_[l];
    const double sum = std::accumulate(ema_[l].begin(), ema_[l].end(), 0.0);
    layer["expert_max_over_mean"] = sum > 0 ? *std::max_element(ema_[l].begin(), ema_[l].end()) * ema_[l].size() / sum : 1.0;
    if (placement_) layer["node_load_max_over_mean"] = NodeImbalance(*placement_, ema_, l);
    layer["qb_bias_step"] = qb_step_[l];  // the last QB estimate of the bias step
    layer["bias"] = bias_[l];             // adaptive: added to the checkpoint's bias
    nlohmann::json replicas = nlohmann::json::array();
    if (placement_ && l < static_cast<int64_t>(placement_->replicas.size()))
      for (const auto& hosts : placement_->replicas[l]) {
        nlohmann::json ids = nlohmann::json::array();
        for (int32_t n : hosts) ids.push_back(placement_->nodes[n].node_id);
        replicas.push_back(ids);
      }
    layer["replicas"] = replicas;
    out["layers"].push_back(layer);
  }
  return out;
}

void RouterService::DropNode(const std::string& node_id, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (experts_.erase(node_id) == 0) return;
  identities_.erase(node_id);
  std::fprintf(stderr, "router: dropping expert node %s: %s\n", node_id.c_str(), why.c_str());
  m_failures_->WithLabels({why}).Inc();
  m_expert_nodes_->Set(static_cast<double>(experts_.size()));
  dirty_ = true;
  cv_.notify_all();
}

void RouterService::FoldLoadLocked() {
  const double a = options_.load_ema;
  for (int64_t l = 0; l < config_.num_layers; ++l)
    for (int64_t e = 0; e < config_.num_experts; ++e) {
      ema_[l][e] = a * static_cast<double>(interval_[l][e]) + (1.0 - a) * ema_[l][e];
      interval_[l][e] = 0;
    }
  // The quantile-balancing estimate of each layer's bias step; adaptive mode applies it.
  bool bias_changed = false;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    QbHistogram& h = qb_[l];
    if (h.bins <= 0 || h.tokens() == 0) continue;
    auto step = QbEstimate(h, config_.top_k);
    if (step.ok()) qb_step_[l] = std::move(*step);
    std::fill(h.counts.begin(), h.counts.end(), 0);
    if (!options_.adaptive || !step.ok()) continue;
    // Each step bounded (the histogram is one interval's sample), the bias kept mean-centred.
    auto& b = bias_[l];
    b.resize(config_.num_experts, 0.0f);
    const float m = static_cast<float>(options_.qb_max_step);
    double mean = 0;
    for (int64_t e = 0; e < config_.num_experts; ++e) {
      b[e] += std::clamp(qb_step_[l][e], -m, m);
      mean += b[e];
    }
    mean /= static_cast<double>(config_.num_experts);
    float max_abs = 0;
    for (float& v : b) {
      v -= static_cast<float>(mean);
      max_abs = std::max(max_abs, std::fabs(v));
    }
    m_bias_max_abs_->WithLabels({std::to_string(l)}).Set(max_abs);
    bias_changed = true;
  }
  if (bias_changed) {
    bias_version_++;
    m_bias_version_->Set(static_cast<double>(bias_version_));
    cv_.notify_all();  // watchers push it
  }
  if (!placement_ || options_.rebalance_after <= 0) return;
  if (NodeImbalance(*placement_, ema_) > options_.rebalance_threshold) {
    if (++over_threshold_ >= options_.rebalance_after) {
      std::fprintf(stderr, "router: node load max/mean %.3f > %.2f for %d intervals: rebalancing\n", NodeImbalance(*placement_, ema_),
                   options_.rebalance_threshold, over_threshold_);
      rebalance_ = true;
      over_threshold_ = 0;
    }
  } else {
    over_threshold_ = 0;
  }
}

void RouterService::ReleaseSlots(const std::vector<std::string>& nodes, uint64_t keep_version) {
  std::vector<v1::ExpertAdmin::Stub*> admins;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& id : nodes) {
      auto it = experts_.find(id);
      if (it != experts_.end()) admins.push_back(it->second.admin.get());
    }
  }
  for (auto* admin : admins) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kProbeDeadline);
    auth::AddAdminCredentials(&ctx);
    v1::ReleaseSlotsRequest req;
    req.set_keep_version(keep_version);
    v1::ReleaseSlotsResponse resp;
    admin->ReleaseSlots(&ctx, req, &resp);  // best effort: a node that misses it frees them on its next change
  }
}

bool RouterService::ChangePlacement(std::shared_ptr<const PlacementTable> table, std::shared_ptr<const PlacementTable> old) {
  const uint64_t v = table->version, old_v = old ? old->version : 0;
  // (1) Every node of the new table loads its slots (beside the ones it holds), in parallel.
  std::vector<std::string> ids;
  std::vector<v1::ExpertAdmin::Stub*> admins;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const NodeInfo& n : table->nodes) {
      auto it = experts_.find(n.node_id);
      if (it == experts_.end()) continue;  // gone meanwhile: its load fails below
      ids.push_back(n.node_id);
      admins.push_back(it->second.admin.get());
    }
  }
  std::vector<std::future<grpc::Status>> loads;
  for (size_t i = 0; i < table->nodes.size(); ++i) {
    auto it = std::find(ids.begin(), ids.end(), table->nodes[i].node_id);
    if (it == ids.end()) {
      loads.push_back(std::async(std::launch::deferred, [] { return grpc::Status(grpc::StatusCode::UNAVAILABLE, "node gone"); }));
      continue;
    }
    v1::ExpertAdmin::Stub* admin = admins[it - ids.begin()];
    v1::LoadSlotsRequest req;
    req.set_version(v);
    for (const Slot& s : table->SlotsOf(static_cast<int32_t>(i))) {
      auto* ps = req.add_slots();
      ps->set_layer(s.layer);
      ps->set_expert(s.expert);
    }
    loads.push_back(std::async(std::launch::async, [admin, req = std::move(req), timeout = options_.placement_timeout] {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
      auth::AddAdminCredentials(&ctx);
      v1::LoadSlotsResponse resp;
      return admin->LoadSlots(&ctx, req, &resp);
    }));
  }
  std::vector<std::pair<std::string, grpc::Status>> failed;
  for (size_t i = 0; i < loads.size(); ++i) {
    grpc::Status s = loads[i].get();
    if (!s.ok()) failed.emplace_back(table->nodes[i].node_id, s);
  }
  std::vector<std::string> table_ids;
  for (const NodeInfo& n : table->nodes) table_ids.push_back(n.node_id);
  if (!failed.empty()) {
    // Abandoned: the nodes free what they loaded for it, serving stays on the old version, and a
    // node that did not get ready leaves the pool (the next change places over the others).
    for (const auto& [id, s] : failed)
      std::fprintf(stderr, "router: placement v%lu abandoned: expert node %s not ready within %s (%s); serving stays on v%lu\n",
                   static_cast<unsigned long>(v), id.c_str(), absl::FormatDuration(options_.placement_timeout).c_str(),
                   s.error_message().c_str(), static_cast<unsigned long>(old_v));
    m_rebalances_->WithLabels({"abandoned"}).Inc();
    std::vector<std::string> loaded;
    for (const std::string& id : table_ids)
      if (std::none_of(failed.begin(), failed.end(), [&](const auto& f) { return f.first == id; })) loaded.push_back(id);
    ReleaseSlots(loaded, old_v);
    for (const auto& [id, s] : failed)
      DropNode(id, s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ? "not ready within the placement timeout" : "LoadSlots failed");
    return false;
  }
  // (2) Publish: watchers get it, attention nodes switch between dispatches.
  std::unique_lock<std::mutex> lock(mu_);
  placement_ = table;
  m_version_->Set(static_cast<double>(v));
  m_placements_->Inc();
  std::fprintf(stderr, "router: placement v%lu over %zu expert nodes (%s), %ld slots moved\n", static_cast<unsigned long>(v),
               table->nodes.size(), table->complete() ? "complete" : "incomplete",
               static_cast<long>(old ? SlotsMoved(*old, *table) : 0));
  cv_.notify_all();
  // (3) Drained: every attention node runs v with nothing in flight on another version.
  const absl::Time end = absl::Now() + options_.placement_timeout;
  auto all_acked = [&] {
    for (const auto& [id, acked] : attention_)
      if (acked < v) return false;
    return true;
  };
  while (!stopping_ && !all_acked() && absl::Now() < end) cv_.wait_for(lock, std::chrono::milliseconds(20));
  if (!all_acked() && !stopping_) {
    std::string late;
    for (const auto& [id, acked] : attention_)
      if (acked < v) absl::StrAppend(&late, late.empty() ? "" : ", ", id);
    std::fprintf(stderr, "router: placement v%lu: %s did not confirm within %s; freeing the old slots (dispatches have timed out)\n",
                 static_cast<unsigned long>(v), late.c_str(), absl::FormatDuration(options_.placement_timeout).c_str());
  }
  // (4) Free what no placement in use needs, on the new nodes and on those that left.
  std::vector<std::string> release = table_ids;
  if (old)
    for (const NodeInfo& n : old->nodes)
      if (!Hosts(*table, n.node_id)) release.push_back(n.node_id);
  lock.unlock();
  ReleaseSlots(release, v);
  lock.lock();
  m_rebalances_->WithLabels({"completed"}).Inc();
  if (old) m_moved_->Inc(static_cast<double>(SlotsMoved(*old, *table)));
  return true;
}

void RouterService::PlacerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  absl::Time next_fold = absl::Now() + options_.load_interval;
  while (!stopping_) {
    if (absl::Now() >= next_fold) {
      FoldLoadLocked();
      next_fold = absl::Now() + options_.load_interval;
    }
    if (!dirty_ && !rebalance_) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      continue;
    }
    // Let a burst of registrations settle into one placement.
    lock.unlock();
    absl::SleepFor(options_.settle);
    lock.lock();
    if (stopping_) break;
    const bool rebalance = rebalance_;
    dirty_ = rebalance_ = false;
    std::vector<NodeInfo> nodes;
    std::vector<int32_t> capacity;
    for (auto& [id, n] : experts_) {
      if (n.leaving) continue;
      nodes.push_back(n.info);
      capacity.push_back(n.capacity);
    }
    std::shared_ptr<const PlacementTable> old = placement_;
    auto table = EplbPlacement(config_, nodes, capacity, ema_, old.get(), options_.eplb, next_version_);
    if (!table.ok()) {
      std::fprintf(stderr, "router: no placement over %zu expert nodes: %s\n", nodes.size(), std::string(table.status().message()).c_str());
      continue;
    }
    if (old && SameAssignment(*old, *table)) {
      if (rebalance) std::fprintf(stderr, "router: rebalance: placement v%lu is already balanced\n", static_cast<unsigned long>(old->version));
      cv_.notify_all();
      continue;
    }
    next_version_++;
    in_progress_ = true;
    m_in_progress_->Set(1);
    lock.unlock();
    ChangePlacement(std::make_shared<const PlacementTable>(std::move(*table)), old);
    lock.lock();
    in_progress_ = false;
    m_in_progress_->Set(0);
    cv_.notify_all();
  }
}

}  // namespace k3::router

#include "router/router_service.h"

#include <algorithm>
#include <numeric>

#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_server.h"
#include "common/tls.h"

namespace k3::router {
namespace {

constexpr auto kLoadSlotsDeadline = std::chrono::seconds(60);
// A node reported unreachable must answer its health probe within this (a hung node does not).
constexpr auto kProbeDeadline = std::chrono::milliseconds(500);

}  // namespace

RouterService::RouterService(ModelConfig config, metrics::Registry& reg, uint64_t first_version)
    : config_(std::move(config)),
      next_version_(first_version > 0 ? first_version : static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))) {
  load_.assign(config_.num_layers, std::vector<int64_t>(config_.num_experts, 0));
  m_version_ = &metrics::Must(reg.AddGauge("k3serve_placement_version", "Version of the published expert placement."))->WithLabels();
  m_expert_nodes_ = &metrics::Must(reg.AddGauge("k3serve_router_expert_nodes", "Live registered expert nodes."))->WithLabels();
  m_attention_nodes_ = &metrics::Must(reg.AddGauge("k3serve_router_attention_nodes", "Attention nodes watching the placement."))->WithLabels();
  m_placements_ = &metrics::Must(reg.AddCounter("k3serve_placement_changes_total", "Placements published."))->WithLabels();
  m_imbalance_ = metrics::Must(reg.AddGauge("k3serve_expert_load_imbalance",
                                            "Per MoE layer: max over mean of the tokens routed to each expert since start.", {"layer"}));
  m_node_load_ = metrics::Must(reg.AddCounter("k3serve_expert_node_load_tokens_total",
                                              "Tokens routed to the slots of each expert node (all layers).", {"node"}));
  m_failures_ = metrics::Must(reg.AddCounter("k3serve_expert_node_failures_total", "Expert nodes dropped, by reason.", {"reason"}));
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
    ExpertNodeState& n = experts_[req->node_id()];
    n.info = {req->node_id(), req->ucx_address(), req->grpc_address()};
    n.admin = v1::ExpertAdmin::NewStub(tls::NewChannel(req->grpc_address()));
    dirty_ = true;
    m_expert_nodes_->Set(static_cast<double>(experts_.size()));
    cv_.notify_all();
  } else if (req->role() == v1::NODE_ROLE_ATTENTION) {
    attention_.insert(req->node_id());
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
  uint64_t sent = 0;
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
    if (placement_ && placement_->version != sent) {
      v1::Placement p;
      placement_->ToProto(&p);
      sent = placement_->version;
      lock.unlock();
      const bool ok = writer->Write(p);
      lock.lock();
      if (!ok) break;
    }
    cv_.wait_for(lock, std::chrono::milliseconds(100));
  }
  // The stream is an expert node's liveness signal.
  if (!stopping_) {
    if (experts_.count(id)) {
      lock.unlock();
      DropNode(id, "watch stream closed");
    } else if (is_attention) {
      attention_.erase(id);
      identities_.erase(id);
      m_attention_nodes_->Set(static_cast<double>(attention_.size()));
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
  }
  std::vector<std::vector<int64_t>> reported(load_.size());  // this report's tokens, by layer
  for (const auto& l : req->layers()) {
    auto& row = load_[l.layer()];
    reported[l.layer()].assign(l.tokens_per_expert().begin(), l.tokens_per_expert().end());
    for (int e = 0; e < l.tokens_per_expert_size(); ++e) row[e] += l.tokens_per_expert(e);
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
        if (!reported[s.layer].empty()) tokens += reported[s.layer][s.expert];
      m_node_load_->WithLabels({placement_->nodes[n].node_id}).Inc(static_cast<double>(tokens));
    }
  }
  return grpc::Status::OK;
}

grpc::Status RouterService::GetPlacement(grpc::ServerContext* ctx, const v1::GetPlacementRequest*, v1::Placement* resp) {
  if (auto s = auth::RequireNode(*ctx, "GetPlacement"); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  if (placement_) placement_->ToProto(resp);
  return grpc::Status::OK;
}

std::vector<std::vector<int64_t>> RouterService::ExpertLoad() const {
  std::lock_guard<std::mutex> lock(mu_);
  return load_;
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

void RouterService::PlacerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (!dirty_) {
      cv_.wait_for(lock, std::chrono::milliseconds(200));
      continue;
    }
    // Let a burst of registrations settle into one placement.
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    lock.lock();
    dirty_ = false;
    std::vector<NodeInfo> nodes;
    std::vector<v1::ExpertAdmin::Stub*> admins;
    for (auto& [id, n] : experts_) {
      nodes.push_back(n.info);
      admins.push_back(n.admin.get());
    }
    auto table = std::make_shared<PlacementTable>(EvenPlacement(config_, nodes, next_version_++));
    lock.unlock();
    // Each node loads its slots before anyone routes to them.
    std::vector<std::string> failed;
    for (size_t i = 0; i < nodes.size(); ++i) {
      v1::LoadSlotsRequest req;
      req.set_version(table->version);
      for (const Slot& s : table->SlotsOf(static_cast<int32_t>(i))) {
        auto* ps = req.add_slots();
        ps->set_layer(s.layer);
        ps->set_expert(s.expert);
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + kLoadSlotsDeadline);
      auth::AddAdminCredentials(&ctx);
      v1::LoadSlotsResponse resp;
      const grpc::Status s = admins[i]->LoadSlots(&ctx, req, &resp);
      if (!s.ok()) failed.push_back(nodes[i].node_id + ": " + s.error_message());
    }
    if (!failed.empty()) {
      for (const auto& f : failed) DropNode(f.substr(0, f.find(':')), "LoadSlots failed");
      lock.lock();
      continue;  // re-place over the survivors
    }
    lock.lock();
    if (dirty_) continue;  // the node set changed meanwhile
    placement_ = table;
    m_version_->Set(static_cast<double>(table->version));
    m_placements_->Inc();
    std::fprintf(stderr, "router: placement v%lu over %zu expert nodes (%s)\n", static_cast<unsigned long>(table->version),
                 nodes.size(), table->complete() ? "complete" : "incomplete");
    cv_.notify_all();
  }
}

}  // namespace k3::router

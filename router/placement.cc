#include "router/placement.h"

namespace k3::router {

bool PlacementTable::complete() const {
  if (nodes.empty()) return false;
  for (const auto& layer : replicas)
    for (const auto& r : layer)
      if (r.empty()) return false;
  return true;
}

std::vector<Slot> PlacementTable::SlotsOf(int32_t node) const {
  std::vector<Slot> out;
  for (size_t l = 0; l < replicas.size(); ++l)
    for (size_t e = 0; e < replicas[l].size(); ++e)
      for (int32_t n : replicas[l][e])
        if (n == node) out.push_back({static_cast<int32_t>(l), static_cast<int32_t>(e)});
  return out;
}

void PlacementTable::ToProto(v1::Placement* out) const {
  out->Clear();
  out->set_version(version);
  out->set_complete(complete());
  out->set_routing_mode(v1::ROUTING_MODE_FROZEN);  // the router sets adaptive and the biases
  for (const auto& n : nodes) {
    auto* pn = out->add_nodes();
    pn->set_node_id(n.node_id);
    pn->set_ucx_address(n.ucx_address);
    pn->set_grpc_address(n.grpc_address);
  }
  for (size_t l = 0; l < replicas.size(); ++l) {
    if (replicas[l].empty()) continue;
    auto* pl = out->add_layers();
    pl->set_layer(static_cast<int32_t>(l));
    for (const auto& r : replicas[l]) *pl->add_experts()->mutable_nodes() = {r.begin(), r.end()};
  }
}

absl::StatusOr<PlacementTable> PlacementTable::FromProto(const v1::Placement& p, const ModelConfig& c) {
  PlacementTable t;
  t.version = p.version();
  for (const auto& n : p.nodes()) t.nodes.push_back({n.node_id(), n.ucx_address(), n.grpc_address()});
  t.replicas.assign(c.num_layers, {});
  for (const auto& pl : p.layers()) {
    const int32_t l = pl.layer();
    if (l < 0 || l >= c.num_layers || c.mlp[l] != Mlp::kMoe)
      return absl::InvalidArgumentError(absl::StrCat("placement: layers.layer = ", l, " is not a MoE layer"));
    if (pl.experts_size() != c.num_experts)
      return absl::InvalidArgumentError(
          absl::StrCat("placement: layer ", l, " lists ", pl.experts_size(), " experts, the model has ", c.num_experts));
    auto& layer = t.replicas[l];
    layer.resize(c.num_experts);
    for (int e = 0; e < pl.experts_size(); ++e)
      for (int32_t n : pl.experts(e).nodes()) {
        if (n < 0 || n >= static_cast<int32_t>(t.nodes.size()))
          return absl::InvalidArgumentError(absl::StrCat("placement: layer ", l, " expert ", e, " names node ", n));
        layer[e].push_back(n);
      }
  }
  return t;
}

PlacementTable EvenPlacement(const ModelConfig& c, std::vector<NodeInfo> nodes, uint64_t version) {
  PlacementTable t;
  t.version = version;
  t.nodes = std::move(nodes);
  t.replicas.assign(c.num_layers, {});
  const int64_t n = static_cast<int64_t>(t.nodes.size()), E = c.num_experts;
  if (n == 0) return t;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.mlp[l] != Mlp::kMoe) continue;
    t.replicas[l].resize(E);
    for (int64_t e = 0; e < E; ++e) t.replicas[l][e] = {static_cast<int32_t>((e * n / E + l) % n)};
  }
  return t;
}

}  // namespace k3::router

// The expert placement: which expert nodes host each (layer, expert) slot. Versioned; the router
// owns it, every node watches it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "k3serve/v1/control.pb.h"

namespace k3 {
namespace v1 = ::k3serve::v1;
}  // namespace k3

namespace k3::router {

struct NodeInfo {
  std::string node_id;
  std::string ucx_address;
  std::string grpc_address;
};

struct Slot {
  int32_t layer = 0;
  int32_t expert = 0;
};

struct PlacementTable {
  uint64_t version = 0;
  std::vector<NodeInfo> nodes;
  // replicas[layer][expert]: indices into nodes. Empty for dense layers.
  std::vector<std::vector<std::vector<int32_t>>> replicas;

  // Every expert of every MoE layer has at least one replica.
  bool complete() const;
  std::vector<Slot> SlotsOf(int32_t node) const;

  void ToProto(v1::Placement* out) const;
  // Checks indices and shapes against the config; errors name the field.
  static absl::StatusOr<PlacementTable> FromProto(const v1::Placement& p, const ModelConfig& config);
};

// Each MoE layer's experts split into contiguous, near-equal ranges over the nodes, one replica
// each; the ranges rotate by layer so that remainders do not always land on the same node.
PlacementTable EvenPlacement(const ModelConfig& config, std::vector<NodeInfo> nodes, uint64_t version);

}  // namespace k3::router

// Expert placement from measured load (DeepSeek EPLB's global policy, plus a migration cost): per
// MoE layer, replicate the expert with the largest load per replica until the redundant slots are
// used, then pack the replicas so that every node carries the same load and the same slot count,
// keeping replicas where the current placement has them unless moving one evens the load.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "router/placement.h"

namespace k3::router {

// The most redundant slots a layer may have, as a fraction of the experts (each expert 5 copies on average).
constexpr double kMaxRedundancy = 4.0;

struct EplbOptions {
  double redundancy = 0.0;  // redundant slots per layer, as a fraction of the experts (rounded up to fill every node)
  double tolerance = 0.01;  // stop evening out at max/mean node load <= 1 + tolerance (per layer)
};

// One layer: hosts[e] = the nodes (0..nodes-1) holding expert e's replicas. Every node gets exactly
// slots_per_node replicas (slots_per_node * nodes >= load.size()), no node two of one expert.
// current: the same layer's hosts under the current placement, in the new node numbering (-1 for
// a node that left); empty for none.
std::vector<std::vector<int32_t>> PlaceLayer(std::span<const double> load, int32_t nodes, int64_t slots_per_node,
                                             const std::vector<std::vector<int32_t>>& current, const EplbOptions& options);

// The whole table. load[layer][expert]: token counts (an EMA); a layer without counts is treated as
// uniform. capacity[n]: node n's slot capacity over all layers (0: no limit). Fails with
// FAILED_PRECONDITION when the nodes' capacity cannot hold one replica of every expert.
absl::StatusOr<PlacementTable> EplbPlacement(const ModelConfig& config, std::vector<NodeInfo> nodes,
                                             std::span<const int32_t> capacity,
                                             const std::vector<std::vector<double>>& load,
                                             const PlacementTable* current, const EplbOptions& options, uint64_t version);

// max/mean over nodes of the load their replicas carry (an expert's load split evenly over its
// replicas, as replica choice by outstanding rows does), summed over the MoE layers; layer >= 0:
// that layer only. 1 for no load.
double NodeImbalance(const PlacementTable& t, const std::vector<std::vector<double>>& load, int64_t layer = -1);
std::vector<double> NodeLoads(const PlacementTable& t, const std::vector<std::vector<double>>& load, int64_t layer = -1);
// Slots of `to` that `from` does not have on the same node (by node id): what a change loads.
int64_t SlotsMoved(const PlacementTable& from, const PlacementTable& to);

}  // namespace k3::router

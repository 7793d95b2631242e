#include "router/eplb.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>

namespace k3::router {
namespace {

ModelConfig Config(int64_t layers, int64_t experts) {
  ModelConfig c;
  c.num_layers = layers + 1;
  c.mlp.assign(c.num_layers, Mlp::kMoe);
  c.mlp[0] = Mlp::kDense;  // a dense first layer, as in the Kimi configs
  c.num_experts = experts;
  c.top_k = 8;
  return c;
}

std::vector<NodeInfo> Nodes(int n, int first = 0) {
  std::vector<NodeInfo> v;
  for (int i = first; i < first + n; ++i) v.push_back({"e" + std::to_string(i), "127.0.0.1:" + std::to_string(9000 + i), ""});
  return v;
}

// Zipf(S) popularity over a random order of the experts, per layer.
std::vector<std::vector<double>> ZipfLoad(const ModelConfig& c, double S, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<double>> load(c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.mlp[l] != Mlp::kMoe) continue;
    std::vector<int64_t> order(c.num_experts);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    load[l].resize(c.num_experts);
    for (int64_t r = 0; r < c.num_experts; ++r) load[l][order[r]] = 1e6 * std::pow(static_cast<double>(r + 1), -S);
  }
  return load;
}

void ExpectWellFormed(const ModelConfig& c, const PlacementTable& t, const std::string& what) {
  ASSERT_TRUE(t.complete()) << what;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.mlp[l] != Mlp::kMoe) {
      EXPECT_TRUE(t.replicas[l].empty());
      continue;
    }
    std::vector<int64_t> slots(t.nodes.size(), 0);
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const auto& h = t.replicas[l][e];
      EXPECT_GE(h.size(), 1u) << what << " layer " << l << " expert " << e;
      EXPECT_EQ(std::set<int32_t>(h.begin(), h.end()).size(), h.size()) << what << ": two replicas on one node";
      for (int32_t n : h) slots[n]++;
    }
    for (int64_t s : slots) EXPECT_EQ(s, slots[0]) << what << " layer " << l << ": unequal slot counts";
  }
}

TEST(Eplb, EveryExpertPlacedWithEqualSlotCounts) {
  for (int64_t E : {8, 64, 896})
    for (int n : {1, 2, 3, 5, 8, 16})
      for (double red : {0.0, 0.1, 0.25}) {
        const ModelConfig c = Config(3, E);
        const std::vector<int32_t> cap(n, 0);
        EplbOptions o;
        o.redundancy = red;
        auto t = EplbPlacement(c, Nodes(n), cap, ZipfLoad(c, 1.2, static_cast<uint32_t>(E + n)), nullptr, o, 1);
        ASSERT_TRUE(t.ok()) << t.status();
        ExpectWellFormed(c, *t, absl::StrCat("E=", E, " n=", n, " redundancy=", red));
      }
}

TEST(Eplb, ZipfLoadsBalancedWithRedundantSlots) {
  const ModelConfig c = Config(4, 896);
  const auto load = ZipfLoad(c, 1.2, 11);
  const std::vector<int32_t> cap(8, 0);
  std::printf("EPLB on Zipf(1.2) loads, E=896, 8 nodes, 4 MoE layers: max/mean node load\n");
  std::printf("%-11s %12s %14s %12s\n", "redundancy", "slots/layer", "worst layer", "all layers");
  EplbOptions o;
  const PlacementTable even = EvenPlacement(c, Nodes(8), 1);
  double worst_even = 0;
  for (int64_t l = 1; l < c.num_layers; ++l) worst_even = std::max(worst_even, NodeImbalance(even, load, l));
  std::printf("%-11s %12d %14.3f %12.3f\n", "even split", 896, worst_even, NodeImbalance(even, load));
  for (double red : {0.0, 0.1, 0.25}) {
    o.redundancy = red;
    auto t = EplbPlacement(c, Nodes(8), cap, load, nullptr, o, 1);
    ASSERT_TRUE(t.ok());
    ExpectWellFormed(c, *t, "zipf");
    double worst = 0;
    for (int64_t l = 1; l < c.num_layers; ++l) worst = std::max(worst, NodeImbalance(*t, load, l));
    std::printf("%9.0f%%  %12zu %14.3f %12.3f\n", red * 100, t->SlotsOf(0).size() / 4 * 8, worst, NodeImbalance(*t, load));
    if (red == 0.1) {
      EXPECT_LE(worst, 1.05);
    }
  }
}

TEST(Eplb, SmallLoadChangeMovesFewSlots) {
  const ModelConfig c = Config(4, 896);
  const std::vector<int32_t> cap(8, 0);
  EplbOptions o;
  o.redundancy = 0.1;
  const auto load = ZipfLoad(c, 1.2, 5);
  auto first = EplbPlacement(c, Nodes(8), cap, load, nullptr, o, 1);
  ASSERT_TRUE(first.ok());
  std::mt19937 rng(9);
  std::uniform_real_distribution<double> change(0.95, 1.05);
  for (int round = 0; round < 3; ++round) {
    auto next_load = load;
    for (auto& l : next_load)
      for (double& v : l) v *= change(rng);
    auto next = EplbPlacement(c, Nodes(8), cap, next_load, &*first, o, 2);
    ASSERT_TRUE(next.ok());
    ExpectWellFormed(c, *next, "after a 5% change");
    int64_t total = 0;
    for (int32_t n = 0; n < 8; ++n) total += static_cast<int64_t>(next->SlotsOf(n).size());
    const int64_t moved = SlotsMoved(*first, *next);
    std::printf("5%% load change: %ld of %ld slots moved (%.1f%%), max/mean %.3f -> %.3f\n", static_cast<long>(moved),
                static_cast<long>(total), 100.0 * moved / total, NodeImbalance(*first, next_load), NodeImbalance(*next, next_load));
    EXPECT_LE(moved, total / 10);
    EXPECT_LE(NodeImbalance(*next, next_load), 1.05);
  }
}

TEST(Eplb, NodeJoiningAndLeaving) {
  const ModelConfig c = Config(2, 64);
  const auto load = ZipfLoad(c, 1.0, 3);
  EplbOptions o;
  auto three = EplbPlacement(c, Nodes(3), std::vector<int32_t>(3, 0), load, nullptr, o, 1);
  ASSERT_TRUE(three.ok());
  // A fourth node joins: it gets its share, the others keep most of theirs.
  auto four = EplbPlacement(c, Nodes(4), std::vector<int32_t>(4, 0), load, &*three, o, 2);
  ASSERT_TRUE(four.ok());
  ExpectWellFormed(c, *four, "joined");
  const int64_t joined_moved = SlotsMoved(*three, *four);
  EXPECT_GE(joined_moved, static_cast<int64_t>(four->SlotsOf(3).size()));
  EXPECT_LE(joined_moved, 2 * static_cast<int64_t>(four->SlotsOf(3).size()));
  // Node e1 leaves: only its experts (and a few swaps) move.
  std::vector<NodeInfo> left = {{"e0", "", ""}, {"e2", "", ""}, {"e3", "", ""}};
  auto after = EplbPlacement(c, left, std::vector<int32_t>(3, 0), load, &*four, o, 3);
  ASSERT_TRUE(after.ok());
  ExpectWellFormed(c, *after, "left");
  EXPECT_LE(SlotsMoved(*four, *after), 2 * static_cast<int64_t>(four->SlotsOf(1).size()));
  std::printf("64 experts x 2 layers: a 4th node joining moves %ld slots (it holds %zu); one leaving moves %ld\n",
              static_cast<long>(joined_moved), four->SlotsOf(3).size(), static_cast<long>(SlotsMoved(*four, *after)));
}

TEST(Eplb, CapacityBoundsTheSlotsAndIsChecked) {
  const ModelConfig c = Config(2, 16);
  EplbOptions o;
  o.redundancy = 0.5;
  // 10 slots over 2 layers: 5 per layer per node, 15 per layer in all (16 needed).
  auto t = EplbPlacement(c, Nodes(3), std::vector<int32_t>{10, 10, 0}, {}, nullptr, o, 1);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("--slots"), std::string::npos) << t.status();
  auto fits = EplbPlacement(c, Nodes(3), std::vector<int32_t>{12, 0, 20}, {}, nullptr, o, 1);
  ASSERT_TRUE(fits.ok()) << fits.status();
  ExpectWellFormed(c, *fits, "capacity");
  EXPECT_EQ(fits->SlotsOf(0).size(), 12u);
}

}  // namespace
}  // namespace k3::router

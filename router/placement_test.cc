#include "router/placement.h"

#include <gtest/gtest.h>

#include "tests/testing.h"

namespace k3::router {
namespace {

ModelConfig Config() {
  auto c = LoadModelConfig(testing::SourceDir() + "/tests/data/tiny-kimi-linear");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

std::vector<NodeInfo> Nodes(int n) {
  std::vector<NodeInfo> v;
  for (int i = 0; i < n; ++i) v.push_back({"e" + std::to_string(i), "127.0.0.1:" + std::to_string(9000 + i), ""});
  return v;
}

TEST(EvenPlacement, EveryExpertOnceAndBalanced) {
  const ModelConfig c = Config();
  for (int n : {1, 2, 3, 5, 16, 17}) {
    const PlacementTable t = EvenPlacement(c, Nodes(n), 7);
    EXPECT_TRUE(t.complete());
    int64_t slots = 0;
    for (int32_t node = 0; node < n; ++node) {
      const auto s = t.SlotsOf(node);
      slots += static_cast<int64_t>(s.size());
      // Per MoE layer a node gets floor or ceil of E/n experts.
      for (int64_t l = 0; l < c.num_layers; ++l) {
        if (c.mlp[l] != Mlp::kMoe) continue;
        const auto in_layer = std::count_if(s.begin(), s.end(), [&](const Slot& x) { return x.layer == l; });
        EXPECT_GE(in_layer, c.num_experts / n) << n << " nodes";
        EXPECT_LE(in_layer, (c.num_experts + n - 1) / n) << n << " nodes";
      }
    }
    EXPECT_EQ(slots, 3 * c.num_experts);  // three MoE layers, one replica each
  }
  EXPECT_FALSE(EvenPlacement(c, {}, 1).complete());
}

TEST(PlacementTable, ProtoRoundTripAndBadTables) {
  const ModelConfig c = Config();
  const PlacementTable t = EvenPlacement(c, Nodes(3), 4);
  v1::Placement p;
  t.ToProto(&p);
  EXPECT_TRUE(p.complete());
  auto back = PlacementTable::FromProto(p, c);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->version, 4u);
  EXPECT_EQ(back->replicas, t.replicas);

  v1::Placement bad = p;
  bad.mutable_layers(0)->set_layer(0);  // the dense layer
  EXPECT_NE(PlacementTable::FromProto(bad, c).status().message().find("is not a MoE layer"), std::string::npos);
  bad = p;
  bad.mutable_layers(0)->mutable_experts(3)->add_nodes(9);
  EXPECT_NE(PlacementTable::FromProto(bad, c).status().message().find("names node 9"), std::string::npos);
  bad = p;
  bad.mutable_layers(0)->mutable_experts()->RemoveLast();
  EXPECT_NE(PlacementTable::FromProto(bad, c).status().message().find("lists 15 experts"), std::string::npos);
}

}  // namespace
}  // namespace k3::router

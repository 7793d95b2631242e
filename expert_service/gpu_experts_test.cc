// An expert node's GPU experts against the CPU experts on the same slots.
#include "expert_service/gpu_experts.h"

#include <gtest/gtest.h>

#include <random>

#include "engine/model.h"
#include "kernels/cuda/testing.cuh"
#include "tests/mxfp4_testing.h"
#include "tests/testing.h"

namespace k3 {
namespace {

// bf16 weights, and MXFP4 ones: the GPU holds both exactly, so only activations round.
void ExpectMatchOnTheirSlots(const std::string& dir) {
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config();
  // This node holds the even experts of layers 1 and 3.
  std::set<std::pair<int32_t, int32_t>> slots;
  for (int32_t l : {1, 3})
    for (int32_t e = 0; e < c.num_experts; e += 2) slots.insert({l, e});
  auto gpu = GpuExperts::Load(c, *(*model)->weights().checkpoint, slots);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  LocalExpertExecutor cpu(c, (*model)->weights());
  const int64_t X = c.expert_width(), k = c.top_k;
  for (int64_t rows : {0, 1, 7, 64, 300}) {
    std::mt19937 rng(rows);
    auto x = testing::Random(rows * X, rows + 1);
    std::vector<int32_t> idx(rows * k);
    std::vector<float> w(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) {
      idx[i] = (i % 5 == 4) ? -1 : static_cast<int32_t>(2 * (rng() % (c.num_experts / 2)));  // some not routed here
      w[i] = 0.1f + 0.2f * static_cast<float>(rng() % 5);
    }
    std::vector<float> want(rows * X), got(rows * X);
    const ExpertRequest req{1, rows, X, k, x.data(), idx.data(), w.data()};
    ASSERT_TRUE(cpu.Run(req, want.data()).ok());
    ASSERT_TRUE((*gpu)->Run(req, got.data()).ok());
    EXPECT_LT(testing::RelDiff(got, want), 2e-2) << rows << " rows";  // bf16 activations and output
  }
  // A slot not held here is refused.
  std::vector<float> x(X, 1.0f), w(k, 1.0f), out(X);
  std::vector<int32_t> idx(k, 1);
  EXPECT_EQ((*gpu)->Run({1, 1, X, k, x.data(), idx.data(), w.data()}, out.data()).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(GpuExperts, MatchCpuExpertsOnTheirSlots) {
  REQUIRE_GPU();
  ExpectMatchOnTheirSlots(testing::SourceDir() + "/tests/data/tiny-kimi-linear-bf16");
}

TEST(GpuExperts, Mxfp4MatchCpuExpertsOnTheirSlots) {
  REQUIRE_GPU();
  ExpectMatchOnTheirSlots(
      testing::QuantizeExperts("k3_gpu_experts_mx", testing::SourceDir() + "/tests/data/tiny-kimi-linear-bf16", 64));
}

}  // namespace
}  // namespace k3

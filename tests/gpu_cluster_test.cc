// The disaggregated cluster with both pools on the GPU: attention nodes running the model in bf16
// (--device cuda, routed experts kept off the device) and expert nodes running their slots with the
// grouped GPU experts (--device cuda), over gRPC and UCX. Runs where a CUDA device is present.
#include <gtest/gtest.h>

#include <cstdlib>

#include "kernels/cuda/testing.cuh"
#include "tests/testing.h"
#include "tools/client.h"
#include "tools/golden.h"
#include "tools/local_cluster.h"

namespace k3 {
namespace {

TEST(GpuCluster, GoldenGreedyWithGpuAttentionAndExperts) {
  REQUIRE_GPU();
  const std::string model = testing::SourceDir() + "/tests/data/tiny-kimi-linear-bf16";
  ClusterOptions o;
  const char* bin = std::getenv("K3SERVE_BIN_DIR");  // where the binaries were carried to
  o.bin_dir = bin ? bin : K3SERVE_BIN_DIR;
  o.model = model;
  o.attention = 1;
  o.experts = 2;
  o.attention_args = {"--device=cuda", "--max-context=1024", "--max-running=8", "--max-batch-tokens=512"};
  o.expert_args = {"--device=cuda"};
  auto cluster = LocalCluster::Start(o, absl::Seconds(120));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto golden = LoadGolden(model);
  ASSERT_TRUE(golden.ok()) << golden.status();
  InferenceClient client((*cluster)->attention_addresses()[0]);
  for (size_t i = 0; i < golden->prompts.size(); ++i) {
    const auto& p = golden->prompts[i];
    SamplingParams sp;
    sp.max_new_tokens = static_cast<int32_t>(p.greedy_ids.size());
    sp.ignore_eos = true;
    auto r = client.Generate(p.input_ids, sp, absl::Seconds(60));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens, p.greedy_ids) << "prompt " << i;
  }
}

}  // namespace
}  // namespace k3

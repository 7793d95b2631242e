// The GPU model behind the engine: the scheduler drives it like the CPU model, and routed experts
// reached through the host (as an attention node reaches expert nodes) give the same tokens.
#include "engine/cuda/cuda_backend.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "engine/engine.h"
#include "engine/model.h"
#include "tests/testing.h"
#include "tools/golden.h"

#include "kernels/cuda/testing.cuh"

namespace k3::cuda {
namespace {

const std::string kModel = testing::SourceDir() + "/tests/data/tiny-kimi-linear-bf16";

// Every golden prompt at once through Engine::Step (prefill chunks and decodes mixed), greedy.
void ExpectGoldenThroughEngine(CudaModel& model) {
  auto golden = LoadGolden(kModel);
  ASSERT_TRUE(golden.ok()) << golden.status();
  CudaBackend backend(model);
  EngineOptions opt;
  opt.max_batch_tokens = 96;  // the 300-token prompt is prefilled in chunks beside the others' decodes
  opt.max_context = 512;
  Engine engine(backend, opt);
  for (size_t i = 0; i < golden->prompts.size(); ++i) {
    SamplingParams p;
    p.max_new_tokens = static_cast<int32_t>(golden->prompts[i].greedy_ids.size());
    p.ignore_eos = true;
    ASSERT_TRUE(engine.Add(i, golden->prompts[i].input_ids, p).ok());
  }
  std::map<uint64_t, std::vector<int32_t>> got;
  while (engine.HasWork())
    for (const StepOutput& o : engine.Step()) {
      ASSERT_NE(o.finish, FinishReason::kError) << o.error;
      got[o.id].insert(got[o.id].end(), o.tokens.begin(), o.tokens.end());
    }
  for (size_t i = 0; i < golden->prompts.size(); ++i) EXPECT_EQ(got[i], golden->prompts[i].greedy_ids) << "prompt " << i;
  EXPECT_EQ(engine.Stats().running, 0);
}

CudaModelOptions Options(bool routed_experts) {
  CudaModelOptions o;
  o.max_seqs = 8, o.max_context = 512, o.max_batch_tokens = 512;
  o.routed_experts = routed_experts;
  return o;
}

TEST(CudaBackend, EngineReproducesGoldenGreedy) {
  REQUIRE_GPU();
  auto model = CudaModel::Load(kModel, Options(true));
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectGoldenThroughEngine(**model);
}

// The attention node's arrangement: no routed experts on the device, rows bridged to a host
// executor (here the CPU experts in process; in the service, the dispatcher to expert nodes).
TEST(CudaBackend, RemoteExpertsThroughTheHost) {
  REQUIRE_GPU();
  auto model = CudaModel::Load(kModel, Options(false));
  ASSERT_TRUE(model.ok()) << model.status();
  // Without an executor the forward refuses rather than compute garbage.
  auto slot = (*model)->AllocSlot();
  ASSERT_TRUE(slot.ok());
  const std::vector<int32_t> one = {1};
  std::vector<float> logits;
  GpuChunk ch{*slot, one, LogitsMode::kLast};
  EXPECT_EQ((*model)->Forward({&ch, 1}, &logits).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*model)->FreeSlot(*slot).ok());

  auto cpu = Model::Load(kModel, WeightFilter::All());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  LocalExpertExecutor host((*cpu)->config(), (*cpu)->weights());
  HostExpertBridge bridge(host);
  (*model)->SetExpertExecutor(&bridge);
  ExpectGoldenThroughEngine(**model);
}

}  // namespace
}  // namespace k3::cuda

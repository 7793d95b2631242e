// Attention and experts in two processes on one GPU over CUDA IPC: an attention-only CudaModel whose routed
// experts run in an expert process (this test binary again, started by IpcRemoteExperts::Spawn) gives the
// monolithic CudaModel's logits and greedy ids bit for bit; a SIGKILLed expert process is UNAVAILABLE at the
// next forward, promptly, and the engine serves again with a new expert process.
#include "engine/cuda/ipc_experts.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <random>

#include "engine/cuda/test_configs.h"
#include "kernels/cuda/testing.cuh"

namespace k3::cuda {
namespace {

constexpr uint64_t kSeed = 7;
constexpr int64_t kRows = 256;

std::vector<int32_t> RandomTokens(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 1000);
  return t;
}

CudaModelOptions Options(bool routed_experts) {
  CudaModelOptions o;
  o.max_seqs = 4, o.max_context = 256, o.max_batch_tokens = kRows, o.routed_experts = routed_experts;
  return o;
}

std::unique_ptr<CudaModel> Create(bool routed_experts) {
  auto config = ParseModelConfig(kKimiLinearLike);
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok()) return nullptr;
  auto m = CudaModel::CreateRandom(*config, kSeed, Options(routed_experts));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

std::unique_ptr<IpcRemoteExperts> SpawnExperts(const ModelConfig& config, bool attention_host_waits = true,
                                               bool expert_host_waits = true) {
  IpcModelSpec spec;
  spec.config_json = kKimiLinearLike, spec.seed = kSeed;
  IpcOptions o;
  o.max_rows = kRows, o.setup_timeout = absl::Seconds(120), o.dispatch_timeout = absl::Seconds(5);
  o.attention_host_waits = attention_host_waits, o.expert_host_waits = expert_host_waits;
  auto r = IpcRemoteExperts::Spawn(config, spec, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

// Prefill of three sequences (T 1, 17, 70) with every row's logits, then greedy decode steps: the logits and
// ids of each forward, in order.
struct Trace {
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<int32_t>> ids;
};
Trace Decode(CudaModel& m, int steps) {
  Trace t;
  std::vector<std::vector<int32_t>> prompts = {RandomTokens(1, 1), RandomTokens(17, 2), RandomTokens(70, 3)};
  std::vector<int32_t> slots;
  std::vector<GpuChunk> chunks;
  for (auto& p : prompts) {
    auto s = m.AllocSlot();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return t;
    slots.push_back(*s);
    chunks.push_back({*s, p, LogitsMode::kAll});
  }
  t.logits.emplace_back();
  EXPECT_TRUE(m.Forward(chunks, &t.logits.back()).ok());
  std::vector<int32_t> next = {11, 22, 33};
  for (int i = 0; i < steps; ++i) {
    chunks.clear();
    for (size_t s = 0; s < slots.size(); ++s) chunks.push_back({slots[s], {&next[s], 1}, LogitsMode::kLast});
    if (i % 2 == 0) {  // both paths: logits to the host, and greedy ids on the device
      t.logits.emplace_back();
      EXPECT_TRUE(m.Forward(chunks, &t.logits.back()).ok());
    }
    std::vector<int32_t> ids;
    EXPECT_TRUE(m.ForwardGreedy(chunks, &ids).ok());
    t.ids.push_back(ids);
    next = ids;
  }
  for (int32_t s : slots) EXPECT_TRUE(m.FreeSlot(s).ok());
  return t;
}

TEST(IpcExperts, MatchesMonolithicBitForBit) {
  REQUIRE_GPU();
  auto mono = Create(true);
  auto attention = Create(false);
  ASSERT_TRUE(mono && attention);
  const Trace want = Decode(*mono, 6);
  for (int mode = 0; mode < 4; ++mode) {  // each side waits on its host or on the GPU
    const bool attention_host = mode & 1, expert_host = mode & 2;
    SCOPED_TRACE(::testing::Message() << "attention host waits " << attention_host << ", expert host waits "
                                      << expert_host);
    auto experts = SpawnExperts(attention->config(), attention_host, expert_host);
    ASSERT_TRUE(experts);
    attention->SetExpertExecutor(experts.get());
    experts->SetTiming(true);
    const Trace got = Decode(*attention, 6);
    ASSERT_EQ(got.logits.size(), want.logits.size());
    for (size_t i = 0; i < want.logits.size(); ++i) {
      ASSERT_EQ(got.logits[i].size(), want.logits[i].size()) << "forward " << i;
      EXPECT_EQ(0, std::memcmp(got.logits[i].data(), want.logits[i].data(), want.logits[i].size() * sizeof(float)))
          << "logits of forward " << i << " differ";
    }
    EXPECT_EQ(got.ids, want.ids);

    // Every dispatch was timed on both sides: 1 prefill + 3 + 6 decode forwards, at each of the two MoE layers.
    auto stats = experts->TakeStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_EQ(stats->size(), 2u);
    for (const auto& [layer, s] : *stats) {
      EXPECT_EQ(s.dispatches, 10) << "layer " << layer;
      EXPECT_GT(s.expert_ms, 0) << "layer " << layer;
      EXPECT_GT(s.round_trip_ms, 0) << "layer " << layer;
      EXPECT_GE(s.wait_ms, s.expert_ms * 0.5) << "layer " << layer;  // the attention stream saw the experts' time
    }

    // A request of another shape is refused before anything is sent; the link stays up.
    CudaExpertRequest bad{1, 4, attention->config().expert_width() + 1, attention->config().top_k, {}, nullptr,
                          nullptr};
    bad.x.ld = bad.width;
    const absl::Status refused = experts->Run(bad, nullptr, nullptr);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_TRUE(experts->status().ok());
    attention->SetExpertExecutor(nullptr);
  }
}

TEST(IpcExperts, KilledExpertProcessIsUnavailableAndReplaced) {
  REQUIRE_GPU();
  auto mono = Create(true);
  auto attention = Create(false);
  ASSERT_TRUE(mono && attention);
  auto experts = SpawnExperts(attention->config());
  ASSERT_TRUE(experts);
  attention->SetExpertExecutor(experts.get());
  const std::vector<int32_t> prompt = RandomTokens(40, 9);
  auto slot = attention->AllocSlot();
  ASSERT_TRUE(slot.ok());
  std::vector<int32_t> ids;
  const GpuChunk chunk{*slot, prompt, LogitsMode::kLast};
  ASSERT_TRUE(attention->ForwardGreedy({&chunk, 1}, &ids).ok());

  ASSERT_EQ(kill(experts->pid(), SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const GpuChunk step{*slot, {&ids[0], 1}, LogitsMode::kLast};
  std::vector<int32_t> lost;
  const absl::Status s = attention->ForwardGreedy({&step, 1}, &lost);
  const double s_taken = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(experts->peer()), std::string::npos) << s;
  EXPECT_LT(s_taken, 6.0);  // the dispatch timeout (5 s) and a margin; EOF is usually seen at once
  EXPECT_EQ(experts->status().code(), absl::StatusCode::kUnavailable);
  std::printf("SIGKILL of %s seen in %.1f ms: %s\n", experts->peer().c_str(), s_taken * 1e3,
              std::string(s.message()).c_str());

  // The engine serves again with a new expert process: a new sequence as the monolithic model decodes it.
  ASSERT_TRUE(attention->FreeSlot(*slot).ok());
  auto replacement = SpawnExperts(attention->config());
  ASSERT_TRUE(replacement);
  attention->SetExpertExecutor(replacement.get());
  std::vector<int32_t> want, got;
  for (CudaModel* m : {mono.get(), attention.get()}) {
    auto sl = m->AllocSlot();
    ASSERT_TRUE(sl.ok());
    const GpuChunk c{*sl, prompt, LogitsMode::kLast};
    std::vector<int32_t> out;
    ASSERT_TRUE(m->ForwardGreedy({&c, 1}, &out).ok());
    for (int i = 0; i < 4; ++i) {
      const GpuChunk d{*sl, {&out.back(), 1}, LogitsMode::kLast};
      std::vector<int32_t> next;
      ASSERT_TRUE(m->ForwardGreedy({&d, 1}, &next).ok());
      out.push_back(next[0]);
    }
    (m == mono.get() ? want : got) = out;
  }
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace k3::cuda

// The test binary is also the expert process that IpcRemoteExperts::Spawn starts.
int main(int argc, char** argv) {
  if (const int rc = k3::cuda::ServeIpcExpertsIfChild(); rc >= 0) return rc;
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

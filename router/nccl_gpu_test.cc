// The NCCL data plane on two GPUs of one host (label "gpu"; every case skips with fewer): an
// attention engine on GPU 0 whose routed experts are a k3serve-nccl-expert process on GPU 1.
#include "router/nccl_transport.h"

#include <csignal>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "tests/testing.h"
#include "tools/local_cluster.h"

namespace k3::dataplane {
namespace {

using cuda::CudaModel;
using cuda::CudaModelOptions;
using cuda::GpuChunk;

#define REQUIRE_TWO_GPUS()                                                                        \
  do {                                                                                            \
    int n_ = 0;                                                                                   \
    if (cudaGetDeviceCount(&n_) != cudaSuccess || n_ < 2) GTEST_SKIP() << "needs two CUDA devices"; \
  } while (0)

std::string Golden() { return testing::SourceDir() + "/tests/data/tiny-kimi-linear-bf16"; }

// A k3serve-nccl-expert on GPU 1 and its NcclBootstrap address (read from its log).
struct Expert {
  std::unique_ptr<Process> process;
  std::string address;
};

Expert StartExpert(const std::string& name) {
  const std::string log = (std::filesystem::temp_directory_path() / ("k3_nccl_" + name + ".log")).string();
  std::filesystem::remove(log);
  auto p = Process::Spawn(name,
                          {K3SERVE_NCCL_EXPERT, "--model", Golden(), "--device", "1", "--node_id", name,
                           "--max_rows", "1024", "--dispatch_timeout_ms", "3000"},
                          log);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return {};
  Expert e{std::move(*p), ""};
  for (int i = 0; i < 600 && e.address.empty() && e.process->alive(); ++i) {
    std::ifstream in(log);
    for (std::string line; std::getline(in, line);)
      if (line.rfind("listening on ", 0) == 0) e.address = line.substr(13);
    if (e.address.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_FALSE(e.address.empty()) << name << " did not start; see " << log;
  return e;
}

std::unique_ptr<CudaModel> Load(bool routed_experts) {
  CudaModelOptions opt;
  opt.device = 0;
  opt.max_seqs = 8;
  opt.max_context = 512;
  opt.max_batch_tokens = 1024;
  opt.routed_experts = routed_experts;
  auto m = CudaModel::Load(Golden(), opt);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

std::vector<std::vector<int32_t>> Prompts(int64_t vocab) {
  std::vector<std::vector<int32_t>> p = {{1}, {}, {}};
  for (int i = 0; i < 17; ++i) p[1].push_back((7 * i + 3) % vocab);
  for (int i = 0; i < 70; ++i) p[2].push_back((13 * i + 5) % vocab);
  return p;
}

// The prompts prefilled together, then `steps` greedy decode steps of all of them together: the ids
// of every step (the prefill's first).
absl::StatusOr<std::vector<std::vector<int32_t>>> Generate(CudaModel& m, const std::vector<std::vector<int32_t>>& prompts,
                                                          int steps) {
  std::vector<int32_t> slots;
  for (size_t i = 0; i < prompts.size(); ++i) {
    K3_ASSIGN_OR_RETURN(int32_t s, m.AllocSlot());
    slots.push_back(s);
  }
  std::vector<std::vector<int32_t>> out;
  std::vector<GpuChunk> chunks;
  for (size_t i = 0; i < prompts.size(); ++i) chunks.push_back({slots[i], prompts[i], LogitsMode::kLast});
  std::vector<int32_t> ids;
  absl::Status st = m.ForwardGreedy(chunks, &ids);
  for (int t = 0; st.ok() && t < steps; ++t) {
    out.push_back(ids);
    std::vector<int32_t> next = ids;
    chunks.clear();
    for (size_t i = 0; i < prompts.size(); ++i) chunks.push_back({slots[i], std::span(&next[i], 1), LogitsMode::kLast});
    st = m.ForwardGreedy(chunks, &ids);
  }
  if (st.ok()) out.push_back(ids);
  for (int32_t s : slots) m.FreeSlot(s).IgnoreError();
  K3_RETURN_IF_ERROR(st);
  return out;
}

TEST(NcclGpu, GreedyIdsEqualMonolithic) {
  REQUIRE_TWO_GPUS();
  Expert expert = StartExpert("nccl-expert-greedy");
  ASSERT_FALSE(expert.address.empty());
  auto mono = Load(true);
  auto attn = Load(false);
  ASSERT_TRUE(mono && attn);
  auto remote = NcclRemoteExperts::Connect(attn->config(), expert.address, 0);
  ASSERT_TRUE(remote.ok()) << remote.status();
  attn->SetExpertExecutor(remote->get());
  const auto prompts = Prompts(mono->config().vocab_size);
  auto want = Generate(*mono, prompts, 24);
  ASSERT_TRUE(want.ok()) << want.status();
  auto got = Generate(*attn, prompts, 24);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*remote)->status().ok()) << (*remote)->status();
  EXPECT_EQ(*got, *want);
  // Each sequence alone too (other row counts per dispatch).
  for (const auto& p : prompts) {
    auto a = Generate(*mono, {p}, 8);
    auto b = Generate(*attn, {p}, 8);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b);
  }
  auto stats = (*remote)->TakeExpertStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GT(stats->dispatches, 0);
  EXPECT_GT(stats->experts_ms, 0);
  attn->SetExpertExecutor(nullptr);
}

TEST(NcclGpu, SigkillOfTheExpertIsUnavailableThenServingResumes) {
  REQUIRE_TWO_GPUS();
  const absl::Duration timeout = absl::Seconds(3);
  Expert first = StartExpert("nccl-expert-a");
  ASSERT_FALSE(first.address.empty());
  auto mono = Load(true);
  auto attn = Load(false);
  ASSERT_TRUE(mono && attn);
  NcclOptions opt;
  opt.dispatch_timeout = timeout;
  auto remote = NcclRemoteExperts::Connect(attn->config(), first.address, 0, opt);
  ASSERT_TRUE(remote.ok()) << remote.status();
  attn->SetExpertExecutor(remote->get());
  const auto prompts = Prompts(attn->config().vocab_size);
  ASSERT_TRUE(Generate(*attn, prompts, 2).ok());

  // Steps until one fails after the SIGKILL: none hangs, and the failure is UNAVAILABLE within the
  // dispatch timeout (the broken control stream usually tells at once).
  std::vector<int32_t> slots;
  for (size_t i = 0; i < prompts.size(); ++i) slots.push_back(*attn->AllocSlot());
  std::vector<GpuChunk> chunks;
  for (size_t i = 0; i < prompts.size(); ++i) chunks.push_back({slots[i], prompts[i], LogitsMode::kLast});
  std::vector<int32_t> ids;
  ASSERT_TRUE(attn->ForwardGreedy(chunks, &ids).ok());
  first.process->Signal(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  absl::Status failed;
  for (int t = 0; t < 1000 && failed.ok(); ++t) {
    std::vector<int32_t> next = ids;
    chunks.clear();
    for (size_t i = 0; i < prompts.size(); ++i) chunks.push_back({slots[i], std::span(&next[i], 1), LogitsMode::kLast});
    failed = attn->ForwardGreedy(chunks, &ids);
    if (failed.ok()) failed = (*remote)->status();  // the step in flight when the link failed is lost too
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_LT(seconds, absl::ToDoubleSeconds(timeout) + 1.0) << failed;
  // Later dispatches fail at once.
  EXPECT_EQ(Generate(*attn, prompts, 1).status().code(), absl::StatusCode::kUnavailable);
  for (int32_t s : slots) ASSERT_TRUE(attn->FreeSlot(s).ok());

  // A replacement: new sequences are served again, with the monolithic ids.
  Expert second = StartExpert("nccl-expert-b");
  ASSERT_FALSE(second.address.empty());
  attn->SetExpertExecutor(nullptr);
  remote->reset();
  auto again = NcclRemoteExperts::Connect(attn->config(), second.address, 0, opt);
  ASSERT_TRUE(again.ok()) << again.status();
  attn->SetExpertExecutor(again->get());
  auto want = Generate(*mono, prompts, 8);
  auto got = Generate(*attn, prompts, 8);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status();
  EXPECT_EQ(*got, *want);
  attn->SetExpertExecutor(nullptr);
}

// A request the expert node would refuse fails here, before anything is sent, and leaves the link up;
// one node serves several sessions.
TEST(NcclGpu, OversizedRequestIsRefusedAndNodesServeSeveralSessions) {
  REQUIRE_TWO_GPUS();
  Expert expert = StartExpert("nccl-expert-refuse");
  ASSERT_FALSE(expert.address.empty());
  auto attn = Load(false);
  ASSERT_TRUE(attn);
  auto remote = NcclRemoteExperts::Connect(attn->config(), expert.address, 0);
  ASSERT_TRUE(remote.ok()) << remote.status();
  // More rows than the node takes: refused here, before anything is sent.
  cuda::CudaExpertRequest r;
  r.layer = 1, r.rows = (*remote)->max_rows() + 1, r.width = attn->config().expert_width(),
  r.top_k = attn->config().top_k;
  r.x = cuda::Split{nullptr, r.width, 1};
  EXPECT_EQ((*remote)->Run(r, nullptr, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*remote)->status().ok());
  auto other = NcclRemoteExperts::Connect(attn->config(), expert.address, 0);
  ASSERT_TRUE(other.ok()) << other.status();
  attn->SetExpertExecutor(other->get());
  EXPECT_TRUE(Generate(*attn, Prompts(attn->config().vocab_size), 2).ok());
  attn->SetExpertExecutor(nullptr);
}

}  // namespace
}  // namespace k3::dataplane

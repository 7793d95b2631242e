// Disaggregated serving with real processes on loopback: router, expert nodes and attention nodes
// started from their binaries, driven over gRPC, observed through /metrics.
#include <gtest/gtest.h>
#include <signal.h>

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "absl/time/clock.h"
#include "engine/engine.h"
#include "tests/cluster_testing.h"
#include "tests/testing.h"
#include "tools/client.h"
#include "tools/golden.h"
#include "tools/http_get.h"
#include "tools/local_cluster.h"

namespace k3 {
namespace {

using testing::Greedy;
using testing::TinyCluster;

double Live(int metrics_port) {
  auto m = HttpGet("127.0.0.1", metrics_port, "/metrics");
  if (!m.ok()) return -1;
  return MetricValue(*m, "k3serve_running_requests") + MetricValue(*m, "k3serve_waiting_requests");
}

// Router + 1 attention + 2 expert nodes reproduce every golden greedy continuation.
TEST(Cluster, GoldenContinuationsOneAttentionTwoExperts) {
  auto cluster = LocalCluster::Start(TinyCluster(1, 2));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto golden = LoadGolden(testing::TinyModel());
  ASSERT_TRUE(golden.ok()) << golden.status();
  InferenceClient client((*cluster)->attention_addresses()[0]);
  for (size_t i = 0; i < golden->prompts.size(); ++i) {
    const auto& p = golden->prompts[i];
    auto r = client.Generate(p.input_ids, Greedy(static_cast<int>(p.greedy_ids.size())), absl::Seconds(60));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens, p.greedy_ids) << "prompt " << i;
    EXPECT_EQ(r->finish_reason, "length");
    EXPECT_EQ(r->prompt_tokens, static_cast<int>(p.input_ids.size()));
    EXPECT_EQ(r->completion_tokens, static_cast<int>(p.greedy_ids.size()));
  }
}

// 2 attention + 3 expert nodes, 16 concurrent streams: each gets its golden continuation.
TEST(Cluster, SixteenConcurrentStreamsTwoAttentionThreeExperts) {
  auto cluster = LocalCluster::Start(TinyCluster(2, 3));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto golden = LoadGolden(testing::TinyModel());
  ASSERT_TRUE(golden.ok());
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<GenerateResult>> results(16, absl::UnknownError("not run"));
  for (int i = 0; i < 16; ++i)
    threads.emplace_back([&, i] {
      const auto& p = golden->prompts[i % golden->prompts.size()];
      InferenceClient client((*cluster)->attention_addresses()[i % 2]);
      results[i] = client.Generate(p.input_ids, Greedy(static_cast<int>(p.greedy_ids.size())), absl::Seconds(120));
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(results[i].ok()) << "stream " << i << ": " << results[i].status();
    EXPECT_EQ(results[i]->tokens, golden->prompts[i % golden->prompts.size()].greedy_ids) << "stream " << i;
  }
}

// SIGKILL of an expert node mid-stream: the stream ends with UNAVAILABLE (or finishes) within its
// deadline, the attention node stays up, and once the router has re-placed the dead node's experts
// the next request succeeds.
TEST(Cluster, ExpertKilledMidStream) {
  auto cluster = LocalCluster::Start(TinyCluster(1, 2));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InferenceClient client((*cluster)->attention_addresses()[0]);
  std::atomic<int> seen{0};
  absl::StatusOr<GenerateResult> r;
  std::thread stream([&] {
    r = client.Generate({1, 5, 77}, Greedy(3000), absl::Seconds(30), [&](const std::vector<int32_t>& c) { seen += c.size(); });
  });
  while (seen < 20) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const absl::Time killed = absl::Now();
  (*cluster)->expert(0).Signal(SIGKILL);
  stream.join();
  const absl::Duration took = absl::Now() - killed;
  if (!r.ok()) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  }
  EXPECT_LT(took, absl::Seconds(30));
  EXPECT_TRUE((*cluster)->attention(0).alive());
  // The router drops the node (its watch stream broke) and re-places its experts.
  auto golden = LoadGolden(testing::TinyModel());
  ASSERT_TRUE(golden.ok());
  const auto& p = golden->prompts[1];
  absl::StatusOr<GenerateResult> after = absl::UnknownError("not run");
  for (int attempt = 0; attempt < 100; ++attempt) {
    after = client.Generate(p.input_ids, Greedy(24), absl::Seconds(30));
    if (after.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->tokens, p.greedy_ids);
}

// Bad requests get INVALID_ARGUMENT naming the field; a full queue RESOURCE_EXHAUSTED; a
// cancelled stream frees its sequence.
TEST(Cluster, BadRequestsFullQueueAndCancellation) {
  ClusterOptions o = TinyCluster(1, 1);
  o.attention_args = {"--max-running=1", "--max-waiting=1", "--max-tokens-limit=60000", "--max-context=65536"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string addr = (*cluster)->attention_addresses()[0];
  const int metrics = (*cluster)->attention_metrics_ports()[0];
  InferenceClient client(addr);
  auto expect = [&](std::vector<int32_t> prompt, SamplingParams p, const std::string& model, absl::StatusCode code,
                    const std::string& text) {
    auto r = client.Generate(prompt, p, absl::Seconds(10), nullptr, model);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status();
  };
  const auto inv = absl::StatusCode::kInvalidArgument;
  expect({}, Greedy(4), "", inv, "prompt_ids must not be empty");
  expect({1, 512}, Greedy(4), "", inv, "prompt_ids[1] = 512 is outside the vocabulary");
  expect({1}, Greedy(0), "", inv, "max_tokens must be > 0");
  expect({1}, Greedy(60001), "", inv, "max_tokens = 60001 exceeds the limit 60000");
  expect(std::vector<int32_t>(65536, 3), Greedy(1), "", inv, "context limit is 65536");
  expect({1}, Greedy(4), "no-such-model", inv, "model: unknown model \"no-such-model\"");
  SamplingParams bad = Greedy(4);
  bad.temperature = -0.5f;
  expect({1}, bad, "", inv, "temperature");
  bad = Greedy(4);
  bad.top_p = 1.5f;
  expect({1}, bad, "", inv, "top_p");
  bad = Greedy(4);
  bad.top_k = -1;
  expect({1}, bad, "", inv, "top_k");

  // One running (for a minute unless cancelled), one waiting; the third does not fit.
  // The second starts only once the first streams: a sequence admitted but not yet stepped
  // counts as waiting, so two requests racing in could see each other as the full queue.
  grpc::ClientContext c1, c2;
  auto req = MakeGenerateRequest({1, 5, 77}, Greedy(60000));
  auto s1 = client.stub().Generate(&c1, req);
  k3serve::v1::GenerateResponse resp;
  ASSERT_TRUE(s1->Read(&resp)) << s1->Finish().error_message();  // running
  auto s2 = client.stub().Generate(&c2, req);
  for (int i = 0; i < 1000 && Live(metrics) < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(Live(metrics), 2) << HttpGet("127.0.0.1", metrics, "/metrics").value_or("");
  expect({1}, Greedy(4), "", absl::StatusCode::kResourceExhausted, "queue full");
  // Cancelling both streams frees their sequences.
  c1.TryCancel();
  c2.TryCancel();
  s1->Finish();
  s2->Finish();
  double live = -1;
  for (int i = 0; i < 1000; ++i) {
    live = Live(metrics);
    if (live == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(live, 0);
  auto ok = client.Generate({1, 5, 77}, Greedy(4), absl::Seconds(10));
  EXPECT_TRUE(ok.ok()) << ok.status();
}

// Health is NOT_SERVING until the placement is complete; nodes re-register after a router restart.
TEST(Cluster, HealthFollowsPlacementAndRouterRestart) {
  ClusterOptions o = TinyCluster(1, 0);
  o.experts = 0;
  // Start with no expert nodes: the attention node loads but must not serve.
  auto cluster = LocalCluster::Start(o, absl::Seconds(2));
  ASSERT_FALSE(cluster.ok());
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kDeadlineExceeded) << cluster.status();

  // The same by hand, keeping the processes: NOT_SERVING, then SERVING once an expert joins.
  struct Hold {
    std::unique_ptr<LocalCluster> c;
  };
  o.experts = 1;
  auto full = LocalCluster::Start(o);
  ASSERT_TRUE(full.ok()) << full.status();
  const std::string addr = (*full)->attention_addresses()[0];
  EXPECT_TRUE(*IsServing(addr, absl::Seconds(2)));
  (*full)->expert(0).Signal(SIGKILL);
  bool serving = true;
  for (int i = 0; i < 100 && serving; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    serving = IsServing(addr, absl::Seconds(1)).value_or(true);
  }
  EXPECT_FALSE(serving) << "attention node still SERVING without experts";
  ASSERT_TRUE((*full)->AddExpert().ok());
  EXPECT_TRUE((*full)->WaitServing(absl::Seconds(20)).ok());

  // Router restart: the nodes register again and requests keep working.
  ASSERT_TRUE((*full)->RestartRouter().ok());
  InferenceClient client(addr);
  absl::StatusOr<GenerateResult> r = absl::UnknownError("not run");
  for (int i = 0; i < 100; ++i) {
    auto p = HttpGet("127.0.0.1", (*full)->router_metrics_port(), "/metrics");
    if (p.ok() && MetricValue(*p, "k3serve_placement_version") > 0 && MetricValue(*p, "k3serve_router_expert_nodes") == 1) {
      r = client.Generate({1, 5, 77}, Greedy(8), absl::Seconds(10));
      if (r.ok()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(r.ok()) << r.status();
}

// A K3 model written by k3serve-mkmodel (Block AttnRes, gated MLA, Stable LatentMoE with SiTU:
// the latent rows, not the hidden state, cross the data plane) served disaggregated gives what
// the in-process engine gives.
TEST(Cluster, ServesAnMkmodelK3Model) {
  const std::string dir = ::testing::TempDir() + "/k3_cluster_tiny_k3";
  std::filesystem::remove_all(dir);
  const std::string mk = std::string(K3SERVE_BIN_DIR) + "/k3serve-mkmodel --config " + testing::SourceDir() +
                         "/tools/configs/tiny-k3.json --out " + dir + " --seed 3 > /dev/null";
  ASSERT_EQ(std::system(mk.c_str()), 0);
  ClusterOptions o = TinyCluster(1, 2);
  o.model = dir;
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  InferenceClient client((*cluster)->attention_addresses()[0]);
  for (const std::vector<int32_t>& prompt : {std::vector<int32_t>{1}, {1, 5, 77, 300, 12, 9, 450, 33, 2, 101}}) {
    auto want = GenerateGreedy(**model, prompt, 20);
    ASSERT_TRUE(want.ok());
    auto got = client.Generate(prompt, Greedy(20), absl::Seconds(30));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tokens, *want);
  }
  std::filesystem::remove_all(dir);
}

// A K3 model in the released layout with MXFP4 experts (written by k3serve-mkmodel; experts 64
// wide, so that the group of 32 divides them): the expert nodes keep their slots packed and the
// cluster gives what the in-process engine gives.
TEST(Cluster, ServesAnMxfp4K3ModelInTheReleaseLayout) {
  const std::string dir = ::testing::TempDir() + "/k3_cluster_mxfp4";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "_config");
  const std::string config = dir + "_config/config.json";
  ASSERT_EQ(std::system(("sed 's/\"moe_intermediate_size\": 48/\"moe_intermediate_size\": 64/' " + testing::SourceDir() +
                         "/tools/configs/tiny-k3.json > " + config).c_str()),
            0);
  const std::string mk = std::string(K3SERVE_BIN_DIR) + "/k3serve-mkmodel --config " + config + " --out " + dir +
                         " --seed 3 --experts-dtype mxfp4 --layout k3-release > /dev/null";
  ASSERT_EQ(std::system(mk.c_str()), 0);
  ClusterOptions o = TinyCluster(1, 2);
  o.model = dir;
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ((*model)->config().expert_format, ExpertFormat::kMxfp4);
  ASSERT_EQ((*model)->config().moe_intermediate_size, 64);
  InferenceClient client((*cluster)->attention_addresses()[0]);
  for (const std::vector<int32_t>& prompt : {std::vector<int32_t>{1}, {1, 5, 77, 300, 12, 9, 450, 33, 2, 101}}) {
    auto want = GenerateGreedy(**model, prompt, 20);
    ASSERT_TRUE(want.ok());
    auto got = client.Generate(prompt, Greedy(20), absl::Seconds(30));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tokens, *want);
  }
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir + "_config");
}

// The Python client (Debian's python3-grpcio) gets the same tokens as the C++ one.
TEST(Cluster, PythonClient) {
  auto cluster = LocalCluster::Start(TinyCluster(1, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string cmd = "/usr/bin/python3 " + testing::SourceDir() + "/tools/python/k3serve_client.py --addr " +
                          (*cluster)->attention_addresses()[0] + " --prompt-ids 1,5,77,300 --max-tokens 16 --ignore-eos 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), p)) out += buf;
  EXPECT_EQ(::pclose(p), 0) << out;
  InferenceClient client((*cluster)->attention_addresses()[0]);
  auto r = client.Generate({1, 5, 77, 300}, Greedy(16), absl::Seconds(10));
  ASSERT_TRUE(r.ok());
  std::string want = "tokens:";
  for (int32_t t : r->tokens) want += " " + std::to_string(t);
  EXPECT_NE(out.find(want + "\n"), std::string::npos) << out;
  EXPECT_NE(out.find("finish: FINISH_REASON_LENGTH; prompt_tokens=4 completion_tokens=16"), std::string::npos) << out;
}

}  // namespace
}  // namespace k3

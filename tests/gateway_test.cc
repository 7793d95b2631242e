// The gateway and the attention node's drain, with real processes: router, expert and attention
// nodes, and k3serve-gateway in front.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/time/clock.h"
#include "common/tls.h"
#include "tests/cluster_testing.h"
#include "tests/load_loop.h"
#include "tests/testing.h"
#include "tools/client.h"
#include "tools/golden.h"
#include "tools/http_get.h"
#include "tools/local_cluster.h"

namespace k3 {
namespace {

using testing::Greedy;
using testing::TinyCluster;

// The tiny cluster behind a gateway.
ClusterOptions Options(int attention, int experts) {
  ClusterOptions o = TinyCluster(attention, experts);
  o.gateway = true;
  return o;
}

double Metric(int port, const std::string& name, const std::string& filter = "") {
  auto m = HttpGet("127.0.0.1", port, "/metrics");
  return m.ok() ? MetricValue(*m, name, filter) : -1;
}

double Live(int port) { return Metric(port, "k3serve_running_requests") + Metric(port, "k3serve_waiting_requests"); }

std::string ReadLog(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<testing::Prompt> GoldenPrompts() {
  auto golden = LoadGolden(testing::TinyModel());
  EXPECT_TRUE(golden.ok()) << golden.status();
  return golden.ok() ? testing::GoldenPrompts(*golden) : std::vector<testing::Prompt>{};
}

// Streams through the gateway get the golden continuations, spread over both attention nodes (two
// multiplexed calls to each); GetModelInfo and Abort pass through.
TEST(Gateway, ForwardsSpreadsAndAborts) {
  ClusterOptions o = Options(2, 1);
  o.gateway_args = {"--connections=2"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const auto prompts = GoldenPrompts();
  ASSERT_FALSE(prompts.empty());
  const std::string gw = (*cluster)->gateway_address();
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<GenerateResult>> results(8, absl::UnknownError("not run"));
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      InferenceClient client(gw);
      const auto& p = prompts[i % prompts.size()];
      results[i] = client.Generate(p.ids, Greedy(static_cast<int>(p.expected.size())), absl::Seconds(60));
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    EXPECT_EQ(results[i]->tokens, prompts[i % prompts.size()].expected) << i;
  }
  for (int port : (*cluster)->attention_metrics_ports())
    EXPECT_GT(Metric(port, "k3serve_requests_total", "code=\"OK\""), 0) << "a node got no stream";
  EXPECT_EQ(Metric((*cluster)->gateway_metrics_port(), "k3serve_gateway_requests_total", "code=\"OK\""), 8);

  InferenceClient client(gw);
  {
    grpc::ClientContext ctx;
    k3serve::v1::ModelInfo info;
    ASSERT_TRUE(client.stub().GetModelInfo(&ctx, k3serve::v1::GetModelInfoRequest(), &info).ok());
    EXPECT_EQ(info.name(), "tiny-kimi-linear");
  }
  std::atomic<int> seen{0};
  absl::StatusOr<GenerateResult> aborted;
  std::thread stream([&] {
    aborted = client.Generate({1, 5, 77}, Greedy(3000), absl::Seconds(60),
                              [&](const std::vector<int32_t>& c) { seen += c.size(); }, "", "abort-me");
  });
  while (seen < 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  grpc::ClientContext ctx;
  k3serve::v1::AbortRequest req;
  req.set_request_id("abort-me");
  k3serve::v1::AbortResponse resp;
  ASSERT_TRUE(client.stub().Abort(&ctx, req, &resp).ok());
  EXPECT_TRUE(resp.found());
  stream.join();
  ASSERT_FALSE(aborted.ok());
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kCancelled) << aborted.status();
}

// A node that fails before a request's first token: the request goes to the other node. One that
// fails after it: the client gets UNAVAILABLE naming the node.
TEST(Gateway, RetriesBeforeTheFirstTokenAndNamesTheNodeAfter) {
  auto cluster = LocalCluster::Start(Options(2, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const auto prompts = GoldenPrompts();
  const std::string gw = (*cluster)->gateway_address();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // both nodes' health watched
  // attention-0 stops answering (its connections and health stay up), then dies: the request the
  // gateway gave it has no token yet.
  (*cluster)->attention(0).Signal(SIGSTOP);
  std::vector<std::thread> threads;
  std::vector<absl::StatusOr<GenerateResult>> results(2, absl::UnknownError("not run"));
  for (int i = 0; i < 2; ++i)
    threads.emplace_back([&, i] {
      InferenceClient client(gw);
      results[i] = client.Generate(prompts[i].ids, Greedy(static_cast<int>(prompts[i].expected.size())), absl::Seconds(60));
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  (*cluster)->attention(0).Signal(SIGKILL);
  for (auto& t : threads) t.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    EXPECT_EQ(results[i]->tokens, prompts[i].expected);
  }
  EXPECT_GE(Metric((*cluster)->gateway_metrics_port(), "k3serve_gateway_retries_total"), 1);

  InferenceClient client(gw);
  std::atomic<int> seen{0};
  absl::StatusOr<GenerateResult> r;
  std::thread stream([&] {
    r = client.Generate({1, 5, 77}, Greedy(3000), absl::Seconds(60), [&](const std::vector<int32_t>& c) { seen += c.size(); });
  });
  while (seen < 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  (*cluster)->attention(1).Signal(SIGKILL);
  stream.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("attention node attention-1"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("after the first token"), std::string::npos) << r.status();
}

// Over TLS, the client's API key reaches the node (the gateway here checks none; the node does),
// and so do its deadline and its cancellation: the node frees those requests.
TEST(Gateway, ForwardsApiKeysDeadlinesAndCancellation) {
  const std::string dir = ::testing::TempDir() + "/k3serve-gateway-keys-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  {
    std::ofstream keys(dir + "/api.keys");
    keys << "k3-gw-key\n";
  }
  ClusterOptions o = Options(1, 1);
  o.tls = true;
  o.work_dir = dir + "/cluster";
  o.attention_args = {"--api-keys-file=" + dir + "/api.keys"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  auto creds = tls::ChannelCredentials({.cert = "", .key = "", .ca = c.ca_file()});
  ASSERT_TRUE(creds.ok()) << creds.status();
  auto channel = grpc::CreateChannel(c.gateway_address(), *creds);
  const auto prompts = GoldenPrompts();
  ASSERT_FALSE(prompts.empty());

  InferenceClient with_key(channel, "k3-gw-key");
  auto r = with_key.Generate(prompts[0].ids, Greedy(static_cast<int>(prompts[0].expected.size())), absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, prompts[0].expected);
  InferenceClient no_key(channel, "");
  auto refused = no_key.Generate(prompts[0].ids, Greedy(4), absl::Seconds(60));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  InferenceClient plaintext(grpc::CreateChannel(c.gateway_address(), grpc::InsecureChannelCredentials()), "k3-gw-key");
  EXPECT_FALSE(plaintext.Generate(prompts[0].ids, Greedy(4), absl::Seconds(2)).ok());

  const int m = c.attention_metrics_ports()[0];
  auto freed = [&] {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (Live(m) > 0 && absl::Now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return Live(m) == 0;
  };
  // The deadline: the stream ends with DEADLINE_EXCEEDED, long before its 3000 tokens.
  auto late = with_key.Generate({1, 5, 77}, Greedy(3000), absl::Milliseconds(400));
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_TRUE(freed()) << "the node still holds the request after its deadline";

  // Cancellation after a few tokens.
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer k3-gw-key");
  auto stub = k3serve::v1::Inference::NewStub(channel);
  auto reader = stub->Generate(&ctx, MakeGenerateRequest({1, 5, 77}, Greedy(3000), "", ""));
  k3serve::v1::GenerateResponse resp;
  int seen = 0;
  while (seen < 5 && reader->Read(&resp)) seen += resp.token_ids_size();
  ASSERT_GE(seen, 5);
  EXPECT_GT(Live(m), 0);
  ctx.TryCancel();
  while (reader->Read(&resp)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(freed()) << "the node still holds the request after the client cancelled";
  EXPECT_GE(Metric(m, "k3serve_requests_total", "code=\"CANCELLED\""), 1);
}

// A drain that times out under a stream through the gateway: the client gets UNAVAILABLE naming
// the node and saying why.
TEST(AttentionDrain, TimeoutThroughTheGatewayNamesTheNode) {
  ClusterOptions o = Options(1, 1);
  o.attention_args = {"--drain-timeout=1", "--max-tokens-limit=60000", "--max-context=65536"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InferenceClient client((*cluster)->gateway_address());
  std::atomic<int> seen{0};
  absl::StatusOr<GenerateResult> r;
  std::thread stream([&] {
    r = client.Generate({1, 5, 77}, Greedy(60000), absl::Seconds(60), [&](const std::vector<int32_t>& c) { seen += c.size(); });
  });
  while (seen < 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto posted = HttpPost("127.0.0.1", (*cluster)->attention_metrics_ports()[0], "/admin/drain");
  ASSERT_TRUE(posted.ok()) << posted.status();
  stream.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("attention node attention-0"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("server shutting down (drain timeout 1 s)"), std::string::npos) << r.status();
  ASSERT_TRUE((*cluster)->attention(0).Wait(absl::Seconds(10)).has_value());
}

// SIGTERM of an attention node under load: its streams finish, the gateway sends it nothing new,
// it exits within the drain timeout; no request fails.
TEST(AttentionDrain, SigtermUnderLoadLosesNothing) {
  ClusterOptions o = Options(2, 1);
  o.attention_args = {"--drain-timeout=20"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<testing::Prompt> prompts = GoldenPrompts();
  testing::LoadLoop load((*cluster)->gateway_address(), prompts, 6);
  const int m0 = (*cluster)->attention_metrics_ports()[0];
  const absl::Time wait_end = absl::Now() + absl::Seconds(20);
  while (Live(m0) <= 0 && absl::Now() < wait_end) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double live = Live(m0);
  ASSERT_GT(live, 0) << "attention-0 never had a request in flight";
  const absl::Time term = absl::Now();
  (*cluster)->attention(0).Signal(SIGTERM);
  auto code = (*cluster)->attention(0).Wait(absl::Seconds(25));
  const absl::Duration took = absl::Now() - term;
  ASSERT_TRUE(code.has_value()) << "attention-0 did not exit within the drain timeout";
  EXPECT_EQ(*code, 0);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // the survivor carries the load
  load.Stop();
  std::printf("attention-0 drained %.0f request(s) in flight and exited %.2f s after SIGTERM; %d requests completed\n", live,
              absl::ToDoubleSeconds(took), load.ok());
  EXPECT_TRUE(load.failures().empty()) << load.failures().size() << " failed, first: " << load.failures()[0];
  EXPECT_EQ(load.mismatches(), 0);
  EXPECT_GT(load.ok(), 0);
  const std::string log = ReadLog((*cluster)->attention(0).log_path());
  EXPECT_NE(log.find("0 request(s) ended at the timeout, 0 new request(s) refused"), std::string::npos) << log;
}

// Told to drain (POST /admin/drain): streams still running at the drain timeout end with
// UNAVAILABLE saying so; the node exits.
TEST(AttentionDrain, TimeoutEndsTheRemainingStreams) {
  ClusterOptions o = Options(1, 1);
  o.gateway = false;
  o.attention_args = {"--drain-timeout=1", "--max-tokens-limit=60000", "--max-context=65536"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InferenceClient client((*cluster)->attention_addresses()[0]);
  std::atomic<int> seen{0};
  absl::StatusOr<GenerateResult> r;
  std::thread stream([&] {
    r = client.Generate({1, 5, 77}, Greedy(60000), absl::Seconds(60), [&](const std::vector<int32_t>& c) { seen += c.size(); });
  });
  while (seen < 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const absl::Time term = absl::Now();
  auto posted = HttpPost("127.0.0.1", (*cluster)->attention_metrics_ports()[0], "/admin/drain");
  ASSERT_TRUE(posted.ok()) << posted.status();
  stream.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("server shutting down (drain timeout 1 s)"), std::string::npos) << r.status();
  ASSERT_TRUE((*cluster)->attention(0).Wait(absl::Seconds(10)).has_value());
  EXPECT_LT(absl::Now() - term, absl::Seconds(5));
}

}  // namespace
}  // namespace k3

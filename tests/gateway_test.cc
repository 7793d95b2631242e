// The gateway and the attention node's drain, with real processes: router, expert and attention
// nodes, and k3serve-gateway in front.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/time/clock.h"
#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
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

namespace health = ::grpc::health::v1;
using ServingStatus = health::HealthCheckResponse::ServingStatus;

// grpc.health.v1 Check of `service`: the status, or the call's error.
absl::StatusOr<ServingStatus> Check(const std::string& address, const std::string& service) {
  auto stub = health::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  health::HealthCheckRequest req;
  req.set_service(service);
  health::HealthCheckResponse resp;
  const grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  return resp.status();
}

// A grpc.health.v1 Watch of `service`, read on a thread of its own: the statuses as they come and how the
// call ended.
class HealthWatch {
 public:
  HealthWatch(const std::string& address, const std::string& service)
      : stub_(health::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    health::HealthCheckRequest req;
    req.set_service(service);
    reader_ = stub_->Watch(&ctx_, req);
    reader_thread_ = std::thread([this] {
      health::HealthCheckResponse r;
      while (reader_->Read(&r)) {
        std::lock_guard<std::mutex> lock(mu_);
        seen_.push_back(r.status());
        cv_.notify_all();
      }
      const grpc::Status s = reader_->Finish();
      std::lock_guard<std::mutex> lock(mu_);
      end_ = s;
      cv_.notify_all();
    });
  }
  ~HealthWatch() {
    ctx_.TryCancel();
    reader_thread_.join();
  }

  // The statuses so far, once there are `n` of them or the call has ended (or after 20 s).
  std::vector<ServingStatus> Seen(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(20), [&] { return seen_.size() >= n || end_.has_value(); });
    return seen_;
  }
  // How the call ended, once it has (or after 20 s).
  std::optional<grpc::Status> End() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(20), [&] { return end_.has_value(); });
    return end_;
  }

 private:
  std::unique_ptr<health::Health::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<health::HealthCheckResponse>> reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<ServingStatus> seen_;
  std::optional<grpc::Status> end_;
  std::thread reader_thread_;
};

// The length-delimited fields numbered `field` of a serialized message.
std::vector<std::string> Fields(const std::string& msg, int field) {
  using google::protobuf::internal::WireFormatLite;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(msg.data()), static_cast<int>(msg.size()));
  std::vector<std::string> out;
  while (const uint32_t tag = in.ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) == field &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!WireFormatLite::ReadBytes(&in, &out.emplace_back())) break;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      break;
    }
  }
  return out;
}

// The services a server lists through grpc.reflection.v1alpha (by hand: that proto's generated code is not
// installed). ServerReflectionRequest{list_services = "*"}; the answer's list_services_response (6) holds
// services (1) with their names (1).
absl::StatusOr<std::vector<std::string>> ReflectedServices(const std::string& address) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto next = [&cq] {
    void* tag;
    bool ok = false;
    return cq.Next(&tag, &ok) && ok;
  };
  const std::string req_bytes("\x3a\x01*", 3);
  grpc::Slice req_slice(req_bytes);
  grpc::ByteBuffer req(&req_slice, 1), resp;
  grpc::Status status;
  // One operation at a time: each Next is that operation's completion.
  call->StartCall(nullptr);
  bool ok = next();
  if (ok) {
    call->Write(req, nullptr);
    ok = next();
  }
  if (ok) {
    call->WritesDone(nullptr);
    ok = next();
  }
  if (ok) {
    call->Read(&resp, nullptr);
    ok = next();
  }
  call->Finish(&status, nullptr);
  next();
  if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  if (!ok) return absl::UnknownError("no reflection response");
  std::vector<grpc::Slice> slices;
  if (!resp.Dump(&slices).ok()) return absl::UnknownError("unreadable reflection response");
  std::string bytes;
  for (const grpc::Slice& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  std::vector<std::string> names;
  for (const std::string& list : Fields(bytes, 6))
    for (const std::string& service : Fields(list, 1))
      for (const std::string& name : Fields(service, 1)) names.push_back(name);
  return names;
}

// The names of a process's threads.
std::vector<std::string> ThreadNames(pid_t pid) {
  std::vector<std::string> names;
  for (const auto& t : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    std::string name = ReadLog(t.path().string() + "/comm");
    while (!name.empty() && name.back() == '\n') name.pop_back();
    names.push_back(name);
  }
  return names;
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

// The gateway's own health service (asynchronous, on its completion queue; gRPC's default one and its
// callback threads are gone): Check and Watch of "" and of k3serve.v1.Inference say SERVING while its node
// serves, NOT_FOUND / SERVICE_UNKNOWN for other names; reflection lists it. The node drains: NOT_SERVING.
// The gateway's SIGTERM ends the watches at once.
TEST(Gateway, HealthFollowsTheNodesAndEndsWatchesOnShutdown) {
  auto cluster = LocalCluster::Start(Options(1, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string gw = (*cluster)->gateway_address();
  EXPECT_EQ(Check(gw, "").value_or(health::HealthCheckResponse::UNKNOWN), health::HealthCheckResponse::SERVING);
  EXPECT_EQ(Check(gw, "k3serve.v1.Inference").value_or(health::HealthCheckResponse::UNKNOWN),
            health::HealthCheckResponse::SERVING);
  const auto checked_unknown = Check(gw, "no.such.Service");
  EXPECT_EQ(checked_unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(checked_unknown.status().message().find("no.such.Service"), std::string::npos)
      << checked_unknown.status();
  HealthWatch all(gw, ""), inference(gw, "k3serve.v1.Inference"), unknown(gw, "no.such.Service");
  EXPECT_EQ(all.Seen(1), std::vector<ServingStatus>{health::HealthCheckResponse::SERVING});
  EXPECT_EQ(inference.Seen(1), std::vector<ServingStatus>{health::HealthCheckResponse::SERVING});
  EXPECT_EQ(unknown.Seen(1), std::vector<ServingStatus>{health::HealthCheckResponse::SERVICE_UNKNOWN});

  auto services = ReflectedServices(gw);
  ASSERT_TRUE(services.ok()) << services.status();
  for (const char* want : {"grpc.health.v1.Health", "k3serve.v1.Inference"})
    EXPECT_NE(std::find(services->begin(), services->end(), want), services->end()) << want << " not reflected";
  for (const std::string& name : ThreadNames((*cluster)->gateway().pid()))
    EXPECT_NE(name, "nexting_thread") << "gRPC's callback threads run in the gateway";

  // The only attention node drains: the gateway has none serving.
  auto posted = HttpPost("127.0.0.1", (*cluster)->attention_metrics_ports()[0], "/admin/drain");
  ASSERT_TRUE(posted.ok()) << posted.status();
  const std::vector<ServingStatus> serving_then_not = {health::HealthCheckResponse::SERVING,
                                                       health::HealthCheckResponse::NOT_SERVING};
  EXPECT_EQ(all.Seen(2), serving_then_not);
  EXPECT_EQ(inference.Seen(2), serving_then_not);
  EXPECT_EQ(Check(gw, "").value_or(health::HealthCheckResponse::UNKNOWN), health::HealthCheckResponse::NOT_SERVING);
  ASSERT_TRUE((*cluster)->attention(0).Wait(absl::Seconds(10)).has_value());

  (*cluster)->gateway().Signal(SIGTERM);
  for (HealthWatch* w : {&all, &inference, &unknown}) {
    const std::optional<grpc::Status> end = w->End();
    ASSERT_TRUE(end.has_value()) << "a watch outlived the gateway's shutdown";
    EXPECT_EQ(end->error_code(), grpc::StatusCode::UNAVAILABLE) << end->error_message();
    EXPECT_EQ(end->error_message(), "the server is shutting down");
  }
  EXPECT_EQ(unknown.Seen(2), std::vector<ServingStatus>{health::HealthCheckResponse::SERVICE_UNKNOWN});
  EXPECT_EQ((*cluster)->gateway().Wait(absl::Seconds(10)), std::optional<int>(0));
}

// SIGTERM of a serving gateway: its watches hear NOT_SERVING, then end.
TEST(Gateway, SigtermSaysNotServingToWatches) {
  auto cluster = LocalCluster::Start(Options(1, 1));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  HealthWatch all((*cluster)->gateway_address(), "");
  EXPECT_EQ(all.Seen(1), std::vector<ServingStatus>{health::HealthCheckResponse::SERVING});
  (*cluster)->gateway().Signal(SIGTERM);
  EXPECT_EQ(all.Seen(2), (std::vector<ServingStatus>{health::HealthCheckResponse::SERVING,
                                                     health::HealthCheckResponse::NOT_SERVING}));
  const std::optional<grpc::Status> end = all.End();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->error_code(), grpc::StatusCode::UNAVAILABLE) << end->error_message();
  EXPECT_EQ((*cluster)->gateway().Wait(absl::Seconds(10)), std::optional<int>(0));
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

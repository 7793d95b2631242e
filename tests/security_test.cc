// Security and fault handling with real processes (DESIGN §5): attacks on the control and data
// planes refused while streams run, fair scheduling beside a long prompt, a hung expert node
// dropped, TLS and API keys, placement versions across router restarts.
#include <gtest/gtest.h>
#include <signal.h>

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/tls.h"
#include "engine/engine.h"
#include "k3serve/v1/control.grpc.pb.h"
#include "router/ucx_transport.h"
#include "router/wire.h"
#include "tests/cluster_testing.h"
#include "tests/testing.h"
#include "tools/client.h"
#include "tools/golden.h"
#include "tools/http_get.h"
#include "tools/local_cluster.h"

namespace k3 {
namespace {
namespace v1 = ::k3serve::v1;

using testing::Greedy;
using testing::TinyCluster;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The ready file's fields of a node ("grpc metrics [data]").
std::vector<std::string> ReadyFields(const LocalCluster& c, const std::string& node) {
  return absl::StrSplit(absl::StripAsciiWhitespace(ReadAll(c.work_dir() + "/" + node + ".ready")), ' ');
}

double Metric(int port, const std::string& name) {
  auto m = HttpGet("127.0.0.1", port, "/metrics");
  return m.ok() ? MetricValue(*m, name) : -1;
}

// Streams that generate in a loop until stopped; every outcome is counted.
class Load {
 public:
  Load(const std::string& address, int streams, std::function<std::unique_ptr<InferenceClient>()> make = nullptr) {
    for (int i = 0; i < streams; ++i)
      threads_.emplace_back([this, address, i, make] {
        auto client = make ? make() : std::make_unique<InferenceClient>(address);
        const std::vector<int32_t> prompt = {1, 5 + i, 9, 14, 3};
        while (!stop_) {
          const absl::Time start = absl::Now();
          auto r = client->Generate(prompt, Greedy(12), absl::Seconds(30));
          std::lock_guard<std::mutex> lock(mu_);
          outcomes_.push_back({start, absl::Now(), r.ok() ? absl::OkStatus() : r.status()});
        }
      });
  }
  ~Load() { Stop(); }
  void Stop() {
    stop_ = true;
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }
  struct Outcome {
    absl::Time start, end;
    absl::Status status;
  };
  std::vector<Outcome> outcomes() {
    std::lock_guard<std::mutex> lock(mu_);
    return outcomes_;
  }

 private:
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<Outcome> outcomes_;
  std::vector<std::thread> threads_;
};

// TCP sockets in LISTEN state of a process, as "hex address" of /proc/net/tcp{,6}.
std::vector<std::string> ListeningAddresses(pid_t pid) {
  std::set<std::string> inodes;
  for (const auto& e : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"))) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<std::string> out;
  for (const char* table : {"tcp", "tcp6"}) {
    std::istringstream in(ReadAll(absl::StrCat("/proc/", pid, "/net/", table)));
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() > 9 && f[3] == "0A" && inodes.count(f[9])) out.push_back(f[1]);
    }
  }
  return out;
}

// A self-signed certificate that expired yesterday, and its key.
void WriteExpiredCertificate(const std::string& cert_path, const std::string& key_path) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* x = X509_new();
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
  X509_gmtime_adj(X509_getm_notBefore(x), -2 * 86400);
  X509_gmtime_adj(X509_getm_notAfter(x), -86400);
  X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("expired"), -1, -1, 0);
  X509_set_issuer_name(x, X509_get_subject_name(x));
  X509_set_pubkey(x, key);
  X509_sign(x, key, EVP_sha256());
  FILE* f = std::fopen(cert_path.c_str(), "w");
  PEM_write_X509(f, x);
  std::fclose(f);
  f = std::fopen(key_path.c_str(), "w");
  PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr);
  std::fclose(f);
  X509_free(x);
  EVP_PKEY_free(key);
}

template <class Call>
grpc::Status WithMetadata(std::vector<std::pair<std::string, std::string>> md, Call call) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  for (auto& [k, v] : md) ctx.AddMetadata(k, v);
  return call(&ctx);
}

// Every attack of the threat model, replayed while 8 streams run: each is refused, the streams
// see no failure, and the placement still covers both real expert nodes.
TEST(Security, AttacksRefusedWhileEightStreamsRun) {
  auto cluster = LocalCluster::Start(TinyCluster(1, 2));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  const std::string token(absl::StripAsciiWhitespace(ReadAll(c.node_token_file())));
  ASSERT_FALSE(token.empty());
  Load load(c.attention_addresses()[0], 8);
  std::this_thread::sleep_for(std::chrono::seconds(1));

  auto router = v1::Router::NewStub(grpc::CreateChannel(c.router_address(), grpc::InsecureChannelCredentials()));
  const std::vector<std::string> e0 = ReadyFields(c, "expert-0");
  auto admin = v1::ExpertAdmin::NewStub(grpc::CreateChannel("127.0.0.1:" + e0[0], grpc::InsecureChannelCredentials()));
  const std::vector<std::pair<std::string, std::string>> none, wrong = {{auth::kNodeTokenKey, "guess"}},
      node = {{auth::kNodeTokenKey, token}, {auth::kNodeKeyKey, "an-attacker"}};

  v1::RegisterNodeRequest bogus;
  bogus.set_role(v1::NODE_ROLE_EXPERT);
  bogus.set_node_id("bogus");
  bogus.set_grpc_address("127.0.0.1:1");
  bogus.set_ucx_address("127.0.0.1:1");
  v1::RegisterNodeRequest hijack = bogus;
  hijack.set_node_id("expert-0");
  v1::RegisterNodeResponse reg;
  auto reg_call = [&](const v1::RegisterNodeRequest& r) {
    return [&, r](grpc::ClientContext* ctx) { return router->RegisterNode(ctx, r, &reg); };
  };
  auto watch_call = [&](grpc::ClientContext* ctx) {
    v1::WatchPlacementRequest w;
    w.set_node_id("expert-0");
    auto reader = router->WatchPlacement(ctx, w);
    v1::Placement p;
    while (reader->Read(&p)) {
    }
    return reader->Finish();
  };
  auto failure_call = [&](grpc::ClientContext* ctx) {
    v1::ReportNodeFailureRequest f;
    f.set_node_id("expert-0");
    v1::ReportNodeFailureResponse resp;
    return router->ReportNodeFailure(ctx, f, &resp);
  };
  auto drain_call = [&](grpc::ClientContext* ctx) {
    v1::DrainResponse resp;
    return admin->Drain(ctx, v1::DrainRequest(), &resp);
  };
  auto load_slots_call = [&](grpc::ClientContext* ctx) {
    v1::LoadSlotsRequest req;
    req.set_version(1);  // no slots: would unload every expert
    v1::LoadSlotsResponse resp;
    return admin->LoadSlots(ctx, req, &resp);
  };
  struct Attack {
    const char* what;
    grpc::Status status;
    grpc::StatusCode want;
  };
  std::vector<Attack> attacks = {
      {"anonymous RegisterNode", WithMetadata(none, reg_call(bogus)), grpc::StatusCode::UNAUTHENTICATED},
      {"RegisterNode with a guessed token", WithMetadata(wrong, reg_call(bogus)), grpc::StatusCode::UNAUTHENTICATED},
      {"RegisterNode of a live node_id by another process", WithMetadata(node, reg_call(hijack)), grpc::StatusCode::ALREADY_EXISTS},
      {"anonymous WatchPlacement of another node", WithMetadata(none, watch_call), grpc::StatusCode::UNAUTHENTICATED},
      {"WatchPlacement of another node", WithMetadata(node, watch_call), grpc::StatusCode::PERMISSION_DENIED},
      {"anonymous ReportNodeFailure", WithMetadata(none, failure_call), grpc::StatusCode::UNAUTHENTICATED},
      {"anonymous Drain", WithMetadata(none, drain_call), grpc::StatusCode::UNAUTHENTICATED},
      {"Drain by a node", WithMetadata(node, drain_call), grpc::StatusCode::PERMISSION_DENIED},
      {"anonymous LoadSlots", WithMetadata(none, load_slots_call), grpc::StatusCode::UNAUTHENTICATED},
      {"LoadSlots by a node", WithMetadata(node, load_slots_call), grpc::StatusCode::PERMISSION_DENIED},
  };
  for (const Attack& a : attacks) {
    EXPECT_EQ(a.status.error_code(), a.want) << a.what << ": " << a.status.error_message();
    EXPECT_EQ(a.status.error_message().find(token), std::string::npos) << a.what << " leaks the token";
    std::printf("refused  %-50s %d %s\n", a.what, a.status.error_code(), a.status.error_message().c_str());
  }

  // The data plane: a connection that does not open with the node token is closed, unanswered.
  auto transport = dataplane::NewUcxTransport();
  ASSERT_TRUE(transport.ok()) << transport.status();
  for (const char* how : {"no Hello", "a Hello with a guessed token"}) {
    std::atomic<int> replies{0};
    std::atomic<bool> closed{false};
    dataplane::ClientCallbacks cb;
    cb.on_message = [&](dataplane::Buffer) { replies++; };
    cb.on_failure = [&](absl::Status) { closed = true; };
    auto conn = (*transport)->Connect("127.0.0.1:" + e0[2], cb);
    ASSERT_TRUE(conn.ok()) << conn.status();
    if (std::string(how) != "no Hello") {
      auto hello = wire::Encode<dataplane::Buffer>(wire::Hello{"guess"});
      (*conn)->Send(std::move(*hello), [](absl::Status) {});
    }
    std::vector<float> x(4, 1.0f);
    wire::ExpertRequest m;
    m.request_id = 7;
    m.width = 4;
    m.n_rows = 1;
    m.row_offsets = {0, 1};
    m.pairs = {{0, 1.0f}};
    m.rows = std::as_bytes(std::span<const float>(x));
    auto msg = wire::Encode<dataplane::Buffer>(m);
    (*conn)->Send(std::move(*msg), [](absl::Status) {});
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (!closed && absl::Now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_TRUE(closed) << how << ": the expert node kept the connection open";
    EXPECT_EQ(replies, 0) << how << ": the expert node answered";
    std::printf("refused  data-plane connection with %s: closed, %d replies\n", how, replies.load());
  }

  // Every listening socket of every process is on --host (127.0.0.1), the data plane's included.
  std::vector<Process*> procs = {&c.router(), &c.attention(0)};
  for (size_t i = 0; i < c.num_experts(); ++i) procs.push_back(&c.expert(i));
  for (Process* p : procs) {
    const std::vector<std::string> listening = ListeningAddresses(p->pid());
    EXPECT_GE(listening.size(), 2u) << p->name() << ": its gRPC and metrics ports at least";
    for (const std::string& a : listening) {
      const std::string host = a.substr(0, a.find(':'));
      EXPECT_TRUE(host == "0100007F" || host == "0000000000000000FFFF00000100007F")
          << p->name() << " listens on " << a << " (hex), not 127.0.0.1";
    }
    std::printf("%s: %zu listening sockets, all on 127.0.0.1\n", p->name().c_str(), listening.size());
  }

  std::this_thread::sleep_for(std::chrono::seconds(1));
  load.Stop();
  int ok = 0;
  for (const auto& o : load.outcomes()) {
    EXPECT_TRUE(o.status.ok()) << o.status;
    ok += o.status.ok();
  }
  std::printf("load: %d requests by 8 streams beside the attacks, %zu failed\n", ok, load.outcomes().size() - ok);
  EXPECT_GT(ok, 8);
  EXPECT_EQ(Metric(c.router_metrics_port(), "k3serve_router_expert_nodes"), 2);
}


// A SIGSTOPped (hung, not dead) expert node under 8 streams: the attention node's dispatch times
// out and reports it, the router's probe gets no answer and drops it, its experts are re-placed
// on the survivor. Requests in flight finish or fail UNAVAILABLE; every request after the
// re-placement succeeds while the node stays stopped.
TEST(Security, HungExpertNodeIsDroppedAndServingContinues) {
  auto cluster = LocalCluster::Start(TinyCluster(1, 2));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  Load load(c.attention_addresses()[0], 8);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const absl::Time stopped = absl::Now();
  c.expert(1).Signal(SIGSTOP);
  absl::Time dropped = absl::InfiniteFuture();
  while (absl::Now() < stopped + absl::Seconds(10)) {
    if (Metric(c.router_metrics_port(), "k3serve_router_expert_nodes") == 1) {
      dropped = absl::Now();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const absl::Status serving = c.WaitServing(absl::Seconds(10));
  const absl::Time replaced = absl::Now();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  load.Stop();
  c.expert(1).Signal(SIGCONT);
  ASSERT_LT(dropped, absl::InfiniteFuture()) << "the hung node was never dropped";
  ASSERT_TRUE(serving.ok()) << serving;
  const double drop_s = absl::ToDoubleSeconds(dropped - stopped);
  int before = 0, during_ok = 0, during_unavailable = 0, after = 0;
  for (const auto& o : load.outcomes()) {
    if (o.end < stopped) {
      EXPECT_TRUE(o.status.ok()) << o.status;
      before++;
    } else if (o.start < replaced) {
      // In flight at the stop, or admitted before the re-placement was served.
      EXPECT_TRUE(o.status.ok() || absl::IsUnavailable(o.status)) << o.status;
      (o.status.ok() ? during_ok : during_unavailable)++;
      if (!o.status.ok()) {
        EXPECT_NE(o.status.message().find("expert"), std::string::npos) << o.status;
      }
    } else {
      EXPECT_TRUE(o.status.ok()) << "a request after the re-placement failed: " << o.status;
      after++;
    }
  }
  std::printf("hung node dropped %.2f s after SIGSTOP; serving again after %.2f s; requests: %d before, "
              "%d ok + %d UNAVAILABLE around the stop, %d after (all ok)\n",
              drop_s, absl::ToDoubleSeconds(replaced - stopped), before, during_ok, during_unavailable, after);
  EXPECT_LE(drop_s, 3.0);
  EXPECT_GT(after, 8);
}

// Placement versions continue upward across router restarts, and an attention node ignores a
// placement older than the one it uses (here a router started with --first-version=5).
TEST(Security, PlacementVersionsMonotonicAcrossRouterRestarts) {
  auto cluster = LocalCluster::Start(TinyCluster(1, 2));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  const int port = c.attention_metrics_ports()[0];
  const double v1 = Metric(port, "k3serve_placement_version");
  ASSERT_GT(v1, 0);
  ASSERT_TRUE(c.RestartRouter().ok());
  double v2 = v1;
  for (absl::Time end = absl::Now() + absl::Seconds(20); v2 <= v1 && absl::Now() < end;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    v2 = Metric(port, "k3serve_placement_version");
  }
  EXPECT_GT(v2, v1) << "the restarted router's placement did not continue above the old version";
  c.router_args() = {"--first-version=5"};
  ASSERT_TRUE(c.RestartRouter().ok());
  // The new router publishes v5 once both expert nodes registered again; the attention node refuses it.
  const std::string log = c.attention(0).log_path();
  bool refused = false;
  for (absl::Time end = absl::Now() + absl::Seconds(20); !refused && absl::Now() < end;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    refused = ReadAll(log).find("placement v5 is older than") != std::string::npos;
  }
  EXPECT_TRUE(refused) << "no refusal in " << log;
  const double v3 = Metric(port, "k3serve_placement_version");
  EXPECT_EQ(v3, v2);
  InferenceClient client(c.attention_addresses()[0]);
  auto r = client.Generate({1, 2, 3}, Greedy(4), absl::Seconds(30));
  EXPECT_TRUE(r.ok()) << r.status();
  std::printf("placement versions: %.0f, after a restart %.0f; a router at v5 ignored (still %.0f)\n", v1, v2, v3);
}


std::vector<int32_t> LongPrompt(int n) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = 3 + (i * 7) % 500;
  return p;
}

absl::Duration TimeToFirstToken(InferenceClient& client, const std::vector<int32_t>& prompt) {
  const absl::Time t0 = absl::Now();
  auto r = client.Generate(prompt, Greedy(1), absl::Seconds(300));
  EXPECT_TRUE(r.ok()) << r.status();
  return absl::Now() - t0;
}

// A 20k-token prompt beside 8 short streams: decode tokens go first in every step and prefill
// chunks fill the rest of the budget, so a short stream's inter-token latency stays within one
// prefill chunk plus one decode step; starved, it would wait for the whole prefill. A prompt above
// --max-prompt-tokens is refused at once.
TEST(Security, LongPromptDoesNotStarveShortStreams) {
  constexpr int kLong = 20000, kChunk = 2048, kLimit = 24000;
  ClusterOptions o = TinyCluster(1, 2);
  o.attention_args = {absl::StrCat("--max-batch-tokens=", kChunk), absl::StrCat("--max-prompt-tokens=", kLimit)};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string addr = (*cluster)->attention_addresses()[0];
  InferenceClient client(addr);

  const absl::Time t_reject = absl::Now();
  auto too_long = client.Generate(LongPrompt(kLimit + 1), Greedy(1), absl::Seconds(30));
  const absl::Duration reject = absl::Now() - t_reject;
  ASSERT_FALSE(too_long.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(too_long.status())) << too_long.status();
  EXPECT_NE(too_long.status().message().find("max-prompt-tokens"), std::string::npos) << too_long.status();
  EXPECT_LT(reject, absl::Seconds(1));

  // Each short stream: 8 prompt tokens, 48 generated; its gaps between tokens.
  auto short_streams = [&](std::vector<double>* itl_ms, std::atomic<int>* failures) {
    std::mutex mu;
    std::vector<std::thread> threads;
    for (int i = 0; i < 8; ++i)
      threads.emplace_back([&, i] {
        InferenceClient cl(addr);
        absl::Time last = absl::InfinitePast();
        std::vector<double> mine;
        auto r = cl.Generate({1, 4 + i, 7, 9, 11, 13, 2 + i, 5}, Greedy(48), absl::Seconds(120), [&](const std::vector<int32_t>& t) {
          const absl::Time now = absl::Now();
          if (last != absl::InfinitePast())
            for (size_t k = 0; k < t.size(); ++k) mine.push_back(absl::ToDoubleMilliseconds(now - last) / t.size());
          last = now;
        });
        std::lock_guard<std::mutex> lock(mu);
        if (!r.ok() || r->tokens.size() != 48) (*failures)++;
        itl_ms->insert(itl_ms->end(), mine.begin(), mine.end());
      });
    for (auto& t : threads) t.join();
  };
  auto p99 = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(0.99 * v.size()))];
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };

  // One decode step: the short streams alone. One prefill chunk: chunk i of a long prompt costs
  // c0 + c1 * i (it attends to i chunks before it), so the first chunk alone (c0) and the whole
  // prompt's time to first token (n c0 + c1 n (n - 1) / 2, measured beside the short streams, under
  // the same load) give the slowest, last chunk c0 + c1 (n - 1).
  std::vector<double> alone;
  std::atomic<int> failures{0};
  short_streams(&alone, &failures);
  const double step_ms = median(alone);
  const double c0_ms = absl::ToDoubleMilliseconds(TimeToFirstToken(client, LongPrompt(kChunk)));

  // Together: the long prompt is admitted first, the short streams start while it prefills.
  absl::Duration whole;
  std::thread long_request([&] { whole = TimeToFirstToken(client, LongPrompt(kLong)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::vector<double> beside;
  short_streams(&beside, &failures);
  long_request.join();
  const double n = (kLong + kChunk - 1) / kChunk;
  const double c1_ms = 2 * (absl::ToDoubleMilliseconds(whole) - n * c0_ms) / (n * (n - 1));
  const double chunk_ms = c0_ms + c1_ms * (n - 1);
  const double p99_ms = p99(beside);
  std::printf("short streams beside a %d-token prompt: ITL p99 %.1f ms (max %.1f ms, %zu gaps); one prefill chunk "
              "(%d tokens, the slowest) %.1f ms (the prompt's first token after %.1f s); one decode step %.1f ms (ITL p99 alone %.1f ms); "
              "rejecting %d tokens took %.1f ms\n",
              kLong, p99_ms, beside.empty() ? 0.0 : *std::max_element(beside.begin(), beside.end()), beside.size(),
              kChunk, chunk_ms, absl::ToDoubleSeconds(whole), step_ms, p99(alone), kLimit + 1,
              absl::ToDoubleMilliseconds(reject));
  EXPECT_EQ(failures, 0);
  // Starved, a short stream would wait out the whole prefill. The bound is one chunk plus one step,
  // with 1.5x for the timing noise of a shared CI machine (measured here: 1.26-1.37x, the chunk
  // estimated alone and the gaps measured beside it).
  EXPECT_LT(p99_ms, absl::ToDoubleMilliseconds(whole) / 3);
  EXPECT_LE(p99_ms, 1.5 * (chunk_ms + step_ms));
}


// `k3serve up --tls` as a cluster: mTLS between the nodes, TLS and API keys on the public API. The
// golden prompts are served over TLS; a plaintext client, a client trusting another CA and a
// client without the key are refused.
TEST(Security, TlsClusterWithApiKeys) {
  const std::string dir = ::testing::TempDir() + "/k3serve-tls-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  {
    std::ofstream keys(dir + "/api.keys");
    keys << "# one key a line\nk3-test-key-1\n";
  }
  ClusterOptions o = TinyCluster(1, 2);
  o.tls = true;
  o.work_dir = dir + "/cluster";
  o.attention_args = {"--api-keys-file=" + dir + "/api.keys"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  const std::string addr = c.attention_addresses()[0];
  auto tls_channel = [&](const std::string& ca) {
    auto creds = tls::ChannelCredentials({.cert = "", .key = "", .ca = ca});
    EXPECT_TRUE(creds.ok()) << creds.status();
    return grpc::CreateChannel(addr, *creds);
  };

  auto golden = LoadGolden(testing::TinyModel());
  ASSERT_TRUE(golden.ok()) << golden.status();
  InferenceClient client(tls_channel(c.ca_file()), "k3-test-key-1");
  for (size_t i = 0; i < golden->prompts.size(); ++i) {
    const auto& p = golden->prompts[i];
    auto r = client.Generate(p.input_ids, Greedy(static_cast<int>(p.greedy_ids.size())), absl::Seconds(60));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens, p.greedy_ids) << "prompt " << i;
  }
  std::printf("TLS: %zu golden prompts served over TLS with an API key\n", golden->prompts.size());

  auto refused = [&](const char* what, InferenceClient& cl, absl::StatusCode want) {
    auto r = cl.Generate({1, 2, 3}, Greedy(2), absl::Seconds(10));
    ASSERT_FALSE(r.ok()) << what << " was served";
    EXPECT_EQ(r.status().code(), want) << what << ": " << r.status();
    EXPECT_EQ(r.status().message().find("k3-test-key-1"), std::string::npos) << what << " leaks the key";
    std::printf("refused  %-40s %s\n", what, r.status().ToString().c_str());
  };
  InferenceClient no_key(tls_channel(c.ca_file()), "");
  refused("a TLS client without the API key", no_key, absl::StatusCode::kUnauthenticated);
  InferenceClient bad_key(tls_channel(c.ca_file()), "k3-test-key-2");
  refused("a TLS client with a wrong API key", bad_key, absl::StatusCode::kUnauthenticated);
  InferenceClient plaintext(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()), "k3-test-key-1");
  refused("a plaintext client", plaintext, absl::StatusCode::kUnavailable);
  ASSERT_TRUE(MakeTestCertificates(dir + "/other", {{"client", "k3serve-node"}}).ok());
  InferenceClient other_ca(tls_channel(dir + "/other/ca.pem"), "k3-test-key-1");
  refused("a client trusting another CA", other_ca, absl::StatusCode::kUnavailable);

  // The control plane is mutual TLS: a certificate of another CA cannot register a node.
  auto creds = tls::ChannelCredentials({.cert = dir + "/other/client.pem", .key = dir + "/other/client.key", .ca = c.ca_file()});
  ASSERT_TRUE(creds.ok()) << creds.status();
  auto router = v1::Router::NewStub(grpc::CreateChannel(c.router_address(), *creds));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::RegisterNodeRequest req;
  req.set_role(v1::NODE_ROLE_ATTENTION);
  req.set_node_id("intruder");
  v1::RegisterNodeResponse resp;
  const grpc::Status s = router->RegisterNode(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  std::printf("refused  %-40s %d %s\n", "a node certificate of another CA", s.error_code(), s.error_message().c_str());

  // SIGHUP re-validates the files; the node keeps serving.
  c.attention(0).Signal(SIGHUP);
  bool reread = false;
  for (absl::Time end = absl::Now() + absl::Seconds(5); !reread && absl::Now() < end;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    reread = ReadAll(c.attention(0).log_path()).find("SIGHUP: TLS files re-read") != std::string::npos;
  }
  EXPECT_TRUE(reread);
  auto after_hup = client.Generate({1, 2, 3}, Greedy(2), absl::Seconds(30));
  EXPECT_TRUE(after_hup.ok()) << after_hup.status();

  // A bad or expired certificate is a startup error naming the file.
  WriteExpiredCertificate(dir + "/expired.pem", dir + "/expired.key");
  for (const auto& [cert, key, want] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {dir + "/api.keys", c.key_file("admin"), "holds no PEM certificate"},
           {dir + "/expired.pem", dir + "/expired.key", "has expired"}}) {
    auto bad = Process::Spawn("bad-cert", {std::string(K3SERVE_BIN_DIR) + "/k3serve-router", "--model=" + testing::TinyModel(),
                                           "--tls-cert=" + cert, "--tls-key=" + key, "--grpc-port=0", "--metrics-port=-1"},
                              dir + "/bad-cert.log");
    ASSERT_TRUE(bad.ok());
    EXPECT_EQ((*bad)->Wait(absl::Seconds(20)), 2);
    const std::string bad_log = ReadAll(dir + "/bad-cert.log");
    EXPECT_NE(bad_log.find(cert), std::string::npos) << bad_log;
    EXPECT_NE(bad_log.find(want), std::string::npos) << bad_log;
    std::printf("startup error: %s", bad_log.c_str());
  }
}

}  // namespace
}  // namespace k3

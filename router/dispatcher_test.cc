// The dispatcher against real UCX endpoints and a real expert node: a hung node (it takes rows and
// never answers) is timed out and reported, and the dispatch retried on its replica; with no
// replica left the dispatch fails UNAVAILABLE naming the node. Older placements are refused. Over
// shared memory a polling Wait takes the replies itself, and still times a hung node out.
#include "router/dispatcher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "expert_service/expert_node.h"
#include "router/shm_transport.h"
#include "router/ucx_transport.h"
#include "tests/testing.h"

namespace k3::router {
namespace {

std::string Tiny() { return testing::SourceDir() + "/tests/data/tiny-kimi-linear"; }

struct Fixture {
  ModelConfig config;
  std::shared_ptr<const Checkpoint> ckpt;
  metrics::Registry registry;
  std::unique_ptr<dataplane::Transport> transport;       // the dispatcher's
  std::unique_ptr<dataplane::Transport> node_transport;  // the nodes': as in a cluster, another progress thread
  std::unique_ptr<ExpertNode> good;
  std::unique_ptr<dataplane::Server> hung;
  std::atomic<int> hung_messages{0};
  int32_t moe_layer = -1;

  explicit Fixture(bool shm = false) {
    config = *LoadModelConfig(Tiny());
    ckpt = std::make_shared<const Checkpoint>(*Checkpoint::Open(Tiny()));
    transport = shm ? *dataplane::NewShmTransport() : *dataplane::NewUcxTransport();
    node_transport = shm ? *dataplane::NewShmTransport() : *dataplane::NewUcxTransport();
    ExpertNodeOptions eopt;
    eopt.node_id = "good";
    good = std::make_unique<ExpertNode>(config, ckpt, eopt, registry);
    EXPECT_TRUE(good->Listen(*node_transport, "127.0.0.1:0").ok());
    for (int32_t l = 0; l < config.num_layers && moe_layer < 0; ++l)
      if (config.mlp[l] == Mlp::kMoe) moe_layer = l;
    LoadEveryExpert(*good);
    dataplane::ServerCallbacks cb;
    cb.on_message = [this](dataplane::ConnectionId, dataplane::Buffer) { hung_messages++; };
    hung = *node_transport->Listen("127.0.0.1:0", cb);
  }
  ~Fixture() {
    hung.reset();
    good.reset();
  }

  void LoadEveryExpert(ExpertNode& node) const {
    grpc::ServerContext ctx;  // no credentials configured: the admin check is open
    v1::LoadSlotsRequest req;
    req.set_version(1);
    for (int32_t l = 0; l < config.num_layers; ++l) {
      if (config.mlp[l] != Mlp::kMoe) continue;
      for (int32_t e = 0; e < config.num_experts; ++e) {
        auto* s = req.add_slots();
        s->set_layer(l);
        s->set_expert(e);
      }
    }
    v1::LoadSlotsResponse resp;
    EXPECT_TRUE(node.LoadSlots(&ctx, &req, &resp).ok());
  }

  // nodes: "hung" and/or "good"; every expert on each of them.
  std::shared_ptr<const PlacementTable> Placement(uint64_t version, const std::vector<std::string>& nodes) {
    auto t = std::make_shared<PlacementTable>();
    t->version = version;
    for (const auto& n : nodes) t->nodes.push_back({n, n == "hung" ? hung->address() : good->data_address(), ""});
    t->replicas.resize(config.num_layers);
    for (int32_t l = 0; l < config.num_layers; ++l) {
      if (config.mlp[l] != Mlp::kMoe) continue;
      t->replicas[l].resize(config.num_experts);
      for (auto& r : t->replicas[l])
        for (int32_t i = 0; i < static_cast<int32_t>(nodes.size()); ++i) r.push_back(i);
    }
    return t;
  }
};

// A request of `rows` rows over the first MoE layer's experts, and the in-process experts' sums for it.
struct Rows {
  std::vector<float> x, w, want;
  std::vector<int32_t> idx;
  ExpertRequest request;
  Rows(const Fixture& f, int64_t rows, uint64_t seed) {
    const int64_t k = f.config.top_k, X = f.config.expert_width();
    x = testing::Random(rows * X, seed);
    idx.resize(rows * k);
    w.resize(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) {
      idx[i] = static_cast<int32_t>((i * 5 + i / k) % f.config.num_experts);
      w[i] = 0.25f + 0.1f * static_cast<float>(i % k);
    }
    request = {f.moe_layer, rows, X, k, x.data(), idx.data(), w.data()};
    auto weights = LoadWeights(f.config, f.ckpt, WeightFilter::ExpertsOnly([](int64_t, int64_t) { return true; }));
    EXPECT_TRUE(weights.ok()) << weights.status();
    want.resize(rows * X);
    if (weights.ok()) {
      EXPECT_TRUE(LocalExpertExecutor(f.config, **weights).Run(request, want.data()).ok());
    }
  }
};

// A node on `transport` that answers every expert request `delay` after it came, with zero sums,
// each from a thread of its own.
struct SlowNode {
  std::mutex mu;
  std::vector<std::thread> repliers;  // guarded by mu
  std::unique_ptr<dataplane::Server> server;

  SlowNode(dataplane::Transport& transport, const ModelConfig& config, absl::Duration delay) {
    dataplane::ServerCallbacks cb;
    cb.on_message = [this, delay, experts = static_cast<uint32_t>(config.num_experts)](dataplane::ConnectionId from,
                                                                                        dataplane::Buffer msg) {
      auto type = wire::PeekType(msg.span());
      if (!type.ok() || *type != wire::MessageType::kExpertRequest) return;  // the Hello
      auto req = wire::DecodeExpertRequest(msg.span(), {experts});
      ASSERT_TRUE(req.ok()) << req.status();
      std::lock_guard<std::mutex> lock(mu);
      repliers.emplace_back([this, delay, from, id = req->request_id, n = req->n_rows, width = req->width] {
        absl::SleepFor(delay);
        std::vector<std::byte> sums(static_cast<size_t>(n) * width * sizeof(float), std::byte{0});
        wire::ExpertReply reply;
        reply.request_id = id;
        reply.width = width;
        reply.n_rows = n;
        reply.sums = sums;
        server->Send(from, *wire::Encode<dataplane::Buffer>(reply), [](absl::Status) {});
      });
    };
    server = *transport.Listen("127.0.0.1:0", cb);
  }
  ~SlowNode() {
    std::vector<std::thread> done;
    {
      std::lock_guard<std::mutex> lock(mu);
      done.swap(repliers);
    }
    for (auto& r : done) r.join();
    server.reset();
  }
};

TEST(Dispatcher, HungNodeIsRetriedOnItsReplica) {
  Fixture f;
  std::mutex mu;
  std::vector<std::string> reported;
  DispatcherOptions opt;
  opt.timeout = absl::Milliseconds(300);
  opt.on_node_failure = [&](const std::string& node, const absl::Status&) {
    std::lock_guard<std::mutex> lock(mu);
    reported.push_back(node);
  };
  Dispatcher d(f.config, *f.transport, opt);
  ASSERT_TRUE(d.SetPlacement(f.Placement(2, {"hung", "good"})).ok());
  EXPECT_TRUE(d.ready());
  EXPECT_TRUE(absl::IsFailedPrecondition(d.SetPlacement(f.Placement(1, {"good"}))));  // older: ignored
  EXPECT_EQ(d.placement_version(), 2u);

  const Rows r(f, 6, 7);
  const ExpertRequest& req = r.request;
  const std::vector<float>& want = r.want;
  std::vector<float> got(want.size());

  const absl::Time t0 = absl::Now();
  auto ticket = d.Submit(req);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  const absl::Status s = d.Wait(*ticket, got.data());
  const absl::Duration took = absl::Now() - t0;
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_GT(f.hung_messages, 1) << "the hung node got no rows (the Hello and a part)";
  EXPECT_LT(testing::MaxAbsDiff(got, want), 1e-5);
  EXPECT_GE(took, absl::Milliseconds(300));
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(reported, std::vector<std::string>{"hung"});
  }
  std::printf("hung node: timed out after %s, retried on the replica: ok in %s\n",
              absl::FormatDuration(opt.timeout).c_str(), absl::FormatDuration(took).c_str());
  // Suspect now: the next dispatch goes to the replica alone, at once.
  const absl::Time t1 = absl::Now();
  ticket = d.Submit(req);
  ASSERT_TRUE(ticket.ok());
  EXPECT_TRUE(d.Wait(*ticket, got.data()).ok());
  EXPECT_LT(absl::Now() - t1, absl::Milliseconds(300));
}

TEST(Dispatcher, HungNodeWithoutReplicaFailsUnavailableNamingIt) {
  Fixture f;
  DispatcherOptions opt;
  opt.timeout = absl::Milliseconds(200);
  Dispatcher d(f.config, *f.transport, opt);
  ASSERT_TRUE(d.SetPlacement(f.Placement(1, {"hung"})).ok());
  const int64_t rows = 2, k = f.config.top_k, X = f.config.expert_width();
  const std::vector<float> x = testing::Random(rows * X, 8);
  std::vector<int32_t> idx(rows * k, 0);
  for (int64_t i = 0; i < rows * k; ++i) idx[i] = static_cast<int32_t>(i % f.config.num_experts);
  std::vector<float> w(rows * k, 0.5f), out(rows * X);
  auto ticket = d.Submit({f.moe_layer, rows, X, k, x.data(), idx.data(), w.data()});
  ASSERT_TRUE(ticket.ok());
  const absl::Status s = d.Wait(*ticket, out.data());
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("expert node hung did not answer within 200ms"), std::string::npos) << s;
  // Suspect now, but connected: it may only have been slow. Without a replica its rows still go to
  // it (failing them at once would fail every request while it is suspect), and they fail only if
  // it leaves them unanswered again.
  EXPECT_TRUE(d.ready());
  const int before = f.hung_messages;
  const absl::Time t1 = absl::Now();
  ticket = d.Submit({f.moe_layer, rows, X, k, x.data(), idx.data(), w.data()});
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  const absl::Status again = d.Wait(*ticket, out.data());
  EXPECT_TRUE(absl::IsUnavailable(again)) << again;
  EXPECT_NE(again.message().find("did not answer within"), std::string::npos) << again;
  EXPECT_GE(absl::Now() - t1, opt.timeout);
  EXPECT_EQ(f.hung_messages, before + 1) << "the suspect node got no rows (or a retry went back to it)";
}

// A node that answers every part late (300 ms, zeros) under the adaptive timeout (100 ms margin):
// the first part times out, its late reply still counts as a round trip, and the next part to the
// (suspect, replica-less) node gets a timeout above it and succeeds.
TEST(Dispatcher, ALateReplyRaisesTheAdaptiveTimeout) {
  Fixture f;
  const absl::Duration delay = absl::Milliseconds(300);
  SlowNode slow(*f.transport, f.config, delay);
  auto t = std::make_shared<PlacementTable>(*f.Placement(1, {"hung"}));
  t->nodes[0] = {"slow", slow.server->address(), ""};

  DispatcherOptions opt;
  opt.timeout_margin = absl::Milliseconds(100);
  {
    Dispatcher d(f.config, *f.transport, opt);
    ASSERT_TRUE(d.SetPlacement(t).ok());
    const int64_t rows = 3, k = f.config.top_k, X = f.config.expert_width();
    const std::vector<float> x = testing::Random(rows * X, 9);
    std::vector<int32_t> idx(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) idx[i] = static_cast<int32_t>(i % f.config.num_experts);
    std::vector<float> w(rows * k, 0.5f), out(rows * X);
    const ExpertRequest req{f.moe_layer, rows, X, k, x.data(), idx.data(), w.data()};
    auto ticket = d.Submit(req);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    const absl::Status first = d.Wait(*ticket, out.data());
    EXPECT_TRUE(absl::IsUnavailable(first)) << first;
    EXPECT_NE(first.message().find("expert node slow did not answer within 100ms"), std::string::npos) << first;
    absl::SleepFor(delay + absl::Milliseconds(200));  // its late reply comes in
    const absl::Time t1 = absl::Now();
    ticket = d.Submit(req);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    const absl::Status second = d.Wait(*ticket, out.data());
    EXPECT_TRUE(second.ok()) << second;
    EXPECT_GE(absl::Now() - t1, delay);
    std::printf("late reply after %s: the next part waited %s and succeeded\n", absl::FormatDuration(delay).c_str(),
                absl::FormatDuration(absl::Now() - t1).c_str());
  }
}

// Where one node hosts every expert a dispatch needs, a dispatch of at most one_node_max_rows rows goes whole
// to one node (one part), the least loaded: two in flight go one to each. A larger one, or any with the option
// off, spreads its pairs over both. The sums are the same every way.
TEST(Dispatcher, SmallDispatchGoesWholeToOneNode) {
  Fixture f;
  metrics::Registry other_registry;
  ExpertNodeOptions eopt;
  eopt.node_id = "other";
  ExpertNode other(f.config, f.ckpt, eopt, other_registry);
  ASSERT_TRUE(other.Listen(*f.node_transport, "127.0.0.1:0").ok());
  f.LoadEveryExpert(other);
  auto both = std::make_shared<PlacementTable>(*f.Placement(1, {"good", "good"}));
  both->nodes[1] = {"other", other.data_address(), ""};

  std::mutex mu;
  std::vector<std::string> parts;
  auto take = [&](size_t n) {  // on_part may run just after Wait returns
    for (const absl::Time until = absl::Now() + absl::Seconds(2); absl::Now() < until;
         absl::SleepFor(absl::Milliseconds(1))) {
      std::lock_guard<std::mutex> lock(mu);
      if (parts.size() >= n) break;
    }
    std::lock_guard<std::mutex> lock(mu);
    std::vector<std::string> p = std::move(parts);
    parts.clear();
    std::sort(p.begin(), p.end());
    return p;
  };
  auto run = [&](int64_t one_node_max_rows, const std::vector<const Rows*>& rows) {
    DispatcherOptions opt;
    opt.one_node_max_rows = one_node_max_rows;
    opt.on_part = [&](const std::string& node, size_t, size_t, absl::Duration) {
      std::lock_guard<std::mutex> lock(mu);
      parts.push_back(node);
    };
    Dispatcher d(f.config, *f.transport, opt);
    ASSERT_TRUE(d.SetPlacement(both).ok());
    std::vector<uint64_t> tickets;
    for (const Rows* r : rows) {
      auto t = d.Submit(r->request);
      ASSERT_TRUE(t.ok()) << t.status();
      tickets.push_back(*t);
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      std::vector<float> got(rows[i]->want.size());
      ASSERT_TRUE(d.Wait(tickets[i], got.data()).ok());
      EXPECT_LT(testing::MaxAbsDiff(got, rows[i]->want), 1e-5) << "dispatch " << i;
    }
  };
  const Rows small_a(f, 5, 21), small_b(f, 6, 22), large(f, 9, 23);
  run(8, {&small_a});
  EXPECT_EQ(take(1), std::vector<std::string>{"good"});
  run(8, {&small_a, &small_b});  // the first one's rows are outstanding on good when the second comes
  EXPECT_EQ(take(2), (std::vector<std::string>{"good", "other"}));
  run(8, {&large});
  EXPECT_EQ(take(2), (std::vector<std::string>{"good", "other"}));
  run(0, {&small_a});
  EXPECT_EQ(take(2), (std::vector<std::string>{"good", "other"}));
}

// Wait polls the shared-memory rings (DispatcherOptions::poll): the sums are the node's, replies are
// taken on the waiting thread, and a poll window longer than the timeout does not hold the timeout up.
TEST(Dispatcher, PollingWaitOverSharedMemory) {
  Fixture f(/*shm=*/true);
  // Replies that come 10 ms after their rows find the waiting thread polling: a fast node's reply may
  // come before Wait begins (on a loaded host the woken node runs first), and the transport's
  // thread takes it then.
  SlowNode slow(*f.node_transport, f.config, absl::Milliseconds(10));
  const std::thread::id self = std::this_thread::get_id();
  std::atomic<int> parts_here{0}, parts{0}, stages_here{0};
  DispatcherOptions opt;
  opt.poll = absl::Seconds(1);
  opt.timeout = absl::Milliseconds(200);
  opt.on_part = [&](const std::string&, size_t, size_t, absl::Duration) {
    parts++;
    if (std::this_thread::get_id() == self) parts_here++;
  };
  opt.on_stages = [&](const std::string&, const DispatchStages&) { stages_here++; };
  // on_part runs after the part completes: on the transport's thread, it may still be running as Wait returns.
  auto settle = [&](int want) {
    for (const absl::Time until = absl::Now() + absl::Seconds(2); parts < want && absl::Now() < until;)
      absl::SleepFor(absl::Milliseconds(1));
  };
  Dispatcher d(f.config, *f.transport, opt);
  ASSERT_TRUE(d.SetPlacement(f.Placement(1, {"good"})).ok());
  const Rows r(f, 5, 9);
  const ExpertRequest& req = r.request;
  const std::vector<float>& want = r.want;
  std::vector<float> got(want.size());
  constexpr int kDispatches = 100;
  for (int i = 0; i < kDispatches; ++i) {
    auto ticket = d.Submit(req);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    ASSERT_TRUE(d.Wait(*ticket, got.data()).ok());
    ASSERT_LT(testing::MaxAbsDiff(got, want), 1e-5) << "dispatch " << i;
  }
  settle(kDispatches);
  EXPECT_EQ(parts, kDispatches);
  EXPECT_EQ(stages_here, kDispatches);
  std::printf("polling Wait, prompt node: %d of %d replies taken on the waiting thread\n", parts_here.load(),
              parts.load());

  auto t = std::make_shared<PlacementTable>(*f.Placement(2, {"hung"}));
  t->nodes[0] = {"slow", slow.server->address(), ""};
  ASSERT_TRUE(d.SetPlacement(t).ok());
  constexpr int kSlow = 40;
  parts = parts_here = 0;
  for (int i = 0; i < kSlow; ++i) {
    auto ticket = d.Submit(req);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    const absl::Status s = d.Wait(*ticket, got.data());
    ASSERT_TRUE(s.ok()) << s;
  }
  settle(kSlow);
  EXPECT_EQ(parts, kSlow);
  EXPECT_GE(parts_here, kSlow / 2) << "the polling Wait took " << parts_here << " of " << parts << " late replies";
  std::printf("polling Wait, 10 ms node: %d of %d replies taken on the waiting thread\n", parts_here.load(),
              parts.load());

  ASSERT_TRUE(d.SetPlacement(f.Placement(3, {"hung"})).ok());
  const absl::Time t0 = absl::Now();
  auto ticket = d.Submit(req);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  const absl::Status s = d.Wait(*ticket, got.data());
  const absl::Duration took = absl::Now() - t0;
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("expert node hung did not answer within 200ms"), std::string::npos) << s;
  EXPECT_LT(took, absl::Milliseconds(900)) << "the poll window held the timeout up";
}

}  // namespace
}  // namespace k3::router

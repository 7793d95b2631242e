// Placement changes under load, on real processes (router, expert and attention nodes): an expert
// node joining and one leaving lose no request, and a change that stalls is abandoned while
// serving continues on the old placement.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "absl/time/clock.h"
#include "engine/engine.h"
#include "tests/load_loop.h"
#include "tests/testing.h"
#include "tools/client.h"
#include "tools/golden.h"
#include "tools/http_get.h"
#include "tools/local_cluster.h"

namespace k3 {
namespace {

std::string Model() { return testing::SourceDir() + "/tests/data/tiny-kimi-linear"; }

double RouterMetric(LocalCluster& c, const std::string& name, const std::string& labels = "") {
  auto m = HttpGet("127.0.0.1", c.router_metrics_port(), "/metrics");
  return m.ok() ? MetricValue(*m, name, labels) : -1;
}

// Polls until the router metric reaches `value` (or the timeout); returns the last value seen.
double WaitRouterMetric(LocalCluster& c, const std::string& name, const std::string& labels, double value, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  double v = RouterMetric(c, name, labels);
  while (v < value && absl::Now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    v = RouterMetric(c, name, labels);
  }
  return v;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Nothing the load sent failed, and every continuation is the golden one.
void ExpectNoLoss(testing::LoadLoop& load) {
  const auto failures = load.failures();
  EXPECT_TRUE(failures.empty()) << "first failure: " << (failures.empty() ? "" : failures[0]);
  EXPECT_EQ(load.mismatches(), 0) << "continuations that differ from the golden";
  std::printf("load: %d requests completed, %zu failed, %d wrong\n", load.ok(), failures.size(), load.mismatches());
}

ClusterOptions Options(int experts) {
  ClusterOptions o;
  o.bin_dir = K3SERVE_BIN_DIR;
  o.model = Model();
  o.attention = 1;
  o.experts = experts;
  return o;
}

// A third expert node joins, then the first leaves on SIGTERM, under 8 looping streams: every
// request completes with its golden continuation.
TEST(Rebalance, ExpertJoiningAndLeavingUnderLoadLosesNothing) {
  auto cluster = LocalCluster::Start(Options(2));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  auto golden = LoadGolden(Model());
  ASSERT_TRUE(golden.ok()) << golden.status();
  const double completed = WaitRouterMetric(c, "k3serve_rebalances_total", "completed", 1, absl::Seconds(10));
  testing::LoadLoop load(c.attention_addresses()[0], testing::GoldenPrompts(*golden), 8);
  load.WaitOk(8, absl::Seconds(20));

  ASSERT_TRUE(c.AddExpert().ok());
  EXPECT_GE(WaitRouterMetric(c, "k3serve_rebalances_total", "completed", completed + 1, absl::Seconds(20)), completed + 1);
  const double moved = RouterMetric(c, "k3serve_experts_moved_total");
  EXPECT_GT(moved, 0);
  load.WaitOk(load.ok() + 8, absl::Seconds(20));

  const absl::Time term = absl::Now();
  c.expert(0).Signal(SIGTERM);
  auto exit = c.expert(0).Wait(absl::Seconds(30));
  ASSERT_TRUE(exit.has_value()) << "expert-0 did not exit after SIGTERM";
  EXPECT_EQ(*exit, 0);
  std::printf("expert-0 left in %.2f s (it waited for the change to complete)\n", absl::ToDoubleSeconds(absl::Now() - term));
  EXPECT_GE(RouterMetric(c, "k3serve_rebalances_total", "completed"), completed + 2);
  load.WaitOk(load.ok() + 8, absl::Seconds(20));
  load.Stop();
  ExpectNoLoss(load);
  EXPECT_EQ(RouterMetric(c, "k3serve_rebalances_total", "abandoned"), 0);
  // The abandoned change still frees what it loaded before it ends.
  for (const absl::Time end = absl::Now() + absl::Seconds(5);
       RouterMetric(c, "k3serve_rebalance_in_progress") != 0 && absl::Now() < end;)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(RouterMetric(c, "k3serve_rebalance_in_progress"), 0);
  std::printf("placement v%.0f, %.0f slots moved in all\n", RouterMetric(c, "k3serve_placement_version"),
              RouterMetric(c, "k3serve_experts_moved_total"));
}

// A joining node that never gets ready (stopped right after it registered): the change is
// abandoned within the placement timeout, with a log line and a metric, and serving goes on over
// the old placement.
TEST(Rebalance, StalledChangeIsAbandonedAndServingContinues) {
  ClusterOptions o = Options(2);
  o.router_args = {"--placement-timeout-s=2", "--placement-settle-ms=800"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  auto golden = LoadGolden(Model());
  ASSERT_TRUE(golden.ok());
  ASSERT_GE(WaitRouterMetric(c, "k3serve_rebalances_total", "completed", 1, absl::Seconds(10)), 1);
  const double version = RouterMetric(c, "k3serve_placement_version");
  testing::LoadLoop load(c.attention_addresses()[0], testing::GoldenPrompts(*golden), 4);
  load.WaitOk(4, absl::Seconds(20));

  ASSERT_TRUE(c.AddExpert().ok());
  // Stop it once the router knows it, before the settle delay ends and its slots are asked for.
  ASSERT_EQ(WaitRouterMetric(c, "k3serve_router_expert_nodes", "", 3, absl::Seconds(5)), 3);
  c.expert(2).Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  EXPECT_EQ(WaitRouterMetric(c, "k3serve_rebalances_total", "abandoned", 1, absl::Seconds(10)), 1);
  const absl::Duration took = absl::Now() - stopped;
  EXPECT_LT(took, absl::Seconds(0.8 + 2 + 3));  // settle + timeout + slack
  std::printf("change abandoned %.2f s after the node stalled\n", absl::ToDoubleSeconds(took));
  EXPECT_EQ(RouterMetric(c, "k3serve_placement_version"), version);
  // The abandoned change still frees what it loaded before it ends.
  for (const absl::Time end = absl::Now() + absl::Seconds(5);
       RouterMetric(c, "k3serve_rebalance_in_progress") != 0 && absl::Now() < end;)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(RouterMetric(c, "k3serve_rebalance_in_progress"), 0);
  const std::string log = ReadFile(c.work_dir() + "/router.log");
  EXPECT_NE(log.find("abandoned: expert node expert-2 not ready"), std::string::npos) << log;
  load.WaitOk(load.ok() + 8, absl::Seconds(20));
  load.Stop();
  ExpectNoLoss(load);
  c.expert(2).Signal(SIGKILL);
  c.expert(2).Wait(absl::Seconds(5));
}

nlohmann::json ExpertLoad(LocalCluster& c) {
  auto body = HttpGet("127.0.0.1", c.router_metrics_port(), "/admin/expert_load");
  if (!body.ok()) return {};
  return nlohmann::json::parse(*body, nullptr, false);
}

// A model whose router bias makes expert popularity Zipf(1.2), on 1 attention and 3 expert nodes
// under 16 bounded streams: an on-demand rebalance (POST /admin/rebalance) evens the node load,
// nothing fails, and every greedy continuation (frozen routing) is the in-process engine's.
TEST(Rebalance, SkewedModelRebalancedUnderLoad) {
  const std::string dir = ::testing::TempDir() + "/k3_rebalance_zipf";
  std::filesystem::remove_all(dir);
  const std::string mk = std::string(K3SERVE_BIN_DIR) + "/k3serve-mkmodel --config " + testing::SourceDir() +
                         "/tools/configs/tiny-k3.json --out " + dir + " --seed 5 --router-skew zipf:1.2 > /dev/null";
  ASSERT_EQ(std::system(mk.c_str()), 0);
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<std::vector<int32_t>> prompts = {{1, 5, 77, 300}, {12, 9, 450, 33, 2, 101}, {7}, {200, 201, 202, 17, 88}};
  std::vector<std::vector<int32_t>> want;
  for (const auto& p : prompts) {
    auto w = GenerateGreedy(**model, p, 16);
    ASSERT_TRUE(w.ok());
    want.push_back(*w);
  }
  ClusterOptions o = Options(3);
  o.model = dir;
  o.router_args = {"--rebalance-after=0", "--load-interval=0.5", "--redundancy=0.25", "--expert-metrics-layers=1"};
  o.attention_args = {"--load-interval=0.25"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  std::atomic<int> done{0}, failed{0}, wrong{0};
  std::atomic<bool> stop{false};
  std::string first_error;
  std::mutex mu;
  std::vector<std::thread> streams;
  const int kStreams = 16, kMaxRequests = 60;  // bounded: each stream stops at the end or after this many
  for (int s = 0; s < kStreams; ++s)
    streams.emplace_back([&, s] {
      InferenceClient client(c.attention_addresses()[0]);
      for (int n = 0; n < kMaxRequests && !stop; ++n) {
        const size_t i = (s + n) % prompts.size();
        SamplingParams sp;
        sp.max_new_tokens = 16;
        sp.ignore_eos = true;
        auto r = client.Generate(prompts[i], sp, absl::Seconds(60));
        if (!r.ok()) {
          failed++;
          std::lock_guard<std::mutex> lock(mu);
          if (first_error.empty()) first_error = r.status().ToString();
        } else if (r->tokens != want[i]) {
          wrong++;
        }
        done++;
      }
    });
  // The load EMA over a few intervals, a rebalance, a few intervals more.
  auto ema_total = [&] {
    double sum = 0;
    for (const auto& l : ExpertLoad(c)["layers"])
      for (double v : l["tokens_ema"]) sum += v;
    return sum;
  };
  for (int i = 0; i < 500 && ema_total() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  nlohmann::json before = ExpertLoad(c);
  const double completed = RouterMetric(c, "k3serve_rebalances_total", "completed");
  httplib::Client admin("127.0.0.1", c.router_metrics_port());
  auto posted = admin.Post("/admin/rebalance");
  ASSERT_TRUE(posted && posted->status == 202);
  EXPECT_GE(WaitRouterMetric(c, "k3serve_rebalances_total", "completed", completed + 1, absl::Seconds(20)), completed + 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  nlohmann::json after = ExpertLoad(c);
  stop = true;
  for (auto& t : streams) t.join();
  EXPECT_EQ(failed, 0) << first_error;
  EXPECT_EQ(wrong, 0) << "continuations that differ from the in-process engine's";
  ASSERT_TRUE(before.contains("node_load_max_over_mean") && after.contains("node_load_max_over_mean"));
  const double b = before["node_load_max_over_mean"], a = after["node_load_max_over_mean"];
  std::printf("zipf:1.2 model, 3 expert nodes, %d requests (%d failed, %d wrong): node load max/mean %.3f before the rebalance "
              "(placement v%d), %.3f after (v%d)\n",
              done.load(), failed.load(), wrong.load(), b, before["placement_version"].get<int>(), a,
              after["placement_version"].get<int>());
  for (size_t l = 0; l < before["layers"].size(); ++l)
    std::printf("  layer %d: expert max/mean %.2f; node max/mean %.3f -> %.3f\n", before["layers"][l]["layer"].get<int>(),
                before["layers"][l]["expert_max_over_mean"].get<double>(), before["layers"][l]["node_load_max_over_mean"].get<double>(),
                after["layers"][l]["node_load_max_over_mean"].get<double>());
  EXPECT_GT(before["layers"][0]["expert_max_over_mean"].get<double>(), 2.0) << "the skewed model should load its experts unevenly";
  EXPECT_LT(a, b);
  // The QB histograms reached the router: its bias step lowers the most loaded expert of a layer
  // and raises the least loaded one.
  const auto& layer = after["layers"][0];
  const std::vector<double> ema = layer["tokens_ema"];
  const std::vector<double> step = layer["qb_bias_step"];
  ASSERT_EQ(step.size(), ema.size());
  const size_t hot = std::max_element(ema.begin(), ema.end()) - ema.begin();
  const size_t cold = std::min_element(ema.begin(), ema.end()) - ema.begin();
  EXPECT_LT(step[hot], 0) << "expert " << hot;
  EXPECT_GT(step[cold], 0) << "expert " << cold;
  std::printf("QB bias step of layer %d: hottest expert %zu %.4f, coldest %zu %+.4f\n", layer["layer"].get<int>(), hot, step[hot],
              cold, step[cold]);
  // Per-expert series only for the layers asked for; frozen routing in use.
  EXPECT_GT(RouterMetric(c, "k3serve_expert_tokens_total", "layer=\"1\""), 0);
  EXPECT_EQ(RouterMetric(c, "k3serve_expert_tokens_total", "layer=\"2\""), 0);
  EXPECT_EQ(RouterMetric(c, "k3serve_routing_mode", "mode=\"frozen\""), 1);
  EXPECT_GE(RouterMetric(c, "k3serve_experts_moved_total"), 1);
  std::filesystem::remove_all(dir);
}

// Per MoE layer: max/mean of the tokens each expert got between two /admin/expert_load snapshots.
std::vector<double> ExpertImbalance(const nlohmann::json& from, const nlohmann::json& to) {
  std::vector<double> out;
  for (size_t l = 0; l < to["layers"].size(); ++l) {
    const std::vector<double> a = from["layers"][l]["tokens"], b = to["layers"][l]["tokens"];
    double sum = 0, max = 0;
    for (size_t e = 0; e < b.size(); ++e) {
      sum += b[e] - a[e];
      max = std::max(max, b[e] - a[e]);
    }
    out.push_back(sum > 0 ? max * b.size() / sum : 0);
  }
  return out;
}

// Adaptive routing on the zipf:1.2 model: the router's QB bias, bounded per interval, brings every
// layer's expert imbalance to <= 1.2 within 10 load intervals; nothing fails meanwhile.
TEST(Rebalance, AdaptiveRoutingBalancesExperts) {
  const std::string dir = ::testing::TempDir() + "/k3_adaptive_zipf";
  std::filesystem::remove_all(dir);
  const std::string mk = std::string(K3SERVE_BIN_DIR) + "/k3serve-mkmodel --config " + testing::SourceDir() +
                         "/tools/configs/tiny-k3.json --out " + dir + " --seed 5 --router-skew zipf:1.2 > /dev/null";
  ASSERT_EQ(std::system(mk.c_str()), 0);
  ClusterOptions o = Options(3);
  o.model = dir;
  o.router_args = {"--routing-mode=adaptive", "--qb-max-step=0.05", "--load-interval=0.5", "--rebalance-after=0"};
  o.attention_args = {"--load-interval=0.25"};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;
  std::atomic<bool> stop{false};
  std::atomic<int> done{0}, failed{0};
  std::vector<std::thread> streams;
  for (int s = 0; s < 16; ++s)
    streams.emplace_back([&, s] {
      InferenceClient client(c.attention_addresses()[0]);
      for (int n = 0; n < 400 && !stop; ++n) {
        SamplingParams sp;
        sp.max_new_tokens = 16;
        sp.ignore_eos = true;
        auto r = client.Generate({1 + s, 5 + n % 7, 77, 300}, sp, absl::Seconds(60));
        failed += !r.ok();
        done++;
      }
    });
  auto total = [](const nlohmann::json& j) {
    double sum = 0;
    for (const auto& l : j["layers"])
      for (double v : l["tokens"]) sum += v;
    return sum;
  };
  nlohmann::json start = ExpertLoad(c);
  for (int i = 0; i < 500 && total(start) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    start = ExpertLoad(c);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // two intervals, barely corrected yet
  const nlohmann::json early = ExpertLoad(c);
  std::this_thread::sleep_for(std::chrono::milliseconds(4000));  // ten intervals from the start
  const nlohmann::json settled = ExpertLoad(c);
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // measured over six more
  const nlohmann::json end = ExpertLoad(c);
  stop = true;
  for (auto& t : streams) t.join();
  EXPECT_EQ(failed, 0);
  const std::vector<double> before = ExpertImbalance(start, early), after = ExpertImbalance(settled, end);
  std::printf("adaptive routing, zipf:1.2 model, %d requests (%d failed), bias v%d: expert max/mean per layer\n", done.load(),
              failed.load(), end["bias_version"].get<int>());
  for (size_t l = 0; l < after.size(); ++l) {
    std::printf("  layer %d: %.3f in the first 2 intervals, %.3f after 10\n", end["layers"][l]["layer"].get<int>(), before[l], after[l]);
    EXPECT_LE(after[l], 1.2) << "layer " << end["layers"][l]["layer"];
  }
  EXPECT_EQ(RouterMetric(c, "k3serve_routing_mode", "mode=\"adaptive\""), 1);
  EXPECT_GT(RouterMetric(c, "k3serve_routing_bias_version"), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace k3

// Placement changes under load, on real processes (router, expert and attention nodes): an expert
// node joining and one leaving lose no request, and a change that stalls is abandoned while
// serving continues on the old placement.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/time/clock.h"
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

// `streams` clients generating the golden greedy continuations in a loop; every result is checked.
class Load {
 public:
  Load(const std::string& address, const Golden& golden, int streams) {
    for (int i = 0; i < streams; ++i)
      threads_.emplace_back([this, address, &golden, i] {
        InferenceClient client(address);
        for (int n = 0; !stop_; ++n) {
          const auto& p = golden.prompts[(i + n) % golden.prompts.size()];
          SamplingParams sp;
          sp.max_new_tokens = static_cast<int>(p.greedy_ids.size());
          sp.ignore_eos = true;
          auto r = client.Generate(p.input_ids, sp, absl::Seconds(60));
          std::lock_guard<std::mutex> lock(mu_);
          if (!r.ok()) {
            failed_++;
            if (first_error_.empty()) first_error_ = r.status().ToString();
          } else if (r->tokens != p.greedy_ids) {
            wrong_++;
          } else {
            ok_++;
          }
        }
      });
  }
  ~Load() { Stop(); }
  void Stop() {
    stop_ = true;
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }
  int ok() {
    std::lock_guard<std::mutex> lock(mu_);
    return ok_;
  }
  void WaitOk(int n, absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (ok() < n && absl::Now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  void Expect() {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_EQ(failed_, 0) << "first failure: " << first_error_;
    EXPECT_EQ(wrong_, 0) << "continuations that differ from the golden";
    std::printf("load: %d requests completed, %d failed, %d wrong\n", ok_, failed_, wrong_);
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
  std::mutex mu_;
  int ok_ = 0, failed_ = 0, wrong_ = 0;
  std::string first_error_;
};

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
  Load load(c.attention_addresses()[0], *golden, 8);
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
  load.Expect();
  EXPECT_EQ(RouterMetric(c, "k3serve_rebalances_total", "abandoned"), 0);
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
  Load load(c.attention_addresses()[0], *golden, 4);
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
  EXPECT_EQ(RouterMetric(c, "k3serve_rebalance_in_progress"), 0);
  const std::string log = ReadFile(c.work_dir() + "/router.log");
  EXPECT_NE(log.find("abandoned: expert node expert-2 not ready"), std::string::npos) << log;
  load.WaitOk(load.ok() + 8, absl::Seconds(20));
  load.Stop();
  load.Expect();
  c.expert(2).Signal(SIGKILL);
  c.expert(2).Wait(absl::Seconds(5));
}

}  // namespace
}  // namespace k3

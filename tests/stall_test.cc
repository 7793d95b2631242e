// An expert node that stalls briefly (SIGSTOP for longer than the dispatch timeout, then SIGCONT)
// under streams through the gateway, with real processes. The attention node judges it hung; that
// verdict fails only the requests whose rows were in the dispatches it left unanswered, and
// serving goes on as soon as the node answers again: a suspect node without a replica still gets
// its rows, the attention node stays SERVING, and the gateway does not set aside an attention node
// that itself answered UNAVAILABLE.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "tests/cluster_testing.h"
#include "tools/client.h"
#include "tools/http_get.h"
#include "tools/local_cluster.h"

namespace k3 {
namespace {

using testing::Greedy;
using testing::TinyCluster;

struct Outcome {
  absl::Time start, end;
  absl::Status status;
};

TEST(ExpertStall, BriefStallFailsOnlyTheDispatchesInFlight) {
  constexpr int kStreams = 8;
  const absl::Duration timeout = absl::Milliseconds(400), stall = absl::Milliseconds(700);
  ClusterOptions o = TinyCluster(1, 2);
  o.gateway = true;
  o.attention_args = {absl::StrCat("--dispatch-timeout-ms=", absl::ToInt64Milliseconds(timeout))};
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  LocalCluster& c = **cluster;

  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<Outcome> outcomes;
  std::vector<std::thread> streams;
  for (int i = 0; i < kStreams; ++i)
    streams.emplace_back([&, i] {
      InferenceClient client(c.gateway_address());
      while (!stop) {
        const absl::Time start = absl::Now();
        auto r = client.Generate({1, 5 + i, 9, 14, 3}, Greedy(12), absl::Seconds(30));
        std::lock_guard<std::mutex> lock(mu);
        outcomes.push_back({start, absl::Now(), r.ok() ? absl::OkStatus() : r.status()});
      }
    });
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const absl::Time stopped = absl::Now();
  c.expert(1).Signal(SIGSTOP);
  absl::SleepFor(stall);
  c.expert(1).Signal(SIGCONT);
  const absl::Time resumed = absl::Now();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  stop = true;
  for (auto& t : streams) t.join();

  // The stall was judged a hang (else this test shows nothing).
  auto metrics = HttpGet("127.0.0.1", c.attention_metrics_ports()[0], "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const double verdicts = MetricValue(*metrics, "k3serve_expert_node_unreachable_total", "node=\"expert-1\"");
  EXPECT_GE(verdicts, 1) << "the stall was not judged a hang";

  // Each stream has one request at a time, and each failure waited for a verdict (one timeout):
  // while the node is stopped a stream loses at most one request per timeout, plus the one that
  // was in flight when the stall began.
  const int bound = kStreams * static_cast<int>(stall / timeout + 2);
  const absl::Time settled = resumed + absl::Seconds(1);
  int before = 0, around_ok = 0, failed = 0, after = 0;
  std::vector<std::string> wrong;  // failures that the stall does not explain (the first few)
  auto explain = [&](const Outcome& r, const std::string& why) {
    if (wrong.size() < 5)
      wrong.push_back(absl::StrCat(why, " (started ", absl::FormatDuration(r.start - resumed), " after SIGCONT): ",
                                   r.status.ToString()));
  };
  int unexplained = 0;
  for (const Outcome& r : outcomes) {
    if (r.status.ok()) {
      r.end < stopped ? before++ : r.start < settled ? around_ok++ : after++;
      continue;
    }
    failed++;
    if (r.end < stopped || r.start >= resumed) {
      ++unexplained;
      explain(r, r.end < stopped ? "failed before the stall" : "admitted after the node answered again");
    } else if (!absl::IsUnavailable(r.status) || r.status.message().find("expert node expert-1") == std::string::npos) {
      ++unexplained;
      explain(r, "not UNAVAILABLE naming the stalled node");
    }
  }
  std::printf("stall %s (dispatch timeout %s): %.0f hang verdict(s); requests: %d ok before, %d ok + %d failed around it "
              "(bound %d), %d ok after\n",
              absl::FormatDuration(stall).c_str(), absl::FormatDuration(timeout).c_str(), verdicts, before, around_ok,
              failed, bound, after);
  EXPECT_EQ(unexplained, 0) << absl::StrJoin(wrong, "\n");
  EXPECT_LE(failed, bound);
  EXPECT_GT(after, 2 * kStreams);
}

}  // namespace
}  // namespace k3

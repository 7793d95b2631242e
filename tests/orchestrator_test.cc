// The orchestrator with its local backend, with real processes: it spawns the attention and
// expert nodes, scales both pools under load, and restores a killed node.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
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

std::string ModelDir() { return testing::SourceDir() + "/tests/data/tiny-kimi-linear"; }

ClusterOptions Orchestrated(int attention, int experts) {
  ClusterOptions o;
  o.bin_dir = K3SERVE_BIN_DIR;
  o.model = ModelDir();
  o.attention = attention;
  o.experts = experts;
  o.orchestrated = true;
  o.orchestrator_args = {"--interval=0.5", "--drain-timeout=20"};
  return o;
}

// The golden prompts with the in-process engine's greedy continuations.
std::vector<testing::Prompt> EnginePrompts() {
  auto golden = LoadGolden(ModelDir());
  EXPECT_TRUE(golden.ok()) << golden.status();
  auto model = Model::Load(ModelDir());
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<testing::Prompt> out;
  if (!golden.ok() || !model.ok()) return out;
  LocalExpertExecutor experts((*model)->config(), (*model)->weights());
  CpuBackend backend(**model, experts);
  Engine engine(backend);
  for (size_t i = 0; i < golden->prompts.size(); ++i) {
    SamplingParams p;
    p.max_new_tokens = static_cast<int>(golden->prompts[i].greedy_ids.size());
    p.ignore_eos = true;
    EXPECT_TRUE(engine.Add(i, golden->prompts[i].input_ids, p).ok());
    out.push_back({golden->prompts[i].input_ids, {}});
  }
  while (engine.HasWork())
    for (const StepOutput& o : engine.Step()) out[o.id].expected.insert(out[o.id].expected.end(), o.tokens.begin(), o.tokens.end());
  return out;
}

double Metric(int port, const std::string& name, const std::string& filter = "") {
  auto m = HttpGet("127.0.0.1", port, "/metrics");
  return m.ok() ? MetricValue(*m, name, filter) : -1;
}

// Whether a process has ended: gone, or a zombie nobody has reaped yet.
bool Ended(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string pid_field, comm, state;
  return !(stat >> pid_field >> comm >> state) || state == "Z";
}

// An owner killed with SIGKILL (it cannot stop its children) leaves none of them running: the
// local backend's nodes end with the orchestrator, `k3serve up`'s with it.
TEST(Process, EndsWhenItsOwnerIsKilled) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t owner = ::fork();
  ASSERT_GE(owner, 0);
  if (owner == 0) {
    ::close(fds[0]);
    const std::string log = ::testing::TempDir() + "/k3serve-sleeper-" + std::to_string(::getpid()) + ".log";
    auto child = Process::Spawn("sleeper", {"/bin/sleep", "60"}, log);
    const pid_t pid = child.ok() ? (*child)->pid() : -1;
    (void)!::write(fds[1], &pid, sizeof(pid));
    ::pause();
    ::_exit(0);
  }
  ::close(fds[1]);
  pid_t child = -1;
  ASSERT_EQ(::read(fds[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  ::close(fds[0]);
  ASSERT_GT(child, 0);
  EXPECT_FALSE(Ended(child));
  ::kill(owner, SIGKILL);
  ::waitpid(owner, nullptr, 0);
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!Ended(child) && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(Ended(child)) << "pid " << child << " outlived its owner";
  if (!Ended(child)) ::kill(child, SIGKILL);
}

// Under 12 running streams for 60 s, experts 2 -> 3 -> 2 and attention 1 -> 2 -> 1 through the
// admin endpoint: no request fails and every output is the in-process engine's.
TEST(Orchestrator, ScalesBothPoolsUnderLoadWithoutLoss) {
  auto cluster = LocalCluster::Start(Orchestrated(1, 2));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string orch = (*cluster)->orchestrator_address();
  const std::string admin = (*cluster)->admin_token_file();
  const auto prompts = EnginePrompts();
  ASSERT_FALSE(prompts.empty());
  // Out of bounds: the CLI fails with the reason.
  {
    const std::string cmd = std::string(K3SERVE_BIN_DIR) + "/k3serve scale --orchestrator " + orch + " --admin-token-file " + admin +
                            " --experts 99 2>&1";
    FILE* f = ::popen(cmd.c_str(), "r");
    ASSERT_NE(f, nullptr);
    char buf[512] = {0};
    std::string out;
    while (std::fgets(buf, sizeof(buf), f)) out += buf;
    EXPECT_NE(::pclose(f), 0);
    EXPECT_NE(out.find("experts = 99 is outside [1, 16]"), std::string::npos) << out;
  }
  // Pinned, so that only these targets move the pools.
  ASSERT_TRUE(ScalePools(orch, 1, 2, absl::Seconds(30), admin).ok());
  const absl::Time start = absl::Now();
  testing::LoadLoop load((*cluster)->gateway_address(), prompts, 12);
  std::this_thread::sleep_for(std::chrono::seconds(3));
  struct Step {
    std::optional<int> attention, experts;
  };
  for (Step s : {Step{std::nullopt, 3}, Step{2, std::nullopt}, Step{std::nullopt, 2}, Step{1, std::nullopt}}) {
    const absl::Time t0 = absl::Now();
    auto pools = ScalePools(orch, s.attention, s.experts, absl::Seconds(40), admin);
    ASSERT_TRUE(pools.ok()) << pools.status();
    const absl::Duration took = absl::Now() - t0;
    std::this_thread::sleep_for(std::chrono::seconds(3));
    // Failures of this change: from the call until the next one (requests in flight meanwhile).
    std::printf("%s -> %d reached in %.2f s (at %.1f s, %d requests done, %d failed during the change)\n",
                s.attention ? "attention" : "experts", s.attention ? *s.attention : *s.experts, absl::ToDoubleSeconds(took),
                absl::ToDoubleSeconds(t0 - start), load.ok(), load.failures_between(t0, absl::Now()));
  }
  // Measured under load: attention time per step against expert time per step.
  const double ratio = Metric((*cluster)->orchestrator_metrics_port(), "k3serve_attention_expert_ratio");
  std::printf("balanced attention:expert ratio under load: %.3f\n", ratio);
  EXPECT_GT(ratio, 0);
  const absl::Duration rest = absl::Seconds(60) - (absl::Now() - start);
  if (rest > absl::ZeroDuration()) absl::SleepFor(rest);
  load.Stop();
  const auto failures = load.failures();
  std::printf("60 s under 12 streams: %d requests completed, %zu failed, %d differed from the engine\n", load.ok(),
              failures.size(), load.mismatches());
  EXPECT_TRUE(failures.empty()) << failures.size() << " failed, first: " << failures[0];
  EXPECT_EQ(load.mismatches(), 0);
  EXPECT_GT(load.ok(), 12);
  const int m = (*cluster)->orchestrator_metrics_port();
  for (const char* pool : {"attention", "experts"})
    for (const char* dir : {"up", "down"})
      EXPECT_GE(Metric(m, "k3serve_scaling_events_total", absl::StrCat("direction=\"", dir, "\",pool=\"", pool, "\"")), 1)
          << pool << " " << dir;
  EXPECT_GE(Metric(m, "k3serve_drain_duration_seconds_count", "pool=\"attention\""), 1);
  EXPECT_EQ(Metric(m, "k3serve_pool_actual_replicas", "pool=\"experts\""), 2);
}

// The attention pool follows the load by itself: 8 streams against a target of 2 per node grow it
// to its max, and with the load gone it shrinks back after the cooldown; no request fails.
TEST(Orchestrator, AttentionPoolFollowsTheLoad) {
  ClusterOptions o = Orchestrated(1, 2);
  o.orchestrator_args.insert(o.orchestrator_args.end(),
                             {"--attention-target-requests=2", "--sustain=2", "--cooldown=3", "--attention-max=2",
                              "--experts-min=2", "--experts-max=2", "--balance=false"});
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string orch = (*cluster)->orchestrator_address();
  auto attention = [&](int* desired, std::string* reason) {
    auto pools = GetPools(orch);
    int actual = -1;
    if (pools.ok())
      for (const auto& p : pools->pools())
        if (p.pool() == "attention") {
          actual = p.actual();
          *desired = p.desired();
          *reason = p.last_reason();
        }
    return actual;
  };
  const absl::Time start = absl::Now();
  auto load = std::make_unique<testing::LoadLoop>((*cluster)->gateway_address(), EnginePrompts(), 8);
  int desired = 0;
  std::string reason;
  while (!(attention(&desired, &reason) == 2 && desired == 2) && absl::Now() - start < absl::Seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const absl::Duration up = absl::Now() - start;
  ASSERT_EQ(desired, 2) << "the attention pool did not grow under load";
  EXPECT_EQ(reason, "load_high");
  std::this_thread::sleep_for(std::chrono::seconds(2));
  load->Stop();
  const auto failures = load->failures();
  const int done = load->ok();
  load.reset();
  const absl::Time idle = absl::Now();
  while (!(attention(&desired, &reason) == 1 && desired == 1) && absl::Now() - idle < absl::Seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::printf("attention 1 -> 2 after %.1f s of load, back to 1 %.1f s after it stopped; %d requests, %zu failed\n",
              absl::ToDoubleSeconds(up), absl::ToDoubleSeconds(absl::Now() - idle), done, failures.size());
  EXPECT_EQ(desired, 1) << "the attention pool did not shrink without load";
  EXPECT_EQ(reason, "load_low");
  EXPECT_TRUE(failures.empty()) << failures.size() << " failed, first: " << failures[0];
}

// SIGKILL of an expert node under load: the orchestrator restarts it and the router re-places;
// requests fail only with UNAVAILABLE, and new ones succeed.
TEST(Orchestrator, RestoresAKilledExpertNode) {
  auto cluster = LocalCluster::Start(Orchestrated(1, 2));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string orch = (*cluster)->orchestrator_address();
  const std::string admin = (*cluster)->admin_token_file();
  ASSERT_TRUE(ScalePools(orch, 1, 2, absl::Seconds(30), admin).ok());
  const auto prompts = EnginePrompts();
  testing::LoadLoop load((*cluster)->gateway_address(), prompts, 6);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  auto pools = GetPools(orch);
  ASSERT_TRUE(pools.ok()) << pools.status();
  int64_t pid = 0;
  for (const auto& p : pools->pools())
    if (p.pool() == "experts") pid = p.replicas(0).pid();
  ASSERT_GT(pid, 0);
  const absl::Time killed = absl::Now();
  ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGKILL), 0);
  // Restored: restarted, ready, in the complete placement, and a new request succeeds.
  bool restarted = false;
  while (!restarted && absl::Now() - killed < absl::Seconds(30)) {
    auto now = GetPools(orch);
    if (now.ok())
      for (const auto& p : now->pools())
        for (const auto& r : p.replicas()) restarted = restarted || r.restarts() > 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(restarted);
  ASSERT_TRUE(WaitPools(orch, std::nullopt, 2, absl::Seconds(30)).ok());
  InferenceClient client((*cluster)->gateway_address());
  absl::StatusOr<GenerateResult> r = absl::UnknownError("not run");
  SamplingParams sp;
  sp.max_new_tokens = static_cast<int>(prompts[0].expected.size());
  sp.ignore_eos = true;
  for (int i = 0; i < 100 && !(r = client.Generate(prompts[0].ids, sp, absl::Seconds(30))).ok(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const absl::Duration recover = absl::Now() - killed;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens, prompts[0].expected);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  load.Stop();
  const auto failures = load.failures();
  std::printf("expert node SIGKILLed under 6 streams: pool restored and serving in %.2f s; %d requests completed, %zu failed\n",
              absl::ToDoubleSeconds(recover), load.ok(), failures.size());
  for (const std::string& f : failures) EXPECT_EQ(f.rfind("UNAVAILABLE", 0), 0u) << f;
  EXPECT_EQ(load.mismatches(), 0);
  // New requests all succeed.
  for (size_t i = 0; i < 4; ++i) {
    const auto& p = prompts[i % prompts.size()];
    sp.max_new_tokens = static_cast<int>(p.expected.size());
    auto after = client.Generate(p.ids, sp, absl::Seconds(30));
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->tokens, p.expected);
  }
}

}  // namespace
}  // namespace k3

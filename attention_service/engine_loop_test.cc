// The engine loop's admission window: requests that reach an idle engine a little apart are
// prefilled in one step; without the window the first one runs alone.
#include "attention_service/engine_loop.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "absl/time/clock.h"
#include "engine/model.h"

namespace k3 {
namespace {

// The sequences running in the loop's first step, for two requests added `gap` apart.
int64_t RunningInFirstStep(absl::Duration window, absl::Duration gap, int64_t max_running = 4) {
  auto model = Model::Load(std::string(K3SERVE_SOURCE_DIR) + "/tests/data/tiny-kimi-linear");
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return -1;
  LocalExpertExecutor experts((*model)->config(), (*model)->weights());
  CpuBackend backend(**model, experts);
  EngineOptions eo;
  eo.max_running = max_running;
  std::atomic<int64_t> first{-1};
  auto bell = std::make_shared<Bell>([] {});
  std::vector<std::shared_ptr<TokenStream>> streams;
  std::vector<int> tokens(2, 0);
  EngineLoop loop(
      backend, eo,
      [&](const EngineStats& s, absl::Duration took) {
        int64_t unset = -1;
        if (took > absl::ZeroDuration()) first.compare_exchange_strong(unset, s.running);
      },
      window);
  SamplingParams p;
  p.max_new_tokens = 2;
  p.ignore_eos = true;
  streams.push_back(loop.Add(1, {5, 6, 7}, p, bell));
  absl::SleepFor(gap);
  streams.push_back(loop.Add(2, {8, 9, 10}, p, bell));
  // Both finish on their own (Stop would end the window early).
  const absl::Time end = absl::Now() + absl::Seconds(60);
  while ((tokens[0] < 2 || tokens[1] < 2) && absl::Now() < end) {
    for (size_t i = 0; i < streams.size(); ++i)
      for (const StepOutput& o : streams[i]->Take()) {
        EXPECT_NE(o.finish, FinishReason::kError) << o.error;
        tokens[i] += static_cast<int>(o.tokens.size());
      }
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(tokens[0], 2);
  EXPECT_EQ(tokens[1], 2);
  return first;
}

TEST(EngineLoop, AdmissionWindowPrefillsABurstTogether) {
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(RunningInFirstStep(absl::Milliseconds(300), absl::Milliseconds(20)), 2);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(300)) << "the window did not hold the first step";
}

TEST(EngineLoop, WithoutAWindowTheFirstRequestStepsAlone) {
  EXPECT_EQ(RunningInFirstStep(absl::ZeroDuration(), absl::Milliseconds(200)), 1);
}

TEST(EngineLoop, TheWindowEndsOnceMaxRunningAreQueued) {
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(RunningInFirstStep(absl::Seconds(60), absl::Milliseconds(1), /*max_running=*/2), 2);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(30)) << "waited out the window with max_running queued";
}

}  // namespace
}  // namespace k3

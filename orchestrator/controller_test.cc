// Hysteresis, cooldown and bounds keep a noisy signal from flapping a pool.
#include "orchestrator/controller.h"

#include <gtest/gtest.h>

#include <random>

namespace k3::orchestrator {
namespace {

PoolPolicy Policy() {
  PoolPolicy p;
  p.min_replicas = 1;
  p.max_replicas = 4;
  p.scale_up_at = 0.8;
  p.scale_down_at = 0.3;
  p.sustain = 3;
  p.cooldown = absl::Seconds(30);
  return p;
}

Pressure Load(double v) {
  Pressure p;
  p.load = v;
  return p;
}

// A signal that hovers around a threshold, crossing it often, never changes the pool.
TEST(PoolController, NoisySignalAroundTheThresholdDoesNotFlap) {
  PoolController c(Policy(), 2);
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> noise(-0.25, 0.25);
  absl::Time t = absl::UnixEpoch();
  int changes = 0;
  for (int i = 0; i < 2000; ++i, t += absl::Seconds(1)) {
    // Above 0.8 at most two intervals in a row, then back under: never sustained.
    const double v = (i % 3 == 2) ? 0.6 : 0.8 + std::abs(noise(rng)) + 0.01;
    changes += c.Observe(t, Load(v), c.desired()).changed;
  }
  EXPECT_EQ(changes, 0);
  EXPECT_EQ(c.desired(), 2);
}

// A sustained rise grows the pool once per cooldown, not once per interval.
TEST(PoolController, SustainedLoadGrowsOncePerCooldown) {
  PoolController c(Policy(), 1);
  absl::Time t = absl::UnixEpoch();
  std::vector<int> sizes;
  for (int i = 0; i < 100; ++i, t += absl::Seconds(1)) {
    Decision d = c.Observe(t, Load(1.5), c.desired());
    if (d.changed) {
      EXPECT_EQ(d.reason, Reason::kLoadHigh);
      sizes.push_back(d.desired);
    }
  }
  // Grows at t=2 (3rd interval), then every 30 s at most, and stops at max.
  EXPECT_EQ(sizes, (std::vector<int>{2, 3, 4}));
  EXPECT_EQ(c.Observe(t, Load(1.5), 4).reason, Reason::kAtMax);
}

// Noise that alternates high and low every interval: neither streak builds; and right after a
// change, the cooldown holds the pool even if the signal flips.
TEST(PoolController, AlternatingSignalAndCooldownAfterChange) {
  PoolController c(Policy(), 2);
  absl::Time t = absl::UnixEpoch();
  int changes = 0;
  for (int i = 0; i < 500; ++i, t += absl::Seconds(1)) changes += c.Observe(t, Load(i % 2 ? 2.0 : 0.0), 2).changed;
  EXPECT_EQ(changes, 0);
  c.Observe(t, Load(0.5), 2);  // in the band: no streak carries over
  t += absl::Seconds(1);
  for (int i = 0; i < 3; ++i, t += absl::Seconds(1)) c.Observe(t, Load(2.0), 2);
  ASSERT_EQ(c.desired(), 3);
  // Immediately idle: shrinking waits out the cooldown.
  Decision d;
  for (int i = 0; i < 29; ++i, t += absl::Seconds(1)) {
    d = c.Observe(t, Load(0.0), 3);
    EXPECT_FALSE(d.changed) << i;
  }
  EXPECT_EQ(d.reason, Reason::kCooldown);
  for (int i = 0; i < 3 && !d.changed; ++i, t += absl::Seconds(1)) d = c.Observe(t, Load(0.0), 3);
  EXPECT_TRUE(d.changed);
  EXPECT_EQ(d.reason, Reason::kLoadLow);
  EXPECT_EQ(c.desired(), 2);
}

// A shrink that would push the survivors over the grow threshold does not happen.
TEST(PoolController, ShrinkThatWouldOverloadTheRestIsHeld) {
  PoolPolicy p = Policy();
  p.scale_down_at = 0.5;
  PoolController c(p, 2);
  absl::Time t = absl::UnixEpoch() + absl::Hours(1);
  // 0.45 on 2 nodes is 0.9 on one: above 0.8.
  for (int i = 0; i < 50; ++i, t += absl::Seconds(1)) EXPECT_FALSE(c.Observe(t, Load(0.45), 2).changed);
  EXPECT_EQ(c.desired(), 2);
}

TEST(PoolController, LatencyAndMemoryNameTheReasonAndUnmeasuredHolds) {
  PoolController c(Policy(), 1);
  absl::Time t = absl::UnixEpoch();
  Pressure p;
  p.load = 0.1;
  p.latency = 1.4;
  Decision d;
  for (int i = 0; i < 3; ++i, t += absl::Seconds(1)) d = c.Observe(t, p, 1);
  EXPECT_TRUE(d.changed);
  EXPECT_EQ(d.reason, Reason::kLatencyHigh);
  PoolController m(Policy(), 1);
  p = {};
  p.memory = 0.95;
  for (int i = 0; i < 3; ++i, t += absl::Seconds(1)) d = m.Observe(t, p, 1);
  EXPECT_EQ(d.reason, Reason::kMemoryHigh);
  PoolController u(Policy(), 2);
  for (int i = 0; i < 10; ++i, t += absl::Seconds(1)) EXPECT_EQ(u.Observe(t, Pressure{}, 2).reason, Reason::kHold);
}

TEST(PoolController, ManualTargetsHoldAndAreBounded) {
  PoolController c(Policy(), 1);
  absl::Time t = absl::UnixEpoch();
  EXPECT_EQ(c.SetManual(5, t).value_or(""), "5 is outside [1, 4]");
  EXPECT_FALSE(c.SetManual(3, t).has_value());
  for (int i = 0; i < 100; ++i, t += absl::Seconds(1)) EXPECT_EQ(c.Observe(t, Load(0.0), 3).reason, Reason::kManual);
  EXPECT_EQ(c.desired(), 3);
  EXPECT_EQ(c.Nudge(t, 1).reason, Reason::kManual);
  c.Automatic();
  EXPECT_EQ(c.Nudge(t, 1).desired, 2);  // one step at a time
  EXPECT_EQ(c.Nudge(t + absl::Seconds(1), 1).reason, Reason::kCooldown);
}

}  // namespace
}  // namespace k3::orchestrator

// The sizing decision for one pool, one interval at a time: hysteresis (the signal must stay
// beyond a threshold for `sustain` intervals, and a shrink must not push the pool straight back
// over the grow threshold), a per-pool cooldown after every change, and min/max replicas.
#pragma once

#include <optional>
#include <string>

#include "absl/time/time.h"

namespace k3::orchestrator {

enum class Pool { kAttention, kExperts };
const char* PoolName(Pool p);  // "attention", "experts"

struct PoolPolicy {
  int min_replicas = 1;
  int max_replicas = 8;
  double scale_up_at = 0.8;    // pressure (1 = at target) above which the pool grows
  double scale_down_at = 0.3;  // pressure below which it shrinks
  int sustain = 3;             // consecutive intervals beyond a threshold before acting
  absl::Duration cooldown = absl::Seconds(30);
};

// How hard the pool is pushed, each as a fraction of its target (1 = at target; < 0: not measured).
struct Pressure {
  double load = -1;     // attention: running + waiting per node; experts: busy ratio
  double latency = -1;  // attention: inter-token latency against --itl-target
  double memory = -1;   // per-node state (attention) or slot (experts) memory against its budget
  double Max() const;
};

// Bounded: these are the label values of k3serve_scaling_decisions_total{reason}.
enum class Reason { kHold, kCooldown, kLoadHigh, kLatencyHigh, kMemoryHigh, kLoadLow, kBalance, kManual, kAtMin, kAtMax };
const char* ReasonName(Reason r);

struct Decision {
  int desired = 0;
  Reason reason = Reason::kHold;
  bool changed = false;  // desired differs from the interval before
};

class PoolController {
 public:
  PoolController(PoolPolicy policy, int initial);

  // One interval's signal with `nodes` ready replicas.
  Decision Observe(absl::Time now, const Pressure& p, int nodes);
  // One step towards `target` (the balanced ratio), if out of cooldown and within min/max.
  Decision Nudge(absl::Time now, int target);
  // A size set by hand holds until Automatic(); INVALID_ARGUMENT outside min/max.
  std::optional<std::string> SetManual(int replicas, absl::Time now);
  void Automatic() { manual_ = false; }

  int desired() const { return desired_; }
  bool manual() const { return manual_; }
  bool in_cooldown(absl::Time now) const { return now - last_change_ < policy_.cooldown; }
  const PoolPolicy& policy() const { return policy_; }

 private:
  Decision Change(absl::Time now, int to, Reason why);

  const PoolPolicy policy_;
  int desired_;
  bool manual_ = false;
  int up_streak_ = 0;
  int down_streak_ = 0;
  absl::Time last_change_ = absl::InfinitePast();
};

}  // namespace k3::orchestrator

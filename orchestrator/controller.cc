#include "orchestrator/controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace k3::orchestrator {

const char* PoolName(Pool p) { return p == Pool::kAttention ? "attention" : "experts"; }

double Pressure::Max() const { return std::max({load, latency, memory}); }

const char* ReasonName(Reason r) {
  switch (r) {
    case Reason::kHold: return "hold";
    case Reason::kCooldown: return "cooldown";
    case Reason::kLoadHigh: return "load_high";
    case Reason::kLatencyHigh: return "latency_high";
    case Reason::kMemoryHigh: return "memory_high";
    case Reason::kLoadLow: return "load_low";
    case Reason::kBalance: return "balance";
    case Reason::kManual: return "manual";
    case Reason::kAtMin: return "at_min";
    case Reason::kAtMax: return "at_max";
  }
  return "hold";
}

PoolController::PoolController(PoolPolicy policy, int initial)
    : policy_(policy), desired_(std::clamp(initial, policy.min_replicas, policy.max_replicas)) {}

Decision PoolController::Change(absl::Time now, int to, Reason why) {
  Decision d;
  d.changed = to != desired_;
  desired_ = to;
  d.desired = to;
  d.reason = why;
  last_change_ = now;
  up_streak_ = down_streak_ = 0;
  return d;
}

Decision PoolController::Observe(absl::Time now, const Pressure& p, int nodes) {
  Decision hold{desired_, Reason::kHold};
  if (manual_) return {desired_, Reason::kManual};
  const double max = p.Max();
  if (max < 0) {  // nothing measured: no evidence either way
    up_streak_ = down_streak_ = 0;
    return hold;
  }
  up_streak_ = max > policy_.scale_up_at ? up_streak_ + 1 : 0;
  // Shrinking only if the survivors would stay under the grow threshold (no flap straight back).
  const int n = std::max(nodes, 1);
  const bool low = max < policy_.scale_down_at && (n <= 1 || max * n / (n - 1) < policy_.scale_up_at);
  down_streak_ = low ? down_streak_ + 1 : 0;
  if (up_streak_ >= policy_.sustain) {
    if (desired_ >= policy_.max_replicas) return {desired_, Reason::kAtMax};
    if (in_cooldown(now)) return {desired_, Reason::kCooldown};
    const Reason why = max == p.latency ? Reason::kLatencyHigh : max == p.memory ? Reason::kMemoryHigh : Reason::kLoadHigh;
    return Change(now, desired_ + 1, why);
  }
  if (down_streak_ >= policy_.sustain) {
    if (desired_ <= policy_.min_replicas) return {desired_, Reason::kAtMin};
    if (in_cooldown(now)) return {desired_, Reason::kCooldown};
    return Change(now, desired_ - 1, Reason::kLoadLow);
  }
  return hold;
}

Decision PoolController::Nudge(absl::Time now, int target) {
  target = std::clamp(target, policy_.min_replicas, policy_.max_replicas);
  if (manual_ || target == desired_) return {desired_, manual_ ? Reason::kManual : Reason::kHold};
  if (in_cooldown(now)) return {desired_, Reason::kCooldown};
  return Change(now, desired_ + (target > desired_ ? 1 : -1), Reason::kBalance);
}

std::optional<std::string> PoolController::SetManual(int replicas, absl::Time now) {
  if (replicas < policy_.min_replicas || replicas > policy_.max_replicas)
    return absl::StrCat(replicas, " is outside [", policy_.min_replicas, ", ", policy_.max_replicas, "]");
  manual_ = true;
  Change(now, replicas, Reason::kManual);
  return std::nullopt;
}

}  // namespace k3::orchestrator

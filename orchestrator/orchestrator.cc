#include "orchestrator/orchestrator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <tuple>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/tls.h"

namespace k3::orchestrator {
namespace {

constexpr auto kRpcDeadline = std::chrono::seconds(1);

std::chrono::system_clock::time_point Deadline() { return std::chrono::system_clock::now() + kRpcDeadline; }

}  // namespace

Orchestrator::Orchestrator(OrchestratorOptions options, Backend& backend, metrics::Registry& reg)
    : options_(std::move(options)),
      backend_(backend),
      board_(v1::AttentionBoard::NewStub(tls::NewChannel(options_.router_address))),
      router_(v1::Router::NewStub(tls::NewChannel(options_.router_address))) {
  controllers_.emplace(Pool::kAttention, PoolController(options_.attention, options_.initial_attention));
  controllers_.emplace(Pool::kExperts, PoolController(options_.experts, options_.initial_experts));
  m_desired_ = metrics::Must(reg.AddGauge("k3serve_pool_desired_replicas", "Replicas the orchestrator wants, per pool.", {"pool"}));
  m_actual_ = metrics::Must(reg.AddGauge("k3serve_pool_actual_replicas",
                                         "Replicas serving (attention: SERVING; experts: in the complete placement), per pool.", {"pool"}));
  m_events_ = metrics::Must(reg.AddCounter("k3serve_scaling_events_total", "Changes of a pool's desired size.", {"pool", "direction"}));
  m_drain_ = metrics::Must(reg.AddHistogram("k3serve_drain_duration_seconds", "From a replica's drain to its exit.",
                                            metrics::ExponentialBuckets(0.05, 2, 14), {"pool"}));
  m_decisions_ = metrics::Must(reg.AddCounter("k3serve_scaling_decisions_total", "Decisions of the control loop, by reason.", {"pool", "reason"}));
  m_ratio_ = &metrics::Must(reg.AddGauge("k3serve_attention_expert_ratio",
                                         "Attention nodes per expert node that balance measured attention and expert time per step."))->WithLabels();
  for (Pool p : {Pool::kAttention, Pool::kExperts}) {
    state_[p];
    m_desired_->WithLabels({PoolName(p)}).Set(controllers_.at(p).desired());
    m_drain_->WithLabels({PoolName(p)});
    // Known label values start at 0, so that rate() and increase() have a series before the first event.
    for (const char* d : {"up", "down"}) m_events_->WithLabels({PoolName(p), d});
  }
  backend_.on_drained = [this](Pool p, absl::Duration d) {
    m_drain_->WithLabels({PoolName(p)}).Observe(absl::ToDoubleSeconds(d));
    std::fprintf(stderr, "k3serve-orchestrator: a %s replica drained in %.2f s\n", PoolName(p), absl::ToDoubleSeconds(d));
  };
  thread_ = std::thread([this] { Loop(); });
}

Orchestrator::~Orchestrator() {
  Stop();
  if (thread_.joinable()) thread_.join();
}

void Orchestrator::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

void Orchestrator::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    lock.unlock();
    Reconcile();
    lock.lock();
    cv_.wait_for(lock, absl::ToChronoNanoseconds(options_.interval), [&] { return stopping_ || kick_; });
    kick_ = false;
  }
}

Orchestrator::Signals Orchestrator::Measure() {
  Signals s;
  // Attention: the nodes' own reports on the router's board.
  v1::AttentionNodes nodes;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    auth::AddAdminCredentials(&ctx);
    if (!board_->ListAttentionNodes(&ctx, v1::ListAttentionNodesRequest(), &nodes).ok()) nodes.Clear();
  }
  double requests = 0, itl_sum = 0, attn_seconds = 0, step_rate = 0;
  int64_t itl_n = 0, steps = 0, state_max = 0;
  for (const v1::AttentionLoad& l : nodes.nodes()) {
    if (l.draining()) continue;
    ++s.attention_nodes;
    requests += static_cast<double>(l.running_requests() + l.waiting_requests());
    if (l.itl_seconds() > 0) {
      itl_sum += l.itl_seconds();
      ++itl_n;
    }
    state_max = std::max(state_max, l.state_bytes());
    steps += l.steps();
    attn_seconds += std::max(0.0, l.step_seconds() - l.dispatch_seconds());
    if (l.step_seconds() > 0) step_rate += static_cast<double>(l.steps()) / l.step_seconds();
  }
  if (s.attention_nodes > 0) {
    s.attention.load = requests / s.attention_nodes / options_.attention_target_requests;
    if (itl_n > 0) s.attention.latency = itl_sum / itl_n / options_.itl_target_s;
    if (options_.attention_memory_budget > 0)
      s.attention.memory = static_cast<double>(state_max) / static_cast<double>(options_.attention_memory_budget);
  }
  // Experts: the placement names them; their admin API tells busy time, rows and slots.
  v1::Placement placement;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    auth::AddAdminCredentials(&ctx);
    if (!router_->GetPlacement(&ctx, v1::GetPlacementRequest(), &placement).ok()) placement.Clear();
  }
  if (placement.complete()) s.placed_experts = placement.nodes_size();
  const absl::Time now = absl::Now();
  double busy_max = -1, busy_total = 0;
  int64_t slots_max = 0;
  std::map<std::string, ExpertSample> samples;
  for (const v1::ExpertNode& n : placement.nodes()) {
    auto& stub = expert_admin_[n.grpc_address()];
    if (!stub) stub = v1::ExpertAdmin::NewStub(tls::NewChannel(n.grpc_address()));
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    auth::AddAdminCredentials(&ctx);
    v1::ExpertStatus st;
    if (!stub->Status(&ctx, v1::StatusRequest(), &st).ok()) continue;
    ExpertSample cur{st.busy_seconds(), st.rows_processed(), now};
    auto prev = expert_samples_.find(n.node_id());
    if (prev != expert_samples_.end() && now > prev->second.at && cur.busy_seconds >= prev->second.busy_seconds) {
      const double busy = (cur.busy_seconds - prev->second.busy_seconds) / absl::ToDoubleSeconds(now - prev->second.at);
      busy_max = std::max(busy_max, busy);
      busy_total += busy;
    }
    slots_max = std::max<int64_t>(slots_max, st.slots());
    samples[n.node_id()] = cur;
  }
  expert_samples_ = std::move(samples);
  if (busy_max >= 0) s.experts.load = busy_max / options_.expert_busy_target;
  if (options_.expert_memory_budget > 0 && options_.slot_bytes > 0)
    s.experts.memory = static_cast<double>(slots_max * options_.slot_bytes) / static_cast<double>(options_.expert_memory_budget);
  // Balanced ratio A/E = t_attn / t_exp: attention time per step (step minus the wait for the
  // experts) against expert busy time per step (the whole pool's busy seconds per second over the
  // attention pool's steps per second).
  if (steps > 0 && step_rate > 0 && busy_total > 0) {
    const double t_attn = attn_seconds / static_cast<double>(steps);
    const double t_exp = busy_total / step_rate;
    s.ratio = t_attn / t_exp;
  }
  return s;
}

void Orchestrator::Reconcile() {
  const Signals sig = Measure();
  const absl::Time now = absl::Now();
  std::map<Pool, int> desired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sig.ratio > 0) {
      ratio_ = sig.ratio;
      m_ratio_->Set(sig.ratio);
    }
    for (Pool p : {Pool::kAttention, Pool::kExperts}) {
      PoolController& c = controllers_.at(p);
      const int before = c.desired();
      Decision d = c.Observe(now, p == Pool::kAttention ? sig.attention : sig.experts,
                             p == Pool::kAttention ? sig.attention_nodes : sig.placed_experts);
      // Both pools with headroom: the expert pool moves towards the balanced ratio.
      if (p == Pool::kExperts && options_.balance && d.reason == Reason::kHold && ratio_ > 0 &&
          sig.attention.Max() < options_.attention.scale_up_at && sig.experts.Max() < options_.experts.scale_up_at &&
          sig.experts.Max() >= 0) {
        const int target = static_cast<int>(std::ceil(controllers_.at(Pool::kAttention).desired() / ratio_));
        d = c.Nudge(now, target);
      }
      m_decisions_->WithLabels({PoolName(p), ReasonName(d.reason)}).Inc();
      if (c.desired() != before) {
        state_[p].last_reason = ReasonName(d.reason);
        m_events_->WithLabels({PoolName(p), c.desired() > before ? "up" : "down"}).Inc();
        std::fprintf(stderr, "k3serve-orchestrator: %s %d -> %d (%s)\n", PoolName(p), before, c.desired(), ReasonName(d.reason));
      }
      desired[p] = c.desired();
    }
  }
  for (Pool p : {Pool::kAttention, Pool::kExperts}) {
    const absl::Status applied = backend_.Apply(p, desired[p]);
    auto replicas = backend_.List(p);
    std::lock_guard<std::mutex> lock(mu_);
    PoolState& st = state_[p];
    st.error = applied.ok() ? (replicas.ok() ? "" : std::string(replicas.status().message())) : std::string(applied.message());
    if (replicas.ok()) st.replicas = *replicas;
    int ready = 0;
    for (const Replica& r : st.replicas) ready += r.ready && !r.draining;
    // Serving as the rest of the cluster sees it: attention nodes on the board, expert nodes in
    // the complete placement.
    st.actual = std::min(ready, p == Pool::kAttention ? sig.attention_nodes : sig.placed_experts);
    m_desired_->WithLabels({PoolName(p)}).Set(desired[p]);
    m_actual_->WithLabels({PoolName(p)}).Set(st.actual);
  }
}

void Orchestrator::Snapshot(v1::Pools* out) {
  for (Pool p : {Pool::kAttention, Pool::kExperts}) {
    const PoolController& c = controllers_.at(p);
    const PoolState& st = state_.at(p);
    v1::PoolStatus* ps = out->add_pools();
    ps->set_pool(PoolName(p));
    ps->set_desired(c.desired());
    ps->set_actual(st.actual);
    ps->set_min_replicas(c.policy().min_replicas);
    ps->set_max_replicas(c.policy().max_replicas);
    ps->set_manual(c.manual());
    ps->set_last_reason(st.last_reason);
    ps->set_error(st.error);
    for (const Replica& r : st.replicas) {
      v1::Replica* pr = ps->add_replicas();
      pr->set_name(r.name);
      pr->set_address(r.address);
      pr->set_pid(r.pid);
      pr->set_ready(r.ready);
      pr->set_draining(r.draining);
      pr->set_restarts(r.restarts);
    }
  }
  out->set_balanced_attention_expert_ratio(ratio_);
}

grpc::Status Orchestrator::GetPools(grpc::ServerContext*, const v1::GetPoolsRequest*, v1::Pools* resp) {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot(resp);
  return grpc::Status::OK;
}

grpc::Status Orchestrator::SetTargets(grpc::ServerContext* ctx, const v1::SetTargetsRequest* req, v1::Pools* resp) {
  if (auto s = auth::RequireAdmin(*ctx, "Orchestrator.SetTargets"); !s.ok()) return s;
  const absl::Time now = absl::Now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (req->automatic()) {
      for (auto& [p, c] : controllers_) c.Automatic();
    } else {
      if (!req->has_attention() && !req->has_experts())
        return {grpc::StatusCode::INVALID_ARGUMENT, "set attention, experts, or automatic"};
      // Check both before changing either.
      for (auto [p, has, n] : {std::tuple{Pool::kAttention, req->has_attention(), req->attention()},
                               std::tuple{Pool::kExperts, req->has_experts(), req->experts()}}) {
        const PoolPolicy& pol = controllers_.at(p).policy();
        if (has && (n < pol.min_replicas || n > pol.max_replicas))
          return {grpc::StatusCode::INVALID_ARGUMENT,
                  absl::StrCat(PoolName(p), " = ", n, " is outside [", pol.min_replicas, ", ", pol.max_replicas,
                               "] (--", PoolName(p), "-min, --", PoolName(p), "-max)")};
      }
      for (auto [p, has, n] : {std::tuple{Pool::kAttention, req->has_attention(), req->attention()},
                               std::tuple{Pool::kExperts, req->has_experts(), req->experts()}}) {
        if (!has) continue;
        PoolController& c = controllers_.at(p);
        const int before = c.desired();
        c.SetManual(n, now);
        m_decisions_->WithLabels({PoolName(p), "manual"}).Inc();
        if (n != before) {
          state_[p].last_reason = "manual";
          m_events_->WithLabels({PoolName(p), n > before ? "up" : "down"}).Inc();
          std::fprintf(stderr, "k3serve-orchestrator: %s %d -> %d (manual)\n", PoolName(p), before, n);
        }
      }
    }
    kick_ = true;
    Snapshot(resp);
  }
  cv_.notify_all();
  return grpc::Status::OK;
}

}  // namespace k3::orchestrator

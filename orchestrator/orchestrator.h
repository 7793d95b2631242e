// The reconcile loop: every interval it reads the pools' load from the router (attention nodes'
// reports; expert nodes' busy time through their admin API), decides each pool's size, applies it
// through the backend, and serves the admin API (k3serve.v1.Orchestrator) that pins sizes by hand.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "common/metrics.h"
#include "k3serve/v1/control.grpc.pb.h"
#include "k3serve/v1/orchestrator.grpc.pb.h"
#include "orchestrator/backend.h"
#include "orchestrator/controller.h"

namespace k3::orchestrator {

namespace v1 = ::k3serve::v1;

struct OrchestratorOptions {
  std::string router_address;
  absl::Duration interval = absl::Seconds(5);
  PoolPolicy attention;
  PoolPolicy experts;
  int initial_attention = 1;
  int initial_experts = 2;
  // Targets that make a pool's pressure 1.
  double attention_target_requests = 16;  // running + waiting per attention node
  double itl_target_s = 0.2;              // mean inter-token latency
  int64_t attention_memory_budget = 0;    // per-sequence state bytes per node (0: not watched)
  double expert_busy_target = 0.7;        // busy ratio per expert node
  int64_t expert_memory_budget = 0;       // slot bytes per node (0: not watched)
  int64_t slot_bytes = 0;                 // one (layer, expert) slot's weights
  bool balance = true;                    // move the expert pool towards the balanced ratio
};

class Orchestrator final : public v1::Orchestrator::Service {
 public:
  Orchestrator(OrchestratorOptions options, Backend& backend, metrics::Registry& registry);
  ~Orchestrator() override;

  grpc::Status GetPools(grpc::ServerContext* ctx, const v1::GetPoolsRequest* req, v1::Pools* resp) override;
  grpc::Status SetTargets(grpc::ServerContext* ctx, const v1::SetTargetsRequest* req, v1::Pools* resp) override;

  void Stop();

 private:
  struct ExpertSample {
    double busy_seconds = 0;
    int64_t rows = 0;
    absl::Time at;
  };
  struct Signals {
    Pressure attention, experts;
    int attention_nodes = 0;       // reporting, not draining
    int placed_experts = 0;        // in the router's placement, if complete
    double ratio = 0;              // balanced attention:expert nodes (0: not measured)
  };
  void Loop();
  void Reconcile();
  Signals Measure();
  void Snapshot(v1::Pools* out);  // mu_ held

  const OrchestratorOptions options_;
  Backend& backend_;
  std::unique_ptr<v1::AttentionBoard::Stub> board_;
  std::unique_ptr<v1::Router::Stub> router_;
  std::map<std::string, std::unique_ptr<v1::ExpertAdmin::Stub>> expert_admin_;  // by gRPC address
  std::map<std::string, ExpertSample> expert_samples_;                          // by node id

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool kick_ = false;
  std::map<Pool, PoolController> controllers_;
  struct PoolState {
    int actual = 0;
    std::string last_reason = "hold";
    std::string error;
    std::vector<Replica> replicas;
  };
  std::map<Pool, PoolState> state_;
  double ratio_ = 0;
  std::thread thread_;

  metrics::Family<metrics::Gauge>* m_desired_;
  metrics::Family<metrics::Gauge>* m_actual_;
  metrics::Family<metrics::Counter>* m_events_;
  metrics::Family<metrics::Histogram>* m_drain_;
  metrics::Family<metrics::Counter>* m_decisions_;
  metrics::Gauge* m_ratio_;
};

}  // namespace k3::orchestrator

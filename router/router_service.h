// The router's control plane: node registration, the versioned placement table and its watchers,
// failure reports, load aggregation, and the placement changes (EPLB over the measured load)
// carried out so that no admitted request fails (DESIGN §3).
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/time/time.h"
#include "common/metrics.h"
#include "engine/config.h"
#include "k3serve/v1/control.grpc.pb.h"

namespace k3 {
namespace v1 = ::k3serve::v1;
}  // namespace k3
#include "router/eplb.h"
#include "router/placement.h"
#include "router/qb.h"

namespace k3::router {

struct RouterOptions {
  // A change whose new slots are not ready on every node within this is abandoned (serving stays
  // on the old version); the old slots are freed at the latest this long after publishing.
  absl::Duration placement_timeout = absl::Seconds(30);
  absl::Duration settle = absl::Milliseconds(50);  // lets a burst of registrations become one change
  absl::Duration load_interval = absl::Seconds(1);  // the load EMA's step
  double load_ema = 0.3;                            // weight of the newest interval
  double rebalance_threshold = 1.15;                // max/mean node load that calls for a rebalance ...
  int rebalance_after = 3;                          // ... for this many intervals in a row (0: never)
  EplbOptions eplb;
  std::vector<int64_t> expert_metrics_layers;  // layers with per-expert k3serve_expert_tokens_total series
  // adaptive: every load interval the QB estimate moves each layer's bias (pushed with the
  // placement) by at most qb_max_step per expert; frozen: the checkpoint's bias only.
  bool adaptive = false;
  double qb_max_step = 0.02;
  // Placement versions start here; 0: the wall clock in microseconds, so that a restarted router
  // continues above every version its predecessor published.
  uint64_t first_version = 0;
};

class RouterService final : public v1::Router::Service {
 public:
  RouterService(ModelConfig config, metrics::Registry& registry, RouterOptions options = {});
  ~RouterService() override;

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                            v1::RegisterNodeResponse* resp) override;
  grpc::Status WatchPlacement(grpc::ServerContext* ctx, const v1::WatchPlacementRequest* req,
                              grpc::ServerWriter<v1::Placement>* writer) override;
  grpc::Status ReportNodeFailure(grpc::ServerContext* ctx, const v1::ReportNodeFailureRequest* req,
                                 v1::ReportNodeFailureResponse* resp) override;
  grpc::Status ReportLoad(grpc::ServerContext* ctx, const v1::LoadReport* req, v1::ReportLoadResponse* resp) override;
  grpc::Status GetPlacement(grpc::ServerContext* ctx, const v1::GetPlacementRequest* req, v1::Placement* resp) override;
  grpc::Status AckPlacement(grpc::ServerContext* ctx, const v1::AckPlacementRequest* req,
                            v1::AckPlacementResponse* resp) override;
  grpc::Status LeaveNode(grpc::ServerContext* ctx, const v1::LeaveNodeRequest* req, v1::LeaveNodeResponse* resp) override;

  // Ends every watch stream (shutdown).
  void Stop();
  // Asks for an EPLB re-placement over the current load (the admin endpoint).
  void RequestRebalance();
  // /admin/expert_load: per MoE layer the tokens, their EMA and each expert's replicas (node ids).
  nlohmann::json ExpertLoadJson() const;

 private:
  struct ExpertNodeState {
    NodeInfo info;
    int32_t capacity = 0;
    bool leaving = false;  // asked to leave: placed nowhere, dropped once a placement without it is in use
    std::unique_ptr<v1::ExpertAdmin::Stub> admin;
  };
  // The reconcile loop: on a node-set change or a rebalance, computes the EPLB table and carries
  // the change out (ChangePlacement); every load interval folds the reports into the EMA.
  void PlacerLoop();
  // Loads → ready → publish → drained → release; false if abandoned. Called without mu_.
  bool ChangePlacement(std::shared_ptr<const PlacementTable> table, std::shared_ptr<const PlacementTable> old);
  void ReleaseSlots(const std::vector<std::string>& nodes, uint64_t keep_version);
  void DropNode(const std::string& node_id, const std::string& why);
  // Binds node_id to the identity of its first live registration (mu_ held).
  grpc::Status BindIdentity(const std::string& node_id, const std::string& identity);
  // PERMISSION_DENIED unless the caller is the process that registered node_id (mu_ held).
  grpc::Status OwnNode(const grpc::ServerContext& ctx, const std::string& node_id) const;
  void FoldLoadLocked();
  // The placement with the routing mode and bias; mu_ held.
  void PlacementProtoLocked(v1::Placement* out) const;

  const ModelConfig config_;
  const RouterOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // placement published or acknowledged, node set changed, or stopping
  std::map<std::string, ExpertNodeState> experts_;  // live expert nodes by id
  std::map<std::string, uint64_t> attention_;       // attention nodes by id -> placement version acknowledged
  std::map<std::string, std::string> identities_;  // live node id -> auth::IdentityOf its registration
  bool dirty_ = false;  // the node set changed since the last placement
  bool rebalance_ = false;  // a rebalance was asked for (load, or on demand)
  bool in_progress_ = false;
  bool stopping_ = false;
  uint64_t next_version_ = 1;
  std::shared_ptr<const PlacementTable> placement_;
  std::vector<std::vector<int64_t>> load_;      // [layer][expert] tokens since start
  std::vector<std::vector<int64_t>> interval_;  // ... since the last fold
  std::vector<std::vector<double>> ema_;        // the placement's input
  std::vector<QbHistogram> qb_;                 // per layer, summed over nodes since the last fold
  std::vector<std::vector<float>> qb_step_;     // per layer: the last QB estimate of the bias step
  std::vector<std::vector<float>> bias_;        // adaptive: per layer, added to the checkpoint's (empty: none yet)
  uint64_t bias_version_ = 0;
  int over_threshold_ = 0;                      // intervals in a row above the rebalance threshold
  std::thread placer_;

  metrics::Gauge* m_version_;
  metrics::Gauge* m_expert_nodes_;
  metrics::Gauge* m_attention_nodes_;
  metrics::Counter* m_placements_;
  metrics::Family<metrics::Gauge>* m_imbalance_;
  metrics::Family<metrics::Counter>* m_node_load_;
  metrics::Family<metrics::Counter>* m_failures_;
  metrics::Family<metrics::Counter>* m_rebalances_;
  metrics::Counter* m_moved_;
  metrics::Gauge* m_in_progress_;
  metrics::Family<metrics::Counter>* m_expert_tokens_ = nullptr;  // only with expert_metrics_layers
  metrics::Gauge* m_bias_version_;
  metrics::Family<metrics::Gauge>* m_bias_max_abs_;
};

}  // namespace k3::router

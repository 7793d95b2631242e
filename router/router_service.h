// The router's control plane: node registration, the versioned placement table and its watchers,
// failure reports, load aggregation.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics.h"
#include "engine/config.h"
#include "k3serve/v1/control.grpc.pb.h"

namespace k3 {
namespace v1 = ::k3serve::v1;
}  // namespace k3
#include "router/placement.h"

namespace k3::router {

class RouterService final : public v1::Router::Service {
 public:
  // Placement versions start at first_version; 0: the wall clock in microseconds, so that a
  // restarted router continues above every version its predecessor published.
  RouterService(ModelConfig config, metrics::Registry& registry, uint64_t first_version = 0);
  ~RouterService() override;

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                            v1::RegisterNodeResponse* resp) override;
  grpc::Status WatchPlacement(grpc::ServerContext* ctx, const v1::WatchPlacementRequest* req,
                              grpc::ServerWriter<v1::Placement>* writer) override;
  grpc::Status ReportNodeFailure(grpc::ServerContext* ctx, const v1::ReportNodeFailureRequest* req,
                                 v1::ReportNodeFailureResponse* resp) override;
  grpc::Status ReportLoad(grpc::ServerContext* ctx, const v1::LoadReport* req, v1::ReportLoadResponse* resp) override;
  grpc::Status GetPlacement(grpc::ServerContext* ctx, const v1::GetPlacementRequest* req, v1::Placement* resp) override;

  // Ends every watch stream (shutdown).
  void Stop();
  // Per-expert token counts over all reports since start: [layer][expert].
  std::vector<std::vector<int64_t>> ExpertLoad() const;

 private:
  struct ExpertNodeState {
    NodeInfo info;
    std::unique_ptr<v1::ExpertAdmin::Stub> admin;
  };
  // Recomputes the placement over the live expert nodes, has each node load its slots, publishes.
  void PlacerLoop();
  void DropNode(const std::string& node_id, const std::string& why);
  // Binds node_id to the identity of its first live registration (mu_ held).
  grpc::Status BindIdentity(const std::string& node_id, const std::string& identity);

  const ModelConfig config_;
  mutable std::mutex mu_;
  std::condition_variable cv_;  // placement published, node set changed, or stopping
  std::map<std::string, ExpertNodeState> experts_;  // live expert nodes by id
  std::set<std::string> attention_;
  std::map<std::string, std::string> identities_;  // live node id -> auth::IdentityOf its registration
  bool dirty_ = false;  // the node set changed since the last placement
  bool stopping_ = false;
  uint64_t next_version_ = 1;
  std::shared_ptr<const PlacementTable> placement_;
  std::vector<std::vector<int64_t>> load_;  // [layer][expert] tokens
  std::thread placer_;

  metrics::Gauge* m_version_;
  metrics::Gauge* m_expert_nodes_;
  metrics::Gauge* m_attention_nodes_;
  metrics::Counter* m_placements_;
  metrics::Family<metrics::Gauge>* m_imbalance_;
  metrics::Family<metrics::Counter>* m_node_load_;
  metrics::Family<metrics::Counter>* m_failures_;
};

}  // namespace k3::router

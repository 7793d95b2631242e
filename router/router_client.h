// A node's side of the control plane: registers with the router (again after a router restart),
// keeps the placement watch open (an expert node's liveness signal), and forwards placements.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "common/status.h"
#include "k3serve/v1/control.grpc.pb.h"

namespace k3 {
namespace v1 = ::k3serve::v1;
}  // namespace k3

namespace k3::router {

class RouterClient {
 public:
  using OnPlacement = std::function<void(const v1::Placement&)>;

  RouterClient(const std::string& router_address, v1::RegisterNodeRequest self, OnPlacement on_placement);
  ~RouterClient();  // closes the watch (for an expert node: the router re-places its experts)

  void Stop();
  bool connected() const { return connected_; }
  // Best effort; both block for at most ~2 s.
  void ReportNodeFailure(const std::string& node_id, const std::string& detail);
  void ReportLoad(const v1::LoadReport& report);
  // This attention node runs placement `version` and has no rows in flight on an older one.
  void AckPlacement(uint64_t version);
  // An expert node's graceful exit: blocks until the router has a placement without this node in
  // use everywhere, or `timeout`.
  absl::Status Leave(absl::Duration timeout);

 private:
  void Loop();

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Router::Stub> stub_;
  const v1::RegisterNodeRequest self_;
  const OnPlacement on_placement_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> connected_{false};
  std::mutex mu_;
  grpc::ClientContext* watch_ = nullptr;  // the open watch, for cancellation
  std::thread thread_;
};

}  // namespace k3::router

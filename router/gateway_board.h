// The router's board of attention nodes: each node reports its load every few hundred ms; the
// gateways and the orchestrator read the live ones. A node silent for `expiry` has left.
#pragma once

#include <map>
#include <mutex>
#include <string>

#include "absl/time/time.h"
#include "k3serve/v1/control.grpc.pb.h"

namespace k3::router {

namespace v1 = ::k3serve::v1;

class AttentionBoardService final : public v1::AttentionBoard::Service {
 public:
  explicit AttentionBoardService(absl::Duration expiry = absl::Seconds(3)) : expiry_(expiry) {}

  grpc::Status ReportAttentionLoad(grpc::ServerContext* ctx, const v1::AttentionLoad* req,
                                   v1::ReportAttentionLoadResponse* resp) override;
  grpc::Status ListAttentionNodes(grpc::ServerContext* ctx, const v1::ListAttentionNodesRequest* req,
                                  v1::AttentionNodes* resp) override;

 private:
  struct Entry {
    v1::AttentionLoad load;
    absl::Time at;
  };
  const absl::Duration expiry_;
  std::mutex mu_;
  std::map<std::string, Entry> nodes_;  // by node_id
};

}  // namespace k3::router

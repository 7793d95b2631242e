#include "router/gateway_board.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"

namespace k3::router {

grpc::Status AttentionBoardService::ReportAttentionLoad(grpc::ServerContext* ctx, const v1::AttentionLoad* req,
                                                        v1::ReportAttentionLoadResponse*) {
  if (auto s = auth::RequireNode(*ctx, "AttentionBoard.ReportAttentionLoad"); !s.ok()) return s;
  if (req->node_id().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "node_id must not be empty"};
  if (req->grpc_address().empty()) return {grpc::StatusCode::INVALID_ARGUMENT, "grpc_address must not be empty"};
  if (req->running_requests() < 0 || req->waiting_requests() < 0 || req->outstanding_tokens() < 0)
    return {grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("running_requests, waiting_requests and outstanding_tokens must be >= 0, got ",
                         req->running_requests(), ", ", req->waiting_requests(), ", ", req->outstanding_tokens())};
  std::lock_guard<std::mutex> lock(mu_);
  nodes_[req->node_id()] = {*req, absl::Now()};
  return grpc::Status::OK;
}

grpc::Status AttentionBoardService::ListAttentionNodes(grpc::ServerContext*, const v1::ListAttentionNodesRequest*,
                                                       v1::AttentionNodes* resp) {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    if (now - it->second.at > expiry_) {
      it = nodes_.erase(it);
      continue;
    }
    *resp->add_nodes() = it->second.load;
    ++it;
  }
  return grpc::Status::OK;
}

}  // namespace k3::router

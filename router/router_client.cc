#include "router/router_client.h"

#include <chrono>
#include <cstdio>

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/tls.h"

namespace k3::router {

RouterClient::RouterClient(const std::string& router_address, v1::RegisterNodeRequest self, OnPlacement on_placement)
    : channel_(tls::NewChannel(router_address)),
      stub_(v1::Router::NewStub(channel_)),
      self_(std::move(self)),
      on_placement_(std::move(on_placement)) {
  thread_ = std::thread([this] { Loop(); });
}

RouterClient::~RouterClient() { Stop(); }

void RouterClient::Stop() {
  stop_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (watch_ != nullptr) watch_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

void RouterClient::Loop() {
  auto backoff = std::chrono::milliseconds(100);
  while (!stop_) {
    grpc::ClientContext reg_ctx;
    reg_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    auth::AddNodeCredentials(&reg_ctx);
    v1::RegisterNodeResponse reg;
    const grpc::Status s = stub_->RegisterNode(&reg_ctx, self_, &reg);
    if (!s.ok()) {
      if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED || s.error_code() == grpc::StatusCode::ALREADY_EXISTS)
        std::fprintf(stderr, "%s: the router refused the registration: %s\n", self_.node_id().c_str(), s.error_message().c_str());
      connected_ = false;
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
      continue;
    }
    backoff = std::chrono::milliseconds(100);
    grpc::ClientContext ctx;
    auth::AddNodeCredentials(&ctx);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) break;
      watch_ = &ctx;
    }
    v1::WatchPlacementRequest req;
    req.set_node_id(self_.node_id());
    auto reader = stub_->WatchPlacement(&ctx, req);
    connected_ = true;
    v1::Placement p;
    while (reader->Read(&p)) on_placement_(p);
    reader->Finish();
    connected_ = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      watch_ = nullptr;
    }
    if (!stop_) {
      std::fprintf(stderr, "%s: lost the router; registering again\n", self_.node_id().c_str());
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
}

void RouterClient::ReportNodeFailure(const std::string& node_id, const std::string& detail) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  auth::AddNodeCredentials(&ctx);
  v1::ReportNodeFailureRequest req;
  req.set_reporter_id(self_.node_id());
  req.set_node_id(node_id);
  req.set_detail(detail);
  v1::ReportNodeFailureResponse resp;
  stub_->ReportNodeFailure(&ctx, req, &resp);
}

void RouterClient::ReportLoad(const v1::LoadReport& report) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  auth::AddNodeCredentials(&ctx);
  v1::ReportLoadResponse resp;
  stub_->ReportLoad(&ctx, report, &resp);
}

void RouterClient::AckPlacement(uint64_t version) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  auth::AddNodeCredentials(&ctx);
  v1::AckPlacementRequest req;
  req.set_node_id(self_.node_id());
  req.set_version(version);
  v1::AckPlacementResponse resp;
  stub_->AckPlacement(&ctx, req, &resp);
}

absl::Status RouterClient::Leave(absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  auth::AddNodeCredentials(&ctx);
  v1::LeaveNodeRequest req;
  req.set_node_id(self_.node_id());
  v1::LeaveNodeResponse resp;
  const grpc::Status s = stub_->LeaveNode(&ctx, req, &resp);
  if (!s.ok()) return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  return absl::OkStatus();
}

}  // namespace k3::router

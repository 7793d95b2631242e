// gRPC server plumbing shared by the service binaries: health (grpc.health.v1), reflection,
// message limits, and the listening port.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/status.h"

namespace k3 {

struct GrpcServer {
  std::unique_ptr<grpc::Server> server;
  int port = 0;  // the bound port

  // Health of the whole server ("" service name) and of each named service.
  void SetServing(bool serving);
  // Health NOT_SERVING for good; stops accepting, lets calls in flight finish until the deadline, then
  // cancels them.
  void Shutdown(absl::Duration grace);
};

// Builds and starts a server on `address` ("host:port"; port 0 picks one) with the given services,
// the standard health service (NOT_SERVING until SetServing(true)) and server reflection.
// `credentials`: TLS (common/tls.h); null means plaintext.
// `configure`, if set, sees the builder before the server starts (e.g. to add a completion queue
// for asynchronous methods, or to give the server its own health service with
// grpc::HealthCheckServiceServerBuilderOption: SetServing and Shutdown then reach that one).
absl::StatusOr<GrpcServer> StartGrpcServer(const std::string& address, const std::vector<grpc::Service*>& services,
                                           std::shared_ptr<grpc::ServerCredentials> credentials = nullptr,
                                           const std::function<void(grpc::ServerBuilder&)>& configure = nullptr);

// absl::Status as grpc::Status (the codes are numerically identical).
grpc::Status ToGrpc(const absl::Status& s);

}  // namespace k3

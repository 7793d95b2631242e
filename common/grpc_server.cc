#include "common/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/time/clock.h"

namespace k3 {

absl::StatusOr<GrpcServer> StartGrpcServer(const std::string& address, const std::vector<grpc::Service*>& services,
                                           std::shared_ptr<grpc::ServerCredentials> credentials,
                                           const std::function<void(grpc::ServerBuilder&)>& configure) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  GrpcServer out;
  builder.AddListeningPort(address, credentials ? credentials : grpc::InsecureServerCredentials(), &out.port);
  builder.SetMaxReceiveMessageSize(64 << 20);
  for (grpc::Service* s : services) builder.RegisterService(s);
  if (configure) configure(builder);
  out.server = builder.BuildAndStart();
  if (!out.server || out.port == 0) return absl::UnavailableError(absl::StrCat("cannot listen for gRPC on ", address));
  out.SetServing(false);
  return out;
}

void GrpcServer::SetServing(bool serving) {
  if (auto* health = server->GetHealthCheckService()) health->SetServingStatus(serving);
}

void GrpcServer::Shutdown(absl::Duration grace) {
  if (auto* health = server->GetHealthCheckService()) health->Shutdown();  // NOT_SERVING for good
  server->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server->Wait();
}

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}
}  // namespace k3

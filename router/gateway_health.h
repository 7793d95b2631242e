// grpc.health.v1.Health served asynchronously on a completion queue that the caller's loop serves (its tags
// are CqEvents), in place of gRPC's default health service: that one's methods are callbacks, and the
// callback queue's threads poll the sockets and wake the loop's thread, a quarter of the gateway's CPU.
// The semantics are the default service's: "" and named services, all set at once by SetServing(bool);
// Check of an unknown name fails NOT_FOUND; Watch sends the status at once (SERVICE_UNKNOWN for an unknown
// name) and then each change; Shutdown sets NOT_SERVING for good, and here the Watch calls then end.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/server_builder_option.h>

#include "common/grpc_async.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace k3::router {

class AsyncHealth final : public grpc::health::v1::Health::AsyncService {
 public:
  AsyncHealth();  // knows "" (NOT_SERVING)
  ~AsyncHealth() override;

  // For ServerBuilder::SetOption: makes this the server's health service, which GrpcServer::SetServing and
  // the server's shutdown reach, and so leaves out gRPC's default one.
  std::unique_ptr<grpc::ServerBuilderOption> BuilderOption();
  // Takes calls on `cq`, the server's, served by the caller's loop.
  void Serve(grpc::ServerCompletionQueue* cq);
  // Before `cq` shuts down: nothing more is queued on it.
  void Stop();

  void SetServing(const std::string& service, bool serving);  // adds the name if new
  void SetServing(bool serving);                              // every known name
  // NOT_SERVING from now on; the Watch calls send it and end.
  void Shutdown();

 private:
  class CheckCall;
  class WatchCall;
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;
  // SERVICE_UNKNOWN for a name not known. mu_ held.
  ServingStatus StatusLocked(const std::string& service) const;
  // The watchers hear of a change on the loop thread. mu_ held.
  void ChangedLocked();
  void Notify(bool);

  grpc::ServerCompletionQueue* cq_ = nullptr;
  std::mutex mu_;
  std::map<std::string, bool> serving_;  // by service name
  bool shutdown_ = false, stopped_ = false, notifying_ = false;
  grpc::Alarm alarm_;  // set while notifying_
  CqOn<AsyncHealth> notified_{this, &AsyncHealth::Notify};
  std::set<WatchCall*> watchers_;  // the loop thread's
};

}  // namespace k3::router

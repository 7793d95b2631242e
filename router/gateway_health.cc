#include "router/gateway_health.h"

#include <grpcpp/ext/health_check_service_server_builder_option.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"

namespace k3::router {
namespace {

namespace health = ::grpc::health::v1;

// The server's view of an AsyncHealth (it owns this, not the AsyncHealth).
class Interface final : public grpc::HealthCheckServiceInterface {
 public:
  explicit Interface(AsyncHealth* health) : health_(health) {}
  void SetServingStatus(const std::string& service, bool serving) override { health_->SetServing(service, serving); }
  void SetServingStatus(bool serving) override { health_->SetServing(serving); }
  void Shutdown() override { health_->Shutdown(); }

 private:
  AsyncHealth* const health_;
};

}  // namespace

// One Check: answered at once. Loop thread.
class AsyncHealth::CheckCall {
 public:
  explicit CheckCall(AsyncHealth* h) : h_(h) { h_->RequestCheck(&ctx_, &req_, &responder_, h_->cq_, h_->cq_, &arrived_); }

 private:
  void Arrived(bool ok) {
    if (!ok) {  // the server is shutting down: no call came
      delete this;
      return;
    }
    new CheckCall(h_);  // for the next one
    ServingStatus s;
    {
      std::lock_guard<std::mutex> lock(h_->mu_);
      s = h_->StatusLocked(req_.service());
    }
    if (s == health::HealthCheckResponse::SERVICE_UNKNOWN) {
      responder_.FinishWithError(
          grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("unknown service \"", req_.service(), "\"")),
          &finished_);
      return;
    }
    resp_.set_status(s);
    responder_.Finish(resp_, grpc::Status::OK, &finished_);
  }
  void Finished(bool) { delete this; }

  AsyncHealth* const h_;
  grpc::ServerContext ctx_;
  health::HealthCheckRequest req_;
  health::HealthCheckResponse resp_;
  grpc::ServerAsyncResponseWriter<health::HealthCheckResponse> responder_{&ctx_};
  CqOn<CheckCall> arrived_{this, &CheckCall::Arrived}, finished_{this, &CheckCall::Finished};
};

// One Watch: the status now, then each change, one write in flight (a change meanwhile goes with the
// next). Loop thread; it deletes itself once the call is over and its operations are through.
class AsyncHealth::WatchCall {
 public:
  explicit WatchCall(AsyncHealth* h) : h_(h) {
    ctx_.AsyncNotifyWhenDone(&done_);
    h_->RequestWatch(&ctx_, &req_, &writer_, h_->cq_, h_->cq_, &arrived_);
  }

  // The status now; with `end`, the call ends once it is sent.
  void Update(ServingStatus s, bool end) {
    if (s != queued_) {
      queued_ = s;
      out_.pending.set_status(s);
      out_.has_pending = true;
    }
    if (end && !out_.end) out_.end = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
    Flush();
  }
  const std::string& service() const { return req_.service(); }

 private:
  void Arrived(bool ok) {
    if (!ok) {  // the server is shutting down: no call came
      delete this;
      return;
    }
    new WatchCall(h_);  // for the next one
    h_->watchers_.insert(this);
    ServingStatus s;
    bool end;
    {
      std::lock_guard<std::mutex> lock(h_->mu_);
      s = h_->StatusLocked(req_.service());
      end = h_->shutdown_;
    }
    Update(s, end);
  }

  void Flush() { out_.Flush(writer_, !gone_, &wrote_, &finished_); }

  void WriteDone(bool ok) {
    out_.writing = false;
    if (!ok) gone_ = true;  // the client went away
    Flush();
    MaybeDelete();
  }
  void FinishDone(bool) {
    finish_done_ = true;
    MaybeDelete();
  }
  // Finished, or cancelled by the client (or by the server's shutdown at its deadline).
  void CallDone(bool) {
    call_done_ = true;
    if (ctx_.IsCancelled()) gone_ = true;
    MaybeDelete();
  }
  void MaybeDelete() {
    if (!call_done_ || out_.writing || (out_.finishing && !finish_done_)) return;
    h_->watchers_.erase(this);
    delete this;
  }

  AsyncHealth* const h_;
  grpc::ServerContext ctx_;
  health::HealthCheckRequest req_;
  grpc::ServerAsyncWriter<health::HealthCheckResponse> writer_{&ctx_};
  CqOn<WatchCall> arrived_{this, &WatchCall::Arrived}, wrote_{this, &WatchCall::WriteDone},
      finished_{this, &WatchCall::FinishDone}, done_{this, &WatchCall::CallDone};
  CoalescedWrites<health::HealthCheckResponse> out_;
  // UNKNOWN (0) is never a status sent: the first Update always writes.
  ServingStatus queued_ = health::HealthCheckResponse::UNKNOWN;
  bool finish_done_ = false, call_done_ = false, gone_ = false;
};

AsyncHealth::AsyncHealth() { serving_[""] = false; }

AsyncHealth::~AsyncHealth() = default;

std::unique_ptr<grpc::ServerBuilderOption> AsyncHealth::BuilderOption() {
  return std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(std::make_unique<Interface>(this));
}

void AsyncHealth::Serve(grpc::ServerCompletionQueue* cq) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cq_ = cq;
  }
  new CheckCall(this);
  new WatchCall(this);
}

void AsyncHealth::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  stopped_ = true;
}

AsyncHealth::ServingStatus AsyncHealth::StatusLocked(const std::string& service) const {
  auto it = serving_.find(service);
  if (it == serving_.end()) return health::HealthCheckResponse::SERVICE_UNKNOWN;
  return it->second ? health::HealthCheckResponse::SERVING : health::HealthCheckResponse::NOT_SERVING;
}

void AsyncHealth::SetServing(const std::string& service, bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  serving_[service] = serving && !shutdown_;
  ChangedLocked();
}

void AsyncHealth::SetServing(bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_) return;
  for (auto& [name, s] : serving_) s = serving;
  ChangedLocked();
}

void AsyncHealth::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_) return;
  shutdown_ = true;
  for (auto& [name, s] : serving_) s = false;
  ChangedLocked();
}

void AsyncHealth::ChangedLocked() {
  if (cq_ == nullptr || stopped_ || notifying_) return;  // without a queue there is no watcher yet
  notifying_ = true;
  alarm_.Set(cq_, gpr_now(GPR_CLOCK_MONOTONIC), &notified_);
}

void AsyncHealth::Notify(bool) {
  std::lock_guard<std::mutex> lock(mu_);
  notifying_ = false;
  // Update only starts operations (a watcher goes from their completions): the set stays as it is.
  for (WatchCall* w : watchers_) w->Update(StatusLocked(w->service()), shutdown_);
}

}  // namespace k3::router

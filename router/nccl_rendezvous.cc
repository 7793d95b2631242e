#include "router/nccl_rendezvous.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"

namespace k3::dataplane {

namespace v1 = ::k3serve::v1;

NcclRendezvousServer::NcclRendezvousServer(OnOpen on_open, OnClosed on_closed)
    : on_open_(std::move(on_open)), on_closed_(std::move(on_closed)) {}

absl::StatusOr<std::unique_ptr<NcclRendezvousServer>> NcclRendezvousServer::Start(const std::string& address,
                                                                                  OnOpen on_open,
                                                                                  OnClosed on_closed) {
  std::unique_ptr<NcclRendezvousServer> s(new NcclRendezvousServer(std::move(on_open), std::move(on_closed)));
  K3_ASSIGN_OR_RETURN(s->grpc_, StartGrpcServer(address, {s.get()}));
  s->grpc_.SetServing(true);
  const size_t colon = address.rfind(':');
  s->address_ = absl::StrCat(address.substr(0, colon), ":", s->grpc_.port);
  return s;
}

NcclRendezvousServer::~NcclRendezvousServer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  grpc_.Shutdown(absl::Seconds(2));
}

void NcclRendezvousServer::Close(uint64_t session, const absl::Status& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_[session] = why;
  }
  cv_.notify_all();
}

grpc::Status NcclRendezvousServer::Open(grpc::ServerContext* ctx, const v1::NcclOpenRequest* req,
                                        grpc::ServerWriter<v1::NcclOpenEvent>* writer) {
  if (req->unique_id().size() != kNcclUniqueIdBytes)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("unique_id: ", req->unique_id().size(), " bytes, want ", kNcclUniqueIdBytes));
  if (req->client_device() < 0)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("client_device: ", req->client_device(), " is negative"));
  absl::StatusOr<NcclAccepted> accepted = on_open_(NcclOpenRequest{req->unique_id(), req->client_id(),
                                                                   req->client_device()});
  if (!accepted.ok()) return ToGrpc(accepted.status());
  const uint64_t session = accepted->session;
  v1::NcclOpenEvent event;
  event.set_node_id(accepted->node_id);
  event.set_device(accepted->device);
  event.set_session(session);
  event.set_max_rows(accepted->max_rows);
  absl::Status why;
  if (!writer->Write(event)) {
    why = absl::UnavailableError("the client went away before the session opened");
  } else {
    // Held open until the client cancels (or dies: the connection breaks), Close, or shutdown.
    std::unique_lock<std::mutex> lock(mu_);
    ++open_streams_;
    while (true) {
      if (ctx->IsCancelled()) {
        why = absl::UnavailableError("the client closed the session or died");
        break;
      }
      if (auto it = closing_.find(session); it != closing_.end()) {
        why = it->second;
        closing_.erase(it);
        break;
      }
      if (stopping_) {
        why = absl::UnavailableError("the expert node is shutting down");
        break;
      }
      cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
    --open_streams_;
  }
  on_closed_(session, why);
  return ctx->IsCancelled() ? grpc::Status::CANCELLED : ToGrpc(why.ok() ? absl::UnavailableError("closed") : why);
}

absl::StatusOr<std::unique_ptr<NcclRendezvousClient>> NcclRendezvousClient::Open(
    const std::string& address, const NcclOpenRequest& request, absl::Duration timeout,
    std::function<void(absl::Status)> on_lost) {
  if (request.unique_id.size() != kNcclUniqueIdBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("unique_id: ", request.unique_id.size(), " bytes, want ", kNcclUniqueIdBytes));
  std::unique_ptr<NcclRendezvousClient> c(new NcclRendezvousClient());
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout)))
    return absl::UnavailableError(absl::StrCat("NCCL bootstrap at ", address, ": not reachable within ",
                                               absl::FormatDuration(timeout)));
  c->stub_ = v1::NcclBootstrap::NewStub(channel);
  v1::NcclOpenRequest req;
  req.set_unique_id(request.unique_id);
  req.set_client_id(request.client_id);
  req.set_client_device(request.client_device);
  // The first event must come within the timeout; the stream itself has no deadline. A watchdog
  // cancels the call if the answer is late (Read blocks otherwise).
  c->reader_ = c->stub_->Open(&c->ctx_, req);
  std::mutex mu;
  std::condition_variable cv;
  bool answered = false;
  std::thread timer([&] {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] { return answered; })) c->ctx_.TryCancel();
  });
  v1::NcclOpenEvent event;
  const bool got = c->reader_->Read(&event);
  {
    std::lock_guard<std::mutex> lock(mu);
    answered = true;
  }
  cv.notify_all();
  timer.join();
  if (!got) {
    const grpc::Status s = c->reader_->Finish();
    if (s.error_code() == grpc::StatusCode::CANCELLED)
      return absl::DeadlineExceededError(absl::StrCat("NCCL bootstrap at ", address, ": no answer within ",
                                                      absl::FormatDuration(timeout)));
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("NCCL bootstrap at ", address, ": ", s.error_message()));
  }
  c->accepted_ = NcclAccepted{event.node_id(), event.device(), event.session(), event.max_rows()};
  c->watcher_ = std::thread(&NcclRendezvousClient::Watch, c.get(), std::move(on_lost));
  return c;
}

void NcclRendezvousClient::Watch(std::function<void(absl::Status)> on_lost) {
  v1::NcclOpenEvent event;
  while (reader_->Read(&event)) {
  }
  const grpc::Status s = reader_->Finish();
  if (s.error_code() == grpc::StatusCode::CANCELLED) return;  // closed here: nothing was lost
  if (on_lost)
    on_lost(absl::UnavailableError(absl::StrCat("expert node ", accepted_.node_id, " (session ", accepted_.session,
                                                "): control stream ended: ", s.error_message())));
}

NcclRendezvousClient::~NcclRendezvousClient() {
  ctx_.TryCancel();
  if (watcher_.joinable()) watcher_.join();
}

}  // namespace k3::dataplane

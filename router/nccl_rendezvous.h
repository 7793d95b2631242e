// The control plane of the NCCL data plane: how an attention node and an expert node agree on a
// communicator (proto/k3serve/v1/nccl.proto). The attention node makes the ncclUniqueId and
// sends it with Open; the expert node starts joining and answers; the stream then stays open as
// both sides' liveness signal. No CUDA here: the id is 128 opaque bytes, so this part is tested
// without a GPU.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "common/grpc_server.h"
#include "k3serve/v1/nccl.grpc.pb.h"

namespace k3::dataplane {

constexpr size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES

struct NcclOpenRequest {
  std::string unique_id;  // kNcclUniqueIdBytes
  std::string client_id;
  int client_device = 0;
};

struct NcclAccepted {
  std::string node_id;
  int device = 0;
  uint64_t session = 0;
  int64_t max_rows = 0;
};

// The expert node's side: serves NcclBootstrap on its own gRPC server.
class NcclRendezvousServer final : public ::k3serve::v1::NcclBootstrap::Service {
 public:
  // Starts joining the communicator of a request (its unique_id already checked for size) and
  // returns its session, or the error the client gets. Runs on a gRPC thread.
  using OnOpen = std::function<absl::StatusOr<NcclAccepted>(const NcclOpenRequest&)>;
  // The session's stream is gone: the client closed it or died, or Close ended it.
  using OnClosed = std::function<void(uint64_t session, const absl::Status& why)>;

  static absl::StatusOr<std::unique_ptr<NcclRendezvousServer>> Start(const std::string& address, OnOpen on_open,
                                                                     OnClosed on_closed);
  // Ends every stream (each session's on_closed runs) and stops the server.
  ~NcclRendezvousServer() override;

  const std::string& address() const { return address_; }  // "host:port", the real port
  // Ends a session's stream from this side (the client learns why); no-op for an unknown session.
  void Close(uint64_t session, const absl::Status& why);

  grpc::Status Open(grpc::ServerContext* ctx, const ::k3serve::v1::NcclOpenRequest* req,
                    grpc::ServerWriter<::k3serve::v1::NcclOpenEvent>* writer) override;

 private:
  NcclRendezvousServer(OnOpen on_open, OnClosed on_closed);

  const OnOpen on_open_;
  const OnClosed on_closed_;
  GrpcServer grpc_;
  std::string address_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<uint64_t, absl::Status> closing_;  // sessions Close ended, with why
  int open_streams_ = 0;
};

// The attention node's side: one open stream.
class NcclRendezvousClient {
 public:
  // Sends the request and waits up to timeout for the expert node's answer. on_lost runs once,
  // on a thread of its own, when the stream breaks (UNAVAILABLE with the reason) — never after
  // the destructor returns.
  static absl::StatusOr<std::unique_ptr<NcclRendezvousClient>> Open(const std::string& address,
                                                                    const NcclOpenRequest& request,
                                                                    absl::Duration timeout,
                                                                    std::function<void(absl::Status)> on_lost);
  ~NcclRendezvousClient();  // cancels the stream: the server's on_closed runs

  const NcclAccepted& accepted() const { return accepted_; }

 private:
  NcclRendezvousClient() = default;
  void Watch(std::function<void(absl::Status)> on_lost);

  std::unique_ptr<::k3serve::v1::NcclBootstrap::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<::k3serve::v1::NcclOpenEvent>> reader_;
  NcclAccepted accepted_;
  std::thread watcher_;
};

}  // namespace k3::dataplane

// The gateway: the one public k3serve.v1.Inference endpoint in front of the attention pool.
// Stateless (several can run behind one Service): it learns the attention nodes and their load
// from the router's board, forwards each Generate stream to the serving node with the least
// outstanding work, retries on another node while no token has reached the client, and never
// picks a node that is draining or not SERVING.
//
// Streams reach a node multiplexed (k3serve.v1.TokenStreams): one call per connection carries
// all of them, one message per engine step, so forwarding costs gRPC's per-message work once per
// step on the node side; each client stream is a callback reactor (no thread of its own).
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"
#include "common/metrics.h"
#include "k3serve/v1/control.grpc.pb.h"
#include "k3serve/v1/gateway.grpc.pb.h"
#include "k3serve/v1/inference.grpc.pb.h"

namespace k3::router {

namespace v1 = ::k3serve::v1;

struct GatewayOptions {
  std::string router_address;
  absl::Duration refresh = absl::Milliseconds(200);  // board polls
  // Streams opened within this window count as load the next report may not show yet.
  absl::Duration pending_window = absl::Milliseconds(800);
  int max_attempts = 3;  // nodes tried for one request before its first token
  int connections = 1;   // per attention node, each carrying one multiplexed call
};

// What a forwarded stream hears from the call that carries it.
class StreamSink {
 public:
  virtual ~StreamSink() = default;
  virtual void OnChunk(v1::StreamChunk& chunk) = 0;   // tokens, and at its end the stream's status
  virtual void OnBroken(const grpc::Status& s) = 0;  // the call to the node ended first
};

// One TokenStreams.Multiplex call to a node. Broken for good once it ends (a new one replaces it);
// its reader keeps it alive until it has told every sink.
class Multiplexed : public std::enable_shared_from_this<Multiplexed> {
 public:
  static std::shared_ptr<Multiplexed> Start(const std::shared_ptr<grpc::Channel>& channel);
  // Sends the stream's request; false (and the sink is not kept) when the call is broken. A kept
  // sink hears its stream's end, or the call's.
  bool Open(v1::StreamOpen open, std::shared_ptr<StreamSink> sink);
  // The node frees the stream; the sink hears nothing more.
  void Cancel(uint64_t stream);
  bool broken();
  void Close() { ctx_.TryCancel(); }
  // Readers still running (the gateway waits for them when it stops).
  static int live();

 private:
  Multiplexed() = default;
  void Read();

  grpc::ClientContext ctx_;
  std::unique_ptr<v1::TokenStreams::Stub> stub_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::MultiplexUp, v1::MultiplexDown>> call_;
  std::mutex write_mu_;  // one writer at a time; Finish only once no write can follow
  std::mutex mu_;
  bool broken_ = false;
  std::map<uint64_t, std::shared_ptr<StreamSink>> sinks_;
};

class Gateway final : public v1::Inference::WithCallbackMethod_Generate<v1::Inference::Service> {
 public:
  Gateway(GatewayOptions options, metrics::Registry& registry);
  ~Gateway() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                           const v1::GenerateRequest* req) override;
  grpc::Status Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req, v1::AbortResponse* resp) override;
  grpc::Status GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest* req, v1::ModelInfo* resp) override;

  // Serving attention nodes known now (the gateway's health follows it).
  int serving_nodes();
  void Stop();

 private:
  class Call;
  struct Node {
    ~Node();
    // Follows the node's grpc.health.v1 Watch: a drain shows here at once, before its next report.
    void Watch();
    // A live multiplexed call, taken in turn over the node's connections.
    std::shared_ptr<Multiplexed> Stream();
    std::string id;
    std::string address;
    std::vector<std::shared_ptr<grpc::Channel>> channels;  // one connection each
    std::unique_ptr<v1::Inference::Stub> stub;             // Abort, GetModelInfo
    std::mutex calls_mu;
    std::vector<std::shared_ptr<Multiplexed>> calls;  // per connection; null until first used
    uint32_t next_call = 0;
    bool draining = false;       // as reported
    std::atomic<bool> healthy{false};  // SERVING, as the health watch last said
    std::atomic<bool> stop_watch{false};
    std::mutex watch_mu;
    grpc::ClientContext* watch_ctx = nullptr;
    std::thread watcher;
    absl::Time down_until;       // after a failure, until the next health poll says otherwise
    int64_t reported_requests = 0;
    int64_t reported_tokens = 0;
    int open = 0;                       // streams through this gateway now
    std::deque<absl::Time> recent;      // streams opened within pending_window
  };
  // The serving node with the least outstanding work, not in `exclude`; counts the stream as open.
  std::shared_ptr<Node> Pick(const std::set<std::string>& exclude, absl::Time now);
  void Release(const std::shared_ptr<Node>& n);
  void RefreshLoop();
  void Refresh();
  grpc::Status Done(const grpc::Status& s);
  static std::unique_ptr<grpc::ClientContext> Upstream(const grpc::ServerContext& ctx);

  const GatewayOptions options_;
  std::unique_ptr<v1::AttentionBoard::Stub> board_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Node>> nodes_;          // by node id
  std::map<std::string, std::shared_ptr<Node>> by_request_id_;  // live requests that named themselves
  std::atomic<uint64_t> next_stream_{1};
  bool stopping_ = false;
  std::thread refresher_;

  metrics::Family<metrics::Counter>* m_requests_;
  metrics::Counter* m_retries_;
  metrics::Gauge* m_inflight_;
};

}  // namespace k3::router

// The gateway: the one public k3serve.v1.Inference endpoint in front of the attention pool.
// Stateless (several can run behind one Service): it learns the attention nodes and their load
// from the router's board, forwards each Generate stream to the serving node with the least
// outstanding work, retries on another node while no token has reached the client, and never
// picks a node that is draining or not SERVING.
//
// Streams reach a node multiplexed (k3serve.v1.TokenStreams): one call per connection carries
// all of them, one message per engine step, so the node pays gRPC's per-message work once per
// step rather than per token and stream. The client streams and those calls are asynchronous, on
// one completion queue that one thread serves: forwarding a token hops no thread.
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
#include "common/grpc_async.h"
#include "common/metrics.h"
#include "k3serve/v1/control.grpc.pb.h"
#include "k3serve/v1/gateway.grpc.pb.h"
#include "k3serve/v1/inference.grpc.pb.h"
#include "router/gateway_health.h"

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

class Gateway final : public v1::Inference::WithAsyncMethod_Generate<v1::Inference::Service> {
 public:
  Gateway(GatewayOptions options, metrics::Registry& registry);
  ~Gateway() override;

  // Starts serving Generate and Health on `cq` (the server's, from ServerBuilder::AddCompletionQueue) and
  // following the router's board.
  void Serve(std::unique_ptr<grpc::ServerCompletionQueue> cq);
  grpc::Status Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req, v1::AbortResponse* resp) override;
  grpc::Status GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest* req, v1::ModelInfo* resp) override;

  // Serving attention nodes known now (the gateway's health follows it).
  int serving_nodes();
  // The gateway's grpc.health.v1 service ("" and k3serve.v1.Inference), on the loop's completion queue:
  // register it and its BuilderOption with the server.
  AsyncHealth& health() { return health_; }
  // After the server's Shutdown: closes the calls to the nodes, ends the health watches and stops the
  // completion queue.
  void Stop();

 private:
  class Call;
  class Mux;
  class HealthWatch;
  class BoardPoll;
  struct Node {
    ~Node();
    bool healthy() const;  // SERVING, as its health watch last said
    std::string id;
    std::string address;
    std::vector<std::shared_ptr<grpc::Channel>> channels;  // one connection each
    std::unique_ptr<v1::Inference::Stub> stub;             // Abort, GetModelInfo
    bool draining = false;       // as reported
    HealthWatch* watch = nullptr;  // until Stop; it stops with the Node
    absl::Time down_until;       // after a failure, until the next health poll says otherwise
    int64_t reported_requests = 0;
    int64_t reported_tokens = 0;
    int open = 0;                       // streams through this gateway now
    std::deque<absl::Time> recent;      // streams opened within pending_window
  };
  // The serving node with the least outstanding work, not in `exclude`; counts the stream as open.
  std::shared_ptr<Node> Pick(const std::set<std::string>& exclude, absl::Time now);
  void Release(const std::shared_ptr<Node>& n);
  // The completion queue's thread: every Call and Mux lives on it.
  void Loop();
  // A live multiplexed call to the node, its connections taken in turn (loop thread).
  Mux* MuxFor(const std::shared_ptr<Node>& n);
  // The board's list now (blocking), then Apply.
  void Refresh();
  // The nodes as the board lists them (unless the list failed: the last ones are kept).
  void Apply(const grpc::Status& s, const v1::AttentionNodes& list);
  grpc::Status Done(const grpc::Status& s);
  static std::unique_ptr<grpc::ClientContext> Upstream(const grpc::ServerContext& ctx);

  const GatewayOptions options_;
  std::unique_ptr<v1::AttentionBoard::Stub> board_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Node>> nodes_;          // by node id
  std::map<std::string, std::shared_ptr<Node>> by_request_id_;  // live requests that named themselves
  bool stopping_ = false;
  BoardPoll* board_poll_ = nullptr;  // until Stop

  AsyncHealth health_;
  // The loop thread's own.
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::thread loop_;
  std::map<Node*, std::vector<Mux*>> muxes_;  // per connection; null until used (a Mux holds its Node)
  uint32_t next_mux_ = 0;
  uint64_t next_stream_ = 1;
  bool closing_ = false;                      // Stop: no new calls to the nodes
  // Stop waits for them; the health watches and the board poll count as watches.
  std::atomic<int> live_calls_{0}, live_muxes_{0}, live_watches_{0};

  metrics::Family<metrics::Counter>* m_requests_;
  metrics::Counter* m_retries_;
  metrics::Gauge* m_inflight_;
};

}  // namespace k3::router

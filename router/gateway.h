// The gateway: the one public k3serve.v1.Inference endpoint in front of the attention pool.
// Stateless (several can run behind one Service): it learns the attention nodes and their load
// from the router's board, forwards each Generate stream to the serving node with the least
// outstanding work, retries on another node while no token has reached the client, and never
// picks a node that is draining or not SERVING.
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
#include "k3serve/v1/inference.grpc.pb.h"

namespace k3::router {

namespace v1 = ::k3serve::v1;

struct GatewayOptions {
  std::string router_address;
  absl::Duration refresh = absl::Milliseconds(200);  // board polls
  // Streams opened within this window count as load the next report may not show yet.
  absl::Duration pending_window = absl::Milliseconds(800);
  int max_attempts = 3;  // nodes tried for one request before its first token
  int connections = 4;   // per attention node
};

class Gateway final : public v1::Inference::Service {
 public:
  Gateway(GatewayOptions options, metrics::Registry& registry);
  ~Gateway() override;

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req, v1::AbortResponse* resp) override;
  grpc::Status GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest* req, v1::ModelInfo* resp) override;

  // Serving attention nodes known now (the gateway's health follows it).
  int serving_nodes();
  void Stop();

 private:
  struct Node {
    ~Node();
    // Follows the node's grpc.health.v1 Watch: a drain shows here at once, before its next report.
    void Watch();
    std::string id;
    std::string address;
    // Several connections: one HTTP/2 connection carrying every stream is read by one thread at
    // a time on both ends. Streams take them in turn.
    std::vector<std::unique_ptr<v1::Inference::Stub>> stubs;
    std::atomic<uint32_t> next_stub{0};
    v1::Inference::Stub& stub() { return *stubs[next_stub++ % stubs.size()]; }
    std::shared_ptr<grpc::Channel> channel;  // the first connection (health watch)
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
  bool stopping_ = false;
  std::thread refresher_;

  metrics::Family<metrics::Counter>* m_requests_;
  metrics::Counter* m_retries_;
  metrics::Gauge* m_inflight_;
};

}  // namespace k3::router

// An expert node: hosts the routed experts of its slots, gathers rows from every attention node
// within a short batching window, runs them grouped by expert, and replies with per-token weighted
// partial sums (a token's experts on this node pre-summed).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/time/time.h"
#include "common/metrics.h"
#include "engine/config.h"
#include "engine/weights.h"
#include "k3serve/v1/control.grpc.pb.h"

namespace k3 {
namespace v1 = ::k3serve::v1;
}  // namespace k3
#include "router/transport.h"
#include "router/wire.h"

namespace k3 {

class GpuExperts;  // expert_service/gpu_experts.h, in CUDA builds

struct ExpertNodeOptions {
  std::string node_id;
  std::string device = "cpu";  // or "cuda" (CUDA builds): the slots' experts on the GPU
  // The longest wait for more rows: a batch starts as soon as every attention node that is sending
  // has sent its rows for the batch's layer, or after this long.
  absl::Duration batch_window = absl::Microseconds(200);
  absl::Duration sending = absl::Milliseconds(10);  // an attention node counts as sending this long after a request
  int64_t max_batch_messages = 64;                        // ... or until this many requests are queued
  // Data-plane connections must open with a Hello carrying this token (empty: no handshake needed).
  std::string node_token;
  // A batch whose window can close at once runs on the transport's thread, not the worker's.
  bool inline_batches = true;
  int32_t slot_capacity = 0;  // most (layer, expert) slots one placement may give this node (0: no limit)
};

class ExpertNode final : public v1::ExpertAdmin::Service {
 public:
  ExpertNode(ModelConfig config, std::shared_ptr<const Checkpoint> checkpoint, ExpertNodeOptions options,
             metrics::Registry& registry);
  ~ExpertNode() override;

  // Starts serving rows on the data plane.
  absl::Status Listen(dataplane::Transport& transport, const std::string& address);
  const std::string& data_address() const;

  // Loads a placement version's slots beside those of the versions still held: rows in flight on
  // an older version keep being answered until the router releases it.
  grpc::Status LoadSlots(grpc::ServerContext* ctx, const v1::LoadSlotsRequest* req, v1::LoadSlotsResponse* resp) override;
  grpc::Status ReleaseSlots(grpc::ServerContext* ctx, const v1::ReleaseSlotsRequest* req,
                            v1::ReleaseSlotsResponse* resp) override;
  grpc::Status Drain(grpc::ServerContext* ctx, const v1::DrainRequest* req, v1::DrainResponse* resp) override;
  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req, v1::ExpertStatus* resp) override;

  // Stops the data plane after the queued rows are answered.
  void Stop();

 private:
  struct Item {
    dataplane::ConnectionId from;
    dataplane::Buffer msg;
    absl::StatusOr<wire::ExpertRequest> request;  // borrows msg
    int64_t received_ns = 0;                       // CLOCK_MONOTONIC
  };
  // What the batching window knows of one attention node (connection).
  struct Sender {
    int64_t last_seen_ns = 0;
    uint32_t last_layer = 0;  // of its latest request
  };
  struct Slots {
    uint64_t version = 0;
    std::set<std::pair<int32_t, int32_t>> slots;
    std::shared_ptr<const ModelWeights> weights;  // only the slots' experts loaded (CPU)
    std::shared_ptr<GpuExperts> gpu;              // the same slots on the GPU (--device cuda)
  };
  using Held = std::map<uint64_t, std::shared_ptr<const Slots>>;  // by placement version
  void Worker();
  // True when no attention node that is sending still has to send rows for `layer` (under mu_).
  bool WindowCanClose(uint32_t layer, int64_t now_ns) const;
  void RunBatch(std::vector<Item>& items, const Held& held);
  // Distinct slots over the held versions; mu_ held.
  int64_t HeldSlotsLocked() const;
  void ReplyError(dataplane::ConnectionId to, uint64_t request_id, const absl::Status& s);
  // The handshake, on the transport's thread: false if the message must not be queued.
  bool Admit(dataplane::ConnectionId from, const dataplane::Buffer& msg);

  const ModelConfig config_;
  const std::shared_ptr<const Checkpoint> checkpoint_;
  const ExpertNodeOptions options_;
  std::unique_ptr<dataplane::Server> server_;
  std::set<dataplane::ConnectionId> greeted_;  // passed the handshake; transport thread only

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::map<dataplane::ConnectionId, Sender> senders_;
  bool stopping_ = false;
  bool busy_ = false;  // a batch is running (worker or transport thread): one at a time
  Held held_;
  std::thread worker_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> rows_processed_{0}, batches_processed_{0};

  metrics::Histogram* m_batch_rows_;
  metrics::Histogram* m_batch_requests_;
  metrics::Histogram* m_batch_seconds_;
  metrics::Counter* m_rows_;
  metrics::Counter* m_busy_seconds_;
  metrics::Gauge* m_slots_;
  metrics::Gauge* m_version_;
  metrics::Family<metrics::Counter>* m_errors_;
};

}  // namespace k3

// The remote ExpertExecutor of an attention node: gate output (rows, top-k ids and weights) →
// replica choice → one message per expert node → UCX → gather the nodes' partial sums → sum.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "engine/expert_executor.h"
#include "router/placement.h"
#include "router/transport.h"
#include "router/wire.h"

namespace k3::router {

struct DispatcherOptions {
  absl::Duration timeout = absl::Seconds(30);  // per MoE dispatch; then DEADLINE_EXCEEDED
  wire::RowDType dtype = wire::RowDType::kF32;  // rows and partial sums on the wire
  // Called on the transport's thread after every dispatch part completes (metrics); must not block.
  std::function<void(const std::string& node_id, size_t bytes_out, size_t bytes_in, absl::Duration)> on_part;
  // Called on the transport's thread when an expert node fails; must not block.
  std::function<void(const std::string& node_id, const absl::Status& why)> on_node_failure;
};

class Dispatcher : public ExpertExecutor {
 public:
  Dispatcher(const ModelConfig& config, dataplane::Transport& transport, DispatcherOptions options);
  ~Dispatcher() override;

  // Installs a placement: connects to its new nodes first, then switches at once (a dispatch
  // uses one version from start to end), then drops the nodes it no longer names. Requests in
  // flight finish on the placement they started with.
  absl::Status SetPlacement(std::shared_ptr<const PlacementTable> placement);
  // Waits until no dispatch is in flight on a placement other than `version`; false on timeout.
  bool WaitDrained(uint64_t version, absl::Duration timeout);
  // A complete placement whose every node is connected and has not failed.
  bool ready() const;
  uint64_t placement_version() const;

  absl::StatusOr<uint64_t> Submit(const ExpertRequest& request) override;
  absl::Status Wait(uint64_t ticket, float* out) override;

 private:
  struct Peer {
    std::string node_id;
    std::string address;
    std::unique_ptr<dataplane::Connection> conn;
    bool failed = false;
    int64_t outstanding_rows = 0;  // balances replica choice
  };
  struct Part {
    std::shared_ptr<Peer> peer;
    std::vector<int32_t> rows;  // request rows this node sums
    std::vector<float> sums;    // [rows, width] once replied
    uint64_t wire_id = 0;       // the message's request id
    bool done = false;
    size_t bytes_out = 0;
  };
  struct Pending {
    int64_t rows = 0, width = 0;
    std::vector<Part> parts;
    int remaining = 0;
    absl::Status status;
    absl::Time start;
    uint64_t version = 0;  // the placement it was routed on
  };

  void OnMessage(const std::string& node_id, dataplane::Buffer msg);
  void OnFailure(const std::string& node_id, const absl::Status& why);
  void FinishPart(uint64_t wire_id, const absl::Status& status, std::span<const float> sums, size_t bytes_in);

  const ModelConfig& config_;
  dataplane::Transport& transport_;
  DispatcherOptions options_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<const PlacementTable> placement_;
  std::map<std::string, std::shared_ptr<Peer>> peers_;  // by node id, for the current placement
  std::map<uint64_t, Pending> pending_;                 // by ticket
  std::map<uint64_t, std::pair<uint64_t, size_t>> parts_;  // wire request id -> (ticket, part)
  std::map<uint64_t, int64_t> in_flight_;                 // placement version -> dispatches on it
  uint64_t next_ticket_ = 1;
  std::atomic<uint64_t> next_wire_id_{1};  // taken outside mu_, while messages are encoded
};

}  // namespace k3::router

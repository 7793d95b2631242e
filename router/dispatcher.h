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

#include "absl/container/inlined_vector.h"
#include "absl/time/time.h"
#include "engine/expert_executor.h"
#include "router/placement.h"
#include "router/transport.h"
#include "router/wire.h"

namespace k3::router {

// Where one dispatch part's time went. out and back compare the two nodes' CLOCK_MONOTONIC, so they
// are meaningful on one host only; their sum is meaningful anywhere.
struct DispatchStages {
  absl::Duration pack;     // routing, replica choice, rows to wire dtype, encoding (whole dispatch)
  absl::Duration out;      // send to arrival at the expert node
  absl::Duration window;   // waiting in the expert node's batching window
  absl::Duration compute;  // the expert batch up to this reply's send
  absl::Duration back;     // reply send to arrival here
  absl::Duration unpack;   // decoding the reply and summing the partials
  bool decode = false;     // the request's rows were all decode tokens (ExpertRequest::decode)
};

struct DispatcherOptions {
  // A dispatch part unanswered this long marks its node suspect (reported, avoided for a while)
  // and is retried on a replica, else fails UNAVAILABLE naming the node. Zero: adaptive, the
  // margin above twice the slowest recent round trip.
  absl::Duration timeout = absl::ZeroDuration();
  absl::Duration timeout_margin = absl::Milliseconds(500);
  wire::RowDType dtype = wire::RowDType::kF32;  // rows and partial sums on the wire
  // Wait polls the connections (Connection::Poll) this long before it sleeps: the reply is taken the
  // moment it lands, without waking the transport's thread and then this one. Zero: sleep at once.
  absl::Duration poll = absl::ZeroDuration();
  // A dispatch of at most this many rows goes whole to one node where one hosts every expert it
  // needs (replicas allow it): one message and one wake-up instead of one per node, which is most
  // of a small dispatch's round trip. The least-loaded such node takes it. Larger dispatches, and
  // those no one node can serve, spread their pairs over the replicas by load. Zero: never.
  int64_t one_node_max_rows = 64;
  std::string node_token;  // sent as each connection's first message (wire::Hello)
  // Called where a part's reply is taken (the transport's thread, or Wait's while it polls) after every dispatch
  // part completes (metrics); must not block.
  std::function<void(const std::string& node_id, size_t bytes_out, size_t bytes_in, absl::Duration)> on_part;
  // Called on the engine's thread (in Wait) for every part that succeeded; must not block.
  std::function<void(const std::string& node_id, const DispatchStages&)> on_stages;
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
    // Did not answer in time: until then its replicas take its rows, and a retry skips it. It is
    // still connected and may only have been slow, so rows without another replica still go to it
    // (failing them at once would fail every request for the whole window).
    absl::Time suspect_until = absl::InfinitePast();
    int64_t outstanding_rows = 0;  // balances replica choice
    bool connected() const { return !failed && conn; }
    bool suspect(absl::Time now) const { return suspect_until > now; }
  };
  struct Part {
    std::shared_ptr<Peer> peer;
    std::vector<int32_t> rows;  // request rows this node sums
    std::vector<float> sums;    // [rows, width] once replied
    uint64_t wire_id = 0;       // the message's request id
    bool done = false;
    size_t bytes_out = 0;
    // Stage timestamps and durations, CLOCK_MONOTONIC ns (DispatchStages).
    int64_t sent_ns = 0, arrived_ns = 0, decode_ns = 0;
    wire::ExpertReply timing;  // received_at_ns, queued_ns, compute_ns; sums not kept
  };
  struct Pending {
    int64_t rows = 0, width = 0;
    std::vector<Part> parts;
    int remaining = 0;
    absl::Status status;
    absl::Time start;
    ExpertRequest request;  // the caller's, valid until Wait returns: a retry re-sends it
    int attempt = 0;
    int64_t pack_ns = 0;
    uint64_t version = 0;  // the placement it was routed on
  };
  // The reply's timings and when it arrived, for DispatchStages.
  struct Arrival {
    const wire::ExpertReply* reply = nullptr;
    int64_t arrived_ns = 0;
  };

  void OnMessage(const std::string& node_id, dataplane::Buffer msg);
  void OnFailure(const std::string& node_id, const absl::Status& why);
  absl::StatusOr<uint64_t> SubmitAttempt(const ExpertRequest& request, int attempt);
  using Polled = absl::InlinedVector<dataplane::Connection*, 8>;
  // Wait's polling, mu_ released meanwhile: the connections of p's unanswered parts join `polled`
  // (BeginPoll), and each of those is polled once; false if none can be. EndPolls ends them all.
  bool PollParts(const Pending& p, Polled& polled, std::unique_lock<std::mutex>& lock);
  void EndPolls(Polled& polled, std::unique_lock<std::mutex>& lock);
  absl::Duration Timeout() const;  // mu_ held
  absl::Status CheckNewer(const PlacementTable& placement) const;  // mu_ held
  void FinishPart(uint64_t wire_id, const absl::Status& status, const Arrival& arrival, size_t bytes_in);

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
  absl::Duration slowest_ = absl::ZeroDuration();  // recent slowest part round trip (decays)
  // Parts that timed out, by wire request id: when they were sent. A late reply still measures a
  // round trip (the node was slow, not hung), so the adaptive timeout grows past it.
  std::map<uint64_t, absl::Time> late_;
  std::atomic<uint64_t> next_wire_id_{1};  // taken outside mu_, while messages are encoded
};

}  // namespace k3::router

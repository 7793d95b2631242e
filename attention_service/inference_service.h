// The public gRPC API (k3serve.v1.Inference), a thin layer over the engine loop.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <grpcpp/alarm.h>

#include "attention_service/engine_loop.h"
#include "common/grpc_async.h"
#include "common/metrics.h"
#include "k3serve/v1/inference.grpc.pb.h"

namespace k3 {
namespace v1 = ::k3serve::v1;
}  // namespace k3

namespace k3 {

struct InferenceOptions {
  std::string model_name;
  int32_t max_tokens_limit = 4096;
  // Whether the experts can serve now (a complete placement, connected); else UNAVAILABLE.
  std::function<bool()> ready = [] { return true; };
  // The routing mode in use ("frozen" or "adaptive") and its bias version, for GetModelInfo.
  std::function<std::pair<std::string, uint64_t>()> routing = [] { return std::pair<std::string, uint64_t>{"frozen", 0}; };
};

// Generate is asynchronous: one thread serves every stream from one completion queue, woken once
// per engine step (a Bell that sets an alarm), so a token costs no thread of its own.
class InferenceService final : public v1::Inference::WithAsyncMethod_Generate<v1::Inference::Service> {
 public:
  // The server starts (health NOT_SERVING) before the weights are loaded; requests get UNAVAILABLE
  // until Attach.
  InferenceService(InferenceOptions options, metrics::Registry& registry);
  ~InferenceService() override;  // Stop
  void Attach(const ModelConfig& config, EngineLoop& loop);
  // Starts serving Generate on `cq` (the server's, from ServerBuilder::AddCompletionQueue).
  void Serve(std::unique_ptr<grpc::ServerCompletionQueue> cq);
  // After the server's Shutdown: stops the completion queue.
  void Stop();

  grpc::Status Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req, v1::AbortResponse* resp) override;
  grpc::Status GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest* req, v1::ModelInfo* resp) override;

  // One admitted request, whichever call carries it (Generate, or a stream of TokenStreams).
  struct Request {
    ~Request();  // gives back its share of inflight() and outstanding_tokens()
    InferenceService* service = nullptr;
    uint64_t id = 0;
    std::string name;  // request_id; "" if none
    int32_t prompt_tokens = 0;
    bool prompt_counted = false;
    absl::Time arrival, last, deadline;
    int generated = 0;
    int64_t outstanding = 0;  // prompt (until the first token) + tokens still to generate
    std::shared_ptr<TokenStream> stream;
  };
  // Checks and queues a request; the engine's own verdict comes on its stream (EngineLoop::Add),
  // and `bell` rings after each step that gave the request output.
  absl::StatusOr<std::unique_ptr<Request>> Admit(const v1::GenerateRequest& req, absl::Time arrival, absl::Time deadline,
                                                 std::shared_ptr<Bell> bell);
  // Adds one engine output to `resp` (tokens; finish and usage at the end); true when it ends the
  // request, with its status in *end (the response is sent only when that is OK).
  bool Take(Request& r, StepOutput& o, v1::GenerateResponse* resp, grpc::Status* end);
  // Ends the request with `s`; `abort`: the engine still holds it.
  grpc::Status End(Request& r, const grpc::Status& s, bool abort);
  // The message the streams still open end with once a drain timed out; null before.
  const std::string* ended() const { return end_remaining_ ? &end_message_ : nullptr; }
  // A request whose client went away: DEADLINE_EXCEEDED when that was its deadline, else
  // CANCELLED with `what`.
  static grpc::Status ClientGone(absl::Time deadline, const char* what);
  // Counts a call's final status.
  grpc::Status Finish(const grpc::Status& s);

  // Drain: new requests get UNAVAILABLE; those in flight go on.
  void SetDraining();
  // The end of a drain: the streams still open end with UNAVAILABLE and this message.
  void EndRemaining(std::string message);
  // Requests refused because of the drain.
  int64_t refused_draining() const { return refused_draining_.load(); }
  // Requests in flight now, direct and through gateways.
  int64_t inflight() const { return inflight_.load(); }
  // Prompt tokens and tokens still to generate of the live requests.
  int64_t outstanding_tokens() const { return outstanding_tokens_.load(); }
  // Mean inter-token latency since the previous call (0 if no token followed another).
  double TakeMeanItl();

  // The completion queue's loop (tags: common/grpc_async.h), for other calls on it (the gateway's multiplexed ones).
  // Woken after every engine step that gave output (loop thread).
  struct Pumped {
    virtual ~Pumped() = default;
    virtual void Pump() = 0;
  };
  void AddPumped(Pumped* p) { live_.insert(p); }
  void RemovePumped(Pumped* p) { live_.erase(p); }
  grpc::ServerCompletionQueue* cq() { return cq_.get(); }
  const std::shared_ptr<Bell>& bell() const { return bell_; }
  // Calls on the queue now, pending ones included: Stop waits for them.
  void CallStarted() { ++live_calls_; }
  void CallEnded() { --live_calls_; }

 private:
  class Stream;
  void Loop();
  void Wake(bool ok);  // the alarm: an engine step gave output, or the drain timed out

  const InferenceOptions options_;
  std::atomic<const ModelConfig*> config_{nullptr};
  std::atomic<EngineLoop*> loop_{nullptr};
  std::atomic<uint64_t> next_id_{1};
  std::mutex mu_;
  std::map<std::string, uint64_t> by_request_id_;  // live requests that named themselves
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> refused_draining_{0};
  std::atomic<bool> end_remaining_{false};
  std::string end_message_;  // set before end_remaining_
  std::atomic<int64_t> inflight_{0};
  std::atomic<int64_t> outstanding_tokens_{0};
  std::mutex itl_mu_;
  double itl_sum_ = 0;
  int64_t itl_count_ = 0;

  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::thread cq_thread_;
  std::unique_ptr<CqEvent> wake_;
  grpc::Alarm alarm_;
  std::mutex alarm_mu_;
  bool alarm_set_ = false, stopped_ = false;  // under alarm_mu_
  std::shared_ptr<Bell> bell_;                // every Generate stream's
  std::set<Pumped*> live_;                    // calls with requests in the engine (loop thread)
  std::atomic<int> live_calls_{0};

  metrics::Family<metrics::Counter>* m_requests_;
  metrics::Histogram* m_ttft_;
  metrics::Histogram* m_itl_;
  metrics::Histogram* m_e2e_;
  metrics::Counter* m_prompt_tokens_;
  metrics::Counter* m_generated_tokens_;
};

}  // namespace k3

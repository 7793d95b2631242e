// The engine's own thread: the gRPC handlers (any thread) add and abort requests and read their
// streams of tokens; one thread owns the Engine and steps it while there is work.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <variant>

#include "absl/time/time.h"
#include "engine/engine.h"

namespace k3 {

// Wakes the one reader of many streams (the completion queue serving Generate and the gateway's
// calls) once per engine step rather than once per stream.
class Bell {
 public:
  explicit Bell(std::function<void()> on_ring) : on_ring_(std::move(on_ring)) {}
  void Ring() { on_ring_(); }

 private:
  const std::function<void()> on_ring_;
};

// The tokens of one request as the engine produces them.
class TokenStream {
 public:
  explicit TokenStream(std::shared_ptr<Bell> bell) : bell_(std::move(bell)) {}
  // What arrived since the last call (no wait).
  std::vector<StepOutput> Take();
  void Push(StepOutput o);
  // Rung (by the engine thread) after the step that pushed to this stream.
  Bell* bell() const { return bell_.get(); }

 private:
  const std::shared_ptr<Bell> bell_;
  std::mutex mu_;
  std::deque<StepOutput> outputs_;
};

class EngineLoop {
 public:
  // Called on the engine thread after every iteration (metrics); `step` is the engine step's wall
  // time (zero when the iteration only took commands).
  using OnStep = std::function<void(const EngineStats&, absl::Duration step)>;

  // admission_window: when requests arrive at an idle engine, how long it waits for more of them
  // (until max_running are queued) before its first step, so that a burst's prompts are prefilled
  // together instead of the first one alone while the rest wait a whole prefill step.
  EngineLoop(Backend& backend, EngineOptions options, OnStep on_step,
             absl::Duration admission_window = absl::ZeroDuration());
  ~EngineLoop();

  // Queues a request without waiting for the engine: the validation error, if any
  // (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...), arrives on the stream as its only output (kError).
  // Many requests queued at once are admitted in one step.
  std::shared_ptr<TokenStream> Add(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& p,
                                   std::shared_ptr<Bell> bell);
  // Frees the request's state (no-op if it already finished).
  void Abort(uint64_t id);
  // Finishes the requests in flight, then stops (no new ones are admitted meanwhile).
  void Stop();
  // Prompt + generated tokens a request may reach.
  int64_t max_context() const { return max_context_; }

 private:
  struct AddCmd {
    uint64_t id;
    std::vector<int32_t> prompt;
    SamplingParams params;
    std::shared_ptr<TokenStream> stream;  // the engine thread keeps it once the request is admitted
  };
  struct AbortCmd {
    uint64_t id;
  };
  void Run();

  Engine engine_;
  const int64_t max_context_;
  const int64_t max_running_;
  const absl::Duration admission_window_;
  OnStep on_step_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::variant<AddCmd, AbortCmd>> commands_;
  bool stopping_ = false;
  std::map<uint64_t, std::shared_ptr<TokenStream>> streams_;  // engine thread only
  std::thread thread_;
};

}  // namespace k3

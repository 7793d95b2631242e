// The serving engine: many sequences, continuous batching, sampling (Triton-style core behind a
// narrow API; the gRPC front end and the CLI are thin layers over it).
//
// Each Step() runs one ragged batch that mixes decode tokens of running sequences and prefill
// chunks of new ones (chunked prefill under a token budget), samples, and reports new tokens.
// Decode tokens go first and prefill chunks fill the rest of the budget (short prompts before long
// ones), so a long prompt delays the others' next token, and a short prompt's first, by at most
// one chunk.
// Not thread-safe: one thread owns the engine and calls Add/Abort/Step.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "engine/backend.h"
#include "engine/sampler.h"

namespace k3 {

struct EngineOptions {
  int64_t max_batch_tokens = 2048;  // tokens per step (decode tokens + prefill chunks)
  int64_t max_running = 64;         // sequences holding state at once
  int64_t max_waiting = 1024;       // queued sequences beyond which Add says RESOURCE_EXHAUSTED
  int64_t max_context = 0;          // prompt + generated tokens; 0: the model's model_max_length
  int64_t max_prompt_tokens = 0;    // longer prompts get INVALID_ARGUMENT; 0: only max_context bounds them
  int64_t max_new_tokens_limit = 1 << 16;
};

enum class FinishReason { kNone, kLength, kStop, kAborted, kError };
const char* FinishReasonName(FinishReason r);

struct StepOutput {
  uint64_t id = 0;
  std::vector<int32_t> tokens;   // new tokens this step (0 or 1)
  FinishReason finish = FinishReason::kNone;
  absl::Status error;            // set when finish == kError
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;  // so far
};

struct EngineStats {
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t state_bytes = 0;
};

class Engine {
 public:
  Engine(Backend& backend, EngineOptions options = {});

  // Queues a sequence. INVALID_ARGUMENT names the bad field; RESOURCE_EXHAUSTED when the queue is
  // full; ALREADY_EXISTS for a live id.
  absl::Status Add(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& params);
  // Drops a sequence and frees its state. NOT_FOUND if it is not live.
  absl::Status Abort(uint64_t id);
  // One iteration. Sequences hit by a failing forward finish with kError; the engine stays usable.
  std::vector<StepOutput> Step();

  bool HasWork() const { return !sequences_.empty(); }
  EngineStats Stats() const;
  int64_t max_context() const { return max_context_; }

 private:
  struct Sequence {
    uint64_t id;
    std::vector<int32_t> tokens;  // prompt then generated
    int64_t prompt_len;
    int64_t consumed = 0;         // tokens fed through the model
    SamplingParams params;
    Sampler sampler;
    int32_t state = -1;  // the backend's state, allocated when the sequence starts running
  };
  absl::Status Validate(const std::vector<int32_t>& prompt, const SamplingParams& p) const;
  bool IsStop(const Sequence& s, int32_t token) const;

  // Frees the sequence's state and forgets it.
  void Drop(uint64_t id);
  // Ends the sequences whose deadline has passed (DEADLINE_EXCEEDED).
  void ExpireDeadlines(std::vector<StepOutput>* out);

  Backend& backend_;
  EngineOptions options_;
  int64_t max_context_;
  std::map<uint64_t, std::unique_ptr<Sequence>> sequences_;
  std::deque<uint64_t> order_;  // admission order: running first, then waiting
};

// One prompt, greedy, through the engine on the CPU model with in-process experts (conformance,
// tests).
absl::StatusOr<std::vector<int32_t>> GenerateGreedy(const Model& model, const std::vector<int32_t>& prompt, int max_new);

}  // namespace k3

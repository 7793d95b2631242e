#include "engine/engine.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace k3 {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kAborted: return "aborted";
    case FinishReason::kError: return "error";
  }
  return "?";
}

Engine::Engine(Backend& backend, EngineOptions options) : backend_(backend), options_(options) {
  max_context_ = options_.max_context > 0 ? options_.max_context : backend.config().max_position;
  if (max_context_ <= 0) max_context_ = 1 << 20;
}

absl::Status Engine::Validate(const std::vector<int32_t>& prompt, const SamplingParams& p) const {
  const int64_t V = backend_.config().vocab_size;
  if (prompt.empty()) return absl::InvalidArgumentError("prompt_ids must not be empty");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= V)
      return absl::InvalidArgumentError(
          absl::StrCat("prompt_ids[", i, "] = ", prompt[i], " is outside the vocabulary [0, ", V, ")"));
  K3_RETURN_IF_ERROR(ValidateSampling(p, V));
  if (p.max_new_tokens > options_.max_new_tokens_limit)
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens = ", p.max_new_tokens, " exceeds the limit ", options_.max_new_tokens_limit));
  if (static_cast<int64_t>(prompt.size()) >= max_context_)
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_ids has ", prompt.size(), " tokens; the context limit is ", max_context_));
  if (static_cast<int64_t>(prompt.size()) + p.max_new_tokens > max_context_)
    return absl::InvalidArgumentError(absl::StrCat("prompt (", prompt.size(), ") + max_tokens (", p.max_new_tokens,
                                                   ") exceeds the context limit ", max_context_));
  if (options_.max_prompt_tokens > 0 && static_cast<int64_t>(prompt.size()) > options_.max_prompt_tokens)
    return absl::InvalidArgumentError(absl::StrCat("prompt_ids has ", prompt.size(), " tokens; the limit is ",
                                                   options_.max_prompt_tokens, " (--max-prompt-tokens)"));
  return absl::OkStatus();
}

absl::Status Engine::Add(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& params) {
  K3_RETURN_IF_ERROR(Validate(prompt, params));
  if (sequences_.count(id)) return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " is already live"));
  const EngineStats st = Stats();
  if (st.waiting >= options_.max_waiting)
    return absl::ResourceExhaustedError(absl::StrCat("queue full: ", st.waiting, " sequences waiting"));
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  sequences_.emplace(id, std::make_unique<Sequence>(Sequence{id, std::move(prompt), prompt_len, 0, params,
                                                             Sampler(params), -1}));
  order_.push_back(id);
  return absl::OkStatus();
}

absl::Status Engine::Abort(uint64_t id) {
  if (!sequences_.count(id)) return absl::NotFoundError(absl::StrCat("sequence ", id, " is not live"));
  Drop(id);
  return absl::OkStatus();
}

void Engine::Drop(uint64_t id) {
  auto it = sequences_.find(id);
  if (it->second->state >= 0) backend_.FreeSequence(it->second->state);
  sequences_.erase(it);
  order_.erase(std::find(order_.begin(), order_.end(), id));
}

EngineStats Engine::Stats() const {
  EngineStats s;
  for (const auto& [id, seq] : sequences_) {
    if (seq->state >= 0) {
      ++s.running;
      s.state_bytes += backend_.SequenceBytes(seq->state);
    } else {
      ++s.waiting;
    }
  }
  return s;
}

bool Engine::IsStop(const Sequence& s, int32_t token) const {
  const auto& stop = s.params.stop_token_ids;
  if (std::find(stop.begin(), stop.end(), token) != stop.end()) return true;
  if (s.params.ignore_eos) return false;
  const auto& eos = backend_.config().eos_token_ids;
  return std::find(eos.begin(), eos.end(), token) != eos.end();
}

void Engine::ExpireDeadlines(std::vector<StepOutput>* out) {
  const absl::Time now = absl::Now();
  std::vector<uint64_t> expired;
  for (uint64_t id : order_)
    if (sequences_.at(id)->params.deadline <= now) expired.push_back(id);
  for (uint64_t id : expired) {
    const Sequence& s = *sequences_.at(id);
    const char* where = s.state < 0 ? "waiting" : s.consumed < s.prompt_len ? "prefilling" : "decoding";
    StepOutput o;
    o.id = id;
    o.finish = FinishReason::kError;
    o.error = absl::DeadlineExceededError(absl::StrCat("deadline exceeded while ", where));
    o.prompt_tokens = s.prompt_len;
    o.generated_tokens = static_cast<int64_t>(s.tokens.size()) - s.prompt_len;
    out->push_back(std::move(o));
    Drop(id);
  }
}

std::vector<StepOutput> Engine::Step() {
  std::vector<StepOutput> out;
  ExpireDeadlines(&out);
  const ModelConfig& c = backend_.config();
  // Decode tokens first (1 each), then prefill chunks fill what is left of the token budget. A
  // sequence starts running (gets state) when it first enters a batch.
  int64_t budget = options_.max_batch_tokens, running = 0;
  std::vector<Sequence*> batch;
  std::vector<BatchChunk> chunks;
  auto add = [&](Sequence& s, int64_t n) {
    budget -= n;
    const bool last = s.consumed + n == static_cast<int64_t>(s.tokens.size());
    batch.push_back(&s);
    chunks.push_back({s.state, std::span<const int32_t>(s.tokens).subspan(s.consumed, n),
                      last ? LogitsMode::kLast : LogitsMode::kNone});
  };
  auto pending = [](const Sequence& s) { return static_cast<int64_t>(s.tokens.size()) - s.consumed; };
  for (uint64_t id : order_) {
    Sequence& s = *sequences_.at(id);
    if (s.state < 0) continue;
    ++running;
    if (pending(s) == 1 && budget > 0) add(s, 1);
  }
  // Prompts that fit in a quarter of the budget go before longer ones (whose first token is far
  // off anyway), so that a short request is not queued behind a long prefill; each group keeps
  // admission order, so no prompt waits behind later ones of its own kind.
  const int64_t short_prompt = std::max<int64_t>(1, options_.max_batch_tokens / 4);
  bool full = false;  // no state for another sequence: admit nobody further
  for (bool short_pass : {true, false})
    for (uint64_t id : order_) {
      if (budget <= 0 || full) break;
      Sequence& s = *sequences_.at(id);
      if (s.state >= 0 && pending(s) == 1) continue;  // a decode, batched above
      if ((pending(s) <= short_prompt) != short_pass) continue;
      if (s.state < 0) {
        if (running >= options_.max_running) continue;  // running ones may still prefill
        auto state = backend_.NewSequence();
        if (!state.ok()) {  // the backend is full: wait for a sequence to finish
          full = true;
          break;
        }
        s.state = *state;
        ++running;
      }
      add(s, std::min(pending(s), budget));
    }
  if (batch.empty()) return out;

  std::vector<float> logits;
  const absl::Status status = backend_.Forward(chunks, &logits);

  const int64_t V = c.vocab_size;
  int64_t row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence& s = *batch[i];
    StepOutput o;
    o.id = s.id;
    o.prompt_tokens = s.prompt_len;
    if (!status.ok()) {
      // The state may have advanced through some layers only: the sequence cannot continue.
      o.finish = FinishReason::kError;
      o.error = status;
    } else {
      s.consumed += static_cast<int64_t>(chunks[i].tokens.size());
      if (chunks[i].logits == LogitsMode::kLast) {
        const int32_t tok = s.sampler.Sample(logits.data() + (row++) * V, V);
        s.tokens.push_back(tok);
        o.tokens.push_back(tok);
        const int64_t generated = static_cast<int64_t>(s.tokens.size()) - s.prompt_len;
        if (IsStop(s, tok)) {
          o.finish = FinishReason::kStop;
        } else if (generated >= s.params.max_new_tokens || static_cast<int64_t>(s.tokens.size()) >= max_context_) {
          o.finish = FinishReason::kLength;
        }
      }
    }
    o.generated_tokens = static_cast<int64_t>(s.tokens.size()) - s.prompt_len;
    if (o.finish != FinishReason::kNone) Drop(s.id);
    if (!o.tokens.empty() || o.finish != FinishReason::kNone) out.push_back(std::move(o));
  }
  return out;
}

absl::StatusOr<std::vector<int32_t>> GenerateGreedy(const Model& model, const std::vector<int32_t>& prompt,
                                                    int max_new) {
  LocalExpertExecutor experts(model.config(), model.weights());
  CpuBackend backend(model, experts);
  Engine engine(backend, EngineOptions{});
  SamplingParams p;
  p.max_new_tokens = max_new;
  p.ignore_eos = true;
  K3_RETURN_IF_ERROR(engine.Add(1, prompt, p));
  std::vector<int32_t> ids;
  while (engine.HasWork()) {
    for (const StepOutput& o : engine.Step()) {
      if (o.finish == FinishReason::kError) return o.error;
      ids.insert(ids.end(), o.tokens.begin(), o.tokens.end());
    }
  }
  return ids;
}

}  // namespace k3

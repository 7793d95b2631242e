#include "attention_service/engine_loop.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace k3 {

std::vector<StepOutput> TokenStream::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StepOutput> out(std::make_move_iterator(outputs_.begin()), std::make_move_iterator(outputs_.end()));
  outputs_.clear();
  return out;
}

void TokenStream::Push(StepOutput o) {
  std::lock_guard<std::mutex> lock(mu_);
  outputs_.push_back(std::move(o));
}

EngineLoop::EngineLoop(Backend& backend, EngineOptions options, OnStep on_step, absl::Duration admission_window)
    : engine_(backend, options),
      max_context_(engine_.max_context()),
      max_running_(options.max_running),
      admission_window_(admission_window),
      on_step_(std::move(on_step)) {
  thread_ = std::thread([this] { Run(); });
}

EngineLoop::~EngineLoop() { Stop(); }

std::shared_ptr<TokenStream> EngineLoop::Add(uint64_t id, std::vector<int32_t> prompt, const SamplingParams& p,
                                             std::shared_ptr<Bell> bell) {
  auto stream = std::make_shared<TokenStream>(std::move(bell));
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      commands_.push_back(AddCmd{id, std::move(prompt), p, stream});
      queued = true;
    }
  }
  if (queued) {
    cv_.notify_all();
  } else {
    StepOutput o;
    o.id = id;
    o.finish = FinishReason::kError;
    o.error = absl::UnavailableError("server is shutting down");
    stream->Push(std::move(o));
    stream->bell()->Ring();
  }
  return stream;
}

void EngineLoop::Abort(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(AbortCmd{id});
  }
  cv_.notify_all();
}

void EngineLoop::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::Run() {
  while (true) {
    std::deque<std::variant<AddCmd, AbortCmd>> cmds;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !commands_.empty() || engine_.HasWork() || stopping_; });
      if (stopping_ && commands_.empty() && !engine_.HasWork()) return;
      if (!engine_.HasWork() && admission_window_ > absl::ZeroDuration()) {
        const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(admission_window_);
        cv_.wait_until(lock, until, [&] { return stopping_ || static_cast<int64_t>(commands_.size()) >= max_running_; });
      }
      cmds.swap(commands_);
    }
    // The bells of the streams pushed to in this iteration, rung once at its end.
    std::vector<Bell*> bells;
    auto push = [&](TokenStream& stream, StepOutput o) {
      stream.Push(std::move(o));
      if (std::find(bells.begin(), bells.end(), stream.bell()) == bells.end()) bells.push_back(stream.bell());
    };
    for (auto& c : cmds) {
      if (auto* add = std::get_if<AddCmd>(&c)) {
        const absl::Status s = engine_.Add(add->id, std::move(add->prompt), add->params);
        if (s.ok()) {
          streams_[add->id] = std::move(add->stream);
        } else {
          StepOutput o;
          o.id = add->id;
          o.finish = FinishReason::kError;
          o.error = s;
          push(*add->stream, std::move(o));
        }
      } else {
        const uint64_t id = std::get<AbortCmd>(c).id;
        if (engine_.Abort(id).ok()) {
          StepOutput o;
          o.id = id;
          o.finish = FinishReason::kAborted;
          if (auto it = streams_.find(id); it != streams_.end()) push(*it->second, std::move(o));
        }
        streams_.erase(id);
      }
    }
    absl::Duration took;
    if (engine_.HasWork()) {
      const absl::Time t0 = absl::Now();
      std::vector<StepOutput> outputs = engine_.Step();
      took = absl::Now() - t0;
      for (StepOutput& o : outputs) {
        auto it = streams_.find(o.id);
        if (it == streams_.end()) continue;
        const bool finished = o.finish != FinishReason::kNone;
        push(*it->second, std::move(o));
        if (finished) streams_.erase(it);
      }
    }
    for (Bell* b : bells) b->Ring();
    if (on_step_) on_step_(engine_.Stats(), took);
  }
}

}  // namespace k3

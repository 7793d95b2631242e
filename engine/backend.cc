#include "engine/backend.h"

#include <chrono>

namespace k3 {

CpuBackend::CpuBackend(const Model& model, ExpertExecutor& experts, bool ping_pong, bool adaptive)
    : model_(model), experts_(experts), ping_pong_(ping_pong), adaptive_(adaptive) {}

bool CpuBackend::ChooseSplit(int64_t tokens) {
  if (!adaptive_) return true;
  SplitTiming& t = timing_[tokens];
  // A few steps each way first; then the faster, and now and then the other, since the machine's
  // load and the expert nodes change.
  constexpr int64_t kTrials = 3, kProbeEvery = 32;
  if (t.steps[0] < kTrials || t.steps[1] < kTrials) return t.steps[1] <= t.steps[0];
  const bool faster = t.ema_s[1] < t.ema_s[0];
  return (t.steps[0] + t.steps[1]) % kProbeEvery == 0 ? !faster : faster;
}

absl::StatusOr<int32_t> CpuBackend::NewSequence() {
  const int32_t seq = next_++;
  states_.emplace(seq, std::make_unique<SequenceState>(model_.config()));
  return seq;
}

void CpuBackend::FreeSequence(int32_t seq) { states_.erase(seq); }

int64_t CpuBackend::SequenceBytes(int32_t seq) const {
  auto it = states_.find(seq);
  return it == states_.end() ? 0 : it->second->bytes();
}

absl::Status CpuBackend::Forward(std::span<const BatchChunk> chunks, std::vector<float>* logits) {
  std::vector<SeqChunk> sc;
  sc.reserve(chunks.size());
  for (const BatchChunk& c : chunks) {
    auto it = states_.find(c.seq);
    if (it == states_.end()) return absl::NotFoundError(absl::StrCat("no state for sequence ", c.seq));
    sc.push_back({it->second.get(), c.tokens, c.logits});
  }
  if (!ping_pong_ || sc.size() < 2) return model_.Forward(sc, experts_, logits);
  int64_t tokens = 0;
  for (const BatchChunk& c : chunks) tokens += static_cast<int64_t>(c.tokens.size());
  const bool split = ChooseSplit(tokens);
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status status = split ? ForwardSplit(sc, logits) : model_.Forward(sc, experts_, logits);
  if (adaptive_ && status.ok()) {
    SplitTiming& t = timing_[tokens];
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double& ema = t.ema_s[split];
    ema = t.steps[split]++ == 0 ? s : 0.75 * ema + 0.25 * s;
  }
  return status;
}

absl::Status CpuBackend::ForwardSplit(std::span<const SeqChunk> sc, std::vector<float>* logits) {
  const size_t half = sc.size() / 2;
  ForwardPass a(model_, sc.first(half));
  ForwardPass b(model_, sc.subspan(half));
  ForwardPass* passes[] = {&a, &b};
  K3_RETURN_IF_ERROR(RunPasses(passes, experts_));
  *logits = std::move(a.logits());
  logits->insert(logits->end(), b.logits().begin(), b.logits().end());
  return absl::OkStatus();
}

}  // namespace k3

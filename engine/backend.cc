#include "engine/backend.h"

namespace k3 {

CpuBackend::CpuBackend(const Model& model, ExpertExecutor& experts, bool ping_pong)
    : model_(model), experts_(experts), ping_pong_(ping_pong) {}

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
  const size_t half = sc.size() / 2;
  ForwardPass a(model_, std::span<const SeqChunk>(sc).first(half));
  ForwardPass b(model_, std::span<const SeqChunk>(sc).subspan(half));
  ForwardPass* passes[] = {&a, &b};
  K3_RETURN_IF_ERROR(RunPasses(passes, experts_));
  *logits = std::move(a.logits());
  logits->insert(logits->end(), b.logits().begin(), b.logits().end());
  return absl::OkStatus();
}

}  // namespace k3

// Framing of the NCCL data plane (router/nccl_transport.h). NCCL point-to-point moves untyped
// device bytes and a receive must name its size, so every exchange starts with one fixed-size
// frame: the attention node sends a kRows frame, then the arrays it describes (x's hi and lo
// planes in bf16, idx int32, w fp32); the expert node answers with the partial sums alone
// ([rows, width] fp32, the size both sides know). kStats asks the expert node for its timings
// (one kStats frame back); kClose ends the session. The frame is read on the expert node's host,
// so it is checked there like any input from the network.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "common/status.h"

namespace k3::dataplane {

constexpr uint32_t kNcclFrameMagic = 0x434e334b;  // "K3NC"
constexpr uint16_t kNcclFrameVersion = 1;
constexpr size_t kNcclFrameBytes = 64;

enum class NcclFrameKind : uint16_t { kRows = 1, kStats = 2, kClose = 3 };

struct NcclFrame {
  NcclFrameKind kind = NcclFrameKind::kRows;
  uint64_t seq = 0;  // dispatches of this session, from 1
  int32_t layer = 0;
  int64_t rows = 0, width = 0, top_k = 0;
};

// What the expert node accepts: the model's widths, and at most max_rows rows.
struct NcclFrameLimits {
  int64_t num_layers = 0, width = 0, top_k = 0, max_rows = 0;
};

// The bytes of each array a kRows frame announces, and of the reply.
struct NcclPayload {
  size_t x_plane = 0;  // rows · width · 2, sent twice (hi, lo)
  size_t idx = 0;      // rows · top_k · 4
  size_t w = 0;        // rows · top_k · 4
  size_t sums = 0;     // rows · width · 4, the reply
  size_t out() const { return 2 * x_plane + idx + w; }
};

// The expert node's timings since the last kStats (device time from its events).
struct NcclExpertStats {
  int64_t dispatches = 0;
  int64_t bytes_in = 0, bytes_out = 0;
  double recv_ms = 0;     // rows arriving (posted after their frame: the transfer itself)
  double experts_ms = 0;  // the routed experts
  double send_ms = 0;     // the partial sums leaving
  double wall_ms = 0;     // since the last kStats, on the expert node's clock
};

using FrameBytes = std::array<std::byte, kNcclFrameBytes>;

FrameBytes EncodeFrame(const NcclFrame& f);
// INVALID_ARGUMENT naming the field for a short buffer, bad magic or version, unknown kind, or a
// kRows frame whose shape the limits refuse.
absl::StatusOr<NcclFrame> DecodeFrame(std::span<const std::byte> bytes, const NcclFrameLimits& limits);
NcclPayload PayloadOf(const NcclFrame& f);

FrameBytes EncodeStats(const NcclExpertStats& s);
absl::StatusOr<NcclExpertStats> DecodeStats(std::span<const std::byte> bytes);

}  // namespace k3::dataplane

#include "router/nccl_frame.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace k3::dataplane {
namespace {

// Little-endian fixed layout, as the hosts of both ends are (x86-64, aarch64).
template <class T>
void Put(FrameBytes& b, size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof(T));
}
template <class T>
T Get(std::span<const std::byte> b, size_t at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof(T));
  return v;
}

// Offsets: magic 0, version 4, kind 6, seq 8, layer 16, rows 24, width 32, top_k 40.
// Stats after the header (kind kStats): dispatches 8, bytes_in 16, bytes_out 24, recv 32,
// experts 40, send 48, wall 56 (ms as float64).
constexpr uint16_t kStatsTag = 0x5354;  // the version field of a stats frame: "ST"

}  // namespace

FrameBytes EncodeFrame(const NcclFrame& f) {
  FrameBytes b{};
  Put(b, 0, kNcclFrameMagic);
  Put(b, 4, kNcclFrameVersion);
  Put(b, 6, static_cast<uint16_t>(f.kind));
  Put(b, 8, f.seq);
  Put(b, 16, f.layer);
  Put(b, 24, f.rows);
  Put(b, 32, f.width);
  Put(b, 40, f.top_k);
  return b;
}

absl::StatusOr<NcclFrame> DecodeFrame(std::span<const std::byte> b, const NcclFrameLimits& lim) {
  if (b.size() != kNcclFrameBytes)
    return absl::InvalidArgumentError(absl::StrCat("frame: ", b.size(), " bytes, want ", kNcclFrameBytes));
  if (Get<uint32_t>(b, 0) != kNcclFrameMagic) return absl::InvalidArgumentError("frame.magic: not a k3serve NCCL frame");
  if (const auto v = Get<uint16_t>(b, 4); v != kNcclFrameVersion)
    return absl::InvalidArgumentError(absl::StrCat("frame.version: ", v, ", want ", kNcclFrameVersion));
  NcclFrame f;
  const auto kind = Get<uint16_t>(b, 6);
  if (kind < 1 || kind > 3) return absl::InvalidArgumentError(absl::StrCat("frame.kind: unknown kind ", kind));
  f.kind = static_cast<NcclFrameKind>(kind);
  f.seq = Get<uint64_t>(b, 8);
  f.layer = Get<int32_t>(b, 16);
  f.rows = Get<int64_t>(b, 24);
  f.width = Get<int64_t>(b, 32);
  f.top_k = Get<int64_t>(b, 40);
  if (f.kind != NcclFrameKind::kRows) return f;
  if (f.layer < 0 || f.layer >= lim.num_layers)
    return absl::InvalidArgumentError(absl::StrCat("frame.layer: ", f.layer, " not in [0, ", lim.num_layers, ")"));
  if (f.width != lim.width)
    return absl::InvalidArgumentError(absl::StrCat("frame.width: ", f.width, ", the model's is ", lim.width));
  if (f.top_k != lim.top_k)
    return absl::InvalidArgumentError(absl::StrCat("frame.top_k: ", f.top_k, ", the model's is ", lim.top_k));
  if (f.rows < 1 || f.rows > lim.max_rows)
    return absl::InvalidArgumentError(absl::StrCat("frame.rows: ", f.rows, " not in [1, ", lim.max_rows, "]"));
  return f;
}

NcclPayload PayloadOf(const NcclFrame& f) {
  NcclPayload p;
  if (f.kind != NcclFrameKind::kRows) return p;
  const size_t rows = static_cast<size_t>(f.rows), width = static_cast<size_t>(f.width),
               k = static_cast<size_t>(f.top_k);
  p.x_plane = rows * width * 2;
  p.idx = rows * k * 4;
  p.w = rows * k * 4;
  p.sums = rows * width * 4;
  return p;
}

FrameBytes EncodeStats(const NcclExpertStats& s) {
  FrameBytes b{};
  Put(b, 0, kNcclFrameMagic);
  Put(b, 4, kStatsTag);
  Put(b, 6, static_cast<uint16_t>(NcclFrameKind::kStats));
  Put(b, 8, s.dispatches);
  Put(b, 16, s.bytes_in);
  Put(b, 24, s.bytes_out);
  Put(b, 32, s.recv_ms);
  Put(b, 40, s.experts_ms);
  Put(b, 48, s.send_ms);
  Put(b, 56, s.wall_ms);
  return b;
}

absl::StatusOr<NcclExpertStats> DecodeStats(std::span<const std::byte> b) {
  if (b.size() != kNcclFrameBytes)
    return absl::InvalidArgumentError(absl::StrCat("stats frame: ", b.size(), " bytes, want ", kNcclFrameBytes));
  if (Get<uint32_t>(b, 0) != kNcclFrameMagic || Get<uint16_t>(b, 4) != kStatsTag ||
      Get<uint16_t>(b, 6) != static_cast<uint16_t>(NcclFrameKind::kStats))
    return absl::InvalidArgumentError("stats frame: bad magic, tag or kind");
  NcclExpertStats s;
  s.dispatches = Get<int64_t>(b, 8);
  s.bytes_in = Get<int64_t>(b, 16);
  s.bytes_out = Get<int64_t>(b, 24);
  s.recv_ms = Get<double>(b, 32);
  s.experts_ms = Get<double>(b, 40);
  s.send_ms = Get<double>(b, 48);
  s.wall_ms = Get<double>(b, 56);
  if (s.dispatches < 0 || s.bytes_in < 0 || s.bytes_out < 0)
    return absl::InvalidArgumentError("stats frame: negative count");
  return s;
}

}  // namespace k3::dataplane

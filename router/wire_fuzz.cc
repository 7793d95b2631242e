// libFuzzer target for the data-plane decoders and the connection handshake (scripts/fuzz.sh builds
// and runs it). Any input must be rejected or accepted without a crash, an out-of-bounds read
// (ASan), undefined behaviour (UBSan) or an allocation the input size does not justify
// (-malloc_limit_mb); whatever is accepted must encode back to exactly the same bytes, and the
// handshake accepts exactly the one Hello that carries the token.
//
// An input that starts with the shared-memory hello's magic is a hello; one that starts with the
// ring frame magic is a ring's byte stream, pushed through a small ring in pieces (so frames wrap
// and arrive in parts) and read by the same RingReader the transport uses; anything else is a
// data-plane message.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <variant>
#include <vector>

#include "router/wire.h"

namespace {

// Reads every value of a row payload, so that ASan checks the span the decoder returned.
void Touch(k3::wire::RowDType dtype, std::span<const std::byte> values) {
  std::vector<float> out(values.size() / k3::wire::RowDTypeSize(dtype));
  if (!k3::wire::ToFloat(dtype, values, out).ok()) std::abort();
}

void FuzzHello(std::span<const std::byte> msg) {
  auto hello = k3::wire::DecodeShmHello(msg);
  if (!hello.ok()) return;
  auto encoded = k3::wire::EncodeShmHello(*hello);
  if (!encoded.ok() || encoded->size() != msg.size() || std::memcmp(encoded->data(), msg.data(), msg.size()) != 0)
    std::abort();
}

// The stream goes through a 256-byte ring in pieces of 1..97 bytes; the frames read out must be
// the frames a straight parse of the stream finds, up to the first error.
void FuzzRing(std::span<const std::byte> stream) {
  constexpr uint64_t kCapacity = 256;
  constexpr uint32_t kMaxLength = 1 << 16;
  std::vector<std::byte> ring(kCapacity);
  k3::wire::RingReader reader(kCapacity, kMaxLength);
  std::vector<std::vector<std::byte>> frames;
  std::vector<std::byte> current;
  uint64_t head = 0, tail = 0;
  size_t pos = 0, step = 0;
  bool failed = false;
  while (!failed && (pos < stream.size() || tail < head)) {
    const size_t piece = std::min<size_t>({1 + (step++ * 37) % 97, stream.size() - pos, kCapacity - (head - tail)});
    for (size_t i = 0; i < piece; ++i) ring[(head + i) % kCapacity] = stream[pos + i];
    head += piece;
    pos += piece;
    auto next = reader.Read(
        ring, tail, head,
        [&](uint32_t length) {
          current.assign(length, std::byte{0});
          return current.data();
        },
        [&] { frames.push_back(current); });
    if (!next.ok()) {
      failed = true;
      break;
    }
    if (*next < tail || *next > head) std::abort();
    if (*next == tail && piece == 0) break;  // a partial frame at the end of the stream
    tail = *next;
  }
  // A straight parse of the same bytes.
  size_t at = 0, n = 0;
  while (at + k3::wire::kRingFrameHeader <= stream.size() && n < frames.size()) {
    uint32_t length;
    std::memcpy(&length, stream.data() + at + 4, 4);
    if (at + k3::wire::RingFrameBytes(length) > stream.size()) break;
    if (frames[n].size() != length ||
        (length != 0 && std::memcmp(frames[n].data(), stream.data() + at + k3::wire::kRingFrameHeader, length) != 0))
      std::abort();
    at += k3::wire::RingFrameBytes(length);
    ++n;
  }
  if (n != frames.size()) std::abort();
  // Cursors a hostile peer might write.
  if (reader.Read(ring, 0, kCapacity + 1, [](uint32_t) { return nullptr; }, [] {}).ok()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> msg(reinterpret_cast<const std::byte*>(data), size);
  uint32_t magic = 0;
  if (size >= 4) std::memcpy(&magic, data, 4);
  if (magic == k3::wire::kShmHelloMagic) {
    FuzzHello(msg);
    return 0;
  }
  if (magic == k3::wire::kRingFrameMagic) {
    FuzzRing(msg);
    return 0;
  }
  static const auto kHello = *k3::wire::Encode(k3::wire::Hello{"fuzz-node-token"});
  const bool is_hello = size == kHello.size() && std::memcmp(data, kHello.data(), size) == 0;
  if (k3::wire::CheckHello(msg, "fuzz-node-token").ok() != is_hello) std::abort();
  auto decoded = k3::wire::Decode(msg, {.num_experts = 896});
  if (!decoded.ok()) return 0;
  auto encoded = std::visit(
      [](const auto& m) {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, k3::wire::ExpertRequest>) Touch(m.dtype, m.rows);
        if constexpr (std::is_same_v<M, k3::wire::ExpertReply>) Touch(m.dtype, m.sums);
        return k3::wire::Encode(m);
      },
      *decoded);
  if (!encoded.ok() || encoded->size() != size ||
      (size != 0 && std::memcmp(encoded->data(), data, size) != 0)) {
    std::abort();  // accepted but does not round-trip
  }
  return 0;
}

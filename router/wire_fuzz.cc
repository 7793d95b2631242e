// libFuzzer target for the data-plane decoder and the connection handshake (scripts/fuzz.sh builds
// and runs it). Any input must be rejected or accepted without a crash, an out-of-bounds read
// (ASan), undefined behaviour (UBSan) or an allocation the input size does not justify
// (-malloc_limit_mb); whatever is accepted must encode back to exactly the same bytes, and the
// handshake accepts exactly the one Hello that carries the token.
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

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> msg(reinterpret_cast<const std::byte*>(data), size);
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

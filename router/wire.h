// The data-plane codec: the messages between attention nodes and expert nodes.
//
// Every message is one contiguous little-endian buffer:
//   header   magic u32 ("K3DP") | version u16 | type u16 | total_length u64 (header included)
//   ExpertRequest  request_id u64 | placement_version u64 | layer u32 | dtype u8 | 3 zero bytes |
//                  width u32 | n_rows u32 | n_pairs u32 |
//                  row_offsets u32[n_rows + 1] | pairs (expert u32, weight f32)[n_pairs] |
//                  rows [n_rows, width] of dtype
//   ExpertReply    request_id u64 | dtype u8 | 3 zero bytes | width u32 | n_rows u32 |
//                  sums [n_rows, width] of dtype (in request row order)
//   ErrorReply     request_id u64 | code u32 (absl::StatusCode) | message_length u32 | message bytes
//   Hello          token_length u32 | token bytes: a client's first message on a connection (the
//                  cluster's node token; an expert node closes a connection that starts otherwise)
// Every field is 4-byte aligned relative to the start of the message.
//
// Decoding never trusts a count before checking it against the buffer size, so a malformed or
// hostile message costs at most O(buffer size) work and memory, and is rejected with an
// InvalidArgument status that names the field.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/status.h"

namespace k3::wire {

inline constexpr uint32_t kMagic = 0x5044334B;  // "K3DP" in memory order
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderSize = 16;

enum class MessageType : uint16_t { kExpertRequest = 1, kExpertReply = 2, kErrorReply = 3, kHello = 4 };
const char* MessageTypeName(MessageType type);

// Element type of rows and sums. Values are the wire codes.
enum class RowDType : uint8_t { kF32 = 1, kBF16 = 2 };
size_t RowDTypeSize(RowDType dtype);  // 4 or 2

// One selected expert of a token and its routing weight.
struct ExpertPair {
  uint32_t expert = 0;
  float weight = 0.0f;
  bool operator==(const ExpertPair&) const = default;
};

// Latent rows for one expert node. The pairs are CSR: row i owns pairs[row_offsets[i],
// row_offsets[i + 1]), row_offsets has n_rows + 1 entries and starts at 0.
// `rows` is borrowed: when encoding it points at the caller's rows, when decoding into the message
// buffer (which must outlive the struct). The row payload is never copied by the codec except
// into the encoded message.
struct ExpertRequest {
  uint64_t request_id = 0;
  uint32_t layer = 0;
  uint64_t placement_version = 0;
  RowDType dtype = RowDType::kF32;
  uint32_t width = 0;
  uint32_t n_rows = 0;
  std::vector<uint32_t> row_offsets = {0};
  std::vector<ExpertPair> pairs;
  std::span<const std::byte> rows;  // n_rows * width values of dtype, row-major
};

// Per-token weighted partial sums, in the order of the request's rows. `sums` is borrowed, as above.
struct ExpertReply {
  uint64_t request_id = 0;
  RowDType dtype = RowDType::kF32;
  uint32_t width = 0;
  uint32_t n_rows = 0;
  std::span<const std::byte> sums;  // n_rows * width values of dtype
};

// A request that the expert node could not serve. `status` is never OK.
struct ErrorReply {
  uint64_t request_id = 0;
  absl::Status status;
};

// The connection handshake. The token is at most kMaxTokenBytes.
struct Hello {
  std::string token;
};
inline constexpr size_t kMaxTokenBytes = 1024;

using Message = std::variant<ExpertRequest, ExpertReply, ErrorReply, Hello>;

// Checks the fields and returns the exact encoded size.
absl::StatusOr<size_t> EncodedSize(const ExpertRequest& m);
absl::StatusOr<size_t> EncodedSize(const ExpertReply& m);
absl::StatusOr<size_t> EncodedSize(const ErrorReply& m);
absl::StatusOr<size_t> EncodedSize(const Hello& m);
// Writes the message into `out`, which must be exactly EncodedSize(m) bytes.
absl::Status EncodeTo(const ExpertRequest& m, std::span<std::byte> out);
absl::Status EncodeTo(const ExpertReply& m, std::span<std::byte> out);
absl::Status EncodeTo(const ErrorReply& m, std::span<std::byte> out);
absl::Status EncodeTo(const Hello& m, std::span<std::byte> out);

// Encodes into a new buffer of type B: anything constructible from a size with data() (a
// std::vector<std::byte>, or the transport's uninitialised dataplane::Buffer).
template <class B = std::vector<std::byte>, class M>
absl::StatusOr<B> Encode(const M& m) {
  K3_ASSIGN_OR_RETURN(size_t size, EncodedSize(m));
  B out(size);
  K3_RETURN_IF_ERROR(EncodeTo(m, std::span<std::byte>(out.data(), size)));
  return out;
}

struct DecodeLimits {
  uint32_t num_experts = 0;  // expert ids must be < num_experts
};

// Validates the header (magic, version, type, total length == buffer size).
absl::StatusOr<MessageType> PeekType(std::span<const std::byte> msg);

// Each rejects a message of another type. The results borrow `msg` (rows / sums).
absl::StatusOr<ExpertRequest> DecodeExpertRequest(std::span<const std::byte> msg,
                                                  const DecodeLimits& limits);
absl::StatusOr<ExpertReply> DecodeExpertReply(std::span<const std::byte> msg);
absl::StatusOr<ErrorReply> DecodeErrorReply(std::span<const std::byte> msg);
absl::StatusOr<Hello> DecodeHello(std::span<const std::byte> msg);
// The handshake check of a connection's first message: OK only for a Hello carrying `token`;
// UNAUTHENTICATED otherwise (never echoing the token).
absl::Status CheckHello(std::span<const std::byte> msg, std::string_view token);
// Any message type.
absl::StatusOr<Message> Decode(std::span<const std::byte> msg, const DecodeLimits& limits);

// Conversions between wire values (rows, sums) and float. The byte span must hold exactly as many
// values of dtype as the float span.
absl::Status ToFloat(RowDType dtype, std::span<const std::byte> src, std::span<float> dst);
absl::Status FromFloat(std::span<const float> src, RowDType dtype, std::span<std::byte> dst);

}  // namespace k3::wire

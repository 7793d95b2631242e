// The data-plane codec: the messages between attention nodes and expert nodes.
//
// Every message is one contiguous little-endian buffer:
//   header   magic u32 ("K3DP") | version u16 | type u16 | total_length u64 (header included)
//   ExpertRequest  request_id u64 | placement_version u64 | layer u32 | dtype u8 | 3 zero bytes |
//                  width u32 | n_rows u32 | n_pairs u32 |
//                  row_offsets u32[n_rows + 1] | pairs (expert u32, weight f32)[n_pairs] |
//                  rows [n_rows, width] of dtype
//   ExpertReply    request_id u64 | received_at_ns u64 | queued_ns u64 | compute_ns u64 |
//                  dtype u8 | 3 zero bytes | width u32 | n_rows u32 |
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

#include "absl/functional/function_ref.h"
#include "common/status.h"

namespace k3::wire {

inline constexpr uint32_t kMagic = 0x5044334B;  // "K3DP" in memory order
inline constexpr uint16_t kVersion = 2;
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
// The timings say where the expert node spent the request's time: received_at_ns is its
// CLOCK_MONOTONIC when the request arrived (comparable with the sender's clock on one host only),
// queued_ns the wait in the batching window, compute_ns the batch's compute and encode.
struct ExpertReply {
  uint64_t request_id = 0;
  uint64_t received_at_ns = 0;
  uint64_t queued_ns = 0;
  uint64_t compute_ns = 0;
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

// ---- the shared-memory transport (router/shm_transport.h) ----
//
// Hello, sent once by a client over the control socket: it names the shared mapping that the
// client created (two rings, client to server and back, each ring_bytes long).
//   magic u32 ("K3SH") | version u16 | zero u16 | total_length u32 (all included) | zero u32 |
//   ring_bytes u64 | name bytes (total_length - 24; "/" then [A-Za-z0-9._-], at most 200)
inline constexpr uint32_t kShmHelloMagic = 0x48533348;  // "K3SH" in memory order
inline constexpr size_t kShmHelloFixed = 24;
inline constexpr uint64_t kShmMinRing = 4096, kShmMaxRing = uint64_t{1} << 30;

struct ShmHello {
  uint64_t ring_bytes = 0;  // a power of two in [kShmMinRing, kShmMaxRing]
  std::string name;         // the shm_open name
};
absl::StatusOr<std::vector<std::byte>> EncodeShmHello(const ShmHello& m);
// The hello's total length once its fixed part has arrived (to know how much to read), else 0.
absl::StatusOr<size_t> ShmHelloLength(std::span<const std::byte> prefix);
absl::StatusOr<ShmHello> DecodeShmHello(std::span<const std::byte> msg);

// A ring is a byte stream of frames: magic u32 ("K3RF") | length u32 | body, padded to 8 bytes, so
// that a frame header never wraps. Cursors count bytes since the start and only grow.
inline constexpr uint32_t kRingFrameMagic = 0x4652334B;  // "K3RF" in memory order
inline constexpr size_t kRingFrameHeader = 8;
inline constexpr uint64_t RingFrameBytes(uint32_t length) { return kRingFrameHeader + ((uint64_t{length} + 7) & ~uint64_t{7}); }

// Reads frames out of one ring whose other end may be hostile: cursors and headers are checked, a
// frame longer than max_length is refused before anything is allocated. A frame's body is copied
// out as it arrives, so frames longer than the ring pass through it.
class RingReader {
 public:
  RingReader(uint64_t capacity, uint32_t max_length) : capacity_(capacity), max_length_(max_length) {}
  // Consumes ring[tail, head) (ring.size() == capacity, a power of two). begin(length) returns
  // where the frame's `length` bytes go, end() runs once they are all there. Returns the new tail,
  // or InvalidArgument (bad cursors, magic or length), after which the ring is unusable.
  absl::StatusOr<uint64_t> Read(std::span<const std::byte> ring, uint64_t tail, uint64_t head,
                                absl::FunctionRef<std::byte*(uint32_t length)> begin,
                                absl::FunctionRef<void()> end);

 private:
  const uint64_t capacity_;
  const uint32_t max_length_;
  bool in_frame_ = false;
  uint32_t length_ = 0, filled_ = 0;
  std::byte* dst_ = nullptr;
};

}  // namespace k3::wire

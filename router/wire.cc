#include "router/wire.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_format.h"
#include "common/bf16.h"

namespace k3::wire {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian and encoded with memcpy; add byte swaps here first");

constexpr size_t kRequestFixed = 36;  // request_id .. n_pairs
constexpr size_t kReplyFixed = 44;    // request_id .. n_rows
constexpr size_t kErrorFixed = 16;    // request_id .. message_length
constexpr size_t kHelloFixed = 4;     // token_length
constexpr uint32_t kMaxStatusCode = 16;  // absl::StatusCode::kUnauthenticated

template <class... Args>
absl::Status Malformed(MessageType type, const absl::FormatSpec<Args...>& format, const Args&... args) {
  return absl::InvalidArgumentError(
      absl::StrCat(MessageTypeName(type), ": ", absl::StrFormat(format, args...)));
}

bool ValidDType(RowDType dtype) { return dtype == RowDType::kF32 || dtype == RowDType::kBF16; }

// *out = n_rows * width * element size; false on overflow of size_t.
bool PayloadBytes(uint32_t n_rows, uint32_t width, RowDType dtype, size_t* out) {
  return !__builtin_mul_overflow(static_cast<size_t>(n_rows), static_cast<size_t>(width), out) &&
         !__builtin_mul_overflow(*out, RowDTypeSize(dtype), out);
}

// Writes fields in order. EncodeTo checks the output size first, so every write is in bounds.
class Writer {
 public:
  explicit Writer(std::span<std::byte> out) : out_(out) {}
  template <class T>
  void Put(T v) {
    std::memcpy(out_.data() + pos_, &v, sizeof(T));
    pos_ += sizeof(T);
  }
  template <class T>
  void PutArray(std::span<const T> v) {
    if (!v.empty()) std::memcpy(out_.data() + pos_, v.data(), v.size_bytes());
    pos_ += v.size_bytes();
  }
  void PutHeader(MessageType type) {
    Put(kMagic);
    Put(kVersion);
    Put(static_cast<uint16_t>(type));
    Put(static_cast<uint64_t>(out_.size()));
  }

 private:
  std::span<std::byte> out_;
  size_t pos_ = 0;
};

// Reads fields in order. Callers check the buffer size before each group of reads.
class Reader {
 public:
  Reader(std::span<const std::byte> in, size_t pos) : in_(in), pos_(pos) {}
  template <class T>
  T Get() {
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> GetArray(size_t n) {
    std::vector<T> v(n);
    if (n != 0) std::memcpy(v.data(), in_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return v;
  }
  std::span<const std::byte> GetBytes(size_t n) {
    auto s = in_.subspan(pos_, n);
    pos_ += n;
    return s;
  }

 private:
  std::span<const std::byte> in_;
  size_t pos_;
};

// Checks the header and the type; the body starts at kHeaderSize.
absl::Status CheckHeader(std::span<const std::byte> msg, MessageType want) {
  K3_ASSIGN_OR_RETURN(MessageType got, PeekType(msg));
  if (got != want) return Malformed(want, "got a message of type %s", MessageTypeName(got));
  return absl::OkStatus();
}

absl::Status CheckDType(MessageType type, uint8_t dtype, const uint8_t reserved[3]) {
  if (!ValidDType(static_cast<RowDType>(dtype))) return Malformed(type, "unknown row dtype %d", dtype);
  if (reserved[0] != 0 || reserved[1] != 0 || reserved[2] != 0)
    return Malformed(type, "reserved bytes after dtype are not zero");
  return absl::OkStatus();
}

// The CSR structure and the pairs. `expert_bound` is exclusive (2^32 when unchecked).
absl::Status CheckPairs(std::span<const uint32_t> offsets, std::span<const ExpertPair> pairs,
                        uint64_t expert_bound) {
  constexpr MessageType kT = MessageType::kExpertRequest;
  if (offsets[0] != 0) return Malformed(kT, "row_offsets[0] is %d, must be 0", offsets[0]);
  const size_t n_rows = offsets.size() - 1;
  for (size_t r = 0; r < n_rows; ++r) {
    if (offsets[r] > offsets[r + 1])
      return Malformed(kT, "row_offsets not monotone: row_offsets[%d] = %d > row_offsets[%d] = %d", r,
                       offsets[r], r + 1, offsets[r + 1]);
  }
  if (offsets[n_rows] != pairs.size())
    return Malformed(kT, "row_offsets[n_rows] = %d does not match n_pairs = %d", offsets[n_rows],
                     pairs.size());
  for (size_t r = 0; r < n_rows; ++r) {
    for (uint32_t p = offsets[r]; p < offsets[r + 1]; ++p) {
      if (pairs[p].expert >= expert_bound)
        return Malformed(kT, "pair %d (row %d): expert id %d out of range [0, %d)", p, r, pairs[p].expert,
                         expert_bound);
      if (!std::isfinite(pairs[p].weight))
        return Malformed(kT, "pair %d (row %d): weight %g is not finite", p, r, pairs[p].weight);
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kExpertRequest: return "ExpertRequest";
    case MessageType::kExpertReply: return "ExpertReply";
    case MessageType::kErrorReply: return "ErrorReply";
    case MessageType::kHello: return "Hello";
  }
  return "?";
}

size_t RowDTypeSize(RowDType dtype) { return dtype == RowDType::kBF16 ? 2 : 4; }

// ---- encoding ----

absl::StatusOr<size_t> EncodedSize(const ExpertRequest& m) {
  constexpr MessageType kT = MessageType::kExpertRequest;
  if (!ValidDType(m.dtype)) return Malformed(kT, "unknown row dtype %d", static_cast<int>(m.dtype));
  if (m.width == 0) return Malformed(kT, "width is 0");
  if (m.row_offsets.size() != static_cast<size_t>(m.n_rows) + 1)
    return Malformed(kT, "row_offsets has %d entries, want n_rows + 1 = %d", m.row_offsets.size(),
                     static_cast<size_t>(m.n_rows) + 1);
  if (m.pairs.size() > std::numeric_limits<uint32_t>::max())
    return Malformed(kT, "%d pairs do not fit the u32 count", m.pairs.size());
  K3_RETURN_IF_ERROR(CheckPairs(m.row_offsets, m.pairs, uint64_t{1} << 32));
  size_t rows_bytes;
  if (!PayloadBytes(m.n_rows, m.width, m.dtype, &rows_bytes) || m.rows.size() != rows_bytes)
    return Malformed(kT, "rows hold %d bytes, want n_rows %d x width %d x %d", m.rows.size(), m.n_rows,
                     m.width, RowDTypeSize(m.dtype));
  return kHeaderSize + kRequestFixed + m.row_offsets.size() * sizeof(uint32_t) +
         m.pairs.size() * sizeof(ExpertPair) + rows_bytes;
}

absl::StatusOr<size_t> EncodedSize(const ExpertReply& m) {
  constexpr MessageType kT = MessageType::kExpertReply;
  if (!ValidDType(m.dtype)) return Malformed(kT, "unknown row dtype %d", static_cast<int>(m.dtype));
  if (m.width == 0) return Malformed(kT, "width is 0");
  size_t sums_bytes;
  if (!PayloadBytes(m.n_rows, m.width, m.dtype, &sums_bytes) || m.sums.size() != sums_bytes)
    return Malformed(kT, "sums hold %d bytes, want n_rows %d x width %d x %d", m.sums.size(), m.n_rows,
                     m.width, RowDTypeSize(m.dtype));
  return kHeaderSize + kReplyFixed + sums_bytes;
}

absl::StatusOr<size_t> EncodedSize(const ErrorReply& m) {
  constexpr MessageType kT = MessageType::kErrorReply;
  if (m.status.ok()) return Malformed(kT, "status is OK");
  if (m.status.message().size() > std::numeric_limits<uint32_t>::max())
    return Malformed(kT, "message of %d bytes is too long", m.status.message().size());
  return kHeaderSize + kErrorFixed + m.status.message().size();
}

absl::StatusOr<size_t> EncodedSize(const Hello& m) {
  if (m.token.size() > kMaxTokenBytes)
    return Malformed(MessageType::kHello, "token of %d bytes is longer than %d", m.token.size(), kMaxTokenBytes);
  return kHeaderSize + kHelloFixed + m.token.size();
}

namespace {

template <class M>
absl::Status CheckOutSize(const M& m, std::span<std::byte> out) {
  K3_ASSIGN_OR_RETURN(size_t size, EncodedSize(m));
  if (out.size() != size)
    return absl::InvalidArgumentError(absl::StrFormat("encode buffer holds %d bytes, message needs %d",
                                                      out.size(), size));
  return absl::OkStatus();
}

void PutDType(Writer& w, RowDType dtype) {
  w.Put(static_cast<uint8_t>(dtype));
  for (int i = 0; i < 3; ++i) w.Put(uint8_t{0});
}

}  // namespace

absl::Status EncodeTo(const ExpertRequest& m, std::span<std::byte> out) {
  K3_RETURN_IF_ERROR(CheckOutSize(m, out));
  Writer w(out);
  w.PutHeader(MessageType::kExpertRequest);
  w.Put(m.request_id);
  w.Put(m.placement_version);
  w.Put(m.layer);
  PutDType(w, m.dtype);
  w.Put(m.width);
  w.Put(m.n_rows);
  w.Put(static_cast<uint32_t>(m.pairs.size()));
  w.PutArray(std::span<const uint32_t>(m.row_offsets));
  static_assert(sizeof(ExpertPair) == 8, "ExpertPair is written as its in-memory (u32, f32) layout");
  w.PutArray(std::span<const ExpertPair>(m.pairs));
  w.PutArray(m.rows);
  return absl::OkStatus();
}

absl::Status EncodeTo(const ExpertReply& m, std::span<std::byte> out) {
  K3_RETURN_IF_ERROR(CheckOutSize(m, out));
  Writer w(out);
  w.PutHeader(MessageType::kExpertReply);
  w.Put(m.request_id);
  w.Put(m.received_at_ns);
  w.Put(m.queued_ns);
  w.Put(m.compute_ns);
  PutDType(w, m.dtype);
  w.Put(m.width);
  w.Put(m.n_rows);
  w.PutArray(m.sums);
  return absl::OkStatus();
}

absl::Status EncodeTo(const ErrorReply& m, std::span<std::byte> out) {
  K3_RETURN_IF_ERROR(CheckOutSize(m, out));
  Writer w(out);
  w.PutHeader(MessageType::kErrorReply);
  w.Put(m.request_id);
  w.Put(static_cast<uint32_t>(m.status.code()));
  w.Put(static_cast<uint32_t>(m.status.message().size()));
  w.PutArray(std::span<const char>(m.status.message().data(), m.status.message().size()));
  return absl::OkStatus();
}

absl::Status EncodeTo(const Hello& m, std::span<std::byte> out) {
  K3_RETURN_IF_ERROR(CheckOutSize(m, out));
  Writer w(out);
  w.PutHeader(MessageType::kHello);
  w.Put(static_cast<uint32_t>(m.token.size()));
  w.PutArray(std::span<const char>(m.token.data(), m.token.size()));
  return absl::OkStatus();
}

// ---- decoding ----

absl::StatusOr<MessageType> PeekType(std::span<const std::byte> msg) {
  if (msg.size() < kHeaderSize)
    return absl::InvalidArgumentError(
        absl::StrFormat("truncated header: %d bytes, need %d", msg.size(), kHeaderSize));
  Reader r(msg, 0);
  const auto magic = r.Get<uint32_t>();
  const auto version = r.Get<uint16_t>();
  const auto type = r.Get<uint16_t>();
  const auto length = r.Get<uint64_t>();
  if (magic != kMagic)
    return absl::InvalidArgumentError(absl::StrFormat("bad magic 0x%08x, want 0x%08x", magic, kMagic));
  if (version != kVersion)
    return absl::InvalidArgumentError(
        absl::StrFormat("unsupported version %d (this build speaks %d)", version, kVersion));
  if (type < static_cast<uint16_t>(MessageType::kExpertRequest) ||
      type > static_cast<uint16_t>(MessageType::kHello))
    return absl::InvalidArgumentError(absl::StrFormat("unknown message type %d", type));
  if (length != msg.size())
    return absl::InvalidArgumentError(absl::StrFormat(
        "length mismatch: header says %d bytes, buffer holds %d (truncated?)", length, msg.size()));
  return static_cast<MessageType>(type);
}

namespace {

// A message of type t whose header checks out and that holds at least its fixed fields; the reader
// stands after the header.
absl::StatusOr<Reader> OpenFixed(std::span<const std::byte> msg, MessageType t, size_t fixed) {
  K3_RETURN_IF_ERROR(CheckHeader(msg, t));
  if (msg.size() < kHeaderSize + fixed)
    return Malformed(t, "truncated: %d bytes, fixed fields need %d", msg.size(), kHeaderSize + fixed);
  return Reader(msg, kHeaderSize);
}

// The row block's description, the same in requests and replies: dtype and 3 reserved bytes, width, n_rows;
// bytes gets the size of its rows (`what`, for the error).
absl::Status ReadRowBlock(Reader& r, MessageType t, const char* what, RowDType* dtype, uint32_t* width,
                          uint32_t* n_rows, size_t* bytes) {
  const auto raw = r.Get<uint8_t>();
  const uint8_t reserved[3] = {r.Get<uint8_t>(), r.Get<uint8_t>(), r.Get<uint8_t>()};
  K3_RETURN_IF_ERROR(CheckDType(t, raw, reserved));
  *dtype = static_cast<RowDType>(raw);
  *width = r.Get<uint32_t>();
  *n_rows = r.Get<uint32_t>();
  if (*width == 0) return Malformed(t, "width is 0");
  if (!PayloadBytes(*n_rows, *width, *dtype, bytes))
    return Malformed(t, "%s size overflows: n_rows %d x width %d x %d", what, *n_rows, *width, RowDTypeSize(*dtype));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ExpertRequest> DecodeExpertRequest(std::span<const std::byte> msg,
                                                  const DecodeLimits& limits) {
  constexpr MessageType kT = MessageType::kExpertRequest;
  K3_ASSIGN_OR_RETURN(Reader r, OpenFixed(msg, kT, kRequestFixed));
  ExpertRequest m;
  m.request_id = r.Get<uint64_t>();
  m.placement_version = r.Get<uint64_t>();
  m.layer = r.Get<uint32_t>();
  // Offsets and pairs cannot overflow (u32 counts times small sizes); the rows can.
  size_t rows_bytes;
  K3_RETURN_IF_ERROR(ReadRowBlock(r, kT, "rows", &m.dtype, &m.width, &m.n_rows, &rows_bytes));
  const auto n_pairs = r.Get<uint32_t>();
  const size_t fixed = kHeaderSize + kRequestFixed + (static_cast<size_t>(m.n_rows) + 1) * sizeof(uint32_t) +
                       static_cast<size_t>(n_pairs) * sizeof(ExpertPair);
  size_t total;
  if (__builtin_add_overflow(fixed, rows_bytes, &total) || total != msg.size())
    return Malformed(kT, "payload size mismatch: n_rows %d, n_pairs %d, width %d, dtype %d need %d bytes, "
                     "message has %d", m.n_rows, n_pairs, m.width, static_cast<int>(m.dtype), total, msg.size());

  // Allocations below are bounded by the buffer size checked above.
  m.row_offsets = r.GetArray<uint32_t>(static_cast<size_t>(m.n_rows) + 1);
  m.pairs = r.GetArray<ExpertPair>(n_pairs);
  K3_RETURN_IF_ERROR(CheckPairs(m.row_offsets, m.pairs, limits.num_experts));
  m.rows = r.GetBytes(rows_bytes);
  return m;
}

absl::StatusOr<ExpertReply> DecodeExpertReply(std::span<const std::byte> msg) {
  constexpr MessageType kT = MessageType::kExpertReply;
  K3_ASSIGN_OR_RETURN(Reader r, OpenFixed(msg, kT, kReplyFixed));
  ExpertReply m;
  m.request_id = r.Get<uint64_t>();
  m.received_at_ns = r.Get<uint64_t>();
  m.queued_ns = r.Get<uint64_t>();
  m.compute_ns = r.Get<uint64_t>();
  size_t sums_bytes;
  K3_RETURN_IF_ERROR(ReadRowBlock(r, kT, "sums", &m.dtype, &m.width, &m.n_rows, &sums_bytes));
  size_t total;
  if (__builtin_add_overflow(kHeaderSize + kReplyFixed, sums_bytes, &total) || total != msg.size())
    return Malformed(kT, "payload size mismatch: n_rows %d, width %d, dtype %d need %d bytes, message has %d",
                     m.n_rows, m.width, static_cast<int>(m.dtype), total, msg.size());
  m.sums = r.GetBytes(sums_bytes);
  return m;
}

absl::StatusOr<ErrorReply> DecodeErrorReply(std::span<const std::byte> msg) {
  constexpr MessageType kT = MessageType::kErrorReply;
  K3_ASSIGN_OR_RETURN(Reader r, OpenFixed(msg, kT, kErrorFixed));
  ErrorReply m;
  m.request_id = r.Get<uint64_t>();
  const auto code = r.Get<uint32_t>();
  const auto length = r.Get<uint32_t>();
  if (code == 0) return Malformed(kT, "status code is OK");
  if (code > kMaxStatusCode) return Malformed(kT, "unknown status code %d", code);
  if (kHeaderSize + kErrorFixed + static_cast<size_t>(length) != msg.size())
    return Malformed(kT, "payload size mismatch: message_length %d needs %d bytes, message has %d", length,
                     kHeaderSize + kErrorFixed + static_cast<size_t>(length), msg.size());
  const auto text = r.GetBytes(length);
  m.status = absl::Status(static_cast<absl::StatusCode>(code),
                          absl::string_view(reinterpret_cast<const char*>(text.data()), text.size()));
  return m;
}

absl::StatusOr<Hello> DecodeHello(std::span<const std::byte> msg) {
  constexpr MessageType kT = MessageType::kHello;
  K3_ASSIGN_OR_RETURN(Reader r, OpenFixed(msg, kT, kHelloFixed));
  const auto length = r.Get<uint32_t>();
  if (length > kMaxTokenBytes) return Malformed(kT, "token_length %d is longer than %d", length, kMaxTokenBytes);
  if (kHeaderSize + kHelloFixed + static_cast<size_t>(length) != msg.size())
    return Malformed(kT, "payload size mismatch: token_length %d needs %d bytes, message has %d", length,
                     kHeaderSize + kHelloFixed + static_cast<size_t>(length), msg.size());
  const auto text = r.GetBytes(length);
  return Hello{std::string(reinterpret_cast<const char*>(text.data()), text.size())};
}

absl::StatusOr<Message> Decode(std::span<const std::byte> msg, const DecodeLimits& limits) {
  K3_ASSIGN_OR_RETURN(MessageType type, PeekType(msg));
  switch (type) {
    case MessageType::kExpertRequest: return DecodeExpertRequest(msg, limits);
    case MessageType::kExpertReply: return DecodeExpertReply(msg);
    case MessageType::kErrorReply: return DecodeErrorReply(msg);
    case MessageType::kHello: return DecodeHello(msg);
  }
  return absl::InternalError("unreachable message type");
}

absl::Status CheckHello(std::span<const std::byte> msg, std::string_view token) {
  auto type = PeekType(msg);
  if (!type.ok() || *type != MessageType::kHello)
    return absl::UnauthenticatedError("the connection's first message is not a Hello");
  auto h = DecodeHello(msg);
  if (!h.ok()) return absl::UnauthenticatedError(absl::StrCat("malformed Hello: ", h.status().message()));
  // Constant time in the token's bytes: no early exit on the first difference.
  unsigned char diff = h->token.size() == token.size() ? 0 : 1;
  for (size_t i = 0; i < h->token.size() && i < token.size(); ++i)
    diff |= static_cast<unsigned char>(h->token[i] ^ token[i]);
  if (diff != 0) return absl::UnauthenticatedError("Hello carries the wrong node token");
  return absl::OkStatus();
}

// ---- values ----

absl::Status ToFloat(RowDType dtype, std::span<const std::byte> src, std::span<float> dst) {
  if (src.size() != dst.size() * RowDTypeSize(dtype))
    return absl::InvalidArgumentError(
        absl::StrFormat("ToFloat: %d bytes for %d values", src.size(), dst.size()));
  if (dtype == RowDType::kF32) {
    if (!dst.empty()) std::memcpy(dst.data(), src.data(), dst.size_bytes());
    return absl::OkStatus();
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, src.data() + 2 * i, 2);
    dst[i] = Bf16ToFloat(h);
  }
  return absl::OkStatus();
}

absl::Status FromFloat(std::span<const float> src, RowDType dtype, std::span<std::byte> dst) {
  if (dst.size() != src.size() * RowDTypeSize(dtype))
    return absl::InvalidArgumentError(
        absl::StrFormat("FromFloat: %d bytes for %d values", dst.size(), src.size()));
  if (dtype == RowDType::kF32) {
    if (!src.empty()) std::memcpy(dst.data(), src.data(), src.size_bytes());
    return absl::OkStatus();
  }
  for (size_t i = 0; i < src.size(); ++i) {
    const uint16_t h = FloatToBf16(src[i]);
    std::memcpy(dst.data() + 2 * i, &h, 2);
  }
  return absl::OkStatus();
}

// ---- the shared-memory transport ----

absl::StatusOr<std::vector<std::byte>> EncodeShmHello(const ShmHello& m) {
  if (m.name.size() > 200) return absl::InvalidArgumentError("ShmHello: name longer than 200 bytes");
  std::vector<std::byte> out(kShmHelloFixed + m.name.size());
  Writer w(out);
  w.Put(kShmHelloMagic);
  w.Put(kVersion);
  w.Put(uint16_t{0});
  w.Put(static_cast<uint32_t>(out.size()));
  w.Put(uint32_t{0});
  w.Put(m.ring_bytes);
  w.PutArray(std::span<const char>(m.name.data(), m.name.size()));
  return out;
}

absl::StatusOr<size_t> ShmHelloLength(std::span<const std::byte> prefix) {
  if (prefix.size() < 12) return 0;
  Reader r(prefix, 0);
  const auto magic = r.Get<uint32_t>();
  const auto version = r.Get<uint16_t>();
  r.Get<uint16_t>();
  const auto length = r.Get<uint32_t>();
  if (magic != kShmHelloMagic)
    return absl::InvalidArgumentError(absl::StrFormat("ShmHello: bad magic 0x%08x, want 0x%08x", magic, kShmHelloMagic));
  if (version != kVersion)
    return absl::InvalidArgumentError(absl::StrFormat("ShmHello: unsupported version %d (this build speaks %d)", version, kVersion));
  if (length < kShmHelloFixed + 2 || length > kShmHelloFixed + 200)
    return absl::InvalidArgumentError(absl::StrFormat("ShmHello: total_length %d out of range [%d, %d]", length,
                                                      kShmHelloFixed + 2, kShmHelloFixed + 200));
  return length;
}

absl::StatusOr<ShmHello> DecodeShmHello(std::span<const std::byte> msg) {
  K3_ASSIGN_OR_RETURN(size_t length, ShmHelloLength(msg));
  if (length == 0 || length != msg.size())
    return absl::InvalidArgumentError(absl::StrFormat("ShmHello: total_length %d, buffer holds %d", length, msg.size()));
  Reader r(msg, 8);
  r.Get<uint32_t>();
  const auto zero = r.Get<uint32_t>();
  if (zero != 0 || msg[6] != std::byte{0} || msg[7] != std::byte{0})
    return absl::InvalidArgumentError("ShmHello: reserved fields are not zero");
  ShmHello m;
  m.ring_bytes = r.Get<uint64_t>();
  if (m.ring_bytes < kShmMinRing || m.ring_bytes > kShmMaxRing || !std::has_single_bit(m.ring_bytes))
    return absl::InvalidArgumentError(absl::StrFormat("ShmHello: ring_bytes %d is not a power of two in [%d, %d]",
                                                      m.ring_bytes, kShmMinRing, kShmMaxRing));
  const auto name = r.GetBytes(length - kShmHelloFixed);
  m.name.assign(reinterpret_cast<const char*>(name.data()), name.size());
  if (m.name[0] != '/') return absl::InvalidArgumentError("ShmHello: name does not start with '/'");
  for (size_t i = 1; i < m.name.size(); ++i) {
    const char c = m.name[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
      return absl::InvalidArgumentError(absl::StrFormat("ShmHello: name has a bad character at %d", i));
  }
  return m;
}

absl::StatusOr<uint64_t> RingReader::Read(std::span<const std::byte> ring, uint64_t tail, uint64_t head,
                                          absl::FunctionRef<std::byte*(uint32_t)> begin,
                                          absl::FunctionRef<void()> end) {
  if (ring.size() != capacity_ || !std::has_single_bit(capacity_) || capacity_ < kRingFrameHeader)
    return absl::InvalidArgumentError(absl::StrFormat("ring: %d bytes, capacity %d", ring.size(), capacity_));
  if (head < tail || head - tail > capacity_)
    return absl::InvalidArgumentError(absl::StrFormat("ring: head %d and tail %d are more than the capacity %d apart",
                                                      head, tail, capacity_));
  const uint64_t mask = capacity_ - 1;
  while (tail < head) {
    if (!in_frame_) {
      // Frames start 8-aligned, so the header is contiguous and arrives whole.
      if (tail % 8 != 0) return absl::InvalidArgumentError(absl::StrFormat("ring: frame at %d is not 8-aligned", tail));
      if (head - tail < kRingFrameHeader) break;
      uint32_t magic, length;
      std::memcpy(&magic, ring.data() + (tail & mask), 4);
      std::memcpy(&length, ring.data() + (tail & mask) + 4, 4);
      if (magic != kRingFrameMagic)
        return absl::InvalidArgumentError(absl::StrFormat("ring: bad frame magic 0x%08x at %d", magic, tail));
      if (length > max_length_)
        return absl::InvalidArgumentError(absl::StrFormat("ring: frame length %d above the limit %d", length, max_length_));
      tail += kRingFrameHeader;
      in_frame_ = true;
      length_ = length;
      filled_ = 0;
      dst_ = begin(length);
    }
    // The body, as much as has arrived, in at most two pieces (the ring wraps).
    while (filled_ < length_ && tail < head) {
      const uint64_t at = tail & mask;
      const uint64_t n = std::min<uint64_t>({length_ - filled_, head - tail, capacity_ - at});
      std::memcpy(dst_ + filled_, ring.data() + at, n);
      filled_ += static_cast<uint32_t>(n);
      tail += n;
    }
    if (filled_ < length_) break;
    const uint64_t pad = RingFrameBytes(length_) - kRingFrameHeader - length_;
    if (head - tail < pad) break;
    tail += pad;
    in_frame_ = false;
    dst_ = nullptr;
    end();
  }
  return tail;
}

}  // namespace k3::wire

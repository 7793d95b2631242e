#include "router/wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <gtest/gtest.h>

namespace k3::wire {
namespace {

using Bytes = std::vector<std::byte>;

// Offsets of ExpertRequest fields in an encoded message.
constexpr size_t kMagicAt = 0, kVersionAt = 4, kTypeAt = 6, kLengthAt = 8;
constexpr size_t kDTypeAt = 36, kReservedAt = 37, kWidthAt = 40, kNRowsAt = 44, kNPairsAt = 48,
                 kOffsetsAt = 52;
constexpr DecodeLimits kLimits{.num_experts = 8};

template <class T>
void Put(Bytes& m, size_t at, T v) {
  std::memcpy(m.data() + at, &v, sizeof(T));
}
template <class T>
T Get(const Bytes& m, size_t at) {
  T v;
  std::memcpy(&v, m.data() + at, sizeof(T));
  return v;
}

// A request with n_rows rows; row r selects (r % 3) experts (so some rows have none).
struct RequestFixture {
  std::vector<float> values;
  Bytes rows;
  ExpertRequest req;

  RequestFixture(RowDType dtype, uint32_t n_rows, uint32_t width) {
    req.request_id = 0x1122334455667788ull;
    req.layer = 7;
    req.placement_version = 42;
    req.dtype = dtype;
    req.width = width;
    req.n_rows = n_rows;
    req.row_offsets = {0};
    for (uint32_t r = 0; r < n_rows; ++r) {
      for (uint32_t j = 0; j < r % 3; ++j) req.pairs.push_back({(r + j) % 8, 0.25f * float(j + 1)});
      req.row_offsets.push_back(static_cast<uint32_t>(req.pairs.size()));
    }
    // Values exactly representable in bf16, so both dtypes round-trip exactly.
    for (uint32_t i = 0; i < n_rows * width; ++i) values.push_back(float(int(i % 37) - 18) * 0.5f);
    rows.resize(values.size() * RowDTypeSize(dtype));
    EXPECT_TRUE(FromFloat(values, dtype, rows).ok());
    req.rows = rows;
  }
  Bytes Encoded() const {
    auto m = Encode(req);
    EXPECT_TRUE(m.ok()) << m.status();
    return *m;
  }
};

void ExpectSameRequest(const ExpertRequest& a, const ExpertRequest& b) {
  EXPECT_EQ(a.request_id, b.request_id);
  EXPECT_EQ(a.layer, b.layer);
  EXPECT_EQ(a.placement_version, b.placement_version);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.width, b.width);
  EXPECT_EQ(a.n_rows, b.n_rows);
  EXPECT_EQ(a.row_offsets, b.row_offsets);
  EXPECT_EQ(a.pairs, b.pairs);
  ASSERT_EQ(a.rows.size(), b.rows.size());
  EXPECT_EQ(std::memcmp(a.rows.data(), b.rows.data(), a.rows.size()), 0);
}

// Expects `msg` to be rejected as a request with a message containing `what`.
void ExpectRejected(const Bytes& msg, const std::string& what) {
  auto d = DecodeExpertRequest(msg, kLimits);
  ASSERT_FALSE(d.ok()) << "accepted; wanted: " << what;
  EXPECT_TRUE(absl::IsInvalidArgument(d.status())) << d.status();
  EXPECT_NE(d.status().message().find(what), std::string::npos)
      << "got \"" << d.status().message() << "\", wanted \"" << what << "\"";
}

// ---- round trips ----

class RequestRoundTrip : public ::testing::TestWithParam<RowDType> {};

TEST_P(RequestRoundTrip, Rows) {
  RequestFixture f(GetParam(), 5, 6);
  const Bytes msg = f.Encoded();
  auto d = DecodeExpertRequest(msg, kLimits);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectSameRequest(*d, f.req);
  // The decoded rows point into the message: no copy.
  EXPECT_GE(d->rows.data(), msg.data());
  EXPECT_LE(d->rows.data() + d->rows.size(), msg.data() + msg.size());
  std::vector<float> back(f.values.size());
  ASSERT_TRUE(ToFloat(d->dtype, d->rows, back).ok());
  EXPECT_EQ(back, f.values);
}

TEST_P(RequestRoundTrip, EmptyBatch) {
  RequestFixture f(GetParam(), 0, 3584);
  const Bytes msg = f.Encoded();
  auto d = DecodeExpertRequest(msg, kLimits);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectSameRequest(*d, f.req);
  EXPECT_EQ(d->row_offsets, std::vector<uint32_t>{0});
  EXPECT_TRUE(d->pairs.empty());
  EXPECT_TRUE(d->rows.empty());
}

TEST_P(RequestRoundTrip, RowsWithZeroPairs) {
  RequestFixture f(GetParam(), 4, 2);
  f.req.pairs.clear();
  f.req.row_offsets = {0, 0, 0, 0, 0};
  auto d = DecodeExpertRequest(f.Encoded(), kLimits);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->row_offsets, f.req.row_offsets);
  EXPECT_TRUE(d->pairs.empty());
}

TEST_P(RequestRoundTrip, Reply) {
  RequestFixture f(GetParam(), 3, 4);
  ExpertReply reply{.request_id = 99, .dtype = GetParam(), .width = 4, .n_rows = 3, .sums = f.rows};
  auto msg = Encode(reply);
  ASSERT_TRUE(msg.ok()) << msg.status();
  auto d = DecodeExpertReply(*msg);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->request_id, 99u);
  EXPECT_EQ(d->dtype, GetParam());
  EXPECT_EQ(d->width, 4u);
  EXPECT_EQ(d->n_rows, 3u);
  std::vector<float> back(12);
  ASSERT_TRUE(ToFloat(d->dtype, d->sums, back).ok());
  EXPECT_EQ(back, f.values);
}

INSTANTIATE_TEST_SUITE_P(DTypes, RequestRoundTrip, ::testing::Values(RowDType::kF32, RowDType::kBF16),
                         [](const auto& info) { return info.param == RowDType::kF32 ? "F32" : "BF16"; });

TEST(Wire, EmptyReply) {
  ExpertReply reply{.request_id = 1, .dtype = RowDType::kBF16, .width = 8, .n_rows = 0, .sums = {}};
  auto msg = Encode(reply);
  ASSERT_TRUE(msg.ok()) << msg.status();
  auto d = DecodeExpertReply(*msg);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->n_rows, 0u);
  EXPECT_TRUE(d->sums.empty());
}

TEST(Wire, ErrorReplyRoundTrip) {
  for (const absl::Status& s : {absl::UnavailableError("expert node draining"), absl::InternalError("")}) {
    auto msg = Encode(ErrorReply{.request_id = 5, .status = s});
    ASSERT_TRUE(msg.ok()) << msg.status();
    auto d = DecodeErrorReply(*msg);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->request_id, 5u);
    EXPECT_EQ(d->status, s);
  }
}

TEST(Wire, DecodeDispatchesOnType) {
  RequestFixture f(RowDType::kF32, 2, 2);
  auto any = Decode(f.Encoded(), kLimits);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_TRUE(std::holds_alternative<ExpertRequest>(*any));
  auto err = Encode(ErrorReply{.request_id = 1, .status = absl::AbortedError("x")});
  ASSERT_TRUE(err.ok());
  any = Decode(*err, kLimits);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_TRUE(std::holds_alternative<ErrorReply>(*any));
  EXPECT_EQ(*PeekType(*err), MessageType::kErrorReply);
}

TEST(Wire, EncodesIntoAnyBuffer) {
  RequestFixture f(RowDType::kF32, 2, 2);
  auto size = EncodedSize(f.req);
  ASSERT_TRUE(size.ok());
  Bytes out(*size);
  ASSERT_TRUE(EncodeTo(f.req, out).ok());
  EXPECT_EQ(out, f.Encoded());
  Bytes wrong(*size + 1);
  EXPECT_FALSE(EncodeTo(f.req, wrong).ok());
}

// ---- the encoder refuses inconsistent messages ----

TEST(Wire, EncoderRejectsInconsistentFields) {
  auto fails = [](const ExpertRequest& r, const std::string& what) {
    auto s = EncodedSize(r);
    ASSERT_FALSE(s.ok()) << what;
    EXPECT_NE(s.status().message().find(what), std::string::npos) << s.status();
  };
  {
    RequestFixture f(RowDType::kF32, 3, 2);
    f.req.row_offsets.pop_back();
    fails(f.req, "row_offsets has 3 entries");
  }
  {
    RequestFixture f(RowDType::kF32, 3, 2);
    f.req.rows = f.req.rows.subspan(1);
    fails(f.req, "rows hold");
  }
  {
    RequestFixture f(RowDType::kF32, 3, 2);
    f.req.pairs[0].weight = std::nanf("");
    fails(f.req, "not finite");
  }
  {
    RequestFixture f(RowDType::kF32, 3, 2);
    f.req.width = 0;
    fails(f.req, "width is 0");
  }
  {
    RequestFixture f(RowDType::kF32, 3, 2);
    f.req.dtype = static_cast<RowDType>(9);
    fails(f.req, "unknown row dtype 9");
  }
  EXPECT_FALSE(EncodedSize(ErrorReply{.request_id = 1, .status = absl::OkStatus()}).ok());
  EXPECT_FALSE(EncodedSize(ExpertReply{.request_id = 1, .dtype = RowDType::kF32, .width = 2, .n_rows = 1,
                                       .sums = {}})
                   .ok());
}

// ---- the decoder rejects malformed messages, naming the problem ----

TEST(WireMalformed, Header) {
  RequestFixture f(RowDType::kF32, 2, 3);
  const Bytes good = f.Encoded();
  ExpectRejected(Bytes(good.begin(), good.begin() + 15), "truncated header: 15 bytes, need 16");
  ExpectRejected(Bytes(), "truncated header: 0 bytes");
  Bytes m = good;
  Put<uint32_t>(m, kMagicAt, 0xdeadbeef);
  ExpectRejected(m, "bad magic 0xdeadbeef");
  m = good;
  Put<uint16_t>(m, kVersionAt, kVersion + 1);
  ExpectRejected(m, absl::StrCat("unsupported version ", kVersion + 1));
  m = good;
  Put<uint16_t>(m, kTypeAt, 0);
  ExpectRejected(m, "unknown message type 0");
  m = good;
  Put<uint16_t>(m, kTypeAt, 5);
  ExpectRejected(m, "unknown message type 5");
  m = good;
  Put<uint16_t>(m, kTypeAt, static_cast<uint16_t>(MessageType::kExpertReply));
  ExpectRejected(m, "ExpertRequest: got a message of type ExpertReply");
  m = good;
  Put<uint64_t>(m, kLengthAt, good.size() + 1);
  ExpectRejected(m, "length mismatch");
  m = good;
  Put<uint64_t>(m, kLengthAt, ~uint64_t{0});
  ExpectRejected(m, "length mismatch");
}

TEST(WireMalformed, RequestFields) {
  RequestFixture f(RowDType::kF32, 3, 2);  // rows have 0, 1, 2 pairs
  const Bytes good = f.Encoded();
  ASSERT_EQ(Get<uint32_t>(good, kNPairsAt), 3u);
  Bytes m;

  // Fixed fields cut short, with a self-consistent header.
  m = Bytes(good.begin(), good.begin() + 40);
  Put<uint64_t>(m, kLengthAt, m.size());
  ExpectRejected(m, "truncated: 40 bytes, fixed fields need 52");

  m = good;
  Put<uint8_t>(m, kDTypeAt, 0);
  ExpectRejected(m, "unknown row dtype 0");
  m = good;
  Put<uint8_t>(m, kReservedAt + 1, 1);
  ExpectRejected(m, "reserved bytes after dtype are not zero");
  m = good;
  Put<uint32_t>(m, kWidthAt, 0);
  ExpectRejected(m, "width is 0");

  // Counts that do not match the payload.
  m = good;
  Put<uint32_t>(m, kNRowsAt, 4);
  ExpectRejected(m, "payload size mismatch");
  m = good;
  Put<uint32_t>(m, kNPairsAt, 2);
  ExpectRejected(m, "payload size mismatch");
  m = good;
  Put<uint32_t>(m, kWidthAt, 3);
  ExpectRejected(m, "payload size mismatch");
  m = good;
  m.push_back(std::byte{0});
  Put<uint64_t>(m, kLengthAt, m.size());
  ExpectRejected(m, "payload size mismatch");
  // Huge counts: rejected by arithmetic, before anything is allocated.
  m = good;
  Put<uint32_t>(m, kNRowsAt, 0xffffffffu);
  Put<uint32_t>(m, kWidthAt, 0xffffffffu);
  ExpectRejected(m, "rows size overflows");
  m = good;
  Put<uint32_t>(m, kNRowsAt, 0xfffffff0u);
  Put<uint32_t>(m, kNPairsAt, 0xfffffff0u);
  ExpectRejected(m, "payload size mismatch");

  // CSR structure.
  const size_t off = kOffsetsAt;  // row_offsets = {0, 0, 1, 3}
  ASSERT_EQ(Get<uint32_t>(good, off + 12), 3u);
  m = good;
  Put<uint32_t>(m, off, 1);
  ExpectRejected(m, "row_offsets[0] is 1, must be 0");
  m = good;
  Put<uint32_t>(m, off + 8, 2);
  Put<uint32_t>(m, off + 4, 3);
  ExpectRejected(m, "row_offsets not monotone: row_offsets[1] = 3 > row_offsets[2] = 2");
  m = good;
  Put<uint32_t>(m, off + 12, 2);
  ExpectRejected(m, "row_offsets[n_rows] = 2 does not match n_pairs = 3");

  // Pairs.
  const size_t pairs = kOffsetsAt + 16;
  m = good;
  Put<uint32_t>(m, pairs + 8, 8);  // pair 1, in row 2
  ExpectRejected(m, "pair 1 (row 2): expert id 8 out of range [0, 8)");
  m = good;
  Put<float>(m, pairs + 4, std::numeric_limits<float>::quiet_NaN());
  ExpectRejected(m, "pair 0 (row 1): weight nan is not finite");
  m = good;
  Put<float>(m, pairs + 12, -std::numeric_limits<float>::infinity());
  ExpectRejected(m, "pair 1 (row 2): weight -inf is not finite");
}

TEST(WireMalformed, ExpertRangeIsTheCallers) {
  RequestFixture f(RowDType::kF32, 3, 2);  // expert ids up to 3
  EXPECT_TRUE(DecodeExpertRequest(f.Encoded(), {.num_experts = 4}).ok());
  auto d = DecodeExpertRequest(f.Encoded(), {.num_experts = 3});
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("out of range [0, 3)"), std::string::npos) << d.status();
}

TEST(WireMalformed, ReplyAndError) {
  RequestFixture f(RowDType::kBF16, 2, 2);
  auto reply = Encode(
      ExpertReply{.request_id = 1, .dtype = RowDType::kBF16, .width = 2, .n_rows = 2, .sums = f.rows});
  ASSERT_TRUE(reply.ok());
  // Reply fields: request_id at 16, timings at 24..47, dtype at 48, width at 52, n_rows at 56.
  Bytes m = *reply;
  Put<uint32_t>(m, 56, 3);
  auto r = DecodeExpertReply(m);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("ExpertReply: payload size mismatch"), std::string::npos) << r.status();
  m = *reply;
  Put<uint32_t>(m, 52, 0xffffffffu);
  Put<uint32_t>(m, 56, 0xffffffffu);
  r = DecodeExpertReply(m);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("sums size overflows"), std::string::npos) << r.status();
  m = *reply;
  Put<uint8_t>(m, 48, 7);
  r = DecodeExpertReply(m);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("ExpertReply: unknown row dtype 7"), std::string::npos) << r.status();
  m = *reply;
  Put<uint32_t>(m, 52, 0);
  r = DecodeExpertReply(m);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("ExpertReply: width is 0"), std::string::npos) << r.status();

  auto err = Encode(ErrorReply{.request_id = 1, .status = absl::UnavailableError("gone")});
  ASSERT_TRUE(err.ok());
  auto expect_error = [](const Bytes& msg, const std::string& what) {
    auto e = DecodeErrorReply(msg);
    ASSERT_FALSE(e.ok()) << what;
    EXPECT_NE(e.status().message().find(what), std::string::npos) << e.status();
  };
  m = *err;
  Put<uint32_t>(m, 24, 0);
  expect_error(m, "ErrorReply: status code is OK");
  m = *err;
  Put<uint32_t>(m, 24, 17);
  expect_error(m, "unknown status code 17");
  m = *err;
  Put<uint32_t>(m, 28, 5);
  expect_error(m, "ErrorReply: payload size mismatch");
  m = *err;
  Put<uint32_t>(m, 28, 0xffffffffu);
  expect_error(m, "ErrorReply: payload size mismatch");
}

// Every strict prefix of a valid message is rejected: as is, and with the header's length patched
// to the prefix so that the body checks must catch it.
TEST(WireMalformed, TruncationAtEveryOffset) {
  RequestFixture f(RowDType::kBF16, 4, 3);
  std::vector<Bytes> messages = {f.Encoded()};
  messages.push_back(*Encode(ExpertReply{.request_id = 1, .dtype = RowDType::kBF16, .width = 3, .n_rows = 4,
                                         .sums = f.rows}));
  messages.push_back(*Encode(ErrorReply{.request_id = 1, .status = absl::UnavailableError("expert gone")}));
  for (const Bytes& good : messages) {
    ASSERT_TRUE(Decode(good, kLimits).ok());
    for (size_t n = 0; n < good.size(); ++n) {
      Bytes cut(good.begin(), good.begin() + n);
      auto d = Decode(cut, kLimits);
      ASSERT_FALSE(d.ok()) << "prefix of " << n << " bytes accepted";
      if (n >= kHeaderSize) {
        EXPECT_NE(d.status().message().find("length mismatch"), std::string::npos) << d.status();
        Put<uint64_t>(cut, kLengthAt, n);
        d = Decode(cut, kLimits);
        ASSERT_FALSE(d.ok()) << "prefix of " << n << " bytes with patched length accepted";
      } else {
        EXPECT_NE(d.status().message().find("truncated header"), std::string::npos) << d.status();
      }
    }
  }
}

// No single corrupted byte crashes the decoder (ASan/UBSan builds and the fuzzer go further).
TEST(WireMalformed, SingleByteCorruptions) {
  RequestFixture f(RowDType::kF32, 3, 2);
  const Bytes good = f.Encoded();
  for (size_t i = 0; i < good.size(); ++i) {
    for (uint8_t x : {0x01, 0x80, 0xff}) {
      Bytes m = good;
      m[i] ^= std::byte{x};
      auto d = Decode(m, kLimits);
      if (i < kHeaderSize) {
        EXPECT_FALSE(d.ok()) << "corrupted header byte " << i << " accepted";
      }
    }
  }
}

TEST(Wire, FloatConversionsCheckSizes) {
  std::vector<float> v(3);
  Bytes b(5);
  EXPECT_FALSE(ToFloat(RowDType::kBF16, b, v).ok());
  EXPECT_FALSE(FromFloat(v, RowDType::kF32, b).ok());
  std::vector<float> one = {1.00390625f};  // rounds to 1 in bf16 (ties to even)
  Bytes h(2);
  ASSERT_TRUE(FromFloat(one, RowDType::kBF16, h).ok());
  ASSERT_TRUE(ToFloat(RowDType::kBF16, h, one).ok());
  EXPECT_EQ(one[0], 1.0f);
}

TEST(Wire, HelloRoundTripsAndGatesTheConnection) {
  auto m = Encode(Hello{"s3cret-token"});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->size(), kHeaderSize + 4 + 12);
  EXPECT_EQ(*PeekType(*m), MessageType::kHello);
  auto h = DecodeHello(*m);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->token, "s3cret-token");
  EXPECT_TRUE(CheckHello(*m, "s3cret-token").ok());
  for (const char* other : {"s3cret-tokeN", "s3cret-toke", "s3cret-token!", ""}) {
    const absl::Status s = CheckHello(*m, other);
    EXPECT_TRUE(absl::IsUnauthenticated(s)) << other << ": " << s;
    EXPECT_EQ(s.message().find("s3cret"), absl::string_view::npos) << s;
  }
  // Not a Hello, truncated, or lying about its length: refused.
  auto err = Encode(ErrorReply{1, absl::InternalError("x")});
  EXPECT_TRUE(absl::IsUnauthenticated(CheckHello(*err, "s3cret-token")));
  Bytes cut(m->begin(), m->end() - 1);
  Put<uint64_t>(cut, kLengthAt, cut.size());
  EXPECT_TRUE(absl::IsUnauthenticated(CheckHello(cut, "s3cret-token")));
  Bytes longer = *m;
  Put<uint32_t>(longer, kHeaderSize, 13);
  EXPECT_FALSE(DecodeHello(longer).ok());
  Bytes huge = *m;
  Put<uint32_t>(huge, kHeaderSize, 0xFFFFFFFFu);
  EXPECT_FALSE(DecodeHello(huge).ok());
  EXPECT_FALSE(Encode(Hello{std::string(kMaxTokenBytes + 1, 'x')}).ok());
}

}  // namespace
}  // namespace k3::wire

namespace k3::wire {
namespace {

TEST(ShmHello, RoundTripAndRejects) {
  auto bytes = EncodeShmHello({.ring_bytes = 1 << 20, .name = "/k3serve-dp-1-2-3"});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  auto length = ShmHelloLength(std::span<const std::byte>(*bytes).first(12));
  ASSERT_TRUE(length.ok());
  EXPECT_EQ(*length, bytes->size());
  EXPECT_EQ(*ShmHelloLength(std::span<const std::byte>(*bytes).first(11)), 0u);  // not yet known
  auto hello = DecodeShmHello(*bytes);
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_EQ(hello->ring_bytes, 1u << 20);
  EXPECT_EQ(hello->name, "/k3serve-dp-1-2-3");

  auto rejected = [](const ShmHello& h, const std::string& what) {
    auto b = EncodeShmHello(h);
    ASSERT_TRUE(b.ok());
    auto d = DecodeShmHello(*b);
    ASSERT_FALSE(d.ok()) << what;
    EXPECT_NE(d.status().message().find(what), std::string::npos) << d.status();
  };
  rejected({.ring_bytes = 3 << 20, .name = "/a"}, "ring_bytes");
  rejected({.ring_bytes = 1024, .name = "/a"}, "ring_bytes");
  rejected({.ring_bytes = 1 << 20, .name = "a/b"}, "does not start with '/'");
  rejected({.ring_bytes = 1 << 20, .name = "/../x/y"}, "bad character at 3");
  std::vector<std::byte> m = *bytes;
  m.push_back(std::byte{0});
  EXPECT_FALSE(DecodeShmHello(m).ok());  // length mismatch
  m = *bytes;
  m[0] = std::byte{0};
  EXPECT_FALSE(ShmHelloLength(m).ok());
  EXPECT_FALSE(EncodeShmHello({.ring_bytes = 1 << 20, .name = "/" + std::string(200, 'a')}).ok());
}

// A producer for tests: frames into a ring of `capacity` bytes, as the transport writes them.
struct TestRing {
  explicit TestRing(uint64_t capacity) : data(capacity) {}
  // Appends up to `room` bytes of the frame stream `stream` from `pos`.
  void Push(const std::vector<std::byte>& stream, size_t& pos, size_t max) {
    const size_t n = std::min<size_t>({max, stream.size() - pos, data.size() - (head - tail)});
    for (size_t i = 0; i < n; ++i) data[(head + i) % data.size()] = stream[pos + i];
    head += n;
    pos += n;
  }
  std::vector<std::byte> data;
  uint64_t head = 0, tail = 0;
};

std::vector<std::byte> Frames(const std::vector<std::vector<std::byte>>& bodies) {
  std::vector<std::byte> s;
  for (const auto& b : bodies) {
    const uint32_t len = static_cast<uint32_t>(b.size());
    const size_t at = s.size();
    s.resize(at + RingFrameBytes(len));
    std::memcpy(s.data() + at, &kRingFrameMagic, 4);
    std::memcpy(s.data() + at + 4, &len, 4);
    if (len != 0) std::memcpy(s.data() + at + 8, b.data(), len);
  }
  return s;
}

TEST(RingReader, FramesWrapAndStreamThroughASmallRing) {
  std::vector<std::vector<std::byte>> bodies;
  for (size_t n : {0, 1, 7, 8, 9, 63, 64, 200, 1000, 3})  // 1000 > the ring's 64 bytes
    bodies.emplace_back(n, std::byte{static_cast<unsigned char>(n)});
  const auto stream = Frames(bodies);
  TestRing ring(64);
  RingReader reader(64, 1 << 20);
  std::vector<std::vector<std::byte>> got;
  std::vector<std::byte> cur;
  size_t pos = 0;
  for (int step = 0; pos < stream.size() || ring.tail < ring.head; ++step) {
    ring.Push(stream, pos, 1 + step % 13);
    auto tail = reader.Read(
        ring.data, ring.tail, ring.head,
        [&](uint32_t len) {
          cur.assign(len, std::byte{0});
          return cur.data();
        },
        [&] { got.push_back(cur); });
    ASSERT_TRUE(tail.ok()) << tail.status();
    ring.tail = *tail;
    ASSERT_LT(step, 100000);
  }
  EXPECT_EQ(got, bodies);
}

TEST(RingReader, RejectsHostileCursorsAndHeaders) {
  RingReader reader(64, 100);
  std::vector<std::byte> ring(64);
  auto read = [&](uint64_t tail, uint64_t head) {
    return reader.Read(ring, tail, head, [](uint32_t) -> std::byte* { return nullptr; }, [] {});
  };
  EXPECT_FALSE(read(8, 0).ok());   // head behind tail
  EXPECT_FALSE(read(0, 65).ok());  // more than the capacity unread
  std::memcpy(ring.data(), "XXXX", 4);
  auto s = read(0, 8);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("bad frame magic"), std::string::npos) << s.status();
  const uint32_t big = 101;
  std::memcpy(ring.data(), &kRingFrameMagic, 4);
  std::memcpy(ring.data() + 4, &big, 4);
  RingReader fresh(64, 100);
  s = fresh.Read(ring, 0, 8, [](uint32_t) -> std::byte* { return nullptr; }, [] {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("above the limit 100"), std::string::npos) << s.status();
  EXPECT_FALSE(RingReader(64, 100).Read(std::vector<std::byte>(32), 0, 0, [](uint32_t) -> std::byte* { return nullptr; }, [] {}).ok());
}

}  // namespace
}  // namespace k3::wire

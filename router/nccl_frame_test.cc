#include "router/nccl_frame.h"

#include <cstring>

#include <gtest/gtest.h>

namespace k3::dataplane {
namespace {

constexpr NcclFrameLimits kLimits{.num_layers = 4, .width = 256, .top_k = 8, .max_rows = 1024};

NcclFrame Rows(int64_t rows) {
  return NcclFrame{.kind = NcclFrameKind::kRows, .seq = 7, .layer = 2, .rows = rows, .width = 256, .top_k = 8};
}

TEST(NcclFrame, RoundTrip) {
  for (int64_t rows : {1, 3, 64, 1024}) {
    const FrameBytes b = EncodeFrame(Rows(rows));
    auto f = DecodeFrame(b, kLimits);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->kind, NcclFrameKind::kRows);
    EXPECT_EQ(f->seq, 7u);
    EXPECT_EQ(f->layer, 2);
    EXPECT_EQ(f->rows, rows);
    const NcclPayload p = PayloadOf(*f);
    EXPECT_EQ(p.x_plane, size_t(rows) * 256 * 2);
    EXPECT_EQ(p.idx, size_t(rows) * 8 * 4);
    EXPECT_EQ(p.w, size_t(rows) * 8 * 4);
    EXPECT_EQ(p.sums, size_t(rows) * 256 * 4);
    EXPECT_EQ(p.out(), 2 * p.x_plane + p.idx + p.w);
  }
  for (NcclFrameKind k : {NcclFrameKind::kStats, NcclFrameKind::kClose}) {
    auto f = DecodeFrame(EncodeFrame(NcclFrame{.kind = k, .seq = 9}), kLimits);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->kind, k);
    EXPECT_EQ(PayloadOf(*f).out(), 0u);  // control frames carry nothing after them
    EXPECT_EQ(PayloadOf(*f).sums, 0u);
  }
}

// Every field the expert node reads is checked, and the error names it.
TEST(NcclFrame, RejectsBadFrames) {
  auto expect = [](std::span<const std::byte> b, const char* field) {
    auto f = DecodeFrame(b, kLimits);
    ASSERT_FALSE(f.ok()) << field;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(f.status().message().find(field), std::string::npos) << f.status();
  };
  FrameBytes b = EncodeFrame(Rows(4));
  expect(std::span(b).first(63), "frame:");
  FrameBytes bad = b;
  bad[0] = std::byte{0};
  expect(bad, "frame.magic");
  bad = b;
  bad[4] = std::byte{9};
  expect(bad, "frame.version");
  bad = b;
  bad[6] = std::byte{0};
  expect(bad, "frame.kind");
  bad[6] = std::byte{4};
  expect(bad, "frame.kind");
  auto with = [](NcclFrame f) { return EncodeFrame(f); };
  NcclFrame f = Rows(4);
  f.layer = 4;
  expect(with(f), "frame.layer");
  f.layer = -1;
  expect(with(f), "frame.layer");
  f = Rows(4);
  f.width = 255;
  expect(with(f), "frame.width");
  f = Rows(4);
  f.top_k = 9;
  expect(with(f), "frame.top_k");
  expect(with(Rows(0)), "frame.rows");
  expect(with(Rows(-5)), "frame.rows");
  expect(with(Rows(1025)), "frame.rows");
  // A size that would overflow the payload arithmetic is refused by the row bound first.
  expect(with(Rows(int64_t{1} << 61)), "frame.rows");
}

TEST(NcclFrame, StatsRoundTrip) {
  const NcclExpertStats s{.dispatches = 12, .bytes_in = 1 << 20, .bytes_out = 3 << 20, .recv_ms = 0.25,
                          .experts_ms = 4.5, .send_ms = 0.125, .wall_ms = 9.75};
  auto d = DecodeStats(EncodeStats(s));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->dispatches, 12);
  EXPECT_EQ(d->bytes_in, 1 << 20);
  EXPECT_EQ(d->bytes_out, 3 << 20);
  EXPECT_DOUBLE_EQ(d->recv_ms, 0.25);
  EXPECT_DOUBLE_EQ(d->experts_ms, 4.5);
  EXPECT_DOUBLE_EQ(d->send_ms, 0.125);
  EXPECT_DOUBLE_EQ(d->wall_ms, 9.75);
  // A rows frame is not a stats frame, nor is a short buffer or a negative count.
  EXPECT_FALSE(DecodeStats(EncodeFrame(Rows(4))).ok());
  FrameBytes b = EncodeStats(s);
  EXPECT_FALSE(DecodeStats(std::span(b).first(10)).ok());
  const int64_t neg = -1;
  std::memcpy(b.data() + 8, &neg, 8);
  EXPECT_FALSE(DecodeStats(b).ok());
}

}  // namespace
}  // namespace k3::dataplane

// k3serve-wire-seeds DIR: writes valid data-plane messages into DIR as a seed corpus for the
// decoder's fuzzer (scripts/fuzz.sh). Generated rather than checked in, so they follow the format.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "router/wire.h"

using namespace k3::wire;

namespace {

std::vector<std::byte> Rows(RowDType dtype, size_t n) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = 0.5f * static_cast<float>(i) - 1.0f;
  std::vector<std::byte> bytes(n * RowDTypeSize(dtype));
  if (!FromFloat(values, dtype, bytes).ok()) std::abort();
  return bytes;
}

ExpertRequest Request(RowDType dtype, uint32_t n_rows, uint32_t width, uint32_t pairs_per_row,
                      const std::vector<std::byte>& rows) {
  ExpertRequest r{.request_id = 7, .layer = 3, .placement_version = 2, .dtype = dtype, .width = width,
                  .n_rows = n_rows, .row_offsets = {0}, .pairs = {}, .rows = rows};
  for (uint32_t i = 0; i < n_rows; ++i) {
    for (uint32_t j = 0; j < pairs_per_row + i % 2; ++j)
      r.pairs.push_back({(i * 5 + j) % 896, 0.125f * static_cast<float>(j + 1)});
    r.row_offsets.push_back(static_cast<uint32_t>(r.pairs.size()));
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const auto f32 = Rows(RowDType::kF32, 4 * 8), bf16 = Rows(RowDType::kBF16, 3 * 16);
  std::vector<std::vector<std::byte>> seeds;
  auto add = [&](const auto& m) {
    auto bytes = Encode(m);
    if (!bytes.ok()) {
      std::fprintf(stderr, "%s\n", bytes.status().ToString().c_str());
      std::exit(1);
    }
    seeds.push_back(*std::move(bytes));
  };
  add(Request(RowDType::kF32, 4, 8, 2, f32));
  add(Request(RowDType::kBF16, 3, 16, 0, bf16));  // some rows without pairs
  add(Request(RowDType::kBF16, 0, 3584, 0, {}));  // empty batch
  add(ExpertReply{.request_id = 7, .dtype = RowDType::kF32, .width = 8, .n_rows = 4, .sums = f32});
  add(ExpertReply{.request_id = 8, .dtype = RowDType::kBF16, .width = 16, .n_rows = 0, .sums = {}});
  add(ErrorReply{.request_id = 9, .status = absl::UnavailableError("expert node draining")});
  add(Hello{"fuzz-node-token"});  // the token the fuzz target's handshake expects
  add(Hello{""});
  // The shared-memory transport's hello, and a ring stream of three frames (one longer than the
  // fuzzer's 256-byte ring).
  seeds.push_back(*EncodeShmHello({.ring_bytes = 1 << 21, .name = "/k3serve-dp-1-2-3"}));
  std::vector<std::byte> ring;
  for (size_t len : {5, 0, 300}) {
    const size_t at = ring.size();
    ring.resize(at + RingFrameBytes(static_cast<uint32_t>(len)), std::byte{0x11});
    const uint32_t l = static_cast<uint32_t>(len);
    std::memcpy(ring.data() + at, &kRingFrameMagic, 4);
    std::memcpy(ring.data() + at + 4, &l, 4);
  }
  seeds.push_back(ring);
  for (size_t i = 0; i < seeds.size(); ++i) {
    const std::string path = std::string(argv[1]) + "/seed-" + std::to_string(i);
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(seeds[i].data()), static_cast<std::streamsize>(seeds[i].size()));
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
  }
  std::printf("%zu seeds in %s\n", seeds.size(), argv[1]);
  return 0;
}

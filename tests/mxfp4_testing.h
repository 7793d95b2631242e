// Test checkpoints with MXFP4 routed experts, made from float ones (the GPU tests run where k3serve-mkmodel
// is not built).
#pragma once

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/bf16.h"
#include "common/safetensors.h"
#include "engine/tensor_names.h"
#include "kernels/cpu/mxfp4.h"
#include "tests/testing.h"

namespace k3::testing {

inline std::vector<float> AsFloats(const TensorInfo& t) {
  std::vector<float> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (t.dtype == DType::kF32) {
      std::memcpy(&v[i], t.data + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, t.data + 2 * i, 2);
      v[i] = Bf16ToFloat(b);
    }
  }
  return v;
}

// [rows, cols] zero-padded to [R, C].
inline std::vector<float> Pad(const std::vector<float>& v, int64_t rows, int64_t cols, int64_t R, int64_t C) {
  std::vector<float> out(R * C, 0.0f);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(v.data() + r * cols, cols, out.data() + r * C);
  return out;
}

// src's checkpoint, into the temp directory `tag`, with every tensor in bf16 (CPU and GPU then read the same
// weights) and its routed experts in MXFP4 (cpu::QuantizeMxfp4 of their values), beside its config with the
// release's quantization_config. The expert (and shared expert) intermediate width is zero-padded to I: zero units
// add nothing, so the model is the same function, and MXFP4's group of 32 divides it.
inline std::string QuantizeExperts(const std::string& tag, const std::string& src, int64_t I) {
  const std::string dir = (std::filesystem::temp_directory_path() / tag).string();
  std::filesystem::create_directories(dir);
  std::ifstream config_in(src + "/config.json");
  nlohmann::json config = nlohmann::json::parse(config_in);
  const int64_t I0 = config["moe_intermediate_size"], ns = config.value("num_shared_experts", 0);
  config["moe_intermediate_size"] = I;
  std::ifstream release_in(SourceDir() + "/tests/data/kimi-k3-release/config.json");
  config["quantization_config"] = nlohmann::json::parse(release_in)["text_config"]["quantization_config"];
  std::ofstream(dir + "/config.json") << config.dump(1);
  auto ck = Checkpoint::Open(src);
  EXPECT_TRUE(ck.ok()) << ck.status();
  std::vector<TensorBlob> blobs;
  auto bytes = [](const void* p, size_t n) {
    std::vector<std::byte> b(n);
    std::memcpy(b.data(), p, n);
    return b;
  };
  for (const auto& [name, t] : ck->tensors()) {
    std::vector<float> v = AsFloats(t);
    std::vector<int64_t> shape = t.shape;
    const bool expert = name.find(".block_sparse_moe.experts.") != std::string::npos;
    const bool rows = name.ends_with(names::kExpertW1) || name.ends_with(names::kExpertW3) ||
                      name.ends_with(names::kSharedGate) || name.ends_with(names::kSharedUp);
    const bool cols = name.ends_with(names::kExpertW2) || name.ends_with(names::kSharedDown);
    const int64_t from = expert ? I0 : I0 * ns, to = expert ? I : I * ns;
    if (rows && shape[0] == from) v = Pad(v, shape[0], shape[1], to, shape[1]), shape[0] = to;
    if (cols && shape[1] == from) v = Pad(v, shape[0], shape[1], shape[0], to), shape[1] = to;
    if (expert) {
      std::vector<uint8_t> q(shape[0] * shape[1] / 2), sc(shape[0] * shape[1] / 32);
      cpu::QuantizeMxfp4(v.data(), shape[0], shape[1], q.data(), sc.data());
      blobs.push_back({name + names::kPackedSuffix, DType::kU8, {shape[0], shape[1] / 2}, bytes(q.data(), q.size())});
      blobs.push_back({name + names::kScaleSuffix, DType::kU8, {shape[0], shape[1] / 32}, bytes(sc.data(), sc.size())});
      continue;
    }
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = FloatToBf16(v[i]);
    blobs.push_back({name, DType::kBF16, shape, bytes(h.data(), h.size() * 2)});
  }
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", blobs).ok());
  return dir;
}

}  // namespace k3::testing

// The released Kimi K3 checkpoint as published: its config.json, the language_model. layout and
// the MXFP4 routed experts, which compute what their exact fp32 dequantization computes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "engine/capacity.h"
#include "engine/model.h"
#include "engine/tensor_names.h"
#include "kernels/cpu/mxfp4.h"
#include "engine/model_testing.h"
#include "tests/testing.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::RelDiff;
using testing::Load;
using testing::Ids;
using testing::Logits;
using testing::ReadText;
using testing::Scratch;
using testing::WriteText;

std::string SourcePath(const std::string& rel) { return testing::SourceDir() + "/" + rel; }

void MkModel(const std::string& config, const std::string& out, const std::string& flags) {
  const std::string cmd = std::string(K3SERVE_BIN_DIR) + "/k3serve-mkmodel --config " + config + " --out " + out +
                          " --seed 1 " + flags;
  std::string output;
  ASSERT_EQ(testing::RunCommand(cmd, &output), 0) << cmd << "\n" << output;
}

// The example configs with widths that MXFP4's group of 32 divides (tiny-k3's experts are 48 wide).
std::string Mxfp4Config(const Scratch& dir, const std::string& name) {
  json c = json::parse(ReadText(name == "tiny-k3" ? SourcePath("tools/configs/tiny-k3.json")
                                                  : SourcePath("tests/data/tiny-kimi-linear/config.json")));
  c["moe_intermediate_size"] = 64;
  const fs::path p = dir / (name + ".json");
  WriteText(p, c.dump(1));
  return p.string();
}

std::map<std::string, TensorBlob> ReadTensors(const std::string& dir) {
  auto ck = Checkpoint::Open(dir);
  EXPECT_TRUE(ck.ok()) << ck.status();
  std::map<std::string, TensorBlob> out;
  for (const auto& [name, t] : ck->tensors())
    out[name] = {name, t.dtype, t.shape, std::vector<std::byte>(t.data, t.data + t.nbytes)};
  return out;
}

void WriteCheckpoint(const fs::path& dir, const json& config, const std::map<std::string, TensorBlob>& blobs) {
  fs::create_directories(dir);
  WriteText(dir / "config.json", config.dump(1));
  std::vector<TensorBlob> v;
  for (const auto& [name, b] : blobs) v.push_back(b);
  ASSERT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), v).ok());
}

// The same model with every MXFP4 expert matrix dequantized (exactly) and stored in fp32, and the
// quantization_config removed.
void WriteDequantized(const std::string& from, const fs::path& to) {
  json config = json::parse(ReadText(fs::path(from) / "config.json"));
  (config.contains("text_config") ? config["text_config"] : config).erase("quantization_config");
  auto blobs = ReadTensors(from);
  std::map<std::string, TensorBlob> out;
  const std::string packed = names::kPackedSuffix, scale = names::kScaleSuffix;
  for (const auto& [name, b] : blobs) {
    if (name.ends_with(scale)) continue;
    if (!name.ends_with(packed)) {
      out[name] = b;
      continue;
    }
    const std::string base = name.substr(0, name.size() - packed.size());
    const TensorBlob& s = blobs.at(base + scale);
    const int64_t rows = b.shape[0], cols = 2 * b.shape[1];
    TensorBlob f{base, DType::kF32, {rows, cols}, std::vector<std::byte>(rows * cols * 4)};
    cpu::DequantizeMxfp4({reinterpret_cast<const uint8_t*>(b.bytes.data()), reinterpret_cast<const uint8_t*>(s.bytes.data())},
                         cols, 0, rows, reinterpret_cast<float*>(f.bytes.data()));
    out[base] = std::move(f);
  }
  WriteCheckpoint(to, config, out);
}

// ---- The released config.json ----

TEST(Release, PublishedConfigParses) {
  const std::string path = SourcePath("tests/data/kimi-k3-release/config.json");
  auto c = ParseModelConfig(ReadText(path), path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->expert_format, ExpertFormat::kMxfp4);
  EXPECT_EQ(c->num_layers, 93);
  EXPECT_EQ(c->num_experts, 896);
  EXPECT_EQ(c->latent_dim, 3584);
  EXPECT_EQ(c->moe_intermediate_size, 3072);
  EXPECT_EQ(c->num_kda_layers(), 69);
  EXPECT_EQ(c->num_mla_layers(), 24);
  // The tensor inventory's shapes (tensors.md), named as released.
  std::map<std::string, std::vector<int64_t>> want = {
      {"language_model.model.embed_tokens.weight", {163840, 7168}},
      {"language_model.lm_head.weight", {163840, 7168}},
      {"language_model.model.layers.0.mlp.gate_proj.weight", {33792, 7168}},
      {"language_model.model.layers.0.mlp.down_proj.weight", {7168, 33792}},
      {"language_model.model.layers.1.self_attn.A_log", {96}},
      {"language_model.model.layers.1.self_attn.q_conv1d.weight", {12288, 1, 4}},
      {"language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight", {576, 7168}},
      {"language_model.model.layers.5.block_sparse_moe.experts.895.w1.weight_packed", {3072, 1792}},
      {"language_model.model.layers.5.block_sparse_moe.experts.895.w1.weight_scale", {3072, 112}},
      {"language_model.model.layers.92.block_sparse_moe.experts.0.w2.weight_packed", {3584, 1536}},
      {"language_model.model.layers.92.block_sparse_moe.experts.0.w2.weight_scale", {3584, 96}},
      {"language_model.model.layers.92.block_sparse_moe.routed_expert_down_proj.weight", {3584, 7168}},
  };
  int64_t packed_bytes = 0;
  for (const TensorSpec& t : ExpectedTensors(*c, nullptr, names::Layout::kK3Release)) {
    if (auto it = want.find(t.name); it != want.end()) {
      EXPECT_EQ(t.shape, it->second) << t.name;
      want.erase(it);
    }
    if (t.role == TensorRole::kMxfp4Packed || t.role == TensorRole::kMxfp4Scale) packed_bytes += t.shape[0] * t.shape[1];
  }
  EXPECT_TRUE(want.empty()) << want.begin()->first;
  // 92 MoE layers · 896 experts · 3 · 3072 · 3584 weights at 4.25 bits: the release's 1.45 TB of experts.
  EXPECT_EQ(packed_bytes, int64_t{92} * 896 * 3 * 3072 * 3584 / 32 * 17);
}

// The capacity plan of the release: 82,432 slots of 3·3072·3584 weights; MXFP4 holds a slot in
// 4.25 bits a weight, 16/4.25 = 3.76 times less than bf16.
TEST(Release, CapacityPlan) {
  const std::string path = SourcePath("tests/data/kimi-k3-release/config.json");
  auto c = ParseModelConfig(ReadText(path), path);
  ASSERT_TRUE(c.ok()) << c.status();
  const double gpu = 131.0 * 1073741824.0;
  const CapacityPlan mx = PlanCapacity(*c, WeightType::kMxfp4, gpu), bf = PlanCapacity(*c, WeightType::kBf16, gpu);
  EXPECT_EQ(mx.slots, 92 * 896);
  EXPECT_EQ(mx.slot_bytes, 3.0 * 3072 * 3584 * 17 / 32);
  EXPECT_EQ(bf.slot_bytes, 3.0 * 3072 * 3584 * 2);
  EXPECT_NEAR(bf.slot_bytes / mx.slot_bytes, 3.76, 0.005);
  EXPECT_EQ(mx.slots_per_gpu, static_cast<int64_t>(gpu / mx.slot_bytes));
  EXPECT_EQ(mx.expert_gpus, (mx.slots + mx.slots_per_gpu - 1) / mx.slots_per_gpu);
  EXPECT_EQ(mx.expert_gpus, 11);
  EXPECT_EQ(bf.expert_gpus, 39);
  EXPECT_EQ(mx.attention_bytes, bf.attention_bytes);
  std::printf("kimi-k3 release:\n%s%s", FormatPlan(mx).c_str(), FormatPlan(bf).c_str());
}

TEST(Release, UnsupportedQuantizationIsNamed) {
  const std::string text = ReadText(SourcePath("tests/data/kimi-k3-release/config.json"));
  auto err = [&](const std::function<void(json&)>& edit) {
    json j = json::parse(text);
    edit(j["text_config"]["quantization_config"]);
    auto c = ParseModelConfig(j.dump());
    return c.ok() ? std::string() : std::string(c.status().message());
  };
  EXPECT_NE(err([](json& q) { q["format"] = "nvfp4-pack-quantized"; }).find("\"format\" \"nvfp4-pack-quantized\""),
            std::string::npos);
  EXPECT_NE(err([](json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 16; }).find("\"group_size\" 16"),
            std::string::npos);
  EXPECT_NE(err([](json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 8; }).find("\"num_bits\" 8"),
            std::string::npos);
  EXPECT_NE(err([](json& q) { q["config_groups"]["group_0"]["weights"]["scale_dtype"] = "torch.float16"; })
                .find("\"scale_dtype\""),
            std::string::npos);
  EXPECT_NE(err([](json& q) { q["quant_method"] = "gptq"; }).find("\"quant_method\" \"gptq\""), std::string::npos);
  EXPECT_NE(err([](json& q) { q["ignore"].push_back("re:.*experts.*"); }).find("excludes the routed experts"),
            std::string::npos);
  EXPECT_NE(err([](json& q) { q["config_groups"]["group_0"]["input_activations"] = json::object(); })
                .find("\"input_activations\""),
            std::string::npos);
  EXPECT_EQ(err([](json&) {}), "");
}

// ---- A tiny checkpoint in the release layout ----

// The release layout with float experts computes exactly what the hub layout computes (mkmodel
// draws the same values for a tensor whatever its name), and its vision tower is never read.
TEST(Release, LayoutLoadsAndEqualsTheHubLayout) {
  Scratch dir("layout");
  const std::string config = Mxfp4Config(dir, "tiny-k3");
  MkModel(config, (dir / "hub").string(), "--dtype fp32");
  MkModel(config, (dir / "release").string(), "--dtype fp32 --layout k3-release");
  MkModel(config, (dir / "release_bf16").string(), "--dtype bf16 --layout k3-release");
  auto bf16 = ReadTensors((dir / "release_bf16").string());
  // The release keeps KDA's decay and conv parameters, its output norm and the router bias in fp32.
  for (const char* name : {"language_model.model.layers.0.self_attn.A_log", "language_model.model.layers.0.self_attn.dt_bias",
                           "language_model.model.layers.0.self_attn.q_conv1d.weight",
                           "language_model.model.layers.0.self_attn.o_norm.weight",
                           "language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"})
    EXPECT_EQ(bf16.at(name).dtype, DType::kF32) << name;
  EXPECT_EQ(bf16.at("language_model.model.layers.0.self_attn.q_proj.weight").dtype, DType::kBF16);
  EXPECT_TRUE(Load((dir / "release_bf16").string()));
  auto blobs = ReadTensors((dir / "release").string());
  EXPECT_TRUE(blobs.count("vision_tower.patch_embed.proj.weight"));
  EXPECT_TRUE(blobs.count("language_model.lm_head.weight"));
  EXPECT_TRUE(blobs.count("language_model.model.layers.0.mlp.gate_proj.weight"));
  EXPECT_EQ(blobs.at("language_model.model.layers.0.self_attn.A_log").shape, std::vector<int64_t>{32});
  auto hub = Load((dir / "hub").string()), release = Load((dir / "release").string());
  ASSERT_TRUE(hub && release);
  const auto ids = Ids(25, 3, hub->config().vocab_size);
  EXPECT_EQ(Logits(*release, ids, 20), Logits(*hub, ids, 20));

  // A tensor of the text model that the config does not imply is still an error.
  blobs["language_model.model.layers.0.mystery.weight"] = {"language_model.model.layers.0.mystery.weight", DType::kF32,
                                                           {2}, std::vector<std::byte>(8)};
  WriteCheckpoint(dir / "extra", json::parse(ReadText(dir / "release" / "config.json")), blobs);
  auto m = Model::Load((dir / "extra").string());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("unexpected tensor \"language_model.model.layers.0.mystery.weight\""),
            std::string::npos)
      << m.status();
}

// ---- MXFP4 experts ----

// Logits of the MXFP4 model equal those of its exact fp32 dequantization, to fp32 rounding.
void ExpectMxfp4EqualsDequantized(const std::string& name, const std::string& flags) {
  Scratch dir("eq_" + name);
  MkModel(Mxfp4Config(dir, name), (dir / "mx").string(), flags);
  WriteDequantized((dir / "mx").string(), dir / "f32");
  auto mx = Load((dir / "mx").string()), f32 = Load((dir / "f32").string());
  ASSERT_TRUE(mx && f32);
  EXPECT_EQ(mx->config().expert_format, ExpertFormat::kMxfp4);
  EXPECT_EQ(f32->config().expert_format, ExpertFormat::kFloat);
  // Packed experts stay views into the mapping: nothing but the bf16 non-expert tensors is converted.
  int64_t converted = 0;
  for (const TensorSpec& t : ExpectedTensors(mx->config())) converted += t.expert < 0;
  EXPECT_LE(static_cast<int64_t>(mx->weights().owned.size()), converted);
  for (const auto& [ids, prefill] : {std::pair{Ids(1, 1, 512), 1}, {Ids(40, 2, 512), 31}, {Ids(97, 4, 512), 97}}) {
    const auto a = Logits(*mx, ids, prefill), b = Logits(*f32, ids, prefill);
    EXPECT_LT(RelDiff(a, b), 1e-5) << name << " " << ids.size() << " tokens";
    std::printf("%s, %zu tokens: MXFP4 vs fp32 dequantization, relative difference %.3g\n", name.c_str(), ids.size(),
                RelDiff(a, b));
  }
}

TEST(Mxfp4Experts, KimiLinearEqualsItsFp32Dequantization) {
  ExpectMxfp4EqualsDequantized("tiny-kimi-linear", "--dtype bf16 --experts-dtype mxfp4");
}

TEST(Mxfp4Experts, K3InTheReleaseLayoutEqualsItsFp32Dequantization) {
  ExpectMxfp4EqualsDequantized("tiny-k3", "--dtype bf16 --experts-dtype mxfp4 --layout k3-release");
}

// Load errors name the tensor: a scale of 255 (NaN), a wrong dtype, a wrong shape, float experts
// where the config says MXFP4.
TEST(Mxfp4Experts, BadTensorsAreNamed) {
  Scratch dir("bad");
  MkModel(Mxfp4Config(dir, "tiny-kimi-linear"), (dir / "mx").string(), "--experts-dtype mxfp4");
  const json config = json::parse(ReadText(dir / "mx" / "config.json"));
  const std::string scale = names::Expert(1, 3, "w2.weight_scale"), packed = names::Expert(2, 0, "w1.weight_packed");
  auto error_after = [&](const std::string& sub, const std::function<void(std::map<std::string, TensorBlob>&)>& edit,
                         const json& cfg) {
    auto blobs = ReadTensors((dir / "mx").string());
    edit(blobs);
    WriteCheckpoint(dir / sub, cfg, blobs);
    auto m = Model::Load((dir / sub).string());
    return m.ok() ? std::string() : std::string(m.status().message());
  };
  std::string e = error_after("nan", [&](auto& b) { b.at(scale).bytes[7] = std::byte{0xFF}; }, config);
  EXPECT_NE(e.find("\"" + scale + "\" has scale 0xFF (NaN) at [3, 1]"), std::string::npos) << e;  // [128, 2]
  e = error_after("dtype", [&](auto& b) {
    b.at(packed).dtype = DType::kBF16;
    b.at(packed).bytes.resize(2 * b.at(packed).bytes.size());
  }, config);
  EXPECT_NE(e.find("\"" + packed + "\" has dtype BF16"), std::string::npos) << e;
  e = error_after("shape", [&](auto& b) { b.at(packed).shape = {b.at(packed).shape[0] * 2, b.at(packed).shape[1] / 2}; },
                  config);
  EXPECT_NE(e.find("\"" + packed + "\" has shape"), std::string::npos) << e;
  json plain = config;
  plain.erase("quantization_config");
  e = error_after("plain", [](auto&) {}, plain);
  EXPECT_NE(e.find("is stored as MXFP4"), std::string::npos) << e;
}

}  // namespace
}  // namespace k3

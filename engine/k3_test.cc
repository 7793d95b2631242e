// Kimi K3 at the engine level: the example configs, closed forms of the K3 switches, and a tiny
// K3 model written by k3serve-mkmodel behaving as a causal model must.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "engine/model.h"
#include "engine/tensor_names.h"
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

std::string ConfigFile(const std::string& name) { return testing::SourceDir() + "/tools/configs/" + name + ".json"; }
std::string DataDir(const std::string& name) { return testing::SourceDir() + "/tests/data/" + name; }

// Runs k3serve-mkmodel with `args`; returns its exit code, its output in *output.
int MkModel(const std::string& args, std::string* output) {
  return testing::RunCommand(std::string(K3SERVE_BIN_DIR) + "/k3serve-mkmodel " + args, output);
}

// Seed 1 keeps every token of these tests away from a near-tie in the top-k routing, where the
// rounding differences between a prefill and a decode step (BLAS blocking) could pick another
// expert: a discrete change that no tolerance covers (rare; a fixed seed keeps the test deterministic).
void WriteModel(const std::string& config, const std::string& out, const std::string& flags = "--dtype fp32") {
  std::string output;
  ASSERT_EQ(MkModel("--config " + config + " --out " + out + " --seed 1 " + flags, &output), 0) << output;
}

// ---- Example configs (tools/configs) ----

absl::StatusOr<ModelConfig> ParseFile(const std::string& path) { return ParseModelConfig(ReadText(path), path); }

int64_t Params(const std::vector<TensorSpec>& specs, bool routed) {
  int64_t n = 0;
  for (const TensorSpec& t : specs) {
    if ((t.expert >= 0) != routed) continue;
    int64_t k = 1;
    for (int64_t s : t.shape) k *= s;
    n += k;
  }
  return n;
}

// Total and active parameters from the loader's tensor list: all non-routed tensors plus top_k of
// the num_experts routed experts of each MoE layer.
std::pair<double, double> TotalAndActive(const ModelConfig& c) {
  const auto specs = ExpectedTensors(c);
  const double routed = static_cast<double>(Params(specs, true)), other = static_cast<double>(Params(specs, false));
  return {routed + other, other + routed * c.top_k / c.num_experts};
}

TEST(K3Configs, KimiK3IsTheReleasedShape) {
  auto c = ParseFile(ConfigFile("kimi-k3"));  // nested under text_config, as released
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 7168);
  EXPECT_EQ(c->num_layers, 93);
  EXPECT_EQ(c->num_kda_layers(), 69);
  EXPECT_EQ(c->num_mla_layers(), 24);
  EXPECT_EQ(std::count(c->mlp.begin(), c->mlp.end(), Mlp::kMoe), 92);  // DESIGN §4: 896 × 92 (layer, expert) pairs
  EXPECT_EQ(c->num_experts, 896);
  EXPECT_EQ(c->top_k, 16);
  EXPECT_EQ(c->num_shared_experts, 2);
  EXPECT_EQ(c->latent_dim, 3584);
  EXPECT_TRUE(c->latent_norm);
  EXPECT_EQ(c->attn_res_block, 12);
  EXPECT_EQ(c->act, Activation::kSitu);
  EXPECT_TRUE(c->kda_gate_bounded);
  EXPECT_TRUE(c->kda_full_rank_gate);
  EXPECT_TRUE(c->mla_output_gate);
  const auto [total, active] = TotalAndActive(*c);
  EXPECT_NEAR(total / 1e12, 2.8, 0.05);  // 2.8T total
  EXPECT_NEAR(active / 1e9, 104, 4);     // 104B active (with embeddings and LM head)
}

TEST(K3Configs, K3MiniHasK3Shapes) {
  auto mini = ParseFile(ConfigFile("k3-mini")), k3 = ParseFile(ConfigFile("kimi-k3"));
  ASSERT_TRUE(mini.ok()) << mini.status();
  ASSERT_TRUE(k3.ok()) << k3.status();
  EXPECT_EQ(mini->num_layers, 4);
  EXPECT_EQ(mini->num_mla_layers(), 1);
  // Every per-layer shape is K3's: the tensors of a KDA, an MLA and a MoE layer match.
  auto layer_shapes = [](const ModelConfig& c, int64_t l) {
    std::map<std::string, std::vector<int64_t>> m;
    const std::string prefix = absl::StrCat("model.layers.", l, ".");
    for (const TensorSpec& t : ExpectedTensors(c))
      if (t.layer == l) m[t.name.substr(prefix.size())] = t.shape;
    return m;
  };
  EXPECT_EQ(layer_shapes(*mini, 0), layer_shapes(*k3, 0));  // KDA + dense MLP
  EXPECT_EQ(layer_shapes(*mini, 1), layer_shapes(*k3, 1));  // KDA + LatentMoE
  EXPECT_EQ(layer_shapes(*mini, 3), layer_shapes(*k3, 3));  // gated MLA + LatentMoE
}

TEST(K3Configs, KimiLinear48bIsTheReleasedShape) {
  auto c = ParseFile(ConfigFile("kimi-linear-48b"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_layers, 27);
  EXPECT_EQ(c->num_mla_layers(), 7);
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->attn_res_block, 0);
  EXPECT_EQ(c->latent_dim, 0);
  const auto [total, active] = TotalAndActive(*c);
  EXPECT_NEAR(total / 1e9, 48, 1.5);   // 48B total
  EXPECT_NEAR(active / 1e9, 3, 0.5);   // A3B (3.5B with the embeddings and the LM head)
}

// The GPU's e2e decode model: d 2304, 32 KDA heads of 128, 256 experts top-8 of width 1024, 1 shared, vocab
// 163840, 4 layers (3 KDA + 1 MLA, the first dense) — Kimi-Linear-48B's layer shapes.
TEST(K3Configs, KimiLinearE2eIsTheIssueShape) {
  auto c = ParseFile(ConfigFile("kimi-linear-e2e")), kl = ParseFile(ConfigFile("kimi-linear-48b"));
  ASSERT_TRUE(c.ok() && kl.ok());
  EXPECT_EQ(c->hidden_size, 2304);
  EXPECT_EQ(c->kda_heads, 32);
  EXPECT_EQ(c->kda_head_dim, 128);
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->top_k, 8);
  EXPECT_EQ(c->moe_intermediate_size, 1024);
  EXPECT_EQ(c->num_shared_experts, 1);
  EXPECT_EQ(c->vocab_size, 163840);
  EXPECT_EQ(c->num_layers, 4);
  EXPECT_EQ(c->num_kda_layers(), 3);
  EXPECT_EQ(c->num_mla_layers(), 1);
  EXPECT_EQ(c->mlp[0], Mlp::kDense);
  EXPECT_EQ(c->intermediate_size, kl->intermediate_size);
  EXPECT_EQ(c->mla_heads, kl->mla_heads);
}

TEST(K3Configs, TinyK3MatchesTheGoldenCheckpoint) {
  auto c = ParseFile(ConfigFile("tiny-k3"));
  ASSERT_TRUE(c.ok()) << c.status();
  auto golden = Checkpoint::Open(DataDir("tiny-k3"));
  ASSERT_TRUE(golden.ok()) << golden.status();
  std::map<std::string, std::vector<int64_t>> want, got;
  for (const auto& [name, t] : golden->tensors()) want[name] = t.shape;
  for (const TensorSpec& t : ExpectedTensors(*c)) got[t.name] = t.shape;
  EXPECT_EQ(got, want);
}

// Per-sequence state from the config (what k3serve-bench-engine reports).
TEST(K3Configs, SequenceStateBytes) {
  auto k3 = ParseFile(ConfigFile("kimi-k3")), kl = ParseFile(ConfigFile("kimi-linear-48b"));
  ASSERT_TRUE(k3.ok() && kl.ok());
  // KDA layers × (H·dk·dv state + 3 convs × (K−1) × H·dk), MLA layers × (kv_lora_rank + dr), fp32.
  EXPECT_EQ(SequenceStateBytes(*k3).fixed, 69 * (96 * 128 * 128 + 3 * 3 * 96 * 128) * 4);
  EXPECT_EQ(SequenceStateBytes(*k3).per_token, 24 * (512 + 64) * 4);
  EXPECT_EQ(SequenceStateBytes(*kl).fixed, 20 * (32 * 128 * 128 + 3 * 3 * 32 * 128) * 4);
  EXPECT_EQ(SequenceStateBytes(*kl).per_token, 7 * (512 + 64) * 4);
}

// ---- A model written by k3serve-mkmodel ----

struct MkCase {
  std::string name, config, dtype;
};
void PrintTo(const MkCase& c, std::ostream* os) { *os << c.name; }

class MkModelTest : public ::testing::TestWithParam<MkCase> {
 protected:
  void SetUp() override {
    WriteModel(GetParam().config, dir_.str(), "--dtype " + GetParam().dtype);
    model_ = Load(dir_.str());
    ASSERT_NE(model_, nullptr);
  }
  Scratch dir_{GetParam().name};
  std::unique_ptr<Model> model_;
};

TEST_P(MkModelTest, IncrementalEqualsPrefill) {
  const auto ids = Ids(150, 7, model_->config().vocab_size);
  const auto whole = Logits(*model_, ids, 150);
  const auto part = Logits(*model_, ids, 70);  // a prefill that crosses a KDA chunk, then decode
  EXPECT_LT(RelDiff(part, whole), 1e-4);
}

// Sequences stepped together (staggered: prefills share steps with decodes) equal each alone.
TEST_P(MkModelTest, BatchedEqualsAlone) {
  const Model& m = *model_;
  LocalExpertExecutor experts(m.config(), m.weights());
  const std::vector<int64_t> lens = {1, 2, 5, 17, 33, 64, 65, 100};
  const int64_t kDecode = 3, V = m.config().vocab_size;
  std::vector<std::vector<int32_t>> seqs;
  std::vector<std::vector<float>> alone;
  for (size_t i = 0; i < lens.size(); ++i) {
    seqs.push_back(Ids(lens[i] + kDecode, 100 + i, V));
    alone.push_back(Logits(m, seqs[i], lens[i]));
  }
  std::vector<std::unique_ptr<SequenceState>> states;
  std::vector<std::vector<float>> batched(seqs.size());
  std::vector<int64_t> fed(seqs.size(), 0);
  for (size_t i = 0; i < seqs.size(); ++i) states.push_back(std::make_unique<SequenceState>(m.config()));
  for (size_t step = 0; step < seqs.size() + kDecode; ++step) {
    std::vector<SeqChunk> chunks;
    std::vector<size_t> who;
    for (size_t i = 0; i <= step && i < seqs.size(); ++i) {
      if (fed[i] == static_cast<int64_t>(seqs[i].size())) continue;
      const int64_t n = fed[i] == 0 ? lens[i] : 1;
      chunks.push_back({states[i].get(), std::span<const int32_t>(seqs[i]).subspan(fed[i], n), LogitsMode::kAll});
      who.push_back(i);
      fed[i] += n;
    }
    std::vector<float> out;
    ASSERT_TRUE(m.Forward(chunks, experts, &out).ok());
    int64_t row = 0;
    for (size_t j = 0; j < chunks.size(); ++j) {
      const int64_t n = static_cast<int64_t>(chunks[j].tokens.size()) * V;
      batched[who[j]].insert(batched[who[j]].end(), out.begin() + row, out.begin() + row + n);
      row += n;
    }
  }
  for (size_t i = 0; i < seqs.size(); ++i) EXPECT_LT(RelDiff(batched[i], alone[i]), 2e-5) << "sequence " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Configs, MkModelTest,
    ::testing::Values(MkCase{"tiny_k3_fp32", ConfigFile("tiny-k3"), "fp32"},
                      MkCase{"tiny_k3_bf16", ConfigFile("tiny-k3"), "bf16"},
                      MkCase{"tiny_kimi_linear", DataDir("tiny-kimi-linear") + "/config.json", "fp32"}),
    [](const auto& info) { return info.param.name; });

TEST(MkModel, ShardedCheckpointIsTheSameModel) {
  Scratch one("one"), sharded("sharded");
  WriteModel(ConfigFile("tiny-k3"), one.str());
  WriteModel(ConfigFile("tiny-k3"), sharded.str(), "--dtype fp32 --shard-bytes 1000000");
  const json index = json::parse(ReadText(sharded / "model.safetensors.index.json"));
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  EXPECT_GT(files.size(), 5u);
  EXPECT_FALSE(fs::exists(sharded / "model.safetensors"));
  auto a = Load(one.str()), b = Load(sharded.str());
  ASSERT_TRUE(a && b);
  const auto ids = Ids(20, 1, a->config().vocab_size);
  EXPECT_EQ(Logits(*a, ids, 20), Logits(*b, ids, 20));
}

TEST(MkModel, SeedDecidesTheWeights) {
  Scratch a("seed_a"), b("seed_b"), c("seed_c");
  WriteModel(ConfigFile("tiny-k3"), a.str());
  WriteModel(ConfigFile("tiny-k3"), b.str());
  std::string output;
  ASSERT_EQ(MkModel("--config " + ConfigFile("tiny-k3") + " --out " + c.str() + " --seed 2 --dtype fp32", &output), 0);
  EXPECT_EQ(ReadText(a / "model.safetensors"), ReadText(b / "model.safetensors"));
  EXPECT_NE(ReadText(a / "model.safetensors"), ReadText(c / "model.safetensors"));
  EXPECT_EQ(ReadText(a / "config.json"), ReadText(ConfigFile("tiny-k3")));
}

TEST(MkModel, RefusesBadArguments) {
  Scratch dir("bad");
  std::string output;
  EXPECT_NE(MkModel("--config " + ConfigFile("tiny-k3") + " --out " + dir.str() + " --dtype fp16", &output), 0);
  EXPECT_NE(output.find("--dtype must be bf16 or fp32"), std::string::npos) << output;
  WriteText(dir / "broken.json", "{\"hidden_size\": 8}");
  output.clear();
  EXPECT_NE(MkModel("--config " + (dir / "broken.json").string() + " --out " + dir.str(), &output), 0);
  EXPECT_NE(output.find("missing required key"), std::string::npos) << output;
  WriteModel(ConfigFile("tiny-k3"), dir.str());
  output.clear();  // a second model into the same directory would mix shards
  EXPECT_NE(MkModel("--config " + ConfigFile("tiny-k3") + " --out " + dir.str(), &output), 0);
  EXPECT_NE(output.find("already holds model.safetensors"), std::string::npos) << output;
}

// ---- Closed forms of the K3 switches ----

// A one-file fp32 checkpoint's tensors, by name, to edit and write back.
std::map<std::string, TensorBlob> ReadTensors(const fs::path& file) {
  std::map<std::string, TensorBlob> blobs;
  auto ck = Checkpoint::OpenFile(file.string());
  EXPECT_TRUE(ck.ok()) << ck.status();
  if (!ck.ok()) return blobs;
  for (const auto& [name, t] : ck->tensors())
    blobs[name] = {name, t.dtype, t.shape, std::vector<std::byte>(t.data, t.data + t.nbytes)};
  return blobs;
}

void WriteCheckpoint(const fs::path& dir, const json& config, const std::map<std::string, TensorBlob>& blobs) {
  fs::create_directories(dir);
  WriteText(dir / "config.json", config.dump(1));
  std::vector<TensorBlob> list;
  for (const auto& [name, b] : blobs) list.push_back(b);
  ASSERT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), list).ok());
}

void Scale(TensorBlob& b, float s) {
  ASSERT_EQ(b.dtype, DType::kF32);
  for (size_t i = 0; i < b.bytes.size(); i += 4) {
    float v;
    std::memcpy(&v, b.bytes.data() + i, 4);
    v *= s;
    std::memcpy(b.bytes.data() + i, &v, 4);
  }
}

TensorBlob Identity(const std::string& name, int64_t n) {
  TensorBlob b{name, DType::kF32, {n, n}, std::vector<std::byte>(n * n * 4)};
  const float one = 1.0f;
  for (int64_t i = 0; i < n; ++i) std::memcpy(b.bytes.data() + (i * n + i) * 4, &one, 4);
  return b;
}

// The Kimi-Linear golden model with every K3 switch written out in its "off" position, in the
// released layout (nested under text_config), computes exactly what the plain config computes:
// Block AttnRes off is the plain residual stream, not an approximation of it.
TEST(K3Switches, AllOffIsTheKimiLinearPathBitForBit) {
  Scratch dir("off");
  json text = json::parse(ReadText(DataDir("tiny-kimi-linear") + "/config.json"));
  text["attn_res_block_size"] = 0;
  text["mla_use_output_gate"] = false;
  text["mla_use_nope"] = true;
  text["latent_moe_use_norm"] = false;
  text["moe_layer_freq"] = 1;
  text["linear_attn_config"]["gate_lower_bound"] = nullptr;
  text["linear_attn_config"]["use_full_rank_gate"] = false;
  WriteText(dir / "config.json", json{{"model_type", "kimi_k3"}, {"text_config", text}}.dump(1));
  fs::copy_file(DataDir("tiny-kimi-linear") + "/model.safetensors", dir / "model.safetensors");
  auto plain = Load(DataDir("tiny-kimi-linear")), off = Load(dir.str());
  ASSERT_TRUE(plain && off);
  EXPECT_EQ(off->config().attn_res_block, 0);
  const auto ids = Ids(40, 5, plain->config().vocab_size);
  EXPECT_EQ(Logits(*off, ids, 30), Logits(*plain, ids, 30));
}

// The AttnRes tensors exist exactly when the switch is on: "off" never ignores weights silently.
TEST(K3Switches, AttnResTensorsFollowTheSwitch) {
  Scratch off("res_off"), on("res_on");
  json k3 = json::parse(ReadText(DataDir("tiny-k3") + "/config.json"));
  k3["attn_res_block_size"] = 0;
  WriteText(off / "config.json", k3.dump(1));
  fs::copy_file(DataDir("tiny-k3") + "/model.safetensors", off / "model.safetensors");
  auto m = Model::Load(off.str());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("unexpected tensor"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find("res_"), std::string::npos) << m.status();

  json kl = json::parse(ReadText(DataDir("tiny-kimi-linear") + "/config.json"));
  kl["attn_res_block_size"] = 2;
  WriteText(on / "config.json", kl.dump(1));
  fs::copy_file(DataDir("tiny-kimi-linear") + "/model.safetensors", on / "model.safetensors");
  m = Model::Load(on.str());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("missing tensor \"model.output_attn_res_proj.weight\""), std::string::npos)
      << m.status();
}

// SiTU-GLU near 0 is SwiGLU: with the gate and up projections of the dense MLP, the shared and the
// routed experts scaled by ε (and the down projections by 1/ε², so the MLPs' outputs keep their
// size), the SiTU model's logits equal the SwiGLU model's. At ε = 1 they differ: the switch is live.
TEST(K3Switches, SituNearZeroIsSwiglu) {
  Scratch base("situ_base"), situ("situ"), silu("silu");
  WriteModel(ConfigFile("tiny-k3"), base.str());
  const json situ_config = json::parse(ReadText(ConfigFile("tiny-k3")));
  json silu_config = situ_config;
  silu_config["hidden_act"] = "silu";
  silu_config.erase("activation_situ_beta");
  silu_config.erase("activation_situ_linear_beta");
  auto logits_at = [&](float eps) {
    auto blobs = ReadTensors(base / "model.safetensors");
    for (auto& [name, b] : blobs) {
      for (const char* in : {names::kDenseGate, names::kDenseUp, names::kSharedGate, names::kSharedUp, names::kExpertW1,
                             names::kExpertW3})
        if (name.ends_with(in)) Scale(b, eps);
      for (const char* out : {names::kDenseDown, names::kSharedDown, names::kExpertW2})
        if (name.ends_with(out)) Scale(b, 1.0f / (eps * eps));
    }
    fs::remove_all(situ.str());
    fs::remove_all(silu.str());
    WriteCheckpoint(situ.str(), situ_config, blobs);
    WriteCheckpoint(silu.str(), silu_config, blobs);
    auto a = Load(situ.str()), b = Load(silu.str());
    const auto ids = Ids(30, 9, situ_config["vocab_size"].get<int64_t>());
    return std::pair{Logits(*a, ids, 30), Logits(*b, ids, 30)};
  };
  const auto [situ_small, silu_small] = logits_at(1e-3f);
  EXPECT_LT(RelDiff(situ_small, silu_small), 1e-5);
  const auto [situ_one, silu_one] = logits_at(1.0f);
  EXPECT_GT(RelDiff(situ_one, silu_one), 1e-2);
}

// Stable LatentMoE with ℓ = d, identity down and up projections and the norm off is the plain MoE:
// same experts, same router, same logits.
TEST(K3Switches, LatentMoeWithIdentityProjectionsIsThePlainMoe) {
  Scratch configs("moe_configs"), plain("moe_plain"), latent("moe_latent");
  json config = json::parse(ReadText(ConfigFile("tiny-k3")));
  config.erase("routed_expert_hidden_size");
  config.erase("latent_moe_use_norm");
  WriteText(configs / "plain.json", config.dump(1));
  WriteModel((configs / "plain.json").string(), plain.str());

  const int64_t d = config["hidden_size"].get<int64_t>();
  config["routed_expert_hidden_size"] = d;
  config["latent_moe_use_norm"] = false;
  auto blobs = ReadTensors(plain / "model.safetensors");
  auto parsed = ParseModelConfig(config.dump());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  for (int64_t l = 0; l < parsed->num_layers; ++l) {
    if (parsed->mlp[l] != Mlp::kMoe) continue;
    for (const char* p : {names::kLatentDown, names::kLatentUp}) blobs[names::Layer(l, p)] = Identity(names::Layer(l, p), d);
  }
  WriteCheckpoint(latent.str(), config, blobs);
  auto a = Load(plain.str()), b = Load(latent.str());
  ASSERT_TRUE(a && b);
  EXPECT_EQ(b->config().latent_dim, d);
  const auto ids = Ids(40, 11, config["vocab_size"].get<int64_t>());
  EXPECT_EQ(Logits(*b, ids, 30), Logits(*a, ids, 30));
}

}  // namespace
}  // namespace k3

// k3serve-mkmodel: a random checkpoint in the hub format for any Kimi-Linear or Kimi K3 config.
//   k3serve-mkmodel --config FILE --out DIR --seed N [--dtype bf16|fp32] [--shard-bytes B]
//                   [--experts-dtype bf16|fp32|mxfp4] [--layout hub|k3-release]
// --experts-dtype mxfp4 quantizes the routed experts' random weights as the OCP MX spec does and
// adds the released quantization_config; --layout k3-release writes the released Kimi K3's layout
// (config under text_config, tensors under language_model., the small fp32 tensors, a vision tower
// and projector stub that a text server skips).
// The tensor list is the loader's own (ExpectedTensors), so what this writes loads. Each tensor's
// values depend only on the seed and its name. The headers are written first (every shape is known
// up front) and the data is generated and written in chunks, so a multi-GB model never sits in
// memory; above --shard-bytes (4 GiB) the checkpoint is sharded with a model.safetensors.index.json.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "common/bf16.h"
#include "common/flags.h"
#include "common/safetensors.h"
#include "engine/weights.h"
#include "kernels/cpu/mxfp4.h"

ABSL_FLAG(std::string, config, "", "config.json to write a model for (flat, or nested under text_config)");
ABSL_FLAG(std::string, out, "", "output model directory");
ABSL_FLAG(uint64_t, seed, 0, "random seed");
ABSL_FLAG(std::string, dtype, "bf16", "bf16 or fp32");
ABSL_FLAG(uint64_t, shard_bytes, uint64_t{4} << 30, "largest file before the checkpoint is split into shards");
ABSL_FLAG(std::string, router_skew, "",
          "zipf:S: the router's correction bias makes expert popularity follow a Zipf law of exponent S "
          "(a random order of the experts per layer), for load-balancing tests");
ABSL_FLAG(std::string, experts_dtype, "",
          "routed experts: bf16, fp32 or mxfp4 (default: mxfp4 if the config has a quantization_config, else --dtype)");
ABSL_FLAG(std::string, layout, "hub", "hub, or k3-release (the released Kimi K3's tensor names and config)");

namespace k3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int64_t kChunk = int64_t{1} << 20;  // values generated and written at a time

// The released Kimi K3's quantization_config (its config.json, text_config.quantization_config).
constexpr const char* kReleaseQuantization = R"({
  "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "input_activations": null,
    "output_activations": null, "targets": ["Linear"],
    "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 32, "num_bits": 4,
      "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
      "symmetric": true, "type": "float", "zp_dtype": null}}},
  "format": "mxfp4-pack-quantized", "global_compression_ratio": null,
  "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
    "re:.*vision_tower.*", "re:.*mm_projector.*"],
  "kv_cache_scheme": null, "quant_method": "compressed-tensors", "quantization_status": "compressed"})";

// How one tensor's values are drawn: U(lo, hi), then transformed.
struct Init {
  enum Kind { kUniform, kLog, kInverseSoftplusOfLogUniform } kind = kUniform;
  float lo = 0, hi = 0;

  float Apply(float u01) const {
    const float u = lo + (hi - lo) * u01;
    switch (kind) {
      case kUniform:
        return u;
      case kLog:
        return std::log(u);
      case kInverseSoftplusOfLogUniform: {  // fla's dt_bias: dt log-uniform, bias = softplus⁻¹(dt)
        const float dt = std::exp(u);
        return dt + std::log(-std::expm1(-dt));
      }
    }
    return u;
  }
};

Init Symmetric(double std_dev) {  // U(−a, a) has standard deviation a / √3
  const float a = static_cast<float>(std::sqrt(3.0) * std_dev);
  return {Init::kUniform, -a, a};
}

// Scales that keep activations O(1) through depth: projections y = W x with Var(W) = 1/fan_in,
// norms near 1, unit-variance embeddings; the KDA decay parameters as flash-linear-attention
// initialises them (A = U(1, 16), dt log-uniform in [1e-3, 0.1]), for the bounded gate (K3) dt_bias
// in [-2, 0] so that the decays spread over (0, 1). AttnRes pseudo-queries give logits of std 0.25
// (the paper starts them at 0, a uniform average): a random pseudo-query is nearly orthogonal to the
// sources, so a relative rounding error ε of a source moves its logit by up to |w|·√d·ε, and larger
// queries would make the model ill-conditioned (logits moved by rounding alone).
Init InitFor(const TensorSpec& t, const ModelConfig& c) {
  switch (t.role) {
    case TensorRole::kMxfp4Packed:  // drawn as the float matrix [out, in] that is then quantized
      return Symmetric(1.0 / std::sqrt(static_cast<double>(2 * t.shape.back())));
    case TensorRole::kMxfp4Scale:
      return Symmetric(1.0 / std::sqrt(static_cast<double>(cpu::kMxfp4Group * t.shape.back())));
    case TensorRole::kEmbedding:
      return Symmetric(1.0);
    case TensorRole::kLinear:
      return Symmetric(1.0 / std::sqrt(static_cast<double>(t.shape.back())));
    case TensorRole::kNorm:
      return {Init::kUniform, 0.9f, 1.1f};
    case TensorRole::kConv: {  // PyTorch's Conv1d default: U(±1/√fan_in), fan_in = kernel size
      const float a = 1.0f / std::sqrt(static_cast<float>(t.shape.back()));
      return {Init::kUniform, -a, a};
    }
    case TensorRole::kALog:
      return {Init::kLog, 1.0f, 16.0f};
    case TensorRole::kDtBias:
      if (c.kda_gate_bounded) return {Init::kUniform, -2.0f, 0.0f};
      return {Init::kInverseSoftplusOfLogUniform, std::log(1e-3f), std::log(0.1f)};
    case TensorRole::kRouterBias:
      return {Init::kUniform, -0.1f, 0.1f};
    case TensorRole::kAttnResQuery:
      return Symmetric(0.25 / std::sqrt(static_cast<double>(c.hidden_size)));
  }
  return {};
}

// splitmix64: a fast stream per tensor, seeded from the run's seed and the tensor's name.
class Rng {
 public:
  Rng(uint64_t seed, const std::string& name) : s_(seed * 0x9e3779b97f4a7c15ULL) {
    for (unsigned char ch : name) s_ = (s_ ^ ch) * 0x100000001b3ULL;  // FNV-1a over the name
  }
  float Uniform01() { return static_cast<float>(Next() >> 40) * 0x1.0p-24f; }

 private:
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  uint64_t s_;
};

int64_t Numel(const TensorSpec& t) {
  int64_t n = 1;
  for (int64_t s : t.shape) n *= s;
  return n;
}

// One tensor to write: its spec (shape as stored) and dtype.
struct Planned {
  TensorSpec spec;
  DType dtype;
  uint64_t bytes() const { return static_cast<uint64_t>(Numel(spec)) * DTypeSize(dtype); }
};

struct Shard {
  std::string file;
  std::vector<const Planned*> tensors;
  uint64_t bytes = 0;
};

// Consecutive tensors up to max_bytes per file (a larger tensor gets a file of its own).
std::vector<Shard> PlanShards(const std::vector<Planned>& specs, uint64_t max_bytes) {
  std::vector<Shard> shards(1);
  for (const Planned& t : specs) {
    const uint64_t b = t.bytes();
    if (!shards.back().tensors.empty() && shards.back().bytes + b > max_bytes) shards.emplace_back();
    shards.back().tensors.push_back(&t);
    shards.back().bytes += b;
  }
  if (shards.size() == 1) {
    shards[0].file = "model.safetensors";
  } else {
    for (size_t i = 0; i < shards.size(); ++i)
      shards[i].file = absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards.size());
  }
  return shards;
}

// --router-skew zipf:S: the bias of the expert of popularity rank r (1-based) is −S·τ·ln(r), so
// the top-k of s + b favours low ranks like a Zipf law of exponent S. τ = 0.05 against scores s
// that spread by ~0.2 (sigmoid of logits of std ~1): ranks 1 and 896 differ by 0.34·S, a strong
// skew, while the scores still decide among nearby ranks. Ranks are a seeded permutation per layer.
void SkewRouterBias(const TensorSpec& t, uint64_t seed, double S, float* values) {
  const int64_t E = t.shape.back();
  std::vector<int64_t> rank(E);
  std::iota(rank.begin(), rank.end(), 0);
  Rng rng(seed, t.value_name + "#skew");
  for (int64_t i = E - 1; i > 0; --i)
    std::swap(rank[i], rank[static_cast<int64_t>(rng.Uniform01() * static_cast<float>(i + 1)) % (i + 1)]);
  for (int64_t e = 0; e < E; ++e)
    values[e] = static_cast<float>(-S * 0.05 * std::log(static_cast<double>(rank[e] + 1)));
}

absl::Status WriteShard(const Shard& shard, const fs::path& path, const ModelConfig& c, uint64_t seed, double skew) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const Planned* t : shard.tensors) {
    const uint64_t b = t->bytes();
    header[t->spec.name] = {{"dtype", DTypeName(t->dtype)}, {"shape", t->spec.shape}, {"data_offsets", {offset, offset + b}}};
    offset += b;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keep tensor data 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path.string(), ": cannot open for writing"));
  const uint64_t header_len = h.size();
  out.write(reinterpret_cast<const char*>(&header_len), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));

  std::vector<float> values(kChunk);
  std::vector<uint16_t> half(kChunk);
  std::vector<uint8_t> packed(kChunk / 2), scale(kChunk / cpu::kMxfp4Group);
  for (const Planned* p : shard.tensors) {
    const TensorSpec* t = &p->spec;
    const DType dtype = p->dtype;
    const Init init = InitFor(*t, c);
    Rng rng(seed, t->value_name);
    // An MXFP4 half: the float matrix it quantizes is drawn (both halves draw the same values).
    const int64_t per_stored = t->role == TensorRole::kMxfp4Packed  ? 2
                               : t->role == TensorRole::kMxfp4Scale ? cpu::kMxfp4Group
                                                                    : 1;
    for (int64_t done = 0, n = Numel(*t) * per_stored; done < n;) {
      const int64_t len = std::min(kChunk, n - done);  // a multiple of 32: blocks never straddle chunks
      for (int64_t i = 0; i < len; ++i) values[i] = init.Apply(rng.Uniform01());
      if (skew > 0 && t->role == TensorRole::kRouterBias) SkewRouterBias(*t, seed, skew, values.data());
      if (per_stored > 1) {
        cpu::QuantizeMxfp4(values.data(), 1, len, packed.data(), scale.data());
        const auto& bytes = t->role == TensorRole::kMxfp4Packed ? packed : scale;
        out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(len / per_stored));
      } else if (dtype == DType::kBF16) {
        for (int64_t i = 0; i < len; ++i) half[i] = FloatToBf16(values[i]);
        out.write(reinterpret_cast<const char*>(half.data()), static_cast<std::streamsize>(len * 2));
      } else {
        out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(len * 4));
      }
      done += len;
    }
  }
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string config_path = absl::GetFlag(FLAGS_config), out_dir = absl::GetFlag(FLAGS_out);
  if (config_path.empty() || out_dir.empty()) return absl::InvalidArgumentError("--config and --out are required");
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  if (dtype_name != "bf16" && dtype_name != "fp32")
    return absl::InvalidArgumentError(absl::StrCat("--dtype must be bf16 or fp32, got \"", dtype_name, "\""));
  const DType dtype = dtype_name == "bf16" ? DType::kBF16 : DType::kF32;
  std::string experts_name = absl::GetFlag(FLAGS_experts_dtype);
  const std::string layout_name = absl::GetFlag(FLAGS_layout);
  if (layout_name != "hub" && layout_name != "k3-release")
    return absl::InvalidArgumentError(absl::StrCat("--layout must be hub or k3-release, got \"", layout_name, "\""));
  const names::Layout layout = layout_name == "hub" ? names::Layout::kHub : names::Layout::kK3Release;
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  double skew = 0;
  if (const std::string rs = absl::GetFlag(FLAGS_router_skew); !rs.empty()) {
    if (rs.rfind("zipf:", 0) != 0 || !absl::SimpleAtod(rs.substr(5), &skew) || !(skew > 0) || skew > 10)
      return absl::InvalidArgumentError(absl::StrCat("--router-skew must be zipf:S with 0 < S <= 10, got \"", rs, "\""));
  }

  std::ifstream in(config_path);
  if (!in) return absl::NotFoundError(absl::StrCat(config_path, ": cannot open"));
  std::stringstream text;
  text << in.rdbuf();
  std::string config_text = text.str();
  K3_ASSIGN_OR_RETURN(const ModelConfig given, ParseModelConfig(config_text, config_path));
  if (experts_name.empty()) experts_name = given.expert_format == ExpertFormat::kMxfp4 ? "mxfp4" : dtype_name;
  if (experts_name != "bf16" && experts_name != "fp32" && experts_name != "mxfp4")
    return absl::InvalidArgumentError(
        absl::StrCat("--experts-dtype must be bf16, fp32 or mxfp4, got \"", experts_name, "\""));

  // The config as written: with the release's quantization_config, and nested as released.
  json root = json::parse(config_text);
  const bool nested = root.contains("text_config");
  const bool has_quant = given.expert_format == ExpertFormat::kMxfp4;
  if (has_quant && experts_name != "mxfp4")
    return absl::InvalidArgumentError(absl::StrCat(config_path, " has a quantization_config: its experts are mxfp4"));
  const bool rewrite = (experts_name == "mxfp4" && !has_quant) || (layout == names::Layout::kK3Release && !nested);
  if (rewrite) {
    if (experts_name == "mxfp4" && !has_quant)
      (nested ? root["text_config"] : root)["quantization_config"] = json::parse(kReleaseQuantization);
    if (layout == names::Layout::kK3Release && !nested) {
      const json text = root;
      root = json{{"architectures", {"KimiK3ForConditionalGeneration"}},
                  {"model_type", "kimi_k3"},
                  {"text_config", text},
                  {"vision_config", {{"vt_hidden_size", 16}, {"text_hidden_size", text["hidden_size"]}}},
                  {"tie_word_embeddings", text.value("tie_word_embeddings", false)}};
    }
    config_text = root.dump(2) + "\n";
  }
  K3_ASSIGN_OR_RETURN(const ModelConfig c, ParseModelConfig(config_text, config_path));

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat(out_dir, ": cannot create: ", ec.message()));
  // Shards of an earlier model would be read together with the new ones.
  for (const auto& e : fs::directory_iterator(out_dir, ec))
    if (e.path().extension() == ".safetensors" || e.path().filename() == "model.safetensors.index.json")
      return absl::AlreadyExistsError(absl::StrCat(out_dir, " already holds ", e.path().filename().string(),
                                                   "; write into an empty directory"));
  const fs::path config_out = fs::path(out_dir) / "config.json";
  if (rewrite) {
    std::ofstream cfg(config_out, std::ios::trunc);
    cfg << config_text;
    cfg.close();
    if (!cfg) return absl::PermissionDeniedError(absl::StrCat(config_out.string(), ": cannot write"));
  } else if (!fs::equivalent(config_path, config_out, ec)) {
    fs::copy_file(config_path, config_out, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::PermissionDeniedError(absl::StrCat(config_out.string(), ": cannot write: ", ec.message()));
  }

  const std::vector<TensorSpec> specs = ExpectedTensors(c, nullptr, layout);
  const DType experts_dtype = experts_name == "bf16" ? DType::kBF16 : DType::kF32;
  std::vector<Planned> plan;
  for (const TensorSpec& t : specs) {
    DType d = t.expert >= 0 ? experts_dtype : dtype;
    if (t.role == TensorRole::kMxfp4Packed || t.role == TensorRole::kMxfp4Scale) d = DType::kU8;
    // The release keeps KDA's decay and conv parameters, its output norm and the router bias in fp32.
    const bool release_f32 = t.role == TensorRole::kConv || t.role == TensorRole::kALog ||
                             t.role == TensorRole::kDtBias || t.role == TensorRole::kRouterBias ||
                             t.name.ends_with(names::kKdaONorm);
    if (layout == names::Layout::kK3Release && release_f32) d = DType::kF32;
    plan.push_back({t, d});
    // The release's A_log is longer than the heads (128 entries for 96).
    if (t.at_least) plan.back().spec.shape = {std::max(t.shape[0], c.kda_head_dim)};
  }
  if (layout == names::Layout::kK3Release) {  // what a text server must skip
    for (const char* name : {"vision_tower.patch_embed.proj.weight", "mm_projector.proj.0.weight"}) {
      TensorSpec t;
      t.name = t.value_name = name;
      t.shape = {16, 8};
      plan.push_back({t, DType::kBF16});
    }
  }
  const std::vector<Shard> shards = PlanShards(plan, absl::GetFlag(FLAGS_shard_bytes));
  int64_t params = 0;
  uint64_t bytes = 0;
  json weight_map = json::object();
  for (const Shard& s : shards) {
    K3_RETURN_IF_ERROR(WriteShard(s, fs::path(out_dir) / s.file, c, seed, skew));
    for (const Planned* t : s.tensors) {
      params += Numel(t->spec) * (t->spec.role == TensorRole::kMxfp4Packed ? 2 : 1);
      weight_map[t->spec.name] = s.file;
    }
    bytes += s.bytes;
    if (shards.size() > 1) std::printf("wrote %s (%.2f GiB)\n", s.file.c_str(), s.bytes / 1073741824.0);
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", bytes}}}, {"weight_map", weight_map}};
    std::ofstream idx(fs::path(out_dir) / "model.safetensors.index.json", std::ios::trunc);
    idx << index.dump(2) << "\n";
    idx.close();
    if (!idx) return absl::DataLossError(absl::StrCat(out_dir, "/model.safetensors.index.json: write failed"));
  }
  std::printf("%s: %zu tensors, %lld parameters (%.3gB), %.3f GiB %s (experts %s, layout %s) in %zu file(s); "
              "layers %ld (KDA %d, MLA %d), experts %ld, seed %llu\n",
              out_dir.c_str(), plan.size(), static_cast<long long>(params), params / 1e9, bytes / 1073741824.0,
              dtype_name.c_str(), experts_name.c_str(), layout_name.c_str(), shards.size(),
              static_cast<long>(c.num_layers), c.num_kda_layers(), c.num_mla_layers(),
              static_cast<long>(c.num_experts), static_cast<unsigned long long>(seed));
  return absl::OkStatus();
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  if (const absl::Status s = k3::Run(); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

#include "engine/config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <regex>

#include <nlohmann/json.hpp>

#include "engine/tensor_names.h"

namespace k3 {
namespace {

using json = nlohmann::json;

// Keys that carry no meaning for inference here (bookkeeping, training-only, or derived and
// cross-checked below). Anything else that is not read is an error, so a config whose semantics
// we do not implement never loads silently.
const std::set<std::string> kIgnoredKeys = {
    "architectures", "auto_map", "model_type", "dtype", "torch_dtype", "transformers_version",
    "use_cache", "initializer_range", "attention_dropout", "pretraining_tp", "bos_token_id",
    "pad_token_id", "head_dim", "qk_head_dim", "linear_conv_kernel_dim", "linear_head_dim",
    "linear_num_heads", "rope_theta", "rope_scaling", "use_grouped_topk", "num_nextn_predict_layers",
    "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "layer_types", "mlp_layer_types", "router_aux_loss_coef", "aux_loss_alpha",
    "scoring_func", "topk_method", "norm_topk_prob", "n_routed_experts", "n_shared_experts", "n_group",
    "num_experts_per_tok", "num_local_experts", "moe_router_activation_func", "attention_bias",
    "mla_use_nope", "max_position_embeddings", "model_max_length", "eos_token_id",
    // transformers' PretrainedConfig defaults (generation and training bookkeeping) that a released
    // config.json serializes along with the model.
    "add_cross_attention", "bad_words_ids", "begin_suppress_tokens", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample", "early_stopping",
    "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id",
    "forced_eos_token_id", "id2label", "is_decoder", "is_encoder_decoder", "label2id", "length_penalty",
    "max_length", "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams", "num_return_sequences",
    "output_scores", "prefix", "problem_type", "pruned_heads", "remove_invalid_values", "repetition_penalty",
    "return_dict_in_generate", "sep_token_id", "suppress_tokens", "task_specific_params", "temperature",
    "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k", "top_p", "torchscript", "typical_p",
    "use_bfloat16",
};

class Reader {
 public:
  Reader(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  bool Has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }

  absl::StatusOr<int64_t> Int(const std::string& key) {
    used_.insert(key);
    if (!j_.contains(key)) return Missing(key);
    if (!j_[key].is_number_integer()) return Bad(key, "an integer");
    return j_[key].get<int64_t>();
  }
  absl::StatusOr<int64_t> PositiveInt(const std::string& key) {
    K3_ASSIGN_OR_RETURN(int64_t v, Int(key));
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat(where_, ": \"", key, "\" must be positive, got ", v));
    return v;
  }
  absl::StatusOr<int64_t> IntOr(const std::string& key, int64_t dflt) {
    used_.insert(key);
    if (!Has(key)) return dflt;
    return Int(key);
  }
  absl::StatusOr<double> Number(const std::string& key) {
    used_.insert(key);
    if (!j_.contains(key)) return Missing(key);
    if (!j_[key].is_number()) return Bad(key, "a number");
    return j_[key].get<double>();
  }
  absl::StatusOr<double> NumberOr(const std::string& key, double dflt) {
    used_.insert(key);
    if (!Has(key)) return dflt;
    return Number(key);
  }
  absl::StatusOr<bool> Bool(const std::string& key) {
    used_.insert(key);
    if (!j_.contains(key)) return Missing(key);
    if (!j_[key].is_boolean()) return Bad(key, "true or false");
    return j_[key].get<bool>();
  }
  absl::StatusOr<bool> BoolOr(const std::string& key, bool dflt) {
    used_.insert(key);
    if (!Has(key)) return dflt;
    return Bool(key);
  }
  absl::StatusOr<std::string> String(const std::string& key) {
    used_.insert(key);
    if (!j_.contains(key)) return Missing(key);
    if (!j_[key].is_string()) return Bad(key, "a string");
    return j_[key].get<std::string>();
  }
  absl::StatusOr<std::vector<int64_t>> IntList(const std::string& key) {
    used_.insert(key);
    if (!j_.contains(key)) return Missing(key);
    if (!j_[key].is_array()) return Bad(key, "a list of integers");
    std::vector<int64_t> out;
    for (const auto& v : j_[key]) {
      if (!v.is_number_integer()) return Bad(key, "a list of integers");
      out.push_back(v.get<int64_t>());
    }
    return out;
  }
  const json& Raw(const std::string& key) {
    used_.insert(key);
    return j_[key];
  }
  void Ignore(const std::string& key) { used_.insert(key); }

  // Every key must have been read or be known to be ignorable.
  absl::Status CheckNoUnknown(const std::set<std::string>& ignorable) const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (used_.count(it.key()) || ignorable.count(it.key())) continue;
      return absl::InvalidArgumentError(absl::StrCat(where_, ": unknown key \"", it.key(), "\""));
    }
    return absl::OkStatus();
  }

  const std::string& where() const { return where_; }

 private:
  absl::Status Missing(const std::string& key) const {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": missing required key \"", key, "\""));
  }
  absl::Status Bad(const std::string& key, const char* want) const {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": key \"", key, "\" must be ", want, ", got ", j_[key].dump()));
  }
  const json& j_;
  std::string where_;
  std::set<std::string> used_;
};

absl::Status Invalid(const std::string& where, const std::string& msg) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", msg));
}

// quantization_config: only compressed-tensors' MXFP4 of the routed experts (the released K3's)
// is supported; every other format, bit width, group size or scale type is an error naming it.
absl::Status ParseQuantization(const json& q, const std::string& where, ModelConfig& c) {
  if (!q.is_object()) return Invalid(where, "\"quantization_config\" is not an object");
  Reader r(q, where + " quantization_config");
  K3_ASSIGN_OR_RETURN(std::string method, r.String("quant_method"));
  if (method != "compressed-tensors")
    return Invalid(r.where(), "\"quant_method\" \"" + method + "\" is not supported (only \"compressed-tensors\")");
  K3_ASSIGN_OR_RETURN(std::string format, r.String("format"));
  if (format != "mxfp4-pack-quantized")
    return Invalid(r.where(), "\"format\" \"" + format + "\" is not supported (only \"mxfp4-pack-quantized\")");
  if (r.Has("quantization_status")) {
    K3_ASSIGN_OR_RETURN(std::string status, r.String("quantization_status"));
    if (status != "compressed")
      return Invalid(r.where(), "\"quantization_status\" must be \"compressed\", got \"" + status + "\"");
  } else {
    r.Ignore("quantization_status");
  }
  if (r.Has("kv_cache_scheme")) return Invalid(r.where(), "\"kv_cache_scheme\" is not supported (must be null)");
  r.Ignore("kv_cache_scheme");
  r.Ignore("global_compression_ratio");
  if (!r.Has("config_groups") || !r.Raw("config_groups").is_object() || r.Raw("config_groups").empty())
    return Invalid(r.where(), "\"config_groups\" must be a non-empty object");
  const json& groups = r.Raw("config_groups");
  for (auto it = groups.begin(); it != groups.end(); ++it) {
    const std::string gw = r.where() + " config_groups." + it.key();
    if (!it.value().is_object()) return Invalid(gw, "is not an object");
    Reader g(it.value(), gw);
    if (g.Has("format")) {
      K3_ASSIGN_OR_RETURN(std::string f, g.String("format"));
      if (f != format) return Invalid(gw, "\"format\" \"" + f + "\" is not supported (only \"mxfp4-pack-quantized\")");
    }
    g.Ignore("format");
    g.Ignore("targets");
    for (const char* k : {"input_activations", "output_activations"})
      if (g.Has(k)) {
        return Invalid(gw, absl::StrCat("\"", k, "\" (activation quantization) is not supported"));
      } else {
        g.Ignore(k);
      }
    if (!g.Has("weights") || !g.Raw("weights").is_object()) return Invalid(gw, "missing \"weights\" (an object)");
    Reader w(g.Raw("weights"), gw + " weights");
    K3_ASSIGN_OR_RETURN(int64_t bits, w.Int("num_bits"));
    if (bits != 4) return Invalid(w.where(), absl::StrCat("\"num_bits\" ", bits, " is not supported (MXFP4: 4)"));
    K3_ASSIGN_OR_RETURN(std::string type, w.String("type"));
    if (type != "float") return Invalid(w.where(), "\"type\" \"" + type + "\" is not supported (MXFP4: \"float\")");
    K3_ASSIGN_OR_RETURN(int64_t group, w.Int("group_size"));
    if (group != 32) return Invalid(w.where(), absl::StrCat("\"group_size\" ", group, " is not supported (MXFP4: 32)"));
    K3_ASSIGN_OR_RETURN(std::string strategy, w.String("strategy"));
    if (strategy != "group") return Invalid(w.where(), "\"strategy\" \"" + strategy + "\" is not supported (\"group\")");
    K3_ASSIGN_OR_RETURN(bool symmetric, w.BoolOr("symmetric", true));
    if (!symmetric) return Invalid(w.where(), "\"symmetric\": false is not supported");
    K3_ASSIGN_OR_RETURN(bool dynamic, w.BoolOr("dynamic", false));
    if (dynamic) return Invalid(w.where(), "\"dynamic\": true is not supported");
    if (w.Has("scale_dtype")) {
      K3_ASSIGN_OR_RETURN(std::string sd, w.String("scale_dtype"));
      if (sd != "torch.uint8") return Invalid(w.where(), "\"scale_dtype\" \"" + sd + "\" is not supported (E8M0: \"torch.uint8\")");
    }
    for (const char* k : {"scale_dtype", "actorder", "block_structure", "observer", "observer_kwargs", "zp_dtype"})
      w.Ignore(k);
    K3_RETURN_IF_ERROR(w.CheckNoUnknown({}));
    K3_RETURN_IF_ERROR(g.CheckNoUnknown({}));
  }
  // The routed experts must be what is quantized: an ignore pattern that matches them would mean a
  // float checkpoint that claims MXFP4.
  if (r.Has("ignore")) {
    const json& ignore = r.Raw("ignore");
    if (!ignore.is_array()) return Invalid(r.where(), "\"ignore\" must be a list of strings");
    const std::string expert = names::InLayout(names::Expert(1, 0, "w1"), names::Layout::kK3Release);
    for (const json& e : ignore) {
      if (!e.is_string()) return Invalid(r.where(), "\"ignore\" must be a list of strings");
      const std::string pat = e.get<std::string>();
      bool hit = pat == expert;
      if (pat.starts_with("re:")) {
        try {
          hit = std::regex_match(expert, std::regex(pat.substr(3)));
        } catch (const std::regex_error&) {
          return Invalid(r.where(), "\"ignore\" entry \"" + pat + "\" is not a valid regular expression");
        }
      }
      if (hit) return Invalid(r.where(), "\"ignore\" entry \"" + pat + "\" excludes the routed experts (" + expert + ")");
    }
  } else {
    r.Ignore("ignore");
  }
  K3_RETURN_IF_ERROR(r.CheckNoUnknown({}));
  c.expert_format = ExpertFormat::kMxfp4;
  return absl::OkStatus();
}

}  // namespace

int ModelConfig::num_kda_layers() const { return static_cast<int>(std::count(mixer.begin(), mixer.end(), Mixer::kKda)); }
int ModelConfig::num_mla_layers() const { return static_cast<int>(std::count(mixer.begin(), mixer.end(), Mixer::kMla)); }
bool ModelConfig::has_layer_kind(Mixer m) const { return std::find(mixer.begin(), mixer.end(), m) != mixer.end(); }

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Invalid(source, "not valid JSON");
  if (!root.is_object()) return Invalid(source, "top level is not a JSON object");
  std::string where = source;
  const json* text = &root;
  if (root.contains("text_config")) {  // released K3 layout: text model beside a vision tower
    if (!root["text_config"].is_object()) return Invalid(source, "\"text_config\" is not an object");
    text = &root["text_config"];
    where = source + " text_config";
  }
  Reader r(*text, where);
  ModelConfig c;

  K3_ASSIGN_OR_RETURN(c.vocab_size, r.PositiveInt("vocab_size"));
  K3_ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("hidden_size"));
  K3_ASSIGN_OR_RETURN(c.num_layers, r.PositiveInt("num_hidden_layers"));
  K3_ASSIGN_OR_RETURN(double eps, r.Number("rms_norm_eps"));
  if (!(eps > 0)) return Invalid(where, "\"rms_norm_eps\" must be positive");
  c.rms_norm_eps = static_cast<float>(eps);
  K3_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", false));
  K3_ASSIGN_OR_RETURN(c.max_position, r.IntOr("model_max_length", 0));
  if (c.max_position == 0) {
    K3_ASSIGN_OR_RETURN(c.max_position, r.IntOr("max_position_embeddings", 0));
  }
  if (r.Has("eos_token_id")) {
    const json& e = r.Raw("eos_token_id");
    if (e.is_number_integer()) {
      c.eos_token_ids.push_back(e.get<int64_t>());
    } else if (e.is_array()) {
      for (const auto& v : e) {
        if (!v.is_number_integer()) return Invalid(where, "\"eos_token_id\" must be an integer or a list of integers");
        c.eos_token_ids.push_back(v.get<int64_t>());
      }
    } else {
      return Invalid(where, "\"eos_token_id\" must be an integer or a list of integers");
    }
  }
  if (r.Has("attention_bias")) {
    K3_ASSIGN_OR_RETURN(bool bias, r.Bool("attention_bias"));
    if (bias) return Invalid(where, "\"attention_bias\": true is not supported (Kimi models have no attention bias)");
  }
  if (r.Has("mla_use_nope")) {
    K3_ASSIGN_OR_RETURN(bool nope, r.Bool("mla_use_nope"));
    if (!nope) return Invalid(where, "\"mla_use_nope\": false (rotary MLA) is not supported");
  }
  if (r.Has("moe_router_activation_func")) {
    K3_ASSIGN_OR_RETURN(std::string f, r.String("moe_router_activation_func"));
    if (f != "sigmoid") return Invalid(where, "\"moe_router_activation_func\" must be \"sigmoid\", got \"" + f + "\"");
  }

  // Activation.
  K3_ASSIGN_OR_RETURN(std::string act, r.String("hidden_act"));
  if (act == "silu" || act == "swish") {
    c.act = Activation::kSilu;
  } else if (act == "situ") {
    c.act = Activation::kSitu;
    K3_ASSIGN_OR_RETURN(double b1, r.Number("activation_situ_beta"));
    K3_ASSIGN_OR_RETURN(double b2, r.Number("activation_situ_linear_beta"));
    if (!(b1 > 0) || !(b2 > 0)) return Invalid(where, "SiTU betas must be positive");
    c.situ_beta = static_cast<float>(b1);
    c.situ_linear_beta = static_cast<float>(b2);
  } else {
    return Invalid(where, "\"hidden_act\" must be \"silu\" or \"situ\", got \"" + act + "\"");
  }

  // Layer plan: mixers from linear_attn_config (1-based lists).
  if (!r.Has("linear_attn_config") || !r.Raw("linear_attn_config").is_object())
    return Invalid(where, "missing required key \"linear_attn_config\" (an object)");
  Reader la(r.Raw("linear_attn_config"), where + " linear_attn_config");
  K3_ASSIGN_OR_RETURN(c.kda_heads, la.PositiveInt("num_heads"));
  K3_ASSIGN_OR_RETURN(c.kda_head_dim, la.PositiveInt("head_dim"));
  K3_ASSIGN_OR_RETURN(c.conv_kernel, la.PositiveInt("short_conv_kernel_size"));
  K3_ASSIGN_OR_RETURN(std::vector<int64_t> kda_layers, la.IntList("kda_layers"));
  K3_ASSIGN_OR_RETURN(std::vector<int64_t> full_layers, la.IntList("full_attn_layers"));
  if (la.Has("gate_lower_bound")) {
    K3_ASSIGN_OR_RETURN(double lb, la.Number("gate_lower_bound"));
    if (!(lb < 0)) return Invalid(la.where(), "\"gate_lower_bound\" must be negative");
    c.kda_gate_bounded = true;
    c.kda_gate_lower_bound = static_cast<float>(lb);
  } else {
    la.Ignore("gate_lower_bound");
  }
  K3_ASSIGN_OR_RETURN(c.kda_full_rank_gate, la.BoolOr("use_full_rank_gate", false));
  K3_RETURN_IF_ERROR(la.CheckNoUnknown({}));

  c.mixer.assign(c.num_layers, Mixer::kKda);
  std::vector<int> seen(c.num_layers, 0);
  for (auto [list, kind, key] : {std::tuple{&kda_layers, Mixer::kKda, "kda_layers"},
                                 std::tuple{&full_layers, Mixer::kMla, "full_attn_layers"}}) {
    for (int64_t l1 : *list) {
      if (l1 < 1 || l1 > c.num_layers)
        return Invalid(la.where(), absl::StrCat("\"", key, "\" names layer ", l1, " outside 1..", c.num_layers));
      c.mixer[l1 - 1] = kind;
      seen[l1 - 1]++;
    }
  }
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (seen[l] != 1)
      return Invalid(la.where(), absl::StrCat("layer ", l + 1, " must appear in exactly one of \"kda_layers\" and "
                                              "\"full_attn_layers\" (appears ", seen[l], " times)"));
  if (r.Has("layer_types")) {
    const json& lt = r.Raw("layer_types");
    if (!lt.is_array() || static_cast<int64_t>(lt.size()) != c.num_layers)
      return Invalid(where, "\"layer_types\" must list num_hidden_layers entries");
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string want = c.mixer[l] == Mixer::kKda ? "linear_attention" : "full_attention";
      if (!lt[l].is_string() || lt[l].get<std::string>() != want)
        return Invalid(where, absl::StrCat("\"layer_types\"[", l, "] disagrees with linear_attn_config (want \"", want, "\")"));
    }
  }

  // MLP plan: dense before first_k_dense_replace, then MoE every moe_layer_freq layers.
  K3_ASSIGN_OR_RETURN(int64_t first_dense, r.Int("first_k_dense_replace"));
  K3_ASSIGN_OR_RETURN(int64_t freq, r.IntOr("moe_layer_freq", 1));
  if (first_dense < 0 || freq < 1) return Invalid(where, "\"first_k_dense_replace\" must be >= 0 and \"moe_layer_freq\" >= 1");
  c.mlp.assign(c.num_layers, Mlp::kDense);
  for (int64_t l = 0; l < c.num_layers; ++l)
    c.mlp[l] = (l >= first_dense && l % freq == 0) ? Mlp::kMoe : Mlp::kDense;
  if (r.Has("mlp_layer_types")) {
    const json& mt = r.Raw("mlp_layer_types");
    if (!mt.is_array() || static_cast<int64_t>(mt.size()) != c.num_layers)
      return Invalid(where, "\"mlp_layer_types\" must list num_hidden_layers entries");
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string want = c.mlp[l] == Mlp::kMoe ? "sparse" : "dense";
      if (!mt[l].is_string() || mt[l].get<std::string>() != want)
        return Invalid(where, absl::StrCat("\"mlp_layer_types\"[", l, "] disagrees with first_k_dense_replace/moe_layer_freq (want \"", want, "\")"));
    }
  }
  const bool any_dense = std::count(c.mlp.begin(), c.mlp.end(), Mlp::kDense) > 0;
  const bool any_moe = std::count(c.mlp.begin(), c.mlp.end(), Mlp::kMoe) > 0;
  if (any_dense) {
    K3_ASSIGN_OR_RETURN(c.intermediate_size, r.PositiveInt("intermediate_size"));
  } else {
    r.Ignore("intermediate_size");
  }

  // MLA.
  if (c.has_layer_kind(Mixer::kMla)) {
    K3_ASSIGN_OR_RETURN(c.mla_heads, r.PositiveInt("num_attention_heads"));
    K3_ASSIGN_OR_RETURN(int64_t kv_heads, r.IntOr("num_key_value_heads", c.mla_heads));
    if (kv_heads != c.mla_heads)
      return Invalid(where, "\"num_key_value_heads\" must equal \"num_attention_heads\" (MLA expands keys per head)");
    K3_ASSIGN_OR_RETURN(c.q_lora_rank, r.IntOr("q_lora_rank", 0));
    if (c.q_lora_rank < 0) return Invalid(where, "\"q_lora_rank\" must be null or positive");
    K3_ASSIGN_OR_RETURN(c.kv_lora_rank, r.PositiveInt("kv_lora_rank"));
    K3_ASSIGN_OR_RETURN(c.qk_nope_dim, r.PositiveInt("qk_nope_head_dim"));
    K3_ASSIGN_OR_RETURN(c.qk_rope_dim, r.Int("qk_rope_head_dim"));
    if (c.qk_rope_dim < 0) return Invalid(where, "\"qk_rope_head_dim\" must be >= 0");
    K3_ASSIGN_OR_RETURN(c.v_head_dim, r.PositiveInt("v_head_dim"));
    K3_ASSIGN_OR_RETURN(c.mla_output_gate, r.BoolOr("mla_use_output_gate", false));
  } else {
    for (const char* k : {"num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                          "qk_rope_head_dim", "v_head_dim", "mla_use_output_gate"})
      r.Ignore(k);
  }

  // MoE.
  if (any_moe) {
    K3_ASSIGN_OR_RETURN(c.num_experts, r.PositiveInt("num_experts"));
    K3_ASSIGN_OR_RETURN(c.top_k, r.PositiveInt("num_experts_per_token"));
    K3_ASSIGN_OR_RETURN(c.num_shared_experts, r.Int("num_shared_experts"));
    K3_ASSIGN_OR_RETURN(c.moe_intermediate_size, r.PositiveInt("moe_intermediate_size"));
    K3_ASSIGN_OR_RETURN(double rsf, r.Number("routed_scaling_factor"));
    c.routed_scaling_factor = static_cast<float>(rsf);
    K3_ASSIGN_OR_RETURN(c.num_expert_group, r.IntOr("num_expert_group", 1));
    K3_ASSIGN_OR_RETURN(c.topk_group, r.IntOr("topk_group", c.num_expert_group));
    K3_ASSIGN_OR_RETURN(c.moe_renormalize, r.Bool("moe_renormalize"));
    if (c.num_shared_experts < 0) return Invalid(where, "\"num_shared_experts\" must be >= 0");
    if (c.top_k > c.num_experts) return Invalid(where, "\"num_experts_per_token\" exceeds \"num_experts\"");
    if (c.num_expert_group < 1 || c.num_experts % c.num_expert_group != 0)
      return Invalid(where, "\"num_expert_group\" must divide \"num_experts\"");
    if (c.topk_group < 1 || c.topk_group > c.num_expert_group)
      return Invalid(where, "\"topk_group\" must be in 1..num_expert_group");
    if (c.num_expert_group > 1 && c.num_experts / c.num_expert_group < 2)
      return Invalid(where, "group-limited routing needs at least 2 experts per group");
    if (c.top_k > c.topk_group * (c.num_experts / c.num_expert_group))
      return Invalid(where, "\"num_experts_per_token\" exceeds the experts in \"topk_group\" groups");
    if (r.Has("routed_expert_hidden_size")) {
      K3_ASSIGN_OR_RETURN(c.latent_dim, r.PositiveInt("routed_expert_hidden_size"));
      K3_ASSIGN_OR_RETURN(c.latent_norm, r.BoolOr("latent_moe_use_norm", false));
    } else {
      r.Ignore("routed_expert_hidden_size");
      K3_ASSIGN_OR_RETURN(bool norm, r.BoolOr("latent_moe_use_norm", false));
      if (norm) return Invalid(where, "\"latent_moe_use_norm\" needs \"routed_expert_hidden_size\"");
    }
  } else {
    for (const char* k : {"num_experts", "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
                          "routed_scaling_factor", "num_expert_group", "topk_group", "moe_renormalize",
                          "routed_expert_hidden_size", "latent_moe_use_norm"})
      r.Ignore(k);
  }

  // Quantized routed experts (in text_config as released, or at the top level).
  const json* quant = r.Has("quantization_config") ? &r.Raw("quantization_config")
                      : root.contains("quantization_config") && !root["quantization_config"].is_null()
                          ? &root["quantization_config"]
                          : nullptr;
  r.Ignore("quantization_config");
  if (quant != nullptr) {
    K3_RETURN_IF_ERROR(ParseQuantization(*quant, where, c));
    if (!any_moe) return Invalid(where, "\"quantization_config\" quantizes routed experts, but the model has none");
    for (int64_t w : {c.expert_width(), c.moe_intermediate_size})
      if (w % 32 != 0)
        return Invalid(where, absl::StrCat("MXFP4 experts need widths that are multiples of the group size 32 "
                                           "(routed_expert_hidden_size or hidden_size, moe_intermediate_size): ", w));
  }

  // Block AttnRes.
  K3_ASSIGN_OR_RETURN(c.attn_res_block, r.IntOr("attn_res_block_size", 0));
  if (c.attn_res_block < 0) return Invalid(where, "\"attn_res_block_size\" must be >= 0");

  if (c.act == Activation::kSilu) {
    r.Ignore("activation_situ_beta");
    r.Ignore("activation_situ_linear_beta");
  }
  K3_RETURN_IF_ERROR(r.CheckNoUnknown(kIgnoredKeys));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelConfig(ss.str(), path);
}

StateBytes SequenceStateBytes(const ModelConfig& c, int64_t bytes_per_value) {
  StateBytes b;
  const int64_t kda = c.kda_heads * c.kda_head_dim * c.kda_head_dim + (c.conv_kernel - 1) * c.kda_conv_channels();
  b.fixed = c.num_kda_layers() * kda * bytes_per_value;
  b.per_token = c.num_mla_layers() * c.mla_cache_width() * bytes_per_value;
  return b;
}

}  // namespace k3

#include "tools/golden.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/safetensors.h"

namespace k3 {
namespace {

// The tensor `name`, checked to hold `want`.
absl::StatusOr<const TensorInfo*> Find(const Checkpoint& ck, const std::string& name, DType want) {
  const TensorInfo* t = ck.Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("golden: missing tensor \"", name, "\""));
  if (t->dtype != want)
    return absl::InvalidArgumentError(absl::StrCat("golden: tensor \"", name, "\" has dtype ", DTypeName(t->dtype)));
  return t;
}

// Logits, element by element: the engine's scalar may be wider than the file's F32 (tools/fp64_check.sh).
absl::StatusOr<std::vector<float>> ReadLogits(const Checkpoint& ck, const std::string& name) {
  K3_ASSIGN_OR_RETURN(const TensorInfo* t, Find(ck, name, DType::kF32));
  std::vector<float> out(t->numel());
  for (size_t i = 0; i < out.size(); ++i) out[i] = LoadF32(t->data + 4 * i);
  return out;
}

absl::StatusOr<std::vector<int32_t>> ReadIds(const Checkpoint& ck, const std::string& name) {
  K3_ASSIGN_OR_RETURN(const TensorInfo* t, Find(ck, name, DType::kI64));
  std::vector<int32_t> ids(t->numel());
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t v;
    std::memcpy(&v, t->data + 8 * i, 8);
    ids[i] = static_cast<int32_t>(v);
  }
  return ids;
}

}  // namespace

absl::StatusOr<Golden> LoadGolden(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string jpath = (fs::path(dir) / "golden.json").string();
  std::ifstream in(jpath);
  if (!in) return absl::NotFoundError(jpath + ": cannot open");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.contains("split") || !j.contains("atol") || !j.contains("rtol"))
    return absl::InvalidArgumentError(jpath + ": needs \"split\", \"atol\" and \"rtol\"");
  K3_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::OpenFile((fs::path(dir) / "golden.safetensors").string()));
  Golden g;
  g.atol = j["atol"].get<double>();
  g.rtol = j["rtol"].get<double>();
  const auto& split = j["split"];
  for (size_t i = 0; i < split.size(); ++i) {
    const std::string p = absl::StrCat("prompt", i, ".");
    GoldenPrompt gp;
    gp.split = split[i].get<int64_t>();
    K3_ASSIGN_OR_RETURN(gp.input_ids, ReadIds(ck, p + "input_ids"));
    K3_ASSIGN_OR_RETURN(gp.greedy_ids, ReadIds(ck, p + "greedy_ids"));
    K3_ASSIGN_OR_RETURN(gp.prefill_logits, ReadLogits(ck, p + "prefill_logits"));
    const int64_t T = static_cast<int64_t>(gp.input_ids.size());
    if (T == 0 || gp.prefill_logits.size() % T != 0)
      return absl::InvalidArgumentError(absl::StrCat("golden: ", p, "prefill_logits does not have T rows"));
    g.vocab = static_cast<int64_t>(gp.prefill_logits.size()) / T;
    if (ck.Find(p + "incremental_logits") != nullptr) {
      K3_ASSIGN_OR_RETURN(gp.incremental_logits, ReadLogits(ck, p + "incremental_logits"));
    }
    g.prompts.push_back(std::move(gp));
  }
  return g;
}

}  // namespace k3

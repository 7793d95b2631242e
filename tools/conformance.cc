// k3serve-conformance: checks an engine against golden logits and greedy continuations.
//   k3serve-conformance --model DIR --golden DIR
// Exit 0 only if every prompt's prefill and incremental logits are within golden.json's tolerance
// and every greedy continuation matches exactly.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/flags.h"
#include "absl/flags/usage.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "tools/golden.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json + safetensors)");
ABSL_FLAG(std::string, golden, "", "golden directory (golden.json + golden.safetensors)");
ABSL_FLAG(std::string, dump, "", "if set, write each prompt's prefill logits as raw fp32 to DUMP/promptI.f32");

namespace k3 {
namespace {

struct Compare {
  double max_abs = 0;
  bool ok = true;
};

Compare CompareLogits(const float* got, const float* want, int64_t n, double atol, double rtol) {
  Compare c;
  for (int64_t i = 0; i < n; ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - want[i]);
    c.max_abs = std::max(c.max_abs, diff);
    if (!(diff <= atol + rtol * std::fabs(want[i]))) c.ok = false;  // NaN fails too
  }
  return c;
}

absl::StatusOr<bool> Run(const std::string& model_dir, const std::string& golden_dir) {
  K3_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Load(model_dir));
  K3_ASSIGN_OR_RETURN(Golden golden, LoadGolden(golden_dir));
  const ModelConfig& c = model->config();
  if (golden.vocab != c.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("golden vocab ", golden.vocab, " != model vocab ", c.vocab_size));
  LocalExpertExecutor experts(c, model->weights());
  const int64_t V = c.vocab_size;
  bool all_ok = true;
  std::printf("%-7s %5s %14s %17s %s\n", "prompt", "T", "prefill_maxabs", "incremental_maxabs", "greedy");
  for (size_t i = 0; i < golden.prompts.size(); ++i) {
    const GoldenPrompt& p = golden.prompts[i];
    const int64_t T = static_cast<int64_t>(p.input_ids.size());

    // Prefill: the whole prompt in one forward, logits for every position.
    SequenceState st(c);
    std::vector<float> logits;
    SeqChunk all{&st, p.input_ids, LogitsMode::kAll};
    K3_RETURN_IF_ERROR(model->Forward({&all, 1}, experts, &logits));
    if (!absl::GetFlag(FLAGS_dump).empty()) {
      const std::string path = absl::StrCat(absl::GetFlag(FLAGS_dump), "/prompt", i, ".f32");
      if (FILE* f = std::fopen(path.c_str(), "wb")) {
        std::fwrite(logits.data(), sizeof(float), logits.size(), f);
        std::fclose(f);
      }
    }
    const Compare pre = CompareLogits(logits.data(), p.prefill_logits.data(), T * V, golden.atol, golden.rtol);

    // Incremental: split tokens as a prefill, then one token per step through the state.
    std::string incr = "-";
    bool incr_ok = true;
    if (!p.incremental_logits.empty()) {
      SequenceState si(c);
      std::vector<float> rows, step;
      SeqChunk head{&si, std::span<const int32_t>(p.input_ids).first(p.split), LogitsMode::kAll};
      K3_RETURN_IF_ERROR(model->Forward({&head, 1}, experts, &rows));
      for (int64_t t = p.split; t < T; ++t) {
        SeqChunk one{&si, std::span<const int32_t>(p.input_ids).subspan(t, 1), LogitsMode::kLast};
        K3_RETURN_IF_ERROR(model->Forward({&one, 1}, experts, &step));
        rows.insert(rows.end(), step.begin(), step.end());
      }
      if (!absl::GetFlag(FLAGS_dump).empty()) {
        const std::string path = absl::StrCat(absl::GetFlag(FLAGS_dump), "/prompt", i, ".incr.f32");
        if (FILE* f = std::fopen(path.c_str(), "wb")) {
          std::fwrite(rows.data(), sizeof(float), rows.size(), f);
          std::fclose(f);
        }
      }
      const Compare inc = CompareLogits(rows.data(), p.incremental_logits.data(), T * V, golden.atol, golden.rtol);
      incr_ok = inc.ok;
      incr = absl::StrCat(inc.max_abs, inc.ok ? "" : " FAIL");
    }

    // Greedy continuation through the serving engine.
    K3_ASSIGN_OR_RETURN(std::vector<int32_t> ids, GenerateGreedy(*model, p.input_ids, static_cast<int>(p.greedy_ids.size())));
    int64_t match = 0;
    while (match < static_cast<int64_t>(ids.size()) && match < static_cast<int64_t>(p.greedy_ids.size()) &&
           ids[match] == p.greedy_ids[match])
      ++match;
    const bool greedy_ok = ids == p.greedy_ids;

    std::printf("%-7zu %5ld %14.3g%s %17s %s (%ld/%zu)\n", i, static_cast<long>(T), pre.max_abs, pre.ok ? "" : " FAIL",
                incr.c_str(), greedy_ok ? "match" : "MISMATCH", static_cast<long>(match), p.greedy_ids.size());
    all_ok = all_ok && pre.ok && incr_ok && greedy_ok;
  }
  std::printf("tolerance: atol %g rtol %g -> %s\n", golden.atol, golden.rtol, all_ok ? "PASS" : "FAIL");
  return all_ok;
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("k3serve-conformance --model DIR --golden DIR");
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  const std::string model = absl::GetFlag(FLAGS_model), golden = absl::GetFlag(FLAGS_golden);
  if (model.empty() || golden.empty()) {
    std::fprintf(stderr, "usage: k3serve-conformance --model DIR --golden DIR\n");
    return 2;
  }
  auto ok = k3::Run(model, golden);
  if (!ok.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(ok.status().message()).c_str());
    return 2;
  }
  return *ok ? 0 : 1;
}

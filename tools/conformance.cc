// k3serve-conformance: checks an engine against golden logits and greedy continuations.
//   k3serve-conformance --model DIR --golden DIR [--noise-floor]
// Exit 0 only if every greedy continuation matches exactly and every prompt's prefill and
// incremental logits are within golden.json's tolerance.
//
// --noise-floor measures how far this model's logits move when its inputs move by one unit in the
// last place (the embedding table, each value nudged up or down at random; 4 draws): the spread an
// fp32 computation cannot avoid, since every operation rounds at that level. Logits then also pass
// when their error is within twice that floor. A model whose floor exceeds the golden tolerance
// (an ill-conditioned random checkpoint) can be judged this way; a real discrepancy (one changed
// weight, a wrong formula) sits far above its floor.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/flags.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "tools/golden.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json + safetensors)");
ABSL_FLAG(std::string, golden, "", "golden directory (golden.json + golden.safetensors)");
ABSL_FLAG(std::string, dump, "", "if set, write each prompt's prefill logits as raw fp32 to DUMP/promptI.f32");
ABSL_FLAG(bool, noise_floor, false, "also accept logits within twice the model's measured fp32 noise floor");

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

// The model with its embedding table moved by one ulp per value, up or down at random.
absl::StatusOr<std::unique_ptr<Model>> Nudged(const Model& m, uint64_t seed) {
  K3_ASSIGN_OR_RETURN(auto w, LoadWeights(m.config(), m.weights().checkpoint));
  const int64_t n = w->embed.rows * w->embed.cols;
  auto buf = std::make_unique<float[]>(n);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < n; ++i) buf[i] = std::nextafter(w->embed.data[i], (rng() & 1) ? INFINITY : -INFINITY);
  w->embed.data = buf.get();
  w->owned.push_back(std::move(buf));
  return std::make_unique<Model>(m.config(), std::move(w));
}

absl::StatusOr<std::vector<float>> PrefillLogits(const Model& m, const std::vector<int32_t>& ids) {
  LocalExpertExecutor experts(m.config(), m.weights());
  SequenceState st(m.config());
  std::vector<float> logits;
  SeqChunk all{&st, ids, LogitsMode::kAll};
  K3_RETURN_IF_ERROR(m.Forward({&all, 1}, experts, &logits));
  return logits;
}

absl::StatusOr<bool> Run(const std::string& model_dir, const std::string& golden_dir) {
  K3_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Load(model_dir));
  K3_ASSIGN_OR_RETURN(Golden golden, LoadGolden(golden_dir));
  const ModelConfig& c = model->config();
  if (golden.vocab != c.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("golden vocab ", golden.vocab, " != model vocab ", c.vocab_size));
  LocalExpertExecutor experts(c, model->weights());
  const int64_t V = c.vocab_size;
  const bool noise = absl::GetFlag(FLAGS_noise_floor);
  std::vector<std::unique_ptr<Model>> nudged;
  for (uint64_t seed = 1; noise && seed <= 4; ++seed) {
    K3_ASSIGN_OR_RETURN(auto m, Nudged(*model, seed));
    nudged.push_back(std::move(m));
  }
  bool all_ok = true;
  std::printf("%-7s %5s %14s %17s %12s %s\n", "prompt", "T", "prefill_maxabs", "incremental_maxabs", "noise_floor", "greedy");
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
    double floor = 0;
    for (const auto& m : nudged) {
      K3_ASSIGN_OR_RETURN(std::vector<float> other, PrefillLogits(*m, p.input_ids));
      floor = std::max(floor, CompareLogits(other.data(), logits.data(), T * V, 0, 0).max_abs);
    }
    auto verdict = [&](const Compare& cmp) { return cmp.ok ? "" : (noise && cmp.max_abs <= 2 * floor) ? " (noise)" : " FAIL"; };

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
      incr_ok = inc.ok || (noise && inc.max_abs <= 2 * floor);
      incr = absl::StrFormat("%.3g%s", inc.max_abs, verdict(inc));
    }

    // Greedy continuation through the serving engine.
    K3_ASSIGN_OR_RETURN(std::vector<int32_t> ids, GenerateGreedy(*model, p.input_ids, static_cast<int>(p.greedy_ids.size())));
    int64_t match = 0;
    while (match < static_cast<int64_t>(ids.size()) && match < static_cast<int64_t>(p.greedy_ids.size()) &&
           ids[match] == p.greedy_ids[match])
      ++match;
    const bool greedy_ok = ids == p.greedy_ids;

    const bool pre_ok = pre.ok || (noise && pre.max_abs <= 2 * floor);
    std::printf("%-7zu %5ld %14s %17s %12s %s (%ld/%zu)\n", i, static_cast<long>(T),
                absl::StrFormat("%.3g%s", pre.max_abs, verdict(pre)).c_str(), incr.c_str(),
                noise ? absl::StrFormat("%.3g", floor).c_str() : "-", greedy_ok ? "match" : "MISMATCH",
                static_cast<long>(match), p.greedy_ids.size());
    all_ok = all_ok && pre_ok && incr_ok && greedy_ok;
  }
  std::printf("tolerance: atol %g rtol %g%s -> %s\n", golden.atol, golden.rtol,
              noise ? ", or within 2x the noise floor" : "", all_ok ? "PASS" : "FAIL");
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

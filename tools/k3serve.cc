// k3serve: the user's command line.
//   k3serve local-generate --model DIR --prompt-ids 1,2,3 --max-tokens N [--temperature T --top-k K --top-p P --seed S]
// runs the in-process engine (no services) and streams tokens with timing.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/flags.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/engine.h"

ABSL_FLAG(std::string, model, "", "model directory");
ABSL_FLAG(std::string, prompt_ids, "", "comma-separated prompt token ids");
ABSL_FLAG(int, max_tokens, 16, "tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "sampling temperature (0: greedy)");
ABSL_FLAG(int, top_k, 0, "top-k cut (0: off)");
ABSL_FLAG(double, top_p, 1.0, "nucleus cut (1: off)");
ABSL_FLAG(int64_t, seed, -1, "sampling seed (-1: random)");
ABSL_FLAG(bool, ignore_eos, false, "keep generating after an end-of-sequence token");

namespace k3 {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& s) {
  std::vector<int32_t> ids;
  for (const auto& part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int32_t v;
    if (!absl::SimpleAtoi(part, &v)) return absl::InvalidArgumentError(absl::StrCat("--prompt-ids: \"", part, "\" is not an integer"));
    ids.push_back(v);
  }
  return ids;
}

int LocalGenerate() {
  auto ids = ParseIds(absl::GetFlag(FLAGS_prompt_ids));
  if (!ids.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(ids.status().message()).c_str());
    return 2;
  }
  auto t_load = std::chrono::steady_clock::now();
  auto model = Model::Load(absl::GetFlag(FLAGS_model));
  if (!model.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(model.status().message()).c_str());
    return 2;
  }
  LocalExpertExecutor experts((*model)->config(), (*model)->weights());
  Engine engine(**model, experts);
  SamplingParams p;
  p.max_new_tokens = absl::GetFlag(FLAGS_max_tokens);
  p.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  p.top_k = absl::GetFlag(FLAGS_top_k);
  p.top_p = static_cast<float>(absl::GetFlag(FLAGS_top_p));
  p.has_seed = absl::GetFlag(FLAGS_seed) >= 0;
  p.seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  p.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  if (auto s = engine.Add(1, *ids, p); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  auto t0 = std::chrono::steady_clock::now();
  std::printf("loaded %s in %.0f ms\ntokens:", absl::GetFlag(FLAGS_model).c_str(),
              std::chrono::duration<double, std::milli>(t0 - t_load).count());
  std::chrono::steady_clock::time_point t_first;
  int n = 0;
  FinishReason finish = FinishReason::kNone;
  while (engine.HasWork()) {
    for (const StepOutput& o : engine.Step()) {
      for (int32_t t : o.tokens) {
        if (n++ == 0) t_first = std::chrono::steady_clock::now();
        std::printf(" %d", t);
        std::fflush(stdout);
      }
      if (o.finish == FinishReason::kError) {
        std::fprintf(stderr, "\nerror: %s\n", std::string(o.error.message()).c_str());
        return 1;
      }
      if (o.finish != FinishReason::kNone) finish = o.finish;
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  const double ttft = std::chrono::duration<double, std::milli>(t_first - t0).count();
  const double decode_s = std::chrono::duration<double>(t1 - t_first).count();
  std::printf("\nfinish: %s; %d tokens; time to first token %.2f ms; decode %.1f tokens/s\n", FinishReasonName(finish), n,
              ttft, n > 1 ? (n - 1) / decode_s : 0.0);
  return 0;
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "k3serve <command> [flags]\n"
      "  local-generate --model DIR --prompt-ids 1,2,3 --max-tokens N   generate with the in-process engine");
  k3::NormalizeFlagNames(argc, argv);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return 2;
  }
  const std::string cmd = args[1];
  if (cmd == "local-generate") return k3::LocalGenerate();
  std::fprintf(stderr, "unknown command \"%s\"\n%s\n", cmd.c_str(), absl::ProgramUsageMessage().data());
  return 2;
}

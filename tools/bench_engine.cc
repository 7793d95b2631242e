// k3serve-bench-engine: CPU engine throughput — prefill and decode tokens/s at several batch sizes.
//   k3serve-bench-engine [--model DIR] [--batches 1,8,32] [--prompt 128] [--decode 32] [--state-configs F,F]
// Also reports the per-sequence state of the --state-configs models, computed from their configs.
//   k3serve-bench-engine --plan tools/configs/kimi-k3.json [--plan-experts mxfp4,bf16] [--gpu-gib 139]
// prints a capacity plan instead: the bytes of each pool and the GPUs the expert pool needs.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/flags.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/capacity.h"
#include "engine/engine.h"

ABSL_FLAG(std::string, model, "tests/data/tiny-kimi-linear", "model directory");
ABSL_FLAG(std::string, batches, "1,8,32", "comma-separated batch sizes");
ABSL_FLAG(int, prompt, 128, "prompt tokens per sequence");
ABSL_FLAG(int, decode, 32, "decode steps to time");
ABSL_FLAG(std::string, state_configs, "tools/configs/kimi-k3.json,tools/configs/kimi-linear-48b.json",
          "comma-separated config.json files whose per-sequence state to report (empty: none)");

ABSL_FLAG(std::string, plan, "", "comma-separated config.json files: print their capacity plans and exit");
ABSL_FLAG(std::string, plan_experts, "mxfp4,bf16", "routed expert storage types to plan for (fp32, bf16, mxfp4)");
ABSL_FLAG(double, gpu_gib, 139.0, "memory of one GPU in GiB (an H200: 139)");
ABSL_FLAG(double, gpu_reserve_gib, 8.0, "GiB of each GPU kept for the CUDA context, workspaces and activations");

namespace k3 {
namespace {

using Clock = std::chrono::steady_clock;

// The state one sequence holds, from the config alone: the KDA recurrent state and the conv
// state (fp32, fixed size) and the MLA latent cache (per token; fp32 here, bf16 on the GPU path).
int ReportStateBytes() {
  for (const auto& part : absl::StrSplit(absl::GetFlag(FLAGS_state_configs), ',', absl::SkipEmpty())) {
    const std::string path(part);
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    const auto c = in ? ParseModelConfig(text.str(), path) : absl::NotFoundError(path + ": cannot open");
    if (!c.ok()) {
      std::fprintf(stderr, "error: --state-configs: %s\n", std::string(c.status().message()).c_str());
      return 2;
    }
    const StateBytes sb = SequenceStateBytes(*c);
    std::printf("state of %s (%ld layers: KDA %d, MLA %d): %.1f MiB fixed (KDA + conv, fp32) + %.1f KiB per token "
                "(MLA latent cache, fp32; %.1f KiB in bf16); %.2f GiB in fp32 at 128K tokens\n",
                path.c_str(), static_cast<long>(c->num_layers), c->num_kda_layers(), c->num_mla_layers(),
                sb.fixed / 1048576.0, sb.per_token / 1024.0, sb.per_token / 2048.0,
                (sb.fixed + 131072.0 * sb.per_token) / 1073741824.0);
  }
  return 0;
}

int Plan() {
  const double gpu = (absl::GetFlag(FLAGS_gpu_gib) - absl::GetFlag(FLAGS_gpu_reserve_gib)) * 1073741824.0;
  for (const auto& part : absl::StrSplit(absl::GetFlag(FLAGS_plan), ',', absl::SkipEmpty())) {
    const std::string path(part);
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    const auto c = in ? ParseModelConfig(text.str(), path) : absl::NotFoundError(path + ": cannot open");
    if (!c.ok()) {
      std::fprintf(stderr, "error: --plan: %s\n", std::string(c.status().message()).c_str());
      return 2;
    }
    std::printf("capacity plan of %s (%ld layers, %ld experts of %ld x %ld, top-%ld), GPUs of %.0f GiB less %.0f:\n",
                path.c_str(), static_cast<long>(c->num_layers), static_cast<long>(c->num_experts),
                static_cast<long>(c->moe_intermediate_size), static_cast<long>(c->expert_width()),
                static_cast<long>(c->top_k), absl::GetFlag(FLAGS_gpu_gib), absl::GetFlag(FLAGS_gpu_reserve_gib));
    for (const auto& t : absl::StrSplit(absl::GetFlag(FLAGS_plan_experts), ',', absl::SkipEmpty())) {
      const auto type = ParseWeightType(std::string(t));
      if (!type.ok()) {
        std::fprintf(stderr, "error: --plan-experts: %s\n", std::string(type.status().message()).c_str());
        return 2;
      }
      std::printf("%s", FormatPlan(PlanCapacity(*c, *type, gpu)).c_str());
    }
  }
  return 0;
}

int Run() {
  if (!absl::GetFlag(FLAGS_plan).empty()) return Plan();
  auto model = Model::Load(absl::GetFlag(FLAGS_model));
  if (!model.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(model.status().message()).c_str());
    return 2;
  }
  const ModelConfig& c = (*model)->config();
  LocalExpertExecutor experts(c, (*model)->weights());
  const int P = absl::GetFlag(FLAGS_prompt), D = absl::GetFlag(FLAGS_decode);
  std::printf("model %s: d=%ld layers=%ld (KDA %d, MLA %d) experts=%ld top-%ld vocab=%ld\n",
              absl::GetFlag(FLAGS_model).c_str(), (long)c.hidden_size, (long)c.num_layers, c.num_kda_layers(),
              c.num_mla_layers(), (long)c.num_experts, (long)c.top_k, (long)c.vocab_size);
  std::printf("%6s %8s %14s %14s %16s\n", "batch", "prompt", "prefill tok/s", "decode tok/s", "decode ms/step");
  for (const auto& part : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int B = 0;
    if (!absl::SimpleAtoi(part, &B) || B <= 0) {
      std::fprintf(stderr, "error: --batches: bad value \"%s\"\n", std::string(part).c_str());
      return 2;
    }
    EngineOptions opt;
    opt.max_batch_tokens = static_cast<int64_t>(B) * P;
    opt.max_running = B;
    CpuBackend backend(**model, experts);
    Engine engine(backend, opt);
    std::mt19937 rng(1);
    SamplingParams sp;
    sp.max_new_tokens = D + 1;
    sp.ignore_eos = true;
    for (int b = 0; b < B; ++b) {
      std::vector<int32_t> ids(P);
      for (auto& t : ids) t = static_cast<int32_t>(rng() % c.vocab_size);
      if (auto s = engine.Add(b, ids, sp); !s.ok()) {
        std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
        return 2;
      }
    }
    auto t0 = Clock::now();
    engine.Step();  // the whole prefill in one step; samples each sequence's first token
    auto t1 = Clock::now();
    int steps = 0;
    while (engine.HasWork()) {
      engine.Step();
      ++steps;
    }
    auto t2 = Clock::now();
    const double pre = std::chrono::duration<double>(t1 - t0).count(), dec = std::chrono::duration<double>(t2 - t1).count();
    std::printf("%6d %8d %14.0f %14.1f %16.2f\n", B, P, B * P / pre, B * static_cast<double>(steps) / dec, 1e3 * dec / steps);
  }
  const StateBytes sb = SequenceStateBytes(c);
  std::printf("per-sequence state (fp32): %.3f MiB fixed (KDA + conv) + %.1f KiB per token (MLA latent cache)\n",
              sb.fixed / 1048576.0, sb.per_token / 1024.0);
  return ReportStateBytes();
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return k3::Run();
}

// k3serve: the user's command line.
//   k3serve up --model DIR [--attention M --experts N --port 50051]   a local cluster until Ctrl-C
//   k3serve scale --orchestrator HOST:PORT [--attention M] [--experts N]   returns once reached
//   k3serve generate --addr HOST:PORT --prompt-ids 1,2,3 --max-tokens N [sampling flags]
//   k3serve bench --model DIR [--streams 16 --prompt-len 64 --max-tokens 64 --attention 1 --experts 2]
//   k3serve local-generate --model DIR --prompt-ids 1,2,3 --max-tokens N   the in-process engine
#include <unistd.h>

#include <chrono>
#include <optional>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/auth.h"
#include "common/tls.h"
#include "common/flags.h"
#include "common/signals.h"
#include "engine/engine.h"
#include "tools/bench_cluster.h"
#include "tools/client.h"
#include "tools/local_cluster.h"

ABSL_FLAG(std::string, model, "", "model directory");
ABSL_FLAG(std::string, addr, "127.0.0.1:50051", "attention node gRPC address (generate)");
ABSL_FLAG(std::string, prompt_ids, "", "comma-separated prompt token ids");
ABSL_FLAG(int, max_tokens, 16, "tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "sampling temperature (0: greedy)");
ABSL_FLAG(int, top_k, 0, "top-k cut (0: off)");
ABSL_FLAG(double, top_p, 1.0, "nucleus cut (1: off)");
ABSL_FLAG(int64_t, seed, -1, "sampling seed (-1: random)");
ABSL_FLAG(bool, ignore_eos, false, "keep generating after an end-of-sequence token");
ABSL_FLAG(double, timeout, 60.0, "request deadline in seconds (generate); how long scale waits");
ABSL_FLAG(int, attention, 1, "attention nodes (up, bench)");
ABSL_FLAG(int, experts, 2, "expert nodes (up, bench)");
ABSL_FLAG(int, port, 50051, "the gateway's gRPC port, the address to call (up; 0: pick)");
ABSL_FLAG(std::string, api_key, "", "generate: sent as authorization: Bearer (servers with --api-keys-file)");
ABSL_FLAG(bool, tls, false, "up: a throwaway CA and certificates; mTLS between the nodes, TLS on the public API");
ABSL_FLAG(std::string, orchestrator, "127.0.0.1:50070", "orchestrator admin address (scale)");
ABSL_FLAG(int, streams, 16, "concurrent streams (bench)");
ABSL_FLAG(std::string, data_plane, "shm", "expert nodes' data plane: shm or ucx (bench)");
ABSL_FLAG(int, repeats, 1, "in-process and disaggregated runs, alternating (bench)");
ABSL_FLAG(int, prompt_len, 64, "prompt tokens per stream (bench)");
ABSL_FLAG(bool, skew, false, "bench: let the router rebalance on measured load; per-layer and per-node load before and after");
ABSL_FLAG(bool, replicate_experts, true,
          "bench: every expert node holds every expert (router --redundancy = experts - 1; one node per decode "
          "dispatch); false: each expert on one node");
ABSL_FLAG(bool, ping_pong_adaptive, false, "bench: the attention nodes split steps only while that measures faster");

namespace k3 {
namespace {

int Error(const absl::Status& s) {
  std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
  return absl::IsInvalidArgument(s) ? 2 : 1;
}

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& s) {
  std::vector<int32_t> ids;
  for (const auto& part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int32_t v;
    if (!absl::SimpleAtoi(part, &v)) return absl::InvalidArgumentError(absl::StrCat("--prompt-ids: \"", part, "\" is not an integer"));
    ids.push_back(v);
  }
  return ids;
}

SamplingParams SamplingFromFlags() {
  SamplingParams p;
  p.max_new_tokens = absl::GetFlag(FLAGS_max_tokens);
  p.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  p.top_k = absl::GetFlag(FLAGS_top_k);
  p.top_p = static_cast<float>(absl::GetFlag(FLAGS_top_p));
  p.has_seed = absl::GetFlag(FLAGS_seed) >= 0;
  p.seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  p.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  return p;
}

std::string BinDir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  std::string exe(buf, n > 0 ? n : 0);
  return exe.substr(0, exe.rfind('/'));
}

int Up() {
  InstallShutdownSignals();
  ClusterOptions o;
  o.bin_dir = BinDir();
  o.model = absl::GetFlag(FLAGS_model);
  o.attention = absl::GetFlag(FLAGS_attention);
  o.experts = absl::GetFlag(FLAGS_experts);
  o.tls = absl::GetFlag(FLAGS_tls);
  o.orchestrated = true;  // the orchestrator's local backend spawns, drains and restarts the nodes
  o.gateway_port = absl::GetFlag(FLAGS_port);
  // The pools start at the sizes asked for and never go below them; the load may grow them.
  o.orchestrator_args = {"--interval=1", absl::StrCat("--attention-min=", o.attention), absl::StrCat("--experts-min=", o.experts)};
  if (o.model.empty()) return Error(absl::InvalidArgumentError("--model is required"));
  std::fprintf(stderr, "starting router, orchestrator (%d expert node(s), %d attention node(s)), gateway...\n", o.experts,
               o.attention);
  auto cluster = LocalCluster::Start(o);
  if (!cluster.ok()) return Error(cluster.status());
  const LocalCluster& c = **cluster;
  std::printf("gateway %s\n", c.gateway_address().c_str());
  std::printf("orchestrator %s\n", c.orchestrator_address().c_str());
  std::printf("router %s\n", c.router_address().c_str());
  std::printf("metrics gateway :%d, orchestrator :%d, router :%d\n", c.gateway_metrics_port(), c.orchestrator_metrics_port(),
              c.router_metrics_port());
  for (const std::string& a : c.attention_addresses()) std::printf("attention %s\n", a.c_str());
  std::printf("admin token %s (k3serve scale --admin-token-file)\n", c.admin_token_file().c_str());
  if (o.tls) std::printf("TLS CA %s\n", c.ca_file().c_str());
  std::printf("logs %s\nCtrl-C stops the cluster.\n", c.work_dir().c_str());
  std::fflush(stdout);
  while (!WaitForShutdown(absl::Seconds(1))) {
  }
  std::fprintf(stderr, "stopping...\n");
  cluster->reset();
  std::fprintf(stderr, "stopped\n");
  return 0;
}

// Flags named on the command line (scale sets only the pools it is given).
std::vector<std::string> g_given;

bool Given(const std::string& name) {
  for (const std::string& a : g_given)
    if (a == "--" + name || a.rfind("--" + name + "=", 0) == 0) return true;
  return false;
}

int Scale() {
  std::optional<int> attention, experts;
  if (Given("attention")) attention = absl::GetFlag(FLAGS_attention);
  if (Given("experts")) experts = absl::GetFlag(FLAGS_experts);
  if (!attention && !experts) return Error(absl::InvalidArgumentError("scale: give --attention N, --experts M, or both"));
  // The admin identity from --admin-token-file (and --tls-* for an mTLS orchestrator).
  if (auto s = auth::LoadFromFlags(); !s.ok()) return Error(s);
  if (auto s = tls::ChannelCredentialsFromFlags().status(); !s.ok()) return Error(s);
  const absl::Time start = absl::Now();
  auto pools = ScalePools(absl::GetFlag(FLAGS_orchestrator), attention, experts, absl::Seconds(absl::GetFlag(FLAGS_timeout)));
  if (!pools.ok()) return Error(pools.status());
  for (const auto& p : pools->pools())
    std::printf("%s %d/%d%s\n", p.pool().c_str(), p.actual(), p.desired(), p.manual() ? " (manual)" : "");
  std::printf("reached in %.1f s\n", absl::ToDoubleSeconds(absl::Now() - start));
  return 0;
}

int Generate() {
  auto ids = ParseIds(absl::GetFlag(FLAGS_prompt_ids));
  if (!ids.ok()) return Error(ids.status());
  // --tls-ca (and --tls-cert/--tls-key) make it a TLS client, e.g. of `k3serve up --tls`.
  if (auto creds = tls::ChannelCredentialsFromFlags(); !creds.ok()) return Error(creds.status());
  InferenceClient client(tls::NewChannel(absl::GetFlag(FLAGS_addr)), absl::GetFlag(FLAGS_api_key));
  const auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point first;
  int n = 0;
  std::printf("tokens:");
  auto result = client.Generate(*ids, SamplingFromFlags(), absl::Seconds(absl::GetFlag(FLAGS_timeout)),
                                [&](const std::vector<int32_t>& chunk) {
                                  for (int32_t t : chunk) {
                                    if (n++ == 0) first = std::chrono::steady_clock::now();
                                    std::printf(" %d", t);
                                  }
                                  std::fflush(stdout);
                                });
  std::printf("\n");
  if (!result.ok()) return Error(result.status());
  const auto t1 = std::chrono::steady_clock::now();
  std::printf("finish: %s; prompt %d, completion %d tokens; time to first token %.2f ms; %.1f tokens/s\n",
              result->finish_reason.c_str(), result->prompt_tokens, result->completion_tokens,
              std::chrono::duration<double, std::milli>(first - t0).count(),
              n > 1 ? (n - 1) / std::chrono::duration<double>(t1 - first).count() : 0.0);
  return 0;
}

int LocalGenerate() {
  auto ids = ParseIds(absl::GetFlag(FLAGS_prompt_ids));
  if (!ids.ok()) return Error(ids.status());
  auto model = Model::Load(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Error(model.status());
  LocalExpertExecutor experts((*model)->config(), (*model)->weights());
  CpuBackend backend(**model, experts);
  Engine engine(backend);
  if (auto s = engine.Add(1, *ids, SamplingFromFlags()); !s.ok()) return Error(s);
  const auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point first;
  int n = 0;
  FinishReason finish = FinishReason::kNone;
  std::printf("tokens:");
  while (engine.HasWork())
    for (const StepOutput& o : engine.Step()) {
      for (int32_t t : o.tokens) {
        if (n++ == 0) first = std::chrono::steady_clock::now();
        std::printf(" %d", t);
      }
      std::fflush(stdout);
      if (o.finish == FinishReason::kError) return Error(o.error);
      if (o.finish != FinishReason::kNone) finish = o.finish;
    }
  const auto t1 = std::chrono::steady_clock::now();
  std::printf("\nfinish: %s; %d tokens; time to first token %.2f ms; %.1f tokens/s\n", FinishReasonName(finish), n,
              std::chrono::duration<double, std::milli>(first - t0).count(),
              n > 1 ? (n - 1) / std::chrono::duration<double>(t1 - first).count() : 0.0);
  return 0;
}

int Bench() {
  BenchOptions o;
  o.bin_dir = BinDir();
  o.model = absl::GetFlag(FLAGS_model);
  o.streams = absl::GetFlag(FLAGS_streams);
  o.prompt_len = absl::GetFlag(FLAGS_prompt_len);
  o.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  o.attention = absl::GetFlag(FLAGS_attention);
  o.experts = absl::GetFlag(FLAGS_experts);
  o.data_plane = absl::GetFlag(FLAGS_data_plane);
  o.repeats = absl::GetFlag(FLAGS_repeats);
  o.skew = absl::GetFlag(FLAGS_skew);
  o.replicate_experts = absl::GetFlag(FLAGS_replicate_experts);
  o.ping_pong_adaptive = absl::GetFlag(FLAGS_ping_pong_adaptive);
  if (o.model.empty()) return Error(absl::InvalidArgumentError("--model is required"));
  const absl::Status s = RunClusterBench(o);
  return s.ok() ? 0 : Error(s);
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "k3serve <command> [flags]\n"
      "  up --model DIR [--attention M --experts N --port 50051 --tls] start a local cluster; Ctrl-C stops it\n"
      "  scale --orchestrator HOST:PORT [--attention M] [--experts N] [--timeout S]   returns once reached\n"
      "  generate --addr HOST:PORT --prompt-ids 1,2,3 --max-tokens N  stream tokens from a server\n"
      "  bench --model DIR [--streams 16 --prompt-len 64 --max-tokens 64 --attention 1 --experts 2 --data-plane shm --repeats 1 --skew --replicate-experts=false --ping-pong-adaptive]\n"
      "  local-generate --model DIR --prompt-ids 1,2,3 --max-tokens N  the in-process engine, no services\n"
      "sampling flags: --temperature T --top-k K --top-p P --seed S --ignore-eos");
  k3::NormalizeFlagNames(argc, argv);
  k3::g_given.assign(argv + 1, argv + argc);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string cmd = args.size() >= 2 ? args[1] : "";
  if (cmd == "up") return k3::Up();
  if (cmd == "generate") return k3::Generate();
  if (cmd == "scale") return k3::Scale();
  if (cmd == "bench") return k3::Bench();
  if (cmd == "local-generate") return k3::LocalGenerate();
  std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
  return 2;
}

// k3serve-bench-e2e: decode throughput of the GPU engine — a batch of sequences decoding greedily after a
// prompt — next to the weight-streaming limit (the bytes of weights one decode step must read, over the
// device-to-device copy bandwidth measured in the same run) and next to Hugging Face transformers on the same
// checkpoint (the JSON that engine/cuda/anchors/hf_e2e_anchor.py writes).
//
//   k3serve-bench-e2e --model DIR [--batch 64] [--prompt 512] [--steps 32] [--anchor hf.json] [--json out.json]
//   k3serve-bench-e2e --config config.json [--seed 1] ...     (random weights drawn on the device)
//   k3serve-bench-e2e --config tools/configs/k3-mini.json --share-experts   (175 GB of experts in 59)
//   k3serve-bench-e2e --config tools/configs/k3-mini.json --experts-dtype mxfp4   (its 47 GB of MXFP4 experts whole)
// --profile adds the device time of each stage of a decode step. Decode is timed with overlapped steps
// (CudaModel::NextGreedy) and with the host in the loop (ForwardGreedy a step); --overlap=false: the latter alone.
// --disaggregated ipc then decodes the same prompts with attention and experts in two processes on this GPU
// (engine/cuda/ipc_experts.h: this binary again as the expert process) and compares tok/s and greedy ids.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "common/flags.h"
#include "engine/cuda/cuda_model.h"
#include "engine/cuda/ipc_experts.h"
#include "engine/config.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json + safetensors)");
ABSL_FLAG(std::string, config, "", "config.json for random weights on the device (instead of --model)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the random weights (--config)");
ABSL_FLAG(bool, share_experts, false,
          "every MoE layer uses the first one's routed experts (models larger than the GPU, e.g. k3-mini; see "
          "CudaModelOptions::share_routed_experts)");
ABSL_FLAG(std::string, experts_dtype, "",
          "mxfp4: the routed experts of --config in MXFP4 (as the released checkpoint stores them); the weight-streaming "
          "limit then counts their MXFP4 bytes");
ABSL_FLAG(bool, graphs, true, "decode steps as CUDA graphs (CudaModelOptions::cuda_graphs)");
ABSL_FLAG(bool, profile, false, "print the device time of each stage of a decode step");
ABSL_FLAG(int, batch, 64, "sequences decoding together");
ABSL_FLAG(int, prompt, 512, "prompt tokens per sequence");
ABSL_FLAG(int, warmup, 4, "decode steps before timing");
ABSL_FLAG(int, steps, 32, "decode steps timed");
ABSL_FLAG(bool, overlap, true,
          "time decode with the next step enqueued before the last one's ids reach the host (CudaModel::NextGreedy, "
          "as SGLang's and vLLM's overlap scheduling); the host-in-the-loop time (ForwardGreedy a step) is printed "
          "beside it");
ABSL_FLAG(int, prefill_tokens, 8192, "tokens per prefill forward");
ABSL_FLAG(std::string, anchor, "", "JSON from hf_e2e_anchor.py (optional)");
ABSL_FLAG(std::string, json, "", "write the results here (optional)");
ABSL_FLAG(std::string, disaggregated, "",
          "ipc: after the monolithic run, the same decode with the routed experts in a second process on this GPU "
          "(CUDA IPC buffers and events, a Unix socket for the frames): tok/s against the monolithic run's, greedy ids "
          "compared step by step, the time of each stage of a MoE dispatch");

namespace k3 {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kProfileSteps = 4;  // decode steps profiled after the timed ones (--profile)

#define CHECK_CUDA(expr)                                                                 \
  do {                                                                                   \
    const cudaError_t e_ = (expr);                                                       \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "error: %s: %s\n", #expr, cudaGetErrorString(e_));            \
      return -1.0;                                                                       \
    }                                                                                    \
  } while (0)

// Device-to-device copy of 1 GiB, bytes read + written per second (the convention of k3serve-bench-kernels).
double CopyBandwidth() {
  const size_t n = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, n));
  CHECK_CUDA(cudaMalloc(&b, n));
  cudaEvent_t t0, t1;
  CHECK_CUDA(cudaEventCreate(&t0));
  CHECK_CUDA(cudaEventCreate(&t1));
  for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
  const int reps = 10;
  CHECK_CUDA(cudaEventRecord(t0));
  for (int i = 0; i < reps; ++i) CHECK_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaEventRecord(t1));
  CHECK_CUDA(cudaEventSynchronize(t1));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
  cudaFree(a);
  cudaFree(b);
  return 2.0 * n * reps / (ms * 1e-3);
}

void Fail(const absl::Status& s) { std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str()); }

// The in-process experts behind the executor interface: the model runs as with remote experts (no CUDA graphs,
// no overlapped steps), which isolates what the second process adds from what losing the graphs costs.
class ForwardingExperts final : public cuda::CudaExpertExecutor {
 public:
  explicit ForwardingExperts(cuda::CudaExpertExecutor* inner) : inner_(inner) {}
  absl::Status Run(const cuda::CudaExpertRequest& r, float* out, cudaStream_t stream) override {
    return inner_->Run(r, out, stream);
  }

 private:
  cuda::CudaExpertExecutor* inner_;
};

using IdTrace = std::vector<std::vector<int32_t>>;  // greedy ids of every sequence, a step at a time

struct Monolithic {
  const ModelConfig* config = nullptr;
  std::string config_text;  // --config's text (random weights), or empty with model_dir
  std::string model_dir;
  cuda::CudaModelOptions options;
  const std::vector<std::vector<int32_t>>* prompts = nullptr;
  IdTrace ids;             // the prefill's, then one entry a decode step
  double ms_overlap = 0;   // overlapped steps with graphs
  double ms_sync = 0;      // host in the loop with graphs
  double ms_no_graphs = 0; // host in the loop, in-process experts behind the executor interface
};

constexpr int kSplitSteps = 8;  // decode steps timed stage by stage after the disaggregated run's timed ones

// One disaggregated run: the attention-only engine decodes the monolithic run's prompts and steps with the routed
// experts in a new expert process, then a few steps stage by stage.
struct IpcRun {
  double ms = 0, ms_timed = 0;
  std::map<int64_t, cuda::IpcStageStats> stats;
  IdTrace ids;
};

// Where each side waits for the other's event (IpcOptions).
struct IpcWaits {
  bool attention_host = true, expert_host = true;
  std::string Name() const {
    return std::string("attention waits on the ") + (attention_host ? "host" : "GPU") + ", experts on the " +
           (expert_host ? "host" : "GPU");
  }
};

absl::StatusOr<IpcRun> DecodeOverIpc(const Monolithic& mono, cuda::CudaModel& model, IpcWaits waits, int B, int W,
                                     int S) {
  IpcRun run;
  cuda::IpcModelSpec spec;
  spec.model_dir = mono.model_dir, spec.config_json = mono.config_text, spec.seed = absl::GetFlag(FLAGS_seed);
  spec.experts_mxfp4 = mono.config->expert_format == ExpertFormat::kMxfp4 && !mono.config_text.empty();
  spec.share_routed_experts = mono.options.share_routed_experts;
  cuda::IpcOptions io;
  io.max_rows = mono.options.max_batch_tokens;
  io.attention_host_waits = waits.attention_host, io.expert_host_waits = waits.expert_host;
  const auto t_start = Clock::now();
  K3_ASSIGN_OR_RETURN(auto experts, cuda::IpcRemoteExperts::Spawn(*mono.config, spec, io));
  std::printf("\n%s: %s up in %.1f s (its own copy of the model, same seed: the same experts)\n",
              waits.Name().c_str(), experts->peer().c_str(),
              std::chrono::duration<double>(Clock::now() - t_start).count());
  model.SetExpertExecutor(experts.get());
  const int P = static_cast<int>((*mono.prompts)[0].size());
  std::vector<int32_t> slots(B), next(B);
  for (int s = 0; s < B; ++s) {
    K3_ASSIGN_OR_RETURN(slots[s], model.AllocSlot());
  }
  const int per = std::max(1, static_cast<int>(mono.options.max_batch_tokens / P));
  for (int s0 = 0; s0 < B; s0 += per) {
    std::vector<cuda::GpuChunk> chunks;
    for (int s = s0; s < std::min(B, s0 + per); ++s) chunks.push_back({slots[s], (*mono.prompts)[s], LogitsMode::kLast});
    std::vector<int32_t> out;
    K3_RETURN_IF_ERROR(model.ForwardGreedy(chunks, &out));
    std::copy(out.begin(), out.end(), next.begin() + s0);
  }
  run.ids.push_back(next);
  auto step = [&]() -> absl::Status {
    std::vector<cuda::GpuChunk> chunks;
    for (int s = 0; s < B; ++s) chunks.push_back({slots[s], std::span<const int32_t>(&next[s], 1), LogitsMode::kLast});
    std::vector<int32_t> out;
    K3_RETURN_IF_ERROR(model.ForwardGreedy(chunks, &out));
    next = out;
    run.ids.push_back(out);
    return absl::OkStatus();
  };
  for (int i = 0; i < W; ++i) K3_RETURN_IF_ERROR(step());
  auto t0 = Clock::now();
  for (int i = 0; i < S; ++i) K3_RETURN_IF_ERROR(step());
  run.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / S;
  // Then a few steps with events around every stage, on both sides.
  const int split_steps = std::min(kSplitSteps, S);
  experts->SetTiming(true);
  t0 = Clock::now();
  for (int i = 0; i < split_steps; ++i) K3_RETURN_IF_ERROR(step());
  run.ms_timed = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / split_steps;
  K3_ASSIGN_OR_RETURN(run.stats, experts->TakeStats());
  model.SetExpertExecutor(nullptr);
  for (int32_t s : slots) K3_RETURN_IF_ERROR(model.FreeSlot(s));

  std::printf("one MoE dispatch by stage (µs, mean of %d steps; attention GPU and host here, expert GPU and host in "
              "the expert process; %.3f ms a step with the events on):\n", split_steps, run.ms_timed);
  std::printf("| layer | pack (attn GPU) | frame round trip (attn host) | sums wait (attn host) | expert compute (expert "
              "GPU) | rows ready → sums in (attn GPU) | that − compute | unpack (attn GPU) | frame → reply (expert "
              "host) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  cuda::IpcStageStats all;
  for (const auto& [layer, st] : run.stats) {
    const double n = std::max<int64_t>(1, st.dispatches) / 1e3;
    std::printf("| %ld | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", long(layer), st.pack_ms / n,
                st.round_trip_ms / n, st.sums_host_ms / n, st.expert_ms / n, st.wait_ms / n,
                (st.wait_ms - st.expert_ms) / n, st.unpack_ms / n, st.expert_host_ms / n);
    all.pack_ms += st.pack_ms / split_steps, all.wait_ms += st.wait_ms / split_steps;
    all.expert_ms += st.expert_ms / split_steps, all.unpack_ms += st.unpack_ms / split_steps;
  }
  std::printf("a step, all MoE layers: pack %.3f ms, expert compute %.3f ms, rows ready → sums in %.3f ms (%.3f ms "
              "more than the compute), unpack %.3f ms\n", all.pack_ms, all.expert_ms, all.wait_ms,
              all.wait_ms - all.expert_ms, all.unpack_ms);
  return run;
}

// Greedy ids against the monolithic run's same forwards: -1 when all equal, else the first that differs.
int64_t FirstDifference(const IdTrace& got, const IdTrace& want) {
  for (size_t i = 0; i < got.size(); ++i)
    if (i >= want.size() || got[i] != want[i]) return static_cast<int64_t>(i);
  return -1;
}

// The same prompts and decode steps as the monolithic run, with the routed experts in an expert process on this
// GPU (IpcRemoteExperts), waits on the hosts and on the GPU; prints the comparison. 1 when ids differ.
int RunDisaggregatedIpc(const Monolithic& mono, int B, int W, int S) {
  const int P = static_cast<int>((*mono.prompts)[0].size());
  std::printf("\ndisaggregated over CUDA IPC: an attention-only engine here, the routed experts in an expert process "
              "on the same GPU\n");
  // Without the MPS control daemon the two processes' contexts take turns on the GPU (time slices); with it their
  // kernels run side by side. Clients find the daemon through its pipe directory.
  const char* pipe_env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string pipe_dir = pipe_env != nullptr && *pipe_env != '\0' ? pipe_env : "/tmp/nvidia-mps";
  std::printf("MPS: %s\n", std::filesystem::exists(pipe_dir + "/control")
                               ? ("control daemon found at " + pipe_dir + ": both processes' kernels share the GPU at once").c_str()
                               : ("no control daemon at " + pipe_dir +
                                  " (nvidia-cuda-mps-control -d starts one): the two contexts take turns on the GPU").c_str());
  cuda::CudaModelOptions opt = mono.options;
  opt.routed_experts = false;
  auto loaded = mono.config_text.empty() ? cuda::CudaModel::Load(mono.model_dir, opt)
                                         : cuda::CudaModel::CreateRandom(*mono.config, absl::GetFlag(FLAGS_seed), opt);
  if (!loaded.ok()) return Fail(loaded.status()), 1;
  // The default (both waits on the hosts) first, then the other three.
  const IpcWaits modes[] = {{true, true}, {true, false}, {false, true}, {false, false}};
  std::vector<IpcRun> runs;
  for (const IpcWaits& w : modes) {
    auto run = DecodeOverIpc(mono, **loaded, w, B, W, S);
    if (!run.ok()) return Fail(run.status()), 1;
    runs.push_back(std::move(*run));
  }

  auto row = [&](const std::string& what, double m) {
    std::printf("| %s | %.0f | %.3f | %.2f |\n", what.c_str(), B / (m * 1e-3), m, mono.ms_overlap / m);
  };
  std::printf("\n| decode, batch %d after %d tokens, this run | tok/s | ms/step | tok/s / monolithic |\n"
              "|---|---:|---:|---:|\n", B, P);
  row("monolithic: overlapped steps, CUDA graphs", mono.ms_overlap);
  row("monolithic: host in the loop, CUDA graphs", mono.ms_sync);
  row("monolithic: host in the loop, no graphs (in-process experts behind the executor interface)", mono.ms_no_graphs);
  for (size_t i = 0; i < runs.size(); ++i)
    row("attention + expert processes over CUDA IPC (host in the loop, no graphs), " + modes[i].Name(), runs[i].ms);
  std::printf("\ndisaggregated (%s) / monolithic tok/s: %.3f (against the monolithic engine without graphs, host in "
              "the loop: %.3f)\n", modes[0].Name().c_str(), mono.ms_overlap / runs[0].ms,
              mono.ms_no_graphs / runs[0].ms);
  bool equal = true;
  for (size_t i = 0; i < runs.size(); ++i) {
    const int64_t d = FirstDifference(runs[i].ids, mono.ids);
    equal = equal && d < 0;
    if (d < 0)
      std::printf("greedy ids (%s) equal to the monolithic run's: yes (%zu forwards: the prefill, %d warm-up, %d "
                  "timed and %d staged decode steps; %d sequences each)\n", modes[i].Name().c_str(),
                  runs[i].ids.size(), W, S, std::min(kSplitSteps, S), B);
    else
      std::printf("greedy ids (%s) equal to the monolithic run's: NO (first difference at forward %ld of %zu)\n",
                  modes[i].Name().c_str(), long(d), runs[i].ids.size());
  }
  return equal ? 0 : 1;
}

int Run() {
  const std::string config_path = absl::GetFlag(FLAGS_config);
  const std::string dir = config_path.empty() ? absl::GetFlag(FLAGS_model) : config_path;
  const int B = absl::GetFlag(FLAGS_batch), P = absl::GetFlag(FLAGS_prompt), W = absl::GetFlag(FLAGS_warmup),
            S = absl::GetFlag(FLAGS_steps);
  if (dir.empty() || B <= 0 || P <= 0 || S <= 0 || W < 0) {
    std::fprintf(stderr, "usage: k3serve-bench-e2e --model DIR | --config FILE [--batch 64] [--prompt 512] [--steps 32]\n");
    return 2;
  }
  const std::string disaggregated = absl::GetFlag(FLAGS_disaggregated);
  if (!disaggregated.empty() && disaggregated != "ipc") {
    std::fprintf(stderr, "error: --disaggregated must be ipc, got \"%s\"\n", disaggregated.c_str());
    return 2;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const double bw = CopyBandwidth();
  if (bw <= 0) return 1;
  std::printf("device: %s; copy bandwidth %.0f GB/s (1 GiB device-to-device, read + write)\n", prop.name, bw * 1e-9);

  cuda::CudaModelOptions opt;
  opt.max_seqs = B;
  // The timed steps run twice (host in the loop, overlapped), then S more weigh the steps' bytes.
  opt.max_context = P + W + 3 * S + kProfileSteps + 2;
  if (!disaggregated.empty()) opt.max_context += S + 2;  // the steps without graphs
  opt.max_batch_tokens = std::max(P, absl::GetFlag(FLAGS_prefill_tokens));
  opt.share_routed_experts = absl::GetFlag(FLAGS_share_experts);
  opt.cuda_graphs = absl::GetFlag(FLAGS_graphs);
  const auto t_load = Clock::now();
  absl::StatusOr<std::unique_ptr<cuda::CudaModel>> loaded;
  std::string config_text;
  if (config_path.empty()) {
    loaded = cuda::CudaModel::Load(dir, opt);
  } else {
    std::ifstream in(config_path);
    std::stringstream text;
    text << in.rdbuf();
    config_text = text.str();
    auto config = ParseModelConfig(config_text, config_path);
    if (!config.ok()) return Fail(config.status()), 1;
    const std::string dtype = absl::GetFlag(FLAGS_experts_dtype);
    if (dtype == "mxfp4") {
      for (int64_t w : {config->expert_width(), config->moe_intermediate_size})
        if (w % 32 != 0) return Fail(absl::InvalidArgumentError("--experts-dtype mxfp4: expert widths must be multiples of 32")), 1;
      config->expert_format = ExpertFormat::kMxfp4;
    } else if (!dtype.empty() && dtype != "bf16") {
      return Fail(absl::InvalidArgumentError("--experts-dtype must be bf16 or mxfp4, got \"" + dtype + "\"")), 1;
    }
    loaded = cuda::CudaModel::CreateRandom(*config, absl::GetFlag(FLAGS_seed), opt);
  }
  if (!loaded.ok()) {
    Fail(loaded.status());
    return 1;
  }
  cuda::CudaModel& model = **loaded;
  const ModelConfig& c = model.config();
  std::printf("model %s: d %ld, %ld layers (KDA %d, MLA %d), %ld experts top-%ld of width %ld, vocab %ld; "
              "%.2f GB of weights%s%s (loaded in %.1f s)\n",
              dir.c_str(), long(c.hidden_size), long(c.num_layers), c.num_kda_layers(), c.num_mla_layers(),
              long(c.num_experts), long(c.top_k), long(c.moe_intermediate_size), long(c.vocab_size),
              model.weight_bytes() * 1e-9, c.expert_format == ExpertFormat::kMxfp4 ? ", routed experts in MXFP4" : "",
              opt.share_routed_experts ? " (MoE layers share one bank of experts)" : "",
              std::chrono::duration<double>(Clock::now() - t_load).count());

  // Prefill: random prompts, as many sequences per forward as the token budget takes.
  std::mt19937 rng(1);
  std::vector<int32_t> slots(B), next(B);
  IdTrace ids;  // the prefill's and every decode step's, for --disaggregated
  std::vector<std::vector<int32_t>> prompts(B, std::vector<int32_t>(P));
  for (auto& p : prompts)
    for (auto& t : p) t = static_cast<int32_t>(rng() % c.vocab_size);
  for (int s = 0; s < B; ++s) {
    auto slot = model.AllocSlot();
    if (!slot.ok()) return Fail(slot.status()), 1;
    slots[s] = *slot;
  }
  const int per = std::max(1, static_cast<int>(opt.max_batch_tokens / P));
  const auto t_prefill = Clock::now();
  for (int s0 = 0; s0 < B; s0 += per) {
    std::vector<cuda::GpuChunk> chunks;
    for (int s = s0; s < std::min(B, s0 + per); ++s) chunks.push_back({slots[s], prompts[s], LogitsMode::kLast});
    std::vector<int32_t> ids;
    if (auto st = model.ForwardGreedy(chunks, &ids); !st.ok()) return Fail(st), 1;
    std::copy(ids.begin(), ids.end(), next.begin() + s0);
  }
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t_prefill).count();
  ids.push_back(next);
  std::printf("prefill: %d × %d tokens in %.2f s (%.0f tok/s)\n", B, P, prefill_s, B * P / prefill_s);

  // Decode: every sequence one token per step, greedy.
  auto step = [&]() -> absl::Status {
    std::vector<cuda::GpuChunk> chunks;
    for (int s = 0; s < B; ++s) chunks.push_back({slots[s], std::span<const int32_t>(&next[s], 1), LogitsMode::kLast});
    std::vector<int32_t> ids;
    K3_RETURN_IF_ERROR(model.ForwardGreedy(chunks, &ids));
    std::copy(ids.begin(), ids.end(), next.begin());
    return absl::OkStatus();
  };
  const bool keep_ids = !disaggregated.empty();
  auto step_kept = [&]() -> absl::Status {
    K3_RETURN_IF_ERROR(step());
    if (keep_ids) ids.push_back(next);
    return absl::OkStatus();
  };
  for (int i = 0; i < W; ++i)
    if (auto st = step_kept(); !st.ok()) return Fail(st), 1;
  // Host in the loop: each step's ids come back before the next step is launched.
  auto t0 = Clock::now();
  for (int i = 0; i < S; ++i)
    if (auto st = step_kept(); !st.ok()) return Fail(st), 1;
  const double ms_sync = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / S;
  double ms = ms_sync;
  if (absl::GetFlag(FLAGS_overlap)) {
    // Overlapped: step i + 1 is enqueued before step i's ids are read (the last step() set up the chain).
    std::vector<int32_t> prev;
    t0 = Clock::now();
    cudaProfilerStart();  // the timed steps are the range an external profiler captures (nsys --capture-range)
    for (int i = 0; i < S; ++i) {
      if (auto st = model.NextGreedy(&prev); !st.ok()) return Fail(st), 1;
      if (keep_ids && i > 0) ids.push_back(prev);  // the first is the last host-in-the-loop step's
    }
    if (auto st = model.LastGreedy(&next); !st.ok()) return Fail(st), 1;
    if (keep_ids) ids.push_back(next);
    cudaProfilerStop();
    ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / S;
  }
  const double tok_s = B / (ms * 1e-3);
  if (absl::GetFlag(FLAGS_profile)) {
    model.SetProfiling(true);
    const int reps = kProfileSteps;
    for (int i = 0; i < reps; ++i)
      if (auto st = step(); !st.ok()) return Fail(st), 1;
    model.SetProfiling(false);
    std::printf("device time per decode step by stage (ms, mean of %d steps; all layers together):\n", reps);
    double total = 0;
    for (const auto& [name, t] : model.TakeProfile()) {
      std::printf("  %-12s %8.3f\n", name.c_str(), t / reps);
      total += t / reps;
    }
    std::printf("  %-12s %8.3f (host time per step %.3f)\n", "sum", total, ms);
  }
  // A step's bytes follow its routing (the experts it hits): the limit takes their mean over S more steps, which
  // continue the same sequences (one step's bytes move the limit by ±1%).
  double mean_bytes = 0, min_bytes = 0, max_bytes = 0;
  for (int i = 0; i < S; ++i) {
    if (auto st = step(); !st.ok()) return Fail(st), 1;
    auto bytes = model.LastForwardWeightBytes();
    if (!bytes.ok()) return Fail(bytes.status()), 1;
    const double b = static_cast<double>(*bytes);
    mean_bytes += b / S;
    min_bytes = i == 0 ? b : std::min(min_bytes, b);
    max_bytes = i == 0 ? b : std::max(max_bytes, b);
  }
  const double limit_ms = mean_bytes / bw * 1e3;
  std::printf("decode step: %.1f MB of weights to read (all but the embedding table, and the routed experts the "
              "step hit; mean of %d steps, %.1f–%.1f MB); streaming limit %.3f ms at the copy bandwidth\n",
              mean_bytes * 1e-6, S, min_bytes * 1e-6, max_bytes * 1e-6, limit_ms);

  // The anchor: HF transformers (+ flash-linear-attention) on the same checkpoint, same shapes.
  nlohmann::json anchor;
  if (const std::string path = absl::GetFlag(FLAGS_anchor); !path.empty()) {
    std::ifstream in(path);
    anchor = nlohmann::json::parse(in, nullptr, false);
    if (anchor.is_discarded()) std::fprintf(stderr, "warning: --anchor %s: not JSON\n", path.c_str());
  }
  auto hf = [&](const char* impl) -> double {
    if (!anchor.is_object() || !anchor.contains("results") || !anchor["results"].contains(impl)) return 0;
    return anchor["results"][impl].value("tok_s", 0.0);
  };
  const double hf_grouped = hf("grouped_mm"), hf_default = hf("eager");
  std::printf("\n| decode, batch %d after %d tokens | tok/s | ms/step | ours / this |\n|---|---:|---:|---:|\n", B, P);
  std::printf("| k3serve (this GPU engine%s) | %.0f | %.3f | 1.00 |\n",
              absl::GetFlag(FLAGS_overlap) ? ", overlapped steps" : "", tok_s, ms);
  if (absl::GetFlag(FLAGS_overlap))
    std::printf("| k3serve, host in the loop (ForwardGreedy a step) | %.0f | %.3f | %.2f |\n", B / (ms_sync * 1e-3),
                ms_sync, ms / ms_sync);
  if (hf_grouped > 0)
    std::printf("| HF transformers, grouped_mm experts | %.0f | %.3f | %.2f |\n", hf_grouped, B / hf_grouped * 1e3,
                tok_s / hf_grouped);
  if (hf_default > 0)
    std::printf("| HF transformers, default experts | %.0f | %.3f | %.2f |\n", hf_default, B / hf_default * 1e3,
                tok_s / hf_default);
  std::printf("| weight-streaming limit | %.0f | %.3f | %.2f |\n", B / (limit_ms * 1e-3), limit_ms, limit_ms / ms);
  std::printf("\nfraction of the weight-streaming limit reached: %.1f%%\n", 100.0 * limit_ms / ms);

  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    nlohmann::json out = {{"device", prop.name},
                          {"copy_bw_gbs", bw * 1e-9},
                          {"batch", B},
                          {"prompt", P},
                          {"steps", S},
                          {"weights_on_device_bytes", model.weight_bytes()},
                          {"decode_weight_bytes", mean_bytes},
                          {"decode_weight_bytes_min", min_bytes},
                          {"decode_weight_bytes_max", max_bytes},
                          {"tok_s", tok_s},
                          {"ms_step", ms},
                          {"overlap", absl::GetFlag(FLAGS_overlap)},
                          {"ms_step_host_in_loop", ms_sync},
                          {"limit_ms", limit_ms},
                          {"fraction_of_limit", limit_ms / ms},
                          {"prefill_tok_s", B * P / prefill_s},
                          {"hf_grouped_mm_tok_s", hf_grouped},
                          {"hf_default_tok_s", hf_default}};
    std::ofstream(path) << out.dump(2) << "\n";
  }
  if (disaggregated.empty()) return 0;

  // The monolithic engine without graphs and overlap (what the disaggregated one runs without), then the
  // disaggregated run.
  Monolithic mono;
  mono.config = &c, mono.config_text = config_text, mono.model_dir = config_path.empty() ? dir : "";
  mono.options = opt, mono.prompts = &prompts, mono.ids = std::move(ids);
  mono.ms_overlap = ms, mono.ms_sync = ms_sync;
  ForwardingExperts forwarding(model.local_experts());
  model.SetExpertExecutor(&forwarding);
  for (int i = 0; i < 2; ++i)
    if (auto st = step(); !st.ok()) return Fail(st), 1;
  t0 = Clock::now();
  for (int i = 0; i < S; ++i)
    if (auto st = step(); !st.ok()) return Fail(st), 1;
  mono.ms_no_graphs = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / S;
  model.SetExpertExecutor(nullptr);
  return RunDisaggregatedIpc(mono, B, W, S);
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  if (const int rc = k3::cuda::ServeIpcExpertsIfChild(); rc >= 0) return rc;  // started as --disaggregated's experts
  absl::SetProgramUsageMessage("k3serve-bench-e2e --model DIR [--batch 64] [--prompt 512] [--steps 32]");
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return k3::Run();
}

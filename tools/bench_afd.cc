// k3serve-bench-afd: attention/expert disaggregation on two GPUs of one host, against the monolithic engine.
// For each model config and batch it times greedy decode after a prompt:
//   - monolithic: CudaModel on GPU 0 (CUDA graphs, overlapped steps: its best);
//   - 1 attention + 1 expert node: CudaModel without routed experts on GPU 0, its experts a k3serve-nccl-expert
//     process on GPU 1, over NCCL (router/nccl_transport.h); serially (one micro-batch) and ping-pong (two
//     micro-batches of half the batch, each its own engine and communicator, so that one's attention runs
//     while the other's rows are at the experts).
// It prints tok/s, tok/s per GPU, ITL p50/p99, the step split (attention, transfer out, experts, transfer back,
// idle on each GPU), f_A / f_E of the monolithic step, the balance bound 1/max(f_A, f_E) × monolithic tok/s,
// and the transfer time per MoE layer next to the NVLink limit (its bytes over the peer-to-peer bandwidth
// measured in the same run).
//
//   k3serve-bench-afd [--configs tools/configs/kimi-linear-e2e.json,tools/configs/k3-mini.json]
//                     [--batches 64,128,256] [--prompt 512] [--steps 32] [--json out.json]
// Needs two GPUs; with fewer it says so and exits with status 2.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "engine/config.h"
#include "engine/cuda/cuda_model.h"
#include "router/nccl_transport.h"
#include "tools/local_cluster.h"

ABSL_FLAG(std::string, configs, "tools/configs/kimi-linear-e2e.json,tools/configs/k3-mini.json",
          "model configs (random weights drawn on the devices), comma-separated");
ABSL_FLAG(std::string, batches, "64,128,256", "decode batch sizes, comma-separated");
ABSL_FLAG(int, prompt, 512, "prompt tokens per sequence");
ABSL_FLAG(int, warmup, 4, "decode steps before timing");
ABSL_FLAG(int, steps, 32, "decode steps timed");
ABSL_FLAG(int, profile_steps, 4, "decode steps profiled by stage after the timed ones");
ABSL_FLAG(uint64_t, seed, 1, "seed of the random weights");
ABSL_FLAG(int, prefill_tokens, 8192, "tokens per prefill forward (and the most rows of a dispatch)");
ABSL_FLAG(double, share_experts_above_gb, 60, "MoE layers share one bank of routed experts when the model's "
          "routed experts exceed this many GB (k3-mini: CudaModelOptions::share_routed_experts)");
ABSL_FLAG(std::string, expert_bin, "", "k3serve-nccl-expert (default: beside this binary)");
ABSL_FLAG(std::string, json, "", "write the results here (optional)");

namespace k3 {
namespace {

using Clock = std::chrono::steady_clock;
using cuda::CudaModel;
using cuda::GpuChunk;

void Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "error: %s: %s\n", what.c_str(), s.ToString().c_str());
}

// Peer-to-peer copy bandwidth from one GPU to the other, bytes per second (256 MiB, ten copies).
absl::StatusOr<double> PeerBandwidth(int from, int to) {
  const size_t n = size_t{256} << 20;
  void *a = nullptr, *b = nullptr;
  cudaSetDevice(from);
  if (cudaDeviceEnablePeerAccess(to, 0) != cudaSuccess) cudaGetLastError();  // already enabled is fine
  if (cudaMalloc(&a, n) != cudaSuccess) return absl::ResourceExhaustedError("cudaMalloc");
  cudaSetDevice(to);
  if (cudaMalloc(&b, n) != cudaSuccess) return absl::ResourceExhaustedError("cudaMalloc");
  cudaSetDevice(from);
  cudaStream_t s;
  cudaStreamCreate(&s);
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  for (int i = 0; i < 2; ++i) cudaMemcpyPeerAsync(b, to, a, from, n, s);
  const int reps = 10;
  cudaEventRecord(t0, s);
  for (int i = 0; i < reps; ++i) cudaMemcpyPeerAsync(b, to, a, from, n, s);
  cudaEventRecord(t1, s);
  const cudaError_t e = cudaEventSynchronize(t1);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  cudaFree(a);
  cudaSetDevice(to);
  cudaFree(b);
  cudaSetDevice(from);
  cudaStreamDestroy(s);
  if (e != cudaSuccess) return absl::InternalError(cudaGetErrorString(e));
  return double(n) * reps / (ms * 1e-3);
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * v.size()));
  return v[i];
}

struct Run {
  std::string mode;  // "monolithic", "1A+1E serial", "1A+1E ping-pong"
  int batch = 0, gpus = 1;
  double tok_s = 0, ms_step = 0, itl_p50 = 0, itl_p99 = 0;
  // Per step, ms. attention: GPU 0's stages but the routed experts; experts: the monolithic step's experts, or
  // the expert node's; transfers from the expert node's events.
  double attention = 0, dispatch = 0, transfer_out = 0, experts = 0, transfer_back = 0, idle0 = 0, idle1 = 0;
  double f_a = 0, f_e = 0;
  double per_layer_transfer_ms = 0, per_layer_limit_ms = 0, per_layer_mb = 0;
};

// One engine's sequences: slots, the next token of each.
struct Seqs {
  CudaModel* model = nullptr;
  std::vector<int32_t> slots, next;
};

absl::Status Prefill(Seqs& q, int count, int prompt, int max_tokens, std::mt19937& rng) {
  const int64_t V = q.model->config().vocab_size;
  q.slots.clear();
  q.next.assign(count, 0);
  std::vector<std::vector<int32_t>> prompts(count, std::vector<int32_t>(prompt));
  for (auto& p : prompts)
    for (auto& t : p) t = static_cast<int32_t>(rng() % V);
  for (int s = 0; s < count; ++s) {
    K3_ASSIGN_OR_RETURN(int32_t slot, q.model->AllocSlot());
    q.slots.push_back(slot);
  }
  const int per = std::max(1, max_tokens / prompt);
  for (int s0 = 0; s0 < count; s0 += per) {
    std::vector<GpuChunk> chunks;
    for (int s = s0; s < std::min(count, s0 + per); ++s) chunks.push_back({q.slots[s], prompts[s], LogitsMode::kLast});
    std::vector<int32_t> ids;
    K3_RETURN_IF_ERROR(q.model->ForwardGreedy(chunks, &ids));
    std::copy(ids.begin(), ids.end(), q.next.begin() + s0);
  }
  return absl::OkStatus();
}

absl::Status Step(Seqs& q) {
  std::vector<GpuChunk> chunks;
  for (size_t s = 0; s < q.slots.size(); ++s)
    chunks.push_back({q.slots[s], std::span<const int32_t>(&q.next[s], 1), LogitsMode::kLast});
  std::vector<int32_t> ids;
  K3_RETURN_IF_ERROR(q.model->ForwardGreedy(chunks, &ids));
  q.next = ids;
  return absl::OkStatus();
}

void Free(Seqs& q) {
  for (int32_t s : q.slots) q.model->FreeSlot(s).IgnoreError();
  q.slots.clear();
}

// (attention, routed experts) of a profile, ms summed over its steps.
std::pair<double, double> StageSplit(const std::vector<std::pair<std::string, double>>& profile) {
  double attention = 0, experts = 0;
  for (const auto& [name, ms] : profile) (name == "moe.experts" ? experts : attention) += ms;
  return {attention, experts};
}

absl::StatusOr<Run> Monolithic(CudaModel& model, int B, int P, int W, int S, int PS, int max_tokens) {
  std::mt19937 rng(B);
  Seqs q{&model, {}, {}};
  K3_RETURN_IF_ERROR(Prefill(q, B, P, max_tokens, rng));
  for (int i = 0; i < W; ++i) K3_RETURN_IF_ERROR(Step(q));
  // Overlapped steps (NextGreedy): each return is one step's ids reaching the host.
  std::vector<double> itl;
  std::vector<int32_t> prev;
  const auto t0 = Clock::now();
  auto last = t0;
  for (int i = 0; i < S; ++i) {
    K3_RETURN_IF_ERROR(model.NextGreedy(&prev));
    const auto now = Clock::now();
    if (i > 0) itl.push_back(std::chrono::duration<double, std::milli>(now - last).count());
    last = now;
  }
  K3_RETURN_IF_ERROR(model.LastGreedy(&q.next));
  const double wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  model.SetProfiling(true);
  model.TakeProfile();
  for (int i = 0; i < PS; ++i) K3_RETURN_IF_ERROR(Step(q));
  const auto [attention, experts] = StageSplit(model.TakeProfile());
  model.SetProfiling(false);
  Free(q);
  Run r;
  r.mode = "monolithic";
  r.batch = B;
  r.ms_step = wall_ms / S;
  r.tok_s = B / (r.ms_step * 1e-3);
  r.itl_p50 = Percentile(itl, 0.5);
  r.itl_p99 = Percentile(itl, 0.99);
  r.f_e = experts / (attention + experts);
  r.f_a = 1 - r.f_e;
  // The profiled steps run without graphs (launch gaps count as stage time): the shares, not the times, carry
  // over to the timed step.
  r.attention = r.f_a * r.ms_step;
  r.experts = r.f_e * r.ms_step;
  return r;
}

// Micro-batch m of engines[m] (each its own communicator to the expert node), B / engines sequences each, the
// micro-batches stepping on their own threads.
absl::StatusOr<Run> Disaggregated(std::vector<std::unique_ptr<CudaModel>>& engines,
                                  std::vector<std::unique_ptr<dataplane::NcclRemoteExperts>>& remotes, int B, int P,
                                  int W, int S, int PS, int max_tokens, double bw_out, double bw_back) {
  const int M = static_cast<int>(engines.size());
  std::mt19937 rng(B);
  std::vector<Seqs> qs(M);
  for (int m = 0; m < M; ++m) {
    qs[m].model = engines[m].get();
    K3_RETURN_IF_ERROR(Prefill(qs[m], B / M, P, max_tokens, rng));
    for (int i = 0; i < W; ++i) K3_RETURN_IF_ERROR(Step(qs[m]));
  }
  auto in_threads = [&](int steps, std::vector<std::vector<double>>* itl) -> absl::Status {
    std::vector<absl::Status> st(M);
    std::vector<std::thread> threads;
    for (int m = 0; m < M; ++m)
      threads.emplace_back([&, m] {
        cudaSetDevice(0);
        auto last = Clock::now();
        for (int i = 0; i < steps && st[m].ok(); ++i) {
          st[m] = Step(qs[m]);
          if (st[m].ok()) st[m] = remotes[m]->status();
          const auto now = Clock::now();
          if (itl) (*itl)[m].push_back(std::chrono::duration<double, std::milli>(now - last).count());
          last = now;
        }
      });
    for (auto& t : threads) t.join();
    for (const auto& s : st) K3_RETURN_IF_ERROR(s);
    return absl::OkStatus();
  };
  K3_RETURN_IF_ERROR(remotes[0]->TakeExpertStats().status());  // starts the expert node's window
  std::vector<std::vector<double>> itl(M);
  const auto t0 = Clock::now();
  K3_RETURN_IF_ERROR(in_threads(S, &itl));
  const double wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  K3_ASSIGN_OR_RETURN(const dataplane::NcclExpertStats es, remotes[0]->TakeExpertStats());
  for (auto& e : engines) {
    e->SetProfiling(true);
    e->TakeProfile();
  }
  K3_RETURN_IF_ERROR(in_threads(PS, nullptr));
  double attention = 0, dispatch = 0;
  for (auto& e : engines) {
    const auto [a, d] = StageSplit(e->TakeProfile());
    attention += a / PS, dispatch += d / PS;
    e->SetProfiling(false);
  }
  for (auto& q : qs) Free(q);
  Run r;
  r.mode = M == 1 ? "1A+1E serial" : "1A+1E ping-pong";
  r.batch = B;
  r.gpus = 2;
  r.ms_step = wall_ms / S;
  r.tok_s = B / (r.ms_step * 1e-3);
  std::vector<double> all;
  for (auto& v : itl) all.insert(all.end(), v.begin() + (v.empty() ? 0 : 1), v.end());
  r.itl_p50 = Percentile(all, 0.5);
  r.itl_p99 = Percentile(all, 0.99);
  r.attention = attention;
  r.dispatch = dispatch;
  r.transfer_out = es.recv_ms / S;
  r.experts = es.experts_ms / S;
  r.transfer_back = es.send_ms / S;
  r.idle0 = std::max(0.0, r.ms_step - r.attention);
  r.idle1 = std::max(0.0, es.wall_ms / S - r.transfer_out - r.experts - r.transfer_back);
  if (es.dispatches > 0) {
    const double in = double(es.bytes_in) / es.dispatches, out = double(es.bytes_out) / es.dispatches;
    r.per_layer_transfer_ms = (es.recv_ms + es.send_ms) / es.dispatches;
    r.per_layer_limit_ms = (in / bw_out + out / bw_back) * 1e3;
    r.per_layer_mb = (in + out) * 1e-6;
  }
  return r;
}

absl::StatusOr<std::string> ExpertAddress(Process& p, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (!p.alive()) return absl::UnavailableError(absl::StrCat("the expert node exited; see ", p.log_path()));
    std::ifstream in(p.log_path());
    for (std::string line; std::getline(in, line);)
      if (line.rfind("listening on ", 0) == 0) return line.substr(13);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return absl::DeadlineExceededError(absl::StrCat("the expert node did not start in time; see ", p.log_path()));
}

void PrintRuns(const std::vector<Run>& runs) {
  std::printf("\n| mode | batch | tok/s | tok/s per GPU | ms/step | ITL p50 | ITL p99 | attention | dispatch wait | "
              "transfer out | experts | transfer back | idle GPU0 | idle GPU1 |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Run& r : runs)
    std::printf("| %s | %d | %.0f | %.0f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n",
                r.mode.c_str(), r.batch, r.tok_s, r.tok_s / r.gpus, r.ms_step, r.itl_p50, r.itl_p99, r.attention,
                r.dispatch, r.transfer_out, r.experts, r.transfer_back, r.idle0, r.idle1);
}

int Main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (devices < 2) {
    std::fprintf(stderr,
                 "k3serve-bench-afd needs two GPUs of one host (the attention node on GPU 0, the expert node on GPU 1); "
                 "this machine has %d. Run it on a two-GPU machine (NVLink), e.g. the device kind nvidia-h200-x2.\n",
                 devices);
    return 2;
  }
  dataplane::DisableNvlinkMulticast();
  const int P = absl::GetFlag(FLAGS_prompt), W = absl::GetFlag(FLAGS_warmup), S = absl::GetFlag(FLAGS_steps),
            PS = absl::GetFlag(FLAGS_profile_steps), T = absl::GetFlag(FLAGS_prefill_tokens);
  std::vector<int> batches;
  for (const auto& b : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(b, &v) || v < 2 || v % 2 != 0) {
      std::fprintf(stderr, "--batches: \"%s\" is not an even number of at least 2\n", std::string(b).c_str());
      return 2;
    }
    batches.push_back(v);
  }
  if (batches.empty() || P <= 0 || S <= 1 || W < 1 || PS < 1 || T < P) {
    std::fprintf(stderr, "k3serve-bench-afd: bad --batches/--prompt/--steps/--warmup/--profile_steps/--prefill_tokens\n");
    return 2;
  }
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  std::string expert_bin = absl::GetFlag(FLAGS_expert_bin);
  if (expert_bin.empty())
    expert_bin = (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "k3serve-nccl-expert").string();

  cudaDeviceProp p0{}, p1{};
  cudaGetDeviceProperties(&p0, 0);
  cudaGetDeviceProperties(&p1, 1);
  int peer = 0;
  cudaDeviceCanAccessPeer(&peer, 0, 1);
  auto bw01 = PeerBandwidth(0, 1), bw10 = PeerBandwidth(1, 0);
  if (!bw01.ok() || !bw10.ok()) return Fail("peer bandwidth", bw01.ok() ? bw10.status() : bw01.status()), 1;
  std::printf("GPU 0: %s, GPU 1: %s; peer access %s; peer-to-peer copy %.0f GB/s 0→1, %.0f GB/s 1→0\n", p0.name,
              p1.name, peer ? "yes" : "no", *bw01 * 1e-9, *bw10 * 1e-9);

  nlohmann::json out = nlohmann::json::array();
  for (const auto& path_view : absl::StrSplit(absl::GetFlag(FLAGS_configs), ',', absl::SkipEmpty())) {
    const std::string path(path_view);
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    auto config = ParseModelConfig(text.str(), path);
    if (!config.ok()) return Fail(path, config.status()), 1;
    const ModelConfig& c = *config;
    int moe_layers = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) moe_layers += c.mlp[l] == Mlp::kMoe;
    const double expert_gb = 3.0 * c.moe_intermediate_size * c.expert_width() * 2 * c.num_experts * moe_layers * 1e-9;
    const bool share = expert_gb > absl::GetFlag(FLAGS_share_experts_above_gb);
    std::printf("\n## %s: d %ld, %ld layers (%d MoE), %ld experts top-%ld, %.1f GB of routed experts%s\n", path.c_str(),
                long(c.hidden_size), long(c.num_layers), moe_layers, long(c.num_experts), long(c.top_k), expert_gb,
                share ? " (MoE layers share one bank: --share_experts_above_gb)" : "");
    cuda::CudaModelOptions opt;
    opt.device = 0;
    opt.max_seqs = max_batch;
    opt.max_context = P + W + S + PS + 2;
    opt.max_batch_tokens = T;
    opt.share_routed_experts = share;
    std::vector<Run> runs;
    std::map<int, Run> mono;
    {
      auto model = CudaModel::CreateRandom(c, absl::GetFlag(FLAGS_seed), opt);
      if (!model.ok()) return Fail("monolithic model", model.status()), 1;
      for (int B : batches) {
        auto r = Monolithic(**model, B, P, W, S, PS, T);
        if (!r.ok()) return Fail("monolithic run", r.status()), 1;
        mono[B] = *r;
        runs.push_back(*r);
      }
    }
    std::vector<std::string> argv = {expert_bin, "--config", path, "--seed", std::to_string(absl::GetFlag(FLAGS_seed)),
                                     "--device", "1", "--max_rows", std::to_string(T), "--node_id", "afd-expert"};
    if (share) argv.push_back("--share_experts");
    const std::string log = (std::filesystem::temp_directory_path() / "k3serve-bench-afd-expert.log").string();
    auto expert = Process::Spawn("expert", argv, log);
    if (!expert.ok()) return Fail("expert node", expert.status()), 1;
    auto address = ExpertAddress(**expert, absl::Minutes(10));
    if (!address.ok()) return Fail("expert node", address.status()), 1;
    for (int M : {1, 2}) {
      std::vector<std::unique_ptr<CudaModel>> engines;
      std::vector<std::unique_ptr<dataplane::NcclRemoteExperts>> remotes;
      cuda::CudaModelOptions aopt = opt;
      aopt.routed_experts = false;
      aopt.max_seqs = max_batch / M;
      for (int m = 0; m < M; ++m) {
        auto e = CudaModel::CreateRandom(c, absl::GetFlag(FLAGS_seed), aopt);
        if (!e.ok()) return Fail("attention engine", e.status()), 1;
        auto remote = dataplane::NcclRemoteExperts::Connect(c, *address, 0, {}, "afd-attention-" + std::to_string(m));
        if (!remote.ok()) return Fail("NCCL connect", remote.status()), 1;
        (*e)->SetExpertExecutor(remote->get());
        engines.push_back(std::move(*e));
        remotes.push_back(std::move(*remote));
      }
      for (int B : batches) {
        auto r = Disaggregated(engines, remotes, B, P, W, S, PS, T, *bw01, *bw10);
        if (!r.ok()) return Fail(absl::StrCat("disaggregated run, batch ", B), r.status()), 1;
        r->f_a = mono[B].f_a, r->f_e = mono[B].f_e;
        runs.push_back(*r);
      }
      for (auto& e : engines) e->SetExpertExecutor(nullptr);
    }
    PrintRuns(runs);
    std::printf("\n| batch | f_A | f_E | bound 1/max(f_A,f_E) × mono tok/s | best 1A+1E tok/s | of the bound | "
                "transfer per MoE layer (ms) | NVLink limit (ms) | MB per layer |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    double best_ratio = 0;
    int best_batch = 0;
    for (int B : batches) {
      const Run& m = mono[B];
      const double bound = m.tok_s / std::max(m.f_a, m.f_e);
      const Run* best = nullptr;
      for (const Run& r : runs)
        if (r.batch == B && r.gpus == 2 && (!best || r.tok_s > best->tok_s)) best = &r;
      if (!best) continue;
      const double ratio = best->tok_s / bound;
      if (ratio > best_ratio) best_ratio = ratio, best_batch = B;
      std::printf("| %d | %.3f | %.3f | %.0f | %.0f (%s) | %.2f | %.3f | %.3f | %.2f |\n", B, m.f_a, m.f_e, bound,
                  best->tok_s, best->mode.c_str(), ratio, best->per_layer_transfer_ms, best->per_layer_limit_ms,
                  best->per_layer_mb);
    }
    std::printf("\nbest batch %d: 1A+1E reaches %.2f of its balance bound (target 0.90)\n", best_batch, best_ratio);
    for (const Run& r : runs)
      out.push_back({{"config", path}, {"mode", r.mode}, {"batch", r.batch}, {"gpus", r.gpus}, {"tok_s", r.tok_s},
                     {"ms_step", r.ms_step}, {"itl_p50_ms", r.itl_p50}, {"itl_p99_ms", r.itl_p99},
                     {"attention_ms", r.attention}, {"dispatch_ms", r.dispatch}, {"transfer_out_ms", r.transfer_out},
                     {"experts_ms", r.experts}, {"transfer_back_ms", r.transfer_back}, {"idle_gpu0_ms", r.idle0},
                     {"idle_gpu1_ms", r.idle1}, {"f_a", r.f_a}, {"f_e", r.f_e},
                     {"transfer_per_layer_ms", r.per_layer_transfer_ms}, {"nvlink_limit_per_layer_ms", r.per_layer_limit_ms},
                     {"mb_per_layer", r.per_layer_mb}});
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) std::ofstream(path) << out.dump(2) << "\n";
  return 0;
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("k3serve-bench-afd [--configs a.json,b.json] [--batches 64,128,256] [--prompt 512]");
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return k3::Main();
}

#include "tools/bench_cluster.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "tools/client.h"
#include "tools/http_get.h"
#include "tools/local_cluster.h"

namespace k3 {
namespace {

using Clock = std::chrono::steady_clock;

struct Figures {
  double decode_tok_s = 0;
  double itl_p50_ms = 0, itl_p99_ms = 0;
  double ttft_p50_ms = 0;
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

// Per stream: token arrival times. Decode rate counts tokens after each stream's first one over
// the span from the first first-token to the last token.
Figures Summarize(const std::vector<std::vector<Clock::time_point>>& arrivals, Clock::time_point start) {
  Figures f;
  std::vector<double> itl, ttft;
  Clock::time_point first_token = Clock::time_point::max(), last = start;
  int64_t decode_tokens = 0;
  for (const auto& a : arrivals) {
    if (a.empty()) continue;
    ttft.push_back(std::chrono::duration<double, std::milli>(a[0] - start).count());
    first_token = std::min(first_token, a[0]);
    last = std::max(last, a.back());
    for (size_t i = 1; i < a.size(); ++i) itl.push_back(std::chrono::duration<double, std::milli>(a[i] - a[i - 1]).count());
    decode_tokens += static_cast<int64_t>(a.size()) - 1;
  }
  const double span = std::chrono::duration<double>(last - first_token).count();
  f.decode_tok_s = span > 0 ? decode_tokens / span : 0;
  f.itl_p50_ms = Percentile(itl, 0.5);
  f.itl_p99_ms = Percentile(itl, 0.99);
  f.ttft_p50_ms = Percentile(ttft, 0.5);
  return f;
}

std::vector<std::vector<int32_t>> Prompts(int n, int len, int64_t vocab) {
  std::mt19937 rng(42);
  std::vector<std::vector<int32_t>> p(n, std::vector<int32_t>(len));
  for (auto& v : p)
    for (auto& t : v) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

absl::StatusOr<Figures> InProcess(const BenchOptions& o) {
  K3_ASSIGN_OR_RETURN(auto model, Model::Load(o.model));
  LocalExpertExecutor experts(model->config(), model->weights());
  EngineOptions eo;
  eo.max_running = o.streams;
  eo.max_batch_tokens = std::max<int64_t>(2048, static_cast<int64_t>(o.streams));
  CpuBackend backend(*model, experts);
  Engine engine(backend, eo);
  SamplingParams sp;
  sp.max_new_tokens = o.max_tokens;
  sp.ignore_eos = true;
  const auto prompts = Prompts(o.streams, o.prompt_len, model->config().vocab_size);
  const auto start = Clock::now();
  for (int i = 0; i < o.streams; ++i) K3_RETURN_IF_ERROR(engine.Add(i, prompts[i], sp));
  std::vector<std::vector<Clock::time_point>> arrivals(o.streams);
  while (engine.HasWork())
    for (const StepOutput& out : engine.Step()) {
      if (out.finish == FinishReason::kError) return out.error;
      for (size_t t = 0; t < out.tokens.size(); ++t) arrivals[out.id].push_back(Clock::now());
    }
  return Summarize(arrivals, start);
}

}  // namespace

absl::Status RunClusterBench(const BenchOptions& o) {
  std::printf("bench: %d streams, prompt %d tokens, %d new tokens each, greedy\n", o.streams, o.prompt_len, o.max_tokens);
  K3_ASSIGN_OR_RETURN(Figures local, InProcess(o));

  ClusterOptions co;
  co.bin_dir = o.bin_dir;
  co.model = o.model;
  co.attention = o.attention;
  co.experts = o.experts;
  co.attention_args = {absl::StrCat("--max-running=", o.streams)};
  if (o.skew) {
    co.router_args = {"--load-interval=0.5", "--rebalance-after=2", "--rebalance-threshold=1.05", "--redundancy=0.25"};
    co.attention_args.push_back("--load-interval=0.25");
  }
  K3_ASSIGN_OR_RETURN(auto cluster, LocalCluster::Start(co));
  K3_ASSIGN_OR_RETURN(auto config, LoadModelConfig(o.model));
  const auto prompts = Prompts(o.streams, o.prompt_len, config.vocab_size);
  auto run_pass = [&]() -> absl::StatusOr<Figures> {
    std::vector<std::vector<Clock::time_point>> arrivals(o.streams);
    std::vector<absl::Status> status(o.streams);
    const auto start = Clock::now();
    std::vector<std::thread> threads;
    for (int i = 0; i < o.streams; ++i)
      threads.emplace_back([&, i] {
        InferenceClient client(cluster->attention_addresses()[i % cluster->attention_addresses().size()]);
        SamplingParams sp;
        sp.max_new_tokens = o.max_tokens;
        sp.ignore_eos = true;
        auto r = client.Generate(prompts[i], sp, absl::Seconds(600), [&](const std::vector<int32_t>& chunk) {
          for (size_t t = 0; t < chunk.size(); ++t) arrivals[i].push_back(Clock::now());
        });
        status[i] = r.status();
      });
    for (auto& t : threads) t.join();
    for (const auto& s : status) K3_RETURN_IF_ERROR(s);
    return Summarize(arrivals, start);
  };
  auto expert_load = [&]() -> absl::StatusOr<nlohmann::json> {
    K3_ASSIGN_OR_RETURN(std::string body, HttpGet("127.0.0.1", cluster->router_metrics_port(), "/admin/expert_load"));
    return nlohmann::json::parse(body, nullptr, false);
  };
  K3_ASSIGN_OR_RETURN(Figures remote, run_pass());
  if (o.skew) {
    K3_ASSIGN_OR_RETURN(nlohmann::json before, expert_load());
    // The router rebalances once the node load stays above its threshold for two intervals.
    auto completed = [&] {
      auto m = HttpGet("127.0.0.1", cluster->router_metrics_port(), "/metrics");
      return m.ok() ? MetricValue(*m, "k3serve_rebalances_total", "completed") : 0.0;
    };
    const double c0 = completed();
    const int64_t v0 = before.value("placement_version", 0);
    for (int i = 0; i < 300 && completed() <= c0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    K3_ASSIGN_OR_RETURN(Figures second, run_pass());
    K3_ASSIGN_OR_RETURN(nlohmann::json after, expert_load());
    std::printf("\nexpert load, EMA at the end of each pass (placement v%ld before, v%ld after the router's rebalance)\n",
                static_cast<long>(v0), static_cast<long>(after.value("placement_version", 0)));
    std::printf("%-8s %18s %22s %22s\n", "layer", "expert max/mean", "node max/mean before", "node max/mean after");
    for (size_t l = 0; l < before["layers"].size() && l < after["layers"].size(); ++l)
      std::printf("%-8d %18.2f %22.3f %22.3f\n", before["layers"][l].value("layer", 0),
                  before["layers"][l].value("expert_max_over_mean", 0.0), before["layers"][l].value("node_load_max_over_mean", 0.0),
                  after["layers"][l].value("node_load_max_over_mean", 0.0));
    std::printf("%-8s %18s %22.3f %22.3f\n", "all", "", before.value("node_load_max_over_mean", 0.0),
                after.value("node_load_max_over_mean", 0.0));
    auto nodes = [](const nlohmann::json& j) {
      std::string out;
      for (size_t n = 0; n < j["nodes"].size() && n < j["node_load_ema"].size(); ++n)
        out += absl::StrCat(" ", j["nodes"][n].get<std::string>(), "=", static_cast<int64_t>(j["node_load_ema"][n].get<double>()));
      return out;
    };
    std::printf("node tokens (EMA per interval) before:%s\n                                after:%s\n", nodes(before).c_str(),
                nodes(after).c_str());
    std::printf("decode tok/s: %.1f before, %.1f after the rebalance\n", remote.decode_tok_s, second.decode_tok_s);
    remote = second;
  }

  // Dispatch cost per MoE layer, from the nodes' own metrics.
  double rt_sum = 0, rt_count = 0, ex_sum = 0, ex_count = 0;
  for (int port : cluster->attention_metrics_ports()) {
    K3_ASSIGN_OR_RETURN(std::string m, HttpGet("127.0.0.1", port, "/metrics"));
    rt_sum += MetricValue(m, "k3serve_dispatch_seconds_sum");
    rt_count += MetricValue(m, "k3serve_dispatch_seconds_count");
  }
  for (int port : cluster->expert_metrics_ports()) {
    K3_ASSIGN_OR_RETURN(std::string m, HttpGet("127.0.0.1", port, "/metrics"));
    ex_sum += MetricValue(m, "k3serve_expert_batch_seconds_sum");
    ex_count += MetricValue(m, "k3serve_expert_batch_seconds_count");
  }
  std::printf("\n%-22s %14s %12s %12s %12s\n", "", "decode tok/s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms");
  std::printf("%-22s %14.1f %12.3f %12.3f %12.2f\n", "in-process engine", local.decode_tok_s, local.itl_p50_ms,
              local.itl_p99_ms, local.ttft_p50_ms);
  std::printf("%-22s %14.1f %12.3f %12.3f %12.2f\n",
              absl::StrCat("disaggregated ", o.attention, "A+", o.experts, "E").c_str(), remote.decode_tok_s,
              remote.itl_p50_ms, remote.itl_p99_ms, remote.ttft_p50_ms);
  std::printf("ratio disaggregated / in-process decode tok/s: %.3f\n",
              local.decode_tok_s > 0 ? remote.decode_tok_s / local.decode_tok_s : 0.0);
  std::printf("MoE dispatch round trip (one expert node, one layer): mean %.1f us over %.0f dispatches\n",
              rt_count > 0 ? 1e6 * rt_sum / rt_count : 0.0, rt_count);
  std::printf("expert compute per batch: mean %.1f us over %.0f batches; the rest of the round trip is transport,\n"
              "codec and batching window\n",
              ex_count > 0 ? 1e6 * ex_sum / ex_count : 0.0, ex_count);
  return absl::OkStatus();
}

}  // namespace k3

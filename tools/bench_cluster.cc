#include "tools/bench_cluster.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <mutex>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "router/eplb.h"
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

// User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15).
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t end = stat.rfind(')');  // the command name may hold spaces
  if (end == std::string::npos) return 0;
  std::istringstream fields(stat.substr(end + 2));
  std::string f;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i)
    if (i >= 14) ticks += std::stod(f);
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

absl::StatusOr<Figures> InProcess(const BenchOptions& o, const Model& model) {
  LocalExpertExecutor experts(model.config(), model.weights());
  EngineOptions eo;
  eo.max_running = o.streams;
  eo.max_batch_tokens = std::max<int64_t>(2048, static_cast<int64_t>(o.streams));
  CpuBackend backend(model, experts);
  Engine engine(backend, eo);
  SamplingParams sp;
  sp.max_new_tokens = o.max_tokens;
  sp.ignore_eos = true;
  const auto prompts = Prompts(o.streams, o.prompt_len, model.config().vocab_size);
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

// The dispatch metrics of every node, summed: cumulative, so a run's figures are a difference.
struct DispatchMetrics {
  double rt_sum = 0, rt_count = 0, batch_sum = 0, batch_count = 0;
  double stage_sum[6] = {}, stage_count = 0;
  double decode_stage_sum[6] = {}, decode_stage_count = 0;  // dispatches of decode rows only
  std::map<double, double> stage_buckets[6];  // cumulative count by upper bound (seconds)
};

// Adds a histogram's cumulative bucket counts (the lines with `filter`) into `buckets`.
void AddBuckets(const std::string& exposition, const std::string& name, const std::string& filter,
                std::map<double, double>& buckets) {
  std::istringstream in(exposition);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.starts_with(name + "{") || line.find(filter) == std::string::npos) continue;
    const size_t le = line.find("le=\"");
    if (le == std::string::npos) continue;
    const std::string bound = line.substr(le + 4, line.find('"', le + 4) - le - 4);
    const double upper = bound == "+Inf" ? std::numeric_limits<double>::infinity() : std::stod(bound);
    buckets[upper] += std::stod(line.substr(line.rfind(' ') + 1));
  }
}

// The upper bound of the bucket that holds the median of the samples between two snapshots.
double MedianBound(const std::map<double, double>& before, const std::map<double, double>& after) {
  if (after.empty()) return 0;
  const double total = after.rbegin()->second - (before.empty() ? 0 : before.rbegin()->second);
  for (const auto& [upper, count] : after) {
    auto b = before.find(upper);
    if (count - (b == before.end() ? 0 : b->second) >= 0.5 * total) return upper;
  }
  return 0;
}
constexpr const char* kStages[6] = {"pack", "out", "window", "compute", "back", "unpack"};

absl::StatusOr<DispatchMetrics> ReadDispatchMetrics(const LocalCluster& cluster) {
  DispatchMetrics d;
  for (int port : cluster.attention_metrics_ports()) {
    K3_ASSIGN_OR_RETURN(std::string m, HttpGet("127.0.0.1", port, "/metrics"));
    d.rt_sum += MetricValue(m, "k3serve_dispatch_seconds_sum");
    d.rt_count += MetricValue(m, "k3serve_dispatch_seconds_count");
    for (int i = 0; i < 6; ++i) {
      const std::string label = absl::StrCat("stage=\"", kStages[i], "\"");
      d.stage_sum[i] += MetricValue(m, "k3serve_dispatch_stage_seconds_sum", label);
      AddBuckets(m, "k3serve_dispatch_stage_seconds_bucket", label, d.stage_buckets[i]);
    }
    d.stage_count += MetricValue(m, "k3serve_dispatch_stage_seconds_count", "stage=\"pack\"");
    const std::string decode = "phase=\"decode\"";
    for (int i = 0; i < 6; ++i)
      d.decode_stage_sum[i] +=
          MetricValue(m, "k3serve_dispatch_stage_seconds_sum", {absl::StrCat("stage=\"", kStages[i], "\""), decode});
    d.decode_stage_count += MetricValue(m, "k3serve_dispatch_stage_seconds_count", {"stage=\"pack\"", decode});
  }
  for (int port : cluster.expert_metrics_ports()) {
    K3_ASSIGN_OR_RETURN(std::string m, HttpGet("127.0.0.1", port, "/metrics"));
    d.batch_sum += MetricValue(m, "k3serve_expert_batch_seconds_sum");
    d.batch_count += MetricValue(m, "k3serve_expert_batch_seconds_count");
  }
  return d;
}

// The streams straight to the attention nodes, or (via_gateway) through the gateway.
absl::StatusOr<Figures> Disaggregated(const BenchOptions& o, LocalCluster& cluster, int64_t vocab, bool via_gateway) {
  const auto prompts = Prompts(o.streams, o.prompt_len, vocab);
  std::vector<std::vector<Clock::time_point>> arrivals(o.streams);
  std::vector<absl::Status> status(o.streams);
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int i = 0; i < o.streams; ++i)
    threads.emplace_back([&, i] {
      InferenceClient client(via_gateway ? cluster.gateway_address()
                                         : cluster.attention_addresses()[i % cluster.attention_addresses().size()]);
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
}

// With a skewed model: one pass, the router's rebalance on measured load, a second pass, and the
// per-layer and per-node load of both.
absl::Status SkewReport(const BenchOptions& o, LocalCluster& cluster, int64_t vocab) {
  auto expert_load = [&]() -> absl::StatusOr<nlohmann::json> {
    K3_ASSIGN_OR_RETURN(std::string body, HttpGet("127.0.0.1", cluster.router_metrics_port(), "/admin/expert_load"));
    return nlohmann::json::parse(body, nullptr, false);
  };
  K3_ASSIGN_OR_RETURN(Figures first, Disaggregated(o, cluster, vocab, /*via_gateway=*/false));
  K3_ASSIGN_OR_RETURN(nlohmann::json before, expert_load());
  // The router rebalances once the node load stays above its threshold for two intervals.
  auto completed = [&] {
    auto m = HttpGet("127.0.0.1", cluster.router_metrics_port(), "/metrics");
    return m.ok() ? MetricValue(*m, "k3serve_rebalances_total", "completed") : 0.0;
  };
  const double c0 = completed();
  const int64_t v0 = before.value("placement_version", 0);
  for (int i = 0; i < 300 && completed() <= c0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  K3_ASSIGN_OR_RETURN(Figures second, Disaggregated(o, cluster, vocab, /*via_gateway=*/false));
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
  std::printf("decode tok/s: %.1f before, %.1f after the rebalance\n", first.decode_tok_s, second.decode_tok_s);
  return absl::OkStatus();
}

// Field by field.
Figures Median(const std::vector<Figures>& runs) {
  auto median = [&](double Figures::*field) {
    std::vector<double> v;
    for (const Figures& f : runs) v.push_back(f.*field);
    return Percentile(v, 0.5);
  };
  Figures m;
  m.decode_tok_s = median(&Figures::decode_tok_s);
  m.itl_p50_ms = median(&Figures::itl_p50_ms);
  m.itl_p99_ms = median(&Figures::itl_p99_ms);
  m.ttft_p50_ms = median(&Figures::ttft_p50_ms);
  return m;
}

constexpr int kPairs = 7;  // in-process, direct and gateway runs per repeat

struct Range {
  double lo = 0, hi = 0;
  int n = 0;
  void Add(double v) {
    lo = n == 0 ? v : std::min(lo, v);
    hi = n == 0 ? v : std::max(hi, v);
    ++n;
  }
};

}  // namespace

absl::Status RunClusterBench(const BenchOptions& o) {
  std::printf("bench: %d streams, prompt %d tokens, %d new tokens each, greedy; data plane %s; %d repeat(s)\n", o.streams,
              o.prompt_len, o.max_tokens, o.data_plane.c_str(), o.repeats);
  std::printf("each repeat: %d in-process, %d direct and %d gateway runs, interleaved (their rows: medians)\n", kPairs,
              kPairs, kPairs);
  // Replicated: every expert on every expert node, within the router's bound on redundancy.
  const int redundancy =
      o.replicate_experts ? std::min(o.experts - 1, static_cast<int>(router::kMaxRedundancy)) : 0;
  if (!o.skew)
    std::printf("experts: %d cop%s of each over %d expert node(s)%s\n", redundancy + 1, redundancy ? "ies" : "y",
                o.experts, redundancy > 0 && redundancy + 1 == o.experts ? " (a decode dispatch goes whole to one node)" : "");
  ClusterOptions co;
  co.bin_dir = o.bin_dir;
  co.model = o.model;
  co.attention = o.attention;
  co.experts = o.experts;
  // The in-process engine is given all its prompts before its first step; the nodes wait 5 ms for
  // a burst's requests (each client opens its own channel), or the first one is prefilled alone
  // and the rest a step later.
  co.attention_args = {absl::StrCat("--max-running=", o.streams), "--admission-window-us=5000",
                       absl::StrCat("--ping-pong-adaptive=", o.ping_pong_adaptive ? "true" : "false")};
  co.expert_args = {"--data-plane=" + o.data_plane};
  co.gateway = true;
  if (!o.skew && redundancy > 0) co.router_args = {absl::StrCat("--redundancy=", redundancy)};
  if (o.skew) {
    co.router_args = {"--load-interval=0.5", "--rebalance-after=2", "--rebalance-threshold=1.05", "--redundancy=0.25"};
    co.attention_args.push_back("--load-interval=0.25");
  }
  K3_ASSIGN_OR_RETURN(auto cluster, LocalCluster::Start(co));
  K3_ASSIGN_OR_RETURN(auto model, Model::Load(o.model));
  const ModelConfig& config = model->config();
  if (o.skew) {
    K3_RETURN_IF_ERROR(SkewReport(o, *cluster, config.vocab_size));
  }
  const std::string remote_name = absl::StrCat("disaggregated ", o.attention, "A+", o.experts, "E");

  Range ratio, overhead, decode_overhead, local_tok, remote_tok, gw_tok, gw_itl;
  std::vector<double> all_pair_tok, all_pair_itl;  // gateway / direct of every pair
  // CPU of the attention nodes and of the gateway, per phase: where forwarding costs.
  auto attention_cpu = [&] {
    double s = 0;
    for (int i = 0; i < o.attention; ++i) s += CpuSeconds(cluster->attention(i).pid());
    return s;
  };
  double direct_attention_cpu = 0, gw_attention_cpu = 0, gateway_cpu = 0;
  for (int rep = 0; rep < std::max(1, o.repeats); ++rep) {
    // One run lasts a fraction of a second, which the machine's other load moves by tens of percent:
    // each round runs the in-process engine, then direct and through the gateway, that pair's order
    // the previous one's reversed, so load changes hit all three alike. Each row below is the median
    // over the rounds. The in-process engine idles the cluster, so the dispatch metrics (read
    // around the whole repeat) are the cluster runs'.
    K3_ASSIGN_OR_RETURN(DispatchMetrics before, ReadDispatchMetrics(*cluster));
    std::vector<Figures> local_runs, direct_runs, gateway_runs;
    for (int pair = 0; pair < kPairs; ++pair) {
      K3_ASSIGN_OR_RETURN(Figures l, InProcess(o, *model));
      local_runs.push_back(l);
      for (int k = 0; k < 2; ++k) {
        const bool via_gateway = (k == 0) == (pair % 2 == 1);
        const double a0 = attention_cpu(), g0 = CpuSeconds(cluster->gateway().pid());
        K3_ASSIGN_OR_RETURN(Figures f, Disaggregated(o, *cluster, config.vocab_size, via_gateway));
        (via_gateway ? gw_attention_cpu : direct_attention_cpu) += attention_cpu() - a0;
        if (via_gateway) gateway_cpu += CpuSeconds(cluster->gateway().pid()) - g0;
        (via_gateway ? gateway_runs : direct_runs).push_back(f);
      }
    }
    K3_ASSIGN_OR_RETURN(DispatchMetrics after, ReadDispatchMetrics(*cluster));
    const Figures local = Median(local_runs), remote = Median(direct_runs), gateway = Median(gateway_runs);
    // A pair's two runs see the same machine: their ratio is steadier than the medians'.
    std::vector<double> pair_tok, pair_itl;
    for (int pair = 0; pair < kPairs; ++pair) {
      const Figures& d = direct_runs[pair];
      const Figures& g = gateway_runs[pair];
      if (d.decode_tok_s > 0) pair_tok.push_back(g.decode_tok_s / d.decode_tok_s);
      if (d.itl_p50_ms > 0) pair_itl.push_back(g.itl_p50_ms / d.itl_p50_ms);
    }
    all_pair_tok.insert(all_pair_tok.end(), pair_tok.begin(), pair_tok.end());
    all_pair_itl.insert(all_pair_itl.end(), pair_itl.begin(), pair_itl.end());
    const double rt_n = after.rt_count - before.rt_count, batch_n = after.batch_count - before.batch_count;
    const double stage_n = after.stage_count - before.stage_count;
    const double decode_n = after.decode_stage_count - before.decode_stage_count;
    const double rt_us = rt_n > 0 ? 1e6 * (after.rt_sum - before.rt_sum) / rt_n : 0.0;
    const double batch_us = batch_n > 0 ? 1e6 * (after.batch_sum - before.batch_sum) / batch_n : 0.0;
    double stage_us[6] = {}, decode_us[6] = {}, decode_total = 0;
    for (int i = 0; i < 6; ++i) {
      stage_us[i] = stage_n > 0 ? 1e6 * (after.stage_sum[i] - before.stage_sum[i]) / stage_n : 0.0;
      decode_us[i] = decode_n > 0 ? 1e6 * (after.decode_stage_sum[i] - before.decode_stage_sum[i]) / decode_n : 0.0;
      decode_total += decode_us[i];
    }
    const double r = local.decode_tok_s > 0 ? remote.decode_tok_s / local.decode_tok_s : 0.0;

    std::printf("\n%s%-22s %14s %12s %12s %12s\n", o.repeats > 1 ? absl::StrCat("[", rep + 1, "] ").c_str() : "", "",
                "decode tok/s", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms");
    std::printf("%-22s %14.1f %12.3f %12.3f %12.2f\n", "in-process engine", local.decode_tok_s, local.itl_p50_ms,
                local.itl_p99_ms, local.ttft_p50_ms);
    std::printf("%-22s %14.1f %12.3f %12.3f %12.2f\n", remote_name.c_str(), remote.decode_tok_s, remote.itl_p50_ms,
                remote.itl_p99_ms, remote.ttft_p50_ms);
    std::printf("%-22s %14.1f %12.3f %12.3f %12.2f\n", "through the gateway", gateway.decode_tok_s, gateway.itl_p50_ms,
                gateway.itl_p99_ms, gateway.ttft_p50_ms);
    std::printf("ratio disaggregated / in-process decode tok/s: %.3f\n", r);
    std::printf("gateway / direct, median over the %d pairs: decode tok/s %.3f, ITL p50 %.3f\n", kPairs,
                Percentile(pair_tok, 0.5), Percentile(pair_itl, 0.5));
    std::printf("MoE dispatch round trip (one expert node, one layer): mean %.1f us over %.0f dispatches\n", rt_us, rt_n);
    std::printf("expert compute per batch: mean %.1f us over %.0f batches\n", batch_us, batch_n);
    std::printf("per MoE layer and expert node, mean us:");
    double total = 0;
    for (int i = 0; i < 6; ++i) {
      std::printf(" %s %.1f%s", kStages[i], stage_us[i], i < 5 ? " |" : "");
      total += stage_us[i];
    }
    std::printf("\n  = %.1f us, of which expert compute %.1f: overhead (round trip minus expert compute) %.1f us\n", total,
                stage_us[3], total - stage_us[3]);
    std::printf("  decode dispatches only (%.0f of %.0f), mean us:", decode_n, stage_n);
    for (int i = 0; i < 6; ++i) std::printf(" %s %.1f%s", kStages[i], decode_us[i], i < 5 ? " |" : "");
    std::printf("\n  = %.1f us, of which expert compute %.1f: overhead %.1f us\n", decode_total, decode_us[3],
                decode_total - decode_us[3]);
    std::printf("  medians, at most (histogram bucket bounds, us):");
    for (int i = 0; i < 6; ++i)
      std::printf(" %s %.0f%s", kStages[i], 1e6 * MedianBound(before.stage_buckets[i], after.stage_buckets[i]),
                  i < 5 ? " |" : "\n");
    ratio.Add(r);
    overhead.Add(total - stage_us[3]);
    decode_overhead.Add(decode_total - decode_us[3]);
    local_tok.Add(local.decode_tok_s);
    remote_tok.Add(remote.decode_tok_s);
    gw_tok.Add(Percentile(pair_tok, 0.5));
    gw_itl.Add(Percentile(pair_itl, 0.5));
  }
  // /proc's CPU times tick at 10 ms: over short runs these are coarse.
  const double tokens = static_cast<double>(std::max(1, o.repeats)) * kPairs * o.streams * o.max_tokens;
  std::printf("\nCPU per streamed token: direct: attention node(s) %.1f us; through the gateway: attention node(s) %.1f us "
              "+ gateway %.1f us\n",
              1e6 * direct_attention_cpu / tokens, 1e6 * gw_attention_cpu / tokens, 1e6 * gateway_cpu / tokens);
  if (o.repeats > 1) {
    std::printf("\nover %d repeats (min - max): in-process %.1f - %.1f tok/s, %s %.1f - %.1f tok/s, ratio %.3f - %.3f, "
                "overhead %.1f - %.1f us (decode dispatches %.1f - %.1f us)\n",
                ratio.n, local_tok.lo, local_tok.hi, remote_name.c_str(), remote_tok.lo, remote_tok.hi, ratio.lo, ratio.hi,
                overhead.lo, overhead.hi, decode_overhead.lo, decode_overhead.hi);
    std::printf("gateway / direct, each repeat's median (min - max): decode tok/s %.3f - %.3f, ITL p50 %.3f - %.3f; "
                "median of all %zu pairs: %.3f, ITL p50 %.3f\n",
                gw_tok.lo, gw_tok.hi, gw_itl.lo, gw_itl.hi, all_pair_tok.size(), Percentile(all_pair_tok, 0.5),
                Percentile(all_pair_itl, 0.5));
  }
  return absl::OkStatus();
}

}  // namespace k3

// k3serve-router: node registration, the versioned expert placement, load aggregation.
//   k3serve-router --model DIR [--host 0.0.0.0] [--grpc-port 50050] [--metrics-port 9150]
#include <cstdio>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/auth.h"
#include "absl/strings/numbers.h"
#include "common/flags.h"
#include "common/grpc_server.h"
#include "common/http_server.h"
#include "common/service.h"
#include "common/signals.h"
#include "common/tls.h"
#include "router/gateway_board.h"
#include "router/router_service.h"

ABSL_FLAG(std::string, model, "", "model directory (only config.json is read)");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(int, grpc_port, 50050, "gRPC port (0: pick one)");
ABSL_FLAG(int, metrics_port, 9150, "Prometheus /metrics port (0: pick one, -1: off)");
ABSL_FLAG(uint64_t, first_version, 0, "first placement version (0: the wall clock in microseconds, above any earlier router's)");
ABSL_FLAG(std::string, ready_file, "", "if set, write \"grpc_port metrics_port\" here once serving");
ABSL_FLAG(double, placement_timeout_s, 30.0,
          "a placement change whose new slots are not ready within this is abandoned (serving stays on the old one)");
ABSL_FLAG(int, placement_settle_ms, 50, "wait this long after a node joins or leaves before re-placing (bursts become one change)");
ABSL_FLAG(double, redundancy, 0.0, "redundant expert slots per MoE layer, as a fraction of the experts (replicas of hot experts)");
ABSL_FLAG(double, load_interval, 1.0, "seconds per step of the per-expert load EMA (and of the rebalance check)");
ABSL_FLAG(double, rebalance_threshold, 1.15, "max/mean expert-node load above which the router rebalances ...");
ABSL_FLAG(int, rebalance_after, 3, "... for this many load intervals in a row (0: only on demand)");
ABSL_FLAG(std::string, routing_mode, "frozen",
          "frozen: the checkpoint's bias (exact model semantics); adaptive: plus the quantile-balancing estimate, refreshed every load interval");
ABSL_FLAG(double, qb_max_step, 0.02, "adaptive routing: largest change of one expert's bias per load interval");
ABSL_FLAG(std::vector<std::string>, expert_metrics_layers, {},
          "MoE layers (comma-separated) that get per-expert k3serve_expert_tokens_total series; keep it short");

int main(int argc, char** argv) {
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  k3::InitServiceProcess();
  auto config = k3::LoadModelConfig(absl::GetFlag(FLAGS_model));
  if (!config.ok()) {
    std::fprintf(stderr, "k3serve-router: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  if (auto s = k3::auth::LoadFromFlags(); !s.ok()) {
    std::fprintf(stderr, "k3serve-router: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  // The control plane: mutual TLS when a CA is given. Our own client side (to expert nodes) too.
  auto creds = k3::tls::ServerCredentialsFromFlags(/*mutual=*/true);
  const absl::Status client_creds = k3::tls::ChannelCredentialsFromFlags().status();
  if (!creds.ok() || !client_creds.ok()) {
    std::fprintf(stderr, "k3serve-router: %s\n", std::string((creds.ok() ? client_creds : creds.status()).message()).c_str());
    return 2;
  }
  k3::tls::ReloadOnSighup("k3serve-router");
  k3::metrics::Registry registry;
  k3::router::RouterOptions ropt;
  ropt.placement_timeout = absl::Seconds(absl::GetFlag(FLAGS_placement_timeout_s));
  ropt.settle = absl::Milliseconds(absl::GetFlag(FLAGS_placement_settle_ms));
  ropt.eplb.redundancy = absl::GetFlag(FLAGS_redundancy);
  ropt.load_interval = absl::Seconds(absl::GetFlag(FLAGS_load_interval));
  ropt.rebalance_threshold = absl::GetFlag(FLAGS_rebalance_threshold);
  ropt.rebalance_after = absl::GetFlag(FLAGS_rebalance_after);
  auto bad = [](const char* flag, const char* why) {
    std::fprintf(stderr, "k3serve-router: --%s %s\n", flag, why);
    return 2;
  };
  if (!(ropt.placement_timeout > absl::ZeroDuration())) return bad("placement-timeout-s", "must be > 0");
  if (ropt.settle < absl::ZeroDuration()) return bad("placement-settle-ms", "must be >= 0");
  if (!(ropt.eplb.redundancy >= 0 && ropt.eplb.redundancy <= k3::router::kMaxRedundancy))
    return bad("redundancy", "must be in [0, 4]");
  if (!(ropt.load_interval > absl::ZeroDuration())) return bad("load-interval", "must be > 0");
  if (!(ropt.rebalance_threshold >= 1)) return bad("rebalance-threshold", "must be >= 1");
  if (ropt.rebalance_after < 0) return bad("rebalance-after", "must be >= 0");
  const std::string mode = absl::GetFlag(FLAGS_routing_mode);
  if (mode != "frozen" && mode != "adaptive") return bad("routing-mode", "must be frozen or adaptive");
  ropt.adaptive = mode == "adaptive";
  ropt.qb_max_step = absl::GetFlag(FLAGS_qb_max_step);
  if (!(ropt.qb_max_step > 0)) return bad("qb-max-step", "must be > 0");
  for (const std::string& l : absl::GetFlag(FLAGS_expert_metrics_layers)) {
    int64_t layer = -1;
    if (!absl::SimpleAtoi(l, &layer) || layer < 0 || layer >= config->num_layers || config->mlp[layer] != k3::Mlp::kMoe)
      return bad("expert-metrics-layers", ("lists \"" + l + "\", which is not a MoE layer of the model").c_str());
    ropt.expert_metrics_layers.push_back(layer);
  }
  ropt.first_version = absl::GetFlag(FLAGS_first_version);
  k3::router::RouterService service(*config, registry, ropt);
  k3::router::AttentionBoardService board;
  auto grpc = k3::StartGrpcServer(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_grpc_port)), {&service, &board},
                                  *creds);
  if (!grpc.ok()) {
    std::fprintf(stderr, "k3serve-router: %s\n", std::string(grpc.status().message()).c_str());
    return 2;
  }
  auto h = k3::StartMetricsServer(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_metrics_port), registry);
  if (!h.ok()) {
    std::fprintf(stderr, "k3serve-router: metrics: %s\n", std::string(h.status().message()).c_str());
    return 2;
  }
  std::unique_ptr<k3::HttpServer> http = std::move(*h);
  if (http) {
    // Per-expert load is too many series for Prometheus (DESIGN §4): it lives here.
    http->Handle("GET", "/admin/expert_load", [&service](const k3::HttpRequest&) {
      return k3::HttpResponse{200, "application/json", service.ExpertLoadJson().dump()};
    });
    // An EPLB re-placement over the measured load, through the placement-change protocol.
    http->Handle("POST", "/admin/rebalance", [&service](const k3::HttpRequest&) {
      service.RequestRebalance();
      return k3::HttpResponse{202, "application/json", "{\"rebalance\": \"requested\"}"};
    });
  }
  grpc->SetServing(true);
  std::fprintf(stderr, "k3serve-router: serving gRPC on port %d, metrics on port %d\n", grpc->port, http ? http->port() : -1);
  k3::WriteReadyFile(absl::GetFlag(FLAGS_ready_file), absl::StrCat(grpc->port, " ", http ? http->port() : -1));
  while (!k3::WaitForShutdown(absl::Seconds(1))) {
  }
  std::fprintf(stderr, "k3serve-router: shutting down\n");
  service.Stop();
  grpc->Shutdown(absl::Seconds(2));
  return 0;
}

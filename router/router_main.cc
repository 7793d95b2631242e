// k3serve-router: node registration, the versioned expert placement, load aggregation.
//   k3serve-router --model DIR [--host 0.0.0.0] [--grpc-port 50050] [--metrics-port 9150]
#include <cstdio>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/auth.h"
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
  k3::router::RouterService service(*config, registry, absl::GetFlag(FLAGS_first_version));
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
      return k3::HttpResponse{200, "application/json", nlohmann::json(service.ExpertLoad()).dump()};
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

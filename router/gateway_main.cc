// k3serve-gateway: the public endpoint in front of the attention pool.
//   k3serve-gateway --router HOST:PORT [--host 0.0.0.0] [--grpc-port 50060] [--metrics-port 9160]
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/flags.h"
#include "common/grpc_server.h"
#include "common/service.h"
#include "common/signals.h"
#include "common/auth.h"
#include "common/tls.h"
#include "router/gateway.h"

ABSL_FLAG(std::string, router, "127.0.0.1:50050", "router gRPC address (the board of attention nodes)");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(int, grpc_port, 50060, "public gRPC port (0: pick one)");
ABSL_FLAG(int, metrics_port, 9160, "Prometheus /metrics port (0: pick one, -1: off)");
ABSL_FLAG(int, refresh_ms, 200, "how often the attention nodes' load and health are read");
ABSL_FLAG(int, max_attempts, 3, "attention nodes tried for one request before its first token");
ABSL_FLAG(int, connections, 1, "gRPC connections to each attention node, each carrying one multiplexed call (streams take them in turn)");
ABSL_FLAG(std::string, ready_file, "", "if set, write \"grpc_port metrics_port\" here once serving");

int main(int argc, char** argv) {
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  k3::InitServiceProcess();
  if (absl::GetFlag(FLAGS_max_attempts) < 1 || absl::GetFlag(FLAGS_refresh_ms) < 1 || absl::GetFlag(FLAGS_connections) < 1) {
    std::fprintf(stderr, "k3serve-gateway: --max-attempts, --refresh-ms and --connections must be >= 1\n");
    return 2;
  }
  if (auto s = k3::auth::LoadFromFlags(); !s.ok()) {
    std::fprintf(stderr, "k3serve-gateway: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  // Server TLS on the public API; the client side (router, attention nodes) as the flags say.
  auto creds = k3::tls::ServerCredentialsFromFlags(/*mutual=*/false);
  const absl::Status client_creds = k3::tls::ChannelCredentialsFromFlags().status();
  if (!creds.ok() || !client_creds.ok()) {
    std::fprintf(stderr, "k3serve-gateway: %s\n", std::string((creds.ok() ? client_creds : creds.status()).message()).c_str());
    return 2;
  }
  k3::tls::ReloadOnSighup("k3serve-gateway");
  k3::metrics::Registry registry;
  k3::router::GatewayOptions opt;
  opt.router_address = absl::GetFlag(FLAGS_router);
  opt.refresh = absl::Milliseconds(absl::GetFlag(FLAGS_refresh_ms));
  opt.max_attempts = absl::GetFlag(FLAGS_max_attempts);
  opt.connections = absl::GetFlag(FLAGS_connections);
  k3::router::Gateway gateway(opt, registry);
  std::unique_ptr<grpc::ServerCompletionQueue> cq;  // Generate's and Health's (asynchronous)
  auto grpc = k3::StartGrpcServer(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_grpc_port)),
                                  {&gateway, &gateway.health()}, *creds, [&](grpc::ServerBuilder& b) {
                                    cq = b.AddCompletionQueue();
                                    b.SetOption(gateway.health().BuilderOption());
                                  });
  if (!grpc.ok()) {
    std::fprintf(stderr, "k3serve-gateway: %s\n", std::string(grpc.status().message()).c_str());
    return 2;
  }
  gateway.Serve(std::move(cq));
  auto http = k3::StartMetricsServer(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_metrics_port), registry);
  if (!http.ok()) {
    std::fprintf(stderr, "k3serve-gateway: metrics: %s\n", std::string(http.status().message()).c_str());
    return 2;
  }
  const int metrics_port = *http ? (*http)->port() : -1;
  std::fprintf(stderr, "k3serve-gateway: gRPC on port %d, metrics on port %d, router %s\n", grpc->port, metrics_port,
               opt.router_address.c_str());
  k3::WriteReadyFile(absl::GetFlag(FLAGS_ready_file), absl::StrCat(grpc->port, " ", metrics_port));
  // SERVING while some attention node is.
  bool serving = false;
  while (!k3::WaitForShutdown(absl::Milliseconds(100))) {
    const bool now = gateway.serving_nodes() > 0;
    if (now != serving) grpc->SetServing(now);
    serving = now;
  }
  std::fprintf(stderr, "k3serve-gateway: shutting down\n");
  grpc->Shutdown(absl::Seconds(5));
  gateway.Stop();
  return 0;
}

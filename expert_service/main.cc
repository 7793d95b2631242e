// k3serve-expert: an expert node (DESIGN §3).
//   k3serve-expert --model DIR --router HOST:PORT [--host 0.0.0.0 --advertise-host 127.0.0.1]
//                  [--grpc-port 0 --data-port 0 --metrics-port 0] [--batch-window-us 200]
#include <unistd.h>

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/auth.h"
#include "common/flags.h"
#include "common/grpc_server.h"
#include "common/http_server.h"
#include "common/service.h"
#include "common/signals.h"
#include "common/tls.h"
#include "expert_service/expert_node.h"
#include "router/router_client.h"
#include "router/shm_transport.h"
#include "router/ucx_transport.h"

ABSL_FLAG(std::string, model, "", "model directory");
ABSL_FLAG(std::string, router, "127.0.0.1:50050", "router gRPC address");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(std::string, advertise_host, "127.0.0.1", "address other nodes use to reach this one");
ABSL_FLAG(int, grpc_port, 0, "admin gRPC port (0: pick one)");
ABSL_FLAG(int, data_port, 0, "UCX data-plane port (0: pick one)");
ABSL_FLAG(int, metrics_port, 0, "Prometheus /metrics port (0: pick one, -1: off)");
ABSL_FLAG(std::string, node_id, "", "unique node id (default: expert-<host>-<pid>)");
ABSL_FLAG(int, batch_window_us, 200, "how long to wait for more rows before running a batch");
ABSL_FLAG(double, drain_seconds, 2.0, "on SIGTERM, keep answering this long after leaving the placement");
ABSL_FLAG(double, leave_timeout_seconds, 30.0,
          "on SIGTERM, wait this long for the router to move this node's experts elsewhere before leaving");
ABSL_FLAG(int32_t, slots, 0, "most (layer, expert) slots this node holds for one placement (0: no limit)");
ABSL_FLAG(std::string, device, "cpu", "where the experts run: cpu, or cuda (CUDA builds)");
ABSL_FLAG(std::string, data_plane, "ucx",
          "ucx (any host; UCX_TLS / UCX_NET_DEVICES apply), or shm (shared memory: attention nodes on this host only)");
ABSL_FLAG(std::string, ready_file, "", "if set, write \"grpc_port metrics_port data_port\" here once serving");

namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "k3serve-expert: %s: %s\n", what.c_str(), std::string(s.message()).c_str());
  return 2;
}

std::string PortOf(const std::string& address) { return address.substr(address.rfind(':') + 1); }

}  // namespace

int main(int argc, char** argv) {
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  k3::InitServiceProcess();
  std::string node_id = absl::GetFlag(FLAGS_node_id);
  if (node_id.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    node_id = absl::StrCat("expert-", host, "-", getpid());
  }
  if (auto s = k3::auth::LoadFromFlags(); !s.ok()) return Fail("auth", s);
  auto creds = k3::tls::ServerCredentialsFromFlags(/*mutual=*/true);
  if (!creds.ok()) return Fail("TLS", creds.status());
  if (auto c = k3::tls::ChannelCredentialsFromFlags(); !c.ok()) return Fail("TLS", c.status());
  k3::tls::ReloadOnSighup("k3serve-expert");
  auto config = k3::LoadModelConfig(absl::GetFlag(FLAGS_model));
  if (!config.ok()) return Fail("config", config.status());
  auto ckpt = k3::Checkpoint::Open(absl::GetFlag(FLAGS_model));
  if (!ckpt.ok()) return Fail("checkpoint", ckpt.status());

  k3::metrics::Registry registry;
  k3::ExpertNodeOptions opt;
  opt.node_id = node_id;
  opt.batch_window = absl::Microseconds(absl::GetFlag(FLAGS_batch_window_us));
  opt.device = absl::GetFlag(FLAGS_device);
  opt.node_token = k3::auth::NodeToken();
  opt.slot_capacity = absl::GetFlag(FLAGS_slots);
  if (opt.slot_capacity < 0) return Fail("--slots", absl::InvalidArgumentError("--slots must be >= 0"));
#ifdef K3SERVE_HAVE_CUDA
  if (opt.device != "cpu" && opt.device != "cuda")
    return Fail("--device", absl::InvalidArgumentError("--device must be \"cpu\" or \"cuda\", got \"" + opt.device + "\""));
#else
  if (opt.device != "cpu")
    return Fail("--device", absl::InvalidArgumentError("--device: only \"cpu\" is available in this build (no CUDA)"));
#endif
  k3::ExpertNode node(*config, std::make_shared<const k3::Checkpoint>(std::move(*ckpt)), opt, registry);

  const std::string data_plane = absl::GetFlag(FLAGS_data_plane);
  if (data_plane != "ucx" && data_plane != "shm")
    return Fail("--data-plane", absl::InvalidArgumentError("--data-plane must be \"ucx\" or \"shm\", got \"" + data_plane + "\""));
  k3::dataplane::UcxOptions ucx;
  ucx.host = absl::GetFlag(FLAGS_host);
  auto transport = data_plane == "shm" ? k3::dataplane::NewShmTransport() : k3::dataplane::NewUcxTransport(ucx);
  if (!transport.ok()) return Fail(data_plane, transport.status());
  if (auto s = node.Listen(**transport, absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_data_port))); !s.ok())
    return Fail("data plane", s);
  auto grpc = k3::StartGrpcServer(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_grpc_port)), {&node}, *creds);
  if (!grpc.ok()) return Fail("gRPC", grpc.status());
  auto h = k3::StartMetricsServer(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_metrics_port), registry);
  if (!h.ok()) return Fail("metrics", h.status());
  std::unique_ptr<k3::HttpServer> http = std::move(*h);
  grpc->SetServing(true);

  const std::string host = absl::GetFlag(FLAGS_advertise_host);
  const std::string data_port = PortOf(node.data_address());
  k3::v1::RegisterNodeRequest self;
  self.set_role(k3::v1::NODE_ROLE_EXPERT);
  self.set_node_id(node_id);
  self.set_grpc_address(absl::StrCat(host, ":", grpc->port));
  self.set_ucx_address(absl::StrCat(data_plane == "shm" ? k3::dataplane::kShmScheme : "", host, ":", data_port));
  self.set_slot_capacity(opt.slot_capacity);
  auto router = std::make_unique<k3::router::RouterClient>(absl::GetFlag(FLAGS_router), self, [](const k3::v1::Placement&) {});
  std::fprintf(stderr, "k3serve-expert %s: data plane %s, gRPC %d, metrics %d\n", node_id.c_str(),
               self.ucx_address().c_str(), grpc->port, http ? http->port() : -1);
  k3::WriteReadyFile(absl::GetFlag(FLAGS_ready_file), absl::StrCat(grpc->port, " ", http ? http->port() : -1, " ", data_port));
  while (!k3::WaitForShutdown(absl::Seconds(1))) {
  }
  // Leave the placement first: the router moves our experts to the other nodes, publishes, and
  // answers once no attention node has rows in flight on a placement with us. Then keep answering
  // stragglers a little longer, and stop.
  std::fprintf(stderr, "k3serve-expert %s: leaving the placement\n", node_id.c_str());
  if (auto s = router->Leave(absl::Seconds(absl::GetFlag(FLAGS_leave_timeout_seconds))); !s.ok())
    std::fprintf(stderr, "k3serve-expert %s: leaving without the router's answer: %s\n", node_id.c_str(),
                 std::string(s.message()).c_str());
  router.reset();
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_drain_seconds)));
  node.Stop();
  grpc->Shutdown(absl::Seconds(1));
  return 0;
}

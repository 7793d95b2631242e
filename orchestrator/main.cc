// k3serve-orchestrator: sizes the attention and expert pools (DESIGN §3).
//   k3serve-orchestrator --router HOST:PORT --backend local --model DIR [--attention 1 --experts 2]
//   k3serve-orchestrator --router HOST:PORT --backend kubernetes [--k8s-namespace NS --dry-run]
#include <unistd.h>

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "common/grpc_server.h"
#include "common/service.h"
#include "common/signals.h"
#include "common/auth.h"
#include "common/tls.h"
#include "engine/config.h"
#include "orchestrator/kubernetes_backend.h"
#include "orchestrator/local_backend.h"
#include "orchestrator/orchestrator.h"

ABSL_FLAG(std::string, router, "127.0.0.1:50050", "router gRPC address");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(int, grpc_port, 50070, "admin gRPC port, k3serve.v1.Orchestrator (0: pick one)");
ABSL_FLAG(int, metrics_port, 9170, "Prometheus /metrics port (0: pick one, -1: off)");
ABSL_FLAG(std::string, ready_file, "", "if set, write \"grpc_port metrics_port\" here once serving");
ABSL_FLAG(std::string, backend, "local", "local (processes on this machine) or kubernetes (/scale subresources)");
ABSL_FLAG(double, interval, 5.0, "seconds between reconciles");
ABSL_FLAG(int, attention, 1, "initial attention replicas");
ABSL_FLAG(int, experts, 2, "initial expert replicas");
ABSL_FLAG(int, attention_min, 1, "fewest attention replicas");
ABSL_FLAG(int, attention_max, 8, "most attention replicas");
ABSL_FLAG(int, experts_min, 1, "fewest expert replicas");
ABSL_FLAG(int, experts_max, 16, "most expert replicas");
ABSL_FLAG(double, scale_up_at, 0.8, "pressure (1 = at target) above which a pool grows");
ABSL_FLAG(double, scale_down_at, 0.3, "pressure below which a pool shrinks");
ABSL_FLAG(int, sustain, 3, "intervals a pressure must stay beyond a threshold before the pool changes");
ABSL_FLAG(double, cooldown, 30.0, "seconds after a pool's change before it may change again");
ABSL_FLAG(double, itl_target, 0.2, "inter-token latency (seconds) an attention node should stay under");
ABSL_FLAG(double, attention_target_requests, 16, "running + waiting requests per attention node at full load");
ABSL_FLAG(int64_t, attention_memory_budget, 0, "per-sequence state bytes per attention node at full load (0: not watched)");
ABSL_FLAG(double, expert_busy_target, 0.7, "busy ratio per expert node at full load");
ABSL_FLAG(int64_t, expert_memory_budget, 0, "slot bytes per expert node at full load (0: not watched; needs --model)");
ABSL_FLAG(bool, balance, true, "move the expert pool towards the balanced attention:expert ratio when both pools have headroom");
ABSL_FLAG(std::string, model, "", "model directory (local backend; slot sizes)");
ABSL_FLAG(std::string, bin_dir, "", "local: where k3serve-attention and k3serve-expert are (default: next to this binary)");
ABSL_FLAG(std::string, work_dir, "", "local: logs and ready files (default: a new temp dir)");
ABSL_FLAG(std::string, attention_args, "", "local: extra flags for attention nodes, space separated");
ABSL_FLAG(std::string, expert_args, "", "local: extra flags for expert nodes, space separated");
ABSL_FLAG(double, drain_timeout, 30.0, "local: attention nodes' --drain-timeout (seconds)");
ABSL_FLAG(std::string, k8s_api, "", "kubernetes: API server https://HOST:PORT (default: from the pod's environment)");
ABSL_FLAG(std::string, k8s_token_file, "/var/run/secrets/kubernetes.io/serviceaccount/token", "kubernetes: bearer token");
ABSL_FLAG(std::string, k8s_ca_file, "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt", "kubernetes: API server CA");
ABSL_FLAG(std::string, k8s_namespace, "", "kubernetes: namespace (default: the service account's)");
ABSL_FLAG(std::string, k8s_attention_deployment, "k3serve-attention", "kubernetes: the attention pool's Deployment");
ABSL_FLAG(std::string, k8s_expert_statefulset, "k3serve-expert", "kubernetes: the expert pool's StatefulSet");
ABSL_FLAG(bool, dry_run, false, "kubernetes: print the PATCHes instead of sending them");

namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "k3serve-orchestrator: %s: %s\n", what.c_str(), std::string(s.message()).c_str());
  return 2;
}

std::string SelfDir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  std::string exe(buf, n > 0 ? n : 0);
  return exe.substr(0, exe.rfind('/'));
}

}  // namespace

int main(int argc, char** argv) {
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  k3::InitServiceProcess();
  namespace o = k3::orchestrator;
  o::OrchestratorOptions opt;
  opt.router_address = absl::GetFlag(FLAGS_router);
  if (absl::GetFlag(FLAGS_interval) <= 0) return Fail("--interval", absl::InvalidArgumentError("--interval must be > 0"));
  opt.interval = absl::Seconds(absl::GetFlag(FLAGS_interval));
  for (auto [pol, lo, hi, name] : {std::tuple{&opt.attention, absl::GetFlag(FLAGS_attention_min), absl::GetFlag(FLAGS_attention_max), "attention"},
                                   std::tuple{&opt.experts, absl::GetFlag(FLAGS_experts_min), absl::GetFlag(FLAGS_experts_max), "experts"}}) {
    if (lo < 1 || hi < lo)
      return Fail("flags", absl::InvalidArgumentError(absl::StrCat("--", name, "-min must be >= 1 and <= --", name, "-max, got ", lo, " and ", hi)));
    pol->min_replicas = lo;
    pol->max_replicas = hi;
    pol->scale_up_at = absl::GetFlag(FLAGS_scale_up_at);
    pol->scale_down_at = absl::GetFlag(FLAGS_scale_down_at);
    pol->sustain = absl::GetFlag(FLAGS_sustain);
    pol->cooldown = absl::Seconds(absl::GetFlag(FLAGS_cooldown));
  }
  if (opt.attention.scale_down_at >= opt.attention.scale_up_at)
    return Fail("flags", absl::InvalidArgumentError("--scale-down-at must be below --scale-up-at"));
  if (opt.attention.sustain < 1) return Fail("flags", absl::InvalidArgumentError("--sustain must be >= 1"));
  if (absl::GetFlag(FLAGS_itl_target) <= 0 || absl::GetFlag(FLAGS_attention_target_requests) <= 0 ||
      absl::GetFlag(FLAGS_expert_busy_target) <= 0)
    return Fail("flags", absl::InvalidArgumentError("--itl-target, --attention-target-requests and --expert-busy-target must be > 0"));
  opt.initial_attention = absl::GetFlag(FLAGS_attention);
  opt.initial_experts = absl::GetFlag(FLAGS_experts);
  opt.itl_target_s = absl::GetFlag(FLAGS_itl_target);
  opt.attention_target_requests = absl::GetFlag(FLAGS_attention_target_requests);
  opt.attention_memory_budget = absl::GetFlag(FLAGS_attention_memory_budget);
  opt.expert_busy_target = absl::GetFlag(FLAGS_expert_busy_target);
  opt.expert_memory_budget = absl::GetFlag(FLAGS_expert_memory_budget);
  opt.balance = absl::GetFlag(FLAGS_balance);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (!model.empty()) {
    auto config = k3::LoadModelConfig(model);
    if (!config.ok()) return Fail("--model", config.status());
    opt.slot_bytes = 3 * config->expert_width() * config->moe_intermediate_size * 4;  // gate, up, down in fp32
  }

  std::unique_ptr<o::Backend> backend;
  const std::string kind = absl::GetFlag(FLAGS_backend);
  if (kind == "local") {
    if (model.empty()) return Fail("--model", absl::InvalidArgumentError("--model is required with --backend local"));
    o::LocalBackendOptions lo;
    lo.bin_dir = absl::GetFlag(FLAGS_bin_dir).empty() ? SelfDir() : absl::GetFlag(FLAGS_bin_dir);
    lo.model = model;
    lo.router_address = opt.router_address;
    lo.work_dir = absl::GetFlag(FLAGS_work_dir);
    if (lo.work_dir.empty()) {
      char tmpl[] = "/tmp/k3serve-orchestrator-XXXXXX";
      if (::mkdtemp(tmpl) == nullptr) return Fail("--work-dir", absl::InternalError("mkdtemp failed"));
      lo.work_dir = tmpl;
    }
    lo.attention_args = absl::StrSplit(absl::GetFlag(FLAGS_attention_args), ' ', absl::SkipEmpty());
    lo.expert_args = absl::StrSplit(absl::GetFlag(FLAGS_expert_args), ' ', absl::SkipEmpty());
    lo.drain_timeout_s = absl::GetFlag(FLAGS_drain_timeout);
    backend = std::make_unique<o::LocalBackend>(lo);
  } else if (kind == "kubernetes") {
    o::KubernetesOptions ko;
    ko.api = absl::GetFlag(FLAGS_k8s_api);
    ko.token_file = absl::GetFlag(FLAGS_k8s_token_file);
    ko.ca_file = absl::GetFlag(FLAGS_k8s_ca_file);
    ko.namespace_ = absl::GetFlag(FLAGS_k8s_namespace);
    ko.attention_deployment = absl::GetFlag(FLAGS_k8s_attention_deployment);
    ko.expert_statefulset = absl::GetFlag(FLAGS_k8s_expert_statefulset);
    ko.dry_run = absl::GetFlag(FLAGS_dry_run);
    auto k = o::KubernetesBackend::Create(ko);
    if (!k.ok()) return Fail("kubernetes", k.status());
    backend = std::move(*k);
  } else {
    return Fail("--backend", absl::InvalidArgumentError(absl::StrCat("--backend must be local or kubernetes, got \"", kind, "\"")));
  }

  if (auto s = k3::auth::LoadFromFlags(); !s.ok()) {
    std::fprintf(stderr, "k3serve-orchestrator: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  // The admin API is control plane: mutual TLS when a CA is given; the admin identity is ours.
  auto creds = k3::tls::ServerCredentialsFromFlags(/*mutual=*/true);
  const absl::Status client_creds = k3::tls::ChannelCredentialsFromFlags().status();
  if (!creds.ok() || !client_creds.ok()) {
    std::fprintf(stderr, "k3serve-orchestrator: %s\n", std::string((creds.ok() ? client_creds : creds.status()).message()).c_str());
    return 2;
  }
  k3::tls::ReloadOnSighup("k3serve-orchestrator");
  k3::metrics::Registry registry;
  auto orchestrator = std::make_unique<o::Orchestrator>(opt, *backend, registry);
  auto grpc = k3::StartGrpcServer(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_grpc_port)), {orchestrator.get()}, *creds);
  if (!grpc.ok()) return Fail("gRPC", grpc.status());
  auto http = k3::StartMetricsServer(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_metrics_port), registry);
  if (!http.ok()) return Fail("metrics", http.status());
  const int metrics_port = *http ? (*http)->port() : -1;
  grpc->SetServing(true);
  std::fprintf(stderr, "k3serve-orchestrator: %s backend, admin gRPC on port %d, metrics on port %d\n", kind.c_str(),
               grpc->port, metrics_port);
  k3::WriteReadyFile(absl::GetFlag(FLAGS_ready_file), absl::StrCat(grpc->port, " ", metrics_port));
  while (!k3::WaitForShutdown(absl::Seconds(1))) {
  }
  std::fprintf(stderr, "k3serve-orchestrator: shutting down\n");
  grpc->Shutdown(absl::Seconds(2));
  orchestrator.reset();
  backend.reset();  // local: drains and stops the nodes
  return 0;
}

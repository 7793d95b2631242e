// k3serve-attention: an attention node — the public gRPC API, continuous batching, everything but
// the routed experts, which it reaches through the router library (DESIGN §3).
//   k3serve-attention --model DIR --router HOST:PORT [--grpc-port 50051 --metrics-port 9151]
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "attention_service/engine_loop.h"
#include "attention_service/inference_service.h"
#include "attention_service/multiplex_service.h"
#ifdef K3SERVE_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif
#include "common/auth.h"
#include "common/flags.h"
#include "common/grpc_server.h"
#include "common/http_server.h"
#include "common/service.h"
#include "common/signals.h"
#include "common/tls.h"
#include "router/dispatcher.h"
#include "router/load_counter.h"
#include "router/router_client.h"
#include "router/shm_transport.h"
#include "router/ucx_transport.h"
#include "common/safetensors.h"

ABSL_FLAG(std::string, model, "", "model directory");
ABSL_FLAG(std::string, model_name, "", "served model name (default: the model directory's name)");
ABSL_FLAG(std::string, router, "127.0.0.1:50050", "router gRPC address");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(std::string, advertise_host, "127.0.0.1", "address other nodes use to reach this one");
ABSL_FLAG(int, grpc_port, 50051, "public gRPC port (0: pick one)");
ABSL_FLAG(int, metrics_port, 9151, "Prometheus /metrics port (0: pick one, -1: off)");
ABSL_FLAG(std::string, node_id, "", "unique node id (default: attention-<host>-<pid>)");
ABSL_FLAG(int64_t, max_batch_tokens, 2048, "tokens per engine step (decode tokens + prefill chunks)");
ABSL_FLAG(int64_t, max_running, 64, "sequences holding state at once");
ABSL_FLAG(int64_t, admission_window_us, 0,
          "an idle engine waits this long (or until max_running requests are queued) for more requests before its "
          "first step, so that a burst is prefilled together; 0: step at once");
ABSL_FLAG(int64_t, max_waiting, 256, "queued requests beyond which Generate answers RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_context, 0, "prompt + generated tokens per request (0: the model's model_max_length)");
ABSL_FLAG(int32_t, max_tokens_limit, 4096, "largest max_tokens a request may ask for");
ABSL_FLAG(bool, ping_pong, true, "split each step into two micro-batches that overlap expert dispatch");
ABSL_FLAG(bool, ping_pong_adaptive, false,
          "with --ping-pong: split a step only while splitting measures faster than not at its token count (where "
          "the weights outweigh the overlap: a large model, few tokens; not where expert nodes share the host's "
          "cores, whose waits it does not see)");
ABSL_FLAG(int, dispatch_timeout_ms, 0,
          "an expert node that leaves an MoE dispatch unanswered this long is reported and avoided; the dispatch is "
          "retried on a replica, else fails UNAVAILABLE (0: 500 ms above twice the slowest recent round trip)");
ABSL_FLAG(int, dispatch_poll_us, 300,
          "an MoE dispatch's wait polls the shared-memory rings this long for the reply before it sleeps, so that a "
          "reply is taken the moment it lands (0: sleep at once; the poll yields the CPU to any thread waiting for it)");
ABSL_FLAG(int64_t, dispatch_one_node_rows, 64,
          "an MoE dispatch of at most this many rows goes whole to one expert node where one hosts all its experts "
          "(replicas, e.g. the router's --redundancy): one message instead of one per node (0: always spread by load)");
ABSL_FLAG(int64_t, max_prompt_tokens, 32768, "longest prompt accepted (INVALID_ARGUMENT beyond; 0: only --max-context bounds it)");
ABSL_FLAG(std::string, device, "cpu", "compute device: cpu, or cuda (builds with K3SERVE_CUDA)");
ABSL_FLAG(std::string, wire_dtype, "auto",
          "rows and partial sums on the data plane: f32, bf16, or auto (bf16 for a bf16 checkpoint on --device cuda)");
ABSL_FLAG(std::string, ready_file, "", "if set, write \"grpc_port metrics_port\" here once listening");
ABSL_FLAG(double, drain_timeout, 30.0, "on SIGTERM or POST /admin/drain: seconds the requests in flight get to finish");
ABSL_FLAG(double, drain_grace, 0.5, "on a drain: seconds between NOT_SERVING and refusing new requests (gateways see the change)");
ABSL_FLAG(int, load_report_ms, 250, "how often this node's load goes to the router (gateways and the orchestrator read it)");
ABSL_FLAG(double, load_interval, 1.0, "seconds between load reports (per-expert tokens, QB histograms) to the router");
ABSL_FLAG(int64_t, qb_bins, 1000, "bins per expert of the quantile-balancing histograms in the load reports (0: none)");

namespace {

// bf16 where the model computes in bf16 (the GPU model of a bf16 checkpoint): its rows lose nothing
// on a bf16 wire. The CPU engine computes in fp32 whatever the checkpoint, so it keeps f32 rows
// (bf16 would round them, and greedy ids then drift from the in-process engine's).
absl::StatusOr<k3::wire::RowDType> WireDType(const std::string& flag, const std::string& device,
                                             const std::string& model_dir) {
  if (flag == "f32") return k3::wire::RowDType::kF32;
  if (flag == "bf16") return k3::wire::RowDType::kBF16;
  if (flag != "auto") return absl::InvalidArgumentError("--wire-dtype must be f32, bf16 or auto, got \"" + flag + "\"");
  if (device != "cuda") return k3::wire::RowDType::kF32;
  K3_ASSIGN_OR_RETURN(auto ckpt, k3::Checkpoint::Open(model_dir));
  for (const auto& [name, t] : ckpt.tensors())
    if (t.dtype == k3::DType::kF32 || t.dtype == k3::DType::kF16) return k3::wire::RowDType::kF32;
  return k3::wire::RowDType::kBF16;
}

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "k3serve-attention: %s: %s\n", what.c_str(), std::string(s.message()).c_str());
  return 2;
}

// Control-plane calls that must not run on the data plane's thread: failure reports, placement
// acknowledgements (once no dispatch is in flight on an older version), and a load report every
// interval.
class Reporter {
 public:
  Reporter(k3::router::RouterClient& client, k3::router::LoadCountingExecutor& load, k3::router::Dispatcher& dispatcher,
           std::string node_id, absl::Duration interval)
      : client_(client),
        load_(load),
        dispatcher_(dispatcher),
        node_id_(std::move(node_id)),
        interval_(interval),
        thread_([this] { Run(); }) {}
  ~Reporter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void NodeFailed(const std::string& node, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      failures_.emplace_back(node, why);
    }
    cv_.notify_all();
  }
  // The dispatcher switched to `version`.
  void Placed(uint64_t version) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      placed_ = std::max(placed_, version);
    }
    cv_.notify_all();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    absl::Time next_report = absl::Now() + interval_;
    while (!stop_) {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(std::max(next_report - absl::Now(), absl::ZeroDuration())),
                   [&] { return stop_ || !failures_.empty() || placed_ > acked_; });
      auto failures = std::move(failures_);
      failures_.clear();
      const uint64_t placed = placed_;
      lock.unlock();
      for (auto& [node, why] : failures) client_.ReportNodeFailure(node, why);
      if (placed > acked_) {
        // Dispatches end within their timeout, so this wait is bounded too.
        if (dispatcher_.WaitDrained(placed, absl::Seconds(60))) client_.AckPlacement(placed);
        acked_ = placed;
      }
      if (absl::Now() >= next_report) {
        auto report = load_.TakeReport(node_id_);
        if (report.layers_size() > 0) client_.ReportLoad(report);
        next_report = absl::Now() + interval_;
      }
      lock.lock();
    }
  }
  k3::router::RouterClient& client_;
  k3::router::LoadCountingExecutor& load_;
  k3::router::Dispatcher& dispatcher_;
  const std::string node_id_;
  const absl::Duration interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<std::pair<std::string, std::string>> failures_;
  uint64_t placed_ = 0;
  uint64_t acked_ = 0;  // reporter thread only
  std::thread thread_;
};

// Times the engine's waits for the experts: a step's wall time minus this is its attention time.
class WaitTimingExecutor : public k3::ExpertExecutor {
 public:
  explicit WaitTimingExecutor(k3::ExpertExecutor& inner) : inner_(inner) {}
  absl::StatusOr<uint64_t> Submit(const k3::ExpertRequest& r) override { return inner_.Submit(r); }
  absl::Status Wait(uint64_t ticket, float* out) override {
    const absl::Time t0 = absl::Now();
    absl::Status s = inner_.Wait(ticket, out);
    nanos_ += absl::ToInt64Nanoseconds(absl::Now() - t0);
    return s;
  }
  double TakeSeconds() { return static_cast<double>(nanos_.exchange(0)) * 1e-9; }

 private:
  k3::ExpertExecutor& inner_;
  std::atomic<int64_t> nanos_{0};
};

// This node's load on the router's board, every interval until destroyed.
class LoadReporter {
 public:
  using Fill = std::function<void(k3::v1::AttentionLoad*)>;
  LoadReporter(const std::string& router, absl::Duration interval, Fill fill)
      : stub_(k3::v1::AttentionBoard::NewStub(k3::tls::NewChannel(router))),
        interval_(interval), fill_(std::move(fill)), thread_([this] { Run(); }) {}
  ~LoadReporter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Reports now (a drain must show before the next interval).
  void Kick() { cv_.notify_all(); }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      k3::v1::AttentionLoad load;
      fill_(&load);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      k3::auth::AddNodeCredentials(&ctx);
      k3::v1::ReportAttentionLoadResponse resp;
      stub_->ReportAttentionLoad(&ctx, load, &resp);
      lock.lock();
      cv_.wait_for(lock, absl::ToChronoNanoseconds(interval_));
    }
  }
  std::unique_ptr<k3::v1::AttentionBoard::Stub> stub_;
  const absl::Duration interval_;
  const Fill fill_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  k3::InitServiceProcess();
  const std::string device = absl::GetFlag(FLAGS_device);
#ifdef K3SERVE_HAVE_CUDA
  if (device != "cpu" && device != "cuda")
    return Fail("--device", absl::InvalidArgumentError("--device must be \"cpu\" or \"cuda\", got \"" + device + "\""));
#else
  if (device != "cpu")
    return Fail("--device", absl::InvalidArgumentError("--device: only \"cpu\" is available in this build (no CUDA)"));
#endif
  std::string node_id = absl::GetFlag(FLAGS_node_id);
  if (node_id.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    node_id = absl::StrCat("attention-", host, "-", getpid());
  }
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  std::string model_name = absl::GetFlag(FLAGS_model_name);
  if (model_name.empty()) {
    std::string d = model_dir;
    while (!d.empty() && d.back() == '/') d.pop_back();
    model_name = d.substr(d.rfind('/') + 1);
  }

  if (auto s = k3::auth::LoadFromFlags(); !s.ok()) return Fail("auth", s);
  // The public API: server TLS (clients are not asked for certificates; API keys authenticate them).
  auto creds = k3::tls::ServerCredentialsFromFlags(/*mutual=*/false);
  if (!creds.ok()) return Fail("TLS", creds.status());
  if (auto c = k3::tls::ChannelCredentialsFromFlags(); !c.ok()) return Fail("TLS", c.status());
  k3::tls::ReloadOnSighup("k3serve-attention");
  k3::metrics::Registry registry;
  // The port and health (NOT_SERVING) come up first, so that orchestration sees the node while it
  // loads; requests get UNAVAILABLE until the engine is attached.
  k3::InferenceOptions iopt;
  iopt.model_name = model_name;
  iopt.max_tokens_limit = absl::GetFlag(FLAGS_max_tokens_limit);
  std::atomic<k3::router::Dispatcher*> experts_ready{nullptr};  // set once the engine is attached
  iopt.ready = [&experts_ready] {
    k3::router::Dispatcher* d = experts_ready.load();
    return d != nullptr && d->ready();
  };
  std::atomic<k3::router::LoadCountingExecutor*> routing{nullptr};  // set once the executor exists
  iopt.routing = [&routing] {
    k3::router::LoadCountingExecutor* c = routing.load();
    return c ? c->routing() : std::pair<std::string, uint64_t>{"frozen", 0};
  };
  k3::InferenceService service(iopt, registry);
  k3::MultiplexService multiplex(service);  // the gateway's streams
  std::unique_ptr<grpc::ServerCompletionQueue> cq;  // Generate's (asynchronous)
  auto grpc = k3::StartGrpcServer(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_grpc_port)),
                                  {&service, &multiplex}, *creds, [&cq](grpc::ServerBuilder& b) { cq = b.AddCompletionQueue(); });
  if (!grpc.ok()) return Fail("gRPC", grpc.status());
  service.Serve(std::move(cq));
  multiplex.Start();
  auto h = k3::StartMetricsServer(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_metrics_port), registry);
  if (!h.ok()) return Fail("metrics", h.status());
  std::unique_ptr<k3::HttpServer> http = std::move(*h);
  k3::WriteReadyFile(absl::GetFlag(FLAGS_ready_file), absl::StrCat(grpc->port, " ", http ? http->port() : -1));
  k3::EngineOptions eopt;
  eopt.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  eopt.max_running = absl::GetFlag(FLAGS_max_running);
  eopt.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  eopt.max_context = absl::GetFlag(FLAGS_max_context);
  eopt.max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens);
  eopt.max_new_tokens_limit = absl::GetFlag(FLAGS_max_tokens_limit);
  // Everything but the routed experts, on the CPU or the GPU.
  auto load_start = absl::Now();
  std::unique_ptr<k3::Model> cpu_model;
#ifdef K3SERVE_HAVE_CUDA
  std::unique_ptr<k3::cuda::CudaModel> gpu_model;
  if (device == "cuda") {
    auto cfg = k3::LoadModelConfig(model_dir);
    if (!cfg.ok()) return Fail("model", cfg.status());
    // The device holds each slot's whole MLA cache: the context must be bounded.
    if (eopt.max_context <= 0) eopt.max_context = std::min<int64_t>(cfg->max_position > 0 ? cfg->max_position : 8192, 8192);
    k3::cuda::CudaModelOptions copt;
    copt.max_seqs = eopt.max_running;
    copt.max_context = eopt.max_context;
    copt.max_batch_tokens = eopt.max_batch_tokens;
    copt.routed_experts = false;
    auto m = k3::cuda::CudaModel::Load(model_dir, copt);
    if (!m.ok()) return Fail("model", m.status());
    gpu_model = std::move(*m);
  }
#endif
  if (device == "cpu") {
    auto m = k3::Model::Load(model_dir, k3::WeightFilter::AttentionOnly());
    if (!m.ok()) return Fail("model", m.status());
    cpu_model = std::move(*m);
  }
#ifdef K3SERVE_HAVE_CUDA
  const k3::ModelConfig& config = gpu_model ? gpu_model->config() : cpu_model->config();
#else
  const k3::ModelConfig& config = cpu_model->config();
#endif
  std::fprintf(stderr, "k3serve-attention %s: loaded %s on %s in %.0f ms\n", node_id.c_str(), model_dir.c_str(),
               device.c_str(), absl::ToDoubleMilliseconds(absl::Now() - load_start));

  // Expert nodes registered as "shm://host:port" are reached over shared memory, the others over UCX.
  k3::dataplane::UcxOptions ucx_options;
  ucx_options.host = absl::GetFlag(FLAGS_host);
  auto ucx = k3::dataplane::NewUcxTransport(ucx_options);
  if (!ucx.ok()) return Fail("UCX", ucx.status());
  auto shm = k3::dataplane::NewShmTransport();
  if (!shm.ok()) return Fail("shared memory", shm.status());
  auto transport = k3::dataplane::NewSchemeTransport(std::move(*shm), std::move(*ucx));
  auto wire_dtype = WireDType(absl::GetFlag(FLAGS_wire_dtype), device, model_dir);
  if (!wire_dtype.ok()) return Fail("--wire-dtype", wire_dtype.status());

  auto* dispatch_seconds = k3::metrics::Must(registry.AddHistogram(
      "k3serve_dispatch_seconds", "Round trip of one MoE dispatch part to an expert node.",
      k3::metrics::ExponentialBuckets(1e-5, 2, 20), {"node"}));
  auto* dispatch_bytes = k3::metrics::Must(
      registry.AddCounter("k3serve_dispatch_bytes_total", "Data-plane bytes per expert node.", {"node", "direction"}));
  auto* node_failures = k3::metrics::Must(
      registry.AddCounter("k3serve_expert_node_unreachable_total", "Expert nodes this attention node lost.", {"node"}));
  std::atomic<Reporter*> reporter{nullptr};
  auto* dispatch_stages = k3::metrics::Must(registry.AddHistogram(
      "k3serve_dispatch_stage_seconds",
      "One MoE dispatch part by stage: pack, out, window, compute, back, unpack (out and back on one host only); "
      "phase: decode (every row a sequence's one new token) or prefill (any prompt rows).",
      k3::metrics::ExponentialBuckets(1e-6, 2, 24), {"stage", "phase"}));
  k3::metrics::Histogram* stage_h[2][6];  // [decode][stage]
  const char* stage_names[6] = {"pack", "out", "window", "compute", "back", "unpack"};
  for (int phase = 0; phase < 2; ++phase) {
    for (int i = 0; i < 6; ++i)
      stage_h[phase][i] = &dispatch_stages->WithLabels({stage_names[i], phase ? "decode" : "prefill"});
  }
  k3::router::DispatcherOptions dopt;
  dopt.dtype = *wire_dtype;
  dopt.on_stages = [&](const std::string&, const k3::router::DispatchStages& st) {
    const absl::Duration d[] = {st.pack, st.out, st.window, st.compute, st.back, st.unpack};
    for (int i = 0; i < 6; ++i) stage_h[st.decode][i]->Observe(std::max(0.0, absl::ToDoubleSeconds(d[i])));
  };
  dopt.timeout = absl::Milliseconds(absl::GetFlag(FLAGS_dispatch_timeout_ms));
  dopt.poll = absl::Microseconds(absl::GetFlag(FLAGS_dispatch_poll_us));
  dopt.one_node_max_rows = absl::GetFlag(FLAGS_dispatch_one_node_rows);
  dopt.node_token = k3::auth::NodeToken();
  dopt.on_part = [&](const std::string& node, size_t out, size_t in, absl::Duration took) {
    dispatch_seconds->WithLabels({node}).Observe(absl::ToDoubleSeconds(took));
    dispatch_bytes->WithLabels({node, "out"}).Inc(static_cast<double>(out));
    dispatch_bytes->WithLabels({node, "in"}).Inc(static_cast<double>(in));
  };
  dopt.on_node_failure = [&](const std::string& node, const absl::Status& why) {
    std::fprintf(stderr, "k3serve-attention: expert node %s failed: %s\n", node.c_str(), std::string(why.message()).c_str());
    node_failures->WithLabels({node}).Inc();
    if (Reporter* r = reporter.load()) r->NodeFailed(node, std::string(why.message()));
  };
  k3::router::Dispatcher dispatcher(config, *transport, dopt);
  if (absl::GetFlag(FLAGS_qb_bins) < 0) return Fail("--qb-bins", absl::InvalidArgumentError("--qb-bins must be >= 0"));
  if (const int w = absl::GetFlag(FLAGS_dispatch_poll_us); w < 0 || w > 1000000)
    return Fail("--dispatch-poll-us",
                absl::InvalidArgumentError(absl::StrCat("--dispatch-poll-us must be in [0, 1000000], got ", w)));
  if (absl::GetFlag(FLAGS_dispatch_one_node_rows) < 0)
    return Fail("--dispatch-one-node-rows", absl::InvalidArgumentError(absl::StrCat(
                                                "--dispatch-one-node-rows must be >= 0, got ",
                                                absl::GetFlag(FLAGS_dispatch_one_node_rows))));
  if (const int64_t w = absl::GetFlag(FLAGS_admission_window_us); w < 0 || w > 1000000)
    return Fail("--admission-window-us",
                absl::InvalidArgumentError(absl::StrCat("--admission-window-us must be in [0, 1000000], got ", w)));
  k3::router::LoadCountingExecutor counted(dispatcher, config, absl::GetFlag(FLAGS_qb_bins));
  routing = &counted;
  WaitTimingExecutor timed(counted);

  auto* placement_version = &k3::metrics::Must(registry.AddGauge("k3serve_placement_version", "Expert placement in use."))->WithLabels();
  if (!(absl::GetFlag(FLAGS_load_interval) > 0))
    return Fail("--load-interval", absl::InvalidArgumentError("--load-interval must be > 0 seconds"));
  k3::v1::RegisterNodeRequest self;
  self.set_role(k3::v1::NODE_ROLE_ATTENTION);
  self.set_node_id(node_id);
  k3::router::RouterClient router(absl::GetFlag(FLAGS_router), self, [&](const k3::v1::Placement& p) {
    auto table = k3::router::PlacementTable::FromProto(p, config);
    if (!table.ok()) {
      std::fprintf(stderr, "k3serve-attention: bad placement: %s\n", std::string(table.status().message()).c_str());
      return;
    }
    const absl::Status s = dispatcher.SetPlacement(std::make_shared<const k3::router::PlacementTable>(std::move(*table)));
    if (!s.ok()) std::fprintf(stderr, "k3serve-attention: placement v%lu: %s\n", static_cast<unsigned long>(p.version()), std::string(s.message()).c_str());
    if (absl::IsFailedPrecondition(s)) return;  // older than the one in use: ignored whole, its routing too
    if (auto r = counted.SetRouting(p); !r.ok())
      std::fprintf(stderr, "k3serve-attention: routing of placement v%lu: %s\n", static_cast<unsigned long>(p.version()),
                   std::string(r.message()).c_str());
    placement_version->Set(static_cast<double>(dispatcher.placement_version()));
    if (Reporter* r = reporter.load()) r->Placed(p.version());
  });
  Reporter rep(router, counted, dispatcher, node_id, absl::Seconds(absl::GetFlag(FLAGS_load_interval)));
  reporter = &rep;
  rep.Placed(dispatcher.placement_version());  // a placement that came before the reporter

  auto* running = &k3::metrics::Must(registry.AddGauge("k3serve_running_requests", "Sequences holding state in the engine."))->WithLabels();
  auto* waiting = &k3::metrics::Must(registry.AddGauge("k3serve_waiting_requests", "Sequences queued for the engine."))->WithLabels();
  auto* state_bytes = &k3::metrics::Must(registry.AddGauge("k3serve_sequence_state_bytes", "Bytes of per-sequence state held."))->WithLabels();
  std::unique_ptr<k3::Backend> backend;
#ifdef K3SERVE_HAVE_CUDA
  // On the GPU the routed experts' rows go through the host to the dispatcher (no ping-pong yet).
  std::unique_ptr<k3::cuda::HostExpertBridge> bridge;
  if (gpu_model) {
    bridge = std::make_unique<k3::cuda::HostExpertBridge>(timed);
    gpu_model->SetExpertExecutor(bridge.get());
    backend = std::make_unique<k3::cuda::CudaBackend>(*gpu_model);
  }
#endif
  if (cpu_model) backend = std::make_unique<k3::CpuBackend>(*cpu_model, timed, absl::GetFlag(FLAGS_ping_pong),
                                                                 absl::GetFlag(FLAGS_ping_pong_adaptive));
  std::atomic<int64_t> stat_running{0}, stat_waiting{0}, stat_state_bytes{0}, steps{0}, step_nanos{0};
  k3::EngineLoop loop(*backend, eopt, [&](const k3::EngineStats& s, absl::Duration took) {
    running->Set(static_cast<double>(s.running));
    waiting->Set(static_cast<double>(s.waiting));
    state_bytes->Set(static_cast<double>(s.state_bytes));
    stat_running = s.running;
    stat_waiting = s.waiting;
    stat_state_bytes = s.state_bytes;
    if (took > absl::ZeroDuration()) {
      ++steps;
      step_nanos += absl::ToInt64Nanoseconds(took);
    }
  }, absl::Microseconds(absl::GetFlag(FLAGS_admission_window_us)));
  experts_ready = &dispatcher;
  service.Attach(config, loop);
  std::fprintf(stderr, "k3serve-attention %s: serving %s on gRPC port %d, metrics port %d\n", node_id.c_str(),
               model_name.c_str(), grpc->port, http ? http->port() : -1);
  std::atomic<bool> draining{false};
  if (http) {
    http->Handle("POST", "/admin/drain", [&draining](const k3::HttpRequest&) {
      draining = true;
      return k3::HttpResponse{200, "text/plain", "draining\n"};
    });
  }
  const std::string grpc_address = absl::StrCat(absl::GetFlag(FLAGS_advertise_host), ":", grpc->port);
  LoadReporter load_reporter(absl::GetFlag(FLAGS_router), absl::Milliseconds(absl::GetFlag(FLAGS_load_report_ms)),
                             [&](k3::v1::AttentionLoad* l) {
                               l->set_node_id(node_id);
                               l->set_grpc_address(grpc_address);
                               l->set_draining(draining);
                               l->set_running_requests(stat_running);
                               l->set_waiting_requests(stat_waiting);
                               l->set_outstanding_tokens(std::max<int64_t>(0, service.outstanding_tokens()));
                               l->set_itl_seconds(service.TakeMeanItl());
                               l->set_state_bytes(stat_state_bytes);
                               l->set_steps(steps.exchange(0));
                               l->set_step_seconds(static_cast<double>(step_nanos.exchange(0)) * 1e-9);
                               l->set_dispatch_seconds(timed.TakeSeconds());
                             });
  // Health follows the experts: SERVING only with a complete, connected placement.
  bool serving = false;
  while (!k3::WaitForShutdown(absl::Milliseconds(100)) && !draining) {
    const bool ready = dispatcher.ready();
    if (ready != serving) {
      grpc->SetServing(ready);
      serving = ready;
      std::fprintf(stderr, "k3serve-attention %s: %s (placement v%lu)\n", node_id.c_str(), ready ? "SERVING" : "NOT_SERVING",
                   static_cast<unsigned long>(dispatcher.placement_version()));
    }
  }
  // Drain: NOT_SERVING and no new requests (the gateways stop picking this node), the streams in
  // flight finish within the drain timeout, the rest end with UNAVAILABLE; then stop.
  draining = true;
  grpc->SetServing(false);
  load_reporter.Kick();
  const double timeout_s = absl::GetFlag(FLAGS_drain_timeout);
  const absl::Time drain_start = absl::Now();
  // What was already on its way when the gateways learnt of the drain is still admitted.
  absl::SleepFor(absl::Seconds(std::min(absl::GetFlag(FLAGS_drain_grace), timeout_s)));
  service.SetDraining();
  std::fprintf(stderr, "k3serve-attention %s: draining %ld request(s) (timeout %g s)\n", node_id.c_str(),
               static_cast<long>(service.inflight()), timeout_s);
  while (service.inflight() > 0 && absl::Now() - drain_start < absl::Seconds(timeout_s))
    absl::SleepFor(absl::Milliseconds(20));
  const int64_t left = service.inflight();
  if (left > 0) {
    service.EndRemaining(absl::StrCat("server shutting down (drain timeout ", timeout_s, " s)"));
    while (service.inflight() > 0) absl::SleepFor(absl::Milliseconds(10));
  }
  std::fprintf(stderr,
               "k3serve-attention %s: drained in %.2f s (%ld request(s) ended at the timeout, %ld new request(s) refused); "
               "shutting down\n",
               node_id.c_str(), absl::ToDoubleSeconds(absl::Now() - drain_start), static_cast<long>(left),
               static_cast<long>(service.refused_draining()));
  grpc->Shutdown(absl::Seconds(1));
  loop.Stop();
  reporter = nullptr;
  return 0;
}

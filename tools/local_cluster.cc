#include "tools/local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "k3serve/v1/orchestrator.grpc.pb.h"

namespace k3 {
namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<Process>> Process::Spawn(const std::string& name, const std::vector<std::string>& argv,
                                                        const std::string& log_path) {
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log < 0) return absl::InternalError(absl::StrCat(log_path, ": ", std::strerror(errno)));
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::dup2(log, 1);
    ::dup2(log, 2);
    ::setpgid(0, 0);  // Ctrl-C in a terminal reaches the cluster through its owner, not directly
    // An owner that dies without stopping its children (SIGKILL, a crash) still ends them, with
    // the drain that SIGTERM starts. The signal follows the forking thread: owners spawn from
    // threads that live as long as they do (main, the orchestrator's control loop).
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(1);  // the owner died before prctl
    ::execv(args[0], args.data());
    std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(log);
  return std::unique_ptr<Process>(new Process(name, pid, log_path));
}

Process::~Process() {
  if (!alive()) return;
  Signal(SIGTERM);
  if (!Wait(absl::Seconds(10))) {
    Signal(SIGKILL);
    Wait(absl::Seconds(5));
  }
}

void Process::Signal(int sig) {
  if (!status_) ::kill(pid_, sig);
}

std::optional<int> Process::Wait(absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (!status_) {
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
      break;
    }
    if (absl::Now() >= end) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status_;
}

bool Process::alive() { return !Wait(absl::ZeroDuration()).has_value(); }

absl::StatusOr<bool> IsServing(const std::string& address, absl::Duration timeout, const std::string& ca) {
  auto creds = tls::ChannelCredentials({.cert = "", .key = "", .ca = ca});
  if (!creds.ok()) return creds.status();
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address, *creds));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status s = stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat(address, ": ", s.error_message()));
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

namespace {

// Waits for a node's ready file ("port port ...") and returns its fields.
absl::StatusOr<std::vector<std::string>> WaitReady(const std::string& path, Process& p, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    std::ifstream in(path);
    std::string line;
    if (in && std::getline(in, line) && !line.empty()) return absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (!p.alive()) {
      std::ifstream log(p.log_path());
      std::stringstream ss;
      ss << log.rdbuf();
      return absl::UnavailableError(absl::StrCat(p.name(), " exited during startup; its log:\n", ss.str()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat(p.name(), " did not become ready (see ", p.log_path(), ")"));
}

// A ready file that must be there already.
absl::StatusOr<std::vector<std::string>> ReadReady(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return absl::NotFoundError(absl::StrCat("no ready file ", path));
  std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (fields.size() < 2) return absl::DataLossError(absl::StrCat(path, ": \"", line, "\" is not \"grpc_port metrics_port\""));
  return fields;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(ClusterOptions options, absl::Duration timeout) {
  if (options.work_dir.empty()) {
    char tmpl[] = "/tmp/k3serve-cluster-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
    options.work_dir = tmpl;
  }
  fs::create_directories(options.work_dir);
  std::unique_ptr<LocalCluster> c(new LocalCluster(std::move(options)));
  K3_RETURN_IF_ERROR(c->MakeCredentials());
  K3_RETURN_IF_ERROR(c->StartRouter(c->options_.router_port));
  if (c->options_.orchestrated) {
    K3_RETURN_IF_ERROR(c->StartOrchestrator());
    K3_RETURN_IF_ERROR(c->StartGateway());
    std::shared_ptr<grpc::ChannelCredentials> admin = grpc::InsecureChannelCredentials();
    if (c->options_.tls) {
      K3_ASSIGN_OR_RETURN(admin, tls::ChannelCredentials({c->cert_file("admin"), c->key_file("admin"), c->ca_file()}));
    }
    K3_ASSIGN_OR_RETURN(auto pools,
                        WaitPools(c->orchestrator_address_, c->options_.attention, c->options_.experts, timeout, admin));
    // The nodes' ports, from the ready files the orchestrator's local backend has them write.
    for (const auto& p : pools.pools())
      for (const auto& r : p.replicas()) {
        K3_ASSIGN_OR_RETURN(auto fields, ReadReady(absl::StrCat(c->options_.work_dir, "/", r.name(), ".ready")));
        if (p.pool() == "attention") {
          c->attention_addresses_.push_back(r.address());
          c->attention_metrics_.push_back(std::stoi(fields[1]));
        } else {
          c->expert_metrics_.push_back(std::stoi(fields[1]));
        }
      }
    const absl::Time end = absl::Now() + timeout;
    while (true) {  // the gateway has seen a serving node
      auto serving = IsServing(c->gateway_address_, absl::Seconds(1), c->options_.tls ? c->ca_file() : "");
      if (serving.ok() && *serving) break;
      if (absl::Now() >= end) return absl::DeadlineExceededError("the gateway is not SERVING (see gateway.log)");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return c;
  }
  for (int i = 0; i < c->options_.experts; ++i) K3_RETURN_IF_ERROR(c->AddExpert());
  for (int i = 0; i < c->options_.attention; ++i) {
    std::vector<std::string> extra = c->options_.attention_args;
    const int port = c->options_.attention_port > 0 ? c->options_.attention_port + i : 0;
    extra.push_back(absl::StrCat("--grpc-port=", port));
    std::vector<std::string> ready;
    K3_ASSIGN_OR_RETURN(auto p, c->StartNode("attention", i, extra, &ready));
    c->attention_addresses_.push_back(absl::StrCat("127.0.0.1:", ready[0]));
    c->attention_metrics_.push_back(std::stoi(ready[1]));
    c->attention_.push_back(std::move(p));
  }
  K3_RETURN_IF_ERROR(c->WaitServing(timeout));
  if (c->options_.gateway) {
    K3_RETURN_IF_ERROR(c->StartGateway());
    const absl::Time end = absl::Now() + timeout;
    while (true) {
      auto serving = IsServing(c->gateway_address_, absl::Seconds(1), c->options_.tls ? c->ca_file() : "");
      if (serving.ok() && *serving) break;
      if (absl::Now() >= end) return absl::DeadlineExceededError("the gateway is not SERVING (see gateway.log)");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return c;
}

absl::Status LocalCluster::StartGateway() {
  const std::string ready = absl::StrCat(options_.work_dir, "/gateway.ready");
  fs::remove(ready);
  std::vector<std::string> argv = {options_.bin_dir + "/k3serve-gateway", "--router=" + router_address_,
                                   "--host=127.0.0.1", absl::StrCat("--grpc-port=", options_.gateway_port),
                                   "--metrics-port=0", "--ready-file=" + ready};
  for (const auto& f : CredentialFlags("node")) argv.push_back(f);
  argv.insert(argv.end(), options_.gateway_args.begin(), options_.gateway_args.end());
  K3_ASSIGN_OR_RETURN(gateway_, Process::Spawn("gateway", argv, absl::StrCat(options_.work_dir, "/gateway.log")));
  K3_ASSIGN_OR_RETURN(auto fields, WaitReady(ready, *gateway_, absl::Seconds(30)));
  gateway_address_ = absl::StrCat("127.0.0.1:", fields[0]);
  gateway_metrics_ = std::stoi(fields[1]);
  return absl::OkStatus();
}

absl::Status LocalCluster::StartOrchestrator() {
  const std::string ready = absl::StrCat(options_.work_dir, "/orchestrator.ready");
  fs::remove(ready);
  std::vector<std::string> argv = {options_.bin_dir + "/k3serve-orchestrator", "--backend=local",
                                   "--model=" + options_.model, "--router=" + router_address_,
                                   "--bin-dir=" + options_.bin_dir, "--work-dir=" + options_.work_dir,
                                   "--host=127.0.0.1", absl::StrCat("--grpc-port=", options_.orchestrator_port),
                                   "--metrics-port=0", "--ready-file=" + ready,
                                   absl::StrCat("--attention=", options_.attention), absl::StrCat("--experts=", options_.experts)};
  for (const auto& f : CredentialFlags("admin")) argv.push_back(f);
  // The nodes it spawns are cluster members: the node credentials.
  std::vector<std::string> attention_args = CredentialFlags("node"), expert_args = CredentialFlags("node");
  expert_args.push_back("--data-plane=shm");  // every node is on this host (expert_args may say ucx)
  attention_args.insert(attention_args.end(), options_.attention_args.begin(), options_.attention_args.end());
  expert_args.insert(expert_args.end(), options_.expert_args.begin(), options_.expert_args.end());
  argv.push_back("--attention-args=" + absl::StrJoin(attention_args, " "));
  argv.push_back("--expert-args=" + absl::StrJoin(expert_args, " "));
  argv.insert(argv.end(), options_.orchestrator_args.begin(), options_.orchestrator_args.end());
  K3_ASSIGN_OR_RETURN(orchestrator_, Process::Spawn("orchestrator", argv, absl::StrCat(options_.work_dir, "/orchestrator.log")));
  K3_ASSIGN_OR_RETURN(auto fields, WaitReady(ready, *orchestrator_, absl::Seconds(30)));
  orchestrator_address_ = absl::StrCat("127.0.0.1:", fields[0]);
  orchestrator_metrics_ = std::stoi(fields[1]);
  return absl::OkStatus();
}

absl::StatusOr<k3serve::v1::Pools> GetPools(const std::string& orchestrator, std::shared_ptr<grpc::ChannelCredentials> creds) {
  auto stub = k3serve::v1::Orchestrator::NewStub(creds ? grpc::CreateChannel(orchestrator, creds) : tls::NewChannel(orchestrator));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  k3serve::v1::Pools pools;
  const grpc::Status s = stub->GetPools(&ctx, k3serve::v1::GetPoolsRequest(), &pools);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("orchestrator ", orchestrator, ": ", s.error_message()));
  return pools;
}

absl::StatusOr<k3serve::v1::Pools> ScalePools(const std::string& orchestrator, std::optional<int> attention,
                                              std::optional<int> experts, absl::Duration timeout,
                                              const std::string& admin_token_file) {
  std::string admin_token;
  if (!admin_token_file.empty()) {
    std::ifstream in(admin_token_file);
    if (!std::getline(in, admin_token) || admin_token.empty())
      return absl::FailedPreconditionError(absl::StrCat("cannot read the admin token from ", admin_token_file));
  }
  auto stub = k3serve::v1::Orchestrator::NewStub(tls::NewChannel(orchestrator));
  k3serve::v1::SetTargetsRequest req;
  if (attention) req.set_attention(*attention);
  if (experts) req.set_experts(*experts);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    if (admin_token.empty()) {
      auth::AddAdminCredentials(&ctx);
    } else {
      ctx.AddMetadata(auth::kAdminTokenKey, admin_token);
    }
    k3serve::v1::Pools pools;
    const grpc::Status s = stub->SetTargets(&ctx, req, &pools);
    if (!s.ok())
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()), absl::StrCat("orchestrator ", orchestrator, ": ", s.error_message()));
  }
  return WaitPools(orchestrator, attention, experts, timeout);
}

absl::StatusOr<k3serve::v1::Pools> WaitPools(const std::string& orchestrator, std::optional<int> attention,
                                             std::optional<int> experts, absl::Duration timeout,
                                             std::shared_ptr<grpc::ChannelCredentials> creds) {
  const absl::Time end = absl::Now() + timeout;
  std::string error;
  absl::Time error_since;
  std::string where;
  while (true) {
    auto pools = GetPools(orchestrator, creds);
    if (pools.ok()) {
      bool reached = true;
      std::string now_error;
      where.clear();
      for (const auto& p : pools->pools()) {
        const bool wanted = (p.pool() == "attention" && attention) || (p.pool() == "experts" && experts);
        if (!wanted) continue;
        bool draining = false;
        for (const auto& r : p.replicas()) draining = draining || r.draining();
        const int target = p.pool() == "attention" ? *attention : *experts;
        reached = reached && p.desired() == target && p.actual() == target && !draining;
        if (!p.error().empty()) now_error = absl::StrCat(p.pool(), ": ", p.error());
        absl::StrAppend(&where, where.empty() ? "" : ", ", p.pool(), " ", p.actual(), "/", p.desired(), draining ? " (draining)" : "");
      }
      if (reached) return *pools;
      // A backend error that persists (not a replica restarting) ends the wait.
      if (now_error != error) {
        error = now_error;
        error_since = absl::Now();
      } else if (!error.empty() && absl::Now() - error_since > absl::Seconds(5)) {
        return absl::FailedPreconditionError(absl::StrCat("scaling failed: ", error));
      }
    }
    if (absl::Now() >= end)
      return absl::DeadlineExceededError(absl::StrCat("pools not reached within ", absl::FormatDuration(timeout), ": ",
                                                      pools.ok() ? where : std::string(pools.status().message()),
                                                      error.empty() ? "" : "; last error: " + error));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

LocalCluster::~LocalCluster() {
  if (gateway_) gateway_->Signal(SIGTERM);
  if (orchestrator_) {  // it drains and stops its nodes before it exits
    orchestrator_->Signal(SIGTERM);
    orchestrator_->Wait(absl::Seconds(60));
  }
  gateway_.reset();
  orchestrator_.reset();
  for (auto& p : attention_) p->Signal(SIGTERM);
  attention_.clear();
  for (auto& p : experts_) p->Signal(SIGTERM);
  experts_.clear();
  router_.reset();
}

namespace {

absl::Status WriteSecret(const std::string& path) {
  std::ifstream rnd("/dev/urandom", std::ios::binary);
  unsigned char b[32];
  if (!rnd.read(reinterpret_cast<char*>(b), sizeof(b))) return absl::InternalError("cannot read /dev/urandom");
  std::string hex;
  for (unsigned char c : b) hex += absl::StrFormat("%02x", c);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || ::write(fd, hex.data(), hex.size()) != static_cast<ssize_t>(hex.size()))
    return absl::InternalError(absl::StrCat(path, ": ", std::strerror(errno)));
  ::close(fd);
  return absl::OkStatus();
}

absl::Status Shell(const std::string& cmd, const std::string& log) {
  const int rc = std::system((cmd + " >>" + log + " 2>&1").c_str());
  if (rc != 0) return absl::InternalError(absl::StrCat("`", cmd, "` failed (see ", log, ")"));
  return absl::OkStatus();
}

}  // namespace

absl::Status MakeTestCertificates(const std::string& dir, const std::vector<std::pair<std::string, std::string>>& names) {
  fs::create_directories(dir);
  const std::string log = dir + "/openssl.log";
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  K3_RETURN_IF_ERROR(Shell(absl::StrCat("openssl req -x509 ", ec, " -keyout ", dir, "/ca.key -out ", dir,
                                        "/ca.pem -days 2 -subj /CN=k3serve-local-ca"), log));
  {
    std::ofstream ext(dir + "/san.ext");
    ext << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
  }
  for (const auto& [name, cn] : names) {
    const std::string base = dir + "/" + name;
    K3_RETURN_IF_ERROR(Shell(absl::StrCat("openssl req ", ec, " -keyout ", base, ".key -out ", base, ".csr -subj /CN=", cn), log));
    K3_RETURN_IF_ERROR(Shell(absl::StrCat("openssl x509 -req -in ", base, ".csr -CA ", dir, "/ca.pem -CAkey ", dir,
                                          "/ca.key -CAcreateserial -days 2 -extfile ", dir, "/san.ext -out ", base, ".pem"), log));
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::MakeCredentials() {
  K3_RETURN_IF_ERROR(WriteSecret(node_token_file()));
  K3_RETURN_IF_ERROR(WriteSecret(admin_token_file()));
  if (options_.tls)
    K3_RETURN_IF_ERROR(MakeTestCertificates(options_.work_dir + "/tls", {{"node", "k3serve-node"}, {"admin", "k3serve-admin"}}));
  return absl::OkStatus();
}

std::vector<std::string> LocalCluster::CredentialFlags(const std::string& identity) const {
  // Nodes read the admin token to verify admin calls (Drain, LoadSlots); only the router sends it.
  std::vector<std::string> f = {"--node-token-file=" + node_token_file(), "--admin-token-file=" + admin_token_file()};
  if (options_.tls) {
    f.push_back("--tls-cert=" + cert_file(identity));
    f.push_back("--tls-key=" + key_file(identity));
    f.push_back("--tls-ca=" + ca_file());
  }
  return f;
}

absl::Status LocalCluster::StartRouter(int port) {
  const std::string ready = absl::StrCat(options_.work_dir, "/router.ready");
  fs::remove(ready);
  std::vector<std::string> argv = {options_.bin_dir + "/k3serve-router", "--model=" + options_.model,
                                   "--host=127.0.0.1", absl::StrCat("--grpc-port=", port),
                                   "--metrics-port=0", "--ready-file=" + ready};
  for (const auto& f : CredentialFlags("admin")) argv.push_back(f);
  argv.insert(argv.end(), options_.router_args.begin(), options_.router_args.end());
  K3_ASSIGN_OR_RETURN(router_, Process::Spawn("router", argv, absl::StrCat(options_.work_dir, "/router.log")));
  K3_ASSIGN_OR_RETURN(auto fields, WaitReady(ready, *router_, absl::Seconds(30)));
  router_address_ = absl::StrCat("127.0.0.1:", fields[0]);
  router_metrics_ = std::stoi(fields[1]);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Process>> LocalCluster::StartNode(const std::string& kind, int index,
                                                                 const std::vector<std::string>& extra,
                                                                 std::vector<std::string>* ready_fields) {
  const std::string name = absl::StrCat(kind, "-", index);
  const std::string ready = absl::StrCat(options_.work_dir, "/", name, ".ready");
  fs::remove(ready);
  std::vector<std::string> argv = {options_.bin_dir + "/k3serve-" + kind, "--model=" + options_.model,
                                   "--router=" + router_address_, "--host=127.0.0.1", "--metrics-port=0",
                                   "--node-id=" + name, "--ready-file=" + ready};
  for (const auto& f : CredentialFlags("node")) argv.push_back(f);
  argv.insert(argv.end(), extra.begin(), extra.end());
  K3_ASSIGN_OR_RETURN(auto p, Process::Spawn(name, argv, absl::StrCat(options_.work_dir, "/", name, ".log")));
  K3_ASSIGN_OR_RETURN(*ready_fields, WaitReady(ready, *p, absl::Seconds(60)));
  return p;
}

absl::Status LocalCluster::AddExpert() {
  // Every node is on this host: shared memory (expert_args may say --data-plane=ucx instead).
  std::vector<std::string> extra = {"--data-plane=shm"};
  extra.insert(extra.end(), options_.expert_args.begin(), options_.expert_args.end());
  extra.push_back("--grpc-port=0");
  extra.push_back("--data-port=0");
  std::vector<std::string> ready;
  K3_ASSIGN_OR_RETURN(auto p, StartNode("expert", next_index_++, extra, &ready));
  experts_.push_back(std::move(p));
  expert_metrics_.push_back(std::stoi(ready[1]));
  return absl::OkStatus();
}

absl::Status LocalCluster::RestartRouter() {
  const int port = std::stoi(router_address_.substr(router_address_.rfind(':') + 1));
  router_->Signal(SIGKILL);
  router_->Wait(absl::Seconds(5));
  return StartRouter(port);
}

absl::Status LocalCluster::WaitServing(absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  for (size_t i = 0; i < attention_addresses_.size(); ++i) {
    while (true) {
      auto serving = IsServing(attention_addresses_[i], absl::Seconds(1), options_.tls ? ca_file() : "");
      if (serving.ok() && *serving) break;
      if (!attention_[i]->alive()) return absl::UnavailableError(absl::StrCat("attention-", i, " exited (see ", attention_[i]->log_path(), ")"));
      if (absl::Now() >= end)
        return absl::DeadlineExceededError(absl::StrCat("attention-", i, " is not SERVING (see ", attention_[i]->log_path(), ")"));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return absl::OkStatus();
}

}  // namespace k3

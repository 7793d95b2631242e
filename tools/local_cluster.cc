#include "tools/local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace k3 {
namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<Process>> Process::Spawn(const std::string& name, const std::vector<std::string>& argv,
                                                        const std::string& log_path) {
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log < 0) return absl::InternalError(absl::StrCat(log_path, ": ", std::strerror(errno)));
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::dup2(log, 1);
    ::dup2(log, 2);
    ::setpgid(0, 0);  // Ctrl-C in a terminal reaches the cluster through its owner, not directly
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

absl::StatusOr<bool> IsServing(const std::string& address, absl::Duration timeout) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
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

}  // namespace

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(ClusterOptions options, absl::Duration timeout) {
  if (options.work_dir.empty()) {
    char tmpl[] = "/tmp/k3serve-cluster-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
    options.work_dir = tmpl;
  }
  fs::create_directories(options.work_dir);
  std::unique_ptr<LocalCluster> c(new LocalCluster(std::move(options)));
  K3_RETURN_IF_ERROR(c->StartRouter(c->options_.router_port));
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
  return c;
}

LocalCluster::~LocalCluster() {
  for (auto& p : attention_) p->Signal(SIGTERM);
  attention_.clear();
  for (auto& p : experts_) p->Signal(SIGTERM);
  experts_.clear();
  router_.reset();
}

absl::Status LocalCluster::StartRouter(int port) {
  const std::string ready = absl::StrCat(options_.work_dir, "/router.ready");
  fs::remove(ready);
  std::vector<std::string> argv = {options_.bin_dir + "/k3serve-router", "--model=" + options_.model, "--host=127.0.0.1",
                                   absl::StrCat("--grpc-port=", port), "--metrics-port=0", "--ready-file=" + ready};
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
  argv.insert(argv.end(), extra.begin(), extra.end());
  K3_ASSIGN_OR_RETURN(auto p, Process::Spawn(name, argv, absl::StrCat(options_.work_dir, "/", name, ".log")));
  K3_ASSIGN_OR_RETURN(*ready_fields, WaitReady(ready, *p, absl::Seconds(60)));
  return p;
}

absl::Status LocalCluster::AddExpert() {
  std::vector<std::string> extra = options_.expert_args;
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
      auto serving = IsServing(attention_addresses_[i], absl::Seconds(1));
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

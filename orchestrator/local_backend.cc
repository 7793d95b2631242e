#include "orchestrator/local_backend.h"

#include <signal.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/tls.h"

namespace k3::orchestrator {
namespace fs = std::filesystem;

LocalBackend::LocalBackend(LocalBackendOptions options) : options_(std::move(options)) {
  fs::create_directories(options_.work_dir);
}

LocalBackend::~LocalBackend() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Pool pool : {Pool::kAttention, Pool::kExperts}) {
    for (Member& m : members_[pool]) m.process->Signal(SIGTERM);
    members_[pool].clear();  // ~Process waits, then SIGKILLs a straggler
  }
}

absl::StatusOr<std::unique_ptr<Process>> LocalBackend::Spawn(Pool pool, const std::string& name) {
  const bool attention = pool == Pool::kAttention;
  const std::string ready = absl::StrCat(options_.work_dir, "/", name, ".ready");
  fs::remove(ready);
  std::vector<std::string> argv = {options_.bin_dir + (attention ? "/k3serve-attention" : "/k3serve-expert"),
                                   "--model=" + options_.model, "--router=" + options_.router_address,
                                   "--host=127.0.0.1", "--metrics-port=0", "--grpc-port=0", "--node-id=" + name,
                                   "--ready-file=" + ready};
  if (attention) {
    argv.push_back(absl::StrCat("--drain-timeout=", options_.drain_timeout_s));
  } else {
    argv.push_back("--data-port=0");
  }
  const auto& extra = attention ? options_.attention_args : options_.expert_args;
  argv.insert(argv.end(), extra.begin(), extra.end());
  return Process::Spawn(name, argv, absl::StrCat(options_.work_dir, "/", name, ".log"));
}

void LocalBackend::Poll(Pool pool, Member& m) {
  if (m.address.empty()) {
    std::ifstream in(absl::StrCat(options_.work_dir, "/", m.name, ".ready"));
    std::string line;
    if (!in || !std::getline(in, line) || line.empty()) return;
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    m.address = absl::StrCat("127.0.0.1:", fields[0]);
  }
  if (pool == Pool::kExperts) {
    m.ready = true;  // serving its gRPC API; whether it is placed, the router says
    return;
  }
  auto serving = IsServing(m.address, absl::Milliseconds(300), tls::FilesFromFlags().ca);
  m.ready = serving.ok() && *serving;
}

absl::Status LocalBackend::Apply(Pool pool, int replicas) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Member>& ms = members_[pool];
  absl::Status status;
  // Drained nodes that exited leave; crashed ones come back under the same name (the router
  // re-places a restarted expert node like a new one).
  for (auto it = ms.begin(); it != ms.end();) {
    if (it->draining) {
      if (!it->process->alive()) {
        if (on_drained) on_drained(pool, absl::Now() - it->drain_start);
        it = ms.erase(it);
        continue;
      }
      if (absl::Now() - it->drain_start > absl::Seconds(options_.drain_timeout_s + 10)) it->process->Signal(SIGKILL);
    } else if (!it->process->alive()) {
      const int code = it->process->Wait(absl::ZeroDuration()).value_or(0);
      std::fprintf(stderr, "k3serve-orchestrator: %s exited (%d); restarting it (see %s)\n", it->name.c_str(), code,
                   it->process->log_path().c_str());
      auto p = Spawn(pool, it->name);
      if (!p.ok()) {
        status = p.status();
      } else {
        it->process = std::move(*p);
        it->address.clear();
        it->ready = false;
        ++it->restarts;
      }
    }
    ++it;
  }
  int live = 0;
  for (const Member& m : ms) live += !m.draining;
  for (; live < replicas; ++live) {
    Member m;
    m.name = absl::StrCat(pool == Pool::kAttention ? "attention-" : "expert-", next_index_++);
    auto p = Spawn(pool, m.name);
    if (!p.ok()) return p.status();
    m.process = std::move(*p);
    std::fprintf(stderr, "k3serve-orchestrator: started %s (pid %d)\n", m.name.c_str(), static_cast<int>(m.process->pid()));
    ms.push_back(std::move(m));
  }
  // Surplus: the newest ones drain (SIGTERM starts the same drain as a scale-down anywhere).
  for (auto it = ms.rbegin(); it != ms.rend() && live > replicas; ++it) {
    if (it->draining) continue;
    it->draining = true;
    it->drain_start = absl::Now();
    it->process->Signal(SIGTERM);
    std::fprintf(stderr, "k3serve-orchestrator: draining %s\n", it->name.c_str());
    --live;
  }
  for (Member& m : ms)
    if (!m.draining) Poll(pool, m);
  return status;
}

absl::StatusOr<std::vector<Replica>> LocalBackend::List(Pool pool) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Replica> out;
  for (Member& m : members_[pool]) {
    Replica r;
    r.name = m.name;
    r.address = m.address;
    r.pid = m.process->pid();
    r.ready = m.ready && !m.draining && m.process->alive();
    r.draining = m.draining;
    r.restarts = m.restarts;
    out.push_back(r);
  }
  return out;
}

}  // namespace k3::orchestrator

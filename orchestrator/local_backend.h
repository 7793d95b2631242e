// The local backend: attention and expert nodes as child processes of the orchestrator.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "orchestrator/backend.h"
#include "tools/local_cluster.h"

namespace k3::orchestrator {

struct LocalBackendOptions {
  std::string bin_dir;  // where k3serve-attention and k3serve-expert live
  std::string model;
  std::string router_address;
  std::string work_dir;  // logs and ready files
  std::vector<std::string> attention_args;
  std::vector<std::string> expert_args;
  double drain_timeout_s = 30;  // an attention node's --drain-timeout; SIGKILL 10 s past it
};

class LocalBackend final : public Backend {
 public:
  explicit LocalBackend(LocalBackendOptions options);
  ~LocalBackend() override;  // drains every node: attention first, then experts

  absl::Status Apply(Pool pool, int replicas) override;
  absl::StatusOr<std::vector<Replica>> List(Pool pool) override;

 private:
  struct Member {
    std::string name;
    std::unique_ptr<Process> process;
    std::string address;
    bool ready = false;
    bool draining = false;
    absl::Time drain_start;
    int restarts = 0;
  };
  absl::StatusOr<std::unique_ptr<Process>> Spawn(Pool pool, const std::string& name);
  void Poll(Pool pool, Member& m);  // readiness from the ready file and health

  const LocalBackendOptions options_;
  std::mutex mu_;
  std::map<Pool, std::vector<Member>> members_;
  int next_index_ = 0;
};

}  // namespace k3::orchestrator

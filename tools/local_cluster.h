// A local k3serve cluster of real processes on loopback: router, expert nodes, attention nodes.
// Used by `k3serve up`, `k3serve bench` and the integration tests.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/status.h"

namespace k3 {

// One child process; its output goes to a log file.
class Process {
 public:
  static absl::StatusOr<std::unique_ptr<Process>> Spawn(const std::string& name, const std::vector<std::string>& argv,
                                                         const std::string& log_path);
  ~Process();  // SIGTERM, then SIGKILL if it has not exited after 10 s

  void Signal(int sig);
  // Waits for the process to exit; returns its exit status (or -signal), or nullopt on timeout.
  std::optional<int> Wait(absl::Duration timeout);
  bool alive();
  pid_t pid() const { return pid_; }
  const std::string& name() const { return name_; }
  const std::string& log_path() const { return log_; }

 private:
  Process(std::string name, pid_t pid, std::string log) : name_(std::move(name)), pid_(pid), log_(std::move(log)) {}
  std::string name_;
  pid_t pid_;
  std::string log_;
  std::optional<int> status_;
};

struct ClusterOptions {
  std::string bin_dir;   // where k3serve-router, -expert, -attention live
  std::string model;     // model directory
  int attention = 1;
  int experts = 2;
  std::string work_dir;  // logs and ready files; created if missing; default: a new temp dir
  int router_port = 0;   // 0: pick
  int attention_port = 0;  // first attention node's gRPC port (the next ones +1 each); 0: pick
  std::vector<std::string> attention_args;  // extra flags
  std::vector<std::string> expert_args;
  std::vector<std::string> router_args;
};

class LocalCluster {
 public:
  // Starts the router, the expert nodes and the attention nodes and waits until every attention
  // node reports SERVING.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(ClusterOptions options,
                                                              absl::Duration timeout = absl::Seconds(60));
  ~LocalCluster();  // SIGTERM to everyone: attention first, then experts, then the router

  const std::string& router_address() const { return router_address_; }
  const std::vector<std::string>& attention_addresses() const { return attention_addresses_; }
  const std::vector<int>& attention_metrics_ports() const { return attention_metrics_; }
  int router_metrics_port() const { return router_metrics_; }
  const std::vector<int>& expert_metrics_ports() const { return expert_metrics_; }
  Process& router() { return *router_; }
  Process& expert(size_t i) { return *experts_.at(i); }
  Process& attention(size_t i) { return *attention_.at(i); }
  size_t num_experts() const { return experts_.size(); }
  const std::string& work_dir() const { return options_.work_dir; }

  absl::Status AddExpert();
  // Kills the router (SIGKILL) and starts a new one on the same port.
  absl::Status RestartRouter();
  // Every attention node reports SERVING (grpc.health.v1) within the timeout.
  absl::Status WaitServing(absl::Duration timeout);

 private:
  explicit LocalCluster(ClusterOptions options) : options_(std::move(options)) {}
  absl::Status StartRouter(int port);
  absl::StatusOr<std::unique_ptr<Process>> StartNode(const std::string& kind, int index, const std::vector<std::string>& extra,
                                                     std::vector<std::string>* ready_fields);

  ClusterOptions options_;
  std::unique_ptr<Process> router_;
  std::vector<std::unique_ptr<Process>> experts_;
  std::vector<std::unique_ptr<Process>> attention_;
  std::string router_address_;
  int router_metrics_ = -1;
  std::vector<std::string> attention_addresses_;
  std::vector<int> attention_metrics_;
  std::vector<int> expert_metrics_;
  int next_index_ = 0;
};

// grpc.health.v1 Check of the server's overall health ("").
absl::StatusOr<bool> IsServing(const std::string& address, absl::Duration timeout);

}  // namespace k3

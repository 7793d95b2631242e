// A local k3serve cluster of real processes on loopback: router, expert nodes, attention nodes,
// and optionally the gateway in front and the orchestrator that owns the nodes.
// Used by `k3serve up`, `k3serve bench` and the integration tests.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/time/time.h"
#include "common/status.h"
#include "k3serve/v1/orchestrator.pb.h"

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
  // The cluster always runs with a generated node token and admin token (files in work_dir). With
  // tls, also a throwaway CA and certificates (openssl): mTLS between the nodes, TLS on the API.
  bool tls = false;
  bool gateway = false;       // a k3serve-gateway in front of the attention nodes
  int gateway_port = 0;       // 0: pick
  std::vector<std::string> gateway_args;
  // The nodes are the orchestrator's (local backend: it spawns, drains and restarts them); implies
  // the gateway.
  bool orchestrated = false;
  int orchestrator_port = 0;  // 0: pick
  std::vector<std::string> orchestrator_args;  // extra flags (--interval, --cooldown, ...)
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
  // The generated secrets and (with tls) certificates, as files in work_dir.
  std::string node_token_file() const { return options_.work_dir + "/node.token"; }
  std::string admin_token_file() const { return options_.work_dir + "/admin.token"; }
  std::string ca_file() const { return options_.work_dir + "/tls/ca.pem"; }
  // "<dir>/tls/<name>.pem" and ".key" for name = node (every node) or admin (the router).
  std::string cert_file(const std::string& name) const { return options_.work_dir + "/tls/" + name + ".pem"; }
  std::string key_file(const std::string& name) const { return options_.work_dir + "/tls/" + name + ".key"; }
  const std::string& gateway_address() const { return gateway_address_; }
  int gateway_metrics_port() const { return gateway_metrics_; }
  const std::string& orchestrator_address() const { return orchestrator_address_; }
  int orchestrator_metrics_port() const { return orchestrator_metrics_; }
  Process& gateway() { return *gateway_; }
  Process& orchestrator() { return *orchestrator_; }

  absl::Status AddExpert();
  // The flags that give a process of this cluster its credentials: identity "node" or "admin"
  // (the router, and an orchestrator).
  std::vector<std::string> CredentialFlags(const std::string& identity) const;
  // Flags of the next router started (RestartRouter).
  std::vector<std::string>& router_args() { return options_.router_args; }
  // Kills the router (SIGKILL) and starts a new one on the same port.
  absl::Status RestartRouter();
  // Every attention node reports SERVING (grpc.health.v1) within the timeout.
  absl::Status WaitServing(absl::Duration timeout);

 private:
  explicit LocalCluster(ClusterOptions options) : options_(std::move(options)) {}
  absl::Status StartRouter(int port);
  absl::Status MakeCredentials();
  absl::Status StartGateway();
  absl::Status StartOrchestrator();
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
  std::unique_ptr<Process> gateway_;
  std::string gateway_address_;
  int gateway_metrics_ = -1;
  std::unique_ptr<Process> orchestrator_;
  std::string orchestrator_address_;
  int orchestrator_metrics_ = -1;
};

// The orchestrator's pools now. Without creds, the channel is as this process's --tls-* flags say.
absl::StatusOr<k3serve::v1::Pools> GetPools(const std::string& orchestrator,
                                            std::shared_ptr<grpc::ChannelCredentials> creds = nullptr);
// Sets the targets given and waits until the pools have reached them (ready, placed, no drain
// left); fails with the backend's error if one persists, or at the timeout with where they are.
// The call carries the admin identity: the token in admin_token_file, or (empty) this process's
// own credentials (--admin-token-file, --tls-*).
absl::StatusOr<k3serve::v1::Pools> ScalePools(const std::string& orchestrator, std::optional<int> attention,
                                              std::optional<int> experts, absl::Duration timeout,
                                              const std::string& admin_token_file = "");
// Waits (without setting targets) until the given pools are at these sizes.
absl::StatusOr<k3serve::v1::Pools> WaitPools(const std::string& orchestrator, std::optional<int> attention,
                                             std::optional<int> experts, absl::Duration timeout,
                                             std::shared_ptr<grpc::ChannelCredentials> creds = nullptr);

// grpc.health.v1 Check of the server's overall health (""); over TLS verified by `ca` when given.
absl::StatusOr<bool> IsServing(const std::string& address, absl::Duration timeout, const std::string& ca = "");

// A throwaway CA (dir/ca.pem, ca.key) and, for each (name, common name), dir/<name>.pem and .key
// signed by it for 127.0.0.1 and localhost, by openssl. For local clusters and tests.
absl::Status MakeTestCertificates(const std::string& dir, const std::vector<std::pair<std::string, std::string>>& names);

}  // namespace k3

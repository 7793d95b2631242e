// The kubernetes backend: the /scale subresource of the attention Deployment and the expert
// StatefulSet, with the pod's service-account token and CA (in-cluster). Kubernetes starts,
// stops and restarts the pods; SIGTERM (terminationGracePeriodSeconds) gives them their drain.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "orchestrator/backend.h"

namespace httplib {
class Client;
}

namespace k3::orchestrator {

struct KubernetesOptions {
  std::string api;         // https://host:port; empty: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
  std::string token_file = "/var/run/secrets/kubernetes.io/serviceaccount/token";
  std::string ca_file = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
  std::string namespace_;  // empty: the service account's namespace file
  std::string attention_deployment = "k3serve-attention";
  std::string expert_statefulset = "k3serve-expert";
  bool dry_run = false;    // print the PATCHes instead of sending them
  int conflict_retries = 5;
};

// One scale subresource as read.
struct Scale {
  int spec_replicas = 0;
  int status_replicas = 0;
  std::string resource_version;
};

class KubernetesBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<KubernetesBackend>> Create(KubernetesOptions options);
  ~KubernetesBackend() override;

  absl::Status Apply(Pool pool, int replicas) override;
  absl::StatusOr<std::vector<Replica>> List(Pool pool) override;

  absl::StatusOr<Scale> GetScale(Pool pool);
  // The merge patch sent for `replicas` (what --dry-run prints).
  static std::string PatchBody(const std::string& resource_version, int replicas);
  std::string ScalePath(Pool pool) const;

 private:
  KubernetesBackend(KubernetesOptions options, std::string token, std::unique_ptr<httplib::Client> client);
  absl::Status ReadToken();

  KubernetesOptions options_;
  std::string token_;
  std::unique_ptr<httplib::Client> client_;
  std::map<Pool, int> dry_run_printed_;  // the size each pool's last printed PATCH asked for
};

}  // namespace k3::orchestrator

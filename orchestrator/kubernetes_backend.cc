#include "orchestrator/kubernetes_backend.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"

namespace k3::orchestrator {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) return absl::FailedPreconditionError(absl::StrCat("kubernetes: cannot read the ", what, " at ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// A clear error for the API server's answer to `method path`.
absl::Status HttpError(const std::string& method, const std::string& path, const httplib::Result& r,
                       const std::string& ns) {
  if (!r) return absl::UnavailableError(absl::StrCat("kubernetes: ", method, " ", path, ": ", httplib::to_string(r.error())));
  std::string message;
  auto body = nlohmann::json::parse(r->body, nullptr, false);
  if (body.is_object() && body.contains("message") && body["message"].is_string()) message = body["message"].get<std::string>();
  const std::string tail = message.empty() ? "" : absl::StrCat(" (", message, ")");
  switch (r->status) {
    case 401:
      return absl::UnauthenticatedError(absl::StrCat("kubernetes: 401 Unauthorized for ", method, " ", path,
                                                     ": the service-account token was rejected", tail));
    case 403:
      return absl::PermissionDeniedError(absl::StrCat("kubernetes: 403 Forbidden for ", method, " ", path,
                                                      ": the service account lacks RBAC permission (get/patch on the "
                                                      "scale subresource in namespace ", ns, ")", tail));
    case 404:
      return absl::NotFoundError(absl::StrCat("kubernetes: 404 Not Found for ", method, " ", path,
                                              ": no such Deployment/StatefulSet in namespace ", ns, tail));
    case 409:
      return absl::AbortedError(absl::StrCat("kubernetes: 409 Conflict for ", method, " ", path, tail));
    default:
      return absl::UnknownError(absl::StrCat("kubernetes: HTTP ", r->status, " for ", method, " ", path, tail));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<KubernetesBackend>> KubernetesBackend::Create(KubernetesOptions o) {
  if (o.api.empty()) {
    const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
    const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
    if (host == nullptr || port == nullptr)
      return absl::FailedPreconditionError(
          "kubernetes: KUBERNETES_SERVICE_HOST/PORT are not set (not in a pod?); pass --k8s-api https://HOST:PORT");
    o.api = absl::StrCat("https://", host, ":", port);
  }
  if (!absl::StartsWith(o.api, "https://"))
    return absl::InvalidArgumentError(absl::StrCat("--k8s-api must start with https://, got \"", o.api, "\""));
  if (o.namespace_.empty()) {
    auto ns = ReadFile("/var/run/secrets/kubernetes.io/serviceaccount/namespace", "service-account namespace");
    if (!ns.ok()) return absl::FailedPreconditionError(absl::StrCat(ns.status().message(), "; pass --k8s-namespace"));
    o.namespace_ = *ns;
  }
  K3_ASSIGN_OR_RETURN(std::string token, ReadFile(o.token_file, "service-account token"));
  std::ifstream ca(o.ca_file);
  if (!ca) return absl::FailedPreconditionError(absl::StrCat("kubernetes: cannot read the CA certificate at ", o.ca_file));
  auto client = std::make_unique<httplib::Client>(o.api);
  client->set_ca_cert_path(o.ca_file.c_str());
  client->enable_server_certificate_verification(true);
  client->set_connection_timeout(2);
  client->set_read_timeout(5);
  return std::unique_ptr<KubernetesBackend>(new KubernetesBackend(std::move(o), std::move(token), std::move(client)));
}

KubernetesBackend::KubernetesBackend(KubernetesOptions options, std::string token, std::unique_ptr<httplib::Client> client)
    : options_(std::move(options)), token_(std::move(token)), client_(std::move(client)) {}

KubernetesBackend::~KubernetesBackend() = default;

absl::Status KubernetesBackend::ReadToken() {
  // Projected tokens rotate: read the file on every call.
  K3_ASSIGN_OR_RETURN(token_, ReadFile(options_.token_file, "service-account token"));
  return absl::OkStatus();
}

std::string KubernetesBackend::ScalePath(Pool pool) const {
  return pool == Pool::kAttention
             ? absl::StrCat("/apis/apps/v1/namespaces/", options_.namespace_, "/deployments/", options_.attention_deployment, "/scale")
             : absl::StrCat("/apis/apps/v1/namespaces/", options_.namespace_, "/statefulsets/", options_.expert_statefulset, "/scale");
}

std::string KubernetesBackend::PatchBody(const std::string& resource_version, int replicas) {
  nlohmann::json j;
  j["metadata"]["resourceVersion"] = resource_version;  // optimistic concurrency: 409 if it moved
  j["spec"]["replicas"] = replicas;
  return j.dump();
}

absl::StatusOr<Scale> KubernetesBackend::GetScale(Pool pool) {
  K3_RETURN_IF_ERROR(ReadToken());
  const std::string path = ScalePath(pool);
  httplib::Headers h = {{"Authorization", "Bearer " + token_}, {"Accept", "application/json"}};
  auto r = client_->Get(path.c_str(), h);
  if (!r || r->status != 200) return HttpError("GET", path, r, options_.namespace_);
  auto j = nlohmann::json::parse(r->body, nullptr, false);
  if (!j.is_object()) return absl::DataLossError(absl::StrCat("kubernetes: GET ", path, ": the answer is not JSON"));
  Scale s;
  s.spec_replicas = j.value("/spec/replicas"_json_pointer, 0);
  s.status_replicas = j.value("/status/replicas"_json_pointer, 0);
  s.resource_version = j.value("/metadata/resourceVersion"_json_pointer, std::string());
  return s;
}

absl::Status KubernetesBackend::Apply(Pool pool, int replicas) {
  const std::string path = ScalePath(pool);
  for (int attempt = 0; attempt <= options_.conflict_retries; ++attempt) {
    K3_ASSIGN_OR_RETURN(Scale s, GetScale(pool));
    // Kubernetes restarts crashed pods itself; a shortfall is reported, not repaired here.
    if (s.spec_replicas == replicas)
      return s.status_replicas >= replicas
                 ? absl::OkStatus()
                 : absl::UnavailableError(absl::StrCat(path, ": ", s.status_replicas, " of ", replicas,
                                                       " replicas running (crashed or pending pods: kubectl get pods)"));
    const std::string body = PatchBody(s.resource_version, replicas);
    if (options_.dry_run) {
      if (dry_run_printed_[pool] == replicas) return absl::OkStatus();
      dry_run_printed_[pool] = replicas;
      std::printf("dry-run: PATCH %s%s (application/merge-patch+json) %s\n", options_.api.c_str(), path.c_str(), body.c_str());
      std::fflush(stdout);
      return absl::OkStatus();
    }
    httplib::Headers h = {{"Authorization", "Bearer " + token_}, {"Accept", "application/json"}};
    auto r = client_->Patch(path.c_str(), h, body, "application/merge-patch+json");
    if (r && r->status == 200) {
      std::fprintf(stderr, "k3serve-orchestrator: %s %s: spec.replicas %d -> %d\n", PoolName(pool), path.c_str(),
                   s.spec_replicas, replicas);
      return absl::OkStatus();
    }
    if (r && r->status == 409) continue;  // someone else wrote it: read again, patch again
    return HttpError("PATCH", path, r, options_.namespace_);
  }
  return absl::AbortedError(absl::StrCat("kubernetes: PATCH ", path, ": still conflicting after ", options_.conflict_retries,
                                         " retries (409: resourceVersion changed each time)"));
}

absl::StatusOr<std::vector<Replica>> KubernetesBackend::List(Pool pool) {
  K3_ASSIGN_OR_RETURN(Scale s, GetScale(pool));
  std::vector<Replica> out(s.status_replicas);
  for (int i = 0; i < s.status_replicas; ++i) {
    out[i].name = pool == Pool::kAttention ? absl::StrCat(options_.attention_deployment, "[", i, "]")
                                           : absl::StrCat(options_.expert_statefulset, "-", i);
    out[i].ready = true;  // the scale subresource counts pods; readiness shows on the router's side
  }
  return out;
}

}  // namespace k3::orchestrator

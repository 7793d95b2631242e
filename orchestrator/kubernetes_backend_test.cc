// The kubernetes backend against an HTTPS server of this test's own that implements GET/PATCH of
// the scale subresource (bearer token, resourceVersion conflicts, RBAC and missing objects), with
// a throwaway CA and server certificate made by openssl. No real API server runs here.
#include "orchestrator/kubernetes_backend.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

namespace k3::orchestrator {
namespace {

namespace fs = std::filesystem;

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// A CA, a server certificate for 127.0.0.1 signed by it, and an unrelated CA.
std::string MakeCerts() {
  char tmpl[] = "/tmp/k3serve-k8s-test-XXXXXX";
  std::string dir = ::mkdtemp(tmpl);
  Write(dir + "/ext", "subjectAltName=IP:127.0.0.1\n");
  const std::string cmd = "(cd " + dir +
                          " && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=test-ca"
                          " && openssl req -newkey rsa:2048 -nodes -keyout srv.key -out srv.csr -subj /CN=127.0.0.1"
                          " && openssl x509 -req -in srv.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out srv.crt -days 1 -extfile ext"
                          " && openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.crt -days 1 -subj /CN=other-ca"
                          ") >/dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0) return "";
  return dir;
}

class FakeApiServer {
 public:
  struct Object {
    int spec = 1;
    int status = 1;
    int rv = 100;
  };
  explicit FakeApiServer(const std::string& dir)
      : server_((dir + "/srv.crt").c_str(), (dir + "/srv.key").c_str()) {
    objects_["/apis/apps/v1/namespaces/serving/deployments/k3serve-attention/scale"] = {};
    objects_["/apis/apps/v1/namespaces/serving/statefulsets/k3serve-expert/scale"] = {2, 2, 200};
    auto guard = [this](const httplib::Request& req, httplib::Response& res) -> Object* {
      if (req.get_header_value("Authorization") != "Bearer good-token") {
        Reply(res, 401, R"({"kind":"Status","message":"Unauthorized"})");
        return nullptr;
      }
      if (req.path.find("/namespaces/locked/") != std::string::npos) {
        Reply(res, 403, R"({"kind":"Status","message":"scale is forbidden: User \"system:serviceaccount:locked:default\" cannot patch"})");
        return nullptr;
      }
      auto it = objects_.find(req.path);
      if (it == objects_.end()) {
        Reply(res, 404, R"({"kind":"Status","message":"not found"})");
        return nullptr;
      }
      return &it->second;
    };
    const std::string pattern = R"(/apis/apps/v1/namespaces/[^/]+/(deployments|statefulsets)/[^/]+/scale)";
    server_.Get(pattern, [this, guard](const httplib::Request& req, httplib::Response& res) {
      std::lock_guard<std::mutex> lock(mu_);
      if (Object* o = guard(req, res)) Reply(res, 200, Render(*o));
    });
    server_.Patch(pattern, [this, guard](const httplib::Request& req, httplib::Response& res) {
      std::lock_guard<std::mutex> lock(mu_);
      Object* o = guard(req, res);
      if (!o) return;
      patches.push_back({req.path, req.get_header_value("Content-Type"), req.body});
      if (conflicts > 0) {  // another writer got there first
        --conflicts;
        ++o->rv;
        Reply(res, 409, R"({"kind":"Status","message":"the object has been modified"})");
        return;
      }
      auto j = nlohmann::json::parse(req.body, nullptr, false);
      if (!j.is_object() || j.value("/metadata/resourceVersion"_json_pointer, std::string()) != std::to_string(o->rv)) {
        Reply(res, 409, R"({"kind":"Status","message":"the object has been modified"})");
        return;
      }
      o->spec = j["spec"]["replicas"].get<int>();
      if (!lagging) o->status = o->spec;
      ++o->rv;
      Reply(res, 200, Render(*o));
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    // Bound already: connections wait in the backlog until the accept loop runs.
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~FakeApiServer() {
    server_.stop();
    thread_.join();
  }
  std::string url() const { return "https://127.0.0.1:" + std::to_string(port_); }
  Object get(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    return objects_.at(path);
  }

  struct Patch {
    std::string path, content_type, body;
  };
  std::vector<Patch> patches;
  int conflicts = 0;     // PATCHes answered 409 (with the version moved) before one succeeds
  bool lagging = false;  // status.replicas stays behind spec

 private:
  static void Reply(httplib::Response& res, int status, const std::string& body) {
    res.status = status;
    res.set_content(body, "application/json");
  }
  static std::string Render(const Object& o) {
    nlohmann::json j;
    j["kind"] = "Scale";
    j["metadata"]["resourceVersion"] = std::to_string(o.rv);
    j["spec"]["replicas"] = o.spec;
    j["status"]["replicas"] = o.status;
    return j.dump();
  }

  httplib::SSLServer server_;
  int port_ = 0;
  std::mutex mu_;
  std::map<std::string, Object> objects_;
  std::thread thread_;
};

class KubernetesBackendTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new std::string(MakeCerts()); }
  static void TearDownTestSuite() {
    if (!dir_->empty()) fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override {
    ASSERT_FALSE(dir_->empty()) << "openssl could not make the test certificates";
    server_ = std::make_unique<FakeApiServer>(*dir_);
    Write(*dir_ + "/token", "good-token\n");
    Write(*dir_ + "/bad-token", "stale-token\n");
  }
  KubernetesOptions Options() {
    KubernetesOptions o;
    o.api = server_->url();
    o.token_file = *dir_ + "/token";
    o.ca_file = *dir_ + "/ca.crt";
    o.namespace_ = "serving";
    return o;
  }
  std::unique_ptr<KubernetesBackend> Make(const KubernetesOptions& o) {
    auto b = KubernetesBackend::Create(o);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }
  static std::string* dir_;
  std::unique_ptr<FakeApiServer> server_;
};
std::string* KubernetesBackendTest::dir_ = nullptr;

const char* kAttention = "/apis/apps/v1/namespaces/serving/deployments/k3serve-attention/scale";
const char* kExperts = "/apis/apps/v1/namespaces/serving/statefulsets/k3serve-expert/scale";

TEST_F(KubernetesBackendTest, PatchesBothScaleSubresourcesWithTokenAndResourceVersion) {
  auto b = Make(Options());
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->Apply(Pool::kAttention, 3).ok());
  ASSERT_TRUE(b->Apply(Pool::kExperts, 4).ok());
  EXPECT_EQ(server_->get(kAttention).spec, 3);
  EXPECT_EQ(server_->get(kExperts).spec, 4);
  ASSERT_EQ(server_->patches.size(), 2u);
  EXPECT_EQ(server_->patches[0].path, kAttention);
  EXPECT_EQ(server_->patches[0].content_type, "application/merge-patch+json");
  EXPECT_EQ(nlohmann::json::parse(server_->patches[0].body),
            nlohmann::json::parse(R"({"metadata":{"resourceVersion":"100"},"spec":{"replicas":3}})"));
  EXPECT_EQ(nlohmann::json::parse(server_->patches[1].body),
            nlohmann::json::parse(R"({"metadata":{"resourceVersion":"200"},"spec":{"replicas":4}})"));
  // Already at the size: nothing is sent.
  ASSERT_TRUE(b->Apply(Pool::kAttention, 3).ok());
  EXPECT_EQ(server_->patches.size(), 2u);
  auto replicas = b->List(Pool::kExperts);
  ASSERT_TRUE(replicas.ok()) << replicas.status();
  ASSERT_EQ(replicas->size(), 4u);
  EXPECT_EQ((*replicas)[3].name, "k3serve-expert-3");
}

TEST_F(KubernetesBackendTest, RetriesOnConflictThenGivesUp) {
  auto b = Make(Options());
  ASSERT_TRUE(b);
  server_->conflicts = 2;
  ASSERT_TRUE(b->Apply(Pool::kAttention, 2).ok());
  EXPECT_EQ(server_->patches.size(), 3u);  // two 409s, then the write with the fresh version
  EXPECT_EQ(nlohmann::json::parse(server_->patches[2].body)["metadata"]["resourceVersion"], "102");
  EXPECT_EQ(server_->get(kAttention).spec, 2);
  server_->conflicts = 1000;
  const absl::Status s = b->Apply(Pool::kAttention, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("409"), std::string::npos) << s;
  EXPECT_EQ(server_->get(kAttention).spec, 2);
}

TEST_F(KubernetesBackendTest, ClearErrorsFor401And403And404) {
  KubernetesOptions o = Options();
  o.token_file = *dir_ + "/bad-token";
  absl::Status s = Make(o)->Apply(Pool::kAttention, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_NE(s.message().find("401 Unauthorized"), std::string::npos) << s;
  EXPECT_NE(s.message().find("token was rejected"), std::string::npos) << s;

  o = Options();
  o.namespace_ = "locked";
  s = Make(o)->Apply(Pool::kExperts, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("403 Forbidden"), std::string::npos) << s;
  EXPECT_NE(s.message().find("RBAC"), std::string::npos) << s;
  EXPECT_NE(s.message().find("cannot patch"), std::string::npos) << s;  // the server's own words

  o = Options();
  o.attention_deployment = "no-such-deployment";
  s = Make(o)->Apply(Pool::kAttention, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("404 Not Found"), std::string::npos) << s;
  EXPECT_NE(s.message().find("no-such-deployment"), std::string::npos) << s;
  EXPECT_TRUE(server_->patches.empty());
}

TEST_F(KubernetesBackendTest, VerifiesTheServerAgainstTheCa) {
  KubernetesOptions o = Options();
  o.ca_file = *dir_ + "/other.crt";
  const absl::Status s = Make(o)->Apply(Pool::kAttention, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(server_->patches.empty());
  o.ca_file = *dir_ + "/missing.crt";
  EXPECT_EQ(KubernetesBackend::Create(o).status().code(), absl::StatusCode::kFailedPrecondition);
  o = Options();
  o.api = "http://127.0.0.1:1";
  EXPECT_EQ(KubernetesBackend::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(KubernetesBackendTest, DryRunPrintsInsteadOfPatching) {
  KubernetesOptions o = Options();
  o.dry_run = true;
  auto b = Make(o);
  ASSERT_TRUE(b);
  ::testing::internal::CaptureStdout();
  ASSERT_TRUE(b->Apply(Pool::kExperts, 3).ok());
  ASSERT_TRUE(b->Apply(Pool::kExperts, 3).ok());  // printed once
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(out, "dry-run: PATCH " + server_->url() + kExperts +
                     " (application/merge-patch+json) {\"metadata\":{\"resourceVersion\":\"200\"},\"spec\":{\"replicas\":3}}\n");
  EXPECT_TRUE(server_->patches.empty());
  EXPECT_EQ(server_->get(kExperts).spec, 2);
}

TEST_F(KubernetesBackendTest, ReportsPodsThatAreNotRunning) {
  auto b = Make(Options());
  ASSERT_TRUE(b);
  server_->lagging = true;
  ASSERT_TRUE(b->Apply(Pool::kExperts, 3).ok());  // the PATCH itself succeeds
  const absl::Status s = b->Apply(Pool::kExperts, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("2 of 3 replicas running"), std::string::npos) << s;
}

}  // namespace
}  // namespace k3::orchestrator

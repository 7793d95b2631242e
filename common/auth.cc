#include "common/auth.h"

#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"

ABSL_FLAG(std::string, node_token_file, "", "file holding the cluster's node token (nodes present it; the router and expert nodes require it)");
ABSL_FLAG(std::string, admin_token_file, "", "file holding the admin token (router/orchestrator identity; required by admin calls)");
ABSL_FLAG(std::string, admin_cn, "k3serve-admin", "common name of the client certificate that has the admin identity (mTLS)");
ABSL_FLAG(std::string, api_keys_file, "", "file of API keys, one a line: the public API then requires authorization: Bearer <key>");

namespace k3::auth {
namespace {

struct State {
  std::string node_token, admin_token, admin_cn, node_key;
  std::set<std::string> api_keys;
};

State& Global() {
  static State s = [] {
    State st;
    std::random_device rd;
    std::uniform_int_distribution<int> hex(0, 15);
    for (int i = 0; i < 32; ++i) st.node_key.push_back("0123456789abcdef"[hex(rd)]);
    return st;
  }();
  return s;
}

absl::StatusOr<std::string> ReadSecret(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s(absl::StripAsciiWhitespace(ss.str()));
  if (s.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  return s;
}

std::string Metadata(const grpc::ServerContext& ctx, const char* key) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(key);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

// The verified client certificate's common name, "" without one.
std::string PeerCommonName(const grpc::ServerContext& ctx) {
  auto auth = ctx.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return {};
  for (const auto& v : auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME)) return std::string(v.data(), v.size());
  return "(certificate)";
}

// A control-plane check applies when there is something to check against.
bool NodeCheckConfigured() { return !Global().node_token.empty(); }

}  // namespace

absl::Status LoadFromFlags() {
  State& s = Global();
  if (const std::string f = absl::GetFlag(FLAGS_node_token_file); !f.empty()) {
    K3_ASSIGN_OR_RETURN(s.node_token, ReadSecret(f, "--node-token-file"));
  }
  if (const std::string f = absl::GetFlag(FLAGS_admin_token_file); !f.empty()) {
    K3_ASSIGN_OR_RETURN(s.admin_token, ReadSecret(f, "--admin-token-file"));
  }
  s.admin_cn = absl::GetFlag(FLAGS_admin_cn);
  if (const std::string f = absl::GetFlag(FLAGS_api_keys_file); !f.empty()) {
    K3_ASSIGN_OR_RETURN(std::string keys, ReadSecret(f, "--api-keys-file"));
    for (absl::string_view line : absl::StrSplit(keys, '\n')) {
      line = absl::StripAsciiWhitespace(line);
      if (!line.empty() && line[0] != '#') s.api_keys.emplace(line);
    }
  }
  return absl::OkStatus();
}

const std::string& NodeToken() { return Global().node_token; }
const std::string& NodeKey() { return Global().node_key; }

bool SecretEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size() || b.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

Role RoleOf(const grpc::ServerContext& ctx) {
  const State& s = Global();
  const std::string cn = PeerCommonName(ctx);
  const std::string admin = Metadata(ctx, kAdminTokenKey);
  if ((!s.admin_token.empty() && SecretEquals(admin, s.admin_token)) || (!cn.empty() && cn == s.admin_cn)) return Role::kAdmin;
  const std::string node = Metadata(ctx, kNodeTokenKey);
  if (!cn.empty() || (!s.node_token.empty() && SecretEquals(node, s.node_token))) return Role::kNode;
  return Role::kNone;
}

std::string IdentityOf(const grpc::ServerContext& ctx) {
  return absl::StrCat(PeerCommonName(ctx), "/", Metadata(ctx, kNodeKeyKey));
}

grpc::Status RequireNode(const grpc::ServerContext& ctx, const char* method) {
  if (RoleOf(ctx) != Role::kNone) return grpc::Status::OK;
  // mTLS servers never get here without a certificate; a token-less dev process is open.
  if (!NodeCheckConfigured() && Global().admin_token.empty()) return grpc::Status::OK;
  return {grpc::StatusCode::UNAUTHENTICATED, absl::StrCat(method, " needs the cluster's node token or a client certificate")};
}

grpc::Status RequireAdmin(const grpc::ServerContext& ctx, const char* method) {
  const Role r = RoleOf(ctx);
  if (r == Role::kAdmin) return grpc::Status::OK;
  if (Global().admin_token.empty() && PeerCommonName(ctx).empty() && !NodeCheckConfigured()) return grpc::Status::OK;
  if (r == Role::kNode)
    return {grpc::StatusCode::PERMISSION_DENIED, absl::StrCat(method, " needs the admin identity; this caller is a node")};
  return {grpc::StatusCode::UNAUTHENTICATED, absl::StrCat(method, " needs the admin token or the admin's client certificate")};
}

grpc::Status RequireApiKey(const grpc::ServerContext& ctx) {
  if (Global().api_keys.empty()) return grpc::Status::OK;
  return CheckApiKey(Metadata(ctx, "authorization"));
}

grpc::Status CheckApiKey(std::string_view h) {
  const State& s = Global();
  if (s.api_keys.empty()) return grpc::Status::OK;
  constexpr std::string_view kBearer = "Bearer ";
  if (h.empty()) return {grpc::StatusCode::UNAUTHENTICATED, "missing API key (authorization: Bearer <key>)"};
  if (h.substr(0, kBearer.size()) == kBearer) {
    const std::string_view key = h.substr(kBearer.size());
    bool ok = false;
    for (const auto& k : s.api_keys) ok |= SecretEquals(key, k);  // no early exit: constant time over keys
    if (ok) return grpc::Status::OK;
  }
  return {grpc::StatusCode::UNAUTHENTICATED, "invalid API key"};
}

void AddNodeCredentials(grpc::ClientContext* ctx) {
  const State& s = Global();
  if (!s.node_token.empty()) ctx->AddMetadata(kNodeTokenKey, s.node_token);
  ctx->AddMetadata(kNodeKeyKey, s.node_key);
}

void AddAdminCredentials(grpc::ClientContext* ctx) {
  const State& s = Global();
  if (!s.admin_token.empty()) ctx->AddMetadata(kAdminTokenKey, s.admin_token);
  AddNodeCredentials(ctx);
}

}  // namespace k3::auth

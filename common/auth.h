// Who a gRPC call comes from, and what it may do (DESIGN §5).
//
// Identities:
//   node    a cluster member: presents the cluster's node token (metadata k3serve-node-token, from
//           --node-token-file) or a client certificate of the cluster's CA (mTLS);
//   admin   the router / orchestrator: presents the admin token (k3serve-admin-token, from
//           --admin-token-file) or a client certificate whose common name is --admin-cn;
//   client  the public API: `authorization: Bearer <key>` with a key of --api-keys-file.
// A node process also sends k3serve-node-key, a random value of its own: the router binds a
// node_id to the first key that registered it, so another process cannot take over that id.
// With no token file and no TLS client CA configured, the corresponding check is open (a
// standalone dev process); `k3serve up` always configures both tokens.
#pragma once

#include <string>
#include <string_view>

#include <grpcpp/grpcpp.h>

#include "common/status.h"

namespace k3::auth {

inline constexpr char kNodeTokenKey[] = "k3serve-node-token";
inline constexpr char kAdminTokenKey[] = "k3serve-admin-token";
inline constexpr char kNodeKeyKey[] = "k3serve-node-key";

enum class Role { kNone, kNode, kAdmin };

// Reads --node-token-file, --admin-token-file and --api-keys-file; the error names the file. Call
// once in main, after flag parsing.
absl::Status LoadFromFlags();

const std::string& NodeToken();   // "" if none
const std::string& NodeKey();     // this process's random key

// The caller's role on the control plane: admin > node > none.
Role RoleOf(const grpc::ServerContext& ctx);
// The key a node sent (k3serve-node-key), plus its certificate's name when it has one.
std::string IdentityOf(const grpc::ServerContext& ctx);

// OK, UNAUTHENTICATED (no or wrong credentials) or PERMISSION_DENIED (a node calling an admin
// method). Never names a secret.
grpc::Status RequireNode(const grpc::ServerContext& ctx, const char* method);
grpc::Status RequireAdmin(const grpc::ServerContext& ctx, const char* method);
// The public API: OK when no keys are configured or the bearer key is one of them.
grpc::Status RequireApiKey(const grpc::ServerContext& ctx);
// The same check of an `authorization` value carried some other way (the gateway's streams).
grpc::Status CheckApiKey(std::string_view authorization);

// Adds this process's credentials to an outgoing call.
void AddNodeCredentials(grpc::ClientContext* ctx);
void AddAdminCredentials(grpc::ClientContext* ctx);

// Constant-time comparison of secrets.
bool SecretEquals(std::string_view a, std::string_view b);

}  // namespace k3::auth

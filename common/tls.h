// TLS for every gRPC server and client, from --tls-cert / --tls-key / --tls-ca (PEM files).
//   server: TLS with the cert and key; with `mutual` and a CA, clients must present a certificate
//           signed by that CA (the control plane). No files: plaintext.
//   client: with a CA, TLS verifying the server against it; with a cert and key too, they are the
//           client certificate (mTLS). No files: plaintext.
// The files are watched: a changed file is re-read by gRPC within a second; SIGHUP re-validates
// them at once and logs the outcome (ReloadOnSighup).
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "common/status.h"

namespace k3::tls {

struct Files {
  std::string cert, key, ca;
  bool server_enabled() const { return !cert.empty(); }
  bool client_enabled() const { return !ca.empty(); }
};

// The --tls-* flags.
Files FilesFromFlags();

// Each named file must exist and parse; certificates must be within their validity period; a key
// must belong to its certificate. The error names the file and the flag.
absl::Status Validate(const Files& files);

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const Files& files, bool mutual);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const Files& files);

// The same from the flags (validated): what each binary calls.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFlags(bool mutual);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFlags();
// A channel to `address` with ChannelCredentialsFromFlags(). Binaries call
// ChannelCredentialsFromFlags() at startup, so that bad files are a startup error; here they end
// the process with the same message.
std::shared_ptr<grpc::Channel> NewChannel(const std::string& address);

// Starts a thread that re-validates the flags' files on SIGHUP and logs the result as `who`.
void ReloadOnSighup(const std::string& who);

}  // namespace k3::tls

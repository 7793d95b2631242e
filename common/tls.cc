#include "common/tls.h"

#include <signal.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "", "PEM certificate (chain) of this process: TLS on its gRPC server, its client certificate");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle: verifies servers, and the control plane's client certificates (mTLS)");

namespace k3::tls {
namespace {

// gRPC re-reads watched files this often.
constexpr int kRefreshSeconds = 1;

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

// Every certificate in a PEM file, each checked against the clock.
absl::StatusOr<std::vector<std::unique_ptr<X509, X509Free>>> ParseCerts(const std::string& path, const char* flag) {
  K3_ASSIGN_OR_RETURN(std::string pem, ReadFile(path, flag));
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::vector<std::unique_ptr<X509, X509Free>> out;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    out.emplace_back(x);
    if (X509_cmp_current_time(X509_get0_notAfter(x)) <= 0)
      return absl::InvalidArgumentError(absl::StrCat(flag, ": the certificate in ", path, " has expired"));
    if (X509_cmp_current_time(X509_get0_notBefore(x)) >= 0)
      return absl::InvalidArgumentError(absl::StrCat(flag, ": the certificate in ", path, " is not valid yet"));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no PEM certificate"));
  return out;
}

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(const Files& f) {
  using grpc::experimental::FileWatcherCertificateProvider;
  if (!f.cert.empty() && !f.ca.empty())
    return std::make_shared<FileWatcherCertificateProvider>(f.key, f.cert, f.ca, kRefreshSeconds);
  if (!f.cert.empty()) return std::make_shared<FileWatcherCertificateProvider>(f.key, f.cert, kRefreshSeconds);
  return std::make_shared<FileWatcherCertificateProvider>(f.ca, kRefreshSeconds);
}

std::atomic<bool> g_sighup{false};
void OnSighup(int) { g_sighup.store(true); }

}  // namespace

Files FilesFromFlags() { return {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca)}; }

absl::Status Validate(const Files& f) {
  if (f.cert.empty() != f.key.empty())
    return absl::InvalidArgumentError("--tls-cert and --tls-key must be given together");
  if (!f.cert.empty()) {
    K3_ASSIGN_OR_RETURN(auto certs, ParseCerts(f.cert, "--tls-cert"));
    K3_ASSIGN_OR_RETURN(std::string pem, ReadFile(f.key, "--tls-key"));
    std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
    std::unique_ptr<EVP_PKEY, KeyFree> key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    if (!key) return absl::InvalidArgumentError(absl::StrCat("--tls-key: ", f.key, " holds no PEM private key"));
    if (X509_check_private_key(certs[0].get(), key.get()) != 1)
      return absl::InvalidArgumentError(absl::StrCat("--tls-key: ", f.key, " is not the key of --tls-cert ", f.cert));
  }
  if (!f.ca.empty()) K3_RETURN_IF_ERROR(ParseCerts(f.ca, "--tls-ca").status());
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const Files& f, bool mutual) {
  K3_RETURN_IF_ERROR(Validate(f));
  if (!f.server_enabled()) {
    if (!f.ca.empty()) return absl::InvalidArgumentError("--tls-ca without --tls-cert/--tls-key: a TLS server needs its own certificate");
    return grpc::InsecureServerCredentials();
  }
  grpc::experimental::TlsServerCredentialsOptions opt(Provider(f));
  opt.watch_identity_key_cert_pairs();
  if (!f.ca.empty()) opt.watch_root_certs();
  opt.set_cert_request_type(mutual && !f.ca.empty() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                    : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  return grpc::experimental::TlsServerCredentials(opt);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const Files& f) {
  K3_RETURN_IF_ERROR(Validate(f));
  if (!f.client_enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions opt;
  opt.set_certificate_provider(Provider(f));
  opt.watch_root_certs();
  if (!f.cert.empty()) opt.watch_identity_key_cert_pairs();
  return grpc::experimental::TlsCredentials(opt);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFlags(bool mutual) {
  return ServerCredentials(FilesFromFlags(), mutual);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFlags() {
  return ChannelCredentials(FilesFromFlags());
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& address) {
  static const auto creds = [] {
    auto c = ChannelCredentialsFromFlags();
    if (!c.ok()) {
      std::fprintf(stderr, "TLS: %s\n", std::string(c.status().message()).c_str());
      std::exit(2);
    }
    return *c;
  }();
  return grpc::CreateChannel(address, creds);
}

void ReloadOnSighup(const std::string& who) {
  struct sigaction sa {};
  sa.sa_handler = OnSighup;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGHUP, &sa, nullptr);
  std::thread([who] {
    while (true) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      if (!g_sighup.exchange(false)) continue;
      const absl::Status s = Validate(FilesFromFlags());
      if (s.ok()) std::fprintf(stderr, "%s: SIGHUP: TLS files re-read\n", who.c_str());
      else std::fprintf(stderr, "%s: SIGHUP: TLS files invalid (new connections will fail until fixed): %s\n", who.c_str(),
                        std::string(s.message()).c_str());
    }
  }).detach();
}

}  // namespace k3::tls

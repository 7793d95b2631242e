#include "router/socket_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace k3::dataplane {

absl::StatusOr<sockaddr_storage> ResolveAddress(const std::string& address, bool passive) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat("address \"", address, "\" is not host:port"));
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  uint32_t port_number;
  if (!absl::SimpleAtoi(port, &port_number) || port_number > 65535)
    return absl::InvalidArgumentError(absl::StrCat("address \"", address, "\": bad port \"", port, "\""));
  if (host.empty() && !passive)
    return absl::InvalidArgumentError(absl::StrCat("address \"", address, "\" has no host"));

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0)
    return absl::InvalidArgumentError(absl::StrCat("address \"", address, "\": ", ::gai_strerror(rc)));
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  ::freeaddrinfo(found);
  return out;
}

socklen_t AddressLength(const sockaddr_storage& a) {
  return a.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

std::string FormatAddress(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
    ::inet_ntop(AF_INET6, &in6.sin6_addr, host, sizeof(host));
    return absl::StrCat("[", host, "]:", ntohs(in6.sin6_port));
  }
  const auto& in4 = reinterpret_cast<const sockaddr_in&>(a);
  ::inet_ntop(AF_INET, &in4.sin_addr, host, sizeof(host));
  return absl::StrCat(host, ":", ntohs(in4.sin_port));
}

}  // namespace k3::dataplane

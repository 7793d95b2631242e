// Socket addresses as the data-plane transports take them: "host:port" or "[v6 host]:port".
#pragma once

#include <sys/socket.h>

#include <string>

#include "common/status.h"

namespace k3::dataplane {

// "host:port" or "[v6 host]:port" -> socket address (numeric port). An empty host means any
// address, for listening (passive) only. InvalidArgument names the address.
absl::StatusOr<sockaddr_storage> ResolveAddress(const std::string& address, bool passive);
socklen_t AddressLength(const sockaddr_storage& a);
// "host:port", with the v6 host in brackets.
std::string FormatAddress(const sockaddr_storage& a);

}  // namespace k3::dataplane

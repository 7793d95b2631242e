#include "tools/http_get.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace k3 {

namespace {

absl::StatusOr<std::string> HttpRequest(const std::string& method, const std::string& host, int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("connect ", host, ":", port, ": ", std::strerror(errno)));
  }
  const std::string req = absl::StrCat(method, " ", path, " HTTP/1.0\r\nHost: ", host, "\r\nContent-Length: 0\r\n\r\n");
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) resp.append(buf, n);
  ::close(fd);
  const size_t body = resp.find("\r\n\r\n");
  if (resp.rfind("HTTP/1.", 0) != 0 || body == std::string::npos) return absl::DataLossError("malformed HTTP response");
  if (resp.compare(9, 3, "200") != 0) return absl::UnavailableError(absl::StrCat("HTTP ", resp.substr(9, 3)));
  return resp.substr(body + 4);
}

}  // namespace

absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path) {
  return HttpRequest("GET", host, port, path);
}

absl::StatusOr<std::string> HttpPost(const std::string& host, int port, const std::string& path) {
  return HttpRequest("POST", host, port, path);
}

double MetricValue(const std::string& exposition, const std::string& name, const std::string& label_filter) {
  return MetricValue(exposition, name, {label_filter});
}

double MetricValue(const std::string& exposition, const std::string& name, std::initializer_list<std::string> label_filters) {
  std::istringstream in(exposition);
  std::string line;
  double sum = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line.compare(0, name.size(), name) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : '\0';
    if (next != ' ' && next != '{') continue;
    if (std::any_of(label_filters.begin(), label_filters.end(),
                    [&](const std::string& f) { return line.find(f) == std::string::npos; }))
      continue;
    sum += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return sum;
}

}  // namespace k3

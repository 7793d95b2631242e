// A small HTTP/1.1 server (cpp-httplib) for /metrics and admin JSON endpoints.
//
// Not civetweb: its worker threads have a fixed 100 KB stack, and a process that links cuBLAS
// (94 KB of static TLS in libcublasLt) cannot start them. cpp-httplib's threads are std::threads.
//
//   K3_ASSIGN_OR_RETURN(auto server, HttpServer::Start({.host = "0.0.0.0", .port = 9100}));
//   server->HandleMetrics(registry);
//   server->Handle("GET", "/admin/expert_load", [&](const HttpRequest&) {
//     return HttpResponse{200, "application/json", load.dump()};
//   });
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace k3 {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // URL-decoded, without the query
  std::string query;   // after '?', undecoded; empty if none
  std::string body;
};

// Every member has a default so that `HttpResponse{200, "application/json", body}` compiles
// cleanly under -Wextra.
struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body = {};
  std::vector<std::pair<std::string, std::string>> headers = {};  // beyond Content-Type/-Length
};

// Called concurrently from the server's worker threads.
using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

class HttpServer {
 public:
  struct Options {
    std::string host = "0.0.0.0";  // an IPv4 address, or an IPv6 one without brackets
    int port = 0;                  // 0: an ephemeral port, see port()
    int num_threads = 4;           // concurrent requests
    size_t max_body_bytes = 1 << 20;
  };

  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const Options& options);

  // Stops accepting, waits for requests in flight and joins the workers. Whatever the handlers
  // use must outlive the server.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound port (the real one when Options::port was 0).
  int port() const { return port_; }

  // Serves exact `path` for `method`, replacing an earlier handler for the pair. Safe while
  // serving. Unknown paths answer 404, a known path with another method 405, a body over
  // Options::max_body_bytes 413, a handler that throws 500.
  void Handle(std::string method, std::string path, HttpHandler handler);

  // GET `path` serves registry.Expose() as text format 0.0.4. The registry must outlive the server.
  void HandleMetrics(const metrics::Registry& registry, std::string path = "/metrics");

 private:
  HttpServer();
  void Serve(const httplib::Request& req, httplib::Response& res);
  HttpResponse Dispatch(const httplib::Request& req);

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;

  std::mutex mu_;
  // path -> method -> handler; shared so a request keeps its handler alive across a replacement.
  std::map<std::string, std::map<std::string, std::shared_ptr<const HttpHandler>>> handlers_;
};

}  // namespace k3

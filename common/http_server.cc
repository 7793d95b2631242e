#include "common/http_server.h"

#include <httplib.h>

#include <chrono>
#include <exception>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace k3 {
namespace {

HttpResponse TextResponse(int status, std::string body) {
  return HttpResponse{status, "text/plain; charset=utf-8", std::move(body)};
}

}  // namespace

HttpServer::HttpServer() : server_(std::make_unique<httplib::Server>()) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const Options& options) {
  auto server = absl::WrapUnique(new HttpServer());
  httplib::Server& s = *server->server_;
  const int threads = options.num_threads;
  s.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  s.set_payload_max_length(options.max_body_bytes);  // larger bodies get 413
  // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, which would let a second server
  // share a port that is in use instead of failing.
  s.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Every path and method comes to Serve, which matches exactly (404 / 405 are ours).
  auto serve = [raw = server.get()](const httplib::Request& req, httplib::Response& res) { raw->Serve(req, res); };
  s.Get(".*", serve).Post(".*", serve).Put(".*", serve).Delete(".*", serve).Patch(".*", serve);
  const std::string listen = absl::StrCat(options.host, ":", options.port);
  if (options.port == 0) {
    server->port_ = s.bind_to_any_port(options.host);
    if (server->port_ < 0) return absl::UnavailableError(absl::StrCat("http server on ", listen, ": cannot bind"));
  } else {
    if (!s.bind_to_port(options.host, options.port))
      return absl::UnavailableError(absl::StrCat("http server on ", listen, ": cannot bind (port in use?)"));
    server->port_ = options.port;
  }
  server->thread_ = std::thread([&s] { s.listen_after_bind(); });
  // stop() is a no-op until the loop runs: wait for it, so that a server destroyed right away
  // still stops.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!s.is_running()) {
    if (std::chrono::steady_clock::now() > deadline)
      return absl::UnavailableError(absl::StrCat("http server on ", listen, ": did not start listening"));
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return server;
}

HttpServer::~HttpServer() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void HttpServer::Handle(std::string method, std::string path, HttpHandler handler) {
  auto shared = std::make_shared<const HttpHandler>(std::move(handler));
  std::lock_guard lock(mu_);
  handlers_[std::move(path)][std::move(method)] = std::move(shared);
}

void HttpServer::HandleMetrics(const metrics::Registry& registry, std::string path) {
  Handle("GET", std::move(path), [&registry](const HttpRequest&) {
    return HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8", registry.Expose()};
  });
}

void HttpServer::Serve(const httplib::Request& req, httplib::Response& res) {
  const HttpResponse response = Dispatch(req);
  res.status = response.status;
  for (const auto& [name, value] : response.headers) res.set_header(name, value);
  res.set_content(response.body, response.content_type.c_str());
}

HttpResponse HttpServer::Dispatch(const httplib::Request& req) {
  HttpRequest request;
  request.method = req.method;
  request.path = req.path;
  const size_t q = req.target.find('?');
  if (q != std::string::npos) request.query = req.target.substr(q + 1);
  request.body = req.body;

  std::shared_ptr<const HttpHandler> handler;
  {
    std::lock_guard lock(mu_);
    auto by_path = handlers_.find(request.path);
    if (by_path == handlers_.end()) return TextResponse(404, "not found\n");
    auto by_method = by_path->second.find(request.method);
    if (by_method == by_path->second.end()) {
      HttpResponse response = TextResponse(405, "method not allowed\n");
      response.headers.emplace_back(
          "Allow", absl::StrJoin(by_path->second, ", ", [](std::string* out, const auto& entry) {
            out->append(entry.first);
          }));
      return response;
    }
    handler = by_method->second;
  }
  try {
    return (*handler)(request);
  } catch (const std::exception& e) {
    return TextResponse(500, absl::StrCat("internal error: ", e.what(), "\n"));
  }
}

}  // namespace k3

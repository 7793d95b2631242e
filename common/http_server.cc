#include "common/http_server.h"

#include <civetweb.h>

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

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const Options& options) {
  // civetweb wants this once per process, before any mg_start; a function-local static makes
  // the first call thread-safe.
  static const unsigned features = mg_init_library(0);
  (void)features;

  auto server = absl::WrapUnique(new HttpServer(options.max_body_bytes));
  const std::string host = options.host.find(':') == std::string::npos
                               ? options.host
                               : absl::StrCat("[", options.host, "]");
  const std::string listen = absl::StrCat(host, ":", options.port);
  const std::string threads = absl::StrCat(options.num_threads);
  const char* config[] = {"listening_ports", listen.c_str(), "num_threads", threads.c_str(),
                          nullptr};
  mg_callbacks callbacks = {};
  mg_init_data init = {&callbacks, server.get(), config};
  unsigned error_code = 0;
  char error_text[256] = "";
  mg_error_data error = {&error_code, error_text, sizeof(error_text)};
  server->ctx_ = mg_start2(&init, &error);
  if (server->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("http server on ", listen, ": ", error_text,
                                               " (civetweb error ", error_code, ")"));
  }
  // "/" is a prefix of every path, so all requests come to OnRequest, which does exact matching.
  mg_set_request_handler(server->ctx_, "/", &HttpServer::OnRequest, server.get());

  mg_server_port port = {};
  if (mg_get_server_ports(server->ctx_, 1, &port) != 1) {
    return absl::InternalError(absl::StrCat("http server on ", listen, ": no listening port"));
  }
  server->port_ = port.port;
  return server;
}

HttpServer::~HttpServer() {
  if (ctx_ != nullptr) mg_stop(ctx_);
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

int HttpServer::OnRequest(mg_connection* conn, void* self) {
  const HttpResponse response = static_cast<HttpServer*>(self)->Dispatch(conn);
  const std::string length = absl::StrCat(response.body.size());
  mg_response_header_start(conn, response.status);
  mg_response_header_add(conn, "Content-Type", response.content_type.c_str(), -1);
  mg_response_header_add(conn, "Content-Length", length.c_str(), -1);
  for (const auto& [name, value] : response.headers) {
    mg_response_header_add(conn, name.c_str(), value.c_str(), -1);
  }
  mg_response_header_send(conn);
  mg_write(conn, response.body.data(), response.body.size());
  return response.status;
}

HttpResponse HttpServer::Dispatch(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  HttpRequest request;
  request.method = info->request_method;
  request.path = info->local_uri != nullptr ? info->local_uri : "";
  if (info->query_string != nullptr) request.query = info->query_string;

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

  // content_length is -1 when unknown (chunked), so the limit is also checked while reading.
  if (info->content_length > static_cast<long long>(max_body_bytes_)) {
    return TextResponse(413, "request body too large\n");
  }
  char buf[8192];
  int n;
  while ((n = mg_read(conn, buf, sizeof(buf))) > 0) {
    request.body.append(buf, n);
    if (request.body.size() > max_body_bytes_) return TextResponse(413, "request body too large\n");
  }

  try {
    return (*handler)(request);
  } catch (const std::exception& e) {
    // An exception must not unwind into civetweb's C threads.
    return TextResponse(500, absl::StrCat("internal error: ", e.what(), "\n"));
  }
}

}  // namespace k3

#include "common/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/http_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing.h"

extern char** environ;

namespace k3::metrics {
namespace {

using ::testing::HasSubstr;

// ---- Helpers: a blocking HTTP/1.0 client, temp dirs, free ports, running a command.

struct ClientResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
};

// HTTP/1.0 so that every server answers with a plain body and closes the connection.
absl::StatusOr<ClientResponse> Fetch(int port, const std::string& method, const std::string& target,
                                     const std::string& body = "") {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  timeval timeout = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to port ", port, " failed"));
  }
  const std::string request =
      absl::StrCat(method, " ", target, " HTTP/1.0\r\nHost: 127.0.0.1:", port,
                   "\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string raw;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) raw.append(buf, n);
  close(fd);

  const size_t header_end = raw.find("\r\n\r\n");
  if (header_end == std::string::npos || raw.compare(0, 5, "HTTP/") != 0) {
    return absl::DataLossError(absl::StrCat("malformed response: ", raw));
  }
  ClientResponse response;
  std::istringstream head(raw.substr(0, header_end));
  std::string line;
  std::getline(head, line);
  std::istringstream(line.substr(line.find(' ') + 1)) >> response.status;
  while (std::getline(head, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    response.headers[absl::AsciiStrToLower(line.substr(0, colon))] =
        std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
  }
  response.body = raw.substr(header_end + 4);
  return response;
}

std::string UrlEncode(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (absl::ascii_isalnum(c) || c == '_' || c == '-' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

std::string MakeTempDir() {
  std::string templ = ::testing::TempDir() + "k3_metrics_test_XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) return "";
  return templ;
}

void RemoveTree(const std::string& dir) {
  if (!dir.empty()) std::system(absl::StrCat("rm -rf '", dir, "'").c_str());
}

bool IsExecutable(const char* path) { return access(path, X_OK) == 0; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---- Exposition text.

// The sample lines of an exposition (no comments), sorted: prometheus-cpp orders families by
// type and children by hash.
std::vector<std::string> Samples(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != '#') out.push_back(line);
  }
  std::sort(out.begin(), out.end());
  return out;
}

using ::testing::ElementsAre;

TEST(MetricsTest, CounterWithLabels) {
  Registry r;
  auto requests = r.AddCounter("k3serve_requests_total", "Requests by status.", {"code", "method"});
  ASSERT_TRUE(requests.ok()) << requests.status();
  (*requests)->WithLabels({"500", "POST"}).Inc();
  (*requests)->WithLabels({"200", "GET"}).Inc(3);
  (*requests)->WithLabels({"200", "POST"}).Inc(0.5);
  (*requests)->WithLabels({"200", "GET"}).Inc();
  (*requests)->WithLabels({"200", "GET"}).Inc(-5);  // a counter never goes down
  const std::string text = r.Expose();
  EXPECT_THAT(text, HasSubstr("# HELP k3serve_requests_total Requests by status.\n"
                              "# TYPE k3serve_requests_total counter\n"));
  EXPECT_THAT(Samples(text), ElementsAre("k3serve_requests_total{code=\"200\",method=\"GET\"} 4",
                                         "k3serve_requests_total{code=\"200\",method=\"POST\"} 0.5",
                                         "k3serve_requests_total{code=\"500\",method=\"POST\"} 1"));
}

TEST(MetricsTest, GaugeWithoutLabelsStartsAtZero) {
  Registry r;
  auto running = r.AddGauge("k3serve_running_requests", "Requests running now.");
  ASSERT_TRUE(running.ok()) << running.status();
  EXPECT_EQ(r.Expose(),
            "# HELP k3serve_running_requests Requests running now.\n"
            "# TYPE k3serve_running_requests gauge\n"
            "k3serve_running_requests 0\n");
  Gauge& g = (*running)->WithLabels();
  g.Set(7);
  g.Inc();
  g.Dec();
  g.Dec();
  g.Add(-2.5);
  EXPECT_EQ(g.Value(), 3.5);
  EXPECT_THAT(r.Expose(), HasSubstr("\nk3serve_running_requests 3.5\n"));
}

TEST(MetricsTest, HistogramBuckets) {
  Registry r;
  auto ttft =
      r.AddHistogram("k3serve_ttft_seconds", "Time to first token.", {0.125, 0.5, 1}, {"pool"});
  ASSERT_TRUE(ttft.ok()) << ttft.status();
  Histogram& a = (*ttft)->WithLabels({"a"});
  a.Observe(0.0625);
  a.Observe(0.125);  // a bound is inclusive: le="0.125"
  a.Observe(0.75);
  a.Observe(3);
  (*ttft)->WithLabels({"b"});  // created, never observed
  const std::string text = r.Expose();
  EXPECT_THAT(text, HasSubstr("# TYPE k3serve_ttft_seconds histogram\n"));
  EXPECT_THAT(Samples(text), ElementsAre("k3serve_ttft_seconds_bucket{pool=\"a\",le=\"+Inf\"} 4",
                                         "k3serve_ttft_seconds_bucket{pool=\"a\",le=\"0.125\"} 2",
                                         "k3serve_ttft_seconds_bucket{pool=\"a\",le=\"0.5\"} 2",
                                         "k3serve_ttft_seconds_bucket{pool=\"a\",le=\"1\"} 3",
                                         "k3serve_ttft_seconds_bucket{pool=\"b\",le=\"+Inf\"} 0",
                                         "k3serve_ttft_seconds_bucket{pool=\"b\",le=\"0.125\"} 0",
                                         "k3serve_ttft_seconds_bucket{pool=\"b\",le=\"0.5\"} 0",
                                         "k3serve_ttft_seconds_bucket{pool=\"b\",le=\"1\"} 0",
                                         "k3serve_ttft_seconds_count{pool=\"a\"} 4",
                                         "k3serve_ttft_seconds_count{pool=\"b\"} 0",
                                         "k3serve_ttft_seconds_sum{pool=\"a\"} 3.9375",
                                         "k3serve_ttft_seconds_sum{pool=\"b\"} 0"));
}

TEST(MetricsTest, HistogramWithoutLabelsAndExponentialBuckets) {
  EXPECT_EQ(ExponentialBuckets(0.25, 2, 4), (std::vector<double>{0.25, 0.5, 1, 2}));
  EXPECT_TRUE(ExponentialBuckets(1, 2, 0).empty());

  Registry r;
  auto batch =
      r.AddHistogram("k3serve_batch_size", "Tokens per batch.", ExponentialBuckets(1, 4, 3));
  ASSERT_TRUE(batch.ok()) << batch.status();
  (*batch)->WithLabels().Observe(2);
  (*batch)->WithLabels().Observe(20);
  EXPECT_THAT(Samples(r.Expose()), ElementsAre("k3serve_batch_size_bucket{le=\"+Inf\"} 2",
                                               "k3serve_batch_size_bucket{le=\"1\"} 0",
                                               "k3serve_batch_size_bucket{le=\"16\"} 1",
                                               "k3serve_batch_size_bucket{le=\"4\"} 1",
                                               "k3serve_batch_size_count 2",
                                               "k3serve_batch_size_sum 22"));
}

TEST(MetricsTest, EscapesLabelValues) {
  Registry r;
  auto g = r.AddGauge("k3serve_escape", "Escapes.", {"v"});
  ASSERT_TRUE(g.ok()) << g.status();
  (*g)->WithLabels({"a\\b\"c\nd"}).Set(1);
  (*g)->WithLabels({"ünïcode"}).Set(2);
  EXPECT_THAT(Samples(r.Expose()), ElementsAre("k3serve_escape{v=\"a\\\\b\\\"c\\nd\"} 1",
                                               "k3serve_escape{v=\"ünïcode\"} 2"));
}

TEST(MetricsTest, EveryKindOfFamilyIsExposed) {
  Registry r;
  ASSERT_TRUE(r.AddGauge("k3serve_b", "B.").ok());
  ASSERT_TRUE(r.AddCounter("k3serve_c_total", "C.").ok());
  ASSERT_TRUE(r.AddHistogram("k3serve_a_seconds", "A.", {1}).ok());
  EXPECT_THAT(Samples(r.Expose()),
              ElementsAre("k3serve_a_seconds_bucket{le=\"+Inf\"} 0", "k3serve_a_seconds_bucket{le=\"1\"} 0",
                          "k3serve_a_seconds_count 0", "k3serve_a_seconds_sum 0", "k3serve_b 0",
                          "k3serve_c_total 0"));
}

TEST(MetricsTest, WithLabelsReturnsTheSameChild) {
  Registry r;
  auto c = r.AddCounter("k3serve_x_total", "X.", {"a"});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(&(*c)->WithLabels({"1"}), &(*c)->WithLabels({"1"}));
  EXPECT_NE(&(*c)->WithLabels({"1"}), &(*c)->WithLabels({"2"}));
  const std::vector<std::string> owned = {"1"};
  EXPECT_EQ(&(*c)->WithLabels({owned[0]}), &(*c)->WithLabels({"1"}));
}

// ---- Validation.

TEST(MetricsTest, RejectsInvalidNames) {
  Registry r;
  for (const char* name : {"", "1abc", "a-b", "a b", "a.b", "ä", "a{b}"}) {
    EXPECT_EQ(r.AddGauge(name, "Help.").status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
  // A cumulative series is a counter named *_total; a counter without it is a mistake.
  EXPECT_EQ(r.AddCounter("k3serve_tokens", "Help.").status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const char* label : {"", "__reserved", "1a", "a-b", "a:b", "ä"}) {
    EXPECT_EQ(r.AddGauge("k3serve_g", "Help.", {label}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << label;
  }
  EXPECT_EQ(r.AddGauge("k3serve_g", "Help.", {"a", "a"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("k3serve_g", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("k3serve_g", "Two\nlines.").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("k3serve_g", "Back\\slash.").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("k3serve_h", "Help.", {1}, {"le"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const double inf = std::numeric_limits<double>::infinity();
  for (const std::vector<double>& bounds : std::vector<std::vector<double>>{
           {1, 1}, {2, 1}, {1, inf}, {std::nan("")}, ExponentialBuckets(1, 1, 3)}) {
    EXPECT_EQ(r.AddHistogram("k3serve_h", "Help.", bounds).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Nothing above was registered, and these are all valid.
  EXPECT_EQ(r.Expose(), "");
  EXPECT_TRUE(r.AddGauge("k3serve_g", "Help.", {"_a", "le", "B9"}).ok());
  EXPECT_TRUE(r.AddCounter("k3serve:recorded_total", "Help.").ok());
  EXPECT_TRUE(r.AddCounter("_underscore_total", "Help.").ok());
  EXPECT_TRUE(r.AddHistogram("k3serve_h", "Help.", {}).ok());
}

TEST(MetricsTest, RejectsDuplicateAndClashingNames) {
  Registry r;
  ASSERT_TRUE(r.AddCounter("k3serve_x_total", "X.").ok());
  EXPECT_EQ(r.AddCounter("k3serve_x_total", "X.").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(r.AddGauge("k3serve_x_total", "X.").status().code(), absl::StatusCode::kAlreadyExists);

  // A histogram writes name_bucket, name_sum and name_count too.
  ASSERT_TRUE(r.AddHistogram("k3serve_h_seconds", "H.", {1}).ok());
  EXPECT_EQ(r.AddGauge("k3serve_h_seconds_count", "C.").status().code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(r.AddGauge("k3serve_g_sum", "S.").ok());
  EXPECT_EQ(r.AddHistogram("k3serve_g", "G.", {1}).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(MetricsDeathTest, WrongNumberOfLabelValuesAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Registry r;
  auto c = r.AddCounter("k3serve_x_total", "X.", {"a"});
  ASSERT_TRUE(c.ok());
  EXPECT_DEATH((*c)->WithLabels({"1", "2"}), "k3serve_x_total takes 1 label values, got 2");
  EXPECT_DEATH((*c)->WithLabels(), "takes 1 label values, got 0");
}

// ---- Concurrency and collectors.

TEST(MetricsTest, ConcurrentUpdatesGiveExactTotals) {
  Registry r;
  auto c = r.AddCounter("k3serve_ops_total", "Ops.", {"kind"});
  auto g = r.AddGauge("k3serve_inflight", "In flight.");
  auto h = r.AddHistogram("k3serve_op_seconds", "Op time.", {0.5, 1.5});
  ASSERT_TRUE(c.ok() && g.ok() && h.ok());

  constexpr int kThreads = 8;
  constexpr int kIters = 50000;
  std::atomic<bool> done{false};
  std::thread scraper([&] {  // exposition must not disturb the writers
    while (!done.load()) r.Expose();
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Gauge& inflight = (*g)->WithLabels();
      Histogram& latency = (*h)->WithLabels();
      for (int i = 0; i < kIters; ++i) {
        // Lookups race with each other too; children are created once.
        (*c)->WithLabels({i % 2 == 0 ? "even" : "odd"}).Inc();
        inflight.Inc();
        latency.Observe(t % 2 == 0 ? 1.0 : 2.0);
        inflight.Dec();
      }
    });
  }
  for (auto& t : threads) t.join();
  done = true;
  scraper.join();

  EXPECT_EQ((*c)->WithLabels({"even"}).Value(), kThreads * kIters / 2);
  EXPECT_EQ((*c)->WithLabels({"odd"}).Value(), kThreads * kIters / 2);
  EXPECT_EQ((*g)->WithLabels().Value(), 0);
  const std::vector<std::string> samples = Samples(r.Expose());
  const auto has = [&](const std::string& line) {
    return std::find(samples.begin(), samples.end(), line) != samples.end();
  };
  EXPECT_TRUE(has(absl::StrCat("k3serve_op_seconds_bucket{le=\"0.5\"} 0")));
  EXPECT_TRUE(has(absl::StrCat("k3serve_op_seconds_bucket{le=\"1.5\"} ", kThreads * kIters / 2)));
  EXPECT_TRUE(has(absl::StrCat("k3serve_op_seconds_bucket{le=\"+Inf\"} ", kThreads * kIters)));
  EXPECT_TRUE(has(absl::StrCat("k3serve_op_seconds_count ", kThreads * kIters)));
  EXPECT_TRUE(has(absl::StrCat("k3serve_op_seconds_sum ", 3 * kThreads * kIters / 2)));
}

TEST(MetricsTest, CollectorsRunAtScrapeUntilTheirHandleIsGone) {
  Registry r;
  auto live = r.AddGauge("k3serve_pool_live_sequences", "Live sequences.", {"pool"});
  ASSERT_TRUE(live.ok());
  int sequences = 3;
  int calls = 0;
  {
    Registry::CollectorHandle handle = r.AddCollector([&] {
      ++calls;
      (*live)->WithLabels({"a"}).Set(sequences);
    });
    EXPECT_THAT(r.Expose(), HasSubstr("k3serve_pool_live_sequences{pool=\"a\"} 3\n"));
    sequences = 5;
    Registry::CollectorHandle moved = std::move(handle);
    EXPECT_THAT(r.Expose(), HasSubstr("k3serve_pool_live_sequences{pool=\"a\"} 5\n"));
    EXPECT_EQ(calls, 2);
  }
  sequences = 9;
  EXPECT_THAT(r.Expose(), HasSubstr("k3serve_pool_live_sequences{pool=\"a\"} 5\n"));
  EXPECT_EQ(calls, 2);
}

// ---- HTTP.

absl::StatusOr<std::unique_ptr<HttpServer>> StartLoopback() {
  HttpServer::Options options;
  options.host = "127.0.0.1";
  return HttpServer::Start(options);
}

TEST(HttpServerTest, ServesMetricsAndHandlers) {
  Registry r;
  auto c = r.AddCounter("k3serve_requests_total", "Requests.", {"code"});
  ASSERT_TRUE(c.ok());
  (*c)->WithLabels({"200"}).Inc(42);

  auto server = StartLoopback();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  const int port = (*server)->port();
  (*server)->HandleMetrics(r);
  (*server)->Handle("POST", "/admin/echo", [](const HttpRequest& request) {
    return HttpResponse{201, "application/json", request.query + "|" + request.body};
  });

  auto metrics = Fetch(port, "GET", "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(metrics->headers["content-length"], absl::StrCat(metrics->body.size()));
  EXPECT_EQ(metrics->body, r.Expose());

  auto echo = Fetch(port, "POST", "/admin/echo?layer=3", "{\"x\": 1}");
  ASSERT_TRUE(echo.ok()) << echo.status();
  EXPECT_EQ(echo->status, 201);
  EXPECT_EQ(echo->headers["content-type"], "application/json");
  EXPECT_EQ(echo->body, "layer=3|{\"x\": 1}");

  auto missing = Fetch(port, "GET", "/metrics/more");
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->status, 404);
  missing = Fetch(port, "GET", "/");
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->status, 404);

  auto wrong_method = Fetch(port, "POST", "/metrics");
  ASSERT_TRUE(wrong_method.ok()) << wrong_method.status();
  EXPECT_EQ(wrong_method->status, 405);
  EXPECT_EQ(wrong_method->headers["allow"], "GET");

  // A replaced handler takes effect for the next request.
  (*server)->Handle("GET", "/metrics", [](const HttpRequest&) {
    return HttpResponse{200, "text/plain", "v2"};
  });
  metrics = Fetch(port, "GET", "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->body, "v2");

  server->reset();  // stops: the port refuses connections
  EXPECT_FALSE(Fetch(port, "GET", "/metrics").ok());
}

TEST(HttpServerTest, LimitsBodiesAndCatchesExceptions) {
  HttpServer::Options options;
  options.host = "127.0.0.1";
  options.max_body_bytes = 16;
  auto server = HttpServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->Handle("POST", "/x", [](const HttpRequest& request) {
    if (request.body == "throw") throw std::runtime_error("boom");
    return HttpResponse{200, "text/plain", request.body};
  });
  const int port = (*server)->port();
  auto ok = Fetch(port, "POST", "/x", std::string(16, 'a'));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->status, 200);
  auto too_large = Fetch(port, "POST", "/x", std::string(17, 'a'));
  ASSERT_TRUE(too_large.ok()) << too_large.status();
  EXPECT_EQ(too_large->status, 413);
  auto thrown = Fetch(port, "POST", "/x", "throw");
  ASSERT_TRUE(thrown.ok()) << thrown.status();
  EXPECT_EQ(thrown->status, 500);
  EXPECT_THAT(thrown->body, HasSubstr("boom"));
}

TEST(HttpServerTest, FailsOnAPortInUse) {
  auto first = StartLoopback();
  ASSERT_TRUE(first.ok()) << first.status();
  HttpServer::Options options;
  options.host = "127.0.0.1";
  options.port = (*first)->port();
  auto second = HttpServer::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
}

// ---- The real Prometheus tools.

// A registry with every kind of family, named the way promtool's linter wants.
void FillExample(Registry& r) {
  auto requests = r.AddCounter("k3serve_requests_total", "Requests by status.", {"code"});
  auto running = r.AddGauge("k3serve_running_requests", "Requests running now.");
  auto ttft = r.AddHistogram("k3serve_ttft_seconds", "Time to \"first\" token, in seconds.",
                             ExponentialBuckets(0.001, 4, 8), {"pool"});
  ASSERT_TRUE(requests.ok() && running.ok() && ttft.ok());
  (*requests)->WithLabels({"200"}).Inc(10);
  (*requests)->WithLabels({"a\"b\\c\nd"}).Inc();
  (*running)->WithLabels().Set(3);
  (*ttft)->WithLabels({"attention"}).Observe(0.02);
  (*ttft)->WithLabels({"expert"}).Observe(0.3);
}

TEST(PromtoolTest, CheckMetricsAcceptsTheExposition) {
  constexpr char kPromtool[] = "/usr/bin/promtool";
  if (!IsExecutable(kPromtool)) GTEST_SKIP() << kPromtool << " is not installed";
  const std::string dir = MakeTempDir();
  ASSERT_FALSE(dir.empty());

  // Returns promtool's exit status and output for `text`.
  auto check = [&](const std::string& text) {
    const std::string input = dir + "/metrics.txt";
    std::ofstream(input) << text;
    const std::string cmd = absl::StrCat(kPromtool, " check metrics < '", input, "' 2>&1");
    FILE* pipe = popen(cmd.c_str(), "r");
    std::string output;
    char buf[1024];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
    const int status = pclose(pipe);
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, output);
  };

  Registry r;
  FillExample(r);
  const std::string text = r.Expose();
  auto [status, output] = check(text);
  EXPECT_EQ(status, 0) << output << "\n--- exposition:\n" << text;
  EXPECT_EQ(output, "");

  // The check is not vacuous: promtool does reject a broken exposition.
  auto [bad_status, bad_output] = check("# TYPE x counter\nx{a=\"unterminated} 1\n");
  EXPECT_NE(bad_status, 0) << bad_output;
  RemoveTree(dir);
}

// Runs /usr/bin/prometheus scraping an HttpServer, and reads the values back through its API.
class PrometheusTest : public ::testing::Test {
 protected:
  static constexpr char kPrometheus[] = "/usr/bin/prometheus";

  void TearDown() override {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status = 0;
      for (int i = 0; i < 100 && waitpid(pid_, &status, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (waitpid(pid_, &status, WNOHANG) == 0) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
      }
    }
    if (HasFailure() && !dir_.empty()) {
      std::cerr << "--- prometheus log:\n" << ReadFile(dir_ + "/prometheus.log");
    }
    RemoveTree(dir_);
  }

  // Starts Prometheus scraping 127.0.0.1:target_port every second.
  void StartPrometheus(int target_port) {
    dir_ = MakeTempDir();
    ASSERT_FALSE(dir_.empty());
    port_ = testing::FreePort();
    ASSERT_GT(port_, 0);
    const std::string config = dir_ + "/prometheus.yml";
    std::ofstream(config) << "global:\n"
                          << "  scrape_interval: 1s\n"
                          << "  scrape_timeout: 1s\n"
                          << "scrape_configs:\n"
                          << "  - job_name: k3serve_test\n"
                          << "    static_configs:\n"
                          << "      - targets: ['127.0.0.1:" << target_port << "']\n";
    std::vector<std::string> args = {
        kPrometheus,
        "--config.file=" + config,
        "--storage.tsdb.path=" + dir_ + "/data",
        absl::StrCat("--web.listen-address=127.0.0.1:", port_),
        "--log.level=warn",
    };
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log = dir_ + "/prometheus.log";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    const int err = posix_spawn(&pid_, kPrometheus, &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ASSERT_EQ(err, 0) << "posix_spawn " << kPrometheus << ": " << strerror(err);
  }

  // GET an API path, parsed as JSON; null while Prometheus is not answering yet.
  nlohmann::json Api(const std::string& target) {
    auto response = Fetch(port_, "GET", target);
    if (!response.ok() || response->status != 200) return nullptr;
    return nlohmann::json::parse(response->body, nullptr, /*allow_exceptions=*/false);
  }

  // Polls `done` every 200 ms until it holds or 30 s pass.
  bool WaitFor(const std::function<bool()>& done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        ADD_FAILURE() << "prometheus exited early";
        return false;
      }
      if (done()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  }

  std::string dir_;
  int port_ = 0;
  pid_t pid_ = 0;
};

TEST_F(PrometheusTest, ScrapesTheServer) {
  if (!IsExecutable(kPrometheus)) GTEST_SKIP() << kPrometheus << " is not installed";
  Registry r;
  FillExample(r);
  auto answer = r.AddGauge("k3serve_test_answer", "The answer.", {"note"});
  ASSERT_TRUE(answer.ok());
  const std::string note = "q\"uote\\back";
  (*answer)->WithLabels({note}).Set(42);

  auto server = StartLoopback();
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->HandleMetrics(r);
  StartPrometheus((*server)->port());
  if (HasFatalFailure()) return;

  nlohmann::json targets;
  const bool up = WaitFor([&] {
    targets = Api("/api/v1/targets");
    if (!targets.is_object()) return false;
    for (const auto& t : targets["data"]["activeTargets"]) {
      if (t.value("health", "") == "up") return true;
    }
    return false;
  });
  ASSERT_TRUE(up) << "target never up: " << targets.dump(2);
  const auto& target = targets["data"]["activeTargets"][0];
  EXPECT_EQ(target["scrapeUrl"], absl::StrCat("http://127.0.0.1:", (*server)->port(), "/metrics"));
  EXPECT_EQ(target["lastError"], "");

  // The escaped label value and the value come back intact.
  nlohmann::json result;
  const bool found = WaitFor([&] {
    nlohmann::json q = Api("/api/v1/query?query=" + UrlEncode("k3serve_test_answer"));
    if (!q.is_object() || q["data"]["result"].empty()) return false;
    result = q["data"]["result"][0];
    return true;
  });
  ASSERT_TRUE(found) << "k3serve_test_answer never appeared";
  EXPECT_EQ(result["metric"]["note"], note);
  EXPECT_EQ(result["value"][1], "42");

  // The histogram works as one: its median over both pools is the top of the bucket holding
  // the first of its two observations (0.02 s, in le="0.064").
  nlohmann::json q =
      Api("/api/v1/query?query=" +
          UrlEncode("histogram_quantile(0.5, sum by (le) (k3serve_ttft_seconds_bucket))"));
  ASSERT_TRUE(q.is_object());
  ASSERT_FALSE(q["data"]["result"].empty()) << q.dump(2);
  EXPECT_EQ(q["data"]["result"][0]["value"][1], "0.064");

  // A later value shows up after the next scrape.
  (*answer)->WithLabels({note}).Set(43);
  EXPECT_TRUE(WaitFor([&] {
    nlohmann::json q = Api("/api/v1/query?query=" + UrlEncode("k3serve_test_answer"));
    return q.is_object() && !q["data"]["result"].empty() &&
           q["data"]["result"][0]["value"][1] == "43";
  }));
}

}  // namespace
}  // namespace k3::metrics

// The observability stack against a real cluster: a local cluster of real processes serves
// traffic while a real Prometheus (Debian's 2.42) scrapes every service with the alerting rules
// of deploy/prometheus/rules.yml loaded. Checked with the real tools:
//   - `promtool check metrics` is clean for every service's /metrics;
//   - every PromQL expression of the Grafana dashboards and of the rules parses and returns data
//     (`promtool query instant`).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "tests/testing.h"
#include "tools/client.h"
#include "tools/http_get.h"
#include "tools/local_cluster.h"

extern char** environ;

namespace k3 {
namespace {

constexpr char kPrometheus[] = "/usr/bin/prometheus";
constexpr char kPromtool[] = "/usr/bin/promtool";

std::string Source(const std::string& path) { return std::string(K3SERVE_SOURCE_DIR) + "/" + path; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs argv (no shell), feeding `input` on stdin; returns the exit status and stdout+stderr.
std::pair<int, std::string> RunTool(const std::vector<std::string>& argv, const std::string& input,
                                const std::string& dir) {
  const std::string in = dir + "/run.in", out = dir + "/run.out";
  std::ofstream(in) << input;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, in.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<std::string> args = argv;
  std::vector<char*> cargv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  pid_t pid = 0;
  const int err = posix_spawn(&pid, cargv[0], &actions, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) return {-1, absl::StrCat("posix_spawn ", argv[0], ": ", strerror(err))};
  int status = 0;
  waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ReadFile(out)};
}

struct Expression {
  std::string where;  // "k3serve.json: Inter-token latency", "rules.yml: K3serveQueueGrowing"
  std::string expr;
};

// Every target expression of a dashboard, with Grafana's variables set the way a user's default
// view has them.
void DashboardExpressions(const std::string& file, std::vector<Expression>& out) {
  const nlohmann::json board = nlohmann::json::parse(ReadFile(Source("deploy/grafana/" + file)));
  std::function<void(const nlohmann::json&)> walk = [&](const nlohmann::json& panels) {
    for (const auto& p : panels) {
      if (p.contains("panels")) walk(p["panels"]);
      for (const auto& t : p.value("targets", nlohmann::json::array())) {
        const std::string expr = absl::StrReplaceAll(
            t["expr"].get<std::string>(), {{"$__rate_interval", "30s"}, {"$layer", ".*"}});
        out.push_back({absl::StrCat(file, ": ", p["title"].get<std::string>()), expr});
      }
    }
  };
  walk(board["panels"]);
}

class ScrapeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (access(kPrometheus, X_OK) != 0 || access(kPromtool, X_OK) != 0) return;
    dir_ = new std::string(std::filesystem::temp_directory_path() / "k3serve_scrape_XXXXXX");
    ASSERT_NE(mkdtemp(dir_->data()), nullptr);
    ClusterOptions o;
    o.bin_dir = K3SERVE_BIN_DIR;
    o.model = Source("tests/data/tiny-kimi-linear");
    o.attention = 1;
    o.experts = 2;
    o.work_dir = *dir_ + "/cluster";
    o.orchestrated = true;  // the orchestrator's local backend runs the nodes; a gateway in front
    o.router_args = {"--expert-metrics-layers=1"};  // the opt-in per-expert series, for the heatmap
    o.orchestrator_args = {"--experts-min=2"};  // the light traffic would shrink the pool to one node
    // This traffic is for the series, not for hang detection (tests/security_test.cc and tests/stall_test.cc have
    // that): on the 2-core CI machine, right after the container image build, the adaptive 0.5 s dispatch deadline
    // has judged a live expert node hung (twice in four runs), which fails the requests of that dispatch, and this
    // test counts every failure.
    o.attention_args = {"--dispatch-timeout-ms=5000"};
    auto cluster = LocalCluster::Start(o);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();

    // Scrape jobs named after the pools, as the chart's PodMonitor names them.
    targets_ = new std::map<std::string, std::vector<int>>{
        {"k3serve-gateway", {cluster_->gateway_metrics_port()}},
        {"k3serve-orchestrator", {cluster_->orchestrator_metrics_port()}},
        {"k3serve-router", {cluster_->router_metrics_port()}},
        {"k3serve-attention", cluster_->attention_metrics_ports()},
        {"k3serve-expert", cluster_->expert_metrics_ports()},
    };
    std::ofstream config(*dir_ + "/prometheus.yml");
    config << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
           << "rule_files: ['" << Source("deploy/prometheus/rules.yml") << "']\n"
           << "scrape_configs:\n";
    for (const auto& [job, ports] : *targets_) {
      config << "  - job_name: " << job << "\n    static_configs:\n      - targets: [";
      for (size_t i = 0; i < ports.size(); ++i) config << (i ? ", " : "") << "'127.0.0.1:" << ports[i] << "'";
      config << "]\n";
    }
    config.close();

    // Traffic while Prometheus scrapes: concurrent streams, a bad request and a deadline.
    StartPrometheus();
    InferenceClient client(cluster_->attention_addresses()[0]);
    SamplingParams p;
    p.max_new_tokens = 24;
    p.ignore_eos = true;
    std::vector<std::thread> streams;
    std::atomic<int> failures{0};
    std::mutex first_mu;
    absl::Status first_failure;  // the first one, to say why
    const absl::Time until = absl::Now() + absl::Seconds(12);
    for (int s = 0; s < 4; ++s) {
      streams.emplace_back([&, s] {
        InferenceClient c(cluster_->gateway_address());
        while (absl::Now() < until) {
          auto r = c.Generate({1, 2, 3, 4 + s}, p, absl::Seconds(30));
          if (r.ok()) continue;
          if (failures++ == 0) {
            std::lock_guard<std::mutex> lock(first_mu);
            first_failure = r.status();
          }
        }
      });
    }
    SamplingParams invalid = p;
    invalid.max_new_tokens = 0;
    (void)client.Generate({1, 2, 3}, invalid, absl::Seconds(5));  // INVALID_ARGUMENT
    SamplingParams endless = p;
    endless.max_new_tokens = 4000;
    deadline_result_ = new absl::Status(client.Generate({5, 6, 7}, endless, absl::Milliseconds(400)).status());
    for (auto& t : streams) t.join();
    EXPECT_EQ(failures.load(), 0) << "first: " << first_failure;
    // The rules' rates and the dashboards' [30s] ranges need a few scrapes after the traffic.
    absl::SleepFor(absl::Seconds(3));
  }

  static void TearDownTestSuite() {
    if (prometheus_pid_ > 0) {
      kill(prometheus_pid_, SIGTERM);
      waitpid(prometheus_pid_, nullptr, 0);
    }
    delete cluster_;
    if (dir_ != nullptr) std::filesystem::remove_all(*dir_);
    delete dir_;
    delete targets_;
    delete deadline_result_;
  }

  static void StartPrometheus() {
    prometheus_port_ = testing::FreePort();
    ASSERT_GT(prometheus_port_, 0);
    std::vector<std::string> args = {kPrometheus, "--config.file=" + *dir_ + "/prometheus.yml",
                                     "--storage.tsdb.path=" + *dir_ + "/data",
                                     absl::StrCat("--web.listen-address=127.0.0.1:", prometheus_port_),
                                     "--log.level=warn"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string log = *dir_ + "/prometheus.log";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    ASSERT_EQ(posix_spawn(&prometheus_pid_, kPrometheus, &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
  }

  void SetUp() override {
    if (access(kPrometheus, X_OK) != 0 || access(kPromtool, X_OK) != 0)
      GTEST_SKIP() << "prometheus and promtool are not installed";
    ASSERT_NE(cluster_, nullptr);
  }

  // `promtool query instant` of expr: its exit status and output.
  std::pair<int, std::string> Query(const std::string& expr) {
    return RunTool({kPromtool, "query", "instant", absl::StrCat("http://127.0.0.1:", prometheus_port_), expr}, "",
               *dir_);
  }

  static std::string* dir_;
  static LocalCluster* cluster_;
  static std::map<std::string, std::vector<int>>* targets_;
  static absl::Status* deadline_result_;
  static pid_t prometheus_pid_;
  static int prometheus_port_;
};

std::string* ScrapeTest::dir_ = nullptr;
LocalCluster* ScrapeTest::cluster_ = nullptr;
std::map<std::string, std::vector<int>>* ScrapeTest::targets_ = nullptr;
absl::Status* ScrapeTest::deadline_result_ = nullptr;
pid_t ScrapeTest::prometheus_pid_ = 0;
int ScrapeTest::prometheus_port_ = 0;

TEST_F(ScrapeTest, PromtoolCheckMetricsIsCleanForEveryService) {
  int checked = 0;
  for (const auto& [job, ports] : *targets_) {
    for (int port : ports) {
      auto text = HttpGet("127.0.0.1", port, "/metrics");
      ASSERT_TRUE(text.ok()) << job << ": " << text.status();
      ASSERT_NE(text->find("# TYPE k3serve_"), std::string::npos) << job << ":\n" << *text;
      auto [rc, out] = RunTool({kPromtool, "check", "metrics"}, *text, *dir_);
      EXPECT_EQ(rc, 0) << job << " :" << port << ":\n" << out;
      EXPECT_EQ(out, "") << job << " :" << port;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6);  // gateway, orchestrator, router, attention, two experts
}

// A client's deadline counts as DEADLINE_EXCEEDED, not CANCELLED.
TEST_F(ScrapeTest, ADeadlineCountsAsDeadlineExceeded) {
  EXPECT_EQ(deadline_result_->code(), absl::StatusCode::kDeadlineExceeded) << *deadline_result_;
  auto text = HttpGet("127.0.0.1", cluster_->attention_metrics_ports()[0], "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  // The server sees the deadline at its next check (every 50 ms).
  absl::SleepFor(absl::Milliseconds(200));
  text = HttpGet("127.0.0.1", cluster_->attention_metrics_ports()[0], "/metrics");
  EXPECT_EQ(MetricValue(*text, "k3serve_requests_total", "code=\"DEADLINE_EXCEEDED\""), 1) << *text;
  EXPECT_EQ(MetricValue(*text, "k3serve_requests_total", "code=\"CANCELLED\""), 0) << *text;
  EXPECT_EQ(MetricValue(*text, "k3serve_requests_total", "code=\"INVALID_ARGUMENT\""), 1) << *text;
  EXPECT_GT(MetricValue(*text, "k3serve_requests_total", "code=\"OK\""), 4) << *text;
}

TEST_F(ScrapeTest, EveryDashboardAndRuleExpressionReturnsData) {
  std::vector<Expression> exprs;
  DashboardExpressions("k3serve.json", exprs);
  DashboardExpressions("k3serve-expert-load.json", exprs);
  const size_t dashboard_exprs = exprs.size();

  // The rules as Prometheus loaded them. An alert compares recorded measures with thresholds
  // ("m > 1.5 and n > 10"): each measure must return data (the comparison filters a healthy
  // cluster's values out).
  nlohmann::json rules;
  for (int i = 0; i < 100 && !rules.is_object(); ++i) {
    auto r = HttpGet("127.0.0.1", prometheus_port_, "/api/v1/rules");
    if (r.ok()) rules = nlohmann::json::parse(*r, nullptr, false);
    if (!rules.is_object()) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(rules.is_object()) << ReadFile(*dir_ + "/prometheus.log");
  static const std::regex kComparison(R"(^\s*(.+?)\s*(>|<|==|!=|>=|<=)\s*(-?[0-9.]+)\s*$)");
  int alerts = 0, records = 0;
  for (const auto& group : rules["data"]["groups"]) {
    for (const auto& rule : group["rules"]) {
      const std::string query = rule["query"];
      EXPECT_EQ(rule["health"], "ok") << rule.dump(2);
      if (rule["type"] == "recording") {
        exprs.push_back({absl::StrCat("rules.yml: ", rule["name"].get<std::string>()), query});
        exprs.push_back({absl::StrCat("rules.yml: recorded ", rule["name"].get<std::string>()), rule["name"]});
        ++records;
        continue;
      }
      ++alerts;
      for (const std::string& term : std::vector<std::string>(absl::StrSplit(query, " and "))) {
        std::smatch m;
        ASSERT_TRUE(std::regex_match(term, m, kComparison))
            << rule["name"] << ": an alert compares measures with thresholds, got " << query;
        exprs.push_back({absl::StrCat("rules.yml: ", rule["name"].get<std::string>()), m[1].str()});
      }
    }
  }
  EXPECT_EQ(alerts, 5);
  EXPECT_GE(records, 5);

  int with_data = 0;
  for (const Expression& e : exprs) {
    // Recorded series take a few evaluations to appear; the measures have data by now.
    std::pair<int, std::string> result;
    for (int i = 0; i < 20; ++i) {
      result = Query(e.expr);
      if (result.first != 0 || !absl::StripAsciiWhitespace(result.second).empty()) break;
      absl::SleepFor(absl::Milliseconds(500));
    }
    const int rc = result.first;
    const std::string out(absl::StripAsciiWhitespace(result.second));  // an empty result prints "\n"
    EXPECT_EQ(rc, 0) << e.where << ": promtool query instant failed for " << e.expr << "\n" << out;
    EXPECT_NE(out, "") << e.where << ": no data for " << e.expr;
    if (!out.empty()) ++with_data;
  }
  std::printf("%zu expressions (%zu from dashboards): %d returned data\n", exprs.size(), dashboard_exprs, with_data);
  EXPECT_GT(with_data, 30);
}

}  // namespace
}  // namespace k3

// A bounded running load for the integration tests: N streams, each sending a new greedy request
// as soon as its last one finished, checking every output against the expected continuation.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "tools/client.h"
#include "tools/golden.h"

namespace k3::testing {

struct Prompt {
  std::vector<int32_t> ids;
  std::vector<int32_t> expected;  // greedy continuation (its length is max_tokens)
};

// A golden's prompts with its greedy continuations.
inline std::vector<Prompt> GoldenPrompts(const Golden& golden) {
  std::vector<Prompt> out;
  for (const auto& p : golden.prompts) out.push_back({p.input_ids, p.greedy_ids});
  return out;
}

class LoadLoop {
 public:
  LoadLoop(std::string address, std::vector<Prompt> prompts, int streams) : prompts_(std::move(prompts)) {
    for (int i = 0; i < streams; ++i)
      threads_.emplace_back([this, address, i] {
        InferenceClient client(address);
        for (int n = i; !stop_; n += 7) {
          const Prompt& p = prompts_[n % prompts_.size()];
          SamplingParams sp;
          sp.max_new_tokens = static_cast<int>(p.expected.size());
          sp.ignore_eos = true;
          auto r = client.Generate(p.ids, sp, absl::Seconds(60));
          if (!r.ok()) {
            std::lock_guard<std::mutex> lock(mu_);
            failures_.push_back(std::string(r.status().message()));
            failed_at_.push_back(absl::Now());
            std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a client backs off
            continue;
          }
          std::lock_guard<std::mutex> lock(mu_);
          if (r->tokens != p.expected) {
            ++mismatches_;
          } else {
            ++ok_;
          }
        }
      });
  }
  ~LoadLoop() { Stop(); }
  void Stop() {
    stop_ = true;
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }
  int ok() {
    std::lock_guard<std::mutex> lock(mu_);
    return ok_;
  }
  // Until n requests have completed (or the timeout).
  void WaitOk(int n, absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (ok() < n && absl::Now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  int mismatches() {
    std::lock_guard<std::mutex> lock(mu_);
    return mismatches_;
  }
  std::vector<std::string> failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }
  // Failures that ended in [from, to).
  int failures_between(absl::Time from, absl::Time to) {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (absl::Time t : failed_at_) n += t >= from && t < to;
    return n;
  }

 private:
  const std::vector<Prompt> prompts_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  int ok_ = 0;
  int mismatches_ = 0;
  std::vector<std::string> failures_;
  std::vector<absl::Time> failed_at_;
  std::vector<std::thread> threads_;
};

}  // namespace k3::testing

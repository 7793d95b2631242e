// The serving engine: continuous batching, sampling, validation, freeing state.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/time/clock.h"

#include "tests/testing.h"

namespace k3 {
namespace {

const Model& Tiny() {
  static std::unique_ptr<Model> m = [] {
    auto loaded = Model::Load(testing::SourceDir() + "/tests/data/tiny-kimi-linear");
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    return std::move(*loaded);
  }();
  return *m;
}

std::vector<int32_t> Ids(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(3 + rng() % 500);
  return v;
}

SamplingParams Greedy(int n) {
  SamplingParams p;
  p.max_new_tokens = n;
  p.ignore_eos = true;
  return p;
}

// Runs the engine dry; returns the tokens and the finish reason per id.
std::map<uint64_t, std::pair<std::vector<int32_t>, FinishReason>> Drain(Engine& e) {
  std::map<uint64_t, std::pair<std::vector<int32_t>, FinishReason>> out;
  while (e.HasWork())
    for (const auto& o : e.Step()) {
      auto& r = out[o.id];
      r.first.insert(r.first.end(), o.tokens.begin(), o.tokens.end());
      if (o.finish != FinishReason::kNone) r.second = o.finish;
    }
  return out;
}

// Concurrent sequences under a small token budget (prefill chunks share steps with decodes)
// generate exactly what each generates alone.
TEST(Engine, ConcurrentEqualsAlone) {
  const Model& m = Tiny();
  LocalExpertExecutor experts(m.config(), m.weights());
  // Adaptive ping-pong switches between split and whole steps as it measures: the same tokens.
  for (int mode : {0, 1, 2}) {
    const bool ping_pong = mode > 0;
    EngineOptions opt;
    opt.max_batch_tokens = 24;
    opt.max_running = 5;  // more sequences than slots: some wait
    CpuBackend backend(m, experts, ping_pong, /*adaptive=*/mode == 2);
    Engine e(backend, opt);
    const std::vector<int64_t> lens = {1, 3, 17, 40, 2, 70, 9, 33};
    for (size_t i = 0; i < lens.size(); ++i) ASSERT_TRUE(e.Add(i, Ids(lens[i], i), Greedy(6 + i)).ok());
    auto got = Drain(e);
    ASSERT_EQ(got.size(), lens.size());
    for (size_t i = 0; i < lens.size(); ++i) {
      auto alone = GenerateGreedy(m, Ids(lens[i], i), 6 + i);
      ASSERT_TRUE(alone.ok());
      EXPECT_EQ(got[i].first, *alone) << "sequence " << i << " ping-pong mode " << mode;
      EXPECT_EQ(got[i].second, FinishReason::kLength);
    }
    EXPECT_EQ(e.Stats().running, 0);
    EXPECT_EQ(e.Stats().state_bytes, 0);
  }
}

TEST(Engine, StopTokensEndASequence) {
  const Model& m = Tiny();
  LocalExpertExecutor experts(m.config(), m.weights());
  auto free_run = GenerateGreedy(m, {1, 5, 77}, 10);
  ASSERT_TRUE(free_run.ok());
  CpuBackend backend(m, experts);
  Engine e(backend);
  SamplingParams p = Greedy(10);
  p.stop_token_ids = {(*free_run)[3]};
  ASSERT_TRUE(e.Add(7, {1, 5, 77}, p).ok());
  auto got = Drain(e);
  // Stops at the first occurrence of the stop token, which is included in the output.
  const auto first = std::find(free_run->begin(), free_run->end(), (*free_run)[3]);
  EXPECT_EQ(got[7].first, std::vector<int32_t>(free_run->begin(), first + 1));
  EXPECT_EQ(got[7].second, FinishReason::kStop);
}

TEST(Engine, AbortFreesState) {
  const Model& m = Tiny();
  LocalExpertExecutor experts(m.config(), m.weights());
  CpuBackend backend(m, experts);
  Engine e(backend);
  ASSERT_TRUE(e.Add(1, Ids(20, 1), Greedy(100)).ok());
  ASSERT_TRUE(e.Add(2, Ids(20, 2), Greedy(100)).ok());
  e.Step();
  EXPECT_EQ(e.Stats().running, 2);
  EXPECT_GT(e.Stats().state_bytes, 0);
  ASSERT_TRUE(e.Abort(1).ok());
  EXPECT_EQ(e.Stats().running, 1);
  EXPECT_EQ(e.Abort(1).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(e.Abort(2).ok());
  EXPECT_FALSE(e.HasWork());
  EXPECT_EQ(e.Stats().state_bytes, 0);
}

TEST(Engine, BadRequestsNameTheField) {
  const Model& m = Tiny();
  LocalExpertExecutor experts(m.config(), m.weights());
  EngineOptions opt;
  opt.max_context = 64;
  opt.max_new_tokens_limit = 32;
  opt.max_waiting = 2;
  CpuBackend backend(m, experts);
  Engine e(backend, opt);
  auto expect = [&](std::vector<int32_t> prompt, SamplingParams p, absl::StatusCode code, const std::string& text) {
    const absl::Status s = e.Add(99, std::move(prompt), p);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(text), std::string::npos) << s;
  };
  const auto inv = absl::StatusCode::kInvalidArgument;
  expect({}, Greedy(4), inv, "prompt_ids must not be empty");
  expect({1, 512}, Greedy(4), inv, "prompt_ids[1] = 512 is outside the vocabulary");
  expect({1, -1}, Greedy(4), inv, "prompt_ids[1] = -1");
  expect({1}, Greedy(0), inv, "max_tokens must be > 0");
  expect({1}, Greedy(33), inv, "max_tokens = 33 exceeds the limit 32");
  expect(Ids(64, 1), Greedy(1), inv, "context limit is 64");
  expect(Ids(40, 1), Greedy(30), inv, "exceeds the context limit 64");
  SamplingParams p = Greedy(4);
  p.temperature = -1;
  expect({1}, p, inv, "temperature");
  p = Greedy(4);
  p.top_p = 0;
  expect({1}, p, inv, "top_p");
  p = Greedy(4);
  p.top_k = -2;
  expect({1}, p, inv, "top_k");
  p = Greedy(4);
  p.stop_token_ids = {9999};
  expect({1}, p, inv, "stop_token_ids");
  // Queue limit, then a duplicate id.
  ASSERT_TRUE(e.Add(1, {1}, Greedy(4)).ok());
  ASSERT_TRUE(e.Add(2, {1}, Greedy(4)).ok());
  expect({1}, Greedy(4), absl::StatusCode::kResourceExhausted, "queue full");
  EXPECT_EQ(e.Add(1, {1}, Greedy(4)).code(), absl::StatusCode::kAlreadyExists);
}

// An expert executor that fails: the batch's sequences end with the error, others continue.
class FailingExecutor : public ExpertExecutor {
 public:
  explicit FailingExecutor(ExpertExecutor& inner) : inner_(inner) {}
  absl::StatusOr<uint64_t> Submit(const ExpertRequest& r) override {
    if (fail) return absl::UnavailableError("expert node gone");
    return inner_.Submit(r);
  }
  absl::Status Wait(uint64_t t, float* out) override { return inner_.Wait(t, out); }
  bool fail = false;

 private:
  ExpertExecutor& inner_;
};

TEST(Engine, FailedStepEndsItsSequencesAndEngineRecovers) {
  const Model& m = Tiny();
  LocalExpertExecutor local(m.config(), m.weights());
  FailingExecutor experts(local);
  CpuBackend backend(m, experts);
  Engine e(backend);
  ASSERT_TRUE(e.Add(1, Ids(5, 1), Greedy(4)).ok());
  experts.fail = true;
  auto out = e.Step();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].finish, FinishReason::kError);
  EXPECT_EQ(out[0].error.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(e.HasWork());
  experts.fail = false;
  ASSERT_TRUE(e.Add(2, Ids(5, 1), Greedy(4)).ok());
  auto got = Drain(e);
  EXPECT_EQ(got[2].first, *GenerateGreedy(m, Ids(5, 1), 4));
}

TEST(Sampler, GreedyAndTopK1AreArgmax) {
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f};
  SamplingParams p;
  Sampler greedy(p);
  EXPECT_EQ(greedy.Sample(logits.data(), 5), 1);  // ties: lowest id
  p.temperature = 5.0f;
  p.top_k = 1;
  p.has_seed = true;
  Sampler k1(p);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(k1.Sample(logits.data(), 5), 1);
}

TEST(Sampler, SeededIsReproducible) {
  auto logits = testing::Random(512, 3);
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  p.has_seed = true;
  p.seed = 42;
  Sampler a(p), b(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(a.Sample(logits.data(), 512), b.Sample(logits.data(), 512));
}

// Empirical frequencies follow the reference distribution for temperature, top-k and top-p.
TEST(Sampler, DistributionMatchesReference) {
  std::vector<float> logits = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, 1.5f, -3.0f, 0.2f};
  for (auto [t, k, top_p] : {std::tuple{1.0f, 0, 1.0f}, {0.7f, 4, 1.0f}, {1.3f, 0, 0.8f}, {1.0f, 3, 0.9f}}) {
    SamplingParams p;
    p.temperature = t;
    p.top_k = k;
    p.top_p = top_p;
    p.has_seed = true;
    p.seed = 7;
    Sampler s(p);
    const int n = 200000;
    std::vector<double> freq(8, 0.0);
    for (int i = 0; i < n; ++i) freq[s.Sample(logits.data(), 8)] += 1.0 / n;
    const auto ref = SamplingDistributionRef(logits.data(), 8, p);
    for (int i = 0; i < 8; ++i) EXPECT_NEAR(freq[i], ref[i], 0.005) << "t=" << t << " k=" << k << " p=" << top_p << " id " << i;
  }
}

// Decode tokens go first: while a long prompt prefills in chunks, every step still gives each
// decoding sequence its next token, and the prompt takes the rest of the budget.
TEST(Engine, DecodesFirstPrefillFillsTheRest) {
  const Model& m = Tiny();
  LocalExpertExecutor experts(m.config(), m.weights());
  CpuBackend backend(m, experts);
  EngineOptions opt;
  opt.max_batch_tokens = 32;
  Engine e(backend, opt);
  ASSERT_TRUE(e.Add(1, Ids(4, 1), Greedy(20)).ok());
  ASSERT_TRUE(e.Add(2, Ids(4, 2), Greedy(20)).ok());
  e.Step();  // both short prompts prefill
  ASSERT_TRUE(e.Add(3, Ids(300, 3), Greedy(1)).ok());
  int steps = 0;
  bool long_done = false;
  while (!long_done) {
    std::set<uint64_t> got;
    for (const auto& o : e.Step()) {
      if (!o.tokens.empty()) got.insert(o.id);
      if (o.id == 3 && o.finish != FinishReason::kNone) long_done = true;
    }
    ++steps;
    EXPECT_TRUE(got.count(1) && got.count(2)) << "step " << steps << " starved a decoding sequence";
    if (steps == 2) {
      // A short prompt arriving mid-prefill gets its first token in the next step.
      ASSERT_TRUE(e.Add(4, Ids(5, 4), Greedy(1)).ok());
    } else if (steps == 3) {
      EXPECT_TRUE(got.count(4)) << "the short prompt waited behind the long prefill";
    }
  }
  // 300 prompt tokens at 32 - 2 per step (one step 32 - 2 - 5).
  EXPECT_EQ(steps, (300 + 5 + 29) / 30);
}

TEST(Engine, PromptLimitAndDeadlines) {
  const Model& m = Tiny();
  LocalExpertExecutor experts(m.config(), m.weights());
  CpuBackend backend(m, experts);
  EngineOptions opt;
  opt.max_prompt_tokens = 100;
  opt.max_batch_tokens = 16;
  Engine e(backend, opt);
  const absl::Status s = e.Add(1, Ids(101, 1), Greedy(1));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("max-prompt-tokens"), std::string::npos) << s;
  // A deadline passes while the request prefills (16 of its 100 tokens per step), or while it waits.
  SamplingParams p = Greedy(4);
  p.deadline = absl::Now() + absl::Milliseconds(30);
  ASSERT_TRUE(e.Add(3, Ids(100, 3), p).ok());
  e.Step();
  ASSERT_TRUE(e.Add(2, Ids(100, 2), Greedy(1)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  p.deadline = absl::Now() - absl::Milliseconds(1);
  ASSERT_TRUE(e.Add(4, Ids(5, 4), p).ok());
  std::map<uint64_t, absl::Status> errors;
  while (e.HasWork())
    for (const auto& o : e.Step())
      if (o.finish == FinishReason::kError) errors[o.id] = o.error;
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_TRUE(absl::IsDeadlineExceeded(errors[3])) << errors[3];
  EXPECT_NE(errors[3].message().find("prefilling"), std::string::npos) << errors[3];
  EXPECT_TRUE(absl::IsDeadlineExceeded(errors[4])) << errors[4];
  EXPECT_NE(errors[4].message().find("waiting"), std::string::npos) << errors[4];
}

}  // namespace
}  // namespace k3

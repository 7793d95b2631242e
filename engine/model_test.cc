// The forward pass: batching, chunking and micro-batching do not change the numbers.
#include "engine/model.h"

#include <gtest/gtest.h>

#include <random>

#include "engine/model_testing.h"
#include "tests/testing.h"

namespace k3 {
namespace {

using testing::RelDiff;
using testing::Ids;

const Model& Tiny(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Model>> models;
  auto& m = models[name];
  if (!m) {
    auto loaded = Model::Load(testing::SourceDir() + "/tests/data/" + name);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    m = std::move(*loaded);
  }
  return *m;
}

class ModelTest : public ::testing::TestWithParam<std::string> {};

// Eight sequences of different lengths stepped together give the same logits as each alone:
// first all prefills in one batch, then decodes; and staggered, so prefill chunks of new
// sequences share steps with decode tokens of older ones.
TEST_P(ModelTest, BatchedEqualsAlone) {
  const Model& model = Tiny(GetParam());
  const ModelConfig& c = model.config();
  LocalExpertExecutor experts(c, model.weights());
  const std::vector<int64_t> lens = {1, 2, 5, 17, 33, 64, 65, 100};
  const int kDecode = 3;
  std::vector<std::vector<int32_t>> seqs;
  for (size_t i = 0; i < lens.size(); ++i) seqs.push_back(Ids(lens[i] + kDecode, 100 + i, c.vocab_size));

  // Alone: prefill then kDecode single-token steps; logits of every position.
  std::vector<std::vector<float>> alone(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    SequenceState st(c);
    std::vector<float> out;
    SeqChunk pre{&st, std::span<const int32_t>(seqs[i]).first(lens[i]), LogitsMode::kAll};
    ASSERT_TRUE(model.Forward({&pre, 1}, experts, &out).ok());
    alone[i] = out;
    for (int t = 0; t < kDecode; ++t) {
      SeqChunk one{&st, std::span<const int32_t>(seqs[i]).subspan(lens[i] + t, 1), LogitsMode::kAll};
      ASSERT_TRUE(model.Forward({&one, 1}, experts, &out).ok());
      alone[i].insert(alone[i].end(), out.begin(), out.end());
    }
  }

  // Staggered: sequence i starts at step i; each step carries decodes of the started ones.
  std::vector<std::unique_ptr<SequenceState>> states;
  for (size_t i = 0; i < seqs.size(); ++i) states.push_back(std::make_unique<SequenceState>(c));
  std::vector<std::vector<float>> batched(seqs.size());
  std::vector<int64_t> fed(seqs.size(), 0);
  for (size_t step = 0; step < seqs.size() + kDecode; ++step) {
    std::vector<SeqChunk> chunks;
    std::vector<size_t> who;
    for (size_t i = 0; i < seqs.size() && i <= step; ++i) {
      const int64_t total = static_cast<int64_t>(seqs[i].size());
      if (fed[i] == total) continue;
      const int64_t n = fed[i] == 0 ? lens[i] : 1;
      chunks.push_back({states[i].get(), std::span<const int32_t>(seqs[i]).subspan(fed[i], n), LogitsMode::kAll});
      who.push_back(i);
      fed[i] += n;
    }
    // Reverse the order so batch position differs from sequence index.
    std::reverse(chunks.begin(), chunks.end());
    std::reverse(who.begin(), who.end());
    std::vector<float> out;
    ASSERT_TRUE(model.Forward(chunks, experts, &out).ok());
    int64_t row = 0;
    for (size_t j = 0; j < chunks.size(); ++j) {
      const int64_t n = static_cast<int64_t>(chunks[j].tokens.size()) * c.vocab_size;
      batched[who[j]].insert(batched[who[j]].end(), out.begin() + row, out.begin() + row + n);
      row += n;
    }
  }
  for (size_t i = 0; i < seqs.size(); ++i) EXPECT_LT(RelDiff(batched[i], alone[i]), 2e-5) << "sequence " << i;
}

// Incremental logits (prefill a prefix, then one token per step) equal the prefill logits.
TEST_P(ModelTest, IncrementalEqualsPrefill) {
  const Model& model = Tiny(GetParam());
  const ModelConfig& c = model.config();
  LocalExpertExecutor experts(c, model.weights());
  const auto ids = Ids(150, 7, c.vocab_size);
  SequenceState a(c), b(c);
  std::vector<float> whole, part, out;
  SeqChunk all{&a, ids, LogitsMode::kAll};
  ASSERT_TRUE(model.Forward({&all, 1}, experts, &whole).ok());
  for (int64_t t = 0; t < 150;) {
    const int64_t n = t < 70 ? 70 : 1;  // a prefill of 70 tokens (crosses a KDA chunk), then decode
    SeqChunk ch{&b, std::span<const int32_t>(ids).subspan(t, n), LogitsMode::kAll};
    ASSERT_TRUE(model.Forward({&ch, 1}, experts, &out).ok());
    part.insert(part.end(), out.begin(), out.end());
    t += n;
  }
  EXPECT_LT(RelDiff(part, whole), 1e-4);
  EXPECT_EQ(a.position, 150);
  EXPECT_EQ(b.position, 150);
}

// Two micro-batches whose dispatches interleave (ping-pong) equal one pass.
TEST_P(ModelTest, PingPongEqualsOnePass) {
  const Model& model = Tiny(GetParam());
  const ModelConfig& c = model.config();
  LocalExpertExecutor experts(c, model.weights());
  std::vector<std::vector<int32_t>> seqs = {Ids(9, 1, c.vocab_size), Ids(1, 2, c.vocab_size), Ids(30, 3, c.vocab_size),
                                            Ids(4, 4, c.vocab_size)};
  std::vector<SequenceState> s1, s2;
  for (size_t i = 0; i < seqs.size(); ++i) s1.emplace_back(c), s2.emplace_back(c);
  std::vector<SeqChunk> c1, c2;
  for (size_t i = 0; i < seqs.size(); ++i) {
    c1.push_back({&s1[i], seqs[i], LogitsMode::kAll});
    c2.push_back({&s2[i], seqs[i], LogitsMode::kAll});
  }
  std::vector<float> one;
  ASSERT_TRUE(model.Forward(c1, experts, &one).ok());
  ForwardPass a(model, std::span<const SeqChunk>(c2).first(2)), b(model, std::span<const SeqChunk>(c2).subspan(2));
  ForwardPass* passes[] = {&a, &b};
  ASSERT_TRUE(RunPasses(passes, experts).ok());
  std::vector<float> two = a.logits();
  two.insert(two.end(), b.logits().begin(), b.logits().end());
  EXPECT_LT(RelDiff(two, one), 1e-5);
}

// An executor whose first Wait fails, counting the dispatches nobody waited for.
class FailFirstWait : public ExpertExecutor {
 public:
  explicit FailFirstWait(ExpertExecutor& inner) : inner_(inner) {}
  absl::StatusOr<uint64_t> Submit(const ExpertRequest& r) override {
    ++outstanding;
    return inner_.Submit(r);
  }
  absl::Status Wait(uint64_t ticket, float* out) override {
    --outstanding;
    const absl::Status s = inner_.Wait(ticket, out);
    if (!failed_) {
      failed_ = true;
      return absl::UnavailableError("expert node gone");
    }
    return s;
  }
  int outstanding = 0;

 private:
  ExpertExecutor& inner_;
  bool failed_ = false;
};

// A failed micro-batch does not leave the other's dispatch in flight.
TEST_P(ModelTest, FailedPassWaitsForTheOthersDispatch) {
  const Model& model = Tiny(GetParam());
  const ModelConfig& c = model.config();
  LocalExpertExecutor local(c, model.weights());
  FailFirstWait experts(local);
  SequenceState s1(c), s2(c);
  const std::vector<int32_t> x = Ids(5, 1, c.vocab_size), y = Ids(3, 2, c.vocab_size);
  std::vector<SeqChunk> chunks = {{&s1, x, LogitsMode::kLast}, {&s2, y, LogitsMode::kLast}};
  ForwardPass a(model, std::span<const SeqChunk>(chunks).first(1)), b(model, std::span<const SeqChunk>(chunks).subspan(1));
  ForwardPass* passes[] = {&a, &b};
  EXPECT_EQ(RunPasses(passes, experts).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(experts.outstanding, 0);
}

TEST_P(ModelTest, EmptyBatchAndBadTokens) {
  const Model& model = Tiny(GetParam());
  LocalExpertExecutor experts(model.config(), model.weights());
  std::vector<float> out = {1.0f};
  ASSERT_TRUE(model.Forward({}, experts, &out).ok());
  EXPECT_TRUE(out.empty());
  SequenceState s(model.config());
  const std::vector<int32_t> bad = {1, static_cast<int32_t>(model.config().vocab_size)};
  SeqChunk ch{&s, bad, LogitsMode::kLast};
  const absl::Status st = model.Forward({&ch, 1}, experts, &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("outside the vocabulary"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Goldens, ModelTest, ::testing::Values("tiny-kimi-linear", "tiny-kimi-linear-bf16"));

}  // namespace
}  // namespace k3

// The GPU engine against the goldens (the bar: greedy ids exact, logits within 2e-2), against
// itself (a sequence in a mixed batch == alone), and against the CPU engine on random models whose KDA head
// dims take the tuned kernels (64, 128; the goldens' 32 runs the small-D kernel).
//
// The GPU holds weights in bf16. On a bf16 checkpoint that is exact and the goldens must match; an fp32
// checkpoint is rounded on upload, and these tiny models are sensitive to it: the fp32 CPU engine itself, on
// the same weights rounded to bf16, lands 0.45–1.05 (tiny-kimi-linear) and 4–9.8 (tiny-k3) from the fp32
// goldens, with greedy mismatches. There the GPU is held to what that CPU engine reaches.
#include "engine/cuda/cuda_model.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "common/bf16.h"
#include "common/safetensors.h"
#include "engine/expert_executor.h"
#include "engine/model.h"
#include "engine/tensor_names.h"
#include "engine/weights.h"
#include "engine/cuda/test_configs.h"
#include "tests/mxfp4_testing.h"
#include "tests/testing.h"
#include "tools/golden.h"

#include "kernels/cuda/mxfp4.cuh"
#include "kernels/cuda/testing.cuh"

namespace k3::cuda {
namespace {

std::string Data(const std::string& name) { return testing::SourceDir() + "/tests/data/" + name; }

double MaxAbsDiff(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(double(a[i]) - b[i]);
    m = std::isfinite(d) ? std::max(m, d) : INFINITY;
  }
  return m;
}

std::unique_ptr<CudaModel> LoadOrDie(const std::string& dir, bool graphs = true) {
  CudaModelOptions o;
  o.max_seqs = 8, o.max_context = 512, o.max_batch_tokens = 512, o.cuda_graphs = graphs;
  auto m = CudaModel::Load(dir, o);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// Greedy continuation: the prompt as one prefill, then one token per step.
std::vector<int32_t> Greedy(CudaModel& model, const std::vector<int32_t>& prompt, int n) {
  auto slot = model.AllocSlot();
  EXPECT_TRUE(slot.ok());
  std::vector<int32_t> out, id;
  GpuChunk ch{*slot, prompt, LogitsMode::kLast};
  EXPECT_TRUE(model.ForwardGreedy({&ch, 1}, &id).ok());
  for (int i = 0; i < n && id.size() == 1; ++i) {
    out.push_back(id[0]);
    if (i + 1 == n) break;
    const std::vector<int32_t> next = {id[0]};
    GpuChunk step{*slot, next, LogitsMode::kLast};
    EXPECT_TRUE(model.ForwardGreedy({&step, 1}, &id).ok());
  }
  EXPECT_TRUE(model.FreeSlot(*slot).ok());
  return out;
}

struct GoldenReport {
  double prefill = 0, incremental = 0;
  int greedy_match = 0, greedy_total = 0;
};

// Prefill, incremental and greedy against one golden directory; prints a line per prompt.
std::vector<GoldenReport> RunGolden(const std::string& name) {
  std::vector<GoldenReport> out;
  auto model = LoadOrDie(Data(name));
  auto golden = LoadGolden(Data(name));
  EXPECT_TRUE(golden.ok()) << golden.status();
  if (!model || !golden.ok()) return out;
  const int64_t V = model->config().vocab_size;
  for (size_t i = 0; i < golden->prompts.size(); ++i) {
    const GoldenPrompt& p = golden->prompts[i];
    const int64_t T = static_cast<int64_t>(p.input_ids.size());
    GoldenReport r;
    auto slot = model->AllocSlot();
    EXPECT_TRUE(slot.ok());
    std::vector<float> logits;
    GpuChunk all{*slot, p.input_ids, LogitsMode::kAll};
    EXPECT_TRUE(model->Forward({&all, 1}, &logits).ok());
    EXPECT_EQ(static_cast<int64_t>(logits.size()), T * V);
    r.prefill = MaxAbsDiff(logits.data(), p.prefill_logits.data(), std::min(logits.size(), p.prefill_logits.size()));
    EXPECT_TRUE(model->FreeSlot(*slot).ok());
    if (!p.incremental_logits.empty()) {
      slot = model->AllocSlot();
      std::vector<float> rows, step;
      GpuChunk head{*slot, std::span<const int32_t>(p.input_ids).first(p.split), LogitsMode::kAll};
      EXPECT_TRUE(model->Forward({&head, 1}, &rows).ok());
      for (int64_t t = p.split; t < T; ++t) {
        GpuChunk one{*slot, std::span<const int32_t>(p.input_ids).subspan(t, 1), LogitsMode::kLast};
        EXPECT_TRUE(model->Forward({&one, 1}, &step).ok());
        rows.insert(rows.end(), step.begin(), step.end());
      }
      r.incremental = MaxAbsDiff(rows.data(), p.incremental_logits.data(), std::min(rows.size(), p.incremental_logits.size()));
      EXPECT_TRUE(model->FreeSlot(*slot).ok());
    }
    const std::vector<int32_t> ids = Greedy(*model, p.input_ids, static_cast<int>(p.greedy_ids.size()));
    r.greedy_total = static_cast<int>(p.greedy_ids.size());
    while (r.greedy_match < r.greedy_total && r.greedy_match < static_cast<int>(ids.size()) &&
           ids[r.greedy_match] == p.greedy_ids[r.greedy_match])
      ++r.greedy_match;
    std::printf("%s prompt %zu (T %ld): prefill max|Δ| %.3g, incremental max|Δ| %.3g, greedy %d/%d\n", name.c_str(), i,
                static_cast<long>(T), r.prefill, r.incremental, r.greedy_match, r.greedy_total);
    out.push_back(r);
  }
  return out;
}

// That bar on the Kimi-Linear golden whose weights are bf16.
TEST(CudaModelGolden, KimiLinearBf16) {
  REQUIRE_GPU();
  for (const GoldenReport& r : RunGolden("tiny-kimi-linear-bf16")) {
    EXPECT_LE(r.prefill, 2e-2);
    EXPECT_LE(r.incremental, 2e-2);
    EXPECT_EQ(r.greedy_match, r.greedy_total);
  }
}

// A copy of a checkpoint with every tensor rounded to bf16 (what the GPU engine holds).
std::string RoundedToBf16(const std::string& name) {
  const std::string dir = (std::filesystem::temp_directory_path() / ("k3_cuda_bf16_" + name)).string();
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(Data(name) + "/config.json", dir + "/config.json",
                             std::filesystem::copy_options::overwrite_existing);
  auto ck = Checkpoint::Open(Data(name));
  EXPECT_TRUE(ck.ok()) << ck.status();
  std::vector<TensorBlob> blobs;
  for (const auto& [n, t] : ck->tensors()) {
    TensorBlob b{n, DType::kBF16, t.shape, std::vector<std::byte>(t.numel() * 2)};
    for (int64_t i = 0; i < t.numel(); ++i) {
      uint16_t h;
      if (t.dtype == DType::kF32) {
        float f;
        std::memcpy(&f, t.data + 4 * i, 4);
        h = FloatToBf16(f);
      } else {
        std::memcpy(&h, t.data + 2 * i, 2);
      }
      std::memcpy(b.bytes.data() + 2 * i, &h, 2);
    }
    blobs.push_back(std::move(b));
  }
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", blobs).ok());
  return dir;
}

// fp32 checkpoints (Kimi-Linear, and Kimi K3 with Block AttnRes, bounded and full-rank KDA gates, gated MLA,
// LatentMoE, SiTU): the GPU's distance to the fp32 golden is at most twice the fp32 CPU engine's on the same
// bf16-rounded weights (or 2e-2). Greedy matches are printed, not required.
TEST(CudaModelGolden, Fp32CheckpointsAsCloseAsTheirBf16Rounding) {
  REQUIRE_GPU();
  for (const char* name : {"tiny-kimi-linear", "tiny-k3"}) {
    auto cpu = Model::Load(RoundedToBf16(name));
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    LocalExpertExecutor experts((*cpu)->config(), (*cpu)->weights());
    auto golden = LoadGolden(Data(name));
    ASSERT_TRUE(golden.ok()) << golden.status();
    const std::vector<GoldenReport> gpu = RunGolden(name);
    ASSERT_EQ(gpu.size(), golden->prompts.size());
    for (size_t i = 0; i < gpu.size(); ++i) {
      const GoldenPrompt& p = golden->prompts[i];
      SequenceState st((*cpu)->config());
      std::vector<float> logits;
      SeqChunk all{&st, p.input_ids, LogitsMode::kAll};
      ASSERT_TRUE((*cpu)->Forward({&all, 1}, experts, &logits).ok());
      const double bound = MaxAbsDiff(logits.data(), p.prefill_logits.data(), logits.size());
      std::printf("%s prompt %zu: CPU engine on bf16-rounded weights max|Δ| %.3g\n", name, i, bound);
      EXPECT_LE(gpu[i].prefill, std::max(2e-2, 2 * bound)) << name << " prompt " << i;
    }
  }
}

// ------------------------------------------------------------------------------------ random checkpoints

// Writes config.json and a bf16 model.safetensors with random weights for the config (initialised by role,
// as k3serve-mkmodel does) into a fresh temp directory.
std::string WriteRandomModel(const std::string& tag, const std::string& config_json, uint32_t seed) {
  const std::string dir = (std::filesystem::temp_directory_path() / ("k3_cuda_" + tag)).string();
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config_json;
  auto c = ParseModelConfig(config_json);
  EXPECT_TRUE(c.ok()) << c.status();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::vector<TensorBlob> blobs;
  for (const TensorSpec& t : ExpectedTensors(*c)) {
    int64_t n = 1;
    for (int64_t s : t.shape) n *= s;
    const float fan_in = static_cast<float>(t.shape.back());
    std::vector<uint16_t> v(n);
    for (auto& e : v) {
      float x = 0;
      switch (t.role) {
        case TensorRole::kEmbedding: x = normal(rng); break;
        case TensorRole::kLinear: x = normal(rng) / std::sqrt(fan_in); break;
        case TensorRole::kNorm: x = 0.9f + 0.2f * uni(rng); break;
        case TensorRole::kConv: x = (2.0f * uni(rng) - 1.0f) / std::sqrt(fan_in); break;
        case TensorRole::kALog: x = std::log(1.0f + 15.0f * uni(rng)); break;
        case TensorRole::kDtBias:
          x = c->kda_gate_bounded ? -2.0f * uni(rng)
                                  : std::log(std::expm1(std::exp(std::log(1e-3f) + uni(rng) * std::log(100.0f))));
          break;
        case TensorRole::kRouterBias: x = 0.2f * uni(rng) - 0.1f; break;
        case TensorRole::kAttnResQuery: x = normal(rng) * 0.25f / std::sqrt(fan_in); break;
        case TensorRole::kMxfp4Packed:  // not in this (float) config
        case TensorRole::kMxfp4Scale: break;
      }
      e = FloatToBf16(x);
    }
    TensorBlob b{t.name, DType::kBF16, t.shape, std::vector<std::byte>(n * 2)};
    std::memcpy(b.bytes.data(), v.data(), n * 2);
    blobs.push_back(std::move(b));
  }
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", blobs).ok());
  return dir;
}

std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// A 100-token prompt (two KDA chunks), then four decode steps: GPU logits against the CPU engine's, row by
// row. Random MoE models are sensitive to their top-k: a 1-ulp change of the embedding table moves most rows
// by 0.02–0.06 on the CPU engine itself, and the odd row whose routing flips by 1–2. So 90% of the rows must
// agree to 2% of the logit scale, and the worst row is printed.
TEST(CudaModel, MatchesCpuEngineOnRandomModels) {
  REQUIRE_GPU();
  int seed = 0;
  for (const char* config : {kKimiLinearLike, kK3Like}) {
    const std::string dir = WriteRandomModel(absl::StrCat("cpu_vs_gpu_", seed), config, 100 + seed);
    ++seed;
    auto cpu = Model::Load(dir);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = LoadOrDie(dir);
    ASSERT_TRUE(gpu);
    LocalExpertExecutor experts((*cpu)->config(), (*cpu)->weights());
    const std::vector<int32_t> prompt = RandomTokens(100, 1000, 7);
    SequenceState st((*cpu)->config());
    auto slot = gpu->AllocSlot();
    ASSERT_TRUE(slot.ok());
    std::vector<float> want, got;
    SeqChunk cc{&st, prompt, LogitsMode::kAll};
    GpuChunk gc{*slot, prompt, LogitsMode::kAll};
    ASSERT_TRUE((*cpu)->Forward({&cc, 1}, experts, &want).ok());
    ASSERT_TRUE(gpu->Forward({&gc, 1}, &got).ok());
    ASSERT_EQ(got.size(), want.size());
    const int64_t V = 1000;
    double scale = 1.0;
    for (float v : want) scale = std::max(scale, double(std::fabs(v)));
    std::vector<double> rows;  // per-row max |Δ|
    auto add_rows = [&]() {
      for (size_t r = 0; r * V < want.size(); ++r) rows.push_back(MaxAbsDiff(got.data() + r * V, want.data() + r * V, V));
    };
    add_rows();
    for (int step = 0; step < 4; ++step) {
      const std::vector<int32_t> tok = {static_cast<int32_t>(11 + 37 * step)};
      SeqChunk cs{&st, tok, LogitsMode::kLast};
      GpuChunk gs{*slot, tok, LogitsMode::kLast};
      ASSERT_TRUE((*cpu)->Forward({&cs, 1}, experts, &want).ok());
      ASSERT_TRUE(gpu->Forward({&gs, 1}, &got).ok());
      add_rows();
    }
    std::sort(rows.begin(), rows.end());
    const double p90 = rows[rows.size() * 9 / 10], worst = rows.back();
    std::printf("random model %d: max|logit| %.3g, GPU vs CPU per-row max|Δ|: 90th percentile %.3g, worst %.3g\n",
                seed, scale, p90, worst);
    EXPECT_LT(p90 / scale, 2e-2);
  }
}

// Sequences in a mixed batch (prefill chunks beside decode tokens, in varying order) get the logits they get
// alone.
TEST(CudaModel, BatchedEqualsAlone) {
  REQUIRE_GPU();
  const std::string dirs[] = {Data("tiny-kimi-linear-bf16"), WriteRandomModel("batched", kKimiLinearLike, 200)};
  for (const std::string& dir : dirs) {
    auto model = LoadOrDie(dir);
    ASSERT_TRUE(model);
    const int64_t V = model->config().vocab_size;
    const std::vector<std::vector<int32_t>> prompts = {RandomTokens(30, V, 1), RandomTokens(70, V, 2), {5}};
    const std::vector<std::vector<int32_t>> next = {{3, 4, 5}, {6, 7, 8}, {9, 10, 11}};
    // Alone: prompt, then three decode tokens; logits of the last row each time.
    std::vector<std::vector<std::vector<float>>> alone(3);
    for (int s = 0; s < 3; ++s) {
      auto slot = model->AllocSlot();
      ASSERT_TRUE(slot.ok());
      std::vector<float> l;
      GpuChunk p{*slot, prompts[s], LogitsMode::kLast};
      ASSERT_TRUE(model->Forward({&p, 1}, &l).ok());
      alone[s].push_back(l);
      for (int t = 0; t < 3; ++t) {
        GpuChunk d{*slot, std::span<const int32_t>(next[s]).subspan(t, 1), LogitsMode::kLast};
        ASSERT_TRUE(model->Forward({&d, 1}, &l).ok());
        alone[s].push_back(l);
      }
      ASSERT_TRUE(model->FreeSlot(*slot).ok());
    }
    // Batched schedule: (sequence, step) per chunk; step 0 is the prompt.
    const std::vector<std::vector<std::pair<int, int>>> schedule = {
        {{0, 0}, {2, 0}}, {{0, 1}, {1, 0}, {2, 1}}, {{1, 1}, {0, 2}, {2, 2}}, {{0, 3}, {1, 2}, {2, 3}}, {{1, 3}}};
    std::vector<int32_t> slots;
    for (int s = 0; s < 3; ++s) slots.push_back(*model->AllocSlot());
    double worst = 0;
    for (const auto& batch : schedule) {
      std::vector<GpuChunk> chunks;
      for (auto [s, step] : batch)
        chunks.push_back({slots[s], step == 0 ? std::span<const int32_t>(prompts[s])
                                              : std::span<const int32_t>(next[s]).subspan(step - 1, 1),
                          LogitsMode::kLast});
      std::vector<float> l;
      ASSERT_TRUE(model->Forward(chunks, &l).ok());
      ASSERT_EQ(static_cast<int64_t>(l.size()), static_cast<int64_t>(batch.size()) * V);
      for (size_t i = 0; i < batch.size(); ++i) {
        const auto& ref = alone[batch[i].first][batch[i].second];
        worst = std::max(worst, MaxAbsDiff(l.data() + i * V, ref.data(), V));
      }
    }
    std::printf("%s: batched vs alone max|Δ| %.3g\n", dir.c_str(), worst);
    EXPECT_LE(worst, 1e-4);
  }
}

// Decode batches replay CUDA graphs captured on their first step; the replays read each step's positions and
// slots from the new metadata: the same logits, bit for bit, as enqueuing every kernel, over steps where the
// batch changes size (new graphs) and repeats a size (replays).
TEST(CudaModel, GraphReplayEqualsDirectLaunch) {
  REQUIRE_GPU();
  const std::string dir = WriteRandomModel("graphs", kKimiLinearLike, 300);
  auto direct = LoadOrDie(dir, false), graphed = LoadOrDie(dir, true);
  ASSERT_TRUE(direct && graphed);
  const int64_t V = direct->config().vocab_size;
  std::vector<int32_t> slots;
  for (int s = 0; s < 3; ++s) {
    const int32_t a = *direct->AllocSlot(), b = *graphed->AllocSlot();
    ASSERT_EQ(a, b);
    slots.push_back(a);
    const std::vector<int32_t> prompt = RandomTokens(20 + 13 * s, V, 40 + s);
    GpuChunk p{a, prompt, LogitsMode::kLast};
    std::vector<float> la, lb;
    ASSERT_TRUE(direct->Forward({&p, 1}, &la).ok());
    ASSERT_TRUE(graphed->Forward({&p, 1}, &lb).ok());
  }
  for (int step = 0; step < 6; ++step) {
    const int n = step < 2 ? 3 : step < 4 ? 2 : 3;  // sizes 3, 3, 2, 2, 3, 3
    std::vector<int32_t> toks(n);
    std::vector<GpuChunk> chunks;
    for (int i = 0; i < n; ++i) {
      toks[i] = static_cast<int32_t>((17 * step + 5 * i) % V);
      chunks.push_back({slots[i], std::span<const int32_t>(&toks[i], 1), LogitsMode::kLast});
    }
    std::vector<float> la, lb;
    ASSERT_TRUE(direct->Forward(chunks, &la).ok());
    ASSERT_TRUE(graphed->Forward(chunks, &lb).ok());
    ASSERT_EQ(la, lb) << "step " << step;
  }
}

// Overlapped greedy decoding (NextGreedy: each step's tokens taken on the device from the step before) gives the
// ids that ForwardGreedy step by step gives, on the golden model and a random MoE model; it continues only a
// decode-only greedy batch, and stops at max_context.
TEST(CudaModel, NextGreedyMatchesStepByStep) {
  REQUIRE_GPU();
  const std::string dirs[] = {Data("tiny-kimi-linear-bf16"), WriteRandomModel("chained", kKimiLinearLike, 400)};
  for (const std::string& dir : dirs) {
    const int kSteps = 8;
    std::vector<std::vector<int32_t>> runs[2];  // the ids of each step: step by step, chained
    for (int chained = 0; chained < 2; ++chained) {
      auto model = LoadOrDie(dir);
      ASSERT_TRUE(model);
      const int64_t V = model->config().vocab_size;
      std::vector<int32_t> slots, next;
      for (int s = 0; s < 3; ++s) {
        slots.push_back(*model->AllocSlot());
        const std::vector<int32_t> prompt = RandomTokens(9 + 21 * s, V, 60 + s);
        GpuChunk p{slots[s], prompt, LogitsMode::kLast};
        std::vector<int32_t> id;
        ASSERT_TRUE(model->ForwardGreedy({&p, 1}, &id).ok());
        next.push_back(id[0]);
      }
      std::vector<int32_t> prev;
      EXPECT_EQ(model->NextGreedy(&prev).code(), absl::StatusCode::kFailedPrecondition);  // a prefill came last
      auto step = [&]() {
        std::vector<GpuChunk> chunks;
        for (int s = 0; s < 3; ++s) chunks.push_back({slots[s], std::span<const int32_t>(&next[s], 1), LogitsMode::kLast});
        std::vector<int32_t> ids;
        EXPECT_TRUE(model->ForwardGreedy(chunks, &ids).ok());
        next = ids;
      };
      step();
      runs[chained].push_back(next);
      if (chained) {
        // Step i is enqueued before step i - 1's ids are read: they come back while it runs.
        for (int i = 1; i < kSteps; ++i) {
          ASSERT_TRUE(model->NextGreedy(&prev).ok());
          if (i == 1) {
            EXPECT_EQ(prev, runs[1].back()) << "step 1 is fed the ids ForwardGreedy returned";
          } else {
            runs[1].push_back(prev);
          }
        }
        ASSERT_TRUE(model->LastGreedy(&next).ok());
        runs[1].push_back(next);
      } else {
        for (int i = 1; i < kSteps; ++i) step(), runs[0].push_back(next);
      }
      for (int s = 0; s < 3; ++s) EXPECT_EQ(model->position(slots[s]), 9 + 21 * s + kSteps);
      if (chained) {
        ASSERT_TRUE(model->FreeSlot(slots[2]).ok());
        EXPECT_EQ(model->NextGreedy(&prev).code(), absl::StatusCode::kFailedPrecondition);  // the batch is gone
      }
    }
    EXPECT_EQ(runs[0], runs[1]) << dir;
  }
  // At max_context the chain stops, before the step that would overflow.
  CudaModelOptions o;
  o.max_seqs = 2, o.max_context = 12;
  auto model = CudaModel::Load(Data("tiny-kimi-linear-bf16"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const int32_t slot = *(*model)->AllocSlot();
  const std::vector<int32_t> prompt = RandomTokens(9, (*model)->config().vocab_size, 70);
  std::vector<int32_t> ids, prev;
  GpuChunk p{slot, prompt, LogitsMode::kLast};
  ASSERT_TRUE((*model)->ForwardGreedy({&p, 1}, &ids).ok());
  GpuChunk d{slot, std::span<const int32_t>(ids.data(), 1), LogitsMode::kLast};
  std::vector<int32_t> ids2;
  ASSERT_TRUE((*model)->ForwardGreedy({&d, 1}, &ids2).ok());  // position 10
  EXPECT_TRUE((*model)->NextGreedy(&prev).ok());               // 11
  EXPECT_TRUE((*model)->NextGreedy(&prev).ok());               // 12
  EXPECT_EQ((*model)->NextGreedy(&prev).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*model)->position(slot), 12);
}

TEST(CudaModel, RejectsBadBatches) {
  REQUIRE_GPU();
  auto model = LoadOrDie(Data("tiny-kimi-linear"));
  ASSERT_TRUE(model);
  const std::vector<int32_t> ok = {1, 2}, bad = {1, 100000};
  std::vector<float> l;
  GpuChunk unallocated{3, ok, LogitsMode::kLast};
  EXPECT_EQ(model->Forward({&unallocated, 1}, &l).code(), absl::StatusCode::kInvalidArgument);
  auto slot = model->AllocSlot();
  ASSERT_TRUE(slot.ok());
  GpuChunk oov{*slot, bad, LogitsMode::kLast};
  EXPECT_EQ(model->Forward({&oov, 1}, &l).code(), absl::StatusCode::kInvalidArgument);
  GpuChunk twice[2] = {{*slot, ok, LogitsMode::kLast}, {*slot, ok, LogitsMode::kLast}};
  EXPECT_EQ(model->Forward(twice, &l).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model->position(*slot), 0);
  std::vector<int32_t> long_prompt(513, 1);
  GpuChunk too_long{*slot, long_prompt, LogitsMode::kLast};
  EXPECT_FALSE(model->Forward({&too_long, 1}, &l).ok());
}

}  // namespace
}  // namespace k3::cuda

namespace k3::cuda {
namespace {

// ------------------------------------------------------------------------------------------------ MXFP4 experts

int32_t Argmax(const float* v, int64_t n) { return static_cast<int32_t>(std::max_element(v, v + n) - v); }

// Greedy continuation on the CPU engine (the reference), as Greedy does on the GPU.
std::vector<int32_t> CpuGreedy(Model& model, const std::vector<int32_t>& prompt, int n) {
  LocalExpertExecutor experts(model.config(), model.weights());
  SequenceState st(model.config());
  const int64_t V = model.config().vocab_size;
  std::vector<float> logits;
  std::vector<int32_t> out, tok = prompt;
  for (int i = 0; i < n; ++i) {
    SeqChunk c{&st, tok, LogitsMode::kLast};
    EXPECT_TRUE(model.Forward({&c, 1}, experts, &logits).ok());
    if (static_cast<int64_t>(logits.size()) != V) break;
    out.push_back(Argmax(logits.data(), V));
    tok = {out.back()};
  }
  return out;
}

// The GPU engine runs MXFP4 routed experts from their packed codes (4.25 bits a weight on the device) and decodes
// greedily as the CPU engine does on the same checkpoint: the Kimi-Linear and K3 goldens' models with their
// experts quantized, on the goldens' prompts.
TEST(CudaModelMxfp4, GreedyEqualsTheCpuEngine) {
  REQUIRE_GPU();
  for (const auto& [name, I] : {std::pair{"tiny-kimi-linear-bf16", 64}, std::pair{"tiny-k3", 64}}) {
    const std::string dir = testing::QuantizeExperts("k3_cuda_mx_" + std::string(name), Data(name), I);
    auto cpu = Model::Load(dir);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_EQ((*cpu)->config().expert_format, ExpertFormat::kMxfp4);
    auto gpu = LoadOrDie(dir);
    ASSERT_TRUE(gpu);
    const int64_t X = gpu->config().expert_width();
    EXPECT_EQ(gpu->expert_bytes(), 2 * (Mxfp4CodeBytes(I, X) + Mxfp4ScaleBytes(I, X)) + Mxfp4CodeBytes(X, I) +
                                       Mxfp4ScaleBytes(X, I));
    EXPECT_LT(gpu->expert_bytes() * 3.5, 3 * I * X * 2) << "MXFP4 experts are held packed";
    auto golden = LoadGolden(Data(name));
    ASSERT_TRUE(golden.ok()) << golden.status();
    int match = 0, total = 0;
    for (const GoldenPrompt& p : golden->prompts) {
      const int n = 12;
      const std::vector<int32_t> want = CpuGreedy(**cpu, p.input_ids, n), got = Greedy(*gpu, p.input_ids, n);
      EXPECT_EQ(got, want) << name << ", prompt of " << p.input_ids.size() << " tokens";
      for (int i = 0; i < n && i < static_cast<int>(got.size()) && got[i] == want[i]; ++i) ++match;
      total += n;
    }
    std::printf("%s with MXFP4 experts: GPU greedy ids equal the CPU engine's for %d of %d tokens\n", name, match,
                total);
  }
}

// A random K3 model of MXFP4 experts drawn on the device runs; a scale of 0xFF in a checkpoint is an error naming
// the tensor.
TEST(CudaModelMxfp4, RandomAndBadCheckpoints) {
  REQUIRE_GPU();
  std::string config = kK3Like;
  config.replace(config.find("\"moe_intermediate_size\": 48"), 27, "\"moe_intermediate_size\": 64");
  auto c = ParseModelConfig(config);
  ASSERT_TRUE(c.ok()) << c.status();
  c->expert_format = ExpertFormat::kMxfp4;
  CudaModelOptions o;
  o.max_seqs = 2, o.max_context = 64, o.max_batch_tokens = 64;
  auto random = CudaModel::CreateRandom(*c, 3, o);
  ASSERT_TRUE(random.ok()) << random.status();
  const std::vector<int32_t> ids = Greedy(**random, RandomTokens(40, c->vocab_size, 5), 4);
  EXPECT_EQ(ids.size(), 4u);

  const std::string dir = testing::QuantizeExperts("k3_cuda_mx_bad", Data("tiny-kimi-linear-bf16"), 64);
  auto ck = Checkpoint::Open(dir);
  ASSERT_TRUE(ck.ok());
  std::vector<TensorBlob> blobs;
  const std::string bad = names::Expert(1, 3, names::kExpertW2) + names::kScaleSuffix;
  for (const auto& [name, t] : ck->tensors()) {
    TensorBlob b{name, t.dtype, t.shape, std::vector<std::byte>(t.data, t.data + t.nbytes)};
    if (name == bad) b.bytes[5] = std::byte{0xFF};
    blobs.push_back(std::move(b));
  }
  ck = absl::InternalError("closed");  // unmaps the file before it is rewritten
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", blobs).ok());
  auto m = CudaModel::Load(dir, o);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find(bad), std::string::npos) << m.status();
}

}  // namespace
}  // namespace k3::cuda

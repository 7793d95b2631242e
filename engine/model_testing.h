// Helpers of the engine's model tests: loading a checkpoint, random ids, logits step by step,
// scratch directories and text files.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "engine/expert_executor.h"
#include "engine/model.h"

namespace k3::testing {

inline std::unique_ptr<Model> Load(const std::string& dir) {
  auto m = Model::Load(dir);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

inline std::vector<int32_t> Ids(int64_t n, uint64_t seed, int64_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng() % vocab);
  return v;
}

// The logits of every position: a prefill of the first `prefill` ids, then one id per step.
inline std::vector<float> Logits(const Model& m, std::span<const int32_t> ids, int64_t prefill) {
  LocalExpertExecutor experts(m.config(), m.weights());
  SequenceState st(m.config());
  std::vector<float> all, out;
  for (int64_t t = 0; t < static_cast<int64_t>(ids.size());) {
    const int64_t n = t == 0 ? prefill : 1;
    SeqChunk ch{&st, ids.subspan(t, n), LogitsMode::kAll};
    EXPECT_TRUE(m.Forward({&ch, 1}, experts, &out).ok());
    all.insert(all.end(), out.begin(), out.end());
    t += n;
  }
  return all;
}

inline std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteText(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

// Runs `command` with its stderr joined to its stdout; returns its exit code (−1 if it did not exit), its output
// in *output.
inline int RunCommand(const std::string& command, std::string* output) {
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  char buf[512];
  while (std::fgets(buf, sizeof(buf), p)) *output += buf;
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A fresh scratch directory of this process, removed when the object goes.
class Scratch {
 public:
  explicit Scratch(const std::string& name)
      : dir_(std::filesystem::temp_directory_path() / ("k3_test_" + std::to_string(::getpid()) + "_" + name)) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~Scratch() { std::filesystem::remove_all(dir_); }
  std::filesystem::path operator/(const std::string& sub) const { return dir_ / sub; }
  std::string str() const { return dir_.string(); }

 private:
  std::filesystem::path dir_;
};

}  // namespace k3::testing

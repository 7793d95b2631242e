// The conformance tool, as a real process: passes on the goldens, fails when one weight changes.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <ostream>

#include "common/safetensors.h"
#include "tests/testing.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;

struct Result {
  int exit_code = -1;
  std::string output;
};

Result RunConformance(const std::string& model, const std::string& golden, const std::string& flags = "") {
  const std::string cmd =
      std::string(K3SERVE_BIN_DIR) + "/k3serve-conformance --model " + model + " --golden " + golden + " " + flags + " 2>&1";
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[512];
  while (std::fgets(buf, sizeof(buf), p)) r.output += buf;
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class Conformance : public ::testing::TestWithParam<std::string> {};

TEST_P(Conformance, PassesOnGolden) {
  const std::string dir = testing::SourceDir() + "/tests/data/" + GetParam();
  const Result r = RunConformance(dir, dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("PASS"), std::string::npos) << r.output;
  std::printf("%s", r.output.c_str());
}

// Every golden is judged by its golden.json's tolerance alone.
INSTANTIATE_TEST_SUITE_P(Goldens, Conformance, ::testing::Values("tiny-kimi-linear", "tiny-kimi-linear-bf16", "tiny-k3"));

struct Change {
  std::string model, tensor, flags;
};
void PrintTo(const Change& c, std::ostream* os) { *os << c.model << ":" << c.tensor << " " << c.flags; }

class ConformanceDetects : public ::testing::TestWithParam<Change> {};

// One changed weight (a single value of one tensor) makes the check fail, also when judged
// against the noise floor.
TEST_P(ConformanceDetects, OneChangedWeight) {
  const Change& ch = GetParam();
  const std::string src = testing::SourceDir() + "/tests/data/" + ch.model;
  const fs::path dir = fs::temp_directory_path() / ("k3_conf_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(src + "/config.json", dir / "config.json");
  auto ck = Checkpoint::OpenFile(src + "/model.safetensors");
  ASSERT_TRUE(ck.ok()) << ck.status();
  std::vector<TensorBlob> blobs;
  for (const auto& [name, t] : ck->tensors()) {
    TensorBlob b{name, t.dtype, t.shape, std::vector<std::byte>(t.data, t.data + t.nbytes)};
    if (name == ch.tensor) {
      float v;
      std::memcpy(&v, b.bytes.data() + 4 * 1000, 4);
      v += 0.05f;
      std::memcpy(b.bytes.data() + 4 * 1000, &v, 4);
    }
    blobs.push_back(std::move(b));
  }
  ASSERT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), blobs).ok());
  const Result r = RunConformance(dir.string(), src, ch.flags);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("FAIL"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Weights, ConformanceDetects,
                         ::testing::Values(Change{"tiny-kimi-linear", "model.layers.2.self_attn.q_proj.weight", ""},
                                           Change{"tiny-kimi-linear", "model.layers.3.self_attn.kv_b_proj.weight", "--noise-floor"},
                                           Change{"tiny-k3", "model.layers.2.self_attn.kv_b_proj.weight", ""},
                                           Change{"tiny-k3", "model.layers.4.block_sparse_moe.routed_expert_up_proj.weight",
                                                  ""}),
                         [](const ::testing::TestParamInfo<Change>& info) {
                           // e.g. tiny_k3_layers_4_block_sparse_moe_routed_expert_up_proj
                           std::string name = info.param.model + "_" + info.param.tensor.substr(6);
                           name = name.substr(0, name.rfind(".weight"));
                           for (char& c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

}  // namespace
}  // namespace k3

// Bad model directories produce errors that name the file and the tensor or key.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "common/bf16.h"
#include "engine/model.h"
#include "tests/testing.h"

namespace k3 {
namespace {

namespace fs = std::filesystem;

std::string TinyDir() { return testing::SourceDir() + "/tests/data/tiny-kimi-linear"; }

// A scratch copy of the tiny model that a test may break.
class BadModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("k3_loader_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(TinyDir() + "/config.json", dir_ / "config.json");
    fs::copy_file(TinyDir() + "/model.safetensors", dir_ / "model.safetensors");
    fs::permissions(dir_ / "config.json", fs::perms::owner_write, fs::perm_options::add);
    fs::permissions(dir_ / "model.safetensors", fs::perms::owner_write, fs::perm_options::add);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Read(const std::string& name) {
    std::ifstream in(dir_ / name, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  void Write(const std::string& name, const std::string& data) {
    std::ofstream out(dir_ / name, std::ios::binary | std::ios::trunc);
    out << data;
  }
  void EditConfig(const std::string& from, const std::string& to) {
    std::string c = Read("config.json");
    const size_t at = c.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    Write("config.json", c.replace(at, from.size(), to));
  }
  // Rewrites the checkpoint through the reader and writer, letting `edit` change the tensor list.
  void EditTensors(const std::function<void(std::vector<TensorBlob>&)>& edit) {
    auto ck = Checkpoint::OpenFile((dir_ / "model.safetensors").string());
    ASSERT_TRUE(ck.ok()) << ck.status();
    std::vector<TensorBlob> blobs;
    for (const auto& [name, t] : ck->tensors())
      blobs.push_back({name, t.dtype, t.shape, std::vector<std::byte>(t.data, t.data + t.nbytes)});
    edit(blobs);
    ASSERT_TRUE(WriteSafetensors((dir_ / "model.safetensors.tmp").string(), blobs).ok());
    fs::rename(dir_ / "model.safetensors.tmp", dir_ / "model.safetensors");
  }
  std::string LoadError() {
    auto m = Model::Load(dir_.string());
    if (m.ok()) return "";
    return std::string(m.status().message());
  }
  fs::path dir_;
};

TEST_F(BadModelTest, IntactCopyLoads) { EXPECT_EQ(LoadError(), ""); }

TEST_F(BadModelTest, MissingTensorIsNamed) {
  EditTensors([](auto& b) { std::erase_if(b, [](auto& t) { return t.name == "model.layers.2.self_attn.dt_bias"; }); });
  const std::string e = LoadError();
  EXPECT_NE(e.find("missing tensor \"model.layers.2.self_attn.dt_bias\""), std::string::npos) << e;
}

TEST_F(BadModelTest, ExtraTensorIsNamed) {
  EditTensors([](auto& b) { b.push_back({"model.layers.9.mystery.weight", DType::kF32, {2}, std::vector<std::byte>(8)}); });
  const std::string e = LoadError();
  EXPECT_NE(e.find("unexpected tensor \"model.layers.9.mystery.weight\""), std::string::npos) << e;
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
}

TEST_F(BadModelTest, WrongShapeIsNamed) {
  EditTensors([](auto& b) {
    for (auto& t : b)
      if (t.name == "model.layers.1.block_sparse_moe.gate.weight") {
        t.shape = {8, 256};  // same bytes, wrong shape
      }
  });
  const std::string e = LoadError();
  EXPECT_NE(e.find("\"model.layers.1.block_sparse_moe.gate.weight\" has shape [8, 256], expected [16, 128]"),
            std::string::npos)
      << e;
}

TEST_F(BadModelTest, TruncatedFileIsNamed) {
  std::string data = Read("model.safetensors");
  Write("model.safetensors", data.substr(0, data.size() - 1000));
  const std::string e = LoadError();
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  Write("model.safetensors", data.substr(0, 5));
  EXPECT_NE(LoadError().find("truncated"), std::string::npos);
}

TEST_F(BadModelTest, BadJsonIsNamed) {
  Write("config.json", "{\"hidden_size\": 128,");
  const std::string e = LoadError();
  EXPECT_NE(e.find("config.json: not valid JSON"), std::string::npos) << e;
}

TEST_F(BadModelTest, MissingConfigKeyIsNamed) {
  EditConfig("\"hidden_size\": 128,", "");
  EXPECT_NE(LoadError().find("missing required key \"hidden_size\""), std::string::npos) << LoadError();
}

TEST_F(BadModelTest, UnknownConfigKeyIsNamed) {
  EditConfig("\"hidden_size\": 128,", "\"hidden_size\": 128, \"use_sliding_window\": true,");
  EXPECT_NE(LoadError().find("unknown key \"use_sliding_window\""), std::string::npos) << LoadError();
}

TEST_F(BadModelTest, WrongTypeConfigKeyIsNamed) {
  EditConfig("\"num_experts\": 16,", "\"num_experts\": \"16\",");
  EXPECT_NE(LoadError().find("key \"num_experts\" must be an integer"), std::string::npos) << LoadError();
}

TEST_F(BadModelTest, MissingFileIsNamed) {
  fs::remove(dir_ / "model.safetensors");
  EXPECT_NE(LoadError().find("no *.safetensors file"), std::string::npos) << LoadError();
  fs::remove(dir_ / "config.json");
  EXPECT_NE(LoadError().find("config.json: cannot open"), std::string::npos) << LoadError();
}

TEST_F(BadModelTest, ShardedWithIndexLoadsAndChecksTheIndex) {
  // Split the checkpoint in two shards with an index; the model loads the same.
  auto ck = Checkpoint::OpenFile((dir_ / "model.safetensors").string());
  ASSERT_TRUE(ck.ok());
  std::vector<TensorBlob> a, b;
  std::string index = "{\"metadata\": {}, \"weight_map\": {";
  bool first = true;
  for (const auto& [name, t] : ck->tensors()) {
    const bool to_a = name.find("layers.3") == std::string::npos;
    (to_a ? a : b).push_back({name, t.dtype, t.shape, std::vector<std::byte>(t.data, t.data + t.nbytes)});
    index += (first ? "" : ",") + ("\"" + name + "\": \"" + (to_a ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors") + "\"");
    first = false;
  }
  index += "}}";
  ASSERT_TRUE(WriteSafetensors((dir_ / "model-00001-of-00002.safetensors").string(), a).ok());
  ASSERT_TRUE(WriteSafetensors((dir_ / "model-00002-of-00002.safetensors").string(), b).ok());
  fs::remove(dir_ / "model.safetensors");
  Write("model.safetensors.index.json", index);
  EXPECT_EQ(LoadError(), "");
  // An index naming a tensor its shard does not hold.
  Write("model.safetensors.index.json", index.substr(0, index.size() - 2) + ", \"lm_head.bias\": \"model-00001-of-00002.safetensors\"}}");
  EXPECT_NE(LoadError().find("\"lm_head.bias\" is listed in model-00001-of-00002.safetensors but not stored there"),
            std::string::npos)
      << LoadError();
}

TEST_F(BadModelTest, Bf16CheckpointLoads) {
  EditTensors([](auto& blobs) {
    for (auto& t : blobs) {
      std::vector<std::byte> out(t.bytes.size() / 2);
      for (size_t i = 0; i < out.size() / 2; ++i) {
        float f;
        std::memcpy(&f, t.bytes.data() + 4 * i, 4);
        const uint16_t h = FloatToBf16(f);
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
      t.dtype = DType::kBF16;
      t.bytes = std::move(out);
    }
  });
  EXPECT_EQ(LoadError(), "");
}

}  // namespace
}  // namespace k3

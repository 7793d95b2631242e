// The expert node's batching window, over the real shared-memory transport: it closes as soon as
// no attention node that is sending still has to send rows for the batch's layer. The windows here
// are far longer than the tests, so a batch that waited for its window would fail them.
#include "expert_service/expert_node.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "router/shm_transport.h"
#include "router/wire.h"

namespace k3 {
namespace {

using namespace std::chrono_literals;

std::string ModelDir() { return std::string(K3SERVE_SOURCE_DIR) + "/tests/data/tiny-kimi-linear"; }

// One attention node's connection: sends requests for a layer, records the replies' ids.
class Sender {
 public:
  Sender(dataplane::Transport& t, const std::string& address) {
    auto c = t.Connect(address, {.on_message = [this](dataplane::Buffer msg) {
      auto reply = wire::DecodeExpertReply(msg.span());
      std::lock_guard<std::mutex> lock(mu_);
      replies_.push_back(reply.ok() ? reply->request_id : 0);
      cv_.notify_all();
    }});
    EXPECT_TRUE(c.ok()) << c.status();
    conn_ = std::move(*c);
  }
  void Send(uint64_t id, uint32_t layer, uint32_t width, uint32_t expert) {
    std::vector<std::byte> rows(width * sizeof(float), std::byte{0});
    wire::ExpertRequest r{.request_id = id, .layer = layer, .placement_version = 1, .dtype = wire::RowDType::kF32,
                          .width = width, .n_rows = 1, .row_offsets = {0, 1}, .pairs = {{expert, 1.0f}}, .rows = rows};
    auto buf = wire::Encode<dataplane::Buffer>(r);
    ASSERT_TRUE(buf.ok()) << buf.status();
    conn_->Send(std::move(*buf), [](absl::Status) {});
  }
  bool WaitReplies(size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return replies_.size() >= n; });
  }
  size_t replies() {
    std::lock_guard<std::mutex> lock(mu_);
    return replies_.size();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> replies_;
  std::unique_ptr<dataplane::Connection> conn_;
};

class BatchingWindow : public ::testing::Test {
 protected:
  void Start(absl::Duration sending, bool inline_batches = true) {
    auto config = LoadModelConfig(ModelDir());
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    for (int64_t l = 0; l < config_.num_layers; ++l)
      if (config_.mlp[l] == Mlp::kMoe) moe_.push_back(static_cast<uint32_t>(l));
    ASSERT_GE(moe_.size(), 2u);
    auto ckpt = Checkpoint::Open(ModelDir());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ExpertNodeOptions o;
    o.node_id = "expert-test";
    o.batch_window = absl::Seconds(60);
    o.sending = sending;
    o.inline_batches = inline_batches;
    node_ = std::make_unique<ExpertNode>(config_, std::make_shared<const Checkpoint>(std::move(*ckpt)), o, registry_);
    v1::LoadSlotsRequest req;
    req.set_version(1);
    for (uint32_t l : moe_) {
      auto* s = req.add_slots();
      s->set_layer(static_cast<int32_t>(l));
      s->set_expert(0);
    }
    v1::LoadSlotsResponse resp;
    grpc::ServerContext ctx;  // in process: no credentials configured, so the admin check is open
    ASSERT_TRUE(node_->LoadSlots(&ctx, &req, &resp).ok());
    auto t = dataplane::NewShmTransport();
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = std::move(*t);
    ASSERT_TRUE(node_->Listen(*transport_, "127.0.0.1:0").ok());
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
    if (node_) node_->Stop();
    node_.reset();
    transport_.reset();
  }
  uint32_t width() const { return static_cast<uint32_t>(config_.expert_width()); }

  ModelConfig config_;
  std::vector<uint32_t> moe_;
  metrics::Registry registry_;
  std::unique_ptr<dataplane::Transport> transport_;
  std::unique_ptr<ExpertNode> node_;
  std::unique_ptr<Sender> a_, b_;
};

TEST_F(BatchingWindow, ALoneAttentionNodeNeverWaits) {
  Start(absl::Seconds(60));
  a_ = std::make_unique<Sender>(*transport_, node_->data_address());
  for (uint64_t i = 0; i < moe_.size(); ++i) {
    a_->Send(i + 1, moe_[i], width(), 0);
    ASSERT_TRUE(a_->WaitReplies(i + 1, 20s)) << "layer " << moe_[i] << " waited for its window";
  }
}

TEST_F(BatchingWindow, ALoneAttentionNodeNeverWaitsOnTheWorkerEither) {
  Start(absl::Seconds(60), /*inline_batches=*/false);
  a_ = std::make_unique<Sender>(*transport_, node_->data_address());
  for (uint64_t i = 0; i < moe_.size(); ++i) {
    a_->Send(i + 1, moe_[i], width(), 0);
    ASSERT_TRUE(a_->WaitReplies(i + 1, 20s)) << "layer " << moe_[i] << " waited for its window";
  }
}

// B's latest rows are for an earlier layer, so A's rows for the next one wait for B's; once B has
// sent, both go in one batch.
TEST_F(BatchingWindow, WaitsForAnAttentionNodeBehindOnTheLayer) {
  Start(absl::Seconds(60));
  a_ = std::make_unique<Sender>(*transport_, node_->data_address());
  b_ = std::make_unique<Sender>(*transport_, node_->data_address());
  a_->Send(1, moe_[0], width(), 0);
  ASSERT_TRUE(a_->WaitReplies(1, 20s));
  b_->Send(2, moe_[0], width(), 0);
  ASSERT_TRUE(b_->WaitReplies(1, 20s));
  a_->Send(3, moe_[1], width(), 0);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(a_->replies(), 1u) << "the batch did not wait for B's rows of layer " << moe_[1];
  b_->Send(4, moe_[1], width(), 0);
  ASSERT_TRUE(a_->WaitReplies(2, 20s));
  ASSERT_TRUE(b_->WaitReplies(2, 20s));
  // The count moves after a batch's replies are sent.
  v1::ExpertStatus status;
  grpc::ServerContext server_ctx;  // in process: no credentials configured, so the check is open
  for (int i = 0; i < 500 && status.batches_processed() < 3; ++i) {
    std::this_thread::sleep_for(10ms);
    ASSERT_TRUE(node_->Status(&server_ctx, nullptr, &status).ok());
  }
  EXPECT_EQ(status.batches_processed(), 3) << "B's and A's rows of layer " << moe_[1] << " in one batch";
}

// An attention node that stopped sending is not waited for.
TEST_F(BatchingWindow, AnIdleAttentionNodeIsNotWaitedFor) {
  Start(absl::Milliseconds(50));
  a_ = std::make_unique<Sender>(*transport_, node_->data_address());
  b_ = std::make_unique<Sender>(*transport_, node_->data_address());
  b_->Send(1, moe_[0], width(), 0);
  ASSERT_TRUE(b_->WaitReplies(1, 20s));
  std::this_thread::sleep_for(200ms);  // B goes idle
  a_->Send(2, moe_[1], width(), 0);
  ASSERT_TRUE(a_->WaitReplies(1, 20s)) << "waited for an idle attention node";
}

}  // namespace
}  // namespace k3

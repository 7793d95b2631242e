// k3serve-nccl-expert: an expert node on a GPU that serves its routed experts over NCCL
// (router/nccl_transport.h) to GPU attention nodes on the same host. It holds the routed experts of
// every MoE layer, as CudaModel loads them (the model's other weights come along; an expert
// placement over several GPUs is the UCX expert node's job for now).
//
//   k3serve-nccl-expert --model DIR --device 1 [--listen 127.0.0.1:0] [--max_rows 8192]
//   k3serve-nccl-expert --config tools/configs/k3-mini.json --seed 1 --share_experts --device 1
// Prints "listening on HOST:PORT" (the NcclBootstrap address) once it serves; SIGTERM stops it.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/flags.h"
#include "common/signals.h"
#include "engine/config.h"
#include "engine/cuda/cuda_model.h"
#include "router/nccl_transport.h"

ABSL_FLAG(std::string, model, "", "model directory (config.json + safetensors)");
ABSL_FLAG(std::string, config, "", "config.json for random weights drawn on the device (instead of --model)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the random weights (--config)");
ABSL_FLAG(bool, share_experts, false, "every MoE layer uses the first one's routed experts (CudaModelOptions)");
ABSL_FLAG(int, device, 0, "CUDA device");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "the NcclBootstrap's address (port 0: any free one)");
ABSL_FLAG(std::string, node_id, "nccl-expert", "this node's name");
ABSL_FLAG(int64_t, max_rows, 8192, "the most rows one dispatch may carry");
ABSL_FLAG(int64_t, dispatch_timeout_ms, 10000, "a reply not gone by then aborts the session");

namespace k3 {
namespace {

int Run() {
  const std::string config_path = absl::GetFlag(FLAGS_config), dir = absl::GetFlag(FLAGS_model);
  if (config_path.empty() == dir.empty()) {
    std::fprintf(stderr, "k3serve-nccl-expert: give exactly one of --model and --config\n");
    return 2;
  }
  cuda::CudaModelOptions opt;
  opt.device = absl::GetFlag(FLAGS_device);
  opt.max_seqs = 1;
  opt.max_context = 1;
  opt.max_batch_tokens = absl::GetFlag(FLAGS_max_rows);
  opt.share_routed_experts = absl::GetFlag(FLAGS_share_experts);
  absl::StatusOr<std::unique_ptr<cuda::CudaModel>> model;
  if (!dir.empty()) {
    model = cuda::CudaModel::Load(dir, opt);
  } else {
    std::ifstream in(config_path);
    std::stringstream text;
    text << in.rdbuf();
    auto config = ParseModelConfig(text.str(), config_path);
    if (!config.ok()) {
      std::fprintf(stderr, "k3serve-nccl-expert: %s\n", config.status().ToString().c_str());
      return 1;
    }
    model = cuda::CudaModel::CreateRandom(*config, absl::GetFlag(FLAGS_seed), opt);
  }
  if (!model.ok()) {
    std::fprintf(stderr, "k3serve-nccl-expert: %s\n", model.status().ToString().c_str());
    return 1;
  }
  dataplane::NcclExpertServer::Config sc;
  sc.address = absl::GetFlag(FLAGS_listen);
  sc.node_id = absl::GetFlag(FLAGS_node_id);
  sc.device = opt.device;
  sc.max_rows = opt.max_batch_tokens;
  sc.options.dispatch_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_dispatch_timeout_ms));
  auto server = dataplane::NcclExpertServer::Start((*model)->config(), *(*model)->local_experts(), sc);
  if (!server.ok()) {
    std::fprintf(stderr, "k3serve-nccl-expert: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  while (!WaitForShutdown(absl::Seconds(1))) {
  }
  server->reset();
  return 0;
}

}  // namespace
}  // namespace k3

int main(int argc, char** argv) {
  k3::InstallShutdownSignals();
  k3::NormalizeFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return k3::Run();
}

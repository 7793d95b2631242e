#include "engine/cuda/cuda_model.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "common/bf16.h"
#include "common/safetensors.h"
#include "engine/cuda/cuda_status.h"
#include "engine/tensor_names.h"
#include "engine/weights.h"
#include "kernels/cuda/attnres.cuh"
#include "kernels/cuda/conv.cuh"
#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/kda.cuh"
#include "kernels/cuda/kda_small.cuh"
#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/lm_head.cuh"
#include "kernels/cuda/mla.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/mxfp4.cuh"
#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/sampling.cuh"

namespace k3::cuda {
namespace {

using bf16 = __nv_bfloat16;

// The MLA LoRA norms use the reference RMSNorm's default eps, not rms_norm_eps (DESIGN §1.3).
constexpr float kLoraNormEps = 1e-6f;
// MLA prefill: query rows per tile of the expanded attention (bounds its score workspace).
constexpr int64_t kMlaQueryTile = 512;

struct KdaW {
  bf16 *in = nullptr, *f_b = nullptr, *g_b = nullptr, *g = nullptr, *b = nullptr, *o = nullptr;
  float *conv = nullptr, *A_log = nullptr, *dt_bias = nullptr, *o_norm = nullptr;
  // [q; k; v; f_a; g_a (low-rank gate); b (head dims 64 and 128, whose kernels take b as bf16: one product
  // fewer, b read from the projection output; else b is a product of its own, fp32 out)]
  int64_t in_rows = 0;
  // [[f_b, 0], [0, g_b]] ([2·H·D, 2·D]): both gates as one product of the adjacent f_a and g_a columns of the input
  // product, read unfolded by the decode and the gated norm (head dims 64 and 128, low-rank gate). A derived copy,
  // not counted in weight_bytes.
  bf16* fg = nullptr;
};
struct MlaW {
  bf16 *in = nullptr, *q_b = nullptr, *kv_b = nullptr, *ukt = nullptr, *o = nullptr, *g = nullptr;
  float *q_a_norm = nullptr, *kv_a_norm = nullptr;
  int64_t in_rows = 0;  // [q or q_a; kv_a]
};
struct GluW {
  bf16 *gate_up = nullptr, *down = nullptr;  // [2I, d] (gate rows, then up rows), [d, I]
  int64_t I = 0;
};
// One layer's routed experts: device arrays of E pointers to each expert's W1 and W3 together in the tiled gate/up
// kernel's packed layout (MoeExpertsArgs::packed), and to its W2 [ℓ, I]; or, for MXFP4 experts, to each matrix's
// codes and scales in the MXFP4 kernels' fragment order (Mxfp4ToFragments).
struct RoutedExperts {
  const bf16* const* gate_up = nullptr;
  const bf16* const* down = nullptr;
  const uint8_t* const* q1 = nullptr;
  const uint8_t* const* s1 = nullptr;
  const uint8_t* const* q3 = nullptr;
  const uint8_t* const* s3 = nullptr;
  const uint8_t* const* q2 = nullptr;
  const uint8_t* const* s2 = nullptr;
};
struct MoeW {
  bf16* router = nullptr;
  float* bias = nullptr;
  GluW shared;
  bf16 *latent_down = nullptr, *latent_up = nullptr;
  float* latent_norm = nullptr;
  RoutedExperts experts;
};
struct LayerW {
  float *input_norm = nullptr, *post_norm = nullptr;
  float *attn_res_w = nullptr, *attn_res_n = nullptr, *mlp_res_w = nullptr, *mlp_res_n = nullptr;
  KdaW kda;
  MlaW mla;
  GluW dense;
  MoeW moe;
};

GluAct Act(const ModelConfig& c) { return c.act == Activation::kSitu ? GluAct::kSitu : GluAct::kSilu; }

}  // namespace

// The routed experts of every MoE layer in this process: kernels/cuda/moe.cuh (the expert node's kernels) on
// the split rows, its tiled path with h and the expert outputs in two planes, the sum in fp32; MXFP4 experts through
// kernels/cuda/mxfp4.cuh the same way.
class LocalCudaExperts : public CudaExpertExecutor {
 public:
  absl::Status Run(const CudaExpertRequest& r, float* out, cudaStream_t stream) override {
    const RoutedExperts& e = (*layers)[r.layer].moe.experts;
    if (r.width != config->expert_width() || r.top_k != config->top_k || r.x.ld != r.width || r.rows > max_rows)
      return absl::InvalidArgumentError(absl::StrCat("expert request shape (rows ", r.rows, ", width ", r.width,
                                                     ", k ", r.top_k, ") does not match layer ", r.layer));
    if (config->expert_format == ExpertFormat::kMxfp4) {
      Mxfp4ExpertsArgs a;
      a.N = r.rows, a.D = r.width, a.I = config->moe_intermediate_size, a.top_k = r.top_k;
      a.num_experts = config->num_experts, a.x = r.x.p, a.x_lo = r.x.lo, a.idx = r.idx, a.w = r.w;
      a.w1 = e.q1, a.s1 = e.s1, a.w3 = e.q3, a.s3 = e.s3, a.w2 = e.q2, a.s2 = e.s2, a.act = Act(*config);
      a.situ_beta = config->situ_beta, a.situ_linear_beta = config->situ_linear_beta;
      a.out_f32 = out, a.experts_hit = hits + r.layer;
      K3_CUDA_OK(Mxfp4Experts(a, mx_workspace, stream));
      return absl::OkStatus();
    }
    MoeExpertsArgs a;
    a.N = r.rows, a.D = r.width, a.I = config->moe_intermediate_size, a.top_k = r.top_k;
    a.num_experts = config->num_experts, a.x = r.x.p, a.x_lo = r.x.lo, a.idx = r.idx, a.w = r.w;
    a.w1 = e.gate_up, a.w2 = e.down, a.packed = true, a.act = Act(*config);
    a.situ_beta = config->situ_beta, a.situ_linear_beta = config->situ_linear_beta;
    a.out_f32 = out, a.experts_hit = hits + r.layer;
    K3_CUDA_OK(MoeExperts(a, MoeGemm::kTiled, workspace, stream));
    return absl::OkStatus();
  }

  const ModelConfig* config = nullptr;
  const std::vector<LayerW>* layers = nullptr;
  MoeWorkspace workspace;         // for max_rows rows (bf16 experts)
  Mxfp4Workspace mx_workspace;    // (MXFP4 experts)
  int64_t max_rows = 0;
  int32_t* hits = nullptr;  // [layers] device: experts hit by the last request of each layer
};

struct CudaModel::Impl {
  ModelConfig c;
  CudaModelOptions opt;
  cudaStream_t stream = nullptr;
  // Products that only read inputs already made (KDA's f_b and g_b, the shared experts) run on the side stream
  // beside the latency-bound kernels that follow them here (the conv; the router, top-k and routed experts):
  // Fork() starts side work after what is queued here, Join() makes this stream wait for it. With its own
  // LinearBlas: one handle and workspace per stream.
  cudaStream_t side = nullptr;
  cudaEvent_t fork_event = nullptr, join_event = nullptr;
  std::vector<void*> allocations;
  int64_t allocated = 0;
  // Weights: all but the routed experts; the embedding table; one routed expert.
  int64_t weight_bytes = 0, embed_bytes = 0, expert_bytes = 0;

  // Weights.
  bf16 *embed = nullptr, *lm_head = nullptr;
  float *final_norm = nullptr, *out_res_w = nullptr, *out_res_n = nullptr;
  std::vector<LayerW> layers;

  // State pools, by layer.
  std::vector<float*> kda_state, conv_state;
  std::vector<bf16*> mla_cache;
  std::vector<int64_t> positions;
  std::vector<bool> in_use;

  // Work buffers for cap = max_batch_tokens rows.
  int64_t cap = 0, win_cols = 0, wide_cols = 0, hidden_cols = 0;
  float *x = nullptr, *hread = nullptr, *bank = nullptr;
  Split a, m, win, onorm, hid, z, zn, qbuf, qan;
  bf16* fn = nullptr;  // the final norm's rows, plain bf16: what the LM head reads
  float *gate = nullptr, *rlogits = nullptr, *wts = nullptr, *moe_out = nullptr, *shared_out = nullptr;
  void *graw = nullptr, *bbuf = nullptr, *qc = nullptr, *kc = nullptr, *vc = nullptr, *obuf = nullptr;
  int32_t *idx = nullptr, *ids = nullptr, *hits = nullptr;
  uint64_t* argmax_keys = nullptr;  // each logit row's greedy key, folded by the LM head's product
  void* mla_decode_ws = nullptr;
  // Grown on demand.
  void* scratch = nullptr;  // KDA prefill and MLA prefill workspaces (used one at a time)
  size_t scratch_bytes = 0;
  float* logits = nullptr;
  int64_t logits_rows = 0;

  // Per-forward metadata: pinned host staging, one upload.
  int32_t* meta_host = nullptr;
  int32_t* meta = nullptr;
  int64_t meta_cap = 0;

  LocalCudaExperts local_experts;
  CudaExpertExecutor* experts = nullptr;

  // Decode batches by (tokens, logit rows, whether the logits are kept).
  std::map<std::tuple<int64_t, int64_t, bool>, cudaGraphExec_t> graphs;
  // The batch NextGreedy continues: the last ForwardGreedy's graph of a decode-only batch, where its token ids and
  // positions sit in the uploaded metadata, its slots. exec null: none. The last step's ids reach the host by
  // `copy` (pinned ids_host) beside the next step.
  struct Chain {
    cudaGraphExec_t exec = nullptr;
    int32_t *tok_id = nullptr, *tok_pos = nullptr;
    std::vector<int32_t> slots;
  } chain;
  cudaStream_t copy = nullptr;
  cudaEvent_t fed = nullptr, copied = nullptr;
  int32_t* ids_host = nullptr;

  // Profiling: events around stages, harvested after each forward.
  bool profile = false;
  std::vector<std::tuple<const char*, cudaEvent_t, cudaEvent_t>> marks;
  std::map<std::string, double> profile_ms;
  cudaEvent_t Mark() {
    cudaEvent_t e = nullptr;
    cudaEventCreate(&e);
    cudaEventRecord(e, stream);
    return e;
  }
  void Harvest() {
    for (auto& [name, begin, end] : marks) {
      float ms = 0;
      cudaEventElapsedTime(&ms, begin, end);
      profile_ms[name] += ms;
      cudaEventDestroy(begin);
      cudaEventDestroy(end);
    }
    marks.clear();
  }

  ~Impl() {
    for (auto& [shape, exec] : graphs) cudaGraphExecDestroy(exec);
    if (stream) cudaStreamDestroy(stream);
    if (side) cudaStreamDestroy(side);
    if (copy) cudaStreamDestroy(copy);
    if (fork_event) cudaEventDestroy(fork_event);
    if (join_event) cudaEventDestroy(join_event);
    if (fed) cudaEventDestroy(fed);
    if (copied) cudaEventDestroy(copied);
    for (void* p : allocations) cudaFree(p);
    cudaFreeHost(meta_host);
    cudaFreeHost(ids_host);
  }

  template <class T>
  absl::StatusOr<T*> Alloc(int64_t count) {
    void* p = nullptr;
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T);
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess)
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes, " bytes: ", cudaGetErrorString(e)));
    allocations.push_back(p);
    allocated += static_cast<int64_t>(bytes);
    return static_cast<T*>(p);
  }
  // A split buffer of rows × cols: two planes.
  absl::StatusOr<Split> AllocSplit(int64_t rows, int64_t cols) {
    K3_ASSIGN_OR_RETURN(bf16 * p, Alloc<bf16>(2 * rows * cols));
    return Split{p, cols, rows * cols};
  }
  absl::Status Grow(void** p, size_t* have, size_t need) {
    if (need <= *have) return absl::OkStatus();
    K3_CUDA_OK(cudaStreamSynchronize(stream));
    if (*p) {
      allocations.erase(std::find(allocations.begin(), allocations.end(), *p));
      K3_CUDA_OK(cudaFree(*p));
      *p = nullptr;
    }
    K3_ASSIGN_OR_RETURN(char* q, Alloc<char>(static_cast<int64_t>(need)));
    *p = q;
    *have = need;
    return absl::OkStatus();
  }

  absl::Status Upload(TensorSource& source);
  absl::Status AllocState();
  absl::Status AllocWork();
  // The forward pass up to each logit row's greedy id (ids); the logits too when keep_logits.
  absl::Status Run(std::span<const GpuChunk> chunks, bool keep_logits, int64_t* rows);
  absl::Status Kda(int64_t l, int64_t N, int64_t nd, int64_t num_chunks, const std::vector<int32_t>& cu_host,
                   const int32_t* const* m);
  absl::Status Mla(int64_t l, int64_t N, int64_t nd, const std::vector<int64_t>& pre_start,
                   const std::vector<int64_t>& pre_len, const std::vector<int64_t>& pre_pos,
                   const std::vector<int32_t>& pre_slot, const int32_t* const* m);
  absl::Status MlaOut(const MlaW& w, int64_t N, Split o);
  absl::Status Moe(int64_t l, int64_t N, bool decode);
  // x = the tokens' embeddings, and (without Block AttnRes) the first layer's input norm `a` of it: both before a
  // decode graph's replay rather than in it — the graph's second kernel starts ≈ 9 µs after its first, which a
  // norm of 2–4 µs would leave idle and the first layer's input product (18 µs) covers.
  absl::Status Inputs(int64_t N, const int32_t* tok_id);
  enum class On { kMain, kSide };
  // hid = act(gate_up · in): the GLU's first product; the caller's down product reads hid.
  absl::Status GluUp(const GluW& g, Split in, int64_t N, On on);

  // x's adds still to make: a residual product leaves its unfolded sums here and the next norm adds them as it
  // reads x (AddRmsNorm) — no fold pass, no add kernel. Not with Block AttnRes, which reads x before its norm:
  // there the products add into x at once (Defer() false).
  bool Defer() const { return c.attn_res_block <= 0; }
  Sums pending[2];
  absl::Status Pend(Sums s) {
    Sums* free = !pending[0].p ? &pending[0] : !pending[1].p ? &pending[1] : nullptr;
    if (!free) return absl::InternalError("more than two residual adds before a norm");
    *free = s;
    return absl::OkStatus();
  }
  // x += in · Wᵀ: deferred to the next norm, or added now (Block AttnRes, or rows that need chunks). K in as many
  // slices as runs fastest (the output products: 36 tiles of N 2304 would leave most SMs idle); the norm or the
  // fold adds them.
  absl::Status AddProduct(const bf16* w, int64_t n, int64_t k, Split in, int64_t M) {
    LinearArgs la = Args(w, n, k, in, M, x, n, LinearOut::kF32Add);
    la.k_parts = 0;
    if (Defer() && blas.Unfoldable(la)) {
      Sums sums;
      K3_CUDA_OK(blas.RunUnfolded(la, stream, &sums));
      return Pend(sums);
    }
    K3_CUDA_OK(Blas(la));
    return absl::OkStatus();
  }
  // in · Wᵀ as sums for a consumer that adds the halves as it reads them: unfolded when the rows fit one chunk,
  // else folded into y (fp32, n columns). k_parts ≠ 1: a consumer that adds K slices too (Sums::parts).
  absl::StatusOr<Sums> Product(const bf16* w, int64_t n, int64_t k, Split in, int64_t M, float* y, On on,
                               int64_t k_parts = 1) {
    LinearArgs la = Args(w, n, k, in, M, y, n, LinearOut::kF32);
    la.k_parts = k_parts;
    LinearBlas& lb = on == On::kSide ? blas_side : blas;
    if (lb.Unfoldable(la)) {
      Sums sums;
      K3_CUDA_OK(lb.RunUnfolded(la, on == On::kSide ? side : stream, &sums));
      return sums;
    }
    K3_CUDA_OK(Blas(la, on));
    return Sums{y, n, 0};
  }

  cudaError_t Fork() {
    const cudaError_t e = cudaEventRecord(fork_event, stream);
    return e == cudaSuccess ? cudaStreamWaitEvent(side, fork_event) : e;
  }
  cudaError_t Join() {
    const cudaError_t e = cudaEventRecord(join_event, side);
    return e == cudaSuccess ? cudaStreamWaitEvent(stream, join_event) : e;
  }

  LinearBlas blas, blas_side;  // the dense products, on the stream and on the side stream
  cudaError_t Blas(const LinearArgs& la, On on = On::kMain) {
    return on == On::kSide ? blas_side.Run(la, side) : blas.Run(la, stream);
  }
  static LinearArgs Args(const bf16* w, int64_t n, int64_t k, Split in, int64_t M, void* y, int64_t ldy, LinearOut out,
                         int64_t y_lo = 0) {
    LinearArgs la;
    la.N = n, la.K = k, la.w = w, la.x = in, la.y = y, la.ldy = ldy, la.y_lo = y_lo, la.out = out, la.M = M;
    return la;
  }
  cudaError_t Lin(const bf16* w, int64_t n, int64_t k, Split in, int64_t M, void* y, int64_t ldy, LinearOut out,
                  int64_t y_lo = 0, On on = On::kMain) {
    return Blas(Args(w, n, k, in, M, y, ldy, out, y_lo), on);
  }
  cudaError_t LinSplit(const bf16* w, int64_t n, int64_t k, Split in, int64_t M, Split y) {
    return Lin(w, n, k, in, M, y.p, y.ld, LinearOut::kSplit, y.lo);
  }
};

namespace {
// One profiled stage: events around it while profiling is on.
struct Phase {
  Phase(CudaModel::Impl& m, const char* name) : m(m), name(name) {
    if (m.profile) begin = m.Mark();
  }
  ~Phase() {
    if (begin) m.marks.emplace_back(name, begin, m.Mark());
  }
  CudaModel::Impl& m;
  const char* name;
  cudaEvent_t begin = nullptr;
};
}  // namespace

// ----------------------------------------------------------------------------------------------- upload

// Where the weights come from: a checkpoint, or random values (benchmarks of shapes without a checkpoint).
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // The tensor as bf16 / fp32 at dst (numel elements).
  virtual absl::Status Bf16(const std::string& name, __nv_bfloat16* dst) = 0;
  virtual absl::Status F32(const std::string& name, float* dst) = 0;
  // The MXFP4 matrix "….wK.weight" [rows, cols] (its "_packed" codes and "_scale" scales) in the MXFP4 kernels'
  // fragment order at codes (Mxfp4CodeBytes) and scales (Mxfp4ScaleBytes).
  virtual absl::Status Mxfp4(const std::string& name, int64_t rows, int64_t cols, uint8_t* codes, uint8_t* scales) = 0;
};

namespace {

// Checkpoint tensors → device, converting to the device dtype.
class CheckpointSource : public TensorSource {
 public:
  CheckpointSource(const Checkpoint& ck, const ModelConfig& c) : ck_(ck), c_(c), layout_(CheckpointLayout(ck)) {}

  absl::Status Bf16(const std::string& name, bf16* dst) override {
    K3_ASSIGN_OR_RETURN(const TensorInfo* t, Find(name));
    const int64_t n = t->numel();
    if (t->dtype == DType::kBF16) {
      K3_CUDA_OK(cudaMemcpy(dst, t->data, n * 2, cudaMemcpyHostToDevice));
      return absl::OkStatus();
    }
    std::vector<uint16_t> h(n);
    for (int64_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, t->data + 4 * i, 4);
      h[i] = FloatToBf16(f);
    }
    K3_CUDA_OK(cudaMemcpy(dst, h.data(), n * 2, cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }

  absl::Status F32(const std::string& name, float* dst) override {
    K3_ASSIGN_OR_RETURN(const TensorInfo* t, Find(name));
    // The release's A_log is longer than the heads (checked by the loader): its first num_heads are theirs.
    const bool a_log = layout_ == names::Layout::kK3Release && name.ends_with(names::kKdaALog);
    const int64_t n = a_log ? c_.kda_heads : t->numel();
    std::vector<float> h(n);
    for (int64_t i = 0; i < n; ++i) {
      if (t->dtype == DType::kF32) {
        std::memcpy(&h[i], t->data + 4 * i, 4);
      } else {
        uint16_t b;
        std::memcpy(&b, t->data + 2 * i, 2);
        h[i] = Bf16ToFloat(b);
      }
    }
    K3_CUDA_OK(cudaMemcpy(dst, h.data(), n * 4, cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }

  absl::Status Mxfp4(const std::string& name, int64_t rows, int64_t cols, uint8_t* codes, uint8_t* scales) override {
    // Names, dtypes, shapes and scales were checked by the loader (CudaModel::Load).
    K3_ASSIGN_OR_RETURN(const TensorInfo* q, Find(name + names::kPackedSuffix));
    K3_ASSIGN_OR_RETURN(const TensorInfo* s, Find(name + names::kScaleSuffix));
    const auto* scale = reinterpret_cast<const uint8_t*>(s->data);
    host_codes_.resize(Mxfp4CodeBytes(rows, cols));
    host_scales_.resize(Mxfp4ScaleBytes(rows, cols));
    Mxfp4ToFragments(reinterpret_cast<const uint8_t*>(q->data), scale, rows, cols, host_codes_.data(),
                     host_scales_.data());
    K3_CUDA_OK(cudaMemcpy(codes, host_codes_.data(), host_codes_.size(), cudaMemcpyHostToDevice));
    K3_CUDA_OK(cudaMemcpy(scales, host_scales_.data(), host_scales_.size(), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }

 private:
  std::vector<uint8_t> host_codes_, host_scales_;  // one matrix in fragment order, reused
  absl::StatusOr<const TensorInfo*> Find(const std::string& hub_name) {
    const std::string name = names::InLayout(hub_name, layout_);
    const TensorInfo* t = ck_.Find(name);
    if (t == nullptr) return absl::NotFoundError(absl::StrCat(ck_.dir(), ": missing tensor \"", name, "\""));
    return t;
  }
  const Checkpoint& ck_;
  const ModelConfig& c_;
  const names::Layout layout_;
};

// Random weights drawn on the device by tensor role, as k3serve-mkmodel draws them (projections with variance
// 1/fan_in, norm weights near 1, A_log / dt_bias in the trained range, a small router bias).
class RandomSource : public TensorSource {
 public:
  RandomSource(const ModelConfig& c, uint64_t seed) : c_(c), seed_(seed) {
    for (TensorSpec& t : ExpectedTensors(c)) specs_.emplace(t.name, std::move(t));
  }
  absl::Status Bf16(const std::string& name, bf16* dst) override { return Fill(name, nullptr, dst); }
  absl::Status F32(const std::string& name, float* dst) override { return Fill(name, dst, nullptr); }
  // Uniform codes (E2M1 values of root mean square 2.93) under one scale band: weights of about the 1/√fan_in
  // standard deviation that the float projections get.
  absl::Status Mxfp4(const std::string& name, int64_t rows, int64_t cols, uint8_t* codes, uint8_t* scales) override {
    const uint64_t seed = seed_ ^ std::hash<std::string>{}(name);
    const int s = 127 + static_cast<int>(std::lround(std::log2(1.0 / (2.93 * std::sqrt(double(cols))))));
    K3_CUDA_OK(FillRandomBytes(Mxfp4CodeBytes(rows, cols), 0, 255, seed, codes, nullptr));
    K3_CUDA_OK(FillRandomBytes(Mxfp4ScaleBytes(rows, cols), static_cast<uint8_t>(s - 1), static_cast<uint8_t>(s),
                               seed ^ 1, scales, nullptr));
    return absl::OkStatus();
  }

 private:
  absl::Status Fill(const std::string& name, float* f32, bf16* b16) {
    const auto it = specs_.find(name);
    if (it == specs_.end()) return absl::NotFoundError(absl::StrCat("no tensor \"", name, "\" in this config"));
    const TensorSpec& t = it->second;
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    const float fan_in = static_cast<float>(t.shape.back());
    RandomKind kind = RandomKind::kNormal;
    float a = 0.0f, b = 1.0f;
    switch (t.role) {
      case TensorRole::kEmbedding: break;
      case TensorRole::kLinear: b = 1.0f / std::sqrt(fan_in); break;
      case TensorRole::kNorm: kind = RandomKind::kUniform, a = 0.9f, b = 1.1f; break;
      case TensorRole::kConv: kind = RandomKind::kUniform, b = 1.0f / std::sqrt(fan_in), a = -b; break;
      case TensorRole::kALog: kind = RandomKind::kLogU, a = 1.0f, b = 16.0f; break;
      case TensorRole::kDtBias:
        if (c_.kda_gate_bounded) {
          kind = RandomKind::kUniform, a = -2.0f, b = 0.0f;
        } else {
          kind = RandomKind::kDtBias, a = std::log(1e-3f), b = std::log(0.1f);
        }
        break;
      case TensorRole::kRouterBias: kind = RandomKind::kUniform, a = -0.1f, b = 0.1f; break;
      case TensorRole::kAttnResQuery: b = 0.25f / std::sqrt(fan_in); break;
      case TensorRole::kMxfp4Packed:
      case TensorRole::kMxfp4Scale:
        return absl::InternalError(absl::StrCat("\"", name, "\" is half of an MXFP4 matrix (TensorSource::Mxfp4)"));
    }
    K3_CUDA_OK(FillRandom(n, kind, a, b, seed_ ^ std::hash<std::string>{}(name), f32, b16, nullptr));
    return absl::OkStatus();
  }
  const ModelConfig& c_;
  uint64_t seed_;
  std::map<std::string, TensorSpec> specs_;
};

}  // namespace

absl::Status CudaModel::Impl::Upload(TensorSource& up) {
  namespace n = names;
  const int64_t d = c.hidden_size, V = c.vocab_size, L = c.num_layers;
  const int64_t start = allocated;
  int64_t routed = 0;             // bytes of routed experts (and their pointer arrays)
  int64_t derived = 0;            // bytes of weights copied into another layout (KdaW::fg)
  RoutedExperts shared_experts;   // the first MoE layer's (share_routed_experts)
  struct Staging {                // one routed expert's W1 and W3 on their way to the packed layout
    bf16* p = nullptr;
    ~Staging() { cudaFree(p); }
  } staging;
  auto bf = [&](int64_t count) { return Alloc<bf16>(count); };
  auto f32 = [&](int64_t count) { return Alloc<float>(count); };
  auto layer = [](int64_t l, const char* s) { return n::Layer(l, s); };

  K3_ASSIGN_OR_RETURN(embed, bf(V * d));
  K3_RETURN_IF_ERROR(up.Bf16(n::kEmbed, embed));
  embed_bytes = V * d * 2;
  if (c.tie_word_embeddings) {
    lm_head = embed;
    embed_bytes = 0;  // read whole by the LM head
  } else {
    K3_ASSIGN_OR_RETURN(lm_head, bf(V * d));
    K3_RETURN_IF_ERROR(up.Bf16(n::kLmHead, lm_head));
  }
  K3_ASSIGN_OR_RETURN(final_norm, f32(d));
  K3_RETURN_IF_ERROR(up.F32(n::kFinalNorm, final_norm));
  if (c.attn_res_block > 0) {
    K3_ASSIGN_OR_RETURN(out_res_w, f32(d));
    K3_ASSIGN_OR_RETURN(out_res_n, f32(d));
    K3_RETURN_IF_ERROR(up.F32(n::kOutResProj, out_res_w));
    K3_RETURN_IF_ERROR(up.F32(n::kOutResNorm, out_res_n));
  }

  layers.assign(L, LayerW{});
  for (int64_t l = 0; l < L; ++l) {
    LayerW& w = layers[l];
    K3_ASSIGN_OR_RETURN(w.input_norm, f32(d));
    K3_ASSIGN_OR_RETURN(w.post_norm, f32(d));
    K3_RETURN_IF_ERROR(up.F32(layer(l, n::kInputNorm), w.input_norm));
    K3_RETURN_IF_ERROR(up.F32(layer(l, n::kPostNorm), w.post_norm));
    if (c.attn_res_block > 0) {
      for (auto [dst, name] : {std::pair{&w.attn_res_w, n::kAttnResProj}, std::pair{&w.attn_res_n, n::kAttnResNorm},
                               std::pair{&w.mlp_res_w, n::kMlpResProj}, std::pair{&w.mlp_res_n, n::kMlpResNorm}}) {
        K3_ASSIGN_OR_RETURN(*dst, f32(d));
        K3_RETURN_IF_ERROR(up.F32(layer(l, name), *dst));
      }
    }

    if (c.mixer[l] == Mixer::kKda) {
      KdaW& k = w.kda;
      const int64_t H = c.kda_heads, D = c.kda_head_dim, HD = H * D, K = c.conv_kernel;
      const bool b_in = D == 64 || D == 128;
      k.in_rows = 3 * HD + D + (c.kda_full_rank_gate ? 0 : D) + (b_in ? H : 0);
      K3_ASSIGN_OR_RETURN(k.in, bf(k.in_rows * d));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaQ), k.in));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaK), k.in + HD * d));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaV), k.in + 2 * HD * d));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaFA), k.in + 3 * HD * d));
      K3_ASSIGN_OR_RETURN(k.f_b, bf(HD * D));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaFB), k.f_b));
      if (c.kda_full_rank_gate) {
        K3_ASSIGN_OR_RETURN(k.g, bf(HD * d));
        K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaG), k.g));
      } else {
        K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaGA), k.in + (3 * HD + D) * d));
        K3_ASSIGN_OR_RETURN(k.g_b, bf(HD * D));
        K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaGB), k.g_b));
      }
      if (b_in && !c.kda_full_rank_gate) {
        const int64_t before = allocated;
        K3_ASSIGN_OR_RETURN(k.fg, bf(2 * HD * 2 * D));
        K3_CUDA_OK(cudaMemset(k.fg, 0, 2 * HD * 2 * D * sizeof(bf16)));
        K3_CUDA_OK(cudaMemcpy2D(k.fg, 2 * D * sizeof(bf16), k.f_b, D * sizeof(bf16), D * sizeof(bf16), HD,
                                cudaMemcpyDeviceToDevice));
        K3_CUDA_OK(cudaMemcpy2D(k.fg + HD * 2 * D + D, 2 * D * sizeof(bf16), k.g_b, D * sizeof(bf16), D * sizeof(bf16),
                                HD, cudaMemcpyDeviceToDevice));
        derived += allocated - before;
      }
      if (b_in) {
        K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaB), k.in + (k.in_rows - H) * d));
      } else {
        K3_ASSIGN_OR_RETURN(k.b, bf(H * d));
        K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaB), k.b));
      }
      K3_ASSIGN_OR_RETURN(k.o, bf(d * HD));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kKdaO), k.o));
      K3_ASSIGN_OR_RETURN(k.conv, f32(3 * HD * K));
      K3_RETURN_IF_ERROR(up.F32(layer(l, n::kKdaQConv), k.conv));
      K3_RETURN_IF_ERROR(up.F32(layer(l, n::kKdaKConv), k.conv + HD * K));
      K3_RETURN_IF_ERROR(up.F32(layer(l, n::kKdaVConv), k.conv + 2 * HD * K));
      K3_ASSIGN_OR_RETURN(k.A_log, f32(H));
      K3_ASSIGN_OR_RETURN(k.dt_bias, f32(HD));
      K3_ASSIGN_OR_RETURN(k.o_norm, f32(D));
      K3_RETURN_IF_ERROR(up.F32(layer(l, n::kKdaALog), k.A_log));
      K3_RETURN_IF_ERROR(up.F32(layer(l, n::kKdaDtBias), k.dt_bias));
      K3_RETURN_IF_ERROR(up.F32(layer(l, n::kKdaONorm), k.o_norm));
    } else {
      MlaW& a = w.mla;
      const MlaDims s{c.mla_heads, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim, c.kv_lora_rank};
      const int64_t q_rows = c.q_lora_rank > 0 ? c.q_lora_rank : s.nh * s.dqk();
      a.in_rows = q_rows + s.cw();
      K3_ASSIGN_OR_RETURN(a.in, bf(a.in_rows * d));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, c.q_lora_rank > 0 ? n::kMlaQA : n::kMlaQ), a.in));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kMlaKvA), a.in + q_rows * d));
      if (c.q_lora_rank > 0) {
        K3_ASSIGN_OR_RETURN(a.q_b, bf(s.nh * s.dqk() * c.q_lora_rank));
        K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kMlaQB), a.q_b));
        K3_ASSIGN_OR_RETURN(a.q_a_norm, f32(c.q_lora_rank));
        K3_RETURN_IF_ERROR(up.F32(layer(l, n::kMlaQANorm), a.q_a_norm));
      }
      K3_ASSIGN_OR_RETURN(a.kv_a_norm, f32(s.r));
      K3_RETURN_IF_ERROR(up.F32(layer(l, n::kMlaKvANorm), a.kv_a_norm));
      K3_ASSIGN_OR_RETURN(a.kv_b, bf(s.nh * s.dkv() * s.r));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kMlaKvB), a.kv_b));
      K3_ASSIGN_OR_RETURN(a.ukt, bf(s.nh * s.r * s.dn));
      K3_CUDA_OK(MlaTransposeUk(s, a.kv_b, a.ukt, nullptr));
      K3_ASSIGN_OR_RETURN(a.o, bf(d * s.nh * s.dv));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kMlaO), a.o));
      if (c.mla_output_gate) {
        K3_ASSIGN_OR_RETURN(a.g, bf(s.nh * s.dv * d));
        K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kMlaG), a.g));
      }
    }

    auto glu = [&](GluW& g, int64_t I, const std::string& gate, const std::string& upn,
                   const std::string& down) -> absl::Status {
      g.I = I;
      K3_ASSIGN_OR_RETURN(g.gate_up, bf(2 * I * d));
      K3_ASSIGN_OR_RETURN(g.down, bf(d * I));
      K3_RETURN_IF_ERROR(up.Bf16(gate, g.gate_up));
      K3_RETURN_IF_ERROR(up.Bf16(upn, g.gate_up + I * d));
      K3_RETURN_IF_ERROR(up.Bf16(down, g.down));
      return absl::OkStatus();
    };
    if (c.mlp[l] == Mlp::kDense) {
      K3_RETURN_IF_ERROR(glu(w.dense, c.intermediate_size, layer(l, n::kDenseGate), layer(l, n::kDenseUp),
                             layer(l, n::kDenseDown)));
      continue;
    }
    MoeW& e = w.moe;
    const int64_t E = c.num_experts, I = c.moe_intermediate_size, X = c.expert_width();
    K3_ASSIGN_OR_RETURN(e.router, bf(E * d));
    K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kRouter), e.router));
    K3_ASSIGN_OR_RETURN(e.bias, f32(E));
    K3_RETURN_IF_ERROR(up.F32(layer(l, n::kRouterBias), e.bias));
    if (c.num_shared_experts > 0)
      K3_RETURN_IF_ERROR(glu(e.shared, I * c.num_shared_experts, layer(l, n::kSharedGate), layer(l, n::kSharedUp),
                             layer(l, n::kSharedDown)));
    if (c.latent_dim > 0) {
      K3_ASSIGN_OR_RETURN(e.latent_down, bf(X * d));
      K3_ASSIGN_OR_RETURN(e.latent_up, bf(d * X));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kLatentDown), e.latent_down));
      K3_RETURN_IF_ERROR(up.Bf16(layer(l, n::kLatentUp), e.latent_up));
      if (c.latent_norm) {
        K3_ASSIGN_OR_RETURN(e.latent_norm, f32(X));
        K3_RETURN_IF_ERROR(up.F32(layer(l, n::kLatentNorm), e.latent_norm));
      }
    }
    const bool mx = c.expert_format == ExpertFormat::kMxfp4;
    const int64_t mx13 = Mxfp4CodeBytes(I, X) + Mxfp4ScaleBytes(I, X), mx2 = Mxfp4CodeBytes(X, I) + Mxfp4ScaleBytes(X, I);
    expert_bytes = mx ? 2 * mx13 + mx2 : 3 * I * X * 2;
    if (!opt.routed_experts) continue;
    if (opt.share_routed_experts && (shared_experts.gate_up || shared_experts.q1)) {
      e.experts = shared_experts;
      continue;
    }
    if (mx) {
      // Each expert's W1, W3, W2 as codes then scales, 4.25 bits a weight, as the kernels stream them.
      const int64_t before = allocated;
      K3_ASSIGN_OR_RETURN(uint8_t * bytes, Alloc<uint8_t>(E * expert_bytes));
      std::vector<const uint8_t*> ptrs(6 * E);  // q1, s1, q3, s3, q2, s2: E each
      for (int64_t x = 0; x < E; ++x) {
        uint8_t* p = bytes + x * expert_bytes;
        const std::pair<const char*, std::pair<int64_t, int64_t>> mats[3] = {
            {n::kExpertW1, {I, X}}, {n::kExpertW3, {I, X}}, {n::kExpertW2, {X, I}}};
        for (int j = 0; j < 3; ++j) {
          const auto [rows, cols] = mats[j].second;
          uint8_t *q = p, *sc = p + Mxfp4CodeBytes(rows, cols);
          K3_RETURN_IF_ERROR(up.Mxfp4(n::Expert(l, x, mats[j].first), rows, cols, q, sc));
          ptrs[(2 * j) * E + x] = q, ptrs[(2 * j + 1) * E + x] = sc;
          p = sc + Mxfp4ScaleBytes(rows, cols);
        }
      }
      K3_ASSIGN_OR_RETURN(const uint8_t** dp, Alloc<const uint8_t*>(6 * E));
      K3_CUDA_OK(cudaMemcpy(dp, ptrs.data(), 6 * E * sizeof(uint8_t*), cudaMemcpyHostToDevice));
      e.experts.q1 = dp, e.experts.s1 = dp + E, e.experts.q3 = dp + 2 * E, e.experts.s3 = dp + 3 * E;
      e.experts.q2 = dp + 4 * E, e.experts.s2 = dp + 5 * E;
      shared_experts = e.experts;
      routed += allocated - before;
      continue;
    }
    // W1 and W3 of each expert through a staging buffer into the tiled gate/up kernel's packed layout
    // (MoePackGateUp: a weight tile one contiguous read; in decode traces the gate/up took 15–27 µs less a step).
    const int64_t before = allocated, gate_up = MoePackedGateUpElems(X, I);
    if (!staging.p) K3_CUDA_OK(cudaMalloc(&staging.p, 2 * I * X * sizeof(bf16)));
    bf16* const plain = staging.p;
    K3_ASSIGN_OR_RETURN(bf16 * w13, bf(E * gate_up));
    K3_ASSIGN_OR_RETURN(bf16 * w2, bf(E * X * I));
    std::vector<const bf16*> ptrs(2 * E);  // packed W1 and W3 of each expert, then W2
    for (int64_t x = 0; x < E; ++x) {
      ptrs[x] = w13 + x * gate_up, ptrs[E + x] = w2 + x * X * I;
      K3_RETURN_IF_ERROR(up.Bf16(n::Expert(l, x, n::kExpertW1), plain));
      K3_RETURN_IF_ERROR(up.Bf16(n::Expert(l, x, n::kExpertW3), plain + I * X));
      K3_RETURN_IF_ERROR(up.Bf16(n::Expert(l, x, n::kExpertW2), w2 + x * X * I));
      // On the legacy stream, as the uploads: the next expert's upload waits for it.
      K3_CUDA_OK(MoePackGateUp(plain, plain + I * X, X, I, w13 + x * gate_up, nullptr));
    }
    K3_ASSIGN_OR_RETURN(const bf16** dp, Alloc<const bf16*>(2 * E));
    K3_CUDA_OK(cudaMemcpy(dp, ptrs.data(), 2 * E * sizeof(bf16*), cudaMemcpyHostToDevice));
    e.experts = RoutedExperts{dp, dp + E};
    shared_experts = e.experts;
    routed += allocated - before;
  }
  weight_bytes = allocated - start - routed - derived;  // everything but the routed experts and derived copies
  K3_CUDA_OK(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::AllocState() {
  const int64_t S = opt.max_seqs, L = c.num_layers;
  kda_state.assign(L, nullptr);
  conv_state.assign(L, nullptr);
  mla_cache.assign(L, nullptr);
  for (int64_t l = 0; l < L; ++l) {
    if (c.mixer[l] == Mixer::kKda) {
      const int64_t H = c.kda_heads, D = c.kda_head_dim;
      K3_ASSIGN_OR_RETURN(kda_state[l], Alloc<float>(S * H * D * D));
      K3_ASSIGN_OR_RETURN(conv_state[l], Alloc<float>(S * (c.conv_kernel - 1) * c.kda_conv_channels()));
    } else {
      K3_ASSIGN_OR_RETURN(mla_cache[l], Alloc<bf16>(S * opt.max_context * c.mla_cache_width()));
    }
  }
  positions.assign(S, 0);
  in_use.assign(S, false);
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::AllocWork() {
  const int64_t d = c.hidden_size, N = cap = opt.max_batch_tokens, L = c.num_layers;
  const int64_t HD = c.kda_heads * c.kda_head_dim, ov = c.mla_heads * c.v_head_dim;
  win_cols = 0, hidden_cols = 0;
  for (const LayerW& w : layers) {
    win_cols = std::max({win_cols, w.kda.in_rows, w.mla.in_rows});
    hidden_cols = std::max({hidden_cols, w.dense.I, w.moe.shared.I});
  }
  wide_cols = std::max<int64_t>({HD, ov, 1});
  K3_ASSIGN_OR_RETURN(x, Alloc<float>(N * d));
  if (c.attn_res_block > 0) {
    K3_ASSIGN_OR_RETURN(hread, Alloc<float>(N * d));
    K3_ASSIGN_OR_RETURN(bank, Alloc<float>((L + c.attn_res_block - 1) / c.attn_res_block * N * d));
  }
  K3_ASSIGN_OR_RETURN(a, AllocSplit(N, d));
  K3_ASSIGN_OR_RETURN(m, AllocSplit(N, d));
  K3_ASSIGN_OR_RETURN(fn, Alloc<bf16>(N * d));
  // Rows on 16 bytes: the products that read column slices of win (f_a, g_a) need them, and with b's H rows
  // the KDA projection's width need not be a multiple of 8.
  K3_ASSIGN_OR_RETURN(win, AllocSplit(N, (std::max<int64_t>(win_cols, 8) + 7) / 8 * 8));
  K3_ASSIGN_OR_RETURN(onorm, AllocSplit(N, wide_cols));
  K3_ASSIGN_OR_RETURN(hid, AllocSplit(N, std::max<int64_t>(hidden_cols, 8)));
  K3_ASSIGN_OR_RETURN(gate, Alloc<float>(N * wide_cols));
  for (void** p : {&graw, &qc, &kc, &vc, &obuf}) {
    K3_ASSIGN_OR_RETURN(float* f, Alloc<float>(N * std::max<int64_t>(HD, 1)));
    *p = f;
  }
  K3_ASSIGN_OR_RETURN(float* bb, Alloc<float>(N * std::max<int64_t>(c.kda_heads, 1)));
  bbuf = bb;
  if (c.has_layer_kind(Mixer::kMla)) {
    const MlaDims s{c.mla_heads, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim, c.kv_lora_rank};
    if (c.q_lora_rank > 0) {
      K3_ASSIGN_OR_RETURN(qbuf, AllocSplit(N, s.nh * s.dqk()));
      K3_ASSIGN_OR_RETURN(qan, AllocSplit(N, c.q_lora_rank));
    }
    K3_ASSIGN_OR_RETURN(char* ws, Alloc<char>(MlaDecodeWorkspaceBytes(s, std::min(opt.max_seqs, N))));
    mla_decode_ws = ws;
  }
  if (c.num_experts > 0) {
    const int64_t E = c.num_experts, k = c.top_k, X = c.expert_width();
    K3_ASSIGN_OR_RETURN(rlogits, Alloc<float>(N * E));
    K3_ASSIGN_OR_RETURN(idx, Alloc<int32_t>(N * k));
    K3_ASSIGN_OR_RETURN(wts, Alloc<float>(N * k));
    K3_ASSIGN_OR_RETURN(moe_out, Alloc<float>(N * X));
    if (c.latent_dim > 0) {
      K3_ASSIGN_OR_RETURN(z, AllocSplit(N, X));
      K3_ASSIGN_OR_RETURN(zn, AllocSplit(N, X));
    }
    if (c.expert_format == ExpertFormat::kMxfp4) {
      K3_CUDA_OK(local_experts.mx_workspace.Reserve(N * k, X, c.moe_intermediate_size, E));
    } else {
      K3_CUDA_OK(local_experts.workspace.Reserve(N * k, X, c.moe_intermediate_size, E));
    }
    local_experts.max_rows = N;
  }
  // The dense products: a workspace for chunks of up to 256 rows of the widest one, and for MLA's per-head products
  // of every decode token (W_UK's, the larger), one batch of the heads.
  int64_t widest = std::max({2 * hidden_cols, win_cols, c.num_experts, HD, ov, d});
  int64_t deepest = std::max({d, HD, ov, hidden_cols, c.expert_width(), c.q_lora_rank});
  size_t blas_bytes = LinearBlas::WorkspaceBytes(std::min<int64_t>(N, 256), widest, deepest);
  if (c.has_layer_kind(Mixer::kMla))
    blas_bytes = std::max(blas_bytes, LinearBlas::WorkspaceBytes(std::min(N, opt.max_seqs), c.kv_lora_rank,
                                                                 c.qk_nope_dim, c.mla_heads));
  K3_CUDA_OK(blas.Init(blas_bytes));
  // The side stream's products: the KDA gates (f_b and g_b as one, [2·H·D, 2·D]; b or the full-rank g) and the
  // shared experts.
  K3_CUDA_OK(blas_side.Init(LinearBlas::WorkspaceBytes(std::min<int64_t>(N, 256),
                                                       std::max({2 * hidden_cols, 2 * HD, d}),
                                                       std::max({d, hidden_cols, 2 * c.kda_head_dim}))));
  bool any_shared = false;
  for (const LayerW& w : layers) any_shared = any_shared || w.moe.shared.gate_up;
  if (any_shared) {
    K3_ASSIGN_OR_RETURN(shared_out, Alloc<float>(N * d));
  }
  K3_ASSIGN_OR_RETURN(hits, Alloc<int32_t>(L));
  K3_CUDA_OK(cudaMemset(hits, 0, L * sizeof(int32_t)));
  K3_ASSIGN_OR_RETURN(ids, Alloc<int32_t>(N));
  K3_ASSIGN_OR_RETURN(argmax_keys, Alloc<uint64_t>(N));
  K3_CUDA_OK(cudaMemset(argmax_keys, 0, N * sizeof(uint64_t)));  // then cleared by each ArgmaxIds that reads them
  // Metadata: 4 per token, 3 per chunk, cu_seqlens, logit rows, has_initial_state bytes.
  meta_cap = 4 * N + 3 * N + (N + 1) + N + N / 4 + 1;
  K3_ASSIGN_OR_RETURN(meta, Alloc<int32_t>(meta_cap));
  K3_CUDA_OK(cudaMallocHost(&meta_host, meta_cap * sizeof(int32_t)));
  K3_CUDA_OK(cudaMallocHost(&ids_host, std::max<int64_t>(opt.max_seqs, 1) * sizeof(int32_t)));
  local_experts.config = &c;
  local_experts.layers = &layers;
  local_experts.hits = hits;
  experts = &local_experts;
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------------------------- forward

absl::Status CudaModel::Impl::GluUp(const GluW& g, Split in, int64_t N, On on) {
  LinearArgs la = Args(g.gate_up, 2 * g.I, c.hidden_size, in, N, hid.p, hid.ld, LinearOut::kSplit, hid.lo);
  la.glu = true, la.act = Act(c), la.situ_beta = c.situ_beta, la.situ_linear_beta = c.situ_linear_beta;
  K3_CUDA_OK(Blas(la, on));
  return absl::OkStatus();
}

// m[0..] = per-forward device metadata: tok_id, tok_slot, tok_pos, tok_start, ch_start, ch_len, ch_slot, cu, rows.
enum Meta { kTokId, kTokSlot, kTokPos, kTokStart, kChStart, kChLen, kChSlot, kCu, kRows, kHasInit, kMetaCount };

absl::Status CudaModel::Impl::Inputs(int64_t N, const int32_t* tok_id) {
  const int64_t d = c.hidden_size;
  K3_CUDA_OK(Embed(N, d, tok_id, embed, x, stream));
  if (Defer())
    K3_CUDA_OK(AddRmsNorm(N, d, x, d, Sums{}, Sums{}, nullptr, layers[0].input_norm, c.rms_norm_eps, a, stream));
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::Kda(int64_t l, int64_t N, int64_t nd, int64_t num_chunks,
                                  const std::vector<int32_t>& cu_host, const int32_t* const* md) {
  const KdaW& w = layers[l].kda;
  const int64_t d = c.hidden_size, H = c.kda_heads, D = c.kda_head_dim, HD = H * D, np = num_chunks - nd;
  const bool tuned = D == 64 || D == 128;  // else KdaSmall (D ≤ 32), fp32 in and out
  const LinearOut raw = tuned ? LinearOut::kBf16 : LinearOut::kF32;
  std::optional<Phase> phase(std::in_place, *this, "kda.proj");
  // The input product. The conv reads its q, k, v columns unfolded (KdaConvArgs::x_sums, rounded as the fold would
  // store them); the rest (f_a, g_a, b: the gates' and beta's inputs) is folded into win on the side stream, ahead
  // of the gate products. Rows that need chunks take the folded path.
  const LinearArgs in = Args(w.in, w.in_rows, d, a, N, win.p, win.ld, LinearOut::kSplit, win.lo);
  const bool conv_reads_sums = blas.Unfoldable(in);
  Sums in_sums;
  if (conv_reads_sums) {
    K3_CUDA_OK(blas.RunUnfolded(in, stream, &in_sums));
  } else {
    K3_CUDA_OK(Blas(in));
  }
  // The gate products on the side stream, beside the conv. With KdaW::fg, one product gives every row's
  // [g_raw | gate] sums, read unfolded by the decode and the gated norm; the prefill's rows read g_raw from f_b's
  // own product (bf16), run first (both use the side LinearBlas's C). So each row is computed one way whatever
  // else is in its batch. Without fg, the decay (and beta) products are joined before the core and the output
  // gate's after it, before the gated norm.
  const LinearArgs fga = Args(w.fg, 2 * HD, 2 * D, win.Cols(3 * HD), N, nullptr, 0, LinearOut::kF32);
  const bool fused_gates = w.fg && blas_side.Unfoldable(fga);
  Sums gates;
  K3_CUDA_OK(Fork());
  if (conv_reads_sums) {
    LinearArgs tail;  // the fold's output: columns 3·HD.. of win
    tail.N = w.in_rows - 3 * HD, tail.M = N, tail.out = LinearOut::kSplit;
    tail.y = win.p + 3 * HD, tail.ldy = win.ld, tail.y_lo = win.lo;
    K3_CUDA_OK(LinearBlas::Fold(tail, in_sums.Cols(3 * HD), side));
  }
  if (!fused_gates || np > 0) K3_CUDA_OK(Lin(w.f_b, HD, D, win.Cols(3 * HD), N, graw, HD, raw, 0, On::kSide));
  if (w.b) K3_CUDA_OK(Lin(w.b, H, d, a, N, bbuf, H, raw, 0, On::kSide));
  if (fused_gates) K3_CUDA_OK(blas_side.RunUnfolded(fga, side, &gates));

  phase.emplace(*this, "kda.conv");
  KdaConvArgs ca;
  ca.N = N, ca.C = 3 * HD, ca.K = c.conv_kernel, ca.x = win, ca.w = w.conv, ca.state = conv_state[l];
  if (conv_reads_sums) ca.x_sums = in_sums;
  ca.tok_start = md[kTokStart], ca.tok_slot = md[kTokSlot];
  ca.out[0] = qc, ca.out[1] = kc, ca.out[2] = vc, ca.out_bf16 = tuned, ca.decode_tokens = nd;
  K3_CUDA_OK(KdaConv(ca, stream));  // also advances the decode tokens' states: the chunks after them remain
  K3_CUDA_OK(KdaConvUpdateState(ca, np, md[kChStart] + nd, md[kChLen] + nd, md[kChSlot] + nd, stream));
  K3_CUDA_OK(Join());
  if (c.kda_full_rank_gate) {
    K3_CUDA_OK(Lin(w.g, HD, d, a, N, gate, HD, LinearOut::kF32, 0, On::kSide));
  } else if (!fused_gates) {
    K3_CUDA_OK(Lin(w.g_b, HD, D, win.Cols(3 * HD + D), N, gate, HD, LinearOut::kF32, 0, On::kSide));
  }

  const KdaGate gk = c.kda_gate_bounded ? KdaGate::kBounded : KdaGate::kSoftplus;
  phase.emplace(*this, "kda.core");
  if (tuned) {
    auto at = [&](void* p, int64_t row, int64_t width) { return static_cast<bf16*>(p) + row * width; };
    KdaArgs ka;
    ka.H = H, ka.D = D, ka.gate = gk, ka.lower_bound = c.kda_gate_lower_bound;
    ka.A_log = w.A_log, ka.dt_bias = w.dt_bias, ka.state = kda_state[l];
    ka.q = at(qc, 0, HD), ka.k = at(kc, 0, HD), ka.v = at(vc, 0, HD);
    if (fused_gates) {
      ka.g_sums = gates;
    } else {
      ka.g_raw = at(graw, 0, HD);
    }
    ka.b = win.p + (w.in_rows - H), ka.ldb = win.ld;  // the hi plane: bf16(x · W_b), the product's bf16 output
    ka.o = at(obuf, 0, HD), ka.state_idx = md[kTokSlot];
    if (nd > 0) K3_CUDA_OK(KdaDecode(ka, nd, stream));
    if (np > 0) {
      KdaArgs kp = ka;
      kp.q = at(qc, nd, HD), kp.k = at(kc, nd, HD), kp.v = at(vc, nd, HD), kp.g_raw = at(graw, nd, HD), kp.g_sums = {};
      kp.b = ka.b + nd * win.ld, kp.o = at(obuf, nd, HD), kp.state_idx = md[kChSlot] + nd;
      KdaPrefillBatch batch;
      batch.num_seqs = np, batch.cu_seqlens = md[kCu];
      batch.has_initial_state = reinterpret_cast<const uint8_t*>(md[kHasInit]);
      batch.num_chunks = KdaNumChunks(cu_host.data(), np);
      K3_RETURN_IF_ERROR(Grow(&scratch, &scratch_bytes, KdaPrefillWorkspaceBytes(batch.num_chunks, H, D)));
      batch.workspace = scratch;
      K3_CUDA_OK(KdaPrefill(kp, batch, stream));
    }
    phase.emplace(*this, "kda.out");
    if (fused_gates) {
      K3_CUDA_OK(GatedRmsNorm(N * H, D, static_cast<const bf16*>(obuf), gates.Cols(HD), H, w.o_norm, c.rms_norm_eps,
                              Split{onorm.p, D, onorm.lo}, stream));
    } else {
      K3_CUDA_OK(Join());
      K3_CUDA_OK(GatedRmsNorm(N * H, D, static_cast<const bf16*>(obuf), gate, w.o_norm, c.rms_norm_eps,
                              Split{onorm.p, D, onorm.lo}, stream));
    }
  } else {
    KdaSmallArgs ks;
    ks.H = H, ks.D = D, ks.gate = gk, ks.lower_bound = c.kda_gate_lower_bound;
    ks.q = static_cast<float*>(qc), ks.k = static_cast<float*>(kc), ks.v = static_cast<float*>(vc);
    ks.g_raw = static_cast<float*>(graw), ks.b = static_cast<float*>(bbuf);
    ks.A_log = w.A_log, ks.dt_bias = w.dt_bias, ks.state = kda_state[l], ks.o = static_cast<float*>(obuf);
    ks.num_chunks = num_chunks, ks.ch_start = md[kChStart], ks.ch_len = md[kChLen], ks.ch_slot = md[kChSlot];
    K3_CUDA_OK(KdaSmall(ks, stream));
    phase.emplace(*this, "kda.out");
    K3_CUDA_OK(Join());
    K3_CUDA_OK(GatedRmsNorm(N * H, D, static_cast<const float*>(obuf), gate, w.o_norm, c.rms_norm_eps,
                            Split{onorm.p, D, onorm.lo}, stream));
  }
  return AddProduct(w.o, d, HD, Split{onorm.p, HD, onorm.lo}, N);
}

absl::Status CudaModel::Impl::Mla(int64_t l, int64_t N, int64_t nd, const std::vector<int64_t>& pre_start,
                                  const std::vector<int64_t>& pre_len, const std::vector<int64_t>& pre_pos,
                                  const std::vector<int32_t>& pre_slot, const int32_t* const* md) {
  const MlaW& w = layers[l].mla;
  const MlaDims s{c.mla_heads, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim, c.kv_lora_rank};
  const int64_t d = c.hidden_size, ov = s.nh * s.dv, max_ctx = opt.max_context;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.dqk()));
  std::optional<Phase> phase(std::in_place, *this, "mla.proj");
  const Split o{onorm.p, ov, onorm.lo};
  // A decode-only batch without the query's low rank: the decode reads the input product's sums, the fold, the
  // cache append and the query's split in one pass (the same bits as the path below).
  const LinearArgs in = Args(w.in, w.in_rows, d, a, N, win.p, win.ld, LinearOut::kSplit, win.lo);
  if (nd == N && c.q_lora_rank == 0 && MlaDecodeSupported(s) && blas.Unfoldable(in)) {
    Sums in_sums;
    K3_CUDA_OK(blas.RunUnfolded(in, stream, &in_sums));
    phase.emplace(*this, "mla.attn");
    K3_CUDA_OK(MlaDecodeSums(nd, s, in_sums, w.kv_a_norm, kLoraNormEps, mla_cache[l], max_ctx, md[kTokSlot],
                             md[kTokPos], w.kv_b, w.ukt, scale, o, mla_decode_ws, blas, stream));
    return MlaOut(w, N, o);
  }
  K3_CUDA_OK(Blas(in));
  Split q = win, latent = win.Cols(s.nh * s.dqk());
  if (c.q_lora_rank > 0) {
    K3_CUDA_OK(RmsNorm(N, c.q_lora_rank, win, w.q_a_norm, kLoraNormEps, qan, stream));
    K3_CUDA_OK(LinSplit(w.q_b, s.nh * s.dqk(), c.q_lora_rank, qan, N, qbuf));
    q = qbuf, latent = win.Cols(c.q_lora_rank);
  }
  phase.emplace(*this, "mla.attn");
  K3_CUDA_OK(MlaCacheAppend(N, s, latent, w.kv_a_norm, kLoraNormEps, md[kTokSlot], md[kTokPos], mla_cache[l], max_ctx,
                            stream));
  if (nd > 0)
    K3_CUDA_OK(MlaDecode(nd, s, q, mla_cache[l], max_ctx, md[kTokSlot], md[kTokPos], w.kv_b, w.ukt, scale, o,
                         mla_decode_ws, blas, stream));
  for (size_t i = 0; i < pre_start.size(); ++i) {
    const int64_t T = pre_len[i], P = pre_pos[i], Tq = std::min(T, kMlaQueryTile);
    K3_RETURN_IF_ERROR(Grow(&scratch, &scratch_bytes, MlaPrefillWorkspaceBytes(s, P + T, Tq)));
    K3_CUDA_OK(MlaPrefill(s, T, P, q.Rows(pre_start[i]), mla_cache[l] + pre_slot[i] * max_ctx * s.cw(), w.kv_b, scale,
                          o.Rows(pre_start[i]), Tq, scratch, stream));
  }
  return MlaOut(w, N, o);
}

// The MLA layer's output: the gate (K3), then the product into the residual.
absl::Status CudaModel::Impl::MlaOut(const MlaW& w, int64_t N, Split o) {
  const int64_t d = c.hidden_size, ov = c.mla_heads * c.v_head_dim;
  Phase phase(*this, "mla.out");
  if (w.g) {
    K3_CUDA_OK(Lin(w.g, ov, d, a, N, gate, ov, LinearOut::kF32));
    K3_CUDA_OK(MulSigmoid(N, ov, o, gate, stream));
  }
  return AddProduct(w.o, d, ov, o, N);
}

absl::Status CudaModel::Impl::Moe(int64_t l, int64_t N, bool decode) {
  const MoeW& w = layers[l].moe;
  const int64_t d = c.hidden_size, E = c.num_experts, k = c.top_k, X = c.expert_width();
  if (experts == &local_experts && !opt.routed_experts)
    return absl::FailedPreconditionError("the routed experts are not loaded here and no expert executor is set");
  // Front: router, top-k, latent down-projection.
  std::optional<Phase> phase(std::in_place, *this, "moe.router");
  // Rows of 1024 or more in two K slices, which the top-k adds as it reads them (no split-K reduce kernel); shorter
  // ones whole (nothing to gain). Fixed rather than timed: alone, 3 or 4 slices time as fast, but in the step they
  // are slower (the top-k reads every slice; kimi-linear-e2e on an H200, six rounds: 2.300-2.304 ms a step with 2,
  // 2.304-2.308 whole, 2.312-2.332 with 3 or 4), and the timed count flipped from one process to the next, and the
  // routing's rounding with it.
  const int64_t router_parts = d >= 1024 && LinearBlas::PartsFit(d, 2) ? 2 : 1;
  K3_ASSIGN_OR_RETURN(const Sums logits, Product(w.router, E, d, m, N, rlogits, On::kMain, router_parts));
  RouterArgs ra;
  ra.N = N, ra.num_experts = E, ra.top_k = k, ra.num_groups = c.num_expert_group, ra.topk_groups = c.topk_group;
  ra.renormalize = c.moe_renormalize, ra.scale = c.routed_scaling_factor;
  ra.logits = logits, ra.bias = w.bias, ra.idx = idx, ra.w = wts;
  K3_CUDA_OK(RouteTopK(ra, stream));
  // The shared experts read m too: on the side stream, beside the routed experts; added after them (their down
  // product's sums, unfolded when x's adds are deferred). Forked here rather than from the norm: in a graph, the
  // branch a fork puts on another stream starts 5–7 µs late, which the router's chain would pay.
  Sums shared;
  if (w.shared.gate_up) {
    K3_CUDA_OK(Fork());
    K3_RETURN_IF_ERROR(GluUp(w.shared, m, N, On::kSide));
    if (Defer()) {
      K3_ASSIGN_OR_RETURN(shared, Product(w.shared.down, d, w.shared.I, hid, N, shared_out, On::kSide));
    } else {
      K3_CUDA_OK(Lin(w.shared.down, d, w.shared.I, hid, N, shared_out, d, LinearOut::kF32, 0, On::kSide));
      shared = Sums{shared_out, d, 0};
    }
  }
  Split rows = m;
  if (w.latent_down) {
    K3_CUDA_OK(LinSplit(w.latent_down, X, d, m, N, z));
    rows = z;
  }
  // The routed experts, wherever they are.
  phase.emplace(*this, "moe.experts");
  K3_RETURN_IF_ERROR(experts->Run(CudaExpertRequest{l, N, X, k, rows, idx, wts, decode}, moe_out, stream));
  // Back: latent norm + up-projection (or the plain sum), shared experts.
  phase.emplace(*this, "moe.back");
  if (w.latent_up) {
    if (w.latent_norm) {
      K3_CUDA_OK(RmsNorm(N, X, moe_out, X, nullptr, w.latent_norm, c.rms_norm_eps, zn, stream));
    } else {
      K3_CUDA_OK(ToSplit(N, X, moe_out, X, zn, stream));
    }
    K3_RETURN_IF_ERROR(AddProduct(w.latent_up, d, X, zn, N));
  }
  if (w.shared.gate_up) K3_CUDA_OK(Join());
  // x += routed (unless the up-projection added it), then += shared: the sums the shared product's own kF32Add
  // made after the routed add.
  if (Defer()) {
    if (!w.latent_up) K3_RETURN_IF_ERROR(Pend(Sums{moe_out, d, 0}));
    if (shared.p) K3_RETURN_IF_ERROR(Pend(shared));
  } else if (!w.latent_up) {
    K3_CUDA_OK(AddInto2(N * d, moe_out, shared.p, x, stream));
  } else if (shared.p) {
    K3_CUDA_OK(AddInto(N * d, shared.p, x, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaModel::Impl::Run(std::span<const GpuChunk> chunks, bool keep_logits, int64_t* out_rows) {
  const int64_t d = c.hidden_size, V = c.vocab_size, L = c.num_layers;
  // Checks, and the internal order: decode tokens (one-token chunks) first, then the longer chunks.
  int64_t N = 0;
  std::set<int32_t> seen;
  std::vector<size_t> order;
  for (int pass = 0; pass < 2; ++pass)
    for (size_t i = 0; i < chunks.size(); ++i)
      if ((chunks[i].tokens.size() == 1) == (pass == 0)) order.push_back(i);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const GpuChunk& ch = chunks[i];
    if (ch.slot < 0 || ch.slot >= opt.max_seqs || !in_use[ch.slot])
      return absl::InvalidArgumentError(absl::StrCat("chunk ", i, ": slot ", ch.slot, " is not allocated"));
    if (!seen.insert(ch.slot).second)
      return absl::InvalidArgumentError(absl::StrCat("chunk ", i, ": slot ", ch.slot, " appears twice in the batch"));
    if (ch.tokens.empty()) return absl::InvalidArgumentError(absl::StrCat("chunk ", i, " has no tokens"));
    for (int32_t t : ch.tokens)
      if (t < 0 || t >= V)
        return absl::InvalidArgumentError(absl::StrCat("token id ", t, " outside the vocabulary [0, ", V, ")"));
    if (positions[ch.slot] + static_cast<int64_t>(ch.tokens.size()) > opt.max_context)
      return absl::ResourceExhaustedError(absl::StrCat("chunk ", i, ": slot ", ch.slot, " would exceed max_context ",
                                                       opt.max_context));
    N += static_cast<int64_t>(ch.tokens.size());
  }
  if (N > cap)
    return absl::InvalidArgumentError(absl::StrCat("batch of ", N, " tokens exceeds max_batch_tokens ", cap));
  chain = Chain{};  // set again below when this is a batch NextGreedy can continue
  *out_rows = 0;
  if (N == 0) return absl::OkStatus();

  // Metadata, in the internal order.
  const int64_t C = static_cast<int64_t>(chunks.size());
  std::vector<int32_t> cols[kMetaCount];
  std::vector<int64_t> row_of(C);  // internal start row of chunk i (original index)
  std::vector<int64_t> pre_start, pre_len, pre_pos;
  std::vector<int32_t> pre_slot, cu_host = {0};
  std::vector<uint8_t> has_init;
  int64_t nd = 0, row = 0;
  for (size_t i : order) {
    const GpuChunk& ch = chunks[i];
    const int64_t T = static_cast<int64_t>(ch.tokens.size()), P = positions[ch.slot];
    row_of[i] = row;
    for (int64_t t = 0; t < T; ++t) {
      cols[kTokId].push_back(ch.tokens[t]);
      cols[kTokSlot].push_back(ch.slot);
      cols[kTokPos].push_back(static_cast<int32_t>(P + t));
      cols[kTokStart].push_back(static_cast<int32_t>(row));
    }
    cols[kChStart].push_back(static_cast<int32_t>(row));
    cols[kChLen].push_back(static_cast<int32_t>(T));
    cols[kChSlot].push_back(ch.slot);
    if (T == 1) {
      ++nd;
    } else {
      pre_start.push_back(row), pre_len.push_back(T), pre_pos.push_back(P), pre_slot.push_back(ch.slot);
      cu_host.push_back(static_cast<int32_t>(cu_host.back() + T));
      has_init.push_back(P > 0);
    }
    row += T;
  }
  cols[kCu] = cu_host;
  for (int64_t i = 0; i < C; ++i) {
    const GpuChunk& ch = chunks[i];
    const int64_t T = static_cast<int64_t>(ch.tokens.size());
    if (ch.logits == LogitsMode::kAll) {
      for (int64_t t = 0; t < T; ++t) cols[kRows].push_back(static_cast<int32_t>(row_of[i] + t));
    } else if (ch.logits == LogitsMode::kLast) {
      cols[kRows].push_back(static_cast<int32_t>(row_of[i] + T - 1));
    }
  }
  cols[kHasInit].resize((has_init.size() + 3) / 4);
  std::memcpy(cols[kHasInit].data(), has_init.data(), has_init.size());
  const int32_t* md[kMetaCount];
  int64_t used = 0;
  for (int k = 0; k < kMetaCount; ++k) {
    std::memcpy(meta_host + used, cols[k].data(), cols[k].size() * sizeof(int32_t));
    md[k] = meta + used;
    used += static_cast<int64_t>(cols[k].size());
  }
  K3_CUDA_OK(cudaMemcpyAsync(meta, meta_host, used * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  const int64_t R = static_cast<int64_t>(cols[kRows].size());
  // The split planes of this batch sit back to back (lo = rows · ld): a product's [hi; lo] operand is then
  // one 2N-row matrix, used by cuBLAS in place.
  for (Split* sp : {&a, &m, &win, &onorm, &hid, &z, &zn, &qbuf, &qan})
    if (sp->p) sp->lo = N * sp->ld;

  if (R > logits_rows) {
    K3_CUDA_OK(cudaStreamSynchronize(stream));
    for (auto& [shape, exec] : graphs) cudaGraphExecDestroy(exec);  // they write the old logits
    graphs.clear();
    if (logits) {
      allocations.erase(std::find(allocations.begin(), allocations.end(), logits));
      K3_CUDA_OK(cudaFree(logits));
      logits = nullptr;
    }
    const int64_t rows = std::max(R, opt.max_seqs);
    K3_ASSIGN_OR_RETURN(logits, Alloc<float>(rows * V));
    logits_rows = rows;
  }

  // The layers (DESIGN §1.1; Block AttnRes §1.5: x is then the partial sum of the current block).
  // The tokens are embedded before the layers are enqueued, so outside a decode graph (NextGreedy embeds its own
  // before the replay): measured side by side on one H200, 2.350/2.351/2.355 -> 2.336/2.340/2.346 ms a step (and
  // 2.409/2.419/2.407 -> 2.383/2.393/2.384 on another).
  {
    Phase p(*this, "embed");
    K3_RETURN_IF_ERROR(Inputs(N, md[kTokId]));
  }
  auto enqueue = [&]() -> absl::Status {
    const bool attn_res = c.attn_res_block > 0;
    pending[0] = pending[1] = Sums{};  // a failed forward may have left some
    int64_t banked = 0;
    // out = RMSNorm(h; w) for M rows (rows: which; null: all N) of what the layer reads: x with its pending adds,
    // or Block AttnRes's read of the bank and x.
    auto norm = [&](const float* res_w, const float* res_n, const float* w, int64_t M, const int32_t* rows,
                    Split out) -> absl::Status {
      if (Defer()) {
        K3_CUDA_OK(AddRmsNorm(M, d, x, d, pending[0], pending[1], rows, w, c.rms_norm_eps, out, stream));
        pending[0] = pending[1] = Sums{};
        return absl::OkStatus();
      }
      K3_CUDA_OK(AttnResRead(N, d, bank, cap * d, banked, x, res_w, res_n, c.rms_norm_eps, hread, stream));
      K3_CUDA_OK(RmsNorm(M, d, hread, d, rows, w, c.rms_norm_eps, out, stream));
      return absl::OkStatus();
    };
    for (int64_t l = 0; l < L; ++l) {
      const LayerW& w = layers[l];
      std::optional<Phase> phase(std::in_place, *this, "norm");
      if (l > 0 || !Defer()) K3_RETURN_IF_ERROR(norm(w.attn_res_w, w.attn_res_n, w.input_norm, N, nullptr, a));
      if (attn_res && l % c.attn_res_block == 0) {  // the partial sum closes a block
        K3_CUDA_OK(
            cudaMemcpyAsync(bank + banked * cap * d, x, N * d * sizeof(float), cudaMemcpyDeviceToDevice, stream));
        K3_CUDA_OK(cudaMemsetAsync(x, 0, N * d * sizeof(float), stream));
        ++banked;
      }
      phase.reset();
      if (c.mixer[l] == Mixer::kKda) {
        K3_RETURN_IF_ERROR(Kda(l, N, nd, C, cu_host, md));
      } else {
        K3_RETURN_IF_ERROR(Mla(l, N, nd, pre_start, pre_len, pre_pos, pre_slot, md));
      }
      phase.emplace(*this, "norm");
      K3_RETURN_IF_ERROR(norm(w.mlp_res_w, w.mlp_res_n, w.post_norm, N, nullptr, m));
      phase.reset();
      if (c.mlp[l] == Mlp::kDense) {
        Phase p(*this, "dense");
        K3_RETURN_IF_ERROR(GluUp(w.dense, m, N, On::kMain));
        K3_RETURN_IF_ERROR(AddProduct(w.dense.down, d, w.dense.I, hid, N));
      } else {
        K3_RETURN_IF_ERROR(Moe(l, N, nd == N));
      }
    }
    Phase head(*this, "lm_head");
    if (R > 0) {
      // The head reads plain bf16 rows (lm_head.cuh): the norm writes no lo plane. Each row's greedy pick is folded
      // on the way; the logits are stored only when kept (greedy decoding would write and never read 42 MB at a
      // batch of 64). The keys are zero here (ArgmaxIds clears them), so the head follows the norm directly (PDL).
      K3_RETURN_IF_ERROR(norm(out_res_w, out_res_n, final_norm, R, md[kRows], Split{fn, d, 0}));
      LmHeadArgs la;
      la.V = V, la.K = d, la.w = lm_head, la.x = Split{fn, d, 0}, la.M = R;
      la.logits = keep_logits ? logits : nullptr, la.ldl = V, la.argmax_keys = argmax_keys;
      K3_CUDA_OK(LmHead(la, stream));
      K3_CUDA_OK(ArgmaxIds(R, argmax_keys, ids, stream));
    }
    return absl::OkStatus();
  };

  // A decode-only batch replays a CUDA graph of its shape: one launch instead of ~20 per layer. The shapes of
  // everything it enqueues depend on (N, R) alone; positions, slots and lengths are read on the device from
  // the metadata uploaded above. Not while profiling, nor with remote experts (their bridge waits on the host).
  if (opt.cuda_graphs && nd == C && !profile && experts == &local_experts) {
    auto it = graphs.find({N, R, keep_logits});
    if (it == graphs.end()) {
      K3_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const absl::Status st = enqueue();
      cudaGraph_t graph = nullptr;
      const cudaError_t end = cudaStreamEndCapture(stream, &graph);
      K3_RETURN_IF_ERROR(st);
      K3_CUDA_OK(end);
      cudaGraphExec_t exec = nullptr;
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      K3_CUDA_OK(inst);
      it = graphs.emplace(std::make_tuple(N, R, keep_logits), exec).first;
    }
    K3_CUDA_OK(cudaGraphLaunch(it->second, stream));
    if (!keep_logits && R == N) {
      chain.exec = it->second;
      chain.tok_id = const_cast<int32_t*>(md[kTokId]), chain.tok_pos = const_cast<int32_t*>(md[kTokPos]);  // in meta
      for (const GpuChunk& ch : chunks) chain.slots.push_back(ch.slot);
    }
  } else {
    K3_RETURN_IF_ERROR(enqueue());
  }
  for (const GpuChunk& ch : chunks) positions[ch.slot] += static_cast<int64_t>(ch.tokens.size());
  *out_rows = R;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------- CudaModel

CudaModel::CudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaModel::~CudaModel() = default;

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const ModelConfig& config, TensorSource& source,
                                                            const CudaModelOptions& options) {
  if (options.max_seqs <= 0 || options.max_context <= 0 || options.max_batch_tokens <= 0)
    return absl::InvalidArgumentError("CudaModelOptions: max_seqs, max_context and max_batch_tokens must be positive");
  if (config.has_layer_kind(Mixer::kKda)) {
    const int64_t D = config.kda_head_dim;
    if (D != 64 && D != 128 && D > kKdaSmallMaxD)
      return absl::UnimplementedError(absl::StrCat("KDA head_dim ", D, " (the GPU path takes 64, 128 or ≤ 32)"));
  }
  if (config.has_layer_kind(Mixer::kMla)) {
    const MlaDims s{config.mla_heads, config.qk_nope_dim, config.qk_rope_dim, config.v_head_dim, config.kv_lora_rank};
    if (!MlaDecodeSupported(s) || s.dn % 16 != 0 || s.dqk() % 16 != 0)
      return absl::UnimplementedError(absl::StrCat(
          "MLA kv_lora_rank ", s.r, ", qk_nope_head_dim ", s.dn, ", qk_rope_head_dim ", s.dr,
          " (the GPU path takes multiples of 16 for kv_lora_rank ≤ 512, qk_nope_head_dim and their sum with "
          "qk_rope_head_dim, and kv_lora_rank + qk_rope_head_dim ≤ 576)"));
  }
  if (config.has_layer_kind(Mixer::kKda) && config.conv_kernel > kKdaConvMaxK)
    return absl::UnimplementedError(
        absl::StrCat("short_conv_kernel_size ", config.conv_kernel, " (the GPU conv takes ≤ ", kKdaConvMaxK, ")"));
  if (config.num_experts > 1024)
    return absl::UnimplementedError(
        absl::StrCat("num_experts ", config.num_experts, " (the GPU router takes ≤ 1024)"));
  auto impl = std::make_unique<Impl>();
  impl->c = config;
  impl->opt = options;
  K3_CUDA_OK(cudaSetDevice(options.device));
  K3_CUDA_OK(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  K3_CUDA_OK(cudaStreamCreateWithFlags(&impl->side, cudaStreamNonBlocking));
  K3_CUDA_OK(cudaEventCreateWithFlags(&impl->fork_event, cudaEventDisableTiming));
  K3_CUDA_OK(cudaEventCreateWithFlags(&impl->join_event, cudaEventDisableTiming));
  K3_CUDA_OK(cudaStreamCreateWithFlags(&impl->copy, cudaStreamNonBlocking));
  K3_CUDA_OK(cudaEventCreateWithFlags(&impl->fed, cudaEventDisableTiming));
  K3_CUDA_OK(cudaEventCreateWithFlags(&impl->copied, cudaEventDisableTiming));
  K3_RETURN_IF_ERROR(impl->Upload(source));
  K3_RETURN_IF_ERROR(impl->AllocState());
  K3_RETURN_IF_ERROR(impl->AllocWork());
  return std::unique_ptr<CudaModel>(new CudaModel(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Load(const std::string& dir, const CudaModelOptions& options) {
  K3_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  K3_ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::Open(dir));
  auto shared = std::make_shared<const Checkpoint>(std::move(ck));
  // Names, shapes and dtypes of every tensor, nothing converted on the host; MXFP4 experts are loaded too (as
  // views into the mapping), so that the loader's checks of their codes and scales (U8, shapes, no 0xFF) run.
  WeightFilter check;
  check.non_expert = false;
  const bool mx = config.expert_format == ExpertFormat::kMxfp4;
  check.expert = [mx](int64_t, int64_t) { return mx; };
  K3_RETURN_IF_ERROR(LoadWeights(config, shared, check).status());
  CheckpointSource source(*shared, config);
  return Create(config, source, options);
}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::CreateRandom(const ModelConfig& config, uint64_t seed,
                                                                  const CudaModelOptions& options) {
  RandomSource source(config, seed);
  return Create(config, source, options);
}

const ModelConfig& CudaModel::config() const { return impl_->c; }
const CudaModelOptions& CudaModel::options() const { return impl_->opt; }

absl::StatusOr<int32_t> CudaModel::AllocSlot() {
  Impl& m = *impl_;
  const auto it = std::find(m.in_use.begin(), m.in_use.end(), false);
  if (it == m.in_use.end())
    return absl::ResourceExhaustedError(absl::StrCat("all ", m.opt.max_seqs, " sequence slots are in use"));
  const int32_t slot = static_cast<int32_t>(it - m.in_use.begin());
  const ModelConfig& c = m.c;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.mixer[l] != Mixer::kKda) continue;
    const int64_t S = c.kda_heads * c.kda_head_dim * c.kda_head_dim, Cv = (c.conv_kernel - 1) * c.kda_conv_channels();
    K3_CUDA_OK(cudaMemsetAsync(m.kda_state[l] + slot * S, 0, S * sizeof(float), m.stream));
    K3_CUDA_OK(cudaMemsetAsync(m.conv_state[l] + slot * Cv, 0, Cv * sizeof(float), m.stream));
  }
  m.in_use[slot] = true;
  m.positions[slot] = 0;
  return slot;
}

absl::Status CudaModel::FreeSlot(int32_t slot) {
  if (slot < 0 || slot >= impl_->opt.max_seqs || !impl_->in_use[slot])
    return absl::NotFoundError(absl::StrCat("slot ", slot, " is not allocated"));
  impl_->in_use[slot] = false;
  impl_->chain = Impl::Chain{};
  return absl::OkStatus();
}

int64_t CudaModel::position(int32_t slot) const {
  return slot >= 0 && slot < impl_->opt.max_seqs ? impl_->positions[slot] : 0;
}

absl::Status CudaModel::Forward(std::span<const GpuChunk> chunks, std::vector<float>* logits) {
  Impl& m = *impl_;
  int64_t R = 0;
  K3_RETURN_IF_ERROR(m.Run(chunks, true, &R));
  logits->resize(R * m.c.vocab_size);
  if (R > 0)
    K3_CUDA_OK(cudaMemcpyAsync(logits->data(), m.logits, R * m.c.vocab_size * sizeof(float), cudaMemcpyDeviceToHost,
                               m.stream));
  K3_CUDA_OK(cudaStreamSynchronize(m.stream));
  m.Harvest();
  return absl::OkStatus();
}

absl::Status CudaModel::ForwardGreedy(std::span<const GpuChunk> chunks, std::vector<int32_t>* ids) {
  Impl& m = *impl_;
  int64_t R = 0;
  K3_RETURN_IF_ERROR(m.Run(chunks, false, &R));
  ids->resize(R);
  if (R > 0)
    K3_CUDA_OK(cudaMemcpyAsync(ids->data(), m.ids, R * sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream));
  K3_CUDA_OK(cudaStreamSynchronize(m.stream));
  m.Harvest();
  return absl::OkStatus();
}

absl::Status CudaModel::NextGreedy(std::vector<int32_t>* prev_ids) {
  Impl& m = *impl_;
  Impl::Chain& ch = m.chain;
  if (!ch.exec || m.profile || m.experts != &m.local_experts)
    return absl::FailedPreconditionError(
        "NextGreedy continues a ForwardGreedy of a decode-only batch (one token a sequence, its row kept, CUDA "
        "graphs on, in-process experts, not profiling); there is none to continue");
  for (int32_t slot : ch.slots)
    if (m.positions[slot] + 1 > m.opt.max_context)
      return absl::ResourceExhaustedError(absl::StrCat("slot ", slot, " would exceed max_context ", m.opt.max_context));
  const int64_t n = static_cast<int64_t>(ch.slots.size());
  // The inputs from the last step's ids, their copy to the host beside the step that reads them.
  K3_CUDA_OK(FeedGreedyIds(n, m.ids, ch.tok_id, ch.tok_pos, m.stream));
  K3_RETURN_IF_ERROR(m.Inputs(n, ch.tok_id));
  K3_CUDA_OK(cudaEventRecord(m.fed, m.stream));
  K3_CUDA_OK(cudaStreamWaitEvent(m.copy, m.fed));
  K3_CUDA_OK(cudaMemcpyAsync(m.ids_host, ch.tok_id, n * sizeof(int32_t), cudaMemcpyDeviceToHost, m.copy));
  K3_CUDA_OK(cudaEventRecord(m.copied, m.copy));
  K3_CUDA_OK(cudaGraphLaunch(ch.exec, m.stream));
  for (int32_t slot : ch.slots) ++m.positions[slot];
  // Before returning, so that the next call's feed may overwrite what was copied.
  K3_CUDA_OK(cudaEventSynchronize(m.copied));
  prev_ids->assign(m.ids_host, m.ids_host + n);
  return absl::OkStatus();
}

absl::Status CudaModel::LastGreedy(std::vector<int32_t>* ids) {
  Impl& m = *impl_;
  if (!m.chain.exec) return absl::FailedPreconditionError("LastGreedy: no decode-only greedy batch to read");
  const int64_t n = static_cast<int64_t>(m.chain.slots.size());
  ids->resize(n);
  K3_CUDA_OK(cudaMemcpyAsync(ids->data(), m.ids, n * sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream));
  K3_CUDA_OK(cudaStreamSynchronize(m.stream));
  return absl::OkStatus();
}

void CudaModel::SetProfiling(bool on) { impl_->profile = on; }

std::vector<std::pair<std::string, double>> CudaModel::TakeProfile() {
  std::vector<std::pair<std::string, double>> out(impl_->profile_ms.begin(), impl_->profile_ms.end());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  impl_->profile_ms.clear();
  return out;
}

void CudaModel::SetExpertExecutor(CudaExpertExecutor* experts) {
  impl_->experts = experts ? experts : &impl_->local_experts;
}

CudaExpertExecutor* CudaModel::local_experts() { return impl_->opt.routed_experts ? &impl_->local_experts : nullptr; }

int64_t CudaModel::weight_bytes() const {
  const Impl& m = *impl_;
  int64_t experts = 0;
  for (int64_t l = 0; l < m.c.num_layers; ++l)
    if (m.c.mlp[l] == Mlp::kMoe) experts += m.c.num_experts * m.expert_bytes;
  return m.weight_bytes + experts;
}

int64_t CudaModel::expert_bytes() const { return impl_->expert_bytes; }

absl::StatusOr<int64_t> CudaModel::LastForwardWeightBytes() const {
  const Impl& m = *impl_;
  std::vector<int32_t> hits(m.c.num_layers);
  K3_CUDA_OK(cudaMemcpy(hits.data(), m.hits, hits.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  int64_t bytes = m.weight_bytes - m.embed_bytes;
  for (int64_t l = 0; l < m.c.num_layers; ++l)
    if (m.c.mlp[l] == Mlp::kMoe) bytes += hits[l] * m.expert_bytes;
  return bytes;
}

}  // namespace k3::cuda

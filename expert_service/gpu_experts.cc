#include "expert_service/gpu_experts.h"

#include <cstring>

#include "common/bf16.h"
#include "engine/cuda/cuda_status.h"
#include "engine/tensor_names.h"
#include "engine/weights.h"
#include "kernels/cuda/moe.cuh"
#include "kernels/cuda/mxfp4.cuh"

namespace k3 {

struct GpuExperts::Impl {
  ModelConfig c;
  cudaStream_t stream = nullptr;
  std::vector<void*> allocations;
  // Per layer: device tables of E pointers (null where the slot is not held here).
  std::vector<const __nv_bfloat16**> w1, w3, w2;
  std::vector<std::vector<bool>> held;
  cuda::MoeWorkspace ws;
  // MXFP4 experts (the release's): codes and scales in the kernels' fragment order, per layer tables.
  bool mxfp4 = false;
  std::vector<const uint8_t**> q1, q3, q2, s1, s3, s2;
  cuda::Mxfp4Workspace mx_ws;
  // Staging, grown on demand.
  __nv_bfloat16 *x = nullptr, *out = nullptr;
  int32_t* idx = nullptr;
  float* w = nullptr;
  int64_t cap_rows = 0;
  std::vector<uint16_t> host_bf16;

  ~Impl() {
    for (void* p : allocations) cudaFree(p);
    cudaFree(x), cudaFree(out), cudaFree(idx), cudaFree(w);
    if (stream) cudaStreamDestroy(stream);
  }
  absl::StatusOr<void*> Alloc(size_t bytes) {
    void* p = nullptr;
    K3_CUDA_OK(cudaMalloc(&p, bytes));
    allocations.push_back(p);
    return p;
  }
  absl::Status Grow(int64_t rows) {
    if (rows <= cap_rows) return absl::OkStatus();
    const int64_t X = c.expert_width(), k = c.top_k;
    cudaFree(x), cudaFree(out), cudaFree(idx), cudaFree(w);
    K3_CUDA_OK(cudaMalloc(&x, rows * X * 2));
    K3_CUDA_OK(cudaMalloc(&out, rows * X * 2));
    K3_CUDA_OK(cudaMalloc(&idx, rows * k * sizeof(int32_t)));
    K3_CUDA_OK(cudaMalloc(&w, rows * k * sizeof(float)));
    cap_rows = rows;
    return absl::OkStatus();
  }
};

GpuExperts::GpuExperts(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuExperts::~GpuExperts() = default;

absl::StatusOr<std::unique_ptr<GpuExperts>> GpuExperts::Load(const ModelConfig& c, const Checkpoint& ck,
                                                             const std::set<std::pair<int32_t, int32_t>>& slots,
                                                             int device) {
  K3_CUDA_OK(cudaSetDevice(device));
  auto m = std::make_unique<Impl>();
  m->c = c;
  K3_CUDA_OK(cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking));
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, X = c.expert_width();
  if (c.expert_format == ExpertFormat::kMxfp4) return LoadMxfp4(std::move(m), ck, slots);
  if (X % 8 != 0 || I % 8 != 0)
    return absl::InvalidArgumentError(absl::StrCat("GPU experts need widths that are multiples of 8 (expert width ", X,
                                                   ", intermediate ", I, ")"));
  m->w1.assign(c.num_layers, nullptr);
  m->w3.assign(c.num_layers, nullptr);
  m->w2.assign(c.num_layers, nullptr);
  m->held.assign(c.num_layers, std::vector<bool>(E, false));
  std::vector<uint16_t> h;
  // One tensor → a new device block in bf16.
  auto upload = [&](const std::string& name, int64_t numel) -> absl::StatusOr<const __nv_bfloat16*> {
    const TensorInfo* t = ck.Find(name);
    if (t == nullptr) return absl::NotFoundError(absl::StrCat(ck.dir(), ": missing tensor \"", name, "\""));
    if (t->numel() != numel) return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" has ", t->numel(), " values"));
    h.resize(numel);
    if (t->dtype == DType::kBF16) {
      std::memcpy(h.data(), t->data, numel * 2);
    } else if (t->dtype == DType::kF32) {
      for (int64_t i = 0; i < numel; ++i) {
        float f;
        std::memcpy(&f, t->data + 4 * i, 4);
        h[i] = FloatToBf16(f);
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": only F32 and BF16 are supported"));
    }
    K3_ASSIGN_OR_RETURN(void* p, m->Alloc(numel * 2));
    K3_CUDA_OK(cudaMemcpy(p, h.data(), numel * 2, cudaMemcpyHostToDevice));
    return static_cast<const __nv_bfloat16*>(p);
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.mlp[l] != Mlp::kMoe) continue;
    std::vector<const __nv_bfloat16*> t1(E, nullptr), t3(E, nullptr), t2(E, nullptr);
    for (int64_t e = 0; e < E; ++e) {
      if (!slots.count({static_cast<int32_t>(l), static_cast<int32_t>(e)})) continue;
      const names::Layout layout = CheckpointLayout(ck);
      K3_ASSIGN_OR_RETURN(t1[e], upload(names::InLayout(names::Expert(l, e, names::kExpertW1), layout), I * X));
      K3_ASSIGN_OR_RETURN(t3[e], upload(names::InLayout(names::Expert(l, e, names::kExpertW3), layout), I * X));
      K3_ASSIGN_OR_RETURN(t2[e], upload(names::InLayout(names::Expert(l, e, names::kExpertW2), layout), X * I));
      m->held[l][e] = true;
    }
    for (auto [table, host] : {std::pair{&m->w1[l], &t1}, {&m->w3[l], &t3}, {&m->w2[l], &t2}}) {
      K3_ASSIGN_OR_RETURN(void* p, m->Alloc(E * sizeof(void*)));
      K3_CUDA_OK(cudaMemcpy(p, host->data(), E * sizeof(void*), cudaMemcpyHostToDevice));
      *table = static_cast<const __nv_bfloat16**>(p);
    }
  }
  return std::unique_ptr<GpuExperts>(new GpuExperts(std::move(m)));
}

absl::StatusOr<std::unique_ptr<GpuExperts>> GpuExperts::LoadMxfp4(std::unique_ptr<Impl> m, const Checkpoint& ck,
                                                                  const std::set<std::pair<int32_t, int32_t>>& slots) {
  const ModelConfig& c = m->c;
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, X = c.expert_width();
  m->mxfp4 = true;
  for (auto* t : {&m->q1, &m->q3, &m->q2, &m->s1, &m->s3, &m->s2}) t->assign(c.num_layers, nullptr);
  m->held.assign(c.num_layers, std::vector<bool>(E, false));
  // The loader's own checks (names, U8, shapes, no 0xFF scale) on exactly these slots; the packed views
  // it returns point into the mapping.
  const std::shared_ptr<const Checkpoint> borrowed(&ck, [](const Checkpoint*) {});  // used only here
  K3_ASSIGN_OR_RETURN(auto views, LoadWeights(c, borrowed, WeightFilter::ExpertsOnly([&](int64_t l, int64_t e) {
                                                return slots.count({static_cast<int32_t>(l), static_cast<int32_t>(e)}) > 0;
                                              })));
  std::vector<uint8_t> codes, scales;
  auto upload = [&](const cpu::Mxfp4Matrix& w, int64_t rows, int64_t cols, const uint8_t** q,
                    const uint8_t** s) -> absl::Status {
    codes.resize(cuda::Mxfp4CodeBytes(rows, cols));
    scales.resize(cuda::Mxfp4ScaleBytes(rows, cols));
    cuda::Mxfp4ToFragments(w.packed, w.scale, rows, cols, codes.data(), scales.data());
    K3_ASSIGN_OR_RETURN(void* dq, m->Alloc(codes.size()));
    K3_ASSIGN_OR_RETURN(void* ds, m->Alloc(scales.size()));
    K3_CUDA_OK(cudaMemcpy(dq, codes.data(), codes.size(), cudaMemcpyHostToDevice));
    K3_CUDA_OK(cudaMemcpy(ds, scales.data(), scales.size(), cudaMemcpyHostToDevice));
    *q = static_cast<const uint8_t*>(dq), *s = static_cast<const uint8_t*>(ds);
    return absl::OkStatus();
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.mlp[l] != Mlp::kMoe) continue;
    std::vector<const uint8_t*> t[6];
    for (auto& v : t) v.assign(E, nullptr);
    for (int64_t e = 0; e < E; ++e) {
      if (!slots.count({static_cast<int32_t>(l), static_cast<int32_t>(e)})) continue;
      const cpu::ExpertWeights& w = views->layers[l].moe.experts[e];
      K3_RETURN_IF_ERROR(upload(w.w1.mxfp4, I, X, &t[0][e], &t[3][e]));
      K3_RETURN_IF_ERROR(upload(w.w3.mxfp4, I, X, &t[1][e], &t[4][e]));
      K3_RETURN_IF_ERROR(upload(w.w2.mxfp4, X, I, &t[2][e], &t[5][e]));
      m->held[l][e] = true;
    }
    std::vector<const uint8_t**>* tables[6] = {&m->q1, &m->q3, &m->q2, &m->s1, &m->s3, &m->s2};
    for (int i = 0; i < 6; ++i) {
      K3_ASSIGN_OR_RETURN(void* p, m->Alloc(E * sizeof(void*)));
      K3_CUDA_OK(cudaMemcpy(p, t[i].data(), E * sizeof(void*), cudaMemcpyHostToDevice));
      (*tables[i])[l] = static_cast<const uint8_t**>(p);
    }
  }
  return std::unique_ptr<GpuExperts>(new GpuExperts(std::move(m)));
}

absl::Status GpuExperts::Run(const ExpertRequest& r, float* out) {
  Impl& m = *impl_;
  const ModelConfig& c = m.c;
  if (r.layer < 0 || r.layer >= c.num_layers || c.mlp[r.layer] != Mlp::kMoe)
    return absl::InvalidArgumentError(absl::StrCat("layer ", r.layer, " has no routed experts"));
  if (r.width != c.expert_width() || r.top_k != c.top_k)
    return absl::InvalidArgumentError(absl::StrCat("expert request shape (width ", r.width, ", k ", r.top_k,
                                                   ") does not match the model"));
  for (int64_t i = 0; i < r.rows * r.top_k; ++i)
    if (r.idx[i] >= c.num_experts || (r.idx[i] >= 0 && !m.held[r.layer][r.idx[i]]))
      return absl::FailedPreconditionError(absl::StrCat("expert ", r.idx[i], " of layer ", r.layer, " is not loaded here"));
  if (r.rows == 0) return absl::OkStatus();
  const int64_t n = r.rows * r.width, nk = r.rows * r.top_k;
  K3_RETURN_IF_ERROR(m.Grow(r.rows));
  m.host_bf16.resize(n);
  for (int64_t i = 0; i < n; ++i) m.host_bf16[i] = FloatToBf16(r.x[i]);
  K3_CUDA_OK(cudaMemcpyAsync(m.x, m.host_bf16.data(), n * 2, cudaMemcpyHostToDevice, m.stream));
  K3_CUDA_OK(cudaMemcpyAsync(m.idx, r.idx, nk * sizeof(int32_t), cudaMemcpyHostToDevice, m.stream));
  K3_CUDA_OK(cudaMemcpyAsync(m.w, r.w, nk * sizeof(float), cudaMemcpyHostToDevice, m.stream));
  if (m.mxfp4) {
    // Rows come as plain bf16: from kMxfp4WgmmaMinPairsPerExpert pairs per expert, the grouped wgmma experts.
    K3_CUDA_OK(m.mx_ws.Reserve(nk, r.width, c.moe_intermediate_size, c.num_experts, false, true));
    cuda::Mxfp4ExpertsArgs a;
    a.N = r.rows, a.D = r.width, a.I = c.moe_intermediate_size, a.top_k = r.top_k, a.num_experts = c.num_experts;
    a.x = m.x, a.idx = m.idx, a.w = m.w;
    a.w1 = m.q1[r.layer], a.s1 = m.s1[r.layer], a.w3 = m.q3[r.layer], a.s3 = m.s3[r.layer];
    a.w2 = m.q2[r.layer], a.s2 = m.s2[r.layer];
    a.act = c.act == Activation::kSitu ? cuda::GluAct::kSitu : cuda::GluAct::kSilu;
    a.situ_beta = c.situ_beta, a.situ_linear_beta = c.situ_linear_beta;
    a.out = m.out;
    K3_CUDA_OK(cuda::Mxfp4Experts(a, m.mx_ws, m.stream));
  } else {
    K3_CUDA_OK(m.ws.Reserve(nk, r.width, c.moe_intermediate_size, c.num_experts));
    cuda::MoeExpertsArgs a;
    a.N = r.rows;
    a.D = r.width;
    a.I = c.moe_intermediate_size;
    a.top_k = r.top_k;
    a.num_experts = c.num_experts;
    a.x = m.x;
    a.idx = m.idx;
    a.w = m.w;
    a.w1 = m.w1[r.layer];
    a.w3 = m.w3[r.layer];
    a.w2 = m.w2[r.layer];
    a.act = c.act == Activation::kSitu ? cuda::GluAct::kSitu : cuda::GluAct::kSilu;
    a.situ_beta = c.situ_beta;
    a.situ_linear_beta = c.situ_linear_beta;
    a.out = m.out;
    K3_CUDA_OK(cuda::MoeExperts(a, cuda::MoeGemm::kAuto, m.ws, m.stream));
  }
  K3_CUDA_OK(cudaMemcpyAsync(m.host_bf16.data(), m.out, n * 2, cudaMemcpyDeviceToHost, m.stream));
  K3_CUDA_OK(cudaStreamSynchronize(m.stream));
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(m.host_bf16[i]);
  return absl::OkStatus();
}

}  // namespace k3

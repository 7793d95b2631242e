// Chunked Kimi Delta Attention (DESIGN §1.2), the prefill form of KdaRecurrent.
//
// Per head and per chunk of n ≤ C tokens, with Γ_r = g_0 + … + g_r (per key channel, within the chunk),
// γ_r = exp(Γ_r) and the chunk's initial state S (Kimi Linear report Eqs. 2–9):
//   A  = (I + StrictTril(Diag(β) Akk))⁻¹,  Akk[r,j] = k_r · (k_j ⊙ exp(Γ_r − Γ_j))     the UT transform
//   w  = A Diag(β) (K ⊙ γ),  u = A Diag(β) V                                           the WY representation
//   o  = (Q ⊙ γ) S + Tril(Aqk) (u − w S),  Aqk[r,j] = q_r · (k_j ⊙ exp(Γ_r − Γ_j))
//   S ← Diag(γ_{n−1}) S + (K ⊙ exp(Γ_{n−1} − Γ))ᵀ (u − w S)
// The decays exp(Γ_r − Γ_j), r ≥ j, are running products of exp(g_t) over j < t ≤ r: every factor is
// ≤ 1, so a strongly negative g underflows to 0 where exp(Γ_r)·exp(−Γ_j) would overflow, and a chunk
// costs one exp per token and key channel, as the recurrence does. The matmuls go to BLAS.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kda.h"

namespace k3::cpu {
namespace {
constexpr int64_t kB = 16;  // sub-block of a chunk: pairwise decays inside, GEMMs across
}  // namespace

void KdaChunked(int64_t T, int64_t H, int64_t dk, int64_t dv, const float* q, const float* k, const float* v,
                const float* g, const float* beta, float* S, float* o, int64_t C) {
  const int64_t ldk = H * dk, ldv = H * dv;  // token strides of q, k, g and of v, o
  std::vector<float> A(C * C), Aqk(C * C);  // [n, n] with row stride C, upper triangle zero
  std::vector<float> Kdec(dk * C);          // Kdec[d, j] = k_j,d · exp(Γ_r − Γ_j)_d; [dk, n], row stride C
  std::vector<float> Qg(C * dk), Kg(C * dk), w(C * dk), u(C * dv), gamma(dk), x(C);
  // Rows of the current sub-block decayed from its start s: q_r, β_r k_r ⊙ exp(Γ_r − Γ_{s−1}).
  std::vector<float> Qb(kB * dk), Kb(kB * dk), gamma_b(dk);

  for (int64_t h = 0; h < H; ++h) {
    float* Sh = S + h * dk * dv;
    for (int64_t t0 = 0; t0 < T; t0 += C) {
      const int64_t n = std::min(C, T - t0);
      const float* qc = q + t0 * ldk + h * dk;
      const float* kc = k + t0 * ldk + h * dk;
      const float* gc = g + t0 * ldk + h * dk;
      const float* vc = v + t0 * ldv + h * dv;
      const float* bc = beta + t0 * H + h;
      float* oc = o + t0 * ldv + h * dv;

      // Akk (into A, rows scaled by β_r) and Aqk, one sub-block of kB rows at a time. Within the
      // sub-block starting at s, step r decays its columns of Kdec by exp(g_r) and appends k_r, so they
      // hold k_j ⊙ exp(Γ_r − Γ_j) for s ≤ j ≤ r. The columns j < s stay at the block start s − 1 and
      // meet the rows by a GEMM, as exp(Γ_r − Γ_j) = exp(Γ_r − Γ_{s−1}) · exp(Γ_{s−1} − Γ_j).
      std::fill(A.begin(), A.end(), 0.0f);
      std::fill(Aqk.begin(), Aqk.end(), 0.0f);
      std::fill(gamma.begin(), gamma.end(), 1.0f);
      for (int64_t s = 0; s < n; s += kB) {
        const int64_t m = std::min(kB, n - s);
        std::fill(gamma_b.begin(), gamma_b.end(), 1.0f);
        for (int64_t r = s; r < s + m; ++r) {
          const float* qr = qc + r * ldk;
          const float* kr = kc + r * ldk;
          const float* gr = gc + r * ldk;
          float* akk = A.data() + r * C + s;
          float* aqk = Aqk.data() + r * C + s;
          for (int64_t d = 0; d < dk; ++d) {
            const float e = std::exp(gr[d]);
            const float bk = bc[r * H] * kr[d], qd = qr[d];
            float* kd = Kdec.data() + d * C + s;
            for (int64_t j = 0; j < r - s; ++j) {
              kd[j] *= e;
              akk[j] += bk * kd[j];
              aqk[j] += qd * kd[j];
            }
            kd[r - s] = kr[d];
            aqk[r - s] += qd * kr[d];
            gamma[d] *= e;
            gamma_b[d] *= e;
            Qg[r * dk + d] = qd * gamma[d];
            Kg[r * dk + d] = kr[d] * gamma[d];
            Qb[(r - s) * dk + d] = qd * gamma_b[d];
            Kb[(r - s) * dk + d] = bk * gamma_b[d];
          }
        }
        Gemm(false, false, m, s, dk, 1.0f, Kb.data(), dk, Kdec.data(), C, 0.0f, A.data() + s * C, C);
        Gemm(false, false, m, s, dk, 1.0f, Qb.data(), dk, Kdec.data(), C, 0.0f, Aqk.data() + s * C, C);
        // Carry the columns j < s on to the block end.
        for (int64_t d = 0; d < dk; ++d)
          for (int64_t j = 0; j < s; ++j) Kdec[d * C + j] *= gamma_b[d];
      }

      // UT transform, A ← (I + A)⁻¹ by forward substitution: row r of the inverse is
      // e_r − Σ_{j<r} A[r,j] · (row j of the inverse), the rows j < r being final already.
      for (int64_t r = 0; r < n; ++r) {
        float* ar = A.data() + r * C;
        std::fill_n(x.begin(), r, 0.0f);
        for (int64_t j = 0; j < r; ++j) {
          const float* aj = A.data() + j * C;
          for (int64_t c = 0; c <= j; ++c) x[c] -= ar[j] * aj[c];
        }
        std::copy_n(x.begin(), r, ar);
        ar[r] = 1.0f;
      }
      // A ← A Diag(β), so that w = A (K ⊙ γ) and u = A V.
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j <= r; ++j) A[r * C + j] *= bc[j * H];

      Gemm(false, false, n, dk, n, 1.0f, A.data(), C, Kg.data(), dk, 0.0f, w.data(), dk);
      Gemm(false, false, n, dv, n, 1.0f, A.data(), C, vc, ldv, 0.0f, u.data(), dv);
      // u ← u − w S: the part of the chunk's values the incoming state does not already predict.
      Gemm(false, false, n, dv, dk, -1.0f, w.data(), dk, Sh, dv, 1.0f, u.data(), dv);
      // o = (Q ⊙ γ) S (the incoming state, decayed) + Aqk u (this chunk's own writes).
      Gemm(false, false, n, dv, dk, 1.0f, Qg.data(), dk, Sh, dv, 0.0f, oc, ldv);
      Gemm(false, false, n, dv, n, 1.0f, Aqk.data(), C, u.data(), dv, 1.0f, oc, ldv);
      // S ← Diag(γ_{n−1}) S + Kdec u, Kdec now being (K ⊙ exp(Γ_{n−1} − Γ))ᵀ.
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) Sh[i * dv + j] *= gamma[i];
      Gemm(false, false, dk, dv, n, 1.0f, Kdec.data(), C, u.data(), dv, 1.0f, Sh, dv);
    }
  }
}

}  // namespace k3::cpu

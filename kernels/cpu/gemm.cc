#include "kernels/cpu/gemm.h"

#include <cblas.h>

#if defined(__x86_64__) && !defined(K3_PLAIN_KERNELS)
#define K3_AVX2_KERNELS 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>

namespace k3::cpu {

namespace {

// One output's order of operations, shared by every block shape below and by the machines without AVX2: eight
// partial sums over k ≡ j (mod 8), k < K8, with fused multiply-adds; their sum ((0+1)+(2+3))+((4+5)+(6+7)), the
// order in which two rounds of horizontal adds reduce a vector; then the k ≥ K8 tail in order.
inline float Tail(float s, const float* x, const float* w, int64_t K8, int64_t K) {
  for (int64_t k = K8; k < K; ++k) s = std::fma(x[k], w[k], s);
  return s;
}

inline void Store(float* y, float s, float beta) { *y = beta == 0.0f ? s : std::fma(beta, *y, s); }

}  // namespace

void LinearPlain(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, int64_t ldy,
                 float beta) {
  const int64_t K8 = K / 8 * 8;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float l[8] = {};
      const float *xr = x + m * K, *wr = W + n * K;
      for (int64_t k = 0; k < K8; k += 8)
        for (int j = 0; j < 8; ++j) l[j] = std::fma(xr[k + j], wr[k + j], l[j]);
      const float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
      Store(y + m * ldy + n, Tail(s, xr, wr, K8, K), beta);
    }
}

#ifdef K3_AVX2_KERNELS
namespace {

// The sums of four accumulators, in the order above: [Σa, Σb, Σc, Σd].
__attribute__((target("avx2,fma"))) inline __m128 Sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// kN rows of W against kM rows of x: kN·kM accumulators of 8 lanes.
template <int kN, int kM>
__attribute__((target("avx2,fma"))) inline void Block(int64_t K, const float* x, const float* W, float* y,
                                                       int64_t ldy, float beta) {
  const int64_t K8 = K / 8 * 8;
  __m256 acc[kM][kN];
  for (int j = 0; j < kM; ++j)
    for (int i = 0; i < kN; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 w[kN];
    for (int i = 0; i < kN; ++i) w[i] = _mm256_loadu_ps(W + i * K + k);
    for (int j = 0; j < kM; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * K + k);
      for (int i = 0; i < kN; ++i) acc[j][i] = _mm256_fmadd_ps(xv, w[i], acc[j][i]);
    }
  }
  for (int j = 0; j < kM; ++j) {
    float* yj = y + j * ldy;
    const __m256* a = acc[j];
    __m128 s = Sum4(a[0], a[kN > 1 ? 1 : 0], a[kN > 2 ? 2 : 0], a[kN > 3 ? 3 : 0]);
    if (kN == 4 && K8 == K) {  // the common case: four outputs at once
      if (beta != 0.0f) s = _mm_fmadd_ps(_mm_set1_ps(beta), _mm_loadu_ps(yj), s);
      _mm_storeu_ps(yj, s);
      continue;
    }
    float v[4];
    _mm_storeu_ps(v, s);
    for (int i = 0; i < kN; ++i) Store(yj + i, Tail(v[i], x + j * K, W + i * K, K8, K), beta);
  }
}

// The rows of x from m0 to m1 against rows of W kN at a time (in L1 while the rows of x pass over them, kM at a
// time); the last rows of W and of x in smaller blocks.
template <int kN, int kM>
__attribute__((target("avx2,fma"))) inline int64_t Rows(int64_t n, int64_t N, int64_t m0, int64_t m1, int64_t K,
                                                         const float* x, const float* W, float* y, int64_t ldy,
                                                         float beta) {
  for (; n + kN <= N; n += kN) {
    int64_t m = m0;
    for (; m + kM <= m1; m += kM) Block<kN, kM>(K, x + m * K, W + n * K, y + m * ldy + n, ldy, beta);
    for (; m < m1; ++m) Block<kN, 1>(K, x + m * K, W + n * K, y + m * ldy + n, ldy, beta);
  }
  return n;
}

// Chunks of x rows (~128 KB, in L2), W streaming once per chunk: three rows of W against four of x where there are
// four (12 accumulators), four against two for two or three rows, and the last rows of W one at a time.
__attribute__((target("avx2,fma"))) void LinearAvx2(int64_t M, int64_t N, int64_t K, const float* x,
                                                     const float* W, float* y, int64_t ldy, float beta) {
  const int64_t chunk = std::max<int64_t>(4, 32768 / std::max<int64_t>(K, 1) / 4 * 4);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    const int64_t n = m1 - m0 >= 4 ? Rows<3, 4>(0, N, m0, m1, K, x, W, y, ldy, beta)
                                   : Rows<4, 2>(0, N, m0, m1, K, x, W, y, ldy, beta);
    Rows<1, 2>(n, N, m0, m1, K, x, W, y, ldy, beta);
  }
}

const bool kAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");

}  // namespace

#endif  // K3_AVX2_KERNELS

void LinearStrided(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, int64_t ldy,
                   float beta) {
  if (M == 0 || N == 0) return;
#ifdef K3_AVX2_KERNELS
  if (kAvx2) return LinearAvx2(M, N, K, x, W, y, ldy, beta);
#endif
  LinearPlain(M, N, K, x, W, y, ldy, beta);
}

void Linear(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, float beta) {
  LinearStrided(M, N, K, x, W, y, N, beta);
}

void LinearRef(int64_t M, int64_t N, int64_t K, const float* x, const float* W, float* y, float beta) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[m * K + k]) * W[n * K + k];
      y[m * N + n] = static_cast<float>(acc + (beta == 0.0f ? 0.0 : static_cast<double>(beta) * y[m * N + n]));
    }
}

void Gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : C[i * ldc + j] * beta;
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A, static_cast<int>(lda), B,
              static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

}  // namespace k3::cpu

#include "kernels/cpu/mxfp4.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace k3::cpu {
namespace {

constexpr std::array<float, 16> kE2M1 = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Both values of one packed byte, so dequantization is one table load per two weights.
struct PairTable {
  std::array<std::array<float, 2>, 256> v;
  PairTable() {
    for (int b = 0; b < 256; ++b) v[b] = {kE2M1[b & 15], kE2M1[b >> 4]};
  }
};
const PairTable kPairs;

// Round-to-nearest-even onto E2M1's magnitudes; ties go to the even code (0, 1, 2, 4 of 0..7).
uint8_t E2M1Code(float v) {
  const float a = std::fabs(v);
  uint8_t c;
  if (a <= 0.25f) c = 0;
  else if (a < 0.75f) c = 1;
  else if (a <= 1.25f) c = 2;
  else if (a < 1.75f) c = 3;
  else if (a <= 2.5f) c = 4;
  else if (a < 3.5f) c = 5;
  else if (a <= 5.0f) c = 6;
  else c = 7;  // saturates at 6 (also NaN-free inputs beyond the block max cannot occur)
  return static_cast<uint8_t>(c | (std::signbit(v) ? 8 : 0));
}

}  // namespace

float E2M1Value(uint8_t code) { return kE2M1[code & 15]; }

float E8M0Value(uint8_t s) {
  if (s == kE8M0Nan) return std::nanf("");
  return std::ldexp(1.0f, static_cast<int>(s) - 127);  // s = 0: the subnormal 2^−127, exact
}

void DequantizeMxfp4(const Mxfp4Matrix& W, int64_t cols, int64_t row0, int64_t n, float* out) {
  const int64_t groups = cols / kMxfp4Group;
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* p = W.packed + (row0 + r) * (cols / 2);
    const uint8_t* s = W.scale + (row0 + r) * groups;
    float* o = out + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = E8M0Value(s[g]);
      for (int64_t j = 0; j < kMxfp4Group / 2; ++j) {
        const auto& pair = kPairs.v[p[g * (kMxfp4Group / 2) + j]];
        o[g * kMxfp4Group + 2 * j] = pair[0] * scale;
        o[g * kMxfp4Group + 2 * j + 1] = pair[1] * scale;
      }
    }
  }
}

void QuantizeMxfp4(const float* x, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* scale) {
  const int64_t groups = cols / kMxfp4Group;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = x + r * cols + g * kMxfp4Group;
      float amax = 0.0f;
      for (int64_t j = 0; j < kMxfp4Group; ++j) amax = std::max(amax, std::fabs(v[j]));
      int e = -127;  // shared exponent; a zero block keeps the smallest scale
      if (amax > 0.0f) {
        int ex;
        std::frexp(amax, &ex);               // amax = m · 2^ex, m in [0.5, 1): floor(log2 amax) = ex − 1
        e = std::clamp(ex - 1 - 2, -127, 127);  // − 2: E2M1's largest exponent (6 = 1.5 · 2^2)
      }
      scale[r * groups + g] = static_cast<uint8_t>(e + 127);
      const float inv = std::ldexp(1.0f, -e);
      uint8_t* p = packed + r * (cols / 2) + g * (kMxfp4Group / 2);
      for (int64_t j = 0; j < kMxfp4Group / 2; ++j)
        p[j] = static_cast<uint8_t>(E2M1Code(v[2 * j] * inv) | (E2M1Code(v[2 * j + 1] * inv) << 4));
    }
  }
}

void LinearMxfp4(int64_t M, int64_t N, int64_t K, const float* x, const Mxfp4Matrix& W, float* y, float beta) {
  if (M == 0 || N == 0) return;
  // A panel of ~256 KB of fp32 weights: dequantized once, used by every row of x while in cache; the products as the
  // fp32 experts' (Linear), so that an MXFP4 expert equals its dequantized fp32 copy bit for bit.
  const int64_t panel = std::clamp<int64_t>(65536 / std::max<int64_t>(K, 1), 8, 256);
  std::vector<float> w(std::min(panel, N) * K);
  for (int64_t n0 = 0; n0 < N; n0 += panel) {
    const int64_t nb = std::min(panel, N - n0);
    DequantizeMxfp4(W, K, n0, nb, w.data());
    LinearStrided(M, nb, K, x, w.data(), y + n0, N, beta);
  }
}

}  // namespace k3::cpu

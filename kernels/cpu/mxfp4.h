// MXFP4 (OCP Microscaling, as the released Kimi K3 stores its routed experts): a matrix [rows, cols]
// as E2M1 codes packed two per byte along a row (the low nibble the even column) and one E8M0 scale
// per 32 consecutive columns. A weight is E2M1(code) · 2^(scale − 127); scale 255 is NaN.
#pragma once

#include <cstdint>

namespace k3::cpu {

inline constexpr int64_t kMxfp4Group = 32;  // columns sharing one scale
inline constexpr uint8_t kE8M0Nan = 0xFF;

// packed [rows, cols/2], scale [rows, cols/32] (cols a multiple of 32).
struct Mxfp4Matrix {
  const uint8_t* packed = nullptr;
  const uint8_t* scale = nullptr;
};

// The value of one E2M1 code (0..15): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign.
float E2M1Value(uint8_t code);
// 2^(s − 127) as fp32 (s = 0 is the subnormal 2^−127); s = 255 gives NaN.
float E8M0Value(uint8_t s);

// Rows [row0, row0 + n) of W into out [n, cols], fp32. Exact: each weight is an E2M1 value (two
// significant bits) times a power of two, so only a product beyond fp32's range (scale 254 with
// |code| ≥ 2) is not the real number: ±inf, as in the fp32 evaluation of the formula.
void DequantizeMxfp4(const Mxfp4Matrix& W, int64_t cols, int64_t row0, int64_t n, float* out);

// The OCP MX quantization of x [rows, cols]: per 32-block the shared exponent is
// floor(log2(max |x|)) − 2 (E2M1's largest exponent), the elements x / 2^e rounded to the nearest
// E2M1 value, ties to even, saturating at ±6. A block of zeros gets scale 2^−127.
void QuantizeMxfp4(const float* x, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* scale);

// y = x · Wᵀ with W [N, K] in MXFP4: W is dequantized a panel of rows at a time into a scratch
// that stays in cache, and each panel multiplied by BLAS. x [M, K], y [M, N]; beta 1 accumulates.
void LinearMxfp4(int64_t M, int64_t N, int64_t K, const float* x, const Mxfp4Matrix& W, float* y, float beta = 0.0f);

}  // namespace k3::cpu

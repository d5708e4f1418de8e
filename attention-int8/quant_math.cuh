// The per-token symmetric INT8 arithmetic, shared by quantize.cu and the Hopper kernel (which quantizes
// its Q tile itself): one definition, so both produce the same bits, which reference.py reproduces.
//
// Why per token: the logit S[i,j] = q_i . k_j is then dequantized with exactly the scales of the two
// rows it came from, s_q[i] * s_k[j], so no tile ever mixes scales, and one outlier token costs
// precision only in its own row. Why symmetric [-127, 127]: zero maps to zero and the range is the same
// on both sides, so x_q * scale is an unbiased reconstruction.
#pragma once

#include <cstdint>

namespace attention_int8 {
namespace quant {

// 127 / amax as an IEEE fp32 division (0 for an all-zero row): x_q = round_half_even(x * inv_scale).
__device__ __forceinline__ float inv_scale_of(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }

__device__ __forceinline__ int8_t quantize(float x, float inv_scale) {
  return static_cast<int8_t>(max(-127, min(127, __float2int_rn(x * inv_scale))));
}

// Scales keep 22 significant bits (round half up on the low 2 of fp32's 24; a relative change below
// 2^-22): the sm90 kernel then dequantizes S * q_scale exactly with one FFMA (ptx::small_int_times).
// A non-finite row gets a NaN scale, so NaN reaches the output instead of being clamped away.
__device__ __forceinline__ float scale_of(float amax, float out_scale, bool finite) {
  const float scale = amax / 127.f * out_scale;
  return finite ? __uint_as_float((__float_as_uint(scale) + 2u) & ~3u) : __int_as_float(0x7fc00000);
}

}  // namespace quant
}  // namespace attention_int8

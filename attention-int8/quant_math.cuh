// The symmetric INT8 arithmetic, shared by quantize.cu and the Hopper kernel (which quantizes its Q tile
// itself): one definition, so both produce the same bits, which reference.py reproduces.
//
// Granularity: Q per token, K per block of kKeyScaleTokens keys. A logit S[i,j] = q_i . k_j is then
// dequantized with one scale per (query row, key block), c = q_scale[i] * k_scale[j / 64] (logit_scale),
// the same for every logit a thread holds of one row of a key tile: the softmax takes the max on the
// integer dot products and turns each into its exponent with one FMA (attention_fwd_sm90.cu), instead
// of a multiply by each key's own scale. Per-token Q costs nothing (a thread's rows are fixed), and K,
// smoothed by its centre first (KeyCenterParams), has no channel offsets left to make one key's range another's.
// Why symmetric [-127, 127]: zero maps to zero and the range is the same on both sides, so x_q * scale
// is an unbiased reconstruction.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace attention_int8 {
namespace quant {

// A group's amax and finiteness in one integer: |x| as unsigned bits orders like |x| for every finite x, and
// every infinity or NaN lies above every finite value. So one integer max over the group's |x| bits (one
// reduction, not one for the amax and one for finiteness) is the amax's bits when below kInfBits.
constexpr uint32_t kInfBits = 0x7f800000u;
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

struct UnsignedMax {
  __device__ __forceinline__ uint32_t operator()(uint32_t a, uint32_t b) const { return max(a, b); }
};

// A group quantizes x * prescale_of(amax): 1, or 2^64 when amax is below 2^-64 (bf16 only), since 127 / amax
// overflows fp32 below ~3.7e-37. Scaling by a power of two is exact, so this changes no result that was finite.
constexpr float kPrescale = 0x1p64f;
__device__ __forceinline__ float prescale_of(float amax) { return amax < 1.f / kPrescale ? kPrescale : 1.f; }

// 127 / (amax * prescale_of(amax)) as an IEEE fp32 division (0 for an all-zero group), always finite:
// x_q = round_half_even(x * prescale_of(amax) * inv_scale).
__device__ __forceinline__ float inv_scale_of(float amax) {
  return amax > 0.f ? 127.f / (amax * prescale_of(amax)) : 0.f;
}

// x_q = round_half_even(x[e] * inv_scale) for four consecutive elements, packed into one word (element e in
// byte e). The rounding runs on the FP32 pipe: adding 1.5 * 2^23 to the rounded product rounds it to an
// integer, half to even (the ulp there is 1), and leaves that integer's two's complement in the low byte.
// No clamp is needed for any (prescaled) x of the group that gave amax: |x * inv_scale| <= 127 (1 + 2^-23)^2.
// (A non-finite x gives other bytes; its group's scale is NaN.) The conversion unit of __float2int_rn does
// 16 per clock and SM, the FP32 pipe 128: in the Hopper kernel's Q tile that was ~1.5k cycles a CTA.
__device__ __forceinline__ uint32_t quantize4(const float* x, float inv_scale) {
  uint32_t b[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) b[e] = __float_as_uint(__fadd_rn(__fmul_rn(x[e], inv_scale), ptx::kSmallIntMagic));
  return __byte_perm(__byte_perm(b[0], b[1], 0x0040), __byte_perm(b[2], b[3], 0x0040), 0x5410);
}

// A non-finite group gets a NaN scale, so NaN reaches the output instead of being clamped away.
__device__ __forceinline__ float scale_of(float amax, float out_scale, bool finite) {
  return finite ? amax / 127.f * out_scale : __int_as_float(0x7fc00000);
}

// The dequantization scale of query row i against key block b, q_scale * k_scale truncated to 22
// significant bits (a relative change below 2^-21): S * logit_scale is the base-2 logit (Q's scale
// carries sm_scale * log2(e)). 22 bits times the 2-bit 1.5 * 2^23 of ptx::SmallIntScale are exact
// in fp32, which the kernels' one-FMA dequantization needs. Truncation is one instruction a row and key
// tile where rounding takes three. Infinity stays infinity, and a NaN product stays NaN: the GPU's NaN 0x7fffffff keeps mantissa bits.
__device__ __forceinline__ float logit_scale(float q_scale, float k_scale) {
  return __uint_as_float(__float_as_uint(q_scale * k_scale) & ~3u);
}

}  // namespace quant
}  // namespace attention_int8
